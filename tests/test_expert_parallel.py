"""Expert parallelism with ZeRO-3: each rank's local experts, gathered over their expert-data-parallel group, equal
the matching slices of the plain single-process load bit for bit; every other parameter and buffer, gathered over
the world, equals plain; each rank reads only its share; training equals DeepSpeed's own engine-side AutoEP.

Every family DeepSpeed 0.19.8 has an AutoEP preset for, at world sizes 2, 3 and 4, with ep_size equal to the world
and smaller (expert-data-parallel groups of 2 and 3), sizes that do and do not divide those groups; and DeepSeek-V3 as
it ships (FP8, with its multi-token-prediction layer, which no rank reads), dequantized on read into the local
experts (also with `keep_in_fp32=True`, where transformers 5.24 keeps its router in fp32), and DeepSeek-V3 with the
hub's own modeling code, which keeps one module per expert
(AutoEP's per-expert storage; also trained against engine-side AutoEP), as bf16 and as FP8 (each local stack
dequantized from the per-expert FP8 tensors on read), and as Kimi-K2 ships it (that code under model type `kimi_k2`,
whose config names DeepSeek-V3's preset). Model types without a preset whose config
names their structure, as DeepSpeed's engine-side AutoEP requires (a preset of the same structure, or custom patterns): OLMoE,
GLM-4.5 (MoE), MiniMax-M2, Granite-MoE (which no preset fits) and Qwen3-VL-MoE (a vision-language model, loaded
through its own auto class, whose MoE layers are its language model's), one of them trained against engine-side
AutoEP.
Task heads, bare bodies and a LoRA adapter over the loaded model train as engine-side AutoEP does. Every preset and
custom-pattern family, routed as its releases route, gives engine-side AutoEP's forward output and losses bit for bit,
its AutoEP layers equal field by field after `deepspeed.initialize`.
"""

from __future__ import annotations

import functools
import json
import os
import re

import pytest
import torch

from tests.checkpoints import (EP_FAMILIES, EP_MODEL_CLASS, EP_NAMED_STRUCTURE, OLMOE_EP_PATTERNS, ep_config,
                               fp8_checkpoint, make_checkpoint, mtp_layer_prefix, remote_code_moe_checkpoint,
                               with_mtp_layer)
from tests.conftest import params_kept_in_fp32, run_torchrun
from tests.dist_worker import NOTHING_PERSISTENT, ds_config_for

# DeepSpeed's grouped GEMM on CPU needs 16-byte strides, which these odd sizes do not have: its loop runs instead
EP_SECTION = {"enabled": True, "use_grouped_mm": False}


def ep_ds_config(ep_size: int, dtype: str = "bfloat16", family: str = "", structure: dict | None = None) -> dict:
    """`structure`: what the config names for a model type without an AutoEP preset (default: the family's)."""
    structure = EP_NAMED_STRUCTURE.get(family, {}) if structure is None else structure
    return ds_config_for(dtype, {"expert_parallel": {**EP_SECTION, **structure, "autoep_size": ep_size}})


FP8 = "deepseek_v3_fp8"  # DeepSeek-V3 as it ships: FP8 with a scale per 16 x 16 block here, dequantized on read
DEQUANTIZE = {"quant_method": "fp8", "dequantize": True}
# DeepSeek-V3 with the hub's own modeling code (`trust_remote_code=True`): one module per expert, which AutoEP's
# DeepSeek-V3 preset takes too (per-expert storage: each AutoEP tensor stacks the local experts' weights)
REMOTE = "deepseek_v3_remote"
# both at once, as DeepSeek-V3 itself ships: the hub's code over FP8 weights (per-expert stacks dequantized on read)
REMOTE_FP8 = "deepseek_v3_remote_fp8"
FP8_FAMILIES = (FP8, REMOTE_FP8)
# Kimi-K2: DeepSeek-V3's hub code under a model type of its own, which has no AutoEP preset: the config names
# DeepSeek-V3's, as for engine-side AutoEP
KIMI = "kimi_k2_remote"
KIMI_STRUCTURE = {"preset_model": "deepseek_v3"}


