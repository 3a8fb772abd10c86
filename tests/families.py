"""The family sweep: every causal-LM model type of transformers 5.23 that can be built small from its own config
class, saved with `save_pretrained`, loaded through hf_zero3_loader and compared with the plain load.

`SWEEP` is the list the model cards claim (scripts/model_cards.py reads it); `tests/test_families.py` proves it.
A family whose config refuses the common small sizes gets its own (`SIZES_FOR`); one that cannot be built small
at all goes in `NOT_BUILT` with the reason, so a card never names it.
"""

from __future__ import annotations

import os
import re

# Small sizes, applied to every config attribute that exists (at construction, so derived fields such as
# layer_types stay consistent); 2 layers, 4 experts, odd-free sizes that still split unevenly over 3 ranks.
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=97, max_position_embeddings=64, head_dim=16, moe_intermediate_size=24, num_experts=4,
             num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_num_experts=4, moe_k=2,
             shared_expert_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8,
             q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1,
             tie_word_embeddings=False)

SWEEP = (
    "afmoe", "apertus", "arcee", "aria_text", "axk1", "axk2", "bailing_hybrid", "bamba", "beam", "bert",
    "bert-generation", "big_bird", "biogpt", "bitnet", "blenderbot-small", "bloom", "camembert", "codegen", "cohere",
    "cohere2", "cohere2_moe", "cpmant", "ctrl", "cwm", "data2vec-text", "dbrx", "deepseek_v2", "deepseek_v3",
    "deepseek_v32", "deepseek_v4", "diffllama", "doge", "dots1", "electra", "ernie", "ernie4_5", "ernie4_5_moe",
    "exaone4", "exaone_moe", "falcon_h1", "falcon_mamba", "flex_olmo", "flint", "fuyu", "gemma", "gemma2",
    "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite",
    "glm_moe_dsa", "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gpt_neox_japanese", "gpt_oss", "gptj",
    "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "helium",
    "hrm_text", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hy_v4", "hyperclovax", "inkling2_text", "inkling_text",
    "internlm3", "iquestcoder", "jais2", "jamba", "jetmoe", "kimi_linear", "kolibri1", "laguna", "lfm2", "lfm2_moe",
    "lfm3", "llama", "llama4", "llama4_text", "longcat_flash", "mamba", "mamba2", "megatron-bert", "mellum",
    "mimo_v2_flash", "minicpm3", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mistral",
    "mixtral", "modernbert-decoder", "moshi", "mpt", "nanochat", "nemotron", "nemotron_h", "olmo", "olmo2", "olmo3",
    "olmo_hybrid", "olmoe", "openai-gpt", "opt", "persimmon", "phi", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3",
    "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen4_exp",
    "qwen4_exp_text", "recurrent_gemma", "reformer", "rembert", "roberta", "roberta-prelayernorm", "roformer", "rwkv",
    "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2", "trocr", "vaultgemma", "xglm", "xlm", "xlm-roberta",
    "xlm-roberta-xl", "xlstm", "xmod", "youtu", "zamba", "zamba2", "zaya",
)
SWEEP_WORLD_SIZES = (2, 3, 4)
# model types transformers 5.24 added (swept when the installed transformers has them; the cards name SWEEP's only):
# (auto class, model type). Dory also in its original layout, whose layer pairs 5.24's `LayerPairCollapse` renames.
NEW_IN_5_24 = (
    *(("AutoModelForCausalLM", t) for t in ("apertus1p5_text", "dory", "exaone", "inkling2_loop_text", "lara_mini",
                                            "sarvam_mla", "sarvam_moe")),
    *(("AutoModelForImageTextToText", t) for t in ("apertus1p5", "hy_v4_vl", "inkling2_loop")),
    ("AutoModelForSpeechSeq2Seq", "omniasr"), ("AutoModelForCTC", "omniasr_ctc"), ("AutoModel", "hy_v4_vl_text"),
)
# and those of its new types that are parts of the ones above (not loaded on their own here)
NOT_SWEPT_5_24 = ("apertus1p5_vision_tokenizer", "wavtokenizer", "wavtokenizer_encoder")
# swept untied, and also tied where their own config ties the output embedding, except: zamba ties its shared
# transformer blocks by a pattern transformers 5.23 itself rejects for 2 layers
NOT_TIED = ("zamba",)

# causal-LM model types whose config validators refuse the small sizes above: sizes that fit them
SIZES_FOR = {
    "bamba": dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1),  # mamba heads must divide expand * hidden
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1),
    "gpt_neo": dict(num_layers=2, attention_types=[[["global", "local"], 1]], window_size=16),  # a pattern per layer
    "mamba2": dict(num_heads=4, head_dim=16, n_groups=1),  # heads * head_dim must be expand * hidden
    "zaya": dict(num_experts_per_tok=1),  # the only routing it supports
    # its init zeroes the padding row of the loaded embedding on every load (a slice, past the loaded flag)
    "youtu": dict(pad_token_id=3),
    # configs whose sizes live under other names, or whose per-layer lists must be given for 2 layers
    "dbrx": dict(d_model=32, n_heads=2, n_layers=2, max_seq_len=64, attn_config={"kv_n_heads": 1, "rope_theta": 1e4},
                 ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2}),
    "diffllama": dict(num_key_value_heads=2),  # differential attention splits the KV heads in two
    "gemma3n_text": dict(intermediate_size=[48, 48], layer_types=["sliding_attention", "full_attention"],
                         activation_sparsity_pattern=[0.0, 0.0], num_kv_shared_layers=0, laurel_rank=4,
                         altup_num_inputs=2, vocab_size_per_layer_input=97, hidden_size_per_layer_input=8,
                         sliding_window=16),
    "gemma4_text": dict(layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=97,
                        hidden_size_per_layer_input=8, sliding_window=16),
    "gemma4_unified_text": dict(layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=97,
                                hidden_size_per_layer_input=8, sliding_window=16),
    "kimi_linear": dict(linear_num_heads=2, linear_head_dim=16),
    # its output rows (transformers 5.24: the unembedding holds these, the checkpoint pads it to the vocabulary)
    "inkling2_text": dict(unpadded_vocab_size=90),
    "inkling2_loop_text": dict(unpadded_vocab_size=90),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention"]),
    "reformer": dict(is_decoder=True, axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16],
                     attn_layers=["local", "lsh"], feed_forward_size=48, attention_head_size=16,
                     local_attn_chunk_length=8, lsh_attn_chunk_length=8, num_buckets=4),
    "xlstm": dict(embedding_dim=32, num_blocks=2, num_heads=2, chunk_size=8),
    "zamba": dict(layers_block_type=["mamba", "hybrid"], attention_hidden_size=64, attention_head_dim=32,
                  num_key_value_heads=2, mamba_d_state=8, mamba_dt_rank=4, use_mamba_kernels=False),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], mamba_d_state=8, n_mamba_heads=4, mamba_headdim=16,
                   num_key_value_heads=2, chunk_size=16, use_mamba_kernels=False, adapter_rank=4),
}
# special tokens the default config puts beyond the small vocabulary (an embedding's padding_idx must fit)
SMALL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# per-layer lists in a text config that must be rebuilt for 2 layers
TEXT_LISTS_FOR = {"llama4": ("no_rope_layers", "moe_layers")}
# causal-LM model types of transformers 5.23 in neither sweep, with the reason (the other types the causal-LM auto
# class knows are encoder-decoders and vision-language models, swept through their own auto classes in HEAD_SWEEP)
NOT_BUILT: dict[str, str] = {
    "blt": "its byte-level patcher and local models keep their sizes in nested configs: 4.6B parameters when shrunk",
    "cohere_compass_text": "its config refuses two small layers: KeyError 'full_attention'",
    "dots3_note": "a vision-language wrapper of dots3_note_text",
    "dots3_note_text": "its per-layer configs keep full-size attention ranks: 38M parameters when shrunk",
    "emu3": "the causal-LM class takes its text config only, not the composite one",
    "gemma3n": "a multimodal wrapper of gemma3n_text, which is swept",
    "gemma4": "a multimodal wrapper of gemma4_text, which is swept; swept whole in the head sweep",
    "gemma4_assistant": "a draft model: its config validator refuses the small layout",
    "gemma4_unified": "a multimodal wrapper of gemma4_text, which is swept; swept whole in the head sweep",
    "gemma4_unified_assistant": "a draft model: its config validator refuses the small layout",
    "marian": "a translation decoder; encoder-decoders are in the head sweep",
    "mllama": "the causal-LM class takes its text config only; swept as a vision-language model in the head sweep",
    "musicgen": "an audio decoder with a composite config",
    "musicgen_melody": "an audio decoder with a composite config",
    "phi4_multimodal": "its vision and audio towers keep their sizes: 870M parameters when shrunk",
    "roc_bert": "13.5M parameters when shrunk: pronunciation and shape vocabularies (the head sweep shrinks them)",
    "whisper": "a speech decoder; swept whole in the head sweep (speech recognition, audio classification)",
    "xlnet": "its config refuses max_position_embeddings; swept with its own sizes in the head sweep",
}


