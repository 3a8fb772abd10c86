"""Execute a plan's reads: copy checkpoint bytes into local partitions with positional reads.

Reads go straight into the destination when dtypes match (no staging copy, no mmap, so RSS grows only by
the partitions themselves); otherwise through a bounded staging buffer and a cast, which rounds exactly
like transformers' `tensor.to(dtype)`. Each destination's pages are mapped in one call before its read
(`populate_for_write`) rather than faulted in one 4 KiB page at a time by the copy. Counters record every byte
read, for tests and benchmarks.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .checkpoint import FileIdentity, TensorEntry
from .errors import CheckpointError
from .read_item import ReadItem

STAGING_BYTES = 64 << 20  # largest staging buffer for casts and strided boxes; also the largest coalesced read
MAX_IOVECS = 512  # buffers per coalesced preadv (Linux allows 1024)
PREFAULT_ENV = "HF_ZERO3_LOADER_PREFAULT"  # "0": let the reads fault pages in (for A/B benchmarks)


@dataclass
class ReadStats:
    bytes_read: int = 0
    reads: int = 0
    bytes_populated: int = 0  # destination bytes mapped before their reads (0: the kernel or the switch said no)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.reads += 1

    def add_populated(self, nbytes: int) -> None:
        if nbytes:
            with self._lock:
                self.bytes_populated += nbytes


def local_world_size() -> int:
    """Ranks of this world on this machine, as the launcher says (torchrun and accelerate set LOCAL_WORLD_SIZE); all
    of them when it does not say."""
    import torch.distributed as dist

    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))


def default_io_threads() -> int:
    """Threads issuing reads or writes when the caller names none: this rank's share of the machine's cores, at most
    4 (more threads than cores only adds contention between the ranks on one machine)."""
    return max(1, min(4, (os.cpu_count() or 1) // max(local_world_size(), 1)))


def node_reads_whole_files(world_size: int) -> bool:
    """Whether the ranks on this machine read every byte of the checkpoint between them: the whole world is here.
    With ranks on other machines, this one reads only its ranks' slices of each tensor."""
    return local_world_size() >= world_size


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_PAGE = mmap.PAGESIZE
_MIN_POPULATE_BYTES = 16 * _PAGE  # below this a syscall saves nothing


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


_madvise = _libc_madvise()  # None where the kernel cannot populate (set so on its first refusal)


def populate_for_write(t: torch.Tensor) -> int:
    """Map a fresh CPU tensor's pages before a read fills it: one madvise(MADV_POPULATE_WRITE) instead of a page
    fault per 4 KiB page as the kernel's copy first touches each. Same pages, same zeroing, same RSS: it saves only
    each fault's entry and exit, a large part of a warm read into fresh memory (README, "Measured"). It never
    changes data (pages already mapped stay as they are); a no-op off Linux and before 5.14. Returns the bytes
    populated."""
    if t.device.type != "cpu":
        return 0
    return populate_range(t.data_ptr(), t.numel() * t.element_size())


def populate_range(address: int, nbytes: int) -> int:
    """`populate_for_write` for the bytes [address, address + nbytes) of a CPU buffer: the whole pages inside."""
    global _madvise
    if _madvise is None or nbytes < _MIN_POPULATE_BYTES:
        return 0
    start = -(-address // _PAGE) * _PAGE  # whole pages inside the range only
    end = (address + nbytes) // _PAGE * _PAGE
    if end <= start:
        return 0
    if _madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
        return end - start
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EPERM):  # an older kernel, or memory it will not
        _madvise = None  # populate: from now on the copies fault pages in, as without this
    # anything else (ENOMEM under a memory limit, EINTR): the copy faults them in, or fails as it would have
    return 0


def _as_bytes(t: torch.Tensor):
    """A writable numpy byte view over a CPU tensor's storage (works for bf16 too)."""
    return t.view(torch.uint8).numpy() if t.numel() else memoryview(b"")


