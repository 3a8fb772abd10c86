"""Demo: load one small Qwen3-MoE checkpoint on 2 CPU ranks with transformers' ZeRO-3 path and with ours.

    python scripts/demo.py [--workdir ./out/demo]

1. writes (once) a random bf16 Qwen3-MoE checkpoint (14.6M params, 28 MiB in 4 shards, per-expert tensors on disk that
   transformers fuses into 3-D expert parameters) with `save_pretrained`;
2. `torchrun --nproc_per_node 2`: hf_zero3_loader.from_pretrained(AutoModelForCausalLM, path, ds_config=DS);
   rank 0 gathers every parameter and buffer and saves them;
3. `torchrun --nproc_per_node 2`: transformers' own path (HfDeepSpeedConfig(DS) alive, then
   AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), built under deepspeed.zero.Init);
   rank 0 gathers every parameter and buffer and compares each with ours: same names, dtype, shape, bits;
4. prints load time, peak RSS growth, collective bytes and bytes read per rank, and "OK: ..." or exits 1;
5. the same with expert parallelism (ep_size 2, DeepSpeed AutoEP), timed through the end of deepspeed.initialize:
   ours loads each rank's 32 local experts straight into AutoEP's layout; transformers' path loads every expert and
   lets deepspeed.initialize replace the MoE blocks (engine-side AutoEP); rank 0 compares its gathered tensors.

Each variant runs in its own torchrun launch (fresh processes), with the checkpoint files in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import MiB, launch, log_tail, make_checkpoint, table, warm_page_cache  # noqa: E402

WORLD = 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="./out/demo")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    start = time.perf_counter()
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    ckpt = os.path.join(workdir, "ckpt")
    meta = make_checkpoint(ckpt, "demo")
    print(f"checkpoint {ckpt}: Qwen3-MoE, {meta['params'] / 1e6:.1f}M params bf16, {meta['files']} shards, "
          f"{meta['bytes_on_disk'] / MiB:.1f} MiB")

    for ep in (False, True):
        if not run_pair(workdir, ckpt, args.timeout, ep):
            return 1
    print(f"[{time.perf_counter() - start:.0f}s]")
    return 0


def run_pair(workdir: str, ckpt: str, timeout: float, ep: bool) -> bool:
    """ours, then upstream (which compares its gathered tensors with ours); prints the table; True if equal."""
    suffix = "_ep" if ep else ""
    extra = ["--ep-size", str(WORLD)] if ep else []
    state = os.path.join(workdir, "ours" + suffix)
    for stale in (state + ".state.json", state + ".state.pt"):
        if os.path.exists(stale):
            os.remove(stale)
    print()
    print(f"== {'expert parallel size 2 (AutoEP), load + deepspeed.initialize' if ep else 'ZeRO-3 load'} ==")
    results = []
    for variant, more in (("ours", ["--state-out", state, "--full-state"]), ("upstream", ["--compare-with", state])):
        result = os.path.join(workdir, f"{variant}{suffix}.json")
        if os.path.exists(result):
            os.remove(result)
        log = os.path.join(workdir, f"{variant}{suffix}.log")
        warm_page_cache(ckpt)
        print(f"torchrun --nproc_per_node {WORLD} scripts/_bench_worker.py --variant {variant} {' '.join(extra)} ...",
              end="", flush=True)
        wall, rc = launch(WORLD, ["--variant", variant, "--path", ckpt, "--result", result, *extra, *more], log, timeout)
        print(f" {wall:.1f}s")
        if rc != 0 or not os.path.exists(result):
            print(f"FAILED: {variant} launch (rc={rc}); log {log}:\n{log_tail(log)}")
            return False
        with open(result) as f:
            results.extend(json.load(f))

    print()
    print(table(results))
    print()
    print("load s: wall time of from_pretrained on that rank" + (" plus deepspeed.initialize" if ep else "") +
          "; peak RSS growth: the kernel's high-water mark (VmHWM) over the RSS just before the load; collective MiB: "
          "tensor bytes given to torch.distributed collectives (incl. DeepSpeed's all-gathers); read MiB: ours = its "
          "report's bytes_read, upstream = read() bytes (/proc/self/io rchar) + bytes of tensors taken from the "
          "mmapped shards via safetensors get_tensor")
    if ep:
        for r in results:
            if r["variant"] == "ours":
                e = r["report"]["expert_parallel"]
                print(f"ours rank {r['rank']}: EP rank {e['ep_rank']}, experts {e['local_experts'][0]}.."
                      f"{e['local_experts'][-1]} of {e['num_experts']}, read {e['expert_bytes_read'] / MiB:.1f} MiB of "
                      f"experts + {e['other_bytes_read'] / MiB:.1f} MiB of the rest")
    cmp_ = next(r["comparison"] for r in results if "comparison" in r)
    if not cmp_["equal"] or cmp_["bitwise_tensor_compares"] != cmp_["tensors"]:
        print(f"MISMATCH: {len(cmp_['problems'])} of {cmp_['tensors']} gathered tensors differ between upstream and "
              f"ours (bitwise compares done: {cmp_['bitwise_tensor_compares']}):")
        for p in cmp_["problems"][:20]:
            print("  " + p)
        return False
    print(f"OK: all {cmp_['parameters']} parameters and {cmp_['buffers']} buffers gathered on rank 0 are equal "
          f"(same names, dtypes, shapes, bitwise-equal values) between transformers' ZeRO-3 path"
          f"{' + engine-side AutoEP' if ep else ''} and hf_zero3_loader")
    return True


if __name__ == "__main__":
    sys.exit(main())
