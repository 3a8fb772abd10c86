"""`from_pretrained`: a drop-in for `AutoModel*.from_pretrained` that loads straight into ZeRO-3 partitions.

This module is the glue: it finds the DeepSpeed config, checks the call's arguments on every rank, picks the init
context, and runs transformers' own `from_pretrained` with two of its hooks replaced.
- ZeRO-3: transformers resolves the checkpoint, config, dtype and conversion mapping and builds a *meta* skeleton
  (no allocation, no broadcast); `zero3_load.Zero3Load` then plans, allocates and fills this rank's partitions and
  finishes the load. Ranks without the files are found first (`streaming.find_readers`).
- A model that cannot be built on meta, or `init_context="zero.Init"`: transformers' own ZeRO-3 path.
- ZeRO-1/2 or no DeepSpeed: transformers loads onto the local device.
Ranks agree on failure at each step (`agreement.py`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from . import _deepspeed_private as ds_private
from . import _transformers_private as hf_private
from . import compat, log
from .agreement import AgreedFailure, Agreement
from .checkpoint import check_index, find_index, missing_folder
from .deepspeed_setup import (check_supported, find_deepspeed_setup, local_device, nvme_param_offload,
                              resolve_dtype, unpartitioned_reason)
from .digests import check_mode as check_verify_mode
from .errors import ConfigError
from .expert_parallel import create_groups, is_requested, refuse_other_parallelism, request_from
from .gc_pause import paused_gc
from .missing_init import DEFAULT_BUDGET_BYTES
from .reader import default_io_threads
from .report import LoadReport, attach
from .staging import DEFAULT_STAGING_BYTES, check_budget
from .streaming import DEFAULT_CHUNK_BYTES, MODES, find_readers, find_state_dict_holders
from .zero3_load import TransformersPathNeeded, Zero3Load, quant_method

__all__ = ["LoadReport", "from_pretrained"]


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


DIFFERENT_CALLS = "were not called with the same arguments and DeepSpeed config"


def _ensure_distributed() -> None:
    """Start the process group DeepSpeed's way. Called from plain `python` with no launcher (none of torchrun's
    variables set), load as a single process (world size 1) instead of failing in DeepSpeed's MPI discovery. A
    process group the script started itself (`torch.distributed.init_process_group`) is adopted by DeepSpeed's comm
    layer, as `deepspeed.initialize` would: its group helpers (expert parallelism's groups) assert on it."""
    import deepspeed
    import deepspeed.comm
    import torch.distributed as dist

    if dist.is_initialized():
        if not deepspeed.comm.is_initialized():
            deepspeed.init_distributed()  # wraps the existing group: nothing is started again
        return
    if not any(v in os.environ for v in LAUNCHER_VARIABLES) and not any(
            v in os.environ for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        log.warning("no launcher environment (RANK, WORLD_SIZE, ...): loading as a single process "
                       "(world size 1). For several ranks run `torchrun --nproc_per_node N your_script.py` or "
                       "`accelerate launch --use_deepspeed --num_processes N your_script.py`.")
    deepspeed.init_distributed()


@log.quiet_dependency_deprecations()  # DeepSpeed's calls of deprecated torch.distributed names, during our load
def from_pretrained(
    model_class,
    pretrained_model_name_or_path: str | os.PathLike,
    *model_args,
    ds_config: dict | str | None = None,
    missing_init_budget_bytes: int = DEFAULT_BUDGET_BYTES,
    read_threads: int | None = None,
    agreement_timeout_s: float | None = None,
    liveness_timeout_s: float | None = None,
    allow_suspicious_missing_keys: bool = False,
    keep_in_fp32: bool = False,
    init_context: str = "auto",
    ep_size: int | None = None,
    load_from: str = "auto",
    stream_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    strict_dtype: bool = False,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    verify_checkpoint: str = "sampled",
    **kwargs: Any,
):
    """Load `model_class` (an Auto class or a concrete model class) for DeepSpeed.

    Under ZeRO-3 every rank reads only its own partitions' bytes; otherwise (plain, ZeRO-1/2) the model is
    built on meta and loaded straight onto the rank's device by transformers. `ds_config` is the DeepSpeed
    config (dict or JSON path); when omitted it is found the way transformers and `accelerate launch`
    expose it. Other keyword arguments are those of `from_pretrained`.

    Args beyond transformers':
        missing_init_budget_bytes: at most this many bytes (or the largest single missing parameter) are
            gathered at once to initialise missing weights.
        read_threads: threads issuing positional reads (default: this rank's share of the CPU cores, at most 4).
        agreement_timeout_s: how long ranks wait for a peer that has not started this load yet (default 300 s,
            env `HF_ZERO3_LOADER_TIMEOUT`; `float('inf')` waits forever). A peer that has started is waited for
            as long as it is alive.
        liveness_timeout_s: a peer silent this long (killed, stopped, its machine gone) fails the load on every
            rank (default 30 s, env `HF_ZERO3_LOADER_LIVENESS_TIMEOUT`). Also the timeout of the loader's own
            collectives (missing-key init, tied-weights check).
        allow_suspicious_missing_keys: load even if parameters come back missing next to unexpected keys
            that look like them (a broken conversion); they are then randomly initialised.
        keep_in_fp32: keep `_keep_in_fp32_modules` parameters in fp32 as a plain load does. DeepSpeed ZeRO-3
            cannot train them in a bf16/fp16 engine (it holds one dtype), so by default they are loaded in
            the engine's dtype, with a warning naming them.
        init_context: "auto" (meta skeleton, falling back to `zero.Init` for models that cannot be built on
            meta), "meta", or "zero.Init" (transformers' own ZeRO-3 path).
        ep_size: expert parallelism: each rank owns `num_experts / ep_size` experts of every MoE layer, as DeepSpeed
            AutoEP trains them, and reads only those. Also asked for by the DeepSpeed config's `expert_parallel`
            section or transformers' `distributed_config=DistributedConfig(ep_size=...)`; they must agree.
        load_from: "auto" (ranks that can read the checkpoint read it; the others receive their bytes from one
            of them, on their node if possible), "read" (every rank must read), or "stream" (one reader per node,
            the other ranks receive).
        stream_chunk_bytes: the largest piece of checkpoint data sent at once to a receiving rank (default 64 MiB);
            a reader holds at most two such buffers.
        strict_dtype: refuse a `dtype` that differs from the DeepSpeed config's (by default the engine's dtype wins,
            with a warning, as in transformers' own ZeRO-3 path).
        staging_bytes: partitions on an accelerator are filled through one host buffer of this many bytes (default
            64 MiB, pinned on CUDA): reads into it overlap the copies to the device, and host memory grows by this
            much rather than by the rank's share of the checkpoint. Host partitions are read in place.
        verify_checkpoint: how ranks prove they load the same checkpoint: "sampled" (each file's size, header and a
            few sampled blocks, and its sha256 where the hub cache or a `SHA256SUMS` manifest tells it) or "full"
            (every file hashed whole, once per node, the work split over the node's ranks and cached on the node).
    """
    start = time.perf_counter()
    try:
        setup = find_deepspeed_setup(ds_config)
        zero3 = setup is not None and setup.partitions_at_load
    except Exception as e:  # e.g. a config file one rank cannot read: the others must hear of it, not wait
        if not _launched_distributed():
            raise
        _share_and_raise(e, "read the DeepSpeed config", agreement_timeout_s, liveness_timeout_s)
    if not zero3:
        return _load_without_zero3(model_class, pretrained_model_name_or_path, model_args, kwargs, setup, ep_size,
                                   start, strict_dtype)
    began = time.perf_counter()
    _ensure_distributed()
    init_distributed_s = time.perf_counter() - began
    agreement = Agreement(agreement_timeout_s, liveness_timeout_s)
    try:
        model = _load_zero3(model_class, pretrained_model_name_or_path, model_args, kwargs, setup, agreement,
                            init_context=init_context, ep_size=ep_size, read_threads=read_threads,
                            budget_bytes=missing_init_budget_bytes, allow_suspicious=allow_suspicious_missing_keys,
                            keep_in_fp32=keep_in_fp32, load_from=load_from, chunk_bytes=stream_chunk_bytes,
                            strict_dtype=strict_dtype, staging_bytes=staging_bytes,
                            verify_checkpoint=verify_checkpoint)
    finally:
        agreement.close()
    target = model[0] if isinstance(model, tuple) else model
    keep_zero3_visible_to_transformers(target, setup)
    report = target.hf_zero3_load_report
    report.phases["init_distributed"] = init_distributed_s  # not part of the load: reported on its own
    report.seconds = time.perf_counter() - start - init_distributed_s
    source = "a state_dict" if pretrained_model_name_or_path is None else pretrained_model_name_or_path
    log.info("%s", report.line(source))
    return model


def keep_zero3_visible_to_transformers(model, setup) -> None:
    """transformers' ZeRO-3-aware code after a load asks `is_deepspeed_zero3_enabled()`: `resize_token_embeddings`
    gathers the old embedding and builds the new one under `zero.Init` (else it fails on the partitioned weight),
    `generate` sets `synced_gpus` so ranks that finish early keep joining the gathers (else they hang), PEFT gathers
    what it reads. That answer is a weak reference to an `HfDeepSpeedConfig` someone keeps alive (the Trainer and
    accelerate do; a user of transformers' own ZeRO-3 path must). A load given its config another way (`ds_config=`,
    the `accelerate launch` environment) leaves none, so the model keeps one: the process sees ZeRO-3 while a model
    loaded into ZeRO-3 partitions lives, as it does on transformers' own path."""
    from transformers.integrations import HfDeepSpeedConfig

    live = hf_private.live_hf_deepspeed_config()
    if live is None or getattr(live, "_hf_zero3_loader_owned", False):  # none, or another loaded model's: take it over
        held = HfDeepSpeedConfig(setup.config)
        held._hf_zero3_loader_owned = True
        model._hf_zero3_deepspeed_config = held


def _launched_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1


def _share_and_raise(error: BaseException, phase: str, join_timeout_s, liveness_timeout_s):
    """An error before the first agreement point: meet the other ranks at it, so every rank raises it."""
    _ensure_distributed()
    agreement = Agreement(join_timeout_s, liveness_timeout_s)
    try:
        agreement.check(phase, error)
    finally:
        agreement.close()
    raise error  # not reached: check raises the agreed error


def _load_without_zero3(model_class, path, model_args, kwargs, setup, ep_size, start, strict_dtype=False):
    """No ZeRO-3 (no DeepSpeed config, ZeRO-1/2, or ZeRO-3 launched with `zero3_init_flag: false`): every rank holds
    the whole model; transformers loads it on meta and straight onto the rank's device."""
    zero_init_off = setup is not None and setup.stage == 3 and not setup.zero_init  # initialize partitions it
    if setup is not None and not zero_init_off and is_requested(setup.config, ep_size,
                                                                 kwargs.get("distributed_config")):
        raise ConfigError(f"expert parallelism with ZeRO stage {setup.stage} is not supported by hf_zero3_loader "
                          "yet; use ZeRO-3, or let deepspeed.initialize apply AutoEP to a plain load")
    if ep_size is not None:
        raise ConfigError("ep_size= needs a DeepSpeed ZeRO-3 config that builds the model under zero.Init (in "
                          "accelerate: zero3_init_flag true); without DeepSpeed use transformers' "
                          "distributed_config=DistributedConfig(ep_size=...)")
    reason = unpartitioned_reason(setup)
    log.info("%s: transformers loads %s whole on each rank (hf_zero3_loader partitions only under ZeRO-3)", reason,
             path if path is not None else "the model")
    if setup is not None:
        kwargs["dtype"] = resolve_dtype(setup, kwargs.get("dtype", kwargs.pop("torch_dtype", None)), strict_dtype)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        kwargs.setdefault("device_map", {"": local_device()})
    try:
        with hf_private.hidden_hf_zero3():
            model = model_class.from_pretrained(path, *model_args, **kwargs)
    except Exception as e:
        missing = missing_folder(path, e)  # transformers takes a path that is not there for a hub repo id
        if missing is None:
            raise
        raise missing from e
    attach(model, LoadReport("meta", reason, seconds=time.perf_counter() - start))
    return model


def _load_zero3(model_class, path, model_args, kwargs, setup, agreement, *, init_context, ep_size, read_threads,
                budget_bytes, allow_suspicious, keep_in_fp32, load_from, chunk_bytes, strict_dtype, staging_bytes,
                verify_checkpoint="sampled"):
    import torch.distributed as dist

    error, ep_request, from_state_dict = None, None, False
    missing = compat.missing_hooks(compat.LOAD)  # checked once per process: an untested transformers or DeepSpeed
    try:  # the call's own checks: whatever fails, every rank hears of it at the first agreement point
        if kwargs.get("device_map") is not None:
            raise ConfigError("`device_map` cannot be combined with DeepSpeed ZeRO-3: ZeRO-3 places each partition "
                              "itself")
        kwargs["dtype"] = resolve_dtype(setup, kwargs.pop("dtype", kwargs.pop("torch_dtype", None)), strict_dtype)
        distributed_config = kwargs.pop("distributed_config", None)  # its expert parallelism is ours to build
        refuse_other_parallelism(distributed_config, kwargs.pop("tp_plan", None), kwargs.pop("tp_size", None),
                                 dist.get_world_size())
        if init_context not in ("auto", "meta", "zero.Init"):
            raise ConfigError(f"init_context must be 'auto', 'meta' or 'zero.Init', got {init_context!r}")
        from_state_dict = kwargs.get("state_dict") is not None  # every rank copies its partitions from its own
        index = None if from_state_dict else find_index(
            str(path), kwargs.get("subfolder") or "", kwargs.get("revision"), kwargs.get("variant"),
            kwargs.get("use_safetensors"), kwargs.get("cache_dir"))
        if index is not None:  # transformers would fail on a malformed index with a bare KeyError/TypeError
            check_index(index)
        if load_from not in MODES:
            raise ConfigError(f"load_from must be one of {MODES}, got {load_from!r}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 64:
            raise ConfigError(f"stream_chunk_bytes must be an integer of at least 64, got {chunk_bytes!r}")
        check_budget(staging_bytes)
        check_verify_mode(verify_checkpoint)
        ep_request = request_from(setup.config, ep_size, distributed_config, dist.get_world_size())
        if ep_request is not None:
            missing = compat.missing_hooks(compat.LOAD, compat.EP)
        if ep_request is not None and nvme_param_offload(setup.config) is not None:
            raise ConfigError("expert parallelism with NVMe parameter offload (offload_param.device='nvme') does not "
                              "train in DeepSpeed 0.19.8: its parameter swapper fails at the first forward pass of an "
                              "AutoEP layer (\"already assigned swap buffer\"), engine-side AutoEP included; offload "
                              "to the CPU instead (offload_param.device='cpu')")
        check_supported(setup)
        if (ep_request is not None and init_context == "zero.Init"
                and not (setup.config.get("expert_parallel") or {}).get("enabled")):
            raise ConfigError("init_context='zero.Init' builds transformers' MoE blocks; expert parallelism is then "
                              "DeepSpeed's engine-side AutoEP, which needs `expert_parallel` in the DeepSpeed config")
    except Exception as e:
        error = e
    # the arguments that choose the path every rank takes (and so the collectives it joins) must agree
    same = {**setup.fields_ranks_share(), "state_dict= given": from_state_dict, "init_context": init_context,
            "quantization_config": quant_method(kwargs.get("quantization_config")),  # may pick transformers' path
            "load_from": load_from, "expert parallel size": ep_request.ep_size if ep_request is not None else None,
            # the partitions' dtypes (DeepSpeed gathers them as one), and the chunks a reader and receiver cut alike
            "keep_in_fp32": bool(keep_in_fp32), "stream_chunk_bytes": chunk_bytes,
            # the missing-key init's gathers, wave by wave, and whether a suspicious load goes ahead at all
            "missing_init_budget_bytes": budget_bytes, "allow_suspicious_missing_keys": bool(allow_suspicious),
            # the partitions' dtype: the engine's, or the call's own where the config leaves it to "auto"
            "dtype the parameters are loaded in": str(kwargs.get("dtype")),
            # "full" adds agreement points (each node hashes its copy)
            "verify_checkpoint": verify_checkpoint,
            # hooks missing (an untested transformers or DeepSpeed) send every rank through transformers' path
            "private hooks missing": missing}
    agreement.check("check the arguments and the DeepSpeed config", error, same=same, differs=DIFFERENT_CALLS,
                    error_type=ConfigError)
    if missing:
        return _load_without_missing_hooks(model_class, path, model_args, kwargs, setup, agreement, ep_request,
                                           missing)
    expert_parallel = None
    if ep_request is not None:  # groups first, on every rank: the engine reuses them
        expert_parallel = (ep_request, create_groups(ep_request, setup.config))
    if init_context == "zero.Init":
        return _load_with_zero_init(model_class, path, model_args, kwargs, setup, agreement,
                                    "requested with init_context='zero.Init'")
    stream, original_path = None, path
    if from_state_dict and dist.get_world_size() > 1:  # with load_from="read" too: a rank holding meta is named
        stream = find_state_dict_holders(kwargs["state_dict"], agreement, load_from, chunk_bytes, expert_parallel)
    elif load_from != "read" and dist.get_world_size() > 1:
        stream, path, kwargs = find_readers(path, kwargs, agreement, load_from, chunk_bytes, expert_parallel)
    try:
        return _load_on_meta(model_class, path, model_args, kwargs, setup, agreement, ep_request, expert_parallel,
                             stream, original_path, init_context=init_context, read_threads=read_threads,
                             budget_bytes=budget_bytes, allow_suspicious=allow_suspicious, keep_in_fp32=keep_in_fp32,
                             staging_bytes=staging_bytes, verify_checkpoint=verify_checkpoint)
    finally:
        if path != original_path and os.path.isdir(str(path)):  # the stub folder of a rank without the files
            import shutil

            shutil.rmtree(path, ignore_errors=True)


def _load_on_meta(model_class, path, model_args, kwargs, setup, agreement, ep_request, expert_parallel, stream,
                  original_path, *, init_context, read_threads, budget_bytes, allow_suspicious, keep_in_fp32,
                  staging_bytes=DEFAULT_STAGING_BYTES, verify_checkpoint="sampled"):
    import torch.distributed as dist

    from .bypass import bypassed  # `import hf_zero3_loader.auto` must not route it back

    reason = f"ZeRO-3 ({setup.found_via})"
    context = "zero3-meta"
    if ep_request is not None:
        context, reason = "ep-meta", f"{reason}, expert parallel size {ep_request.ep_size} ({ep_request.asked_via})"
    report = LoadReport(context, reason, rank=dist.get_rank(), world_size=dist.get_world_size())
    log.debug("init context '%s' (%s): each rank reads its own partitions", context, reason)
    if read_threads is None:
        read_threads = default_io_threads()
    hooks = Zero3Load(setup, agreement, report, budget_bytes, read_threads, allow_suspicious, keep_in_fp32,
                       expert_parallel, stream, staging_bytes, verify_checkpoint)
    error, model, outer = None, None, None
    try:
        with ds_private.callers_zero_init_paused() as outer, hf_private.hidden_hf_zero3(), \
                hf_private.replaced_loading(hooks.load, hooks.finalize), paused_gc(), bypassed():
            model = model_class.from_pretrained(path, *model_args, **kwargs)
    except AgreedFailure:
        raise
    except Exception as e:
        error = missing_folder(path, e) or e  # transformers takes a path that is not there for a hub repo id
    fallback = None  # why this load is transformers' own ZeRO-3 path after all
    if error is not None and not hooks.reached_load and init_context == "auto" and "meta" in str(error).lower():
        fallback = f"the model cannot be built on meta ({type(error).__name__}: {error})"
    elif isinstance(error, TransformersPathNeeded):
        fallback = str(error)
        if init_context != "auto" or ep_request is not None:
            error = ConfigError(f"{fallback}: only transformers' own ZeRO-3 path (zero.Init) loads such weights, "
                                f"which init_context={init_context!r}" + (" and expert parallelism" if ep_request
                                                                           is not None else "") + " rule out")
            fallback = None
    # a rank taking transformers' path says so at this point; the others must be at it too, for the same reason
    agreement.check("finish load", None if fallback else error,
                    same={"transformers' ZeRO-3 path": fallback is not None})
    if fallback:
        if stream is not None:
            raise ConfigError(f"{fallback}; transformers' zero.Init path needs the checkpoint on every rank: give "
                              "every rank the files, or load_from='read'")
        return _load_with_zero_init(model_class, path, model_args, kwargs, setup, agreement, fallback)
    target = model[0] if isinstance(model, tuple) else model
    _note_callers_zero_init(outer, setup, kwargs.get("dtype"))
    if path != original_path:  # loaded from a stub folder: name the checkpoint as the user did
        target.config.name_or_path = str(original_path)  # the config's public setter
        target.name_or_path = str(original_path)
    attach(model, report)
    return model


def _note_callers_zero_init(outer, setup, dtype) -> None:
    """A load (on meta) inside the caller's own `with deepspeed.zero.Init(...)`: the partitions followed the load's
    DeepSpeed config (the one the engine gets), which the context's settings should match."""
    if outer is None:
        return
    log.debug("loaded inside the caller's zero.Init context, paused while this load built its partitions")
    if isinstance(dtype, torch.dtype) and outer.dtype != dtype:
        log.warning_once(f"outer zero.Init {outer.dtype} {dtype}",
                         "from_pretrained ran inside a `deepspeed.zero.Init` context whose dtype is %s, but the "
                         "DeepSpeed config of this load (%s) trains in %s: the parameters were loaded in %s. Give "
                         "zero.Init the same config (config_dict_or_path=...), or leave it out: hf_zero3_loader "
                         "partitions the model itself.", outer.dtype, setup.found_via, dtype, dtype)


def _load_without_missing_hooks(model_class, path, model_args, kwargs, setup, agreement, ep_request, missing):
    """An untested transformers or DeepSpeed lacks (or has changed) a private hook the load needs: transformers' own
    ZeRO-3 path, which needs none of them. Expert parallelism is then the engine's AutoEP (`deepspeed.initialize`,
    from the config's `expert_parallel` section), or refused where only the call asked for it. Every rank agreed on
    `missing` and the expert parallel size: they all take the same branch."""
    reason = compat.describe(missing)
    engine_ep = ""
    if ep_request is not None:
        if not (setup.config.get("expert_parallel") or {}).get("enabled"):
            raise ConfigError(f"{reason}. Expert parallelism ({ep_request.asked_via}) cannot load without them: "
                              "transformers' own ZeRO-3 path, the fallback, builds transformers' MoE blocks. Put an "
                              "`expert_parallel` section in the DeepSpeed config (deepspeed.initialize then applies "
                              f"AutoEP itself), or install the tested versions ({compat.DOC})")
        engine_ep = (" Expert parallelism is left to deepspeed.initialize (AutoEP, from the config's expert_parallel "
                     "section).")
        try:  # engine-side AutoEP on a transformers 5.23 model needs it; a hook of its own, maybe gone too
            ds_private.allow_registry_get_default()
        except Exception:
            pass
    log.warning_once(f"missing hooks {missing}{engine_ep}",
                     "%s. Loading through transformers' own ZeRO-3 path instead (deepspeed.zero.Init): slower (rank 0 "
                     "reads the whole checkpoint and broadcasts it, instead of each rank reading its share), but the "
                     "same model.%s See %s.", reason, engine_ep, compat.DOC)
    return _load_with_zero_init(model_class, path, model_args, kwargs, setup, agreement, reason, announce=False)


def _load_with_zero_init(model_class, path, model_args, kwargs, setup, agreement, reason, announce=True):
    """The fallback: transformers' own ZeRO-3 path (zero.Init, rank 0 reads, gathers and broadcasts)."""
    from .bypass import bypassed

    if announce:
        log.warning("%s: loading through transformers' own ZeRO-3 path (deepspeed.zero.Init: rank 0 reads the whole "
                    "checkpoint and broadcasts it, instead of each rank reading its share)", reason)
    error, model = None, None
    try:
        # this load's config, held for its whole duration; `import hf_zero3_loader.auto` must not route it back here
        with hf_private.hf_zero3_config(setup.config), bypassed():
            model = model_class.from_pretrained(path, *model_args, **kwargs)
    except Exception as e:
        error = missing_folder(path, e) or e
    agreement.check("finish load (zero.Init)", error)
    import torch.distributed as dist

    attach(model, LoadReport("zero.Init", reason, rank=dist.get_rank(), world_size=dist.get_world_size()))
    return model


