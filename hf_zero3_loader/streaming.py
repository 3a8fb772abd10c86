"""Ranks without the files: reader ranks stream each rank exactly its partition bytes, in bounded chunks.

Shard-on-read needs every rank to open the checkpoint. When some cannot (the model sits on one node's disk, no
shared filesystem) or should not (a filesystem so slow per client that one reader per node is faster):

1. `find_readers`: every rank reports whether it can read the checkpoint (config, index, every weight file) and on
   which node it runs; all ranks take the same decision (`decide`): who reads, and which reader serves whom.
   `load_from="read"` (every rank reads), `"stream"` (one reader per node, the others receive) or `"auto"` (ranks
   that can read read; the others receive, from a reader on their node if there is one).
2. `collect_small_files`: ranks without the files get the config, generation config, index, the folder's other small
   non-weight files (code, pickles a model reads beside its weights) and every weight file's header from the first
   reader (a broadcast of a few MB); they write a *stub* folder (the small files, and each safetensors file as its
   real header followed by a hole) so transformers' own `from_pretrained` runs as usual.
3. The plan is the same on both ends: a receiving rank plans its own partitions as if it read them, with
   `TensorPlan.byte_source` naming its reader; the reader builds the same plan for it (`plan_for`). Both cut it into
   the same pieces and chunks (`stream_chunks`): files in name order, at most `chunk_bytes` per chunk. The reader
   reads a chunk into one of two staging buffers and sends it (`isend`) while it reads the next; the receiver
   copies each piece into its partition. No buffer is larger than `chunk_bytes`, and no tensor is ever whole.
   Dequantized (FP8/MXFP4) pieces travel as the stored bytes their computation reads (`ComputedEntry.stored_reads`):
   the reader reads them without computing, the receiver computes its own partition from them (`_pack_stored`,
   `_unpack_stored`), unless that is no smaller than their elements.
4. Errors agree as everywhere else: each chunk is preceded by a status; a reader that fails sends "failed" to the
   ranks waiting on it and reports its error at the next agreement point; one that dies or stops is caught by the
   liveness verdict (streams run in a thread watched for it, `Agreement.run_watched`: gloo's point-to-point waits
   would wait on for a stopped peer).

Point-to-point `send`/`recv` on the default process group: gloo on CPU; on NCCL the chunks travel through device
buffers (not tested here: one GPU was available).
"""

from __future__ import annotations

import collections
import os
import socket
import struct
import threading
from dataclasses import asdict, dataclass, field

import torch

from .checkpoint import (SAFETENSORS_DTYPES, STATE_DICT_VALUES, Checkpoint, TensorEntry, _open_pickled,
                         _pickled_fingerprint, _read_header, local_checkpoint, state_dict_fingerprint)
from .errors import CheckpointError, ConfigError, LoaderError, PeerFailed
from .planner.plan import LoadPlan
from .read_item import ReadItem

MODES = ("auto", "read", "stream")
DEFAULT_CHUNK_BYTES = 64 << 20
SMALL_FILE_BYTES = 8 << 20  # non-weight files a reader hands over (config, generation config, index, code)
# pickles named like weights (another format's or variant's shards): not handed over; other small pickles are, as a
# model's from_pretrained may read them beside its weights (Qwen2.5-Omni's speakers, spk_dict.pt)
WEIGHT_PICKLE_PREFIXES = ("pytorch_model", "model", "consolidated", "adapter_model", "tf_model", "flax_model")
OK, FAILED = 0, 1
# How a chunk travels (the status's third field): each piece's elements as read, or, for a chunk holding dequantized
# (FP8/MXFP4) pieces, the stored bytes they are computed from: the receiver computes them as a reader would (the
# reader only reads). The stored bytes are 0.25-0.5x the elements; a chunk goes as elements where they are not fewer.
ELEMENTS, STORED = 0, 1


# -- who can read ----------------------------------------------------------------------------------------------------

@dataclass
class Peer:
    """What a rank tells the others before the load."""

    rank: int
    node: str
    readable: bool
    reason: str = ""
    ep_rank: int = 0
    edp_rank: int = 0
    copy: str = ""  # what it would read (a state dict's values): the readers' must agree


