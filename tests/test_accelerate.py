"""No call-site changes: `import hf_zero3_loader.auto` under a real `accelerate launch --use_deepspeed`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests.checkpoints import make_checkpoint
from tests.conftest import ROOT, free_port, python_path


def accelerate_launch(ds_config_file: str, script: str, *args: str) -> None:
    """`accelerate launch --use_deepspeed --num_processes 2 --deepspeed_config_file F tests/SCRIPT ARGS`."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "2",
           "--deepspeed_config_file", ds_config_file, "--main_process_port", str(free_port()),
           os.path.join(ROOT, "tests", script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"})
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
    Accelerator.prepare (deepspeed.initialize with the same file) accepts it, and AdamW steps run."""
    from tests.checkpoints import ep_config

    path = make_checkpoint(os.path.join(workdir, "ep_qwen3_moe"), "qwen3_moe", config=ep_config("qwen3_moe"))
    config = os.path.join(workdir, "ds_zero3_ep.json")
    with open(config, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": 3},
                   "expert_parallel": {"enabled": True, "autoep_size": 2, "use_grouped_mm": False}}, f)
    out = os.path.join(workdir, "accelerate_ep.pt")
    accelerate_launch(config, "accelerate_ep_script.py", path, out)
    ranks = torch.load(out, weights_only=False)
    for rank, got in enumerate(ranks):
        assert got["report"]["init_context"] == "ep-meta", got["report"]
        assert got["report"]["expert_parallel"]["ep_rank"] == rank
        assert got["report"]["expert_parallel"]["local_experts"] == [[0, 1, 2], [3, 4, 5]][rank]
        assert all(torch.isfinite(torch.tensor(got["losses"])))
    # the same batch on both ranks: the same loss, up to the order in which each rank's experts see the tokens
    assert torch.allclose(torch.tensor(ranks[0]["losses"]), torch.tensor(ranks[1]["losses"]), rtol=1e-5)


def test_without_zero3_the_hook_leaves_from_pretrained_alone(workdir):
    from transformers import AutoModelForCausalLM

    from hf_zero3_loader.integrations.transformers_hook import install, uninstall

    path = make_checkpoint(os.path.join(workdir, "llama_untied"), "llama_untied")
    install()
    try:
        model = AutoModelForCausalLM.from_pretrained(path)
    finally:
        uninstall()
    assert not hasattr(model, "hf_zero3_load_report")
    plain = AutoModelForCausalLM.from_pretrained(path)
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, b), name
