"""Missing keys in bounded chunks, and loads that behave exactly like the plain load (issue: missing keys).

One real 2-rank torchrun job runs every case; each is compared with plain single-process `from_pretrained`
(same seed, so missing-key initialisation draws the same RNG stream).
"""

from __future__ import annotations

import functools
import os
import re
import shutil

import pytest
import torch

from tests.checkpoints import (ernie_moe_config, make_checkpoint, qwen3_vl_moe_config, remote_code_checkpoint,
                                rewrite_checkpoint, transpose_experts)
from tests.conftest import run_torchrun
from tests.families import TALKER_EXPERTS, head_checkpoint, omni_without_talker_experts

BUDGET = 2048  # bytes: far below one expert tensor, so chunking is exercised


def _drop_layer1_experts(t):
    return {k: v for k, v in t.items() if not k.startswith("model.layers.1.mlp.experts.")}


def _mixtral_names(t):
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    return {re.sub(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)", lambda m: f"experts.{m[1]}.{names[m[2]]}", k): v
            for k, v in t.items()}


def _renamed_prefix(t):  # a checkpoint saved under another prefix, loaded with key_mapping=
    return {re.sub(r"^model\.", "transformer.", k): v for k, v in t.items()}


def _untie(t):
    return {**t, "lm_head.weight": t["lm_head.weight"] + 1.0}


@pytest.fixture(scope="module")
def paths(workdir):
    from transformers import AutoModelForImageTextToText

    d = lambda name: os.path.join(workdir, name)  # noqa: E731
    qwen = make_checkpoint(d("qwen3_moe"), "qwen3_moe")
    llama = make_checkpoint(d("llama_untied"), "llama_untied")
    if not os.path.exists(d("hub_layout/lm")):  # a repo holding the model in a subfolder (subfolder=)
        shutil.copytree(qwen, d("hub_layout/lm"))
    return {
        "qwen": qwen,
        "llama": llama,
        "qwen_missing_experts": rewrite_checkpoint(qwen, d("qwen_missing_experts"), _drop_layer1_experts),
        "llama_tied_but_different": rewrite_checkpoint(llama, d("llama_tied_diff"), _untie,
                                                       {"tie_word_embeddings": True}),
        "ernie": make_checkpoint(d("ernie"), "ernie", config=ernie_moe_config()),
        "qwen3_vl_moe": rewrite_checkpoint(
            make_checkpoint(d("qwen3_vl_moe_src"), "qvl", config=qwen3_vl_moe_config(),
                            model_class=AutoModelForImageTextToText),
            d("qwen3_vl_moe"), transpose_experts),
        "qwen_renamed": rewrite_checkpoint(qwen, d("qwen_renamed"), _renamed_prefix),
        "in_subfolder": d("hub_layout"),
        "qwen_bf16": make_checkpoint(d("qwen3_moe_bf16"), "qwen3_moe", dtype=torch.bfloat16),
        "remote_code": remote_code_checkpoint(llama, d("remote_code")),
        "qwen_broken": rewrite_checkpoint(qwen, d("qwen_broken"), _mixtral_names),
        "mamba_rescale": make_checkpoint(d("mamba_rescale"), "mamba", config=_mamba_rescaling_loaded_weights()),
        "youtu_padding": make_checkpoint(d("youtu_padding"), "youtu", config=_youtu_with_padding()),
        # a 0-dim parameter (logit_scale) missing: its init runs under a gather whose broadcast DeepSpeed cannot do
        "metaclip_no_scale": rewrite_checkpoint(head_checkpoint(workdir, "AutoModel", "metaclip_2"),
                                                d("metaclip_no_scale"), _without_logit_scale),
        # transformers 5.23 saves its language model as model.model.language_model.model.* and cannot map it back
        "shieldgemma2": head_checkpoint(workdir, "AutoModelForImageTextToText", "shieldgemma2"),
        "omni_no_talker_experts": omni_without_talker_experts(workdir),
        # a transposed convolution's bias missing beside its loaded weight: DAC's init is torch's reset_parameters,
        # which branches on whether the weight is contiguous
        "dac_no_conv_bias": rewrite_checkpoint(head_checkpoint(workdir, "AutoModel", "dac"), d("dac_no_conv_bias"),
                                               _without_a_conv_bias),
        # a weight-norm conv's direction (`original1`) missing: transformers 5.23's init writes the computed `weight`,
        # never its parametrization's originals
        "wav2vec2_no_weight_norm_v": rewrite_checkpoint(head_checkpoint(workdir, "AutoModelForCTC", "wav2vec2"),
                                                        d("wav2vec2_no_weight_norm_v"), _without_weight_norm_v),
        # `fusion_config={"patch_embeddings": True}` (transformers 5.23): Conv3d patch embeddings become Linear layers
        "qwen3_vl": head_checkpoint(workdir, "AutoModelForImageTextToText", "qwen3_vl"),
        "qwen2_vl": head_checkpoint(workdir, "AutoModelForImageTextToText", "qwen2_vl"),
    }


