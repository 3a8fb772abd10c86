"""ZeRO-3 leaf modules for MoE blocks whose experts are separate modules run only for the tokens routed to them.

ZeRO-3 gathers a module's parameters when its forward runs. Where each expert is its own module (Switch Transformers
and NLLB-MoE keep them in a `ModuleDict` in transformers 5.24), a rank whose tokens skip an expert never gathers it
while the others do: their all-gathers no longer pair up, and training stops with a collective mismatch (gloo) or
hangs (NCCL). DeepSpeed's answer is a leaf module (`deepspeed.utils.set_z3_leaf_modules`, accelerate's
`deepspeed_moe_layer_cls_names`): a module whose forward always runs and that gathers all its parameters at once. The
loader marks the experts containers, so a model it loads trains without that step. Fused experts (every causal-LM MoE
type, and the AutoEP layers of expert parallelism) are one parameter per projection and need nothing.
"""

from __future__ import annotations

import torch

from . import log


def experts_to_mark(model: torch.nn.Module) -> list[str]:
    """Names of the modules to mark: each list or dict of expert modules that runs them itself (its own `forward`,
    as transformers' do), else the block that holds it and loops over them (`...mlp` holding `...mlp.experts`).
    The container, where it can be: DeepSpeed's leaf hooks reject a block whose output is a view of its input
    (Switch Transformers' reshapes), which is then modified in place."""
    names = []
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        if "expert" in leaf and isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            runs_them = type(module).forward is not torch.nn.Module.forward
            names.append(name if runs_them or not parent else parent)
    return names


def mark_experts_as_leaf_modules(model: torch.nn.Module) -> list[str]:
    """Mark those modules as ZeRO-3 leaf modules (before `deepspeed.initialize`, which registers the gather hooks)."""
    from deepspeed.utils import set_z3_leaf_modules_by_name

    names = experts_to_mark(model)
    if names:
        set_z3_leaf_modules_by_name(model, names)
        kinds = sorted({type(model.get_submodule(name)).__name__ for name in names})
        log.info_once("leaf-modules", "marked %d experts modules (%s) as ZeRO-3 leaf modules: each expert runs only "
                      "for the tokens routed to it, so ranks would otherwise gather different experts", len(names),
                      ", ".join(kinds))
    return names
