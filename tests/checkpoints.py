"""Small real checkpoints written by transformers' `save_pretrained` (random weights, real on-disk layouts).

Sizes are chosen so that tensor sizes are divisible by some world sizes (2, 4) and not by others (3).
"""

from __future__ import annotations

import os

import torch

FAMILIES = ("qwen3_moe", "mixtral", "llama_tied", "llama_untied")


def make_config(family: str):
    from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=101, hidden_size=28, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=14, intermediate_size=44, moe_intermediate_size=22, num_experts=5,
                              num_experts_per_tok=2, decoder_sparse_step=1, tie_word_embeddings=False)
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=38, num_local_experts=3, num_experts_per_tok=2,
                             tie_word_embeddings=False)
    if family in ("llama_tied", "llama_untied"):
        return LlamaConfig(**common, intermediate_size=37, tie_word_embeddings=family == "llama_tied")
    raise ValueError(family)


def make_checkpoint(path: str, family: str, dtype: torch.dtype = torch.float32, sharded: bool = False,
                    seed: int = 0, config=None, model_class=None, max_shard_size: str | None = None) -> str:
    """Write a checkpoint for `family` to `path` (once; reused if present) and return `path`. `max_shard_size`
    overrides the shard size `sharded` picks."""
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    config = config or make_config(family)
    model = (model_class or AutoModelForCausalLM).from_config(config, dtype=dtype)
    # save_pretrained drops tied tensors; random-init norms are ones, so perturb everything to catch mix-ups.
    # Some models' init leaves a parameter as torch.empty memory (Qwen3-Omni-MoE's talker experts, transformers
    # 5.23): whatever the allocator held, NaN at times, and NaN != NaN in a bit-exact comparison. No init gives
    # values that large, so such entries are replaced by the noise alone.
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn_like(p) * 0.5
            garbage = ~torch.isfinite(p) | (p.abs() > 1e4) if p.is_floating_point() else None
            p.copy_(torch.where(garbage, noise, p + noise) if garbage is not None and garbage.any() else p + noise)
    model.save_pretrained(path, max_shard_size=max_shard_size or ("20KB" if sharded else "10GB"))
    return path


def transpose_experts(tensors: dict) -> dict:
    """Fused experts between the model's layout and Qwen3-VL-MoE's released one (`[E, H, 2I]`): either way."""
    return {k: (v.transpose(1, 2) if ".mlp.experts." in k else v) for k, v in tensors.items()}


