"""Reinforcement learning on a MoE as TRL users write it, under `accelerate launch --use_deepspeed` (ZeRO-3, bf16;
with expert parallelism when the DeepSpeed config file has an `expert_parallel` section): GRPOTrainer(model="<path>")
samples completions under ZeRO-3 (its parameters gathered for generation), scores them with a reward function, and
with `beta` > 0 loads the path a second time as its frozen reference. Run with and without
`import hf_zero3_loader.auto` (argv[3] == "with-loader"). Writes every logged number, the reference model's wrapper
and how each model was loaded."""

import json
import os
import sys

if sys.argv[3] == "with-loader":
    import hf_zero3_loader.auto  # noqa: F401  (the only line a user adds)
else:  # DeepSpeed 0.19.8's engine-side AutoEP cannot run on a transformers 5.23+ model at all without this
    from hf_zero3_loader._deepspeed_private import allow_registry_get_default

    allow_registry_get_default()

import transformers.training_args  # noqa: E402

transformers.training_args.is_torch_bf16_gpu_available = lambda: True  # no GPU here: pretend, as the tests do

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

path, out = sys.argv[1], sys.argv[2]
rows = [{"prompt": " ".join(f"w{(7 * i + 3 * j) % 98 + 3}" for j in range(4))} for i in range(8)]


def reward(completions, **kwargs):  # longer completions with more words ending in 7 score higher
    return [len(c.split()) + 0.1 * sum(w.endswith("7") for w in c.split()) for c in completions]


args = GRPOConfig(output_dir=out + ".run", per_device_train_batch_size=2, num_generations=2, max_steps=3,
                  max_completion_length=6, beta=0.1, logging_steps=1, learning_rate=1e-2, bf16=True,
                  report_to="none", save_strategy="no", ddp_backend="gloo", seed=7, dataloader_num_workers=0,
                  disable_tqdm=True, model_init_kwargs={"experts_implementation": "eager"})
trainer = GRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows))
trainer.train()
logged = [{k: v for k, v in h.items() if isinstance(v, (int, float)) and k != "step_time"}
          for h in trainer.state.log_history if "loss" in h]
models = [trainer.accelerator.unwrap_model(m) for m in (trainer.model, trainer.ref_model)]
reports = [getattr(m, "hf_zero3_load_report", None) for m in models]
if trainer.accelerator.is_main_process:
    with open(out, "w") as f:
        json.dump({"logged": logged, "ref_model": type(trainer.ref_model).__name__,
                   "moe_layers": sorted({type(layer.mlp).__name__ for m in models for layer in m.model.layers}),
                   "init_contexts": [r.summary()["init_context"] if r else None for r in reports]}, f)
trainer.accelerator.wait_for_everyone()
os._exit(0)
