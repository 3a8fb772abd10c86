"""`import hf_zero3_loader.auto`: every `from_pretrained` under DeepSpeed ZeRO-3 loads shard-on-read, and
`Trainer.save_model` / `Accelerator.save_model` save a ZeRO-3 model without a gather."""

from .deepspeed_setup import warn_of_unreadable_accelerate_config
from .integrations import saving_hooks, transformers_hook

transformers_hook.install()
saving_hooks.install()
warn_of_unreadable_accelerate_config()