# The other heads people fine-tune under ZeRO-3: vision-language models, encoder-decoders, sequence classifiers
# (reward models), masked LMs, speech recognition (encoder-decoder and CTC), audio and image classifiers. Every model
# type of these auto classes that builds small from its own config, with its sub-configs (vision, audio, encoder,
# decoder) shrunk as well, to under 6M parameters. Masked LMs keep their configs' tied decoder (as they are used); the
# other heads are untied, so that every weight is read on its own. `AutoModel`: the bare models of every other type
# that builds small (dual encoders such as CLIP with their 0-dim `logit_scale`, vision and audio towers, SAM, time
# series, ...) and of the contrastive models whose other heads drop their `logit_scale`.
HEAD_SWEEP = {
    "AutoModel": (
        "aimv2", "aimv2_vision_model", "altclip", "audioflamingo3_encoder", "autoformer", "blip", "blip_2_qformer",
        "bridgetower", "bros", "chinese_clip", "chinese_clip_vision_model", "clap", "clip", "clip_text_model",
        "clip_vision_model", "clipseg", "clvp", "cohere_compass_vision", "cosmos3_edge_text", "cosmos3_edge_vision",
        "dac", "decision_transformer", "deit", "dinov3_convnext", "dinov3_vit", "dpr", "dpt", "embedding_gemma2",
        "embedding_gemma2_text", "encodec", "exaone4_5_vision", "fastspeech2_conformer", "flava", "focalnet",
        "fun_asr_nano_encoder", "gemma3n_audio", "gemma4_audio", "gemma4_vision", "glm4v_moe_text", "glm4v_moe_vision",
        "glm4v_text", "glm4v_vision", "glm5_next_text", "glm5_next_vision", "glm_image", "glm_image_text",
        "glm_image_vision", "glm_image_vqmodel", "glm_ocr_text", "glm_ocr_vision", "glmasr_encoder", "glpn",
        "granite_docling_text", "granite_docling_vision", "granite_speech5_encoder", "groupvit", "higgs_audio_v2",
        "hunyuan_vl_text", "hunyuan_vl_vision", "idefics3_vision", "informer", "inkling2_vision", "internvl_vision",
        "kimi_k25_vision", "kyutai_speech_to_text", "lasr_encoder", "lfm3_vl_vision", "lightglue", "lxmert",
        "maskformer-swin", "metaclip_2", "mgp-str", "mimi", "mimi_decoder", "mimi_encoder", "minicpm_ocr_vision",
        "minicpmv4_7_vision", "mistral_large4_text", "mlcd", "mlcd_vision_model", "mobilenet_v1", "mobilevit",
        "mobilevitv2", "molmo2_text", "moss_transcribe_diarize_audio", "muse_glimmer_assistant", "muse_glimmer_text",
        "muse_glimmer_vision", "muse_spark_audio", "muse_spark_text", "muse_spark_vision", "nemotron3_5_asr",
        "nemotron3_5_transcribe_asr_audio", "nemotron3_5_transcribe_audio", "nemotron3_5_transcribe_word_timestamp",
        "nemotron3_diarization", "nemotron3_diarization_audio", "nemotron_asr_streaming",
        "nemotron_asr_streaming_encoder", "neucodec", "openai_privacy_filter", "owlv2", "owlvit", "parakeet_encoder",
        "parakeet_rnnt", "parakeet_tdt", "patchtsmixer", "patchtst", "pe_audio", "pe_audio_encoder", "pixio", "pixtral",
        "pocket_tts_audio_tokenizer", "pocket_tts_audio_tokenizer_decoder", "pocket_tts_audio_tokenizer_encoder",
        "pp_ocrv5_mobile_rec", "pp_ocrv5_server_rec", "pp_ocrv6_small_det", "pp_ocrv6_small_rec", "pp_ocrv6_tiny_rec",
        "pvt_v2", "qianfan_ocr_vision", "qwen2_5_vl_text", "qwen2_5_vl_vision", "qwen2_audio_encoder", "qwen2_vl_text",
        "qwen3_5_moe_vision", "qwen3_5_vision", "qwen3_asr_encoder", "qwen3_vl_moe_text", "qwen3_vl_moe_vision",
        "qwen3_vl_text", "qwen3_vl_vision", "qwen4_exp_vision", "radio", "sam", "sam2_hiera_det_model",
        "sam2_vision_model", "sam3", "sam3_lite_text", "sam3_lite_text_text_model", "sam3_tracker",
        "sam3_tracker_video", "sam3_vision_model", "sam3_vit_model", "sam_hq", "sam_hq_vision_model",
        "sam_vision_model", "segformer", "seggpt", "siglip", "siglip2", "siglip2_vision_model", "siglip_vision_model",
        "smolvlm_vision", "speecht5", "splinter", "swiftformer", "t5gemma2_encoder", "time_series_transformer",
        "timesfm", "timesfm2_5", "timesformer", "tipsv2_text_model", "tipsv2_vision_model", "tvp", "univnet", "uvdoc",
        "vibevoice_acoustic_tokenizer", "vibevoice_acoustic_tokenizer_decoder", "vibevoice_acoustic_tokenizer_encoder",
        "video_llama_3_vision", "videomae", "videoprism", "videoprism_vision_model", "vilt", "vision-text-dual-encoder",
        "visual_bert", "vit_mae", "vitdet", "vivit", "voxtral_encoder", "voxtral_realtime_encoder", "xclip", "xcodec",
        "xcodec2",
    ),
    "AutoModelForAudioClassification": (
        "audio-spectrogram-transformer", "wav2vec2-bert", "wav2vec2-conformer", "whisper"),
    "AutoModelForCTC": (
        "data2vec-audio", "granite_speech5_ctc", "hubert", "lasr_ctc", "parakeet_ctc", "sew", "sew-d", "unispeech",
        "unispeech-sat", "wav2vec2", "wavlm"),
    "AutoModelForDepthEstimation": (
        "chmv2", "depth_anything", "depth_pro", "prompt_depth_anything", "tipsv2_dpt", "zoedepth"),
    "AutoModelForImageClassification": (
        "beit", "bit", "clip", "convnext", "convnextv2", "cvt", "data2vec-vision", "dinov2", "dinov2_with_registers",
        "donut-swin", "efficientnet", "hgnet_v2", "hiera", "ijepa", "imagegpt", "levit", "metaclip_2", "mobilenet_v2",
        "perceiver", "poolformer", "pp_lcnet", "pvt", "regnet", "resnet", "siglip", "siglip2", "swin", "swinv2",
        "textnet", "vit", "vit_msn"),
    "AutoModelForImageSegmentation": ("detr",),
    "AutoModelForImageTextToText": (
        "aria", "aya_vision", "blip", "blip-2", "chameleon", "cohere2_vision", "cohere_compass", "cosmos3_edge",
        "cosmos3_omni", "deepseek_ocr2", "deepseek_vl", "deepseek_vl_hybrid", "diffusion_gemma", "emu3",
        "ernie4_5_vl_moe", "exaone4_5", "florence2", "fuyu", "gemma3", "gemma4", "gemma4_unified", "git", "glm46v",
        "glm4v", "glm4v_moe", "glm5_next", "glm_ocr", "glmga", "got_ocr2", "granite4_vision", "granite_docling",
        "hunyuan_vl", "hyperclovax_vision_v2", "idefics", "idefics2", "idefics3", "inkling2", "inkling_mm_model",
        "instructblip", "instructblipvideo", "internvl", "janus", "kimi_k25", "kosmos-2", "kosmos-2.5", "lfm2_vl",
        "lfm3_vl", "lighton_ocr", "llava", "llava_next", "llava_next_video", "llava_onevision", "minicpm_ocr",
        "minicpmv4_6", "minicpmv4_7", "minimax_m3_vl", "mistral3", "mistral4", "mistral_large4", "mllama", "molmo2",
        "muse_glimmer", "muse_spark", "nemotron_h_omni", "ovis2", "paddleocr_vl", "paligemma", "pi0", "pix2struct",
        "pp_chart2table", "pp_formulanet", "qianfan_ocr", "qwen2_5_omni_thinker", "qwen2_5_vl", "qwen2_vl", "qwen3_5",
        "qwen3_5_moe", "qwen3_omni_moe_thinker", "qwen3_vl", "qwen3_vl_moe", "qwen4_exp", "shieldgemma2", "smolvlm",
        "step3p7", "udop", "unlimited_ocr", "video_llama_3", "video_llava", "vipllava", "vision-encoder-decoder"),
    "AutoModelForImageMatting": ("sapiens2", "vitmatte"),
    "AutoModelForImageToImage": ("swin2sr",),
    "AutoModelForKeypointDetection": ("superpoint",),
    "AutoModelForKeypointMatching": ("efficientloftr", "superglue"),
    "AutoModelForMaskGeneration": ("edgetam_video", "sam2", "sam2_video"),
    "AutoModelForMaskedLM": (
        "albert", "bart", "bert", "big_bird", "camembert", "convbert", "data2vec-text", "deberta", "deberta-v2",
        "distilbert", "electra", "ernie", "esm", "esmc", "eurobert", "flaubert", "fnet", "gte", "ibert",
        "jina_embeddings_v3", "layoutlm", "longformer", "luke", "mbart", "megatron-bert", "modernbert", "modernvbert",
        "mpnet", "mra", "mvp", "neomme", "nomic_bert", "nystromformer", "perceiver", "rembert", "roberta",
        "roberta-prelayernorm", "roc_bert", "roformer", "squeezebert", "tapas", "ultrabert", "ultravbert",
        "xlm-roberta", "xlm-roberta-xl", "xmod", "yoso"),
    "AutoModelForObjectDetection": (
        "conditional_detr", "d_fine", "dab-detr", "deformable_detr", "deimv2", "detr", "lw_detr", "pp_doclayout_v2",
        "pp_doclayout_v3", "pp_doclayout_v4", "pp_ocrv5_mobile_det", "pp_ocrv5_server_det", "pp_ocrv6_medium_det",
        "rf_detr", "rt_detr", "rt_detr_v2", "table-transformer", "yolos"),
    "AutoModelForPoseEstimation": ("sapiens2", "vitpose"),  # ViTPose+: a slice of experts per dataset
    "AutoModelForQuestionAnswering": ("distilbert", "flaubert", "luke", "squeezebert", "xlnet"),
    "AutoModelForSemanticSegmentation": ("beit", "sapiens2", "tipsv2_dpt", "upernet"),
    "AutoModelForSeq2SeqLM": (
        "audioflamingo3", "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "encoder-decoder", "fsmt",
        "glmasr", "granite_speech_plus", "led", "longt5", "m2m_100", "marian", "mbart", "moss_transcribe_diarize",
        "mt5", "musicflamingo", "mvp", "nemo_speechlm", "nllb-moe", "pegasus", "pegasus_x", "plbart", "prophetnet",
        "qwen2_audio", "qwen3_asr", "seamless_m4t", "seamless_m4t_v2", "switch_transformers", "t5", "t5gemma",
        "t5gemma2", "umt5", "vibevoice_asr", "voxtral", "voxtral_realtime"),
    "AutoModelForSequenceClassification": (
        "albert", "arcee", "axk1", "bart", "bert", "big_bird", "bigbird_pegasus", "biogpt", "bloom", "camembert",
        "canine", "convbert", "data2vec-text", "deberta", "deberta-v2", "deepseek_v2", "deepseek_v3", "distilbert",
        "doge", "electra", "ernie", "esm", "esmc", "eurobert", "exaone4", "falcon", "flaubert", "fnet", "funnel",
        "gemma", "gemma2", "gemma3", "gemma3_text", "glm", "glm4", "gpt_neox", "gpt_oss", "gte", "helium", "ibert",
        "jamba", "jetmoe", "jina_embeddings_v3", "layoutlm", "layoutlmv3", "lilt", "llama", "longformer", "luke",
        "markuplm", "mbart", "megatron-bert", "minicpm3", "minimax", "ministral3", "mistral", "mistral4", "mixtral",
        "mobilebert", "modernbert", "modernbert-decoder", "modernvbert", "mpnet", "mpt", "mra", "mt5", "mvp",
        "nomic_bert", "nystromformer", "olmo", "olmo2", "olmo3", "opt", "perceiver", "persimmon", "phi", "phi3",
        "phimoe", "plbart",
        "qwen2", "qwen2_moe", "qwen3", "qwen3_5", "qwen3_5_text", "qwen3_moe", "qwen3_next", "rembert", "roberta",
        "roberta-prelayernorm", "roc_bert", "roformer", "seed_oss", "smollm3", "squeezebert", "stablelm", "starcoder2",
        "t5", "t5gemma", "t5gemma2", "tapas", "ultrabert", "ultravbert", "umt5", "xlm-roberta", "xlm-roberta-xl",
        "xlnet", "xmod", "yoso"),
    "AutoModelForSpeechSeq2Seq": (
        "canary", "cohere_asr", "dia", "fun_asr_nano", "granite_speech", "granite_speech_plus", "moonshine",
        "moonshine_streaming", "pop2piano", "speech-encoder-decoder", "speech_to_text", "vibevoice", "vibevoice_asr",
        "whisper"),
    "AutoModelForTextToWaveform": (
        "bark", "csm", "fastspeech2_conformer_with_hifigan", "gradium_phonon_tts", "musicgen", "musicgen_melody",
        "pocket_tts", "qwen2_5_omni", "qwen3_omni_moe", "vibevoice", "vits"),
    "AutoModelForTokenClassification": (
        "distilbert", "esm", "esmc", "flaubert", "luke", "squeezebert", "t5gemma", "xlnet"),
    "AutoModelForUniversalSegmentation": ("eomt", "eomt_dinov3", "mask2former", "maskformer", "oneformer", "videomt"),
    "AutoModelForVideoClassification": ("vjepa2",),
    "AutoModelForZeroShotImageClassification": ("align", "tipsv2"),
    "AutoModelForZeroShotObjectDetection": ("grounding-dino", "mm-grounding-dino", "omdet-turbo"),
}
HEAD_SWEEP_WORLD_SIZE = 3
# model types the auto classes above know but no sweep covers, with the reason (transformers 5.23)
HEAD_NOT_SWEPT: dict[str, str] = {
    "cohere_compass_text": "its config refuses two small layers: KeyError 'full_attention'",
    "dinat": "needs the natten library",
    "dots3_note": "its text model's per-layer configs keep full-size attention ranks when shrunk",
    "edgetam": "its vision backbone is a timm model (needs timm and PIL); EdgeTAM video is swept",
    "evolla": "listed for AutoModelForImageTextToText, which refuses its config: a plain load fails too",
    "fast_vlm": "its vision tower is a timm model (needs timm and PIL)",
    "gemma3n": "its vision tower is a timm model (needs timm and PIL); its text model is in the family sweep",
    "layoutlmv2": "needs the detectron2 library",
    "perception_lm": "its vision tower is a timm model (needs timm and PIL)",
    "sam3_video": "its save_pretrained writes a sam3_tracker_video config, which AutoModelForMaskGeneration refuses: a "
                  "plain load of its own save fails",
    "timm_wrapper": "needs timm and PIL",
}
TIED_HEADS = ("AutoModelForMaskedLM",)
# sizes for sub-configs (vision towers, audio encoders, encoder-decoder stacks), on top of SMALL
SMALL_TOWERS = dict(depth=2, embed_dim=32, num_heads=2, out_hidden_size=32, image_size=32, patch_size=8, num_layers=2,
                    d_model=32, d_ff=48, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=48, d_kv=16, num_decoder_layers=2,
                    projection_dim=32, vision_output_dim=32, num_global_layers=1, intermediate_layers_indices=[0],
                    mm_hidden_size=32)
