"""Benchmark: reading and checking every shard's header (`checkpoint.open_checkpoint`), cold and warm, as the loader
does it against reading the files in turn.

    python scripts/bench_headers.py [--workdir ./out/bench_headers] [--rounds 5] [--threads 8]

Every rank reads every shard's header before it plans: per file an open, the header's length and bytes, and eight
4 KiB data samples spread over the file (its fingerprint, which ranks compare to prove they hold the same copy):
about ten dependent small reads. From the page cache that is CPU work; from cold or network storage each is a round
trip. The loader reads them in turn when the checkpoint is in the page cache, and with the reads of up to
`HEADER_THREADS` files in flight at once when it is not (`checkpoint.read_headers`). The checkpoint: a 48-layer
Qwen3-MoE of ~270 MB, saved by `save_pretrained` in 147 shards of at most 2 MB (`_ckpt.py`, "bench_many_shards"). Each
round runs each variant cold (every shard evicted with posix_fadvise DONTNEED first) and then warm (three times),
alternating which variant goes first; it prints the median seconds and the bytes fetched from the device. Linux only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(SCRIPTS)
sys.path[:0] = [REPO, SCRIPTS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="./out/bench_headers")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="8", help="HEADER_THREADS values for the loader's variant, comma-separated")
    args = ap.parse_args()

    from _bench_common import checkpoint_files, device_read_bytes, evict_page_cache, make_checkpoint

    from hf_zero3_loader import checkpoint as ckpt

    folder = os.path.join(os.path.abspath(args.workdir), "ckpt")
    make_checkpoint(folder, "bench_many_shards")
    files = checkpoint_files(folder)
    os.sync()  # pages just written cannot be evicted until they are clean
    default_threads = ckpt.HEADER_THREADS
    variants = {"in turn": 1, **{f"loader, {n} threads": n for n in map(int, args.threads.split(","))}}
    seconds = {(v, cache): [] for v in variants for cache in ("cold", "warm")}
    fetched = {(v, cache): [] for v in variants for cache in ("cold", "warm")}
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for cache in ("cold", "warm"):
            for name in order:
                ckpt.HEADER_THREADS = variants[name]
                if cache == "cold":
                    evict_page_cache(folder)
                for _ in range(1 if cache == "cold" else 3):  # warm runs are short: three per round
                    before, t = device_read_bytes(), time.perf_counter()
                    checkpoint = ckpt.open_checkpoint(files)
                    seconds[name, cache].append(time.perf_counter() - t)
                    fetched[name, cache].append(device_read_bytes() - before)
    ckpt.HEADER_THREADS = default_threads

    print(f"{len(files)} files, {len(checkpoint.entries)} tensors, {checkpoint.nbytes / 2**20:.0f} MiB; "
          f"{args.rounds} rounds; {os.cpu_count()} CPU cores\n")
    print("| variant | cold s | cold: MiB from the device | in turn / this, cold | warm s | in turn / this, warm |")
    print("|---|---|---|---|---|---|")
    base = {cache: statistics.median(seconds["in turn", cache]) for cache in ("cold", "warm")}
    for name in variants:
        cold, warm = (statistics.median(seconds[name, cache]) for cache in ("cold", "warm"))
        print(f"| {name} | {cold:.3f} | {statistics.median(fetched[name, 'cold']) / 2**20:.1f} | "
              f"{base['cold'] / cold:.2f}x | {warm:.3f} | {base['warm'] / warm:.2f}x |")


if __name__ == "__main__":
    main()
