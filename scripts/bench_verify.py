"""Benchmark: what `verify_checkpoint="full"` costs against the default sampled check, first and cached.

    python scripts/bench_verify.py [--workdir ./out/bench] [--size bench_quarter] [--world-size 2] [--repeats 3]

For each repeat, three `torchrun` launches, each a fresh process, the page cache warm (every shard read before each):

  sampled       hf_zero3_loader.from_pretrained(AutoModelForCausalLM, path, ds_config=DS)
  full, first   the same with verify_checkpoint="full" and an empty digest cache: the node hashes its copy once, its
                files split over its ranks
  full, cached  the same again: the node's cache holds every file's digest

DS = ZeRO-3 bf16. Per variant: the median launch's load seconds (its slowest rank), its `verify` phase (slowest
rank), and the bytes hashed (all ranks). The digest cache lives under WORKDIR (HF_ZERO3_LOADER_CACHE).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import MiB, launch, log_tail, make_checkpoint, warm_page_cache  # noqa: E402

DS = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}


def worker(path: str, mode: str, out: str) -> None:
    """One rank of one launch: a timed load, every rank's numbers appended to `out` by rank 0."""
    import time

    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    import transformers.modeling_utils  # noqa: F401  (its lazy imports paid before the timed load)
    from transformers import AutoModelForCausalLM

    import hf_zero3_loader

    dist.barrier()
    start = time.perf_counter()
    model = hf_zero3_loader.from_pretrained(AutoModelForCausalLM, path, ds_config=DS, verify_checkpoint=mode)
    seconds = time.perf_counter() - start
    report = model.hf_zero3_load_report
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"seconds": seconds, "verify_s": report.phases.get("verify", 0.0),
                                   "hashed": (report.verify or {}).get("hashed_bytes", 0)})
    if dist.get_rank() == 0:
        with open(out, "a") as f:
            f.write(json.dumps(ranks) + "\n")
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="./out/bench")
    ap.add_argument("--size", default="bench_quarter", choices=("bench_quarter", "bench", "bench_4gb"))
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    ckpt = os.path.join(workdir, "ckpt" if args.size == "bench" else f"ckpt_{args.size}")
    meta = make_checkpoint(ckpt, args.size)
    cache = os.path.join(workdir, "digest_cache")
    os.environ["HF_ZERO3_LOADER_CACHE"] = cache
    os.environ.setdefault("HF_ZERO3_LOADER_VERBOSITY", "warning")
    out = os.path.join(workdir, "bench_verify.jsonl")
    results: dict[str, list] = {"sampled": [], "full, first": [], "full, cached": []}
    for _ in range(args.repeats):
        for variant, mode in (("sampled", "sampled"), ("full, first", "full"), ("full, cached", "full")):
            if variant == "full, first":
                shutil.rmtree(cache, ignore_errors=True)
            warm_page_cache(ckpt)
            if os.path.exists(out):
                os.remove(out)
            log = os.path.join(workdir, "bench_verify.log")
            _, rc = launch(args.world_size, ["--worker", ckpt, mode, out], log, args.timeout,
                           worker=os.path.basename(__file__))
            if rc != 0:
                sys.stderr.write(log_tail(log))
                raise SystemExit(f"{variant}: the launch failed (rc {rc})")
            with open(out) as f:
                ranks = json.loads(f.read().splitlines()[-1])
            results[variant].append({"seconds": max(r["seconds"] for r in ranks),
                                     "verify_s": max(r["verify_s"] for r in ranks),
                                     "hashed": sum(r["hashed"] for r in ranks)})
    print(f"checkpoint {ckpt}: {meta['bytes_on_disk'] / MiB:.0f} MiB in {meta['files']} files; "
          f"{args.world_size} ranks, {args.repeats} launches per variant, warm page cache")
    print("| variant | load s (median) | verify phase s | MiB hashed (all ranks) |")
    print("|---|---|---|---|")
    for variant, runs in results.items():
        median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
        print(f"| {variant} | {statistics.median(r['seconds'] for r in runs):.2f} | {median['verify_s']:.2f} | "
              f"{median['hashed'] / MiB:.0f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
    else:
        main()