def rewrite_checkpoint(src: str, dst: str, transform, config_update: dict | None = None,
                       max_shard_size: str | None = None) -> str:
    """Copy checkpoint `src` to `dst` with its tensors passed through `transform(dict) -> dict`: one file, or
    shards of `max_shard_size` in the order `transform` returns them (as `save_pretrained` shards)."""
    import json
    import shutil

    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file, save_file

    if os.path.exists(os.path.join(dst, "config.json")):
        return dst
    os.makedirs(dst, exist_ok=True)
    tensors = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, name)))
        elif (name.endswith(".json") and name != "model.safetensors.index.json") or name.endswith(".py"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))  # config, and custom modeling code
    if max_shard_size is None:
        save_file({k: v.contiguous() for k, v in transform(tensors).items()}, os.path.join(dst, "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        save_torch_state_dict(transform(tensors), dst, max_shard_size=max_shard_size, metadata={"format": "pt"})
    if config_update:
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        config.update(config_update)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    return dst


def with_mtp_layer(dst: str, config, dtype: torch.dtype = torch.float32, max_shard_size: str = "10GB", seed: int = 0,
                   model_class=None) -> str:
    """A DeepSeek-V3-style checkpoint as the release ships it: `config.num_hidden_layers` layers and, numbered after
    them, the multi-token-prediction layer (`model.layers.61.*` in DeepSeek-V3, `model.layers.92.*` in GLM-4.5),
    which the model does not build and transformers leaves unloaded (`_keys_to_ignore_on_load_unexpected`): a whole
    decoder layer, its routed experts too, with `enorm`, `hnorm`, `eh_proj`, `shared_head` and `embed_tokens`.
    Sharded at `max_shard_size` as `save_pretrained` shards (the extra layer in the last shards, as released)."""
    import copy

    layers = config.num_hidden_layers
    longer = copy.deepcopy(config)
    longer.num_hidden_layers = layers + 1
    # lists with an entry per layer (`layer_types`, MiniMax-M3's `mlp_layer_types`, ...) get one for the extra layer
    per_layer = [k for k, v in config.to_dict().items() if isinstance(v, list) and len(v) == layers and v]
    for key in per_layer:
        setattr(longer, key, [*getattr(config, key), getattr(config, key)[-1]])
    full = make_checkpoint(dst + ".with_layer", "", dtype=dtype, config=longer, seed=seed, model_class=model_class)
    mtp, hidden, g = mtp_layer_prefix(config), config.hidden_size, torch.Generator().manual_seed(seed + 1)
    shapes = {"enorm.weight": (hidden,), "hnorm.weight": (hidden,), "shared_head.norm.weight": (hidden,),
              "eh_proj.weight": (hidden, 2 * hidden), "shared_head.head.weight": (config.vocab_size, hidden),
              "embed_tokens.weight": (config.vocab_size, hidden)}

    def add_mtp_parts(tensors: dict) -> dict:  # the model's layers first, then the extra one: it fills the last shards
        tensors = {**tensors, **{mtp + n: torch.randn(shape, generator=g).to(dtype) for n, shape in shapes.items()}}
        return dict(sorted(tensors.items(), key=lambda kv: kv[0].startswith(mtp)))

    return rewrite_checkpoint(full, dst, add_mtp_parts, max_shard_size=max_shard_size,
                              config_update={"num_hidden_layers": layers, **{k: getattr(config, k) for k in per_layer}})


def mtp_layer_prefix(config) -> str | None:
    """The key prefix of `with_mtp_layer`'s extra layer, for a config object or config.json's dict (None where the
    config keeps its depth elsewhere: a vision-language model's text_config)."""
    layers = config.get("num_hidden_layers") if isinstance(config, dict) else getattr(config, "num_hidden_layers", None)
    return None if layers is None else f"model.layers.{layers}."


def remote_code_checkpoint(src: str, dst: str) -> str:
    """`src` (a Llama checkpoint) as a hub repo with its own modeling code (`auto_map`, loaded with
    `trust_remote_code=True`): a subclass with a new model type and one extra parameter, saved in the checkpoint."""
    if os.path.exists(os.path.join(dst, "config.json")):
        return dst
    rewrite_checkpoint(src, dst, lambda t: {**t, "extra_scale": torch.arange(3, dtype=torch.float32) + 0.5},
                       {"model_type": "custom_llama", "architectures": ["CustomForCausalLM"],
                        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                                     "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}})
    with open(os.path.join(dst, "configuration_custom.py"), "w") as f:
        f.write("from transformers import LlamaConfig\n\n\nclass CustomConfig(LlamaConfig):\n"
                "    model_type = 'custom_llama'\n")
    with open(os.path.join(dst, "modeling_custom.py"), "w") as f:
        f.write("import torch\nfrom transformers import LlamaForCausalLM\n\nfrom .configuration_custom import "
                "CustomConfig\n\n\nclass CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n\n"
                "    def __init__(self, config):\n        super().__init__(config)\n"
                "        self.extra_scale = torch.nn.Parameter(torch.ones(3))\n        self.post_init()\n")
    return dst


REMOTE_MOE_CONFIG = """from transformers import DeepseekV3Config as _DeepseekV3Config


class DeepseekV3Config(_DeepseekV3Config):
    pass
"""

REMOTE_MOE_MODELING = """import torch
from torch import nn
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from .configuration_deepseek import DeepseekV3Config


class DeepseekV3MoE(nn.Module):
    \"\"\"The hub's DeepSeek-V3 MoE block: one module per routed expert.\"\"\"

    def __init__(self, config):
        super().__init__()
        self.experts = nn.ModuleList([hf.DeepseekV3MLP(config, intermediate_size=config.moe_intermediate_size)
                                      for _ in range(config.n_routed_experts)])
        self.gate = hf.DeepseekV3TopkRouter(config)
        self.shared_experts = hf.DeepseekV3MLP(
            config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, hidden_states):
        residuals, shape = hidden_states, hidden_states.shape
        _, topk_weights, topk_indices = self.gate(hidden_states)
        x = hidden_states.view(-1, shape[-1])
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(topk_indices == e)
            out = out.index_add(0, token, expert(x[token]) * topk_weights[token, slot, None].to(x.dtype))
        return out.view(*shape) + self.shared_experts(residuals)


class DeepseekV3Model(hf.DeepseekV3Model):
    config_class = DeepseekV3Config

    def __init__(self, config):
        super().__init__(config)
        for layer in self.layers:
            if isinstance(layer.mlp, hf.DeepseekV3MoE):
                layer.mlp = DeepseekV3MoE(config)
        self.post_init()


class DeepseekV3ForCausalLM(hf.DeepseekV3ForCausalLM):
    config_class = DeepseekV3Config

    def __init__(self, config):
        super().__init__(config)
        self.model = DeepseekV3Model(config)
        self.post_init()
"""


def _remote_moe_code(family: str) -> tuple[str, str]:
    """The config and modeling files of `remote_code_moe_checkpoint`: the hub's DeepSeek-V2 code has the same shape
    as its DeepSeek-V3 code (one module per routed expert), over transformers' DeepSeek-V2 classes."""
    if family == "deepseek_v3":
        return REMOTE_MOE_CONFIG, REMOTE_MOE_MODELING
    return (REMOTE_MOE_CONFIG.replace("DeepseekV3", "DeepseekV2"),
            REMOTE_MOE_MODELING.replace("deepseek_v3", "deepseek_v2").replace("DeepseekV3", "DeepseekV2")
            .replace("hf.DeepseekV2MoE", "hf.DeepseekV2Moe"))


def remote_code_moe_checkpoint(dst: str, config=None, dtype: torch.dtype = torch.float32, max_shard_size: str = "20KB",
                               seed: int = 0, family: str = "deepseek_v3") -> str:
    """A DeepSeek-V3 checkpoint as the hub ships it (`trust_remote_code=True`, model type `deepseek_v3`): its own
    modeling code, whose MoE blocks keep one module per routed expert (`mlp.experts.N.gate_proj.weight`, ...), the
    layout DeepSpeed's AutoEP preset for DeepSeek-V3 also takes (per-expert storage). Kimi-K2 reuses that code.
    `config`: a DeepseekV3Config (default: the expert-parallel tests' small one, with an odd hidden size, so that a
    stack of local experts splits unevenly over an expert-data-parallel group of 2 or 4). `family="deepseek_v2"`:
    the hub's DeepSeek-V2 code (DeepSeek-V2-Lite's), the same shape over DeepSeek-V2's classes."""
    if os.path.exists(os.path.join(dst, "config.json")):
        return dst
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(dst, exist_ok=True)
    for name, text in zip(("configuration_deepseek.py", "modeling_deepseek.py"), _remote_moe_code(family)):
        with open(os.path.join(dst, name), "w") as f:
            f.write(text)
    if config is None:
        config = ep_config(family)
        config.hidden_size = 27 if family == "deepseek_v3" else config.hidden_size
    stem = {"deepseek_v3": "DeepseekV3", "deepseek_v2": "DeepseekV2"}[family]
    config.architectures = [f"{stem}ForCausalLM"]
    config.auto_map = {"AutoConfig": f"configuration_deepseek.{stem}Config",
                       "AutoModelForCausalLM": f"modeling_deepseek.{stem}ForCausalLM"}
    config.save_pretrained(dst)
    config = AutoConfig.from_pretrained(dst, trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=dtype)
    with torch.no_grad():  # perturbed, as make_checkpoint does, so that mix-ups show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(dst, max_shard_size=max_shard_size)
    return dst


def ernie_moe_config():
    from transformers import Ernie4_5_MoeConfig

    return Ernie4_5_MoeConfig(vocab_size=101, hidden_size=28, intermediate_size=36, moe_intermediate_size=20,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=14,
                              moe_num_experts=4, moe_k=2, moe_layer_start_index=1, max_position_embeddings=64,
                              tie_word_embeddings=False)


def qwen3_vl_moe_config():
    from transformers import Qwen3VLMoeConfig

    return Qwen3VLMoeConfig(
        text_config=dict(vocab_size=101, hidden_size=28, intermediate_size=36, moe_intermediate_size=20,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=14,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=64,
                         rope_scaling={"rope_type": "default", "mrope_section": [2, 2, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=28,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0]),
    )


# Expert-parallel families: every model type DeepSpeed 0.19.8 has an AutoEP preset for. 6 experts (ep_size 1, 2, 3, 6;
# Mixtral 4: ep_size 4), odd expert and hidden sizes, so a local expert slice does not divide over an
# expert-data-parallel group of 2.
EP_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "qwen3_5_moe_text", "minimax_m3_vl_text")
OLMOE_EP_PATTERNS = {"moe_layer_pattern": r"model\.layers\.\d+\.mlp", "num_experts_attr": "num_experts",
                     "route_norm": False}
# model types DeepSpeed 0.19.8 has no AutoEP preset for, whose config names their structure (as engine-side AutoEP
# needs): a preset of the same structure (`preset_model`), or custom patterns (no preset fits Granite-MoE: its MoE
# block is `block_sparse_moe`, its router `router`)
EP_NAMED_STRUCTURE = {"olmoe": {"preset_model": "qwen3_moe"}, "glm4_moe": {"preset_model": "deepseek_v3"},
                      "minimax_m2": {"preset_model": "minimax_m3"},
                      "granitemoe": {"moe_layer_pattern": r"model\.layers\.\d+\.block_sparse_moe",
                                     "router_pattern": "router", "num_experts_attr": "num_local_experts"},
                      # a vision-language model: its MoE layers are the language model's, and AutoEP reads top_k from
                      # the top-level config, where Qwen3-VL-MoE has none (its text_config does)
                      "qwen3_vl_moe": {"preset_model": "qwen3_moe",
                                       "moe_layer_pattern": r"model\.language_model\.layers\.\d+\.mlp", "top_k": 2}}
# the auto class of an expert-parallel family that is not a causal LM
EP_MODEL_CLASS = {"qwen3_vl_moe": "AutoModelForImageTextToText"}


def ep_config(family: str):
    import transformers as T

    common = dict(vocab_size=101, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64, tie_word_embeddings=False, num_experts_per_tok=2)
    deepseek = dict(hidden_size=28, intermediate_size=22, moe_intermediate_size=11, n_routed_experts=6,
                    n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8,
                    qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1)
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(**common, hidden_size=27, head_dim=10, intermediate_size=22, moe_intermediate_size=11,
                                num_experts=6, decoder_sparse_step=1)
    if family == "qwen2_moe":
        return T.Qwen2MoeConfig(**common, hidden_size=28, intermediate_size=22, moe_intermediate_size=11,
                                shared_expert_intermediate_size=13, num_experts=6, decoder_sparse_step=1)
    if family == "mixtral":
        return T.MixtralConfig(**common, hidden_size=28, intermediate_size=11, num_local_experts=4)
    if family == "deepseek_v2":
        return T.DeepseekV2Config(**{**common, "num_key_value_heads": 2}, **deepseek, q_lora_rank=None)
    if family == "deepseek_v3":
        return T.DeepseekV3Config(**{**common, "num_key_value_heads": 2}, **deepseek, q_lora_rank=24)
    if family == "qwen3_5_moe_text":
        return T.Qwen3_5MoeTextConfig(**common, hidden_size=27, head_dim=10, moe_intermediate_size=11,
                                      shared_expert_intermediate_size=13, num_experts=6, linear_key_head_dim=8,
                                      linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2)
    if family == "olmoe":
        return T.OlmoeConfig(**common, hidden_size=28, intermediate_size=11, num_experts=6, bos_token_id=1,
                             eos_token_id=2, pad_token_id=0)
    if family == "glm4_moe":
        return T.Glm4MoeConfig(**common, hidden_size=28, head_dim=10, intermediate_size=22, moe_intermediate_size=11,
                               n_routed_experts=6, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1)
    if family == "minimax_m2":
        return T.MiniMaxM2Config(**common, hidden_size=27, head_dim=10, rotary_dim=10, intermediate_size=11,
                                 num_local_experts=6, bos_token_id=1, eos_token_id=2)
    if family == "granitemoe":
        return T.GraniteMoeConfig(**common, hidden_size=28, intermediate_size=11, num_local_experts=6, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0)
    if family == "qwen3_vl_moe":  # saved in the released layout (experts transposed), a vision tower beside
        text = dict(common, hidden_size=27, head_dim=10, intermediate_size=22, moe_intermediate_size=11, num_experts=6,
                    decoder_sparse_step=1, rope_scaling={"rope_type": "default", "mrope_section": [1, 2, 2]})
        return T.Qwen3VLMoeConfig(text_config=text, tie_word_embeddings=False, vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=27, patch_size=4,
            spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0]))
    if family == "minimax_m3_vl_text":
        return T.MiniMaxM3VLTextConfig(**common, hidden_size=27, head_dim=10, rotary_dim=10, intermediate_size=11,
                                       dense_intermediate_size=22, shared_intermediate_size=13, num_local_experts=6,
                                       bos_token_id=1, eos_token_id=2, index_n_heads=1, index_head_dim=8,
                                       index_block_size=4)
    raise ValueError(family)


def add_word_tokenizer(path: str, vocab_size: int) -> str:
    """A word-level tokenizer (`w3` ... `w{vocab_size-1}`, pad 0, eos 1, unk 2) saved next to a checkpoint: what TRL and
    the Trainer load from the model path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def trainable_moe_config():
    """A small Qwen3-MoE whose sizes are multiples of 8: transformers' grouped-GEMM experts on CPU need 16-byte
    strides, so the default (not eager) experts run as they would for a user."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=101, hidden_size=32, head_dim=16, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
                          pad_token_id=0, eos_token_id=1, bos_token_id=None)


def ernie4_5_vl_moe_config():
    """Ernie 4.5 VL MoE: text and vision experts fused by ErnieFuseAndSplitTextVisionExperts."""
    from transformers import AutoConfig

    default = AutoConfig.for_model("ernie4_5_vl_moe")
    text = {**default.text_config.to_dict(), "vocab_size": 101, "hidden_size": 64, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "rope_parameters": {**default.text_config.rope_parameters, "mrope_section": [4, 4, 8]},
            "moe_intermediate_size": [24, 12], "moe_k": 2, "moe_num_experts": 4, "moe_num_shared_experts": 1,
            "max_position_embeddings": 64}
    text.pop("layer_types", None)
    vision = {**default.vision_config.to_dict(), "depth": 1, "hidden_size": 32, "intermediate_size": 48,
              "num_heads": 2, "patch_size": 4, "spatial_merge_size": 2, "out_hidden_size": 64}
    return AutoConfig.for_model("ernie4_5_vl_moe", text_config=text, vision_config=vision)


def fp8_checkpoint(src: str, dst: str, block: tuple[int, int] = (128, 128), skip=("embed", "lm_head", "norm", ".gate.")) -> str:
    """Fine-grained FP8 in transformers' on-disk format, from a bf16/fp32 checkpoint: each 2-D Linear weight (but
    `skip`) as float8_e4m3fn with a float32 `weight_scale_inv` per block (amax / 448, ceil-sized grid), the rest as is;
    `quantization_config` names the skipped modules as `modules_to_not_convert`."""
    import json
    import math
    import shutil

    from safetensors.torch import load_file, save_file

    if os.path.exists(os.path.join(dst, "config.json")):
        return dst
    os.makedirs(dst)
    tensors = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, name)))
        elif name.endswith((".json", ".py")) and name != "model.safetensors.index.json":  # its own code travels too
            shutil.copy(os.path.join(src, name), dst)
    out = {}
    bm, bn = block
    for key, t in tensors.items():
        if t.dim() != 2 or not key.endswith(".weight") or any(s in key for s in skip):
            out[key] = t
            continue
        rows, cols = t.shape
        sr, sc = math.ceil(rows / bm), math.ceil(cols / bn)
        w = t.float()
        scale = torch.empty(sr, sc)
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(sr):
            for j in range(sc):
                tile = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
                scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
                q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
        out[key], out[key[: -len("weight")] + "weight_scale_inv"] = q, scale
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block),
                                     "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head", "gate"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def gpt_oss_config(hidden: int = 64):
    from transformers import GptOssConfig

    return GptOssConfig(num_hidden_layers=2, num_local_experts=4, hidden_size=hidden, intermediate_size=96,
                        vocab_size=101, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        max_position_embeddings=64, num_experts_per_tok=2,
                        layer_types=["sliding_attention", "full_attention"])