def load_kwargs(path: str) -> dict:
    """What a load of the checkpoint at `path` needs: its own modeling code trusted, where it ships some."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        return {"trust_remote_code": True} if "auto_map" in json.load(f) else {}


def checkpoint(workdir: str, family: str) -> str:
    import transformers

    if family in FP8_FAMILIES:
        config = transformers.DeepseekV3Config(  # every expert and projection dimension a whole number of blocks
            vocab_size=101, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_size=64,
            intermediate_size=48, moe_intermediate_size=32, n_routed_experts=6, n_shared_experts=1,
            first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, n_group=2, topk_group=1, num_experts_per_tok=2, max_position_embeddings=64,
            tie_word_embeddings=False)
        source = (remote_code_moe_checkpoint(os.path.join(workdir, "ep_deepseek_v3_remote_bf16"), config=config,
                                             dtype=torch.bfloat16) if family == REMOTE_FP8 else
                  with_mtp_layer(os.path.join(workdir, "ep_deepseek_v3_mtp_bf16"), config, dtype=torch.bfloat16))
        return fp8_checkpoint(source, os.path.join(workdir, f"ep_{family}"), block=(16, 16))
    if family == REMOTE:
        return remote_code_moe_checkpoint(os.path.join(workdir, f"ep_{REMOTE}"))
    if family == KIMI:
        return _renamed_model_type(checkpoint(workdir, REMOTE), os.path.join(workdir, f"ep_{KIMI}"), "kimi_k2")
    if family == "deepseek_v3":  # as it ships: sharded, its multi-token-prediction layer (which no load reads) last
        return with_mtp_layer(os.path.join(workdir, "ep_deepseek_v3_mtp"), ep_config(family), max_shard_size="20KB")
    model_class = getattr(transformers, EP_MODEL_CLASS.get(family, "AutoModelForCausalLM"))
    return make_checkpoint(os.path.join(workdir, f"ep_{family}"), family, config=ep_config(family),
                           model_class=model_class)


def _renamed_model_type(src: str, dst: str, model_type: str) -> str:
    """A copy of a checkpoint with DeepSeek-V3's hub code (`src`) whose config class and config.json name
    `model_type`."""
    import json
    import shutil

    if not os.path.exists(os.path.join(dst, "config.json")):
        shutil.copytree(src, dst + ".tmp")
        with open(os.path.join(dst + ".tmp", "configuration_deepseek.py"), "a") as f:
            f.write(f"\n\nDeepseekV3Config.model_type = {model_type!r}\n")
        with open(os.path.join(dst + ".tmp", "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(dst + ".tmp", "config.json"), "w") as f:
            json.dump({**config, "model_type": model_type}, f)
        os.rename(dst + ".tmp", dst)
    return dst


# world size -> [(family, ep_size, engine dtype[, the structure the config names if not the family's own (or None),
#                 keywords for the load])]
RUNS = {
    2: [*((f, 2, "bfloat16") for f in EP_FAMILIES), ("qwen3_moe", 1, "bfloat16"), ("mixtral", 2, "float32"),
        ("olmoe", 2, "bfloat16"), ("glm4_moe", 2, "bfloat16"), (REMOTE, 2, "bfloat16"),
        # the router transformers 5.24 keeps in fp32 stays fp32 with keep_in_fp32=True, dequantized from FP8 too
        (FP8, 2, "bfloat16", None, {"keep_in_fp32": True}), (REMOTE_FP8, 2, "bfloat16", None, {"keep_in_fp32": True}),
        (KIMI, 2, "bfloat16", KIMI_STRUCTURE)],
    3: [("qwen3_moe", 3, "bfloat16"), ("deepseek_v3", 1, "bfloat16"), ("qwen2_moe", 3, "bfloat16"),
        (FP8, 3, "bfloat16"), ("minimax_m2", 3, "bfloat16"), ("granitemoe", 3, "bfloat16"), (REMOTE, 3, "bfloat16")],
    4: [("qwen3_moe", 2, "bfloat16"), ("deepseek_v3", 2, "bfloat16"), ("mixtral", 4, "bfloat16"),
        ("minimax_m3_vl_text", 2, "bfloat16"), ("olmoe", 2, "bfloat16", OLMOE_EP_PATTERNS),
        ("qwen3_vl_moe", 2, "bfloat16"), (REMOTE, 2, "float32"),
        # a stack of 3 local FP8 experts split over its expert-data-parallel pair mid-expert, mid-block
        (REMOTE_FP8, 2, "bfloat16", None, {"keep_in_fp32": True})],
}

_dumps: dict = {}


def dumps(workdir: str, world_size: int) -> list[tuple[dict, dict]]:
    if world_size not in _dumps:
        cases = []
        for family, ep, dtype, *extra in RUNS[world_size]:
            structure, kwargs = (extra[0] if extra else None), (extra[1] if len(extra) > 1 else {})
            tag = ("/patterns" if structure else "") + "".join(f"/{k}" for k in kwargs)
            cases.append({"name": f"{family}/ep{ep}/{dtype}{tag}", "family": family, "ep_size": ep,
                          "path": checkpoint(workdir, family), "dtype": dtype,
                          "model_class": EP_MODEL_CLASS.get(family, "AutoModelForCausalLM"),
                          "ds_config": ep_ds_config(ep, dtype, family, structure), "all_ranks_state": True,
                          "kwargs": {**({"quantization_config": DEQUANTIZE} if family in FP8_FAMILIES else {}),
                                     **load_kwargs(checkpoint(workdir, family)), **kwargs},
                          "out": os.path.join(workdir, f"ep_w{world_size}_{family}_{ep}_{dtype}{tag.replace('/', '_')}.pt")})
        _dumps[world_size] = list(zip(cases, run_torchrun(world_size, cases, workdir)))
    return _dumps[world_size]


@functools.lru_cache(maxsize=None)
def _plain(path: str, dtype: str, model_class: str = "AutoModelForCausalLM", seed: int = 0) -> tuple[dict, frozenset]:
    """`seed`: the ranks' seed, for what the checkpoint lacks (a new task head) to be initialised alike."""
    import transformers

    extra = {}
    if path.endswith(FP8_FAMILIES):
        extra = {"quantization_config": transformers.FineGrainedFP8Config(dequantize=True)}
    extra.update(load_kwargs(path))
    torch.manual_seed(seed)
    model = getattr(transformers, model_class).from_pretrained(path, dtype=getattr(torch, dtype), **extra)
    return ({n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()]},
            params_kept_in_fp32(model, getattr(torch, dtype)))


def plain_load(path: str, dtype: str, model_class: str = "AutoModelForCausalLM", seed: int = 0) -> dict:
    return _plain(path, dtype, model_class, seed)[0]


def plain_fp32_params(path: str, dtype: str, model_class: str = "AutoModelForCausalLM", seed: int = 0) -> frozenset:
    """The parameters a plain load in `dtype` keeps in fp32 anyway."""
    return _plain(path, dtype, model_class, seed)[1]


@functools.lru_cache(maxsize=None)
def buffer_names(path: str, model_class: str = "AutoModelForCausalLM") -> frozenset:
    import transformers

    remote = load_kwargs(path)
    with torch.device("meta"):
        model = getattr(transformers, model_class).from_config(transformers.AutoConfig.from_pretrained(path, **remote),
                                                               **remote)
    return frozenset(n for n, _ in model.named_buffers())