class OpenFiles:
    """Descriptors shared by the threads of a reader or a writer: at most `max_open` stay open (an 800-shard
    checkpoint under `ulimit -n 256` loads and saves), the least recently used closed first, never one in use."""

    def __init__(self, open_file: Callable[[str], int], max_open: int = 32,
                 before_close: Callable[[str, int], None] | None = None):
        self.open_file, self.max_open, self.before_close = open_file, max_open, before_close
        self._fds: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._users: dict[str, int] = {}  # path -> threads using its descriptor now
        self._lock = threading.Lock()

    @contextmanager
    def use(self, path: str) -> Iterator[int]:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = self.open_file(path)
                for old in [p for p in self._fds if self._users.get(p, 0) == 0 and p != path]:
                    if len(self._fds) <= self.max_open:
                        break
                    old_fd = self._fds.pop(old)
                    if self.before_close is not None:
                        self.before_close(old, old_fd)
                    os.close(old_fd)
            self._fds.move_to_end(path)
            self._users[path] = self._users.get(path, 0) + 1
        try:
            yield fd
        finally:
            with self._lock:
                self._users[path] -= 1

    def take_all(self) -> list[tuple[str, int]]:
        """Every open (path, descriptor), for the caller to close once no thread uses them."""
        with self._lock:
            fds, self._fds = list(self._fds.items()), OrderedDict()
        return fds


class FileReader:
    """Positional reads from checkpoint files, safe to share between threads.

    At most `max_open` descriptors stay open (an 800-shard checkpoint under `ulimit -n 256` loads); a file is
    (re)opened as needed. Each file is pinned to the identity its header was read with (`FileIdentity`: inode, size,
    modification and change time): each open checks it, so a shard replaced or rewritten before it is opened is
    never read at old offsets; and each descriptor is checked again (`fstat`) before it closes, so a shard written in
    place while it was read (`dd conv=notrunc`, `rsync --inplace`, even with its modification time put back) is
    found (`changed_error`, `checked_reads`) rather than loaded half old, half new. Files read through a memory map
    (pickled checkpoints) are checked by path.
    """

    def __init__(self, stats: ReadStats | None = None, identities: dict | None = None, max_open: int = 32,
                 prefault: bool = True, readahead: bool = True):
        self.stats = stats or ReadStats()
        self.identities = identities or {}
        self.changed: dict[str, str] = {}  # path -> how it changed while read (the first change of each file)
        self.mapped: set[str] = set()  # files read through a memory map (pickled checkpoints): checked by path
        self._changed_lock = threading.Lock()
        self._files = OpenFiles(self._open, max_open, before_close=self._note_if_changed)
        # populate fresh destinations (partitions); a reader filling reused buffers (staging slots, stream chunks) is
        # made with prefault=False: populating resident pages again is a page-table walk per refill, for nothing
        self.prefault = prefault and os.environ.get(PREFAULT_ENV, "1") != "0"
        # readahead=False where this machine reads only part of each file: the kernel's read-ahead would fetch the
        # neighbouring slices, which other machines read (3.3x the bytes asked for, one rank of 8 here; README). The
        # reads are coalesced and sized already, so the kernel then fetches exactly them
        self.readahead = readahead

    def _open(self, path: str) -> int:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"cannot open checkpoint file {path}: {e.strerror}") from e
        expected = self.identities.get(path)
        if expected is not None and FileIdentity.of(os.fstat(fd)) != expected:
            os.close(fd)
            raise CheckpointError(f"{path} changed on disk after its header was read (replaced or rewritten during "
                                  "the load); refusing to read it at the old header's offsets")
        if not self.readahead and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            except OSError:  # advice only: a filesystem that refuses it is read as before
                pass
        return fd

    def read_into(self, path: str, offset: int, out: torch.Tensor) -> None:
        """Fill the CPU tensor `out` with the bytes at `offset` of `path`."""
        self.read_buffers(path, offset, [(_as_bytes(out), out.data_ptr())])

    def read_spans(self, path: str, offset: int, outs: list[torch.Tensor]) -> None:
        """Fill the CPU tensors `outs`, in order, with the consecutive bytes at `offset` of `path`: one preadv for
        reads that are adjacent on disk but land in different places (coalesced reads)."""
        self.read_buffers(path, offset, [(_as_bytes(out), out.data_ptr()) for out in outs])

    def read_buffers(self, path: str, offset: int, buffers: list[tuple]) -> None:
        """`read_spans` for (writable byte array, its address) pairs: byte views of CPU memory, which callers slice
        far more cheaply than tensors."""
        if self.prefault:
            self.stats.add_populated(sum(populate_range(address, len(buf)) for buf, address in buffers))
        bufs = [buf for buf, _ in buffers if len(buf)]
        done, total, first = 0, sum(len(b) for b in bufs), 0  # bytes read; index of the first buffer not yet full
        with self._files.use(path) as fd:
            while done < total:
                n = os.preadv(fd, bufs[first:first + MAX_IOVECS], offset + done)
                if n <= 0:
                    raise CheckpointError(f"{path}: truncated file (wanted {total} bytes at offset {offset})")
                done += n
                while n and n >= len(bufs[first]):  # drop the buffers filled, trim a partly filled one
                    n -= len(bufs[first])
                    first += 1
                if n:
                    bufs[first] = bufs[first][n:]
        self.stats.add(total)

    def _note_if_changed(self, path: str, fd: int | None) -> None:
        """Record whether `path` (through its descriptor `fd`, else by path) is still the file its header was read
        from. Never raises: it runs while descriptors close."""
        expected = self.identities.get(path)
        if expected is None:
            return
        try:
            st = os.fstat(fd) if fd is not None else os.stat(path)
            now = FileIdentity.of(st)
            # a file renamed over or deleted while its descriptor was held keeps its inode, but its last link is gone
            # (which moves its change time too): that is a replacement, not a write in place
            replaced = st.st_nlink == 0 or (now.device, now.inode) != (expected.device, expected.inode)
        except OSError as e:
            now, replaced = e.strerror, True
        if now != expected:
            with self._changed_lock:
                self.changed.setdefault(path, "replaced" if replaced else "written in place")

    def close(self) -> None:
        """Close every descriptor, checking each file first (`changed_error` tells what changed)."""
        for path, fd in self._files.take_all():
            self._note_if_changed(path, fd)
            os.close(fd)
        for path in sorted(self.mapped):
            self._note_if_changed(path, None)

    def changed_error(self) -> CheckpointError | None:
        """After `close`: the error for the first file (in path order) that changed on disk while this reader read
        it, or None."""
        if not self.changed:
            return None
        path = sorted(self.changed)[0]
        others = len(self.changed) - 1
        return CheckpointError(f"{path} changed on disk while it was read ({self.changed[path]} during the load"
                               f"{f'; {others} more files too' if others else ''}): the bytes read from it may mix "
                               "old and new, so refusing to load them; do not write into a checkpoint while it loads")


