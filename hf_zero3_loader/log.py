"""Logging the way transformers users expect it.

One `hf_zero3_loader` logger, with its own handler. Its level: `HF_ZERO3_LOADER_VERBOSITY` (debug, info, warning,
error, critical) when set; otherwise it follows transformers' verbosity switch (`TRANSFORMERS_VERBOSITY`,
`transformers.logging.set_verbosity_*`) when that is quieter than the default, and is INFO otherwise, so the one-line
summary of each load shows by default. Only rank 0 logs INFO; every rank logs warnings and errors.
"""

from __future__ import annotations

import logging
import os
import warnings
from contextlib import contextmanager

logger = logging.getLogger("hf_zero3_loader")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
           "critical": logging.CRITICAL}
_warned: set[str] = set()


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _configure() -> None:
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[hf_zero3_loader] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    level = _LEVELS.get(os.environ.get("HF_ZERO3_LOADER_VERBOSITY", "").lower())
    if level is None:
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        level = logging.INFO if verbosity <= logging.WARNING else verbosity  # a silenced transformers silences us
    logger.setLevel(level if _rank() == 0 else max(level, logging.WARNING))


def debug(message: str, *args) -> None:
    _configure()
    logger.debug(message, *args)


def info(message: str, *args) -> None:
    _configure()
    logger.info(message, *args)


def warning(message: str, *args) -> None:
    _configure()
    logger.warning(message, *args)


def _first_time_on_rank_0(key: str) -> bool:
    """True the first time `key` is seen in this process, on rank 0 only (every rank would say the same)."""
    if key in _warned or _rank() != 0:
        return False
    _warned.add(key)
    return True


def warning_once(key: str, message: str, *args) -> None:
    """A warning shown once per process, on rank 0 only."""
    if _first_time_on_rank_0(key):
        warning(message, *args)


def info_once(key: str, message: str, *args) -> None:
    """An INFO line shown once per process, on rank 0 only."""
    if _first_time_on_rank_0(key):
        info(message, *args)


def size(nbytes: int) -> str:
    """Bytes in the unit that suits this value: "512 B", "57.3 KiB", "1.2 GiB", "3.0 TiB"."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def count(n: int) -> str:
    """A number of parameters in the unit that suits it: "950", "12.3K", "1.50M", "30.53B"."""
    for unit, scale, digits in (("T", 10**12, 2), ("B", 10**9, 2), ("M", 10**6, 2), ("K", 10**3, 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f}{unit}"
    return str(n)


def ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


# The FutureWarnings that DeepSpeed 0.19.8's own calls make torch (and DeepSpeed itself) raise during a load, a save
# or a gather that we start: `torch.distributed.all_gather_into_tensor` / `reduce_scatter_tensor` "is deprecated"
# (DeepSpeed's comm layer calls them), DeepSpeed's deprecations of its own names. Nothing a user can act on.
_DEPENDENCY_MODULES = (r"torch\.distributed(\.|$)", r"deepspeed(\.|$)")


@contextmanager
def quiet_dependency_deprecations():
    """Hide the FutureWarnings of the modules above, for the duration of one of our calls only (the filters are
    restored after it, so the same warnings from the user's own code are shown as before)."""
    with warnings.catch_warnings():
        for module in _DEPENDENCY_MODULES:
            warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        yield


class _OncePerMessage(logging.Filter):
    def __init__(self):
        super().__init__()
        self.seen: set[tuple[int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


@contextmanager
def each_dependency_message_once(name: str = "DeepSpeed"):
    """While one of our calls runs, let each distinct message of the dependency logger `name` through once: AutoEP
    warns once per MoE layer it replaces (DeepSeek-V3: 58 identical lines per rank, for each ep_size `plan` tries)."""
    dependency_logger, once = logging.getLogger(name), _OncePerMessage()
    dependency_logger.addFilter(once)
    try:
        yield
    finally:
        dependency_logger.removeFilter(once)
