"""`import hf_zero3_loader.auto`: every `from_pretrained` under DeepSpeed ZeRO-3 loads shard-on-read."""

from .integrations.transformers_hook import install

install()
