"""Execute a plan's writes: the reader run backwards. Each `ReadItem` of a rank's plan says which box of an on-disk
tensor its partition range fills when loading; saving writes that range to that box with positional writes.

Files exist at their final size before anyone writes (`create_file`), so ranks write disjoint byte ranges of the same
files concurrently, without locks. From a CPU partition the bytes go straight to `pwrite` (no copy); a partition on
an accelerator, or a transposed box, passes through a staging buffer of at most `staging_bytes`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from .errors import CheckpointError, LoaderError
from .read_item import ReadItem
from .reader import STAGING_BYTES, OpenFiles, _as_bytes, run_in_threads


@dataclass
class WriteStats:
    bytes_written: int = 0
    writes: int = 0
    largest_staging_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_written += nbytes
            self.writes += 1

    def staged(self, nbytes: int) -> None:
        with self._lock:
            self.largest_staging_bytes = max(self.largest_staging_bytes, nbytes)


def create_file(path: str, header: bytes, size: int) -> None:
    """The file at its final size: the header written, the data section a hole the ranks fill."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if os.pwrite(fd, header, 0) != len(header):
            raise CheckpointError(f"{path}: short write of the header")
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_for_write(path: str) -> int:
    try:
        return os.open(path, os.O_WRONLY)  # never created or truncated here
    except OSError as e:
        raise CheckpointError(f"cannot open {path} for writing: {e.strerror}") from e


class FileWriter:
    """Positional writes into files that already exist, safe to share between threads (at most `max_open`
    descriptors stay open, least recently used closed first)."""

    def __init__(self, stats: WriteStats | None = None, max_open: int = 32):
        self.stats = stats or WriteStats()
        self._files = OpenFiles(_open_for_write, max_open)

    def write_from(self, path: str, offset: int, src: torch.Tensor) -> None:
        """Write the bytes of the contiguous CPU tensor `src` at `offset` of `path`."""
        buf = _as_bytes(src)
        done, total = 0, src.numel() * src.element_size()
        try:
            with self._files.use(path) as fd:
                while done < total:
                    n = os.pwritev(fd, [buf[done:]], offset + done)
                    if n <= 0:
                        raise CheckpointError(f"{path}: short write ({done} of {total} bytes at offset {offset})")
                    done += n
        except OSError as e:
            raise CheckpointError(f"cannot write {path}: {e.strerror}") from e
        self.stats.add(total)

    def close(self, sync: bool = False) -> None:
        """Close every descriptor; with `sync`, first make this process's writes durable (and, on a network
        filesystem, visible to the other clients)."""
        error = None
        for path, fd in self._files.take_all():
            try:
                if sync:
                    os.fsync(fd)
            except OSError as e:
                error = error or CheckpointError(f"cannot write {path}: {e.strerror}")
            finally:
                os.close(fd)
        if error is not None:
            raise error


def _host(src: torch.Tensor, stats: WriteStats) -> torch.Tensor:
    """A contiguous CPU tensor with `src`'s values: `src` itself when it already is one."""
    if src.device.type == "cpu" and src.is_contiguous():
        return src
    stats.staged(src.numel() * src.element_size())
    staging = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.device.type != "cpu" and torch.cuda.is_available())
    staging.copy_(src)
    return staging


def execute_write(writer: FileWriter, item: ReadItem, data_start: int, src: torch.Tensor,
                  staging_bytes: int = STAGING_BYTES) -> None:
    """Write partition elements `src[item.dst_offset : + item.numel]` (flat) to the box `item` names in its file,
    whose tensor data begins at byte `data_start`. No staging buffer exceeds `staging_bytes`."""
    if src.dtype != item.src_dtype:
        raise LoaderError(f"internal error: {item.key} is {item.src_dtype} on disk but {src.dtype} in the model")
    itemsize = item.src_dtype.itemsize
    part = src[item.dst_offset:item.dst_offset + item.numel]
    at = lambda row, col=0: data_start + (item.src_offset + row * item.row_stride + col) * itemsize  # noqa: E731
    if not item.transposed and (item.rows == 1 or item.row_stride == item.cols):  # one contiguous span
        step = item.numel if src.device.type == "cpu" else max(1, staging_bytes // itemsize)
        for i in range(0, item.numel, step):
            writer.write_from(item.file, at(0, i), _host(part[i:i + step], writer.stats))
        return
    # a box: `rows` runs of `cols` elements, `row_stride` apart in the file
    box = part.view(item.cols, item.rows).t() if item.transposed else part.view(item.rows, item.cols)
    if box.device.type == "cpu" and not item.transposed:  # each row is contiguous in the partition: no copy
        for r in range(item.rows):
            writer.write_from(item.file, at(r), box[r])
        return
    cols_per_step = min(item.cols, max(1, staging_bytes // itemsize))
    rows_per_step = max(1, staging_bytes // (cols_per_step * itemsize))
    for r0 in range(0, item.rows, rows_per_step):
        for c0 in range(0, item.cols, cols_per_step):
            block = _host(box[r0:r0 + rows_per_step, c0:c0 + cols_per_step], writer.stats)
            for r in range(block.shape[0]):
                writer.write_from(item.file, at(r0 + r, c0), block[r])


def split_for_threads(item: ReadItem, staging_bytes: int = STAGING_BYTES) -> list[ReadItem]:
    """Cut a large contiguous write into staging-sized pieces so threads can share it."""
    if item.rows != 1:
        return [item]
    step = max(1, staging_bytes // item.src_dtype.itemsize)
    if item.cols <= step:
        return [item]
    return [ReadItem(item.file, item.key, item.src_dtype, item.src_offset + i, 1, min(step, item.cols - i),
                     min(step, item.cols - i), item.dst_offset + i) for i in range(0, item.cols, step)]


def run_writes(jobs: list[tuple[ReadItem, int, torch.Tensor]], writer: FileWriter, threads: int = 4,
               staging_bytes: int = STAGING_BYTES, progress=None) -> None:
    """Execute (item, tensor data start in its file, source partition) jobs in parallel threads (pwrite releases the
    GIL); the first failure cancels the rest."""
    pieces = [(p, start, src) for item, start, src in jobs for p in split_for_threads(item, staging_bytes)]

    def one(item, start, src):
        execute_write(writer, item, start, src, staging_bytes)
        if progress is not None:
            progress(item.numel * item.src_dtype.itemsize)

    run_in_threads(pieces, one, threads)
