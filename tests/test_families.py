"""The family sweep (tests/families.py): every listed model type loads bit- and dtype-exact at world sizes 2, 3 and 4,
each world size one torchrun job over all families (at 3, the job that then saves without a gather into the very files
transformers' own save_pretrained writes); and with its second layer and head missing from the checkpoint, initialises
them at world size 3 to the plain load's values (same seed) through the byte-bounded chunks of `missing_init.py`.
Families whose own config ties the output embedding load tied at world size 3 as well; tied names must be one tensor,
as in the plain load, not equal copies. Other heads (HEAD_SWEEP) load and save at world size 3, and pretrained bodies
load into new task heads. The model cards name exactly these families.

Tiers (tests/tiers.py): each check runs in the default tier over the representative families (REPRESENTATIVE,
REPRESENTATIVE_HEADS) and in the sweep over every family of the slice."""

from __future__ import annotations

import functools
import os
import re

import pytest
import torch

from tests import tiers
from tests.checkpoints import rewrite_checkpoint
from tests.conftest import run_torchrun
from tests.families import (EXTRA_FILES_FOR, HEAD_SWEEP, HEAD_SWEEP_WORLD_SIZE, SWEEP, SWEEP_WORLD_SIZES,
                            head_checkpoint, small_head_config, sweep_checkpoint)
from tests.test_saving import same_files


# The default tier's families: dense untied (Llama), tied by their own config (Gemma; GPT-2's Conv1D), fused MoE
# (Qwen3-MoE), MLA with shared experts (DeepSeek-V3), hybrid conv + MoE (LFM2-MoE) and Mamba + attention + MoE
# (Granite-MoE-hybrid)
REPRESENTATIVE = ("llama", "gemma", "gpt2", "qwen3_moe", "deepseek_v3", "lfm2_moe", "granitemoehybrid")
# and heads: a vision-language MoE, an encoder-decoder with one module per expert, a masked LM (tied head)
REPRESENTATIVE_HEADS = {"AutoModelForImageTextToText": ("qwen3_vl_moe",),
                        "AutoModelForSeq2SeqLM": ("switch_transformers",), "AutoModelForMaskedLM": ("bert",)}
TIERS = [pytest.param("default"), pytest.param("sweep", marks=pytest.mark.sweep(by_type=True))]


def families(tier: str, of=SWEEP) -> list:
    """The model types a check runs over: the representative ones by default, the sweep slice's in the sweep."""
    return [t for t in of if t in REPRESENTATIVE] if tier == "default" else tiers.sliced(of)


def sweep_checkpoints(workdir: str, types) -> dict:
    return {t: sweep_checkpoint(workdir, t) for t in types}


def compare_with_plain_loads(cases: list[dict], world_size: int, workdir: str, seed=None, as_expected=None) -> list:
    """Run the cases in one torchrun job; each rank 0 state is compared with plain `from_pretrained` of the same
    folder (after `torch.manual_seed(seed)` when given). `as_expected(case, name, ours, plain)` overrides the default
    check (equal dtype and bits). Returns the failures, one line per family."""
    dumps = run_torchrun(world_size, cases, workdir, timeout=1500)
    return [f for case, dump in zip(cases, dumps) if (f := load_failure(case, dump, seed, as_expected))]


def folder_signature(path: str) -> tuple:
    """What a folder holds, as far as a cached plain load of it goes: each file's name, size and modification time."""
    return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path) if e.is_file()))


