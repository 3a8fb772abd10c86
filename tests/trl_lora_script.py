"""LoRA fine-tuning of a MoE as TRL users write it, under `accelerate launch --use_deepspeed` (ZeRO-3, bf16; with
expert parallelism when the DeepSpeed config file has an `expert_parallel` section):
SFTTrainer(model="<path>", peft_config=LoraConfig(...)), then `trainer.save_model` (the adapter). Run with and without
`import hf_zero3_loader.auto` (argv[3] == "with-loader"). Writes the losses, the adapter's parameters gathered after
training, the bytes its save passed through collectives, and the save's error if it failed."""

import os
import sys

if sys.argv[3] == "with-loader":
    import hf_zero3_loader.auto  # noqa: F401  (the only line a user adds)
else:  # DeepSpeed 0.19.8's engine-side AutoEP cannot run on a transformers 5.23+ model at all without this
    from hf_zero3_loader._deepspeed_private import allow_registry_get_default

    allow_registry_get_default()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import transformers.training_args  # noqa: E402

transformers.training_args.is_torch_bf16_gpu_available = lambda: True  # no GPU here: pretend, as the tests do

from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from tests.instrument import CollectiveCounter  # noqa: E402

path, out = sys.argv[1], sys.argv[2]
rows = [{"text": " ".join(f"w{(7 * i + 3 * j) % 98 + 3}" for j in range(10))} for i in range(8)]
args = SFTConfig(output_dir=out + ".run", per_device_train_batch_size=1, max_steps=3,
                 logging_steps=1, learning_rate=1e-2, bf16=True, report_to="none", save_strategy="no",
                 ddp_backend="gloo", seed=7, max_length=12, dataloader_num_workers=0, disable_tqdm=True,
                 model_init_kwargs={"experts_implementation": "eager"})
# LoRA on the attention projections, the output head trained whole beside it (PEFT keeps a trainable copy)
peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], init_lora_weights=False)
trainer = SFTTrainer(model=path, args=args, train_dataset=Dataset.from_list(rows), peft_config=peft_config)
trainer.train()
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
base = trainer.model.get_base_model()
report = getattr(base, "hf_zero3_load_report", None)
adapter = {}
for name, p in trainer.model.named_parameters():
    if p.requires_grad:
        with deepspeed.zero.GatheredParameters([p]):
            adapter[name] = p.detach().clone()
save_error, counter = None, CollectiveCounter()
try:
    with counter:
        trainer.save_model(out + ".saved")
except Exception as e:  # engine-side AutoEP: DeepSpeed refuses the consolidated state dict the Trainer asks for
    save_error = f"{type(e).__name__}: {e}"
if trainer.accelerator.is_main_process:
    torch.save({"losses": losses, "report": report.summary() if report else None, "adapter": adapter,
                "moe_layers": sorted({type(layer.mlp).__name__ for layer in base.model.layers}),
                "save_error": save_error, "save_collective_bytes": counter.bytes}, out)
trainer.accelerator.wait_for_everyone()
os._exit(0)