# per-layer lists that must be rebuilt for 2 layers
PER_LAYER_LISTS = ("layer_types", "no_rope_layers", "moe_layers", "mlp_only_layers", "fullatt_block_indexes",
                   "deepstack_visual_indexes", "vision_feature_layer", "mlp_layer_types", "kv_source_layers")
# a backbone's stages and the stages it outputs, rebuilt by its config from its (fewer) layers
NEW_STAGES = dict(stage_names=None, out_features=None, out_indices=None)
# the same, for configs that do not derive their stage names from their (2) layers
TWO_STAGES = dict(stage_names=["stem", "stage1", "stage2"], out_features=["stage2"], out_indices=[2])
VITPOSE_SIZES = dict(TWO_STAGES, image_size=[32, 24], patch_size=[8, 8], mlp_ratio=2, part_features=16, num_experts=3)
def small_tower(model_type: str) -> dict:
    """A sub-config a composite's default config leaves out (None), added as `model_type`'s defaults shrunk."""
    return {"model_type": model_type, "shrunk": True}


# small backbones for the detectors and segmenters (transformers' own classes: timm is not installed)
RESNET_BACKBONE = {"model_type": "resnet", "embedding_size": 16, "hidden_sizes": [16, 32], "depths": [1, 1],
                   "out_features": ["stage1", "stage2"]}
RESNET_4_STAGES = {**RESNET_BACKBONE, "hidden_sizes": [8, 16, 16, 32], "depths": [1, 1, 1, 1],
                   "out_features": ["stage1", "stage2", "stage3", "stage4"]}
SWIN_BACKBONE = {"model_type": "swin", "embed_dim": 16, "depths": [1, 1, 1, 1], "num_heads": [1, 1, 2, 2],
                 "window_size": 2, "image_size": 64, "patch_size": 4,
                 "out_features": ["stage1", "stage2", "stage3", "stage4"]}
DETR_SIZES = dict(use_timm_backbone=False, use_pretrained_backbone=False, num_queries=8, d_model=32, encoder_ffn_dim=48,
                  decoder_ffn_dim=48, backbone_config={**RESNET_BACKBONE, "out_features": ["stage2"]})
RT_DETR_SIZES = dict(use_pretrained_backbone=False, encoder_in_channels=[16, 32, 32], encoder_hidden_dim=32,
                     encoder_ffn_dim=48, encoder_attention_heads=2, d_model=32, decoder_in_channels=[32, 32, 32],
                     decoder_ffn_dim=48, decoder_layers=2, decoder_attention_heads=2, decoder_n_points=2, num_queries=8,
                     num_denoising=4,
                     backbone_config={"model_type": "rt_detr_resnet", "embedding_size": 16,
                                      "hidden_sizes": [16, 16, 32, 32], "depths": [1, 1, 1, 1],
                                      "out_features": ["stage2", "stage3", "stage4"]})
D_FINE_SIZES = dict(RT_DETR_SIZES, head_dim=16, lqe_hidden_dim=16,
                    backbone_config={"model_type": "hgnet_v2", "embedding_size": 16, "depths": [1, 1, 1, 1],
                                     "hidden_sizes": [16, 16, 32, 32], "stem_channels": [3, 8, 16],
                                     "stage_in_channels": [16, 16, 16, 32], "stage_mid_channels": [8, 8, 16, 16],
                                     "stage_out_channels": [16, 16, 32, 32], "stage_num_blocks": [1, 1, 1, 1],
                                     "stage_downsample": [False, True, True, True],
                                     "stage_downsample_strides": [2, 2, 2, 2],
                                     "stage_light_block": [False, False, True, True],
                                     "stage_kernel_size": [3, 3, 5, 5], "stage_numb_of_layers": [2, 2, 2, 2],
                                     "out_features": ["stage2", "stage3", "stage4"]})
# RT-DETR's encoder and decoder over all four HGNetV2 stages, with a mask branch and a reading-order head
PP_DOCLAYOUT_SIZES = dict({k: v for k, v in RT_DETR_SIZES.items() if k != "backbone_config"},
                          backbone_config=dict(D_FINE_SIZES["backbone_config"],
                                               out_features=["stage1", "stage2", "stage3", "stage4"]),
                          encoder_in_channels=[16, 32, 32], mask_feature_channels=[16, 16], x4_feat_dim=16,
                          global_pointer_head_size=16)
PP_OCR_DET_SIZES = dict(
    backbone_config=PP_DOCLAYOUT_SIZES["backbone_config"], neck_out_channels=16, kernel_list=[3, 2, 2],
    scale_factor_list=[2, 2, 2], intraclass_block_number=1,
    intraclass_block_config={"reduce_channel": [1, 1, 0], "return_channel": [1, 1, 0],
                             "vertical_long_to_small_conv_longratio": [[7, 1], 1, [3, 0]],
                             "vertical_long_to_small_conv_midratio": [[5, 1], 1, [2, 0]],
                             "vertical_long_to_small_conv_shortratio": [[3, 1], 1, [1, 0]],
                             "horizontal_small_to_long_conv_longratio": [[1, 7], 1, [0, 3]],
                             "horizontal_small_to_long_conv_midratio": [[1, 5], 1, [0, 2]],
                             "horizontal_small_to_long_conv_shortratio": [[1, 3], 1, [0, 1]],
                             "symmetric_conv_long_longratio": [7, 1, 3], "symmetric_conv_long_midratio": [5, 1, 2],
                             "symmetric_conv_long_shortratio": [3, 1, 1]})
SAM_SIZES = dict(output_channels=16, window_size=2, global_attn_indexes=[1], mlp_dim=48)  # SAM-style image towers
GROUNDING_DINO_SIZES = dict(use_timm_backbone=False, num_queries=8, d_model=32, encoder_ffn_dim=48,
                            decoder_ffn_dim=48, encoder_attention_heads=2, decoder_attention_heads=2,
                            num_feature_levels=3, encoder_n_points=2, decoder_n_points=2, max_text_len=16,
                            backbone_config={**SWIN_BACKBONE, "depths": [1, 1, 1], "num_heads": [1, 2, 2],
                                             "out_features": ["stage1", "stage2", "stage3"]})
DEPTH_ANYTHING_SIZES = dict(backbone_config={"model_type": "dinov2", "hidden_size": 32, "num_hidden_layers": 4,
                                             "num_attention_heads": 2, "intermediate_size": 48, "image_size": 28,
                                             "patch_size": 14, "out_indices": [1, 2, 3, 4],
                                             "reshape_hidden_states": False},
                            reassemble_hidden_size=32, neck_hidden_sizes=[8, 16, 24, 32], fusion_hidden_size=16,
                            head_hidden_size=8)
