"""accelerate's documented ZeRO-3 save, in a user's script with the one import: `unwrapped.save_pretrained(dir,
is_main_process=..., save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))`, where
`get_state_dict` gathers on rank 0 and returns None on the others; then `state_dict=None` on a rank that writes
(refused), and the save without a gather (every rank, no state_dict). `--lora`: the same saves of a LoRA adapter."""

import os
import sys

import hf_zero3_loader.auto  # noqa: F401  (the only line a user adds)
import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

path, out, lora = sys.argv[1], sys.argv[2], "--lora" in sys.argv
accelerator = Accelerator()
model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
if lora:  # PEFT's save of the adapter: the same two calls
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(0))
accelerator.backward(model(input_ids=ids, labels=ids).loss)
optimizer.step()
accelerator.wait_for_everyone()
unwrapped = accelerator.unwrap_model(model)
state_dict = accelerator.get_state_dict(model)
# accelerator.is_main_process, as on GPUs (accelerate 1.15 reports every CPU rank under DeepSpeed as the main one)
is_main_process = dist.get_rank() == 0
unwrapped.save_pretrained(os.path.join(out, "documented"), is_main_process=is_main_process,
                          save_function=accelerator.save, state_dict=state_dict)
try:
    unwrapped.save_pretrained(os.path.join(out, "empty"), state_dict=None)
    refused = None
except Exception as e:
    refused = {"type": type(e).__name__, "message": str(e)}
unwrapped.save_pretrained(os.path.join(out, "without_a_gather"))
every = [None] * dist.get_world_size()
dist.all_gather_object(every, {"state_dict": None if state_dict is None else len(state_dict), "refused": refused})
if dist.get_rank() == 0:
    torch.save({"ranks": every, "gathered": {k: v.clone() for k, v in state_dict.items() if not lora or "lora_" in k}},
               os.path.join(out, "dump.pt"))
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
