"""`hf-zero3-loader verify CHECKPOINT --world-size W`: a real W-rank load, every gathered tensor compared with the
plain single-process `from_pretrained` of the same checkpoint (what to run before trusting a new family).

The command launches `torchrun --nproc_per_node W -m hf_zero3_loader.verify ...`; rank 0 also loads the model the
plain way (so it needs the whole model's memory once) and compares each parameter and buffer, gathered one at a
time, for dtype, shape and bits. Exit status 0 when all are equal. Missing parameters the model's own init never writes
(uninitialised memory in the plain load; see `missing_init.UnwrittenWatch`) are checked to be zeros and listed apart.
Parameters the plain load keeps in another float dtype (`_keep_in_fp32_modules`) load in the engine's dtype unless
`keep_in_fp32` is passed (the documented default): they are compared with the plain values cast to it, and listed.
The ranks' output goes to a log file; a failure is reported as one line per cause (a rank's error names the rank),
with the log file's name.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

from .log import quiet_dependency_deprecations


def launch(checkpoint: str, world_size: int, dtype: str = "bfloat16", model_class: str = "AutoModelForCausalLM",
           ep_size: int | None = None, timeout: float = 3600, load_kwargs: dict | None = None,
           expert_parallel: dict | None = None, keep_in_fp32: bool = False, port: int | None = None,
           ds_config: dict | None = None, verbose: bool = False, log_path: str | None = None) -> dict:
    """Run the verification in `world_size` fresh processes; return rank 0's report. `load_kwargs` go to both
    loads (where the checkpoint is and which code builds it: subfolder, revision, variant, trust_remote_code...).
    `expert_parallel`: more of DeepSpeed's section of that name with `ep_size` (a `preset_model`, custom patterns).
    `keep_in_fp32`: our load's keyword of that name. `port`: torchrun's master port (default: a free one).
    `ds_config`: the DeepSpeed config of the ranks' loads (default: ZeRO-3 in `dtype`). `verbose`: the ranks' output
    goes to stderr as it comes; otherwise it is kept in a log file (`log_path`, default a new file in the temp folder),
    named in the report, and a failure is reported as one line per cause: `{"ok": False, "error": ..., "log": ...}`."""
    import tempfile

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "report.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size), "--master_addr",
               "127.0.0.1", "--master_port", str(port), "-m", "hf_zero3_loader.verify", checkpoint, out,
               "--dtype", dtype, "--model-class", model_class, "--load-kwargs", json.dumps(load_kwargs or {})]
        cmd += ["--ep-size", str(ep_size)] if ep_size else []
        cmd += ["--expert-parallel", json.dumps(expert_parallel)] if expert_parallel else []
        cmd += ["--keep-in-fp32"] if keep_in_fp32 else []
        cmd += ["--ds-config", json.dumps(ds_config)] if ds_config is not None else []
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        own_log = False
        if verbose:
            log_path, log = None, None
        else:
            if log_path is None:
                fd, log_path = tempfile.mkstemp(prefix="hf-zero3-loader-verify-", suffix=".log")
                os.close(fd)
                own_log = True
            log = open(log_path, "w")
        try:
            returncode = subprocess.run(cmd, stdout=log or sys.stderr, stderr=subprocess.STDOUT if log else None,
                                        timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            if log is not None:
                log.close()
        if os.path.exists(out) and returncode == 0:
            with open(out) as f:
                report = json.load(f)
            if own_log:
                os.remove(log_path)  # nothing to look at
            elif log_path is not None:
                report["log"] = log_path
            return report
        causes = _rank_errors(out, world_size)
        if returncode is None:
            causes.insert(0, f"the ranks did not finish within {timeout:.0f} s")
        if not causes:
            causes = [_launcher_error(log_path, returncode)]
        where = f" (full output: {log_path})" if log_path else ""
        return {"ok": False, "error": "\n".join(causes) + where, "causes": causes, "log": log_path}


def _rank_errors(out: str, world_size: int) -> list[str]:
    """One line per distinct error the ranks wrote (`_write_error`), naming the ranks that raised it."""
    import re

    by_error: dict[str, list[int]] = {}
    for rank in range(world_size):
        path = f"{out}.rank{rank}.error"
        if os.path.exists(path):
            with open(path) as f:
                error = f.read().strip()
            # an error every rank raised together names the rank it came from ("OSError: [rank 0] ..."): that rank
            if m := re.fullmatch(r"(\w+): \[rank (\d+)\] (.*)", error, re.S):
                error, rank = f"{m[1]}: {m[3]}", int(m[2])
            if rank not in by_error.setdefault(error, []):
                by_error[error].append(rank)
    return [f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, sorted(ranks)))}: {error}"
            for error, ranks in by_error.items()]


def _launcher_error(log_path: str | None, returncode: int | None) -> str:
    """No rank said what went wrong (killed, or torchrun failed before starting them): the last exception line of the
    output that is not torchrun's own summary of a failed child."""
    import re

    lines = []
    if log_path is not None and os.path.exists(log_path):
        with open(log_path, errors="replace") as f:
            lines = [line.strip() for line in f]
    found = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)
             and "ChildFailedError" not in line]
    if found:
        return f"the verification job failed (exit {returncode}): {found[-1]}"
    return f"the verification job failed (exit {returncode}) before any rank reported an error"


