"""Build plans outside a distributed job: what would each rank read? (used by the CLI and tests)."""

from __future__ import annotations

import glob
import json
import os

import torch

from ..checkpoint import open_checkpoint
from .plan import WORLD, LoadPlan, PartitionGroup, build_plan


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


def plan_ranks(folder: str, world_size: int, ranks=None, model_class=None, dtype=None) -> list[LoadPlan]:
    from transformers.conversion_mapping import get_model_conversion_mapping

    model, dtype = meta_skeleton(folder, model_class, dtype)
    checkpoint = open_checkpoint(checkpoint_files(folder))
    mapping = get_model_conversion_mapping(model)  # build_plan copies converters; the mapping is reusable
    plans = []
    for rank in ranks if ranks is not None else range(world_size):
        plans.append(build_plan(model, checkpoint, mapping, dtype, model._get_dtype_plan(dtype),
                                group_of=lambda name, r=rank: PartitionGroup(WORLD, world_size, r),
                                rank=rank, world_size=world_size))
    return plans
