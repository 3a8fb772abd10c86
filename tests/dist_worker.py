"""Runs inside each rank of a real `torchrun` job: loads checkpoints with hf_zero3_loader, gathers, dumps.

Usage: torchrun --nproc_per_node W tests/dist_worker.py CASES.json   (or `--serve FOLDER`: a pool, see `serve`)
Each case: {"path", "out", "dtype", "model_class", "kwargs", "ds_config"(optional), "train_steps"(optional),
"checkpoint_roundtrip"(optional), "all_ranks_state"(optional), "save"(optional: {"dir", "kwargs", "reference"}),
"load_again"(optional: a second model loaded the same way, kept while the first is gathered and trained),
"callers_zero_init"(optional: {"dtype"}: the load inside the script's own `with deepspeed.zero.Init(...)`),
"peft_adapter"(optional: an adapter folder PEFT's `PeftModel.from_pretrained` loads over the model)}.
What one rank does differently (keys: the rank as a string): "path_by_rank", "kwargs_by_rank", "model_class_by_rank",
"ds_config_by_rank", "adapters_by_rank", and the save's own "kwargs_by_rank".
Rank 0 writes `out` (torch.save) with every gathered parameter and buffer, the loading report, and
the collectives each rank saw during the load (with "all_ranks_state", every rank's gathered state: under expert
parallelism each rank gathers its own experts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import traceback
from contextlib import nullcontext

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.instrument import CollectiveCounter, LargestAllocation  # noqa: E402


# ZeRO-3 keeping no parameter whole on every rank: DeepSpeed keeps those under 1e5 elements so
# (`stage3_param_persistence_threshold`), which is every parameter of the tests' small models, so a training step
# would gather and release nothing; with this, each step gathers and releases as a large model's do
NOTHING_PERSISTENT = {"stage": 3, "stage3_param_persistence_threshold": 0}


# transformers' docs' ds_config_zero3.json: "auto" wherever the Trainer fills in a value
TRAINER_STYLE_CONFIG = {
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"},
                          "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}


def ds_config_for(dtype: str, extra: dict | None = None) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    if os.environ.get("HF_ZERO3_TEST_BACKEND") == "nccl":  # a lent GPU: torch's AdamW, not a JIT-built fused Adam
        config["optimizer"]["params"]["torch_adam"] = True
    if dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    if dtype == "float16":  # V100/T4 users' engine (loads on CPU ranks; DeepSpeed's CPU accelerator cannot train it)
        config["fp16"] = {"enabled": True}
    config.update(extra or {})
    return config


def gather_state(model) -> dict:
    import deepspeed

    state = {}
    named = list(model.named_parameters(remove_duplicate=False))
    # many at once, their all-gathers in flight together; one by one from NVMe (its swap buffers are few)
    batch = 1 if any(getattr(p, "nvme_swapper", None) is not None for _, p in named) else 256
    for start in range(0, len(named), batch):
        chunk = named[start:start + batch]
        with deepspeed.zero.GatheredParameters([p for _, p in chunk]):
            for name, p in chunk:
                state[name] = p.detach().clone().cpu()
    for name, b in model.named_buffers(remove_duplicate=False):
        state[name] = b.detach().clone().cpu()
    return state


def sharing(model) -> list[list[str]]:
    """The names under which one parameter (or buffer) object appears more than once: tied weights are one tensor, not
    equal copies (a copy would train apart from its twin)."""
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    return sorted(sorted(group) for group in names.values() if len(group) > 1)


def rng_digest() -> str:
    """Where the global RNG stands, for what a run draws next (sampling, dropout)."""
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


def next_deepep_scope() -> int:
    """The DeepEP sharing scope AutoEP's next `AutoEP` object takes (a process-wide counter, read without taking one)."""
    from deepspeed.module_inject import auto_ep_comm

    return int(repr(auto_ep_comm._SCOPE_COUNTER)[len("count("):-1])


def initialize(model, ds_config: dict, result: dict, autoep_fields: bool = False):
    """deepspeed.initialize, counting the collectives it issues (into `result["init_collectives"]`); with
    `autoep_fields`, what `describe_autoep_layers` says of the model as `initialize` leaves it (before `train()`), and
    how many DeepEP sharing scopes the case took by then (from `result["scope_at_start"]`)."""
    import deepspeed

    result["rng_before_initialize"] = rng_digest()
    with CollectiveCounter() as counter:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
    result["init_collectives"] = {"calls": counter.calls, "bytes": counter.bytes, "largest": counter.largest}
    result["rng_after_initialize"] = rng_digest()
    if autoep_fields:
        result["autoep_fields"] = describe_autoep_layers(model, result["scope_at_start"])
        result["scopes_taken"] = next_deepep_scope() - result["scope_at_start"]
    engine.train()
    return engine


