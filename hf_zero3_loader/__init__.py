"""Load Hugging Face checkpoints straight into DeepSpeed ZeRO-3 partitions: every rank reads only its bytes."""

from ._version import __version__
from .errors import CheckpointError, ConfigError, ConversionMismatchError, DistributedLoadError, LoaderError, UnsupportedConversionError
from .loader import LoadReport, from_pretrained
from .saving import SaveReport, save_pretrained

from .compat import warn_if_untested as _warn_if_untested  # isort: skip

_warn_if_untested()  # an untested transformers or DeepSpeed: one warning (docs/compatibility.md), never a failure

__all__ = [
    "__version__",
    "from_pretrained",
    "save_pretrained",
    "LoadReport",
    "SaveReport",
    "LoaderError",
    "CheckpointError",
    "ConfigError",
    "ConversionMismatchError",
    "DistributedLoadError",
    "UnsupportedConversionError",
]
