"""Failure agreement: an error on any rank becomes the same error on every rank, fast.

Ranks meet at a few agreement points (after planning and reading, before any DeepSpeed collective, and at the
end), through the process group's key-value store rather than a collective: each rank counts itself in, a
failing rank records its error (the first one wins), the last rank in opens the gate. Every rank then raises
the first failing rank's exception type and message, prefixed with that rank. Waiting is bounded by
`timeout_s`, so a rank that died instead of raising makes the others fail, not hang. Points are numbered, not
named: a rank that fails early and one that reaches a later point still meet, as in a collective.

The store is torch's default c10d store (`distributed_c10d._get_default_store`, private, torch 2.13): it needs no
process group of its own (creating one costs ~0.5 s) and works the same under gloo and NCCL.
"""

from __future__ import annotations

import builtins
import datetime
import itertools
import json
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


_loads = itertools.count()  # every rank starts its loads in the same order, so the numbers agree


class Agreement:
    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        from torch.distributed.distributed_c10d import _get_default_store

        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.timeout_s = timeout_s
        self.store = _get_default_store()
        self.prefix = f"hf_zero3_loader/load{next(_loads)}"
        self.points = itertools.count()

    def check(self, phase: str, error: BaseException | None = None) -> None:
        """Every rank calls this at the same points; raise on every rank if `error` is set on any rank."""
        if isinstance(error, AgreedFailure):
            raise error
        key = f"{self.prefix}/point{next(self.points)}"
        try:
            if error is not None:
                payload = json.dumps([self.rank, type(error).__module__, type(error).__qualname__, str(error)])
                self.store.compare_set(f"{key}/error", "", payload)  # the first failure wins
            if self.store.add(f"{key}/arrived", 1) == self.world_size:
                self.store.set(f"{key}/done", "1")
            self.store.wait([f"{key}/done"], datetime.timedelta(seconds=self.timeout_s))
            failed = self.store.check([f"{key}/error"])
            first = json.loads(self.store.get(f"{key}/error")) if failed else None
        except Exception as e:  # a peer died or hung: bounded by the timeout
            raise _agreed_type(errors.DistributedLoadError)(
                f"rank {self.rank}: another rank stopped answering during '{phase}' "
                f"(no reply within {self.timeout_s:.0f}s or the store was lost): {e}"
            ) from error
        if first is None:
            return
        rank, module, qualname, message = first
        text = f"[rank {rank}] {message}"
        try:
            agreed = _agreed_type(_lookup(module, qualname))(text)
        except Exception:  # a type whose constructor wants more than a message
            agreed = _agreed_type(errors.DistributedLoadError)(f"[rank {rank}] {qualname}: {message}")
        raise agreed from error
