"""No call-site changes: `import hf_zero3_loader.auto` under a real `accelerate launch --use_deepspeed`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.conftest import ROOT, free_port, python_path


def accelerate_launch(ds_config_file: str, script: str, *args: str, env: dict | None = None,
                      launch_args: tuple = ()) -> None:
    """`accelerate launch --use_deepspeed --num_processes 2 --deepspeed_config_file F [LAUNCH_ARGS] tests/SCRIPT ARGS`."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "2",
           "--deepspeed_config_file", ds_config_file, "--main_process_port", str(free_port()), *launch_args,
           os.path.join(ROOT, "tests", script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-6000:]


def test_accelerate_launch_routes_from_pretrained_through_the_loader(workdir):
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    config = os.path.join(workdir, "ds_zero3.json")
    with open(config, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}, f)
    out = os.path.join(workdir, "accelerate.pt")
    accelerate_launch(config, "accelerate_script.py", path, out)
    got = torch.load(out, weights_only=False)
    assert got["report"]["init_context"] == "zero3-meta"
    assert "accelerate launch environment" in got["report"]["reason"]
    plain = AutoModelForCausalLM.from_pretrained(path)
    for name, p in plain.named_parameters():
        assert torch.equal(got["state"][name], p.detach()), name


def test_accelerate_launch_with_expert_parallel_in_the_config_file_trains(workdir):
    """The DeepSpeed config file accelerate users have, with `expert_parallel`: the load builds the EP layout,
    Accelerator.prepare (deepspeed.initialize with the same file) accepts it, AdamW steps run, and
    `accelerator.save_model` saves it (its `get_state_dict`, refused under EP, names that save). The launch also
    names the MoE block as a ZeRO-3 leaf module (`deepspeed_moe_layer_cls_names`, as accelerate suggests for MoE
    models): the AutoEP layers replaced every such block at load, so prepare would find none and raise; the name is
    dropped, as engine-side AutoEP drops the marks of the blocks it replaces (the losses then equal engine-side
    AutoEP's, checked by hand on 2026-11-29: the same two losses bit for bit on both ranks)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.checkpoints import ep_config

    path = make_checkpoint(os.path.join(workdir, "ep_qwen3_moe"), "qwen3_moe", config=ep_config("qwen3_moe"))
    config = os.path.join(workdir, "ds_zero3_ep.json")
    with open(config, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": 3},
                   "expert_parallel": {"enabled": True, "autoep_size": 2, "use_grouped_mm": False}}, f)
    out = os.path.join(workdir, "accelerate_ep.pt")
    accelerate_launch(config, "accelerate_ep_script.py", path, out,
                      launch_args=("--deepspeed_moe_layer_cls_names", "Qwen3MoeSparseMoeBlock"))
    ranks = torch.load(out, weights_only=False)
    for rank, got in enumerate(ranks):
        assert got["moe_leaf_names"] == ("Qwen3MoeSparseMoeBlock", None), got["moe_leaf_names"]  # before, after load
        assert got["report"]["init_context"] == "ep-meta", got["report"]
        assert got["report"]["expert_parallel"]["ep_rank"] == rank
        assert got["report"]["expert_parallel"]["local_experts"] == [[0, 1, 2], [3, 4, 5]][rank]
        assert all(torch.isfinite(torch.tensor(got["losses"])))
    # the same batch on both ranks: the same loss, up to the order in which each rank's experts see the tokens
    assert torch.allclose(torch.tensor(ranks[0]["losses"]), torch.tensor(ranks[1]["losses"]), rtol=1e-5)
    # accelerate's documented save needs a consolidated state dict: refused by accelerate without
    # `stage3_gather_16bit_weights_on_model_save`, by DeepSpeed under EP with it, on every rank; each refusal names
    # the save that works, and that save writes what accelerate's own save writes: the plain model's tensors, whole
    for got in ranks:
        without, under_ep = got["state_dict_errors"]
        assert without.startswith("ValueError: Cannot get 16bit model weights") and "AutoEP" not in without, without
        assert under_ep.startswith("NotImplementedError") and "not supported for AutoEP" in under_ep, under_ep
        assert all("accelerator.save_model(model, folder)" in e for e in (without, under_ep))
    written = load_file(os.path.join(out + ".saved", "model.safetensors"))
    plain = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in plain.items()}


@pytest.mark.sweep
def test_accelerates_documented_save_with_a_gathered_state_dict_writes_as_without_the_import(workdir):
    """accelerate's documented ZeRO-3 save (`save_pretrained(..., state_dict=accelerator.get_state_dict(model))`, as
    transformers' `run_*_no_trainer.py` examples save): the state dict is gathered on rank 0 and None on the others,
    and every rank takes the original method, as without the import (before, the ranks given None entered the
    collective save alone and failed after the 300 s join timeout). `state_dict=None` on a rank that writes is refused
    there (the original would write every partitioned parameter empty); the save without a gather writes the same
    file. The same for a LoRA adapter (PEFT's `save_pretrained`, which gathered the adapter on the ranks given None
    while rank 0 did not)."""
    import filecmp

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.checkpoints import ep_config

    path = make_checkpoint(os.path.join(workdir, "ep_qwen3_moe"), "qwen3_moe", config=ep_config("qwen3_moe"))
    config = os.path.join(workdir, "ds_zero3_gather_on_save.json")
    with open(config, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}, f)
    for lora in (False, True):
        out = os.path.join(workdir, f"accelerate_documented_save{'_lora' if lora else ''}")
        accelerate_launch(config, "accelerate_save_script.py", path, out, *(("--lora",) if lora else ()))
        dump = torch.load(os.path.join(out, "dump.pt"), weights_only=False)
        assert dump["ranks"][0]["state_dict"] > 0 and dump["ranks"][1]["state_dict"] is None
        for r in dump["ranks"]:
            assert r["refused"]["type"] == "ConfigError" and "state_dict=None" in r["refused"]["message"], r
        weights = "adapter_model.safetensors" if lora else "model.safetensors"
        assert not os.path.exists(os.path.join(out, "empty", weights))
        assert filecmp.cmp(*(os.path.join(out, folder, weights) for folder in ("documented", "without_a_gather")),
                           shallow=False)
        if lora:  # the trained LoRA tensors, under PEFT's names
            written = load_file(os.path.join(out, "documented", weights))
            assert sorted(written) == sorted(k.replace(".default", "") for k in dump["gathered"]) and len(written) == 8
            assert all(torch.equal(written[k.replace(".default", "")], v) for k, v in dump["gathered"].items())
            continue
        loaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, "documented"))  # loads back as trained
        state = dict(loaded.named_parameters())
        assert set(state) == set(dump["gathered"])
        assert all(torch.equal(state[k].detach(), v) for k, v in dump["gathered"].items())


def test_the_launch_environment_gives_the_config_accelerate_trains_with(workdir, monkeypatch):
    """A model loaded before the script's Accelerator exists: the config is what accelerate's own DeepSpeedPlugin
    makes of the launch's environment, as the Accelerator will. With a config file, its "auto" precision is filled
    from --mixed_precision (it was left "auto": the load did not know the engine's dtype) and its "auto" batch sizes
    resolved as accelerate resolves them for zero.Init; without one, accelerate's own flags (`--zero_stage 3
    --offload_param_device cpu`), offload included (only the stage and precision were read before); an NVMe folder
    the launcher did not forward ("none") is warned of."""
    from hf_zero3_loader.deepspeed_setup import DeepSpeedSetup, _from_accelerate_env
    from tests.dist_worker import CapturedWarnings

    config_file = os.path.join(workdir, "ds_zero3_auto.json")
    with open(config_file, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                   "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 3},
                   "bf16": {"enabled": "auto"}}, f)
    for name in [n for n in os.environ if n.startswith("ACCELERATE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", config_file)
    config, zero_init = _from_accelerate_env()
    assert DeepSpeedSetup(config, "test").dtype == torch.bfloat16 and zero_init  # ZeRO-3 builds under zero.Init
    assert config["train_micro_batch_size_per_gpu"] == config["gradient_accumulation_steps"] == 1
    assert "train_batch_size" not in config
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "cpu")
    config, _ = _from_accelerate_env()
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert DeepSpeedSetup(config, "test").dtype == torch.bfloat16
    # accelerate's launcher does not forward --offload_param_nvme_path: its plugin's folder is "none", said aloud
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "nvme")
    with CapturedWarnings() as warned:
        config, _ = _from_accelerate_env()
    assert config["zero_optimization"]["offload_param"]["nvme_path"] == "none"
    assert any("offload_param.nvme_path is 'none'" in w and "./none" in w for w in warned.messages), warned.messages
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false")  # `--zero3_init_flag false`
    assert _from_accelerate_env()[1] is False


def test_zero3_init_flag_false_loads_the_whole_model_as_transformers_does(workdir):
    """`accelerate launch --zero3_init_flag false` (or `zero3_init_flag: false` in accelerate's config) asks for
    models built whole, partitioned only by `deepspeed.initialize`. A model loaded before the script's Accelerator
    exists is then whole on every rank in the plain load, and stays so with the import (a script that edits its
    weights before `prepare` would otherwise write into empty partitions); the explicit `from_pretrained` does the
    same and says why. Once the Accelerator or TrainingArguments exist, accelerate 1.15 hands transformers the config
    whatever the flag, and both paths build the model partitioned (by hand, accelerate 1.15)."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    config = os.path.join(workdir, "ds_zero3.json")
    with open(config, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}, f)
    out = os.path.join(workdir, "accelerate_zero3_init_off.pt")
    accelerate_launch(config, "accelerate_script.py", path, out, env={"ACCELERATE_DEEPSPEED_ZERO3_INIT": "false"})
    got = torch.load(out, weights_only=False)
    assert got["report"] is None and got["partitioned"] is False  # transformers' own load, untouched
    assert got["explicit_report"]["init_context"] == "meta"
    assert "zero3_init_flag false" in got["explicit_report"]["reason"], got["explicit_report"]
    plain = AutoModelForCausalLM.from_pretrained(path)
    for name, p in plain.named_parameters():
        assert torch.equal(got["state"][name], p.detach()), name


def test_without_zero3_the_hook_leaves_from_pretrained_alone(workdir):
    """...and says so, once, on rank 0: a user can tell the import is active, and why it did nothing."""
    import logging

    from transformers import AutoModelForCausalLM

    from hf_zero3_loader.integrations.transformers_hook import install, uninstall

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    path = make_checkpoint(os.path.join(workdir, "llama_untied"), "llama_untied")
    lines = Lines()
    logging.getLogger("hf_zero3_loader").addHandler(lines)
    install()
    try:
        model = AutoModelForCausalLM.from_pretrained(path)
    finally:
        uninstall()
        logging.getLogger("hf_zero3_loader").removeHandler(lines)
    assert not hasattr(model, "hf_zero3_load_report")
    said = [m for m in lines.messages if m.startswith("import hf_zero3_loader.auto: ")]
    assert len(said) == 1 and f"from_pretrained({path}) loads as transformers does" in said[0] and \
        "no DeepSpeed config found" in said[0], lines.messages
    plain = AutoModelForCausalLM.from_pretrained(path)
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, b), name


def test_the_shipped_accelerate_configs_hold_their_deepspeed_config():
    """scripts/accelerate/*.yaml hold their DeepSpeed config as JSON text (accelerate reads it as it reads a file),
    the same as the ds_*.json beside them; the loader reads it the same way. A config file given by a relative path
    that is not there from the working directory is named, with that directory (accelerate says only "Expected a
    string path to an existing deepspeed config")."""
    import pytest
    import yaml

    from hf_zero3_loader.deepspeed_setup import accelerate_config_file
    from hf_zero3_loader.errors import ConfigError

    folder = os.path.join(ROOT, "scripts", "accelerate")
    for name in ("zero3", "zero3_ep"):
        with open(os.path.join(folder, f"{name}.yaml")) as f:
            inline = yaml.safe_load(f)["deepspeed_config"]["deepspeed_config_file"]
        with open(os.path.join(folder, f"ds_{name}.json")) as f:
            assert json.loads(inline) == json.load(f), name
        assert accelerate_config_file(inline) == json.loads(inline)
    with pytest.raises(ConfigError, match=r"'scripts/accelerate/nothing\.json', does not exist \(a relative path, "
                                          r"opened from the working directory"):
        accelerate_config_file("scripts/accelerate/nothing.json")


@pytest.mark.sweep
def test_the_shipped_accelerate_config_trains_from_another_folder(workdir):
    """`accelerate launch --config_file <repo>/scripts/accelerate/zero3.yaml` run from a folder of the user's own (it
    named its DeepSpeed config by a path relative to the repository: accelerate failed from anywhere else): the
    example script loads into ZeRO-3 partitions, trains and saves."""
    from tests.checkpoints import add_word_tokenizer, trainable_moe_config

    model = add_word_tokenizer(make_checkpoint(os.path.join(workdir, "trl_qwen3_moe"), "qwen3_moe",
                                               config=trainable_moe_config()), 101)
    elsewhere = os.path.join(workdir, "a_users_folder")
    os.makedirs(elsewhere, exist_ok=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(ROOT, "scripts", "accelerate", "zero3.yaml"), "--main_process_port", str(free_port()),
           os.path.join(ROOT, "scripts", "finetune_moe.py"), "--model", model, "--output-dir", "run",
           "--max-steps", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=elsewhere,
                          env={**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "finetune_moe: 3 steps" in proc.stdout and "loaded into ZeRO-3 partitions;" in proc.stdout, proc.stdout
    assert "loaded " + model + " on 2 ranks in" in proc.stderr, proc.stderr[-4000:]
    assert {"model.safetensors", "config.json"} <= set(os.listdir(os.path.join(elsewhere, "run")))
