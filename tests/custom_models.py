"""Model classes for tests that transformers does not ship."""

import torch
from transformers import LlamaForCausalLM


class MetaHostileLlamaForCausalLM(LlamaForCausalLM):
    """Reads a tensor's value in __init__ (like some remote-code models): impossible on the meta device."""

    def __init__(self, config):
        super().__init__(config)
        self.scale = float(torch.ones(1).sum().item())
