"""Failure agreement: an error on any rank becomes the same error on every rank, fast.

Ranks meet at a few agreement points (after planning and reading, before any DeepSpeed collective, and
at the end). Each rank brings "ok" or its exception; if any rank failed, every rank raises the first
failing rank's exception type and message, prefixed with that rank. A dedicated gloo group with its own
timeout bounds the wait when a rank has died instead of raising.
"""

from __future__ import annotations

import builtins
import datetime
import os

import torch.distributed as dist

from . import errors

DEFAULT_TIMEOUT_S = float(os.environ.get("HF_ZERO3_LOADER_TIMEOUT", "300"))


class AgreedFailure(Exception):
    """Marker base: this exception was already agreed on by all ranks, do not agree again."""


_rebuilt_types: dict[type, type] = {}


def _agreed_type(exc_type: type) -> type:
    """A subclass of the original type that also carries the AgreedFailure marker."""
    if exc_type not in _rebuilt_types:
        try:
            _rebuilt_types[exc_type] = type(exc_type.__name__, (exc_type, AgreedFailure), {"__module__": exc_type.__module__})
        except TypeError:
            _rebuilt_types[exc_type] = type("DistributedLoadError", (errors.DistributedLoadError, AgreedFailure), {})
    return _rebuilt_types[exc_type]


def _lookup(module: str, qualname: str) -> type:
    """Resolve an exception type by name; builtins and our errors are rebuilt as themselves."""
    candidates = {"builtins": builtins, errors.__name__: errors}
    owner = candidates.get(module)
    exc_type = getattr(owner, qualname, None) if owner else None
    if not (isinstance(exc_type, type) and issubclass(exc_type, Exception)):
        exc_type = errors.DistributedLoadError
    return exc_type


class Agreement:
    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        # A separate gloo group: a bounded timeout, and no interference with the training backend's streams.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s

    def check(self, phase: str, error: BaseException | None = None) -> None:
        """Collective: raise on every rank if `error` is set on any rank."""
        if isinstance(error, AgreedFailure):
            raise error
        mine = None
        if error is not None:
            mine = (self.rank, type(error).__module__, type(error).__qualname__, str(error))
        gathered: list = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, (phase, mine), group=self.group)
        except Exception as e:  # a peer died or hung: bounded by the group timeout
            raise _agreed_type(errors.DistributedLoadError)(
                f"rank {self.rank}: another rank stopped answering during '{phase}' "
                f"(no reply within {self.timeout_s:.0f}s or connection lost): {e}"
            ) from error
        failures = [f for _, f in gathered if f is not None]
        if not failures:
            return
        rank, module, qualname, message = failures[0]
        text = f"[rank {rank}] {message}"
        try:
            agreed = _agreed_type(_lookup(module, qualname))(text)
        except Exception:  # a type whose constructor wants more than a message
            agreed = _agreed_type(errors.DistributedLoadError)(f"[rank {rank}] {qualname}: {message}")
        raise agreed from error
