"""Exceptions raised by the loader. Every one of them is raised identically on every rank."""


class LoaderError(RuntimeError):
    """Base class for hf_zero3_loader errors."""


class CheckpointError(LoaderError):
    """The checkpoint on disk is missing, damaged or unsafe."""


class UnsupportedConversionError(LoaderError):
    """The model's weight conversion mapping uses an operation the shard-on-read planner cannot slice."""


class ConfigError(LoaderError, ValueError):
    """The DeepSpeed config or the keyword arguments ask for something inconsistent or unsupported."""


class DistributedLoadError(LoaderError):
    """Another rank failed; raised on every rank with that rank's error."""


class ConversionMismatchError(LoaderError):
    """Parameters the checkpoint should provide would be randomly initialised: its layout did not convert."""


class PeerFailed(LoaderError):
    """The rank this rank depended on (e.g. the one streaming its bytes) failed; it reports its own error."""
