"""Generate model_cards/ from a registry of families and the tests that verify them.

    python scripts/model_cards.py            # (re)write model_cards/
    python scripts/model_cards.py --check    # exit 1 if model_cards/ differs from what this would write (CI)

Nothing a card says about verification is typed by hand: world sizes, dtypes, expert-parallel sizes and streaming
come from the tests' own definitions (tests/test_fidelity.py CHECKPOINTS, tests/test_expert_parallel.py RUNS and
TRAINED, tests/test_missing_and_guards.py CASES, tests/test_streaming.py STREAMED, tests/families.py SWEEP and
HEAD_SWEEP), so a card can only name what those tests run, and `tests/test_model_cards.py` fails when the committed
cards drift.
The registry below holds what tests cannot: how each family's checkpoint is laid out and converted.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# family (model type) -> (title, card file, layout notes)
FEATURED = {
    "qwen3_moe": ("Qwen3-MoE", "qwen3_moe.md", [
        "**On disk** (`save_pretrained`): one tensor per expert, `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`.",
        "**In the model**: fused `mlp.experts.gate_up_proj [E, 2I, H]` and `mlp.experts.down_proj [E, H, I]`.",
        "**Conversion**: `MergeModulelist(dim=0)` + `Concatenate(dim=1)` for gate/up, `MergeModulelist(dim=0)` for down. "
        "Both are row-local: each rank reads, per expert, only the gate and up rows of its flat partition range.",
        "Also the conversion of the model types transformers maps to `qwen2_moe` (deepseek_v2/v3, glm4_moe, olmoe, "
        "hunyuan_v1_moe, qwen3_next, ernie4_5_moe and more).",
    ]),
    "mixtral": ("Mixtral", "mixtral.md", [
        "**On disk**: `model.layers.{i}.mlp.experts.{e}.w1/w3/w2.weight` (older checkpoints: `block_sparse_moe.`, renamed "
        "by transformers' mapping).",
        "**In the model**: fused `mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`.",
        "**Conversion**: renames, `MergeModulelist(dim=0)` + `Concatenate(dim=1)` (w1, w3), `MergeModulelist(dim=0)` (w2).",
    ]),
    "llama": ("Llama (dense; tied and untied embeddings)", "llama.md", [
        "**On disk = in the model**: no conversion ops; each parameter is one contiguous read of its partition range.",
        "**Tied embeddings**: `save_pretrained` drops `lm_head.weight`; the loader ties it to the embedding (one ZeRO-3 "
        "partition). A checkpoint whose `lm_head` differs while the config says tie is untied with transformers' "
        "warning, as the plain load does.",
    ]),
    "ernie4_5_moe": ("Ernie 4.5 MoE", "ernie4_5_moe.md", [
        "**fp32 parameters**: `_keep_in_fp32_modules_strict = [\"gate.weight\", \"moe_statics\"]`. DeepSpeed ZeRO-3 "
        "(0.19.8) keeps all trainable parameters in one dtype, so by default they are loaded in the engine's dtype with "
        "a warning naming them; `keep_in_fp32=True` keeps the plain dtype (freeze them before `deepspeed.initialize`).",
    ]),
    "qwen3_vl_moe": ("Qwen3-VL-MoE", "qwen3_vl_moe.md", [
        "**On disk**: released checkpoints store fused experts transposed (`gate_up_proj [E, H, 2I]`); transformers maps "
        "them with `Transpose(1, 2, check_dims=True)`, which transposes only when the disk shape differs from the "
        "model's. The check uses the model's true shape; a transpose of the last dimension becomes strided reads. "
        "transformers' own ZeRO-3 load (5.24) does not apply it: `size mismatch for ...mlp.experts.gate_up_proj`, "
        "raised on rank 0 only, while the other ranks finish the load and go on.",
        "**Expert parallelism**: DeepSpeed 0.19.8 has no AutoEP preset for it; the config names the Qwen3-MoE preset, "
        "the language model's MoE layers and `top_k` (AutoEP reads `num_experts_per_tok` from the top-level config, "
        "where this model has none): `\"expert_parallel\": {\"autoep_size\": 2, \"preset_model\": \"qwen3_moe\", "
        "\"moe_layer_pattern\": \"model\\\\.language_model\\\\.layers\\\\.\\\\d+\\\\.mlp\", \"top_k\": 8}` "
        "(8: Qwen3-VL-30B-A3B's `text_config.num_experts_per_tok`). Without `top_k`, a `ConfigError` on every rank "
        "says so. The vision tower is dense and partitioned over the world.",
    ]),
    "qwen2_moe": ("Qwen2-MoE", "qwen2_moe.md", [
        "**On disk**: per-expert tensors, a shared expert `mlp.shared_expert.*` and its gate `mlp.shared_expert_gate`.",
        "**Expert parallelism**: AutoEP keeps the shared expert as `mlp.shared_experts` and its gate as "
        "`mlp.shared_experts_gate` (same tensors, new names).",
    ]),
    "deepseek_v2": ("DeepSeek-V2", "deepseek_v2.md", [
        "**Conversion**: the `qwen2_moe` expert merge; shared experts `mlp.shared_experts.*`.",
    ]),
    "deepseek_v3": ("DeepSeek-V3", "deepseek_v3.md", [
        "**On disk**: per-expert tensors from `first_k_dense_replace` on, shared experts, and the router's persistent "
        "`mlp.gate.e_score_correction_bias` buffer.",
        "**Expert parallelism**: the correction bias moves to AutoEP's router (`mlp.router.e_score_correction_bias`) and "
        "is read whole by every rank, as buffers are. Dense layers stay plain MLPs.",
    ]),
    "qwen3_5_moe_text": ("Qwen3.5-MoE (text)", "qwen3_5_moe.md", [
        "**On disk**: per-expert tensors, shared expert and gate as in Qwen2-MoE; linear-attention (gated delta net) and "
        "full-attention layers.",
    ]),
    "fp8": ("Fine-grained FP8 checkpoints (DeepSeek-V3/R1, Qwen3-FP8, GLM-4.5-FP8, ...)", "fp8.md", [
        "**On disk**: each quantized Linear weight in `float8_e4m3fn` with a float32 `weight_scale_inv` per block "
        "(usually 128 x 128; any grid that divides the weight); `modules_to_not_convert` stay bf16.",
        "**Loading**: transformers' `Fp8Dequantize` runs first in each converter chain (per-expert weights are "
        "dequantized, then merged). Here each rank reads the FP8 bytes of its partition's elements and the scale rows "
        "covering them, and computes `(weight * scale).to(dtype)` exactly as the op does; the plan counts ~1 byte an "
        "element instead of 2. Ask for it as transformers users do: `quantization_config=FineGrainedFP8Config("
        "dequantize=True)` (on a machine without a suitable GPU transformers switches to it by itself, with its "
        "warning). Keeping the weights in FP8 is refused under ZeRO-3 with what to pass instead.",
    ]),
    "mxfp4": ("MXFP4 checkpoints (GPT-OSS)", "mxfp4.md", [
        "**On disk**: GPT-OSS experts as `*_blocks` (two FP4 values a byte, 32 a block) and `*_scales` (E8M0 "
        "exponents); the rest bf16.",
        "**Loading**: transformers' `Mxfp4Dequantize` (`quantization_config=Mxfp4Config(dequantize=True)`) unpacks and "
        "transposes; here each rank reads the blocks and exponents under its partition and computes its elements "
        "with the same lookup table and `ldexp`.",
    ]),
    "ernie4_5_vl_moe": ("Ernie 4.5 VL MoE", "ernie4_5_vl_moe.md", [
        "**Conversion**: `ErnieFuseAndSplitTextVisionExperts` splits each expert list into text and vision halves and "
        "fuses gate and up of each half; a shard-on-read rule stacks and concatenates the same pieces symbolically.",
    ]),
    "minimax_m3_vl_text": ("MiniMax-M3 (text)", "minimax_m3_vl.md", [
        "**On disk**: fused `mlp.experts.gate_up_proj` / `down_proj` as in the model (no conversion op), shared experts, "
        "router correction bias. AutoEP's preset computes its clamped SwiGLU.",
    ]),
    "glm4_moe": ("GLM-4.5 MoE", "glm4_moe.md", [
        "**Expert parallelism**: DeepSpeed 0.19.8 has no AutoEP preset for `glm4_moe`; its structure is DeepSeek-V3's "
        "(shared experts, a router correction bias, grouped top-k), so the config names that preset, as engine-side "
        "AutoEP needs: `\"expert_parallel\": {\"enabled\": true, \"autoep_size\": E, \"preset_model\": "
        "\"deepseek_v3\"}`.",
    ]),
    "minimax_m2": ("MiniMax-M2", "minimax_m2.md", [
        "**On disk**: one tensor per expert under `block_sparse_moe.experts.{e}.w1/w2/w3`, renamed and fused by "
        "transformers' mapping; the router correction bias sits on the MoE block itself.",
        "**Expert parallelism**: no AutoEP preset for `minimax_m2`; the config names MiniMax-M3's "
        "(`\"preset_model\": \"minimax_m3\"`). Each rank reads only its share of its local experts' per-expert tensors.",
    ]),
    "olmoe": ("OLMoE", "olmoe.md", [
        "**Expert parallelism**: no AutoEP preset for `olmoe`; the config names Qwen3-MoE's (`\"preset_model\": "
        "\"qwen3_moe\"`) or DeepSpeed's custom patterns (`moe_layer_pattern`, `num_experts_attr: \"num_experts\"`, "
        "`route_norm: false`).",
    ]),
}


def verification() -> dict:
    """family -> list of (what, where) lines, from the tests' own definitions."""
    from tests import (families, test_expert_parallel, test_fidelity, test_missing_and_guards, test_quantized,
                       test_streaming)

    found: dict[str, list[tuple[str, str]]] = {}

    def add(family, text, where):
        found.setdefault(family, []).append((text, where))

    by_family: dict[str, list] = {}
    for name, (family, saved, sharded) in test_fidelity.CHECKPOINTS.items():
        by_family.setdefault(family.split("_")[0] if family.startswith("llama") else family, []).append(
            (name, saved, sharded))
    for family, entries in by_family.items():
        saved = sorted({str(s).removeprefix("torch.") for _, s, _ in entries})
        kinds = sorted({"sharded" if sh else "single-file" for _, _, sh in entries})
        extra = " tied and untied;" if family == "llama" else ""
        add(family, f"world sizes {', '.join(map(str, test_fidelity.WORLD_SIZES))}; engine dtypes "
                    f"{', '.join(test_fidelity.DTYPES)}; checkpoints saved in {', '.join(saved)};{extra} "
                    f"{' and '.join(kinds)}; every gathered parameter and buffer bit- and dtype-equal to the plain "
                    "load; bytes read per rank = its exact share; no collective during the load", "tests/test_fidelity.py")
    cases_by_path = {"qwen": "qwen3_moe", "llama": "llama", "qwen_missing_experts": "qwen3_moe",
                     "llama_tied_but_different": "llama", "ernie": "ernie4_5_moe", "qwen3_vl_moe": "qwen3_vl_moe",
                     "qwen_broken": "qwen3_moe", "mamba_rescale": "mamba",
                     "shieldgemma2": "shieldgemma2", "qwen_renamed": "qwen3_moe", "in_subfolder": "qwen3_moe",
                     "remote_code": "llama", "youtu_padding": "youtu", "metaclip_no_scale": "metaclip_2",
                     "omni_no_talker_experts": "qwen3_omni_moe", "qwen3_vl": "qwen3_vl", "qwen2_vl": "qwen2_vl",
                     "qwen_bf16": "qwen3_moe", "dac_no_conv_bias": "dac", "wav2vec2_no_weight_norm_v": "wav2vec2"}
    for name, (path, *_rest) in test_missing_and_guards.CASES.items():
        add(cases_by_path[path], f"world size 2: `{name}` equal to the plain load (or refused alike on every rank)",
            "tests/test_missing_and_guards.py")
    for world, runs in test_expert_parallel.RUNS.items():
        for family, ep, dtype, *extra in runs:
            fp8 = " (an FP8 checkpoint, dequantized on read)" if family == test_expert_parallel.FP8 else ""
            named = extra[0] if extra and extra[0] else test_expert_parallel.EP_NAMED_STRUCTURE.get(family, {})
            named = (f" (preset `{named['preset_model']}` named in the config)" if "preset_model" in named else
                     " (custom AutoEP patterns in the config)" if named else "")
            keywords = "".join(f", {k}={v!r}" for k, v in (extra[1] if len(extra) > 1 else {}).items())
            add(family.removesuffix("_fp8"), f"expert parallelism: world size {world}, ep_size {ep}, {dtype}{fp8}"
                f"{named}{keywords}: local experts equal the plain load's slices, everything else equal",
                "tests/test_expert_parallel.py")
    for world, family, ep in test_expert_parallel.TRAINED:
        add(family, f"expert parallelism: 3 AdamW steps at world size {world}, ep_size {ep} equal DeepSpeed's "
                    "engine-side AutoEP; checkpoints round-trip", "tests/test_expert_parallel.py")
    for family, worlds in test_streaming.STREAMED.items():
        add(family, f"streamed to ranks without the files at world sizes {', '.join(map(str, worlds))}",
            "tests/test_streaming.py")
    for fmt, fams in test_quantized.FORMATS.items():
        worlds = ", ".join(map(str, test_quantized.WORLD_SIZES))
        add(fmt, f"{', '.join(fams)} in {fmt.upper()} at world sizes {worlds}: every gathered parameter equal to the "
                 "plain dequantized load; each rank reads its share of the quantized bytes and the scales it touches",
            "tests/test_quantized.py")
    add("ernie4_5_vl_moe", "world sizes 2, 3, 4: bit-exact, text and vision experts", "tests/test_quantized.py")
    for family in families.SWEEP:
        add(family, f"family sweep: world sizes {', '.join(map(str, families.SWEEP_WORLD_SIZES))}, bit-exact",
            "tests/test_families.py")
    return found


