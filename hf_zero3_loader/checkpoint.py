"""The checkpoint on disk: safetensors headers, parsed and validated without reading tensor data.

A checkpoint is one `model.safetensors` or several shards named by `model.safetensors.index.json`.
Only headers are read here (a few KB per file); tensor bytes are read later by `reader.py`, and only
the ranges the plan asks for.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import stat
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .errors import CheckpointError

# safetensors dtype names -> torch dtypes we can load
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    # quantized checkpoints (dequantized on read, see dequantize.py)
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    **({"F8_E8M0": torch.float8_e8m0fnu} if hasattr(torch, "float8_e8m0fnu") else {}),
}

# A header larger than this is not a real checkpoint header (the safetensors library uses 100 MB too).
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorEntry:
    """Where one checkpoint tensor's bytes are: `file`, absolute byte offset `data_start`, and its layout."""

    key: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data_start: int
    # pickled checkpoints only: the (memory-mapped) tensor, loaded with `weights_only` semantics
    tensor: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class FileIdentity:
    """Which file a path named when its header was read: a file replaced or rewritten since then differs. The change
    time is in it because a writer cannot set it back (`rsync --inplace --times` puts the modification time back;
    any write, and that `utime` itself, moves the change time on)."""

    size: int
    device: int
    inode: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class Checkpoint:
    """All tensors of a checkpoint, by key, plus how many header bytes were read to learn them."""

    files: list[str]
    entries: dict[str, TensorEntry]
    header_bytes: int
    metadata: dict[str, str]
    identities: dict[str, FileIdentity] = field(default_factory=dict)
    # per file name: what ranks compare to prove they load the same copy (`FileFingerprint`); a `state_dict=`'s are
    # strings (`checkpoint_from_state_dict`)
    fingerprints: dict[str, "FileFingerprint | str"] = field(default_factory=dict)
    sampled_bytes: int = 0
    # tensors the conversion computes from stored ones (dequantized FP8 / MXFP4), by key: see dequantize.py
    computed: dict = field(default_factory=dict)
    # values of a pickle or state dict that are not tensors (an epoch, a note), by key: what they are; skipped, as
    # transformers skips them, unless the model loads that key (`planner.plan.resolve_checkpoint` refuses that)
    not_tensors: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def entry(self, key: str):
        """A stored tensor, or a computed one."""
        return self.entries[key] if key in self.entries else self.computed[key]


SAMPLE_BLOCKS, SAMPLE_BYTES = 8, 4096  # data read per file to compare copies across ranks


def sample_spans(start: int, end: int) -> list[tuple[int, int]]:
    """(offset, size) of the up to SAMPLE_BLOCKS blocks of SAMPLE_BYTES spread evenly over [start, end), the first and
    last included."""
    span = end - start
    if span <= SAMPLE_BLOCKS * SAMPLE_BYTES:
        return [(start, span)] if span else []
    step = (span - SAMPLE_BYTES) // (SAMPLE_BLOCKS - 1)
    return [(start + i * step, SAMPLE_BYTES) for i in range(SAMPLE_BLOCKS)]


SEGMENTS_PER_BLOCK = 8  # a sampled block is digested per tensor it holds, in at most this many pieces


@dataclass(frozen=True)
class FileFingerprint:
    """What ranks compare to prove they read the same copy of a file: its size, its header's digest (safetensors), a
    digest of a few blocks sampled over its data (`sample_spans(start, size)`), the short digest of each piece of
    those blocks that one tensor holds (`samples`, starting at `sample_starts`: where copies differ, the tensor is
    named), and, where known without reading the file, the sha256 of the whole file (`sha256_from` says how)."""

    size: int
    header: str | None  # None: a pickle
    data: str
    samples: tuple[str, ...]
    sample_starts: tuple[tuple[int, int], ...]  # (file offset, bytes) of each sample: this rank's, not compared
    sha256: str | None = None
    sha256_from: str = ""

    def compared(self) -> dict:
        """The values every rank compares with the first rank's (all but the sha256, which not every rank may know:
        `Agreement.check(same_where_known=...)`)."""
        return {"size": self.size, "header": self.header, "data": self.data, "samples": list(self.samples)}


def _read_samples(fd: int, start: int, end: int) -> list[tuple[int, bytes]]:
    return [(offset, os.pread(fd, size, offset)) for offset, size in sample_spans(start, end)]


