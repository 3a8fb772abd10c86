"""A Trainer full fine-tune of a MoE under `accelerate launch --use_deepspeed` (ZeRO-3 with expert parallelism, the
DeepSpeed config file's `expert_parallel` section) with periodic checkpoints (`save_strategy="steps"`): the whole run
(`full`), the run stopped after its first checkpoint (`first`), and a new run resumed from that checkpoint
(`resume`, `train(resume_from_checkpoint=...)`); the whole run takes the model through `model_init=`, as
hyperparameter search does (loaded twice: the Trainer's init loads one, `train` a fresh one).
argv: model out mode [without] (transformers + engine-side AutoEP)."""

import json
import os
import sys

if len(sys.argv) > 4 and sys.argv[4] == "without":  # DeepSpeed 0.19.8's engine-side AutoEP on transformers 5.23+
    from hf_zero3_loader._deepspeed_private import allow_registry_get_default

    allow_registry_get_default()
else:
    import hf_zero3_loader.auto  # noqa: F401  (the only line a user adds)

from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,  # noqa: E402
                          TrainerCallback, TrainingArguments)

path, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
run_dir = os.path.join(os.path.dirname(out), "resume_run")  # `first` writes the checkpoint `resume` starts from
args = TrainingArguments(output_dir=run_dir + "_" + mode, per_device_train_batch_size=1, max_steps=4,
                         learning_rate=1e-3, logging_steps=1, save_strategy="steps", save_steps=2, report_to="none",
                         ddp_backend="gloo", seed=3, dataloader_num_workers=0, disable_tqdm=True)
tokenizer = AutoTokenizer.from_pretrained(path)
examples = [tokenizer(" ".join(f"w{(7 * i + 3 * j) % 98 + 3}" for j in range(12))) for i in range(16)]
collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
expert_parallel_loads = []  # whether each load's report says it loaded with expert parallelism


def load():
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    report = getattr(model, "hf_zero3_load_report", None)  # none without the import
    expert_parallel_loads.append(report is not None and report.expert_parallel is not None)
    return model


if mode == "full":  # hyperparameter search's form: the Trainer loads the model twice (at init, and again in `train`)
    trainer = Trainer(model_init=load, args=args, train_dataset=examples, data_collator=collator)
else:
    trainer = Trainer(model=load(), args=args, train_dataset=examples, data_collator=collator)


class StopAfterTheFirstCheckpoint(TrainerCallback):  # an interrupted run: same schedule, stopped at step 2
    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == 2


if mode == "first":
    trainer.add_callback(StopAfterTheFirstCheckpoint())
trainer.train(resume_from_checkpoint=run_dir + "_first/checkpoint-2" if mode == "resume" else None)
if trainer.is_world_process_zero():
    with open(out, "w") as f:
        json.dump({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                   "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
                   "expert_parallel_loads": expert_parallel_loads,
                   "checkpoints": {c: sorted(os.listdir(os.path.join(args.output_dir, c)))
                                   for c in os.listdir(args.output_dir) if c.startswith("checkpoint-")}}, f)
trainer.accelerator.wait_for_everyone()
os._exit(0)
