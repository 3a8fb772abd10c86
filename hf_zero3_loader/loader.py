"""`from_pretrained`: a drop-in for `AutoModel*.from_pretrained` that loads straight into ZeRO-3 partitions.

Flow under ZeRO-3:
1. transformers' own `from_pretrained` runs with the ZeRO-3 weakref hidden, so it resolves the checkpoint,
   config, dtype and conversion mapping and builds a *meta* skeleton (no allocation, no broadcast);
2. our `_load_pretrained_model` plans this rank's reads (`planner/`), turns every meta parameter into a
   ZeRO-3 parameter with a local partition (`zero3.py`) and fills it from the files (`reader.py`);
3. our `_finalize_model_loading` initialises missing keys in bounded chunks, ties weights, reports.
Ranks agree on failure at each step (`agreement.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from . import _transformers_private as hf_private
from . import log
from .agreement import AgreedFailure, Agreement
from .checkpoint import check_files, check_index, check_weight_map, find_index, open_checkpoint
from .deepspeed_setup import check_supported, find_deepspeed_setup, resolve_dtype
from .errors import CheckpointError, ConfigError, ConversionMismatchError
from .expert_parallel import ExpertParallelLayout, create_groups, is_requested, request_from
from .missing_init import DEFAULT_BUDGET_BYTES, InitStats, initialize_missing, materialize_meta_buffers
from .planner.plan import (WORLD, LoadPlan, PartitionGroup, check_plan_is_exact, missing_inputs, plan_tensors,
                           resolve_checkpoint, suspicious_missing_keys)
from .reader import FileReader, ReadStats, run_reads
from .staging import DEFAULT_STAGING_BYTES, check_budget, run_staged_reads
from .streaming import (DEFAULT_CHUNK_BYTES, MODES, Peer, Streamer, checkpoint_from_bundle, collect_small_files,
                        decide, local_checkpoint, node_id, write_stub_folder)
from .zero3 import Zero3Partitioner



@dataclass
class LoadReport:
    """What one rank did; attached to the model as `model.hf_zero3_load_report`."""

    init_context: str
    reason: str
    rank: int = 0
    world_size: int = 1
    plan: LoadPlan | None = None
    read: ReadStats = field(default_factory=ReadStats)
    init: InitStats = field(default_factory=InitStats)
    seconds: float = 0.0
    phases: dict = field(default_factory=dict)  # seconds per phase: plan, allocate, read, finalize
    expert_parallel: dict | None = None  # EP rank, local experts, bytes read for experts vs the rest
    stream: dict | None = None  # who read the files, who streamed to whom, bytes sent and received
    staging: dict | None = None  # partitions on an accelerator: the host staging buffer, pieces, bytes copied
    expert_parallel_layout: object = None  # expert_parallel.ExpertParallelLayout: what a save writes back

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def summary(self) -> dict:
        out = {"init_context": self.init_context, "reason": self.reason, "rank": self.rank,
               "bytes_read": self.read.bytes_read, "read_calls": self.read.reads, "seconds": round(self.seconds, 3),
               "missing_init_peak_gathered_bytes": self.init.peak_gathered_bytes,
               "phases": {k: round(v, 3) for k, v in self.phases.items()}}
        if self.plan is not None:
            out.update(self.plan.summary())
        if self.expert_parallel is not None:
            out["expert_parallel"] = self.expert_parallel
        if self.stream is not None:
            out["stream"] = self.stream
        if self.staging is not None:
            out["staging"] = self.staging
        return out


def _local_device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def _ensure_distributed() -> None:
    """Start the process group DeepSpeed's way. Called from plain `python` with no launcher (none of torchrun's
    variables set), load as a single process (world size 1) instead of failing in DeepSpeed's MPI discovery."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
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


