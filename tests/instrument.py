"""Deterministic measurements for tests and benchmarks: collectives issued and the largest tensor allocated.

These observe real torch.distributed calls and real allocations; nothing is mocked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "broadcast", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single", "reduce", "gather",
    "scatter", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "all_gather_coalesced", "send", "recv", "isend", "irecv",
)


def _tensor_bytes(args, kwargs) -> int:
    total = 0
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            total += a.numel() * a.element_size()
        elif isinstance(a, (list, tuple)):
            total += sum(t.numel() * t.element_size() for t in a if isinstance(t, torch.Tensor))
    return total


class CollectiveCounter:
    """Counts torch.distributed collective calls and the tensor bytes they were given, while active."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self._saved: dict[str, object] = {}

    def __enter__(self):
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapper(*args, __name=name, __fn=fn, **kwargs):
                self.calls[__name] = self.calls.get(__name, 0) + 1
                self.bytes[__name] = self.bytes.get(__name, 0) + _tensor_bytes(args, kwargs)
                return __fn(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        return False

    @property
    def tensor_collective_bytes(self) -> int:
        """Bytes through collectives other than the small pickled-object ones (agreement messages)."""
        return sum(b for n, b in self.bytes.items() if not n.endswith("_object") and n != "broadcast_object_list")


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any aten op produced on a real (non-meta) device while active."""

    def __init__(self):
        super().__init__()
        self.largest_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    nbytes = t.untyped_storage().nbytes()
                except Exception:
                    nbytes = t.numel() * t.element_size()
                self.largest_bytes = max(self.largest_bytes, nbytes)
        return out
