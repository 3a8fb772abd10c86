"""Benchmark: what planning one rank costs for full-size models, as the world grows.

    python scripts/bench_plan.py [--workdir ./out/sparse] [--models deepseek_v3,qwen3_235b,gpt_oss_120b,mixtral_8x22b]
                                 [--world-sizes 8,64,512,4096] [--ep] [--json OUT.json]

Each model is a header-only ("sparse") checkpoint of its full-size config (`scripts/_sparse_ckpt.py`: the files
`save_pretrained` would write, real safetensors headers, data regions left as holes; built once per model and kept in
WORKDIR/<model>). For every (model, W) a fresh process does what one rank of a load does before reading any data, and
times each step:

  skeleton  transformers builds the model on meta from the config
  headers   every shard's header is read and checked (`open_checkpoint`)
  resolve   transformers' conversion mapping, checkpoint keys grouped and resolved against the model (once per load)
  plan      rank 0's plan: its partition of every tensor turned into read items (`plan_tensors`); with --ep this
            step also builds AutoEP's layers on the skeleton (`ExpertParallelLayout.convert`)

It prints per row: those seconds and their sum (what a rank pays), the process's peak RSS (ru_maxrss) and its RSS
before the steps, rank 0's read items and bytes. Target: the sum under 5 s at every size. With --ep each world size is
also planned with expert parallelism (ep_size = the largest divisor of W that divides the expert count, at most 64;
families without a DeepSpeed AutoEP preset, such as GPT-OSS, have no EP row).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(SCRIPTS))
sys.path.insert(0, SCRIPTS)

MODELS = ("deepseek_v3", "qwen3_235b", "gpt_oss_120b", "mixtral_8x22b")
TARGET_SECONDS = 5.0


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(folder: str, world_size: int, ep_size: int) -> dict:
    """One rank's planning, step by step (the steps of `planner.inspect.plan_ranks`, timed apart)."""
    import torch  # noqa: F401  (imports are not timed)
    import transformers.conversion_mapping  # noqa: F401

    import hf_zero3_loader.planner.inspect  # noqa: F401
    from hf_zero3_loader.gc_pause import paused_gc

    rss_before = rss_mib()
    with paused_gc():  # as in a load
        seconds, checkpoint, plan = _timed_steps(folder, world_size, ep_size)
    return {"world_size": world_size, "ep_size": ep_size, "seconds": seconds, "total_seconds": sum(seconds.values()),
            "rss_before_mib": rss_before, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "checkpoint_tensors": len(checkpoint.entries), "checkpoint_bytes": checkpoint.nbytes,
            "parameters": sum(e.numel for e in checkpoint.entries.values()),
            "read_items": sum(len(t.reads) for t in plan.tensors.values()), "bytes_to_read": plan.bytes_to_read}


