"""`save_pretrained`: write a ZeRO-3 model (with or without expert parallelism) as the Hugging Face checkpoint a plain
`save_pretrained` of the gathered model writes, with no gather: every rank writes its own partitions' bytes.

A save is the load plan run backwards:
1. Files (`describe_files`): transformers' own `save_pretrained` runs on a meta skeleton of the model (built from its
   config, every tensor in the live model's dtype) with the shard writer captured. So transformers decides the keys
   after reverting the weight conversions, the shard split, the index, config and generation config; each shard
   becomes a `PlannedFile` (its safetensors header, and where each tensor's bytes go).
2. Plan (`plan_writes`): those files are a checkpoint like any other. The planner resolves it against the skeleton
   (the forward conversions, as a load would) and plans this rank's partitions: `ReadItem`s saying which box of which
   on-disk tensor each partition range is. Under expert parallelism the AutoEP tensors are boxes of transformers'
   fused ones, as when loading. A round-trip check proves every on-disk element is written exactly once.
3. Write (`writer.py`): one rank creates the files at their final size in a temporary folder beside the target
   (`save_folder.py`), under names no loader looks for (`*.partial`); every rank `pwrite`s its partition ranges to
   their boxes. Ranks that cannot see the folder stream their bytes to a rank that can, in bounded chunks
   (`streaming.Streamer.send_partitions`).
4. Publish: the ranks agree every write succeeded; the files take their names and the folder is renamed into place
   (into a folder holding other files, the files are moved in: weights first, config and index last). A failure
   anywhere removes the temporary folder and raises the same error on every rank; one left by a writer that was
   killed loads nowhere, and the next save into the target removes it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from . import _deepspeed_private as ds_private
from . import _transformers_private as hf_private
from . import log
from .agreement import Agreement
from .checkpoint import Checkpoint, PlannedFile, plan_safetensors_file
from .deepspeed_setup import local_device
from .errors import CheckpointError, ConfigError, LoaderError
from .expert_parallel import loaded_layout
from .gc_pause import paused_gc
from .planner.plan import (LoadPlan, PartitionGroup, SourceBox, check_plan_is_exact, model_tensors, plan_tensors,
                           resolve_checkpoint)
from .reader import STAGING_BYTES, default_io_threads
from .report import timed_phase
from .save_folder import UNFINISHED, WRITER_FILE, TempFolder, is_index, unfinished
from .streaming import DEFAULT_CHUNK_BYTES, Peer, Streamer, decide, node_id
from .writer import FileWriter, WriteStats, create_file, run_writes

FILE_LAYOUTS = ("transformers", "accelerate")
WRITE_MODES = ("auto", "write", "stream")


@dataclass
class SaveReport:
    """What one rank did; returned by `save_pretrained`."""

    folder: str
    rank: int = 0
    world_size: int = 1
    writer_rank: int = 0
    files: list[str] = field(default_factory=list)
    partition_bytes: int = 0  # the bytes of this rank's partitions (its share of the checkpoint)
    write: WriteStats = field(default_factory=WriteStats)
    seconds: float = 0.0
    phases: dict = field(default_factory=dict)
    stream: dict | None = None
    gathered: bool = False  # True only when the model was not partitioned and transformers saved it

    def phase(self, name: str):
        return timed_phase(self.phases, name)

    def summary(self) -> dict:
        out = {"folder": self.folder, "rank": self.rank, "world_size": self.world_size, "writer_rank": self.writer_rank,
               "files": self.files, "partition_bytes": self.partition_bytes, "bytes_written": self.write.bytes_written,
               "writes": self.write.writes, "largest_staging_bytes": self.write.largest_staging_bytes,
               "seconds": round(self.seconds, 3), "phases": {k: round(v, 3) for k, v in self.phases.items()}}
        if self.stream is not None:
            out["stream"] = self.stream
        return out


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The PreTrainedModel inside a DeepSpeed engine, DDP or accelerate wrapper, or torch.compile."""
    from transformers import PreTrainedModel

    while not isinstance(model, PreTrainedModel):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    return model


