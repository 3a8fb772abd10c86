"""Command line: `hf-zero3-loader plan CHECKPOINT --world-size W` shows what each rank reads and whether it fits.

`hf-zero3-loader verify CHECKPOINT --world-size W` runs a real load and compares it with the plain one.
`hf-zero3-loader bench ...` runs scripts/bench_load.py (upstream vs ours, side by side).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

from . import log
from ._version import __version__
from .errors import LoaderError


def _ep_candidates(world: int, num_experts: int) -> list[int]:
    return [e for e in range(1, world + 1) if world % e == 0 and num_experts % e == 0]


def plan_report(checkpoint: str, world_size: int, ep_size: int | None = None, ds_config: dict | None = None,
                device_memory: float | None = None, device: str = "cuda", model_class=None, show_ranks: int = 8,
                load_kwargs: dict | None = None) -> dict:
    """Everything `plan` prints, as a dict (what `--json` writes). Reads only the config and the headers.
    `load_kwargs`: where the checkpoint is and which code builds it (subfolder, revision, variant, use_safetensors,
    trust_remote_code), as given to `from_pretrained`."""
    from .deepspeed_setup import DeepSpeedSetup
    from .errors import ConfigError
    from .expert_parallel import request_from, structure_named, supported_model_types
    from .planner.inspect import plan_ranks
    from .planner.memory import GiB, predict

    ds_config = ds_config or {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    stage = DeepSpeedSetup(ds_config, "--ds-config").stage
    if stage != 3:  # its predictions are of partitions; under ZeRO-0/1/2 the load has none
        raise ConfigError(f"plan predicts ZeRO-3 loads, and this DeepSpeed config is ZeRO stage {stage}: there every "
                          "rank loads the whole model onto its device, as transformers does")
    section = ds_config.get("expert_parallel") or {}  # a preset or custom patterns named for the model
    request = request_from(ds_config, ep_size, None, world_size)  # as a load merges --ep-size and the config's
    ep_size = request.ep_size if request is not None else None
    ranks = sorted({*range(min(world_size, show_ranks)), world_size - 1})
    plans, model, checkpoint_, resolution, layout = plan_ranks(checkpoint, world_size, ranks=ranks,
                                                               model_class=model_class, ep_size=ep_size,
                                                               with_model=True, load_kwargs=load_kwargs,
                                                               expert_parallel=section)
    from .planner.inspect import meta_skeleton
    from .planner.memory import layer_params

    total = sum(e.numel for e in checkpoint_.entries.values())
    largest_full = layer_params(meta_skeleton(checkpoint, model_class, **(load_kwargs or {}))[0] if layout else model)[0]
    prediction = predict(plans, model, ds_config, checkpoint_.nbytes, total, largest_full, ep_size or 1, device)
    model_type = getattr(model.config, "model_type", "?")
    warnings = []
    ops = sorted({type(op).__name__ for c in resolution.used_mapping for op in getattr(c, "operations", [])})
    first = plans[0]
    if first.missing_keys:
        from .planner.plan import suspicious_missing_keys

        warnings.append(f"{len(first.missing_keys)} model tensors are not in the checkpoint (initialised at load)")
        if suspicious := suspicious_missing_keys(first, body=getattr(model, "base_model_prefix", "")):
            missing, alike = suspicious[0]
            warnings.append(f"{len(suspicious)} of them look like unexpected checkpoint tensors (e.g. {missing} <- "
                            f"{alike[0]}): the load refuses them (ConversionMismatchError) unless "
                            "allow_suspicious_missing_keys=True")
    if first.unexpected_keys:
        warnings.append(f"{len(first.unexpected_keys)} checkpoint tensors are not used by the model")
    if first.mismatched_keys:  # as the load says: refused, unless ignore_mismatched_sizes=True initialises them
        from .planner.plan import missing_inputs

        short = [t for t, _, shape in sorted(first.mismatched_keys, key=lambda m: m[0])
                 if missing_inputs(resolution.inputs.get(t, {}), tuple(shape))]
        warnings.append(f"{len(first.mismatched_keys)} model tensors have another shape in the checkpoint"
                        + (f" ({len(short)} lack numbered checkpoint tensors, e.g. {short[0]})" if short else "")
                        + ": the load refuses them (with ignore_mismatched_sizes=True they are initialised at load)")
    smallest_ep = None
    if device_memory is not None and not prediction.fits(device_memory):
        if model_type in supported_model_types() or structure_named(section):
            from .expert_parallel import ExpertParallelLayout  # noqa: F401  (only to say EP is possible)

            num_experts = _num_experts(model.config)
            for e in _ep_candidates(world_size, num_experts or 1):
                if e <= (ep_size or 1):
                    continue
                trial = plan_report(checkpoint, world_size, e, ds_config, None, device, model_class, show_ranks=1,
                                    load_kwargs=load_kwargs)
                if trial["train"]["device_bytes"] <= device_memory * GiB:
                    smallest_ep = e
                    break
        else:
            warnings.append(f"model type {model_type!r} has no DeepSpeed AutoEP preset: expert parallelism cannot "
                            "shrink its largest gather unless the config's expert_parallel section names one "
                            "(preset_model) or custom patterns")
    if ep_size and not layout:
        warnings.append("the config enables expert parallelism, but the model has no experts: planned as plain "
                        "ZeRO-3, as it loads (and as engine-side AutoEP trains it)")
    return {
        "checkpoint": checkpoint, "model_type": model_type, "world_size": world_size, "ep_size": ep_size or 1,
        "device": device, "checkpoint_bytes": checkpoint_.nbytes, "parameters": prediction.total_params,
        "conversions": ops, "warnings": warnings,
        "ranks": [{"rank": p.rank, "bytes_to_read": p.bytes_to_read, "read_items": sum(len(t.reads) for t in p.tensors.values()),
                   "load_ours_host_bytes": prediction.load_ours_host[i], "load_ours_device_bytes": prediction.load_ours_device[i],
                   "load_upstream_host_bytes": prediction.load_upstream_host[i],
                   "load_upstream_device_bytes": prediction.load_upstream_device[i]} for i, p in enumerate(plans)],
        "train": {"device_bytes": prediction.train_device, "host_bytes_per_node": prediction.train_host_per_node,
                  "largest_layer": prediction.largest_layer, "largest_layer_params": prediction.largest_layer_params,
                  "largest_gather_bytes": prediction.largest_gather_bytes},
        "device_memory_bytes": None if device_memory is None else int(device_memory * GiB),
        "fits": prediction.fits(device_memory), "smallest_ep_size_that_fits": smallest_ep,
    }


def _num_experts(config) -> int | None:
    for attr in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return None


def add_location_arguments(parser) -> None:
    """The `from_pretrained` keywords that say where the checkpoint is and which code builds it."""
    group = parser.add_argument_group("checkpoint location (as from_pretrained's keywords)")
    group.add_argument("--subfolder", default=None, help="the model's folder inside CHECKPOINT")
    group.add_argument("--revision", default=None, help="hub revision (a repo id in the local hub cache)")
    group.add_argument("--cache-dir", default=None,
                       help="the hub cache holding a repo id (from_pretrained's cache_dir)")
    group.add_argument("--variant", default=None, help="weight files of a variant, e.g. model.fp16.safetensors")
    group.add_argument("--no-safetensors", dest="use_safetensors", action="store_const", const=False, default=None,
                       help="prefer pickled weights (use_safetensors=False)")
    group.add_argument("--trust-remote-code", action="store_true", help="run the checkpoint's own modeling code")


def _load_kwargs(args) -> dict:
    kwargs = {k: getattr(args, k) for k in ("subfolder", "revision", "cache_dir", "variant", "use_safetensors")
              if getattr(args, k) is not None}
    if args.trust_remote_code:
        kwargs["trust_remote_code"] = True
    return kwargs


# where --model-class is not given: the first of these that builds the architecture the checkpoint's config names
_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForSeq2SeqLM",
                 "AutoModelForSpeechSeq2Seq", "AutoModelForSequenceClassification", "AutoModelForMaskedLM")


def _model_class_name(args) -> str:
    """--model-class, or the auto class of the architecture the config names (a vision-language model:
    AutoModelForImageTextToText); AutoModelForCausalLM where none matches."""
    if args.model_class:
        return args.model_class
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(args.checkpoint, **_load_kwargs(args))
    except (OSError, ValueError):  # the load itself reports what is wrong with the folder
        return "AutoModelForCausalLM"
    from ._transformers_private import auto_class_builds

    named = (getattr(config, "architectures", None) or [None])[0]
    for name in _AUTO_CLASSES:
        if named is not None and auto_class_builds(getattr(transformers, name), config.model_type, named):
            return name
    return "AutoModelForCausalLM"


def _gib(nbytes: int) -> str:
    from .log import size

    return size(nbytes)


def default_device() -> str:
    """Where partitions live by default: the GPU where torch sees one, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _checkpoint_problem(args) -> str | None:
    """What is wrong with CHECKPOINT before anything is launched: a path that is not there, or a file. A name that
    could be a hub repo id (`org/name`) is left to the load (it may be in the hub cache)."""
    import re

    path = args.checkpoint
    if os.path.isdir(path):
        inner = os.path.join(path, args.subfolder) if args.subfolder else path
        return None if os.path.isdir(inner) else f"no such folder: {inner} (--subfolder {args.subfolder})"
    if os.path.exists(path):
        return f"not a folder: {path} (give the folder that holds config.json and the weights)"
    if re.fullmatch(r"[\w][\w.-]*(/[\w][\w.-]*)?", path) is None:  # not a repo id: a path that is not there
        return f"no such folder: {path}"
    return None


