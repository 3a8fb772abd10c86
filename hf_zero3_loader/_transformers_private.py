"""Every touch of transformers' private API, in one place. Written against transformers 5.23; checked against 5.24
(the same private API; 5.24 adds conversion ops, whose rules are in `planner/ops.py`).

- `integrations.deepspeed._hf_deepspeed_config_weak_ref`: hidden while we build the model, so
  `from_pretrained` builds a meta skeleton instead of entering `zero.Init`.
- `PreTrainedModel._load_pretrained_model` / `_finalize_model_loading` (staticmethods): replaced for the
  duration of one call, so transformers still resolves files, config, dtype, the conversion mapping and
  generation config, and we only replace how bytes reach the parameters and how missing keys are set. A second
  `_load_pretrained_model` call in that window is `load_adapter`'s (PEFT adapter folders): it goes to the original.
- `modeling_utils._tied_params_are_equal`: made ZeRO-3 aware (it compares `(0,)` placeholders otherwise).
- `modeling_utils.safe_save_file` / `split_torch_state_dict_into_shards` (the names `save_pretrained` calls): replaced
  while `save_pretrained` runs on a meta skeleton, so transformers decides every file of a save (keys after reverting
  the conversions, dtypes, shard split, index, config) and we write the tensor bytes (`saving.py`); the skeleton's
  `should_save_on_this_rank` (transformers' `distributed/mixin.py`) says yes on every rank.
- `core_model_loading.revert_weight_conversion`'s choice of conversions (`conversions_for_save`), and
  `WeightTransform._original_source_patterns` / `_original_target_patterns`, to rebuild a quantizer's converter
  without its dequantize op (`conversions_without_dequantize`).
- `_BaseAutoModelClass._model_mapping._model_mapping` (model type -> class name(s)): which auto class builds the
  architecture a config names (`auto_class_builds`, for the command line's default `--model-class`).
- `GgufHfQuantizer.supported`: False when transformers' legacy GGUF loader handles the architecture, which hands
  `_load_pretrained_model` every tensor already dequantized (`state_dict_is_dequantized`).
- The model's private methods and attributes a load and a save use as transformers' own load does:
  `_adjust_missing_and_unexpected_keys` (the finish of a load), `_init_weights` / `_initialize_weights` (the
  missing-key init), the tensor (and module) flag `_is_hf_initialized` that transformers' guarded init functions
  skip, `_get_dtype_plan` (`plan`'s dtypes), `_weight_conversions` (set: what `save_pretrained` reverses) and
  `_checkpoint_conversion_mapping` (set: the key mapping PEFT's adapter load applies).
- `core_model_loading`'s key grouping and conversion classes (`rename_source_key`, `dot_natural_key`,
  `build_glob_alternation`, `WeightTransform` / `WeightConverter` / `WeightRenaming`, the op classes,
  `Conv3dToLinear._get_target_pattern`), re-exported for the planner (`planner/plan.py`, `planner/ops.py`).
- `Trainer._save` (the Trainer's writer of a model folder): a PEFT adapter's state dict written as the Trainer writes
  one (`integrations/saving_hooks.py`).

accelerate (the Hugging Face launcher transformers' Trainer runs on; written against accelerate 1.15.0), at the end:
`AcceleratorState._shared_state`, the process-wide state its DeepSpeed plugins are read from.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

from ._hooks import CLI, EP, LOAD, SAVE, TESTS, TRAINER, Hook

TRANSFORMERS_VERSIONS_CHECKED = ("5.23", "5.24")
# the releases tested: 5.23.x and 5.24.x (from, up to but not including); others warn at import (`compat.py`)
TESTED_RANGE = ((5, 23), (5, 25))
_originals: dict[str, Callable] = {}  # transformers' methods while ours replace them

_MU, _CML, _INIT = "transformers.modeling_utils", "transformers.core_model_loading", "transformers.initialization"
_OPS = ("MergeModulelist", "Concatenate", "Chunk", "Split", "Interleave", "Transpose", "PermuteForRope",
        "Conv3dToLinear", "ErnieFuseAndSplitTextVisionExperts", "VisionFuseAndPermuteForRope")  # `planner/ops.py`

# Every private name of transformers (and huggingface_hub) the package touches, with the shape it relies on; checked
# at the first load or save (`compat.missing_hooks`). Where one of a load's is missing or changed, the load goes
# through transformers' own ZeRO-3 path; a save is refused.
HOOKS = (
    Hook("transformers.integrations.deepspeed:_hf_deepspeed_config_weak_ref", (LOAD, SAVE)),
    Hook(f"{_MU}:PreTrainedModel._load_pretrained_model", static=True, exact=True,
         params=("model", "state_dict", "checkpoint_files", "load_config", "expected_keys")),
    Hook(f"{_MU}:PreTrainedModel._finalize_model_loading", static=True, exact=True,
         params=("model", "load_config", "loading_info")),
    Hook(f"{_MU}:LoadStateDictConfig", fields=("pretrained_model_name_or_path", "ignore_mismatched_sizes",
                                               "sharded_metadata", "dtype", "dtype_plan", "hf_quantizer",
                                               "weight_mapping", "weights_only")),
    Hook("transformers.utils.loading_report:LoadStateDictInfo", fields=(
        "missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs", "conversion_errors", "skipped_pp_keys")),
    Hook("transformers.utils.loading_report:log_state_dict_report",
         keywords=("model", "pretrained_model_name_or_path", "ignore_mismatched_sizes", "loading_info", "logger")),
    Hook(f"{_MU}:_tied_params_are_equal", params=("source", "target"), exact=True),
    Hook(f"{_MU}:PreTrainedModel._adjust_missing_and_unexpected_keys", params=("self", "loading_info")),
    Hook(f"{_MU}:PreTrainedModel._init_weights", params=("self", "module")),
    Hook(f"{_MU}:PreTrainedModel._initialize_weights", params=("self", "module", "is_custom_code")),
    Hook(_INIT, source=("_is_hf_initialized",)),  # the flag its guarded init functions skip a tensor by
    Hook(f"{_MU}:PreTrainedModel._get_dtype_plan", params=("self", "dtype")),
    Hook(f"{_MU}:PreTrainedModel._from_config", (LOAD, SAVE)),
    Hook(f"{_INIT}:guard_torch_init_functions", (LOAD, SAVE)),
    Hook(f"{_INIT}:TORCH_INIT_FUNCTIONS", (LOAD, SAVE)),
    Hook(f"{_INIT}:no_init_weights", (LOAD, SAVE)),
    Hook("transformers.quantizers.quantizer_gguf:GgufHfQuantizer", (LOAD, SAVE), source=("self.supported",)),
    Hook("transformers.integrations.finegrained_fp8:Fp8Dequantize", (LOAD, SAVE)),
    Hook("transformers.integrations.mxfp4:Mxfp4Dequantize", (LOAD, SAVE)),
    # the planner (`planner/plan.py`, `planner/ops.py`) groups keys and routes ops as transformers does
    # (`_weight_conversions`, set on a loaded model, is what its `revert_weight_conversion` reverses when saving)
    Hook(f"{_CML}:revert_weight_conversion", (LOAD, SAVE), source=("_weight_conversions",)),
    Hook(f"{_CML}:rename_source_key", (LOAD, SAVE), params=("source_key", "weight_renamings", "weight_converters",
                                                           "base_model_prefix", "meta_state_dict")),
    Hook(f"{_CML}:dot_natural_key", (LOAD, SAVE), params=("s",), exact=True),
    Hook(f"{_CML}:build_glob_alternation", (LOAD, SAVE), params=("globs",)),
    Hook(f"{_CML}:WeightTransform", (LOAD, SAVE),
         source=("self._original_source_patterns", "self._original_target_patterns")),
    Hook(f"{_CML}:WeightConverter", (LOAD, SAVE)),
    Hook(f"{_CML}:WeightRenaming", (LOAD, SAVE)),
    *(Hook(f"{_CML}:{op}", (LOAD, SAVE)) for op in _OPS),
    Hook(f"{_CML}:Conv3dToLinear._get_target_pattern", (LOAD, SAVE), static=True,
         params=("input_dict", "source_patterns", "target_patterns")),
    # a save: transformers' save_pretrained on a meta skeleton, the shard writer captured
    Hook(f"{_MU}:safe_save_file", (SAVE,), params=("tensors", "filename", "metadata"), exact=True),
    Hook(f"{_MU}:split_torch_state_dict_into_shards", (SAVE,), params=("state_dict",),
         keywords=("filename_pattern", "max_shard_size")),
    Hook(f"{_MU}:PreTrainedModel.should_save_on_this_rank", (SAVE,), params=("self", "is_main_process"), exact=True),
    Hook(f"{_CML}:PrefixChange", (SAVE,)),
    Hook(f"{_CML}:WeightConverter.copy", (SAVE,), params=("self", "source_patterns", "target_patterns")),
    Hook("transformers.conversion_mapping:get_model_conversion_mapping", (SAVE,), params=("model",),
         keywords=("add_legacy",)),
    Hook("huggingface_hub.serialization._torch:get_torch_storage_id", (SAVE,)),
    Hook("huggingface_hub.serialization._torch:get_torch_storage_size", (SAVE,)),
    Hook("huggingface_hub:split_state_dict_into_shards_factory", (SAVE,), params=("state_dict",),
         keywords=("max_shard_size", "filename_pattern", "get_storage_size", "get_storage_id")),
    Hook("transformers.models.auto.auto_factory:_LazyAutoMapping", (CLI,), source=("self._model_mapping",)),
    # checked by the full check only (`compat.missing_hooks()`, the tests): a load or save does not depend on it
    Hook("transformers.trainer:Trainer._save", (TRAINER,), params=("self", "output_dir"), keywords=("state_dict",)),
    Hook("transformers.conversion_mapping:_build_checkpoint_conversion_mapping", (TESTS,)),
    Hook("transformers.quantizers.auto:AUTO_QUANTIZER_MAPPING", (TESTS,)),
)


def missing_hooks(*uses: str) -> list[str]:
    """"name: what is wrong" for each hook above that `uses` need (all when none given) and the installed transformers
    lacks or has changed; [] when every one is as expected. Checked once per process."""
    from ._hooks import missing

    return missing(HOOKS, uses)


def live_hf_deepspeed_config():
    """The `HfDeepSpeedConfig` transformers consults now (its module-level weak reference), or None."""
    import transformers.integrations.deepspeed as hf_ds

    ref = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None)  # gone in an untested transformers: none known
    return ref() if ref is not None else None


@contextmanager
def hf_zero3_config(config: dict):
    """transformers sees ZeRO-3 with `config` for the duration, through an `HfDeepSpeedConfig` held here: not a weak
    reference to someone else's object, which the garbage collector may drop mid-load (then transformers builds the
    model under zero.Init and loads it as if ZeRO-3 were off). Afterwards it sees what it saw before."""
    import transformers.integrations.deepspeed as hf_ds
    from transformers.integrations import HfDeepSpeedConfig

    saved = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", _GONE)
    held = HfDeepSpeedConfig(config)
    try:
        yield held
    finally:
        if saved is not _GONE:  # gone in an untested transformers: `held` stays what it sees (as upstream's users do)
            hf_ds._hf_deepspeed_config_weak_ref = saved


_GONE = object()


@contextmanager
def hidden_hf_zero3():
    import transformers.integrations.deepspeed as hf_ds

    if not hasattr(hf_ds, "_hf_deepspeed_config_weak_ref"):  # an untested transformers: loads take its own path
        yield
        return
    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


@contextmanager
def replaced_loading(load: Callable, finalize: Callable):
    """Swap transformers' weight loading and finalisation for ours, for every model class."""
    from transformers.modeling_utils import PreTrainedModel

    saved_load = PreTrainedModel.__dict__["_load_pretrained_model"]
    saved_finalize = PreTrainedModel.__dict__["_finalize_model_loading"]
    _originals["load"] = saved_load.__func__
    PreTrainedModel._load_pretrained_model = staticmethod(load)
    PreTrainedModel._finalize_model_loading = staticmethod(finalize)
    try:
        yield
    finally:
        PreTrainedModel._load_pretrained_model = saved_load
        PreTrainedModel._finalize_model_loading = saved_finalize