def node_id() -> str:
    """Ranks on one node share its storage. torchrun's GROUP_RANK tells nodes apart (also several simulated nodes on
    one machine); otherwise the host name."""
    group = os.environ.get("GROUP_RANK")
    return f"{socket.gethostname()}#{group}" if group is not None else socket.gethostname()


@dataclass
class StreamLayout:
    """Who reads and who receives from whom; the same on every rank."""

    mode: str  # "read" (nobody streams) or "stream"
    peers: list[Peer]
    source_of: dict[int, int] = field(default_factory=dict)  # receiving rank -> the rank that streams to it

    @property
    def streaming(self) -> bool:
        return bool(self.source_of)

    def serves(self, rank: int) -> list[int]:
        return sorted(r for r, src in self.source_of.items() if src == rank)

    def reads_files(self, rank: int) -> bool:
        return rank not in self.source_of

    def first_reader(self) -> int:
        return min(p.rank for p in self.peers if p.rank not in self.source_of)

    def summary(self, rank: int) -> dict:
        out = {"mode": self.mode, "reads_files": self.reads_files(rank)}
        if rank in self.source_of:
            out["receives_from"] = self.source_of[rank]
        if self.serves(rank):
            out["streams_to"] = self.serves(rank)
        return out


def decide(peers: list[Peer], mode: str) -> StreamLayout:
    """Readers and receivers from what each rank reported (a pure function: every rank computes the same)."""
    if mode not in MODES:
        raise ConfigError(f"load_from must be one of {MODES}, got {mode!r}")
    readable = [p for p in peers if p.readable]
    unreadable = [p for p in peers if not p.readable]
    if mode == "read" or (mode == "auto" and (not unreadable or not readable)):
        if mode == "read" and unreadable and readable:
            raise CheckpointError(
                "load_from='read', but ranks " + ", ".join(str(p.rank) for p in unreadable) + " cannot read the "
                f"checkpoint ({unreadable[0].reason}); pass load_from='auto' to stream to them from the others")
        return StreamLayout("read", peers)  # all read (or none can: the read path reports what is wrong)
    if not readable:
        raise CheckpointError("no rank can read the checkpoint: " + "; ".join(f"rank {p.rank}: {p.reason}"
                                                                              for p in peers[:4]))
    if mode == "auto":
        readers = [p.rank for p in readable]
    else:  # one reader per node: the lowest rank there that can read
        first_on_node: dict[str, int] = {}
        for p in readable:
            first_on_node.setdefault(p.node, p.rank)
        readers = sorted(first_on_node.values())
    node_of = {p.rank: p.node for p in peers}
    load = {r: 0 for r in readers}
    source_of = {}
    for p in peers:
        if p.rank in load:
            continue
        near = [r for r in readers if node_of[r] == p.node]
        choice = min(near or readers, key=lambda r: (load[r], r))  # same node first, then the least loaded
        source_of[p.rank] = choice
        load[choice] += 1
    return StreamLayout("stream", peers, source_of)


# -- the small files, for ranks without the checkpoint ---------------------------------------------------------------

def collect_small_files(folder: str, files: list[str]) -> dict:
    """What a rank without the files needs to run transformers' from_pretrained and plan: the non-weight files, and
    each weight file's header (safetensors) or tensor list (pickle), with this reader's fingerprints."""
    weight_names = {os.path.basename(f) for f in files}
    small = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name in weight_names or not os.path.isfile(path) or os.path.getsize(path) > SMALL_FILE_BYTES:
            continue
        if name.endswith((".safetensors", ".h5", ".msgpack", ".gguf")) or (
                name.endswith((".bin", ".pt", ".pth")) and name.startswith(WEIGHT_PICKLE_PREFIXES)):
            continue
        with open(path, "rb") as f:
            small[name] = f.read()
    weights = {}
    for path in files:
        name = os.path.basename(path)
        if name.endswith(".safetensors"):
            header, data_start, identity, fingerprint = _read_header(path)
            with open(path, "rb") as f:
                raw = f.read(data_start)
            weights[name] = {"header": raw, "size": identity.size, "fingerprint": fingerprint}
        else:
            _, fingerprint, _ = _pickled_fingerprint(path)
            tensors = [(k, str(e.dtype).removeprefix("torch."), e.shape) for k, e in _open_pickled(path, True).items()]
            weights[name] = {"tensors": tensors, "fingerprint": fingerprint}
    return {"small": small, "weights": weights}


