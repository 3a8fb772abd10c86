"""Fidelity: every gathered parameter and buffer equals plain single-process `from_pretrained`, bit for bit and
dtype for dtype, at world sizes that do and do not divide the tensor sizes; plus the deterministic bounds:
bytes read per rank, reads coalesced (one per file when a rank reads whole files), no collective moving parameter data, no full tensor of a sharded parameter allocated.

Each world size is one real `torchrun` job loading every case with real DeepSpeed (CPU accelerator, gloo).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.conftest import run_torchrun
from tests.dist_worker import NOTHING_PERSISTENT, ds_config_for

CHECKPOINTS = {
    # name: (family, saved dtype, sharded)
    "qwen3_moe": ("qwen3_moe", torch.float32, False),
    "qwen3_moe_sharded": ("qwen3_moe", torch.float32, True),
    "qwen3_moe_bf16": ("qwen3_moe", torch.bfloat16, False),
    "mixtral": ("mixtral", torch.float32, False),
    "mixtral_sharded": ("mixtral", torch.float32, True),
    "llama_tied": ("llama_tied", torch.float32, False),
    "llama_untied_sharded": ("llama_untied", torch.float32, True),
}
DTYPES = ("bfloat16", "float32")
WORLD_SIZES = (1, 2, 3, 4)


def _cases(workdir: str, world_size: int) -> list[dict]:
    cases = []
    for name, (family, saved, sharded) in CHECKPOINTS.items():
        path = make_checkpoint(os.path.join(workdir, name), family, saved, sharded)
        for dtype in DTYPES:
            cases.append({"name": f"{name}/{dtype}", "path": path, "dtype": dtype, "model_class": "AutoModelForCausalLM",
                          "out": os.path.join(workdir, f"w{world_size}_{name}_{dtype}.pt")})
    # an fp16 engine (`fp16: {enabled: true}`): a bf16 MoE checkpoint and an fp32 tied one, cast as the plain load casts
    for name in ("qwen3_moe_bf16", "llama_tied"):
        cases.append({"name": f"{name}/float16", "path": os.path.join(workdir, name), "dtype": "float16",
                      "model_class": "AutoModelForCausalLM",
                      "out": os.path.join(workdir, f"w{world_size}_{name}_fp16.pt")})
    # a base model loaded from a causal-LM checkpoint (drops the `model.` prefix, leaves lm_head unexpected)
    cases.append({"name": "qwen3_moe/base", "path": os.path.join(workdir, "qwen3_moe"), "dtype": "float32",
                  "model_class": "AutoModel", "out": os.path.join(workdir, f"w{world_size}_base.pt")})
    # partitions offloaded to the host (`offload_param: cpu`): read in place, as on a device rank (tests/test_gpu.py)
    # (pinning them, as the config asks, is a no-op on DeepSpeed's CPU accelerator)
    offload = ds_config_for("bfloat16", {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",
                                                                                             "pin_memory": True}}})
    cases.append({"name": "qwen3_moe/offload_param", "path": os.path.join(workdir, "qwen3_moe"), "dtype": "bfloat16",
                  "model_class": "AutoModelForCausalLM", "ds_config": offload,
                  "out": os.path.join(workdir, f"w{world_size}_offload.pt")})
    return cases


_results: dict = {}


def results(workdir: str, world_size: int) -> list[tuple[dict, dict]]:
    if world_size not in _results:
        cases = _cases(workdir, world_size)
        _results[world_size] = list(zip(cases, run_torchrun(world_size, cases, workdir)))
    return _results[world_size]


@functools.lru_cache(maxsize=None)
def reference(path: str, dtype: str, model_class: str) -> dict:
    """Plain single-process from_pretrained: every parameter and buffer."""
    import transformers

    model = getattr(transformers, model_class).from_pretrained(path, dtype=getattr(torch, dtype))
    state = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    state.update({n: b.detach() for n, b in model.named_buffers(remove_duplicate=False)})
    return state


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gathered_state_equals_plain_load(workdir, world_size):
    for case, dump in results(workdir, world_size):
        got = dump["rank0"]
        assert "error" not in got, f"{case['name']}: {got.get('error', {}).get('traceback')}"
        ref = reference(case["path"], case["dtype"], case["model_class"])
        assert set(got["state"]) == set(ref), case["name"]
        for key, expected in ref.items():
            actual = got["state"][key]
            assert actual.dtype == expected.dtype, f"{case['name']} {key}: {actual.dtype} != {expected.dtype}"
            assert actual.shape == expected.shape, f"{case['name']} {key}"
            assert torch.equal(actual, expected), f"{case['name']} {key}: values differ (W={world_size})"
        assert got["training"] is False, "from_pretrained returns the model in eval mode"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_each_rank_reads_its_share_and_moves_no_parameter_data(workdir, world_size):
    from hf_zero3_loader.checkpoint import open_checkpoint

    for case, dump in results(workdir, world_size):
        if case["model_class"] != "AutoModelForCausalLM":
            continue
        ranks = dump["ranks"]
        files = sorted(os.path.join(case["path"], f) for f in os.listdir(case["path"]) if f.endswith(".safetensors"))
        checkpoint = open_checkpoint(files)
        total = checkpoint.nbytes
        read = [r["report"]["bytes_read"] for r in ranks]
        # every parameter byte is read by exactly one rank (these models have no persistent buffers)
        assert sum(read) == total, f"{case['name']}: ranks read {read}, checkpoint holds {total}"
        slack = len(checkpoint.entries) * 4  # ceil rounding: at most one element per tensor
        assert max(read) <= total / world_size + slack, f"{case['name']}: {read} vs {total}/{world_size}"
        saved = CHECKPOINTS[case["name"].split("/")[0]][1]
        if world_size == 1 and str(saved) == f"torch.{case['dtype']}":
            # no cast: the whole checkpoint is read in file order, tensors adjacent on disk coalesced into one
            # preadv per file (each file here is far below the 64 MiB cap on one read)
            assert [r["report"]["read_calls"] for r in ranks] == [len(files)], case["name"]
        for r in ranks:
            # no collective at all (ranks agree through the store), so none carries parameter data
            assert r["collectives"] == {}, f"{case['name']}: {r['collectives']}"


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_no_rank_allocates_a_whole_sharded_parameter(workdir, world_size):
    """Counted in elements: a cast stages a partition in the (possibly wider) checkpoint dtype, never a whole tensor.
    Reads run in this thread here (read_threads defaults to the cores per rank), so the dispatch mode sees them."""
    for case, dump in results(workdir, world_size):
        ref = reference(case["path"], case["dtype"], case["model_class"])
        largest_param = max(t.numel() for t in ref.values())
        for r in dump["ranks"]:
            assert 0 < r["largest_allocation_numel"] < largest_param, (
                f"{case['name']}: rank {r['rank']} allocated a tensor of {r['largest_allocation_numel']} elements, "
                f"largest parameter has {largest_param}"
            )


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("qwen2", marks=pytest.mark.sweep)])
def test_training_losses_equal_upstream_zero3(workdir, family):
    """3 steps, each rank on its own tokens, every parameter gathered and released: every rank's losses equal
    transformers' own ZeRO-3 path's. Qwen2's biased q/k/v round alike only under the same `F.linear`: the load
    installs DeepSpeed's memory-efficient one, as transformers' `zero.Init` does (ours runs first, with torch's)."""
    if family == "qwen2":  # dense, biased q/k/v
        from tests.families import small_config

        path = make_checkpoint(os.path.join(workdir, "train_qwen2"), family, config=small_config(family))
    else:
        path = make_checkpoint(os.path.join(workdir, family), family)
    cases = [
        {"name": f"train/{variant}", "path": path, "dtype": "bfloat16", "upstream": variant == "upstream",
         "ds_config": ds_config_for("bfloat16", {"zero_optimization": NOTHING_PERSISTENT}), "rank_inputs": True,
         "train_steps": 3, "kwargs": {"experts_implementation": "eager"} if family == "qwen3_moe" else {},
         "out": os.path.join(workdir, f"train_{family}_{variant}.pt")}
        for variant in ("ours", "upstream")
    ]
    ours, upstream = run_torchrun(2, cases, workdir)
    for dump in (ours, upstream):
        assert "error" not in dump["rank0"], dump["rank0"].get("error", {}).get("traceback")
    assert [r["losses"] for r in ours["ranks"]] == [r["losses"] for r in upstream["ranks"]]
    assert len(ours["rank0"]["losses"]) == 3 and ours["ranks"][0]["losses"] != ours["ranks"][1]["losses"]
    assert ours["rank0"]["fresh_linear_at_start"] and not upstream["rank0"]["fresh_linear_at_start"]


def test_zeropp_hpz_second_model_and_training_equal_upstream(workdir):
    """ZeRO++ hierarchical partitioning (`zero_hpz_partition_size`): `zero.Init` creates its group once per process
    and asserts it is new. Here transformers' own ZeRO-3 path loads first, then ours loads twice in the same process
    (a TRL policy and reference model do this): both reuse the group, and training matches upstream's losses."""
    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    config = ds_config_for("bfloat16",
                           {"zero_optimization": {**NOTHING_PERSISTENT, "zero_hpz_partition_size": 2}})
    cases = [{"name": f"hpz/{variant}", "path": path, "dtype": "bfloat16", "upstream": variant == "upstream",
              "ds_config": config, "kwargs": {"experts_implementation": "eager"},
              "out": os.path.join(workdir, f"hpz_{variant}.pt"), **({} if variant == "reference" else {"train_steps": 3})}
             for variant in ("upstream", "reference", "ours")]
    dumps = run_torchrun(2, cases, workdir)
    for case, dump in zip(cases, dumps):
        assert "error" not in dump["rank0"], f"{case['name']}: {dump['rank0'].get('error', {}).get('traceback')}"
    upstream, second, ours = dumps
    assert len(ours["rank0"]["losses"]) == 3 and ours["rank0"]["losses"] == upstream["rank0"]["losses"]
    want = reference(path, "bfloat16", "AutoModelForCausalLM")  # the second model loads bit-exact too
    assert set(second["rank0"]["state"]) == set(want)
    for key, value in want.items():
        got = second["rank0"]["state"][key]
        assert got.dtype == value.dtype and torch.equal(got, value), key