def is_partitioned(model: torch.nn.Module) -> bool:
    return any(ds_private.is_zero3_param(p) for p in model.parameters())


@log.quiet_dependency_deprecations()  # DeepSpeed's calls of deprecated torch.distributed names, during our save
def save_pretrained(
    model: torch.nn.Module,
    save_directory: str | os.PathLike,
    *,
    is_main_process: bool | None = None,
    max_shard_size: int | str = "50GB",
    variant: str | None = None,
    save_original_format: bool = True,
    state_dict: dict | None = None,
    safe_serialization: bool = True,
    push_to_hub: bool = False,
    file_layout: str = "transformers",
    write_mode: str = "auto",
    write_threads: int | None = None,
    stream_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    staging_bytes: int = STAGING_BYTES,
    agreement_timeout_s: float | None = None,
    liveness_timeout_s: float | None = None,
    extra_files=None,
    **kwargs,
) -> SaveReport:
    """Save a ZeRO-3 model as the Hugging Face checkpoint `model.save_pretrained` writes for the gathered model (same
    files, keys, dtypes, shards, index, config, generation config), every rank writing its own partitions: nothing is
    gathered. Call it on every rank, like a collective. `model` may be the PreTrainedModel or its DeepSpeed engine.

    A model that is not partitioned (no DeepSpeed, ZeRO-1/2) is saved by transformers' own `save_pretrained` on the
    main process.

    Args beyond transformers':
        is_main_process: the rank that creates the folder and writes config, index and buffers is the lowest rank
            passing True (default: rank 0).
        file_layout: "transformers" (what `save_pretrained` writes) or "accelerate" (what `Accelerator.save_model`
            writes: the model's own tensor names, weights and index only).
        write_mode: "auto" (ranks that see the folder write; the others stream their bytes to one that does, on their
            node if possible), "write" (every rank must write), or "stream" (one writer per node).
        write_threads: threads issuing positional writes (default: this rank's share of the CPU cores, at most 4).
        stream_chunk_bytes: the largest piece a rank streams at once to a writing rank (default 64 MiB).
        staging_bytes: the largest host buffer a write uses (partitions on an accelerator, transposed boxes).
        agreement_timeout_s / liveness_timeout_s: as for `from_pretrained`.
        extra_files: `callable(folder)` the writing rank runs before publishing, to add files (tokenizer, training
            arguments) that should appear with the checkpoint, not before it.
    """
    import torch.distributed as dist

    start = time.perf_counter()
    module = unwrap(model)
    if not is_partitioned(module):
        return _save_gathered(module, save_directory, is_main_process, max_shard_size, variant, save_original_format,
                              state_dict, file_layout, extra_files, start, kwargs)
    agreement = Agreement(agreement_timeout_s, liveness_timeout_s)
    report = SaveReport(os.path.abspath(str(save_directory)), dist.get_rank(), dist.get_world_size())
    try:
        _Save(module, report, agreement, is_main_process=is_main_process, max_shard_size=max_shard_size,
              variant=variant, save_original_format=save_original_format, file_layout=file_layout,
              write_mode=write_mode, write_threads=write_threads, chunk_bytes=stream_chunk_bytes,
              staging_bytes=staging_bytes, extra_files=extra_files,
              refused=_refused_arguments(state_dict, safe_serialization, push_to_hub, file_layout, write_mode,
                                         stream_chunk_bytes, staging_bytes, kwargs)).run()
    finally:
        agreement.close()
    report.seconds = time.perf_counter() - start
    log.info("saved %s on %s in %.2f s: this rank wrote %s%s", report.folder, log.ranks(report.world_size),
             report.seconds, log.size(report.write.bytes_written),
             f", streamed {log.size(report.stream['bytes_sent'])}" if report.stream else "")
    return report


