"""Benchmark: hf_zero3_loader vs transformers' own ZeRO-3 loading vs the read floor, on a ~1 GB Qwen3-MoE.

    python scripts/bench_load.py [--workdir ./out/bench] [--world-sizes 2,4] [--json OUT.json]

Generates (once, cached in WORKDIR/ckpt) a random ~500M-parameter bf16 Qwen3-MoE checkpoint with
`save_pretrained` (6 shards of ~200 MB, 92% of the bytes routed experts). For each world size W it runs separate
`torchrun --nproc_per_node W` launches, one per variant (each --repeats times, interleaved; the median launch is
reported), so every variant starts in a fresh process:

  ours      hf_zero3_loader.from_pretrained(AutoModelForCausalLM, path, ds_config=DS)   (no HfDeepSpeedConfig)
  floor     positional reads (os.preadv into one fresh buffer) of exactly the byte ranges our plan reads on
            that rank, one pass into fresh memory with the loader's default thread count: the cost of merely
            reading this rank's bytes (a second pass would reuse memory the first freed, which this VM serves far
            faster than fresh memory)
  ours_faulting, floor_populated  (--prefault-ab) ours with HF_ZERO3_LOADER_PREFAULT=0, its reads faulting each
            fresh page in, and the floor with the loader's populate call before each read: what populating buys
  upstream  HfDeepSpeedConfig(DS) kept alive, then AutoModelForCausalLM.from_pretrained(path, dtype=bf16):
            built under deepspeed.zero.Init, rank 0 reads the whole checkpoint, gathers/broadcasts per module

DS = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}.

With --ep, each world size W also runs expert parallelism (DS + "expert_parallel": {"enabled": true, "autoep_size": W}),
timed through the end of deepspeed.initialize (no optimizer) for both variants:

  ours      hf_zero3_loader.from_pretrained(..., ds_config=DS_EP) builds the AutoEP layout while loading, each rank
            reading its local experts; then deepspeed.initialize(model, DS_EP)
  upstream  transformers' ZeRO-3 load, then deepspeed.initialize(model, DS_EP): engine-side AutoEP replaces the MoE
            blocks, gathering each layer's whole fused experts on every rank
By default all checkpoint files are read once before every launch: every variant runs warm. With --cold they are
evicted from the page cache (posix_fadvise DONTNEED) before every launch instead, and the floor evicts them again
before each of its timed passes. --size picks the checkpoint (~0.29, ~0.94 or ~3.5 GB) for the size-scaling rows.
Per rank: load seconds; peak RSS growth (the kernel's high-water mark VmHWM, reset at the start of the load through
/proc/self/clear_refs, minus the RSS just before the load; imports and init_distributed happen before; no sampling
thread on the hot path, see _bench_worker.RssSampler); bytes through collectives during the
load (tests/instrument.py CollectiveCounter plus DeepSpeed's captured all-gather/reduce-scatter references,
which that counter cannot see); bytes read (ours: report bytes_read; floor: bytes it read; upstream: read()
bytes from /proc/self/io rchar + bytes of the tensors transformers takes from the mmapped shards through
safetensors get_tensor, counted by wrapping transformers.modeling_utils.safe_open: mmap reads are page faults,
which rchar does not see; its file-backed RSS growth is in the JSON as rss_growth_shared).
On the first world size (--verify-world-size), rank 0 of the upstream run gathers every parameter and
buffer and compares dtype, shape and sha256 of the bits with ours (gathered by ours' rank 0 the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import (REPO, MiB, evict_page_cache, launch, log_tail, make_checkpoint, table,  # noqa: E402
                           warm_page_cache)

VARIANTS = ("ours", "floor", "upstream", "stream", "plain")  # ours first: the floor reads the byte ranges ours planned
PREFAULT_AB = ("ours_faulting", "floor_populated")  # --prefault-ab: ours without populate, the floor with it


def run_world(world: int, ckpt: str, workdir: str, verify: bool, timeout: float, repeats: int, ep: bool = False,
              stream: bool = False, fp8: bool = False, cold: bool = False, tag: str = "", upstream: bool = True,
              prefault_ab: bool = False, state_dict: str | None = None, nvme: bool = False) -> dict:
    """Every variant `repeats` times, interleaved in rotating order; keeps each variant's median run.

    With W ranks on a 2-core machine the wall time of one launch varies a lot with scheduling, so each variant is
    launched `repeats` times and the run whose slowest rank is the median is reported (all runs are in the JSON).
    """
    d = os.path.join(workdir, f"w{world}{'_ep' if ep else ''}{'_fp8' if fp8 else ''}{'_cold' if cold else ''}{tag}"
                              f"{'_state_dict_' + state_dict if state_dict else ''}{'_nvme' if nvme else ''}")
    os.makedirs(d, exist_ok=True)
    # FP8: ours, transformers' ZeRO-3 path (both dequantizing), and the plain single-process load on rank 0
    variants = ("ours", "upstream") if ep else ("ours", "upstream", "plain") if fp8 else VARIANTS[:4] if stream else VARIANTS[:3]
    if fp8 and stream:  # FP8 streamed: the receivers get the stored bytes and dequantize them
        variants += ("stream",)
    if state_dict or nvme:  # in memory before the window, or written to swap files after the read: no read floor
        variants = ("ours", "upstream")
    if not upstream:
        variants = tuple(v for v in variants if v != "upstream")
    if prefault_ab and not ep:
        variants += PREFAULT_AB
    out: dict = {"world_size": world, "runs": {v: [] for v in variants}, "launch_seconds": {v: [] for v in variants},
                 "ep_size": world if ep else None, "cold": cold, "state_dict": state_dict, "nvme": nvme}
    for rep in range(repeats):
        # the order rotates each round (ours first in the first: the floors read the spans it writes), so no variant
        # always runs right after another: on this VM a launch's speed depends on what the one before it left
        for variant in variants[rep % len(variants):] + variants[:rep % len(variants)]:
            if variant.startswith("floor") and not out["runs"]["ours"]:
                continue  # no plan to read
            result = os.path.join(d, f"{variant}.{rep}.json")
            if os.path.exists(result):
                os.remove(result)
            args = ["--variant", variant, "--path", ckpt, "--result", result] + (["--ep-size", str(world)] if ep else [])
            args += ["--dequantize"] if fp8 else []
            args += ["--cold"] if cold else []
            args += ["--state-dict", state_dict] if state_dict else []
            args += ["--nvme-path", os.path.join(d, f"swap_{variant}")] if nvme else []
            check = verify and rep == 0
            if variant == "ours" and rep == 0 and not fp8 and not state_dict:
                args += ["--spans-out", os.path.join(d, "spans.json")]
            if variant == "ours" and check:
                args += ["--state-out", os.path.join(d, "ours")]
            elif variant.startswith("floor"):
                args += ["--spans-in", os.path.join(d, "spans.json")]
            elif variant in ("upstream", "stream") and check:
                args += ["--compare-with", os.path.join(d, "ours")]
            evict_page_cache(ckpt) if cold else warm_page_cache(ckpt)
            log = os.path.join(d, f"{variant}.{rep}.log")
            print(f"  W={world} run {rep + 1}/{repeats} {variant:8s} ...", end="", flush=True)
            wall, rc = launch(world, args, log, timeout)
            out["launch_seconds"][variant].append(wall)
            if rc != 0 or not os.path.exists(result):
                print(f" FAILED (rc={rc}); log {log}:\n{log_tail(log)}", flush=True)
                out.setdefault("failed", []).append(f"{variant} run {rep + 1}")
                continue
            with open(result) as f:
                ranks = json.load(f)
            out["runs"][variant].append(ranks)
            print(f" load {max(r['seconds'] for r in ranks):.3f}s (slowest rank); launch wall {wall:.1f}s"
                  f"{' incl. gather+verify' if check and not variant.startswith('floor') else ''}", flush=True)
    out["results"] = []
    out["median_run"] = {}
    for variant, runs in out["runs"].items():
        if not runs:
            continue
        order = sorted(range(len(runs)), key=lambda i: max(r["seconds"] for r in runs[i]))
        pick = order[len(order) // 2]
        out["median_run"][variant] = pick
        out["results"].extend(runs[pick])
    return out


def summarize(world: int, run: dict, ckpt_bytes: int) -> tuple[str, dict]:
    by = {v: [r for r in run["results"] if r["variant"] == v] for v in VARIANTS + PREFAULT_AB}
    title = f"### world size {world}" + (f", expert parallel size {run['ep_size']} (load + deepspeed.initialize)"
                                         if run.get("ep_size") else "")
    lines = [title, "", f"(per variant: the median of {max(len(v) for v in run['runs'].values())} "
             f"launches by slowest-rank load time)", "", table(run["results"]), ""]
    lines.append("slowest-rank load s of every launch: " + "; ".join(
        f"{v} " + ", ".join(f"{max(r['seconds'] for r in ranks):.3f}" for ranks in runs)
        for v, runs in run["runs"].items() if runs))
    for r in by["upstream"]:
        if r["rss_growth_shared"] > 64 * MiB:
            lines.append(f"upstream rank {r['rank']}: {r['rss_growth_shared'] / MiB:.0f} MiB of its RSS growth is "
                         f"file-backed (mmapped checkpoint pages); anonymous growth {r['rss_growth_anon'] / MiB:.0f} MiB")
    for r in by["floor"] + by["floor_populated"]:
        lines.append(f"{r['variant']} rank {r['rank']}: " + ", ".join(
            f"{t} thread(s) {s:.3f}s" for t, s in sorted(r["floor_seconds_by_threads"].items(), key=lambda x: int(x[0]))))
    for v, runs in run["runs"].items():  # where ours' time goes: each phase's median and range over all rank-runs
        phases: dict = {}
        for ranks in runs:
            for r in ranks:
                for name, sec in (r.get("report") or {}).get("phases", {}).items():
                    phases.setdefault(name, []).append(sec)
                if r.get("report"):
                    phases.setdefault("outside the phases", []).append(r["seconds"] - sum(r["report"]["phases"].values()))
        if phases:
            populated = {r["report"].get("bytes_populated", 0) for ranks in runs for r in ranks if r.get("report")}
            lines.append(f"{v} phases over {sum(len(x) for x in runs)} rank-runs (median, min-max s): " + "; ".join(
                f"{name} {sorted(xs)[len(xs) // 2]:.3f} ({min(xs):.3f}-{max(xs):.3f})"
                for name, xs in phases.items() if name != "init_distributed")
                + f"; destination MiB populated per rank: {', '.join(f'{b / MiB:.1f}' for b in sorted(populated))}")
    disk = {v: sum(r["read_bytes_disk"] for r in rs) for v, rs in by.items()}
    lines.append("bytes fetched from the storage device during the loads (/proc/self/io read_bytes, all ranks; "
                 "~0 means warm): " + ", ".join(f"{v} {b / MiB:.1f} MiB" for v, b in disk.items()))
    lines.append("")

    def worst(v, key):
        return max(r[key] for r in by[v]) if by[v] else None

    ratios, targets = {}, {}
    t_ours, t_up, t_floor = worst("ours", "seconds"), worst("upstream", "seconds"), worst("floor", "seconds")
    if t_ours and t_up:
        ratios["upstream/ours time (slowest rank)"] = t_up / t_ours
        ratios["upstream/ours peak RSS growth (largest rank)"] = worst("upstream", "rss_growth") / worst("ours", "rss_growth")
        c_ours, c_up = worst("ours", "collective_bytes"), worst("upstream", "collective_bytes")
        ratios["upstream/ours collective bytes (per rank)"] = (c_up / c_ours) if c_ours else float("inf")
        ratios["_collective"] = (c_up, c_ours)
    if t_ours and t_floor:
        ratios["ours/floor time (slowest rank)"] = t_ours / t_floor
    t_faulting, t_populated = worst("ours_faulting", "seconds"), worst("floor_populated", "seconds")
    if t_faulting and t_floor:
        ratios["ours_faulting/floor time (slowest rank)"] = t_faulting / t_floor
    if t_ours and t_populated:
        ratios["ours/floor_populated time (slowest rank)"] = t_ours / t_populated
    t_stream = worst("stream", "seconds")
    if t_ours and t_stream:
        ratios["stream/ours time (slowest rank)"] = t_stream / t_ours
        if t_up:
            ratios["upstream/stream time (slowest rank)"] = t_up / t_stream
    lines.append("ratios:")
    for k, v in ratios.items():
        if k == "_collective":
            continue
        extra = ""
        if k.startswith("upstream/ours collective"):
            extra = f"  ({ratios['_collective'][0] / MiB:.1f} MiB vs {ratios['_collective'][1] / MiB:.1f} MiB)"
        lines.append(f"- {k}: {v:.2f}x{extra}" if v != float("inf") else f"- {k}: inf (ours 0 bytes){extra}")
    ratios.pop("_collective", None)

    lines.append("")
    lines.append("targets:")
    budget = ckpt_bytes / world + 128 * MiB
    if run.get("state_dict"):  # the targets are those of a load from files; the equality check still applies
        lines.append("- (a state dict in memory: the load-from-files targets of speed and memory do not apply)")
    elif run.get("nvme"):  # both variants build DeepSpeed's swapper: its pinned buffers are in both RSS growths
        lines.append("- (NVMe offload: both variants hold DeepSpeed's pinned swap buffers, 5 x 1e8 elements by "
                     "default, and page-lock them inside the window; the targets of a load to memory do not apply)")
    elif t_ours and t_up:
        ok = t_up / t_ours >= 10
        targets["ours >= 10x faster than upstream"] = ok
        lines.append(f"- ours >= 10x faster than upstream: {t_up / t_ours:.2f}x -> {'PASS' if ok else 'FAIL'}")
    if by["ours"] and not run.get("state_dict") and not run.get("nvme"):
        every = [r["rss_growth"] for ranks in run["runs"]["ours"] for r in ranks]
        ok = max(every) <= budget
        targets["ours peak RSS growth per rank <= checkpoint/W + 128 MiB"] = ok
        lines.append(f"- ours peak RSS growth per rank <= checkpoint/W + 128 MiB = {budget / MiB:.1f} MiB: "
                     f"max {max(every) / MiB:.1f} MiB over all ranks of all launches -> {'PASS' if ok else 'FAIL'}")
    if t_ours and t_floor:
        limit = 1.2 if run.get("cold") else 1.3
        name = f"ours within {limit}x of the {'cold' if run.get('cold') else 'warm'} floor"
        ok = t_ours <= limit * t_floor
        targets[name] = ok
        lines.append(f"- {name}: {t_ours:.3f}s vs {t_floor:.3f}s = {t_ours / t_floor:.2f}x -> {'PASS' if ok else 'FAIL'}")
        reads = sorted(r["report"]["phases"].get("read", 0.0) for ranks in run["runs"]["ours"] for r in ranks
                       if r.get("report"))
        if reads:  # what the target leaves for everything but the read (plan, allocate, transformers' scaffolding)
            read = reads[len(reads) // 2]
            lines.append(f"  ours less its read phase (median {read:.3f}s): {t_ours - read:.3f}s of fixed cost; "
                         f"{limit}x leaves {limit * t_floor - read:.3f}s for it")
    cmp_ = [r["comparison"] for ranks in run["runs"].get("upstream", []) for r in ranks if "comparison" in r]
    if cmp_:
        c = cmp_[0]
        if c["equal"]:
            lines.append(f"- equality (rank 0, gathered): all {c['tensors']} parameters and buffers of ours and upstream "
                         f"have equal dtype, shape and sha256 of their bits -> PASS")
        else:
            lines.append(f"- equality (rank 0, gathered): {len(c['problems'])} differences -> FAIL: {c['problems'][:10]}")
        targets["ours == upstream (gathered, bitwise)"] = c["equal"]
    return "\n".join(lines), {"ratios": ratios, "targets": targets}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="./out/bench")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--json", dest="json_out", help="also write the raw per-rank numbers here")
    ap.add_argument("--verify-world-size", type=int, default=None,
                    help="world size whose run also checks ours == upstream (default: the first; 0: none)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per torchrun launch")
    ap.add_argument("--repeats", type=int, default=3, help="launches per variant and world size (median reported)")
    ap.add_argument("--ep", action="store_true", help="also run expert parallelism (ep_size = world size)")
    ap.add_argument("--ep-only", action="store_true", help="run only the expert parallelism rows")
    ap.add_argument("--fp8-only", action="store_true",
                    help="only the FP8 rows: the checkpoint in fine-grained FP8, dequantized while loading")
    ap.add_argument("--size", default="bench", choices=("bench_quarter", "bench", "bench_4gb", "bench_many_shards"),
                    help="the checkpoint: ~0.27 GB, ~1 GB (default) or ~3.8 GB of the same Qwen3-MoE (32/128/512 "
                         "experts), or bench_many_shards: ~0.27 GB of a 48-layer Qwen3-MoE in 147 shards")
    ap.add_argument("--cold", action="store_true",
                    help="evict the checkpoint from the page cache (posix_fadvise DONTNEED) before every launch")
    ap.add_argument("--stream", action="store_true",
                    help="also run load_from='stream': rank 0 reads and streams every other rank its bytes")
    ap.add_argument("--no-upstream", action="store_true",
                    help="skip transformers' path (ours against the floor only, e.g. to compare two versions of ours)")
    ap.add_argument("--read-threads", type=int, help="read_threads for ours (default: the loader's own default)")
    ap.add_argument("--state-dict", choices=("every", "rank0"),
                    help="ours and upstream load `from_pretrained(None, config=..., state_dict=...)` from the "
                         "checkpoint's tensors held in memory before the window: on every rank, or on rank 0 only "
                         "(meta tensors on the others, which ours streams from rank 0 and upstream broadcasts)")
    ap.add_argument("--nvme", action="store_true",
                    help="ours and upstream with offload_param to NVMe (DeepSpeed's default swap buffers; swap files "
                         "under WORKDIR): the partitions are written to swap files within the window")
    ap.add_argument("--prefault-ab", action="store_true",
                    help="also run ours with HF_ZERO3_LOADER_PREFAULT=0 (reads fault pages in) and the floor with the "
                         "loader's populate call, to measure what populating the destinations buys")
    args = ap.parse_args()
    if args.read_threads:
        os.environ["HF_ZERO3_BENCH_READ_THREADS"] = str(args.read_threads)

    start = time.perf_counter()
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    ckpt = os.path.join(workdir, "ckpt" if args.size == "bench" else f"ckpt_{args.size}")
    worlds = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    verify_world = worlds[0] if args.verify_world_size is None else args.verify_world_size

    meta = make_checkpoint(ckpt, args.size)
    ckpt_bytes = meta["bytes_on_disk"]
    print(f"checkpoint {ckpt}: Qwen3-MoE, {meta['params'] / 1e6:.1f}M params bf16 "
          f"({meta['expert_params'] / meta['params']:.0%} in experts), {meta['files']} safetensors shards, "
          f"{ckpt_bytes / MiB:.1f} MiB on disk")
    if args.cold:
        evicted = evict_page_cache(ckpt)
        print(f"page cache: COLD runs: all {evicted / MiB:.1f} MiB of shards are evicted (posix_fadvise DONTNEED) "
              "before every launch; the floor reads its bytes cold too")
    else:
        warmed = warm_page_cache(ckpt)
        print(f"page cache: WARM runs: all {warmed / MiB:.1f} MiB of shards are read once before every launch")
    import subprocess

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "hf_zero3_loader"], capture_output=True, text=True,
                           cwd=REPO).stdout.strip()
    print(f"hf_zero3_loader at {head}{' + uncommitted changes in hf_zero3_loader/' if dirty else ''}")
    print(f"machine: {os.cpu_count()} CPU cores; each variant runs in its own torchrun launch (fresh processes)\n")

    report: dict = {"checkpoint": {"path": ckpt, **meta}, "worlds": {}}
    texts = []
    modes = ([] if args.ep_only else [False]) + ([True] if args.ep or args.ep_only else [])
    if args.fp8_only:
        sys.path.insert(0, REPO)
        from tests.checkpoints import fp8_checkpoint

        ckpt = fp8_checkpoint(ckpt, os.path.join(workdir, "ckpt_fp8"))
        files = [f for f in os.listdir(ckpt) if f.endswith(".safetensors")]
        print(f"FP8 checkpoint {ckpt}: {sum(os.path.getsize(os.path.join(ckpt, f)) for f in files) / MiB:.1f} MiB")
        modes = [False]
    for ep in modes:
        for world in worlds:
            run = run_world(world, ckpt, workdir, verify=world == verify_world and not args.no_upstream, timeout=args.timeout,
                            repeats=args.repeats, ep=ep, stream=args.stream, fp8=args.fp8_only, cold=args.cold,
                            tag="" if args.size == "bench" else f"_{args.size}", upstream=not args.no_upstream,
                            prefault_ab=args.prefault_ab, state_dict=args.state_dict, nvme=args.nvme)
            text, summary = summarize(world, run, ckpt_bytes)
            run.update(summary)
            report["worlds"][f"{world}{'_ep' if ep else ''}"] = run
            texts.append(text)
            print()
            print(text, flush=True)
            print()
    report["total_seconds"] = time.perf_counter() - start
    print(f"total wall time {report['total_seconds']:.0f}s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"raw numbers: {args.json_out}")


if __name__ == "__main__":
    main()
