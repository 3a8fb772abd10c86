"""Saving a PEFT adapter (LoRA, ...) trained over a ZeRO-3 model: gather only what the adapter holds.

`Trainer.save_model` of a PEFT model under ZeRO-3 takes DeepSpeed's `_zero3_consolidated_16bit_state_dict(
exclude_frozen_parameters=True)` and lets PEFT keep the adapter's keys. DeepSpeed gathers every parameter of the model
for it, one module at a time (the whole frozen base through collectives, to keep a few MB of adapter), and refuses
any model with AutoEP layers (so a LoRA run under expert parallelism trains, then fails at its save). Only the
trainable parameters are gathered here; the state dict is the one DeepSpeed's gives, and the files are PEFT's.
"""

from __future__ import annotations

import sys

import torch

from .errors import ConfigError


def partitioned_peft_model(model: torch.nn.Module):
    """`model` if it is a PEFT model whose base is partitioned by ZeRO-3, else None."""
    from .saving import is_partitioned

    peft = sys.modules.get("peft")  # never imported here: a script without PEFT has no PEFT model
    if peft is None or not isinstance(model, peft.PeftModel):
        return None
    return model if is_partitioned(model.get_base_model()) else None


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """What `_zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)` gives (every trainable parameter
    gathered, each module's together; the persistent buffers; a tied parameter under each of its names), on rank 0;
    None on the other ranks. Every rank calls it. A trainable parameter that is an expert's under expert parallelism
    (its partitions span its expert-data-parallel group only, and its name is AutoEP's, not the checkpoint's) is
    refused on every rank."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import is_moe_param

    experts = [name for name, p in model.named_parameters() if p.requires_grad and is_moe_param(p)]
    if experts:
        raise ConfigError(
            f"{len(experts)} trainable parameters are experts under expert parallelism ({experts[0]}, ...): saving "
            "them as an adapter is not supported (each rank holds its own experts, named as DeepSpeed's AutoEP layer "
            "names them); train the adapter on other modules, or keep these in DeepSpeed's own checkpoint "
            "(engine.save_checkpoint)")
    on_rank0 = dist.get_rank() == 0
    state: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}  # a tied parameter, gathered once
    for prefix, module in model.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not params and not on_rank0:
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in params if id(p) not in seen]):
            for name, p in params:
                if id(p) not in seen:
                    seen[id(p)] = p.detach().cpu().clone() if on_rank0 else p
                if on_rank0:
                    state[prefix + name] = seen[id(p)]
        if on_rank0:
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    state[prefix + name] = buffer.detach().cpu()
    return state if on_rank0 else None