def write_stub_folder(bundle: dict, folder: str) -> str:
    """The checkpoint as transformers expects to find it, without tensor data: small files as they are, each
    safetensors file as its header followed by a hole of the data's size, each pickle as an empty file."""
    os.makedirs(folder, exist_ok=True)
    for name, data in bundle["small"].items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    for name, info in bundle["weights"].items():
        with open(os.path.join(folder, name), "wb") as f:
            if "header" in info:
                f.write(info["header"])
                f.truncate(info["size"])
    return folder


def checkpoint_from_bundle(bundle: dict, files: list[str]) -> Checkpoint:
    """The checkpoint's entries and fingerprints as the reader sees them, for a rank whose files are stubs."""
    from .checkpoint import _parse_header

    by_name = {os.path.basename(f): f for f in files}
    checkpoint = Checkpoint(files=list(files), entries={}, header_bytes=0, metadata={})
    for name, info in bundle["weights"].items():
        path = by_name.get(name, name)
        checkpoint.fingerprints[name] = info["fingerprint"]
        if "header" in info:
            raw = info["header"]
            (n,) = struct.unpack("<Q", raw[:8])
            header = _parse_header(path, raw[8:8 + n])
            checkpoint.header_bytes += len(raw)
            checkpoint.metadata.update(header.get("__metadata__") or {})
            for key, meta in header.items():
                if key != "__metadata__":
                    checkpoint.entries[key] = TensorEntry(key, path, SAFETENSORS_DTYPES[meta["dtype"]],
                                                          tuple(meta["shape"]), len(raw) + meta["data_offsets"][0])
        else:
            for key, dtype, shape in info["tensors"]:
                checkpoint.entries[key] = TensorEntry(key, path, getattr(torch, dtype), tuple(shape), 0)
    return checkpoint


@dataclass
class StreamContext:
    layout: object  # streaming.StreamLayout
    bundle: dict | None  # the reader's small files and headers, on a rank without the files
    chunk_bytes: int


def _expert_ranks(expert_parallel) -> tuple[int, int]:
    """This rank's (EP rank, expert-data-parallel rank): which experts, and which slice of them, it loads."""
    import torch.distributed as dist

    if expert_parallel is None:
        return 0, 0
    groups = expert_parallel[1]
    return groups.ep_rank, dist.get_rank(group=groups.edp_group)


def _find_layout(me: Peer, agreement, mode: str, phase: str) -> tuple[list[Peer], StreamLayout | None]:
    """Every rank's Peer and the layout when some rank streams; ([], None) when none does. Through the store, no
    collective: when every rank can read (and nobody asks to stream), one store round trip is all."""
    values = agreement.gather(phase, asdict(me), needed=not me.readable or mode == "stream")
    if values is None:
        return [], None
    peers = [Peer(**v) for v in values]
    layout = decide(peers, mode)
    return (peers, layout) if layout.streaming else ([], None)


def find_state_dict_holders(state_dict: dict, agreement, mode: str, chunk_bytes: int, expert_parallel):
    """`state_dict=`: ranks whose state dict holds the values copy from it; ranks that pass meta tensors (transformers'
    own ZeRO-3 path lets every rank but the first do so, to hold it once) receive their partitions' bytes from a rank
    that holds them. Returns a StreamContext, or None when every rank copies from its own."""
    import torch.distributed as dist

    _, values = state_dict_fingerprint(state_dict)
    me = Peer(dist.get_rank(), node_id(), values is not None, "its state_dict holds meta tensors" if values is None
              else "", *_expert_ranks(expert_parallel), copy=values or "")
    peers, layout = _find_layout(me, agreement, mode, "find the ranks that hold the state_dict's values")
    if layout is None:
        return None
    holders = [p for p in peers if p.readable]  # the receivers get the values of one of them: all must agree
    for p in holders[1:]:
        if p.copy != holders[0].copy:
            raise CheckpointError(f"ranks {holders[0].rank} and {p.rank} are not loading the same checkpoint: "
                                  f"{STATE_DICT_VALUES} differs ({holders[0].copy} on rank {holders[0].rank}, "
                                  f"{p.copy} on rank {p.rank}); give every rank the same copy")
    summary = ", ".join(f"rank {r} <- rank {src}" for r, src in sorted(layout.source_of.items()))
    if me.rank == 0:
        from . import log

        log.info("streaming the state_dict's bytes (load_from=%r): %s", mode, summary)
    return StreamContext(layout, None, chunk_bytes)