# the loader's own marks on the AutoEP layers it builds (`_deepspeed_private.BUILT_BY_LOADER`,
# `expert_parallel.BUILT_WITH`): not DeepSpeed's, so not compared
LOADER_TAGS = ("_hf_zero3_loader_built", "_hf_zero3_loader_autoep_section")
# ZeRO-3's per-parameter bookkeeping: its counter and closures differ by construction order, not by what they mean
PARAM_BOOKKEEPING = ("ds_id", "ds_tensor", "all_gather", "all_gather_coalesced", "partition", "reduce_gradients_at_owner",
                     "partition_gradients", "aligned_size", "padding_size", "partition_numel", "item_override",
                     "convert_to_zero_parameters", "ds_summary", "nvme_swapper", "ds_process_group",
                     "ds_zero_partition_process_group", "comm", "data")


def _describe(value, depth: int = 0):
    """A comparable picture of an attribute: plain values as they are, tensors by dtype, shape and values, process
    groups by their ranks, modules by class (each described on its own), other objects by their fields."""
    import dataclasses
    import enum

    if isinstance(value, torch.Tensor):
        data = None if value.is_meta or value.numel() > 100_000 else value.detach().float().cpu().tolist()
        return ("tensor", str(value.dtype), tuple(value.shape), data)
    if value is None or isinstance(value, (bool, int, float, str, enum.Enum)):
        return value
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_describe(v, depth + 1) for v in value]
        return (type(value).__name__, sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items)
    if isinstance(value, dict):
        return {str(k): _describe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, torch.nn.Module):
        return ("module", type(value).__qualname__)
    if isinstance(value, dist.ProcessGroup):
        return ("group", tuple(dist.get_process_group_ranks(value)))
    if isinstance(value, type):
        return ("class", value.__qualname__)
    if callable(value) and not hasattr(value, "__dict__") or type(value).__name__ in ("function", "method"):
        return ("callable", getattr(value, "__qualname__", type(value).__name__))
    if dataclasses.is_dataclass(value) and depth < 4:
        return (type(value).__qualname__, {f.name: _describe(getattr(value, f.name), depth + 1)
                                           for f in dataclasses.fields(value)})
    if hasattr(value, "__dict__") and depth < 4:
        return (type(value).__qualname__, {k: _describe(v, depth + 1) for k, v in vars(value).items()})
    return ("object", type(value).__qualname__)


def describe_autoep_layers(model, scope_at_start: int) -> dict:
    """Every AutoEP layer of `model` and each module inside it, field by field: class, `training`, every other
    attribute (`vars()`, hooks by count), buffers with their values, and each parameter's dtype, shape and tags
    (ZeRO-3's bookkeeping left out). Compares the loader's layers with engine-side AutoEP's. Process-wide counters
    count from where this case found them: `deepep_scope` from `scope_at_start`, a module's ZeRO-3 `ds_id` from the
    model's (the engine numbers modules from a counter every engine of the process shares)."""
    import enum

    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    described = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, AutoEPMoELayer):
            continue
        for sub, module in layer.named_modules():
            fields = {}
            for key, value in vars(module).items():
                if key in ("_parameters", "_buffers", "_modules") or key in LOADER_TAGS:
                    continue
                if key.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called")) and isinstance(value, dict):
                    fields[key] = ("hooks", len(value))
                elif key == "deepep_scope" and isinstance(value, int):
                    fields[key] = ("scope", value - scope_at_start)
                elif key == "ds_id" and hasattr(model, "ds_id"):
                    fields[key] = ("module id", value - model.ds_id)
                else:
                    fields[key] = _describe(value)
            buffers = {b: _describe(t) for b, t in module._buffers.items()}
            params = {p: ("param", str(t.dtype), tuple(getattr(t, "ds_shape", t.shape)), t.requires_grad,
                          {k: _describe(v) for k, v in vars(t).items() if k not in PARAM_BOOKKEEPING
                           and (v is None or isinstance(v, (bool, int, float, str, enum.Enum, dist.ProcessGroup)))})
                      for p, t in module._parameters.items() if t is not None}
            described[f"{name}.{sub}" if sub else name] = {"class": type(module).__qualname__, "fields": fields,
                                                           "buffers": buffers, "params": params}
    return described


def train_losses(engine, steps: int, vocab: int, seed: int = 1234, seq_len: int = 12,
                 first_output: dict | None = None) -> list[float]:
    """`first_output`: a dict that gets the first step's logits (the forward output before any step), as "logits"."""
    g = torch.Generator().manual_seed(seed)
    losses = []
    module = getattr(engine, "module", engine)
    classifier = type(module).__name__.endswith("ForSequenceClassification")  # a reward model: one label per sequence
    for _ in range(steps):
        ids = torch.randint(0, vocab, (1, seq_len), generator=g).to(engine.device)
        out = engine(input_ids=ids, labels=ids[:, 0] % module.config.num_labels if classifier else ids)
        if first_output is not None and not losses:
            first_output["logits"] = out.logits.detach().cpu().clone()
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return losses


def checkpoint_roundtrip(case: dict, engine, load_model, ds_config: dict, vocab: int) -> dict:
    """save_checkpoint, take one more step; a freshly loaded and initialised engine that load_checkpoint()s the
    same folder takes the same step: both losses must be equal."""
    import deepspeed

    folder = case["out"] + ".ckpt"
    engine.save_checkpoint(folder, tag="t")
    next_loss = train_losses(engine, 1, vocab, seed=99)[0]
    fresh = load_model()
    engine2, *_ = deepspeed.initialize(model=fresh, config=ds_config, model_parameters=fresh.parameters())
    engine2.load_checkpoint(folder, tag="t")
    engine2.train()
    return {"next_loss": next_loss, "next_loss_after_load": train_losses(engine2, 1, vocab, seed=99)[0]}


