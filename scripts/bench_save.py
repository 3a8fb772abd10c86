"""Benchmark: saving a ZeRO-3 model with hf_zero3_loader.save_pretrained vs the gathered path Trainer.save_model and
accelerate use (`stage3_gather_16bit_weights_on_model_save`), on the ~1 GB Qwen3-MoE of bench_load.py.

    python scripts/bench_save.py [--workdir ./out/bench] [--world-sizes 2,4] [--repeats 3] [--json OUT.json]

For each world size W, separate `torchrun --nproc_per_node W` launches per variant (interleaved, --repeats times; the
median launch by its slowest rank is reported), each loading the checkpoint into a ZeRO-3 engine (bf16) and saving it
(see scripts/_bench_save_worker.py). Per rank: save seconds, peak RSS growth, bytes through collectives, bytes
written. Then the two saved folders are compared file by file: they must be byte-identical (an index's
`metadata.total_parameters` aside: upstream writes 0 there, see `digest`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import MiB, launch, log_tail, make_checkpoint, warm_page_cache  # noqa: E402

VARIANTS = ("ours", "upstream")


def digest(folder: str) -> dict:
    """sha256 of every file; an index's `metadata.total_parameters` is left out and reported on its own: transformers'
    gathered ZeRO-3 save writes 0 there (it counts the parameters' local numel, which ZeRO-3 empties), where a plain
    save_pretrained of the same model, and ours, write the real count."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".index.json"):
            with open(os.path.join(folder, name)) as f:
                index = json.load(f)
            out["total_parameters in " + name] = index.get("metadata", {}).pop("total_parameters", None)
            out[name] = hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()
            continue
        h = hashlib.sha256()
        with open(os.path.join(folder, name), "rb") as f:
            while chunk := f.read(MiB * 16):
                h.update(chunk)
        out[name] = h.hexdigest()
    return out


def run_world(world: int, ckpt: str, workdir: str, repeats: int, timeout: float, ep: bool) -> dict:
    d = os.path.join(workdir, f"save_w{world}{'_ep' if ep else ''}")
    os.makedirs(d, exist_ok=True)
    runs: dict = {v: [] for v in VARIANTS}
    digests = {}
    for rep in range(repeats):
        for variant in VARIANTS:
            folder = os.path.join(d, f"saved_{variant}")
            shutil.rmtree(folder, ignore_errors=True)
            result = os.path.join(d, f"{variant}.{rep}.json")
            log = os.path.join(d, f"{variant}.{rep}.log")
            warm_page_cache(ckpt)
            print(f"  W={world}{' EP' if ep else ''} run {rep + 1}/{repeats} {variant:8s} ...", end="", flush=True)
            args = ["--variant", variant, "--path", ckpt, "--out", folder, "--result", result]
            args += ["--ep-size", str(world)] if ep else []
            wall, rc = launch(world, args, log, timeout, worker="_bench_save_worker.py")
            if rc != 0 or not os.path.exists(result):
                print(f" FAILED (rc={rc}); log {log}:\n{log_tail(log)}", flush=True)
                continue
            with open(result) as f:
                ranks = json.load(f)
            runs[variant].append(ranks)
            digests[variant] = digest(folder)
            print(f" save {max(r['seconds'] for r in ranks):.3f}s (slowest rank); launch wall {wall:.1f}s", flush=True)
    median = {}
    for variant, rs in runs.items():
        if rs:
            order = sorted(rs, key=lambda ranks: max(r["seconds"] for r in ranks))
            median[variant] = order[len(order) // 2]
    return {"world_size": world, "ep": ep, "runs": runs, "median": median,
            "identical_files": len(digests) == len(VARIANTS) and len({json.dumps(_files(v)) for v in digests.values()}) == 1,
            "digests": digests}


def _files(digests: dict) -> dict:
    return {k: v for k, v in digests.items() if not k.startswith("total_parameters")}


def summarize(run: dict) -> str:
    world, median = run["world_size"], run["median"]
    title = f"W={world}{' (expert parallel, ep_size=' + str(world) + ')' if run['ep'] else ''}"
    lines = [f"### save, {title}", "", "| variant | rank | save s | peak RSS growth MiB | collective MiB | written MiB |",
             "|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        for r in median.get(variant, []):
            lines.append(f"| {variant} | {r['rank']} | {r['seconds']:.3f} | {r['rss_growth'] / MiB:.1f} | "
                         f"{r['collective_bytes'] / MiB:.1f} | {r['wchar'] / MiB:.1f} |")
    if len(median) == 2:
        t = {v: max(r["seconds"] for r in median[v]) for v in VARIANTS}
        m = {v: max(r["rss_growth"] for r in median[v]) for v in VARIANTS}
        c = {v: max(r["collective_bytes"] for r in median[v]) for v in VARIANTS}
        lines += ["", f"- time (slowest rank): ours {t['ours']:.3f}s vs upstream {t['upstream']:.3f}s = "
                      f"{t['upstream'] / t['ours']:.1f}x faster",
                  f"- peak RSS growth (worst rank): ours {m['ours'] / MiB:.1f} MiB vs upstream {m['upstream'] / MiB:.1f}"
                  f" MiB = {m['upstream'] / max(m['ours'], 1):.1f}x less",
                  f"- bytes through collectives (worst rank): ours {c['ours'] / MiB:.1f} MiB vs upstream "
                  f"{c['upstream'] / MiB:.1f} MiB",
                  f"- saved files byte-identical: {'PASS' if run['identical_files'] else 'FAIL'}"]
        counts = {v: [n for k, n in sorted(run["digests"].get(v, {}).items()) if k.startswith("total_parameters")]
                  for v in VARIANTS}
        if counts["ours"] != counts["upstream"]:
            lines.append(f"- index metadata total_parameters: ours {counts['ours']} vs upstream {counts['upstream']} "
                         "(upstream counts ZeRO-3's emptied local tensors; a plain save_pretrained writes ours)")
        if not run["identical_files"]:
            ours, upstream = run["digests"].get("ours", {}), run["digests"].get("upstream", {})
            lines.append(f"  differing files: {sorted(n for n in set(ours) | set(upstream) if ours.get(n) != upstream.get(n))}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="./out/bench")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--ep", action="store_true", help="also save expert-parallel engines (ep_size = world size)")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    start = time.perf_counter()
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    ckpt = os.path.join(workdir, "ckpt")
    meta = make_checkpoint(ckpt, "bench")
    print(f"checkpoint {ckpt}: Qwen3-MoE, {meta['params'] / 1e6:.1f}M params bf16, {meta['files']} shards, "
          f"{meta['bytes_on_disk'] / MiB:.1f} MiB; machine: {os.cpu_count()} CPU cores\n")
    report = {"checkpoint": meta, "worlds": {}}
    for ep in [False] + ([True] if args.ep else []):
        for world in [int(w) for w in args.world_sizes.split(",") if w.strip()]:
            run = run_world(world, ckpt, workdir, args.repeats, args.timeout, ep)
            report["worlds"][f"{world}{'_ep' if ep else ''}"] = run
            print()
            print(summarize(run), flush=True)
            print()
    print(f"total wall time {time.perf_counter() - start:.0f}s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