GRANITE_SPEECH_SIZES = dict(audio_token_index=3, projector_config=dict(encoder_hidden_size=32),
                            encoder_config=dict(input_dim=16, hidden_dim=32, dim_head=16, output_dim=8, context_size=16,
                                                max_pos_emb=32))
VIBEVOICE_ENCODER = dict(num_filters=8, hidden_size=16, downsampling_ratios=[2, 2], depths=[1, 1, 1], ffn_expansion=2)
SMALL_DPT_NECK = dict(neck_hidden_sizes=[8, 16, 16, 32], fusion_hidden_size=16)  # DPT-style depth heads
DEPTH_PRO_TOWER = dict(NEW_STAGES, out_indices=[2], image_size=32, patch_size=8)  # one feature from 2 DINOv2 layers
ENCODEC_SMALL = dict(num_filters=8, upsampling_ratios=[2, 2], codebook_size=16, codebook_dim=8, num_lstm_layers=1)
BARK_SUB_MODEL = dict(input_vocab_size=96, output_vocab_size=96, block_size=64)
CONFORMER_SMALL = dict(num_attention_heads=2, layers=2, kernel_size=7, attention_dropout_rate=0.2, dropout_rate=0.2,
                       positional_dropout_rate=0.2, linear_units=48, normalize_before=False, concat_after=False)
SAM2_SIZES = dict(vision_config=dict(backbone_config=dict(hidden_size=16, embed_dim_per_stage=[16, 32, 32, 32],
                                                          num_attention_heads_per_stage=[1, 1, 2, 2],
                                                          blocks_per_stage=[1, 1, 1, 1],
                                                          window_size_per_stage=[2, 2, 2, 2],
                                                          global_attention_blocks=[2], image_size=64,
                                                          window_positional_embedding_background_size=[2, 2]),
                                     backbone_channel_list=[32, 32, 32, 16], fpn_hidden_size=32,
                                     backbone_feature_sizes=[[16, 16], [8, 8], [4, 4]]),
                  mask_decoder_config=dict(mlp_dim=48, iou_head_hidden_dim=16),
                  prompt_encoder_config=dict(image_size=64, patch_size=16))
SAM2_VIDEO_MEMORY = dict(image_size=64, memory_attention_hidden_size=32, memory_attention_rope_feat_sizes=[4, 4],
                         memory_encoder_hidden_size=32, memory_encoder_output_channels=16,
                         mask_downsampler_embed_dim=32, memory_fuser_embed_dim=32, memory_fuser_intermediate_dim=48,
                         num_maskmem=2, memory_attention_num_layers=1)
# DAC codec: 2 strides of 2 (encoder channels double per stride: 8 -> 32 = hidden), 2 codebooks of 16
DAC_SMALL = dict(encoder_hidden_size=8, downsampling_ratios=[2, 2], decoder_hidden_size=32, upsampling_ratios=[2, 2],
                 n_codebooks=2, codebook_size=16, codebook_dim=8, hop_length=4)
# Mimi codec (the one in csm's codec_config): its upsample conv is grouped by upsample_groups, which must divide
# the (shrunk) hidden size
MIMI_SMALL = dict(num_filters=8, upsampling_ratios=[2, 2], codebook_size=16, codebook_dim=8, num_quantizers=4,
                  vector_quantization_hidden_dimension=8, upsample_groups=16, sliding_window=16)
# RNN-T / TDT speech recognisers: a small prediction network and subsampling convs; the encoders' attention keeps as
# many KV heads as query heads (as nemo_speechlm's: transformers' save fuses q/k/v and splits them back in thirds)
RNNT_SMALL = dict(decoder_hidden_size=32, encoder_config=dict(subsampling_conv_channels=16, num_mel_bins=16,
                                                              num_key_value_heads=2))
# time-series transformers: no default horizon (their validator needs one)
TIME_SERIES = dict(prediction_length=8, context_length=8)
# wav2vec2-BERT semantic encoder of XCodec2 / NeuCodec
W2V_BERT_SMALL = dict(feature_projection_input_dim=16, output_hidden_size=32, classifier_proj_size=16,
                      conv_depthwise_kernel_size=7, tdnn_dim=[16, 16], tdnn_kernel=[3, 1], tdnn_dilation=[1, 1],
                      xvector_output_dim=16)
# the quantizer projects hidden + semantic hidden (32 + 32) to FSQ levels
XCODEC2_SMALL = dict(encoder_hidden_size=8, downsampling_ratios=[2, 2], quantization_dim=64,
                     quantization_levels=[4, 4, 4, 4], semantic_model_config=W2V_BERT_SMALL)
