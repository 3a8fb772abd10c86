"""Plan what one rank reads: for every model tensor, which checkpoint bytes make this rank's partition.

`build_plan` mirrors the key grouping of transformers' `convert_and_load_state_dict_in_model` (5.23):
the same renamings, the same converter per target, the same dtype rules, the same missing / unexpected /
mismatched classification. Instead of reading tensors, it resolves each parameter's flat partition range
through the symbolic conversion graph (`ops.py`) to `ReadItem`s. The plan is a plain value: it can be
built for any rank on any process, inspected and tested without reading a byte of tensor data.
"""

from __future__ import annotations

import math
from collections import defaultdict
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Callable

import torch

from .._transformers_private import (WeightConverter, WeightRenaming, WeightTransform, build_glob_alternation,
                                      dot_natural_key, rename_source_key)
from ..agreement import digest
from ..checkpoint import Checkpoint
from ..errors import CheckpointError, LoaderError
from ..read_item import ReadItem  # noqa: F401  (also named here: the plan's items)
from .ops import ConversionInputError, apply_converter
from .symbolic import Run, Sym, slice_along, stack_along, to_leaf_runs


@dataclass(frozen=True)
class PartitionGroup:
    """The ranks a parameter is partitioned over, and this rank's place in them.

    Today every parameter uses the world; expert parallelism partitions expert parameters over the
    expert-data-parallel group instead, which only changes these fields.
    """

    name: str
    size: int
    rank: int


WORLD = "world"


@dataclass
class TensorPlan:
    """One model parameter or buffer on this rank."""

    name: str
    kind: str  # "param" | "buffer"
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: PartitionGroup | None  # None for buffers: every rank holds them whole
    start: int  # this rank's flat range [start, end) of the logical tensor
    end: int
    partition_numel: int  # length of the local storage (ZeRO-3 pads the last partition)
    status: str  # "load" | "missing" | "mismatched"
    byte_source: str = "file"  # where this rank gets its bytes; "file" = reads them itself
    reads: list[ReadItem] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes_to_read(self) -> int:
        return sum(r.stored_bytes for r in self.reads)


@dataclass
class LoadPlan:
    rank: int
    world_size: int
    tensors: dict[str, TensorPlan]
    missing_keys: set[str]
    unexpected_keys: set[str]
    mismatched_keys: set[tuple[str, tuple, tuple]]
    converted_weight_mapping: list = field(default_factory=list)

    @property
    def bytes_to_read(self) -> int:
        return sum(t.bytes_to_read for t in self.tensors.values())

    def summary(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "tensors": len(self.tensors),
            "bytes_to_read": self.bytes_to_read,
            "read_items": sum(len(t.reads) for t in self.tensors.values()),
            "largest_partition_numel": max((t.partition_numel for t in self.tensors.values()), default=0),
            "missing": len(self.missing_keys),
            "unexpected": len(self.unexpected_keys),
            "mismatched": len(self.mismatched_keys),
        }


class PlainRename:
    """What transformers' `WeightRenaming(original_key, renamed_key)` holds for a key that is only renamed, without
    compiling a regex per checkpoint key (that alone took most of the planning time on a 3,500-key MoE)."""

    def __init__(self, source_key: str, target_key: str):
        self.source_patterns = [source_key]
        self.target_patterns = [target_key]
        self.collected_tensors: dict[str, list] = defaultdict(list)
        self.layer_targets: dict[str, set] = defaultdict(set)


def partition_range(numel: int, group: PartitionGroup) -> tuple[int, int, int]:
    """ZeRO-3's rule: each rank holds ceil(numel / size) elements, rank r the flat range [r*P, (r+1)*P)."""
    per_rank = math.ceil(numel / group.size) if numel else 0
    start = min(group.rank * per_rank, numel)
    return start, min(start + per_rank, numel), per_rank