WEIGHT_NORM_V = re.compile(r"\.pos_conv_embed\.conv\.parametrizations\.weight\.original1$")


def _without_weight_norm_v(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if not WEIGHT_NORM_V.search(k)}


def _without_a_conv_bias(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if k != "decoder.block.0.conv_t1.bias"}


def _without_logit_scale(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if k != "logit_scale"}


def _youtu_with_padding():
    from tests.families import small_config

    config = small_config("youtu")
    config.pad_token_id = 3  # its init zeroes that row of the loaded embedding, through a slice past the loaded flag
    return config


def _mamba_rescaling_loaded_weights():
    from tests.families import small_config

    config = small_config("mamba")
    config.rescale_prenorm_residual = True  # its init divides out_proj.weight in place, loaded or not
    return config


CASES = {
    # name: (path key, model class, dtype, kwargs, seed)
    "seq_cls_head": ("llama", "AutoModelForSequenceClassification", "float32", {"num_labels": 3}, 7),
    "resized_vocab": ("llama", "AutoModelForCausalLM", "float32", {"vocab_size": 120, "ignore_mismatched_sizes": True}, 8),
    "mismatch_no_ignore": ("llama", "AutoModelForCausalLM", "float32", {"vocab_size": 120}, 8),
    "missing_experts": ("qwen_missing_experts", "AutoModelForCausalLM", "float32",
                        {"missing_init_budget_bytes": BUDGET, "allow_suspicious_missing_keys": True}, 9),
    "tied_but_different": ("llama_tied_but_different", "AutoModelForCausalLM", "float32", {}, 0),
    # the loading kwargs a hub user passes, given to both loads
    "key_mapping": ("qwen_renamed", "AutoModelForCausalLM", "float32",
                    {"key_mapping": {r"^transformer\.": "model."}}, 0),
    "subfolder": ("in_subfolder", "AutoModelForCausalLM", "bfloat16", {"subfolder": "lm"}, 0),
    "trust_remote_code": ("remote_code", "AutoModelForCausalLM", "float32", {"trust_remote_code": True}, 0),
    "keep_in_fp32": ("ernie", "AutoModelForCausalLM", "bfloat16", {"keep_in_fp32": True}, 0),
    "keep_in_fp32_default": ("ernie", "AutoModelForCausalLM", "bfloat16", {"experts_implementation": "eager"}, 0),
    "qwen3_vl_moe_transposed": ("qwen3_vl_moe", "AutoModelForImageTextToText", "float32", {}, 0),
    "broken_conversion": ("qwen_broken", "AutoModelForCausalLM", "float32", {}, 0),
    "broken_conversion_opt_out": ("qwen_broken", "AutoModelForCausalLM", "float32",
                                  {"allow_suspicious_missing_keys": True}, 3),
    # a plain load zeroes the loaded padding row (an unguarded write into a slice): replayed into the partitions
    "init_zeroes_loaded_padding_row": ("youtu_padding", "AutoModelForCausalLM", "float32",
                                       {"missing_init_budget_bytes": BUDGET}, 0),
    "init_writes_loaded_param": ("mamba_rescale", "AutoModelForCausalLM", "float32", {}, 0),
    "prefix_not_mapped": ("shieldgemma2", "AutoModelForImageTextToText", "float32", {}, 0),
    "scalar_param_missing": ("metaclip_no_scale", "AutoModel", "float32", {"missing_init_budget_bytes": BUDGET}, 0),
    "conv_init_beside_loaded_weight": ("dac_no_conv_bias", "AutoModel", "float32",
                                       {"missing_init_budget_bytes": BUDGET}, 0),
    "init_leaves_missing_unwritten": ("omni_no_talker_experts", "AutoModelForTextToWaveform", "float32", {}, 0),
    "init_leaves_missing_unwritten_chunked": ("omni_no_talker_experts", "AutoModelForTextToWaveform", "float32",
                                              {"missing_init_budget_bytes": BUDGET}, 0),
    "init_leaves_weight_norm_unwritten": ("wav2vec2_no_weight_norm_v", "AutoModelForCTC", "float32",
                                          {"missing_init_budget_bytes": BUDGET}, 0),
    # `dtype="auto"` (the checkpoint's dtype, here the engine's) and its older spelling
    "dtype_auto": ("qwen_bf16", "AutoModelForCausalLM", "bfloat16", {"dtype": "auto"}, 0),
    "torch_dtype_auto": ("qwen_bf16", "AutoModelForCausalLM", "bfloat16", {"torch_dtype": "auto"}, 0),
    # Llama's question-answering head keeps its body as `transformer`, the causal LM's checkpoint as `model`:
    # transformers 5.24 maps neither to the other, and a plain load initialises the whole body at random
    "body_not_mapped": ("llama", "AutoModelForQuestionAnswering", "float32", {}, 0),
    "body_not_mapped_opt_out": ("llama", "AutoModelForQuestionAnswering", "float32",
                                {"allow_suspicious_missing_keys": True, "missing_init_budget_bytes": BUDGET}, 4),
    "body_key_mapping": ("llama", "AutoModelForQuestionAnswering", "float32",  # what the refusal says to pass
                         {"key_mapping": {r"^model\.": "transformer."}}, 4),
    # last: transformers registers a fusion for the rest of the process (its module patches, its weight converters)
    "fusion_config": ("qwen3_vl", "AutoModelForImageTextToText", "float32", {"fusion_config": {"patch_embeddings": True}},
                      0),
    "fusion_config_not_mapped": ("qwen2_vl", "AutoModelForImageTextToText", "float32",
                                 {"fusion_config": {"patch_embeddings": True}}, 0),
}
PLAIN_ONLY = {"missing_init_budget_bytes", "allow_suspicious_missing_keys", "keep_in_fp32"}