@contextmanager
def checked_reads(reader: FileReader) -> Iterator[FileReader]:
    """Run reads, then close `reader` and refuse the bytes of any file that changed on disk while it was read. When
    the reads failed and a file changed, the change is raised: it is the likelier cause (a read past a shrunk end)."""
    try:
        yield reader
    except Exception as e:
        reader.close()
        changed = reader.changed_error()
        if changed is not None:
            raise changed from e
        raise
    except BaseException:  # an interrupt: just close
        reader.close()
        raise
    reader.close()
    changed = reader.changed_error()
    if changed is not None:
        raise changed


def execute_read(reader: FileReader, item: ReadItem, entry: TensorEntry, dst: torch.Tensor,
                 staging_bytes: int = STAGING_BYTES) -> None:
    """Copy one ReadItem into the flat CPU tensor `dst` (a partition, buffer or stream chunk); no temporary buffer
    exceeds `staging_bytes`."""
    itemsize = item.src_dtype.itemsize
    out = dst[item.dst_offset : item.dst_offset + item.numel]
    if not isinstance(entry, TensorEntry):  # computed from stored tensors (dequantized): produced box by box
        box = entry.read_box(reader, item.src_offset, item.rows, item.cols, item.row_stride)
        view = out.view(item.cols, item.rows) if item.transposed else out.view(item.rows, item.cols)
        view.copy_(box.t() if item.transposed else box)
        return
    entry_start = entry.data_start
    if entry.tensor is not None:  # a pickled checkpoint, memory-mapped (or loaded whole, legacy format)
        reader.mapped.add(item.file)
        _copy_from_tensor(entry.tensor, item, out)
        reader.stats.add(item.numel * itemsize)
        return
    if not item.transposed and (item.rows == 1 or item.row_stride == item.cols):  # one contiguous span
        _read_span(reader, item.file, entry_start + item.src_offset * itemsize, item.src_dtype, out, staging_bytes)
        return
    # a box: `rows` runs of `cols` elements, `row_stride` apart
    box = torch.empty((item.rows, item.cols), dtype=item.src_dtype)
    gap = (item.row_stride - item.cols) * itemsize
    if gap <= 4096 and item.rows * item.row_stride * itemsize <= staging_bytes:
        # small gaps: one read of the covering span is faster than many tiny reads
        span = torch.empty(((item.rows - 1) * item.row_stride + item.cols,), dtype=item.src_dtype)
        reader.read_into(item.file, entry_start + item.src_offset * itemsize, span)
        box.copy_(span.as_strided((item.rows, item.cols), (item.row_stride, 1)))
    else:
        for r in range(item.rows):
            reader.read_into(item.file, entry_start + (item.src_offset + r * item.row_stride) * itemsize, box[r])
    view = out.view(item.cols, item.rows) if item.transposed else out.view(item.rows, item.cols)
    view.copy_(box.t() if item.transposed else box)


