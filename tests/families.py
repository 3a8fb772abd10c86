"""The family sweep: every causal-LM model type of transformers 5.23 that can be built small from its own config
class, saved with `save_pretrained`, loaded through hf_zero3_loader and compared with the plain load.

`SWEEP` is the list the model cards claim (scripts/model_cards.py reads it); `tests/test_families.py` proves it.
A family that cannot be built small is listed in `NOT_BUILT` with the reason, so a card never names it.
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
    "afmoe", "apertus", "arcee", "aria_text", "axk1", "axk2", "beam", "bert", "bert-generation", "big_bird", "biogpt",
    "bitnet", "blenderbot-small", "bloom", "camembert", "codegen", "cohere", "cohere2", "cohere2_moe", "cpmant",
    "ctrl", "cwm", "data2vec-text", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "doge", "dots1",
    "electra", "ernie", "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe", "falcon_h1", "falcon_mamba", "flint",
    "fuyu", "gemma", "gemma2", "gemma3_text", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt-sw3", "gpt2",
    "gpt_bigcode", "gpt_neox", "gpt_neox_japanese", "gpt_oss", "gptj", "granite", "granite_swa", "granitemoe",
    "granitemoe_swa", "granitemoeshared", "helium", "hrm_text", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3",
    "hyperclovax", "inkling2_text", "inkling_text", "internlm3", "iquestcoder", "jais2", "jamba", "jetmoe", "kolibri1",
    "laguna", "lfm2", "llama", "llama4_text", "longcat_flash", "mamba", "megatron-bert", "mellum", "mimo_v2_flash",
    "minicpm3", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mistral", "mixtral",
    "moshi", "mpt", "nanochat", "nemotron", "nemotron_h", "olmo", "olmo2", "olmo3", "olmoe", "openai-gpt", "opt",
    "persimmon", "phi", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text",
    "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen4_exp", "qwen4_exp_text", "rembert", "roberta",
    "roberta-prelayernorm", "roformer", "rwkv", "seed_oss", "solar_open", "stablelm", "starcoder2", "trocr",
    "vaultgemma", "xglm", "xlm", "xlm-roberta", "xlm-roberta-xl", "xmod", "youtu",
)
SWEEP_WORLD_SIZES = (2, 3)

# causal-LM model types left out: their config validators refuse the small sizes above
NOT_BUILT = {
    "bamba": "mamba_n_heads must divide the small sizes", "granitemoehybrid": "mamba_n_heads must divide the small sizes",
    "gpt_neo": "its attention layer pattern needs more layers", "llama4": "its layer types need more layers",
    "mamba2": "its head sizes do not fit the small hidden size", "zaya": "its architecture needs other sizes",
}


def small_config(model_type: str):
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    kwargs = {k: v for k, v in SMALL.items() if hasattr(default, k)}
    text = getattr(default, "text_config", None)
    if text is not None:
        kwargs["text_config"] = {**text.to_dict(), **{k: v for k, v in SMALL.items() if hasattr(text, k)}}
        kwargs["text_config"].pop("layer_types", None)
    return AutoConfig.for_model(model_type, **kwargs)


def sweep_checkpoint(workdir: str, model_type: str) -> str:
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(os.path.join(workdir, "sweep", model_type), model_type, config=small_config(model_type))
