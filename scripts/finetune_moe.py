"""Fine-tune a MoE with the Trainer under DeepSpeed ZeRO-3 (and expert parallelism), loaded shard-on-read.

    accelerate launch --config_file scripts/accelerate/zero3.yaml    scripts/finetune_moe.py [OPTIONS]
    accelerate launch --config_file scripts/accelerate/zero3_ep.yaml scripts/finetune_moe.py [OPTIONS]
    OPTIONS: [--model P] [--data F] [--lora] [--gradient-checkpointing]

A normal Trainer script; the only line that differs from one without hf_zero3_loader is `import hf_zero3_loader.auto`.
The DeepSpeed config files in scripts/accelerate/ say ZeRO-3 (and `expert_parallel`, autoep_size 2, for the EP one);
`--model` is a local folder or a hub id in the cache (default: a small Qwen3-MoE generated under ./out/finetune);
`--data` a text file, one training example per line (default: a few synthetic lines); `--lora` trains a LoRA adapter
on the attention projections instead of the whole model; `--gradient-checkpointing` trades compute for activation
memory. bf16 on a GPU, fp32 on CPU. At the end `trainer.save_model`
writes the model (or the adapter) to `--output-dir`, with no gather.
"""

from __future__ import annotations

import argparse
import os
import sys

import hf_zero3_loader.auto  # noqa: F401  (every from_pretrained under ZeRO-3 now loads shard-on-read)
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainingArguments)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_model(folder: str) -> str:
    """A small random Qwen3-MoE with a word tokenizer, for trying the script without a download."""
    sys.path.insert(0, REPO)
    from tests.checkpoints import add_word_tokenizer, make_checkpoint, trainable_moe_config

    return add_word_tokenizer(make_checkpoint(folder, "qwen3_moe", config=trainable_moe_config()), 101)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", default=None)
    ap.add_argument("--output-dir", default="./out/finetune/run")
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lora", action="store_true",
                    help="train a LoRA adapter on the attention projections (PEFT) instead of the whole model")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="recompute activations in the backward pass (transformers' non-reentrant checkpointing)")
    args = ap.parse_args()

    path = args.model
    if path is None:
        path = os.path.abspath("./out/finetune/model")
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            small_model(path)
    training = TrainingArguments(output_dir=args.output_dir, per_device_train_batch_size=1, max_steps=args.max_steps,
                                 learning_rate=args.lr, logging_steps=1, save_strategy="no", report_to="none",
                                 gradient_checkpointing=args.gradient_checkpointing,
                                 gradient_checkpointing_kwargs={"use_reentrant": False},
                                 bf16=torch.cuda.is_available(), ddp_backend=None if torch.cuda.is_available() else "gloo")
    with training.main_process_first():  # rank 0 wrote the default model
        tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)  # ZeRO-3 partitions; EP layout when the config asks for it
    report = model.hf_zero3_load_report.summary()
    if args.lora:  # under EP the engine keeps the loader's expert layers beneath PEFT's wrapper
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                 task_type="CAUSAL_LM"))
    lines = (open(args.data).read().splitlines() if args.data else
             [" ".join(f"w{(7 * i + 3 * j) % 98 + 3}" for j in range(12)) for i in range(16)])
    examples = [tokenizer(line, truncation=True, max_length=64) for line in lines if line.strip()]
    trainer = Trainer(model=model, args=training, train_dataset=examples,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()
    # every rank writes its own partitions (the whole model), or the adapter gathered alone (--lora)
    trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        ep = report.get("expert_parallel")
        print(f"finetune_moe: {len(losses)} steps, losses {', '.join(f'{x:.3f}' for x in losses)}; loaded as "
              f"{report['init_context']}" + (f" (ep_size {ep['ep_size']}, experts {ep['local_experts']} on rank 0)"
                                              if ep else "") + f"; saved {'the adapter' if args.lora else 'the model'} "
              f"to {args.output_dir}")
    # process groups left to interpreter teardown can abort it (gloo's worker threads; "terminate called without an
    # active exception", seen once in this script's test)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
