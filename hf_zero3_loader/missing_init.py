"""Initialise missing weights in chunks bounded by a byte budget, with the plain load's exact values.

transformers initialises missing keys by walking modules in `smart_apply` order and calling the owning
model's `_initialize_weights` on each; under ZeRO-3 it gathers *every* uninitialised parameter at once.
We walk the same modules in the same order (so rank 0 consumes its RNG stream exactly as a plain
single-process load does) but gather only the uninitialised parameters of consecutive modules up to
`budget_bytes` at a time; `GatheredParameters(modifier_rank=0)` then broadcasts rank 0's values and
re-partitions. At no moment is more than max(budget, largest missing parameter) gathered, except for a module
whose init draws random numbers outside transformers' init functions (Mamba's mixer): its missing params are
gathered together, since initialising them one at a time would draw those numbers once per param; and a module whose
init fills a slice of a *loaded* param outside the guarded init functions (a padding row zeroed on every load, as
Funnel's, Chinese-CLIP's, Youtu's and BLT's inits do): that param is gathered to replay the write the plain load keeps.
A missing tensor that no init writes at all is found by `UnwrittenWatch`, zeroed and named.
Partitions on an accelerator are initialised in host memory (`on_host`) and copied back, and the partitioned params an
init sees are host stand-ins: a plain load initialises on the CPU, and the same init on a GPU draws other numbers
(CUDA's generator) from other kernels.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from . import _deepspeed_private as ds_private
from . import _transformers_private as hf_private
from . import log
from .errors import LoaderError

DEFAULT_BUDGET_BYTES = 1 << 30


@dataclass
class InitStats:
    gathers: list[int] = field(default_factory=list)  # bytes gathered by each GatheredParameters
    left_by_init: list[str] = field(default_factory=list)  # missing tensors no init wrote: zeros, not the plain load's garbage

    @property
    def peak_gathered_bytes(self) -> int:
        return max(self.gathers, default=0)


def _needs_gather(param) -> bool:
    return hasattr(param, "ds_id") and not hf_private.is_initialized(param)


def _nbytes(param) -> int:
    return param.ds_numel * param.dtype.itemsize


def materialize_meta_buffers(model: torch.nn.Module, device: torch.device) -> list[tuple[str, torch.nn.Module, str]]:
    """Buffers not loaded (non-persistent ones such as RoPE `inv_freq`) get real storage; init computes them. Float
    ones hold NaN until then (see `UnwrittenWatch`), others zeros: a buffer the model's init leaves alone (Apertus'
    xIELU `beta` and `eps` when missing) must hold the same value on every rank, where a plain load leaves
    uninitialised memory. Returns the float ones: (full name, module, name)."""
    marked = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        # setattr on a registered buffer's name replaces the buffer (persistent or not, as it was)
        for name, buf in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if buf.is_meta:
                if buf.dtype in UnwrittenWatch.FLOAT_DTYPES:
                    setattr(module, name, torch.full_like(buf, float("nan"), device=device))
                    marked.append((f"{prefix}.{name}" if prefix else name, module, name))
                else:
                    setattr(module, name, torch.zeros_like(buf, device=device))
    return marked


@dataclass
class InitTouches:
    """What `owner._init_weights(module)` does, learned from a dry run."""

    params: list  # missing ZeRO-3 params it initialises (its own and its children's), in order
    draws_outside: bool  # it also draws random numbers outside transformers' init functions (Mamba's `torch.rand`)


def _init_touches(module, owner) -> InitTouches | None:
    """A dry run of `owner._init_weights(module)` with recording stand-ins for the init functions, under a forked RNG:
    nothing is written or drawn. None if it cannot run that way."""
    recorded: list = []
    devices = _rng_devices()
    try:
        subtree = [(m, owner) for m in module.modules()]
        with torch.random.fork_rng(devices=devices), logical_shapes(subtree) as stand_ins, \
                stand_ins.contiguous_weight(module):
            before = _rng_states(devices)
            with hf_private.recording_init_functions(recorded.append):
                hf_private.init_weights(owner, module)
            after = _rng_states(devices)
    except Exception:
        return None
    params = _distinct([t for t in recorded if isinstance(t, torch.nn.Parameter) and _needs_gather(t)])
    return InitTouches(params, any(not torch.equal(a, b) for a, b in zip(before, after)))


def _rng_devices() -> list:
    """The CUDA device whose generator an init may draw from (forked with the CPU's), if CUDA is in use."""
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def _rng_states(devices: list) -> list:
    return [torch.random.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]


def _distinct(params: list) -> list:
    """`params` without repeats (by identity), in order."""
    seen: set[int] = set()
    return [p for p in params if not (id(p) in seen or seen.add(id(p)))]


def _modules_with_missing_params(model) -> set[int]:
    """ids of the modules that hold a missing param themselves or in a descendant: only their init can touch one."""
    names = {name for name, p in model.named_parameters(remove_duplicate=False) if _needs_gather(p)}
    prefixes = {".".join(n.split(".")[:i]) for n in names for i in range(n.count(".") + 1)}
    return {id(m) for name, m in model.named_modules(remove_duplicate=False) if name in prefixes}


def _plan_chunks(model, budget_bytes: int):
    """Steps of (modules with owner, params to gather, None or (the param to init alone, the module's others)), in
    `smart_apply` order.

    When everything missing fits the budget, one step gathers it all. Otherwise each module's step gathers what its
    init touches, learned by a dry run: its own missing params, and its children's that it initialises again (GPT-2's
    attention re-draws `c_proj.weight` after the Conv1D did; Mamba's mixer initialises `conv1d` and `dt_proj`).
    """
    order = hf_private.init_module_order(model)
    todo = [(m, o) for m, o in order if not getattr(m, "_is_hf_initialized", False)]
    everything, seen = [], set()
    for module, _ in todo:
        for p in module.parameters(recurse=False):
            if _needs_gather(p) and id(p) not in seen:
                everything.append(p)
                seen.add(id(p))
    if sum(_nbytes(p) for p in everything) <= budget_bytes:
        return [(todo, everything, None)] if todo else []

    holds_missing = _modules_with_missing_params(model)
    steps, modules, params, in_chunk, size, seen = [], [], [], set(), 0, set()

    def flush():
        nonlocal modules, params, in_chunk, size
        if modules:
            steps.append((modules, params, None))
        modules, params, in_chunk, size = [], [], set(), 0

    for module, owner in todo:
        own = [p for p in module.parameters(recurse=False) if _needs_gather(p) and id(p) not in seen]
        seen.update(id(p) for p in own)
        touches = _init_touches(module, owner) if id(module) in holds_missing else None
        if touches is not None:
            extra = touches.params
        else:  # no dry run possible: whatever in its subtree is still missing, as transformers' inits touch no more
            extra = [p for p in module.parameters() if _needs_gather(p)] if id(module) in holds_missing else []
            if extra:
                log.debug("missing-key init: no dry run of %s._init_weights(%s); gathering its subtree's %d missing "
                          "params together", type(owner).__name__, type(module).__name__, len(extra))
        needed = _distinct(own + extra)
        needed_bytes = sum(_nbytes(p) for p in needed)
        if needed_bytes > budget_bytes and len(needed) > 1 and touches is not None and not touches.draws_outside:
            # one parameter at a time, in the order the module initialises them: the same draws as all at once
            flush()
            ordered = _distinct(touches.params + needed)
            for p in ordered:
                steps.append(([(module, owner)], [p], (p, ordered)))
            hf_private.mark_initialized(module)
            continue
        if params and size + needed_bytes > budget_bytes:
            flush()
        modules.append((module, owner))
        for p in needed:
            if id(p) not in in_chunk:
                in_chunk.add(id(p))
                params.append(p)
                size += _nbytes(p)
    flush()
    return steps


# The one value every stand-in holds (exact in bf16, fp16 and fp32): a fill or zero written into a stand-in, or into a
# slice of it, changes it; no init writes exactly this.
SENTINEL = -(2.0 ** -15)


class StandIns:
    """Partitioned params of the modules being initialised, shown with their logical shape (see `logical_shapes`), in
    host memory whatever device holds their partitions. All stand-ins of one dtype are views of one element holding
    SENTINEL, so `written()` tells, in one comparison per dtype, whether an init has filled any of them (which the
    expanded view allows, unlike other in-place ops).

    Except a convolution's weight while the convolution's own init runs (`contiguous_weight`): torch's
    `_ConvNd.reset_parameters` (DAC's and X-Codec's init of their transposed convolutions) draws into a temporary and
    copies it over a weight that is not contiguous, where a loaded one, being contiguous, is skipped by the guarded
    init function (nothing drawn). There it stands in as a real contiguous tensor of SENTINEL, one at a time."""

    def __init__(self):
        self.swapped: dict[int, tuple] = {}  # id(param) -> (param, its real data)
        self.cells: dict[torch.dtype, torch.Tensor] = {}
        self.contiguous: dict[int, torch.Tensor] = {}  # id(param) -> its own stand-in, while its module's init runs

    def swap(self, param) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        if id(param) in self.swapped or getattr(param, "ds_status", None) != ZeroParamStatus.NOT_AVAILABLE:
            return
        self.swapped[id(param)] = (param, param.data)
        param.data = self.stand_in(param)

    def stand_in(self, param) -> torch.Tensor:
        cell = self.cells.get(param.dtype)
        if cell is None:  # on the host, as the missing params being initialised (`on_host`) and the plain load's are:
            # a draw an init places by a param (`torch.empty(n, device=module.A_log.device).uniform_()`) takes the CPU
            # generator there too, and the draws after it stay the plain load's
            cell = self.cells[param.dtype] = torch.full((), SENTINEL, dtype=param.dtype)
        return cell.expand(param.ds_shape)

    @contextmanager
    def contiguous_weight(self, module):
        """While `module`'s own init runs (and `written` checks it): a convolution's loaded weight as a contiguous
        tensor of SENTINEL."""
        param = (dict(module.named_parameters(recurse=False, remove_duplicate=False)).get("weight")
                 if ds_private.is_torch_convolution(module) else None)
        if param is None or id(param) not in self.swapped:
            yield
            return
        param.data = self.contiguous[id(param)] = torch.full(param.ds_shape, SENTINEL, dtype=param.dtype)
        try:
            yield
        finally:
            del self.contiguous[id(param)]
            param.data = self.stand_in(param)

    def written(self) -> bool:
        """Whether an init wrote into a stand-in since the last call (and re-arm)."""
        hit = False
        for cell in (*self.cells.values(), *self.contiguous.values()):
            if cell.ne(SENTINEL).any():
                hit = True
                cell.fill_(SENTINEL)
        return hit

    def loaded_params_under(self, module) -> list:
        return [p for p in module.parameters() if id(p) in self.swapped and getattr(p, "_is_hf_initialized", False)]

    def restore(self) -> None:
        for param, data in self.swapped.values():
            param.data = data
        self.swapped.clear()


@contextmanager
def logical_shapes(modules):
    """While `_init_weights` runs on these modules, their partitioned (not gathered) params, and their descendants',
    show their logical shape: an init that reads `weight.shape` before its guarded write (RoFormer's sinusoidal
    positions, RWKV) sees what a plain load shows. The stand-in is one element expanded, so a write into it fails
    loudly (random draws, copies, arithmetic) or is seen by `StandIns.written` (fills); for a convolution's own init,
    see `StandIns.contiguous_weight`."""
    stand_ins = StandIns()
    listed = {id(module) for module, _ in modules}
    for module, _ in modules:
        for p in module.parameters(recurse=False):
            stand_ins.swap(p)
        for child in module.children():  # a subtree initialised in another step (or not at all) is reachable too
            if id(child) not in listed:
                for p in child.parameters():
                    stand_ins.swap(p)
    try:
        yield stand_ins
    finally:
        stand_ins.restore()


def _replay_writes_into_loaded(module, owner, stand_ins: StandIns, stats: InitStats) -> None:
    """`owner._init_weights(module)` filled a slice of a loaded parameter outside transformers' guarded init functions
    (Funnel's and Chinese-CLIP's embeddings, Youtu's and BLT's: `init.zeros_(weight[padding_idx])`, a slice that has
    lost the loaded flag). A plain load keeps that write, so it is replayed: the loaded parameters under the module
    gathered for real, every tensor under it flagged as initialised so the guarded functions skip it (and draw
    nothing), random draws outside them forked away. Only writes that bypass the guard land."""
    loaded = stand_ins.loaded_params_under(module)
    if not loaded:
        return
    flagged = [t for t in (*module.parameters(), *module.buffers()) if not hf_private.is_initialized(t)]
    for t in flagged:
        hf_private.mark_initialized(t)
    cells = [stand_ins.swapped[id(p)] for p in loaded]
    stats.gathers.append(sum(_nbytes(p) for p in loaded))
    for p, data in cells:  # the real (empty) local data, for DeepSpeed to gather into
        p.data = data
    devices = _rng_devices()
    try:
        with ds_private.gathered_to_modify(loaded), torch.random.fork_rng(devices=devices):
            hf_private.init_weights(owner, module)
    finally:
        for t in flagged:
            hf_private.unmark_initialized(t)
        for p, _ in cells:  # back to the stand-in for the rest of this step
            p.data = stand_ins.stand_in(p)
    log.debug("missing-key init: %s._init_weights(%s) writes into loaded %s outside the guarded init functions; "
              "replayed as a plain load keeps it", type(owner).__name__, type(module).__name__,
              ", ".join(str(tuple(p.ds_shape)) for p in loaded))


@contextmanager
def _explained_in_place_writes(model, module, owner):
    """A loaded parameter stands in for itself with its logical shape but no data (`logical_shapes`); an init that
    writes into it in place, outside transformers' guarded init functions, fails there. Say why, on every rank."""
    try:
        yield
    except RuntimeError as e:
        if "written-to tensor refers to a single memory location" not in str(e):
            raise
        name = next((n for n, m in model.named_modules() if m is module), "?")
        raise LoaderError(
            f"{type(owner).__name__}._init_weights({name or 'the model'}: {type(module).__name__}) writes in place, "
            "outside transformers' init functions, into a parameter the checkpoint loaded. A plain from_pretrained "
            "changes that loaded value (for example Mamba with `rescale_prenorm_residual=True` divides every loaded "
            "out_proj.weight on every load); hf_zero3_loader refuses to. Turn off the config option behind that "
            "init.") from e


class UnwrittenWatch:
    """Missing params and buffers the model's init never writes. A plain load leaves `torch.empty` memory in them
    (transformers 5.23's Qwen3-Omni-MoE never initialises its talker's experts, Apertus its xIELU scalars), which no
    sharded load can reproduce and no rank should train from. Each missing float param is filled with NaN when first
    gathered, before any init sees it (buffers when materialised); what still holds NaN once the steps that gather it
    are done was never written. Those elements become zeros, named in a warning."""

    FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    PIECE = 1 << 24  # elements per NaN check: the bool temporary stays small whatever the param's size

    def __init__(self):
        self.marked: set[int] = set()  # params filled with NaN, ever
        self.pending: dict[int, object] = {}  # id -> param: still NaN (somewhere) after its last step

    def mark(self, params) -> None:
        """Fill the params not seen before with NaN (inside the gather: the full tensor, on every rank)."""
        for p in params:
            if id(p) not in self.marked and p.dtype in self.FLOAT_DTYPES:
                self.marked.add(id(p))
                p.data.fill_(float("nan"))

    def check(self, params) -> None:
        """After a step: which of its marked params still hold NaN (a later step may write them yet)."""
        for p in params:
            if id(p) in self.marked:
                if self._has_nan(p.data):
                    self.pending[id(p)] = p
                else:
                    self.pending.pop(id(p), None)

    @classmethod
    def _has_nan(cls, data) -> bool:
        if data.numel() == 0 or not bool(data.sum().isnan()):  # one fast pass; NaN anywhere makes the sum NaN
            return False
        flat = data.reshape(-1)  # confirm (+inf and -inf written by an init also sum to NaN)
        return any(bool(flat[i:i + cls.PIECE].isnan().any()) for i in range(0, flat.numel(), cls.PIECE))

    @classmethod
    def _zero_nan(cls, data) -> None:
        flat = data.reshape(-1)
        for i in range(0, flat.numel(), cls.PIECE):
            piece = flat[i:i + cls.PIECE]
            piece.masked_fill_(piece.isnan(), 0)

    def zero_unwritten(self, model, stats: InitStats, marked_buffers=()) -> None:
        """Zero the NaN left in pending params and in buffers no init computed, and say which they are, on every rank.
        Each rank zeroes its own partition: the NaN elements are exactly the unwritten ones, so nothing is gathered."""
        for p in self.pending.values():
            self._zero_nan(ds_private.zero3_partition(p).tensor)
        names = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in self.pending]
        for name, module, key in marked_buffers:  # whole on every rank: no gather
            buf = dict(module.named_buffers(recurse=False, remove_duplicate=False)).get(key)
            if buf is not None and buf.dtype in self.FLOAT_DTYPES and self._has_nan(buf):
                self._zero_nan(buf)
                names.append(name)
        if not names:
            return
        stats.left_by_init = names
        log.warning_once(
            "left_by_init:" + ",".join(names), "%d missing tensor(s) are not initialised by %s's own init, so a plain "
            "from_pretrained leaves uninitialised memory in them; hf_zero3_loader sets them to zeros instead (the same "
            "on every rank): %s%s. Load a checkpoint that has them, or initialise them yourself before training.",
            len(names), type(model).__name__, ", ".join(names[:8]), f" and {len(names) - 8} more" if len(names) > 8 else "")