class _Box:
    """The ReadItem being grown while leaf runs merge into it (made a ReadItem once complete: a MoE partition has
    thousands of runs, and a frozen ReadItem per merge step cost more than the rest of the planning of them)."""

    __slots__ = ("entry", "per_element", "src_offset", "rows", "cols", "row_stride", "dst_offset", "transposed")

    def __init__(self, entry, per_element, src_offset, rows, cols, row_stride, dst_offset):
        self.entry, self.per_element, self.src_offset, self.dst_offset = entry, per_element, src_offset, dst_offset
        self.rows, self.cols, self.row_stride, self.transposed = rows, cols, row_stride, False

    def item(self) -> ReadItem:
        e = self.entry
        return ReadItem(e.file, e.key, e.dtype, self.src_offset, self.rows, self.cols, self.row_stride, self.dst_offset,
                        transposed=self.transposed, stored_bytes_per_element=self.per_element)


def runs_to_read_items(runs: list[Run], checkpoint: Checkpoint, dst_offset: int = 0) -> list[ReadItem]:
    """Merge leaf runs into as few boxes as possible, in destination order: adjacent contiguous runs of a tensor into
    one row, consecutive strided columns of equal height into one transposed box."""
    items: list[ReadItem] = []
    box: _Box | None = None
    key, entry, per_element = None, None, 0.0
    pos = dst_offset
    for sym, start, length, stride in runs:
        if sym.key != key:
            key, entry = sym.key, checkpoint.entry(sym.key)
            per_element = entry.stored_bytes_per_element() if key in checkpoint.computed else 0.0
        if stride == 1:
            rows, cols, row_stride = 1, length, length
        else:  # strided: `length` rows of one element, or a column of a transposed box
            rows, cols, row_stride = length, 1, stride
        dst, pos = pos, pos + length
        if box is not None and box.entry.key == key and box.src_offset + box.cols == start:
            if not box.transposed and box.rows == 1 and rows == 1:  # one longer row
                box.cols = box.row_stride = box.cols + cols
                continue
            if (cols == 1 and rows > 1 and box.rows == rows and box.row_stride == row_stride
                    and (box.transposed or box.cols == 1)):  # the next column of a transposed box
                box.cols, box.transposed = box.cols + 1, True
                continue
        if box is not None:
            items.append(box.item())
        box = _Box(entry, per_element, start, rows, cols, row_stride, dst)
    if box is not None:
        items.append(box.item())
    return items


def dtype_policy(dtype_plan: dict):
    if not dtype_plan:
        return lambda key: None
    alternation, by_group, _ = build_glob_alternation(list(dtype_plan.keys()))

    def policy(key: str):
        match = alternation.search(key)
        return dtype_plan[by_group[match.lastgroup]] if match else None

    return policy


@dataclass
class Resolution:
    """transformers' key grouping applied to a checkpoint, in the names of the model transformers built:
    for each model tensor the checkpoint provides, the symbolic converted tensor and its target dtype."""

    converted: dict[str, tuple[Sym, torch.dtype]]
    unexpected_keys: set[str]
    mismatched_keys: set[tuple[str, tuple, tuple]]
    used_mapping: list
    inputs: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # target -> source pattern -> keys
    # checkpoint key -> its leading elements the model holds: the rest is padding a conversion drops when loading
    # and whose reverse writes zeros when saving (Inkling2's padded unembedding)
    zero_padded: dict[str, int] = field(default_factory=dict)

    def fingerprint(self) -> str:
        """Which checkpoint keys load into which model tensor, in which dtype, and what is left over: ranks that
        resolve the same files differently (another `key_mapping`, another transformers) would fill one tensor's
        partitions from different keys."""
        dtypes = {target: str(dtype) for target, (_, dtype) in self.converted.items()}
        return digest([self.inputs, dtypes, sorted(self.unexpected_keys), sorted(map(str, self.mismatched_keys))])