def inject_fault(case: dict):
    """Test-side fault injection on one rank: patch a loader internal so that this rank fails, dies, stops or
    stalls, or its checkpoint changes under it. Returns a function that undoes the patch."""
    import signal

    import hf_zero3_loader.reader as reader
    import hf_zero3_loader.zero3_load as loader  # the ZeRO-3 load's steps look these names up here

    fault = case.get("inject")
    if not fault or fault["rank"] != dist.get_rank():
        return lambda: None
    saved = [(reader.FileReader, "read_buffers"), (os, "open"), (loader, "run_reads"), (loader, "initialize_missing"),
             (reader.FileReader, "__init__")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in saved]

    def undo():
        for owner, name, value in saved:
            setattr(owner, name, value)

    kind = fault["kind"]
    real_run_reads, real_init_missing, real_open = loader.run_reads, loader.initialize_missing, os.open
    if kind == "raise_in_read":
        def failing_read(self, path, offset, buffers):  # every read of a checkpoint file goes through it
            raise OSError(f"injected read failure in {path}")
        reader.FileReader.read_buffers = failing_read
    elif kind == "unreadable":  # this rank cannot open the checkpoint files, the others can
        def denied(path, *args, **kwargs):
            if str(path).endswith(".safetensors"):
                raise PermissionError(13, "Permission denied", path)
            return real_open(path, *args, **kwargs)
        os.open = denied
    elif kind in ("die_in_read", "kill_in_read", "stop_in_read", "slow_read"):
        def run_reads(*args, **kwargs):
            if kind == "die_in_read":
                os._exit(17)
            if kind == "kill_in_read":
                if fault.get("stamp"):  # when it died, for the survivors' delay
                    with open(fault["stamp"], "w") as f:
                        f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "stop_in_read":
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(fault.get("seconds", 0))  # slow, but alive: its heartbeat goes on
            return real_run_reads(*args, **kwargs)
        loader.run_reads = run_reads
    elif kind in ("die_in_finalize", "stop_in_finalize"):  # inside the collective section of missing-key init
        def initialize_missing(*args, **kwargs):
            if kind == "die_in_finalize":
                os._exit(17)
            os.kill(os.getpid(), signal.SIGSTOP)
            return real_init_missing(*args, **kwargs)
        loader.initialize_missing = initialize_missing
    elif kind == "die_in_stream":  # a reader that dies after a few chunks: its receivers are mid-stream
        real_execute = reader.execute_read
        calls = [0]

        def execute_read(*args, **kwargs):
            calls[0] += 1
            if calls[0] > fault.get("after", 3):
                os._exit(17)
            return real_execute(*args, **kwargs)
        reader.execute_read = execute_read
        saved.append((reader, "execute_read", real_execute))
    elif kind == "stop_in_stream":  # a reader that stops (SIGSTOP) after a few chunks: its receivers are mid-stream
        import hf_zero3_loader.streaming as streaming

        real_next_chunk = streaming.Streamer._next_chunk
        calls = [0]

        def next_chunk(self):
            calls[0] += 1
            if calls[0] > fault.get("after", 3):
                os.kill(os.getpid(), signal.SIGSTOP)
            return real_next_chunk(self)
        streaming.Streamer._next_chunk = next_chunk
        saved.append((streaming.Streamer, "_next_chunk", real_next_chunk))
    elif kind == "no_local_rank":  # a script that starts its own processes (mp.spawn) and sets no LOCAL_RANK
        local_rank = os.environ.pop("LOCAL_RANK")  # nothing patched: putting it back is the whole undo
        return lambda: os.environ.update(LOCAL_RANK=local_rank)
    elif kind == "replace_shard":  # after the headers were read, before the reads: an atomic rename over a shard
        real_init = reader.FileReader.__init__

        def init(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            target = os.path.join(case["path"], fault["file"])
            with open(target, "rb") as f:
                data = bytearray(f.read())
            data[-8:] = bytes(8)  # same size, other bytes: a new file with the same layout
            with open(target + ".new", "wb") as f:
                f.write(data)
            os.replace(target + ".new", target)
        reader.FileReader.__init__ = init
    elif kind == "rewrite_shard_in_place":  # new bytes at the same offsets while its descriptor is held, as `dd
        # conv=notrunc` writes them (same inode, size, header); "keep_mtime": the old modification time put back, as
        # `rsync --inplace --times` does
        real_read_buffers = reader.FileReader.read_buffers
        written = [False]

        def read_buffers(self, path, offset, buffers):
            real_read_buffers(self, path, offset, buffers)
            if written[0] or os.path.basename(path) != fault["file"]:
                return
            written[0] = True
            target = os.path.join(case["path"], fault["file"])
            before = os.stat(target)
            with open(target, "rb") as f:
                f.seek(before.st_size - 8)
                old = f.read(8)
            fd = real_open(target, os.O_WRONLY)
            try:
                os.pwrite(fd, bytes(b ^ 0xFF for b in old), before.st_size - 8)
            finally:
                os.close(fd)
            if fault.get("keep_mtime"):
                os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
        reader.FileReader.read_buffers = read_buffers
    return undo


def quantization_config(spec: dict):
    """transformers' quantization config object for a JSON spec, as a user passes it to from_pretrained."""
    import transformers

    if spec["quant_method"] == "bitsandbytes_4bit":  # QLoRA: NF4 weights kept quantized, stored in the engine dtype
        return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.bfloat16,
                                               bnb_4bit_quant_storage=torch.bfloat16)
    classes = {"fp8": transformers.FineGrainedFP8Config, "mxfp4": transformers.Mxfp4Config}
    return classes[spec["quant_method"]](dequantize=spec.get("dequantize", False))