def _refused_arguments(state_dict, safe_serialization, push_to_hub, file_layout, write_mode, chunk_bytes,
                       staging_bytes, kwargs) -> Exception | None:
    from .compat import DOC, SAVE, describe, missing_hooks

    missing = missing_hooks(SAVE)  # an untested transformers or DeepSpeed: refused on every rank, nothing written
    if missing:
        return ConfigError(f"{describe(missing)}. hf_zero3_loader.save_pretrained refuses to write without them: save "
                           "through the Trainer or accelerate (with these versions they gather the model, as without "
                           "hf_zero3_loader: stage3_gather_16bit_weights_on_model_save), or with the engine's "
                           f"save_checkpoint; or install the tested versions ({DOC})")
    if state_dict is not None:
        return ConfigError("hf_zero3_loader.save_pretrained writes the model's own partitions; a `state_dict` would "
                           "have to be gathered first (use transformers' save_pretrained for that)")
    if not safe_serialization:
        return ConfigError("hf_zero3_loader.save_pretrained writes safetensors only (safe_serialization=True)")
    if push_to_hub:
        return ConfigError("push_to_hub is not supported by hf_zero3_loader.save_pretrained: save, then upload the "
                           "folder from one rank with huggingface_hub.upload_folder")
    if file_layout not in FILE_LAYOUTS:
        return ConfigError(f"file_layout must be one of {FILE_LAYOUTS}, got {file_layout!r}")
    if write_mode not in WRITE_MODES:
        return ConfigError(f"write_mode must be one of {WRITE_MODES}, got {write_mode!r}")
    for name, value in (("stream_chunk_bytes", chunk_bytes), ("staging_bytes", staging_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 64:
            return ConfigError(f"{name} must be an integer of at least 64, got {value!r}")
    if kwargs:
        return ConfigError(f"unsupported arguments for hf_zero3_loader.save_pretrained: {sorted(kwargs)}")
    return None


def _save_gathered(module, save_directory, is_main_process, max_shard_size, variant, save_original_format,
                   state_dict, file_layout, extra_files, start, kwargs) -> SaveReport:
    """Not partitioned: every rank holds the whole model, transformers writes it from the main process."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    main = rank == 0 if is_main_process is None else is_main_process
    if main:
        if file_layout != "transformers":
            raise ConfigError("file_layout='accelerate' is for ZeRO-3 models; use Accelerator.save_model")
        module.save_pretrained(save_directory, max_shard_size=max_shard_size, variant=variant, state_dict=state_dict,
                               save_original_format=save_original_format, **kwargs)
        if extra_files is not None:
            extra_files(str(save_directory))
    return SaveReport(os.path.abspath(str(save_directory)), rank, writer_rank=rank if main else -1, gathered=True,
                      seconds=time.perf_counter() - start)


# -- 1. the files ------------------------------------------------------------------------------------------------------

def meta_skeleton(module, layout) -> torch.nn.Module:
    """The model as a plain load builds it, on meta, each tensor in the live model's dtype: what `save_pretrained`
    runs on. Under expert parallelism (`layout`), with transformers' fused experts (or the expert modules) that the
    AutoEP tensors are boxes (or stacks) of."""
    # model name -> the transformers tensors it is a box of, on any EP rank (each expert module is in one EP rank's
    # stack)
    made_of: dict[str, list[str]] = {}
    for ep_rank in range(layout.groups.ep_size if layout is not None else 0):
        for name, box in layout.sources_for(ep_rank).items():
            made_of.setdefault(name, []).extend(box.members)
    wanted: dict[str, tuple[tuple[int, ...] | None, torch.dtype]] = {}  # skeleton name -> (shape if known, dtype)
    for names, _, shape, dtype in model_tensors(module):
        members = [m for n in names for m in made_of.get(n, ())]
        for member in members:  # their dtype, not their shape (AutoEP's aliases aside)
            wanted.setdefault(member, (None, dtype))
        if not members:
            wanted.update((name, (shape, dtype)) for name in names)
    dtypes = Counter(d for _, d in wanted.values() if d.is_floating_point)
    config = copy.deepcopy(module.config)
    if hf_private.state_dict_is_dequantized(getattr(module, "hf_quantizer", None)) and hasattr(
            config, "quantization_config"):  # read from GGUF dequantized: plain weights now (transformers refuses)
        del config.quantization_config
    skeleton = hf_private.meta_model(type(module), config, dtypes.most_common(1)[0][0] if dtypes else torch.float32)
    if getattr(module, "generation_config", None) is not None:
        skeleton.generation_config = copy.deepcopy(module.generation_config)
    conversions = hf_private.weight_conversions(module)
    if conversions is not None:  # loaded dequantized: saved dequantized
        hf_private.set_weight_conversions(skeleton, hf_private.conversions_without_dequantize(conversions))
    state = skeleton.state_dict(keep_vars=True)
    absent = sorted(n for n in state if n not in wanted)
    extra = sorted(n for n in wanted if n not in state)
    differ = sorted(n for n, t in state.items() if n in wanted and wanted[n][0] not in (None, tuple(t.shape)))
    if absent or extra or differ:
        parts = [f"{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                 for what, names in (("not in the model", absent), ("not built by its config", extra),
                                     ("of another shape than its config builds", differ)) if names]
        raise ConfigError(f"the model's tensors differ from what its config builds ({type(module).__name__}), so "
                          "the checkpoint cannot be written in transformers' layout: " + "; ".join(parts))
    for name, tensor in state.items():
        dtype = wanted[name][1]
        if tensor.dtype != dtype:
            owner_name, _, attr = name.rpartition(".")
            owner = skeleton.get_submodule(owner_name)
            meta = torch.empty(tensor.shape, dtype=dtype, device="meta")
            # setattr on a registered name replaces that parameter or buffer (a buffer stays persistent or not)
            if attr in dict(owner.named_parameters(recurse=False, remove_duplicate=False)):
                setattr(owner, attr, torch.nn.Parameter(meta, requires_grad=tensor.requires_grad))
            else:
                setattr(owner, attr, meta)
    skeleton.tie_weights()
    return skeleton


def describe_files(skeleton, file_layout: str, folder: str, max_shard_size, variant, save_original_format) -> dict:
    """Shard name -> PlannedFile, as transformers (or accelerate) would write them for the skeleton's model. The small
    files (config, generation config, index, custom code) are written to `folder` by the library itself."""
    files: dict[str, PlannedFile] = {}

    def record(path, tensors, metadata):
        name = os.path.basename(path)
        files[name] = plan_safetensors_file(name, {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}, metadata)

    if file_layout == "accelerate":
        _describe_accelerate_files(skeleton, folder, max_shard_size, record)
        return files
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' "Writing model shards" bar for a save that writes nothing
    try:
        with hf_private.captured_weight_files(skeleton, record):
            skeleton.save_pretrained(folder, max_shard_size=max_shard_size, variant=variant,
                                     save_original_format=save_original_format)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    if not files:
        raise LoaderError(f"internal error: transformers' save_pretrained wrote no weights for {type(skeleton).__name__}")
    return files


def _describe_accelerate_files(skeleton, folder, max_shard_size, record) -> None:
    """`Accelerator.save_model` (accelerate 1.15) for the gathered state dict: the model's own names, tied duplicates
    after the first dropped, split by huggingface_hub, metadata {"format": "pt"}, the index when sharded."""
    state, seen = {}, set()
    for name, tensor in skeleton.state_dict().items():
        storage = hf_private.meta_storage_id(tensor)
        if storage not in seen:
            seen.add(storage)
            state[name] = tensor
    split = hf_private.split_state_dict_on_meta(state, "model{suffix}.safetensors", max_shard_size)
    for name, keys in split.filename_to_tensors.items():
        record(name, {k: state[k] for k in keys}, {"format": "pt"})
    if split.is_sharded:
        with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, indent=2,
                               sort_keys=True) + "\n")


def as_checkpoint(files: dict[str, PlannedFile]) -> Checkpoint:
    entries = {key: entry for f in files.values() for key, entry in f.entries.items()}
    return Checkpoint(files=sorted(files), entries=entries, header_bytes=sum(len(f.header) for f in files.values()),
                      metadata={})


def files_digest(files: dict[str, PlannedFile]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name].header)
    return h.hexdigest()[:16]


# -- 2. the plan -------------------------------------------------------------------------------------------------------

def check_round_trip(skeleton, resolution, checkpoint: Checkpoint) -> None:
    """The files, loaded back with the forward conversions, give every tensor of the model, and every on-disk element
    is some model element: planning the whole model as one rank covers each file tensor exactly once."""
    problems = [f"{k} would load as unexpected" for k in sorted(resolution.unexpected_keys)]
    problems += [f"{m[0]} would load with shape {tuple(m[1])}" for m in sorted(resolution.mismatched_keys, key=str)]
    whole = plan_tensors(skeleton, resolution, checkpoint, lambda name: WHOLE, 0, 1)
    covered: Counter = Counter()
    for t in whole.tensors.values():
        for item in t.reads:
            covered[item.key] += item.numel
    # padding the forward conversion drops is left a hole of the new file: zeros, as the reverse op writes it
    problems += [f"{k}: {covered[k]} of {e.numel} elements written" for k, e in sorted(checkpoint.entries.items())
                 if covered[k] != resolution.zero_padded.get(k, e.numel)]
    if problems:
        raise CheckpointError("the weight conversions of this model do not reverse exactly, so a save without a "
                              f"gather cannot write its checkpoint: {'; '.join(problems[:6])}")


# A parameter that is not partitioned, in a model whose others are: whole on every rank, written once, like a buffer
# (transformers' ZeRO-3-aware `resize_token_embeddings` builds the new embedding this way, outside zero.Init)
WHOLE = PartitionGroup("whole", 1, 0)


def _group_of_param(module, name: str) -> PartitionGroup:
    param = module.get_parameter(name)
    if not ds_private.is_zero3_param(param):
        return WHOLE
    part = ds_private.zero3_partition(param)
    return PartitionGroup(f"pg{id(part.group)}", part.group_size, part.rank)


def plan_writes(module, resolution, checkpoint: Checkpoint, layout, rank: int, world_size: int,
                group_of=None, ep_rank: int | None = None, writes_buffers: bool = False,
                not_saved: frozenset = frozenset()) -> LoadPlan:
    """What this rank (or, with `group_of` / `ep_rank`, another rank) writes: each parameter's partition, as the
    load plan of the same files would read it; buffers (and whole parameters) only on the rank that `writes_buffers`.
    `not_saved`: the names transformers leaves out of a save (`_keys_to_ignore_on_save`)."""
    if group_of is None:
        def group_of(name):
            return _group_of_param(module, name)
    sources = layout.sources_for(layout.groups.ep_rank if ep_rank is None else ep_rank) if layout is not None else None
    plan = plan_tensors(module, resolution, checkpoint, group_of, rank, world_size, sources)
    check_plan_is_exact(plan)
    for t in plan.tensors.values():
        source = (sources or {}).get(t.name) or SourceBox(t.name)
        if t.kind == "param" and t.status != "load" and not set(source.members) <= not_saved:
            raise LoaderError(f"internal error: no file position for parameter {t.name} ({t.status})")
    plan.tensors = {n: t for n, t in plan.tensors.items()
                    if t.status == "load" and ((t.kind == "param" and t.group != WHOLE) or writes_buffers)}
    return plan


def partitions_of(module, plan: LoadPlan) -> dict[str, torch.Tensor]:
    """Each planned tensor's local flat data: a parameter's ZeRO-3 partition, a buffer (or whole parameter) whole."""
    out = {}
    for name, t in plan.tensors.items():
        if t.kind == "param" and t.group != WHOLE:
            out[name] = ds_private.zero3_partition(module.get_parameter(name)).tensor
        elif t.kind == "param":
            out[name] = module.get_parameter(name).detach().reshape(-1)
        else:
            out[name] = module.get_buffer(name).detach().reshape(-1)
    return out


# -- 3 and 4. write and publish ----------------------------------------------------------------------------------------

class _Save:
    def __init__(self, module, report: SaveReport, agreement: Agreement, *, is_main_process, max_shard_size, variant,
                 save_original_format, file_layout, write_mode, write_threads, chunk_bytes, staging_bytes,
                 extra_files, refused):
        self.module, self.report, self.agreement = module, report, agreement
        self.is_main_process = is_main_process
        self.max_shard_size, self.variant, self.save_original_format = max_shard_size, variant, save_original_format
        self.file_layout, self.write_mode = file_layout, write_mode
        self.chunk_bytes, self.staging_bytes = chunk_bytes, staging_bytes
        self.extra_files, self.refused = extra_files, refused
        self.threads = default_io_threads() if write_threads is None else write_threads
        self.layout = loaded_layout(module)
        self.temp: TempFolder | None = None  # the writer's temporary folder, until published

    def run(self) -> None:
        report, agreement = self.report, self.agreement
        private = tempfile.mkdtemp(prefix="hf_zero3_save_")
        try:
            error = self.refused
            try:
                if error is None:
                    with report.phase("plan"), paused_gc():
                        self._plan(private)
            except Exception as e:
                error = e
            with report.phase("agree"):
                # what the files hold, and how ranks stream to the writers: a rank deciding alone would wait for
                # bytes nobody sends, or leave its partitions unwritten in a checkpoint the writer publishes
                same = None if error else {"the planned files (from the model, max_shard_size, variant, file_layout, "
                                           "save_original_format)": self.digest,
                                           "write_mode": self.write_mode, "stream_chunk_bytes": self.chunk_bytes}
                agreement.check("plan the save", error, same=same,
                                differs="did not call save_pretrained alike", error_type=ConfigError)
                writer = self._writer_rank()
            report.writer_rank = writer
            self._with_temp_folder(writer, private)
        finally:
            shutil.rmtree(private, ignore_errors=True)

    def _plan(self, private: str) -> None:
        module, report = self.module, self.report
        self._refuse_foreign_expert_layers()
        skeleton = meta_skeleton(module, self.layout)
        self.files = describe_files(skeleton, self.file_layout, private, self.max_shard_size, self.variant,
                                    self.save_original_format)
        self.checkpoint = as_checkpoint(self.files)
        mapping = (hf_private.conversions_for_save(skeleton)
                   if self.file_layout == "transformers" and self.save_original_format else [])
        self.resolution = resolve_checkpoint(skeleton, self.checkpoint, mapping, {})
        if report.rank == 0:  # a property of the model and the files, the same on every rank
            check_round_trip(skeleton, self.resolution, self.checkpoint)
        self.not_saved = frozenset(getattr(skeleton, "_keys_to_ignore_on_save", None) or ())
        self.plan = plan_writes(module, self.resolution, self.checkpoint, self.layout, report.rank, report.world_size,
                                not_saved=self.not_saved)
        self.digest = files_digest(self.files)
        report.files = sorted(self.files)

    def _refuse_foreign_expert_layers(self) -> None:
        layer_class = ds_private.autoep_layer_class()
        if self.layout is None and any(isinstance(m, layer_class) for m in self.module.modules()):
            raise ConfigError("this model's MoE layers were replaced by DeepSpeed AutoEP at deepspeed.initialize; "
                              "saving it in transformers' layout needs the expert layout hf_zero3_loader records when "
                              "it loads with ep_size (or the config's expert_parallel section)")

    def _writer_rank(self) -> int:
        """Rank 0, unless `is_main_process` names another rank: then the lowest rank passing True."""
        rank = self.report.rank
        main = self.is_main_process
        values = self.agreement.gather("choose the writing rank", {"main": main},
                                       needed=main is not None and bool(main) != (rank == 0))
        if values is None:
            return 0
        mains = [r for r, v in enumerate(values) if (r == 0 if v["main"] is None else v["main"])]
        if not mains:
            raise ConfigError("no rank passed is_main_process=True: one rank must create the checkpoint folder")
        return mains[0]

    def _with_temp_folder(self, writer: int, private: str) -> None:
        report, agreement = self.report, self.agreement
        published = False
        try:
            error = None
            try:
                if report.rank == writer:
                    with report.phase("create files"):
                        self._create_files(private)
            except Exception as e:
                error = e
            agreement.check("create the checkpoint files", error)
            shared = agreement.share("save folder") if report.rank != writer else {"temp": self.temp.path,
                                                                                       "token": self.temp.token}
            self._write(shared["temp"], shared["token"], writer)
            error = None
            try:
                if report.rank == writer:
                    with report.phase("publish"):
                        if self.extra_files is not None:
                            self.extra_files(self.temp.path)
                        self.temp.publish(set(self.files), self.variant,
                                          remove_stale_shards=self.file_layout == "transformers")
                        published = True
            except Exception as e:
                error = e
            agreement.check("publish the checkpoint", error)
        finally:
            if report.rank == writer and not published and self.temp is not None:
                self.temp.remove()

    def _create_files(self, private: str) -> None:
        """The temporary folder (`save_folder.TempFolder`; earlier saves' whose writers are gone removed), the small
        files, and every weight file at its final size, under its unfinished name."""
        temp = self.temp = TempFolder(self.report.folder)
        if temp.removed:
            log.info("removed %d temporary folders of earlier saves into %s whose writers are gone: %s",
                     len(temp.removed), self.report.folder, ", ".join(temp.removed))
        for name in os.listdir(private):  # config, generation config, index, custom code: the library wrote them
            source = os.path.join(private, name)
            target = os.path.join(temp.path, unfinished(name) if is_index(name, self.variant) else name)
            (shutil.copytree if os.path.isdir(source) else shutil.copy2)(source, target)
        for planned in self.files.values():
            create_file(os.path.join(temp.path, unfinished(planned.name)), planned.header, planned.size)
        self.agreement.share("save folder", {"temp": temp.path, "token": temp.token})

    def _write(self, temp: str, token: str, writer: int) -> None:
        """Every rank writes its partitions into `temp`; ranks that cannot see it stream to ranks that can."""
        import torch.distributed as dist

        report, agreement = self.report, self.agreement
        if report.rank == writer:  # buffers are whole on every rank: one rank writes them
            self.plan = plan_writes(self.module, self.resolution, self.checkpoint, self.layout, report.rank,
                                    report.world_size, writes_buffers=True, not_saved=self.not_saved)
        report.partition_bytes = self.plan.bytes_to_read
        sees, why = _sees_folder(temp, token)
        ep_rank, edp_rank = 0, 0
        if self.layout is not None:
            ep_rank, edp_rank = self.layout.groups.ep_rank, dist.get_rank(group=self.layout.groups.edp_group)
        me = Peer(report.rank, node_id(), sees, why, ep_rank, edp_rank)
        with report.phase("agree"):
            values = agreement.gather("find the ranks that can write the folder", asdict(me),
                                      needed=not sees or self.write_mode == "stream")
        stream = self._decide_stream([Peer(**v) for v in values], writer) if values is not None else None
        error = None
        stats = report.write
        file_writer = FileWriter(stats)
        try:
            if stream is None or stream.reads_files(report.rank):
                with report.phase("write"):
                    self._write_own(temp, file_writer)
        except Exception as e:
            error = e
        if stream is not None:
            agreement.check("write this rank's partitions", error)
            error = None
            with report.phase("stream"):
                self._stream(stream, temp, file_writer, values)
        try:
            with report.phase("write"):
                file_writer.close(sync=True)  # on a network filesystem, another client sees the bytes after this
        except Exception as e:
            error = error or e
        agreement.check("write the checkpoint", error)

    def _write_own(self, temp: str, file_writer: FileWriter) -> None:
        from transformers.utils.logging import tqdm

        partitions = partitions_of(self.module, self.plan)
        jobs = [(_in_folder(item, temp), self.checkpoint.entries[item.key].data_start, partitions[t.name])
                for t in self.plan.tensors.values() for item in t.reads]
        with tqdm(total=self.plan.bytes_to_read, unit="B", unit_scale=True, desc="Writing ZeRO-3 partitions",
                  disable=self.report.rank != 0) as bar:
            run_writes(jobs, file_writer, self.threads, self.staging_bytes, progress=bar.update)

    def _decide_stream(self, peers: list[Peer], writer: int):
        unable = [p for p in peers if not p.readable]
        if self.write_mode == "write" and unable:
            raise CheckpointError(
                "write_mode='write', but ranks " + ", ".join(str(p.rank) for p in unable[:8]) + " cannot write the "
                f"checkpoint folder ({unable[0].reason}); pass write_mode='auto' to stream their partitions to a rank "
                "that can")
        layout = decide(peers, "read" if self.write_mode == "write" else self.write_mode)
        return layout if layout.streaming else None

    def _stream(self, stream, temp: str, file_writer: FileWriter, peers: list[dict]) -> None:
        """Ranks that cannot see the folder send their plan's bytes to a rank that can, which writes them."""
        import torch.distributed as dist

        report = self.report
        device = torch.device("cpu") if dist.get_backend() == "gloo" else local_device()
        streamer = Streamer(self.chunk_bytes, device)
        edp = [self.layout.groups.edp_group] if self.layout is not None else []
        phase = "stream partitions to the writing ranks"
        with self.agreement.collective_section(phase, edp):
            sink = stream.source_of.get(report.rank)
            if sink is not None:
                partitions = partitions_of(self.module, self.plan)
                self.agreement.run_watched(lambda: streamer.send_partitions(self.plan, sink, partitions), phase,
                                           streamer.cancelled)
            senders = stream.serves(report.rank)
            if senders:
                plans = {r: self._plan_for(Peer(**peers[r])) for r in senders}
                self.agreement.run_watched(
                    lambda: streamer.receive_to_files(plans, self.checkpoint, file_writer, temp, UNFINISHED), phase,
                    streamer.cancelled)
        report.stream = {"writes_files": sink is None, **({"streams_to": sink} if sink is not None else {}),
                         **({"receives_from": senders} if senders else {}), "bytes_sent": streamer.bytes_sent,
                         "bytes_received": streamer.bytes_received,
                         "largest_stream_buffer_bytes": streamer.largest_buffer}

    def _plan_for(self, peer: Peer) -> LoadPlan:
        """Another rank's plan, from what it told (its place in the world and in the expert groups)."""
        world = self.report.world_size
        expert_params = self.layout.expert_params if self.layout is not None else set()
        edp_size = world // self.layout.groups.ep_size if self.layout is not None else world

        def group_of(name):
            if not ds_private.is_zero3_param(self.module.get_parameter(name)):
                return WHOLE  # written by the writer rank itself
            part = ds_private.zero3_partition(self.module.get_parameter(name))
            if name in expert_params:
                return PartitionGroup("experts", edp_size, peer.edp_rank)
            if part.group_size != world:
                raise ConfigError(f"{name} is partitioned over {part.group_size} of {world} ranks; streaming a save "
                                  "supports partitions over the world (and expert-data-parallel groups)")
            return PartitionGroup("world", world, peer.rank)

        return plan_writes(self.module, self.resolution, self.checkpoint, self.layout, peer.rank, world,
                           group_of=group_of, ep_rank=peer.ep_rank, not_saved=self.not_saved)


def _in_folder(item, folder: str):
    """The item writing into its file's unfinished name in `folder`."""
    from dataclasses import replace

    return replace(item, file=os.path.join(folder, unfinished(item.file)))


def _sees_folder(temp: str, token: str) -> tuple[bool, str]:
    """Whether this rank sees the writer's temporary folder (the same filesystem) and may write into it."""
    try:
        with open(os.path.join(temp, WRITER_FILE)) as f:
            if f.read() != token:
                return False, f"{temp} here is another folder than the writing rank's"
    except OSError as e:
        return False, f"{temp} is not visible here ({e.strerror})"
    if not os.access(temp, os.W_OK):
        return False, f"{temp} is not writable here"
    return True, ""
