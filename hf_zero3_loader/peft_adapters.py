"""Saving a PEFT adapter (LoRA, ...) trained over a ZeRO-3 model: gather only what the adapter holds.

Under ZeRO-3 a PEFT model's own `save_pretrained` writes each partitioned adapter tensor as this rank's empty slice
(PEFT warns, and the adapter is lost). `Trainer.save_model` of a PEFT model takes DeepSpeed's
`_zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)` instead, which gathers every parameter of the
model, one module at a time (the whole frozen base through collectives, to keep a few MB of adapter), keeps only
trainable ones (so PEFT writes a second, inactive adapter with the active one's tensors), and refuses any model with
AutoEP layers (so a LoRA run under expert parallelism trains, then fails at its save).

Here PEFT's own selection (`get_peft_model_state_dict`, run on the model's unmaterialised tensors) says which
parameters an adapter save writes; only those are gathered, and PEFT writes its files from them as usual.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager

import torch

from .errors import ConfigError
from .expert_parallel import loaded_layout, parameters_in_loaded_experts


def partitioned_peft_model(model: torch.nn.Module):
    """`model` if it is a PEFT model whose base is partitioned by ZeRO-3, else None."""
    from .saving import is_partitioned

    peft = sys.modules.get("peft")  # never imported here: a script without PEFT has no PEFT model
    if peft is None or not isinstance(model, peft.PeftModel):
        return None
    return model if is_partitioned(model.get_base_model()) else None


def adapter_names(model, adapters=None, save_embedding_layers="auto") -> list[str]:
    """The model's tensor names that PEFT's save of `adapters` (default: all) writes, in PEFT's own selection."""
    from peft.utils import get_peft_model_state_dict

    tensors = model.state_dict(keep_vars=True)  # the parameters themselves: PEFT selects them by name, unread
    chosen: set[int] = set()
    for adapter in adapters or list(model.peft_config):
        selected = get_peft_model_state_dict(model, state_dict=tensors, adapter_name=adapter,
                                             save_embedding_layers=save_embedding_layers)
        chosen.update(id(t) for t in selected.values())
    return [name for name, t in tensors.items() if id(t) in chosen]


def adapter_state_dict(model, adapters=None, save_embedding_layers="auto", *,
                       on_every_rank: bool = False) -> dict[str, torch.Tensor] | None:
    """The adapter's tensors, gathered (each module's together), under the model's names, for PEFT's
    `save_pretrained(state_dict=...)`: on rank 0, or on every rank; None elsewhere. Every rank calls it; the ranks
    agree first, so one that calls it alone fails (after the join timeout) instead of hanging in a gather. Adapter
    tensors inside the experts of an expert-parallel layer (each rank holds its own experts, under AutoEP's names;
    `deepspeed.initialize` refuses to train them too) are refused on every rank."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import is_moe_param

    from .agreement import Agreement, digest

    agreement = Agreement()
    try:
        error = None
        try:
            names = set(adapter_names(model, adapters, save_embedding_layers))
            # LoRA on the loader's experts, or PEFT's whole copy of such a layer; or experts of DeepSpeed's own layers
            in_experts = {id(p) for _, p in parameters_in_loaded_experts(model)}
            experts = [name for name, p in model.named_parameters(remove_duplicate=False)
                       if name in names and (is_moe_param(p) or id(p) in in_experts)]
            if experts:
                error = ConfigError(
                    f"{len(experts)} adapter tensors are experts under expert parallelism ({experts[0]}, ...): saving "
                    "them as an adapter is not supported (each rank holds its own experts, under DeepSpeed AutoEP's "
                    "names); put the adapter on other modules (attention, shared experts)")
        except Exception as e:  # agreed on below: every rank raises it, none waits in the gather
            error = e
        # the tensors each rank gathers, module by module: unlike lists (another `selected_adapters` on one rank)
        # would pair one rank's gather with another's
        same = None if error else {"the adapter tensors to gather": digest(sorted(names))}
        agreement.check("save the PEFT adapter", error, same=same, differs="are not saving the same adapter",
                        error_type=ConfigError)
        keep = on_every_rank or dist.get_rank() == 0
        state: dict[str, torch.Tensor] = {}
        with agreement.collective_section("gather the PEFT adapter"):
            for prefix, module in model.named_modules(remove_duplicate=False):
                prefix = f"{prefix}." if prefix else ""
                params = [(prefix + n, p) for n, p in module.named_parameters(recurse=False) if prefix + n in names]
                buffers = [(prefix + n, b) for n, b in module.named_buffers(recurse=False) if prefix + n in names]
                if params:
                    with deepspeed.zero.GatheredParameters([p for _, p in params]):
                        state.update((n, p.detach().cpu().clone()) for n, p in params if keep)
                state.update((n, b.detach().cpu()) for n, b in buffers if keep)
    finally:
        agreement.close()
    return state if keep else None


@contextmanager
def written_under_transformers_names(model):
    """PEFT's save of an adapter over an expert-parallel load: a LoRA on a module that an AutoEP layer holds under
    another name than transformers' (its router's `gate` is transformers' `mlp.gate`) is written under transformers'
    name, as the model's own save writes its weights. PEFT then loads the adapter onto the model without expert
    parallelism; under AutoEP's names it would leave that LoRA out, with only a warning. (Onto an expert-parallel
    load it loads through the key mapping the load leaves: `let_peft_load_adapters_in_transformers_names`.) PEFT
    0.21 selects the adapter's tensors by its own module names, so the names change on the way to its files: in
    `peft.peft_model.get_peft_model_state_dict`, for the duration of the save."""
    layout = loaded_layout(model)
    renamed = layout.renamed_modules() if layout is not None else {}
    if not renamed:
        yield
        return
    import peft.peft_model as peft_model

    prefix = "base_model.model."
    owners = sorted(renamed, key=len, reverse=True)  # the innermost first

    def in_transformers_names(key: str) -> str:
        inner = key[len(prefix):] if key.startswith(prefix) else key
        owner = next((m for m in owners if inner.startswith(m + ".")), None)
        return key if owner is None else key[:len(key) - len(inner)] + renamed[owner] + inner[len(owner):]

    original = peft_model.get_peft_model_state_dict

    @functools.wraps(original)
    def get_peft_model_state_dict(*args, **kwargs):
        return {in_transformers_names(k): v for k, v in original(*args, **kwargs).items()}

    peft_model.get_peft_model_state_dict = get_peft_model_state_dict
    try:
        yield
    finally:
        peft_model.get_peft_model_state_dict = original
