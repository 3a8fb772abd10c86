"""Route `Trainer.save_model`, `Accelerator.save_model` and `PreTrainedModel.save_pretrained` through
`hf_zero3_loader.save_pretrained` for ZeRO-3 models, and PEFT adapters' saves through `peft_adapters.py`.

The first two gather today (`stage3_gather_16bit_weights_on_model_save`: every parameter all-gathered, the whole
state dict in rank 0's memory) or, with that option off, write no model at all; a model's own `save_pretrained` writes
each partitioned parameter as an empty tensor (a dense model's checkpoint of `(0,)`-shaped weights, silently) or fails
reverting MoE conversions ("chunk expects `chunks` to be greater than 0"). With `import hf_zero3_loader.auto` a
partitioned `PreTrainedModel` is written by every rank from its own partitions instead; the files are the ones the
gathered path writes. Anything else (a `state_dict=` the caller passes, as accelerate's documented
`save_pretrained(..., state_dict=accelerator.get_state_dict(model))` does, PEFT models given to accelerate's or
transformers' save, plain `nn.Module`s, ZeRO-1/2) goes to the original methods unchanged, and so do the Trainer's and
accelerate's saves of a model whose partitions are swapped out to NVMe (they gather it; a model's own
`save_pretrained` of one is refused, not written empty). A PEFT model over a ZeRO-3 base (`Trainer.save_model`, or
PEFT's own `save_pretrained` called on every rank) writes its adapter as PEFT does, from the adapter's tensors alone
gathered (`peft_adapters.py`). accelerate's `get_state_dict`, where accelerate or DeepSpeed refuse it for a ZeRO-3
model, names the save without a gather in its error.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys

_originals: dict = {}


def _partitioned_pretrained_model(model):
    """The PreTrainedModel to write without a gather, or None for the original method: not partitioned,
    partitions swapped out to NVMe (`offload_param: nvme`), or a private hook the save needs missing from an untested
    transformers or DeepSpeed (`compat.py`), which the Trainer and accelerate gather as before."""
    from transformers import PreTrainedModel

    from .._deepspeed_private import on_nvme
    from ..compat import SAVE, missing_hooks
    from ..saving import is_partitioned, unwrap

    module = unwrap(model)
    if not (isinstance(module, PreTrainedModel) and is_partitioned(module)):
        return None
    if missing_hooks(SAVE):  # an untested transformers or DeepSpeed: the Trainer and accelerate gather, as before
        return None
    return None if any(on_nvme(p) for p in module.parameters()) else module


def _trainer_save_model(original):
    @functools.wraps(original)
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        from .._transformers_private import trainer_save
        from ..peft_adapters import adapter_state_dict, partitioned_peft_model

        if self.is_deepspeed_enabled and partitioned_peft_model(self.model) is not None:
            # the adapter, gathered alone (upstream: DeepSpeed's consolidated state dict, every parameter gathered)
            trainer_save(self, output_dir, adapter_state_dict(self.model))
            if self.args.push_to_hub and not _internal_call:
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
            return
        module = _partitioned_pretrained_model(self.model) if self.is_deepspeed_enabled else None
        if module is None:
            return original(self, output_dir, _internal_call)
        from transformers.trainer import TRAINING_ARGS_NAME

        from ..saving import save_pretrained

        output_dir = output_dir if output_dir is not None else self.args.output_dir

        def extra_files(folder: str) -> None:  # what Trainer._save writes next to the model
            import torch

            if self.processing_class is not None:
                self.processing_class.save_pretrained(folder)
            elif getattr(self.data_collator, "tokenizer", None) is not None:
                self.data_collator.tokenizer.save_pretrained(folder)
            torch.save(self.args, os.path.join(folder, TRAINING_ARGS_NAME))

        save_pretrained(module, output_dir, is_main_process=self.args.should_save, extra_files=extra_files)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    return save_model


def _accelerator_save_model(original):
    @functools.wraps(original)
    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True):
        from accelerate.utils import DistributedType

        module = None
        if self.distributed_type == DistributedType.DEEPSPEED and safe_serialization:
            module = _partitioned_pretrained_model(model)
        if module is None:
            return original(self, model, save_directory, max_shard_size, safe_serialization)
        from ..saving import save_pretrained

        save_pretrained(module, save_directory, is_main_process=self.is_main_process, max_shard_size=max_shard_size,
                        file_layout="accelerate")

    return save_model


# transformers' save_pretrained keywords that do not change the files (the hub token; PEFT's format and the writer
# function, which only a caller-gathered state dict or an adapter uses: those go to the original)
_IGNORED_SAVE_KEYWORDS = ("token", "save_peft_format", "save_function")


def _refuse_writing_empty_partitions(passed: dict, what: str) -> None:
    """`state_dict=None` passed on a rank that writes (`is_main_process`): the original method would take the
    model's own state dict, every partitioned parameter an empty tensor, and write that silently. Raised on this rank
    alone: the original path runs no collective, so the other ranks return as they would have."""
    if "state_dict" in passed and passed["state_dict"] is None and passed.get("is_main_process", True):
        from ..errors import ConfigError

        raise ConfigError(f"{what}(state_dict=None) of a ZeRO-3 model would write every partitioned parameter as an "
                          "empty tensor: pass the gathered state dict (accelerator.get_state_dict(model)), or leave "
                          "state_dict out and call it on every rank to save without a gather (hf_zero3_loader)")


def _model_save_pretrained(original):
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        import torch.distributed as dist

        from ..saving import is_partitioned

        bound = signature.bind(self, save_directory, *args, **kwargs).arguments
        # a state dict the caller passes, even None: accelerate's documented ZeRO-3 save passes
        # `state_dict=accelerator.get_state_dict(model)`, gathered on rank 0 and None on the others, which must take
        # the original path with rank 0 (the collective save here would wait for rank 0 until the join timeout)
        partitioned = is_partitioned(self)
        if ("state_dict" in bound or getattr(self, "_hf_peft_config_loaded", False)
                or not (dist.is_available() and dist.is_initialized()) or not partitioned):
            if partitioned:
                _refuse_writing_empty_partitions(bound, "save_pretrained")
            return original(self, save_directory, *args, **kwargs)
        from .. import log
        from ..saving import save_pretrained as save_partitions

        options = {k: v for k, v in bound.items() if k not in ("self", "save_directory", "kwargs")}
        options.update(bound.get("kwargs", {}))
        options = {k: v for k, v in options.items() if k not in _IGNORED_SAVE_KEYWORDS}
        log.info("save_pretrained of a ZeRO-3 model: every rank writes its own partitions (hf_zero3_loader; call it "
                 "on every rank)")
        save_partitions(self, save_directory, **options)

    return save_pretrained


def _peft_save_pretrained(original):
    """PEFT's `save_pretrained` of a PEFT model over a partitioned base (a Trainer callback's `on_save`, a custom
    loop): every rank gathers the adapter, then PEFT writes it as usual. Without this PEFT writes each partitioned
    tensor as this rank's empty slice (with a warning): an adapter that loads as nothing."""
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        import torch.distributed as dist

        from ..peft_adapters import adapter_state_dict, partitioned_peft_model, written_under_transformers_names

        if (not (dist.is_available() and dist.is_initialized()) or partitioned_peft_model(self) is None):
            return original(self, save_directory, *args, **kwargs)
        bound = signature.bind(self, save_directory, *args, **kwargs).arguments
        _refuse_writing_empty_partitions({**bound, **bound.get("kwargs", {})}, "PeftModel.save_pretrained")
        if "state_dict" not in kwargs:  # one the caller passes, even None (accelerate's `get_state_dict` on ranks
            # other than 0), is the caller's: gathering here would wait for ranks that do not
            kwargs["state_dict"] = adapter_state_dict(self, bound.get("selected_adapters"), bound.get(
                "save_embedding_layers", "auto"), on_every_rank=True)  # each rank writes where its is_main_process says
        with written_under_transformers_names(self):  # the Trainer's save (its state_dict given) too
            return original(self, save_directory, *args, **kwargs)

    return save_pretrained


