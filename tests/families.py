"""The family sweep: every causal-LM model type of transformers 5.23 that can be built small from its own config
class, saved with `save_pretrained`, loaded through hf_zero3_loader and compared with the plain load.

`SWEEP` is the list the model cards claim (scripts/model_cards.py reads it); `tests/test_families.py` proves it.
A family whose config refuses the common small sizes gets its own (`SIZES_FOR`); one that cannot be built small
at all goes in `NOT_BUILT` with the reason, so a card never names it.
"""

from __future__ import annotations

import os

# Small sizes, applied to every config attribute that exists (at construction, so derived fields such as
# layer_types stay consistent); 2 layers, 4 experts, odd-free sizes that still split unevenly over 3 ranks.
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=97, max_position_embeddings=64, head_dim=16, moe_intermediate_size=24, num_experts=4,
             num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_num_experts=4, moe_k=2,
             shared_expert_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8,
             q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1,
             tie_word_embeddings=False)

SWEEP = (
    "afmoe", "apertus", "arcee", "aria_text", "axk1", "axk2", "bamba", "beam", "bert", "bert-generation", "big_bird",
    "biogpt", "bitnet", "blenderbot-small", "bloom", "camembert", "codegen", "cohere", "cohere2", "cohere2_moe",
    "cpmant", "ctrl", "cwm", "data2vec-text", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "doge",
    "dots1", "electra", "ernie", "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe", "falcon_h1", "falcon_mamba",
    "flint", "fuyu", "gemma", "gemma2", "gemma3_text", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt-sw3", "gpt2",
    "gpt_bigcode", "gpt_neo", "gpt_neox", "gpt_neox_japanese", "gpt_oss", "gptj", "granite", "granite_swa",
    "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "helium", "hrm_text", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "hy_v3", "hyperclovax", "inkling2_text", "inkling_text", "internlm3", "iquestcoder", "jais2",
    "jamba", "jetmoe", "kolibri1", "laguna", "lfm2", "llama", "llama4", "llama4_text", "longcat_flash", "mamba",
    "mamba2", "megatron-bert", "mellum", "mimo_v2_flash", "minicpm3", "minimax", "minimax_m2", "minimax_m3_vl_text",
    "ministral", "ministral3", "mistral", "mixtral", "moshi", "mpt", "nanochat", "nemotron", "nemotron_h", "olmo",
    "olmo2", "olmo3", "olmoe", "openai-gpt", "opt", "persimmon", "phi", "phimoe", "qwen2", "qwen2_moe", "qwen3",
    "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen4_exp",
    "qwen4_exp_text", "rembert", "roberta", "roberta-prelayernorm", "roformer", "rwkv", "seed_oss", "solar_open",
    "stablelm", "starcoder2", "trocr", "vaultgemma", "xglm", "xlm", "xlm-roberta", "xlm-roberta-xl", "xmod", "youtu",
    "zaya",
)
SWEEP_WORLD_SIZES = (2, 3, 4)

# causal-LM model types whose config validators refuse the small sizes above: sizes that fit them
SIZES_FOR = {
    "bamba": dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1),  # mamba heads must divide expand * hidden
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1),
    "gpt_neo": dict(num_layers=2, attention_types=[[["global", "local"], 1]], window_size=16),  # a pattern per layer
    "mamba2": dict(num_heads=4, head_dim=16, n_groups=1),  # heads * head_dim must be expand * hidden
    "zaya": dict(num_experts_per_tok=1),  # the only routing it supports
}
# per-layer lists in a text config that must be rebuilt for 2 layers
TEXT_LISTS_FOR = {"llama4": ("no_rope_layers", "moe_layers")}
NOT_BUILT: dict[str, str] = {}  # causal-LM model types that cannot be built small, with the reason


def small_config(model_type: str):
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    kwargs = {k: v for k, v in SMALL.items() if hasattr(default, k)}
    kwargs.update(SIZES_FOR.get(model_type, {}))
    text = getattr(default, "text_config", None)
    if text is not None:
        kwargs["text_config"] = {**text.to_dict(), **{k: v for k, v in SMALL.items() if hasattr(text, k)}}
        for key in ("layer_types", *TEXT_LISTS_FOR.get(model_type, ())):
            kwargs["text_config"].pop(key, None)
    return AutoConfig.for_model(model_type, **kwargs)


def sweep_checkpoint(workdir: str, model_type: str) -> str:
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(os.path.join(workdir, "sweep", model_type), model_type, config=small_config(model_type))