@functools.lru_cache(maxsize=256)  # a checkpoint is compared at several world sizes and paths: loaded plain once
def plain_load(path: str, model_class: str, dtype: str, seed, signature: tuple) -> tuple[dict, list]:
    """Plain single-process `from_pretrained` of the folder (after `torch.manual_seed(seed)` when given): every
    parameter and buffer, and which names share one tensor. `signature` (`folder_signature`) keys the cache."""
    import transformers

    from tests.dist_worker import sharing

    if seed is not None:
        torch.manual_seed(seed)
    # one thread, as the ranks run (OMP_NUM_THREADS=1): LAPACK-based inits (`orthogonal_`'s QR) round by thread count
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = getattr(transformers, model_class).from_pretrained(path, dtype=getattr(torch, dtype))
    finally:
        torch.set_num_threads(threads)
    reference = {n: t.detach() for n, t in [*plain.named_parameters(remove_duplicate=False),
                                             *plain.named_buffers(remove_duplicate=False)]}
    return reference, sharing(plain)


def load_failure(case: dict, dump: dict, seed=None, as_expected=None) -> str | None:
    """Why rank 0's gathered state differs from a plain load of the case's folder through the case's `model_class`
    (default AutoModelForCausalLM) in the case's `plain_dtype` (default float32); None when it does not."""
    got = dump["rank0"]
    if "error" in got:
        return f"{case['name']}: {got['error']['type']}: {got['error']['message'][:200]}"
    reference, plain_sharing = plain_load(case["path"], case.get("model_class", "AutoModelForCausalLM"),
                                          case.get("plain_dtype", "float32"), seed, folder_signature(case["path"]))
    if set(got["state"]) != set(reference):
        return f"{case['name']}: names differ: {sorted(set(got['state']) ^ set(reference))[:4]}"
    if "sharing" in got and got["sharing"] != plain_sharing:
        return f"{case['name']}: tied tensors differ: {got['sharing']} vs the plain load's {plain_sharing}"
    differ = [n for n, want in reference.items()
              if not (as_expected(case, n, got["state"][n], want) if as_expected else
                      got["state"][n].dtype == want.dtype and torch.equal(got["state"][n], want))]
    return f"{case['name']}: {len(differ)} tensors differ, e.g. {differ[:3]}" if differ else None


def save_failure(case: dict, dump: dict, loads_back_whole: bool = True) -> str | None:
    """Why the case's save (hf_zero3_loader.save_pretrained, each rank writing its share) is not byte for byte what
    transformers' save_pretrained writes for the gathered model, or does not load back to the saved values; None
    when it is and does. `loads_back_whole=False` for a model transformers cannot load back from its own save."""
    import transformers

    errors = [r.get("error") or r.get("save_error") for r in dump["ranks"] if "error" in r or "save_error" in r]
    if errors:
        return f"{case['name']}: {errors[0]['type']}: {errors[0]['message'][:200]}"
    folder = case["save"]["dir"]
    try:
        same_files(folder, folder + ".reference")  # transformers' save_pretrained of the gathered model
    except AssertionError as e:
        return f"{case['name']}: {e}"
    if not loads_back_whole:
        return None
    model_class = getattr(transformers, case.get("model_class", "AutoModelForCausalLM"))
    model, info = model_class.from_pretrained(folder, output_loading_info=True)
    if any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
        return f"{case['name']}: loading the saved folder reports {info}"
    loaded = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    differ = [n for n, want in dump["rank0"]["trained_state"].items()
              if n not in loaded or loaded[n].dtype != want.dtype or not torch.equal(loaded[n].detach(), want)]
    if differ:
        return f"{case['name']}: {len(differ)} tensors differ after loading the saved folder: {differ[:3]}"
    return None


SAVE_WORLD_SIZE = 3  # (partitions padded) the save sweep loads there and checks the load too


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("world_size", [w for w in SWEEP_WORLD_SIZES if w != SAVE_WORLD_SIZE])
def test_every_family_in_the_sweep_equals_the_plain_load(workdir, world_size, tier):
    checkpoints = sweep_checkpoints(workdir, families(tier))
    cases = [{"name": t, "path": path, "dtype": "float32", "out": os.path.join(workdir, f"sweep_{t}_w{world_size}.pt")}
             for t, path in checkpoints.items()]
    failures = compare_with_plain_loads(cases, world_size, workdir)
    assert not failures, "\n".join(failures)