def render() -> dict[str, str]:
    import transformers

    from tests import families

    verified = verification()
    files = {}
    for family, (title, card, notes) in FEATURED.items():
        lines = [f"# {title} (`{family}`)", "", *[f"- {n}" for n in notes], "", "## Verified", ""]
        lines += [f"- {text} (`{where}`)" for text, where in verified.get(family, [])]
        files[card] = "\n".join(lines) + "\n"
    index = ["# Model cards", "",
             "Generated by `python scripts/model_cards.py` from a registry of families and the tests that verify them; "
             "`tests/test_model_cards.py` fails in CI when these files differ from what the script writes, so a card "
             "names only families and world sizes that a test runs.", "",
             "\"Verified\" means: real multi-process loads (DeepSpeed, gloo), every gathered parameter and buffer equal "
             "bit for bit and dtype for dtype to plain single-process `from_pretrained` of the same checkpoint.", "",
             "| family | card | world sizes | expert parallelism (world size / ep_size) |", "|---|---|---|---|"]
    for family, (title, card, _) in FEATURED.items():
        texts = [t for t, _ in verified.get(family, [])]
        worlds = sorted({int(w) for t in texts for w in re.findall(r"world sizes? ((?:\d+(?:, )?)+)", t)
                         for w in re.findall(r"\d+", w)})
        ep = sorted({(int(a), int(b)) for t in texts for a, b in re.findall(r"world size (\d+), ep_size (\d+)", t)})
        index.append(f"| {title} | [{card}]({card}) | {', '.join(map(str, worlds))} | "
                     f"{', '.join(f'{a}/{b}' for a, b in ep) or '-'} |")
    index += ["", f"## The family sweep ({len(families.SWEEP)} model types)", "",
              "Every causal-LM model type transformers 5.23 can build small from its own config class, saved with "
              f"`save_pretrained` and loaded bit-exact at world sizes "
              f"{', '.join(map(str, families.SWEEP_WORLD_SIZES))}; saved without a gather at world size 3 into "
              "byte for byte the files transformers' own `save_pretrained` writes; and, with a layer and the head "
              "missing from the checkpoint, initialised at world size 3 in 4 KiB chunks to the plain load's values "
              "(`tests/test_families.py`); and loaded at world size 3 from a state dict (`state_dict=`, half in the "
              "checkpoint's layout, half the model's own `state_dict()`) bit-exact like the plain load of it "
              "(`tests/test_state_dict.py`):", "",
              ", ".join(f"`{t}`" for t in families.SWEEP), "",
              "The families among these whose own config ties the output embedding to the input one load tied at world "
              "size 3 too, and save: the tied names are one tensor, as in the plain load.", ""]
    if families.NOT_BUILT:
        index += ["The other causal-LM model types of transformers 5.23, and why they are not in this sweep: " +
                  "; ".join(f"`{t}` ({why})" for t, why in families.NOT_BUILT.items()) + ".", ""]
    heads = sum(len(types) for types in families.HEAD_SWEEP.values())
    index += [f"## The head sweep ({heads} model types and heads)", "",
              "Model types of these auto classes built small from their own configs (vision, audio, encoder, decoder "
              "and backbone sub-configs shrunk too), saved with `save_pretrained` and loaded through their "
              f"own auto class bit-exact at world size {families.HEAD_SWEEP_WORLD_SIZE}, then saved without a gather into "
              "byte for byte the files transformers' own `save_pretrained` writes (`tests/test_families.py`). "
              f"{' and '.join(f'`{c}`' for c in families.TIED_HEADS)} keep their configs' tied decoder; the others are "
              "untied. `AutoModel` lists the bare models of the types no other class here sweeps (dual encoders, "
              "vision and audio towers, ...) and of the contrastive models (CLIP, SigLIP, BLIP, MetaCLIP 2).", ""]
    for model_class, types in sorted(families.HEAD_SWEEP.items()):
        index += [f"- `{model_class}` ({len(types)}): " + ", ".join(f"`{t}`" for t in types)]
    new_in_5_24 = [t for _, t in families.NEW_IN_5_24]
    index += ["", f"## Model types transformers 5.24 added ({len(new_in_5_24)})", "",
              "With transformers 5.24 installed (what a fresh install gets), each through its own auto class at world "
              "size 3: loaded bit-exact, then saved without a gather into byte for byte the files its `save_pretrained` "
              "writes (`tests/test_families.py`; Dory also from its original layer-pair layout): "
              + ", ".join(f"`{t}` ({c})" for c, t in families.NEW_IN_5_24) + "."]
    # the lists below are of transformers 5.23's types, whichever version writes or checks them
    swept = set(families.SWEEP).union(*families.HEAD_SWEEP.values(), FEATURED, new_in_5_24,
                                      families.NOT_SWEPT_5_24)
    index += ["", "Model types of these auto classes (other than `AutoModel`) that neither a sweep nor a card above "
              "covers, and why (`HEAD_NOT_SWEPT` in `tests/families.py`):"]
    unexplained = set()
    for model_class in sorted(families.HEAD_SWEEP):
        left = sorted(set(getattr(transformers, model_class)._model_mapping._model_mapping) - swept)
        if model_class != "AutoModel" and left:
            index += [f"- `{model_class}` ({len(left)}): " + ", ".join(f"`{t}`" for t in left)]
            unexplained.update(t for t in left if t not in families.HEAD_NOT_SWEPT)
    if unexplained:
        raise SystemExit(f"model types in no sweep without a reason in HEAD_NOT_SWEPT: {sorted(unexplained)}")
    index += [""] + [f"- `{t}`: {why}." for t, why in sorted(families.HEAD_NOT_SWEPT.items())]
    index += [""]
    files["README.md"] = "\n".join(index)
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--folder", default=os.path.join(REPO, "model_cards"))
    args = ap.parse_args()
    folder = args.folder
    files = render()
    if args.check:
        problems = []
        present = {f for f in os.listdir(folder) if f.endswith(".md")}
        for name in sorted(present - set(files)):
            problems.append(f"model_cards/{name} is not generated (no registry entry)")
        for name, text in files.items():
            path = os.path.join(folder, name)
            current = open(path).read() if os.path.exists(path) else ""
            if current != text:
                diff = "".join(difflib.unified_diff(current.splitlines(True), text.splitlines(True), name, name, n=0))
                problems.append(f"model_cards/{name} differs from the generated card:\n{diff[:2000]}")
        print("\n".join(problems) if problems else f"model_cards/ up to date ({len(files)} files)")
        return 1 if problems else 0
    for name in os.listdir(folder):
        if name.endswith(".md") and name not in files:
            os.remove(os.path.join(folder, name))
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    print(f"wrote {len(files)} files to model_cards/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
