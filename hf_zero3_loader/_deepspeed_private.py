"""Every touch of DeepSpeed's private API, in one place. Written against deepspeed 0.19.8. Also torch's internals
under DeepSpeed's comm layer and module code (sections at the end), written against torch 2.13.

ZeRO-3 parameters without `zero.Init` (`zero3.py`):
- `zero.Init._convert_to_deepspeed_param` only attaches attributes and closures (no allocation, no collective), so an
  un-entered `Init` converts a parameter; we then hand it a partition we allocated (`ds_tensor` and the status
  fields `GatheredParameters` and the engine read).
- `utils.groups._ZERO_PARAM_INTRA_PARALLEL_GROUP`: the ZeRO++ hpZ group, created by the first `zero.Init` of a process
  and handed to every later one (it asserts the group is new).
- `Init.pin_memory`: whether `zero.Init` page-locks host partitions (`offload_param: {device: cpu, pin_memory: true}`);
  ours are pinned the same way.
- `partition_parameters.zero_init_context` / `top_level_context`: a caller's own `with zero.Init(...)` around the
  load; `shutdown_init_context` / `restore_init_context` (what `deepspeed.initialize` uses) pause its patching.
- `param.ds_zero_partition_process_group`, set before the conversion, is the group the parameter is partitioned over
  (AutoEP expert parameters: their expert-data-parallel group).
- DeepSpeed's memory-efficient linear (`zero_optimization.memory_efficient_linear`, default true): an entered
  `zero.Init` (`InsertPostInitMethodToModuleSubClasses._enable_mem_efficient_linear`, keyed on `Init.enabled` and
  `Init.mem_efficient_linear`) replaces `torch.nn.functional.linear` with `linear.zero3_linear_wrap` for the rest of
  the process (DeepSpeed never puts it back; the original is kept as `linear_bk`), and so does `deepspeed.initialize`
  for a model not built by `zero.Init`. Its forward is a matmul, then the bias added as a separate step (fused for
  2-D inputs): a biased layer rounds otherwise than torch's fused linear. The loader's un-entered `Init` patches
  nothing, and the engine does not replace it for a model whose every parameter is already ZeRO-3's, so
  `use_memory_efficient_linear` does what entering it would have done.
- NVMe parameter offload (`offload_param: {device: nvme}`): `Init.param_swapper` (an `AsyncPartitionedParameterSwapper`,
  attached to every converted param as `nvme_swapper`); a partition goes out as `Init._partition_param` sends it:
  `get_buffer` (one of its `buffer_count` pinned buffers), the values copied in, `ds_tensor.final_location = nvme`,
  `swap_out_and_release` (written, buffer released, `ds_tensor` NOT_AVAILABLE until a gather swaps it in);
  `swap_in(params, async_op=False)` / `remove_partition_and_release_buffers` read one back for a moment. Each
  swapper empties its folder, `<nvme_path>/zero_stage_3/<dtype>params/rank<r>`, when it is built
  (`_configure_aio`): a second model in the process (a TRL reference model) would delete the first one's swap files,
  so a load whose `nvme_path` a live swapper uses gets a folder of its own below it (`separate_nvme_path`).

Ops built on first use (async_io, for NVMe offload): the CUDA builder's `compute_capability_args` parses each
TORCH_CUDA_ARCH_LIST entry as numbers and raises on "9.0a" (`arch_list_the_op_builder_cannot_parse`);
`git_version_info.installed_ops` / `OpBuilder._loaded_ops` say when nothing is built.

Missing-key init (`missing_init.py`): `GatheredParameters(modifier_rank=r)` broadcasts `p.data.view(torch.uint8)` on
exit, which raises for a 0-dim parameter (CLIP's `logit_scale`); `gathered_to_modify` gives those a 1-element shape
just before that exit (the partition keeps `ds_shape`, so later gathers are 0-dim again).

Saving (`saving.py`) reads the same fields back: `is_zero3_param` / `zero3_partition` give a parameter's local
partition (`ds_tensor`) and its group without a gather; `autoep_layer_class` tells AutoEP layers apart.

Expert parallelism (`expert_parallel.py`), the way `DeepSpeedEngine._configure_expert_parallel` does it:
- `utils.groups._create_expert_and_data_parallel` makes the EP / expert-data-parallel (EDP) groups (idempotent: a
  group name that exists is kept, so the engine later finds ours);
- the parameters AutoEP builds besides the experts (the routers) are partitioned over
  `utils.groups._get_sequence_data_parallel_group()`, the group the engine gives the ones it builds
  (`DeepSpeedEngine._resolve_zero3_param_placement`), so the optimizer's sub-groups, and the checkpoints that record
  them, are engine-side AutoEP's;
- `module_inject.auto_ep.AutoEP(model, cfg).ep_parser()` / `replace_moe_layers(...)` swap transformers' MoE blocks for
  `AutoEPMoELayer`s; under a meta device nothing is allocated or gathered. One `AutoEP` per model, as the engine
  makes one: each takes a DeepEP sharing scope (`auto_ep_comm.new_exchange_scope`, a process-wide counter) that its
  layers keep as `deepep_scope`;
- `DeepSpeedEngine._configure_expert_parallel` is wrapped so that a model whose MoE blocks we already replaced is not
  parsed again (the parser finds no transformers MoE block in it and raises): the engine still builds its groups
  and folding spec, and re-tags optimizer flags as it does after its own replacement; its `AutoEP` takes no sharing
  scope; the modules the replacement built leave in training mode, as the engine's own leave (it builds them after
  `from_pretrained`'s `eval()`); and it makes the random draws the replacement makes (each router gate's `nn.Linear`
  init), so the global RNG leaves `initialize` as it does under engine-side AutoEP.
- AutoEP's presets call `_CAN_RECORD_REGISTRY.get(key, default)`; transformers 5.23's registry `get` takes one
  argument. `allow_registry_get_default` widens it to accept the dict signature for string keys.

torch 2.13 (not DeepSpeed's, but what the package reaches under it):
- `distributed_c10d._get_default_store`, `_get_default_group`, `_set_pg_timeout`, `ProcessGroup._get_backend` and the
  gloo backend's `options._timeout`: the agreement's store, and the collectives' timeout lowered inside a collective
  section (`agreement.py`);
- `nn.modules.conv._ConvNd`: whether a module is one of torch's convolutions (`missing_init.py`).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ._hooks import EP, LOAD, SAVE, Hook

logger = logging.getLogger(__name__)

DEEPSPEED_VERSION_WRITTEN_AGAINST = "0.19.8"
# the releases tested: 0.19.8 (from, up to but not including); others warn at import (`compat.py`)
TESTED_RANGE = ((0, 19, 8), (0, 19, 9))

_PP = "deepspeed.runtime.zero.partition_parameters"
_SWAPPER = "deepspeed.runtime.swap_tensor.partitioned_param_swapper:AsyncPartitionedParameterSwapper"
_PARAM_FIELDS = ("ds_tensor", "ds_numel", "ds_numel_aligned", "ds_status", "ds_persist", "ds_shape", "ds_id",
                 "ds_zero_partition_process_group", "ds_zero_partition_world_size", "ds_zero_partition_rank",
                 "ds_process_group", "nvme_swapper", "final_location")

# Every private name of DeepSpeed the package touches, with the shape it relies on; checked at the first load or save
# (`compat.missing_hooks`). Where one of a load's is missing or changed, the load goes through transformers' own
# ZeRO-3 path (expert parallelism: left to the engine's AutoEP, or refused); a save is refused.
HOOKS = (
    Hook(f"{_PP}:Init._convert_to_deepspeed_param", (LOAD, SAVE), params=("self", "param"), exact=True),
    Hook(f"{_PP}:Init.__init__", (LOAD, SAVE), keywords=("config_dict_or_path", "zero_param_parallel_group")),
    Hook(f"{_PP}:Init", (LOAD, SAVE), source=("self.local_device", "self.remote_device", "self.ds_process_group",
                                              "self.pin_memory", "self.param_swapper")),
    Hook(_PP, (LOAD, SAVE), source=_PARAM_FIELDS),  # the fields of a converted parameter
    Hook(f"{_PP}:Init._enable_mem_efficient_linear", (LOAD,), params=("self",), exact=True),
    Hook(f"{_PP}:InsertPostInitMethodToModuleSubClasses", (LOAD,), source=("self.enabled", "self.mem_efficient_linear")),
    Hook("deepspeed.runtime.zero.linear:zero3_linear_wrap", (LOAD,), params=("input", "weight", "bias")),
    Hook(f"{_PP}:PartitionedParamStatus.AVAILABLE", (LOAD, SAVE)),
    Hook(f"{_PP}:PartitionedParamStatus.NOT_AVAILABLE", (LOAD, SAVE)),
    Hook(f"{_PP}:ZeroParamStatus.NOT_AVAILABLE", (LOAD, SAVE)),
    Hook(f"{_PP}:zero_init_context"),
    Hook(f"{_PP}:top_level_context"),
    Hook(f"{_PP}:shutdown_init_context"),
    Hook(f"{_PP}:restore_init_context"),
    Hook(f"{_PP}:GatheredParameters.__init__", params=("self", "params", "modifier_rank")),
    Hook("deepspeed.utils.groups:_ZERO_PARAM_INTRA_PARALLEL_GROUP"),
    # NVMe parameter offload
    Hook(f"{_SWAPPER}.get_buffer", (LOAD, SAVE), params=("self", "param", "numel")),
    Hook(f"{_SWAPPER}.swap_out_and_release", (LOAD, SAVE), params=("self", "params")),
    Hook(f"{_SWAPPER}.swap_in", (LOAD, SAVE), params=("self", "params", "async_op")),
    Hook(f"{_SWAPPER}.remove_partition_and_release_buffers", (LOAD, SAVE), params=("self", "params")),
    Hook(f"{_SWAPPER}.available_swap_in_buffers", (LOAD, SAVE), params=("self",)),
    Hook(f"{_SWAPPER}.swappable_tensor", (LOAD, SAVE), params=("self", "param", "numel")),
    Hook(_SWAPPER, (LOAD, SAVE), source=("self.elements_per_buffer", "self.dtype", "self.swap_config")),
    Hook("deepspeed.runtime.zero.offload_config:OffloadDeviceEnum.nvme", (LOAD, SAVE)),
    Hook("deepspeed.git_version_info:installed_ops"),
    Hook("deepspeed.ops.op_builder.builder:OpBuilder._loaded_ops"),
    # expert parallelism: AutoEP run on the meta skeleton, the engine's groups, the engine's acceptance
    Hook("deepspeed.module_inject.auto_ep:AutoEP.__init__", (EP,), params=("self", "model", "config")),
    Hook("deepspeed.module_inject.auto_ep:AutoEP", (EP,), source=("self.model", "self.deepep_scope = new_exchange_scope()",
                                                                  "from deepspeed.module_inject.auto_ep_comm import new_exchange_scope")),
    Hook("deepspeed.module_inject.auto_ep_comm:new_exchange_scope", (EP,)),
    Hook("deepspeed.module_inject.auto_ep:AutoEP.ep_parser", (EP,), params=("self",)),
    Hook("deepspeed.module_inject.auto_ep:AutoEP.replace_moe_layers", (EP,), params=("self", "specs"),
         keywords=("ep_size", "ep_rank")),
    Hook("deepspeed.module_inject.auto_ep_config:parse_autoep_config", (EP,), params=("param_dict",)),
    Hook("deepspeed.module_inject.auto_ep_layer:AutoEPMoELayer", (EP, SAVE)),
    Hook("deepspeed.module_inject.auto_ep_presets.registry:PRESET_MODELS", (EP,)),
    Hook("deepspeed.module_inject.auto_ep_presets.registry:resolve_preset_candidates", (EP,),
         params=("config", "model_config")),
    Hook("deepspeed.module_inject.auto_ep_presets.registry:unsupported_preset_for_hf_model_type", (EP,),
         params=("model_type",)),
    Hook("deepspeed.runtime.config:get_expert_data_topo_config", (EP,), params=("param_dict",)),
    Hook("deepspeed.utils.groups:_create_expert_and_data_parallel", (EP,), keywords=(
        "expert_parallel_size_", "mp_size", "pp_size", "mp_mode", "use_data_before_expert_parallel_")),
    Hook("deepspeed.utils.groups:_get_expert_parallel_group", (EP,)),
    Hook("deepspeed.utils.groups:_get_expert_data_parallel_group", (EP,)),
    Hook("deepspeed.utils.groups:_get_sequence_data_parallel_group", (EP,)),
    Hook("deepspeed.moe.ep_repack:_local_expert_range", (EP,), params=("spec", "ep_rank", "ep_size")),
    Hook("deepspeed.moe.ep_repack:_get_expert_weight", (EP,), params=("expert_module", "weight_name")),
    Hook("deepspeed.moe.fused_expert_layout:classify_fused_gate_up_layout", (EP,), params=("w1_shape", "w2_shape")),
    Hook("deepspeed.runtime.engine:DeepSpeedEngine._configure_expert_parallel", (EP,),
         params=("self", "model", "collect_sources"), exact=True),
    Hook("deepspeed:set_optimizer_flags", (EP,), params=("config_class", "model")),
    Hook("transformers.utils.output_capturing:_CAN_RECORD_REGISTRY.get", (EP,)),
)


def missing_hooks(*uses: str) -> list[str]:
    """"name: what is wrong" for each hook above that `uses` need (all when none given) and the installed DeepSpeed
    lacks or has changed; [] when every one is as expected. Checked once per process."""
    from ._hooks import missing

    return missing(HOOKS, uses)

# set on every AutoEPMoELayer this loader builds, so the engine wrapper knows not to replace again
BUILT_BY_LOADER = "_hf_zero3_loader_built"


# -- ZeRO-3 parameters ---------------------------------------------------------------------------------------------

def _hpz_group():
    """The ZeRO++ hpZ group (`zero_hpz_partition_size` > 1) an earlier model of this process created, or None.
    `zero.Init` creates it from the config and asserts it is new, so a second model (a TRL reference model, a second
    load) must be handed the first one's, as the engine hands it to its optimizer."""
    from deepspeed.utils import groups

    return groups._ZERO_PARAM_INTRA_PARALLEL_GROUP