def _timed_steps(folder: str, world_size: int, ep_size: int):
    from transformers.conversion_mapping import get_model_conversion_mapping

    from hf_zero3_loader.checkpoint import open_checkpoint
    from hf_zero3_loader.planner.inspect import EXPERTS, checkpoint_files, meta_skeleton
    from hf_zero3_loader.planner.plan import WORLD, PartitionGroup, plan_tensors, resolve_checkpoint

    seconds = {}
    t = time.perf_counter()
    model, dtype = meta_skeleton(folder)
    seconds["skeleton"] = time.perf_counter() - t
    t = time.perf_counter()
    checkpoint = open_checkpoint(checkpoint_files(folder))
    seconds["headers"] = time.perf_counter() - t
    t = time.perf_counter()
    resolution = resolve_checkpoint(model, checkpoint, get_model_conversion_mapping(model), model._get_dtype_plan(dtype))
    resolution.fingerprint()  # what the ranks agree on before reading
    seconds["resolve"] = time.perf_counter() - t
    t = time.perf_counter()
    world = PartitionGroup(WORLD, world_size, 0)
    group_of, sources = (lambda name: world), None
    if ep_size:
        from hf_zero3_loader.expert_parallel import ExpertParallelGroups, ExpertParallelLayout, request_from

        layout = ExpertParallelLayout.convert(model, request_from({}, ep_size, None, world_size),
                                              ExpertParallelGroups(ep_size, 0, None, EXPERTS))
        experts = PartitionGroup(EXPERTS, world_size // ep_size, 0)
        group_of, sources = layout.group_of(world, experts), layout.sources_for(0)
    plan = plan_tensors(model, resolution, checkpoint, group_of, 0, world_size, sources)
    seconds["plan"] = time.perf_counter() - t
    return seconds, checkpoint, plan


def sparse_checkpoint(workdir: str, name: str) -> str:
    from _sparse_ckpt import full_size_config, write_sparse_checkpoint

    folder = os.path.join(workdir, name)
    if not os.path.exists(os.path.join(folder, "config.json")):
        print(f"building the header-only {name} checkpoint in {folder} ...", flush=True)
        write_sparse_checkpoint(full_size_config(name), folder)
    return folder


def ep_size_for(folder: str, world_size: int) -> int:
    """0 for a model type DeepSpeed's AutoEP has no preset for (the loader refuses EP for it)."""
    from hf_zero3_loader.expert_parallel import supported_model_types

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    if config["model_type"] not in supported_model_types():
        return 0
    experts = next(config[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if k in config)
    return max(e for e in range(1, min(world_size, 64) + 1) if world_size % e == 0 and experts % e == 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="./out/sparse")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--world-sizes", default="8,64,512,4096")
    ap.add_argument("--ep", action="store_true", help="also plan with expert parallelism")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--child", nargs=3, metavar=("FOLDER", "W", "EP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return

    start = time.perf_counter()
    worlds = [int(w) for w in args.world_sizes.split(",")]
    rows = []
    for name in args.models.split(","):
        folder = sparse_checkpoint(os.path.abspath(args.workdir), name)
        for world in worlds:
            for ep in sorted({0, ep_size_for(folder, world) if args.ep else 0}):
                out = subprocess.run([sys.executable, __file__, "--child", folder, str(world), str(ep)],
                                     capture_output=True, text=True)
                if out.returncode != 0:
                    print(f"{name} W={world} ep={ep}: FAILED\n{out.stderr[-3000:]}", flush=True)
                    rows.append({"model": name, "world_size": world, "ep_size": ep, "failed": True})
                    continue
                row = {"model": name, **json.loads(out.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(f"{name} W={world}{f' ep={ep}' if ep else ''}: {row['total_seconds']:.2f}s", flush=True)

    print("\n| model | params (B) | checkpoint tensors | W | ep | skeleton s | headers s | resolve s | plan s | total s "
          "| RSS before / peak MiB | read items | GiB read by rank 0 | < 5 s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("failed"):
            print(f"| {r['model']} | | | {r['world_size']} | {r['ep_size'] or '-'} | FAILED | | | | | | | | FAIL |")
            continue
        s = r["seconds"]
        print(f"| {r['model']} | {r['parameters'] / 1e9:.1f} | {r['checkpoint_tensors']:,} | {r['world_size']} | "
              f"{r['ep_size'] or '-'} | {s['skeleton']:.2f} | {s['headers']:.2f} | {s['resolve']:.2f} | {s['plan']:.2f} | "
              f"{r['total_seconds']:.2f} | {r['rss_before_mib']:.0f} / {r['peak_rss_mib']:.0f} | {r['read_items']:,} | "
              f"{r['bytes_to_read'] / 2**30:.2f} | {'PASS' if r['total_seconds'] < TARGET_SECONDS else 'FAIL'} |")
    ok = all(not r.get("failed") and r["total_seconds"] < TARGET_SECONDS for r in rows)
    print(f"\nplanning one rank under {TARGET_SECONDS:.0f} s at every size: {'PASS' if ok else 'FAIL'}; "
          f"machine: {os.cpu_count()} CPU cores; total wall time {time.perf_counter() - start:.0f}s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