@dataclass(frozen=True)
class SourceBox:
    """A model tensor made of a box of a converted tensor: `source`, sliced by (dim, start, count) in turn; or, with
    `stacked`, of several converted tensors stacked along a new first dim, then boxed.

    Identity (no box) for most tensors; expert parallelism maps each rank's local experts this way: a slice of
    fused experts, or the stack of per-expert modules' weights (`source` is then the first of them).
    """

    source: str
    box: tuple[tuple[int, int, int], ...] = ()
    stacked: tuple[str, ...] = ()

    @classmethod
    def stack(cls, sources: list[str], box: tuple[tuple[int, int, int], ...] = ()) -> "SourceBox":
        return cls(sources[0], box, tuple(sources))

    @property
    def members(self) -> tuple[str, ...]:
        """The converted tensors this is made of."""
        return self.stacked or (self.source,)

    def describe(self) -> str:
        return self.source if not self.stacked else f"{self.stacked[0]} ... {self.stacked[-1]} (stacked)"

    def resolved_in(self, converted: dict) -> bool:
        return all(m in converted for m in self.members)

    def resolve(self, converted: dict[str, tuple[Sym, torch.dtype]]) -> tuple[Sym, torch.dtype]:
        """This tensor's symbolic form and dtype, from the resolution's converted tensors."""
        parts = [converted[m] for m in self.members]
        sym, dtype = parts[0]
        if self.stacked:
            if len({s.shape for s, _ in parts}) > 1 or len({d for _, d in parts}) > 1:
                raise CheckpointError(f"{self.describe()}: the tensors stacked into one differ in shape or dtype: "
                                      f"{sorted({(tuple(s.shape), str(d)) for s, d in parts})}")
            sym = stack_along([s for s, _ in parts], 0)
        for dim, start, count in self.box:
            sym = slice_along(sym, dim, start, count)
        return sym, dtype


def _natural_key_by_parts() -> Callable[[str], list]:
    """transformers' `dot_natural_key` (the order it collects a merge's tensors in), computed once per distinct
    dot-separated part: it maps each part on its own (5.23), and a checkpoint's 14k keys share a few hundred parts,
    so sorting them costs a third of calling it per key."""
    cache: dict[str, tuple] = {}

    def part_key(part: str) -> tuple:
        if part not in cache:
            (cache[part],) = dot_natural_key(part)
        return cache[part]

    return lambda key: [part_key(part) for part in key.split(".")]


