"""The package version, in one place: pyproject.toml reads it (`[tool.setuptools.dynamic]`), and so do
`hf_zero3_loader.__version__` and `hf-zero3-loader --version`."""

__version__ = "0.1.0"
