"""Route `Trainer.save_model` and `Accelerator.save_model` through `hf_zero3_loader.save_pretrained` for ZeRO-3 models.

Both gather today (`stage3_gather_16bit_weights_on_model_save`: every parameter all-gathered, the whole state dict in
rank 0's memory) or, with that option off, write no model at all. With `import hf_zero3_loader.auto` a partitioned
`PreTrainedModel` is written by every rank from its own partitions instead; the files are the ones the gathered path
writes. Anything else (PEFT adapters, plain `nn.Module`s, ZeRO-1/2) goes to the original methods unchanged.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys

_originals: dict = {}


def _partitioned_pretrained_model(model):
    from transformers import PreTrainedModel

    from ..saving import is_partitioned, unwrap

    module = unwrap(model)
    return module if isinstance(module, PreTrainedModel) and is_partitioned(module) else None


def _trainer_save_model(original):
    @functools.wraps(original)
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
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


TARGETS = {"transformers.trainer": ("Trainer", _trainer_save_model),
           "accelerate.accelerator": ("Accelerator", _accelerator_save_model)}


def _patch(module) -> None:
    class_name, wrap = TARGETS[module.__name__]
    owner = getattr(module, class_name)
    if owner not in _originals:
        _originals[owner] = owner.__dict__["save_model"]
        owner.save_model = wrap(_originals[owner])


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
    """Patch `Trainer.save_model` and `Accelerator.save_model` now if imported, else when they are (idempotent)."""
    for name in TARGETS:
        if name in sys.modules:
            _patch(sys.modules[name])
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for owner, original in list(_originals.items()):
        owner.save_model = original
        del _originals[owner]
