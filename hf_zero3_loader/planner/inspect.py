"""Build plans outside a distributed job: what would each rank read? (used by the CLI and tests)."""

from __future__ import annotations

import glob
import json
import os

import torch

from ..checkpoint import open_checkpoint
from ..gc_pause import paused_gc
from .plan import WORLD, PartitionGroup, plan_tensors, resolve_checkpoint


def checkpoint_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no safetensors checkpoint in {folder}")
    return files


def meta_skeleton(folder: str, model_class=None, dtype: torch.dtype | None = None):
    """The model as transformers builds it before loading: on meta, untied, in `dtype` (default: config's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = (model_class or AutoModelForCausalLM).from_config(config, dtype=dtype)
    return model, dtype


def plan_ranks(folder: str, world_size: int, ranks=None, model_class=None, dtype=None, ep_size: int | None = None,
               with_model: bool = False):
    """Each rank's plan, outside a distributed job (no data read). With `ep_size`, the model's MoE blocks become
    AutoEP layers (as a load with expert parallelism makes them) and EP ranks are laid out as DeepSpeed lays them
    out by default (EP groups of consecutive ranks). The checkpoint is resolved once for all ranks."""
    with paused_gc():
        return _plan_ranks(folder, world_size, ranks, model_class, dtype, ep_size, with_model)


def _plan_ranks(folder, world_size, ranks, model_class, dtype, ep_size, with_model):
    from transformers.conversion_mapping import get_model_conversion_mapping

    model, dtype = meta_skeleton(folder, model_class, dtype)
    checkpoint = open_checkpoint(checkpoint_files(folder))
    mapping = get_model_conversion_mapping(model)
    resolution = resolve_checkpoint(model, checkpoint, mapping, model._get_dtype_plan(dtype))
    layout = None
    if ep_size:
        from ..expert_parallel import ExpertParallelGroups, ExpertParallelLayout, request_from

        request = request_from({}, ep_size, None, world_size)
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
