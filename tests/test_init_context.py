"""The init-context decision: ZeRO-3 -> meta skeleton with ZeRO-3 partitions; ZeRO-1/2 -> meta and straight onto
the device through transformers; a model that cannot be built on meta -> zero.Init (transformers' path)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.checkpoints import make_checkpoint, make_config
from tests.conftest import run_torchrun
from tests.dist_worker import TRAINER_STYLE_CONFIG


def _plain_state(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return {n: t.detach() for n, t in [*model.named_parameters(remove_duplicate=False),
                                        *model.named_buffers(remove_duplicate=False)]}


@pytest.fixture(scope="module")
def dumps(workdir):
    qwen = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    llama = make_checkpoint(os.path.join(workdir, "llama_untied"), "llama_untied")
    stage2 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    cases = [
        {"name": "zero2", "path": qwen, "dtype": "float32", "ds_config": stage2, "train_steps": 2,
         "kwargs": {"experts_implementation": "eager"}, "out": os.path.join(workdir, "ctx_zero2.pt")},
        {"name": "meta_hostile", "path": llama, "dtype": "float32",
         "model_class": "tests.custom_models:MetaHostileLlamaForCausalLM", "out": os.path.join(workdir, "ctx_hostile.pt")},
        {"name": "forced_zero_init", "path": qwen, "dtype": "float32", "kwargs": {"init_context": "zero.Init"},
         "out": os.path.join(workdir, "ctx_forced.pt")},
        # the script wraps the load in its own `with deepspeed.zero.Init(config_dict_or_path=...)`
        {"name": "in_callers_zero_init", "path": qwen, "dtype": "bfloat16", "callers_zero_init": {},
         "out": os.path.join(workdir, "ctx_callers.pt")},
        {"name": "in_callers_zero_init_other_dtype", "path": llama, "dtype": "bfloat16",
         "callers_zero_init": {"dtype": "float32"}, "out": os.path.join(workdir, "ctx_callers_fp32.pt")},
        {"name": "meta_hostile_in_callers_zero_init", "path": llama, "dtype": "float32", "callers_zero_init": {},
         "model_class": "tests.custom_models:MetaHostileLlamaForCausalLM",
         "out": os.path.join(workdir, "ctx_callers_hostile.pt")},
        {"name": "trainer_style_config", "path": qwen, "dtype": "float32", "ds_config": TRAINER_STYLE_CONFIG,
         "out": os.path.join(workdir, "ctx_trainer_style.pt")},
    ]
    return {c["name"]: d for c, d in zip(cases, run_torchrun(2, cases, workdir))}


def test_zero2_loads_onto_the_device_with_transformers_and_trains(dumps, workdir):
    got = dumps["zero2"]["rank0"]
    assert "error" not in got, got.get("error", {}).get("traceback")
    assert got["report"]["init_context"] == "meta" and "stage 2" in got["report"]["reason"]
    ref = _plain_state(os.path.join(workdir, "qwen3_moe"))
    for name, expected in ref.items():
        assert got["state"][name].dtype == expected.dtype and torch.equal(got["state"][name], expected), name
    assert len(got["losses"]) == 2


@pytest.mark.parametrize("name", ["meta_hostile", "meta_hostile_in_callers_zero_init"])
def test_model_that_cannot_be_built_on_meta_falls_back_to_zero_init(dumps, workdir, name):
    """Inside the script's own zero.Init too: transformers' path nests in it, as without this library."""
    from safetensors.torch import load_file

    from tests.custom_models import MetaHostileLlamaForCausalLM

    got = dumps[name]["rank0"]
    assert "error" not in got, got.get("error", {}).get("traceback")
    assert got["report"]["init_context"] == "zero.Init"
    assert "cannot be built on meta" in got["report"]["reason"]
    # plain from_pretrained builds on meta too, so the reference is built on CPU and loaded by hand
    model = MetaHostileLlamaForCausalLM(make_config("llama_untied")).eval()
    model.load_state_dict(load_file(os.path.join(workdir, "llama_untied", "model.safetensors")))
    for name, p in model.named_parameters():
        assert torch.equal(got["state"][name], p.detach()), name


def test_init_context_can_be_forced(dumps, workdir):
    got = dumps["forced_zero_init"]["rank0"]
    assert "error" not in got, got.get("error", {}).get("traceback")
    assert got["report"]["init_context"] == "zero.Init"
    ref = _plain_state(os.path.join(workdir, "qwen3_moe"))
    for name, expected in ref.items():
        assert torch.equal(got["state"][name], expected), name


def test_a_config_written_for_the_trainer_loads_as_the_plain_load(dumps, workdir):
    """Its "auto" batch sizes are resolved as accelerate resolves them for `zero.Init` (DeepSpeed's config parser
    failed on the strings: "'>' not supported between instances of 'str' and 'int'")."""
    from hf_zero3_loader.deepspeed_setup import find_deepspeed_setup

    got = dumps["trainer_style_config"]["rank0"]
    assert "error" not in got, got.get("error", {}).get("traceback")
    assert got["report"]["init_context"] == "zero3-meta"
    ref = _plain_state(os.path.join(workdir, "qwen3_moe"))
    for name, expected in ref.items():
        assert got["state"][name].dtype == expected.dtype and torch.equal(got["state"][name], expected), name
    config = find_deepspeed_setup(TRAINER_STYLE_CONFIG).config
    assert config["train_micro_batch_size_per_gpu"] == config["gradient_accumulation_steps"] == 1
    assert "train_batch_size" not in config and TRAINER_STYLE_CONFIG["train_batch_size"] == "auto"  # a copy


def test_deepspeed_config_is_found_where_transformers_and_accelerate_put_it(tmp_path, monkeypatch):
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from hf_zero3_loader.deepspeed_setup import find_deepspeed_setup

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    assert find_deepspeed_setup(config).found_via == "ds_config argument"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    assert find_deepspeed_setup(str(path)).stage == 3
    assert find_deepspeed_setup(None) is None

    keep = HfDeepSpeedConfig(config)  # what the Trainer creates: transformers holds a weakref
    try:
        setup = find_deepspeed_setup(None)
        assert setup.found_via == "transformers HfDeepSpeedConfig" and setup.dtype == torch.bfloat16
    finally:
        unset_hf_deepspeed_config()
        del keep

    # `accelerate launch --use_deepspeed` before Accelerator() exists: only the environment says it
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    assert find_deepspeed_setup(None).found_via == "accelerate launch environment"
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    setup = find_deepspeed_setup(None)
    assert setup.stage == 3 and setup.dtype == torch.bfloat16


def test_hub_id_from_the_local_cache(workdir, monkeypatch):
    """A hub id already in the local cache resolves through transformers (offline), and loads equal to plain; with
    `cache_dir=` too, where a rank whose cache lacks it (a node's own local cache) receives its bytes from one that
    has it instead of failing in transformers' offline download. `revision=` picks its own snapshot (a tag's other
    weights, files linked into `blobs/` as the hub lays them out), on the ranks that read and the one streamed to."""
    from transformers import AutoModelForCausalLM

    src = make_checkpoint(os.path.join(workdir, "qwen3_moe_sharded"), "qwen3_moe", sharded=True)
    cache = os.path.join(workdir, "hub_cache")
    snapshot = os.path.join(cache, "models--local--tiny-qwen3-moe", "snapshots", "0" * 40)
    if not os.path.exists(snapshot):
        os.makedirs(os.path.join(cache, "models--local--tiny-qwen3-moe", "refs"))
        with open(os.path.join(cache, "models--local--tiny-qwen3-moe", "refs", "main"), "w") as f:
            f.write("0" * 40)
        shutil.copytree(src, snapshot)
        tagged = os.path.join(cache, "models--local--tiny-qwen3-moe", "snapshots", "1" * 40)
        blobs = os.path.join(cache, "models--local--tiny-qwen3-moe", "blobs")
        os.makedirs(blobs)
        other = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(1.0)
        other.save_pretrained(os.path.join(workdir, "qwen3_moe_tag_v1"), max_shard_size="40KB")
        os.makedirs(tagged)
        for name in os.listdir(os.path.join(workdir, "qwen3_moe_tag_v1")):
            shutil.copy(os.path.join(workdir, "qwen3_moe_tag_v1", name), os.path.join(blobs, name))
            os.symlink(os.path.join("..", "..", "blobs", name), os.path.join(tagged, name))
        with open(os.path.join(cache, "models--local--tiny-qwen3-moe", "refs", "v1"), "w") as f:
            f.write("1" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    empty_cache = os.path.join(workdir, "hub_cache_empty")
    os.makedirs(empty_cache, exist_ok=True)
    case = {"name": "hub", "path": "local/tiny-qwen3-moe", "dtype": "float32", "out": os.path.join(workdir, "hub.pt")}
    cache_dir = {**case, "name": "cache_dir", "out": os.path.join(workdir, "hub_cache_dir.pt"),
                 "kwargs_by_rank": {"0": {"cache_dir": cache}, "1": {"cache_dir": empty_cache}}}
    revision = {**case, "name": "revision", "out": os.path.join(workdir, "hub_revision.pt"),
                "kwargs": {"revision": "v1"}}
    revision_streamed = {**cache_dir, "name": "revision_streamed", "out": os.path.join(workdir, "hub_rev_stream.pt"),
                         "kwargs": {"revision": "v1"}}
    dumps = run_torchrun(2, [case, cache_dir, revision, revision_streamed], workdir)
    plain_main = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    plain_v1 = AutoModelForCausalLM.from_pretrained(os.path.join(workdir, "qwen3_moe_tag_v1"), dtype=torch.float32)
    for dump, plain in zip(dumps, (plain_main, plain_main, plain_v1, plain_v1)):
        got = dump["rank0"]
        assert "error" not in got, got.get("error", {}).get("traceback")
        want = dict([*plain.named_parameters(), *plain.named_buffers()])
        assert set(got["state"]) == set(want)
        for name, p in want.items():
            assert got["state"][name].dtype == p.dtype and torch.equal(got["state"][name], p.detach()), name
        assert got["generation_config"] == plain.generation_config.to_dict()
    for streamed in (dumps[1], dumps[3]):
        receiver = streamed["ranks"][1]["report"]
        assert receiver["bytes_read"] == 0 and receiver["stream"]["bytes_received"] == receiver["bytes_to_read"] > 0


def test_a_load_inside_the_callers_own_zero_init_context(dumps, workdir):
    """`with deepspeed.zero.Init(config_dict_or_path=ds_config): from_pretrained(...)` (older scripts, DeepSpeed's
    docs): its patched constructors partitioned the meta skeleton as it was built (a size-mismatch error from
    transformers on every rank). The context is paused while the load builds its partitions, patches again after."""
    got = dumps["in_callers_zero_init"]["rank0"]
    assert "error" not in got, got.get("error", {}).get("traceback")
    assert got["report"]["init_context"] == "zero3-meta"
    ref = _plain_state(os.path.join(workdir, "qwen3_moe"), torch.bfloat16)
    assert set(got["state"]) == set(ref)
    for name, expected in ref.items():
        assert got["state"][name].dtype == expected.dtype and torch.equal(got["state"][name], expected), name
    assert not any("zero.Init" in w for w in got["warnings"]), got["warnings"]


def test_a_callers_zero_init_of_another_dtype_is_named_and_the_config_wins(dumps, workdir):
    got = dumps["in_callers_zero_init_other_dtype"]["rank0"]
    assert "error" not in got, got.get("error", {}).get("traceback")
    ref = _plain_state(os.path.join(workdir, "llama_untied"), torch.bfloat16)
    for name, expected in ref.items():
        assert got["state"][name].dtype == expected.dtype and torch.equal(got["state"][name], expected), name
    assert any("deepspeed.zero.Init" in w and "torch.float32" in w for w in got["warnings"]), got["warnings"]
