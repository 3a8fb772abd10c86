"""Initialise missing weights in chunks bounded by a byte budget, with the plain load's exact values.

transformers initialises missing keys by walking modules in `smart_apply` order and calling the owning
model's `_initialize_weights` on each; under ZeRO-3 it gathers *every* uninitialised parameter at once.
We walk the same modules in the same order (so rank 0 consumes its RNG stream exactly as a plain
single-process load does) but gather only the uninitialised parameters of consecutive modules up to
`budget_bytes` at a time; `GatheredParameters(modifier_rank=0)` then broadcasts rank 0's values and
re-partitions. At no moment is more than max(budget, largest missing parameter) gathered.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
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


def _init_order(module, owner, params: list) -> list | None:
    """The order in which `owner._init_weights(module)` initialises `params`; None if it cannot be learned.

    A dry run with recording stand-ins for the init functions, under a forked RNG: nothing is written or drawn.
    """
    recorded: list = []
    wanted = {id(p): p for p in params}
    try:
        with torch.random.fork_rng(devices=[]), hf_private.recording_init_functions(recorded.append):
            owner._init_weights(module)
    except Exception:
        return None
    order, seen = [], set()
    for t in recorded:
        if id(t) in wanted and id(t) not in seen:
            order.append(wanted[id(t)])
            seen.add(id(t))
    return order + [p for p in params if id(p) not in seen]


def _plan_chunks(model, budget_bytes: int):
    """Steps of (modules with owner, params to gather, param to init alone or None), in `smart_apply` order."""
    steps, modules, params, size, seen = [], [], [], 0, set()

    def flush():
        nonlocal modules, params, size
        if modules:
            steps.append((modules, params, None))
        modules, params, size = [], [], 0

    for module, owner in hf_private.init_module_order(model):
        if getattr(module, "_is_hf_initialized", False):
            continue
        needed = [p for p in module.parameters(recurse=False) if _needs_gather(p) and id(p) not in seen]
        seen.update(id(p) for p in needed)
        needed_bytes = sum(_nbytes(p) for p in needed)
        if needed_bytes > budget_bytes and len(needed) > 1:
            order = _init_order(module, owner, needed)
            if order is not None:  # one parameter at a time, in the order the module initialises them
                flush()
                for p in order:
                    steps.append(([(module, owner)], [p], p))
                module._is_hf_initialized = True
                continue
        if params and size + needed_bytes > budget_bytes:
            flush()
        modules.append((module, owner))
        params.extend(needed)
        size += needed_bytes
    flush()
    return steps


@contextmanager
def logical_shapes(modules):
    """While `_init_weights` runs on these modules, their partitioned (not gathered) params show their logical shape:
    an init that reads `weight.shape` before its guarded write (RoFormer's sinusoidal positions, RWKV) sees what a
    plain load shows. The stand-in is one element expanded, so a write into it fails loudly, never silently."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    swapped = []
    for module, _ in modules:
        for p in module.parameters(recurse=False):
            if hasattr(p, "ds_shape") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                swapped.append((p, p.data))
                p.data = torch.empty(1, dtype=p.dtype, device=p.data.device).expand(p.ds_shape)
    try:
        yield
    finally:
        for p, data in swapped:
            p.data = data


def initialize_missing(model, budget_bytes: int = DEFAULT_BUDGET_BYTES, stats: InitStats | None = None) -> InitStats:
    import deepspeed

    stats = stats or InitStats()
    is_custom_code = model.is_custom_code()
    with torch.no_grad(), hf_private.guarded_init_functions():
        for modules, params, alone in _plan_chunks(model, budget_bytes):
            gather = deepspeed.zero.GatheredParameters(params, modifier_rank=0) if params else nullcontext()
            if params:
                stats.gathers.append(sum(_nbytes(p) for p in params))
            with gather, logical_shapes(modules):
                if alone is not None:  # the module's other missing params are skipped by the guarded init
                    module, owner = modules[0]
                    others = [p for p in module.parameters(recurse=False) if p is not alone and _needs_gather(p)]
                    for p in others:
                        p._is_hf_initialized = True
                    try:
                        owner._init_weights(module)
                    finally:
                        for p in others:
                            del p._is_hf_initialized
                    continue
                for module, owner in modules:
                    owner._initialize_weights(module, is_custom_code)
    return stats
