"""The ecosystem as users call it: TRL's SFTTrainer(model="<path>") under a real `accelerate launch` (ZeRO-3, bf16)
trains with `import hf_zero3_loader.auto` exactly as without it."""

from __future__ import annotations

import json
import os

from tests.checkpoints import add_word_tokenizer, make_checkpoint, trainable_moe_config
from tests.test_accelerate import accelerate_launch


def test_trl_sft_trainer_with_a_model_path_trains_the_same_with_the_import(workdir):
    path = add_word_tokenizer(make_checkpoint(os.path.join(workdir, "trl_qwen3_moe"), "qwen3_moe",
                                              config=trainable_moe_config()), 101)
    config = os.path.join(workdir, "ds_trl.json")
    with open(config, "w") as f:  # what an accelerate user's file says: the Trainer fills in the "auto"s
        json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                   "zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}, f)
    runs = {}
    for variant in ("with-loader", "without"):
        out = os.path.join(workdir, f"trl_{variant}.json")
        accelerate_launch(config, "trl_script.py", path, out, variant)
        with open(out) as f:
            runs[variant] = json.load(f)
    ours, upstream = runs["with-loader"], runs["without"]
    assert ours["report"]["init_context"] == "zero3-meta" and upstream["report"] is None
    assert len(ours["losses"]) == 3
    assert ours["losses"] == upstream["losses"]
    assert ours["param_dtypes"] == upstream["param_dtypes"] == ["torch.bfloat16"]  # TRL asked float32: engine wins