def mxfp4_checkpoint(src: str, dst: str, seed: int = 0) -> str:
    """GPT-OSS with its experts in MXFP4 as released: `*_blocks` [E, R, H/32, 16] uint8 (two FP4 values a byte) and
    `*_scales` [E, R, H/32] uint8 (E8M0 exponents), random; everything else as in `src`."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    if os.path.exists(os.path.join(dst, "config.json")):
        return dst
    os.makedirs(dst)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(src, name), dst)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, t in load_file(os.path.join(src, "model.safetensors")).items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, cols, rows = t.shape  # the model's [E, H, R]; on disk the transpose, packed
            out[key + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            out[key + "_scales"] = torch.randint(118, 134, (experts, rows, cols // 32), generator=g, dtype=torch.uint8)
        else:
            out[key] = t
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def pickled_checkpoint(src: str, dst: str) -> str:
    """The same checkpoint as one pickled `pytorch_model.bin` (torch.save of every tensor), configs copied."""
    import shutil

    if os.path.exists(os.path.join(dst, "config.json")):
        return dst
    os.makedirs(dst)
    state = state_dict_of(src, "checkpoint", None)
    for name in os.listdir(src):
        if name.endswith(".json") and not name.endswith(".index.json"):
            shutil.copy(os.path.join(src, name), dst)
    torch.save(state, os.path.join(dst, "pytorch_model.bin"))
    return dst


def state_dict_of(path: str, layout: str, model_class) -> dict:
    """A checkpoint's weights as a state dict: "checkpoint", the files' tensors under their stored names (per-expert
    keys that the conversion merges); "model", a plain load's own `state_dict()` (merged experts, tied weights under
    both names, sharing one tensor)."""
    import glob

    from safetensors.torch import load_file

    if layout == "model":  # seeded: what the checkpoint lacks (a new task head) is the same in every process
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return dict(model_class.from_pretrained(path, dtype=torch.float32).state_dict())
    state = {}
    for name in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        state.update(load_file(name))
    return state


def gguf_checkpoint(folder: str, name: str, quantized: bool, seed: int = 0) -> str:
    """A small Llama in a GGUF file (`gguf.GGUFWriter`, as llama.cpp writes one), random values; `quantized`: its
    linear weights in Q8_0 blocks, else all float32. transformers 5.23 loads Llama GGUF through its legacy loader,
    which hands the load a state dict of dequantized tensors. Returns the file's name in `folder`."""
    import gguf
    import numpy as np

    path = os.path.join(folder, name)
    if os.path.exists(path):
        return name
    os.makedirs(folder, exist_ok=True)
    vocab, hidden, ffn, layers, heads, kv_heads = 96, 64, 96, 2, 4, 2
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}".encode() for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([1] * vocab)
    rng = np.random.default_rng(seed)

    def tensor(key: str, *shape: int, linear: bool = False):
        values = rng.standard_normal(shape).astype(np.float32)
        if quantized and linear:  # Q8_0: blocks of 32 along the last dimension
            writer.add_tensor(key, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(key, values)

    kv = hidden // heads * kv_heads
    tensor("token_embd.weight", vocab, hidden)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", vocab, hidden, linear=True)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        for key, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                ("attn_output", hidden, hidden), ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden),
                                ("ffn_down", hidden, ffn)):
            tensor(f"blk.{i}.{key}.weight", rows, cols, linear=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return name