def expected(name: str, plain: dict, ep_rank: int, ep_size: int) -> tuple[tuple[str, ...], torch.Tensor]:
    """What AutoEP's tensor `name` must hold on this EP rank, and the plain tensors it is made of, written from
    AutoEP's documented layout (not from the loader's mapping): w1/w3 = gate/up halves of gate_up_proj for the local
    experts, w2 = down_proj (or, one module per expert, their gate/up/down weights stacked), router = gate."""
    if m := re.fullmatch(r"(.*)\.experts\.(w1|w2|w3)", name):
        moe, which = m.groups()
        if f"{moe}.experts.0.gate_proj.weight" in plain:  # one module per expert
            num = 0  # experts are numbered from 0
            while f"{moe}.experts.{num}.gate_proj.weight" in plain:
                num += 1
            per_rank = num // ep_size
            sources = tuple(f"{moe}.experts.{e}.{dict(w1='gate_proj', w2='down_proj', w3='up_proj')[which]}.weight"
                            for e in range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
            return sources, torch.stack([plain[s] for s in sources])
        gate_up, down = plain[f"{moe}.experts.gate_up_proj"], plain[f"{moe}.experts.down_proj"]
        per_rank = gate_up.shape[0] // ep_size
        local = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        ffn = gate_up.shape[1] // 2
        source = f"{moe}.experts.{'down_proj' if which == 'w2' else 'gate_up_proj'}"
        return (source,), {"w1": gate_up[local, :ffn], "w3": gate_up[local, ffn:], "w2": down[local]}[which]
    if m := re.fullmatch(r"(.*)\.(?:router|gate)\.gate\.(weight|bias)", name):  # the block's router, by its name
        (source,) = [s for s in (f"{m[1]}.gate.{m[2]}", f"{m[1]}.router.{m[2]}") if s in plain]
    elif m := re.fullmatch(r"(.*)\.(?:router|gate)\.e_score_correction_bias", name):
        # wherever the MoE block keeps it: on its router (DeepSeek), on itself (MiniMax-M2), in the router's
        # `moe_statics` (ERNIE 4.5)
        (source,) = [n for n in plain if n.startswith(f"{m[1]}.") and n.endswith(".e_score_correction_bias")]
    elif name not in plain and ".shared_experts" in name:  # Qwen's shared_expert(_gate), renamed by AutoEP
        source = name.replace(".shared_experts", ".shared_expert")
    else:
        source = name
    return (source,), plain[source]


@pytest.mark.parametrize("world_size", sorted(RUNS))
def test_local_experts_and_everything_else_equal_the_plain_load(workdir, world_size):
    for case, dump in dumps(workdir, world_size):
        plain = plain_load(case["path"], case["dtype"], case["model_class"])
        covered, experts_seen = set(), set()
        for r in dump["ranks"]:
            assert "error" not in r, f"{case['name']}: {r.get('error', {}).get('traceback')}"
            ep_rank, ep = r["rank"] % case["ep_size"], case["ep_size"]  # EP groups are consecutive ranks
            report = r["report"]["expert_parallel"]
            num = report["num_experts"]
            assert report["ep_rank"] == ep_rank and report["ep_size"] == ep, case["name"]
            assert report["local_experts"] == list(range(ep_rank * num // ep, (ep_rank + 1) * num // ep))
            experts_seen.update(report["local_experts"])
            assert r["report"]["init_context"] == "ep-meta"
            for name, actual in r["state"].items():
                if name.endswith(".tokens_per_expert"):  # AutoEP's own token counter: zeros, as it builds it
                    assert not actual.any(), name
                    continue
                sources, want = expected(name, plain, ep_rank, ep)
                covered.update(sources)
                if (want.dtype != actual.dtype and set(sources) <= plain_fp32_params(case["path"], case["dtype"],
                                                                                       case["model_class"])
                        and not case["kwargs"].get("keep_in_fp32")):
                    # a router the plain load keeps in fp32 (`_keep_in_fp32_modules_strict`: DeepSeek-V3's from
                    # transformers 5.24) is loaded in the engine's dtype by default, as zero.Init casts it
                    want = want.to(getattr(torch, case["dtype"]))
                assert actual.dtype == want.dtype and actual.shape == want.shape, f"{case['name']} {name} rank {r['rank']}"
                assert torch.equal(actual, want), f"{case['name']} {name}: values differ on rank {r['rank']}"
            assert any(".experts.w1" in n for n in r["state"]), f"{case['name']}: no AutoEP layer on rank {r['rank']}"
        assert covered == set(plain), f"{case['name']}: plain tensors not covered: {set(plain) - covered}"
        assert experts_seen == set(range(num)), case["name"]


@pytest.mark.parametrize("world_size", sorted(RUNS))
def test_each_rank_reads_its_share_moves_no_data_and_allocates_no_more_than_a_partition(workdir, world_size):
    from hf_zero3_loader.checkpoint import open_checkpoint

    for case, dump in dumps(workdir, world_size):
        ranks = dump["ranks"]
        files = sorted(os.path.join(case["path"], f) for f in os.listdir(case["path"]) if f.endswith(".safetensors"))
        checkpoint_ = open_checkpoint(files)
        # DeepSeek-V3's multi-token-prediction layer, which the model does not build: no rank reads a byte of it
        with open(os.path.join(case["path"], "config.json")) as f:
            unread = mtp_layer_prefix(json.load(f)) or "\0"  # no key starts with NUL
        entries = {k: e for k, e in checkpoint_.entries.items() if not k.startswith(unread)}
        total = sum(e.nbytes for e in entries.values())
        read = [r["report"]["bytes_read"] for r in ranks]
        # every parameter byte is read by exactly one rank (the experts of an EP rank are split over its EDP group);
        # persistent buffers (DeepSeek-V3's e_score_correction_bias) are whole on every rank
        # (matched by the buffer's own name: MiniMax-M2's checkpoint keeps its original `block_sparse_moe` keys)
        leaves = {n.rsplit(".", 1)[-1] for n in buffer_names(case["path"], case["model_class"])}
        buffers = sum(e.nbytes for k, e in entries.items() if k.rsplit(".", 1)[-1] in leaves)
        slack = len(entries) * 4 * case["ep_size"]
        largest_allocation = lambda r: r["report"]["largest_partition_numel"]  # noqa: E731
        if case["family"] in FP8_FAMILIES:  # a block's scale is read by every rank whose share the block straddles, and
            # dequantizing works in chunks of up to twice a partition (as in tests/test_quantized.py)
            scales = sum(e.nbytes for k, e in entries.items() if k.endswith("_scale_inv"))
            assert total + (world_size - 1) * buffers <= sum(read) <= total + (world_size - 1) * (buffers + scales)
            slack += scales
            largest_allocation = lambda r: 2 * r["report"]["largest_partition_numel"] + (1 << 20)  # noqa: E731
        else:
            assert sum(read) == total + (world_size - 1) * buffers, f"{case['name']}: read {read}, checkpoint {total}"
        assert max(read) <= total / world_size + slack, f"{case['name']}: {read} vs {total}/{world_size}"
        for r in ranks:
            ep = r["report"]["expert_parallel"]
            assert ep["expert_bytes_read"] + ep["other_bytes_read"] == r["report"]["bytes_to_read"]  # the plan's split
            assert r["collectives"] == {}, f"{case['name']}: {r['collectives']}"
            assert 0 < r["largest_allocation_numel"] <= largest_allocation(r), (
                f"{case['name']}: rank {r['rank']} allocated {r['largest_allocation_numel']} elements, its largest "
                f"partition is {r['report']['largest_partition_numel']}")


def _train_cases(workdir: str, family: str, ep: int, world_size: int, path: str | None = None,
                 structure: dict | None = None, zero: dict | None = None, roundtrip: bool = True,
                 tag: str = "") -> list[dict]:
    """Ours, then engine-side AutoEP (transformers' own ZeRO-3 load, AutoEP at `deepspeed.initialize`), 3 steps each.
    Ours runs first, so its load starts with torch's own `F.linear` (a pool's request starts with it): engine-side
    AutoEP's `zero.Init` replaces it for the rest of the process. `zero`: more of the ZeRO section."""
    from tests.checkpoints import rewrite_checkpoint, transpose_experts

    path = path or checkpoint(workdir, family)
    engine_side_path = path
    if family == "qwen3_vl_moe":  # transformers' own ZeRO-3 load does not apply the conversion ops, so it cannot load
        # the released layout (experts transposed): it gets the same values in the model's layout
        engine_side_path = rewrite_checkpoint(path, path + "_model_layout", transpose_experts)
    # every rank on its own tokens, and every parameter gathered and released at each step
    every_param_gathered = ep_ds_config(ep, family=family, structure=structure)
    every_param_gathered["zero_optimization"] = {**NOTHING_PERSISTENT, **(zero or {})}
    return [{"name": f"train/{family}{tag}/{variant}", "dtype": "bfloat16",
             "path": engine_side_path if variant == "engine-side AutoEP" else path,
             "model_class": EP_MODEL_CLASS.get(family, "AutoModelForCausalLM"),
             "ds_config": every_param_gathered,
             "upstream": variant == "engine-side AutoEP", "train_steps": 3, "seed": 5, "rank_inputs": True,
             "checkpoint_roundtrip": roundtrip and variant == "ours", "forward_output": True, "autoep_fields": True,
             "kwargs": load_kwargs(path) or {"experts_implementation": "eager"},
             "out": os.path.join(workdir, f"ep_train_w{world_size}_{family}{tag}_{variant.split()[0]}.pt")}
            for variant in ("ours", "engine-side AutoEP")]


def _without_transformers_marks(fields):
    """`describe_autoep_layers` without transformers' `_is_hf_initialized` marks: the loader's layers hold loaded
    values when transformers finishes the load, which marks them so (its init then leaves them alone); engine-side
    AutoEP builds its layers after that. AutoEP does not read the mark."""
    if isinstance(fields, dict):
        return {k: _without_transformers_marks(v) for k, v in fields.items() if k != "_is_hf_initialized"}
    if isinstance(fields, tuple):
        return tuple(_without_transformers_marks(v) for v in fields)
    return fields


def _differences(ours, theirs, where: str = "") -> list[str]:
    """Where two `describe_autoep_layers` pictures differ (the first few), for a readable failure."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        found = []
        for key in sorted(set(ours) | set(theirs)):
            if key not in ours or key not in theirs:
                found.append(f"{where}/{key}: only {'ours' if key in ours else 'engine-side'}")
            else:
                found += _differences(ours[key], theirs[key], f"{where}/{key}")
        return found
    if isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple)) and len(ours) == len(theirs):
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in _differences(a, b, f"{where}[{i}]")]
    return [] if ours == theirs else [f"{where}: ours {ours!r:.120}, engine-side {theirs!r:.120}"]


def assert_trains_as_engine_side_autoep(ours: dict, engine_side: dict, what: str) -> None:
    """Every rank's first forward output and 3 losses bit for bit engine-side AutoEP's, and the AutoEP layers as
    `deepspeed.initialize` leaves them equal field by field (mode, every attribute and config value, buffers,
    parameter tags), the DeepEP sharing scopes taken included."""
    for dump in (ours, engine_side):
        assert "error" not in dump["rank0"], f"{what}: {dump['rank0'].get('error', {}).get('traceback')}"
    for r, e in zip(ours["ranks"], engine_side["ranks"]):
        assert r["logits"].dtype == e["logits"].dtype and torch.equal(r["logits"], e["logits"]), (
            f"{what}: the forward output differs on rank {r['rank']}")
        assert [x.hex() for x in r["losses"]] == [x.hex() for x in e["losses"]], f"{what}: rank {r['rank']}"
        mine, theirs = _without_transformers_marks(r["autoep_fields"]), _without_transformers_marks(e["autoep_fields"])
        assert mine and set(mine) == set(theirs), (what, sorted(mine), sorted(theirs))
        assert mine == theirs, f"{what}, rank {r['rank']}: " + "; ".join(_differences(mine, theirs)[:8])
        assert r["scopes_taken"] == e["scopes_taken"] == 1, (what, r["scopes_taken"], e["scopes_taken"])
    assert len(ours["rank0"]["losses"]) == 3 and ours["ranks"][0]["losses"] != ours["ranks"][1]["losses"], what


# (world size, family, ep_size): losses vs engine-side AutoEP; GLM-4.5 through the DeepSeek-V3 preset its config names,
# Qwen3-VL-MoE through the Qwen3-MoE preset, its language model's layers and top_k
TRAINED = [(2, "qwen3_moe", 2), (4, "deepseek_v3", 2), (2, "glm4_moe", 2), (2, "qwen3_vl_moe", 2), (2, REMOTE, 2)]
# the default tier's (Qwen2-MoE at 2 ranks is trained against engine-side AutoEP by the next test); the others are
# sweep cases
TRAINED_BY_DEFAULT = [(4, "deepseek_v3", 2)]


@pytest.mark.parametrize("world_size,family,ep", [
    case if case in TRAINED_BY_DEFAULT else pytest.param(*case, marks=pytest.mark.sweep) for case in TRAINED])
def test_training_equals_engine_side_autoep_and_checkpoints_round_trip(workdir, world_size, family, ep):
    ours, engine_side = run_torchrun(world_size, _train_cases(workdir, family, ep, world_size), workdir)
    assert_trains_as_engine_side_autoep(ours, engine_side, family)
    # the global RNG stands where the plain path leaves it, after the load and after deepspeed.initialize (where
    # engine-side AutoEP draws for each router it builds)
    for when in ("rng_before_initialize", "rng_after_initialize"):
        assert [r[when] for r in ours["ranks"]] == [r[when] for r in engine_side["ranks"]], when
    roundtrip = ours["rank0"]["checkpoint"]
    assert roundtrip["next_loss"] == roundtrip["next_loss_after_load"]
    # deepspeed.initialize: DeepSpeed gathers every parameter of an already-partitioned model once (its output and
    # input buffers are counted: at most 2x the parameter). Ours holds local experts only, so nothing larger than
    # the largest parameter of the EP model is gathered; engine-side AutoEP gathers each layer's whole fused
    # experts on every rank (larger than anything ours gathers, unless the model holds a larger tensor elsewhere:
    # Qwen3-VL-MoE's vision tower), or every expert module one at a time, and more bytes in all.
    largest_param = max(t.numel() * t.element_size() for t in ours["rank0"]["state"].values())
    plain = plain_load(checkpoint(workdir, family), "bfloat16", EP_MODEL_CLASS.get(family, "AutoModelForCausalLM"))
    fused = max((t.numel() * t.element_size() for n, t in plain.items() if n.endswith("gate_up_proj")), default=0)
    largest_other = max(t.numel() * t.element_size() for n, t in plain.items() if ".experts." not in n)
    for r, e in zip(ours["ranks"], engine_side["ranks"]):
        mine, theirs = r["init_collectives"], e["init_collectives"]
        assert max(mine["largest"].values()) <= 2 * largest_param, mine
        assert max(theirs["largest"].values()) >= fused, (mine, theirs)
        if fused > largest_other:
            assert fused > max(v for k, v in mine["largest"].items() if "all_gather" in k) / 2, (mine, theirs)
        assert sum(mine["bytes"].values()) < sum(theirs["bytes"].values()), (mine, theirs)


# What the released checkpoints set where a family's config default differs: Qwen3-MoE normalises its top-k weights,
# GLM-4.5 has biased q/k/v and scales its routed experts by 2.5, Qwen3.5-MoE has full attention layers between its
# linear-attention ones (2 small layers of linear attention alone fail transformers' own forward: its cache finds
# no attention layer). The defaults are the releases' elsewhere: Qwen2-MoE (biased q/k/v, a gated shared expert,
# top-k weights not normalised), DeepSeek-V2-Lite (not normalised, ungated shared experts), DeepSeek-V3 (normalised,
# ungated shared experts), Qwen3.5-MoE (a gated shared expert), OLMoE (not normalised), Mixtral, MiniMax-M2,
# Granite-MoE (no shared experts).
RELEASED = {"qwen3_moe": {"norm_topk_prob": True}, "glm4_moe": {"attention_bias": True, "routed_scaling_factor": 2.5},
            "qwen3_5_moe_text": {"layer_types": ["linear_attention", "full_attention"]}}


def released_checkpoint(workdir: str, family: str) -> str:
    if family not in RELEASED:
        return checkpoint(workdir, family)
    config = ep_config(family)
    for key, value in RELEASED[family].items():
        setattr(config, key, value)
    model_class = getattr(__import__("transformers"), EP_MODEL_CLASS.get(family, "AutoModelForCausalLM"))
    return make_checkpoint(os.path.join(workdir, f"ep_{family}_released"), family, config=config,
                           model_class=model_class)


# every family with an AutoEP preset, and every one whose config names its structure (a preset, or custom patterns:
# OLMoE both ways); Qwen2-MoE, whose biased q/k/v once trained otherwise, in the default tier
AS_ENGINE_SIDE = [*EP_FAMILIES, *EP_NAMED_STRUCTURE, "olmoe/patterns"]
AS_ENGINE_SIDE_BY_DEFAULT = [(2, "qwen2_moe")]


@pytest.mark.parametrize("world_size,family", [
    case if case in AS_ENGINE_SIDE_BY_DEFAULT else pytest.param(*case, marks=pytest.mark.sweep)
    for case in [(w, f) for w in (2, 4) for f in AS_ENGINE_SIDE]])
def test_forward_and_losses_equal_engine_side_autoep_bit_for_bit(workdir, world_size, family):
    """Each family as its releases route (`RELEASED`), 2 experts per EP group (ep_size 2): the first forward output
    and 3 losses on every rank bit for bit engine-side AutoEP's, and the AutoEP layers equal field by field after
    `deepspeed.initialize`. The load computes as transformers' ZeRO-3 path does, under DeepSpeed's memory-efficient
    `F.linear` (`zero3_linear_wrap`, which `zero.Init` installs: a matmul, then the bias added on its own), so
    biased layers (Qwen2-MoE's and GLM-4.5's q/k/v) round alike."""
    family, _, patterns = family.partition("/")
    structure = OLMOE_EP_PATTERNS if patterns else None
    cases = _train_cases(workdir, family, 2, world_size, path=released_checkpoint(workdir, family), structure=structure,
                         roundtrip=False, tag=f"_released{'_patterns' if patterns else ''}")
    ours, engine_side = run_torchrun(world_size, cases, workdir)
    assert_trains_as_engine_side_autoep(ours, engine_side, f"{family}{' with patterns' if patterns else ''}")
    # ours started with torch's own F.linear (nothing in the process had replaced it) and left DeepSpeed's
    assert ours["rank0"]["fresh_linear_at_start"] and not engine_side["rank0"]["fresh_linear_at_start"]


@pytest.mark.sweep
def test_without_memory_efficient_linear_the_load_keeps_torchs_linear(workdir):
    """`"memory_efficient_linear": false` in the ZeRO section: `zero.Init` leaves `F.linear` alone, and so does the
    load; both paths train under torch's own, bit for bit alike."""
    cases = _train_cases(workdir, "qwen2_moe", 2, 2, zero={"memory_efficient_linear": False}, roundtrip=False,
                         tag="_torch_linear")
    ours, engine_side = run_torchrun(2, cases, workdir)
    assert ours["rank0"]["fresh_linear_at_start"] and engine_side["rank0"]["fresh_linear_at_start"]
    assert_trains_as_engine_side_autoep(ours, engine_side, "qwen2_moe, memory_efficient_linear false")


def test_every_way_of_asking_gives_the_same_load_and_run(workdir):
    """The config's `expert_parallel` section, `ep_size=`, transformers' `DistributedConfig`: one load, and the same
    2 training steps after `deepspeed.initialize` with the config given to the load (which holds no enabled section
    when EP was asked another way), the global RNG left in the same place. The job's script starts its own process
    group (`torch.distributed.init_process_group`, not DeepSpeed's): the loader hands it to DeepSpeed's comm layer,
    whose expert-parallel group helpers assert on it (they once failed there)."""
    path = checkpoint(workdir, "qwen3_moe")
    base = ds_config_for("bfloat16", {"expert_parallel": {"use_grouped_mm": False}})  # CPU ranks: the kernel only
    ways = {
        "ds_config": {"ds_config": ep_ds_config(2)},
        "ep_size": {"ds_config": base, "kwargs": {"ep_size": 2}},
        "distributed_config ep_size": {"ds_config": base, "kwargs": {"distributed_config": {"ep_size": 2, "fsdp_size": 2}}},
        "distributed_config enable_expert_parallel": {
            "ds_config": base, "kwargs": {"distributed_config": {"enable_expert_parallel": True}}},
    }
    cases = [{"name": name, "path": path, "dtype": "bfloat16", "all_ranks_state": True, "train_steps": 2, "seed": 5,
              "out": os.path.join(workdir, f"ep_way_{i}.pt"), **way,
              "kwargs": {**way.get("kwargs", {}), "experts_implementation": "eager"}}
             for i, (name, way) in enumerate(ways.items())]
    dumps_ = run_torchrun(2, cases, workdir, env={"HF_ZERO3_TEST_TORCH_PROCESS_GROUP": "1"})
    first = dumps_[0]["ranks"]
    for case, dump in zip(cases, dumps_):
        for r, ref in zip(dump["ranks"], first):
            assert "error" not in r, f"{case['name']}: {r.get('error', {}).get('traceback')}"
            assert r["report"]["expert_parallel"]["ep_size"] == 2, case["name"]
            assert set(r["state"]) == set(ref["state"]), case["name"]
            assert all(r["state"][n].dtype == ref["state"][n].dtype and torch.equal(r["state"][n], ref["state"][n])
                       for n in ref["state"]), case["name"]
            assert len(r["losses"]) == 2 and r["losses"] == ref["losses"], case["name"]
            assert r["rng_after_initialize"] == ref["rng_after_initialize"], case["name"]


def test_an_initialize_config_that_asks_for_other_expert_parallelism_is_refused_on_every_rank(workdir):
    """The engine keeps the MoE layers the loader built with the load's `expert_parallel` section. A config given
    to `deepspeed.initialize` that asks for another size or other routing math would train the load's layers while
    saying otherwise: the same ConfigError on every rank. Kernel settings only warn (the layers keep the load's)."""
    path = checkpoint(workdir, "qwen3_moe")
    other = {"size": ep_ds_config(1), "routing": ds_config_for("bfloat16", {"expert_parallel": {
        **EP_SECTION, "autoep_size": 2, "route_scale": 2.5}}), "kernels": ds_config_for("bfloat16", {
            "expert_parallel": {**EP_SECTION, "autoep_size": 2, "comm_num_sm": 8}})}
    cases = [{"name": name, "path": path, "dtype": "bfloat16", "ds_config": ep_ds_config(2), "train_steps": 1,
              "initialize_ds_config": config, "expect_initialize_error": name != "kernels",
              "kwargs": {"experts_implementation": "eager"}, "out": os.path.join(workdir, f"ep_other_init_{name}.pt")}
             for name, config in other.items()]
    size, routing, kernels = run_torchrun(2, cases, workdir)
    for dump, words in ((size, ["expert parallelism of size 2", "autoep_size=1"]),
                        (routing, ["differs from the one the model was loaded with",
                                   "route_scale (1.0 at the load, 2.5 now)"])):
        errors = [r["initialize_error"] for r in dump["ranks"]]
        assert errors[0] == errors[1] and errors[0]["type"] == "ConfigError", errors
        assert all(w in errors[0]["message"] for w in words), errors[0]["message"]
    assert len(kernels["rank0"]["losses"]) == 1
    warned = kernels["rank0"]["warnings"]
    assert any("comm_num_sm (12 at the load, 8 now)" in w for w in warned), warned


def test_a_dense_model_under_an_expert_parallel_config_loads_and_trains_as_engine_side_autoep_does(workdir):
    """A dense model (a reward, reference or teacher model beside a MoE run) loaded under the run's config, whose
    `expert_parallel` section is enabled: engine-side AutoEP finds no MoE layer in it and trains it as plain ZeRO-3.
    So does the loader (it refused such a model), with a warning: equal to the plain load, and 2 training steps give
    the plain path's losses. EP asked of the load itself (`ep_size=`) is still refused (`tests/test_errors.py`)."""
    path = make_checkpoint(os.path.join(workdir, "ep_dense_llama"), "llama_untied")
    cases = [{"name": v, "path": path, "dtype": "bfloat16", "ds_config": ep_ds_config(2), "train_steps": 2,
              "seed": 1, "upstream": v == "engine-side AutoEP", "all_ranks_state": v == "ours",
              "out": os.path.join(workdir, f"ep_dense_{v.split()[0]}.pt")} for v in ("ours", "engine-side AutoEP")]
    ours, engine_side = run_torchrun(2, cases, workdir)
    plain = plain_load(path, "bfloat16")
    for r in ours["ranks"]:
        assert "error" not in r, r["error"]["traceback"]
        assert r["report"]["init_context"] == "zero3-meta" and "expert_parallel" not in r["report"]
        assert set(r["state"]) == set(plain)
        assert all(r["state"][n].dtype == t.dtype and torch.equal(r["state"][n], t) for n, t in plain.items())
    assert any("has no experts: loaded without expert parallelism" in w for w in ours["rank0"]["warnings"])
    assert len(ours["rank0"]["losses"]) == 2 and ours["rank0"]["losses"] == engine_side["rank0"]["losses"]


def test_missing_non_expert_keys_are_initialised_as_the_seeded_plain_load(workdir):
    """With a layer's attention, the final norm and lm_head missing, the AutoEP layers built on the skeleton do not
    change what the model's init draws: every rank's tensors equal AutoEP's layout of the seeded plain load."""
    from transformers import AutoModelForCausalLM

    from tests.checkpoints import rewrite_checkpoint

    def drop(tensors):
        return {k: v for k, v in tensors.items() if not (k.startswith("model.layers.1.self_attn.")
                                                          or k in ("model.norm.weight", "lm_head.weight"))}

    cases = [{"name": f"{family}/{dtype}", "path": rewrite_checkpoint(checkpoint(workdir, family), os.path.join(
                 workdir, f"ep_missing_{family}"), drop), "dtype": dtype, "seed": 11, "ds_config": ep_ds_config(2, dtype),
              "all_ranks_state": True, "kwargs": {"allow_suspicious_missing_keys": True},
              "out": os.path.join(workdir, f"ep_missing_{family}_{dtype}.pt")}
             for family, dtype in (("qwen3_moe", "bfloat16"), ("deepseek_v3", "float32"))]
    for case, dump in zip(cases, run_torchrun(2, cases, workdir)):
        torch.manual_seed(11)
        model = AutoModelForCausalLM.from_pretrained(case["path"], dtype=getattr(torch, case["dtype"]))
        plain = {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()]}
        for r in dump["ranks"]:
            assert "error" not in r, f"{case['name']}: {r.get('error', {}).get('traceback')}"
            for name, actual in r["state"].items():
                if name.endswith(".tokens_per_expert"):
                    continue
                _, want = expected(name, plain, r["rank"] % 2, 2)
                assert actual.dtype == want.dtype and torch.equal(actual, want), f"{case['name']} {name} rank {r['rank']}"


def assert_autoep_layout_of(plain: dict, dump: dict, what: str, ep_size: int = 2) -> None:
    """Every tensor each rank gathered (`all_ranks_state`, EP over the world) is AutoEP's layout of the plain load,
    bit for bit and dtype for dtype, and together they cover every plain tensor."""
    covered = set()
    for r in dump["ranks"]:
        assert "error" not in r, f"{what}: {r.get('error', {}).get('traceback')}"
        assert r["report"]["expert_parallel"]["ep_size"] == ep_size, what
        for name, actual in r["state"].items():
            if name.endswith(".tokens_per_expert"):
                continue
            sources, want = expected(name, plain, r["rank"] % ep_size, ep_size)
            covered.update(sources)
            assert actual.dtype == want.dtype and torch.equal(actual, want), f"{what} {name} rank {r['rank']}"
    assert covered == set(plain), f"{what}: not loaded: {sorted(set(plain) - covered)}"


def test_a_task_head_and_a_bare_body_load_with_expert_parallelism_as_their_seeded_plain_loads(workdir):
    """Where MoE fine-tuning starts from a causal LM's checkpoint: a reward model (a new `score` head, drawn as the
    seeded plain load draws it, the old `lm_head` unexpected; 3 training steps give engine-side AutoEP's losses) and
    a bare body (`AutoModel`: `layers.N.mlp`, which no AutoEP preset matches until the config names the pattern, as
    for engine-side AutoEP; without it, the same clear error on every rank, saying what to name)."""
    path = checkpoint(workdir, "qwen3_moe")
    body = ep_ds_config(2, structure={"moe_layer_pattern": r"layers\.\d+\.mlp"})
    cases = [{"name": name, "path": path, "dtype": "bfloat16", "seed": 11, "ds_config": ds, "model_class": cls,
              "all_ranks_state": True, "out": os.path.join(workdir, f"ep_head_{i}.pt")}
             for i, (name, cls, ds) in enumerate((("reward model", "AutoModelForSequenceClassification", ep_ds_config(2)),
                                                  ("bare body", "AutoModel", body),
                                                  ("bare body, no pattern", "AutoModel", ep_ds_config(2))))]
    trained = [{**cases[0], "name": f"reward model trained, {v}", "upstream": v == "engine-side AutoEP",
                "train_steps": 3, "all_ranks_state": False, "kwargs": {"experts_implementation": "eager"},
                "out": os.path.join(workdir, f"ep_head_trained_{v.split()[0]}.pt")}
               for v in ("ours", "engine-side AutoEP")]
    *dumps_, ours, engine_side = run_torchrun(2, cases + trained, workdir)
    for dump in (ours, engine_side):
        assert "error" not in dump["rank0"], dump["rank0"].get("error", {}).get("traceback")
    assert len(ours["rank0"]["losses"]) == 3 and ours["rank0"]["losses"] == engine_side["rank0"]["losses"]
    # the routers AutoEP builds are partitioned over the engine's data-parallel group, as the engine partitions its
    # own (so the optimizer's sub-groups, and DeepSpeed checkpoints, are engine-side AutoEP's)
    groups = ours["rank0"]["partition_groups"]
    assert groups == engine_side["rank0"]["partition_groups"]
    assert {n for n, g in groups.items() if g == "data parallel"} == {f"model.layers.{i}.mlp.router.gate.weight"
                                                                     for i in range(2)}, groups
    for case, dump in zip(cases[:2], dumps_):
        assert_autoep_layout_of(plain_load(path, "bfloat16", case["model_class"], seed=11), dump, case["name"])
    assert "score.weight" in plain_load(path, "bfloat16", "AutoModelForSequenceClassification", seed=11)
    errors = [r.get("error") for r in dumps_[2]["ranks"]]
    assert all(errors) and len({e["message"].split("] ", 1)[1] for e in errors}) == 1, errors
    assert errors[0]["type"] == "ConfigError" and r"moe_layer_pattern: 'layers\.\d+\.mlp'" in errors[0]["message"]


def test_a_lora_adapter_over_an_expert_parallel_load_trains_as_engine_side_autoep(workdir):
    """LoRA fine-tuning of a MoE under EP: PEFT wraps the loaded model (`get_peft_model`, as TRL's `peft_config`
    does) and the engine keeps the loader's layers under the wrapper. Engine-side AutoEP sees the wrapper's names
    and finds no MoE layer unless the config names them so (`base_model.model.model.layers.N.mlp`); that config
    loads with the loader too (the pattern applied to the model's own names). 3 training steps, the same losses, then
    the same generations. Saving the adapter (with the import): the Trainer's state dict and PEFT's own
    `save_pretrained` on every rank hold the trained adapter, here and under plain ZeRO-3; adapters over the experts
    themselves are refused, at the save and at `deepspeed.initialize`."""
    path = checkpoint(workdir, "qwen3_moe")
    peft_named = ep_ds_config(2, structure={"moe_layer_pattern": r"base_model\.model\.model\.layers\.\d+\.mlp"})
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}
    variants = {"ours": ep_ds_config(2), "ours, the PEFT-named pattern": peft_named, "engine-side AutoEP": peft_named}
    cases = [{"name": f"lora, {variant}", "path": path, "dtype": "bfloat16", "ds_config": ds,
              "upstream": variant == "engine-side AutoEP", "lora": lora, "train_steps": 3, "generate": True,
              "all_ranks_state": variant != "engine-side AutoEP",
              "kwargs": {"experts_implementation": "eager"}, "out": os.path.join(workdir, f"ep_lora_{i}.pt")}
             for i, (variant, ds) in enumerate(variants.items())]
    # adapters over the experts themselves: LoRA on them (PEFT's target_parameters), or the MoE blocks trained whole
    # beside the adapter (PEFT's modules_to_save copy). Each rank's copy holds its own experts, but ZeRO-3 would
    # partition and average it over the world: refused at deepspeed.initialize, and by the adapter save
    over_experts = [{**cases[0], "name": name, "train_steps": 1, "generate": False, "expect_initialize_error": True,
                     "lora": {**lora, **extra}, "out": os.path.join(workdir, f"ep_lora_over_experts_{i}.pt")}
                    for i, (name, extra) in enumerate((("lora on the experts", {"target_parameters": ["mlp.experts.w1"]}),
                                                        ("MoE blocks trained whole", {"modules_to_save": ["mlp"]})))]
    cases[0]["peft_save"] = True
    # the same save under plain ZeRO-3 (tests/test_ecosystem.py saves one with a modules_to_save copy, through TRL),
    # with a second, inactive adapter: DeepSpeed's consolidated state dict (the Trainer's, without the import) holds
    # trainable tensors only, and PEFT then writes the active adapter's tensors as the other one's
    dense = {**cases[0], "name": "lora, ZeRO-3", "ds_config": ds_config_for("bfloat16"), "generate": False,
             "second_adapter": {"r": 2, "target_modules": ["v_proj"], "init_lora_weights": False}, "train_steps": 2,
             "out": os.path.join(workdir, "lora_zero3.pt")}
    # one rank selecting other adapters to save than the others would gather other tensors: refused alike
    unlike = {**dense, "name": "unlike selections", "train_steps": 0, "adapters_by_rank": {"1": ["other"]},
              "out": os.path.join(workdir, "lora_unlike_selections.pt")}
    *dumps_, on_experts, blocks, plain_zero3, unlike_selections = run_torchrun(
        2, cases + over_experts + [dense, unlike], workdir)
    errors = [r["adapter_error"] for r in unlike_selections["ranks"]]
    assert errors[0] == errors[1] and errors[0]["type"] == "ConfigError", errors
    assert "are not saving the same adapter: the adapter tensors to gather differs" in errors[0]["message"], errors
    for case, dump in zip(cases, dumps_):
        assert "error" not in dump["rank0"], dump["rank0"].get("error", {}).get("traceback")
        assert len(dump["rank0"]["losses"]) == 3 and dump["rank0"]["losses"] == dumps_[-1]["rank0"]["losses"], case["name"]
        # then generation, each rank to its own length (ZeRO-3 keeps the ranks' forwards, and EP's all-to-alls, in step)
        assert [r["generated"] for r in dump["ranks"]] == [r["generated"] for r in dumps_[-1]["ranks"]], case["name"]
    assert len(dumps_[0]["ranks"][1]["generated"][0]) > len(dumps_[0]["ranks"][0]["generated"][0])
    # the PEFT-named pattern loads the layout the usual config loads: every tensor, on both ranks, is AutoEP's layout
    # of the plain single-process load, bit for bit and dtype for dtype (27-wide hidden: partitions do not divide)
    for case, dump in zip(cases[:2], dumps_):
        assert_autoep_layout_of(plain_load(path, "bfloat16"), dump, case["name"])
    # the adapter the Trainer saves (with the import): the LoRA weights; not experts, which each rank holds its own of
    rank0, rank1 = dumps_[0]["ranks"]
    assert len(rank0["adapter_state"]) == 8 and all(".lora_" in n for n in rank0["adapter_state"])
    assert rank1["adapter_state"] is None
    # after training, PEFT's own save_pretrained on every rank (with the import) writes the trained adapter, not each
    # rank's empty slice of it
    from safetensors.torch import load_file

    assert plain_zero3["rank0"]["report"]["init_context"] == "zero3-meta"
    for case, dump, adapters in ((cases[0], dumps_[0], {"default": ""}),
                                 (dense, plain_zero3, {"default": "", "other": "other"})):
        trained = dump["ranks"][0]["adapter_trained"]
        assert any(not torch.equal(t, dump["ranks"][0]["adapter_state"][n]) for n, t in trained.items()), case["name"]
        for adapter, folder in adapters.items():
            saved = load_file(os.path.join(case["out"] + ".adapter", folder, "adapter_model.safetensors"))
            want = {n.replace(f".{adapter}.", "."): t for n, t in trained.items() if f".{adapter}." in n}
            assert saved.keys() == want.keys(), (case["name"], adapter, sorted(saved), sorted(want))
            assert all(torch.equal(saved[n], t) for n, t in want.items()), (case["name"], adapter)
            assert all(t.dim() == 2 and t.numel() > 0 for t in want.values()), (case["name"], adapter)
            assert len(want) == (8 if adapter == "default" else 4), (case["name"], adapter)
    for dump, tensor in ((on_experts, ".experts.lora_A."), (blocks, ".mlp.modules_to_save.default.experts.w1")):
        errors = [r["adapter_error"] for r in dump["ranks"]]
        assert errors[0] == errors[1] and errors[0]["type"] == "ConfigError" and tensor in errors[0]["message"], errors
        errors = [r["initialize_error"] for r in dump["ranks"]]
        assert errors[0] == errors[1] and errors[0]["type"] == "ConfigError", errors
        assert "added inside the expert-parallel experts" in errors[0]["message"], errors


@pytest.mark.sweep
def test_a_router_adapter_saves_under_transformers_names_and_expert_lora_is_refused(workdir):
    """PEFT (for transformers 5 MoE types) targets the router by `target_parameters=["gate.weight"]`: under EP that is
    AutoEP's router linear (`mlp.router.gate`, also reachable as `mlp.gate.gate`). Its trained LoRA is written under
    transformers' names (`mlp.gate.lora_A.weight`, what the plain ZeRO-3 run writes), so it loads onto the model
    without EP, and back onto an EP load through the key mapping the load leaves on the model. Targets that name the
    replaced experts (the experts' `gate_proj/up_proj/down_proj`, "all-linear": PEFT maps them to `gate_up_proj` and
    `down_proj`, which AutoEP's experts do not have) would train without the expert LoRA, silently unlike the same
    config without EP: refused at `deepspeed.initialize`, on every rank."""
    import warnings

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = checkpoint(workdir, "qwen3_moe")
    router = {"r": 4, "target_modules": ["q_proj"], "target_parameters": ["gate.weight"], "init_lora_weights": False}
    saved = os.path.join(workdir, "ep_router_lora.pt")
    cases = [{"name": "router lora", "path": path, "dtype": "bfloat16", "ds_config": ep_ds_config(2), "lora": router,
              "train_steps": 2, "peft_save": True, "kwargs": {"experts_implementation": "eager"}, "out": saved}]
    cases += [{**cases[0], "name": f"lora {name}", "lora": {"r": 4, "target_modules": targets}, "peft_save": False,
               "train_steps": 1, "expect_initialize_error": True, "out": os.path.join(workdir, f"ep_lora_{i}.pt")}
              for i, (name, targets) in enumerate((("all-linear", "all-linear"),
                                                   ("llama list", ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])))]
    router_run, *refused = run_torchrun(2, cases, workdir)
    assert "error" not in router_run["rank0"], router_run["rank0"].get("error", {}).get("traceback")
    for dump in refused:
        for rank in dump["ranks"]:
            error = rank["initialize_error"]
            assert error["type"] == "ConfigError" and "target_parameters ['down_proj', 'gate_up_proj']" in error["message"]
    adapter = saved + ".adapter"
    written = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    trained = {n.replace(".default", "").replace("mlp.router.gate", "mlp.gate"): t
               for n, t in router_run["rank0"]["adapter_trained"].items()}
    assert sorted(written) == sorted(trained) and any("mlp.gate.lora_B" in n for n in written)
    assert all(torch.equal(written[n], trained[n].to(written[n].dtype)) for n in written)
    # onto the model without expert parallelism: every tensor in place, no missing key
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), adapter)
    assert not [w for w in caught if "missing adapter keys" in str(w.message)]
    loaded = {n.replace(".default", ""): p.detach() for n, p in plain.named_parameters() if ".lora_" in n}
    assert sorted(loaded) == sorted(written) and all(torch.equal(loaded[n], written[n]) for n in written)
    # back onto an expert-parallel load
    [again] = run_torchrun(2, [{**cases[0], "name": "reload", "lora": None, "train_steps": 0, "peft_save": False,
                                "peft_adapter": adapter, "out": os.path.join(workdir, "ep_router_reload.pt")}], workdir)
    assert "error" not in again["rank0"], again["rank0"].get("error", {}).get("traceback")
    back = {n.replace(".default", "").replace("mlp.router.gate", "mlp.gate"): t
            for n, t in again["rank0"]["adapter_loaded"].items()}
    assert sorted(back) == sorted(written) and all(torch.equal(back[n], written[n]) for n in written)
