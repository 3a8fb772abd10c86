"""Make ZeRO-3 parameters from a meta skeleton without broadcasting or allocating any full tensor.

DeepSpeed has no public way to do this: `zero.Init` allocates each parameter at full size and broadcasts it. We
convert each meta parameter with DeepSpeed's own converter (`_deepspeed_private.ZeroParamFactory`) and hand it a
partition we allocated and fill ourselves. `GatheredParameters` and `deepspeed.initialize` then treat the model as
if `zero.Init` had built it. A parameter is partitioned over its plan's `PartitionGroup`: the world, or (expert
parallelism) its expert-data-parallel group.
"""

from __future__ import annotations

import torch

from ._deepspeed_private import ZeroParamFactory, swap_out_to_nvme
from .errors import LoaderError
from .planner.plan import WORLD, PartitionGroup, TensorPlan


class Zero3Partitioner:
    def __init__(self, ds_config: dict):
        self._factory = ZeroParamFactory(ds_config)
        # the process computes as under `zero.Init` (transformers' ZeRO-3 path builds the model inside it):
        # DeepSpeed's memory-efficient `F.linear`, when the config asks for it
        self.memory_efficient_linear = self._factory.use_memory_efficient_linear()
        self.local_device = self._factory.local_device
        self.remote_device = self._factory.remote_device
        self._process_groups = {WORLD: None}  # None: zero.Init's own group
        # NVMe offload: params whose partitions are filled in host memory, then swapped out (`swap_out`), by id of
        # their partition (a read's destination)
        self.nvme_params: dict[int, torch.nn.Parameter] = {}
        self.swapped_out = {"partitions": 0, "bytes": 0}

    def world_group(self) -> PartitionGroup:
        """The group `zero.Init` would partition over (the world, or the config's data-parallel group)."""
        import deepspeed.comm as dist

        group = self._factory.default_group
        return PartitionGroup(WORLD, dist.get_world_size(group=group), dist.get_rank(group=group))

    def add_group(self, name: str, process_group) -> PartitionGroup:
        """Partition the parameters planned with group `name` over `process_group`."""
        import torch.distributed as dist

        self._process_groups[name] = process_group
        return PartitionGroup(name, dist.get_world_size(group=process_group), dist.get_rank(group=process_group))

    def allocate(self, module: torch.nn.Module, name: str, plan: TensorPlan) -> torch.Tensor:
        """Replace meta parameter `module.<name>` by a ZeRO-3 param with a local partition; return it."""
        meta = getattr(module, name)  # a registered parameter (setattr below replaces it)
        # A meta tensor cannot take real data, so the param is rebuilt: one real element expanded to the full
        # shape gives DeepSpeed the logical shape without allocating the tensor (0-dim: CLIP's `logit_scale`).
        shell = torch.empty((), dtype=plan.dtype, device=self.local_device).expand(plan.shape)
        param = torch.nn.Parameter(shell, requires_grad=meta.requires_grad)
        param.__dict__.update(meta.__dict__)  # keeps tags such as AutoEP's allreduce / group_name
        self._factory.convert(param, self._process_groups[plan.group.name])
        if (param.ds_zero_partition_world_size, param.ds_zero_partition_rank) != (plan.group.size, plan.group.rank):
            raise LoaderError(f"internal error: {name} planned for group {plan.group} but DeepSpeed partitions it "
                              f"over {param.ds_zero_partition_world_size} ranks (rank {param.ds_zero_partition_rank})")
        device = self.local_device if param.ds_persist else self.remote_device
        to_nvme = self._factory.swappable_to_nvme(param, plan.partition_numel, plan.dtype)
        partition = self._new_partition(plan.partition_numel, plan.dtype, device, pin=not to_nvme)
        if plan.status == "load":  # the reads fill [0, end - start); only the padding must be zeroed
            partition[plan.end - plan.start :].zero_()
        else:  # missing: initialised later (or left zero, never garbage)
            partition.zero_()
        self._factory.attach_partition(param, partition, torch.empty(0, dtype=plan.dtype, device=self.local_device))
        setattr(module, name, param)
        if to_nvme:
            self.nvme_params[id(partition)] = param
        return param

    def swap_out(self, partitions: list[torch.Tensor] | None = None, model: torch.nn.Module | None = None) -> None:
        """NVMe offload: write the partitions that hold their final values (all that are left when None) to their
        swap files and free their host memory; the others are not NVMe's. With `model`, params no longer in it
        (tied away to another) are dropped instead of written."""
        keys = (list(self.nvme_params) if partitions is None
                else [id(p) for p in partitions if id(p) in self.nvme_params])
        params = [self.nvme_params.pop(key) for key in keys]
        if model is not None:
            live = {id(p) for p in model.parameters()}
            params = [p for p in params if id(p) in live]
        self.swapped_out["partitions"] += len(params)
        self.swapped_out["bytes"] += sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params)
        swap_out_to_nvme(params)

    def _new_partition(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool = True) -> torch.Tensor:
        """Uninitialised storage; on the host page-locked when the config asks (`offload_param.pin_memory`), as
        zero.Init pins its partitions: the engine moves trainable ones into pinned buffers of its own, but frozen ones
        (a LoRA base model) stay where the load put them and are copied to the device at every gather."""
        if pin and self._factory.pin_memory and device.type == "cpu":
            from deepspeed.accelerator import get_accelerator

            return get_accelerator().pin_empty(numel, dtype=dtype)  # a no-op pin on DeepSpeed's CPU accelerator
        return torch.empty(numel, dtype=dtype, device=device)