def _digest_samples(blocks: list[tuple[int, bytes]], tensor_starts: list[int] = ()
                    ) -> tuple[str, tuple[str, ...], tuple[tuple[int, int], ...]]:
    """(the digest of all sampled bytes, each piece's short digest, each piece's (offset, bytes)): each block cut
    where a tensor starts (`tensor_starts`, sorted), the last piece of a block taking what is left after
    SEGMENTS_PER_BLOCK - 1 cuts."""
    import bisect

    whole, digests, spans = hashlib.sha256(), [], []
    for offset, block in blocks:
        whole.update(block)
        end = offset + len(block)
        cuts = tensor_starts[bisect.bisect_right(tensor_starts, offset):bisect.bisect_left(tensor_starts, end)]
        edges = [offset, *cuts[:SEGMENTS_PER_BLOCK - 1], end]
        for a, b in zip(edges, edges[1:]):
            digests.append(hashlib.sha256(block[a - offset:b - offset]).hexdigest()[:8])
            spans.append((a, b - a))
    return whole.hexdigest()[:16], tuple(digests), tuple(spans)


def _refuse_duplicates(path: str):
    def hook(pairs):
        obj = dict(pairs)
        if len(obj) != len(pairs):  # rare: find the name given twice
            seen = set()
            for key, _ in pairs:
                if key in seen:
                    raise CheckpointError(f"{path}: safetensors header names tensor {key!r} twice")
                seen.add(key)
        return obj

    return hook


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_header(path: str, raw: bytes) -> dict:
    """The header JSON, held to the safetensors format's own rules (what `safetensors` itself refuses)."""
    try:
        text = raw.decode("utf-8")  # strict: safetensors refuses UTF-16 and invalid UTF-8
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not UTF-8: {e})") from e
    try:
        header = json.loads(text, object_pairs_hook=_refuse_duplicates(path))
    except RecursionError:
        raise CheckpointError(f"{path}: corrupt safetensors header (JSON nested deeper than a header can be)") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: safetensors __metadata__ must map strings to strings, got {_short(metadata)}")
    return header


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """Return (header dict, offset of the data section), validated against the file and the format's rules."""
    header, data_start, _, _ = _read_header(path)
    return header, data_start


def _read_header(path: str) -> tuple[dict, int, FileIdentity, FileFingerprint]:
    """(header, data start, the file's identity, its fingerprint), from one open descriptor."""
    return _parse_fetched(path, _fetch_header(path))