def _plan(args) -> int:
    import transformers

    ds_config = None
    if args.ds_config:
        with open(args.ds_config) as f:
            ds_config = json.load(f)
    device = args.device or default_device()
    # libraries' import-time notices must not mix into --json output; AutoEP's warnings once, not per layer and size
    with contextlib.redirect_stdout(sys.stderr), log.each_dependency_message_once():
        model_class = _model_class_name(args)
        report = plan_report(args.checkpoint, args.world_size, args.ep_size, ds_config, args.device_memory,
                             device, getattr(transformers, model_class), load_kwargs=_load_kwargs(args))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from .log import count

    on_cpu = report["device"] == "cpu"
    print(f"{report['checkpoint']}: {report['model_type']}, {count(report['parameters'])} parameters, "
          f"{_gib(report['checkpoint_bytes'])} on disk; world size {report['world_size']}, ep_size "
          f"{report['ep_size']}, partitions on the {'CPU (host memory)' if on_cpu else 'GPU'}")
    print(f"conversions: {', '.join(report['conversions']) or 'renames only'}")
    print()
    if on_cpu:  # the partitions are in host memory: no device columns
        print(f"{'rank':>5} {'read':>10} {'reads':>7} | {'ours host':>10} | {'upstr host':>10}   "
              "(peak during the load)")
        for r in report["ranks"]:
            print(f"{r['rank']:>5} {_gib(r['bytes_to_read']):>10} {r['read_items']:>7} | "
                  f"{_gib(r['load_ours_host_bytes']):>10} | {_gib(r['load_upstream_host_bytes']):>10}")
    else:
        print(f"{'rank':>5} {'read':>10} {'reads':>7} | {'ours host':>10} {'ours dev':>10} | {'upstr host':>10} "
              f"{'upstr dev':>10}   (peak during the load)")
        for r in report["ranks"]:
            print(f"{r['rank']:>5} {_gib(r['bytes_to_read']):>10} {r['read_items']:>7} | "
                  f"{_gib(r['load_ours_host_bytes']):>10} {_gib(r['load_ours_device_bytes']):>10} | "
                  f"{_gib(r['load_upstream_host_bytes']):>10} {_gib(r['load_upstream_device_bytes']):>10}")
    t = report["train"]
    print()
    if on_cpu:
        print(f"after deepspeed.initialize, per rank: {_gib(t['device_bytes'])} of host memory for the ZeRO-3 model "
              f"states and the largest gather (activations not included); {_gib(t['host_bytes_per_node'])} of "
              "other host memory per node")
    else:
        print(f"after deepspeed.initialize, per rank: {_gib(t['device_bytes'])} on the GPU (ZeRO-3 model states and "
              f"the largest gather; activations not included), {_gib(t['host_bytes_per_node'])} of host memory "
              "per node")
    print(f"largest all-gather in a forward pass: {t['largest_layer'] or '-'} ({count(t['largest_layer_params'])} "
          f"parameters, {_gib(t['largest_gather_bytes'])})")
    if report["fits"] is not None:
        verdict = "fits" if report["fits"] else "does NOT fit"
        print(f"{'memory per rank' if on_cpu else 'GPU memory'} {_gib(report['device_memory_bytes'])}: {verdict}")
        if not report["fits"] and report["smallest_ep_size_that_fits"]:
            print(f"smallest ep_size that fits: {report['smallest_ep_size_that_fits']}")
    for w in report["warnings"]:
        print(f"warning: {w}")
    if args.verbose:
        plans = __import__("hf_zero3_loader.planner.inspect", fromlist=["plan_ranks"]).plan_ranks(
            args.checkpoint, args.world_size, ranks=[args.rank], model_class=getattr(transformers, model_class),
            ep_size=report["ep_size"] if report["ep_size"] > 1 else args.ep_size, load_kwargs=_load_kwargs(args),
            expert_parallel=(ds_config or {}).get("expert_parallel"))
        for tp in plans[0].tensors.values():
            print(f"  {tp.name:70} {tp.status:10} [{tp.start}:{tp.end}) of {tp.numel} -> {len(tp.reads)} reads")
    return 0


