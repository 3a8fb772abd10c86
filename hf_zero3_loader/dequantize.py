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
from .reader import read_stored

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

    def stored_reads(self, src_offset: int, rows: int, cols: int, row_stride: int):
        """(stored entry, first element, count) of every read `read_box` makes for this box, in its order, without
        reading or computing: a reading rank streams exactly these bytes and the receiver computes the box from them
        (`streaming.py`). Both follow the same steps (`_steps`), so the two cannot drift apart."""
        for r in range(rows):
            for step in self._steps(src_offset + r * row_stride, cols):
                yield from self._reads(step)

    def read_run(self, reader, start: int, out: torch.Tensor) -> None:
        """Elements [start, start + out.numel()) of the computed tensor, step by step."""
        for step in self._steps(start, out.numel()):
            inputs = []
            for entry, first, count in self._reads(step):
                inputs.append(_read_flat(reader, entry, first, count))
            self._compute(step, inputs, out)

    def _steps(self, start: int, n: int):
        """The steps computing elements [start, start + n): each what `_reads` and `_compute` need."""
        raise NotImplementedError

    def _reads(self, step) -> list[tuple[TensorEntry, int, int]]:
        raise NotImplementedError

    def _compute(self, step, inputs: list[torch.Tensor], out: torch.Tensor) -> None:
        raise NotImplementedError


def _read_stored(reader, entry: TensorEntry, start: int, out: torch.Tensor) -> None:
    """Stored elements from the file or a pickled checkpoint's tensor (`reader.read_stored`); from a stream's bytes
    where `reader` has a `read_stored` of its own (a reading rank records what a receiver replays, `streaming.py`)."""
    stand_in = getattr(reader, "read_stored", None)
    if stand_in is not None:
        stand_in(entry, start, out)
        return
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

    def _grid(self):
        rows, cols = self.weight.shape[-2:]
        scale_rows, scale_cols = self.scale.shape[-2:] if len(self.scale.shape) >= 2 else (1, 1)
        return rows, cols, scale_cols, rows // scale_rows, cols // scale_cols, scale_rows

    def _steps(self, start: int, n: int):
        """Whole matrix rows at a time where the run allows: a partial row first (a run that starts mid-row), then as
        many whole rows as fit in one step. Each step: (done, take, flat, scale_row, lo, hi): `take` elements from
        flat index `flat`, each row's scale-grid row, and the scale-grid rows [lo, hi) they use."""
        rows, cols, _, block_m, _, scale_rows = self._grid()
        step = max(cols, (CHUNK_ELEMENTS // cols) * cols)
        done = 0
        while done < n:
            flat = start + done
            take = min(n - done, cols - flat % cols if flat % cols else step)
            first_row, last_row = flat // cols, (flat + take - 1) // cols  # global rows (matrix * rows + row)
            matrices = torch.arange(first_row, last_row + 1) // rows
            scale_row = matrices * scale_rows + (torch.arange(first_row, last_row + 1) % rows) // block_m
            lo, hi = int(scale_row.min()), int(scale_row.max()) + 1
            yield done, take, flat, scale_row, lo, hi
            done += take

    def _reads(self, step):
        _, take, flat, _, lo, hi = step
        scale_cols = self._grid()[2]
        return [(self.weight, flat, take), (self.scale, lo * scale_cols, (hi - lo) * scale_cols)]

    def _compute(self, step, inputs, out):
        done, take, flat, scale_row, lo, hi = step
        _, cols, scale_cols, _, block_n, _ = self._grid()
        q, scales = inputs[0].to(torch.float32), inputs[1].view(hi - lo, scale_cols)
        s = (scales.to(torch.float32) - 127.0).exp2() if scales.dtype == torch.uint8 else scales.to(torch.float32)
        # each row's scales, each repeated over its block of columns: [rows in this step, cols]
        per_row = s[scale_row - lo].repeat_interleave(block_n, dim=1)
        col0 = flat % cols
        per_element = per_row.reshape(-1)[col0:col0 + take]
        out[done:done + take] = (q * per_element).to(self.dtype)


FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Mxfp4Dequantized(ComputedEntry):
    """transformers' `convert_moe_packed_tensors(blocks, scales, dtype)`: blocks [E, R, G, 16] uint8 (two FP4 values
    per byte), scales [E, R, G] (E8M0) -> [E, G * 32, R] (the unpacked [E, R, G * 32], transposed)."""

    blocks: TensorEntry = None
    scales: TensorEntry = None

    def inputs(self):
        return [self.blocks, self.scales]

    def _steps(self, start: int, n: int):
        """Per step the output rows [h0, h1) of one expert that the run touches, from the groups [g0, g1) of 32
        values: (done, take, e, g0, g1, h0, h1, offset)."""
        experts, width, height = self.shape  # output [E, G*32, R]
        block_bytes = self.blocks.shape[3]
        done = 0
        while done < n:
            flat = start + done
            e, rem = divmod(flat, width * height)
            h0 = rem // height
            h1 = min(width, (rem + (n - done) - 1) // height + 1)  # output rows [h0, h1) of expert e touched
            g0, g1 = h0 // (2 * block_bytes), (h1 - 1) // (2 * block_bytes) + 1
            offset = rem - h0 * height
            take = min(n - done, (h1 - h0) * height - offset)
            yield done, take, e, g0, g1, h0, h1, offset
            done += take

    def _reads(self, step):
        """One row of blocks and of scales per R row: `g1 - g0` groups each."""
        _, _, e, g0, g1, _, _, _ = step
        _, rows, groups, block_bytes = self.blocks.shape
        count, reads = g1 - g0, []
        for r in range(rows):
            base = (e * rows + r) * groups + g0
            reads += [(self.blocks, base * block_bytes, count * block_bytes), (self.scales, base, count)]
        return reads

    def _compute(self, step, inputs, out):
        done, take, _, g0, g1, h0, h1, offset = step
        _, rows, _, block_bytes = self.blocks.shape
        count = g1 - g0
        blocks = torch.stack(inputs[0::2]).view(rows * count, block_bytes)
        scales = torch.stack(inputs[1::2]).view(rows * count, 1)
        lut = torch.tensor(FP4_VALUES, dtype=self.dtype)
        sub = torch.empty(rows * count, block_bytes * 2, dtype=self.dtype)
        sub[:, 0::2] = lut[(blocks & 0x0F).to(torch.int)]
        sub[:, 1::2] = lut[(blocks >> 4).to(torch.int)]
        torch.ldexp(sub, scales.to(torch.int32) - 127, out=sub)
        values = sub.reshape(rows, count * block_bytes * 2)  # [R, (g1-g0)*32]
        part = values[:, h0 - g0 * 2 * block_bytes:h1 - g0 * 2 * block_bytes].t().reshape(-1)  # [h, R] flat
        out[done:done + take] = part[offset:offset + take]


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