def _fetch_header(path: str) -> tuple[os.stat_result, int, bytes, list]:
    """The reads of `_read_header`: the file's status, its header's length and bytes, and its sampled data blocks."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint file not found: {path}") from e
    except OSError as e:
        raise CheckpointError(f"cannot open checkpoint file {path}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"checkpoint file {path} is not a regular file")
        file_size = st.st_size
        raw_len = os.pread(fd, 8, 0)
        if len(raw_len) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
            raise CheckpointError(
                f"{path}: corrupt safetensors header (declares {header_len} header bytes, file has {file_size})"
            )
        raw = os.pread(fd, header_len, 8)
        return st, header_len, raw, _read_samples(fd, 8 + header_len, file_size)
    finally:
        os.close(fd)


def _parse_fetched(path: str, fetched: tuple[os.stat_result, int, bytes, list]
                   ) -> tuple[dict, int, FileIdentity, FileFingerprint]:
    st, header_len, raw, blocks = fetched
    header = _parse_header(path, raw)
    data_start = 8 + header_len
    _check_entries(path, header, st.st_size - data_start, st.st_size, data_start)
    tensor_starts = sorted(data_start + info["data_offsets"][0] for key, info in header.items() if key != "__metadata__")
    fingerprint = FileFingerprint(st.st_size, hashlib.sha256(raw).hexdigest()[:16],
                                  *_digest_samples(blocks, tensor_starts), *known_sha256(path, st))
    return header, data_start, FileIdentity.of(st), fingerprint


HEADER_THREADS = 8  # files whose header reads are in flight at once when the checkpoint is not in memory


def read_headers(paths: list[str]) -> list[tuple[dict, int, FileIdentity, str]]:
    """`_read_header` of each path, in order. From cold or network storage, the reads of several files are in flight
    at once: each file takes about ten dependent small reads (open, length, header, data samples), and one file after
    another would wait on every round trip in turn (DeepSeek-V3 has 163 files). The threads only read; parsing and
    checks, which hold the GIL, stay in this thread. From memory (the page cache, tmpfs) the files are read in turn:
    threads there only add GIL handoffs (2.5x slower here). The first failing path in order raises, as reading in
    turn would."""
    if len(paths) <= 1 or HEADER_THREADS <= 1 or (_start_is_in_memory(paths[-1]) and _start_is_in_memory(paths[0])):
        return [_read_header(path) for path in paths]
    with ThreadPoolExecutor(min(HEADER_THREADS, len(paths)), thread_name_prefix="hf_zero3_loader-headers") as pool:
        return [_parse_fetched(path, fetched) for path, fetched in zip(paths, pool.map(_fetch_header, paths))]


MEMORY_READ_S = 50e-6  # a small read from memory returns within this; one that waits on a device or a network does not


def _start_is_in_memory(path: str) -> bool:
    """Whether the first bytes of `path` are in memory: a read that need not wait (`RWF_NOWAIT`) or, where the
    filesystem cannot say (tmpfs, network filesystems), a plain read of them that returned within `MEMORY_READ_S`.
    The first and the last file in memory are taken as a sign for the whole checkpoint (tools that peek at a
    checkpoint read its first file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True  # reading it in turn reports the error
    try:
        nowait = getattr(os, "RWF_NOWAIT", None)
        if nowait is not None:
            try:
                os.preadv(fd, [bytearray(8)], 0, nowait)
                return True
            except BlockingIOError:  # EAGAIN: a device read would be needed
                return False
            except OSError:  # EOPNOTSUPP: this filesystem cannot say
                pass
        start = time.perf_counter()
        os.pread(fd, 8, 0)
        return time.perf_counter() - start < MEMORY_READ_S
    except OSError:
        return True
    finally:
        os.close(fd)


def _check_entries(path: str, header: dict, data_size: int, file_size: int, data_start: int) -> None:
    """Every tensor entry well formed; the byte ranges, sorted, tile the data section exactly (no overlap, no gap,
    no trailing bytes), as safetensors requires."""
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        # the common case in one expression (JSON numbers are exactly `int`, never bool); details only on failure
        try:
            begin, end = info["data_offsets"]
            shape = info["shape"]
            well_formed = (type(shape) is list and all(type(d) is int and d >= 0 for d in shape)
                           and type(begin) is int and type(end) is int and 0 <= begin <= end <= data_size
                           and end - begin == math.prod(shape) * SAFETENSORS_DTYPES[info["dtype"]].itemsize)
        except Exception:
            well_formed = False
        if not well_formed:
            _explain_entry(path, key, info, data_size, file_size, data_start)
        spans.append((begin, end, key))
    expected, previous = 0, None
    for begin, end, key in sorted(spans):
        if begin != expected:
            what = f"overlaps tensor {previous!r}" if begin < expected else f"leaves a gap after {previous!r}"
            raise CheckpointError(f"{path}: tensor {key!r} data_offsets [{begin}, {end}] {what} "
                                  "(safetensors requires the tensors to tile the data section)")
        expected, previous = end, key
    if expected != data_size:
        raise CheckpointError(f"{path}: {data_size - expected} bytes after the last tensor: not a complete "
                              "safetensors file")


def _explain_entry(path: str, key: str, info, data_size: int, file_size: int, data_start: int) -> None:
    """Raise the CheckpointError that says what is wrong with a header entry that failed the fast check."""
    where = f"{path}: tensor {key!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: corrupt header entry (not a JSON object)")
    dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype_name, str):
        raise CheckpointError(f"{where}: corrupt header entry (dtype {_short(dtype_name)})")
    if dtype_name not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{where} has unsupported dtype {dtype_name}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: corrupt header entry (shape {_short(shape)} is not a list of sizes)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: corrupt header entry (data_offsets {_short(offsets)})")
    begin, end = offsets
    if end - begin != math.prod(shape) * SAFETENSORS_DTYPES[dtype_name].itemsize:
        raise CheckpointError(f"{where}: byte range does not match its shape {shape}")
    if end > data_size:
        raise CheckpointError(f"{path}: truncated file: tensor {key!r} ends at byte {data_start + end}, "
                              f"file has {file_size}")
    raise CheckpointError(f"{where}: corrupt header entry")  # not reached: the fast check is the sum of these