def state_dict_call(case: dict, model_class, kwargs: dict):
    """`case["state_dict"]`: {"layout": "checkpoint" | "model" (`checkpoints.state_dict_of`), "drop": [keys],
    "as_list": [keys] (lists, not tensors), "differs_on_rank": r (one tensor + 1 there), "meta_on_ranks": [r, ...]
    (meta tensors there), "only_rank": r (the others pass none)}; returns the concrete model class (transformers'
    Auto classes need a folder) and the kwargs."""
    from transformers import AutoConfig

    from tests.checkpoints import state_dict_of

    spec, rank = case["state_dict"], dist.get_rank()
    config = AutoConfig.from_pretrained(case["path"])
    model_class = getattr(model_class, "_model_mapping", {type(config): model_class})[type(config)]
    state = state_dict_of(case["path"], spec["layout"], model_class)
    for key in spec.get("drop", []):
        del state[key]
    for key in spec.get("as_list", []):  # a weight passed as a list of floats
        state[key] = state[key].tolist()
    if spec.get("differs_on_rank") == rank:
        key = sorted(state)[-1]
        state[key] = state[key] + 1
    if rank in spec.get("meta_on_ranks", []):
        state = {k: v.to("meta") for k, v in state.items()}
    if spec.get("only_rank", rank) != rank:
        state = None
    return model_class, {**kwargs, "config": config, "state_dict": state}