class _Refused(Exception):
    """A reason `verify` does not launch, said in one line."""


def _verify_config(args) -> tuple[dict | None, str]:
    """--ds-config read and checked, and the dtype both loads use: --dtype, else the config's, else bfloat16."""
    from .deepspeed_setup import DeepSpeedSetup

    ds_config = None
    if args.ds_config:
        try:
            with open(args.ds_config) as f:
                ds_config = json.load(f)
        except OSError as e:
            raise _Refused(f"cannot read --ds-config {args.ds_config}: {e.strerror}") from e
        except ValueError as e:
            raise _Refused(f"--ds-config {args.ds_config} is not JSON: {e}") from e
        if not isinstance(ds_config, dict):
            raise _Refused(f"--ds-config {args.ds_config} is not a JSON object")
        setup = DeepSpeedSetup(ds_config, f"--ds-config {args.ds_config}")
        try:
            stage = setup.stage
        except LoaderError as e:
            raise _Refused(str(e)) from e
        if stage != 3:
            raise _Refused(f"--ds-config {args.ds_config} is ZeRO stage {stage}: verify checks ZeRO-3 loads (under "
                           "ZeRO-0/1/2 every rank loads the whole model with transformers)")
        engine = setup.dtype  # None: the config leaves it to "auto"
        if engine is not None:
            name = str(engine).removeprefix("torch.")
            if args.dtype is not None and args.dtype != name:
                raise _Refused(f"--dtype {args.dtype} conflicts with --ds-config {args.ds_config}, which trains in "
                               f"{name}: drop --dtype, or change the config")
            return ds_config, name
    return ds_config, args.dtype or "bfloat16"


