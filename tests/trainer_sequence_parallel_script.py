"""Long-context fine-tuning as transformers documents it (ALST): the Trainer with DeepSpeed Ulysses sequence
parallelism (`parallelism_config`, sp_size 2: each rank holds half of every sequence) over ZeRO-3, under a real
`accelerate launch`. argv: model out with-loader|without."""

import json
import os
import sys

if sys.argv[3] == "with-loader":
    import hf_zero3_loader.auto  # noqa: F401  (the only line a user adds)

from accelerate.parallelism_config import ParallelismConfig  # noqa: E402
from accelerate.utils import DeepSpeedSequenceParallelConfig  # noqa: E402
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,  # noqa: E402
                          TrainingArguments)

path, out = sys.argv[1], sys.argv[2]
sequence_parallel = ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(
    sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
args = TrainingArguments(output_dir=out + "_run", per_device_train_batch_size=1, max_steps=3, learning_rate=1e-3,
                         logging_steps=1, save_strategy="no", report_to="none", ddp_backend="gloo", seed=3,
                         dataloader_num_workers=0, disable_tqdm=True, parallelism_config=sequence_parallel)
tokenizer = AutoTokenizer.from_pretrained(path)
# Ulysses shards each sequence across ranks: every batch carries its global positions
examples = [dict(e, position_ids=list(range(len(e["input_ids"])))) for e in
            (tokenizer(" ".join(f"w{(7 * i + 3 * j) % 98 + 3}" for j in range(16))) for i in range(8))]
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", experts_implementation="eager")
report = getattr(model, "hf_zero3_load_report", None)  # none without the import
trainer = Trainer(model=model, args=args, train_dataset=examples,
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
trainer.train()
if trainer.is_world_process_zero():
    with open(out, "w") as f:
        json.dump({"logged": [{k: h[k] for k in ("loss", "grad_norm")} for h in trainer.state.log_history
                              if "loss" in h],
                   "report": report.summary() if report else None}, f)
trainer.accelerator.wait_for_everyone()
os._exit(0)
