"""TRL's preference training as users write it, under `accelerate launch --use_deepspeed` (ZeRO-3, bf16):
DPOTrainer(model="<path>") with no ref_model, so TRL loads the same path a second time as its frozen reference and
wraps it in its own ZeRO-3 engine. Run with and without `import hf_zero3_loader.auto` (argv[3] == "with-loader")."""

import json
import os
import sys

if sys.argv[3] == "with-loader":
    import hf_zero3_loader.auto  # noqa: F401  (the only line a user adds)

import transformers.training_args  # noqa: E402

# This machine has no GPU, and TrainingArguments(bf16=True) refuses to run without one: pretend, as the tests do.
transformers.training_args.is_torch_bf16_gpu_available = lambda: True

from datasets import Dataset  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

path, out = sys.argv[1], sys.argv[2]


def words(i: int) -> str:
    return " ".join(f"w{(7 * i + 3 * j) % 98 + 3}" for j in range(4))


rows = [{"prompt": words(i), "chosen": words(i + 1), "rejected": words(i + 2)} for i in range(8)]
args = DPOConfig(output_dir=os.path.dirname(out) + "/dpo_run", per_device_train_batch_size=1, max_steps=3,
                 logging_steps=1, learning_rate=1e-3, bf16=True, report_to="none", save_strategy="no",
                 ddp_backend="gloo", seed=7, max_length=12, dataloader_num_workers=0, disable_tqdm=True)
trainer = DPOTrainer(model=path, args=args, train_dataset=Dataset.from_list(rows))
trainer.train()
# the rewards are the policy's log-probabilities against the reference's: a wrong reference weight shows there
logged = [{k: h[k] for k in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen")}
          for h in trainer.state.log_history if "loss" in h]
reports = [getattr(getattr(m, "module", m), "hf_zero3_load_report", None) for m in (trainer.model, trainer.ref_model)]
if trainer.accelerator.is_main_process:
    with open(out, "w") as f:
        json.dump({"logged": logged, "ref_model": type(trainer.ref_model).__name__,
                   "init_contexts": [r.summary()["init_context"] if r else None for r in reports]}, f)
trainer.accelerator.wait_for_everyone()
os._exit(0)
