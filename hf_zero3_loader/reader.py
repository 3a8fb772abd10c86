"""Execute a plan's reads: copy checkpoint bytes into local partitions with positional reads.

Reads go straight into the destination when dtypes match (no staging copy, no mmap, so RSS grows only by
the partitions themselves); otherwise through a bounded staging buffer and a cast, which rounds exactly
like transformers' `tensor.to(dtype)`. Counters record every byte read, for tests and benchmarks.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .checkpoint import TensorEntry
from .errors import CheckpointError
from .planner.plan import ReadItem

STAGING_BYTES = 64 << 20  # largest staging buffer for casts and strided boxes


@dataclass
class ReadStats:
    bytes_read: int = 0
    reads: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.reads += 1


def _as_bytes(t: torch.Tensor):
    """A writable numpy byte view over a CPU tensor's storage (works for bf16 too)."""
    return t.view(torch.uint8).numpy() if t.numel() else memoryview(b"")


class FileReader:
    """Positional reads from checkpoint files, one descriptor per file, safe to share between threads."""

    def __init__(self, stats: ReadStats | None = None):
        self.stats = stats or ReadStats()
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: str) -> int:
        with self._lock:
            if path not in self._fds:
                try:
                    self._fds[path] = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise CheckpointError(f"cannot open checkpoint file {path}: {e.strerror}") from e
            return self._fds[path]

    def read_into(self, path: str, offset: int, out: torch.Tensor) -> None:
        """Fill the CPU tensor `out` with the bytes at `offset` of `path`."""
        buf = _as_bytes(out)
        fd, done, total = self._fd(path), 0, out.numel() * out.element_size()
        while done < total:
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{path}: truncated file (wanted {total} bytes at offset {offset})")
            done += n
        self.stats.add(total)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def execute_read(reader: FileReader, item: ReadItem, entry: TensorEntry, dst: torch.Tensor) -> None:
    """Copy one ReadItem into the flat CPU tensor `dst` (a partition or buffer)."""
    itemsize = item.src_dtype.itemsize
    entry_start = entry.data_start
    out = dst[item.dst_offset : item.dst_offset + item.numel]
    if entry.tensor is not None:  # a pickled checkpoint, memory-mapped
        box = entry.tensor.reshape(-1).as_strided((item.rows, item.cols), (item.row_stride, 1), item.src_offset)
        view = out.view(item.cols, item.rows) if item.transposed else out.view(item.rows, item.cols)
        view.copy_(box.t() if item.transposed else box)
        reader.stats.add(item.numel * itemsize)
        return
    if not item.transposed and (item.rows == 1 or item.row_stride == item.cols):  # one contiguous span
        _read_span(reader, item.file, entry_start + item.src_offset * itemsize, item.src_dtype, out)
        return
    # a box: `rows` runs of `cols` elements, `row_stride` apart
    box = torch.empty((item.rows, item.cols), dtype=item.src_dtype)
    gap = (item.row_stride - item.cols) * itemsize
    if gap <= 4096 and item.rows * item.row_stride * itemsize <= STAGING_BYTES:
        # small gaps: one read of the covering span is faster than many tiny reads
        span = torch.empty(((item.rows - 1) * item.row_stride + item.cols,), dtype=item.src_dtype)
        reader.read_into(item.file, entry_start + item.src_offset * itemsize, span)
        box.copy_(span.as_strided((item.rows, item.cols), (item.row_stride, 1)))
    else:
        for r in range(item.rows):
            reader.read_into(item.file, entry_start + (item.src_offset + r * item.row_stride) * itemsize, box[r])
    view = out.view(item.cols, item.rows) if item.transposed else out.view(item.rows, item.cols)
    view.copy_(box.t() if item.transposed else box)


def _read_span(reader: FileReader, path: str, offset: int, src_dtype: torch.dtype, out: torch.Tensor) -> None:
    if out.dtype == src_dtype:
        reader.read_into(path, offset, out)
        return
    step = max(1, STAGING_BYTES // src_dtype.itemsize)
    for i in range(0, out.numel(), step):
        piece = out[i : i + step]
        staging = torch.empty(piece.numel(), dtype=src_dtype)
        reader.read_into(path, offset + i * src_dtype.itemsize, staging)
        piece.copy_(staging)


def split_for_threads(item: ReadItem) -> list[ReadItem]:
    """Cut a large contiguous read into staging-sized pieces so threads can share it."""
    if item.rows != 1:
        return [item]
    step = max(1, STAGING_BYTES // item.src_dtype.itemsize)
    if item.cols <= step:
        return [item]
    return [
        ReadItem(item.file, item.key, item.src_dtype, item.src_offset + i, 1, min(step, item.cols - i),
                 min(step, item.cols - i), item.dst_offset + i)
        for i in range(0, item.cols, step)
    ]


def run_reads(jobs: list[tuple[ReadItem, TensorEntry, torch.Tensor]], reader: FileReader, threads: int = 4,
              progress=None) -> None:
    """Execute (item, checkpoint entry, destination) jobs, in parallel threads (preadv releases the GIL).
    `progress(nbytes)` is called as pieces complete."""
    pieces = [(p, entry, dst) for item, entry, dst in jobs for p in split_for_threads(item)]

    def one(item, entry, dst):
        execute_read(reader, item, entry, dst)
        if progress is not None:
            progress(item.numel * item.src_dtype.itemsize)

    if threads <= 1 or len(pieces) <= 1:
        for piece in pieces:
            one(*piece)
        return
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for f in [pool.submit(one, *piece) for piece in pieces]:
            f.result()
