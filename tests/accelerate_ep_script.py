"""A user's fine-tuning script under `accelerate launch --use_deepspeed` with `expert_parallel` in its DeepSpeed config
file, unchanged but for one import: from_pretrained, Accelerator.prepare (deepspeed.initialize), two AdamW steps;
then accelerate's `get_state_dict` (refused under EP) and `save_model`."""

import os
import sys

import hf_zero3_loader.auto  # noqa: F401  (the only line a user adds)
import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

path, out = sys.argv[1], sys.argv[2]
accelerator = Accelerator()
leaf_names_before = os.environ.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES")  # (the test's record)
model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
report = model.hf_zero3_load_report.summary()
moe_leaf_names = (leaf_names_before, os.environ.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
g = torch.Generator().manual_seed(0)
losses = []
for _ in range(2):
    ids = torch.randint(0, 101, (1, 12), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
state_dict_errors = []  # accelerate's documented save takes the consolidated state dict: refused here twice
for gather_on_save in (False, True):  # this config's `stage3_gather_16bit_weights_on_model_save`, then with it on
    model._config.zero_config.gather_16bit_weights_on_model_save = gather_on_save
    try:
        accelerator.get_state_dict(model)
        state_dict_errors.append(None)
    except (ValueError, NotImplementedError) as e:
        state_dict_errors.append(f"{type(e).__name__}: {e}")
accelerator.save_model(model, out + ".saved")  # what that error names instead: every rank writes its partitions
every = [None] * dist.get_world_size()
dist.all_gather_object(every, {"report": report, "losses": losses, "moe_leaf_names": moe_leaf_names,
                               "state_dict_errors": state_dict_errors})
if dist.get_rank() == 0:
    torch.save(every, out)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
