"""Symbolic tensors: where each element of a converted tensor comes from, without any data.

transformers converts checkpoint tensors with a chain of ops (`MergeModulelist`, `Concatenate`, `Chunk`,
`Transpose`, ...). Every supported op only moves elements, so each output tensor is described by a
`Mapper` that answers: "the output's flat elements [start, start+length) come from which runs of which
input tensors?". Chaining mappers backwards from a model parameter down to the checkpoint tensors (the
leaves) turns "this rank's flat partition range" into the exact runs of bytes to read.

A `Run` is `length` elements starting at flat index `start` of a symbolic tensor, stepping by `stride`.
Runs passed into a mapper are contiguous (stride 1); only a leaf may receive a strided run (from a
transpose of the last dimension or an interleave of it), which the planner turns into a box read.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from ..errors import UnsupportedConversionError


@dataclass(eq=False)
class Sym:
    """A tensor in the conversion graph. A leaf names a checkpoint tensor; otherwise `mapper` says how it is built."""

    shape: tuple[int, ...]
    key: str | None = None  # checkpoint key, for leaves
    mapper: "Mapper | None" = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Run(NamedTuple):  # a tuple, not a dataclass: a large MoE plan makes tens of thousands of them
    sym: Sym
    start: int
    length: int
    stride: int = 1


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def _unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    coords = []
    for d in reversed(shape):
        index, c = divmod(index, d) if d else (index, 0)
        coords.append(c)
    return coords[::-1]


def _ravel(coords: list[int], shape: tuple[int, ...]) -> int:
    return sum(c * s for c, s in zip(coords, _strides(shape)))


class Mapper:
    """Maps a contiguous run of the output's flat elements to runs of the inputs' flat elements."""

    def backward(self, start: int, length: int) -> list[Run]:
        raise NotImplementedError


@dataclass
class Same(Mapper):
    """Output is the input with the same flat order (renames, reshapes such as `Conv3dToLinear`)."""

    src: Sym

    def backward(self, start, length):
        return [Run(self.src, start, length)]


@dataclass
class Piece:
    """`count` slices along the concat dim, starting at `offset`, of `src` whose size along that dim is `src_dim`."""

    src: Sym
    offset: int
    count: int
    src_dim: int


@dataclass
class Concat(Mapper):
    """Output = concatenation along `dim` of pieces (covers stack, cat, chunk, split, slices)."""

    dim: int
    out_shape: tuple[int, ...]
    pieces: list[Piece]
    _cum: list[int] = field(init=False)
    _post: int = field(init=False)  # elements after one index of `dim`

    def __post_init__(self):
        self._cum = [0]
        for p in self.pieces:
            self._cum.append(self._cum[-1] + p.count)
        if self._cum[-1] != self.out_shape[self.dim]:
            raise AssertionError(f"pieces cover {self._cum[-1]} of {self.out_shape[self.dim]} along dim {self.dim}")
        self._post = math.prod(self.out_shape[self.dim + 1 :])

    def backward(self, start, length):
        post = self._post
        dim_size = self.out_shape[self.dim]
        runs, pos, end = [], start, start + length
        while pos < end:
            outer, rem = divmod(pos, dim_size * post)
            j = rem // post
            k = bisect.bisect_right(self._cum, j) - 1
            piece = self.pieces[k]
            segment_end = outer * dim_size * post + self._cum[k + 1] * post
            take = min(end, segment_end) - pos
            src_start = outer * piece.src_dim * post + (piece.offset + j - self._cum[k]) * post + (rem - j * post)
            runs.append(Run(piece.src, src_start, take))
            pos += take
        return runs


@dataclass
class Permute(Mapper):
    """Output index `j` along `dim` is input index `perm(j)` along `dim` (interleave, RoPE permutation)."""

    dim: int
    shape: tuple[int, ...]
    src: Sym
    perm: Callable[[int], int]

    def backward(self, start, length):
        post = math.prod(self.shape[self.dim + 1 :])
        dim_size = self.shape[self.dim]
        runs, pos, end = [], start, start + length
        while pos < end:
            outer, rem = divmod(pos, dim_size * post)
            j, inner = divmod(rem, post)
            take = min(end - pos, post - inner)
            runs.append(Run(self.src, outer * dim_size * post + self.perm(j) * post + inner, take))
            pos += take
        return runs


@dataclass
class Transpose(Mapper):
    """Output = input with dims `d0 < d1` swapped."""

    d0: int
    d1: int
    out_shape: tuple[int, ...]
    src: Sym

    def backward(self, start, length):
        in_shape = list(self.out_shape)
        in_shape[self.d0], in_shape[self.d1] = in_shape[self.d1], in_shape[self.d0]
        in_shape = tuple(in_shape)
        last = len(self.out_shape) - 1
        # Elements stay contiguous along the dims after d1; if d1 is the last dim, a run along the output's
        # last dim walks the input's dim d0, i.e. a strided run.
        block = math.prod(self.out_shape[self.d1 + 1 :]) if self.d1 < last else self.out_shape[last]
        stride = 1 if self.d1 < last else _strides(in_shape)[self.d0]
        runs, pos, end = [], start, start + length
        while pos < end:
            take = min(end - pos, block - pos % block)
            coords = _unravel(pos, self.out_shape)
            coords[self.d0], coords[self.d1] = coords[self.d1], coords[self.d0]
            runs.append(Run(self.src, _ravel(coords, in_shape), take, stride))
            pos += take
        return runs


def slice_along(src: Sym, dim: int, start: int, count: int) -> Sym:
    """`src[..., start:start+count, ...]` along `dim` (chunk, split, an expert-parallel slice)."""
    dim = dim % len(src.shape)
    shape = list(src.shape)
    shape[dim] = count
    return Sym(tuple(shape), mapper=Concat(dim, tuple(shape), [Piece(src, start, count, src.shape[dim])]))


def stack_along(syms: list[Sym], dim: int) -> Sym:
    """`torch.stack(syms, dim)` of equal shapes (merged per-expert tensors)."""
    dim = dim % (len(syms[0].shape) + 1)
    shape = list(syms[0].shape)
    shape.insert(dim, len(syms))
    return Sym(tuple(shape), mapper=Concat(dim, tuple(shape), [Piece(s, 0, 1, 1) for s in syms]))


def to_leaf_runs(sym: Sym, start: int, length: int) -> list[Run]:
    """Resolve `length` output elements from `start` of `sym` to runs of checkpoint tensors, in output order."""
    if length <= 0:
        return []
    if sym.mapper is None:
        return [Run(sym, start, length)]
    out: list[Run] = []
    for run in sym.mapper.backward(start, length):
        if run.stride != 1:
            if run.sym.mapper is not None:
                raise UnsupportedConversionError(
                    "a transpose of the last dimension followed by further conversion ops cannot be sliced"
                )
            out.append(run)
        else:
            out.extend(to_leaf_runs(run.sym, run.start, run.length))
    return out


def materialize(sym: Sym, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
    """Build a whole tensor from leaves through the mappers (used by tests to check mappers against transformers)."""
    flat = torch.empty(sym.numel, dtype=next(iter(leaves.values())).dtype)
    pos = 0
    for run in to_leaf_runs(sym, 0, sym.numel):
        src = leaves[run.sym.key].reshape(-1)
        flat[pos : pos + run.length] = src[run.start : run.start + (run.length - 1) * run.stride + 1 : run.stride]
        pos += run.length
    return flat.view(sym.shape)