@contextmanager
def on_host(params):
    """While init runs, gathered params on an accelerator hold host memory, copied into their device data after: the
    plain load's CPU generator and kernels give the values (bit-exact), and the host holds one step's gather at most."""
    moved = [(p, p.data) for p in params if p.data.device.type != "cpu"]
    for p, data in moved:
        p.data = torch.empty(data.shape, dtype=data.dtype)
    try:
        yield
    finally:
        for p, data in moved:
            data.copy_(p.data)
            p.data = data


def _run_init_step(model, modules, alone, stand_ins, stats: InitStats, is_custom_code: bool) -> None:
    if alone is not None:  # the module's other missing params are skipped by the guarded init
        (module, owner), (alone, group) = modules[0], alone
        others = [p for p in group if p is not alone]
        for p in others:
            hf_private.mark_initialized(p)
        try:
            with _explained_in_place_writes(model, module, owner), stand_ins.contiguous_weight(module):
                hf_private.init_weights(owner, module)
                written = stand_ins.written()
        finally:
            for p in others:
                hf_private.unmark_initialized(p)
        if written:
            _replay_writes_into_loaded(module, owner, stand_ins, stats)
        return
    for module, owner in modules:
        with _explained_in_place_writes(model, module, owner), stand_ins.contiguous_weight(module):
            hf_private.initialize_weights(owner, module, is_custom_code)
            written = stand_ins.written()
        if written:
            _replay_writes_into_loaded(module, owner, stand_ins, stats)


def initialize_missing(model, budget_bytes: int = DEFAULT_BUDGET_BYTES, stats: InitStats | None = None,
                       marked_buffers=()) -> InitStats:
    """Initialise the missing params in bounded steps; `marked_buffers` are the NaN-filled buffers of
    `materialize_meta_buffers`, checked (and zeroed where no init computed them) with the params."""
    stats = stats or InitStats()
    is_custom_code = model.is_custom_code()
    unwritten = UnwrittenWatch()
    with torch.no_grad(), hf_private.guarded_init_functions():
        for modules, params, alone in _plan_chunks(model, budget_bytes):
            gather = ds_private.gathered_to_modify(params) if params else nullcontext()
            if params:
                stats.gathers.append(sum(_nbytes(p) for p in params))
            with gather, on_host(params), logical_shapes(modules) as stand_ins:
                unwritten.mark(params)
                _run_init_step(model, modules, alone, stand_ins, stats, is_custom_code)
                unwritten.check(params)
        unwritten.zero_unwritten(model, stats, marked_buffers)
    return stats
