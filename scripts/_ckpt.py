"""Write a random bf16 Qwen3-MoE checkpoint with transformers' own `save_pretrained` (shared by bench and demo).

Usage: python scripts/_ckpt.py --out DIR --size {bench,demo}
Run as a subprocess so the caller's memory stays small. Does nothing if DIR/config.json exists.
"""

from __future__ import annotations

import argparse
import json
import os
import time

_BENCH = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=9, num_attention_heads=8, num_key_value_heads=2,
              head_dim=64, intermediate_size=1024, moe_intermediate_size=256, num_experts_per_tok=8)
SIZES = {
    # ~500M params, ~1 GB bf16; 93% of the bytes are routed experts
    "bench": dict(_BENCH, num_experts=128, shard="200MB"),
    # the size-scaling rows of bench_load.py: ~0.29 GB and ~3.5 GB, the same model with 32 or 512 experts
    "bench_quarter": dict(_BENCH, num_experts=32, shard="200MB"),
    "bench_4gb": dict(_BENCH, num_experts=512, shard="400MB"),
    # ~270 MB in 147 shards of at most 2 MB, for bench_headers.py (large MoE checkpoints come in 60-270 files)
    "bench_many_shards": dict(_BENCH, num_hidden_layers=48, num_experts=4, shard="2MB"),
    # ~130 MB: large enough that a load's memory stands out from the process's own noise (tests/test_cli.py)
    "test": dict(vocab_size=8000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, intermediate_size=1024, moe_intermediate_size=256,
                 num_experts=32, num_experts_per_tok=4, shard="40MB"),
    # tens of MB; sizes not all divisible by 2 so the last ZeRO-3 partition is padded
    "demo": dict(vocab_size=3001, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=129,
                 num_experts=64, num_experts_per_tok=4, shard="10MB"),
}


def make_config(size: str):
    from transformers import Qwen3MoeConfig

    kw = dict(SIZES[size])
    kw.pop("shard")
    return Qwen3MoeConfig(**kw, max_position_embeddings=2048, decoder_sparse_step=1, mlp_only_layers=[],
                          tie_word_embeddings=False)


def write_checkpoint(out: str, size: str, seed: int = 0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(out, "config.json")):
        return json.load(open(os.path.join(out, "bench_meta.json")))
    start = time.perf_counter()
    config = make_config(size)
    # Build on meta (no init work), then materialise in bf16 with a fast random fill: ~1 GB peak for 500M params.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms: ones plus noise, so mix-ups show
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:  # chunked so no fp32 copy of a whole 3-D expert tensor is made
                flat = p.view(-1)
                for i in range(0, flat.numel(), 1 << 24):
                    n = min(1 << 24, flat.numel() - i)
                    flat[i:i + n].copy_(torch.randn(n, generator=g) * 0.02)
    # non-persistent buffers (rotary inv_freq) stay uninitialised here: save_pretrained does not write them
    n_params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    model.save_pretrained(out, max_shard_size=SIZES[size]["shard"])
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    meta = {
        "size": size, "params": n_params, "expert_params": expert_params,
        "bytes_on_disk": sum(os.path.getsize(os.path.join(out, f)) for f in files),
        "files": len(files), "seconds": round(time.perf_counter() - start, 1),
    }
    with open(os.path.join(out, "bench_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", choices=sorted(SIZES), required=True)
    args = ap.parse_args()
    print(json.dumps(write_checkpoint(args.out, args.size)))


if __name__ == "__main__":
    main()