# Nemotron diarization: its head reads the audio tower's hidden size
DIARIZATION = dict(head_config=dict(audio_hidden_size=32), audio_config=dict(num_key_value_heads=2, num_mel_bins=16))
# head-sweep model types whose sizes live under other names or in per-stage lists (text models with their own
# names, vision backbones, detectors, segmenters, depth estimators) or whose sub-configs must agree: sizes that build
# them small. A sub-config given without a model_type changes the shrunk one; with a model_type it replaces it.
HEAD_SIZES_FOR: dict[str, dict] = {
    # text
    "nllb-moe": dict(encoder_sparse_step=1, decoder_sparse_step=1),  # experts in both layers (its default: every 4th)
    # text models of vision-language families (MoE among them) that only AutoModel knows: per-layer lists for 2
    # layers (a dense and a sparse MLP), sizes their validators accept
    "cosmos3_edge_text": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e8, "mrope_section": [4, 2, 2]}),
    "embedding_gemma2": dict(text_config=dict(per_layer_config={"1": {"head_dim": 32, "num_key_value_heads": 1}})),
    "embedding_gemma2_text": dict(per_layer_config={"1": {"head_dim": 32, "num_key_value_heads": 1}}),
    "glm5_next_text": dict(num_key_value_heads=2, qk_rope_head_dim=0, qk_head_dim=16, linear_head_dim=16,
                           index_head_dim=16, index_topk=16, layer_types=["indexed_attention", "linear_attention"],
                           mlp_layer_types=["dense", "sparse"]),  # no RoPE, heads equal KV heads: its validator
    "hunyuan_vl_text": dict(head_dim=16),  # None by default (derived), so not shrunk with the rest
    "mistral_large4_text": dict(mlp_layer_types=["dense", "sparse"]),
    "muse_spark_text": dict(moe_hidden_size=48, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                            mlp_layer_types=["sparse", "sparse"]),
    "distilbert": dict(dim=32, hidden_dim=48, n_layers=2, n_heads=2),
    "esm": dict(vocab_size=33, pad_token_id=1, mask_token_id=32),  # protein LMs: no default vocabulary
    "esmc": dict(num_key_value_heads=2),  # refuses grouped-query attention
    "flaubert": dict(emb_dim=32, n_layers=2, n_heads=2),
    "luke": dict(entity_vocab_size=50, entity_emb_size=16),
    "roc_bert": dict(pronunciation_vocab_size=16, shape_vocab_size=16, pronunciation_embed_dim=8, shape_embed_dim=8),
    "xlnet": dict(d_model=32, n_layer=2, n_head=2, d_inner=48, d_head=16),
    "neomme": dict(per_layer_config={"01": {"sliding_window": None}}, embedding_rank=16, embedding_dim=16,
                   sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
    "squeezebert": dict(embedding_size=32, q_groups=2, k_groups=2, v_groups=2, intermediate_groups=2, output_groups=2),
    # vision backbones: 2 stages of 1 block
    "beit": dict(num_hidden_layers=4, out_indices=[1, 2, 3, 4], stage_names=None, out_features=None),  # 4 for FPN
    "bit": dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_groups=4, **NEW_STAGES),
    "convnext": dict(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], **NEW_STAGES),
    "convnextv2": dict(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], **NEW_STAGES),
    "cvt": dict(patch_sizes=[7, 3], patch_stride=[4, 2], patch_padding=[2, 1], embed_dim=[16, 32], num_heads=[1, 2],
                depth=[1, 2], mlp_ratio=[2.0, 2.0], attention_drop_rate=[0.0, 0.0], drop_rate=[0.0, 0.0],
                drop_path_rate=[0.0, 0.0], qkv_bias=[True, True], cls_token=[False, True],
                qkv_projection_method=["dw_bn", "dw_bn"], kernel_qkv=[3, 3], padding_kv=[1, 1], stride_kv=[2, 2],
                padding_q=[1, 1], stride_q=[1, 1]),
    "dinov2": NEW_STAGES,
    "dinov2_with_registers": NEW_STAGES,
    "donut-swin": dict(embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=2, patch_size=4),
    "efficientnet": dict(image_size=32, kernel_sizes=[3, 3], in_channels=[16, 16], out_channels=[16, 24],
                         strides=[1, 2], num_block_repeats=[1, 1], expand_ratios=[1, 2], hidden_dim=64,
                         width_coefficient=1.0, depth_coefficient=1.0, depthwise_padding=[]),
    "hgnet_v2": dict(embedding_size=16, depths=[1, 1], hidden_sizes=[32, 64], stem_channels=[3, 8, 16],
                     stage_in_channels=[16, 32], stage_mid_channels=[8, 16], stage_out_channels=[32, 64],
                     stage_num_blocks=[1, 1], stage_downsample=[False, True], stage_downsample_strides=[2, 2],
                     stage_light_block=[False, True], stage_kernel_size=[3, 5], stage_numb_of_layers=[2, 2],
                     **NEW_STAGES),
    "hiera": dict(embed_dim=16, image_size=[64, 64], patch_size=[7, 7], depths=[1, 1], num_heads=[1, 2],
                  num_query_pool=1, masked_unit_attention=[True, False], **NEW_STAGES),
    "imagegpt": dict(n_embd=32, n_layer=2, n_head=2, n_positions=64),
    "poolformer": dict(depths=[1, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1],
                       num_encoder_blocks=2),
    "pvt": dict(num_encoder_blocks=2, depths=[1, 1], sequence_reduction_ratios=[2, 1], hidden_sizes=[16, 32],
                patch_sizes=[4, 2], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2]),
    "regnet": dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8),
    "resnet": dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], **NEW_STAGES),
    "swin": dict(embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=2, patch_size=4, **NEW_STAGES),
    "swinv2": dict(embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=2, patch_size=4,
                   pretrained_window_sizes=[0, 0], **NEW_STAGES),
    "textnet": dict(stem_out_channels=16, image_size=[32, 32], hidden_sizes=[16, 16, 32], depths=[1, 1],
                    conv_layer_kernel_sizes=[[[3, 3]], [[3, 3]]], conv_layer_strides=[[1], [2]], **NEW_STAGES),
    # ViT backbones of 2 layers: matting, and ViTPose(+) with experts in every layer's MLP (a shared part and one
    # slice per dataset, chosen by dataset index)
    "vitmatte": dict(backbone_config=dict(TWO_STAGES, image_size=32, pretrain_image_size=32, patch_size=8)),
    "vitpose": dict(backbone_config=dict(VITPOSE_SIZES)),
    "vitpose_backbone": VITPOSE_SIZES,
    # detectors (DETR's segmentation head convolves d_model + heads channels in groups of 8, over 4 stages)
    "conditional_detr": DETR_SIZES,
    "dab-detr": dict(DETR_SIZES, hidden_size=32),
    "deformable_detr": dict(DETR_SIZES, backbone_config=RESNET_BACKBONE, num_feature_levels=2, encoder_n_points=2,
                            decoder_n_points=2, two_stage_num_proposals=8),
    "detr": dict(DETR_SIZES, encoder_attention_heads=8, decoder_attention_heads=8, backbone_config=RESNET_4_STAGES),
    "table-transformer": DETR_SIZES,
    "yolos": dict(image_size=[32, 48], num_detection_tokens=8),
    "rt_detr": RT_DETR_SIZES,
    "rt_detr_v2": RT_DETR_SIZES,
    "d_fine": D_FINE_SIZES,
    "pp_doclayout_v2": PP_DOCLAYOUT_SIZES,
    "pp_doclayout_v3": PP_DOCLAYOUT_SIZES,
    "pp_doclayout_v4": PP_DOCLAYOUT_SIZES,
    # text detectors: an HGNetV2 backbone, a neck of intra-class convolution blocks (their default configs leave the
    # blocks' kernels unset), a differentiable-binarization head
    "pp_ocrv5_server_det": PP_OCR_DET_SIZES,
    "pp_ocrv6_medium_det": PP_OCR_DET_SIZES,
    "deimv2": D_FINE_SIZES,
    # vision-language models whose sub-configs must agree with each other
    # Gemma 4's default config has no towers: its vision and audio towers are added, small
    "gemma4": dict(text_config=dict(SIZES_FOR["gemma4_text"], per_layer_config={}),
                   vision_config=small_tower("gemma4_vision"), audio_config=small_tower("gemma4_audio")),
    "gemma4_unified": dict(text_config=dict(SIZES_FOR["gemma4_unified_text"], per_layer_config={})),
    "cosmos3_edge": dict(projector_hidden_size=48, vision_config=dict(num_patches=16),
                         text_config=dict(rope_parameters={"rope_type": "default", "rope_theta": 1e8,
                                                           "mrope_section": [4, 2, 2]})),
    "deepseek_vl_hybrid": dict(high_res_vision_config=dict(SAM_SIZES, num_pos_feats=16)),
    # transformers 5.24's (NEW_IN_5_24): token ranges inside the small vocabulary, small tokenizer towers, and
    # rotary sections that add up to the small rotary dims
    "apertus1p5": dict(image_token_id=3, audio_token_id=4, image_token_offset=60, audio_token_offset=76,
                       vision_config=dict(codebook_size=16, embed_dim=8, latent_channels=8, base_channels=32,
                                          channel_multiplier=[1, 2], num_res_blocks=1, attn_resolutions=[4],
                                          resolution=8),
                       audio_config=dict(codebook_size=8, codebook_dim=32, num_filters=4, upsampling_ratios=[2, 2],
                                         num_lstm_layers=1)),
    "hy_v4_vl": dict(text_config=dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                       "mrope_section": [2, 1, 1]})),
    "hy_v4_vl_text": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1]}),
    "inkling2_loop": dict(vision_config=dict(text_hidden_size=32, projection_hidden_dim=48, posemb_grid_size=4),
                          text_config=dict(unpadded_vocab_size=90, swa_num_attention_heads=2, swa_num_key_value_heads=1,
                                           swa_head_dim=16, sliding_window_size=16)),
    "inkling2": dict(vision_config=dict(text_hidden_size=32, projection_hidden_dim=48, posemb_grid_size=4),
                     text_config=dict(unpadded_vocab_size=97, swa_num_attention_heads=2, swa_num_key_value_heads=1,
                                      swa_head_dim=16, sliding_window_size=16)),
    "muse_spark": dict(projector_hidden_size=48, text_config=dict(layer_rope_theta=[500000.0, 0], moe_hidden_size=32),
                       audio_config=dict(patch_sizes=[16, 6], hidden_sizes=[16, 32], depths=[1, 1])),
    "florence2": dict(vision_config=dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                                         patch_prenorm=[False, True], embed_dim=[16, 32], num_heads=[1, 2],
                                         num_groups=[1, 2], window_size=2)),
    "janus": dict(vision_config=dict(num_image_tokens=16),
                  vq_config=dict(num_embeddings=64, latent_channels=8, base_channels=32, channel_multiplier=[1, 2],
                                 num_res_blocks=1, num_patches=4, image_token_embed_dim=32)),
    "muse_glimmer": dict(projector_hidden_size=48, text_config=dict(layer_rope_theta=[10000.0, 0])),
    "nemotron_h_omni": dict(projector_hidden_size=48, vision_hidden_size=32,
                            text_config=dict(layers_block_type=["mamba", "moe"], ssm_state_size=8, mamba_num_heads=4,
                                             mamba_head_dim=16, n_groups=1, chunk_size=16,
                                             moe_shared_expert_intermediate_size=24),
                            vision_config=dict(num_registers=1, max_img_size=64, patch_dim=192, video_patch_dim=384)),
    "pp_formulanet": dict(vision_config=dict(SAM_SIZES, post_conv_in_channels=16, post_conv_out_channels=32,
                                             post_conv_mid_channels=16, decoder_hidden_size=32)),
    "kosmos-2": dict(text_config=dict(layers=2, ffn_dim=48, attention_heads=2), latent_query_num=4),
    # zero-shot and video models
    "align": dict(projection_dim=32,
                  vision_config=dict(kernel_sizes=[3, 3], in_channels=[16, 16], out_channels=[16, 24], strides=[1, 2],
                                     num_block_repeats=[1, 1], expand_ratios=[1, 2], hidden_dim=64,
                                     width_coefficient=1.0, depth_coefficient=1.0)),
    "grounding-dino": GROUNDING_DINO_SIZES,
    # a ViT backbone with windowed blocks and a projector (its checkpoint stores q/k/v apart: renames only)
    "lw_detr": dict(backbone_config={"model_type": "lw_detr_vit", "hidden_size": 32, "num_hidden_layers": 2,
                                     "num_attention_heads": 2, "image_size": 64, "pretrain_image_size": 32,
                                     "patch_size": 16, "window_block_indices": [0], "num_windows": 4,
                                     "out_indices": [1, 2]},
                    projector_scale_factors=[1.0], num_feature_levels=1, projector_in_channels=[32, 32],
                    projector_out_channels=32, d_model=32, decoder_ffn_dim=48, decoder_layers=2,
                    decoder_self_attention_heads=2, decoder_cross_attention_heads=2, decoder_n_points=2,
                    num_queries=8, group_detr=2, c2f_num_blocks=1),
    # a windowed DINOv2 backbone; its checkpoint stores the decoder's self-attention as one fused in_proj_weight
    # and in_proj_bias, which transformers' conversion splits into q/k/v on load
    "rf_detr": dict(backbone_config={"model_type": "rf_detr_dinov2", "hidden_size": 32, "num_hidden_layers": 2,
                                     "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
                                     "window_block_indexes": [0], "out_indices": [1, 2]},
                    d_model=32, decoder_ffn_dim=48, decoder_layers=2, decoder_self_attention_heads=2,
                    decoder_cross_attention_heads=2, decoder_n_points=2, num_queries=8, group_detr=2,
                    c2f_num_blocks=1, intermediate_size=48),
    # transformers' Swin instead of the default timm backbone, a small CLIP text tower
    "omdet-turbo": dict(use_timm_backbone=False,
                        backbone_config={**SWIN_BACKBONE, "depths": [1, 1, 1], "num_heads": [1, 2, 2],
                                         "out_features": None, "out_indices": [1, 2, 3]},
                        text_config={"model_type": "clip_text_model", "vocab_size": 97, "hidden_size": 32,
                                     "intermediate_size": 48, "projection_dim": 32, "num_hidden_layers": 2,
                                     "num_attention_heads": 2, "max_position_embeddings": 16,
                                     "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
                        apply_layernorm_after_vision_backbone=False, class_embed_dim=32, d_model=16,
                        decoder_hidden_dim=16, image_size=64, decoder_dim_feedforward=48, decoder_num_heads=2,
                        decoder_num_layers=2, decoder_num_points=2, encoder_dim_feedforward=48,
                        encoder_in_channels=[16, 32, 64], num_queries=8, task_encoder_hidden_dim=48,
                        text_projection_in_dim=32, text_projection_out_dim=32, vision_features_channels=[16, 16, 16],
                        cache_size=8),
    "mm-grounding-dino": GROUNDING_DINO_SIZES,
    "vjepa2": dict(patch_size=8, crop_size=32, frames_per_clip=4, num_pooler_layers=1, pred_hidden_size=32,
                   pred_num_attention_heads=2, pred_num_hidden_layers=2, pred_num_mask_tokens=2),
    "sam2": SAM2_SIZES,
    # speech and audio models
    "musicgen": dict(decoder=dict(ffn_dim=48), audio_encoder=ENCODEC_SMALL),
    "musicgen_melody": dict(decoder=dict(ffn_dim=48), audio_encoder=ENCODEC_SMALL),
    "bark": dict(semantic_config=BARK_SUB_MODEL, coarse_acoustics_config=BARK_SUB_MODEL,
                 fine_acoustics_config=dict(BARK_SUB_MODEL, n_codes_total=4, n_codes_given=1),
                 codec_config=ENCODEC_SMALL),
    "csm": dict(num_codebooks=4, text_vocab_size=97, codebook_pad_token_id=2,
                depth_decoder_config=dict(num_codebooks=4, backbone_hidden_size=32),
                codec_config=dict(num_filters=8, upsampling_ratios=[2, 2], codebook_size=16, codebook_dim=8,
                                  num_quantizers=4, vector_quantization_hidden_dimension=8, upsample_groups=16,
                                  sliding_window=16)),  # a Mimi codec
    # the conformer's sizes live in derived encoder/decoder dicts, which a saved config carries and wins with
    "fastspeech2_conformer_with_hifigan": dict(
        model_config=dict(num_mel_bins=16, encoder_linear_units=48, decoder_linear_units=48, decoder_kernel_size=7,
                          speech_decoder_postnet_layers=2, speech_decoder_postnet_units=16,
                          duration_predictor_channels=16, energy_predictor_channels=16, pitch_predictor_layers=2,
                          pitch_predictor_channels=16, max_source_positions=64,
                          encoder_config=CONFORMER_SMALL, decoder_config=CONFORMER_SMALL),
        vocoder_config=dict(model_in_dim=16, upsample_initial_channel=16, upsample_rates=[2, 2],
                            upsample_kernel_sizes=[4, 4], resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]])),
    "granite_speech5_ctc": dict(encoder_config=dict(context_size=16)),
    "qwen2_5_omni": dict(talker_config=dict(embedding_size=32, max_window_layers=2),  # the thinker's hidden size
                         token2wav_config=dict(
                             dit_config=dict(emb_dim=16, num_embeds=16, mel_dim=16, enc_emb_dim=16, enc_dim=16,
                                             enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8,
                                             enc_se_channels=8, look_ahead_layers=[1], look_backward_layers=[0, 1]),
                             bigvgan_config=dict(mel_dim=16, upsample_initial_channel=32, resblock_kernel_sizes=[3],
                                                 resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[2, 2],
                                                 upsample_kernel_sizes=[4, 4]))),
    # its MoE thinker and MoE talker small; the talker's config classes leave out two fields its modeling code reads
    "qwen3_omni_moe": dict(thinker_config=dict(audio_config=dict(output_dim=32, downsample_hidden_size=16)),
                           talker_config=dict(thinker_hidden_size=32, spatial_merge_size=2,
                                              text_config=dict(shared_expert_intermediate_size=24),
                                              codec_eos_token_id=90, codec_nothink_id=91, codec_think_bos_id=92,
                                              codec_think_eos_id=93, codec_pad_id=94, codec_bos_id=95),
                           code2wav_config=dict(codebook_size=16, decoder_dim=32, upsample_rates=[2, 2],
                                                sliding_window=16)),
    "vits": dict(hidden_size=32, ffn_dim=48, flow_size=16, spectrogram_bins=17, upsample_initial_channel=16,
                 upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4], resblock_kernel_sizes=[3],
                 resblock_dilation_sizes=[[1, 3]], duration_predictor_filter_channels=16,
                 duration_predictor_num_flows=2, prior_encoder_num_flows=2, prior_encoder_num_wavenet_layers=2,
                 posterior_encoder_num_wavenet_layers=2),
    "dia": dict(decoder_config=dict(cross_num_attention_heads=2, cross_head_dim=16, cross_num_key_value_heads=1,
                                    cross_hidden_size=32, num_channels=3), delay_pattern=[0, 1, 2]),
    "granite_speech": GRANITE_SPEECH_SIZES,
    "granite_speech_plus": GRANITE_SPEECH_SIZES,
    # a Mamba + MoE language model (Nemotron-H) over ASR, diarization and word-timestamp encoders; the encoders'
    # attention keeps as many KV heads as query heads (transformers' save fuses q/k/v and splits them back in thirds)
    "nemo_speechlm": dict(audio_config=dict(asr_config=dict(num_key_value_heads=2),
                                            diarization_config=dict(head_config=dict(audio_hidden_size=32),
                                                                    audio_config=dict(num_key_value_heads=2))),
                          word_timestamp_config=dict(num_key_value_heads=2),
                          text_config=dict(layers_block_type=["mamba", "moe"], ssm_state_size=8, mamba_num_heads=4,
                                           mamba_head_dim=16, n_groups=1, chunk_size=16,
                                           moe_shared_expert_intermediate_size=24)),
    "vibevoice_asr": dict(acoustic_tokenizer_encoder_config=VIBEVOICE_ENCODER,
                          semantic_tokenizer_encoder_config=VIBEVOICE_ENCODER, audio_token_id=3, audio_bos_token_id=4,
                          audio_eos_token_id=5),
    "vibevoice": dict(audio_config=VIBEVOICE_ENCODER, semantic_model_config=VIBEVOICE_ENCODER, audio_token_id=3,
                      audio_bos_token_id=4, audio_eos_token_id=5),
    # text-to-speech whose flow head reads the backbone's hidden states
    "gradium_phonon_tts": dict(flow_head_config=dict(condition_dim=32, frequency_embedding_size=16),
                               audio_prompt_dim=16, duration_delta_embedding_dim=16, head_dim=16,
                               num_key_value_heads=2),  # its RoPE permutation of q/k needs whole heads
    "pocket_tts": dict(flow_head_config=dict(condition_dim=32, frequency_embedding_size=16)),
    "efficientloftr": dict(stage_num_blocks=[1, 1, 1, 1], out_features=[16, 16, 32, 32], stage_stride=[2, 1, 2, 2],
                           stage_in_channels=[1, 16, 16, 32], stage_block_stride=[[2], [1], [2], [2]],
                           stage_block_out_channels=[[16], [16], [32], [32]],
                           stage_block_in_channels=[[1], [16], [16], [32]], fine_fusion_dims=[32, 16, 16]),
    "moonshine_streaming": dict(num_key_value_heads=1, encoder_config=dict(sliding_windows=[[16, 4], [16, 0]])),
    # more vision-language models and speech LLMs: their MoE layers kept MoE, per-layer lists for 2 layers
    # a sparse-attention layer (its indexer) beside a full one; every MLP stays MoE (4 experts, 2 per token)
    "minimax_m3_vl": {"projector_hidden_size": 48,
                      "text_config": {"shared_intermediate_size": 24, "rotary_dim": 8,
                                      "layer_types": ["full_attention", "minimax_m3_sparse"], "index_n_heads": 1,
                                      "index_head_dim": 16, "index_block_size": 8, "index_topk_blocks": 2}},
    # a dense then a MoE layer (the dropped per-layer list defaults to dense for 2 layers); sliding + full attention
    "step3p7": {"text_config": {"mlp_layer_types": ["dense", "sparse"], "share_expert_dim": 24,
                                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16,
                                "num_sliding_attention_heads": 2,
                                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10000.0}}}},
    "ernie4_5_vl_moe": {"text_config": {"moe_intermediate_size": [24, 16],  # text experts, vision experts
                                        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default",
                                                            "mrope_section": [3, 3, 2]}}},  # sums to head_dim / 2
    # the one in HEAD_SIZES_FOR, plus a linear-attention and an indexed-attention layer, a dense and a MoE MLP
    "glm5_next": {"text_config": {"num_key_value_heads": 2, "indexer_types": ["full", "full"], "index_head_dim": 16,
                                  "index_n_heads": 2, "linear_head_dim": 16, "linear_num_heads": 2, "index_topk": 16,
                                  "index_kpool": 4, "qk_rope_head_dim": 0, "qk_nope_head_dim": 16, "qk_head_dim": 16,
                                  "layer_types": ["linear_attention", "indexed_attention"],
                                  "mlp_layer_types": ["dense", "sparse"]},
                  "vision_config": {"projection_intermediate_size": 48}},
    # the one in HEAD_SIZES_FOR, plus a small largest image: its position table is (max_image_size / patch)^2 + 1
    "hunyuan_vl": {"vision_config": {"text_hidden_size": 32, "max_image_size": 64, "min_image_size": 32},
                   "text_config": {"head_dim": 16}},
    "inkling_mm_model": {"vision_config": {"text_hidden_size": 32, "n_layers": 2},
                         "audio_config": {"text_hidden_size": 32, "mel_vocab_size": 16},
                         "text_config": {"unpadded_vocab_size": 97, "swa_num_attention_heads": 2,
                                         "swa_num_key_value_heads": 1, "swa_head_dim": 16,
                                         "sliding_window_size": 16}},
    # a MoE text model (router, 4 experts, 2 per token) beside the dense MLP; its full-attention layer keeps a
    # head_dim of its own (32) through per_layer_config, as the real one does (512)
    "diffusion_gemma": {"text_config": {"per_layer_config": {"01": {"head_dim": 32}},
                                        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16,
                                        "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 24},
                        "vision_config": {"position_embedding_size": 16}},
    "deepseek_ocr2": {"vision_config": {"sam_config": dict(SAM_SIZES, downsample_channels=[16, 32])},
                      "text_config": {"mlp_layer_types": ["dense", "sparse"], "num_experts_per_tok": 2}},
    "unlimited_ocr": {"vision_config": {"sam_config": dict(SAM_SIZES, downsample_channels=[16, 32])}},
    "kosmos-2.5": {"text_config": {"layers": 2, "ffn_dim": 48, "attention_heads": 2},
                   "vision_config": {"patch_embed_hidden_size": 192, "max_num_patches": 64},  # 8 * 8 * 3 pixels
                   "latent_query_num": 4},
    "molmo2": {"vision_config": {"image_size": [32, 32], "num_position_embeddings": 16},
               "adapter_config": {"text_hidden_size": 32, "vision_feature_layer": [-1, -2]},
               "text_config": {"additional_vocab_size": 16, "rope_scaling_layers": [0, 1]}},
    # a VQ-GAN of 8 codes, mapped to BPE tokens 8..15 by the vocabulary map the modeling code requires
    "emu3": {"vq_config": {"codebook_size": 8, "base_channels": 32, "channel_multiplier": [1, 2], "num_res_blocks": 1,
                           "attn_resolutions": [], "hidden_size": 32, "embed_dim": 4},
             "image_token_id": 4,
             "vocabulary_map": {"<|extra_200|>": 3, "<image>": 4,
                                **{f"<|visual token {i:06d}|>": 8 + i for i in range(8)}}},
    "chameleon": {"vq_config": {"num_embeddings": 8, "latent_channels": 8, "base_channels": 32,
                                "channel_multiplier": [1, 2], "num_res_blocks": 1, "resolution": 32},
                  "image_token_id": 3,
                  "vocabulary_map": {"<image>": 3, "IMGIMGAZ": 8, "IMGIMGBZ": 9, "IMGIMGCZ": 10, "IMGIMGDZ": 11,
                                     "IMGIMGEZ": 12, "IMGIMGFZ": 13, "IMGIMGGZ": 14, "IMGIMGHZ": 15}},
    # its Q-Former projectors take vision hidden // 64 heads; 2 deepstack + 4 spatial projectors for 2 LLM layers
    "granite4_vision": {"vision_config": {"hidden_size": 64}, "downsample_rate": "1/2",
                        "deepstack_layer_map": [[-1, 0], [-2, 1]], "spatial_target_layers": [0, 1, 0, 1]},
    # its default config leaves the per-layer-type RoPE empty (the rotary embedding reads one per layer type)
    "cohere_compass": {"text_config": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16,
                                       "rope_parameters": {
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                 "mrope_section": [4, 2, 2]},
                                           "full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                              "mrope_section": [4, 2, 2]}}},
                       "vision_config": {"num_position_embeddings": 16}},
    # speech: its adaptor's intermediate size must be a quarter of the text hidden size
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": 8, "projector_hidden_size": 48},
                     "audio_config": {"num_timestamp_prediction_layers": 1, "num_mel_bins": 16}},
    # segmenters (group norms of 32) and depth estimators (4 backbone features)
    "mask2former": dict(backbone_config=SWIN_BACKBONE, feature_size=32, mask_feature_size=32, hidden_dim=32,
                        encoder_feedforward_dim=32, encoder_layers=1, decoder_layers=2, num_attention_heads=2,
                        dim_feedforward=32, num_queries=8),
    "maskformer": dict(backbone_config=SWIN_BACKBONE, fpn_feature_size=32, mask_feature_size=32,
                       num_attention_heads=2, num_hidden_layers=2,
                       decoder_config={"model_type": "detr", "d_model": 32, "encoder_layers": 1, "decoder_layers": 2,
                                       "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "encoder_attention_heads": 2,
                                       "decoder_attention_heads": 2, "num_queries": 8, "use_timm_backbone": False}),
    "oneformer": dict(backbone_config=SWIN_BACKBONE, num_queries=8, text_encoder_width=32, text_encoder_num_layers=2,
                      text_encoder_vocab_size=97, text_encoder_context_length=8, task_seq_len=8, text_encoder_n_ctx=4,
                      conv_dim=32, mask_dim=32, hidden_dim=32, encoder_feedforward_dim=48, dim_feedforward=48),
    "upernet": dict(backbone_config=RESNET_4_STAGES, hidden_size=16, auxiliary_channels=16, pool_scales=[1, 2]),
    "depth_anything": DEPTH_ANYTHING_SIZES,
    "prompt_depth_anything": DEPTH_ANYTHING_SIZES,
    "chmv2": dict(backbone_config={"model_type": "dinov3_vit", "hidden_size": 32, "num_hidden_layers": 4,
                                   "num_attention_heads": 2, "intermediate_size": 48, "image_size": 32,
                                   "patch_size": 8, "out_indices": [1, 2, 3, 4]},
                  fusion_hidden_size=16, post_process_channels=[8, 16, 16, 32], head_hidden_size=8,
                  number_output_channels=16),
    "tipsv2_dpt": dict(SMALL_DPT_NECK, backbone_config={"model_type": "tipsv2_vision_model", "hidden_size": 32,
                                                        "num_hidden_layers": 4, "num_attention_heads": 2,
                                                        "intermediate_size": 48, "image_size": 28, "patch_size": 14,
                                                        "out_indices": [1, 2, 3, 4]}),
    "depth_pro": dict(image_model_config=DEPTH_PRO_TOWER, patch_model_config=DEPTH_PRO_TOWER,
                      fov_model_config=DEPTH_PRO_TOWER, patch_size=32, intermediate_hook_ids=[1, 0],
                      intermediate_feature_dims=[16, 16], scaled_images_feature_dims=[32, 32, 16],
                      fusion_hidden_size=16),
    "sapiens2": dict(stage_names=["stem", "stage1", "stage2"], out_features=["stage2"], out_indices=[2],
                     head_config=dict(upsample_out_channels=[16, 16], upsample_kernel_sizes=[4, 4],
                                      conv_out_channels=[16], conv_kernel_sizes=[1], use_pixel_shuffle=False)),
    "tipsv2": dict(vision_config=dict(NEW_STAGES, out_indices=[2], image_size=28)),
    # the auto class picks one of several heads by the config's `architectures`
    "levit": dict(architectures=["LevitForImageClassification"], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                  depths=[1, 1], key_dim=[8, 8], drop_path_rate=0, mlp_ratio=[2, 2], attention_ratio=[2, 2],
                  down_ops=[["Subsample", 8, 1, 4, 2, 2]], image_size=32, kernel_size=3, patch_size=16),
    "perceiver": dict(architectures=["PerceiverForImageClassificationLearned"], num_latents=8, d_latents=32,
                      d_model=32, num_blocks=1, num_self_attends_per_block=2, num_self_attention_heads=2,
                      num_cross_attention_heads=2, image_size=16, qk_channels=None, v_channels=None),
    "sam2_video": dict(SAM2_SIZES, **SAM2_VIDEO_MEMORY, memory_attention_feed_forward_hidden_size=48),
    "edgetam_video": dict(SAM2_SIZES, **SAM2_VIDEO_MEMORY, memory_attention_mlp_hidden_size=48,
                          memory_attention_rope_k_sizes=[2, 2], perceiver_resampler_num_latents=4,
                          perceiver_resampler_num_latents_2d=4, perceiver_resampler_hidden_size=16,
                          perceiver_resampler_mlp_intermediate_size=32, perceiver_resampler_attention_head_dim=16,
                          perceiver_resampler_num_layers=1),
    "swin2sr": dict(embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4, image_size=16, num_layers=2),
    "superglue": dict(hidden_size=32, keypoint_encoder_sizes=[8, 16], gnn_layers_types=["self", "cross"],
                      num_attention_heads=2),
    "zoedepth": dict(backbone_config={"model_type": "beit", "hidden_size": 32, "num_hidden_layers": 4,
                                      "num_attention_heads": 2, "intermediate_size": 48, "image_size": 32,
                                      "patch_size": 8, "out_indices": [1, 2, 3, 4], "reshape_hidden_states": False,
                                      "use_relative_position_bias": True, "vocab_size": 97},
                     neck_hidden_sizes=[8, 16, 24, 32], fusion_hidden_size=16, bottleneck_features=16,
                     num_relative_features=8, bin_embedding_dim=16, num_attractors=[4, 2, 2, 1],
                     bin_configurations=[{"n_bins": 8, "min_depth": 0.001, "max_depth": 10.0}]),
    # the bare models (AutoModel) of types no other head sweeps: codecs, vocoders, speech and vision towers, time series
    # audio-text contrastive: a 2-stage HTS-AT (Swin) audio tower over a small spectrogram
    "clap": dict(audio_config=dict(depths=[1, 1], num_attention_heads=[1, 2], patch_embeds_hidden_size=16,
                                   spec_size=32, num_mel_bins=16, num_classes=8, window_size=2)),
    # a DAC codec (its transposed convolutions' init is torch's reset_parameters)
    "dac": DAC_SMALL,
    # vision backbone: 2 stages of 1 block
    "dinov3_convnext": dict(hidden_sizes=[16, 32], depths=[1, 1], **NEW_STAGES),
    # audio codecs: the ones musicgen / bark / csm already use
    "encodec": ENCODEC_SMALL,
    "mimi_encoder": MIMI_SMALL,
    "mimi": MIMI_SMALL,
    "mimi_decoder": MIMI_SMALL,
    "pocket_tts_audio_tokenizer": dict(num_filters=8, upsampling_ratios=[2, 2], upsample_groups=16,
                                       sliding_window=16),  # a Mimi-style codec: groups must divide hidden
    "pocket_tts_audio_tokenizer_decoder": dict(num_filters=8, upsampling_ratios=[2, 2], upsample_groups=16,
                                               sliding_window=16),
    # text-to-speech: the fastspeech2_conformer_with_hifigan model_config (conformer sizes in derived dicts)
    "fastspeech2_conformer": dict(num_mel_bins=16, encoder_linear_units=48, decoder_linear_units=48,
                                  decoder_kernel_size=7, speech_decoder_postnet_layers=2,
                                  speech_decoder_postnet_units=16, duration_predictor_channels=16,
                                  energy_predictor_channels=16, pitch_predictor_layers=2, pitch_predictor_channels=16,
                                  max_source_positions=64, encoder_config=CONFORMER_SMALL,
                                  decoder_config=CONFORMER_SMALL),
    # vision tower with its projector into the (small) text hidden size, as in inkling2
    "inkling2_vision": dict(text_hidden_size=32, projection_hidden_dim=48, posemb_grid_size=4),
    # speech recognisers (RNN-T, TDT): prompt table small too
    "nemotron3_5_asr": dict(RNNT_SMALL, num_prompts=8, prompt_intermediate_size=48, default_prompt_id=3),
    "nemotron_asr_streaming": RNNT_SMALL,
    "parakeet_rnnt": RNNT_SMALL,
    "parakeet_tdt": RNNT_SMALL,
    # audio encoders over a DAC codec
    "pe_audio": dict(audio_config=dict(dac_config=DAC_SMALL)),
    "pe_audio_encoder": dict(dac_config=DAC_SMALL),
    # SAM2's Hiera image tower (and its FPN neck), as in sam2
    "sam2_hiera_det_model": SAM2_SIZES["vision_config"]["backbone_config"],
    "sam2_vision_model": SAM2_SIZES["vision_config"],
    # vocoder: 2 small LVC blocks, a 1-block kernel predictor
    "univnet": dict(model_in_channels=16, model_hidden_channels=16, num_mel_bins=16, resblock_kernel_sizes=[3, 3],
                    resblock_stride_sizes=[2, 2], resblock_dilation_sizes=[[1, 3], [1, 3]],
                    kernel_predictor_num_blocks=1, kernel_predictor_hidden_channels=16),
    # the VibeVoice acoustic tokenizer vibevoice / vibevoice_asr already use
    "vibevoice_acoustic_tokenizer": VIBEVOICE_ENCODER,
    "vibevoice_acoustic_tokenizer_decoder": VIBEVOICE_ENCODER,
    "vibevoice_acoustic_tokenizer_encoder": VIBEVOICE_ENCODER,
    "autoformer": TIME_SERIES,
    "informer": TIME_SERIES,
    "time_series_transformer": TIME_SERIES,
    # ViT backbones: stages rebuilt from 2 layers
    "dinov3_vit": NEW_STAGES,
    "pixio": NEW_STAGES,
    "tipsv2_vision_model": NEW_STAGES,
    "vitdet": NEW_STAGES,
    # heads per stage must be a list
    "maskformer-swin": dict(embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=2, patch_size=4, **NEW_STAGES),
    # image_size must be [height, width]; BPE and WordPiece heads over a small vocabulary
    "mgp-str": dict(image_size=[32, 32], num_bpe_labels=97, num_wordpiece_labels=97, max_token_length=8),
    "granite_speech5_encoder": dict(context_size=16, num_mel_bins=16),  # attention blocks of context_size frames
    "muse_spark_audio": dict(patch_sizes=[16, 6], hidden_sizes=[16, 32], depths=[1, 1]),  # as in muse_spark
    # the text encoder reads dropout_rate, which only the encoder-decoder config sets on it; image tokens in vocab
    "t5gemma2_encoder": dict(text_config=dict(dropout_rate=0.0), mm_tokens_per_image=16, boi_token_index=3,
                             eoi_token_index=4, image_token_index=5),
    # its CLIP-style vision tower takes hidden_size // 64 attention heads
    "bridgetower": dict(vision_config=dict(hidden_size=64)),
    "neucodec": XCODEC2_SMALL,
    "xcodec2": XCODEC2_SMALL,
    # a DAC acoustic model and a wav2vec2-style semantic one
    "xcodec": dict(codebook_size=16, codebook_dim=16, acoustic_model_config=DAC_SMALL,
                   semantic_model_config=dict(conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3],
                                              num_feat_extract_layers=2, num_conv_pos_embeddings=16,
                                              num_conv_pos_embedding_groups=2, classifier_proj_size=16)),
    # document unwarping: 2 ResNet stages, 2 bridge blocks (the connector takes one input per bridge)
    "uvdoc": dict(kernel_size=3, bridge_connector=[16, 16], out_point_positions2D=[[16, 8], [8, 2]],
                  backbone_config=dict(resnet_head=[[3, 8], [8, 8]],
                                       resnet_configs=[[[8, 8, 1, False]], [[8, 16, 1, True]]],
                                       stage_configs=[[[16, 1]], [[16, 2]]], kernel_size=3,
                                       stage_names=["stem", "stage1", "stage2"], out_features=["stage2"],
                                       out_indices=[2])),
    # text recogniser: D-FINE's small HGNetV2 with the recogniser's own (anisotropic) strides, a 97-way CTC head
    "pp_ocrv5_server_rec": dict(head_out_channels=97,
                                backbone_config=dict(D_FINE_SIZES["backbone_config"], stage_downsample=[True] * 4,
                                                     stem_strides=[2, 1, 1, 1, 1],
                                                     stage_downsample_strides=[[2, 1], [1, 2], [2, 1], [2, 1]],
                                                     out_features=["stage1", "stage2", "stage3", "stage4"])),
    # SAM3 tracker: sam2_video's memory sizes on a 32-pixel image (4x4 tokens: FPN 16/8/4, mask stride 8)
    "sam3_tracker_video": dict(SAM2_VIDEO_MEMORY, image_size=32, memory_attention_rope_feat_sizes=[4, 4],
                               mask_downsampler_total_stride=8, memory_attention_feed_forward_hidden_size=48,
                               vision_config=dict(fpn_hidden_size=32,
                                                  backbone_feature_sizes=[[16, 16], [8, 8], [4, 4]],
                                                  backbone_config=dict(window_size=2, global_attn_indexes=[1],
                                                                       pretrain_image_size=32)),
                               mask_decoder_config=dict(mlp_dim=48, iou_head_hidden_dim=16)),
    # video grounding: a 2-stage ResNet, a small frame-padding visual prompt
    "tvp": dict(backbone_config={**RESNET_BACKBONE, "out_features": ["stage2"]}, visual_prompt_size=4,
                max_img_size=32, num_frames=4, max_grid_col_position_embeddings=8,
                max_grid_row_position_embeddings=8),
    "nemotron3_diarization": DIARIZATION,
    "nemotron3_5_transcribe_audio": dict(asr_config=dict(num_key_value_heads=2, num_mel_bins=16),
                                         diarization_config=DIARIZATION),
}


