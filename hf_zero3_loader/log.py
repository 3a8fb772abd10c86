"""Logging the way transformers users expect it.

One `hf_zero3_loader` logger, with its own handler. Its level: `HF_ZERO3_LOADER_VERBOSITY` (debug, info, warning,
error, critical) when set; otherwise it follows transformers' verbosity switch (`TRANSFORMERS_VERBOSITY`,
`transformers.logging.set_verbosity_*`) when that is quieter than the default, and is INFO otherwise, so the one-line
summary of each load shows by default. Only rank 0 logs INFO; every rank logs warnings and errors.
"""

from __future__ import annotations

import logging
import os

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
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