def _inside(folder: str, path: str) -> bool:
    # abspath, not realpath: a hub cache snapshot links to blobs outside it, by design
    folder = os.path.abspath(folder)
    return os.path.commonpath([folder, os.path.abspath(path)]) == folder


def looks_like_a_path(name: str) -> bool:
    """Whether `from_pretrained`'s argument names a local folder rather than a hub repo id: absolute, `./` or
    `../`, or under a folder that exists here."""
    return (os.path.isabs(name) or name in (".", "..") or name.startswith(("./", "../", "~"))
            or bool(os.path.dirname(name)) and os.path.isdir(os.path.dirname(name)))


def missing_folder(name, error: BaseException) -> OSError | None:
    """The error to raise instead of `error` when `name` looks like a local path that does not exist: transformers
    takes it for a hub repo id and says "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"."""
    if name is None or not isinstance(error, (OSError, ValueError)):
        return None
    name = os.fspath(name)
    if not isinstance(name, str) or os.path.exists(name) or not looks_like_a_path(name):
        return None
    missing = OSError(f"no such folder: {name}")
    missing.__cause__ = error
    return missing


def check_files(folder: str | None, files: list[str]) -> None:
    """Every checkpoint file must exist and lie inside the checkpoint folder (an index can name any path)."""
    for path in files:
        if folder is not None and not _inside(folder, path):
            raise CheckpointError(f"checkpoint file {path} is outside the checkpoint folder {folder}; refusing to read it")
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint file not found: {path} (a missing or partly downloaded shard?)")
        if not os.path.isfile(path):
            kind = "a directory" if os.path.isdir(path) else "not a regular file (a FIFO, socket or device?)"
            raise CheckpointError(f"checkpoint file {path} is {kind}")


def _open_pickled(path: str, weights_only: bool, not_tensors: dict | None = None) -> dict[str, TensorEntry]:
    """A pickled (.bin) checkpoint, loaded as transformers loads it: memory-mapped when it is torch's zip format,
    read whole when it is the legacy format (which cannot be mapped), and with `weights_only` unless trusted.
    Keys whose values are not tensors go into `not_tensors`."""
    import zipfile

    try:
        mapped = zipfile.is_zipfile(path)
        state = torch.load(path, map_location="cpu", mmap=mapped, weights_only=weights_only)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint file not found: {path}") from e
    except Exception as e:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # torch's message carries terminal colour codes
        if weights_only and "Weights only load failed" in text:
            # torch's own advice is to allow-list what the pickle names (`exec`, `posix.system`): not ours to give
            names = re.findall(r"GLOBAL ([\w.]+)", text)
            named = f" (its pickle names `{names[0]}`)" if names else ""
            raise CheckpointError(f"{path}: this pickled checkpoint needs code execution to load{named}, which "
                                  "weights_only=True refuses. Load it with weights_only=False only if it comes from a "
                                  "trusted source; better, convert it to safetensors") from e
        raise CheckpointError(f"{path}: cannot load pickled checkpoint with weights_only={weights_only}: {text}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: a pickled checkpoint must hold a dict of tensors, found {type(state).__name__}")
    entries = {}
    for key, t in state.items():
        if not isinstance(t, torch.Tensor):
            if not_tensors is not None:
                not_tensors[key] = f"a {type(t).__name__} in {os.path.basename(path)}"
            continue
        if t.dtype not in SAFETENSORS_DTYPES.values():
            raise CheckpointError(f"{path}: tensor {key!r} has unsupported dtype {t.dtype}")
        # kept as saved (a non-contiguous view is read in place, never copied whole)
        entries[key] = TensorEntry(key=key, file=path, dtype=t.dtype, shape=tuple(t.shape), data_start=0, tensor=t)
    return entries