# the NVMe swappers of the models this process loaded, while their params live (each holds its swapper)
_LIVE_NVME_SWAPPERS: weakref.WeakSet = weakref.WeakSet()


def separate_nvme_path(ds_config: dict) -> dict:
    """`ds_config`, or with NVMe parameter offload whose `nvme_path` a live model's swapper already uses, a copy
    whose `nvme_path` is a free folder below it (`hf_zero3_loader_model<n>`): the new swapper empties its folder when
    built, which would delete the live model's swap files (its next gather fails; transformers' path does that)."""
    # the section read as `deepspeed_setup.nvme_param_offload` reads it (that module sits above this one)
    offload = (ds_config.get("zero_optimization") or {}).get("offload_param") or {}
    if str(offload.get("device", "none")).lower() != "nvme" or not offload.get("nvme_path"):
        return ds_config
    in_use = {os.path.normpath(str(s.swap_config.nvme_path)) for s in list(_LIVE_NVME_SWAPPERS)}
    path = os.path.normpath(str(offload["nvme_path"]))
    if path not in in_use:
        return ds_config
    own = next(p for p in (os.path.join(path, f"hf_zero3_loader_model{n}") for n in range(1, len(in_use) + 2))
               if p not in in_use)
    logger.warning("offload_param.nvme_path %s holds the swap files of another model in this process; DeepSpeed's "
                   "swapper for this one would delete them, so this model swaps to %s", path, own)
    ds_config = copy.deepcopy(ds_config)
    ds_config["zero_optimization"]["offload_param"]["nvme_path"] = own
    return ds_config


