"""`ReadItem`: one box of checkpoint bytes and where it lands. The planner makes them (`planner/plan.py`); the reader,
the staging path, the streams and the writer execute them. It sits below all of them, so none imports another to
name it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ReadItem:
    """Copy a box of a checkpoint tensor into the destination, like DCP's ReadItem.

    The box is `rows` runs of `cols` contiguous elements, the first at element `src_offset` of tensor
    `key` in `file`, the next `row_stride` elements further. They land at element `dst_offset` of the
    destination, row-major, or column-major if `transposed` (a transpose of the last dimension).
    """

    file: str
    key: str
    src_dtype: torch.dtype
    src_offset: int
    rows: int
    cols: int
    row_stride: int
    dst_offset: int
    transposed: bool = False
    stored_bytes_per_element: float = 0.0  # a computed (dequantized) tensor: checkpoint bytes behind each element

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def stored_bytes(self) -> int:
        return math.ceil(self.numel * (self.stored_bytes_per_element or self.src_dtype.itemsize))