@pytest.fixture(scope="module")
def results(paths, workdir):
    cases = [{"name": name, "path": paths[p], "model_class": cls, "dtype": dtype, "seed": seed,
              "kwargs": {**kw, "output_loading_info": True}, "out": os.path.join(workdir, f"missing_{name}.pt"),
              "train_steps": 2 if name == "keep_in_fp32_default" else 0}
             for name, (p, cls, dtype, kw, seed) in CASES.items()]
    return {c["name"]: d for c, d in zip(cases, run_torchrun(2, cases, workdir))}


@functools.lru_cache(maxsize=None)
def plain(name: str, path: str):
    import transformers
    from transformers import monkey_patching

    _, cls, dtype, kwargs, seed = CASES[name]
    torch.manual_seed(seed)
    kwargs = {k: v for k, v in kwargs.items() if k not in PLAIN_ONLY}
    if not {"dtype", "torch_dtype"} & set(kwargs):
        kwargs["dtype"] = getattr(torch, dtype)
    # `fusion_config=` registers its fusion's module patches for the rest of the process, and while any are registered
    # every `from_pretrained` walks `dir()` of every transformers module (5.23-5.24, ~0.7 s a load): taken back here,
    # or every later plain load in this pytest process pays it
    patches_before = set(monkey_patching.get_patch_mapping())
    model, info = getattr(transformers, cls).from_pretrained(path, output_loading_info=True, **kwargs)
    if added := set(monkey_patching.get_patch_mapping()) - patches_before:
        monkey_patching.unregister_patch_mapping(sorted(added))
    state = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    state.update({n: b.detach() for n, b in model.named_buffers(remove_duplicate=False)})
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return state, {k: sorted(map(str, v)) for k, v in info.items()}, tied


