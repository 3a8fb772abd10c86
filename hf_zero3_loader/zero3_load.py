"""One ZeRO-3 load, as the two transformers hooks it replaces (`_load_pretrained_model`, `_finalize_model_loading`).

The steps, each its own module:
1. open the checkpoint and agree every rank holds the same one (`checkpoint.py`, `agreement.py`);
2. plan this rank's reads (`planner/`), with experts laid out for expert parallelism (`expert_parallel.py`);
3. turn each meta parameter into a ZeRO-3 parameter with a local partition (`zero3.py`);
4. fill the partitions: from the files (`reader.py`, through `staging.py` on an accelerator) or, on a rank without the
   files, from a reader rank (`streaming.py`);
5. initialise missing keys in bounded chunks and tie weights (`missing_init.py`).
A failure on any rank becomes the same error on every rank at the next agreement point.
"""

from __future__ import annotations

import functools
import os
import re
import threading

import torch

from . import _transformers_private as hf_private
from . import log
from ._deepspeed_private import partitions_in_memory
from .agreement import Agreement, Worker, digest
from .checkpoint import (STATE_DICT, STATE_DICT_VALUES, FileFingerprint, check_files, check_weight_map,
                         checkpoint_from_state_dict, open_checkpoint)
from .deepspeed_setup import local_device
from .digests import full_check
from .errors import CheckpointError, ConfigError, ConversionMismatchError, LoaderError
from .expert_parallel import ExpertParallelLayout
from .leaf_modules import mark_experts_as_leaf_modules
from .missing_init import initialize_missing, materialize_meta_buffers
from .nvme_offload import SwapOutAsCompleted, read_in_waves
from .planner.plan import (WORLD, LoadPlan, PartitionGroup, check_plan_is_exact, checkpoint_bodies, missing_inputs,
                           plan_tensors, resolve_checkpoint, suspicious_missing_keys)
from .reader import FileReader, checked_reads, node_reads_whole_files, run_reads
from .report import LoadReport
from .staging import DEFAULT_STAGING_BYTES, run_staged_reads
from .streaming import Streamer, checkpoint_from_bundle, node_id, stream_bytes
from .zero3 import Zero3Partitioner


# quantizers whose weights this loader dequantizes on read: kept quantized they are refused with what to pass
DEQUANTIZE_HINTS = {"fp8": "FineGrainedFP8Config(dequantize=True)", "mxfp4": "Mxfp4Config(dequantize=True)",
                    "gguf": "GgufConfig(dequantize=True)"}


def _in_thread(fn):
    """Start `fn` in a thread; returns a join that waits for it and returns its exception (or None)."""
    thread = Worker(fn, "hf_zero3_loader-own-read")
    thread.start()

    def join():
        thread.join()
        return thread.error

    return join


def quant_method(config) -> str | None:
    """A quantization config's method ("fp8", "bitsandbytes", ...), from a config object or config.json's dict."""
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method",
                                                                                 type(config).__name__)
    return str(getattr(method, "value", method))


class TransformersPathNeeded(Exception):
    """Raised on every rank before anything is read: this load is transformers' own ZeRO-3 path (the reason)."""