def _write_error(out: str, error: BaseException) -> None:
    """This rank's error, in one line, for `launch` to report (the traceback goes to the log)."""
    first = (str(error).strip().splitlines() or [""])[0]
    with open(f"{out}.rank{os.environ.get('RANK', '0')}.error", "w") as f:
        f.write(f"{type(error).__name__}: {first}" if first else type(error).__name__)


def _expected(name: str, plain: dict, ep_rank: int, ep_size: int):
    """The plain load's tensor for one of ours (AutoEP tensors: their slice of the fused experts, or their local
    experts' weights stacked where each expert is its own module)."""
    import re

    import torch

    if m := re.fullmatch(r"(.*)\.experts\.(w1|w2|w3)", name):
        moe, which = m.groups()
        if f"{moe}.experts.0.gate_proj.weight" in plain:  # one module per expert (DeepSeek-V3's hub code)
            num = 0  # experts are numbered from 0: count by lookup, not by scanning every name
            while f"{moe}.experts.{num}.gate_proj.weight" in plain:
                num += 1
            n, weight = num // ep_size, {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[which]
            local = range(ep_rank * n, (ep_rank + 1) * n)
            return torch.stack([plain[f"{moe}.experts.{e}.{weight}.weight"] for e in local])
        gate_up, down = plain[f"{moe}.experts.gate_up_proj"], plain[f"{moe}.experts.down_proj"]
        n = gate_up.shape[0] // ep_size
        local, ffn = slice(ep_rank * n, (ep_rank + 1) * n), gate_up.shape[1] // 2
        return {"w1": gate_up[local, :ffn], "w3": gate_up[local, ffn:], "w2": down[local]}[which]
    if m := re.fullmatch(r"(.*)\.(?:router|gate)\.gate\.(weight|bias)", name):  # the block's router, by its name
        return plain.get(f"{m[1]}.gate.{m[2]}", plain.get(f"{m[1]}.router.{m[2]}"))
    if m := re.fullmatch(r"(.*)\.(?:router|gate)\.e_score_correction_bias", name):  # wherever the block keeps it
        found = [n for n in plain if n.startswith(f"{m[1]}.") and n.endswith(".e_score_correction_bias")]
        return plain[found[0]] if len(found) == 1 else None
    if name not in plain and ".shared_experts" in name:
        return plain.get(name.replace(".shared_experts", ".shared_expert"))
    return plain.get(name)


def dequantize_config(checkpoint: str, load_kwargs: dict):
    """For an FP8 or MXFP4 checkpoint, the quantization config that loads it dequantized; else None."""
    import transformers

    location = {k: v for k, v in load_kwargs.items()
                if k in ("subfolder", "revision", "cache_dir", "trust_remote_code")}
    from .zero3_load import quant_method

    quantization = getattr(transformers.AutoConfig.from_pretrained(checkpoint, **location), "quantization_config", None)
    config_class = {"fp8": transformers.FineGrainedFP8Config, "mxfp4": transformers.Mxfp4Config}.get(
        quant_method(quantization))
    return config_class(dequantize=True) if config_class is not None else None


