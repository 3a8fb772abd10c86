"""A user's script, unchanged but for one import: run by tests under a real `accelerate launch --use_deepspeed`."""

import os
import sys

import hf_zero3_loader
import hf_zero3_loader.auto  # noqa: F401  (the only line a user adds)
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

path, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(path)  # the call site stays as it is
import deepspeed  # noqa: E402

state = {}
for name, p in model.named_parameters():
    with deepspeed.zero.GatheredParameters([p]):
        state[name] = p.detach().clone()
report = getattr(model, "hf_zero3_load_report", None)
explicit = hf_zero3_loader.from_pretrained(AutoModelForCausalLM, path).hf_zero3_load_report  # the API, called as such
if int(os.environ["RANK"]) == 0:  # a whole-model load (zero3_init_flag false) starts no process group
    torch.save({"state": state, "report": report.summary() if report else None,
                "partitioned": any(hasattr(p, "ds_id") for p in model.parameters()),
                "explicit_report": explicit.summary(),
                "env": {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}}, out)
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