def _pickled_fingerprint(path: str) -> tuple[FileIdentity, FileFingerprint, int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        blocks = _read_samples(fd, 0, st.st_size)
        return (FileIdentity.of(st), FileFingerprint(st.st_size, None, *_digest_samples(blocks), *known_sha256(path, st)),
                sum(len(b) for _, b in blocks))
    finally:
        os.close(fd)


# -- exact digests known without reading the files ---------------------------------------------------------------------

MANIFEST = "SHA256SUMS"  # `sha256sum` lines ("<hex>  <name>") for the folder's files: `hf-zero3-loader digest` writes it
_SHA256 = re.compile(r"[0-9a-f]{64}")


def known_sha256(path: str, st: os.stat_result) -> tuple[str | None, str]:
    """(the sha256 of the whole file, how it is known), or (None, "") where it is not known without reading the file:
    - the Hugging Face hub cache keeps each LFS file once, as `blobs/<its sha256>`, and a snapshot's file links to it;
    - a folder may carry a `SHA256SUMS` manifest (`hf-zero3-loader digest`), trusted for a file not modified since
      the manifest was written (a file newer than it is not taken from it)."""
    real = os.path.realpath(path)
    if os.path.basename(os.path.dirname(real)) == "blobs" and _SHA256.fullmatch(os.path.basename(real)):
        return os.path.basename(real), "hub cache blob name"
    manifest, written_ns = read_manifest(os.path.dirname(os.path.abspath(path)))
    sha = manifest.get(os.path.basename(path))
    if sha is not None and st.st_mtime_ns <= written_ns:
        return sha, MANIFEST
    return None, ""


def read_manifest(folder: str) -> tuple[dict[str, str], int]:
    """A folder's `SHA256SUMS` as {file name: sha256} and the time it was written (ns); ({}, 0) when it has none."""
    path = os.path.join(folder, MANIFEST)
    try:
        written_ns = os.stat(path).st_mtime_ns
    except OSError:
        return {}, 0
    return _parsed_manifest(path, written_ns), written_ns


@functools.lru_cache(maxsize=64)
def _parsed_manifest(path: str, written_ns: int) -> dict[str, str]:
    out = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                digest_hex, _, name = line.rstrip("\n").partition(" ")
                name = name[1:] if name[:1] in (" ", "*") else name  # text or binary mode marker
                if _SHA256.fullmatch(digest_hex.lower()) and name and "/" not in name:
                    out[name] = digest_hex.lower()
    except (OSError, UnicodeDecodeError):
        return {}
    return out


STATE_DICT = "state_dict"  # the "file" of a checkpoint given as `from_pretrained(None, state_dict=...)`
STATE_DICT_VALUES = "state_dict (values)"  # its fingerprint's second part (what ranks holding values compare)


def checkpoint_from_state_dict(state_dict: dict, streamed: bool = False) -> Checkpoint:
    """A `state_dict=` passed to `from_pretrained`: a rank that holds the values copies its partitions' elements from
    them as from a pickled checkpoint's tensors. The fingerprint (names, dtypes and shapes; the values' first and last
    elements) is what ranks compare, so state dicts that differ between ranks (an unseeded random init, a rank that
    built its own) are refused rather than mixed. `streamed`: ranks with meta tensors receive their bytes from a
    rank with values (`streaming.find_state_dict_holders`, which compares the values among those)."""
    entries, not_tensors = {}, {}
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor):  # as in a pickled checkpoint: only tensors are weights
            not_tensors[key] = f"a {type(t).__name__} in the state_dict"
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise CheckpointError(f"state_dict[{key!r}] is a {type(t).__name__}; pass plain tensors (each rank copies "
                                  "its partitions from them)")
        if t.is_meta and not streamed:
            raise CheckpointError(f"state_dict[{key!r}] is on the meta device, and no rank holds the values: pass them "
                                  "on at least one rank (the others receive their partitions' bytes from it)")
        if t.dtype not in SAFETENSORS_DTYPES.values():
            raise CheckpointError(f"state_dict[{key!r}] has unsupported dtype {t.dtype}")
        entries[key] = TensorEntry(key=key, file=STATE_DICT, dtype=t.dtype, shape=tuple(t.shape), data_start=0,
                                   tensor=t.detach())
    checkpoint = Checkpoint(files=[], entries=entries, header_bytes=0, metadata={}, not_tensors=not_tensors)
    names, values = state_dict_fingerprint(state_dict)
    checkpoint.fingerprints[STATE_DICT] = names
    if not streamed:
        checkpoint.fingerprints[STATE_DICT_VALUES] = values
    return checkpoint


def state_dict_fingerprint(state_dict: dict) -> tuple[str, str | None]:
    """(names, dtypes, shapes and bytes; digest of each tensor's first and last elements, None with meta tensors)."""
    names, samples, count, nbytes = hashlib.sha256(), [], 0, 0
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            continue
        count, nbytes = count + 1, nbytes + t.numel() * t.element_size()
        names.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        if samples is not None and t.is_meta:
            samples = None
        elif samples is not None and t.numel():
            samples += [edge.contiguous().view(torch.uint8).reshape(-1).cpu() for edge in _edge_elements(t.detach())]
    values = None if samples is None else hashlib.sha256(
        torch.cat(samples).numpy().tobytes() if samples else b"").hexdigest()[:16]
    return f"{count} tensors, {nbytes} bytes, names {names.hexdigest()[:16]}", values


