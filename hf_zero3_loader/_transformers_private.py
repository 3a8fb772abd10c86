"""Every touch of transformers' private API, in one place. Written against transformers 5.23.

- `integrations.deepspeed._hf_deepspeed_config_weak_ref`: hidden while we build the model, so
  `from_pretrained` builds a meta skeleton instead of entering `zero.Init`.
- `PreTrainedModel._load_pretrained_model` / `_finalize_model_loading` (staticmethods): replaced for the
  duration of one call, so transformers still resolves files, config, dtype, the conversion mapping and
  generation config, and we only replace how bytes reach the parameters and how missing keys are set.
- `modeling_utils._tied_params_are_equal`: made ZeRO-3 aware (it compares `(0,)` placeholders otherwise).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

TRANSFORMERS_VERSION_WRITTEN_AGAINST = "5.23"


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
    PreTrainedModel._load_pretrained_model = staticmethod(load)
    PreTrainedModel._finalize_model_loading = staticmethod(finalize)
    try:
        yield
    finally:
        PreTrainedModel._load_pretrained_model = saved_load
        PreTrainedModel._finalize_model_loading = saved_finalize


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