class ZeroParamFactory:
    """Turns meta parameters into ZeRO-3 parameters whose partition we provide."""

    def __init__(self, ds_config: dict):
        import deepspeed

        # Constructed, never entered: no module patching, no construction hooks.
        self._init = deepspeed.zero.Init(config_dict_or_path=separate_nvme_path(ds_config),
                                         zero_param_parallel_group=_hpz_group())
        self.local_device = torch.device(self._init.local_device)
        remote = str(getattr(self._init.remote_device, "value", self._init.remote_device))
        # NVMe offload: partitions are filled in host memory, then swapped out (`swap_out_to_nvme`)
        self.nvme_swapper = self._init.param_swapper if remote == "nvme" else None
        if self.nvme_swapper is not None:
            _LIVE_NVME_SWAPPERS.add(self.nvme_swapper)
        remote = "cpu" if remote == "nvme" else remote
        self.remote_device = torch.device(remote) if remote not in ("None", "none") else self.local_device
        # `offload_param.pin_memory`, as zero.Init resolved it (False unless the partitions are offloaded)
        self.pin_memory = bool(getattr(self._init, "pin_memory", False))

    def use_memory_efficient_linear(self) -> bool:
        """What entering this `zero.Init` would do to `torch.nn.functional.linear`: when the config asks for DeepSpeed's
        memory-efficient linear (`zero_optimization.memory_efficient_linear`, default true), replace it with
        `zero3_linear_wrap` (once; DeepSpeed keeps the original as `linear_bk`), and leave it replaced, as `zero.Init`
        leaves it. Every ZeRO-3 load of transformers' own path runs under that replacement (it builds the model inside
        `zero.Init`), and so does a model `deepspeed.initialize` partitions itself; a biased linear layer (Qwen2's
        q/k/v) rounds differently without it. Returns whether it is in place."""
        init = self._init
        if init.enabled and init.mem_efficient_linear:
            init._enable_mem_efficient_linear()  # a no-op when it is already replaced
            return True
        return False

    @property
    def default_group(self):
        """The group `zero.Init` partitions over (the world, or the config's data-parallel group)."""
        return self._init.ds_process_group

    def convert(self, param: torch.nn.Parameter, process_group=None) -> torch.nn.Parameter:
        """Attach ZeRO-3 attributes to `param` (a real tensor of the full logical shape, e.g. an expanded scalar)."""
        if process_group is not None:
            param.ds_zero_partition_process_group = process_group
        self._init._convert_to_deepspeed_param(param)  # ds_shape/ds_numel, ds_id, closures; no collective
        return param

    @staticmethod
    def attach_partition(param: torch.nn.Parameter, partition: torch.Tensor, empty_data: torch.Tensor) -> None:
        """Give a converted param its local partition and mark it partitioned (not gathered)."""
        from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus, ZeroParamStatus

        partition.requires_grad = False
        partition.ds_numel = partition.numel()
        partition.status = PartitionedParamStatus.AVAILABLE
        partition.final_location = None
        param.ds_tensor = partition
        param.ds_numel_aligned = partition.numel() * param.ds_zero_partition_world_size
        param.data = empty_data
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE

    def swappable_to_nvme(self, param: torch.nn.Parameter, partition_numel: int, dtype: torch.dtype) -> bool:
        """Whether `zero.Init` would keep this partition on NVMe (large enough for the swapper, not persistent,
        in the swapper's dtype: `keep_in_fp32=True` parameters are not); the others stay in host memory (or on the
        device, when persistent), as `zero.Init` leaves them."""
        return (self.nvme_swapper is not None and not param.ds_persist and dtype == self.nvme_swapper.dtype
                and self.nvme_swapper.swappable_tensor(numel=partition_numel))


