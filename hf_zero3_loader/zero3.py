"""Make ZeRO-3 parameters from a meta skeleton without broadcasting or allocating any full tensor.

DeepSpeed has no public way to do this (deepspeed 0.19.8): `zero.Init` allocates each parameter at full
size and broadcasts it. `Init._convert_to_deepspeed_param` however only attaches attributes and closures
(no allocation, no collective), so we use an `Init` object as a converter, then hand each parameter a
partition we allocated and filled ourselves. `GatheredParameters` and `deepspeed.initialize` then treat
the model as if `zero.Init` had built it. Written against deepspeed 0.19.8.
"""

from __future__ import annotations

import torch

from .planner.plan import WORLD, PartitionGroup, TensorPlan


class Zero3Partitioner:
    def __init__(self, ds_config: dict):
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import Init

        # Constructed, never entered: no module patching, no construction hooks.
        self._init: Init = deepspeed.zero.Init(config_dict_or_path=ds_config)
        self.local_device = torch.device(self._init.local_device)
        # NVMe offload was refused earlier (deepspeed_setup.check_supported); this is the CPU-offload or local device
        remote = str(getattr(self._init.remote_device, "value", self._init.remote_device))
        self.remote_device = torch.device(remote) if remote not in ("None", "none") else self.local_device

    @property
    def group(self):
        return self._init.ds_process_group

    def world_group(self) -> PartitionGroup:
        """The group `zero.Init` would partition over (the world, or the config's data-parallel group)."""
        import deepspeed.comm as dist

        return PartitionGroup(WORLD, dist.get_world_size(group=self.group), dist.get_rank(group=self.group))

    def allocate(self, module: torch.nn.Module, name: str, plan: TensorPlan) -> torch.Tensor:
        """Replace meta parameter `module.<name>` by a ZeRO-3 param with a zeroed local partition; return it."""
        from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus, ZeroParamStatus

        meta = module._parameters[name]
        # A meta tensor cannot take real data, so the param is rebuilt: one real element expanded to the full
        # shape gives DeepSpeed the logical shape without allocating the tensor.
        shell = torch.empty(1, dtype=plan.dtype, device=self.local_device).expand(plan.shape)
        param = torch.nn.Parameter(shell, requires_grad=meta.requires_grad)
        param.__dict__.update(meta.__dict__)
        self._init._convert_to_deepspeed_param(param)  # ds_shape/ds_numel, ds_id, closures; no collective
        device = self.local_device if param.ds_persist else self.remote_device
        if plan.status == "load":  # the reads fill [0, end - start); only the padding must be zeroed
            partition = torch.empty(plan.partition_numel, dtype=plan.dtype, device=device)
            partition[plan.end - plan.start :].zero_()
        else:  # missing: initialised later (or left zero, never garbage)
            partition = torch.zeros(plan.partition_numel, dtype=plan.dtype, device=device)
        partition.requires_grad = False
        partition.ds_numel = plan.partition_numel
        partition.status = PartitionedParamStatus.AVAILABLE
        partition.final_location = None
        param.ds_tensor = partition
        param.ds_numel_aligned = plan.partition_numel * param.ds_zero_partition_world_size
        param.data = torch.empty(0, dtype=plan.dtype, device=self.local_device)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        module._parameters[name] = param
        return param