def transformers_load(*args, **kwargs):
    """transformers' own `_load_pretrained_model`, while ours replaces it: `load_adapter` (an adapter folder given to
    `from_pretrained`) calls it a second time, to fill the LoRA parameters it just added."""
    return _originals["load"](*args, **kwargs)


@contextmanager
def tied_equality(compare: Callable):
    import transformers.modeling_utils as mu

    saved = mu._tied_params_are_equal
    mu._tied_params_are_equal = compare
    try:
        yield
    finally:
        mu._tied_params_are_equal = saved


def load_state_dict_info(missing, unexpected, mismatched):
    from transformers.utils.loading_report import LoadStateDictInfo

    return LoadStateDictInfo(
        missing_keys=set(missing),
        unexpected_keys=set(unexpected),
        mismatched_keys=set(mismatched),
        error_msgs=[],
        conversion_errors={},
        skipped_pp_keys=set(),
    )


def report_loading(model, load_config, loading_info):
    from transformers.modeling_utils import logger
    from transformers.utils.loading_report import log_state_dict_report

    log_state_dict_report(
        model=model,
        pretrained_model_name_or_path=load_config.pretrained_model_name_or_path,
        ignore_mismatched_sizes=load_config.ignore_mismatched_sizes,
        loading_info=loading_info,
        logger=logger,
    )


