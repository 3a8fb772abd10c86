"""Initialise missing weights in chunks bounded by a byte budget, with the plain load's exact values.

transformers initialises missing keys by walking modules in `smart_apply` order and calling the owning
model's `_initialize_weights` on each; under ZeRO-3 it gathers *every* uninitialised parameter at once.
We walk the same modules in the same order (so rank 0 consumes its RNG stream exactly as a plain
single-process load does) but gather only the uninitialised parameters of consecutive modules up to
`budget_bytes` at a time; `GatheredParameters(modifier_rank=0)` then broadcasts rank 0's values and
re-partitions. At no moment is more than max(budget, largest missing parameter) gathered.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from . import _transformers_private as hf_private

DEFAULT_BUDGET_BYTES = 1 << 30


@dataclass
class InitStats:
    gathers: list[int] = field(default_factory=list)  # bytes gathered by each GatheredParameters

    @property
    def peak_gathered_bytes(self) -> int:
        return max(self.gathers, default=0)


def _needs_gather(param) -> bool:
    return hasattr(param, "ds_id") and not getattr(param, "_is_hf_initialized", False)


def _nbytes(param) -> int:
    return param.ds_numel * param.dtype.itemsize


def materialize_meta_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers not loaded (non-persistent ones such as RoPE `inv_freq`) get real storage; init computes them."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty_like(buf, device=device)


def initialize_missing(model, budget_bytes: int = DEFAULT_BUDGET_BYTES, stats: InitStats | None = None) -> InitStats:
    import deepspeed

    stats = stats or InitStats()
    is_custom_code = model.is_custom_code()
    chunks: list[tuple[list, list]] = []  # (modules with their owner, params to gather)
    modules, params, size, seen = [], [], 0, set()
    for module, owner in hf_private.init_module_order(model):
        if getattr(module, "_is_hf_initialized", False):
            continue
        needed = [p for p in module.parameters(recurse=False) if _needs_gather(p) and id(p) not in seen]
        needed_bytes = sum(_nbytes(p) for p in needed)
        if params and size + needed_bytes > budget_bytes:
            chunks.append((modules, params))
            modules, params, size = [], [], 0
        modules.append((module, owner))
        params.extend(needed)
        seen.update(id(p) for p in needed)
        size += needed_bytes
    if modules:
        chunks.append((modules, params))

    with torch.no_grad(), hf_private.guarded_init_functions():
        for chunk_modules, chunk_params in chunks:
            gather = deepspeed.zero.GatheredParameters(chunk_params, modifier_rank=0) if chunk_params else nullcontext()
            if chunk_params:
                stats.gathers.append(sum(_nbytes(p) for p in chunk_params))
            with gather:
                for module, owner in chunk_modules:
                    owner._initialize_weights(module, is_custom_code)
    return stats
