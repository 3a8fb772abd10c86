"""Command line: `hf-zero3-loader plan CHECKPOINT --world-size W` shows what each rank would read.

`hf-zero3-loader bench ...` runs scripts/bench_load.py (upstream vs ours, side by side).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _plan(args) -> int:
    import transformers

    from .planner.inspect import plan_ranks

    model_class = getattr(transformers, args.model_class)
    plans = plan_ranks(args.checkpoint, args.world_size, model_class=model_class)
    rows = [p.summary() for p in plans]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    total = sum(r["bytes_to_read"] for r in rows)
    print(f"{'rank':>4} {'bytes to read':>15} {'share':>7} {'read items':>10}")
    for r in rows:
        print(f"{r['rank']:>4} {r['bytes_to_read']:>15,} {r['bytes_to_read'] / max(total, 1):>7.1%} {r['read_items']:>10}")
    first = plans[0]
    print(f"missing: {len(first.missing_keys)}  unexpected: {len(first.unexpected_keys)}  "
          f"mismatched: {len(first.mismatched_keys)}")
    if args.verbose:
        for t in plans[args.rank].tensors.values():
            print(f"  {t.name:70} {t.status:10} [{t.start}:{t.end}) of {t.numel} -> {len(t.reads)} reads")
    return 0


def _bench(args, rest) -> int:
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_load.py")
    return subprocess.call([sys.executable, script, *rest])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hf-zero3-loader")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="show what each rank reads, without reading tensor data")
    plan.add_argument("checkpoint")
    plan.add_argument("--world-size", type=int, required=True)
    plan.add_argument("--model-class", default="AutoModelForCausalLM")
    plan.add_argument("--rank", type=int, default=0, help="rank whose tensors --verbose lists")
    plan.add_argument("--verbose", action="store_true")
    plan.add_argument("--json", action="store_true")
    sub.add_parser("bench", help="run scripts/bench_load.py (arguments are passed through)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "plan":
        return _plan(args)
    return _bench(args, rest)


if __name__ == "__main__":
    sys.exit(main())