def assert_equal_to_plain(name, dump, path):
    got = dump["rank0"]
    assert "error" not in got, got.get("error", {}).get("traceback")
    state, info, _ = plain(name, path)
    assert set(got["state"]) == set(state)
    for key, expected in state.items():
        actual = got["state"][key]
        assert actual.dtype == expected.dtype, f"{name} {key}: {actual.dtype} != {expected.dtype}"
        assert torch.equal(actual, expected), f"{name} {key}: values differ"
    assert got["loading_info"] == info, f"{name}: loading info differs from plain"


@pytest.mark.parametrize("name", ["seq_cls_head", "resized_vocab", "tied_but_different", "keep_in_fp32",
                                  "key_mapping", "subfolder", "trust_remote_code", "init_zeroes_loaded_padding_row",
                                  "qwen3_vl_moe_transposed", "broken_conversion_opt_out", "scalar_param_missing",
                                  "fusion_config", "dtype_auto", "torch_dtype_auto", "conv_init_beside_loaded_weight",
                                  "body_not_mapped_opt_out", "body_key_mapping"])
def test_equal_to_plain_load(results, paths, name):
    assert_equal_to_plain(name, results[name], paths[CASES[name][0]])


def test_missing_experts_initialised_in_bounded_chunks(results, paths):
    assert_equal_to_plain("missing_experts", results["missing_experts"], paths["qwen_missing_experts"])
    state, _, _ = plain("missing_experts", paths["qwen_missing_experts"])
    missing = [k for k in state if k.startswith("model.layers.1.mlp.experts.")]
    largest_missing = max(state[k].numel() * state[k].element_size() for k in missing)
    for r in results["missing_experts"]["ranks"]:
        peak = r["report"]["missing_init_peak_gathered_bytes"]
        assert 0 < peak <= max(BUDGET, largest_missing), f"rank {r['rank']} gathered {peak} at once"
        # the whole missing set is bigger than what was gathered at once
        assert peak < sum(state[k].numel() * state[k].element_size() for k in missing)


@pytest.mark.parametrize("name, unwritten", [("init_leaves_missing_unwritten", TALKER_EXPERTS),
                                             ("init_leaves_missing_unwritten_chunked", TALKER_EXPERTS),
                                             ("init_leaves_weight_norm_unwritten", WEIGHT_NORM_V)])
def test_missing_params_the_init_never_writes_are_zeros_and_named(results, paths, name, unwritten):
    """A plain load leaves `torch.empty` memory in a missing param its model's init never writes (garbage, NaN at
    times); no sharded load can reproduce that, so ours holds zeros and every rank's report names the params."""
    dump = results[name]
    got = dump["rank0"]
    assert "error" not in got, got.get("error", {}).get("traceback")
    state, info, _ = plain(name, paths[CASES[name][0]])
    left = sorted(k for k in state if unwritten.search(k))
    assert left, "the checkpoint should lack them"
    for r in dump["ranks"]:
        assert sorted(r["report"]["missing_left_by_init"]) == left, f"rank {r['rank']}"
    assert set(got["state"]) == set(state)
    for key, expected in state.items():
        actual = got["state"][key]
        assert actual.dtype == expected.dtype, key
        if key in left:
            assert not actual.any(), f"{key}: not zeros"
        else:
            assert torch.equal(actual, expected), f"{key}: values differ"
    assert got["loading_info"] == info


def test_tied_but_different_lm_head_is_untied(results, paths):
    _, _, tied = plain("tied_but_different", paths["llama_tied_but_different"])
    assert tied == set(), "plain load unties a checkpoint whose lm_head differs"
    got = results["tied_but_different"]["rank0"]["state"]
    assert not torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])


