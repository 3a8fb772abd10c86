"""NVMe parameter offload (`offload_param: {device: nvme}`, ZeRO-Infinity): each rank reads its partitions in waves
of at most `staging_bytes`, writing each wave to DeepSpeed's swap files and freeing it (`nvme_offload.py`); missing
keys' partitions go out once initialised; ties are checked on partitions swapped back in. Gathered, they equal the
plain load bit for bit; trained, the losses are transformers' own ZeRO-3 path's. Needs DeepSpeed's async_io op
(built on first use against libaio, which `scripts/dev.sh` installs where it can); skipped where it cannot be
built."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from hf_zero3_loader.deepspeed_setup import async_io_buildable
from tests.checkpoints import make_checkpoint, rewrite_checkpoint
from tests.conftest import run_nodes, run_torchrun
from tests.dist_worker import ds_config_for


pytestmark = pytest.mark.skipif(not async_io_buildable(), reason="DeepSpeed's async_io op needs libaio")
TORCH_ADAM = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
WAVE = 2 << 20  # staging_bytes: the most loaded partition bytes a rank holds before swapping them out


def nvme_config(dtype: str, swap_folder: str) -> dict:
    """Few swap buffers (4 of 1M elements): a load swaps out more partitions than that, in groups."""
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap_folder, "buffer_count": 4,
                                          "buffer_size": 1 << 20, "max_in_cpu": 0}}
    return ds_config_for(dtype, {"zero_optimization": zero, **TORCH_ADAM})


def _moe_config(tie: bool = False, vocab_size: int = 4096):
    """DeepSpeed swaps only partitions of at least 1 MiB (smaller ones stay in host memory, as zero.Init leaves
    them): fused experts of 8 x 512 x 512 and the 4096 x 512 embedding and head (4 MiB each in bf16) give each of 3
    ranks one."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=512, head_dim=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                          moe_intermediate_size=256, num_experts=8,
                          num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=tie,
                          pad_token_id=0, eos_token_id=1, bos_token_id=None)


@functools.lru_cache(maxsize=None)
def _plain(path: str, dtype: str, model_class: str, seed: int, kwargs: tuple = ()) -> dict:
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_class).from_pretrained(path, dtype=getattr(torch, dtype), **dict(kwargs))
    return {n: t.detach() for n, t in [*model.named_parameters(remove_duplicate=False),
                                        *model.named_buffers(remove_duplicate=False)]}


