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


# deepspeed.comm's TorchBackend captures these torch.distributed functions when it is created
# (`cdb.all_gather_function`, ...), so patching torch.distributed later does not see GatheredParameters' traffic.
DEEPSPEED_CAPTURED = ("all_gather_function", "reduce_scatter_function")


class CollectiveCounter:
    """Counts collective calls and the tensor bytes they were given, while active: torch.distributed's functions
    and the references DeepSpeed's comm backend captured from it."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.largest: dict[str, int] = {}  # the largest single call's tensor bytes, per collective
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner, attr: str, label: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:
            return
        self._saved.append((owner, attr, fn))

        def wrapper(*args, **kwargs):
            nbytes = _tensor_bytes(args, kwargs)
            self.calls[label] = self.calls.get(label, 0) + 1
            self.bytes[label] = self.bytes.get(label, 0) + nbytes
            self.largest[label] = max(self.largest.get(label, 0), nbytes)
            return fn(*args, **kwargs)

        setattr(owner, attr, wrapper)

    def __enter__(self):
        for name in COLLECTIVES:
            self._wrap(dist, name, name)
        try:
            from deepspeed.comm import comm as ds_comm
        except ImportError:
            ds_comm = None
        if ds_comm is not None and getattr(ds_comm, "cdb", None) is not None:
            for attr in DEEPSPEED_CAPTURED:
                self._wrap(ds_comm.cdb, attr, "deepspeed." + attr)
        return self

    def __exit__(self, *exc):
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)
        self._saved.clear()
        return False

    @property
    def tensor_collective_bytes(self) -> int:
        """Bytes through collectives other than the small pickled-object ones (agreement messages)."""
        return sum(b for n, b in self.bytes.items() if not n.endswith("_object") and n != "broadcast_object_list")


def _storage_ptr(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr() or None
    except Exception:
        return None


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor storage (in elements, and in bytes) any aten op allocated on a real (non-meta)
    device while active, in this thread (dispatch modes are thread-local). Views of an input's storage are not
    allocations (a slice of the engine's flat parameter buffer is not its size)."""

    def __init__(self):
        super().__init__()
        self.largest_bytes = 0
        self.largest_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_ptr(a) for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and _storage_ptr(t) not in inputs:  # not a view
                try:
                    nbytes = t.untyped_storage().nbytes()
                except Exception:
                    nbytes = t.numel() * t.element_size()
                self.largest_bytes = max(self.largest_bytes, nbytes)
                if t.is_floating_point():  # a uint8 view over a partition is bytes, not elements
                    self.largest_numel = max(self.largest_numel, nbytes // t.element_size())
        return out
