"""Will it fit? Memory of a load and of training, predicted from the config and the checkpoint headers alone.

Per rank, in bytes:
- the load, ours: its partitions (the plan's partition sizes in the engine's dtype, buffers whole). On an
  accelerator the partitions live on the device and reach it through the host staging buffer (`staging_bytes`,
  64 MiB by default), so the host holds at most that; with `offload_param: cpu` they are the share in host memory;
  with `offload_param: nvme` they are read in waves of `staging_bytes` and swapped out after each, so the host holds
  one wave and DeepSpeed's pinned swap buffers (`buffer_count` x `buffer_size`, which transformers' path holds too);
- the load, transformers' ZeRO-3 path: every rank holds its partitions plus one module gathered whole and its
  broadcast copy (2x the largest module); rank 0 also maps the whole checkpoint (file-backed pages);
- after `deepspeed.initialize`, DeepSpeed's own estimate for ZeRO-3 model states
  (`stage3.estimate_zero3_model_states_mem_needs`: 18 bytes per parameter of the rank's partitions, less what
  `offload_optimizer` / `offload_param` move to the host, plus 4 bytes per parameter of the largest layer), where the
  largest layer is what a forward pass all-gathers at once: a MoE layer's whole fused experts under plain ZeRO-3,
  its local experts (1/ep_size of them) under expert parallelism. Activations are not included.

`tests/test_cli.py` checks the load predictions against measured peaks of real loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..deepspeed_setup import nvme_param_offload
from ..staging import DEFAULT_STAGING_BYTES
from .plan import LoadPlan

GiB = 1 << 30
MiB = 1 << 20
# working memory beyond the tensors, measured on CPU ranks (tests/test_cli.py, scripts/bench_load.py): ours plans and
# stages; transformers' path also runs zero.Init's per-module allocations and the load's gather/broadcast buffers
OURS_OVERHEAD, UPSTREAM_OVERHEAD = 16 * MiB, 96 * MiB


def _offload(ds_config: dict, key: str) -> bool:
    section = ((ds_config or {}).get("zero_optimization") or {}).get(key) or {}
    return str(section.get("device", "none")).lower() in ("cpu", "nvme")


def _nvme_swap_buffer_bytes(ds_config: dict, itemsize: int) -> int:
    """DeepSpeed's pinned parameter swap buffers under `offload_param: nvme` (its defaults: 5 of 1e8 elements)."""
    section = nvme_param_offload(ds_config)
    if section is None:
        return 0
    return int(section.get("buffer_count", 5)) * int(float(section.get("buffer_size", 1e8))) * itemsize


def engine_itemsize(ds_config: dict) -> int:
    for key in ("bf16", "bfloat16", "fp16"):
        if ((ds_config or {}).get(key) or {}).get("enabled") in (True, "auto"):
            return 2
    return 4 if ds_config else 2  # without a config: the common bf16 training setup


def layer_params(model: torch.nn.Module) -> tuple[int, str]:
    """The largest number of parameters one module owns (what ZeRO-3 gathers at once in a forward pass), counting a
    ZeRO-3 leaf module with all its submodules: the loader marks MoE experts so (`leaf_modules`), and one module per
    expert is then gathered together. Under expert parallelism the model holds AutoEP layers whose experts are the
    local ones."""
    from ..leaf_modules import experts_to_mark

    leaves = set(experts_to_mark(model))
    best, where = 0, ""
    for module_name, module in model.named_modules():
        count = sum(p.numel() for p in module.parameters(recurse=module_name in leaves))
        if count > best:
            best, where = count, module_name
    return best, where


@dataclass
class Prediction:
    world_size: int
    ep_size: int
    device: str
    load_ours_host: list[int]
    load_ours_device: list[int]
    load_upstream_host: list[int]
    load_upstream_device: list[int]
    train_device: int
    train_host_per_node: int
    largest_layer_params: int
    largest_layer: str
    largest_gather_bytes: int
    total_params: int

    def fits(self, device_memory: float | None) -> bool | None:
        return None if device_memory is None else self.train_device <= device_memory * GiB

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def predict(plans: list[LoadPlan], model: torch.nn.Module, ds_config: dict, checkpoint_bytes: int, total_params: int,
            largest_full: int, ep_size: int, device: str = "cuda", ranks_per_node: int = 8,
            staging_bytes: int = DEFAULT_STAGING_BYTES) -> Prediction:
    """`model` as the load builds it (with expert parallelism: AutoEP layers holding local experts);
    `largest_full` the largest module of transformers' own model (what its ZeRO-3 path gathers)."""
    itemsize = engine_itemsize(ds_config)
    world = plans[0].world_size
    shares = [sum(t.partition_numel * (itemsize if t.kind == "param" else t.dtype.itemsize)
                  for t in p.tensors.values()) for p in plans]
    # parameters each rank holds a partition of: experts over their expert-data-parallel group, the rest over the world
    per_rank = max(sum(t.partition_numel for t in p.tensors.values() if t.kind == "param") for p in plans)
    total = total_params
    largest, where = layer_params(model)
    on_device = device != "cpu"
    offload_optimizer, offload_param = _offload(ds_config, "offload_optimizer"), _offload(ds_config, "offload_param")
    swap_buffers = _nvme_swap_buffer_bytes(ds_config, itemsize)
    partitions_on_device = on_device and not offload_param
    # on an accelerator the share passes through the staging buffer, to NVMe in waves of that size; offloaded to the
    # host or on CPU ranks it is in host memory
    waves = partitions_on_device or swap_buffers > 0
    ours_host = [(min(s, staging_bytes) if waves else s) + swap_buffers + OURS_OVERHEAD for s in shares]
    ours_device = list(shares) if partitions_on_device else [0] * len(shares)
    gathered = 2 * largest_full * itemsize  # one module gathered whole, and the copy broadcast from rank 0
    upstream_host = [(0 if on_device else s + gathered) + swap_buffers + UPSTREAM_OVERHEAD
                     + (checkpoint_bytes if p.rank == 0 else 0) for s, p in zip(shares, plans)]  # rank 0 maps it all
    upstream_device = [s + gathered if on_device else 0 for s in shares]
    largest_layer_memory = 4 * largest
    per_node = min(world, ranks_per_node) * per_rank
    if offload_param:
        train_device, host = largest_layer_memory, 18 * per_node * 1.5
    elif offload_optimizer:
        train_device, host = largest_layer_memory + 2 * per_rank, 16 * per_node * 1.5
    else:
        train_device, host = largest_layer_memory + 18 * per_rank, largest * 4 * min(world, ranks_per_node) * 1.5
    return Prediction(world, ep_size, device, ours_host, ours_device, upstream_host, upstream_device,
                      int(train_device), int(host), largest, where, largest * itemsize, total)