def init_module_order(model):
    """(module, owner) pairs in the order `PreTrainedModel.initialize_weights` (its `smart_apply`) visits them."""
    from transformers.modeling_utils import PreTrainedModel

    order = []

    def visit(module, owner):
        for child in module.children():
            visit(child, child if isinstance(child, PreTrainedModel) else owner)
        order.append((module, owner))

    visit(model, model)
    return order


def guarded_init_functions():
    from transformers import initialization

    return initialization.guard_torch_init_functions()


@contextmanager
def recording_init_functions(record: Callable):
    """Replace transformers' init functions (and torch's) by `record(tensor)`: no data touched, no RNG drawn."""
    import torch
    from transformers import initialization

    extra = ("copy_", "lecun_normal_", "default_flax_embed_init_")
    names = [n for n in (*initialization.TORCH_INIT_FUNCTIONS, *extra) if hasattr(initialization, n)]
    saved = {(m, n): getattr(m, n) for m in (initialization, torch.nn.init) for n in names if hasattr(m, n)}

    def recorder(tensor, *args, **kwargs):
        record(tensor)
        return tensor

    for module, name in saved:
        setattr(module, name, recorder)
    try:
        yield
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


def loading_conversion_ops() -> set[type]:
    """Every op class transformers' conversion mappings run when loading (all model types), plus the dequantize ops its
    quantizers put first in a chain (`get_load_operations()["dequantize"]`)."""
    from transformers import conversion_mapping
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    ops: set[type] = set()
    for converters in conversion_mapping._build_checkpoint_conversion_mapping().values():
        for converter in converters:
            ops.update(type(op) for op in getattr(converter, "operations", None) or [])
    for quantizer_class in AUTO_QUANTIZER_MAPPING.values():
        try:
            dequantize = quantizer_class.get_load_operations(quantizer_class).get("dequantize")
        except Exception:
            continue
        if dequantize is not None:
            ops.add(dequantize)
    return ops


