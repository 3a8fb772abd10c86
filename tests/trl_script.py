"""TRL's most common form, as a user writes it, under `accelerate launch --use_deepspeed` (ZeRO-3, bf16):
SFTTrainer(model="<path>"), then `trainer.save_model` and `accelerator.save_model`. Run with and without
`import hf_zero3_loader.auto` (argv[3] == "with-loader")."""

import json
import os
import sys

if sys.argv[3] == "with-loader":
    import hf_zero3_loader.auto  # noqa: F401  (the only line a user adds)

import transformers.training_args  # noqa: E402

# This machine has no GPU, and TrainingArguments(bf16=True) refuses to run without one: pretend, as the tests do.
transformers.training_args.is_torch_bf16_gpu_available = lambda: True

from datasets import Dataset  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

path, out = sys.argv[1], sys.argv[2]
rows = [{"text": " ".join(f"w{(7 * i + 3 * j) % 98 + 3}" for j in range(10))} for i in range(8)]
args = SFTConfig(output_dir=os.path.dirname(out) + "/trl_run", per_device_train_batch_size=1, max_steps=3,
                 logging_steps=1, learning_rate=1e-3, bf16=True, report_to="none", save_strategy="no",
                 ddp_backend="gloo", seed=7, max_length=12, dataloader_num_workers=0, disable_tqdm=True)
trainer = SFTTrainer(model=path, args=args, train_dataset=Dataset.from_list(rows))
trainer.train()
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
report = getattr(trainer.model, "hf_zero3_load_report", None)
if trainer.accelerator.is_main_process:
    with open(out, "w") as f:
        json.dump({"losses": losses, "report": report.summary() if report else None,
                   "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()})}, f)
# saving, as users call it: the Trainer's save_model (tokenizer and training arguments with it) and accelerate's
saved = os.path.dirname(out) + f"/trl_saved_{sys.argv[3]}"
trainer.save_model(saved + "/trainer")
trainer.accelerator.save_model(trainer.model_wrapped, saved + "/accelerate", max_shard_size="20KB")
trainer.accelerator.wait_for_everyone()
os._exit(0)