def test_partitions_swapped_out_to_nvme_equal_the_plain_load_at_3_ranks(workdir):
    """3 ranks do not divide the tensors; a MoE cast to the bf16 engine, read in waves of at most 2 MiB; a tied one
    in fp32; a classifier whose head is missing (initialised from the seed before it goes out); and a checkpoint whose
    config ties the head to the embedding but whose head differs (the plain load unties them: the comparison must
    see the swapped-out values, not the swapper's placeholder)."""
    moe = make_checkpoint(os.path.join(workdir, "nvme_qwen3_moe"), "qwen3_moe", config=_moe_config())
    tied = make_checkpoint(os.path.join(workdir, "nvme_qwen3_moe_tied"), "qwen3_moe", config=_moe_config(tie=True))
    tied_but_different = rewrite_checkpoint(moe, os.path.join(workdir, "nvme_tied_but_different"),
                                            lambda t: t, {"tie_word_embeddings": True})
    cases = [
        {"name": "moe", "path": moe, "dtype": "bfloat16", "model_class": "AutoModelForCausalLM", "seed": 0,
         "kwargs": {"staging_bytes": WAVE}},
        {"name": "tied", "path": tied, "dtype": "float32", "model_class": "AutoModelForCausalLM", "seed": 0},
        {"name": "classifier", "path": tied, "dtype": "float32", "model_class": "AutoModelForSequenceClassification",
         "seed": 7, "kwargs": {"num_labels": 3}},
        {"name": "tied but different", "path": tied_but_different, "dtype": "bfloat16",
         "model_class": "AutoModelForCausalLM", "seed": 0},
    ]
    for case in cases:
        case.update(ds_config=nvme_config(case["dtype"], os.path.join(workdir, "nvme_swap", case["name"])),
                    out=os.path.join(workdir, f"nvme_{case['name']}.pt"))
    # swap buffers smaller than a partition: refused on every rank with the size to ask for (zero.Init asserts)
    small = nvme_config("bfloat16", os.path.join(workdir, "nvme_swap", "small"))
    small["zero_optimization"]["offload_param"]["buffer_size"] = 1 << 18
    dumps = run_torchrun(3, [*cases, {**cases[0], "name": "small buffers", "ds_config": small,
                                      "out": os.path.join(workdir, "nvme_small.pt")}], workdir)
    for got in dumps.pop()["ranks"]:
        assert got["error"]["type"] == "ConfigError", got["error"]
        assert "do not fit DeepSpeed's NVMe swap buffers of offload_param.buffer_size=262144" in got["error"]["message"]
    for case, dump in zip(cases, dumps):
        for rank, got in enumerate(dump["ranks"]):
            assert "error" not in got, f"{case['name']}: {got.get('error', {}).get('traceback')}"
            nvme = got["report"]["nvme"]
            # every partition large enough for the swapper lives in its swap file, its host copy freed
            assert nvme["partitions_swapped_out"] == got["partitions"]["on_nvme"] > 0, (case["name"], rank, nvme)
            assert nvme["bytes_swapped_out"] > 0
            swap = os.path.join(case["ds_config"]["zero_optimization"]["offload_param"]["nvme_path"], "zero_stage_3",
                                f"{case['dtype']}params", f"rank{rank}")
            assert len(os.listdir(swap)) == nvme["partitions_swapped_out"], (case["name"], rank)
            if case["name"] == "moe":  # no wave larger than the budget, but for one partition larger than it
                largest = got["report"]["largest_partition_numel"] * 2  # bf16
                assert nvme["waves"] >= 3 and nvme["largest_wave_bytes"] <= max(WAVE, largest), nvme
        got = dump["rank0"]
        want = _plain(case["path"], case["dtype"], case["model_class"], case["seed"],
                      tuple(sorted((k, v) for k, v in case.get("kwargs", {}).items() if k != "staging_bytes")))
        assert set(got["state"]) == set(want), case["name"]
        for name, expected in want.items():
            actual = got["state"][name]
            assert actual.dtype == expected.dtype and torch.equal(actual, expected), f"{case['name']} {name}"
        if case["name"] == "tied but different":
            assert got["sharing"] == [] and not torch.equal(want["lm_head.weight"], want["model.embed_tokens.weight"])


def test_a_rank_streamed_its_bytes_swaps_them_out_in_waves_as_they_arrive(workdir):
    """Two nodes, only the first with the files: the second receives its partitions from the first and swaps each
    wave of completed ones out as the stream fills them (it held its whole share until the end before)."""
    path = make_checkpoint(os.path.join(workdir, "nvme_stream_qwen3_moe"), "qwen3_moe", config=_moe_config())
    case = {"name": "streamed", "path_by_node": {"0": path, "1": "/nonexistent/checkpoint"}, "dtype": "bfloat16",
            "kwargs": {"staging_bytes": WAVE, "stream_chunk_bytes": 1 << 20},
            "ds_config": nvme_config("bfloat16", os.path.join(workdir, "nvme_swap", "streamed")),
            "out": os.path.join(workdir, "nvme_streamed.pt")}
    (dump,) = run_nodes(2, 1, [case], workdir)
    for got in dump["ranks"]:
        assert "error" not in got, got.get("error", {}).get("traceback")
        nvme = got["report"]["nvme"]
        assert nvme["partitions_swapped_out"] == got["partitions"]["on_nvme"] > 0, nvme
    receiver = dump["ranks"][1]
    assert receiver["report"]["stream"]["receives_from"] == 0 and receiver["report"]["bytes_read"] == 0
    nvme, largest = receiver["report"]["nvme"], receiver["report"]["largest_partition_numel"] * 2  # bf16
    # a wave goes out once it reaches the budget: at most the budget plus one partition
    assert nvme["waves"] >= 3 and nvme["largest_wave_bytes"] < WAVE + largest, nvme
    want = _plain(path, "bfloat16", "AutoModelForCausalLM", 0)
    assert set(dump["rank0"]["state"]) == set(want)
    for name, expected in want.items():
        actual = dump["rank0"]["state"][name]
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), name