class CapturedWarnings(logging.Handler):
    """The loader's warnings on this rank, while entered."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("hf_zero3_loader").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("hf_zero3_loader").removeHandler(self)


def run_case(case: dict) -> dict:
    import transformers

    import hf_zero3_loader

    class_name = case.get("model_class_by_rank", {}).get(str(dist.get_rank()),  # a rank that builds another model
                                                         case.get("model_class", "AutoModelForCausalLM"))
    if ":" in class_name:  # "module:Class", e.g. tests.custom_models:MetaHostileLlamaForCausalLM
        import importlib

        module_name, _, attr = class_name.partition(":")
        model_class = getattr(importlib.import_module(module_name), attr)
    else:
        model_class = getattr(transformers, class_name)
    rank = str(dist.get_rank())
    case = {**case, "path": case.get("path_by_rank", {}).get(rank, case.get("path"))}
    if "path_by_node" in case:  # several simulated nodes: each launch's GROUP_RANK picks its copy (or none)
        case["path"] = case["path_by_node"][os.environ.get("GROUP_RANK", "0")]
    ds_config = case.get("ds_config_by_rank", {}).get(rank, case.get("ds_config") or ds_config_for(case["dtype"]))
    if case.get("max_open_files"):  # e.g. `ulimit -n 128` with a checkpoint of more shards than that
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (case["max_open_files"], resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    kwargs = {**case.get("kwargs", {}), **case.get("kwargs_by_rank", {}).get(rank, {})}
    if isinstance(kwargs.get("distributed_config"), dict):  # JSON cases carry transformers' DistributedConfig as a dict
        kwargs["distributed_config"] = transformers.DistributedConfig(**kwargs["distributed_config"])
    if isinstance(kwargs.get("quantization_config"), dict):  # {"quant_method": "fp8"|"mxfp4", "dequantize": True}
        kwargs["quantization_config"] = quantization_config(kwargs["quantization_config"])
    if "state_dict" in case:  # from_pretrained(None, config=..., state_dict=...) instead of the folder
        model_class, kwargs = state_dict_call(case, model_class, kwargs)
        case = {**case, "path": None}
    result: dict = {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                    # whether the case found torch's own F.linear (not DeepSpeed's, from an earlier case's load)
                    "fresh_linear_at_start": torch.nn.functional.linear is FRESH_LINEAR}
    if case.get("autoep_fields"):
        result["scope_at_start"] = next_deepep_scope()
    if "seed" in case:
        torch.manual_seed(case["seed"])
    undo_fault = inject_fault(case)
    counter, largest = CollectiveCounter(), LargestAllocation()
    started = time.monotonic()

    def load():
        if case.get("upstream"):  # transformers' own ZeRO-3 path (and engine-side AutoEP), for comparisons
            from transformers.integrations import HfDeepSpeedConfig

            from hf_zero3_loader import _deepspeed_private

            # DeepSpeed 0.19.8's AutoEP presets need this to run on a transformers 5.23 model at all
            _deepspeed_private.allow_registry_get_default()
            keep_alive.append(HfDeepSpeedConfig(ds_config))  # transformers holds a weakref
            dtype = torch.bfloat16 if case["dtype"] == "bfloat16" else torch.float32
            model = model_class.from_pretrained(case["path"], dtype=dtype, **kwargs)
            model.hf_zero3_load_report = hf_zero3_loader.LoadReport("upstream zero.Init", "baseline")
            return model
        return hf_zero3_loader.from_pretrained(model_class, case["path"], ds_config=ds_config, **kwargs)

    keep_alive: list = []
    if case.get("measure_staging"):  # the largest allocation while filling partitions through the staging buffer
        from hf_zero3_loader import zero3_load as loader_module

        staged_largest, real_staged = LargestAllocation(), loader_module.run_staged_reads

        def run_staged_reads(*args, **kwargs):
            with staged_largest:  # read_threads=1: every staged read runs in this thread
                return real_staged(*args, **kwargs)

        loader_module.run_staged_reads = run_staged_reads
    callers_zero_init, warnings = nullcontext(), CapturedWarnings()
    if "callers_zero_init" in case:  # the script wraps from_pretrained in its own `with deepspeed.zero.Init(...)`
        import deepspeed

        other_dtype = case["callers_zero_init"].get("dtype")  # its config another dtype's (else the load's own)
        callers_zero_init = deepspeed.zero.Init(
            config_dict_or_path=ds_config_for(other_dtype) if other_dtype else ds_config)
    result["warnings"] = warnings.messages  # the loader's warnings on this rank, filled as they come
    try:
        with counter, largest, warnings, callers_zero_init:
            model = load()
    except Exception as e:
        undo_fault()
        result["error"] = {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
                           "message": str(e), "traceback": traceback.format_exc(),
                           "seconds": time.monotonic() - started, "at": time.time()}
        return result
    undo_fault()
    info = None
    if isinstance(model, tuple):
        model, info = model
        result["loading_info"] = {k: sorted(map(str, v)) for k, v in info.items()}
    report = model.hf_zero3_load_report
    result["report"] = report.summary()
    result["collectives"] = counter.calls
    result["collective_bytes"] = counter.bytes
    result["largest_allocation_bytes"] = largest.largest_bytes
    result["largest_allocation_numel"] = largest.largest_numel
    if case.get("measure_staging"):
        result["staging_largest_allocation_bytes"] = staged_largest.largest_bytes
        loader_module.run_staged_reads = real_staged
    result["training"] = model.training
    if case.get("z3_leaf_classes"):  # DeepSpeed's own answer to per-expert modules, as a user applies it by hand
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, case["z3_leaf_classes"])
    if case.get("resize_to"):  # transformers' ZeRO-3-aware resize: gathers the old embedding, builds under zero.Init
        from transformers.integrations import is_deepspeed_zero3_enabled

        result["zero3_visible"] = is_deepspeed_zero3_enabled()
        torch.manual_seed(case.get("seed", 0))
        model.resize_token_embeddings(case["resize_to"])
    if case.get("load_again"):  # a second model in the process (a TRL reference model), held while the first is used
        with warnings:
            again = load()
        keep_alive.append(again)
        result["again"] = {"report": again.hf_zero3_load_report.summary(), "state": gather_state(again),
                           "nvme_path": getattr(next(again.parameters(), None), "nvme_swapper", None)
                           and str(next(again.parameters()).nvme_swapper.swap_config.nvme_path)}
    partitions = [p.ds_tensor for p in model.parameters() if getattr(p, "ds_tensor", None) is not None]
    result["partitions"] = {"devices": sorted({str(t.device) for t in partitions}),
                            "pinned": sum(t.is_pinned() for t in partitions), "count": len(partitions),
                            # NVMe offload: partitions that live in swap files, their host memory freed
                            "on_nvme": sum(str(getattr(t, "final_location", None)).endswith("nvme")
                                           and str(getattr(t, "status", "")).endswith("NOT_AVAILABLE")
                                           for t in partitions)}
    result["state"] = gather_state(model)
    result["sharing"] = sharing(model)
    result["config"] = model.config.to_dict()
    if model.can_generate():
        result["generation_config"] = model.generation_config.to_dict()
    if case.get("peft_adapter"):  # a saved adapter loaded over the model by PEFT's own from_pretrained
        import warnings as warnings_module

        import deepspeed
        from peft import PeftModel

        with warnings_module.catch_warnings(record=True) as caught:
            warnings_module.simplefilter("always")
            peft_model = PeftModel.from_pretrained(model, case["peft_adapter"])
        result["peft_warnings"] = [str(w.message) for w in caught]
        result["adapter_loaded"] = {}
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                with deepspeed.zero.GatheredParameters([p]):
                    result["adapter_loaded"][name] = p.detach().clone()
    if case.get("lora"):  # a PEFT LoRA adapter over the loaded model, added as TRL's `peft_config` adds it
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(case.get("seed", 0) + 1)
        model = get_peft_model(model, LoraConfig(**case["lora"]))
        if case.get("second_adapter"):  # another adapter beside the active one, frozen while "default" trains
            model.add_adapter("other", LoraConfig(**case["second_adapter"]))
        try:  # what Trainer.save_model writes the adapter from, with the import
            from hf_zero3_loader.peft_adapters import adapter_state_dict

            # a rank may select other adapters (`selected_adapters`): the ranks must refuse it alike
            adapter = adapter_state_dict(model, case.get("adapters_by_rank", {}).get(str(dist.get_rank())))
            result["adapter_state"] = adapter
        except Exception as e:
            result["adapter_error"] = {"type": type(e).__name__, "message": str(e)}
            if case.get("adapters_by_rank"):
                return result
    if case.get("train_steps"):
        try:
            with warnings:  # the config given to deepspeed.initialize: the load's, unless the case gives another
                engine = initialize(model, case.get("initialize_ds_config", ds_config), result,
                                    autoep_fields=case.get("autoep_fields", False))
        except Exception as e:
            if not case.get("expect_initialize_error"):
                raise
            result["initialize_error"] = {"type": type(e).__name__, "message": str(e)}
            return result
        seed = 1234 + (dist.get_rank() if case.get("rank_inputs") else 0)  # per-rank batches route differently
        result["losses"] = train_losses(engine, case["train_steps"], model.config.get_text_config().vocab_size, seed,
                                        case.get("seq_len", 12), first_output=result if case.get("forward_output") else None)
        result["partition_groups"] = partition_groups(model)
        if case.get("peft_save"):  # PEFT's own save_pretrained of the trained adapter, on every rank (an on_save callback)
            import deepspeed

            from hf_zero3_loader.integrations import saving_hooks

            result["adapter_trained"] = {}
            for name, p in model.named_parameters():
                if ".lora_" in name or ".modules_to_save." in name:
                    with deepspeed.zero.GatheredParameters([p]):
                        result["adapter_trained"][name] = p.detach().clone()
            saving_hooks.install()  # what `import hf_zero3_loader.auto` does
            try:
                model.save_pretrained(case["out"] + ".adapter", is_main_process=dist.get_rank() == 0)
            finally:
                saving_hooks.uninstall()
        if case.get("checkpoint_roundtrip"):
            result["checkpoint"] = checkpoint_roundtrip(case, engine, load, ds_config,
                                                        model.config.get_text_config().vocab_size)
    if case.get("generate"):  # each rank asks for a different length: generate must keep the ranks in step
        engine = engine if case.get("train_steps") else initialize(model, ds_config, result)
        engine.module.eval()
        ids = torch.tensor([[1, 2, 3 + dist.get_rank()]]).to(engine.device)
        with torch.no_grad():
            out = engine.module.generate(ids, max_new_tokens=2 + 3 * dist.get_rank(), do_sample=False,
                                         pad_token_id=0)
        result["generated"] = out.cpu().tolist()
    if case.get("save"):
        save_case(case, engine if case.get("train_steps") else model, model, result)
    return result


def save_case(case: dict, target, model, result: dict) -> None:
    """hf_zero3_loader.save_pretrained(target, ...) on every rank, counting collectives and allocations; then the
    parameters as trained (gathered), and on rank 0 transformers' own save_pretrained of them (the reference)."""
    import torch.distributed as dist

    import hf_zero3_loader

    spec = case["save"]
    kwargs = {**spec.get("kwargs", {}), **spec.get("kwargs_by_rank", {}).get(str(dist.get_rank()), {})}
    undo_fault = inject_save_fault(case)
    counter, largest = CollectiveCounter(), LargestAllocation()
    try:
        with counter, largest:
            if spec.get("direct"):  # the model's own save_pretrained, routed by `import hf_zero3_loader.auto`
                import hf_zero3_loader.auto  # noqa: F401

                model.save_pretrained(spec["dir"], **kwargs)
                report = None
            else:
                report = hf_zero3_loader.save_pretrained(target, spec["dir"], **kwargs)
    except Exception as e:
        result["save_error"] = {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
                                "message": str(e), "traceback": traceback.format_exc()}
        return
    finally:
        undo_fault()
    result["save"] = report.summary() if report is not None else None
    result["save_collectives"] = {"calls": counter.calls, "bytes": counter.bytes}
    result["save_largest_allocation_bytes"] = largest.largest_bytes
    # what was loaded, unless the case changed it since (trained it, or wrapped it in an adapter)
    result["trained_state"] = gather_state(model) if case.get("train_steps") or case.get("lora") else result["state"]
    layout = model.hf_zero3_load_report.expert_parallel_layout
    if spec.get("reference") and layout is None and dist.get_rank() == 0:
        save_reference(model, result["trained_state"], spec["dir"] + ".reference", spec.get("kwargs", {}))


