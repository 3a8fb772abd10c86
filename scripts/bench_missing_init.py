"""Missing-key initialisation under ZeRO-3: upstream vs hf_zero3_loader, side by side.

A Qwen3-MoE checkpoint whose expert weights are all missing (attention, norms and embeddings only) is loaded on
W CPU ranks by transformers' ZeRO-3 path and by ours, each in its own torchrun job. Per rank we record the
largest `GatheredParameters` (bytes gathered at once for initialisation), peak RSS growth during the load and
load time, then print both and the ratios.

    python scripts/bench_missing_init.py [--world-size 2] [--workdir out/bench_missing] [--budget-mib 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import free_port  # noqa: E402
from _bench_worker import RssSampler  # noqa: E402


def make_checkpoint(path: str) -> tuple[str, int]:
    """~0.5 GB of bf16 experts missing; the rest (~30 MB) on disk. Returns (path, missing bytes)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=8192, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                            num_experts=64, num_experts_per_tok=4, decoder_sparse_step=1, tie_word_embeddings=False)
    missing = 4 * 64 * 3 * 512 * 512 * 2
    if os.path.exists(os.path.join(path, "config.json")):
        return path, missing
    os.makedirs(path, exist_ok=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: torch.randn(v.shape, dtype=torch.bfloat16) * 0.02 for k, v in model.state_dict().items()
             if ".mlp.experts." not in k}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.dtype = "bfloat16"
    config.save_pretrained(path)
    return path, missing


def worker(variant: str, path: str, out: str, budget: int) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from transformers import AutoModelForCausalLM

    import hf_zero3_loader

    deepspeed.init_distributed(dist_backend="gloo")
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    gathers: list[int] = []
    original_init = GatheredParameters.__init__

    def recording_init(self, params, *args, **kwargs):  # the bytes each gather brings in at once
        params = [params] if isinstance(params, torch.nn.Parameter) else list(params)
        gathers.append(sum(p.ds_numel * p.element_size() for p in params if hasattr(p, "ds_numel")))
        original_init(self, params, *args, **kwargs)

    GatheredParameters.__init__ = recording_init
    torch.manual_seed(0)
    dist.barrier()
    keep = None
    with RssSampler() as rss:
        start = time.perf_counter()
        if variant == "upstream":
            from transformers.integrations import HfDeepSpeedConfig

            keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 (transformers keeps a weakref)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        else:
            model = hf_zero3_loader.from_pretrained(AutoModelForCausalLM, path, ds_config=ds_config,
                                                    missing_init_budget_bytes=budget)
        seconds = time.perf_counter() - start
    # a checksum of the initialised experts, to show both paths produce the same values
    checksum = 0.0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            with GatheredParameters([p]):
                checksum += float(p.float().abs().sum()) if dist.get_rank() == 0 else 0.0
    row = {"variant": variant, "rank": dist.get_rank(), "seconds": seconds, "rss_growth": rss.growth()["rss"],
           "largest_gather": max(gathers, default=0), "gathers": len(gathers), "checksum": checksum}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip finalisation: gloo threads can abort it (a known torch teardown race)


def _launch(variant: str, world_size: int, path: str, out: str, budget: int) -> list[dict]:
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size), "--master_port",
           str(port), __file__, "--worker", variant, "--path", path, "--out", out, "--budget-mib", str(budget >> 20)]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workdir", default=os.path.join(ROOT, "out", "bench_missing"))
    parser.add_argument("--budget-mib", type=int, default=64)
    parser.add_argument("--worker")
    parser.add_argument("--path")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.path, args.out, args.budget_mib << 20)
    path, missing = make_checkpoint(os.path.join(args.workdir, "qwen3_moe_no_experts"))
    results = {v: _launch(v, args.world_size, path, os.path.join(args.workdir, f"{v}.json"), args.budget_mib << 20)
               for v in ("upstream", "ours")}
    mib = 1 << 20
    print(f"Missing-key init: Qwen3-MoE, {missing / mib:.0f} MiB of bf16 experts missing, {args.world_size} CPU ranks, "
          f"budget {args.budget_mib} MiB\n")
    print("| variant | rank | load s | largest gather MiB | gathers | peak RSS growth MiB |")
    print("|---|---|---|---|---|---|")
    for variant, rows in results.items():
        for r in rows:
            print(f"| {variant} | {r['rank']} | {r['seconds']:.2f} | {r['largest_gather'] / mib:.1f} | {r['gathers']} "
                  f"| {r['rss_growth'] / mib:.0f} |")
    up, ours = results["upstream"], results["ours"]
    ratio = lambda key: max(r[key] for r in up) / max(max(r[key] for r in ours), 1)  # noqa: E731
    print(f"\nupstream / ours: largest gather {ratio('largest_gather'):.1f}x, peak RSS growth "
          f"{ratio('rss_growth'):.1f}x, time {ratio('seconds'):.1f}x")
    same = abs(up[0]["checksum"] - ours[0]["checksum"]) <= 1e-6 * max(1.0, abs(up[0]["checksum"]))
    print(f"initialised experts checksum: upstream {up[0]['checksum']:.6f}, ours {ours[0]['checksum']:.6f} "
          f"({'equal' if same else 'DIFFERENT'})")


if __name__ == "__main__":
    main()
