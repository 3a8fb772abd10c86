"""ZeRO-3 leaf modules for the experts of MoE blocks, whose forward depends on the routing.

ZeRO-3 gathers a module's parameters when its forward runs, and checks that every rank ran the same modules in the
same order (the trace it prefetches by). An experts module runs a data-dependent part of itself:
- where each expert is its own module (Switch Transformers and NLLB-MoE keep them in a `ModuleDict` in transformers
  5.24), a rank whose tokens skip an expert never gathers it while the others do: their all-gathers no longer pair
  up, and training stops with a collective mismatch (gloo) or hangs (NCCL);
- fused experts (one parameter per projection, every causal-LM MoE type) gather the same parameters on every rank,
  but their eager forward calls a submodule once per expert that received tokens (`act_fn`; DBRX runs its `mlp`,
  Muse Spark a norm), so two ranks' traces differ in length and DeepSpeed stops training with "Detected a disagreement
  on list length between rank0 and rank1" (or hangs where only one rank re-records its trace);
- a block that sends tokens to one of several MoE blocks by modality (Ernie 4.5 VL MoE's `text_moe` and
  `vision_moe`) skips the vision one on a rank whose batch holds no image tokens (a text-only batch beside the usual
  ZeRO-3 dummy vision pass): that rank never gathers its gate and experts while the others do.
DeepSpeed's answer is a leaf module (`deepspeed.utils.set_z3_leaf_modules`, accelerate's
`deepspeed_moe_layer_cls_names`, DeepSpeed's own default list of three MoE blocks): a module whose forward always
runs, that gathers all its parameters at once and whose submodules are not traced. The loader marks every experts
module, so a model it loads trains without that step. Shared experts run for every token and need nothing, and
neither do DeepSpeed's AutoEP layers (expert parallelism).
"""

from __future__ import annotations

import inspect

import torch

from . import log


def experts_to_mark(model: torch.nn.Module) -> list[str]:
    """Names of the modules to mark, outermost first (nothing inside a marked module):
    - each list or dict of expert modules that runs them itself (its own `forward`, as transformers' do), else the
      block that holds it and loops over them (`...mlp` holding `...mlp.experts`). The container, where it can be:
      DeepSpeed's leaf hooks reject a block whose output is a view of its input (Switch Transformers' reshapes),
      which is then modified in place;
    - experts modules whose submodules hold no parameters (fused experts and their `act_fn`): marking them changes
      nothing else, as their parameters are gathered in their own forward either way;
    - experts modules with submodules that hold parameters (DBRX's per-expert `mlp`, Muse Spark's norm after each
      expert) where the parent's forward calls them: a leaf module whose forward never runs would never be gathered
      (JetMoE's attention experts are run through other methods, and their submodules through their own forwards);
    - in place of those, a module holding two or more MoE blocks with experts (Ernie 4.5 VL MoE's text and vision
      ones) where its parent's forward calls it: its forward may run only some of them."""
    names: list[str] = []
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        if "expert" not in leaf or "shared" in leaf or type(module).__module__.startswith("deepspeed."):
            continue
        if any(name.startswith(marked + ".") for marked in names):
            continue
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            runs_them = type(module).forward is not torch.nn.Module.forward
            names.append(name if runs_them or not parent else parent)
        elif next(module.children(), None) is None:
            continue
        elif all(next(child.parameters(), None) is None for child in module.children()):
            names.append(name)
        elif parent and _forward_calls(model.get_submodule(parent), leaf):
            names.append(name)
    return _routers_in_place_of_their_experts(model, names)


def _routers_in_place_of_their_experts(model: torch.nn.Module, names: list[str]) -> list[str]:
    """`names` with the experts of two or more sibling MoE blocks (`<router>.<block>.experts`) replaced by their
    `<router>`, where the router's parent's forward calls it."""
    blocks_of: dict[str, set[str]] = {}
    for name in names:
        block = name.rpartition(".")[0]
        if "." in block:
            blocks_of.setdefault(block.rpartition(".")[0], set()).add(block)
    routers = []
    for router, blocks in blocks_of.items():
        parent, _, leaf = router.rpartition(".")
        if len(blocks) > 1 and parent and _forward_calls(model.get_submodule(parent), leaf):
            routers.append(router)
    kept: list[str] = []
    for name in names:
        name = next((r for r in routers if name.startswith(r + ".")), name)
        if name not in kept:
            kept.append(name)
    return kept


def _forward_calls(module: torch.nn.Module, attribute: str) -> bool:
    """Whether `module`'s forward calls `self.<attribute>(...)` (read from its source; False where there is none)."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return f"self.{attribute}(" in source


def mark_experts_as_leaf_modules(model: torch.nn.Module) -> list[str]:
    """Mark those modules as ZeRO-3 leaf modules (before `deepspeed.initialize`, which registers the gather hooks)."""
    from deepspeed.utils import set_z3_leaf_modules_by_name

    names = experts_to_mark(model)
    if names:
        set_z3_leaf_modules_by_name(model, names)
        kinds = sorted({type(model.get_submodule(name)).__name__ for name in names})
        log.info_once("leaf-modules", "marked %d experts modules (%s) as ZeRO-3 leaf modules: what they run depends "
                      "on the routing, so ranks would otherwise trace and gather different modules", len(names),
                      ", ".join(kinds))
    return names