def partition_groups(model) -> dict:
    """The process group each ZeRO-3 parameter is partitioned over, by what it is: the world, DeepSpeed's
    data-parallel group (its clone of the world), or its ranks. The optimizer makes a sub-group per group object, and
    a DeepSpeed checkpoint records them."""
    from deepspeed.utils import groups

    def label(group) -> str:
        if group is None or group is dist.group.WORLD:
            return "world"
        if group is groups._WORLD_GROUP:
            return "data parallel"
        return f"ranks {dist.get_process_group_ranks(group)}"

    return {n: label(p.ds_process_group) for n, p in model.named_parameters() if hasattr(p, "ds_process_group")}


def save_reference(model, state: dict, folder: str, kwargs: dict) -> None:
    """What `save_pretrained` writes for the gathered model: a plain (unpartitioned) model holding `state`."""
    from hf_zero3_loader import _transformers_private as hf_private

    with hf_private.hidden_hf_zero3(), torch.device("meta"):
        plain = type(model)._from_config(model.config)  # the loaded class: causal LM, VLM, seq2seq, classifier
    own = plain.state_dict()
    plain.load_state_dict({k: v for k, v in state.items() if k in own}, assign=True, strict=True)
    plain.tie_weights()
    if getattr(model, "_weight_conversions", None) is not None:
        plain._weight_conversions = model._weight_conversions
    plain.save_pretrained(folder, **{k: v for k, v in kwargs.items() if k in ("max_shard_size", "variant")})


