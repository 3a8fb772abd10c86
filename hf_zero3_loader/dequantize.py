"""Quantized checkpoints dequantized on read: each rank reads the quantized bytes of its elements and the scales that
cover them, and computes its partition exactly as transformers' dequantize ops do.

transformers puts its dequantize op first in a weight's conversion chain (`Fp8Dequantize` for fine-grained FP8,
`Mxfp4Dequantize` for GPT-OSS's MXFP4 experts); the merge / concat ops after it only move elements. So the planner
treats a dequantized tensor as a *computed checkpoint tensor*: a leaf of the conversion graph whose elements a
`ComputedEntry` produces on demand, for any box the plan asks for, reading only what that box needs. Everything
downstream (runs, boxes, casts, streaming) is the same as for a stored tensor.

The arithmetic is transformers' own, element for element, so results are bit-exact:
- FP8: `(weight.float() * scale_inv_block.float()).to(out_dtype)`, the block size taken from the weight and scale grid
  shapes (`rows // scale_rows`), E8M0 `uint8` scales as `2 ** (byte - 127)`;
- MXFP4: `ldexp(lut[nibble], exponent - 127)` in the output dtype, two values per byte (low nibble first), 32 values
  per block, then `transpose(1, 2)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .checkpoint import TensorEntry

CHUNK_ELEMENTS = 1 << 20  # elements computed at once: bounds the index and fp32 temporaries


@dataclass(frozen=True)
class ComputedEntry:
    """A tensor the conversion computes from stored ones; `read_box` produces any box of its flat elements."""

    key: str
    dtype: torch.dtype  # what the computation yields (transformers' op output dtype)
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def file(self) -> str:
        return self.inputs()[0].file

    def inputs(self) -> list[TensorEntry]:
        raise NotImplementedError

    def stored_bytes_per_element(self) -> float:
        """Checkpoint bytes behind one element (for plans and reports)."""
        return sum(e.nbytes for e in self.inputs()) / max(self.numel, 1)

    def read_box(self, reader, src_offset: int, rows: int, cols: int, row_stride: int) -> torch.Tensor:
        out = torch.empty(rows, cols, dtype=self.dtype)
        for r in range(rows):
            self.read_run(reader, src_offset + r * row_stride, out[r])
        return out

    def read_run(self, reader, start: int, out: torch.Tensor) -> None:
        raise NotImplementedError


def _read_stored(reader, entry: TensorEntry, start: int, out: torch.Tensor) -> None:
    """Stored elements from the file or a pickled checkpoint's tensor (`reader.read_stored`); from a stream's bytes
    where `reader` has a `read_stored` of its own (a reading rank records what a receiver replays, `streaming.py`)."""
    stand_in = getattr(reader, "read_stored", None)
    if stand_in is not None:
        stand_in(entry, start, out)
        return
    from .reader import read_stored  # imported here: reader -> planner -> ops -> this module

    read_stored(reader, entry, start, out)


def _read_flat(reader, entry: TensorEntry, start: int, count: int) -> torch.Tensor:
    """Elements [start, start + count) of a stored tensor, as stored."""
    out = torch.empty(count, dtype=entry.dtype)
    _read_stored(reader, entry, start, out)
    return out


@dataclass(frozen=True)
class Fp8Dequantized(ComputedEntry):
    """transformers' `Fp8Dequantize._dequantize_one(weight, weight_scale_inv, output_dtype)`."""

    weight: TensorEntry = None
    scale: TensorEntry = None

    def inputs(self):
        return [self.weight, self.scale]

    def read_run(self, reader, start: int, out: torch.Tensor) -> None:
        """Elements [start, start + n) of the dequantized weight, whole matrix rows at a time where the run allows."""
        rows, cols = self.weight.shape[-2:]
        scale_rows, scale_cols = self.scale.shape[-2:] if len(self.scale.shape) >= 2 else (1, 1)
        block_m, block_n = rows // scale_rows, cols // scale_cols
        step = max(cols, (CHUNK_ELEMENTS // cols) * cols)
        done, n = 0, out.numel()
        while done < n:
            flat = start + done
            # a partial row first (a run that starts mid-row), then as many whole rows as fit in one step
            take = min(n - done, cols - flat % cols if flat % cols else step)
            first_row, last_row = flat // cols, (flat + take - 1) // cols  # global rows (matrix * rows + row)
            q = _read_flat(reader, self.weight, flat, take).to(torch.float32)
            matrices = torch.arange(first_row, last_row + 1) // rows
            scale_row = matrices * scale_rows + (torch.arange(first_row, last_row + 1) % rows) // block_m
            lo, hi = int(scale_row.min()), int(scale_row.max()) + 1
            scales = _read_flat(reader, self.scale, lo * scale_cols, (hi - lo) * scale_cols).view(hi - lo, scale_cols)
            s = (scales.to(torch.float32) - 127.0).exp2() if scales.dtype == torch.uint8 else scales.to(torch.float32)
            # each row's scales, each repeated over its block of columns: [rows in this step, cols]
            per_row = s[scale_row - lo].repeat_interleave(block_n, dim=1)
            col0 = flat % cols
            per_element = per_row.reshape(-1)[col0:col0 + take]
            out[done:done + take] = (q * per_element).to(self.dtype)
            done += take


FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Mxfp4Dequantized(ComputedEntry):
    """transformers' `convert_moe_packed_tensors(blocks, scales, dtype)`: blocks [E, R, G, 16] uint8 (two FP4 values
    per byte), scales [E, R, G] (E8M0) -> [E, G * 32, R] (the unpacked [E, R, G * 32], transposed)."""

    blocks: TensorEntry = None
    scales: TensorEntry = None

    def inputs(self):
        return [self.blocks, self.scales]

    def read_run(self, reader, start: int, out: torch.Tensor) -> None:
        experts, width, height = self.shape  # output [E, G*32, R]
        _, rows, groups, block_bytes = self.blocks.shape
        done, n = 0, out.numel()
        while done < n:
            flat = start + done
            e, rem = divmod(flat, width * height)
            h0 = rem // height
            h1 = min(width, (rem + (n - done) - 1) // height + 1)  # output rows [h0, h1) of expert e touched
            g0, g1 = h0 // (2 * block_bytes), (h1 - 1) // (2 * block_bytes) + 1
            values = self._dequantize(reader, e, g0, g1, rows, groups, block_bytes)  # [R, (g1-g0)*32]
            part = values[:, h0 - g0 * 2 * block_bytes:h1 - g0 * 2 * block_bytes].t().reshape(-1)  # [h, R] flat
            offset = rem - h0 * height
            take = min(n - done, part.numel() - offset)
            out[done:done + take] = part[offset:offset + take]
            done += take

    def _dequantize(self, reader, e, g0, g1, rows, groups, block_bytes) -> torch.Tensor:
        count = g1 - g0
        blocks = torch.empty(rows, count, block_bytes, dtype=torch.uint8)
        scales = torch.empty(rows, count, dtype=torch.uint8)
        for r in range(rows):  # one row of blocks and of scales per R row: `count` groups each
            base = (e * rows + r) * groups + g0
            _read_stored(reader, self.blocks, base * block_bytes, blocks[r].view(-1))
            _read_stored(reader, self.scales, base, scales[r])
        lut = torch.tensor(FP4_VALUES, dtype=self.dtype)
        sub = torch.empty(rows * count, block_bytes * 2, dtype=self.dtype)
        flat_blocks = blocks.reshape(rows * count, block_bytes)
        sub[:, 0::2] = lut[(flat_blocks & 0x0F).to(torch.int)]
        sub[:, 1::2] = lut[(flat_blocks >> 4).to(torch.int)]
        torch.ldexp(sub, scales.reshape(rows * count, 1).to(torch.int32) - 127, out=sub)
        return sub.reshape(rows, count * block_bytes * 2)


@dataclass(frozen=True)
class Computation:
    """What a dequantize rule asks for; `resolve` turns it into an entry once the stored entries are known."""

    kind: str  # "fp8" | "mxfp4"
    inputs: tuple[str, ...]  # checkpoint keys
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def key(self) -> str:
        return f"{self.kind}-dequantized:{self.inputs[0]}"

    def resolve(self, entries: dict) -> ComputedEntry:
        a, b = (entries[k] for k in self.inputs)
        if self.kind == "fp8":
            return Fp8Dequantized(self.key, self.dtype, self.shape, weight=a, scale=b)
        return Mxfp4Dequantized(self.key, self.dtype, self.shape, blocks=a, scales=b)