def _accelerator_get_state_dict(original):
    """accelerate's documented save (`save_pretrained(..., state_dict=accelerator.get_state_dict(model))`) needs a
    consolidated state dict, which accelerate refuses under ZeRO-3 without `stage3_gather_16bit_weights_on_model_save`
    (pointing at that option, or `zero_to_fp32.py`), and DeepSpeed refuses under expert parallelism (engine-side AutoEP
    too; pointing at a checkpoint conversion tool), on every rank. The save this library adds needs neither: its
    refusals name it."""
    @functools.wraps(original)
    def get_state_dict(self, model, *args, **kwargs):
        try:
            return original(self, model, *args, **kwargs)
        except (NotImplementedError, ValueError) as e:
            refused = "AutoEP" in str(e) or "stage3_gather_16bit_weights_on_model_save" in str(e)
            if not refused or _partitioned_pretrained_model(model) is None:
                raise
            raise type(e)(f"{e} With hf_zero3_loader, save without a state dict instead: "
                          "accelerator.save_model(model, folder), or accelerator.unwrap_model(model).save_pretrained("
                          "folder), called on every rank (each rank writes its own partitions, no gather)") from e

    return get_state_dict


TARGETS = {"transformers.trainer": [("Trainer", "save_model", _trainer_save_model)],
           "peft.peft_model": [("PeftModel", "save_pretrained", _peft_save_pretrained)],
           "accelerate.accelerator": [("Accelerator", "save_model", _accelerator_save_model),
                                      ("Accelerator", "get_state_dict", _accelerator_get_state_dict)],
           "transformers.modeling_utils": [("PreTrainedModel", "save_pretrained", _model_save_pretrained)]}


def _patch(module) -> None:
    for class_name, method, wrap in TARGETS[module.__name__]:
        owner = getattr(module, class_name)
        if (owner, method) not in _originals:
            _originals[owner, method] = owner.__dict__[method]
            setattr(owner, method, wrap(_originals[owner, method]))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a target module right after it is first imported, so `import hf_zero3_loader.auto` does not import
    the Trainer (seconds) for scripts that never use it."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, exec_module=exec_module):
                    exec_module(module)
                    _patch(module)

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


_finder = _PatchOnImport()


def install() -> None:
    """Patch the targets now if imported, else when they are (idempotent)."""
    for name in TARGETS:
        if name in sys.modules:
            _patch(sys.modules[name])
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for (owner, method), original in list(_originals.items()):
        setattr(owner, method, original)
        del _originals[owner, method]