def inject_save_fault(case: dict):
    """A save that fails, dies or stops on one rank while it writes its partitions."""
    import signal

    import hf_zero3_loader.saving as saving
    import hf_zero3_loader.writer as writer

    fault = case.get("save_inject")
    if not fault or dist.get_rank() not in (fault["rank"] if isinstance(fault["rank"], list) else [fault["rank"]]):
        return lambda: None
    saved = [(writer.FileWriter, "write_from", writer.FileWriter.write_from),
             (saving, "_sees_folder", saving._sees_folder)]
    real_write = writer.FileWriter.write_from
    calls = [0]

    def write_from(self, path, offset, src):
        calls[0] += 1
        if calls[0] > fault.get("after", 2):
            if fault["kind"] == "raise_in_write":
                raise OSError(28, "No space left on device (injected)")
            if fault["kind"] == "die_in_write":
                os._exit(17)
            if fault["kind"] == "stop_in_write":
                os.kill(os.getpid(), signal.SIGSTOP)
        return real_write(self, path, offset, src)

    if fault["kind"] == "cannot_see_folder":  # another node's filesystem: the writer's folder is not there
        saving._sees_folder = lambda temp, token: (False, f"{temp} is not visible here (injected)")
    elif fault["kind"] == "die_in_publish":  # the writer killed between two of its moves into the folder
        from hf_zero3_loader.save_folder import TEMP_MARK

        real_replace, moves = os.replace, [0]

        def replace(src, dst, *args, **kwargs):
            if TEMP_MARK in str(src):
                moves[0] += 1
                if moves[0] > fault.get("after", 2):
                    os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(src, dst, *args, **kwargs)

        saved.append((os, "replace", real_replace))
        os.replace = replace
    else:
        writer.FileWriter.write_from = write_from

    def undo():
        for owner, name, value in saved:
            setattr(owner, name, value)
    return undo


FAILED = ("error", "save_error", "initialize_error", "adapter_error")


def run_cases(cases: list[dict]) -> bool:
    """Each case in turn on every rank; rank 0 writes each case's `out` (after every rank wrote its own, if asked).
    Returns whether any rank failed any case (the same answer on every rank)."""
    failed = False
    for case in cases:
        print(f"[dist_worker] rank {dist.get_rank()}: case {case.get('name', case['out'])}", flush=True)
        result = run_case(case)
        if case.get("per_rank_out"):  # written before any collective: a dead peer cannot stop it
            torch.save({k: v for k, v in result.items() if k not in ("state", "trained_state")},
                       f"{case['out']}.rank{dist.get_rank()}")
        results = [None] * dist.get_world_size()
        keep = (lambda k: True) if case.get("all_ranks_state") else (lambda k: k not in ("state", "trained_state"))
        dist.all_gather_object(results, {k: v for k, v in result.items() if keep(k)})
        failed = failed or any(key in r for r in results for key in FAILED)
        if dist.get_rank() == 0:
            torch.save({"rank0": result, "ranks": results}, case["out"])
        dist.barrier()
    return failed


# What a case may leave behind in its process that would change a later case's run: transformers' from_pretrained
# routed through the loader (`hf_zero3_loader.auto`), a patched loader internal (fault injection), a lowered
# descriptor limit, a caller's own zero.Init, ranks that made different calls (`*_by_rank`: their loads' agreement
# points no longer pair up), a case that failed (seen: a later load's weight conversion no longer matched its
# checkpoint in the same process), a torch function DeepSpeed patches left patched, or a ZeRO++ hpZ group. An upstream load (transformers'
# own ZeRO-3 path) leaves only what `undo_zero3_process_state` puts back: `zero.Init` restores the module and tensor
# functions it patched on exit (checked in `leaves_state`), keeps DeepSpeed's memory-efficient `F.linear` (as every
# ZeRO-3 load does, ours too), and transformers keeps a weak reference to the HfDeepSpeedConfig. A pool that ran such
# a case retires.
LEAVES_STATE = ("callers_zero_init", "inject", "save_inject", "max_open_files")
FRESH_SEED = torch.initial_seed()  # the seed a new process starts from
FRESH_LINEAR = torch.nn.functional.linear


