"""Benchmark: bytes fetched from the storage device per byte read, when a machine holds only some ranks of the world.

    python scripts/bench_read_amplification.py [--checkpoint ./out/bench/ckpt] [--layouts 8:0,64:5,8:0-3,2:0-1]

A machine of a multi-node load reads only its ranks' slices of every tensor (and, with expert parallelism, runs of
whole expert matrices), skipping what other machines read. For each layout W:RANKS (the ranks this machine holds in a
world of W), one process plans those ranks with the loader's planner (`plan_tensors`, no distributed job) and reads
their spans cold through the loader's `FileReader`, in file order, twice: with the kernel's read-ahead (what the
loader did before) and without it (`readahead=False`, what it does when ranks of the world are on other machines).
It prints bytes read, bytes the device delivered (/proc/self/io read_bytes) and their ratio, and seconds. The
checkpoint is evicted from the page cache (posix_fadvise DONTNEED) before each pass. Default checkpoint: the 939 MiB
Qwen3-MoE `bench_load.py` builds (run it once first). Linux only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(SCRIPTS)
sys.path[:0] = [REPO, SCRIPTS]

from _bench_common import device_read_bytes, evict_page_cache, spans_of  # noqa: E402


def machine_spans(folder: str, world_size: int, ranks: list[int]) -> list:
    """(file, byte offset, nbytes) of every read the planner gives these ranks, in file order."""
    from hf_zero3_loader.planner.inspect import plan_ranks

    plans, _, checkpoint, _, _ = plan_ranks(folder, world_size, ranks, with_model=True)
    return sorted(span for plan in plans for span in spans_of(plan, checkpoint.entries))


def one_pass(spans: list, folder: str, readahead: bool) -> tuple[int, float]:
    import torch

    from hf_zero3_loader.reader import FileReader

    evict_page_cache(folder)
    out = torch.empty(max(n for _, _, n in spans), dtype=torch.uint8)
    reader = FileReader(readahead=readahead)
    before, start = device_read_bytes(), time.perf_counter()
    try:
        for path, offset, nbytes in spans:
            reader.read_into(path, offset, out[:nbytes])
    finally:
        reader.close()
    return device_read_bytes() - before, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=os.path.join(REPO, "out", "bench", "ckpt"))
    ap.add_argument("--layouts", default="8:0,64:5,8:0-3,2:0-1",
                    help="W:RANKS, comma-separated; RANKS one rank or a range a-b (the ranks this machine holds)")
    args = ap.parse_args()
    print("| this machine holds | MiB read | read-ahead: device MiB, ratio, s | no read-ahead: device MiB, ratio, s |")
    print("|---|---|---|---|")
    for layout in args.layouts.split(","):
        world, _, ranks = layout.partition(":")
        lo, _, hi = ranks.partition("-")
        held = list(range(int(lo), int(hi or lo) + 1))
        spans = machine_spans(args.checkpoint, int(world), held)
        wanted = sum(n for _, _, n in spans)
        cells = []
        for readahead in (True, False):
            fetched, seconds = one_pass(spans, args.checkpoint, readahead)
            cells.append(f"{fetched / 2**20:.1f}, {fetched / wanted:.2f}x, {seconds:.2f}")
        name = f"rank {held[0]} of {world}" if len(held) == 1 else f"ranks {held[0]}-{held[-1]} of {world}"
        print(f"| {name} | {wanted / 2**20:.1f} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
