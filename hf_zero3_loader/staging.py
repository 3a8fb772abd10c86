"""Fill accelerator partitions through a bounded host staging buffer.

Checkpoint bytes are read into host memory; a partition that lives on an accelerator is filled piece by piece:
each piece of the plan is read into a slot of one host buffer of `staging_bytes` (pinned when the destination is
a CUDA device), copied to the device asynchronously on a side stream, and its slot is reused once that copy is
done. Host memory grows by the budget, never by the rank's share of the checkpoint, and reading the next pieces
overlaps the copies of the earlier ones. Partitions on the host (CPU ranks, `offload_param: cpu`) never come here:
they are read in place (`reader.run_reads`).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field, replace

import torch

from .errors import ConfigError
from .read_item import ReadItem
from .reader import FileReader, _as_bytes, coalesce, execute_read, file_order, merge_runs, run_in_threads

DEFAULT_STAGING_BYTES = 64 << 20  # pinning 256 MiB took 0.10-0.14 s on an H100 host; 64 MiB reads as fast
MIN_STAGING_BYTES = 4096
SLOTS_PER_THREAD = 2  # one slot being read while the previous one's copy is in flight
_ALIGN = 64  # slot starts stay aligned for any dtype view


@dataclass
class StagingStats:
    budget_bytes: int = 0
    buffer_bytes: int = 0  # the one host allocation holding every slot
    slot_bytes: int = 0
    slots: int = 0
    pieces: int = 0
    bytes_copied: int = 0
    copies: int = 0  # slot-to-destination copies: one per run of pieces adjacent in the slot and the destination
    pinned: bool = False
    largest_piece_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, piece_bytes: list[int], copies: int) -> None:
        with self._lock:
            self.pieces += len(piece_bytes)
            self.bytes_copied += sum(piece_bytes)
            self.copies += copies
            self.largest_piece_bytes = max(self.largest_piece_bytes, *piece_bytes)

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


def check_budget(staging_bytes) -> int:
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < MIN_STAGING_BYTES:
        raise ConfigError(f"staging_bytes must be an integer of at least {MIN_STAGING_BYTES}, got {staging_bytes!r}")
    return staging_bytes


def split_item(item: ReadItem, max_numel: int) -> list[ReadItem]:
    """Cut a ReadItem into pieces of at most `max_numel` elements, each landing on a contiguous destination range."""
    if item.numel <= max_numel:
        return [item]
    if item.rows == 1 or (not item.transposed and item.row_stride == item.cols):  # one contiguous run
        if item.rows != 1:
            item = replace(item, cols=item.numel, rows=1, row_stride=item.numel)
        return [replace(item, src_offset=item.src_offset + i, cols=min(max_numel, item.cols - i),
                        row_stride=min(max_numel, item.cols - i), dst_offset=item.dst_offset + i)
                for i in range(0, item.cols, max_numel)]
    if not item.transposed:  # whole rows land contiguously: groups of rows, or single rows cut further
        per = max_numel // item.cols
        if per:
            return [replace(item, src_offset=item.src_offset + r * item.row_stride, rows=min(per, item.rows - r),
                            dst_offset=item.dst_offset + r * item.cols) for r in range(0, item.rows, per)]
        return [piece for r in range(item.rows)
                for piece in split_item(replace(item, src_offset=item.src_offset + r * item.row_stride, rows=1,
                                                row_stride=item.cols, dst_offset=item.dst_offset + r * item.cols),
                                        max_numel)]
    # transposed: each column of the box lands contiguously (`rows` elements)
    per = max_numel // item.rows
    if per:
        return [replace(item, src_offset=item.src_offset + c, cols=min(per, item.cols - c),
                        dst_offset=item.dst_offset + c * item.rows) for c in range(0, item.cols, per)]
    pieces = []
    for c in range(item.cols):
        for r in range(0, item.rows, max_numel):
            n = min(max_numel, item.rows - r)
            pieces.append(replace(item, src_offset=item.src_offset + r * item.row_stride + c, rows=n, cols=1,
                                  dst_offset=item.dst_offset + c * item.rows + r))
    return pieces


class _Slots:
    """Equal slices of one host buffer, handed out to reader threads; a slot comes back with the event of the copy
    still reading it, and is not handed out again before that copy is done."""

    def __init__(self, buffer: torch.Tensor, count: int, slot_bytes: int):
        self.buffer, self.slot_bytes = buffer, slot_bytes
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(count):
            self.free.put((i, None))

    def take(self) -> tuple[int, torch.Tensor]:
        index, copy_done = self.free.get()
        if copy_done is not None:
            copy_done.synchronize()
        return index, self.buffer[index * self.slot_bytes : (index + 1) * self.slot_bytes]

    def give(self, index: int, copy_done) -> None:
        self.free.put((index, copy_done))


def pack_batches(pieces: list[tuple], slot_bytes: int) -> list[list[tuple]]:
    """Consecutive pieces (in file order) packed into slot-sized batches of (item, entry, dst, byte offset in the
    slot), kept in file order for reading. Within a batch the pieces are laid out in destination order: pieces that
    are adjacent in their destination are adjacent in the slot however the file orders them (per-expert checkpoint
    tensors landing in one fused parameter), so a batch costs one device copy per run of adjacent destination bytes,
    not one per piece."""
    batches, batch, bound = [], [], 0  # bound: the batch's bytes plus the most alignment padding its layout can need
    for piece in pieces:
        nbytes = piece[0].numel * piece[2].element_size()
        if batch and bound + _ALIGN - 1 + nbytes > slot_bytes:
            batches.append(_lay_out(batch))
            batch, bound = [], 0
        bound += nbytes + (_ALIGN - 1 if batch else 0)
        batch.append(piece)
    if batch:
        batches.append(_lay_out(batch))
    return batches


def _lay_out(batch: list[tuple]) -> list[tuple]:
    """Slot offsets for a batch, assigned in destination order; each new destination run starts aligned."""
    first_seen: dict[int, int] = {}  # destinations in order of first appearance (tensors compare by identity)
    for _, _, dst in batch:
        first_seen.setdefault(id(dst), len(first_seen))
    order = sorted(range(len(batch)), key=lambda i: (first_seen[id(batch[i][2])], batch[i][0].dst_offset))
    offsets, used, previous = [0] * len(batch), 0, None
    for i in order:
        item, _, dst = batch[i]
        follows = (previous is not None and previous[2] is dst
                   and previous[0].dst_offset + previous[0].numel == item.dst_offset)
        offsets[i] = used if follows else -(-used // _ALIGN) * _ALIGN
        used = offsets[i] + item.numel * dst.element_size()
        previous = batch[i]
    return [(item, entry, dst, offset) for (item, entry, dst), offset in zip(batch, offsets)]


def _copy_runs(batch: list[tuple], slot: torch.Tensor, non_blocking: bool) -> int:
    """Copy a filled slot to its destinations: one copy per run of pieces adjacent in the slot and the destination.
    Returns the number of copies."""
    in_slot_order = sorted(batch, key=lambda piece: piece[3])
    i = copies = 0
    while i < len(in_slot_order):
        item, _, dst, offset = in_slot_order[i]
        start, numel, j = item.dst_offset, item.numel, i + 1
        while j < len(in_slot_order):
            nxt = in_slot_order[j]
            if nxt[2] is not dst or nxt[0].dst_offset != start + numel or nxt[3] != offset + numel * dst.element_size():
                break
            numel += nxt[0].numel
            j += 1
        staged = slot[offset : offset + numel * dst.element_size()].view(dst.dtype)
        dst[start : start + numel].copy_(staged, non_blocking=non_blocking)
        copies += 1
        i = j
    return copies


def run_staged_reads(jobs: list[tuple], reader: FileReader, staging_bytes: int = DEFAULT_STAGING_BYTES,
                     threads: int = 4, progress=None) -> StagingStats:
    """Execute (item, checkpoint entry, flat destination) jobs through the staging buffer; destinations may be on
    any device (a CPU destination here is a test of this path). Returns what was staged."""
    check_budget(staging_bytes)
    devices = {dst.device for _, _, dst in jobs}
    if len(devices) > 1:
        raise ValueError(f"staged reads go to one device, got {sorted(map(str, devices))}")
    device = next(iter(devices), torch.device("cpu"))
    cuda = device.type == "cuda"
    threads = max(1, threads)
    count = max(1, min(threads * SLOTS_PER_THREAD, staging_bytes // (1 << 20)))  # slots of at least 1 MiB
    slot_bytes = staging_bytes // count // _ALIGN * _ALIGN
    stats = StagingStats(budget_bytes=staging_bytes, slot_bytes=slot_bytes, slots=count, pinned=cuda)
    pieces = []
    for item, entry, dst in jobs:
        # casts and boxes are staged in the source dtype; dequantized tensors are computed in fp32
        widest = max(item.src_dtype.itemsize, dst.element_size(), 4 if item.stored_bytes_per_element else 0)
        pieces += [(p, entry, dst) for p in split_item(item, slot_bytes // widest)]
    pieces.sort(key=lambda job: file_order(job[0], job[1]))
    batches = pack_batches(pieces, slot_bytes)
    if not batches:
        return stats
    buffer = torch.empty(count * slot_bytes, dtype=torch.uint8, pin_memory=cuda)
    stats.buffer_bytes = buffer.numel()
    slots = _Slots(buffer, count, slot_bytes)
    copy_stream = torch.cuda.Stream(device) if cuda else None
    if cuda:  # the partitions were allocated (and their padding zeroed) on the default stream
        copy_stream.wait_stream(torch.cuda.current_stream(device))

    # the buffer viewed as bytes once: slicing that view costs far less than slicing tensors, over thousands of pieces
    buffer_bytes, buffer_address = _as_bytes(buffer), buffer.data_ptr()

    def one(batch: list[tuple]) -> None:
        index, slot = slots.take()
        copy_done, copies = None, 0
        try:
            for file_offset, group in coalesce(batch, lambda piece: piece[2].dtype):
                if file_offset is not None:  # plain spans, one or more adjacent on disk: one preadv
                    base = index * slot_bytes  # pieces that follow each other in the slot too share one buffer
                    runs = merge_runs((None, base + offset, item.numel * dst.element_size())
                                      for item, _, dst, offset in group)
                    reader.read_buffers(group[0][0].file, file_offset,
                                        [(buffer_bytes[start:stop], buffer_address + start) for _, start, stop in runs])
                    continue
                item, entry, dst, offset = group[0]  # a cast, a box or a computed tensor
                staged = slot[offset : offset + item.numel * dst.element_size()].view(dst.dtype)
                execute_read(reader, replace(item, dst_offset=0), entry, staged, staging_bytes=slot_bytes)
            if cuda:
                with torch.cuda.device(device), torch.cuda.stream(copy_stream):
                    copies = _copy_runs(batch, slot, non_blocking=True)
                    copy_done = torch.cuda.Event()
                    copy_done.record(copy_stream)
            else:
                copies = _copy_runs(batch, slot, non_blocking=False)
        finally:
            slots.give(index, copy_done)
        stats.add([item.numel * dst.element_size() for item, _, dst, _ in batch], copies)
        if progress is not None:
            progress(sum(item.stored_bytes for item, *_ in batch))

    # the slots are reused for every batch: populating their pages again on each refill is a page-table walk for nothing
    prefault, reader.prefault = reader.prefault, False
    try:
        run_in_threads([(batch,) for batch in batches], one, threads)
    finally:
        reader.prefault = prefault
        if cuda:  # nothing may read the partitions, or reuse the pinned buffer, before the last copy lands
            copy_stream.synchronize()
            torch.cuda.current_stream(device).wait_stream(copy_stream)
    return stats
