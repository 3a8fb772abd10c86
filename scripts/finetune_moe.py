"""Fine-tune a MoE with the Trainer under DeepSpeed ZeRO-3 (and expert parallelism), loaded shard-on-read.

    accelerate launch --config_file scripts/accelerate/zero3.yaml    scripts/finetune_moe.py [OPTIONS]
    accelerate launch --config_file scripts/accelerate/zero3_ep.yaml scripts/finetune_moe.py [OPTIONS]
    OPTIONS: [--model P] [--data F] [--lora] [--gradient-checkpointing] [--max-steps N] [--batch-size B] [--lr LR]

A normal Trainer script; the only line that differs from one without hf_zero3_loader is `import hf_zero3_loader.auto`.
The accelerate configs in scripts/accelerate/ hold their DeepSpeed config (ZeRO-3; and `expert_parallel`, autoep_size
2, for the EP one), so they work from any folder. `--model` is a local folder or a hub id in the cache (default: a
small Qwen3-MoE generated under ./out/finetune); `--data` a text file, one training example per line (default: eight
lines of counting words, which the model learns: the loss falls from about 9 to below 1 in the default 40 steps, in
seconds on a CPU); `--lora` trains a LoRA adapter on the attention projections instead of the whole model (its loss
falls to about 3); `--gradient-checkpointing` trades compute for activation memory. bf16 on a GPU, fp32 on CPU. At the
end it prints the first and last step's loss, and `trainer.save_model` writes the model (or the adapter) to
`--output-dir`, with no gather.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings

import hf_zero3_loader.auto  # noqa: F401  (every from_pretrained under ZeRO-3 now loads shard-on-read)
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainingArguments)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# DeepSpeed 0.19's ZeRO-3 collectives call torch.distributed names torch deprecates (all_gather_into_tensor,
# reduce_scatter_tensor): a FutureWarning from each rank at every step, about DeepSpeed's code, not this script's
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
# PEFT 0.21's get_peft_model reads transformers' deprecated `is_gradient_checkpointing`
warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def small_model(folder: str) -> str:
    """A small random Qwen3-MoE with a word tokenizer, for trying the script without a download."""
    sys.path.insert(0, REPO)
    from tests.checkpoints import add_word_tokenizer, make_checkpoint, trainable_moe_config

    return add_word_tokenizer(make_checkpoint(folder, "qwen3_moe", config=trainable_moe_config()), 101)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a local folder or a hub id in the cache (default: a small "
                                                   "generated Qwen3-MoE)")
    ap.add_argument("--data", default=None, help="a text file, one training example per line (default: eight "
                                                  "lines of counting words, which the model learns in seconds)")
    ap.add_argument("--output-dir", default="./out/finetune/run")
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=4, help="examples per rank and step")
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default: 5e-3, 2e-2 with --lora)")
    ap.add_argument("--lora", action="store_true",
                    help="train a LoRA adapter on the attention projections (PEFT) instead of the whole model")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="recompute activations in the backward pass (transformers' non-reentrant checkpointing)")
    args = ap.parse_args()
    lr = args.lr if args.lr is not None else (2e-2 if args.lora else 5e-3)

    path = args.model
    if path is None:
        path = os.path.abspath("./out/finetune/model")
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            small_model(path)
    # transformers 5.24 renamed gradient_checkpointing to activation_checkpointing (the old name warns)
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    training = TrainingArguments(output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
                                 max_steps=args.max_steps, learning_rate=lr, logging_steps=1, save_strategy="no",
                                 report_to="none",
                                 **{checkpointing: args.gradient_checkpointing,
                                    f"{checkpointing}_kwargs": {"use_reentrant": False}},
                                 dataloader_pin_memory=torch.cuda.is_available(),
                                 bf16=torch.cuda.is_available(), ddp_backend=None if torch.cuda.is_available() else "gloo")
    with training.main_process_first():  # rank 0 wrote the default model
        tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)  # ZeRO-3 partitions; EP layout when the config asks for it
    report = model.hf_zero3_load_report.summary()
    if args.lora:  # under EP the engine keeps the loader's expert layers beneath PEFT's wrapper
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                 task_type="CAUSAL_LM"))
    # the default data: counting in words from 8 starting points (w17 w18 w19 ...), a pattern the small model learns
    lines = (open(args.data).read().splitlines() if args.data else
             [" ".join(f"w{(12 * i + j) % 98 + 3}" for j in range(16)) for i in range(8)])
    examples = [tokenizer(line, truncation=True, max_length=64) for line in lines if line.strip()]
    trainer = Trainer(model=model, args=training, train_dataset=examples,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()
    # every rank writes its own partitions (the whole model), or the adapter gathered alone (--lora)
    trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        ep = report.get("expert_parallel")
        how = (f"ZeRO-3 partitions, expert parallel (ep_size {ep['ep_size']}, experts {ep['local_experts']} on rank 0)"
               if ep else "ZeRO-3 partitions" if report["init_context"] != "zero.Init" else "transformers' ZeRO-3 path")
        print(f"finetune_moe: {len(losses)} steps at lr {lr:g}, loss {losses[0]:.3f} at the first step, "
              f"{losses[-1]:.3f} at the last; loaded into {how}; saved {'the adapter' if args.lora else 'the model'} "
              f"to {args.output_dir}")
    # process groups left to interpreter teardown can abort it (gloo's worker threads; "terminate called without an
    # active exception", seen in this script's test even after destroy_process_group): the work is saved, so end the
    # process here, after flushing, without the interpreter's teardown
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