def resolve_checkpoint(model: torch.nn.Module, checkpoint: Checkpoint, weight_mapping: list, dtype_plan: dict) -> Resolution:
    """Group checkpoint keys as transformers does and evaluate every converter symbolically (no data read).
    `model` is the meta skeleton transformers built, untied."""
    meta_state = model.state_dict()
    prefix = model.base_model_prefix
    renamings = [e for e in weight_mapping if isinstance(e, WeightRenaming)]
    converters = [e for e in weight_mapping if isinstance(e, WeightConverter)]
    pattern_to_converter = {k: c for c in converters for k in c.source_patterns}
    policy = dtype_policy(dtype_plan)

    unexpected: set[str] = set()
    to_load: dict[str, WeightTransform] = {}
    target_dtype: dict[str, torch.dtype] = {}
    for original_key in sorted(checkpoint.entries, key=_natural_key_by_parts()):
        entry = checkpoint.entries[original_key]
        renamed, source_pattern = rename_source_key(original_key, renamings, converters, prefix, meta_state)
        if renamed not in meta_state and original_key in meta_state:
            renamed, source_pattern = rename_source_key(original_key, [], [], prefix, meta_state)
        if renamed in meta_state:
            if renamed not in to_load:  # each target gets its own converter (copied once, not per key)
                to_load[renamed] = (deepcopy(pattern_to_converter[source_pattern]) if source_pattern is not None
                                    else PlainRename(original_key, renamed))
            mapping = to_load[renamed]
            source_pattern = source_pattern if source_pattern is not None else original_key
            # same rule as transformers: the dtype plan wins, else the model tensor's own dtype
            planned = policy(renamed)
            target_dtype[renamed] = planned if planned is not None else meta_state[renamed].dtype
            mapping.collected_tensors[source_pattern].append(Sym(entry.shape, key=original_key))
            mapping.layer_targets[renamed].add(original_key)
        elif source_pattern is not None:
            converter = pattern_to_converter[source_pattern]
            for k in converter.target_patterns:
                unexpected.add(renamed.replace(converter.target_patterns[0], k))
        else:
            unexpected.add(renamed)
    used = [c for c in weight_mapping if c.was_used()]
    _refuse_weights_that_are_not_tensors(checkpoint, renamings, converters, prefix, meta_state)

    ctx = {
        "config": model.config,
        "model_type": getattr(model.config, "model_type", type(model).__name__),
        "shape_of": lambda name: tuple(model.get_parameter(name).shape),
        "dtype_of": lambda name: meta_state[name].dtype if name in meta_state else None,
        "entry": lambda key: checkpoint.entries[key],
        "computed": {},  # dequantize rules register the tensors they compute (dequantize.Computation)
        "zero_padded": {},  # rules whose reverse pads with zeros register the elements they keep
    }
    converted: dict[str, tuple[Sym, torch.dtype]] = {}
    mismatched: set[tuple[str, tuple, tuple]] = set()
    inputs: dict[str, dict[str, list[str]]] = {}
    failed: list[tuple[str, dict[str, list[str]], str]] = []
    for first_name, mapping in to_load.items():
        keys = {pattern: [t.key for t in syms] for pattern, syms in mapping.collected_tensors.items()}
        try:
            converted_syms = apply_converter(mapping, first_name, ctx)
        except ConversionInputError as e:  # transformers' own load fails on these inputs too
            absent = [p for p in getattr(mapping, "source_patterns", ()) if not mapping.collected_tensors.get(p)]
            failed.append((first_name, {**keys, **dict.fromkeys(absent, [])}, str(e)))
            continue
        for target, sym in converted_syms.items():
            inputs[target] = keys
            sym = sym[0] if isinstance(sym, list) else sym
            if target not in meta_state:
                unexpected.add(target)
            elif tuple(sym.shape) != tuple(meta_state[target].shape):
                mismatched.add((target, torch.Size(sym.shape), meta_state[target].shape))
            else:
                converted[target] = (sym, target_dtype.get(first_name, meta_state[target].dtype))
    if failed:
        _refuse_failed_conversions(failed, meta_state)
    for key, computation in ctx["computed"].items():
        checkpoint.computed[key] = computation.resolve(checkpoint.entries)
    return Resolution(converted, unexpected, mismatched, used, inputs, ctx["zero_padded"])


def _refuse_weights_that_are_not_tensors(checkpoint: Checkpoint, renamings, converters, prefix, meta_state) -> None:
    """Values of a pickle or state dict that are not tensors are skipped, as transformers skips them; but one under a
    key the model loads (a list saved in a weight's place) fails a plain load, and skipping it would initialise that
    weight at random. Checked after `used` is taken: renaming these keys marks the mapping's entries as used."""
    held = []
    for key, what in sorted(checkpoint.not_tensors.items()):
        renamed, _ = rename_source_key(key, renamings, converters, prefix, meta_state)
        if renamed in meta_state or key in meta_state:
            held.append(f"  {key}: {what}" + (f" (the model's {renamed})" if renamed != key else ""))
    if held:
        raise CheckpointError(f"{len(held)} weights the model loads are not tensors in the checkpoint (a plain load "
                              "fails on them too):\n" + "\n".join(held[:8]) + (" ..." if len(held) > 8 else ""))


def _refuse_failed_conversions(failed: list[tuple[str, dict[str, list[str]], str]], meta_state: dict) -> None:
    """Targets whose checkpoint tensors a conversion op refuses (e.g. fused experts with some experts' tensors
    absent: the concatenation of unequal stacks). A plain load fails on them too ("issues during automatic
    conversion"), whatever `ignore_mismatched_sizes` says; name each target, the numbered tensors it lacks (or the
    source patterns none of its tensors match) and the op's complaint."""
    lines = []
    for target, keys, message in failed[:8]:
        shape = tuple(meta_state[target].shape) if target in meta_state else ()
        missing = missing_inputs(keys, shape)
        lacks = f" lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''};" if missing else ""
        absent = [pattern for pattern, k in keys.items() if not k]
        lacks += f" no checkpoint tensor matches {', '.join(absent)};" if absent else ""
        lines.append(f"  {target}:{lacks} {message}")
    raise CheckpointError(
        f"{len(failed)} parameters cannot be converted from this checkpoint's tensors (transformers' conversion "
        "refuses them too: a shard or an index entry missing, or a checkpoint of another layout?):\n"
        + "\n".join(lines))


