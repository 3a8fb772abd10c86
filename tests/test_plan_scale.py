"""Planning one rank stays per-rank work at full size, however large the world (issue 13).

A header-only copy of full-size DeepSeek-V3 (671B, 45,395 checkpoint tensors, 252 shards of holes;
`scripts/_sparse_ckpt.py`), planned for one rank at W = 8 and W = 4096 in this process. Only deterministic bounds here
(the seconds are `scripts/bench_plan.py`'s): every plan covers exactly its partitions, its bytes are the rank's share,
and neither its read items nor the memory its planning allocates grow with the world.
"""

from __future__ import annotations

import os
import sys
import tracemalloc

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def deepseek_v3(workdir):
    """(meta skeleton, checkpoint headers, key resolution): what every rank computes once, whatever W."""
    from hf_zero3_loader.planner.inspect import plan_ranks

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from _sparse_ckpt import full_size_config, write_sparse_checkpoint

    folder = os.path.join(workdir, "sparse_deepseek_v3")
    write_sparse_checkpoint(full_size_config("deepseek_v3"), folder)
    _, model, checkpoint, resolution, _ = plan_ranks(folder, 8, ranks=[], with_model=True)  # no plan made yet
    return model, checkpoint, resolution


def _plan(setup, rank: int, world_size: int):
    """The plan of `rank` in a world of `world_size`, and the peak bytes Python allocated while making it."""
    from hf_zero3_loader.planner.plan import WORLD, PartitionGroup, check_plan_is_exact, plan_tensors

    model, checkpoint, resolution = setup
    group = PartitionGroup(WORLD, world_size, rank)
    tracemalloc.start()
    try:
        plan = plan_tensors(model, resolution, checkpoint, lambda name: group, rank, world_size, None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    check_plan_is_exact(plan)  # every loaded tensor's reads cover exactly its partition
    return plan, peak


def test_one_rank_plans_no_more_as_the_world_grows(deepseek_v3):
    small, small_peak = _plan(deepseek_v3, 0, 8)
    # 45,395 checkpoint tensors into 967 model tensors (fused experts); 156 GiB for rank 0 of 8
    assert len(deepseek_v3[1].entries) > 45_000 and len(small.tensors) > 900 and small.bytes_to_read > 150 << 30
    items = sum(len(t.reads) for t in small.tensors.values())
    for rank in (0, 1234, 4095):  # the first, one inside, and the last (padded partitions)
        big, big_peak = _plan(deepseek_v3, rank, 4096)
        assert sum(len(t.reads) for t in big.tensors.values()) <= items, rank
        assert big_peak <= small_peak, (rank, big_peak, small_peak)
        # the rank's share: W times it is the whole checkpoint's loaded bytes, up to each tensor's padding
        assert abs(big.bytes_to_read * 4096 - small.bytes_to_read * 8) <= 0.01 * small.bytes_to_read * 8, rank
