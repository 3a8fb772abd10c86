"""One rank of a save benchmark launch (run by torchrun): load the checkpoint into a ZeRO-3 engine, then save it one
way and measure the save.

    torchrun --nproc_per_node W scripts/_bench_save_worker.py --variant {ours,upstream} --path CKPT --out DIR
        --result R.json [--max-shard-size 200MB] [--ep-size N]

  ours      hf_zero3_loader.save_pretrained(engine, DIR): every rank writes its partitions, nothing gathered
  upstream  what Trainer.save_model / accelerate do with stage3_gather_16bit_weights_on_model_save: the engine's
            _zero3_consolidated_16bit_state_dict() (every parameter all-gathered, layer by layer, into rank 0's CPU
            memory), then model.save_pretrained(DIR, state_dict=...) on rank 0

Both load with hf_zero3_loader (not measured). The window is the save only: per rank wall seconds, peak RSS growth over
the RSS just before it (the kernel's VmHWM, reset there), bytes through collectives, bytes written (/proc/self/io wchar).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_worker import DS_CONFIG, RssSampler, io_counters  # noqa: E402
from tests.instrument import CollectiveCounter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=("ours", "upstream"), required=True)
    ap.add_argument("--path", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--max-shard-size", default="200MB")
    ap.add_argument("--ep-size", type=int, default=0)
    args = ap.parse_args()

    import deepspeed
    from transformers import AutoModelForCausalLM

    import hf_zero3_loader

    on_gpu = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {**DS_CONFIG, "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    if args.ep_size:
        config["expert_parallel"] = {"enabled": True, "autoep_size": args.ep_size}
    model = hf_zero3_loader.from_pretrained(AutoModelForCausalLM, args.path, ds_config=config)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    dist.barrier()

    counter = CollectiveCounter()
    io0 = io_counters()
    with RssSampler() as rss:
        start = time.perf_counter()
        with counter:
            if args.variant == "ours":
                report = hf_zero3_loader.save_pretrained(engine, args.out, max_shard_size=args.max_shard_size)
            else:
                state_dict = engine._zero3_consolidated_16bit_state_dict()
                if rank == 0:
                    model.save_pretrained(args.out, state_dict=state_dict, max_shard_size=args.max_shard_size)
                del state_dict
        seconds = time.perf_counter() - start
    io1 = io_counters()
    result = {"variant": args.variant, "rank": rank, "world_size": world, "seconds": seconds,
              "rss_growth": rss.growth()["rss"], "collective_bytes": sum(counter.bytes.values()),
              "collective_calls": sum(counter.calls.values()), "wchar": io1["wchar"] - io0["wchar"]}
    if args.variant == "ours":
        result["report"] = report.summary()
    every = [None] * world
    dist.all_gather_object(every, result)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(every, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