def _shrunk(values: dict, untie: bool = True) -> dict:
    out = dict(values)
    for key, value in values.items():
        if isinstance(value, dict) and "model_type" in value:  # a sub-config (vision_config, encoder, ...)
            out[key] = _shrunk(value, untie)
        elif key == "tie_word_embeddings":
            out[key] = False if untie else value
        elif isinstance(value, bool):
            continue
        elif key in SMALL and isinstance(value, int):
            out[key] = SMALL[key]
        elif key in SMALL_TOWERS and isinstance(value, (int, list)):
            out[key] = SMALL_TOWERS[key]
    for key in PER_LAYER_LISTS:
        out.pop(key, None)
    if "vocab_size" in values:
        out.update(_tokens_in_small_vocabulary(values))
    return out


def _tokens_in_small_vocabulary(values: dict, keys=None) -> dict:
    """Special tokens (`*_token_id`, or only `keys`) a default config puts beyond the small vocabulary, moved into it
    (an embedding's padding_idx must fit)."""
    return {key: SMALL_TOKENS.get(key, SMALL_TOKENS["eos_token_id"]) for key, value in values.items()
            if (key in keys if keys is not None else key.endswith("_token_id"))
            and isinstance(value, int) and not isinstance(value, bool) and value >= SMALL["vocab_size"]}


