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
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

TRANSFORMERS_VERSIONS_CHECKED = ("5.23", "5.24")
_originals: dict[str, Callable] = {}  # transformers' methods while ours replace them


def live_hf_deepspeed_config():
    """The `HfDeepSpeedConfig` transformers consults now (its module-level weak reference), or None."""
    import transformers.integrations.deepspeed as hf_ds

    ref = hf_ds._hf_deepspeed_config_weak_ref
    return ref() if ref is not None else None


@contextmanager
def hf_zero3_config(config: dict):
    """transformers sees ZeRO-3 with `config` for the duration, through an `HfDeepSpeedConfig` held here: not a weak
    reference to someone else's object, which the garbage collector may drop mid-load (then transformers builds the
    model under zero.Init and loads it as if ZeRO-3 were off). Afterwards it sees what it saw before."""
    import transformers.integrations.deepspeed as hf_ds
    from transformers.integrations import HfDeepSpeedConfig

    saved = hf_ds._hf_deepspeed_config_weak_ref
    held = HfDeepSpeedConfig(config)
    try:
        yield held
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


@contextmanager
def hidden_hf_zero3():
    import transformers.integrations.deepspeed as hf_ds

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