def _edge_elements(t: torch.Tensor, count: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of (up to) the first and the last `count` elements in flat order, without copying `t`."""
    if t.is_contiguous():
        flat = t.view(-1)
        return flat[:count], flat[-count:]
    if t.dim() == 1:
        return t[:count], t[-count:]
    return t[(0,) * (t.dim() - 1)][:count], t[(-1,) * (t.dim() - 1)][-count:]


def open_checkpoint(files: list[str], weights_only: bool = True) -> Checkpoint:
    """Parse the headers of the given files (all shards of one checkpoint); tensor data is not read."""
    checkpoint = Checkpoint(files=list(files), entries={}, header_bytes=0, metadata={})
    entries = checkpoint.entries

    def add(key: str, entry: TensorEntry) -> None:
        if key in entries:
            raise CheckpointError(f"tensor {key!r} appears in both {entries[key].file} and {entry.file} (a mixed or "
                                  "partly updated copy? transformers 5.23 would silently take the file it reads last)")
        entries[key] = entry

    safetensors_files = list(dict.fromkeys(path for path in files if path.endswith(".safetensors")))
    headers = dict(zip(safetensors_files, read_headers(safetensors_files)))
    for path in files:
        name = os.path.basename(path)
        if not path.endswith(".safetensors"):
            checkpoint.identities[path], checkpoint.fingerprints[name], read = _pickled_fingerprint(path)
            checkpoint.sampled_bytes += read
            for key, entry in _open_pickled(path, weights_only, checkpoint.not_tensors).items():
                add(key, entry)
            continue
        header, data_start, checkpoint.identities[path], checkpoint.fingerprints[name] = headers[path]
        checkpoint.sampled_bytes += min(SAMPLE_BLOCKS * SAMPLE_BYTES, checkpoint.identities[path].size - data_start)
        checkpoint.header_bytes += data_start
        checkpoint.metadata.update(header.get("__metadata__") or {})
        for key, info in header.items():
            if key != "__metadata__":
                add(key, TensorEntry(key=key, file=path, dtype=SAFETENSORS_DTYPES[info["dtype"]],
                                     shape=tuple(info["shape"]), data_start=data_start + info["data_offsets"][0]))
    return checkpoint


# -- the other direction: the header `safetensors.torch.save_file` writes, computed from shapes and dtypes alone ------

# safetensors orders a file's tensors by dtype (its Dtype enum, largest first), then by name (safetensors 0.8 `prepare`)
SAFETENSORS_DTYPE_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16",
                           "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64")
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class PlannedFile:
    """A safetensors file before any tensor byte exists: its header and where each tensor's bytes go."""

    name: str
    header: bytes  # the 8-byte length and the JSON header, padded as safetensors pads it
    entries: dict[str, TensorEntry]  # key -> entry, `data_start` absolute in the file, `file` = name

    @property
    def size(self) -> int:
        return len(self.header) + sum(e.nbytes for e in self.entries.values())


def plan_safetensors_file(name: str, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
                          metadata: dict[str, str] | None) -> PlannedFile:
    """The bytes `safetensors.torch.save_file(tensors, name, metadata)` writes before the data, and each tensor's
    data offset: tensors sorted by dtype then name, compact JSON with `__metadata__` first, padded with spaces to a
    multiple of 8."""
    for key, (_, dtype) in tensors.items():
        if dtype not in SAFETENSORS_NAMES:
            raise CheckpointError(f"{key}: dtype {dtype} cannot be written to a safetensors file")
    rank = {dtype: i for i, dtype in enumerate(SAFETENSORS_DTYPE_ORDER)}
    order = sorted(tensors, key=lambda k: (-rank[SAFETENSORS_NAMES[tensors[k][1]]], k))
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset, relative = 0, {}
    for key in order:
        shape, dtype = tensors[key]
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        relative[key] = offset
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    data_start = 8 + len(raw)
    entries = {key: TensorEntry(key=key, file=name, dtype=tensors[key][1], shape=tuple(tensors[key][0]),
                                data_start=data_start + relative[key]) for key in order}
    return PlannedFile(name, struct.pack("<Q", len(raw)) + raw, entries)


INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_NAMES = ("model.safetensors", "pytorch_model.bin")


def with_variant(name: str, variant: str | None) -> str:
    """transformers' file name for a `variant` (its `_add_variant`): model.fp16.safetensors,
    model.safetensors.index.fp16.json."""
    if not variant:
        return name
    stem, _, suffix = name.rpartition(".")
    return f"{stem}.{variant}.{suffix}"


def weight_file_names(variant: str | None = None, use_safetensors: bool | None = None) -> tuple[list[str], list[str]]:
    """(index names, single-file names) in the order transformers looks for them: safetensors first, pickles first
    with `use_safetensors=False`."""
    order = (1, 0) if use_safetensors is False else (0, 1)
    return ([with_variant(INDEX_NAMES[i], variant) for i in order], [with_variant(SINGLE_NAMES[i], variant) for i in order])


def find_index(path: str, subfolder: str = "", revision: str | None = None, variant: str | None = None,
               use_safetensors: bool | None = None, cache_dir: str | None = None) -> str | None:
    """The checkpoint's index file, if any, in a local folder or the hub cache (nothing is downloaded)."""
    for name in weight_file_names(variant, use_safetensors)[0]:
        local = os.path.join(path, subfolder, name)
        if os.path.isfile(local):
            return local
        if not os.path.isdir(path):
            try:
                from huggingface_hub import try_to_load_from_cache

                cached = try_to_load_from_cache(path, os.path.join(subfolder, name) if subfolder else name,
                                                revision=revision, cache_dir=cache_dir)
            except Exception:
                cached = None
            if isinstance(cached, str):
                return cached
    return None


def local_checkpoint(path: str, subfolder: str = "", revision: str | None = None, variant: str | None = None,
                     use_safetensors: bool | None = None,
                     cache_dir: str | None = None) -> tuple[str | None, list[str], str]:
    """(folder, weight files, "") when this rank can read the whole checkpoint here, else (None, [], why not). The
    files are those transformers will pick (`variant`, `use_safetensors`); a repo id is looked up in the hub cache
    transformers uses (`cache_dir`, else the default)."""
    if os.path.isdir(path):
        folder = os.path.join(path, subfolder)
    else:
        try:
            from huggingface_hub import snapshot_download

            folder = os.path.join(snapshot_download(path, revision=revision, cache_dir=cache_dir,
                                                            local_files_only=True), subfolder)
        except Exception:
            where = f"the hub cache at {cache_dir}" if cache_dir else "the local hub cache"
            return None, [], f"{path} is neither a folder here nor in {where}"
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return None, [], f"no config.json in {folder}"
    files = []
    index_names, single_names = weight_file_names(variant, use_safetensors)
    for index_name in index_names:
        index = os.path.join(folder, index_name)
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(os.path.join(folder, v) for v in set(json.load(f).get("weight_map", {}).values()))
            break
    else:
        for single in single_names:
            if os.path.isfile(os.path.join(folder, single)):
                files = [os.path.join(folder, single)]
                break
    if not files:
        return None, [], f"no weight files found in {folder}"
    for f in files:
        if not (os.path.isfile(f) and os.access(f, os.R_OK)):
            return None, [], f"cannot read {f}"
    return folder, files, ""


def check_index(index_path: str) -> None:
    """An index transformers will follow: JSON with a `weight_map` of tensor name -> shard file name."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except RecursionError:
        raise CheckpointError(f"{index_path}: corrupt checkpoint index (JSON nested too deeply)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{index_path}: corrupt checkpoint index ({e})") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: checkpoint index has no `weight_map` object (tensor name -> shard file)")
    bad = [k for k, v in weight_map.items() if not isinstance(v, str)]
    if bad:
        raise CheckpointError(f"{index_path}: checkpoint index maps tensor {bad[0]!r} to {weight_map[bad[0]]!r}, "
                              "not a shard file name")


def check_weight_map(weight_map: dict[str, str], checkpoint: Checkpoint) -> None:
    """A sharded checkpoint's index must name tensors that the named shard really holds."""
    name = functools.lru_cache(maxsize=None)(os.path.basename)  # once per distinct file, not per tensor
    for key, shard in weight_map.items():
        entry = checkpoint.entries.get(key)
        if entry is None or name(entry.file) != name(shard):
            raise CheckpointError(f"the checkpoint index names tensor {key!r} in {shard}, but that file does not hold it")