def test_training_from_nvme_partitions_equals_transformers_own_zero3_path(workdir):
    """The engine swaps the partitions in and out as it would after zero.Init: the same losses. (The experts go to
    NVMe here, the 1024-word embedding and head stay in host memory: with the 4096-word ones on NVMe too, DeepSpeed
    0.19.8's swapper fails in the first forward pass, "already assigned swap buffer" or "Not enough buffers", on
    transformers' path as on ours.)"""
    path = make_checkpoint(os.path.join(workdir, "nvme_train_qwen3_moe"), "qwen3_moe", dtype=torch.bfloat16,
                           config=_moe_config(vocab_size=1024))
    cases = [{"name": variant, "path": path, "dtype": "bfloat16", "upstream": variant == "upstream",
              "ds_config": nvme_config("bfloat16", os.path.join(workdir, "nvme_swap", f"train_{variant}")),
              "train_steps": 2, "out": os.path.join(workdir, f"nvme_train_{variant}.pt")}
             for variant in ("ours", "upstream")]
    # the model's own save_pretrained cannot write partitions that live in swap files without a gather: refused on
    # every rank with what to use instead (transformers' own writes them as empty tensors)
    cases[0]["save"] = {"dir": os.path.join(workdir, "nvme_saved"), "direct": True}
    # a second model loaded while the first lives (TRL's reference model): DeepSpeed's new swapper would empty the
    # first's swap folder (on transformers' path its next gather fails), so it swaps to a folder of its own
    cases[0]["load_again"] = True
    ours, upstream = run_torchrun(2, cases, workdir)
    for dump in (ours, upstream):
        assert "error" not in dump["rank0"], dump["rank0"].get("error", {}).get("traceback")
    assert ours["rank0"]["report"]["init_context"] == "zero3-meta"
    # at 2 ranks, which divide every tensor here, the load (gathered before training) is the plain load too
    want = _plain(path, "bfloat16", "AutoModelForCausalLM", 0)
    assert set(ours["rank0"]["state"]) == set(want)
    for name, expected in want.items():
        actual = ours["rank0"]["state"][name]
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), name
    assert ours["rank0"]["losses"] == upstream["rank0"]["losses"]  # the first model, trained after the second load
    nvme_path = cases[0]["ds_config"]["zero_optimization"]["offload_param"]["nvme_path"]
    for rank, got in enumerate(ours["ranks"]):
        again = got["again"]
        assert again["nvme_path"] == os.path.join(nvme_path, "hf_zero3_loader_model1"), again["nvme_path"]
        assert again["report"]["nvme"]["partitions_swapped_out"] == got["report"]["nvme"]["partitions_swapped_out"]
        assert any("holds the swap files of another model" in w for w in got["warnings"]), got["warnings"]
        for folder in (nvme_path, again["nvme_path"]):
            assert os.listdir(os.path.join(folder, "zero_stage_3", "bfloat16params", f"rank{rank}"))
    for name, expected in want.items():
        actual = ours["rank0"]["again"]["state"][name]
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), name
    for got in ours["ranks"]:
        error = got["save_error"]
        assert error["type"] == "ConfigError" and "swapped out to NVMe" in error["message"], error
        assert "Trainer or accelerate" in error["message"]
    assert not os.path.exists(os.path.join(workdir, "nvme_saved", "config.json"))