class _Zero3Load:
    """The two transformers hooks for one ZeRO-3 load, sharing state through `self`."""

    def __init__(self, setup, agreement: Agreement, report: LoadReport, budget_bytes: int, read_threads: int,
                 allow_suspicious_missing: bool = False, keep_in_fp32: bool = False, expert_parallel=None,
                 stream=None, staging_bytes: int = DEFAULT_STAGING_BYTES):
        self.staging_bytes = staging_bytes
        self.allow_suspicious_missing = allow_suspicious_missing
        self.stream = stream  # StreamContext when some ranks receive their bytes from another rank
        self.expert_parallel = expert_parallel  # (ExpertParallelRequest, ExpertParallelGroups) or None
        self.reached_load = False
        self.keep_in_fp32 = keep_in_fp32
        self.setup = setup
        self.agreement = agreement
        self.report = report
        self.budget_bytes = budget_bytes
        self.read_threads = read_threads

    # -- replaces PreTrainedModel._load_pretrained_model ---------------------------------------------
    def load(self, model, state_dict, checkpoint_files, load_config, expected_keys=None):
        self.reached_load = True  # the meta skeleton was built
        info, error = None, None
        try:
            info = self._load(model, state_dict, checkpoint_files, load_config)
        except Exception as e:  # agree before anyone enters a DeepSpeed collective
            error = e
        with self.report.phase("agree"):
            self.agreement.check("read checkpoint", error)
        return info, None

    def _load(self, model, state_dict, checkpoint_files, load_config):
        if state_dict is not None:
            raise ConfigError("hf_zero3_loader reads checkpoints from files; `state_dict=` is not supported")
        self._refuse_kept_quantized(load_config.hf_quantizer)
        with self.report.phase("plan"):
            checkpoint = self._open_checkpoint(checkpoint_files, load_config)
        with self.report.phase("agree"):  # every rank proves it loads the same checkpoint before planning
            self.agreement.check("identify the checkpoint", same=checkpoint_identity(model, load_config, checkpoint))
        with self.report.phase("plan"):
            partitioner = Zero3Partitioner(self.setup.config)
            world = partitioner.world_group()
            resolution = resolve_checkpoint(model, checkpoint, load_config.weight_mapping or [],
                                            load_config.dtype_plan or {})
            layout, experts = None, None
            if self.expert_parallel is not None:  # the MoE blocks become AutoEP layers, still on meta
                request, groups = self.expert_parallel
                layout = ExpertParallelLayout.convert(model, request, groups)
                experts = partitioner.add_group(groups.edp_name, groups.edp_group)
            if not load_config.ignore_mismatched_sizes:
                self._refuse_incomplete_inputs(resolution)

            def plan_for(rank: int, world_group: PartitionGroup, expert_group, ep_rank: int) -> LoadPlan:
                group_of, sources = (lambda name: world_group), None
                if layout is not None:
                    group_of, sources = layout.group_of(world_group, expert_group), layout.sources_for(ep_rank)
                return plan_tensors(model, resolution, checkpoint, group_of, rank, world.size, sources)

            plan = plan_for(world.rank, world, experts, layout.groups.ep_rank if layout else 0)
            check_plan_is_exact(plan)
            if layout is not None:
                layout.check_loaded(plan)
                self.report.expert_parallel = layout.summary(plan)
                self.report.expert_parallel_layout = layout
            if isinstance(load_config.dtype, torch.dtype):
                self._params_in_engine_dtype(plan, load_config.dtype)
            self._refuse_broken_conversion(model, plan)
            self.report.plan = plan
            served = {}
            if self.stream is not None:  # the same plans the receiving ranks make for themselves
                if world.size != self.agreement.world_size:
                    raise ConfigError("streaming checkpoint bytes needs ZeRO-3 partitions over the whole world")
                for rank in self.stream.layout.serves(world.rank):
                    peer = self.stream.layout.peers[rank]
                    expert_group = PartitionGroup(experts.name, experts.size, peer.edp_rank) if experts else None
                    served[rank] = plan_for(rank, PartitionGroup(WORLD, world.size, rank), expert_group, peer.ep_rank)
                source = self.stream.layout.source_of.get(world.rank)
                for t in plan.tensors.values():
                    if t.status == "load" and source is not None:
                        t.byte_source = f"rank {source}"
        with self.report.phase("allocate"):
            destinations = self._allocate(model, plan, partitioner)
            if layout is not None:
                layout.materialize_new_buffers(_local_device())
        if self.stream is not None:
            with self.report.phase("stream"):
                edp = [self.expert_parallel[1].edp_group] if self.expert_parallel else []
                self._stream(plan, served, checkpoint, destinations, edp)
        if self.stream is None or self.stream.layout.reads_files(world.rank):
            with self.report.phase("read"):
                self._read(plan, checkpoint, destinations)
        model._weight_conversions = plan.converted_weight_mapping  # what save_pretrained reverses
        return hf_private.load_state_dict_info(plan.missing_keys, plan.unexpected_keys, plan.mismatched_keys)

    def _stream(self, plan: LoadPlan, served: dict, checkpoint, destinations, groups) -> None:
        """Readers send the ranks they serve their plans' bytes; receivers fill their partitions from them."""
        import torch.distributed as dist

        layout, rank = self.stream.layout, self.report.rank
        device = torch.device("cpu") if dist.get_backend() == "gloo" else _local_device()
        streamer = Streamer(self.stream.chunk_bytes, device)
        with self.agreement.collective_section("stream checkpoint bytes", groups):
            if served:
                reader = FileReader(self.report.read, checkpoint.identities)
                try:
                    streamer.serve(served, checkpoint, reader)
                finally:
                    reader.close()
            if rank in layout.source_of:
                streamer.receive(plan, layout.source_of[rank], {t.name: dst for t, dst in destinations})
        self.report.stream = {**layout.summary(rank), "bytes_sent": streamer.bytes_sent,
                              "bytes_received": streamer.bytes_received,
                              "largest_stream_buffer_bytes": streamer.largest_buffer}

    def _open_checkpoint(self, checkpoint_files, load_config):
        if not checkpoint_files:
            raise ConfigError(f"no checkpoint files found for {load_config.pretrained_model_name_or_path}")
        name = str(load_config.pretrained_model_name_or_path)
        check_files(name if os.path.isdir(name) else os.path.dirname(checkpoint_files[0]), checkpoint_files)
        if self.stream is not None and self.stream.bundle is not None:  # stub files: the reader's headers
            checkpoint = checkpoint_from_bundle(self.stream.bundle, checkpoint_files)
        else:
            checkpoint = open_checkpoint(checkpoint_files, weights_only=load_config.weights_only)
        if load_config.sharded_metadata and "weight_map" in load_config.sharded_metadata:
            check_weight_map(load_config.sharded_metadata["weight_map"], checkpoint)
        return checkpoint

    @staticmethod
    def _refuse_kept_quantized(quantizer) -> None:
        """Quantized checkpoints load dequantized (each rank dequantizes its own partition, `dequantize.py`); weights
        kept quantized cannot be ZeRO-3 partitions that DeepSpeed trains."""
        if quantizer is None or getattr(quantizer.quantization_config, "dequantize", False):
            return
        method = getattr(quantizer.quantization_config, "quant_method", "?")
        hint = {"fp8": "FineGrainedFP8Config(dequantize=True)", "mxfp4": "Mxfp4Config(dequantize=True)"}.get(
            str(getattr(method, "value", method)), "the quantization config with dequantize=True, if it has one")
        raise ConfigError(f"{type(quantizer).__name__}: keeping the weights quantized is not supported under DeepSpeed "
                          f"ZeRO-3 (it partitions and trains dequantized weights); pass quantization_config={hint} to "
                          "dequantize them while loading")

    @staticmethod
    def _refuse_incomplete_inputs(resolution) -> None:
        """Merged tensors (fused experts) short of some of their checkpoint tensors: name them, rather than the size
        mismatch transformers would report."""
        short = [(target, missing_inputs(resolution, target, tuple(shape)))
                 for target, _, shape in sorted(resolution.mismatched_keys, key=lambda m: m[0])]
        short = [(target, missing) for target, missing in short if missing]
        if short:
            lines = "\n".join(f"  {target} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
                              for target, missing in short[:8])
            raise CheckpointError(f"{len(short)} parameters are built from numbered checkpoint tensors the checkpoint "
                                  f"does not hold (a shard or an index entry missing?):\n{lines}")

    def _refuse_broken_conversion(self, model, plan: LoadPlan) -> None:
        suspicious = suspicious_missing_keys(plan)
        if not suspicious or self.allow_suspicious_missing:
            return
        lines = "\n".join(f"  {m} <- unexpected: {', '.join(u[:4])}{' ...' if len(u) > 4 else ''}" for m, u in suspicious)
        raise ConversionMismatchError(
            f"{len(suspicious)} parameters the checkpoint seems meant to provide would be randomly initialised, "
            f"while it holds unexpected keys that look like them (the weight conversion for model type "
            f"{getattr(model.config, 'model_type', '?')!r} did not match this checkpoint's layout):\n{lines}\n"
            "Pass `allow_suspicious_missing_keys=True` to load anyway and initialise them randomly."
        )

    def _allocate(self, model, plan: LoadPlan, partitioner: Zero3Partitioner) -> list[tuple]:
        """ZeRO-3 params with local partitions, and loaded buffers; returns (plan, flat destination) to fill."""
        destinations = []
        for name, _ in list(model.named_parameters()):  # the same order on every rank: ds_ids agree
            tensor_plan = plan.tensors[name]
            module_name, _, param_name = name.rpartition(".")
            param = partitioner.allocate(model.get_submodule(module_name), param_name, tensor_plan)
            if tensor_plan.status == "load":
                param._is_hf_initialized = True
                destinations.append((tensor_plan, param.ds_tensor))
        for name, _ in list(model.named_buffers()):
            tensor_plan = plan.tensors.get(name)
            if tensor_plan is None or tensor_plan.status != "load":
                continue
            module_name, _, buf_name = name.rpartition(".")
            value = torch.empty(tensor_plan.shape, dtype=tensor_plan.dtype, device=partitioner.local_device)
            value._is_hf_initialized = True
            model.get_submodule(module_name)._buffers[buf_name] = value
            destinations.append((tensor_plan, value.view(-1)))
        return destinations

    def _read(self, plan: LoadPlan, checkpoint, destinations) -> None:
        from transformers.utils.logging import tqdm  # honours transformers' progress-bar switches

        # host partitions are read in place; accelerator ones through the bounded staging buffer (`staging.py`)
        in_place, staged = [], []
        force_staging = os.environ.get("HF_ZERO3_LOADER_FORCE_STAGING") == "1"  # tests the staging path on CPU
        for tensor_plan, dst in destinations:
            jobs = staged if force_staging or dst.device.type != "cpu" else in_place
            jobs.extend((item, checkpoint.entry(item.key), dst) for item in tensor_plan.reads)
        reader = FileReader(self.report.read, checkpoint.identities)
        try:
            with tqdm(total=plan.bytes_to_read, unit="B", unit_scale=True, desc="Loading ZeRO-3 partitions",
                      disable=self.report.rank != 0) as bar:
                run_reads(in_place, reader, threads=self.read_threads, progress=bar.update)
                if staged:
                    self.report.staging = run_staged_reads(staged, reader, self.staging_bytes, self.read_threads,
                                                           progress=bar.update).summary()
        finally:
            reader.close()

    def _params_in_engine_dtype(self, plan: LoadPlan, engine_dtype: torch.dtype) -> None:
        """DeepSpeed ZeRO-3 (0.19.8) flattens all trainable params into one buffer of one dtype (stage3
        `defragment` asserts otherwise), as `zero.Init` casts them. Params a plain load keeps in another float
        dtype (`_keep_in_fp32_modules`, fp32 biases built by the model) are loaded in the engine's dtype."""
        if self.keep_in_fp32:
            return
        changed = [(t.name, t.dtype) for t in plan.tensors.values()
                   if t.kind == "param" and t.dtype.is_floating_point and t.dtype != engine_dtype]
        for name, _ in changed:
            plan.tensors[name].dtype = engine_dtype
        if changed and self.report.rank == 0:
            log.warning(
                "%d parameters that a plain load keeps in another dtype (e.g. %s: %s, from `_keep_in_fp32_modules` "
                "or the model) are loaded in %s: DeepSpeed ZeRO-3 holds all trainable parameters in the engine's "
                "dtype. Pass `keep_in_fp32=True` to keep the plain load's dtypes (then freeze those parameters "
                "before `deepspeed.initialize`).",
                len(changed), changed[0][0], changed[0][1], engine_dtype,
            )

    # -- replaces PreTrainedModel._finalize_model_loading ---------------------------------------------
    def finalize(self, model, load_config, loading_info):
        with self.report.phase("finalize"):
            return self._finalize(model, load_config, loading_info)

    def _finalize(self, model, load_config, loading_info):
        groups = [self.expert_parallel[1].edp_group] if self.expert_parallel is not None else []
        try:
            model.mark_tied_weights_as_initialized(loading_info)
            materialize_meta_buffers(model, _local_device())
            with self.agreement.collective_section("missing-key init", groups):
                initialize_missing(model, self.budget_bytes, self.report.init)
            with self.agreement.collective_section("tied-weights check", groups), \
                    hf_private.tied_equality(_zero3_tied_params_are_equal):
                model.tie_weights(missing_keys=loading_info.missing_keys, recompute_mapping=False)
            model._adjust_missing_and_unexpected_keys(loading_info)
        finally:
            hf_private.report_loading(model, load_config, loading_info)
        return loading_info


