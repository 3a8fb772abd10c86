"""Sweep of the accelerator staging knobs (`staging_bytes`, `read_threads`) at world size 1, in one process.

    python scripts/bench_staging.py [--workdir ./out/bench] [--size bench] [--repeats 3]

For a GPU session (partitions on the device; on a CPU machine the loads read in place and the knobs do nothing).
One process loads the bench checkpoint (warm page cache) once untimed, then `--repeats` times per setting in rotating
order (`--cold`: the checkpoint evicted from the page cache before each), and prints per setting the median load
seconds and read phase. The pinned host allocator's cache is emptied
before each load, so every load pins its staging buffer as a fresh process would; the cost of that pinning alone is
measured first, per size. The floor is `_bench_worker.read_spans` of the same byte ranges (fresh memory, the loader's
default threads): bench_load.py's warm floor, in this process.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _bench_common import MiB, evict_page_cache, make_checkpoint, warm_page_cache  # noqa: E402


def empty_host_cache() -> None:
    if hasattr(torch._C, "_host_emptyCache"):  # pinned blocks go back to the OS, so the next load pins afresh
        torch._C._host_emptyCache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="./out/bench")
    ap.add_argument("--size", default="bench", choices=("bench_quarter", "bench", "bench_4gb"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--staging-mib", default="32,64,128,256")
    ap.add_argument("--threads", default="2,4,8")
    ap.add_argument("--cold", action="store_true", help="evict the checkpoint before each timed load and floor pass")
    args = ap.parse_args()
    ckpt = os.path.join(args.workdir, "ckpt" if args.size == "bench" else f"ckpt_{args.size}")
    info = make_checkpoint(ckpt, args.size)
    print(f"checkpoint {ckpt}: {info}", flush=True)
    # run with plain `python`: the first load starts a world-size-1 process group itself (NCCL on a GPU)
    from _bench_worker import DS_CONFIG, load_ours, plan_spans, read_spans
    from hf_zero3_loader.reader import default_io_threads

    on_gpu = torch.cuda.is_available()
    print(f"device: {torch.cuda.get_device_name() if on_gpu else 'cpu (staging unused)'}; "
          f"{os.cpu_count()} cores; default read_threads {default_io_threads()}", flush=True)

    if on_gpu:
        for mib in map(int, args.staging_mib.split(",")):
            times = []
            for _ in range(3):
                empty_host_cache()
                start = time.perf_counter()
                buf = torch.empty(mib * MiB, dtype=torch.uint8, pin_memory=True)
                times.append(time.perf_counter() - start)
                del buf
            print(f"pinning {mib:4d} MiB: {min(times):.4f} s (best of 3; {mib / 1024 / min(times):.1f} GiB/s)")

    warm_page_cache(ckpt)
    model = load_ours(ckpt, DS_CONFIG)  # untimed: lazy imports, CUDA and NCCL set-up
    spans = plan_spans(model)
    del model
    floors = []
    for _ in range(args.repeats):
        if args.cold:
            evict_page_cache(ckpt)
        start = time.perf_counter()
        buf = read_spans(spans, default_io_threads())
        floors.append(time.perf_counter() - start)
        del buf
    floor = statistics.median(floors)
    print(f"{'cold' if args.cold else 'warm'} floor (read_spans, {default_io_threads()} threads, fresh memory): "
          f"median {floor:.3f} s "
          f"({', '.join(f'{t:.3f}' for t in floors)})", flush=True)

    settings = list(itertools.product(map(int, args.staging_mib.split(",")), map(int, args.threads.split(","))))
    results = {s: [] for s in settings}
    for rep in range(args.repeats):
        for mib, threads in settings[rep % len(settings):] + settings[:rep % len(settings)]:
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
            empty_host_cache()
            if args.cold:
                evict_page_cache(ckpt)
            start = time.perf_counter()
            model = load_ours(ckpt, DS_CONFIG, staging_bytes=mib * MiB, read_threads=threads)
            seconds = time.perf_counter() - start
            report = model.hf_zero3_load_report
            results[(mib, threads)].append((seconds, report.phases["read"], report.phases["finalize"]))
            del model, report

    print("\n| staging MiB | read threads | load s (median) | read phase s | finalize s | load / floor |")
    print("|---|---|---|---|---|---|")
    for (mib, threads), runs in results.items():
        load, read, fin = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"| {mib} | {threads} | {load:.3f} | {read:.3f} | {fin:.3f} | {load / floor:.2f}x |")


if __name__ == "__main__":
    main()
