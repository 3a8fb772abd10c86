"""Build plans outside a distributed job: what would each rank read? (used by the CLI and tests)."""

from __future__ import annotations

import torch

from .. import _transformers_private as hf_private
from ..checkpoint import local_checkpoint, open_checkpoint
from ..errors import ConfigError
from ..gc_pause import paused_gc
from .plan import WORLD, PartitionGroup, plan_tensors, resolve_checkpoint


# `from_pretrained` keywords that say where the checkpoint is and which code builds it (what `plan` and `verify` accept)
LOCATION_KWARGS = ("subfolder", "revision", "variant", "use_safetensors", "cache_dir", "trust_remote_code")


def checkpoint_files(path: str, subfolder: str = "", revision: str | None = None, variant: str | None = None,
                     use_safetensors: bool | None = None, cache_dir: str | None = None, **_) -> list[str]:
    """The weight files transformers' `from_pretrained(path, ...)` would load: a local folder or a repo in the local
    hub cache; the index's shards, else the single file; safetensors first (pickles with `use_safetensors=False`)."""
    folder, files, why_not = local_checkpoint(path, subfolder or "", revision, variant, use_safetensors, cache_dir)
    if folder is None:
        raise FileNotFoundError(f"cannot plan {path}: {why_not}")
    return files


def meta_skeleton(path: str, model_class=None, dtype: torch.dtype | None = None, **load_kwargs):
    """The model as transformers builds it before loading: on meta, untied, in `dtype` (default: config's).
    `load_kwargs`: any of LOCATION_KWARGS, as given to `from_pretrained`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    trust = bool(load_kwargs.get("trust_remote_code"))
    config = AutoConfig.from_pretrained(path, subfolder=load_kwargs.get("subfolder") or "",
                                        revision=load_kwargs.get("revision"), cache_dir=load_kwargs.get("cache_dir"),
                                        trust_remote_code=trust)
    _refuse_transformers_path(path, config)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model_class = model_class or AutoModelForCausalLM
    extra = {"trust_remote_code": trust} if model_class.__name__.startswith("Auto") else {}
    with torch.device("meta"):
        model = model_class.from_config(config, dtype=dtype, **extra)
    return model, dtype


def _refuse_transformers_path(path: str, config) -> None:
    """A checkpoint quantized in a format this loader does not dequantize (bitsandbytes, GPTQ, ...) is loaded by
    transformers' own ZeRO-3 path, which a shard-on-read plan does not describe: say so rather than plan it as dense."""
    from ..zero3_load import DEQUANTIZE_HINTS, quant_method

    method = quant_method(getattr(config, "quantization_config", None))
    if method is not None and method not in DEQUANTIZE_HINTS:
        raise ConfigError(f"{path} holds {method}-quantized weights, which from_pretrained loads through "
                          "transformers' own ZeRO-3 path (zero.Init: rank 0 reads every parameter and broadcasts "
                          "it); plans describe shard-on-read loads only")


def plan_ranks(path: str, world_size: int, ranks=None, model_class=None, dtype=None, ep_size: int | None = None,
               with_model: bool = False, load_kwargs: dict | None = None, expert_parallel: dict | None = None):
    """Each rank's plan, outside a distributed job (no data read). With `ep_size`, the model's MoE blocks become
    AutoEP layers (as a load with expert parallelism makes them) and EP ranks are laid out as DeepSpeed lays them
    out by default (EP groups of consecutive ranks); `expert_parallel`: the DeepSpeed config's section of that name
    (a `preset_model` or custom patterns for a model type without a preset; its own size settings are ignored).
    The checkpoint is resolved once for all ranks. `load_kwargs`: any of LOCATION_KWARGS, as given to
    `from_pretrained`."""
    unknown = set(load_kwargs or {}) - set(LOCATION_KWARGS)
    if unknown:
        raise TypeError(f"plan_ranks: unsupported from_pretrained keywords {sorted(unknown)}; planned: {LOCATION_KWARGS}")
    with paused_gc():
        return _plan_ranks(path, world_size, ranks, model_class, dtype, ep_size, with_model, load_kwargs or {},
                           expert_parallel or {})


def _plan_ranks(path, world_size, ranks, model_class, dtype, ep_size, with_model, load_kwargs, expert_parallel):
    from transformers.conversion_mapping import get_model_conversion_mapping

    from transformers.quantizers import AutoHfQuantizer

    from ..verify import dequantize_config

    model, dtype = meta_skeleton(path, model_class, dtype, **load_kwargs)
    checkpoint = open_checkpoint(checkpoint_files(path, **load_kwargs))
    quantization = dequantize_config(path, load_kwargs)  # FP8/MXFP4 plan as they load: dequantized on read
    quantizer = AutoHfQuantizer.from_config(quantization, pre_quantized=True) if quantization is not None else None
    mapping = get_model_conversion_mapping(model, hf_quantizer=quantizer)
    resolution = resolve_checkpoint(model, checkpoint, mapping, hf_private.dtype_plan(model, dtype))
    layout = None
    if ep_size:
        from ..expert_parallel import ExpertParallelGroups, ExpertParallelLayout, request_from

        if expert_parallel.get("enabled"):  # asked by the config, as a load sees it (a dense model then plans plain)
            request = request_from({"expert_parallel": {**expert_parallel, "autoep_size": ep_size}}, None, None,
                                   world_size)
        else:
            section = {k: v for k, v in expert_parallel.items() if k not in ("enabled", "autoep_size")}
            request = request_from({"expert_parallel": section}, ep_size, None, world_size)
        layout = ExpertParallelLayout.convert(model, request, ExpertParallelGroups(ep_size, 0, None, EXPERTS))
    plans = []
    for rank in ranks if ranks is not None else range(world_size):
        world = PartitionGroup(WORLD, world_size, rank)
        group_of, sources = (lambda name, w=world: w), None
        if layout is not None:  # DeepSpeed's default layout: EP rank = rank % ep_size, EDP rank = rank // ep_size
            experts = PartitionGroup(EXPERTS, world_size // ep_size, rank // ep_size)
            group_of, sources = layout.group_of(world, experts), layout.sources_for(rank % ep_size)
        plans.append(plan_tensors(model, resolution, checkpoint, group_of, rank, world_size, sources))
    return (plans, model, checkpoint, resolution, layout) if with_model else plans


EXPERTS = "expert_data_parallel"
