"""What one load did, per rank: attached to the model as `model.hf_zero3_load_report`."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from .missing_init import InitStats
from .planner.plan import LoadPlan
from .reader import ReadStats


@contextmanager
def timed_phase(phases: dict, name: str):
    """Add the seconds spent inside the block to `phases[name]` (a phase can be entered several times)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start


@dataclass
class LoadReport:
    """What one rank did; attached to the model as `model.hf_zero3_load_report`."""

    init_context: str
    reason: str
    rank: int = 0
    world_size: int = 1
    plan: LoadPlan | None = None
    read: ReadStats = field(default_factory=ReadStats)
    init: InitStats = field(default_factory=InitStats)
    seconds: float = 0.0
    phases: dict = field(default_factory=dict)  # seconds per phase: plan, allocate, read, finalize
    expert_parallel: dict | None = None  # EP rank, local experts, bytes read for experts vs the rest
    stream: dict | None = None  # who read the files, who streamed to whom, bytes sent and received
    staging: dict | None = None  # partitions on an accelerator: the host staging buffer, pieces, bytes copied
    nvme: dict | None = None  # NVMe offload: partitions and bytes swapped out, the read's waves
    verify: dict | None = None  # verify_checkpoint="full": bytes this rank hashed, files the node had hashed before
    leaf_modules: list = field(default_factory=list)  # experts modules marked as ZeRO-3 leaf modules (leaf_modules.py)
    expert_parallel_layout: object = None  # expert_parallel.ExpertParallelLayout: what a save writes back

    def phase(self, name: str):
        return timed_phase(self.phases, name)

    def line(self, source) -> str:
        """What rank 0 logs after the load of `source`, in plain words (the init context and the reason are in
        `summary()`)."""
        from . import log

        if self.init_context == "zero.Init":
            return (f"loaded {source} on {log.ranks(self.world_size)} in {self.seconds:.2f} s: transformers' own "
                    "ZeRO-3 path (deepspeed.zero.Init)")
        how = "ZeRO-3 partitions"
        if self.expert_parallel:
            how += f", experts split over {log.ranks(self.expert_parallel['ep_size'])} (expert parallelism)"
        line = (f"loaded {source} on {log.ranks(self.world_size)} in {self.seconds:.2f} s: {how}, this rank read "
                f"{log.size(self.read.bytes_read)}")
        if self.stream:
            line += f" and received {log.size(self.stream['bytes_received'])} from another rank"
        return line

    def summary(self) -> dict:
        out = {"init_context": self.init_context, "reason": self.reason, "rank": self.rank,
               "bytes_read": self.read.bytes_read, "read_calls": self.read.reads,
               "bytes_populated": self.read.bytes_populated, "seconds": round(self.seconds, 3),
               "missing_init_peak_gathered_bytes": self.init.peak_gathered_bytes,
               "missing_left_by_init": self.init.left_by_init,
               "phases": {k: round(v, 3) for k, v in self.phases.items()}}
        if self.plan is not None:
            out.update(self.plan.summary())
        if self.expert_parallel is not None:
            out["expert_parallel"] = self.expert_parallel
        if self.stream is not None:
            out["stream"] = self.stream
        if self.staging is not None:
            out["staging"] = self.staging
        if self.nvme is not None:
            out["nvme"] = self.nvme
        if self.verify is not None:
            out["verify"] = self.verify
        if self.leaf_modules:
            out["leaf_modules"] = self.leaf_modules
        return out


def attach(model, report: LoadReport) -> None:
    target = model[0] if isinstance(model, tuple) else model
    target.hf_zero3_load_report = report