def test_keep_in_fp32_params_stay_fp32(results):
    got = results["keep_in_fp32"]["rank0"]["state"]
    assert got["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


def _same_error_on_every_rank(dump):
    errors = [r.get("error") for r in dump["ranks"]]
    assert all(errors), f"every rank must fail: {errors}"
    assert len({(e["type"], e["message"]) for e in errors}) == 1, errors
    return errors[0]


def test_mismatched_shape_without_ignore_fails_on_every_rank(results):
    error = _same_error_on_every_rank(results["mismatch_no_ignore"])
    assert error["type"] == "RuntimeError" and "ignore_mismatched_sizes" in error["message"]


def test_broken_conversion_is_an_error_on_every_rank(results):
    error = _same_error_on_every_rank(results["broken_conversion"])
    assert "ConversionMismatchError" in error["mro"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in error["message"]
    assert "experts.0.w1.weight" in error["message"]
    assert "allow_suspicious_missing_keys" in error["message"]


def test_a_checkpoint_prefix_the_loader_does_not_map_is_an_error_on_every_rank(results):
    """shieldgemma2 as transformers saves it: a plain load initialises the whole language model at random (with a
    MISSING/UNEXPECTED table on one rank's log); ours names the keys that look alike and refuses."""
    error = _same_error_on_every_rank(results["prefix_not_mapped"])
    assert "ConversionMismatchError" in error["mro"]
    missing = "model.language_model.embed_tokens.weight"
    unexpected = "model.model.language_model.model.embed_tokens.weight"
    assert f"{missing} <- unexpected: {unexpected}" in error["message"]
    assert "allow_suspicious_missing_keys" in error["message"]


def test_a_head_whose_body_transformers_does_not_map_is_an_error_on_every_rank(results):
    """LlamaForQuestionAnswering (body `transformer.`) from a LlamaForCausalLM checkpoint (`model.`): a plain load
    initialises every body weight at random; ours names the pair of bodies and the `key_mapping` that maps them, and
    refuses (opting out loads as the plain load, and so does the key mapping: `test_equal_to_plain_load`)."""
    error = _same_error_on_every_rank(results["body_not_mapped"])
    assert "ConversionMismatchError" in error["mro"]
    assert "holds its body as 'transformer.', the checkpoint as 'model.'" in error["message"]
    assert "transformer.embed_tokens.weight <- unexpected: model.embed_tokens.weight" in error["message"]
    assert "key_mapping={r'^model\\.': 'transformer.'}" in error["message"]


def test_a_fusion_transformers_does_not_map_for_the_checkpoint_is_an_error_on_every_rank(results):
    """`fusion_config={"patch_embeddings": True}` on Qwen2-VL as transformers 5.23 saves it (`visual.*`): the fused
    Linear's converter does not meet the checkpoint's Conv3d weight, and a plain load initialises the patch embedding
    at random (MISSING/UNEXPECTED in its loading info). Ours names the pair and refuses. (Qwen3-VL's fusion loads:
    `test_equal_to_plain_load[fusion_config]`.)"""
    error = _same_error_on_every_rank(results["fusion_config_not_mapped"])
    assert "ConversionMismatchError" in error["mro"]
    assert "model.visual.patch_embed.linear_proj.weight <- unexpected: model.visual.patch_embed.proj.weight" in (
        error["message"])


def test_an_init_that_rewrites_loaded_weights_in_place_is_refused_on_every_rank(results):
    """transformers' plain load divides Mamba's loaded out_proj.weight when `rescale_prenorm_residual=True`: a
    silently changed checkpoint value, which ours refuses with the reason instead of copying."""
    error = _same_error_on_every_rank(results["init_writes_loaded_param"])
    assert "LoaderError" in error["mro"]
    assert "MambaModel._init_weights(backbone.layers.0.mixer: MambaMixer)" in error["message"]
    assert "rescale_prenorm_residual" in error["message"]


def test_keep_in_fp32_default_loads_engine_dtype_and_trains(results, paths):
    """DeepSpeed ZeRO-3 holds one dtype: by default the fp32-kept params come in bf16 (the plain value, cast)."""
    got = results["keep_in_fp32_default"]["rank0"]
    assert "error" not in got, got.get("error", {}).get("traceback")
    state, _, _ = plain("keep_in_fp32", paths["ernie"])
    for key, expected in state.items():
        actual = got["state"][key]
        is_param = not key.endswith(("inv_freq", "original_inv_freq"))
        want = expected.to(torch.bfloat16) if is_param and expected.is_floating_point() else expected
        assert actual.dtype == want.dtype and torch.equal(actual, want), key
    assert len(got["losses"]) == 2 and all(loss == loss for loss in got["losses"])