STAGED_BUDGET = 64 * 1024  # bytes: many slots per rank, each holding pieces of several destinations


@pytest.mark.sweep(by_type=True)
def test_every_family_in_the_sweep_equals_the_plain_load_through_the_staged_path(workdir):
    """The accelerator path (host staging slots, pieces laid out in destination order, one copy per run), forced on
    CPU ranks: every family at W=3 (partitions padded) with a 64 KiB budget and 2 reader threads equals the plain
    load bit for bit and by dtype, and every load took the staged path. (The default tier's staged loads:
    tests/test_staging.py.)"""
    checkpoints = sweep_checkpoints(workdir, tiers.sliced(SWEEP))
    cases = [{"name": t, "path": path, "dtype": "float32",
              "kwargs": {"staging_bytes": STAGED_BUDGET, "read_threads": 2},
              "out": os.path.join(workdir, f"sweep_staged_{t}.pt")} for t, path in checkpoints.items()]
    dumps = run_torchrun(SAVE_WORLD_SIZE, cases, workdir, timeout=1500, env={"HF_ZERO3_LOADER_FORCE_STAGING": "1"})
    failures = [f for case, dump in zip(cases, dumps) if (f := load_failure(case, dump))]
    failures += [f"{case['name']}: not staged" for case, dump in zip(cases, dumps)
                 if "error" not in dump["rank0"] and "staging" not in dump["rank0"]["report"]]
    assert not failures, "\n".join(failures)


def dory_in_its_original_layout(path: str, dst: str) -> str:
    """Dory's checkpoint as published: each layer an attention block `layers.{2i}.mixer` and an mlp block
    `layers.{2i+1}.mixer` (transformers 5.24's `LayerPairCollapse` renames them when loading; its save keeps its own)."""
    def split_layers(tensors: dict) -> dict:
        out = {}
        for key, value in tensors.items():
            if m := re.match(r"backbone\.layers\.(\d+)\.(self_attn|mlp|lambda_1|lambda_2)(.*)", key):
                i, part, rest = int(m[1]), m[2], m[3]
                key = {"self_attn": f"backbone.layers.{2 * i}.mixer", "mlp": f"backbone.layers.{2 * i + 1}.mixer",
                       "lambda_1": f"backbone.layers.{2 * i}.attn_alpha",
                       "lambda_2": f"backbone.layers.{2 * i + 1}.mlp_alpha"}[part] + rest
            out[key] = value
        return out

    return rewrite_checkpoint(path, dst, split_layers)