def _verify(args) -> int:
    from .verify import launch

    def refuse(message: str) -> int:
        print(f"hf-zero3-loader verify: {message}", file=sys.stderr)
        return 2

    if args.expert_parallel and not args.ep_size:
        return refuse("--expert-parallel adds to the section --ep-size enables; give --ep-size too")
    if args.world_size < 1:
        return refuse(f"--world-size must be at least 1, got {args.world_size}")
    if args.port is not None and not 0 < args.port < 65536:
        return refuse(f"--port must be between 1 and 65535, got {args.port}")
    if problem := _checkpoint_problem(args):
        return refuse(problem)
    try:
        expert_parallel = json.loads(args.expert_parallel) if args.expert_parallel else None
    except ValueError as e:
        return refuse(f"--expert-parallel is not JSON: {e}")
    try:
        ds_config, dtype = _verify_config(args)
    except _Refused as e:
        return refuse(str(e))
    with contextlib.redirect_stdout(sys.stderr):
        import transformers

        if args.model_class and not hasattr(transformers, args.model_class):
            return refuse(f"--model-class {args.model_class}: transformers has no class of that name")
        if not os.path.isdir(args.checkpoint):  # a hub repo id: its config must load here, as in every rank
            try:
                transformers.AutoConfig.from_pretrained(args.checkpoint, **_load_kwargs(args))
            except (OSError, ValueError) as e:
                first = (str(e).strip().splitlines() or [""])[0]
                return refuse(f"no such folder: {args.checkpoint}, nor a hub model whose config loads "
                              f"({type(e).__name__}: {first})")
        report = launch(args.checkpoint, args.world_size, dtype, _model_class_name(args), args.ep_size,
                        load_kwargs=_load_kwargs(args), expert_parallel=expert_parallel,
                        keep_in_fp32=args.keep_in_fp32, port=args.port, ds_config=ds_config, verbose=args.verbose,
                        log_path=args.log)
    if args.json:
        print(json.dumps(report, indent=2))
    elif "error" in report:
        for cause in report["causes"]:
            print(f"hf-zero3-loader verify: {cause}", file=sys.stderr)
        if report.get("log"):
            print(f"hf-zero3-loader verify: the ranks' full output is in {report['log']} (--verbose shows it as it "
                  "comes)", file=sys.stderr)
    else:
        verdict = "OK" if report["ok"] else "MISMATCH"
        print(f"{verdict}: {report['compared']} gathered tensors compared with the plain from_pretrained of "
              f"{report['checkpoint']} (world size {report['world_size']}, ep_size {report['ep_size']}, "
              f"{report['dtype']}); {len(report['problems'])} differ")
        for problem in report["problems"][:20]:
            print("  " + problem)
        if report.get("left_by_init"):
            print(f"{len(report['left_by_init'])} missing tensors that the model's own init never writes are zeros "
                  "here (a plain load leaves uninitialised memory in them): "
                  + ", ".join(report["left_by_init"][:8]))
        if report.get("in_engine_dtype"):
            print(f"{len(report['in_engine_dtype'])} parameters the plain load keeps in another dtype are in "
                  f"{report['dtype']} here, equal to its values cast (--keep-in-fp32 keeps its dtypes): "
                  + ", ".join(report["in_engine_dtype"][:8]))
    return 0 if report.get("ok") else 1