def _changed(values: dict, changes: dict) -> dict:
    """`values` with `changes`: a sub-config given without a model_type changes the shrunk one (recursively); with
    one, it replaces it."""
    from transformers import AutoConfig

    out = dict(values)
    for key, value in changes.items():
        nested = (isinstance(value, dict) and "model_type" not in value
                  and isinstance(values.get(key), dict) and "model_type" in values[key])
        if isinstance(value, dict) and value.get("shrunk"):
            value = _shrunk(AutoConfig.for_model(value["model_type"]).to_dict())
        out[key] = _changed(values[key], value) if nested else value
    return out


def small_head_config(model_type: str, model_class: str):
    from transformers import AutoConfig

    values = _shrunk(AutoConfig.for_model(model_type).to_dict(), untie=model_class not in TIED_HEADS)
    for key in ("model_type", "transformers_version", "architectures", "_name_or_path"):
        values.pop(key, None)
    values = _changed(values, HEAD_SIZES_FOR.get(model_type, {}))  # may name the `architectures` an auto class picks
    config = AutoConfig.for_model(model_type, **values)
    if model_class == "AutoModelForSequenceClassification":
        config.num_labels = 3
        if getattr(config, "pad_token_id", None) is None:  # batched classification needs one
            config.pad_token_id = 0
    return config