def _worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    import transformers

    import hf_zero3_loader
    from hf_zero3_loader import _transformers_private as hf_private

    deepspeed.init_distributed()
    rank = dist.get_rank()
    dtype = getattr(torch, args.dtype)
    if args.ds_config is not None:  # the user's config (the command checked that its dtype is args.dtype)
        config = json.loads(args.ds_config)
    else:
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        if dtype == torch.bfloat16:
            config["bf16"] = {"enabled": True}
        elif dtype == torch.float16:
            config["fp16"] = {"enabled": True}
    if args.ep_size:
        config["expert_parallel"] = {**(config.get("expert_parallel") or {}), **json.loads(args.expert_parallel),
                                     "enabled": True, "autoep_size": args.ep_size}
    model_class = getattr(transformers, args.model_class)
    load_kwargs = json.loads(args.load_kwargs)
    dequantize = dequantize_config(args.checkpoint, load_kwargs)
    if dequantize is not None:  # ZeRO-3 trains dequantized weights: both loads dequantize (else a GPU keeps FP8)
        load_kwargs["quantization_config"] = dequantize
    model = hf_zero3_loader.from_pretrained(model_class, args.checkpoint, ds_config=config, dtype=dtype,
                                            keep_in_fp32=args.keep_in_fp32, **load_kwargs)
    ep = model.hf_zero3_load_report.expert_parallel
    plain = None
    if rank == 0 or ep:  # under EP every rank checks its own experts
        with hf_private.hidden_hf_zero3():  # the plain load, though our ZeRO-3 model keeps transformers' config alive
            reference = model_class.from_pretrained(args.checkpoint, dtype=dtype, **load_kwargs)
        plain = {n: t.detach() for n, t in [*reference.named_parameters(), *reference.named_buffers()]}
    # missing params the model's init never writes: uninitialised memory in the plain load, zeros in ours (by design)
    left_by_init = set(model.hf_zero3_load_report.init.left_by_init)
    in_engine_dtype = not args.keep_in_fp32  # the documented default for `_keep_in_fp32_modules` parameters
    problems, compared, cast = [], 0, []
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            if plain is None or (rank != 0 and ".experts.w" not in name):
                continue
            want = _expected(name, plain, ep["ep_rank"] if ep else 0, ep["ep_size"] if ep else 1)
            got = p.detach().cpu()
            if name in left_by_init:
                if got.any():
                    problems.append(f"{name}: left by the model's init, yet not zeros")
            elif want is None:
                problems.append(f"{name}: not in the plain load")
            elif (in_engine_dtype and got.dtype == dtype and want.dtype != dtype and want.is_floating_point()
                  and got.shape == want.shape and torch.equal(got, want.to(dtype))):
                cast.append(name)  # kept in another dtype by the plain load; equal once cast to the engine's
            elif got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                problems.append(f"{name}: {got.dtype}{tuple(got.shape)} differs from the plain load's "
                                f"{want.dtype}{tuple(want.shape)}")
            compared += 1
    if plain is not None:
        for name, b in model.named_buffers():
            want = _expected(name, plain, 0, 1)
            if name in left_by_init:
                compared += 1
                if b.any():
                    problems.append(f"{name} (buffer): left by the model's init, yet not zeros")
            elif want is not None:
                compared += 1
                if b.dtype != want.dtype or not torch.equal(b.cpu(), want):
                    problems.append(f"{name} (buffer) differs from the plain load")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rank": rank, "compared": compared, "problems": problems, "cast": cast})
    if rank == 0:
        report = {"ok": not any(r["problems"] for r in everyone), "world_size": dist.get_world_size(),
                  "ep_size": ep["ep_size"] if ep else 1, "checkpoint": args.checkpoint, "dtype": args.dtype,
                  "compared": sum(r["compared"] for r in everyone),
                  "problems": [p for r in everyone for p in r["problems"]], "left_by_init": sorted(left_by_init),
                  "in_engine_dtype": sorted({n for r in everyone for n in r["cast"]}),
                  "load": model.hf_zero3_load_report.summary()}
        with open(args.out, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort interpreter teardown (a known torch race)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model-class", default="AutoModelForCausalLM")
    ap.add_argument("--ep-size", type=int, default=None)
    ap.add_argument("--expert-parallel", default="{}", help="JSON: more of DeepSpeed's expert_parallel section")
    ap.add_argument("--load-kwargs", default="{}", help="JSON: from_pretrained keywords for both loads")
    ap.add_argument("--keep-in-fp32", action="store_true", help="our load keeps the plain load's dtypes")
    ap.add_argument("--ds-config", default=None, help="JSON: the DeepSpeed config of our load")
    args = ap.parse_args()
    try:
        with quiet_dependency_deprecations():  # DeepSpeed's gathers call deprecated torch.distributed names
            _worker(args)
    except BaseException as e:
        _write_error(args.out, e)
        raise