def missing_inputs(inputs: dict[str, list[str]], model_shape: tuple) -> list[str]:
    """Checkpoint keys a target lacks, from its checkpoint keys by source pattern (`Resolution.inputs[target]`): the
    numbered tensors (`experts.*.w1`, ...) a merge expects `model_shape[0]` of, that the checkpoint does not hold."""
    missing = []
    for pattern, keys in inputs.items():
        parts = pattern.split(".")
        if "*" not in parts or not keys or not model_shape:
            continue
        position = len(keys[0].split(".")) - (len(parts) - parts.index("*"))
        present = {int(k.split(".")[position]) for k in keys if k.split(".")[position].isdigit()}
        template = keys[0].split(".")
        for index in range(model_shape[0]):
            if index not in present:
                template[position] = str(index)
                missing.append(".".join(template))
    return missing


def model_tensors(model: torch.nn.Module) -> list[tuple[list[str], bool, tuple[int, ...], torch.dtype]]:
    """(names, is_param, logical shape, dtype) of each distinct tensor of `model`'s state dict, in state-dict order.
    A meta skeleton, or a live ZeRO-3 model: a partitioned parameter shows its logical shape (`ds_shape`) and the
    dtype of its partition."""
    params = {id(p) for p in model.parameters()}
    by_id: dict[int, tuple[list[str], bool, tuple[int, ...], torch.dtype]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in by_id:
            by_id[id(tensor)][0].append(name)
            continue
        shape = tuple(tensor.ds_shape) if hasattr(tensor, "ds_shape") else tuple(tensor.shape)
        dtype = tensor.ds_tensor.dtype if getattr(tensor, "ds_tensor", None) is not None else tensor.dtype
        by_id[id(tensor)] = ([name], id(tensor) in params, shape, dtype)
    return list(by_id.values())


def plan_tensors(
    model: torch.nn.Module,
    resolution: Resolution,
    checkpoint: Checkpoint,
    group_of: Callable[[str], PartitionGroup],
    rank: int,
    world_size: int,
    sources: dict[str, SourceBox] | None = None,
) -> LoadPlan:
    """This rank's plan for every tensor of `model`'s state dict (each tensor once, under its first name).
    `sources` maps a tensor to a box of another resolved tensor when the model was reshaped after resolution."""
    mismatched_names = {m[0] for m in resolution.mismatched_keys}
    tensors: dict[str, TensorPlan] = {}
    source_of = lambda name: (sources or {}).get(name) or SourceBox(name)  # noqa: E731
    for names, is_param, shape, own_dtype in model_tensors(model):
        # aliases (tied weights, AutoEP's router under the transformers name): planned once, under a name the
        # resolution provides if one does
        name = next((n for n in names if source_of(n).resolved_in(resolution.converted)), names[0])
        source = source_of(name)
        group = group_of(name) if is_param else None
        numel = math.prod(shape)
        start, end, per_rank = partition_range(numel, group) if is_param else (0, numel, numel)
        if source.resolved_in(resolution.converted):
            (sym, dtype), status = source.resolve(resolution.converted), "load"
            if tuple(sym.shape) != shape:
                raise LoaderError(f"internal planning error for {name}: source {sym.shape} vs model {shape}")
        else:
            sym, dtype = None, own_dtype
            status = "mismatched" if any(m in mismatched_names for m in source.members) else "missing"
        plan = TensorPlan(name=name, kind="param" if is_param else "buffer", shape=shape, dtype=dtype, group=group,
                          start=start, end=end, partition_numel=per_rank, status=status)
        if sym is not None:
            plan.reads = runs_to_read_items(to_leaf_runs(sym, start, end - start), checkpoint)
        tensors[name] = plan

    missing = {n for n, t in tensors.items() if t.status == "missing"}
    return LoadPlan(rank, world_size, tensors, missing, resolution.unexpected_keys, resolution.mismatched_keys,
                    resolution.used_mapping)


def build_plan(
    model: torch.nn.Module,
    checkpoint: Checkpoint,
    weight_mapping: list,
    dtype: torch.dtype,
    dtype_plan: dict,
    group_of: Callable[[str], PartitionGroup],
    rank: int,
    world_size: int,
) -> LoadPlan:
    """Plan this rank's reads. `model` is the meta skeleton, untied; `group_of(name)` gives a param's group."""
    resolution = resolve_checkpoint(model, checkpoint, weight_mapping, dtype_plan)
    return plan_tensors(model, resolution, checkpoint, group_of, rank, world_size)


def check_plan_is_exact(plan: LoadPlan) -> None:
    """Every loaded tensor's reads cover exactly its partition, in order (a cheap invariant, always checked)."""
    for t in plan.tensors.values():
        if t.status != "load":
            continue
        covered = sum(r.numel for r in t.reads)
        if covered != t.end - t.start:
            raise LoaderError(f"internal planning error for {t.name}: {covered} elements for range {t.start}:{t.end}")


def suspicious_missing_keys(plan: LoadPlan, body: str = "") -> list[tuple[str, list[str]]]:
    """Missing parameters next to unexpected checkpoint keys that look like them: a conversion that broke.

    A missing key and an unexpected key "look alike" when
    - they share every module component but the last two of the missing key (and at least two):
      `layers.0.mlp.experts.gate_up_proj` missing beside `layers.0.mlp.experts.0.w1.weight` unexpected; or
    - they are the same key once every `model` wrapper component is dropped: `model.language_model.norm.weight`
      missing beside `model.model.language_model.model.norm.weight` (a prefix the loader does not map; shieldgemma2
      as transformers 5.23 saves it); or
    - the missing key is under the model's `body` (its `base_model_prefix`) and the unexpected one is the same key
      under another first component: `transformer.layers.0.mlp.gate.weight` missing beside
      `model.layers.0.mlp.gate.weight` (Llama's or Qwen3-MoE's question-answering head, whose body is `transformer`,
      from its causal LM's checkpoint: transformers 5.24 maps neither name to the other, and initialises the whole
      body at random).
    A new head (`score.weight` beside `lm_head.weight`, `classifier.dense.weight` beside `lm_head.dense.weight`)
    does not.
    """
    unexpected = [u.split(".") for u in sorted(plan.unexpected_keys)]
    unwrapped: dict[tuple, list[str]] = {}
    under_another_body: dict[tuple, list[str]] = {}
    for u in unexpected:
        unwrapped.setdefault(_without_wrappers(u), []).append(".".join(u))
        if len(u) >= 3 and u[0] != body:
            under_another_body.setdefault(tuple(u[1:]), []).append(".".join(u))
    found = []
    for key in sorted(plan.missing_keys):
        if plan.tensors[key].kind != "param":
            continue
        parts = key.split(".")
        need = max(2, len(parts) - 2)
        alike = [".".join(u) for u in unexpected if len(u) >= need and u[:need] == parts[:need]]
        alike += [u for u in unwrapped.get(_without_wrappers(parts), []) if u not in alike]
        if body and len(parts) >= 3 and parts[0] == body:
            alike += [u for u in under_another_body.get(tuple(parts[1:]), []) if u not in alike]
        if alike:
            found.append((key, alike))
    return found


def checkpoint_bodies(suspicious: list[tuple[str, list[str]]], body: str) -> list[str]:
    """The names the checkpoint gives the model's `body` among `suspicious_missing_keys(plan, body)` (its third
    rule: `model` for a `transformer.layers.0...` missing beside `model.layers.0...`); [] if no pair is of that kind."""
    if not body:
        return []
    return sorted({u.split(".", 1)[0] for m, alike in suspicious if m.startswith(body + ".")
                   for u in alike if u.split(".", 1)[-1] == m.split(".", 1)[1]})


def _without_wrappers(parts: list[str]) -> tuple:
    return tuple(p for p in parts if p != "model")