def state_dict_is_dequantized(quantizer) -> bool:
    """A GGUF file of an architecture the legacy loader handles (all but a few in 5.23): its state dict holds every
    tensor dequantized to the load's dtype, though the quantization config does not say `dequantize`."""
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

    return isinstance(quantizer, GgufHfQuantizer) and not quantizer.supported


def meta_storage_id(tensor):
    """huggingface_hub's storage id, also for meta tensors: views of one meta tensor share its storage (as views of a
    real tensor do), so a save planned on meta groups and sizes them as the real save does."""
    from huggingface_hub.serialization._torch import get_torch_storage_id, get_torch_storage_size

    if tensor.device.type != "meta":
        return get_torch_storage_id(tensor)
    return tensor.device, tensor.untyped_storage()._cdata, get_torch_storage_size(tensor)


def split_state_dict_on_meta(state_dict, filename_pattern, max_shard_size):
    from huggingface_hub import split_state_dict_into_shards_factory
    from huggingface_hub.serialization._torch import get_torch_storage_size

    return split_state_dict_into_shards_factory(state_dict, max_shard_size=max_shard_size,
                                                filename_pattern=filename_pattern,
                                                get_storage_size=get_torch_storage_size, get_storage_id=meta_storage_id)


@contextmanager
def captured_weight_files(model, record: Callable):
    """While active, `model.save_pretrained` writes every file but the weight shards, on any rank (not only on rank 0,
    as `should_save_on_this_rank` decides); each shard's tensors (meta) and metadata go to
    `record(path, tensors, metadata)`."""
    import transformers.modeling_utils as mu

    saved = mu.safe_save_file, mu.split_torch_state_dict_into_shards
    mu.safe_save_file = lambda tensors, filename, metadata=None: record(filename, tensors, metadata)
    mu.split_torch_state_dict_into_shards = split_state_dict_on_meta
    model.should_save_on_this_rank = lambda is_main_process: True
    try:
        yield
    finally:
        mu.safe_save_file, mu.split_torch_state_dict_into_shards = saved
        del model.should_save_on_this_rank


