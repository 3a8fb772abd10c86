"""The checkpoint on disk: safetensors headers, parsed and validated without reading tensor data.

A checkpoint is one `model.safetensors` or several shards named by `model.safetensors.index.json`.
Only headers are read here (a few KB per file); tensor bytes are read later by `reader.py`, and only
the ranges the plan asks for.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

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


@dataclass
class Checkpoint:
    """All tensors of a checkpoint, by key, plus how many header bytes were read to learn them."""

    files: list[str]
    entries: dict[str, TensorEntry]
    header_bytes: int
    metadata: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """Return (header dict, offset of the data section). Validates size and offsets against the file."""
    try:
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise CheckpointError(
                    f"{path}: corrupt safetensors header (declares {header_len} header bytes, file has {file_size})"
                )
            raw = f.read(header_len)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint file not found: {path}") from e
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    data_start = 8 + header_len
    data_size = file_size - data_start
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt header entry for tensor {key!r}") from e
        if dtype_name not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {key!r} has unsupported dtype {dtype_name}")
        itemsize = torch.empty((), dtype=SAFETENSORS_DTYPES[dtype_name]).element_size()
        if any((not isinstance(d, int)) or d < 0 for d in shape) or not (0 <= begin <= end):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {key!r}")
        if end - begin != math.prod(shape) * itemsize:
            raise CheckpointError(f"{path}: tensor {key!r} byte range does not match its shape {shape}")
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated file: tensor {key!r} ends at byte {data_start + end}, file has {file_size}"
            )
    return header, data_start


def _inside(folder: str, path: str) -> bool:
    # abspath, not realpath: a hub cache snapshot links to blobs outside it, by design
    folder = os.path.abspath(folder)
    return os.path.commonpath([folder, os.path.abspath(path)]) == folder


def check_files(folder: str | None, files: list[str]) -> None:
    """Every checkpoint file must exist and lie inside the checkpoint folder (an index can name any path)."""
    for path in files:
        if folder is not None and not _inside(folder, path):
            raise CheckpointError(f"checkpoint file {path} is outside the checkpoint folder {folder}; refusing to read it")
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file not found: {path} (a missing or partly downloaded shard?)")


def _open_pickled(path: str, weights_only: bool) -> dict[str, TensorEntry]:
    """A pickled (.bin) checkpoint: memory-mapped, and only with `weights_only` semantics unless trusted."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint file not found: {path}") from e
    except Exception as e:
        hint = (" It may execute code when unpickled; pass `weights_only=False` only if you trust its source."
                if weights_only else "")
        raise CheckpointError(f"{path}: cannot load pickled checkpoint with weights_only={weights_only}: {e}.{hint}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: a pickled checkpoint must hold a dict of tensors, found {type(state).__name__}")
    entries = {}
    for key, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        if t.dtype not in SAFETENSORS_DTYPES.values():
            raise CheckpointError(f"{path}: tensor {key!r} has unsupported dtype {t.dtype}")
        entries[key] = TensorEntry(key=key, file=path, dtype=t.dtype, shape=tuple(t.shape), data_start=0,
                                   tensor=t.contiguous())
    return entries


def open_checkpoint(files: list[str], weights_only: bool = True) -> Checkpoint:
    """Parse the headers of the given files (all shards of one checkpoint); tensor data is not read."""
    entries: dict[str, TensorEntry] = {}
    header_bytes = 0
    metadata: dict[str, str] = {}
    for path in files:
        if not path.endswith(".safetensors"):
            for key, entry in _open_pickled(path, weights_only).items():
                if key in entries:
                    raise CheckpointError(f"tensor {key!r} appears in both {entries[key].file} and {path}")
                entries[key] = entry
            continue
        header, data_start = read_safetensors_header(path)
        header_bytes += data_start
        metadata.update(header.get("__metadata__") or {})
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if key in entries:
                raise CheckpointError(f"tensor {key!r} appears in both {entries[key].file} and {path}")
            entries[key] = TensorEntry(
                key=key,
                file=path,
                dtype=SAFETENSORS_DTYPES[info["dtype"]],
                shape=tuple(info["shape"]),
                data_start=data_start + info["data_offsets"][0],
            )
    return Checkpoint(files=list(files), entries=entries, header_bytes=header_bytes, metadata=metadata)


def check_weight_map(weight_map: dict[str, str], checkpoint: Checkpoint) -> None:
    """A sharded checkpoint's index must name tensors that the named shard really holds."""
    for key, shard in weight_map.items():
        entry = checkpoint.entries.get(key)
        if entry is None or os.path.basename(entry.file) != os.path.basename(shard):
            raise CheckpointError(f"the checkpoint index names tensor {key!r} in {shard}, but that file does not hold it")