def checkpoint_identity(model, load_config, checkpoint) -> dict:
    """What every rank must agree on before planning: the config transformers built, the index, and every file's
    size, header and sampled data (each rank's copy is compared with the first rank's)."""
    config = {k: v for k, v in model.config.to_diff_dict().items() if not k.startswith("_")}
    weight_map = (load_config.sharded_metadata or {}).get("weight_map")
    digest = lambda value: hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]  # noqa: E731
    return {"config.json": digest(config), "the list of files": digest(sorted(checkpoint.fingerprints)),
            "the index": digest(weight_map) if weight_map else "none",
            **{f"file {name}": value for name, value in sorted(checkpoint.fingerprints.items())}}


def _zero3_tied_params_are_equal(source: torch.Tensor, target: torch.Tensor) -> bool:
    """Compare two ZeRO-3 params by their partitions: each rank compares its own, all ranks agree."""
    import torch.distributed as dist

    if not (hasattr(source, "ds_tensor") and hasattr(target, "ds_tensor")):
        return source.shape == target.shape and torch.equal(source, target)
    if source.ds_shape != target.ds_shape:
        return False
    differs = torch.tensor([0 if torch.equal(source.ds_tensor, target.ds_tensor) else 1], dtype=torch.int32,
                           device=source.ds_tensor.device)  # NCCL reduces only accelerator tensors
    dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=source.ds_process_group)
    return differs.item() == 0


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
            256 MiB, pinned on CUDA): reads into it overlap the copies to the device, and host memory grows by this
            much rather than by the rank's share of the checkpoint. Host partitions are read in place.
    """
    start = time.perf_counter()
    try:
        setup = find_deepspeed_setup(ds_config)
        zero3 = setup is not None and setup.stage == 3
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
                            strict_dtype=strict_dtype, staging_bytes=staging_bytes)
    finally:
        agreement.close()
    report = (model[0] if isinstance(model, tuple) else model).hf_zero3_load_report
    report.phases["init_distributed"] = init_distributed_s  # not part of the load: reported on its own
    report.seconds = time.perf_counter() - start - init_distributed_s
    log.info("loaded %s on %d ranks in %.2fs (%s, %s): this rank read %s%s", pretrained_model_name_or_path,
             report.world_size, report.seconds, report.init_context, report.reason, log.size(report.read.bytes_read),
             f", received {log.size(report.stream['bytes_received'])}" if report.stream else "")
    return model


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
    """No ZeRO-3 (no DeepSpeed config, or ZeRO-1/2): every rank holds the whole model; transformers loads it on meta
    and straight onto the rank's device."""
    if setup is not None and is_requested(setup.config, ep_size, kwargs.get("distributed_config")):
        raise ConfigError(f"expert parallelism with ZeRO stage {setup.stage} is not supported by hf_zero3_loader "
                          "yet; use ZeRO-3, or let deepspeed.initialize apply AutoEP to a plain load")
    if ep_size is not None:
        raise ConfigError("ep_size= needs a DeepSpeed ZeRO-3 config; without DeepSpeed use transformers' "
                          "distributed_config=DistributedConfig(ep_size=...)")
    reason = "no DeepSpeed config found" if setup is None else f"ZeRO stage {setup.stage} ({setup.found_via})"
    log.info("init context 'meta' (%s): loading onto the local device with transformers", reason)
    if setup is not None:
        kwargs["dtype"] = resolve_dtype(setup, kwargs.get("dtype", kwargs.pop("torch_dtype", None)), strict_dtype)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        kwargs.setdefault("device_map", {"": _local_device()})
    with hf_private.hidden_hf_zero3():
        model = model_class.from_pretrained(path, *model_args, **kwargs)
    _attach(model, LoadReport("meta", reason, seconds=time.perf_counter() - start))
    return model