def swap_out_to_nvme(params: list[torch.nn.Parameter]) -> None:
    """Write each param's host partition to its NVMe swap file and free it, as `zero.Init` does for each param it
    partitions: in groups of the swapper's free buffers (`offload_param.buffer_count`), each through a pinned
    buffer."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    too_large = [p for p in params if p.ds_tensor.numel() > p.nvme_swapper.elements_per_buffer]
    if too_large:  # zero.Init fails on an assertion there
        from .errors import ConfigError

        largest, size = max(p.ds_tensor.numel() for p in too_large), too_large[0].nvme_swapper.elements_per_buffer
        raise ConfigError(f"{len(too_large)} ZeRO-3 partitions (the largest {largest} elements) do not fit DeepSpeed's "
                          f"NVMe swap buffers of offload_param.buffer_size={size} elements; raise buffer_size to at "
                          "least the largest partition")
    pending = list(params)
    while pending:
        swapper = pending[0].nvme_swapper
        count = max(1, swapper.available_swap_in_buffers())
        batch, pending = pending[:count], pending[count:]
        for param in batch:
            partition = param.ds_tensor
            buffer = swapper.get_buffer(param, partition.numel())
            buffer.copy_(partition)
            partition.data = buffer.data  # the host copy is freed here
            partition.final_location = OffloadDeviceEnum.nvme
        swapper.swap_out_and_release(batch)  # waits for the writes, releases the buffers


@contextmanager
def callers_zero_init_paused():
    """Yields the caller's own entered `zero.Init` (older scripts wrap `from_pretrained` in `with
    deepspeed.zero.Init(config_dict_or_path=...)`), or None, with its patching paused meanwhile. Entered, it patches
    every module's `__init__` and torch's tensor constructors: the meta skeleton would be partitioned as it is built,
    and float tensors cast to its dtype. `deepspeed.initialize` pauses it the same way while it builds an engine; the
    context stays entered and patches again afterwards."""
    from deepspeed.runtime.zero import partition_parameters

    outer = partition_parameters.top_level_context if partition_parameters.zero_init_context > 0 else None
    if outer is None or not getattr(outer, "patched", False):  # none, or paused already (by an outer caller)
        yield None
        return
    partition_parameters.shutdown_init_context()
    try:
        yield outer
    finally:
        partition_parameters.restore_init_context()


def is_zero3_param(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "ds_tensor")


@contextmanager
def partitions_in_memory(params: list[torch.Tensor]):
    """The partitions of `params` readable in `ds_tensor` inside the block: those swapped out to NVMe are swapped in
    (synchronously, through the swapper's buffers) and released again after it."""
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    swapped = list({id(p): p for p in params if on_nvme(p)
                    and p.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE}.values())
    if swapped:
        swapped[0].nvme_swapper.swap_in(swapped, async_op=False)
    try:
        yield
    finally:
        if swapped:
            swapped[0].nvme_swapper.remove_partition_and_release_buffers(swapped)


def on_nvme(param: torch.Tensor) -> bool:
    """A ZeRO-3 param whose partition lives in an NVMe swap file (`offload_param: nvme`)."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    return getattr(getattr(param, "ds_tensor", None), "final_location", None) == OffloadDeviceEnum.nvme


@dataclass(frozen=True)
class Zero3Partition:
    """A ZeRO-3 parameter's local piece: flat range [rank * size, ...) of the logical tensor, over `group`."""

    tensor: torch.Tensor  # flat, `ceil(numel / group_size)` elements (the last rank's padded)
    group_size: int
    rank: int
    group: object


def zero3_partition(param: torch.Tensor) -> Zero3Partition:
    """The partition a save writes (the engine's 16-bit copy, updated by every optimizer step)."""
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    partition = param.ds_tensor
    if getattr(partition, "status", PartitionedParamStatus.AVAILABLE) != PartitionedParamStatus.AVAILABLE:
        from .errors import ConfigError

        raise ConfigError("a ZeRO-3 partition is not in memory (swapped out to NVMe by offload_param: nvme); saving "
                          "without a gather needs partitions in device or CPU memory. Save through the Trainer or "
                          "accelerate (with stage3_gather_16bit_weights_on_model_save, they gather as without "
                          "hf_zero3_loader), or with the engine's save_checkpoint")
    return Zero3Partition(partition.data.view(-1), param.ds_zero_partition_world_size, param.ds_zero_partition_rank,
                          param.ds_process_group)


# -- DeepSpeed's ops, built on first use ----------------------------------------------------------------------------

def arch_list_the_op_builder_cannot_parse(op_name: str) -> list[str]:
    """The entries of TORCH_CUDA_ARCH_LIST that DeepSpeed 0.19.8's CUDA op builder would fail on when it JIT-builds
    `op_name` (`compute_capability_args` parses each as numbers: "9.0a" raises `int('0a')`); [] when nothing would be
    built here (no CUDA, the op installed prebuilt or already loaded) or every entry parses."""
    if not torch.cuda.is_available():
        return []
    try:
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder.builder import OpBuilder

        if installed_ops.get(op_name, False) or op_name in OpBuilder._loaded_ops:
            return []
    except (ImportError, AttributeError):  # an untested DeepSpeed: no advice rather than a failed check
        return []
    bad = []
    for cc in os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(" ", ";").split(";"):
        try:
            tuple(int(part.split("+")[0]) for part in cc.strip().split("."))
        except ValueError:
            if cc.strip():
                bad.append(cc.strip())
    return bad


# -- expert parallelism --------------------------------------------------------------------------------------------

def autoep_presets() -> dict[str, tuple[str, ...]]:
    """AutoEP preset name -> the transformers model types it accepts."""
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    return {name: tuple(preset.hf_model_types) for name, preset in PRESET_MODELS.items()}


def autoep_note_for(model_type: str) -> str | None:
    """DeepSpeed's own advice for a model type AutoEP knows but has no preset for (a vision-language wrapper whose
    text backbone has one), or None."""
    from deepspeed.module_inject.auto_ep_presets.registry import unsupported_preset_for_hf_model_type

    found = unsupported_preset_for_hf_model_type(model_type)
    return found[1].unsupported_hf_model_type_notes[model_type] if found else None


def parse_autoep_section(section: dict):
    """The `expert_parallel` config section as DeepSpeed parses it (an `AutoEPConfig`)."""
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    return parse_autoep_config(section)


def use_data_before_expert_parallel(ds_config: dict) -> bool:
    from deepspeed.runtime.config import get_expert_data_topo_config

    return bool(get_expert_data_topo_config(ds_config))


def expert_parallel_groups(ep_size: int, data_before_expert: bool):
    """Create (once) and return (ep group, expert-data-parallel group, group name) as the engine does."""
    from deepspeed.utils import groups

    groups._create_expert_and_data_parallel(expert_parallel_size_=ep_size, mp_size=1, pp_size=1, mp_mode="sp",
                                            use_data_before_expert_parallel_=data_before_expert)
    name = f"ep_size_{ep_size}"
    return groups._get_expert_parallel_group(name), groups._get_expert_data_parallel_group(name), name


def engine_replicated_group():
    """The group `deepspeed.initialize` partitions a parameter over that AutoEP created and no `zero.Init` converted
    (`DeepSpeedEngine._resolve_zero3_param_placement`: the "replicated" family goes to `seq_data_parallel_group`,
    `groups._get_sequence_data_parallel_group()`; with no `mpu` a clone of the world, made once and cached). Same
    ranks as the world, another group object: ZeRO-3's optimizer makes a sub-group per group object, and a DeepSpeed
    checkpoint records the sub-groups, so the load partitions the routers it builds over this one, as the engine
    does for the routers it builds (a collective the first time: every rank calls it, at the load)."""
    from deepspeed.utils import groups

    return groups._get_sequence_data_parallel_group()


def autoep_for(model: torch.nn.Module, autoep_config):
    """DeepSpeed's `AutoEP` for `model`: one per model, as the engine makes one. Each takes the next DeepEP sharing
    scope (`auto_ep_comm.new_exchange_scope`, a process-wide counter) and hands it to every layer it builds
    (`deepep_scope`), so one object detects and replaces: the layers get the scope engine-side AutoEP gives them."""
    from deepspeed.module_inject.auto_ep import AutoEP

    allow_registry_get_default()
    return AutoEP(model, autoep_config)


def detect_moe_layers(autoep) -> list:
    """AutoEP's own detection (`MoELayerSpec`s), run on the meta skeleton."""
    allow_registry_get_default()
    return autoep.ep_parser()


def autoep_layer_patterns(model: torch.nn.Module, autoep_config) -> list[str]:
    """The MoE layer patterns AutoEP's detection tries on `model` (`AutoEP._resolve_presets`), [] if none resolve."""
    from deepspeed.module_inject.auto_ep_presets.registry import resolve_preset_candidates

    try:
        return [preset.moe_layer_pattern for _, preset in
                resolve_preset_candidates(autoep_config, getattr(model, "config", None))]
    except ValueError:
        return []


# the modules AutoEP's replacement built (each layer, its router, gate and experts), as opposed to the transformers
# modules it moved into a layer (shared experts and their gate): engine-side AutoEP builds them at
# `deepspeed.initialize`, after `from_pretrained` put the model in eval mode, so they train (`training=True`)
_BUILT_BY_REPLACEMENT: weakref.WeakSet = weakref.WeakSet()


def replace_moe_layers(autoep, specs: list, ep_size: int, ep_rank: int) -> None:
    """AutoEP's own replacement, on meta: each layer's router and local expert slices are meta copies."""
    allow_registry_get_default()
    # the modules themselves are held until the end: an id is only an identity while its object lives, and the
    # replaced blocks' modules are freed as it goes, so a new module can take the id of one
    before = list(autoep.model.modules())
    ids_before = {id(m) for m in before}
    with torch.device("meta"):
        autoep.replace_moe_layers(specs, ep_size=ep_size, ep_rank=ep_rank)
    layer_class = autoep_layer_class()
    for layer in autoep.model.modules():
        if isinstance(layer, layer_class):
            _BUILT_BY_REPLACEMENT.update(m for m in layer.modules() if id(m) not in ids_before)
    del before


def autoep_layer_class():
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return AutoEPMoELayer


def local_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """The experts `ep_rank` owns, as `moe.ep_repack._local_expert_range` computes them."""
    from deepspeed.moe.ep_repack import _local_expert_range

    class _Spec:  # _local_expert_range reads only num_experts
        pass

    spec = _Spec()
    spec.num_experts = num_experts
    return _local_expert_range(spec, ep_rank, ep_size)


def fused_gate_up_layout(gate_up_shape: tuple, down_shape: tuple):
    """DeepSpeed's classification of a fused gate/up expert tensor: `.layout` ('gate_up_first' or other) and
    `.ffn_hidden_size`, or None."""
    from deepspeed.moe.fused_expert_layout import classify_fused_gate_up_layout

    return classify_fused_gate_up_layout(tuple(gate_up_shape), tuple(down_shape))


def expert_weight(expert: torch.nn.Module, weight_name: str) -> torch.Tensor:
    """The weight AutoEP stacks from one per-expert module (`module_list` storage): `weight_name` as a child
    linear's weight or as a tensor attribute, as its repacking finds it (`ep_repack._get_expert_weight`)."""
    from deepspeed.moe.ep_repack import _get_expert_weight

    return _get_expert_weight(expert, weight_name)


_registry_patched = False


def allow_registry_get_default() -> None:
    """transformers 5.23's `_CanRecordRegistry.get(model)` -> also `get(str_key, default)` (what AutoEP calls)."""
    global _registry_patched
    if _registry_patched:
        return
    from transformers.utils import output_capturing

    registry_class = type(output_capturing._CAN_RECORD_REGISTRY)
    original = registry_class.get

    @functools.wraps(original)
    def get(self, key, *default):
        if isinstance(key, str):
            return dict.get(self, key, *default)
        return original(self, key)

    registry_class.get = get
    _registry_patched = True


@contextmanager
def _no_moe_layers_to_parse(scope: int):
    """The engine's `AutoEP` finds nothing to replace, and takes no DeepEP sharing scope of its own: the model's
    layers hold theirs (`scope`, taken at the load), so the next model converted gets the scope it gets after
    engine-side AutoEP."""
    from deepspeed.module_inject import auto_ep_comm
    from deepspeed.module_inject.auto_ep import AutoEP

    saved, saved_scope = AutoEP.ep_parser, auto_ep_comm.new_exchange_scope
    AutoEP.ep_parser = lambda self: []
    auto_ep_comm.new_exchange_scope = lambda: scope
    try:
        yield
    finally:
        AutoEP.ep_parser, auto_ep_comm.new_exchange_scope = saved, saved_scope


_engine_wrapped = False


# called with a model holding loader-built layers and the engine's parsed `expert_parallel` section (or None), before
# the engine configures EP
_engine_checks: list = []


def let_engine_accept_replaced_layers(check=None) -> None:
    """Wrap `DeepSpeedEngine._configure_expert_parallel` (once): for a model holding AutoEP layers built by this
    loader, the engine creates its groups and folding spec as usual but does not parse or replace again."""
    global _engine_wrapped
    if check is not None and check not in _engine_checks:
        _engine_checks.append(check)
    if _engine_wrapped:
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._configure_expert_parallel

    @functools.wraps(original)
    def configure_expert_parallel(self, model, collect_sources=None):
        ours = [m for m in model.modules() if getattr(m, BUILT_BY_LOADER, False)]
        if not ours:
            allow_registry_get_default()  # engine-side AutoEP on a transformers 5.23 model needs it too
            return original(self, model, collect_sources)
        config = self._config.expert_parallel_config
        for check in _engine_checks:
            check(model, config)
        with _no_moe_layers_to_parse(ours[0].deepep_scope):
            result = original(self, model, collect_sources)
        _train_as_built_at_initialize(ours)
        _advance_rng_as_autoep_replacement(ours)  # also when EP was asked of the load only (`ep_size=`): one run
        if config is not None and config.enabled:
            from deepspeed import set_optimizer_flags

            set_optimizer_flags(self._config, model)  # what the engine does after replacing layers itself
        return result

    DeepSpeedEngine._configure_expert_parallel = configure_expert_parallel
    _engine_wrapped = True


def _train_as_built_at_initialize(layers: list) -> None:
    """Engine-side AutoEP builds its layers inside `deepspeed.initialize`, after `from_pretrained` put the model in
    eval mode: the modules it builds leave `initialize` in training mode, the transformers modules it moved into them
    (shared experts) in the mode the model was in. The loader built them before `from_pretrained`'s `eval()`: the same
    modules are put in training mode here, each on its own (`train()` would also switch the moved ones)."""
    for layer in layers:
        for module in layer.modules():
            if module in _BUILT_BY_REPLACEMENT:
                module.training = True


def _advance_rng_as_autoep_replacement(layers: list) -> None:
    """Engine-side AutoEP builds each layer's router gate as a fresh `nn.Linear` (`TokenChoiceTopKRouter`), whose
    default init draws from the global RNG before the checkpoint's gate is copied over it. The loader built its layers
    on meta, drawing nothing: the same draws here, the values discarded, leave the RNG where engine-side AutoEP leaves
    it, so what a run samples after `deepspeed.initialize` (GRPO's generations, dropout) is the same with the import."""
    for layer in layers:
        gate = layer.router.gate
        torch.nn.Linear(gate.in_features, gate.out_features, bias=gate.bias is not None)


@contextmanager
def gathered_to_modify(params):
    """`GatheredParameters(params, modifier_rank=0)`: rank 0's writes reach every rank's partition. Its exit
    broadcasts each gathered tensor viewed as bytes, which a 0-dim tensor cannot be: those leave with shape (1,) (the
    same element; the partition keeps `ds_shape`)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        try:
            yield
        finally:
            for p in params:
                if p.data.dim() == 0:
                    p.data = p.data.reshape(1)


# -- torch.distributed internals under DeepSpeed's comm layer: written against torch 2.13 ----------------------------
# The agreement (`agreement.py`) talks through the default group's store and lowers the groups' collective timeout to
# its liveness bound (restored after). Not in HOOKS: the agreement runs on every path, transformers' own ZeRO-3 path
# (where a missing hook sends a load) included, so a check could only send loads to a path that needs them too.

def default_store():
    """The key-value store of the default process group (`distributed_c10d._get_default_store`)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def default_process_group():
    """The default (world) process group (`distributed_c10d._get_default_group`)."""
    from torch.distributed.distributed_c10d import _get_default_group

    return _get_default_group()


def cpu_backend_timeout(pg):
    """The collective timeout of `pg`'s CPU (gloo) backend (`ProcessGroup._get_backend`, its `options._timeout`);
    raises for a group without one (NCCL alone, or a backend without options)."""
    return pg._get_backend(torch.device("cpu")).options._timeout


def set_process_group_timeout(timeout, pg) -> None:
    """`pg`'s collective timeout set to `timeout` (a timedelta) (`distributed_c10d._set_pg_timeout`)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, pg)


# -- torch.nn internals --------------------------------------------------------------------------------------------

def is_torch_convolution(module) -> bool:
    """A convolution of torch's (`torch.nn.modules.conv._ConvNd`: ConvNd, ConvTransposeNd, their lazy forms, and
    subclasses of the base itself)."""
    return isinstance(module, torch.nn.modules.conv._ConvNd)