def _read_span(reader: FileReader, path: str, offset: int, src_dtype: torch.dtype, out: torch.Tensor,
               staging_bytes: int = STAGING_BYTES) -> None:
    if out.dtype == src_dtype:
        reader.read_into(path, offset, out)
        return
    step = max(1, staging_bytes // src_dtype.itemsize)
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
                 min(step, item.cols - i), item.dst_offset + i, stored_bytes_per_element=item.stored_bytes_per_element)
        for i in range(0, item.cols, step)
    ]


def _copy_flat_range(src: torch.Tensor, start: int, out: torch.Tensor) -> None:
    """out <- src.flatten()[start:start + out.numel()], for any strides, without copying `src` whole: the range is
    split into at most 2 * ndim + 1 boxes, each a strided view of `src`."""
    n = out.numel()
    if n == 0:
        return
    if src.dim() <= 1:
        out.copy_(src.reshape(-1)[start:start + n] if src.dim() == 0 else src[start:start + n])
        return
    inner = math.prod(src.shape[1:])
    first, last = start // inner, (start + n - 1) // inner
    pos = 0
    head = start - first * inner
    if head or first == last:  # a partial leading block
        take = min(inner - head, n)
        _copy_flat_range(src[first], head, out[:take])
        pos, first = take, first + 1
    if pos < n:
        full_end = (start + n) // inner  # blocks [first, full_end) are whole
        if full_end > first:
            count = (full_end - first) * inner
            out[pos:pos + count].view(full_end - first, *src.shape[1:]).copy_(src[first:full_end])
            pos += count
        if pos < n:
            _copy_flat_range(src[full_end], 0, out[pos:])


def read_stored(reader: FileReader, entry: TensorEntry, start: int, out: torch.Tensor) -> None:
    """Elements [start, start + out.numel()) of a stored tensor, bytes unchanged, into `out` (a contiguous tensor of
    the stored item size): from the file, or from the tensor of a pickled checkpoint."""
    if entry.tensor is None:
        reader.read_into(entry.file, entry.data_start + start * entry.itemsize,
                         out.view(torch.uint8) if out.numel() else out)
        return
    reader.mapped.add(entry.file)
    src = entry.tensor if entry.tensor.dtype == out.dtype else entry.tensor.view(out.dtype)
    _copy_flat_range(src, start, out)
    reader.stats.add(out.numel() * out.element_size())


def _copy_from_tensor(src: torch.Tensor, item: ReadItem, out: torch.Tensor) -> None:
    """A ReadItem served from an in-memory (or memory-mapped) tensor."""
    if src.is_contiguous():
        flat = src.reshape(-1)  # as_strided's offset counts from the storage's start, not the view's
        box = flat.as_strided((item.rows, item.cols), (item.row_stride, 1), flat.storage_offset() + item.src_offset)
    else:
        box = torch.empty((item.rows, item.cols), dtype=src.dtype)
        for r in range(item.rows):
            _copy_flat_range(src, item.src_offset + r * item.row_stride, box[r])
    view = out.view(item.cols, item.rows) if item.transposed else out.view(item.rows, item.cols)
    view.copy_(box.t() if item.transposed else box)


def file_order(item: ReadItem, entry) -> tuple:
    """Sort key: by file, then by position in it (sequential reads for disks and network filesystems)."""
    return item.file, getattr(entry, "data_start", 0) + item.src_offset * item.src_dtype.itemsize


def _span_offset(item: ReadItem, entry, out_dtype: torch.dtype) -> int | None:
    """The file offset of a piece that is one run of stored bytes landing unchanged in a destination of
    `out_dtype`; None otherwise."""
    if (not isinstance(entry, TensorEntry) or entry.tensor is not None or item.transposed
            or (item.rows != 1 and item.row_stride != item.cols) or out_dtype != item.src_dtype):
        return None
    return entry.data_start + item.src_offset * item.src_dtype.itemsize