# files beside the weights that a model's own from_pretrained reads, and refuses to load without. Their saves are
# checked byte for byte but not loaded back: save_pretrained does not write these files, and Qwen2.5-Omni's
# from_pretrained fails with output_loading_info=True (transformers 5.23 calls load_speakers on the returned tuple).
EXTRA_FILES_FOR = {"qwen2_5_omni": "spk_dict.pt"}  # Qwen2.5-Omni's speakers (torch.save of name -> tensors)


def head_checkpoint(workdir: str, model_class: str, model_type: str) -> str:
    import transformers

    from tests.checkpoints import make_checkpoint

    path = make_checkpoint(os.path.join(workdir, "heads", model_class, model_type), model_type,
                           config=small_head_config(model_type, model_class),
                           model_class=getattr(transformers, model_class))
    return with_extra_files(path, model_type)


def with_extra_files(path: str, model_type: str) -> str:
    """`path`, with the files beside the weights that `model_type`'s from_pretrained needs (EXTRA_FILES_FOR)."""
    import torch

    extra = EXTRA_FILES_FOR.get(model_type)
    if extra and not os.path.exists(os.path.join(path, extra)):
        torch.save({"Chelsie": {"bos_token": 2}}, os.path.join(path, extra))
    return path


# transformers 5.23's Qwen3-Omni-MoE init never writes its talker's experts: when they are missing, a plain load leaves
# uninitialised memory in them (ours: zeros, named in the load report)
TALKER_EXPERTS = re.compile(r"^talker\.model\.layers\.\d+\.mlp\.experts\.")


def omni_without_talker_experts(workdir: str) -> str:
    """A Qwen3-Omni-MoE (AutoModelForTextToWaveform) checkpoint saved without its talker's experts."""
    from tests.checkpoints import rewrite_checkpoint

    return rewrite_checkpoint(head_checkpoint(workdir, "AutoModelForTextToWaveform", "qwen3_omni_moe"),
                              os.path.join(workdir, "omni_no_talker_experts"),
                              lambda tensors: {k: v for k, v in tensors.items() if not TALKER_EXPERTS.match(k)})


def _settable(config, key: str) -> bool:
    """The config has `key` as a field: not a derived, read-only property (xLSTM's `v_head_dim`); a per-layer field
    (Gemma 4's `head_dim`) raises something other than AttributeError when read globally, but is one."""
    field = getattr(type(config), key, None)
    if isinstance(field, property) and field.fset is None:
        return False
    try:
        getattr(config, key)
    except AttributeError:
        return False
    except Exception:
        return True
    return True


def small_config(model_type: str, tied: bool = False):
    """`tied`: the tie of the output embedding to the input one as the model type's own config has it (untied
    otherwise, so that every weight is read on its own)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    small = {k: v for k, v in SMALL.items() if not (tied and k == "tie_word_embeddings")}
    kwargs = {k: v for k, v in small.items() if _settable(default, k)}
    kwargs.update(_tokens_in_small_vocabulary(default.to_dict(), keys=SMALL_TOKENS))
    kwargs.update(SIZES_FOR.get(model_type, {}))
    text = getattr(default, "text_config", None)
    if text is not None:
        kwargs["text_config"] = {**text.to_dict(), **{k: v for k, v in small.items() if hasattr(text, k)}}
        for key in ("layer_types", *TEXT_LISTS_FOR.get(model_type, ())):
            kwargs["text_config"].pop(key, None)
    return AutoConfig.for_model(model_type, **kwargs)


def ties_embeddings(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False)
                or getattr(getattr(config, "text_config", None), "tie_word_embeddings", False))


def sweep_checkpoint(workdir: str, model_type: str, tied: bool = False) -> str:
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(os.path.join(workdir, "sweep_tied" if tied else "sweep", model_type), model_type,
                           config=small_config(model_type, tied))