@dataclass
class StreamContext:
    layout: object  # streaming.StreamLayout
    bundle: dict | None  # the reader's small files and headers, on a rank without the files
    chunk_bytes: int


def _find_readers(path, kwargs, agreement, mode, chunk_bytes, expert_parallel):
    """Which ranks can read the checkpoint; the others get the small files and write a stub folder for transformers.
    Returns (StreamContext or None, the path and kwargs this rank loads with)."""
    import tempfile

    import torch.distributed as dist

    folder, files, reason = local_checkpoint(str(path), kwargs.get("subfolder") or "", kwargs.get("revision"))
    ep_rank, edp_rank = 0, 0
    if expert_parallel is not None:
        groups = expert_parallel[1]
        ep_rank, edp_rank = groups.ep_rank, dist.get_rank(group=groups.edp_group)
    me = Peer(dist.get_rank(), node_id(), folder is not None, reason, ep_rank, edp_rank)
    # through the store, no collective: when every rank can read (and nobody asks to stream), that is all
    values = agreement.gather("find the ranks that can read the checkpoint", asdict(me),
                              needed=not me.readable or mode == "stream")
    if values is None:
        return None, path, kwargs
    peers = [Peer(**v) for v in values]
    layout = decide(peers, mode)
    if not layout.streaming:
        return None, path, kwargs
    bundle = None
    if not all(p.readable for p in peers):
        box = [None]
        with agreement.collective_section("hand the config and headers to the ranks without the files"):
            if me.rank == layout.first_reader():
                box = [collect_small_files(folder, files)]
            dist.broadcast_object_list(box, src=layout.first_reader())
        if not me.readable:
            bundle = box[0]
            path = write_stub_folder(bundle, tempfile.mkdtemp(prefix="hf_zero3_loader_stub_"))
            kwargs = {k: v for k, v in kwargs.items() if k not in ("subfolder", "revision")}
    summary = ", ".join(f"rank {r} <- rank {src}" for r, src in sorted(layout.source_of.items()))
    if me.rank == 0:
        log.info("streaming checkpoint bytes (load_from=%r): %s", mode, summary)
    return StreamContext(layout, bundle, chunk_bytes), path, kwargs