def coalesce(pieces: list[tuple], dtype_of, max_bytes: int = STAGING_BYTES) -> list[tuple[int | None, list[tuple]]]:
    """Group pieces (in file order) into reads: consecutive plain spans that follow each other in one file become
    one read of at most `max_bytes` (one preadv into their separate destinations, of dtype `dtype_of(piece)`);
    anything else (casts, boxes, computed tensors) stays a read of its own. Returns (file offset or None, pieces)
    per read."""
    reads: list[tuple[int | None, list[tuple]]] = []
    end, size = None, 0
    for piece in pieces:
        item = piece[0]
        offset = _span_offset(item, piece[1], dtype_of(piece))
        nbytes = item.numel * item.src_dtype.itemsize
        last = reads[-1] if reads else None
        if (offset is not None and last is not None and last[0] is not None and offset == end
                and last[1][0][0].file == item.file and size + nbytes <= max_bytes and len(last[1]) < MAX_IOVECS):
            last[1].append(piece)
            size += nbytes
        else:
            reads.append((offset, [piece]))
            size = nbytes
        end = None if offset is None else offset + nbytes
    return reads


def merge_runs(ranges) -> list[list]:
    """(key, byte start, nbytes) ranges, in read order, as [key, start, stop] runs: a range that starts where the
    previous one of the same memory (key) stops extends it, so one preadv fills it through one buffer."""
    runs: list[list] = []
    for key, start, nbytes in ranges:
        if runs and runs[-1][0] == key and runs[-1][2] == start:
            runs[-1][2] = start + nbytes
        else:
            runs.append([key, start, start + nbytes])
    return runs


def run_reads(jobs: list[tuple[ReadItem, TensorEntry, torch.Tensor]], reader: FileReader, threads: int = 4,
              progress=None) -> None:
    """Execute (item, checkpoint entry, destination) jobs, in parallel threads (preadv releases the GIL), in file
    order, reads adjacent on disk coalesced. `progress(nbytes)` is called as reads complete. The first failure,
    or an interrupt, cancels every queued read at once; reads already running finish (at most STAGING_BYTES each)."""
    pieces = [(p, entry, dst) for item, entry, dst in jobs for p in split_for_threads(item)]
    pieces.sort(key=lambda job: file_order(job[0], job[1]))
    # each destination (flat, contiguous) viewed as bytes once: slicing those views costs far less than slicing
    # tensors, a few microseconds per piece over the thousands of pieces a load has
    bytes_of = {id(dst): (_as_bytes(dst), dst.data_ptr(), dst.element_size()) for _, _, dst in jobs}

    def span_buffers(group):
        """(bytes, address) per run of destination memory: pieces adjacent in one destination share a buffer."""
        def byte_range(item, dst):
            size = bytes_of[id(dst)][2]
            return id(dst), item.dst_offset * size, item.numel * size

        ranges = (byte_range(item, dst) for item, _, dst in group)
        return [(bytes_of[key][0][start:stop], bytes_of[key][1] + start) for key, start, stop in merge_runs(ranges)]

    def one(offset, group):
        if offset is not None:  # plain spans, one or more adjacent on disk
            reader.read_buffers(group[0][0].file, offset, span_buffers(group))
        else:
            execute_read(reader, *group[0])
        if progress is not None:
            progress(sum(p[0].stored_bytes for p in group))

    run_in_threads(coalesce(pieces, lambda piece: piece[2].dtype), one, threads)


def run_in_threads(tasks: list[tuple], one, threads: int) -> None:
    """`one(*task)` for every task, in `threads` threads. The first failure, or an interrupt, cancels every queued
    task at once; tasks already running finish."""
    stop = threading.Event()

    def guarded(*task):
        if not stop.is_set():
            one(*task)

    if threads <= 1 or len(tasks) <= 1:
        for task in tasks:
            one(*task)
        return
    pool = ThreadPoolExecutor(max_workers=threads)
    try:
        futures = [pool.submit(guarded, *task) for task in tasks]
        pending = futures
        while pending:  # short waits: the main thread gets back to Python often, so Ctrl-C lands at once
            done, pending = wait(pending, timeout=0.1, return_when=FIRST_EXCEPTION)
            for f in done:
                f.result()  # raises the first failure
    finally:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
