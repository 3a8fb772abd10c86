"""A vision-language MoE fine-tuned under ZeRO-3, as a user's script does: the DeepSpeed config kept alive in
`HfDeepSpeedConfig` (the Trainer's and accelerate's way), `from_pretrained`, `deepspeed.initialize`, 3 steps in which
each rank trains on its own text and images:
- qwen3_vl_moe: images of different sizes on each rank, so the vision tower and the experts see different tokens;
- ernie4_5_vl_moe: images on rank 0, text only on rank 1, which runs the vision tower on a dummy image and adds its
  output times 0 (the usual ZeRO-3 workaround for text-only batches), so only rank 0 has tokens for the vision experts.
argv: path out variant ep_size family. variant: `ours` (`import hf_zero3_loader.auto`) or `without` (transformers'
own ZeRO-3 path; under EP, engine-side AutoEP; without EP, DeepSpeed's leaf-module fix applied by hand).
Rank 0 writes every rank's losses and the load report's leaf modules (json)."""

import json
import os
import sys

import torch

path, out, variant, ep_size, family = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
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
from tests.dist_worker import NOTHING_PERSISTENT, ds_config_for  # noqa: E402

IMAGE, START, END = 5, 4, 7  # token ids inside the small test vocabulary
TOKEN_IDS = {"qwen3_vl_moe": dict(image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END,
                                  video_token_id=6),
             "ernie4_5_vl_moe": dict(image_token_id=IMAGE, image_start_token_id=START, image_end_token_id=END,
                                     video_token_id=6, video_start_token_id=8, video_end_token_id=9)}
BY_HAND_LEAF = {"qwen3_vl_moe": "Qwen3VLMoeTextExperts", "ernie4_5_vl_moe": "Ernie4_5_VLMoeMoeBlock"}
PATCH = {"qwen3_vl_moe": 3 * 2 * 4 * 4, "ernie4_5_vl_moe": 3 * 4 * 4}  # channels x (temporal) x patch x patch

extra = {}
if ep_size:
    extra["expert_parallel"] = {"enabled": True, "use_grouped_mm": False, "autoep_size": ep_size,
                                **EP_NAMED_STRUCTURE[family]}
ds_config = ds_config_for("bfloat16", extra)
ds_config["zero_optimization"] = dict(NOTHING_PERSISTENT)  # every parameter gathered and released at each step
keep = HfDeepSpeedConfig(ds_config)  # noqa: F841  (transformers reads it while it lives)
deepspeed.init_distributed("gloo")
model = AutoModelForImageTextToText.from_pretrained(path, experts_implementation="eager", **TOKEN_IDS[family])
report = getattr(model, "hf_zero3_load_report", None)
if variant == "without" and not ep_size:
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, [BY_HAND_LEAF[family]])
engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
engine.train()
rank = dist.get_rank()
text_only = family == "ernie4_5_vl_moe" and rank == 1
if text_only:
    inner = engine.module.model

    def dummy_vision_pass(module, args, embeds):
        dummy = inner.get_image_features(torch.zeros(4, PATCH[family], dtype=torch.bfloat16), torch.tensor([[1, 2, 2]]),
                                         return_dict=True).pooler_output
        return embeds + 0 * sum(d.sum() for d in dummy)

    inner.get_input_embeddings().register_forward_hook(dummy_vision_pass)
g = torch.Generator().manual_seed(100 + rank)
losses = []
for step in range(3):
    text = torch.randint(10, 101, (8,), generator=g)
    if text_only:
        ids = text[None]
        images = {"mm_token_type_ids": torch.zeros_like(ids), "moe_mm_token_type_ids": torch.zeros_like(ids)}
    else:
        h, w = (4, 4) if rank == 0 else (4, 8 if step % 2 else 4)  # patches; 2 x 2 of them merge into one image token
        ids = torch.cat([text[:3], torch.tensor([START]), torch.full((h * w // 4,), IMAGE), torch.tensor([END]),
                         text[3:]])[None]
        images = {"pixel_values": torch.randn(h * w, PATCH[family], generator=g).to(torch.bfloat16),
                  "image_grid_thw": torch.tensor([[1, h, w]]), "mm_token_type_ids": (ids == IMAGE).long()}
        if family == "ernie4_5_vl_moe":  # its processor's: the image's start and end tokens go to the vision experts
            images["moe_mm_token_type_ids"] = ((ids == IMAGE) | (ids == START) | (ids == END)).long()
    labels = ids.masked_fill(ids == IMAGE, -100)
    loss = engine(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids), **images).loss
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