def conversions_for_save(model) -> list:
    """The conversions `revert_weight_conversion` reverses for `model` (the same choice): the ones used when it was
    loaded, else the model type's defaults without prefix changes."""
    from transformers.core_model_loading import PrefixChange

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        from transformers.conversion_mapping import get_model_conversion_mapping

        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return list(conversions or [])


# what a quantized checkpoint stores beside each weight (FP8: scales; MXFP4: the packed blocks and their scales)
QUANTIZED_PARTS = ("weight_scale_inv", "activation_scale", "_blocks", "_scales")


def conversions_without_dequantize(conversions: list) -> list:
    """A model loaded with `dequantize=True` keeps its quantizer's converters: `Fp8Dequantize` / `Mxfp4Dequantize`
    first, over each weight and its scales. transformers 5.23 cannot reverse them when saving: an FP8 MoE fails
    ("Undefined Operation encountered!"), a dense FP8 model is written as FP8 weights and scales under a config that
    no longer says FP8 (loaded back, the scales are unexpected and the weights wrong). The model holds dequantized
    weights, so a save writes those in the checkpoint's own layout: the same converters without the dequantize op and
    the scales' patterns; one left with nothing to convert is dropped."""
    from transformers.core_model_loading import WeightConverter

    dropped = tuple(dequantize_ops().values())
    out = []
    for conversion in conversions:
        operations = getattr(conversion, "operations", None) or []
        if not isinstance(conversion, WeightConverter) or not any(isinstance(op, dropped) for op in operations):
            out.append(conversion)
            continue
        sources = [p for p in conversion._original_source_patterns if not p.endswith(QUANTIZED_PARTS)]
        targets = list(conversion._original_target_patterns)
        operations = [op for op in operations if not isinstance(op, dropped)]
        if not sources or not operations:  # a rename at most: the weight keeps its name, or (MXFP4) its target's
            continue
        out.append(conversion.copy(sources, targets, operations=operations))
    return out


def dequantize_ops() -> dict[str, type]:
    """The dequantize ops transformers' quantizers put first in a chain when loading with `dequantize=True`, by format
    ("fp8", "mxfp4"): what the planner has rules for and a save leaves out."""
    ops = {}
    try:
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize

        ops["fp8"] = Fp8Dequantize
    except ImportError:
        pass
    try:
        from transformers.integrations.mxfp4 import Mxfp4Dequantize

        ops["mxfp4"] = Mxfp4Dequantize
    except ImportError:
        pass
    return ops


def meta_model(model_class, config, dtype):
    """`model_class` built from `config` on meta, weights not initialised, tied as transformers ties them."""
    import torch
    from transformers.initialization import no_init_weights

    with hidden_hf_zero3(), torch.device("meta"), no_init_weights():
        model = model_class._from_config(config, dtype=dtype)
    model.tie_weights()
    return model


def auto_class_builds(auto_class, model_type: str, architecture: str) -> bool:
    """Whether `auto_class` (e.g. `transformers.AutoModelForImageTextToText`) maps `model_type` to `architecture`,
    read from its lazy mapping's names without importing any model code."""
    built = auto_class._model_mapping._model_mapping.get(model_type)
    return architecture in (built if isinstance(built, tuple) else (built,))