def find_readers(path, kwargs, agreement, mode, chunk_bytes, expert_parallel):
    """Which ranks can read the checkpoint; the others get the small files and write a stub folder for transformers.
    Returns (StreamContext or None, the path and kwargs this rank loads with)."""
    import tempfile

    import torch.distributed as dist

    from . import log

    folder, files, reason = local_checkpoint(str(path), kwargs.get("subfolder") or "", kwargs.get("revision"),
                                             kwargs.get("variant"), kwargs.get("use_safetensors"),
                                             kwargs.get("cache_dir"))
    me = Peer(dist.get_rank(), node_id(), folder is not None, reason, *_expert_ranks(expert_parallel))
    peers, layout = _find_layout(me, agreement, mode, "find the ranks that can read the checkpoint")
    if layout is None:
        return None, path, kwargs
    bundle = None
    if not all(p.readable for p in peers):
        box = [None]
        with agreement.collective_section("hand the config and headers to the ranks without the files"):
            if me.rank == layout.first_reader():
                box = [collect_small_files(folder, files)]
            dist.broadcast_object_list(box, src=layout.first_reader())
        if not me.readable:
            bundle = box[0]
            path = write_stub_folder(bundle, tempfile.mkdtemp(prefix="hf_zero3_loader_stub_"))
            kwargs = {k: v for k, v in kwargs.items() if k not in ("subfolder", "revision", "cache_dir")}
    summary = ", ".join(f"rank {r} <- rank {src}" for r, src in sorted(layout.source_of.items()))
    if me.rank == 0:
        log.info("streaming checkpoint bytes (load_from=%r): %s", mode, summary)
    return StreamContext(layout, bundle, chunk_bytes), path, kwargs