def _load_zero3(model_class, path, model_args, kwargs, setup, agreement, *, init_context, ep_size, read_threads,
                budget_bytes, allow_suspicious, keep_in_fp32, load_from, chunk_bytes, strict_dtype, staging_bytes):
    import torch.distributed as dist

    error, ep_request = None, None
    try:  # the call's own checks: whatever fails, every rank hears of it at the first agreement point
        if kwargs.get("device_map") is not None:
            raise ConfigError("`device_map` cannot be combined with DeepSpeed ZeRO-3: ZeRO-3 places each partition "
                              "itself")
        kwargs["dtype"] = resolve_dtype(setup, kwargs.pop("dtype", kwargs.pop("torch_dtype", None)), strict_dtype)
        distributed_config = kwargs.pop("distributed_config", None)  # its expert parallelism is ours to build
        check_supported(setup)
        if init_context not in ("auto", "meta", "zero.Init"):
            raise ConfigError(f"init_context must be 'auto', 'meta' or 'zero.Init', got {init_context!r}")
        index = find_index(str(path), kwargs.get("subfolder") or "", kwargs.get("revision"))
        if index is not None:  # transformers would fail on a malformed index with a bare KeyError/TypeError
            check_index(index)
        if load_from not in MODES:
            raise ConfigError(f"load_from must be one of {MODES}, got {load_from!r}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 64:
            raise ConfigError(f"stream_chunk_bytes must be an integer of at least 64, got {chunk_bytes!r}")
        check_budget(staging_bytes)
        ep_request = request_from(setup.config, ep_size, distributed_config, dist.get_world_size())
        if (ep_request is not None and init_context == "zero.Init"
                and not (setup.config.get("expert_parallel") or {}).get("enabled")):
            raise ConfigError("init_context='zero.Init' builds transformers' MoE blocks; expert parallelism is then "
                              "DeepSpeed's engine-side AutoEP, which needs `expert_parallel` in the DeepSpeed config")
    except Exception as e:
        error = e
    agreement.check("check the arguments and the DeepSpeed config", error)
    expert_parallel = None
    if ep_request is not None:  # groups first, on every rank: the engine reuses them
        expert_parallel = (ep_request, create_groups(ep_request, setup.config))
    if init_context == "zero.Init":
        return _load_with_zero_init(model_class, path, model_args, kwargs, setup, agreement,
                                    "requested with init_context='zero.Init'")
    stream, original_path = None, path
    if load_from != "read" and dist.get_world_size() > 1:
        stream, path, kwargs = _find_readers(path, kwargs, agreement, load_from, chunk_bytes, expert_parallel)
    try:
        return _load_on_meta(model_class, path, model_args, kwargs, setup, agreement, ep_request, expert_parallel,
                             stream, original_path, init_context=init_context, read_threads=read_threads,
                             budget_bytes=budget_bytes, allow_suspicious=allow_suspicious, keep_in_fp32=keep_in_fp32,
                             staging_bytes=staging_bytes)
    finally:
        if path != original_path and os.path.isdir(str(path)):  # the stub folder of a rank without the files
            import shutil

            shutil.rmtree(path, ignore_errors=True)


def _load_on_meta(model_class, path, model_args, kwargs, setup, agreement, ep_request, expert_parallel, stream,
                  original_path, *, init_context, read_threads, budget_bytes, allow_suspicious, keep_in_fp32,
                  staging_bytes=DEFAULT_STAGING_BYTES):
    import torch.distributed as dist

    reason = f"ZeRO-3 ({setup.found_via})"
    context = "zero3-meta"
    if ep_request is not None:
        context, reason = "ep-meta", f"{reason}, expert parallel size {ep_request.ep_size} ({ep_request.asked_via})"
    report = LoadReport(context, reason, rank=dist.get_rank(), world_size=dist.get_world_size())
    log.debug("init context '%s' (%s): each rank reads its own partitions", context, reason)
    if read_threads is None:  # more threads than cores only adds contention between ranks on one machine
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        read_threads = max(1, min(4, (os.cpu_count() or 1) // max(local_ranks, 1)))
    hooks = _Zero3Load(setup, agreement, report, budget_bytes, read_threads, allow_suspicious, keep_in_fp32,
                       expert_parallel, stream, staging_bytes)
    error, model = None, None
    try:
        with hf_private.hidden_hf_zero3(), hf_private.replaced_loading(hooks.load, hooks.finalize):
            model = model_class.from_pretrained(path, *model_args, **kwargs)
    except AgreedFailure:
        raise
    except Exception as e:
        error = e
    cannot_build_on_meta = (error is not None and not hooks.reached_load and init_context == "auto"
                            and "meta" in str(error).lower())
    agreement.check("finish load", None if cannot_build_on_meta else error)
    if cannot_build_on_meta:
        if stream is not None:
            raise ConfigError("this model cannot be built on meta, and transformers' zero.Init path needs the "
                              "checkpoint on every rank: give every rank the files, or load_from='read'")
        return _load_with_zero_init(model_class, path, model_args, kwargs, setup, agreement,
                                    f"the model cannot be built on meta ({type(error).__name__}: {error})")
    target = model[0] if isinstance(model, tuple) else model
    if path != original_path:  # loaded from a stub folder: name the checkpoint as the user did
        target.config._name_or_path = str(original_path)
        target.name_or_path = str(original_path)
    _attach(model, report)
    return model


def _load_with_zero_init(model_class, path, model_args, kwargs, setup, agreement, reason):
    """The fallback: transformers' own ZeRO-3 path (zero.Init, rank 0 reads, gathers and broadcasts)."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import deepspeed_config, unset_hf_deepspeed_config

    log.warning("init context 'zero.Init' (%s): using transformers' ZeRO-3 path", reason)
    own_config = HfDeepSpeedConfig(setup.config) if deepspeed_config() is None else None
    error, model = None, None
    try:
        model = model_class.from_pretrained(path, *model_args, **kwargs)
    except Exception as e:
        error = e
    finally:
        if own_config is not None:
            unset_hf_deepspeed_config()
    agreement.check("finish load (zero.Init)", error)
    import torch.distributed as dist

    _attach(model, LoadReport("zero.Init", reason, rank=dist.get_rank(), world_size=dist.get_world_size()))
    return model


def _attach(model, report: LoadReport) -> None:
    target = model[0] if isinstance(model, tuple) else model
    target.hf_zero3_load_report = report