def _torch_now() -> dict:
    """What `zero.Init` patches while it is entered (and restores on exit)."""
    return {"torch.empty": torch.empty, "torch.zeros": torch.zeros, "torch.tensor": torch.tensor,
            "Tensor.__new__": torch.Tensor.__new__, "Module.apply": torch.nn.Module.apply,
            "Module.__init_subclass__": torch.nn.Module.__init_subclass__}


FRESH_TORCH = _torch_now()  # as a new process has them


def put_fresh_linear_back() -> None:
    """Every ZeRO-3 load (the loader's, as `zero.Init`'s) replaces `torch.nn.functional.linear` with DeepSpeed's
    memory-efficient linear for the rest of the process (`zero3_linear_wrap`, keeping torch's as `linear_bk`). A new
    process has torch's: put it back between requests, so the next request computes as a fresh launch would (and
    its own ZeRO-3 load replaces it again) and the pool lives on. Only that replacement, over this process's own
    `F.linear`, is undone; any other leaves `F.linear` changed, and the pool retires (`leaves_state`)."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    if (torch.nn.functional.linear is zero3_linear_wrap
            and getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None) is FRESH_LINEAR):
        torch.nn.functional.linear = FRESH_LINEAR


def undo_zero3_process_state() -> None:
    """Between requests: what a ZeRO-3 load leaves in the process that a new one does not have. DeepSpeed's
    `F.linear` goes back to torch's; transformers' weak reference to an HfDeepSpeedConfig (a case's, or an upstream
    load's) is dropped, with the objects that may still hold it."""
    import gc

    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    put_fresh_linear_back()
    unset_hf_deepspeed_config()
    gc.collect()


def leaves_state(cases: list[dict], failed: bool) -> bool:
    from transformers.integrations.deepspeed import deepspeed_config

    return (failed or any(key in case for case in cases for key in LEAVES_STATE)
            or any(key.endswith("_by_rank") for case in cases for key in case)
            or any(case.get("save", {}).get("direct") for case in cases)
            or "hf_zero3_loader.auto" in sys.modules or torch.nn.functional.linear is not FRESH_LINEAR
            or _torch_now() != FRESH_TORCH or deepspeed_config() is not None or _hpz_group_made())


def _hpz_group_made() -> bool:
    """A ZeRO++ hpZ group is process state: DeepSpeed's engine hands it to every later engine's ZeRO-3 partitioning
    (`_configure_zero_optimizer` takes `groups._get_zero_param_intra_parallel_group()` whatever its config says)."""
    from deepspeed.utils import groups

    return groups._get_zero_param_intra_parallel_group() is not None


def _alive(pid: int) -> bool:
    """The process is there and not a zombie (an exited pytest whose parent has not reaped it still answers kill 0)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def serve(folder: str) -> None:
    """A pool's ranks (tests/conftest.py `TorchrunPool`): run the requests `folder/request_N.json` in order, each as
    a fresh launch would (the RNG where a new process has it), writing `folder/done_N` when every rank is through.
    The launch's imports and process group are paid once for all of them. After a request whose cases leave state
    behind, the ranks exit instead of taking the next one."""
    owner = int(os.environ.get("HF_ZERO3_TEST_POOL_OWNER", "0"))
    n = 0
    while True:
        request = os.path.join(folder, f"request_{n}.json")
        while not os.path.exists(request):
            if os.path.exists(os.path.join(folder, "stop")) or owner and not _alive(owner):  # closed, or pytest gone
                return
            time.sleep(0.05)
        with open(request) as f:
            cases = json.load(f)
        torch.manual_seed(FRESH_SEED)
        failed = run_cases(cases)
        undo_zero3_process_state()
        retire = [leaves_state(cases, failed)]
        dist.broadcast_object_list(retire, src=0)  # rank 0's word, so that all ranks retire together
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(folder, f"done_{n}.tmp"), "w") as f:
                json.dump({"retire": retire[0]}, f)
            os.replace(os.path.join(folder, f"done_{n}.tmp"), os.path.join(folder, f"done_{n}"))
        if retire[0]:
            return
        n += 1


def main() -> None:
    import deepspeed

    # gloo on CPU; tests/test_gpu.py sets nccl on an accelerator
    backend = os.environ.get("HF_ZERO3_TEST_BACKEND", "gloo")
    if os.environ.get("HF_ZERO3_TEST_TORCH_PROCESS_GROUP"):  # a script that starts its own group, not DeepSpeed's
        dist.init_process_group(backend)
    else:
        deepspeed.init_distributed(dist_backend=backend)
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:
        with open(sys.argv[1]) as f:
            run_cases(json.load(f))
    dist.destroy_process_group()
    # Results are written. Skip interpreter finalisation: gloo's worker threads can still hold tensors then and
    # abort the process ("terminate called without an active exception", a known torch teardown race).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
