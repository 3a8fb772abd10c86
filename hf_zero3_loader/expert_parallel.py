"""Expert parallelism with ZeRO-3: load straight into DeepSpeed AutoEP's layout, each rank reading its local experts.

Under expert parallelism (EP) each rank owns `num_experts / ep_size` experts of every MoE layer; ZeRO-3 partitions
those over the rank's expert-data-parallel (EDP) group, every other parameter over the world (the routers AutoEP
builds over DeepSpeed's data-parallel group: the same ranks, as the engine places them). DeepSpeed's AutoEP
builds that layout at `deepspeed.initialize`, after transformers has built (and broadcast) every expert tensor whole,
by gathering each layer's fused experts on every rank. Here it is built on the meta skeleton instead:

1. `request_from(...)`: the ways users ask for EP (the DeepSpeed config's `expert_parallel` section, `ep_size=`,
   transformers' `distributed_config=`) become one `ExpertParallelRequest`; `create_groups` makes the EP / EDP
   groups, and DeepSpeed's data-parallel group, the way the engine does, on every rank, before anything else runs.
2. `ExpertParallelLayout.convert(...)`: AutoEP's own detection and replacement run on the meta skeleton, after the
   planner resolved the checkpoint against transformers' module names. Each new tensor is mapped back to what it is
   a box of: `experts.w1` = `gate_up_proj[local experts, :ffn]`, `experts.w3` = `gate_up_proj[local experts, ffn:]`,
   `experts.w2` = `down_proj[local experts]`, the router = transformers' gate (one module per expert, as the hub's
   DeepSeek-V3 code keeps them: `experts.w1` = the local experts' `gate_proj.weight` stacked, ...). The planner then
   reads, for each rank, only its partition of those boxes: no fused expert tensor is ever whole anywhere.
3. `deepspeed.initialize` with the user's unchanged config works: the engine keeps our groups and layers
   (`_deepspeed_private.let_engine_accept_replaced_layers`); `check_at_initialize` first refuses what would then
   train silently wrong (a section asking for other EP math than the load's, parameters added inside the experts).
A model with no experts under an enabled section (a dense reward model beside a MoE run) loads as plain ZeRO-3.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields

import torch

from . import _deepspeed_private as ds_private
from . import _transformers_private as hf_private
from . import log
from .deepspeed_setup import accelerate_deepspeed_plugins
from .errors import ConfigError, LoaderError, UnsupportedConversionError
from .planner.plan import LoadPlan, PartitionGroup, SourceBox


ACCELERATE_MOE_LEAF_ENV = "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"  # accelerate's deepspeed_moe_layer_cls_names


@dataclass(frozen=True)
class ExpertParallelRequest:
    ep_size: int
    autoep_section: dict  # the `expert_parallel` section AutoEP is configured with
    asked_via: str
    by_config_only: bool = False  # only the DeepSpeed config's section asked (what the engine reads too)
    engine_refuses: tuple[str, ...] = ()  # settings deepspeed.initialize refuses for AutoEP layers under ZeRO-3


def _what_the_engine_refuses(ds_config: dict) -> tuple[str, ...]:
    """The settings of this config that DeepSpeed 0.19.8's engine refuses for AutoEP layers under ZeRO-3
    (`DeepSpeedEngine._validate_zero3_moe_compatibility`, at `deepspeed.initialize`): found before the load, not
    after it."""
    zero = ds_config.get("zero_optimization") or {}
    found = []
    for where, value, supported in (
            ("zero_optimization.zero_quantized_gradients", zero.get("zero_quantized_gradients"), False),
            ("zero_optimization.zero_hpz_partition_size", zero.get("zero_hpz_partition_size"), 1),
            ("expert_parallel.expert_tensor_parallel_size",
             (ds_config.get("expert_parallel") or {}).get("expert_tensor_parallel_size"), 1)):
        if value is not None and value != supported:
            found.append(f"{where}={value!r}")
    return tuple(found)


def _ep_size_from_distributed_config(distributed_config, world_size: int) -> int | None:
    """transformers' `DistributedConfig` (or its dict): `ep_size`, or the world for the legacy
    `enable_expert_parallel=True` that transformers 5.23 resolves to `ep_size=tp_size=1, tp_plan={}`."""
    get = distributed_config.get if isinstance(distributed_config, dict) else (
        lambda key, default=None: getattr(distributed_config, key, default))
    tp_size, tp_plan = get("tp_size") or 1, get("tp_plan")
    ep_size = get("ep_size")
    if ep_size and ep_size > 1:
        return ep_size
    if get("enable_expert_parallel") or (tp_plan == {} and (ep_size or 1) == 1 and tp_size == 1):
        return world_size
    return None


def refuse_other_parallelism(distributed_config, tp_plan, tp_size, world_size: int) -> None:
    """transformers' tensor and pipeline parallelism build their own device mesh and shard the model themselves.
    Under ZeRO-3 transformers refuses them (through its `device_map` check); a load that went on would leave their
    sharding plan on ZeRO-3 partitions, or ignore what was asked. Read as transformers reads them: a plan without a
    size means the world. (In a `DistributedConfig`, tp_size and fsdp_size without a plan size expert parallelism's
    mesh: not refused.)"""
    if distributed_config is not None and (tp_plan is not None or tp_size is not None):
        raise ConfigError("pass either `distributed_config` or the standalone `tp_plan`/`tp_size` arguments, not both "
                          "(as transformers requires)")
    asked = []
    if distributed_config is None:  # the standalone (deprecated) arguments
        tp_size = world_size if tp_size is None and tp_plan else (tp_size or 1)
        asked += [f"tp_size={tp_size}"] if tp_size > 1 else []
    else:
        get = distributed_config.get if isinstance(distributed_config, dict) else (
            lambda key, default=None: getattr(distributed_config, key, default))
        tp_size = get("tp_size") or (world_size if get("tp_plan") else 1)
        asked += [f"tp_size={tp_size}"] if tp_size > 1 and get("tp_plan") else []
        asked += [f"pp_size={get('pp_size')}"] if (get("pp_size") or 1) > 1 else []
    if asked:
        raise ConfigError(f"transformers' own parallelism ({', '.join(asked)}) cannot be combined with DeepSpeed "
                          "ZeRO-3, which partitions the model itself (transformers refuses it too); load with ZeRO-3 "
                          "alone, and give MoE models expert parallelism with ep_size=")


CONFIG_ASK = "expert_parallel.autoep_size="


def _asked(ds_config: dict, ep_size: int | None, distributed_config, world_size: int) -> list[tuple[str, object]]:
    """(how, size) for each way EP was asked for."""
    section = ds_config.get("expert_parallel") or {}
    asked: list[tuple[str, object]] = []
    if section.get("enabled"):
        asked.append((CONFIG_ASK, section.get("autoep_size", 1)))
    if ep_size is not None:
        asked.append(("ep_size=", ep_size))
    if distributed_config is not None:
        size = _ep_size_from_distributed_config(distributed_config, world_size)
        if size is not None:
            asked.append(("distributed_config ep_size=", size))
    return asked


def is_requested(ds_config: dict, ep_size: int | None, distributed_config) -> bool:
    return bool(_asked(ds_config, ep_size, distributed_config, 1))


def request_from(ds_config: dict, ep_size: int | None, distributed_config, world_size: int) -> ExpertParallelRequest | None:
    """Merge the ways of asking for EP; they must agree. None when EP is not asked for."""
    asked = _asked(ds_config, ep_size, distributed_config, world_size)
    if not asked:
        return None
    for via, size in asked:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world_size % size:
            raise ConfigError(f"{via}{size!r} does not divide the world size {world_size}: expert parallelism needs "
                              "a positive divisor of the world size")
    if len({size for _, size in asked}) > 1:
        raise ConfigError("conflicting expert parallel sizes: " + ", ".join(f"{via}{size}" for via, size in asked))
    size = asked[0][1]
    section = {**(ds_config.get("expert_parallel") or {}), "enabled": True, "autoep_size": size}
    return ExpertParallelRequest(size, section, ", ".join(via.rstrip("=") for via, _ in asked),
                                 by_config_only=[via for via, _ in asked] == [CONFIG_ASK],
                                 engine_refuses=_what_the_engine_refuses(ds_config))


@dataclass
class ExpertParallelGroups:
    ep_size: int
    ep_rank: int
    edp_group: object  # torch.distributed ProcessGroup the experts are partitioned over
    edp_name: str  # the PartitionGroup name of expert parameters
    # the ProcessGroup (the world's ranks) of the other parameters AutoEP builds: the routers
    built_group: object = None
    built_name: str = "autoep_built"


def create_groups(request: ExpertParallelRequest, ds_config: dict) -> ExpertParallelGroups:
    """The EP and EDP groups, created as `deepspeed.initialize` creates them (it then reuses them). A collective
    over the world: every rank calls it, before the load."""
    import torch.distributed as dist

    data_before_expert = ds_private.use_data_before_expert_parallel(ds_config)
    ep_group, edp_group, name = ds_private.expert_parallel_groups(request.ep_size, data_before_expert)
    return ExpertParallelGroups(request.ep_size, dist.get_rank(group=ep_group), edp_group,
                                f"expert_data_parallel/{name}", built_group=ds_private.engine_replicated_group())


def supported_model_types() -> dict[str, str]:
    """transformers model type -> the AutoEP preset that trains it."""
    return {t: preset for preset, types in ds_private.autoep_presets().items() for t in types}


def structure_named(section: dict) -> bool:
    """Whether DeepSpeed's `expert_parallel` config section names the MoE structure itself: a preset
    (`preset_model`) or custom patterns (`moe_layer_pattern`, ...). DeepSpeed's engine-side AutoEP then takes model
    types it has no preset for, its detection checking the structure. Without either it tries every preset on such
    a model: ambiguous (refused), or no layer found and no EP at all, so this loader refuses those types."""
    return bool(section.get("preset_model") or section.get("moe_layer_pattern"))


def loaded_layout(model: torch.nn.Module) -> "ExpertParallelLayout | None":
    """The expert-parallel layout this loader built `model` with (under PEFT's wrapper too), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(getattr(base, "hf_zero3_load_report", None), "expert_parallel_layout", None)


def parameters_in_loaded_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Every parameter inside the experts of the AutoEP layers this loader built (wrappers and copies PEFT made of
    them included: a copied layer keeps the loader's mark), under its name in `model`."""
    return [(f"{name}.experts.{p_name}" if name else f"experts.{p_name}", p)
            for name, layer in model.named_modules() if getattr(layer, ds_private.BUILT_BY_LOADER, False)
            for p_name, p in layer.experts.named_parameters()]


# the `expert_parallel` section a loader-built layer was built with (a dict: PEFT's copies of a layer copy it equal)
BUILT_WITH = "_hf_zero3_loader_autoep_section"

# AutoEP settings that pick kernels or transport, not what a layer computes; the others decide the math
KERNEL_SETTINGS = frozenset({"use_grouped_mm", "disable_triton_grouped_mm", "combine_impl", "row_weighting_impl",
                             "gate_up_impl", "comm_backend", "comm_num_sm", "comm_qp_margin",
                             "comm_max_tokens_per_rank", "async_split_plan", "validate_folding_routing"})
# checked on their own (the size), or applied to the unwrapped model's names (`_section_for_unwrapped_model`)
NOT_COMPARED = frozenset({"enabled", "autoep_size", "moe_layer_pattern", "_load_balance_coeff_explicit"})


def without_experts(model: torch.nn.Module, request: ExpertParallelRequest) -> bool:
    """A model with no experts at all (no module named `...experts`: every transformers MoE type names them so)
    loaded under a config whose `expert_parallel` section is enabled: a dense reward, reference or teacher model
    beside a MoE run, which shares its config. Engine-side AutoEP finds no MoE layer in it and trains it as plain
    ZeRO-3; so does this loader, with a warning. EP asked of this load itself (`ep_size=`, `DistributedConfig`)
    is refused as for any model without a preset."""
    if not request.by_config_only or any(name.rsplit(".", 1)[-1].endswith("experts")
                                         for name, _ in model.named_modules()):
        return False
    log.warning_once(f"no experts {type(model).__name__}",
                     "expert_parallel is enabled in the DeepSpeed config, but this %s model (%s) has no experts: "
                     "loaded without expert parallelism, as DeepSpeed's engine-side AutoEP trains it",
                     getattr(model.config, "model_type", None), type(model).__name__)
    return True


def check_at_initialize(model: torch.nn.Module, engine_config) -> None:
    """`deepspeed.initialize` of a model holding loader-built AutoEP layers, before the engine configures EP
    (`engine_config`: the `expert_parallel` section it was given, parsed)."""
    refuse_an_initialize_section_that_differs(model, engine_config)
    refuse_parameters_added_to_experts(model)
    refuse_adapter_targets_the_load_replaced(model)


def refuse_an_initialize_section_that_differs(model: torch.nn.Module, engine_config) -> None:
    """The engine keeps the layers the loader built with the load's `expert_parallel` section. A section given to
    `deepspeed.initialize` that asks for another size, or other routing or expert math (`route_scale`, `score_func`,
    `top_k`, `load_balance_coeff`, ...), would train the load's layers while the config says otherwise: refused, on
    every rank alike. Kernel and transport settings only warn: the layers keep the load's. EP asked of the load only
    (`ep_size=`, `DistributedConfig`) leaves the engine's section disabled: nothing to compare."""
    if engine_config is None or not engine_config.enabled:
        return
    layer = next(m for m in model.modules() if getattr(m, BUILT_WITH, None) is not None)
    if engine_config.autoep_size != layer.ep_size:
        raise ConfigError(
            f"the model was loaded with expert parallelism of size {layer.ep_size}, but the DeepSpeed config "
            f"passed to deepspeed.initialize asks for expert_parallel.autoep_size={engine_config.autoep_size}; "
            "load and initialize with the same size")
    loaded = ds_private.parse_autoep_section(getattr(layer, BUILT_WITH))  # parsed anew: AutoEP's detection fills
    # in the config object it is given from the model
    differ = {f.name: (getattr(loaded, f.name), getattr(engine_config, f.name)) for f in fields(loaded)
              if f.name not in NOT_COMPARED and getattr(loaded, f.name) != getattr(engine_config, f.name)}
    said = ", ".join(f"{k} ({a!r} at the load, {b!r} now)" for k, (a, b) in differ.items())
    if set(differ) - KERNEL_SETTINGS:
        raise ConfigError(
            f"the expert_parallel section passed to deepspeed.initialize differs from the one the model was loaded "
            f"with: {said}. The loader built the MoE layers at the load, with the load's settings, and the engine "
            "keeps them: they would train in place of what this config asks for. Load and initialize with the same "
            "expert_parallel section")
    if differ:
        log.warning_once("ep-kernel-settings", "the expert_parallel section passed to deepspeed.initialize differs "
                         "from the load's in kernel settings only: %s; the MoE layers keep the load's", said)


def refuse_parameters_added_to_experts(model: torch.nn.Module) -> None:
    """At `deepspeed.initialize`. A parameter added inside a loader-built AutoEP layer's experts after the load (PEFT's
    LoRA on `experts.w1` through `target_parameters`, or PEFT's copy of the whole layer, whose tensors lose
    DeepSpeed's expert mark) belongs to this rank's local experts, yet ZeRO-3 would take it as an ordinary parameter:
    partitioned over the whole world and its gradients averaged across ranks that hold different experts. That trains
    silently wrong, so it is refused, on every rank alike (the ranks' models have the same structure)."""
    from deepspeed.moe.utils import is_moe_param

    added = [name for name, p in parameters_in_loaded_experts(model) if not is_moe_param(p)]
    if added:
        raise ConfigError(
            f"{len(added)} parameters were added inside the expert-parallel experts after the load ({added[0]}, ...; "
            "PEFT's LoRA on the experts?): each rank holds its own experts, but ZeRO-3 would partition these over "
            "every rank and average their gradients across ranks holding different experts. Adapt the other modules "
            "(attention, shared experts), or train the experts themselves")


def refuse_adapter_targets_the_load_replaced(model: torch.nn.Module) -> None:
    """At `deepspeed.initialize`. PEFT names what LoRA adapts in transformers' names, and for transformers 5 MoE
    types turns the experts' projections (`gate_proj`, `up_proj`, `down_proj`; "all-linear" covers them too) into the
    fused expert parameters (`target_parameters`: `gate_up_proj`, `down_proj`). Under expert parallelism those are
    AutoEP's `experts.w1/w2/w3`, so PEFT matched nothing for them, without an error when another target matched: the
    adapter would train without the expert LoRA the same config trains without expert parallelism. Refused, on every
    rank alike (LoRA on the experts is not supported under EP: `refuse_parameters_added_to_experts`)."""
    configs, tuner = getattr(model, "peft_config", None), getattr(model, "base_model", None)
    layout = loaded_layout(model)
    if not isinstance(configs, dict) or layout is None:
        return
    targeted = list(getattr(tuner, "targeted_parameter_names", None) or [])  # PEFT's names: the unwrapped model's
    replaced = {m for box in layout.sources.values() for m in box.members}  # transformers' names of what AutoEP holds

    def matches(name: str, target: str) -> bool:  # PEFT's rule for target_parameters
        return name == target or name.endswith(f".{target}")

    lost = sorted({target for config in configs.values() for target in getattr(config, "target_parameters", None) or []
                   if any(matches(n, target) for n in replaced) and not any(matches(n, target) for n in targeted)})
    if lost:
        example = next(n for n in sorted(replaced) if matches(n, lost[0]))
        raise ConfigError(
            f"the PEFT adapter targets parameters that expert parallelism replaced (target_parameters {lost}: "
            f"{example}, ...; PEFT maps the experts' gate_proj/up_proj/down_proj, and \"all-linear\", to them for "
            "transformers 5 MoE models). Under expert parallelism the experts are DeepSpeed AutoEP's, so PEFT adapted "
            "none of them: the adapter would train without the expert LoRA this config trains without expert "
            "parallelism, and LoRA on the experts is not supported under it. Name the modules to adapt without the "
            "experts (target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']), or train without expert parallelism")


# PEFT's wrapper (`get_peft_model`) names the model's modules `base_model.model.<name>`
PEFT_WRAPPER_PREFIX = "base_model.model."


def _section_for_unwrapped_model(model: torch.nn.Module, section: dict) -> dict:
    """A `moe_layer_pattern` written for engine-side AutoEP on a PEFT-wrapped model (the engine sees the wrapper's
    names, `base_model.model.model.layers.N.mlp`) names no module of the model this loader builds, before PEFT wraps
    it. The config that works without the loader must work with it: the pattern is applied to the model's own names
    (the engine then keeps the loader's layers and does not match it again). Any other pattern is left as given."""
    pattern = section.get("moe_layer_pattern")
    if not pattern:
        return section
    names = [name for name, _ in model.named_modules()]
    if any(re.fullmatch(pattern, name) for name in names):
        return section
    wrapped = [name for name in names if re.fullmatch(pattern, PEFT_WRAPPER_PREFIX + name)]
    if not wrapped:
        return section
    unwrapped = next((pattern[len(p):] for p in (re.escape(PEFT_WRAPPER_PREFIX), PEFT_WRAPPER_PREFIX)
                      if pattern.startswith(p)), None)
    if unwrapped is None or [n for n in names if re.fullmatch(unwrapped, n)] != wrapped:
        unwrapped = "|".join(map(re.escape, wrapped))  # the layers it names, spelled out
    log.info("expert_parallel.moe_layer_pattern %r names the MoE layers under PEFT's wrapper (%s...); this loader "
             "builds them before the model is wrapped, as %r", pattern, PEFT_WRAPPER_PREFIX, unwrapped)
    return {**section, "moe_layer_pattern": unwrapped}


def _layer_pattern_hint(model: torch.nn.Module, section: dict, autoep_config) -> str:
    """AutoEP's presets name MoE layers where a causal LM holds them (`model.layers.N.mlp`); a bare body
    (`AutoModel`: `layers.N.mlp`) or a head whose body has another name (`transformer.layers.N.mlp`) matches none.
    DeepSpeed applies a `moe_layer_pattern` given in the config over the preset it detects, so the preset's pattern
    where this model holds those layers is all it needs: found here, and named in the error. Only blocks that hold
    `experts` count (a vision tower's `layers.N.mlp` is dense; ERNIE 4.5 VL's `mlp` holds two MoE blocks)."""
    if section.get("moe_layer_pattern"):
        return ""
    blocks = [name for name, module in model.named_modules()
              if isinstance(getattr(module, "experts", None), torch.nn.Module)]
    for pattern in ds_private.autoep_layer_patterns(model, autoep_config):
        if any(re.fullmatch(pattern, name) for name in blocks):
            return ""  # the preset found the layers where they are: something else failed
        tail = pattern.removeprefix(r"model\.")
        prefixes = {m[1] for name in blocks if (m := re.fullmatch(f"(.*?){tail}", name))}
        if len(prefixes) == 1:
            where = re.escape(prefixes.pop()) + tail
            return (f" This {type(model).__name__} holds its MoE layers at '{where}': name them in the config, "
                    f"expert_parallel.moe_layer_pattern: '{where}'")
    return ""


def _top_k_hint(model: torch.nn.Module, error: ValueError) -> str:
    """AutoEP reads top_k from the model's top-level config (DeepSpeed: "Set model.config.num_experts_per_tok or
    config top_k"); a vision-language model (Qwen3-VL-MoE) keeps it in its text config, whose value the error names."""
    attr = re.search(r"top_k .*model\.config\.(\w+)", str(error))
    top_k = attr and getattr(model.config.get_text_config(), attr[1], None)
    if not isinstance(top_k, int):
        return ""
    return f" Its text config holds {attr[1]}={top_k}: name it in the config, expert_parallel.top_k: {top_k}"


def _remote_code_hint(model: torch.nn.Module, error: ValueError) -> str:
    """A checkpoint's own modeling code (`trust_remote_code=True`; the hub's DeepSeek-V2 code) can keep one module per
    expert where the AutoEP preset takes only transformers' fused experts: DeepSpeed then cannot infer the experts'
    shapes. transformers' own class for the model type reads the same checkpoint into fused experts (its conversion
    ops stack the per-expert tensors), and that the preset takes."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = getattr(model.config, "model_type", None)
    if ("storage=module_list" not in str(error) or not type(model).__module__.startswith("transformers_modules")
            or model_type not in CONFIG_MAPPING):
        return ""
    return (f" This {type(model).__name__} is the checkpoint's own code (trust_remote_code=True), with one module per "
            f"expert; transformers' own {model_type} model reads the same checkpoint into the fused experts the "
            "preset takes: load it without trust_remote_code")


@dataclass
class ExpertParallelLayout:
    """The skeleton's MoE blocks replaced by AutoEP layers, and where every new tensor's bytes come from."""

    groups: ExpertParallelGroups
    sources: dict[str, SourceBox] = field(default_factory=dict)  # new model name -> box of a resolved tensor
    # the same for every EP rank (a reader rank plans the ranks it streams to): rank-independent renames, and the
    # boxes of each EP rank's local experts
    renames: dict[str, SourceBox] = field(default_factory=dict)
    boxes_by_ep_rank: dict[int, dict[str, SourceBox]] = field(default_factory=dict)
    expert_params: set[str] = field(default_factory=set)
    # the other parameters AutoEP builds (the routers; not the modules it keeps, e.g. shared experts): partitioned
    # over the group the engine gives the ones it builds (`ExpertParallelGroups.built_group`)
    built_params: set[str] = field(default_factory=set)
    new_buffers: list[tuple[torch.nn.Module, str]] = field(default_factory=list)  # AutoEP's own zero buffers
    layers: list[str] = field(default_factory=list)
    replaced_classes: set[str] = field(default_factory=set)  # the MoE block classes AutoEP layers took the place of
    num_experts: int = 0
    local_experts: tuple[int, int] = (0, 0)

    @classmethod
    def convert(cls, model: torch.nn.Module, request: ExpertParallelRequest, groups: ExpertParallelGroups):
        """The layout, its AutoEP layers built in place on the meta skeleton; None for a model without experts
        that only the DeepSpeed config's section asked EP of (see `without_experts`)."""
        model_type = getattr(model.config, "model_type", None)
        if without_experts(model, request):
            return None
        families = supported_model_types()
        if model_type not in families and not structure_named(request.autoep_section):
            note = ds_private.autoep_note_for(model_type)  # e.g. a vision-language model: its text backbone has one
            raise ConfigError(
                f"expert parallelism under ZeRO-3 needs a DeepSpeed AutoEP preset for the model; model type "
                f"{model_type!r} has none (deepspeed {ds_private.DEEPSPEED_VERSION_WRITTEN_AGAINST} presets cover: "
                f"{', '.join(sorted(families))})" + (f". DeepSpeed: {note}" if note else "") +
                f". As for DeepSpeed's engine-side AutoEP, a model of the same structure can name one in the config: "
                f"expert_parallel.preset_model (one of {', '.join(sorted(ds_private.autoep_presets()))}), or custom "
                f"patterns (expert_parallel.moe_layer_pattern, router_pattern, expert_pattern, ...)")
        section = _section_for_unwrapped_model(model, request.autoep_section)
        autoep_config = ds_private.parse_autoep_section(section)
        autoep = ds_private.autoep_for(model, autoep_config)  # one per model: it detects and replaces
        try:
            specs = ds_private.detect_moe_layers(autoep)
        except ValueError as e:
            raise ConfigError(f"DeepSpeed AutoEP cannot take this {model_type} model: {e}"
                              + _layer_pattern_hint(model, section, autoep_config) + _top_k_hint(model, e)
                              + _remote_code_hint(model, e)) from e
        if not specs:
            raise ConfigError(f"DeepSpeed AutoEP found no MoE layer in this {model_type} model")
        if request.engine_refuses:
            raise ConfigError(f"DeepSpeed {ds_private.DEEPSPEED_VERSION_WRITTEN_AGAINST}'s engine does not support "
                              f"expert parallelism (AutoEP) with ZeRO-3 under {', '.join(request.engine_refuses)}: "
                              "deepspeed.initialize would refuse it after the load (engine-side AutoEP too), so the "
                              "load refuses it first; drop the setting, or expert parallelism")
        for spec in specs:
            if spec.num_experts % request.ep_size:
                sizes = [d for d in range(1, spec.num_experts + 1) if spec.num_experts % d == 0]
                raise ConfigError(f"{spec.moe_module_name} has {spec.num_experts} experts, which ep_size="
                                  f"{request.ep_size} does not divide (sizes that do: {sizes})")
        layout = cls(groups, layers=[s.moe_module_name for s in specs], num_experts=specs[0].num_experts)
        layout.local_experts = ds_private.local_expert_range(layout.num_experts, request.ep_size, groups.ep_rank)
        # the tensors themselves are held until the end: an id is only an identity while its object lives, and the
        # replacement frees the MoE blocks' tensors, whose ids AutoEP's new ones can then take
        tensors_before = model.state_dict(keep_vars=True)
        names_before = {id(t): n for n, t in tensors_before.items()}
        for ep_rank in range(request.ep_size):
            local = ds_private.local_expert_range(layout.num_experts, request.ep_size, ep_rank)
            layout.boxes_by_ep_rank[ep_rank] = {k: v for spec in specs for k, v in layout._boxes_for(model, spec, local).items()}
        boxes = layout.boxes_by_ep_rank[groups.ep_rank]
        layout.replaced_classes = {type(model.get_submodule(name)).__name__ for name in layout.layers}
        with log.each_dependency_message_once():  # AutoEP's warnings come once per layer
            ds_private.replace_moe_layers(autoep, specs, request.ep_size, groups.ep_rank)
        layer_class = ds_private.autoep_layer_class()
        for name in layout.layers:
            layer = model.get_submodule(name)
            if not isinstance(layer, layer_class):
                raise LoaderError(f"internal error: AutoEP did not replace {name}")
            setattr(layer, ds_private.BUILT_BY_LOADER, True)
            setattr(layer, BUILT_WITH, section)
            layout.expert_params.update(f"{name}.experts.{p}" for p, _ in layer.experts.named_parameters())
            layout.built_params.update(f"{name}.{p}" for p, t in layer.named_parameters()
                                       if id(t) not in names_before and not p.startswith("experts."))
            layout.new_buffers.extend((layer, b) for b, _ in layer.named_buffers(recurse=False))
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name not in boxes and names_before.get(id(tensor), name) != name:  # a module kept under a new name
                layout.renames[name] = SourceBox(names_before[id(tensor)])
        del tensors_before
        layout.sources = layout.sources_for(groups.ep_rank)
        ds_private.let_engine_accept_replaced_layers(check=check_at_initialize)
        return layout

    def sources_for(self, ep_rank: int) -> dict[str, SourceBox]:
        return {**self.renames, **self.boxes_by_ep_rank[ep_rank]}

    def _boxes_for(self, model: torch.nn.Module, spec, local_experts: tuple[int, int]) -> dict[str, SourceBox]:
        """What each AutoEP tensor of one layer is a box of, in transformers' names, for these local experts."""
        moe = spec.moe_module_name
        experts = f"{moe}.{spec.experts_name}"
        if spec.expert_storage == "fused_3d":
            boxes = self._fused_expert_boxes(model, spec, experts, local_experts)
        elif spec.expert_storage == "module_list":
            boxes = self._per_expert_module_boxes(model, spec, experts, local_experts)
        else:
            raise UnsupportedConversionError(f"{moe}: AutoEP expert storage {spec.expert_storage!r} has no "
                                             "shard-on-read rule (fused 3-D experts and per-expert modules have)")
        router = f"{moe}.{spec.router_name}"
        boxes[f"{moe}.router.gate.weight"] = SourceBox(f"{router}.weight")
        if spec.gate_bias:
            boxes[f"{moe}.router.gate.bias"] = SourceBox(f"{router}.bias")
        if spec.e_score_correction_bias_path is not None:
            owner = f"{moe}.{spec.e_score_correction_bias_path}" if spec.e_score_correction_bias_path else moe
            boxes[f"{moe}.router.e_score_correction_bias"] = SourceBox(f"{owner}.e_score_correction_bias")
        return boxes

    @staticmethod
    def _fused_expert_boxes(model, spec, experts: str, local_experts: tuple[int, int]) -> dict[str, SourceBox]:
        """transformers' fused experts (`gate_up_proj` [E, 2*ffn, hidden], `down_proj`): the local experts' slice."""
        moe, (e0, e1) = spec.moe_module_name, local_experts
        w1 = f"{experts}.{spec.expert_w1_name}"
        w2 = f"{experts}.{spec.expert_w2_name}"
        local = (0, e0, e1 - e0)
        boxes = {f"{moe}.experts.w2": SourceBox(w2, (local,))}
        if spec.expert_w3_name is None:  # gate and up fused in one tensor
            gate_up, down = model.get_parameter(w1).shape, model.get_parameter(w2).shape
            layout = ds_private.fused_gate_up_layout(gate_up, down)
            if layout is None or layout.layout != "gate_up_first":
                raise UnsupportedConversionError(f"{moe}: fused expert layout {tuple(gate_up)} / {tuple(down)} has no "
                                                 "shard-on-read rule for AutoEP ([E, 2*ffn, hidden] is supported)")
            ffn = layout.ffn_hidden_size
            boxes[f"{moe}.experts.w1"] = SourceBox(w1, (local, (1, 0, ffn)))
            boxes[f"{moe}.experts.w3"] = SourceBox(w1, (local, (1, ffn, ffn)))
        else:
            boxes[f"{moe}.experts.w1"] = SourceBox(w1, (local,))
            boxes[f"{moe}.experts.w3"] = SourceBox(f"{experts}.{spec.expert_w3_name}", (local,))
        return boxes

    @staticmethod
    def _per_expert_module_boxes(model, spec, experts: str, local_experts: tuple[int, int]) -> dict[str, SourceBox]:
        """One module per expert (the hub's remote code for DeepSeek-V3 and Kimi-K2: `experts.N.gate_proj.weight`):
        each AutoEP tensor is the local experts' weights stacked, as AutoEP's repacking stacks them."""
        moe, (e0, e1) = spec.moe_module_name, local_experts

        def stacked(weight_name: str) -> list[str]:
            names = []
            for e in range(e0, e1):
                expert = model.get_submodule(f"{experts}.{e}")
                weight = ds_private.expert_weight(expert, weight_name)
                names.append(next(f"{experts}.{e}.{n}" for n, p in expert.named_parameters() if p is weight))
            return names

        boxes = {f"{moe}.experts.w2": SourceBox.stack(stacked(spec.expert_w2_name))}
        if spec.expert_w3_name is None:  # each expert's gate and up in one weight [2*ffn, hidden]
            w1 = stacked(spec.expert_w1_name)
            ffn = model.get_parameter(w1[0]).shape[0] // 2
            boxes[f"{moe}.experts.w1"] = SourceBox.stack(w1, ((1, 0, ffn),))
            boxes[f"{moe}.experts.w3"] = SourceBox.stack(w1, ((1, ffn, ffn),))
        else:
            boxes[f"{moe}.experts.w1"] = SourceBox.stack(stacked(spec.expert_w1_name))
            boxes[f"{moe}.experts.w3"] = SourceBox.stack(stacked(spec.expert_w3_name))
        return boxes

    def group_of(self, world: PartitionGroup, experts: PartitionGroup):
        """A parameter's group for the rank whose world group is `world`: experts over their expert-data-parallel
        group, the routers AutoEP built over the world's ranks as their own group (as the engine places them)."""
        built = PartitionGroup(self.groups.built_name, world.size, world.rank)
        return lambda name: experts if name in self.expert_params else built if name in self.built_params else world

    def check_loaded(self, plan: LoadPlan, resolved: dict) -> None:
        """Every tensor AutoEP derives from the checkpoint must be in it: a missing expert would be initialised
        per slice, not as the plain load initialises the fused tensor (or the expert's own module). `resolved`: the
        resolution's converted tensors, to name the expert modules' weights a stack lacks."""
        absent = sorted(n for n in self.sources if n in plan.tensors and plan.tensors[n].status != "load")
        if absent:
            def where(name: str) -> str:
                source = self.sources[name]
                if not source.stacked:
                    return f"from {source.source}: {plan.tensors[name].status}"
                lacking = [m for m in source.members if m not in resolved]
                return f"from {source.describe()}, without {', '.join(lacking[:3])}{' ...' if len(lacking) > 3 else ''}"

            detail = ", ".join(f"{n} ({where(n)})" for n in absent[:6])
            raise ConfigError(f"expert parallelism needs every MoE router and expert weight from the checkpoint; "
                              f"{len(absent)} are not there: {detail}{' ...' if len(absent) > 6 else ''}")

    def renamed_modules(self) -> dict[str, str]:
        """Module name in the expert-parallel model -> transformers' name, for each module AutoEP holds whole under
        another name (its router's `gate` linear is transformers' `gate`; shared experts, where moved)."""
        renamed = {}
        for name, source in self.sources.items():
            (module, param), (original, original_param) = name.rpartition(".")[::2], source.source.rpartition(".")[::2]
            if not source.box and not source.stacked and param == original_param and module != original:
                renamed[module] = original
        return renamed

    def let_peft_load_adapters_in_transformers_names(self, model: torch.nn.Module) -> None:
        """An adapter saved from an expert-parallel load names its modules as transformers does
        (`peft_adapters.written_under_transformers_names`); PEFT's `PeftModel.from_pretrained` maps the keys it loads
        with the base model's `_checkpoint_conversion_mapping` (transformers 5 models define none), so one mapping
        them to AutoEP's names lets the adapter load back onto this model too."""
        back = {}
        for module, original in sorted(self.renamed_modules().items()):
            if f"{module}.weight" in self.sources:  # the module LoRA adapts (the router's linear), not its parent
                back[f"^{re.escape(original)}\\."] = f"{module}."
        if back:
            hf_private.set_checkpoint_conversion_mapping(model, back)

    def forget_accelerate_leaf_marks(self, model: torch.nn.Module) -> None:
        """accelerate's `deepspeed_moe_layer_cls_names` (`ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES`) marks MoE blocks
        as ZeRO-3 leaf modules in `Accelerator.prepare`, before `deepspeed.initialize`, and raises where the model
        holds no module of a named class. Under engine-side AutoEP the blocks are still there then, and the marks go
        with them when the engine replaces them; here AutoEP layers replaced them at load. The classes the model no
        longer holds are dropped from that setting, so the run goes as engine-side AutoEP's does (an AutoEP layer
        runs on every rank whatever the routing, so it needs no mark)."""
        gone = self.replaced_classes - {type(m).__name__ for m in model.modules()}
        dropped = set()

        def kept(names: str | None) -> str | None:  # accelerate splits on "," as is
            listed = names.split(",") if names else []
            dropped.update(n for n in listed if n.strip() in gone)
            return ",".join(n for n in listed if n.strip() not in gone) or None

        if os.environ.get(ACCELERATE_MOE_LEAF_ENV):
            names = kept(os.environ[ACCELERATE_MOE_LEAF_ENV])
            if names is None:
                del os.environ[ACCELERATE_MOE_LEAF_ENV]
            else:
                os.environ[ACCELERATE_MOE_LEAF_ENV] = names
        for plugin in accelerate_deepspeed_plugins():  # one given transformer_moe_cls_names itself
            if getattr(plugin, "transformer_moe_cls_names", None):
                plugin.transformer_moe_cls_names = kept(plugin.transformer_moe_cls_names)
        if dropped:
            log.warning_once("ep-leaf-marks", "expert parallelism replaced every %s with DeepSpeed's AutoEP layer; "
                             "accelerate's deepspeed_moe_layer_cls_names no longer marks %s as a ZeRO-3 leaf module "
                             "(as with engine-side AutoEP, whose layers need no mark)",
                             ", ".join(sorted(n.strip() for n in dropped)), "it" if len(dropped) == 1 else "them")

    def materialize_new_buffers(self, device: torch.device) -> None:
        """AutoEP's own buffers (token counters) are zeros by construction; they are on meta after the replacement."""
        for module, name in self.new_buffers:
            buf = getattr(module, name)  # a registered buffer (setattr replaces it, persistent or not as it was)
            if buf is not None and buf.is_meta:
                setattr(module, name, torch.zeros(buf.shape, dtype=buf.dtype, device=device))

    def summary(self, plan: LoadPlan) -> dict:
        expert_bytes = sum(plan.tensors[n].bytes_to_read for n in self.expert_params if n in plan.tensors)
        return {"ep_size": self.groups.ep_size, "ep_rank": self.groups.ep_rank,
                "local_experts": list(range(*self.local_experts)), "num_experts": self.num_experts,
                "moe_layers": len(self.layers), "expert_bytes_read": expert_bytes,
                "other_bytes_read": plan.bytes_to_read - expert_bytes}