@pytest.mark.sweep(by_type=True)
def test_families_new_in_transformers_5_24_load_and_save_like_plain_transformers(workdir):
    """With transformers 5.24 installed: its new model types at W=3, loaded bit-exact and saved into the files its
    save_pretrained writes (Inkling2-Loop's unembedding padded in the file, unpadded by a 5.24 conversion op, and
    padded again with zeros when saved); Dory also from its original layer-pair layout."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from tests.checkpoints import make_checkpoint
    from tests.families import NEW_IN_5_24, small_config

    if not all(t in CONFIG_MAPPING_NAMES for _, t in NEW_IN_5_24):
        pytest.skip("transformers < 5.24")
    import transformers

    cases = []
    for model_class, t in tiers.sliced(NEW_IN_5_24, key=lambda entry: entry[1]):
        config = (small_config(t) if model_class == "AutoModelForCausalLM" else small_head_config(t, model_class))
        path = make_checkpoint(os.path.join(workdir, "new_in_5_24", t), t, config=config,
                               model_class=getattr(transformers, model_class), sharded=True)
        cases.append({"name": t, "path": path, "dtype": "float32", "model_class": model_class, "seed": 0,
                      "out": os.path.join(workdir, f"new_in_5_24_{t}.pt"),
                      "save": {"dir": os.path.join(workdir, "new_in_5_24_saved", t), "kwargs": {}, "reference": True}})
        if t == "dory":
            original = dory_in_its_original_layout(path, os.path.join(workdir, "new_in_5_24", "dory_original"))
            cases.append({"name": "dory (original layout)", "path": original, "dtype": "float32", "seed": 0,
                          "out": os.path.join(workdir, "new_in_5_24_dory_original.pt")})
    dumps = run_torchrun(SAVE_WORLD_SIZE, cases, workdir, timeout=1500)
    failures = [f for case, dump in zip(cases, dumps)
                if (f := load_failure(case, dump, seed=0) or ("save" in case and save_failure(case, dump)))]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("tier", TIERS)
def test_families_whose_config_ties_the_embeddings_equal_the_plain_load_tied(workdir, tier):
    """The sweep's families whose own config ties the output embedding to the input one (Gemma, GPT-2, BERT, ...),
    loaded at W=3 with that tie kept: the same values, and the tied names one tensor, as in the plain load; saved
    without a gather into the files transformers' save_pretrained writes (the tied copy left out, as it does)."""
    from tests.families import NOT_TIED, small_config, ties_embeddings

    tied = [t for t in SWEEP if t not in NOT_TIED and ties_embeddings(small_config(t, tied=True))]
    assert len(tied) > 50
    tied = families(tier, tied)
    cases = [{"name": f"{t} (tied)", "path": sweep_checkpoint(workdir, t, tied=True), "dtype": "float32",
              "out": os.path.join(workdir, f"sweep_tied_{t}.pt"),
              "save": {"dir": os.path.join(workdir, "sweep_tied_saved", t), "kwargs": {}, "reference": True}}
             for t in tied]
    dumps = run_torchrun(SAVE_WORLD_SIZE, cases, workdir, timeout=1500)
    failures = [f for case, dump in zip(cases, dumps) if (f := load_failure(case, dump) or save_failure(case, dump))]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("tier", TIERS)
def test_every_family_in_the_sweep_loads_at_3_ranks_and_saves_the_files_plain_save_pretrained_writes(workdir, tier):
    """Loaded at W=3, equal to the plain load (the sweep's third world size), then saved with
    hf_zero3_loader.save_pretrained (each rank writes its share): the folder is byte for byte what transformers'
    save_pretrained writes for the gathered model, and loads back with nothing missing."""
    assert SAVE_WORLD_SIZE in SWEEP_WORLD_SIZES
    checkpoints = sweep_checkpoints(workdir, families(tier))
    cases = [{"name": t, "path": path, "dtype": "float32", "out": os.path.join(workdir, f"sweep_save_{t}.pt"),
              "save": {"dir": os.path.join(workdir, "sweep_saved", t), "kwargs": {}, "reference": True}}
             for t, path in checkpoints.items()]
    dumps = run_torchrun(SAVE_WORLD_SIZE, cases, workdir, timeout=1500)
    failures = [f for case, dump in zip(cases, dumps) if (f := load_failure(case, dump) or save_failure(case, dump))]
    assert not failures, "\n".join(failures)


PLAIN_LOAD_MISSES_KEYS = {"shieldgemma2"}  # transformers 5.23 does not load its own save of these back whole
HEAD_KWARGS = {t: {"allow_suspicious_missing_keys": True} for t in PLAIN_LOAD_MISSES_KEYS}
# OneFormer's loss module has a float64 `logit_scale`: by default it is loaded in the engine's dtype, as zero.Init
# casts it (ZeRO-3 holds trainable parameters in one dtype); `keep_in_fp32=True` keeps the plain load's dtype
HEAD_KWARGS["oneformer"] = {"keep_in_fp32": True}


@pytest.mark.parametrize("model_class, tier", [
    *(pytest.param(c, "default", id=f"{c}-default") for c in sorted(REPRESENTATIVE_HEADS)),
    *(pytest.param(c, "sweep", marks=pytest.mark.sweep(by_type=True), id=f"{c}-sweep") for c in sorted(HEAD_SWEEP))])