def _bench(args, rest) -> int:
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_load.py")
    return subprocess.call([sys.executable, script, *rest])


def add_digest_parser(sub) -> None:
    digest = sub.add_parser("digest", help="write SHA256SUMS for a local checkpoint folder: loads of it then compare "
                                           "whole-file digests across ranks")
    digest.add_argument("checkpoint", help="a local checkpoint folder")
    digest.add_argument("--threads", type=int, default=4, help="files hashed at once (default 4)")


def _digest(args) -> int:
    """`hf-zero3-loader digest FOLDER`: the sha256 of every file of the folder, as `SHA256SUMS` (the format of
    `sha256sum`); a load whose ranks all find it compares these digests (digests.py). Digests this machine computed
    before for the same files are reused."""
    import time

    from .digests import write_manifest

    start = time.perf_counter()
    try:
        path, sums = write_manifest(args.checkpoint, threads=args.threads)
    except (OSError, LoaderError) as e:
        print(f"hf-zero3-loader digest: error: {e}", file=sys.stderr)
        return 2
    nbytes = sum(os.path.getsize(os.path.join(args.checkpoint, name)) for name in sums)
    print(f"wrote {path}: {len(sums)} files, {nbytes / 2**30:.2f} GiB, in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hf-zero3-loader")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="show what each rank reads, without reading tensor data")
    plan.add_argument("checkpoint", help="a checkpoint folder, or a hub repo id in the local hub cache")
    plan.add_argument("--world-size", type=int, required=True, help="the number of ranks (processes) of the load")
    plan.add_argument("--ep-size", type=int, default=None, help="expert parallelism (DeepSpeed AutoEP layout)")
    plan.add_argument("--ds-config", help="DeepSpeed config JSON (dtype, offload); default ZeRO-3 bf16")
    plan.add_argument("--device-memory", type=float, default=None,
                      help="GiB of memory per rank (a GPU's; with --device cpu, host memory): does training fit?")
    plan.add_argument("--device", default=None, choices=("cuda", "cpu"),
                      help="where partitions live (default: cuda where torch sees a GPU, else cpu)")
    plan.add_argument("--model-class", default=None,
                      help="transformers auto class (default: the one that builds the config's architecture, "
                           "else AutoModelForCausalLM)")
    plan.add_argument("--rank", type=int, default=0, help="rank whose tensors --verbose lists")
    plan.add_argument("--verbose", action="store_true", help="also list each tensor --rank reads")
    plan.add_argument("--json", action="store_true", help="print the whole report as JSON")
    add_location_arguments(plan)
    verify = sub.add_parser("verify", help="a real multi-rank load compared, tensor by tensor, with the plain load")
    verify.add_argument("checkpoint", help="a checkpoint folder, or a hub repo id in the local hub cache")
    verify.add_argument("--world-size", type=int, required=True,
                        help="the number of ranks torchrun starts on this machine (CPU ranks where there is no GPU)")
    verify.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="the dtype of both loads: the DeepSpeed engine's (the default config enables bf16 or "
                             "fp16 for it; float32: neither) and the plain from_pretrained's dtype (default: the "
                             "--ds-config's dtype, else bfloat16)")
    verify.add_argument("--ds-config", default=None, metavar="FILE",
                        help="a DeepSpeed config JSON file (ZeRO-3) for the ranks' loads, instead of the default "
                             "ZeRO-3 in --dtype; its dtype, offload and expert_parallel sections are used")
    verify.add_argument("--ep-size", type=int, default=None,
                        help="expert parallelism: each rank loads num_experts / ep-size experts (DeepSpeed AutoEP)")
    verify.add_argument("--expert-parallel", default=None,
                        help='JSON: more of DeepSpeed\'s expert_parallel section, e.g. \'{"preset_model": "qwen3_moe"}\' '
                             "for a model type without an AutoEP preset")
    verify.add_argument("--model-class", default=None,
                        help="transformers auto class (default: the one that builds the config's architecture, "
                             "else AutoModelForCausalLM)")
    verify.add_argument("--keep-in-fp32", action="store_true",
                        help="load with keep_in_fp32=True: parameters the plain load keeps in fp32 stay in fp32")
    verify.add_argument("--port", type=int, default=None,
                        help="torchrun's master port on 127.0.0.1 (default: a free port)")
    verify.add_argument("--verbose", action="store_true",
                        help="show the ranks' own output (logs, tracebacks) as it comes, instead of keeping it in a "
                             "log file named on failure")
    verify.add_argument("--log", default=None, metavar="FILE",
                        help="keep the ranks' output in FILE (default: a new file in the temp folder, removed when "
                             "the check passes)")
    verify.add_argument("--json", action="store_true", help="print the report (or the error) as JSON")
    add_location_arguments(verify)
    sub.add_parser("bench", help="run scripts/bench_load.py (arguments are passed through)")
    add_digest_parser(sub)
    args, rest = parser.parse_known_args(argv)
    if args.command == "digest":
        return _digest(args)
    if args.command == "plan":
        if problem := _checkpoint_problem(args):
            print(f"hf-zero3-loader plan: error: {problem}", file=sys.stderr)
            return 2
        try:
            return _plan(args)
        except (OSError, ValueError, LoaderError) as e:  # a checkpoint or an argument we cannot plan: say which
            hint = (" (--trust-remote-code)" if "trust_remote_code" in str(e) else "")
            print(f"hf-zero3-loader plan: error: {e}{hint}", file=sys.stderr)
            return 2
    if args.command == "verify":
        return _verify(args)
    return _bench(args, rest)


if __name__ == "__main__":
    sys.exit(main())
