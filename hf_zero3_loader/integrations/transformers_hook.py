"""Route `PreTrainedModel.from_pretrained` through hf_zero3_loader whenever DeepSpeed ZeRO-3 is in force.

For scripts run with `accelerate launch --use_deepspeed` or the Trainer: add `import hf_zero3_loader.auto` once at
the top and leave every `AutoModel*.from_pretrained(...)` call as it is. Without ZeRO-3 (no config found, stage
0-2, or ZeRO-3 launched with `zero3_init_flag: false` before transformers holds the config) the call goes to
transformers unchanged. The ZeRO-3 config is found the way `from_pretrained` finds it (HfDeepSpeedConfig,
AcceleratorState, `accelerate launch` environment).
"""

from __future__ import annotations

import functools

from ..bypass import bypassed, inside_loader

_original = None


def install() -> None:
    """Patch `PreTrainedModel.from_pretrained` (idempotent)."""
    global _original
    from transformers.modeling_utils import PreTrainedModel

    if _original is not None:
        return
    _original = PreTrainedModel.__dict__["from_pretrained"]
    plain = _original.__func__

    @functools.wraps(plain)
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        from ..deepspeed_setup import find_deepspeed_setup
        from ..loader import from_pretrained as zero3_from_pretrained

        if inside_loader():
            return plain(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        setup = find_deepspeed_setup(None)
        if setup is None or not setup.partitions_at_load:
            _say_left_to_transformers(setup, pretrained_model_name_or_path)
            return plain(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        with bypassed():  # our loader calls from_pretrained itself
            # no ds_config: the loader finds the same config and records where it came from
            return zero3_from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def _say_left_to_transformers(setup, path) -> None:
    """One line on rank 0 (once per model and reason): the import is active, and why this load is not ours."""
    from .. import log
    from ..deepspeed_setup import unpartitioned_reason

    reason = unpartitioned_reason(setup)
    name = "a state_dict" if path is None else str(path)
    log.info_once(f"left to transformers: {reason} {name}",
                  "import hf_zero3_loader.auto: from_pretrained(%s) loads as transformers does, whole on each rank: "
                  "%s. hf_zero3_loader loads into ZeRO-3 partitions only under ZeRO-3.", name, reason)


def uninstall() -> None:
    global _original
    from transformers.modeling_utils import PreTrainedModel

    if _original is not None:
        PreTrainedModel.from_pretrained = _original
        _original = None