# -- the stream: the same pieces and chunks on both ends -----------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """Rows [r0, r1) x cols [c0, c1) of one ReadItem's box, at `offset` in its chunk."""

    tensor: str
    item: ReadItem
    r0: int
    r1: int
    c0: int
    c1: int
    offset: int
    dtype: torch.dtype  # what it travels as: the checkpoint's dtype, or the partition's where that is narrower

    @property
    def nbytes(self) -> int:
        return (self.r1 - self.r0) * (self.c1 - self.c0) * self.dtype.itemsize

    def source(self) -> ReadItem:
        """The sub-box to read, row-major, untransposed."""
        i = self.item
        return ReadItem(i.file, i.key, i.src_dtype, i.src_offset + self.r0 * i.row_stride + self.c0, self.r1 - self.r0,
                        self.c1 - self.c0, i.row_stride, 0, stored_bytes_per_element=i.stored_bytes_per_element)

    def place(self, data: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the piece's bytes (`data`, its travel dtype) into the partition `out` (cast as transformers casts)."""
        i = self.item
        if self.dtype != i.src_dtype and out.dtype != self.dtype:  # cast by the reader: never cast twice
            raise LoaderError(f"internal error: {self.tensor} was streamed as {self.dtype}, its partition is {out.dtype}")
        part = data.view(self.r1 - self.r0, self.c1 - self.c0)
        dst = out[i.dst_offset:i.dst_offset + i.numel]
        if i.transposed:
            dst.view(i.cols, i.rows)[self.c0:self.c1, self.r0:self.r1].copy_(part.t())
        else:
            dst.view(i.rows, i.cols)[self.r0:self.r1, self.c0:self.c1].copy_(part)


    def pack(self, partition: torch.Tensor, data: torch.Tensor) -> None:
        """The reverse of `place`, for a save: copy the piece's elements from the partition into `data`."""
        i = self.item
        part = data.view(self.r1 - self.r0, self.c1 - self.c0)
        src = partition[i.dst_offset:i.dst_offset + i.numel]
        if i.transposed:
            part.copy_(src.view(i.cols, i.rows)[self.c0:self.c1, self.r0:self.r1].t())
        else:
            part.copy_(src.view(i.rows, i.cols)[self.r0:self.r1, self.c0:self.c1])


def stream_chunks(plan: LoadPlan, chunk_bytes: int, narrow: bool = True) -> list[tuple[str, list[list[Piece]]]]:
    """[(file name, chunks of pieces)], files in name order; a chunk never spans two files nor exceeds chunk_bytes.
    Both the reader and the receiver compute this from the receiver's plan. `narrow`: pieces travel in their
    partition's dtype where it is narrower than the checkpoint's (a load; a save sends the files' dtype)."""
    by_file: dict[str, list[tuple[str, ReadItem, torch.dtype]]] = {}
    for t in plan.tensors.values():
        if t.status == "load":
            for item in t.reads:
                dtype = travel_dtype(item, t.dtype) if narrow else item.src_dtype
                by_file.setdefault(os.path.basename(item.file), []).append((t.name, item, dtype))
    out = []
    for name in sorted(by_file):
        chunks, current, used = [], [], 0
        for tensor, item, dtype in by_file[name]:
            for r0, r1, c0, c1 in _split(item, chunk_bytes):  # as read: no read of a piece exceeds chunk_bytes
                nbytes = (r1 - r0) * (c1 - c0) * dtype.itemsize
                start = -(-used // 8) * 8  # 8-byte aligned, so each piece can be viewed as its dtype
                if current and start + nbytes > chunk_bytes:
                    chunks.append(current)
                    current, start = [], 0
                current.append(Piece(tensor, item, r0, r1, c0, c1, start, dtype))
                used = start + nbytes
        if current:
            chunks.append(current)
        out.append((name, chunks))
    return out


def travel_dtype(item: ReadItem, partition_dtype: torch.dtype) -> torch.dtype:
    """The partition's float dtype where it is narrower than the checkpoint's (an fp32 checkpoint loaded in bf16
    travels as bf16, half the bytes): the reader casts as the receiver would have (`copy_`, elementwise, so the bits
    are the same). Dequantized pieces travel as their stored bytes or as computed elements, uncast."""
    if (_computed(item) or not item.src_dtype.is_floating_point or not partition_dtype.is_floating_point
            or partition_dtype.itemsize >= item.src_dtype.itemsize):
        return item.src_dtype
    return partition_dtype


def _split(item: ReadItem, chunk_bytes: int):
    """Sub-boxes of at most chunk_bytes: whole rows when a row fits, else pieces of one row."""
    row_bytes = item.cols * item.src_dtype.itemsize
    if row_bytes <= chunk_bytes:
        step = max(1, chunk_bytes // max(row_bytes, 1))
        for r0 in range(0, item.rows, step):
            yield r0, min(item.rows, r0 + step), 0, item.cols
        return
    step = max(1, chunk_bytes // item.src_dtype.itemsize)
    for r in range(item.rows):
        for c0 in range(0, item.cols, step):
            yield r, r + 1, c0, min(item.cols, c0 + step)


def stream_bytes(plan: LoadPlan) -> int:
    """The bytes a stream of `plan` carries: its elements as they travel (`travel_dtype`); for FP8/MXFP4 entries the
    stored bytes behind them (an estimate: a run also carries the whole scales it touches)."""
    return sum(i.stored_bytes if _computed(i) else i.numel * travel_dtype(i, t.dtype).itemsize
               for t in plan.tensors.values() if t.status == "load" for i in t.reads)


def _computed(item: ReadItem) -> bool:
    """A dequantized tensor's item: computed from stored bytes, not read as it is."""
    return item.stored_bytes_per_element > 0


def _aligned(offset: int, alignment: int = 8) -> int:
    return -(-offset // alignment) * alignment  # each piece 8-byte aligned, so it can be viewed as its dtype


class _ReplayingReader:
    """Serves a receiving rank's computation of a dequantized piece the stored bytes its reader sent, in the order
    the computation asks for them (`ComputedEntry.stored_reads` is that order), each at its item-size alignment."""

    def __init__(self, data: torch.Tensor, start: int):
        self.data, self.end, self.payload = data, start, 0

    def read_stored(self, entry, start: int, out: torch.Tensor) -> None:
        at = _aligned(self.end, entry.dtype.itemsize)
        n = out.numel() * out.element_size()
        if at + n > self.data.numel() or not out.is_contiguous():
            raise LoaderError(f"internal error: the stream ran out of the stored bytes of {entry.key}")
        if n:
            out.reshape(-1).view(torch.uint8).copy_(self.data[at:at + n])
        self.end, self.payload = at + n, self.payload + n


def _largest_chunk(chunk_lists) -> int:
    """The buffer a stream needs: its largest chunk (at most chunk_bytes; a small stream needs far less)."""
    return max((_chunk_size(chunk) for chunks in chunk_lists for chunk in chunks), default=0)


def _chunk_size(chunk: list[Piece]) -> int:
    return chunk[-1].offset + chunk[-1].nbytes


class Streamer:
    """Point-to-point chunks on the default process group, through at most two buffers of `chunk_bytes` each."""

    def __init__(self, chunk_bytes: int, device: torch.device):
        if chunk_bytes < 64:
            raise ConfigError(f"stream_chunk_bytes must be at least 64, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.device = device  # where chunks travel: the CPU for gloo, the accelerator for NCCL
        self.largest_buffer = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.chunks_sent = {"elements": 0, "stored bytes": 0}  # by form
        self.cancelled = threading.Event()  # set when the load stopped waiting for this stream (`run_watched`)

    def _next_chunk(self) -> None:
        if self.cancelled.is_set():
            raise LoaderError("stream cancelled: the load failed or was interrupted")

    def _buffer(self, nbytes: int, device=None) -> torch.Tensor:
        self.largest_buffer = max(self.largest_buffer, nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=device or self.device)

    def serve(self, plans: dict[int, LoadPlan], checkpoint: Checkpoint, file_reader, progress=None) -> None:
        """Send each receiving rank its plan's bytes: file by file, receiver by receiver, chunk by chunk, reading
        the next chunk while the previous one is on the wire. On a failure, tell every receiver still waiting.
        `progress(nbytes)` is called as each chunk is handed to the wire."""
        import torch.distributed as dist

        streams = {rank: dict(stream_chunks(plan, self.chunk_bytes)) for rank, plan in plans.items()}
        remaining = {rank: sum(len(c) for c in s.values()) for rank, s in streams.items()}
        files = sorted({name for s in streams.values() for name in s})
        size = _largest_chunk(chunks for s in streams.values() for chunks in s.values())
        buffers = [self._buffer(size, "cpu") for _ in range(2)]
        in_flight: list[list] = [[], []]  # per buffer: its sends (and the tensors they send, kept alive)
        turn = 0
        try:
            for name in files:
                for rank in sorted(plans):
                    for chunk in streams[rank].get(name, []):
                        self._next_chunk()
                        for work in in_flight[turn][:2]:
                            work.wait()
                        buf = buffers[turn]
                        size, form, sent = self._pack(chunk, buf, checkpoint, file_reader)
                        payload = buf[:size] if self.device.type == "cpu" else buf[:size].to(self.device)
                        status = torch.tensor([OK, size, form], dtype=torch.int64, device=self.device)
                        in_flight[turn] = [dist.isend(status, rank), dist.isend(payload, rank), status, payload]
                        self.bytes_sent += sent
                        self.chunks_sent["stored bytes" if form == STORED else "elements"] += 1
                        remaining[rank] -= 1
                        if progress is not None:
                            progress(sent)
                        turn = 1 - turn
            for sends in in_flight:
                for work in sends[:2]:
                    work.wait()
        except BaseException:
            for rank in sorted(r for r, left in remaining.items() if left):  # it waits for a status: tell it
                try:
                    dist.send(torch.tensor([FAILED, 0, 0], dtype=torch.int64, device=self.device), rank)
                except Exception:
                    pass
            raise

    def _pack(self, chunk: list[Piece], buf: torch.Tensor, checkpoint: Checkpoint, file_reader) -> tuple[int, int, int]:
        """Fill `buf` with one chunk: (its size, its form, the checkpoint bytes in it, padding aside)."""
        from .reader import execute_read

        if any(_computed(p.item) for p in chunk):
            packed = self._pack_stored(chunk, buf, checkpoint, file_reader)
            if packed is not None:
                return packed[0], STORED, packed[1]
        for piece in chunk:  # read as the partition reads (cast on the way where the piece travels narrower)
            view = buf[piece.offset:piece.offset + piece.nbytes].view(piece.dtype)
            execute_read(file_reader, piece.source(), checkpoint.entry(piece.item.key), view,
                         staging_bytes=self.chunk_bytes)
        return _chunk_size(chunk), ELEMENTS, sum(p.nbytes for p in chunk)

    def _pack_stored(self, chunk: list[Piece], buf: torch.Tensor, checkpoint: Checkpoint, file_reader):
        """The chunk with each dequantized piece as the stored bytes its computation reads (read, not computed: the
        receiver computes), one piece after the other; None where that is no smaller than the chunk's elements (a
        piece of a few elements still carries the whole scales it touches) or does not fit the buffer. Returns
        (size, checkpoint bytes in it)."""
        from .reader import execute_read, read_stored

        end, payload, limit = 0, 0, min(buf.numel(), _chunk_size(chunk) - 1)  # smaller than the elements, or none
        for piece in chunk:
            end, item, entry = _aligned(end), piece.source(), checkpoint.entry(piece.item.key)
            if _computed(piece.item):
                for stored, first, count in entry.stored_reads(item.src_offset, item.rows, item.cols, item.row_stride):
                    at = _aligned(end, stored.dtype.itemsize)
                    end = at + count * stored.dtype.itemsize
                    if end > limit:
                        return None
                    read_stored(file_reader, stored, first, buf[at:end].view(stored.dtype))
                    payload += end - at
            else:
                at, end = end, end + piece.nbytes
                if end > limit:
                    return None
                execute_read(file_reader, item, entry, buf[at:end].view(piece.dtype),
                             staging_bytes=self.chunk_bytes)
                payload += piece.nbytes
        return end, payload

    def receive(self, plan: LoadPlan, source: int, destinations: dict[str, torch.Tensor], checkpoint: Checkpoint,
                progress=None, on_complete=None) -> None:
        """Receive this rank's plan from `source`, chunk by chunk, into the partitions (`name -> flat tensor`);
        `checkpoint` computes the dequantized pieces of chunks that come as stored bytes. `on_complete(name)` runs
        once a partition has all its pieces (NVMe offload swaps it out then)."""
        stream = stream_chunks(plan, self.chunk_bytes)
        buf = self._buffer(_largest_chunk(chunks for _, chunks in stream))
        pieces_left = (collections.Counter(piece.tensor for _, chunks in stream for chunk in chunks for piece in chunk)
                       if on_complete is not None else None)
        status = torch.empty(3, dtype=torch.int64, device=self.device)
        for _, chunks in stream:
            for chunk in chunks:
                self._next_chunk()
                size, form = self._receive_chunk(buf, status, source, chunk, "streams this rank's checkpoint bytes")
                received = self._place(chunk, buf[:size], form, checkpoint, destinations)
                self.bytes_received += received
                if progress is not None:
                    progress(received)
                if on_complete is not None:
                    for piece in chunk:
                        pieces_left[piece.tensor] -= 1
                        if not pieces_left[piece.tensor]:
                            on_complete(piece.tensor)

    @classmethod
    def _place(cls, chunk: list[Piece], data: torch.Tensor, form: int, checkpoint: Checkpoint, destinations) -> int:
        """One chunk as received (`data`, its bytes) into the partitions; returns the checkpoint bytes it held."""
        if form == STORED:
            return cls._unpack_stored(chunk, data.cpu(), checkpoint, destinations)
        for piece in chunk:
            piece.place(data[piece.offset:piece.offset + piece.nbytes].view(piece.dtype), destinations[piece.tensor])
        return sum(p.nbytes for p in chunk)

    @staticmethod
    def _unpack_stored(chunk: list[Piece], data: torch.Tensor, checkpoint: Checkpoint, destinations) -> int:
        """`_pack_stored` undone: each dequantized piece computed from its stored bytes, as its reader would have;
        returns the checkpoint bytes the chunk held."""
        end, payload = 0, 0
        for piece in chunk:
            end, item = _aligned(end), piece.source()
            if _computed(piece.item):
                replay = _ReplayingReader(data, end)
                box = checkpoint.entry(piece.item.key).read_box(replay, item.src_offset, item.rows, item.cols,
                                                                item.row_stride)
                piece.place(box.reshape(-1), destinations[piece.tensor])
                end, payload = replay.end, payload + replay.payload
            else:
                piece.place(data[end:end + piece.nbytes].view(piece.dtype), destinations[piece.tensor])
                end, payload = end + piece.nbytes, payload + piece.nbytes
        if end != data.numel():
            raise LoaderError(f"internal error: a chunk of {data.numel()} bytes held {end} bytes of its pieces")
        return payload

    def _receive_chunk(self, buf: torch.Tensor, status: torch.Tensor, source: int, chunk: list,
                       role: str) -> tuple[int, int]:
        """One chunk from `source` into the start of `buf`, after its status; returns its size in bytes and form."""
        import torch.distributed as dist

        dist.recv(status, source)
        if int(status[0]) != OK:
            raise PeerFailed(f"rank {source}, which {role}, failed")
        size, form = int(status[1]), int(status[2])
        expected = _chunk_size(chunk)
        if size > expected or (form == ELEMENTS and size != expected) or form not in (ELEMENTS, STORED):
            raise LoaderError(f"internal error: rank {source} sent {size} bytes (form {form}), {expected} expected")
        dist.recv(buf[:size], source)
        return size, form

    # -- a save: the same pieces and chunks, flowing the other way ----------------------------------------------------

    def send_partitions(self, plan: LoadPlan, sink: int, partitions: dict[str, torch.Tensor]) -> None:
        """Send the rank `sink` (which writes the files) this rank's plan's bytes from its partitions, chunk by chunk,
        packing the next chunk while the previous one is on the wire."""
        import torch.distributed as dist

        stream = stream_chunks(plan, self.chunk_bytes, narrow=False)
        buffers = [self._buffer(_largest_chunk(chunks for _, chunks in stream)) for _ in range(2)]
        in_flight: list[list] = [[], []]
        turn, between_chunks = 0, True
        try:
            for _, chunks in stream:
                for chunk in chunks:
                    self._next_chunk()
                    for work in in_flight[turn][:2]:
                        work.wait()
                    buf = buffers[turn]
                    for piece in chunk:
                        view = buf[piece.offset:piece.offset + piece.nbytes].view(piece.item.src_dtype)
                        piece.pack(partitions[piece.tensor].to(self.device), view)
                    size = _chunk_size(chunk)
                    status = torch.tensor([OK, size, ELEMENTS], dtype=torch.int64, device=self.device)
                    between_chunks = False
                    in_flight[turn] = [dist.isend(status, sink), dist.isend(buf[:size], sink), status]
                    between_chunks = True
                    self.bytes_sent += sum(p.nbytes for p in chunk)
                    turn = 1 - turn
            for sends in in_flight:
                for work in sends[:2]:
                    work.wait()
        except BaseException:
            if between_chunks:  # the sink waits for a status: tell it
                try:
                    dist.send(torch.tensor([FAILED, 0, 0], dtype=torch.int64, device=self.device), sink)
                except Exception:
                    pass
            raise

    def receive_to_files(self, plans: dict[int, LoadPlan], checkpoint: Checkpoint, file_writer, folder: str,
                         suffix: str = "") -> None:
        """Receive each sending rank's plan's bytes and write them where its plan puts them in the files (in `folder`,
        each file's name followed by `suffix`)."""
        from .writer import execute_write

        streams = {source: stream_chunks(plans[source], self.chunk_bytes, narrow=False) for source in plans}
        buf = self._buffer(_largest_chunk(chunks for stream in streams.values() for _, chunks in stream))
        status = torch.empty(3, dtype=torch.int64, device=self.device)
        for source in sorted(plans):
            for _, chunks in streams[source]:
                for chunk in chunks:
                    self._next_chunk()
                    size, form = self._receive_chunk(buf, status, source, chunk,
                                                     "streams its partitions to this rank")
                    if form != ELEMENTS:  # a save sends partition elements only
                        raise LoaderError(f"internal error: rank {source} sent a save chunk of form {form}")
                    self.bytes_received += sum(p.nbytes for p in chunk)
                    data = buf[:size].cpu()
                    for piece in chunk:
                        item = piece.source()
                        item = ReadItem(os.path.join(folder, item.file + suffix), item.key, item.src_dtype, item.src_offset,
                                        item.rows, item.cols, item.row_stride, 0)
                        execute_write(file_writer, item, checkpoint.entries[item.key].data_start,
                                      data[piece.offset:piece.offset + piece.nbytes].view(item.src_dtype))
