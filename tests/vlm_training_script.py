"""A vision-language MoE (Qwen3-VL-MoE) fine-tuned on images under ZeRO-3, as a user's script does: the DeepSpeed config
kept alive in `HfDeepSpeedConfig` (the Trainer's and accelerate's way), `from_pretrained`, `deepspeed.initialize`,
3 steps in which each rank trains on its own text and its own images (of different sizes, so the vision tower and the
experts see different tokens on each rank).
argv: path out variant ep_size. variant: `ours` (`import hf_zero3_loader.auto`) or `without` (transformers' own ZeRO-3
path; under EP, engine-side AutoEP; without EP, DeepSpeed's leaf-module fix applied by hand to the experts class).
Rank 0 writes every rank's losses and the load report's leaf modules (json)."""

import json
import os
import sys

import torch

path, out, variant, ep_size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if variant == "without":  # DeepSpeed 0.19.8's engine-side AutoEP on transformers 5.23+
    from hf_zero3_loader._deepspeed_private import allow_registry_get_default

    allow_registry_get_default()
else:
    import hf_zero3_loader.auto  # noqa: F401  (the only line a user adds)

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.checkpoints import EP_NAMED_STRUCTURE  # noqa: E402
from tests.dist_worker import ds_config_for  # noqa: E402

extra = {}
if ep_size:
    extra["expert_parallel"] = {"enabled": True, "use_grouped_mm": False, "autoep_size": ep_size,
                                **EP_NAMED_STRUCTURE["qwen3_vl_moe"]}
ds_config = ds_config_for("bfloat16", extra)
keep = HfDeepSpeedConfig(ds_config)  # noqa: F841  (transformers reads it while it lives)
deepspeed.init_distributed("gloo")
IMAGE, VISION_START, VISION_END = 5, 4, 7  # token ids inside the small test vocabulary
model = AutoModelForImageTextToText.from_pretrained(path, experts_implementation="eager", image_token_id=IMAGE,
                                                    vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                                                    video_token_id=6)
report = getattr(model, "hf_zero3_load_report", None)
if variant == "without" and not ep_size:
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, ["Qwen3VLMoeTextExperts"])
engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
engine.train()
rank = dist.get_rank()
g = torch.Generator().manual_seed(100 + rank)
patch = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch (the checkpoint's vision config)
losses = []
for step in range(3):
    h, w = (4, 4) if rank == 0 else (4, 8 if step % 2 else 4)  # patches; 2 x 2 of them merge into one image token
    text = torch.randint(10, 101, (8,), generator=g)
    ids = torch.cat([text[:3], torch.tensor([VISION_START]), torch.full((h * w // 4,), IMAGE),
                     torch.tensor([VISION_END]), text[3:]])[None]
    labels = ids.masked_fill(ids == IMAGE, -100)
    pixels = torch.randn(h * w, patch, generator=g).to(torch.bfloat16)
    loss = engine(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                  image_grid_thw=torch.tensor([[1, h, w]]), mm_token_type_ids=(ids == IMAGE).long()).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
every_rank = [None] * dist.get_world_size()
dist.all_gather_object(every_rank, losses)
if rank == 0:
    with open(out, "w") as f:
        json.dump({"losses": every_rank, "leaf_modules": report.leaf_modules if report else None}, f)
dist.barrier()
sys.stdout.flush()
os._exit(0)  # not left to interpreter teardown, where gloo's threads can abort the process
