"""Full-size checkpoint layouts without data: real safetensors headers, data regions left as holes.

    python scripts/_sparse_ckpt.py --model deepseek_v3 --out ./out/sparse/deepseek_v3

The on-disk layout is the one `save_pretrained` writes (transformers' own `revert_weight_conversion`, run on a meta
model: per-expert tensors where the model fuses them), split into shards of `--shard-gb`. Each file is its header
followed by a hole (`truncate`), so a 1.3 TB layout takes a few MB of disk; planning reads only headers.
"""

from __future__ import annotations

import argparse
import json
import os
import struct


def full_size_config(name: str):
    import transformers as T

    if name == "deepseek_v3":  # DeepSeek-V3 / R1, 671B (transformers' defaults are the released config)
        return T.DeepseekV3Config()
    if name == "qwen3_235b":  # Qwen3-235B-A22B
        return T.Qwen3MoeConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                                num_attention_heads=64, num_key_value_heads=4, head_dim=128, moe_intermediate_size=1536,
                                num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                                tie_word_embeddings=False)
    if name == "gpt_oss_120b":  # GPT-OSS-120B, its experts in bf16 here (MXFP4 on the hub)
        return T.GptOssConfig(num_hidden_layers=36, num_local_experts=128, hidden_size=2880, intermediate_size=2880,
                              vocab_size=201088, num_attention_heads=64, num_key_value_heads=8, head_dim=64)
    if name == "mixtral_8x22b":
        return T.MixtralConfig(vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
                               num_attention_heads=48, num_key_value_heads=8, num_local_experts=8,
                               num_experts_per_tok=2, tie_word_embeddings=False)
    raise ValueError(name)


def write_sparse_checkpoint(config, out: str, dtype: str = "bfloat16", shard_bytes: int = 5 * 10**9) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    if os.path.exists(os.path.join(out, "model.safetensors.index.json")):
        with open(os.path.join(out, "sparse_meta.json")) as f:
            return json.load(f)
    os.makedirs(out, exist_ok=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    on_disk = revert_weight_conversion(model, model.state_dict())
    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    shards, current, size = [], [], 0
    for key in sorted(on_disk):
        t = on_disk[key]
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((key, t, nbytes))
        size += nbytes
    if current:
        shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, t, nbytes in shard:
            header[key] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[key] = name
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(out, name), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
        total += offset
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config.save_pretrained(out)
    meta = {"tensors": len(on_disk), "files": len(shards), "bytes": total,
            "params": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(out, "sparse_meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, choices=("deepseek_v3", "qwen3_235b", "gpt_oss_120b", "mixtral_8x22b"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--shard-gb", type=float, default=5.0)
    args = ap.parse_args()
    meta = write_sparse_checkpoint(full_size_config(args.model), args.out, shard_bytes=int(args.shard_gb * 1e9))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