class Zero3Load:
    """The two transformers hooks for one ZeRO-3 load, sharing state through `self`."""

    def __init__(self, setup, agreement: Agreement, report: LoadReport, budget_bytes: int, read_threads: int,
                 allow_suspicious_missing: bool = False, keep_in_fp32: bool = False, expert_parallel=None,
                 stream=None, staging_bytes: int = DEFAULT_STAGING_BYTES, verify_checkpoint: str = "sampled"):
        self.staging_bytes = staging_bytes
        self.verify_checkpoint = verify_checkpoint  # "full": every file hashed whole (once per node) and compared
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
        self.partitioner = None  # the load's Zero3Partitioner, once planning starts
        self.nvme_waves = None  # NVMe offload: how the reads went in waves (`nvme_offload.read_in_waves`)

    # -- replaces PreTrainedModel._load_pretrained_model ---------------------------------------------
    def load(self, model, state_dict, checkpoint_files, load_config, expected_keys=None):
        if self.reached_load:  # transformers' `load_adapter`: an adapter folder, its base model loaded by us already
            return self._load_adapter(model, state_dict, checkpoint_files, load_config, expected_keys)
        self.reached_load = True  # the meta skeleton was built
        info, error = None, None
        try:
            self._check_quantizer(load_config.hf_quantizer)
            info = self._load(model, state_dict, checkpoint_files, load_config)
        except TransformersPathNeeded:  # on every rank (the same arguments): the loader takes transformers' path
            raise
        except Exception as e:  # agree before anyone enters a DeepSpeed collective
            error = e
        with self.report.phase("agree"):
            self.agreement.check("read checkpoint", error)
        return info, None

    def _load_adapter(self, model, state_dict, checkpoint_files, load_config, expected_keys):
        """PEFT has just added the adapter's parameters, as plain tensors (as under transformers' own ZeRO-3 path), and
        transformers fills them with its own loading and the adapter's conversions; every rank reads the (small)
        adapter. The base model's ZeRO-3 parameters are not in the adapter's files, so nothing touches them."""
        result, error = (None, None), None
        try:
            result = hf_private.transformers_load(model, state_dict, checkpoint_files, load_config, expected_keys)
        except Exception as e:
            error = e
        self.agreement.check("load the adapter", error)
        return result

    def _load(self, model, state_dict, checkpoint_files, load_config):
        with self.report.phase("plan"):
            checkpoint = (checkpoint_from_state_dict(state_dict, streamed=self.stream is not None)
                          if state_dict is not None else self._open_checkpoint(checkpoint_files, load_config))
        if self.verify_checkpoint == "full" and state_dict is None:
            with self.report.phase("verify"):  # every file's sha256, each node hashing its copy once
                self.agreement.check("open the checkpoint")
                self.report.verify = full_check(checkpoint, self.agreement, node_id(), self.read_threads)
        with self.report.phase("agree"):  # every rank proves it loads the same checkpoint before planning
            self.agreement.check("identify the checkpoint", same=checkpoint_identity(model, load_config, checkpoint),
                                 hint=SAME_COPY, hints=IDENTITY_HINTS, same_where_known=exact_identity(checkpoint),
                                 explain=functools.partial(explain_file_difference, checkpoint))
        with self.report.phase("plan"):
            partitioner = self.partitioner = Zero3Partitioner(self.setup.config)
            world = partitioner.world_group()
            resolution = resolve_checkpoint(model, checkpoint, load_config.weight_mapping or [],
                                            load_config.dtype_plan or {})
            layout, experts = None, None
            if self.expert_parallel is not None:  # the MoE blocks become AutoEP layers, still on meta
                request, groups = self.expert_parallel
                layout = ExpertParallelLayout.convert(model, request, groups)
                if layout is None:  # no experts to place: plain ZeRO-3, as the engine will train it
                    self.report.init_context, self.report.reason = "zero3-meta", f"{self.report.reason}; no experts"
                else:
                    experts = partitioner.add_group(groups.edp_name, groups.edp_group)
                    partitioner.add_group(groups.built_name, groups.built_group)
            if not load_config.ignore_mismatched_sizes:
                self._refuse_incomplete_inputs(resolution)

            def plan_for(rank: int, world_group: PartitionGroup, expert_group, ep_rank: int) -> LoadPlan:
                group_of, sources = (lambda name: world_group), None
                if layout is not None:
                    group_of, sources = layout.group_of(world_group, expert_group), layout.sources_for(ep_rank)
                plan = plan_tensors(model, resolution, checkpoint, group_of, rank, world.size, sources)
                if isinstance(load_config.dtype, torch.dtype):  # its partitions' dtypes (what streamed pieces travel as)
                    self._params_in_engine_dtype(plan, load_config.dtype, warn=rank == world.rank)
                return plan

            plan = plan_for(world.rank, world, experts, layout.groups.ep_rank if layout else 0)
            check_plan_is_exact(plan)
            self._refuse_broken_conversion(model, plan)  # first: it names the cause of what EP finds missing below
            if layout is not None:
                layout.check_loaded(plan, resolution.converted)
                self.report.expert_parallel = layout.summary(plan)
                self.report.expert_parallel_layout = layout
                layout.forget_accelerate_leaf_marks(model)
                layout.let_peft_load_adapters_in_transformers_names(model)
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
        with self.report.phase("agree"):  # the same files, resolved alike (before any rank streams or gathers)
            self.agreement.check("resolve the checkpoint keys", same={RESOLUTION: resolution.fingerprint()},
                                 hints=IDENTITY_HINTS)
        with self.report.phase("allocate"):
            destinations = self._allocate(model, plan, partitioner)
            if layout is not None:
                layout.materialize_new_buffers(local_device())
        own_read = None
        if self.stream is None or self.stream.layout.reads_files(world.rank):
            own_read = functools.partial(self._read, plan, checkpoint, destinations)
        if self.stream is not None:
            with self.report.phase("stream"):
                edp = [self.expert_parallel[1].edp_group] if self.expert_parallel else []
                own_read = self._stream(plan, served, checkpoint, destinations, edp, own_read)
        if own_read is not None:  # not read by `_stream` while it served
            own_read()
        hf_private.set_weight_conversions(model, plan.converted_weight_mapping)  # what save_pretrained reverses
        return hf_private.load_state_dict_info(plan.missing_keys, plan.unexpected_keys, plan.mismatched_keys)

    def _stream(self, plan: LoadPlan, served: dict, checkpoint, destinations, groups, own_read=None):
        """Readers send the ranks they serve their plans' bytes; receivers fill their partitions from them. A reader
        reads its own partitions (`own_read`) in a thread meanwhile: serving mostly waits for the receivers to take
        each chunk (dequantizing FP8 there), and its own read would otherwise wait for all of it. Returns
        `own_read` when it did not run it."""
        import torch.distributed as dist
        from transformers.utils.logging import tqdm  # honours transformers' progress-bar switches

        layout, rank = self.stream.layout, self.report.rank
        device = torch.device("cpu") if dist.get_backend() == "gloo" else local_device()
        streamer = Streamer(self.stream.chunk_bytes, device)
        with self.agreement.collective_section("stream checkpoint bytes", groups):
            if served:
                reader = FileReader(self.report.read, checkpoint.identities, prefault=False,  # into reused chunks
                                    readahead=node_reads_whole_files(self.report.world_size))
                desc = f"Streaming partitions to {len(served)} rank{'s' * (len(served) > 1)}"
                cancel = threading.Event()  # a failed or interrupted serve stops the own read's queued reads
                joined_read = _in_thread(functools.partial(own_read, cancel=cancel)) if own_read is not None else None
                own_read, error = None, None
                try:  # rank 0 shows its progress, as it does for its own reads
                    with tqdm(total=sum(stream_bytes(p) for p in served.values()), unit="B", unit_scale=True,
                              desc=desc, disable=rank != 0) as bar:
                        self.agreement.run_watched(
                            lambda: streamer.serve(served, checkpoint, reader, progress=bar.update),
                            "stream checkpoint bytes", streamer.cancelled)
                except BaseException as e:
                    error = e
                    cancel.set()
                finally:
                    reader.close()  # checks every file it read against its pin: a shard written meanwhile fails
                    error = reader.changed_error() or error
                if joined_read is not None:  # the partitions are written by then, whatever failed
                    read_error = joined_read()
                    error = error or read_error
                if error is not None:
                    raise error
            if rank in layout.source_of:
                by_name = {t.name: dst for t, dst in destinations}
                # NVMe offload: each wave of completed partitions goes to the swap files as the stream fills them
                swap_out = (SwapOutAsCompleted(self.partitioner, self.staging_bytes)
                            if self.partitioner is not None and self.partitioner.nvme_params else None)
                with tqdm(total=stream_bytes(plan), unit="B", unit_scale=True, desc="Receiving ZeRO-3 partitions",
                          disable=rank != 0) as bar:
                    self.agreement.run_watched(
                        lambda: streamer.receive(plan, layout.source_of[rank], by_name, checkpoint,
                                                 progress=bar.update,
                                                 on_complete=swap_out and (lambda name: swap_out(by_name[name]))),
                        "stream checkpoint bytes", streamer.cancelled)
                if swap_out is not None:
                    swap_out.flush()
                    self.nvme_waves = swap_out.summary()
        self.report.stream = {**layout.summary(rank), "bytes_sent": streamer.bytes_sent,
                              "bytes_received": streamer.bytes_received,
                              "largest_stream_buffer_bytes": streamer.largest_buffer,
                              "chunks_sent": streamer.chunks_sent}
        return own_read

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
    def _check_quantizer(quantizer) -> None:
        """FP8 and MXFP4 checkpoints load dequantized (each rank dequantizes its own partition, `dequantize.py`); kept
        quantized they cannot be ZeRO-3 partitions that DeepSpeed trains. Other quantizers that keep the weights
        quantized (bitsandbytes 4-bit for QLoRA, whose `bnb_4bit_quant_storage` in the engine dtype lets zero.Init
        partition them) are transformers' own ZeRO-3 path, taken as without this library."""
        if (quantizer is None or getattr(quantizer.quantization_config, "dequantize", False)
                or hf_private.state_dict_is_dequantized(quantizer)):
            return
        method = quant_method(quantizer.quantization_config)
        hint = DEQUANTIZE_HINTS.get(method)
        if hint is None:
            raise TransformersPathNeeded(f"{type(quantizer).__name__} ({method}) keeps the weights quantized")
        raise ConfigError(f"{type(quantizer).__name__}: keeping the weights quantized is not supported under DeepSpeed "
                          f"ZeRO-3 (it partitions and trains dequantized weights); pass quantization_config={hint} to "
                          "dequantize them while loading")

    @staticmethod
    def _refuse_incomplete_inputs(resolution) -> None:
        """Merged tensors (fused experts) short of some of their checkpoint tensors: name them, rather than the size
        mismatch transformers would report."""
        short = [(target, missing_inputs(resolution.inputs.get(target, {}), tuple(shape)))
                 for target, _, shape in sorted(resolution.mismatched_keys, key=lambda m: m[0])]
        short = [(target, missing) for target, missing in short if missing]
        if short:
            lines = "\n".join(f"  {target} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
                              for target, missing in short[:8])
            raise CheckpointError(f"{len(short)} parameters are built from numbered checkpoint tensors the checkpoint "
                                  f"does not hold (a shard or an index entry missing?):\n{lines}")

    def _refuse_broken_conversion(self, model, plan: LoadPlan) -> None:
        body = getattr(model, "base_model_prefix", "")
        suspicious = suspicious_missing_keys(plan, body)
        if not suspicious or self.allow_suspicious_missing:
            return
        lines = "\n".join(f"  {m} <- unexpected: {', '.join(u[:4])}{' ...' if len(u) > 4 else ''}" for m, u in suspicious)
        other_bodies = checkpoint_bodies(suspicious, body)
        cause = (f"{type(model).__name__} holds its body as '{body}.', the checkpoint as "
                 f"{', '.join(repr(b + '.') for b in other_bodies)}, which transformers does not map; "
                 f"from_pretrained's key_mapping={{r'^{re.escape(other_bodies[0])}\\.': '{body}.'}} maps it"
                 if other_bodies else
                 f"the weight conversion for model type {getattr(model.config, 'model_type', '?')!r} did not match "
                 "this checkpoint's layout")
        raise ConversionMismatchError(
            f"{len(suspicious)} parameters the checkpoint seems meant to provide would be randomly initialised, "
            f"while it holds unexpected keys that look like them ({cause}):\n{lines}\n"
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
                hf_private.mark_initialized(param)
                destinations.append((tensor_plan, param.ds_tensor))
        for name, _ in list(model.named_buffers()):
            tensor_plan = plan.tensors.get(name)
            if tensor_plan is None or tensor_plan.status != "load":
                continue
            module_name, _, buf_name = name.rpartition(".")
            value = torch.empty(tensor_plan.shape, dtype=tensor_plan.dtype, device=partitioner.local_device)
            hf_private.mark_initialized(value)
            setattr(model.get_submodule(module_name), buf_name, value)  # a registered buffer: stays one, as persistent
            destinations.append((tensor_plan, value.view(-1)))
        return destinations

    def _read(self, plan: LoadPlan, checkpoint, destinations, cancel: threading.Event | None = None) -> None:
        with self.report.phase("read"):
            self._read_partitions(plan, checkpoint, destinations, cancel)

    def _read_partitions(self, plan: LoadPlan, checkpoint, destinations, cancel=None) -> None:
        from transformers.utils.logging import tqdm  # honours transformers' progress-bar switches

        # host partitions are read in place; accelerator ones through the bounded staging buffer (`staging.py`)
        in_place, staged = [], []
        force_staging = os.environ.get("HF_ZERO3_LOADER_FORCE_STAGING") == "1"  # tests the staging path on CPU
        for tensor_plan, dst in destinations:
            jobs = staged if force_staging or dst.device.type != "cpu" else in_place
            jobs.extend((item, checkpoint.entry(item.key), dst) for item in tensor_plan.reads)
        reader = FileReader(self.report.read, checkpoint.identities,
                            readahead=node_reads_whole_files(self.report.world_size))
        with checked_reads(reader):  # a file written while it was read fails the load, naming it
            with tqdm(total=plan.bytes_to_read, unit="B", unit_scale=True, desc="Loading ZeRO-3 partitions",
                      disable=self.report.rank != 0) as bar:

                def progress(nbytes: int) -> None:  # raising here cancels the queued reads, as a failure does
                    if cancel is not None and cancel.is_set():
                        raise LoaderError("reading this rank's partitions was cancelled: streaming failed")
                    bar.update(nbytes)

                if self.partitioner is not None and self.partitioner.nvme_params:  # NVMe offload: read and swap out
                    self.nvme_waves = read_in_waves(in_place, functools.partial(
                        run_reads, reader=reader, threads=self.read_threads, progress=progress), self.partitioner,
                        self.staging_bytes)
                else:
                    run_reads(in_place, reader, threads=self.read_threads, progress=progress)
                if staged:
                    self.report.staging = run_staged_reads(staged, reader, self.staging_bytes, self.read_threads,
                                                           progress=progress).summary()

    def _params_in_engine_dtype(self, plan: LoadPlan, engine_dtype: torch.dtype, warn: bool = True) -> None:
        """DeepSpeed ZeRO-3 (0.19.8) flattens all trainable params into one buffer of one dtype (stage3
        `defragment` asserts otherwise), as `zero.Init` casts them. Params a plain load keeps in another float
        dtype (`_keep_in_fp32_modules`, fp32 biases built by the model) are loaded in the engine's dtype."""
        if self.keep_in_fp32:
            return
        changed = [(t.name, t.dtype) for t in plan.tensors.values()
                   if t.kind == "param" and t.dtype.is_floating_point and t.dtype != engine_dtype]
        for name, _ in changed:
            plan.tensors[name].dtype = engine_dtype
        if changed and warn and self.report.rank == 0:
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
            buffers = materialize_meta_buffers(model, local_device())
            with self.agreement.collective_section("missing-key init", groups):
                initialize_missing(model, self.budget_bytes, self.report.init, buffers)
            with self.agreement.collective_section("tied-weights check", groups), \
                    hf_private.tied_equality(_zero3_tied_params_are_equal):
                model.tie_weights(missing_keys=loading_info.missing_keys, recompute_mapping=False)
            hf_private.adjust_missing_and_unexpected_keys(model, loading_info)
            self.report.leaf_modules = mark_experts_as_leaf_modules(model)
            if self.partitioner.nvme_params or self.nvme_waves:  # NVMe offload: what is left goes to the swap files
                # the missing keys' partitions, initialised (or partitions streamed here), unless tied away
                self.partitioner.swap_out(model=model)
                swapped = self.partitioner.swapped_out
                self.report.nvme = {"partitions_swapped_out": swapped["partitions"],
                                    "bytes_swapped_out": swapped["bytes"], **(self.nvme_waves or {})}
        finally:
            hf_private.report_loading(model, load_config, loading_info)
        return loading_info


CONFIG = "the config (config.json with this call's config arguments)"
RESOLUTION = "which checkpoint keys load into which tensors (key_mapping, transformers' conversions)"
# what to do when it differs: a file, the same copy; the model class and config arguments come from the call
SAME_COPY = "give every rank the same copy"
IDENTITY_HINTS = {"the model class": "call from_pretrained with the same model class on every rank",
                  CONFIG: "give every rank the same copy, config arguments and transformers version (config.json "
                          "records it)",
                  RESOLUTION: "give every rank the same key_mapping"}


def checkpoint_identity(model, load_config, checkpoint) -> dict:
    """What every rank must agree on before planning: the model class, the config transformers built, the index,
    and every file's size, header and sampled data, or a `state_dict`'s fingerprint (each rank's is compared with
    the first rank's). Ranks that built different models would partition different parameters: a hang later. (The
    class by name: remote code's module is named after the folder, which may differ from node to node.)"""
    config = {k: v for k, v in model.config.to_diff_dict().items() if not k.startswith("_")}
    weight_map = (load_config.sharded_metadata or {}).get("weight_map")
    return {"the model class": type(model).__qualname__, CONFIG: digest(config),
            "the list of files": digest(sorted(checkpoint.fingerprints)),
            "the index": digest(weight_map) if weight_map else "none",
            **{(name if name in (STATE_DICT, STATE_DICT_VALUES) else f"file {name}"):
               value.compared() if isinstance(value, FileFingerprint) else value
               for name, value in sorted(checkpoint.fingerprints.items())}}


def exact_identity(checkpoint) -> dict | None:
    """Each file's sha256, where this rank knows every file's (`checkpoint.known_sha256`, or a full check): ranks
    that know them compare them, so copies that differ anywhere fail, not only in the bytes sampled."""
    fingerprints = [(n, f) for n, f in sorted(checkpoint.fingerprints.items()) if isinstance(f, FileFingerprint)]
    if not fingerprints or not all(f.sha256 for _, f in fingerprints):
        return None
    return {f"file {name}": f.sha256 for name, f in fingerprints}


def explain_file_difference(checkpoint, label: str, theirs, mine, their_rank: int, my_rank: int) -> str | None:
    """How two ranks' copies of a file differ, for the message: the first tensor whose sampled bytes differ (the
    headers being equal, both copies lay their tensors out alike), or their sha256s."""
    name = label.removeprefix("file ")
    if name == label:
        return None
    if isinstance(theirs, str) and isinstance(mine, str):  # sha256s (`exact_identity`)
        return (f"sha256 {theirs[:16]}... on rank {their_rank}, {mine[:16]}... on rank {my_rank}: the copies differ "
                "in bytes the sampled check does not read")
    if not (isinstance(theirs, dict) and isinstance(mine, dict)):
        return None

    def summary(v: dict) -> str:
        header = f", header {v['header']}" if v["header"] else ""
        return f"size {v['size']}{header}, data {v['data']}"

    both = f"{summary(theirs)} on rank {their_rank}, {summary(mine)} on rank {my_rank}"
    fingerprint = checkpoint.fingerprints.get(name)
    if ((theirs["size"], theirs["header"]) != (mine["size"], mine["header"]) or not mine["header"]
            or not isinstance(fingerprint, FileFingerprint) or len(theirs["samples"]) != len(mine["samples"])):
        return both
    differ = next(i for i, (a, b) in enumerate(zip(theirs["samples"], mine["samples"])) if a != b)
    start, size = fingerprint.sample_starts[differ]
    keys = sorted((e.data_start, e.key) for e in checkpoint.entries.values() if os.path.basename(e.file) == name
                  and e.data_start < start + size and e.data_start + e.nbytes > start)
    if not keys:
        return both
    named = (f"tensor {keys[0][1]!r} holds" if len(keys) == 1 else
             f"tensors {', '.join(repr(k) for _, k in keys[:3])}{' ...' if len(keys) > 3 else ''} hold")
    return f"{named} other values (the bytes sampled at offset {start} differ); {both}"


def _zero3_tied_params_are_equal(source: torch.Tensor, target: torch.Tensor) -> bool:
    """Compare two ZeRO-3 params by their partitions: each rank compares its own, all ranks agree."""
    import torch.distributed as dist

    if not (hasattr(source, "ds_tensor") and hasattr(target, "ds_tensor")):
        return source.shape == target.shape and torch.equal(source, target)
    if source.ds_shape != target.ds_shape:
        return False
    with partitions_in_memory([source, target]):  # NVMe offload: swapped in for the comparison
        differs = torch.tensor([0 if torch.equal(source.ds_tensor, target.ds_tensor) else 1], dtype=torch.int32,
                               device=source.ds_tensor.device)  # NCCL reduces only accelerator tensors
    dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=source.ds_process_group)
    return differs.item() == 0