def test_other_heads_load_and_save_like_plain_transformers(workdir, model_class, tier):
    """The other heads (vision-language, encoder-decoder, classifiers, detectors, ...) at W=3, each through its own
    auto class: loaded bit-exact, then saved without a gather into byte for byte the files transformers'
    save_pretrained writes.
    Seeded like the plain load: a checkpoint transformers itself cannot load back whole (shieldgemma2 saves its
    language model under a prefix its loader does not map) is refused by default (tests/test_missing_and_guards.py);
    with the opt-out it gets the same random init as the plain load for what is missing."""
    types = REPRESENTATIVE_HEADS[model_class] if tier == "default" else tiers.sliced(HEAD_SWEEP[model_class])
    cases = [{"name": f"{model_class}/{t}", "path": head_checkpoint(workdir, model_class, t), "dtype": "float32",
              "model_class": model_class, "seed": 0, "out": os.path.join(workdir, f"heads_{model_class}_{t}.pt"),
              "kwargs": HEAD_KWARGS.get(t, {}),
              "save": {"dir": os.path.join(workdir, "heads_saved", model_class, t), "kwargs": {}, "reference": True}}
             for t in types]
    dumps = run_torchrun(HEAD_SWEEP_WORLD_SIZE, cases, workdir, timeout=1500)
    failures = [f for t, case, dump in zip(types, cases, dumps)
                if (f := load_failure(case, dump, seed=0)
                    or save_failure(case, dump, loads_back_whole=t not in PLAIN_LOAD_MISSES_KEYS
                                    and t not in EXTRA_FILES_FOR))]
    assert not failures, "\n".join(failures)


MISSING_BUDGET = 4096  # bytes: far below a layer, so modules are initialised in many chunks, and some param by param
# tensors a plain load leaves as uninitialised memory when they are missing (the model's `_init_weights` never sets
# them); ours come out as zeros, the same on every rank
LEFT_UNINITIALISED = {"apertus": r"\.act_fn\.", "apertus1p5_text": r"\.act_fn\.",  # (transformers 5.24's: fuzz.py)
                      "openai-gpt": r"\.(c_attn|c_proj|c_fc)\.",
                      "pe_audio": r"^text_audio_logit_scale$"}  # (a head-sweep type: met by scripts/fuzz.py)
# and in any family: a weight-norm parametrization's originals (transformers' inits write the computed `weight`)
LEFT_UNINITIALISED_ANY = r"\.parametrizations\.weight\.original[01]$"


def _without_layer_1_and_head(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items()
            if not re.search(r"(layers|h|blocks|layer)\.1\.", k) and k != "lm_head.weight"}


@pytest.mark.parametrize("tier", TIERS)
def test_every_family_in_the_sweep_initialises_missing_layers_like_the_plain_load(workdir, tier):
    checkpoints = sweep_checkpoints(workdir, families(tier))
    paths = {t: rewrite_checkpoint(path, os.path.join(workdir, "sweep_missing", t), _without_layer_1_and_head)
             for t, path in checkpoints.items()}
    cases = [{"name": t, "path": path, "dtype": "float32", "seed": 11,
              "kwargs": {"missing_init_budget_bytes": MISSING_BUDGET, "allow_suspicious_missing_keys": True},
              "out": os.path.join(workdir, f"sweep_missing_{t}.pt")} for t, path in paths.items()]

    def as_expected(case, name, ours, plain):
        left = LEFT_UNINITIALISED.get(case["name"])
        if left and ".1." in name and re.search(left, name):
            return ours.dtype == plain.dtype and bool((ours == 0).all())
        return ours.dtype == plain.dtype and torch.equal(ours, plain)

    dumps = run_torchrun(SAVE_WORLD_SIZE, cases, workdir, timeout=1500)
    failures = [f for case, dump in zip(cases, dumps) if (f := load_failure(case, dump, 11, as_expected))]
    for case, dump in zip(cases, dumps):  # exactly those are named as left by the init, on every rank
        left = LEFT_UNINITIALISED.get(case["name"])
        for r in dump["ranks"]:
            named = r.get("report", {}).get("missing_left_by_init", [])
            if bool(named) != bool(left) or any(".1." not in n or not re.search(left, n) for n in named):
                failures.append(f"{case['name']}: rank {r['rank']} names {named[:4]} as left by the init")
    assert not failures, "\n".join(failures)