# -- the model's private methods and attributes, as transformers' own load uses them --------------------------------
# (their hooks above: `_adjust_missing_and_unexpected_keys`, `_init_weights`, `_initialize_weights`, `_get_dtype_plan`,
# the `_is_hf_initialized` flag, `revert_weight_conversion` reading `_weight_conversions`. `_checkpoint_conversion_mapping`
# has none: transformers 5 defines it nowhere, and PEFT reads it where a model sets it)

def adjust_missing_and_unexpected_keys(model, loading_info) -> None:
    """The finish of a load: transformers' own pruning of the missing and unexpected keys it reports."""
    model._adjust_missing_and_unexpected_keys(loading_info)


def init_weights(owner, module) -> None:
    """`owner`'s init of `module` alone (`_init_weights`), as `initialize_weights` runs it per module."""
    owner._init_weights(module)


def initialize_weights(owner, module, is_custom_code: bool) -> None:
    """`owner._initialize_weights(module, is_custom_code)`: `_init_weights` unless `module` is flagged initialised."""
    owner._initialize_weights(module, is_custom_code)


def dtype_plan(model, dtype) -> dict:
    """The dtype each tensor loads in (`_get_dtype_plan`): `keep_in_fp32` modules and the like."""
    return model._get_dtype_plan(dtype)


def is_initialized(tensor) -> bool:
    """Whether `tensor` (or a module) carries transformers' `_is_hf_initialized` flag."""
    return getattr(tensor, "_is_hf_initialized", False)


def mark_initialized(tensor) -> None:
    """Flag `tensor` (or a module) as initialised: transformers' guarded init functions (and `_initialize_weights`)
    leave it alone."""
    tensor._is_hf_initialized = True


def unmark_initialized(tensor) -> None:
    """Remove the flag `mark_initialized` set."""
    del tensor._is_hf_initialized


def weight_conversions(model):
    """The conversions `model` was loaded with (`_weight_conversions`), or None."""
    return getattr(model, "_weight_conversions", None)


def set_weight_conversions(model, conversions) -> None:
    """What `save_pretrained` reverses for `model` (`_weight_conversions`, as transformers' own load sets it)."""
    model._weight_conversions = conversions


def set_checkpoint_conversion_mapping(model, mapping: dict) -> None:
    """The key mapping (regex -> replacement) PEFT's `PeftModel.from_pretrained` applies to the keys of an adapter it
    loads onto `model` (`_checkpoint_conversion_mapping`)."""
    model._checkpoint_conversion_mapping = mapping


# -- core_model_loading: the planner groups keys and routes ops as transformers does ---------------------------------

# re-exported on first use (importing this module imports no transformers code; an untested transformers without one
# of them fails the planner's import, not the package's)
_CML_EXPORTS = ("rename_source_key", "dot_natural_key", "build_glob_alternation", "WeightTransform", "WeightConverter",
                "WeightRenaming")


def __getattr__(name: str):
    if name in _CML_EXPORTS:
        from transformers import core_model_loading

        return getattr(core_model_loading, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def conversion_ops(names) -> dict:
    """{name: op class} for each of `names` the installed transformers' `core_model_loading` has."""
    from transformers import core_model_loading

    return {name: getattr(core_model_loading, name) for name in names if hasattr(core_model_loading, name)}


def conv3d_to_linear_target_pattern(input_dict: dict, source_patterns, target_patterns):
    """`Conv3dToLinear._get_target_pattern`: the key its output goes to."""
    from transformers.core_model_loading import Conv3dToLinear

    return Conv3dToLinear._get_target_pattern(input_dict, source_patterns, target_patterns)


# -- transformers' Trainer ---------------------------------------------------------------------------------------------

def trainer_save(trainer, output_dir, state_dict) -> None:
    """`Trainer._save`: `state_dict` written to `output_dir` as the Trainer writes a model (with its processing class
    and training arguments)."""
    trainer._save(output_dir, state_dict=state_dict)


# -- accelerate (the Hugging Face launcher transformers' Trainer runs on): written against accelerate 1.15.0 ----------
# Not in HOOKS: every load reads it to find the DeepSpeed config, transformers' own ZeRO-3 path (the fallback) too.

def accelerate_shared_state() -> dict | None:
    """The process-wide state of accelerate's `AcceleratorState` (`_shared_state`, a dict its objects share), or None
    where accelerate is not installed."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return None
    return AcceleratorState._shared_state
