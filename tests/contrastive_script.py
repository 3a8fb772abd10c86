"""One data-parallel training step of a CLIP model (its `logit_scale` is a 0-dim parameter) loaded by hf_zero3_loader.
Run by torchrun: `contrastive_script.py CHECKPOINT OUT.json`. Rank 0 writes the loss of its batch next to the plain
model's, and the largest difference between each gathered gradient and the plain model's gradient of the mean of both
ranks' losses (what data parallelism averages). transformers' own ZeRO-3 path cannot build this model: DeepSpeed
0.19.8's `zero.Init` broadcasts each parameter viewed as bytes, which a 0-dim tensor cannot be."""

import json
import sys

import deepspeed
import torch
import torch.distributed as dist
import transformers
from deepspeed.utils import safe_get_full_grad

import hf_zero3_loader

CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}


def batch(config, rank: int):
    g = torch.Generator().manual_seed(1 + rank)
    vision = config.vision_config
    return {"input_ids": torch.randint(3, config.text_config.vocab_size, (2, 8), generator=g),
            "pixel_values": torch.randn(2, vision.num_channels, vision.image_size, vision.image_size, generator=g)}


def main(path: str, out: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    plain = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)  # before ZeRO-3 is visible
    model = hf_zero3_loader.from_pretrained(transformers.AutoModel, path, ds_config=CONFIG, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG, model_parameters=model.parameters())
    engine.train()
    plain.train()
    rank, world = dist.get_rank(), dist.get_world_size()
    loss = engine(**batch(model.config, rank), return_loss=True).loss
    engine.backward(loss)
    grads = {name: safe_get_full_grad(p) for name, p in model.named_parameters()}  # collective: every rank
    engine.step()
    if rank != 0:
        return
    losses = [plain(**batch(plain.config, r), return_loss=True).loss for r in range(world)]
    (sum(losses) / world).backward()
    differences = {name: ((grads[name] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-12)).item()
                   for name, p in plain.named_parameters()}
    with open(out, "w") as f:
        json.dump({"loss": loss.item(), "plain_loss": losses[0].item(), "grad_relative_differences": differences,
                   "scalar_params": [n for n, p in plain.named_parameters() if p.dim() == 0]}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
    dist.destroy_process_group()  # not left to interpreter teardown, where gloo's threads can abort it