def known_to(auto_class: str, types) -> tuple:
    """The model types among `types` that `auto_class` has a class for."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    known = getattr(transformers, auto_class)._model_mapping
    return tuple(t for t in types if CONFIG_MAPPING[t] in known)


# Where fine-tuning starts: a pretrained body saved by one class, loaded into a task head that is not in the
# checkpoint (a reward model from a causal LM, a classifier from a masked LM, CTC from a bare speech encoder, an image
# classifier from a bare vision encoder, a causal LM from a whole vision-language checkpoint). The body is renamed
# into the head class's layout by transformers (a prefix added or dropped, the old head unexpected) and the new head
# is randomly initialised in 4 KiB chunks, in the plain load's RNG order (target class, source class, model types).
NEW_HEADS = (
    ("AutoModelForSequenceClassification", "AutoModelForCausalLM",
     ("deepseek_v3", "gemma2", "gpt_neox", "gpt_oss", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3_moe")),
    ("AutoModelForSequenceClassification", "AutoModelForMaskedLM",
     tuple(t for t in HEAD_SWEEP["AutoModelForMaskedLM"] if t in HEAD_SWEEP["AutoModelForSequenceClassification"])),
    ("AutoModelForCTC", "AutoModel", HEAD_SWEEP["AutoModelForCTC"]),
    # pp_lcnet and hgnet_v2 have no bare model; Perceiver's has no image preprocessor (its cross-attention then takes
    # d_model, not the image channels: a plain load refuses the sizes as well)
    ("AutoModelForImageClassification", "AutoModel", tuple(t for t in HEAD_SWEEP["AutoModelForImageClassification"]
                                                           if t not in ("pp_lcnet", "hgnet_v2", "perceiver"))),
    # a vision-language checkpoint saved whole, loaded as its text backbone (Gemma 3, Qwen3.5-MoE, Mllama, ...)
    ("AutoModelForCausalLM", "AutoModelForImageTextToText", known_to("AutoModelForCausalLM",
                                                                     HEAD_SWEEP["AutoModelForImageTextToText"])),
)


# the default tier's: a reward model from a fused-MoE causal LM
REPRESENTATIVE_NEW_HEADS = (("AutoModelForSequenceClassification", "AutoModelForCausalLM", ("qwen3_moe",)),)


@pytest.mark.parametrize("tier", TIERS)
def test_a_pretrained_body_loads_into_a_new_head_like_the_plain_load(workdir, tier):
    import transformers

    from tests.checkpoints import make_checkpoint
    from tests.families import small_head_config

    pairs = [(target, source, t) for target, source, types in
             (REPRESENTATIVE_NEW_HEADS if tier == "default" else NEW_HEADS) for t in types]
    if tier == "sweep":
        pairs = tiers.sliced(pairs, key=lambda pair: "/".join(pair))
    cases = []
    for target, source, t in pairs:
        path = make_checkpoint(os.path.join(workdir, "new_heads", source, target, t), t,
                               config=small_head_config(t, target), model_class=getattr(transformers, source))
        cases.append({"name": f"{source} -> {target}/{t}", "path": path, "dtype": "float32", "model_class": target,
                      "seed": 5, "kwargs": {"missing_init_budget_bytes": MISSING_BUDGET},
                      "out": os.path.join(workdir, f"new_head_{source}_{target}_{t}.pt")})
    failures = compare_with_plain_loads(cases, HEAD_SWEEP_WORLD_SIZE, workdir, seed=5)
    assert not failures, "\n".join(failures)
