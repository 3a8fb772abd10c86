"""Randomised checks beyond the tests' fixed cases: random configs, dropped keys, damaged headers, streams, saves.

    python scripts/fuzz.py configs --seed 1 --world-size 3 --cases 24   # random MoE/dense configs, dtypes, shards
    python scripts/fuzz.py missing --seed 1 --world-size 3 --cases 20   # their checkpoints with random keys dropped
    python scripts/fuzz.py configs --dtype bfloat16 ...                  # in a bf16 (or fp16) engine
    python scripts/fuzz.py configs --model-class AutoModel ...           # as a base model (or a new task head)
    python scripts/fuzz.py configs --model-class AutoModel --families mistral_large4_text,...  # types only it knows
    python scripts/fuzz.py ep      --seed 1 --world-size 4 --cases 10   # expert parallelism on random configs
                                                                         # (some with a multi-token-prediction layer)
    python scripts/fuzz.py ep --stream ...                               # ... to "nodes" without the files
    python scripts/fuzz.py ep --model-class AutoModelForSequenceClassification ...  # ... into a new task head
    python scripts/fuzz.py ep --families deepseek_v3_remote ...          # ... DeepSeek-V3's hub code (expert modules)
    python scripts/fuzz.py headers --seed 1 --cases 40                  # headers (or a shard index) mutated
    python scripts/fuzz.py save    --seed 1 --world-size 3 --cases 16   # saves of the `configs` checkpoints (any head)
    python scripts/fuzz.py stream  --seed 1 --world-size 2 --cases 8    # them streamed to "nodes" without files
    python scripts/fuzz.py state_dict --seed 1 --world-size 3 --cases 12  # from_pretrained(None, state_dict=...)
    python scripts/fuzz.py nvme    --seed 1 --world-size 3 --cases 6    # NVMe parameter offload (needs libaio)

Each mode builds its checkpoints with transformers' config classes and `save_pretrained` under --workdir (reused
across runs), runs them through real torchrun ranks (tests/dist_worker.py) and checks what the tests check:
- configs / missing / ep: every gathered parameter and buffer equals plain single-process `from_pretrained`, bit and
  dtype (missing keys with the same seed; ep through AutoEP's documented layout, tests/test_expert_parallel.py);
  a load that fails must fail as the plain load does (the case is reported with both errors, never as a pass);
- headers: ranks as separate processes (`run_ranks`, so a hang or a rank-local error shows): a failure must be the
  same error on every rank, where the plain load fails too (a LoaderError, or the plain load's own error) or where
  it would randomly initialise what the checkpoint holds under another name (`ConversionMismatchError`, the guard
  against silent random init); a success equal to the plain load;
- state_dict: `from_pretrained(None, config=..., state_dict=...)` in the checkpoint's layout or the model's, a key
  dropped at random, values on rank 0 only at times; equal to the plain load of the same state dict (same seed);
- nvme: partitions swapped out to DeepSpeed's NVMe files in waves of random sizes; equal to the plain load;
- stream: one rank per "node" (`run_nodes`), only node 0 with the files; equal to the plain load in the load's dtype;
- save: right after the load or after two training steps, the folder is byte for byte what transformers'
  `save_pretrained` writes for the gathered model, and loads back to the saved values.
Random sizes are odd (37, 13, 29, ...), expert counts 3-8, checkpoints fp32/fp16/bf16 and sharded at odd points
(3-30 KB), so partition boundaries fall inside fused and concatenated tensors. Prints each failure; exit status 1
if any.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import struct
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "minimax", "qwen2_moe", "glm4_moe", "olmoe", "phimoe",
            "granitemoe", "jetmoe", "llama4_text", "hunyuan_v1_moe", "ernie4_5_moe", "dots1", "deepseek_v2", "llama",
            "qwen3", "gemma2", "qwen3_next", "longcat_flash", "flex_olmo", "bailing_hybrid", "afmoe")


def _save_random(config, path: str, dtype, seed: int, shard: str, model_class=None) -> str:
    """The tests' checkpoint maker (random weights perturbed, so that mix-ups show), at a random shard size."""
    from tests.checkpoints import make_checkpoint
    from tests.families import with_extra_files

    return with_extra_files(make_checkpoint(path, config.model_type, dtype=dtype, seed=seed, config=config,
                                            max_shard_size=shard, model_class=model_class), config.model_type)


def _mtp_builds(config) -> bool:
    """Whether `config` can carry an extra (multi-token-prediction) layer: its layers are `model.layers.N` (not a
    vision-language model's `model.language_model.layers.N`)."""
    return isinstance(getattr(config, "num_hidden_layers", None), int) and getattr(config, "text_config", None) is None


def _save_with_mtp_layer(config, path: str, dtype, seed: int, shard: str, model_class=None) -> str:
    """`_save_random` with a multi-token-prediction layer after the model's last (tests/checkpoints.with_mtp_layer),
    or without one where the model cannot be built a layer deeper."""
    from tests.checkpoints import with_mtp_layer
    from tests.families import with_extra_files

    try:
        return with_extra_files(with_mtp_layer(path, config, dtype, shard, seed, model_class), config.model_type)
    except Exception as e:
        print(f"{config.model_type}: no extra layer ({type(e).__name__}: {str(e)[:120]})")
        return None


def random_checkpoints(workdir: str, rng: random.Random, n: int, seed: int, families=None,
                       model_class: str = "AutoModelForCausalLM") -> list[tuple[str, str]]:
    """(name, folder) of `n` random small configs of `families` (default FAMILIES; any of tests/families.SWEEP, or
    of a head sweep's types for `model_class`: those are built small as the head sweep builds them, through it)."""
    import torch
    import transformers

    from tests.families import SWEEP, small_config, small_head_config

    out = []
    for i in range(n):
        family = rng.choice(families or FAMILIES)
        # a causal LM is saved as one and loaded through `model_class` (a base model, a new head) where that class
        # knows the config the causal LM saves; a type no causal LM class knows (a text model only AutoModel knows,
        # a classifier), or one whose causal LM saves a config `model_class` does not know (Qwen3.5's text config,
        # for ImageTextToText), is saved through `model_class` itself
        auto_class = getattr(transformers, model_class)
        causal = small_config(family) if family in SWEEP else None
        saved_config = (transformers.AutoModelForCausalLM._model_mapping[type(causal)].config_class
                        if causal is not None else None)
        built_by = None if saved_config in auto_class._model_mapping else auto_class
        config = causal if built_by is None else small_head_config(family, model_class)
        sizes = dict(intermediate_size=rng.choice([37, 50, 64]), moe_intermediate_size=rng.choice([13, 22, 29]),
                     num_experts=rng.choice([3, 5, 6]), num_local_experts=rng.choice([3, 5, 6]),
                     n_routed_experts=rng.choice([3, 5, 6]), vocab_size=rng.choice([89, 101, 128]),
                     tie_word_embeddings=rng.random() < 0.3, attention_bias=rng.random() < 0.5,
                     shared_expert_intermediate_size=rng.choice([11, 30]))
        for key, value in sizes.items():
            if getattr(config, key, None) is not None and not isinstance(getattr(config, key), (list, dict)):
                setattr(config, key, value)
        if getattr(config, "qk_rope_head_dim", None):  # MLA: rotary over the rope dims, a key per query head (as
            # their configs derive them; the sweep's common head_dim / one KV head load, but cannot run a forward)
            config.head_dim, config.num_key_value_heads = config.qk_rope_head_dim, config.num_attention_heads
        dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
        shard = rng.choice(["10GB", "30KB", "7KB"])
        built = f" {model_class}" if built_by else ""
        drawn = hashlib.sha1(f"{config.to_json_string()} {dtype} {shard}{built}".encode()).hexdigest()[:8]
        try:  # one folder per drawn checkpoint: reused by any run (mode) that draws it again
            path = _save_random(config, os.path.join(workdir, "configs", f"{family}_{drawn}"), dtype, i, shard,
                                built_by)
        except Exception as e:  # a config these sizes do not fit: not a loader case
            print(f"skipped {family}: {type(e).__name__}: {str(e)[:120]}")
            continue
        out.append((f"{family}#{i} {str(dtype)[6:]} shards {shard}", path))
    print(f"built {len(out)} of {n} drawn checkpoints ({n - len(out)} skipped)")
    if not out:  # every draw skipped: "0 failure(s)" would claim checks that never ran
        raise SystemExit("no drawn checkpoint could be built; nothing was checked")
    return out


def differing(got: dict, model) -> list[str]:
    """Names of `model`'s parameters and buffers that the gathered `got` lacks or holds with other bits or dtype."""
    import torch

    return [k for k, w in [*model.named_parameters(), *model.named_buffers()]
            if k not in got or got[k].dtype != w.dtype or not torch.equal(got[k], w.detach())]


def plain_failure(path: str, model_class: str = "AutoModelForCausalLM") -> str | None:
    """Why a plain load of `path` through `model_class` fails, or None."""
    import torch
    import transformers

    try:
        getattr(transformers, model_class).from_pretrained(path, dtype=torch.float32)
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:160]}"
    return None


def plain_trains(path: str) -> bool:
    """Whether the plain model of `path` runs a training forward and backward (some small hybrid configs cannot:
    transformers 5.23's linear-attention cache without a full-attention layer)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
        ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
    except Exception:
        return False
    return True


def loader_errors() -> set[str]:
    """Names of the loader's own error classes (LoaderError and its subclasses)."""
    from hf_zero3_loader.errors import LoaderError

    names, todo = set(), [LoaderError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def explain(failures: list[str], cases: list[dict]) -> list[str]:
    """A load failure both paths share is upstream's behaviour: kept as a note, not a failure, where ours is a clear
    error (the loader's own, or the plain load's own type); a bare IndexError where the plain load explains stays a
    failure."""
    clear = loader_errors()
    real = []
    for f in failures:
        # the longest case name the failure starts with (names may hold ": ", e.g. a save's kwargs)
        case = max((c for c in cases if f.startswith(c["name"] + ": ")), key=lambda c: len(c["name"]), default=None)
        rest = f[len(case["name"]) + 2:] if case else f.partition(": ")[2]
        plain = plain_failure(_source(case), case.get("model_class", "AutoModelForCausalLM")) if case and (
            "Error: " in f) else None
        ours = rest.split(": ", 1)[0]
        if plain and (ours in clear or plain.startswith(ours + ":")):
            print(f"  both fail (as upstream): {f[:200]} | plain: {plain}")
        elif ours == "ConversionMismatchError" and case and plain_misses_keys(case):
            print(f"  refused as documented (the plain load initialises them at random): {f[:200]}")
        else:
            real.append(f)
    return real


def _source(case: dict) -> str:
    """The checkpoint folder a case loads (a streamed case names it per node: node 0's)."""
    return case.get("path") or case["source"]


def plain_misses_keys(case: dict) -> bool:
    """Whether the plain load of `case` initialises parameters at random beside unexpected checkpoint keys: the
    loader's documented refusal (`ConversionMismatchError`, README "Errors") applies where it does."""
    import transformers

    try:
        _, info = getattr(transformers, case.get("model_class", "AutoModelForCausalLM")).from_pretrained(
            _source(case), output_loading_info=True)
    except Exception:
        return False
    return bool(info["missing_keys"] and info["unexpected_keys"])


def engine_dtype(args, kwargs: dict | None = None) -> dict:
    """A case's engine dtype (--dtype) and the plain load's to compare with. `keep_in_fp32=True` keeps parameters
    whose dtype is not the engine's as the plain load does, so they compare bit for bit: `_keep_in_fp32_modules` in a
    bf16 or fp16 engine, and a float64 parameter in any engine (OneFormer's `criterion.logit_scale`, made from a numpy
    float64). By default those load in the engine's dtype, with a warning, as zero.Init casts them."""
    kwargs = {**(kwargs or {}), "keep_in_fp32": True}
    return {"dtype": args.dtype, "plain_dtype": args.dtype, "kwargs": kwargs}


def families_for(args) -> list[str] | None:
    """--families that the --model-class auto class knows; without --families, the default ones it knows and the
    head sweep's types for it (tests/families.HEAD_SWEEP: most heads know none of the default causal LMs)."""
    if args.model_class == "AutoModelForCausalLM":
        return args.families
    from tests.families import HEAD_SWEEP
    from tests.test_families import known_to

    if args.families:
        families = list(known_to(args.model_class, args.families))
    else:
        families = list(known_to(args.model_class, FAMILIES)) + list(HEAD_SWEEP.get(args.model_class, ()))
    if not families:  # never fall back to types the class cannot load: every case would only "fail as upstream"
        raise SystemExit(f"no model type {'in --families ' if args.families else ''}is known to {args.model_class}")
    return list(dict.fromkeys(families))


def run_configs(args, rng) -> list[str]:
    from tests.test_families import compare_with_plain_loads

    # another auto class than the checkpoint's (--model-class): a base model drops the head, a task head is new and
    # initialised, from the same seed on both sides
    cases = [{"name": name, "path": path, **engine_dtype(args), "model_class": args.model_class, "seed": 11,
              "out": os.path.join(args.workdir, "out", f"configs_{args.seed}_{i}_w{args.world_size}.pt")}
             for i, (name, path) in enumerate(random_checkpoints(args.workdir, rng, args.cases, args.seed,
                                                                 families_for(args), args.model_class))]
    return explain(compare_with_plain_loads(cases, args.world_size, args.workdir, seed=11), cases)


def run_missing(args, rng) -> list[str]:
    import torch

    from tests.checkpoints import rewrite_checkpoint
    from tests.conftest import run_torchrun
    from tests.test_families import LEFT_UNINITIALISED, LEFT_UNINITIALISED_ANY, load_failure

    sources = random_checkpoints(args.workdir, random.Random(args.seed), args.cases, args.seed, families_for(args),
                                 args.model_class)
    cases = []
    for i in range(args.cases):
        name, src = rng.choice(sources)
        fraction, key_seed = rng.choice([0.05, 0.2, 0.5]), rng.randrange(1 << 30)

        def drop(tensors, fraction=fraction, key_seed=key_seed):
            keep = random.Random(key_seed)
            return {k: v for k, v in tensors.items() if keep.random() > fraction}

        dst = rewrite_checkpoint(src, os.path.join(args.workdir, "missing", f"{os.path.basename(src)}_{args.seed}_{i}"),
                                 drop)
        budget = rng.choice([4096, 65536, None])
        kwargs = {"allow_suspicious_missing_keys": True, **({"missing_init_budget_bytes": budget} if budget else {})}
        cases.append({"name": f"{name} -{fraction:.0%} keys, budget {budget}", "path": dst, "seed": 11,
                      **engine_dtype(args, kwargs), "model_class": args.model_class,
                      "out": os.path.join(args.workdir, "out", f"missing_{args.seed}_{i}_w{args.world_size}.pt")})
    failures = []
    for case, dump in zip(cases, run_torchrun(args.world_size, cases, args.workdir, timeout=1500)):
        # a missing tensor the model's own init never writes: the plain load leaves uninitialised memory, ours zeros
        # (by design, with a warning; README "How it works"), named in the report; only those the tests know of
        left = set(dump["rank0"].get("report", {}).get("missing_left_by_init", []))
        known = "|".join(filter(None, (LEFT_UNINITIALISED.get(case["name"].split("#")[0]), LEFT_UNINITIALISED_ANY)))

        def as_expected(case, name, ours, plain, left=left, known=known):
            if name in left and re.search(known, name):
                return ours.dtype == plain.dtype and not ours.any()
            return ours.dtype == plain.dtype and torch.equal(ours, plain)

        if failure := load_failure(case, dump, 11, as_expected):
            failures.append(failure)
    return explain(failures, cases)


def run_ep(args, rng) -> list[str]:
    import torch

    import transformers

    from tests.checkpoints import EP_FAMILIES, EP_MODEL_CLASS, EP_NAMED_STRUCTURE, ep_config, remote_code_moe_checkpoint
    from tests.conftest import run_nodes, run_torchrun
    from tests.test_expert_parallel import REMOTE, ep_ds_config, expected, load_kwargs, plain_fp32_params, plain_load

    # presets, and structures the config names: a preset of the same structure, or custom patterns; with
    # --model-class, those its auto class knows (a causal LM's body loaded into a reward model, a bare body, ...);
    # and DeepSeek-V3 with the hub's own modeling code (one module per expert)
    families = EP_FAMILIES + tuple(EP_NAMED_STRUCTURE) + (REMOTE,)
    if args.families:  # a choice among them
        if unknown := sorted(set(args.families) - set(families)):
            raise SystemExit(f"no expert-parallel config for {unknown} (tests/checkpoints.ep_config: {families})")
        families = tuple(args.families)
    if args.model_class != "AutoModelForCausalLM":
        from tests.test_families import known_to

        # the hub's code (REMOTE, not a model type transformers knows) maps only its causal LM (its config's auto_map)
        if not (families := known_to(args.model_class, tuple(f for f in families if f != REMOTE))):
            raise SystemExit(f"no expert-parallel model type is known to {args.model_class}")
    cases = []
    for i in range(args.cases):
        family = rng.choice(families)
        kind = "deepseek_v3" if family == REMOTE else family  # the model type, and its AutoEP structure
        # the family's own class (a vision-language model's) unless --model-class asks for another
        model_class = (EP_MODEL_CLASS.get(family, args.model_class) if args.model_class == "AutoModelForCausalLM"
                       else args.model_class)
        config = ep_config(kind)
        text = getattr(config, "text_config", None) or config
        experts = rng.choice([4, 6, 8, 12])  # 6 and 12 split over 3 (and 6) ranks too
        for key in ("num_experts", "n_routed_experts", "num_local_experts"):
            if getattr(text, key, None) is not None:
                setattr(text, key, experts)
        for key, choices in (("moe_intermediate_size", [7, 13, 20]), ("intermediate_size", [19, 30]),
                             ("shared_expert_intermediate_size", [9, 14]), ("vocab_size", [89, 130])):
            if getattr(text, key, None) is not None:
                setattr(text, key, rng.choice(choices))
        ep = rng.choice([e for e in (1, 2, 3, 4, 6) if args.world_size % e == 0 and experts % e == 0])
        dtype = rng.choice([torch.bfloat16, torch.float32])
        saved_as = getattr(transformers, EP_MODEL_CLASS.get(family, "AutoModelForCausalLM"))
        folder, shard = os.path.join(args.workdir, "ep", f"{family}_{args.seed}_{i}"), rng.choice(["10GB", "9KB"])
        # at times as DeepSeek-V3 and GLM-4.5 ship: a multi-token-prediction layer after the last, which no load
        # reads (drawn apart, so that a seed draws what it drew before this was added)
        mtp = family != REMOTE and random.Random(f"mtp/{args.seed}/{i}").random() < 0.3 and _mtp_builds(config)
        path = _save_with_mtp_layer(config, folder + "_mtp", dtype, i, shard, saved_as) if mtp else None
        mtp = path is not None
        path = path or (remote_code_moe_checkpoint(folder, config, dtype, shard, seed=i) if family == REMOTE
                        else _save_random(config, folder, dtype, i, shard, saved_as))
        case = {"name": f"{family}#{i} ep{ep} {experts} experts {str(dtype)[6:]}{' +mtp' * mtp}", "ep_size": ep,
                "path": path,
                "dtype": "bfloat16", "all_ranks_state": True,
                "ds_config": ep_ds_config(ep, "bfloat16", kind, _ep_structure(kind, config, model_class)),
                "model_class": model_class, "seed": 11,  # a new head: drawn as the seeded plain load draws it
                "kwargs": load_kwargs(path),
                "out": os.path.join(args.workdir, "out", f"ep_{args.seed}_{i}_w{args.world_size}.pt")}
        if args.stream:  # one rank per "node", only node 0 with the files: the others receive their expert shares
            chunk = rng.choice([256, 4096, 1 << 20])
            case.update(name=f"{case['name']} streamed in {chunk} B chunks",
                        kwargs={**case["kwargs"], "stream_chunk_bytes": chunk},
                        path_by_node={str(n): (path if n == 0 else "/nonexistent/checkpoint")
                                      for n in range(args.world_size)})
        elif rng.random() < 0.5:  # saved back right after the load (the read plan run backwards through AutoEP)
            folder = os.path.join(args.workdir, "saved", f"ep_{args.seed}_{i}")
            shutil.rmtree(folder, ignore_errors=True)
            shard = rng.choice(["10GB", "7KB"])
            case.update(name=f"{case['name']} saved ({shard} shards)",
                        save={"dir": folder, "kwargs": {"max_shard_size": shard}})
        cases.append(case)
    failures = []
    dumps = (run_nodes(args.world_size, 1, cases, args.workdir, timeout=900) if args.stream
             else run_torchrun(args.world_size, cases, args.workdir, timeout=1500))
    for case, dump in zip(cases, dumps):
        if args.stream and not any(r.get("report", {}).get("stream", {}).get("bytes_received") for r in dump["ranks"]):
            failures.append(f"{case['name']}: nothing was streamed")
        plain, covered = plain_load(case["path"], "bfloat16", case["model_class"], case["seed"]), set()
        kept_in_fp32 = plain_fp32_params(case["path"], "bfloat16", case["model_class"], case["seed"])
        for r in dump["ranks"]:
            if "error" in r:
                failures.append(f"{case['name']}: {r['error']['type']}: {r['error']['message'][:200]}")
                break
            ep_rank = r["rank"] % case["ep_size"]
            for name, actual in r["state"].items():
                if name.endswith(".tokens_per_expert"):  # AutoEP's own counter
                    continue
                sources, want = expected(name, plain, ep_rank, case["ep_size"])
                covered.update(sources)
                if set(sources) <= kept_in_fp32:  # a router kept in fp32 (transformers
                    want = want.to(torch.bfloat16)  # 5.24's DeepSeek-V3, GLM-4.5): loaded in the engine's dtype
                if actual.dtype != want.dtype or not torch.equal(actual, want):
                    failures.append(f"{case['name']}: {name} differs on rank {r['rank']}")
        else:
            if covered != set(plain):
                failures.append(f"{case['name']}: not loaded: {sorted(set(plain) - covered)[:3]}")
            if case.get("save") and (saved := _ep_save_failure(case, dump, kept_in_fp32)):
                failures.append(f"{case['name']}: {saved}")
    return explain(failures, cases)


def _ep_save_failure(case: dict, dump: dict, kept_in_fp32: frozenset) -> str | None:
    """A save under expert parallelism right after the load must be, byte for byte, transformers' `save_pretrained`
    of the plain load in the engine's dtype (as tests/test_saving.py checks it), and load back whole."""
    import filecmp

    import torch
    import transformers

    if errors := [r["save_error"] for r in dump["ranks"] if "save_error" in r]:
        return f"save failed: {errors[0]['type']}: {errors[0]['message'][:200]}"
    auto_class, folder = getattr(transformers, case["model_class"]), case["save"]["dir"]
    torch.manual_seed(case["seed"])
    model = auto_class.from_pretrained(case["path"], dtype=torch.bfloat16, **case["kwargs"])
    for name in kept_in_fp32:  # a router the plain load keeps in fp32 trains and saves in the engine's dtype
        model.get_parameter(name).data = model.get_parameter(name).data.to(torch.bfloat16)
    reference = folder + ".reference"
    shutil.rmtree(reference, ignore_errors=True)
    model.save_pretrained(reference, **case["save"]["kwargs"])
    names = sorted(os.listdir(folder))
    if names != sorted(os.listdir(reference)):
        return f"saved files {names} vs transformers' {sorted(os.listdir(reference))}"
    if differ := [n for n in names if not filecmp.cmp(os.path.join(folder, n), os.path.join(reference, n),
                                                      shallow=False)]:
        return f"saved files differ from transformers' save_pretrained: {differ}"
    _, info = auto_class.from_pretrained(folder, output_loading_info=True, **case["kwargs"])
    if bad := {k: v for k, v in info.items() if k != "error_msgs" and v}:
        return f"the saved folder does not load back whole: {bad}"
    return None


def _ep_structure(family: str, config, model_class: str) -> dict:
    """What the AutoEP section names for `family`: its named structure (tests.checkpoints.EP_NAMED_STRUCTURE), and
    where `model_class` holds the layers elsewhere than that pattern says (the presets' `model.layers.N`; a bare
    body: `layers.N`; Qwen3-MoE's QA head: `transformer.layers.N`; Qwen3-VL-MoE's bare body: `language_model.layers.N`),
    the MoE layer pattern there, as a user names it (DeepSpeed applies the pattern over the preset it detects)."""
    import torch
    import transformers
    from deepspeed.module_inject.auto_ep_presets import registry

    from tests.checkpoints import EP_NAMED_STRUCTURE

    structure = dict(EP_NAMED_STRUCTURE.get(family, {}))
    with torch.device("meta"):
        model = getattr(transformers, model_class).from_config(config)
    (body,) = {m[1] for name, _ in model.named_modules() if (m := re.fullmatch(r"(.*?)layers\.0", name))}
    preset = structure.get("preset_model") or registry.preset_name_for_hf_model_type(family)
    pattern = structure.get("moe_layer_pattern") or registry.get_preset(preset).moe_layer_pattern
    if not re.fullmatch(pattern.split(r"layers\.")[0], body):
        structure["moe_layer_pattern"] = re.escape(body) + r"layers\." + pattern.split(r"layers\.", 1)[1]
    return structure


def _mutate(header: dict, rng: random.Random) -> str:
    keys = [k for k in header if k != "__metadata__"]
    if not keys:  # a small shard's one tensor deleted by the mutation before
        return "no tensor left"
    key = rng.choice(keys)
    kind = rng.choice(["dtype", "shape", "offsets", "delete", "rename", "shape_swap", "reshape", "metadata", "extra"])
    entry = header[key]
    if kind == "dtype":
        entry["dtype"] = rng.choice(["F32", "F16", "BF16", "I32", "F64", "I64", "U8", "F8_E4M3", "BOOL", "I16"])
    elif kind == "shape":
        shape = list(entry["shape"]) or [1]
        i = rng.randrange(len(shape))
        shape[i] = max(0, shape[i] + rng.choice([-1, 1, -shape[i], shape[i]]))
        entry["shape"] = shape
    elif kind == "shape_swap":
        entry["shape"] = list(reversed(entry["shape"]))
    elif kind == "reshape":  # the same elements in another number of dims (what conversion ops' dims see)
        shape = list(entry["shape"])
        entry["shape"] = rng.choice([[math.prod(shape)], [1, *shape], shape[:-2] + [math.prod(shape[-2:])]])
    elif kind == "offsets":
        a, b = entry["data_offsets"]
        d = rng.choice([-4, 4, -2, 2, 1])
        entry["data_offsets"] = [a + d, b + d] if rng.random() < 0.5 else [a, b + d]
    elif kind == "delete":
        del header[key]
    elif kind == "rename":
        header[key.replace("layers.1", "layers.7") if "layers.1" in key else key + "_x"] = header.pop(key)
    elif kind == "metadata":
        header["__metadata__"] = rng.choice([{"format": "tf"}, {"format": "mlx"}, {}, {"format": "pt", "x": "y"}])
    else:
        header["model.extra.weight"] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    return f"{kind} {key}"


def _mutate_index(path: str, shards: list[str], rng: random.Random) -> str:
    with open(path) as f:
        index = json.load(f)
    weight_map = index["weight_map"]
    key = rng.choice(sorted(weight_map))
    kind = rng.choice(["drop", "other_shard", "absent_file", "extra_key", "delete_shard_file"])
    if kind == "drop":
        del weight_map[key]
    elif kind == "other_shard":
        weight_map[key] = rng.choice([s for s in shards if s != weight_map[key]])
    elif kind == "absent_file":
        weight_map[key] = "model-99999-of-99999.safetensors"
    elif kind == "extra_key":
        weight_map["model.layers.9.mlp.gate.weight"] = rng.choice(shards)
    else:
        os.remove(os.path.join(os.path.dirname(path), weight_map[key]))
    with open(path, "w") as f:
        json.dump(index, f)
    return f"index: {kind} {key}"


def documented_refusal(error: dict) -> bool:
    """Refusals of checkpoints a plain load takes, by design (README): parameters the plain load would initialise at
    random while the checkpoint holds them under another name (`ConversionMismatchError`), and an index that names a
    tensor in a file that does not hold it (transformers takes only the index's list of files; "Same checkpoint")."""
    return error["type"] == "ConversionMismatchError" or "the checkpoint index names tensor" in error["message"]


def run_headers(args, rng) -> list[str]:
    import torch
    import transformers

    from tests.checkpoints import make_checkpoint
    from tests.conftest import run_ranks, run_torchrun
    from tests.families import small_config

    sources = []
    for family in args.families or ["qwen3_moe"]:  # each family's checkpoint, whole and sharded
        config, name = (None, "source") if family == "qwen3_moe" else (small_config(family), f"source_{family}")
        sources += [make_checkpoint(os.path.join(args.workdir, "headers", name), family, config=config),
                    make_checkpoint(os.path.join(args.workdir, "headers", name + "_sharded"), family, config=config,
                                    sharded=True)]
    cases = []
    for i in range(args.cases):
        src = rng.choice(sources)
        dst = os.path.join(args.workdir, "headers", f"{args.seed}_{i}")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        shards = sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))
        if len(shards) > 1 and rng.random() < 0.3:  # the index of a sharded checkpoint, not a header
            edits = _mutate_index(os.path.join(dst, "model.safetensors.index.json"), shards, rng)
        else:
            shard = rng.choice(shards)
            path = os.path.join(dst, shard)
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header, data = json.loads(f.read(n)), f.read()
            edits = f"{shard}: " * (len(shards) > 1) + "; ".join(
                _mutate(header, rng) for _ in range(rng.choice([1, 1, 2])))
            raw = json.dumps(header).encode()
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(raw)) + raw + data)
        cases.append({"name": edits, "path": dst, "dtype": "float32", "seed": 3,
                      "out": os.path.join(args.workdir, "out", f"headers_{args.seed}_{i}.pt")})
    failures, loaded = [], []
    for case, ranks in zip(cases, run_ranks(args.world_size, cases, args.workdir, timeout=600)):
        errors = [r.get("error") if r else None for r in ranks]
        if not any(errors) and all(ranks):
            loaded.append({**case, "out": case["out"] + ".loaded"})
            continue
        if not all(errors) or len({(e["type"], e["message"]) for e in errors}) != 1:
            failures.append(f"{case['name']}: ranks disagree or one gave no outcome: {errors}")
        elif not documented_refusal(errors[0]):
            # a LoaderError, or transformers' own error as the plain load raises it; and the plain load fails too
            plain = plain_failure(case["path"])
            if not plain or ("LoaderError" not in errors[0]["mro"] and not plain.startswith(errors[0]["type"] + ":")):
                failures.append(f"{case['name']}: {errors[0]['type']}: {errors[0]['message'][:200]} | plain: {plain}")
    for case, dump in zip(loaded, run_torchrun(args.world_size, loaded, args.workdir, timeout=600) if loaded else []):
        plain = plain_failure(case["path"])
        if plain:
            failures.append(f"{case['name']}: loaded, while the plain load fails: {plain}")
            continue
        torch.manual_seed(3)
        model = transformers.AutoModelForCausalLM.from_pretrained(case["path"], dtype=torch.float32)
        got = dump["rank0"]["state"]
        if differ := differing(got, model):
            failures.append(f"{case['name']}: {len(differ)} tensors differ from the plain load, e.g. {differ[:3]}")
    return failures


def run_save(args, rng) -> list[str]:
    from tests.conftest import run_torchrun
    from tests.families import EXTRA_FILES_FOR
    from tests.test_families import PLAIN_LOAD_MISSES_KEYS, save_failure

    causal = args.model_class == "AutoModelForCausalLM"
    sources = random_checkpoints(args.workdir, random.Random(args.seed), args.cases, args.seed, families_for(args),
                                 args.model_class)
    cases = []
    for i in range(args.cases):
        name, src = rng.choice(sources)
        kwargs = rng.choice([{}, {"max_shard_size": "20KB"}, {"max_shard_size": "3KB"}, {"max_shard_size": "100KB"}])
        folder = os.path.join(args.workdir, "saved", f"{args.seed}_{i}")
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(folder + ".reference", ignore_errors=True)
        # saved right after the load, or (causal LMs) after two training steps of the engine where the plain model
        # trains
        steps = rng.choice([0, 2])
        steps = steps if steps == 0 or (causal and plain_trains(src)) else 0
        cases.append({"name": f"{name} {kwargs} after {steps} steps", "path": src, "dtype": "float32",
                      "model_class": args.model_class,
                      # the grouped-GEMM experts need 16-byte strides on CPU, which these odd sizes lack (as in
                      # tests/test_saving.py): the eager experts train here. keep_in_fp32: a float64 parameter
                      # (OneFormer's) is saved as the plain load holds it, so the saved folder loads back equal
                      "train_steps": steps, "kwargs": {"keep_in_fp32": True, **({"experts_implementation": "eager"}
                                                                                if steps else {})},
                      "out": os.path.join(args.workdir, "out", f"save_{args.seed}_{i}.pt"),
                      "save": {"dir": folder, "kwargs": kwargs, "reference": True}})
    dumps = run_torchrun(args.world_size, cases, args.workdir, timeout=1500)
    # what transformers cannot load back from its own save is checked byte for byte only (as the head sweep does)
    return explain([f for case, dump in zip(cases, dumps)
                    if (f := save_failure(case, dump, loads_back_whole=case["name"].split("#")[0] not in
                                          {*PLAIN_LOAD_MISSES_KEYS, *EXTRA_FILES_FOR}))], cases)


def run_stream(args, rng) -> list[str]:
    """Ranks without the files: node 0 holds the checkpoint, the others receive their partitions from it (one rank
    per node, --world-size nodes), in chunks of random sizes, loaded in fp32 or bf16 (narrowed in transit); through
    --model-class, what the checkpoint lacks (a new head) is initialised from the same seed on both sides."""
    import torch
    import transformers

    from tests.conftest import run_nodes

    sources = random_checkpoints(args.workdir, random.Random(args.seed), args.cases, args.seed, families_for(args),
                                 args.model_class)
    cases = []
    for i in range(args.cases):
        name, src = rng.choice(sources)
        dtype, chunk = rng.choice(["float32", "bfloat16"]), rng.choice([256, 4096, 1 << 20])
        nodes = {str(n): (src if n == 0 else "/nonexistent/checkpoint") for n in range(args.world_size)}
        cases.append({"name": f"{name} {dtype} chunks {chunk}", "path_by_node": nodes, "dtype": dtype,
                      # keep_in_fp32: the plain load's dtypes for `_keep_in_fp32_modules` (ERNIE's router), so that
                      # a bf16 load compares bit for bit (by default they load in the engine's dtype, with a warning)
                      "kwargs": {"stream_chunk_bytes": chunk, "keep_in_fp32": True}, "source": src,
                      "model_class": args.model_class, "seed": 11,
                      "out": os.path.join(args.workdir, "out", f"stream_{args.seed}_{i}.pt")})
    failures = []
    for case, dump in zip(cases, run_nodes(args.world_size, 1, cases, args.workdir, timeout=900)):
        errors = [r["error"] for r in dump["ranks"] if "error" in r]
        if errors:
            if plain := plain_failure(case["source"], args.model_class):  # a config the class cannot load
                print(f"  both fail (as upstream): {case['name']}: {errors[0]['type']} | plain: {plain}")
            else:
                failures.append(f"{case['name']}: {errors[0]['type']}: {errors[0]['message'][:200]}")
            continue
        torch.manual_seed(11)
        model = getattr(transformers, args.model_class).from_pretrained(case["source"],
                                                                        dtype=getattr(torch, case["dtype"]))
        got = dump["rank0"]["state"]
        if differ := differing(got, model):
            failures.append(f"{case['name']}: {len(differ)} tensors differ from the plain load, e.g. {differ[:3]}")
        if not any(r["report"].get("stream", {}).get("bytes_received") for r in dump["ranks"]):
            failures.append(f"{case['name']}: nothing was streamed")
    return explain(failures, cases)


def run_state_dict(args, rng) -> list[str]:
    """`from_pretrained(None, config=..., state_dict=...)` of random configs: the state dict in the checkpoint's
    layout or the model's own, a key dropped at random, the values on every rank or on rank 0 only (meta elsewhere)."""
    import torch
    import transformers
    from transformers import AutoConfig

    from tests.checkpoints import state_dict_of
    from tests.conftest import run_torchrun

    def concrete_class(path: str):  # transformers' Auto classes need a folder: the class --model-class maps it to
        return getattr(transformers, args.model_class)._model_mapping[type(AutoConfig.from_pretrained(path))]

    sources = random_checkpoints(args.workdir, random.Random(args.seed), args.cases, args.seed, families_for(args),
                                 args.model_class)
    cases = []
    for i in range(args.cases):
        name, src = rng.choice(sources)
        layout = rng.choice(["checkpoint", "model"])
        keys = sorted(state_dict_of(src, layout, concrete_class(src)))
        drop = [rng.choice(keys)] if rng.random() < 0.4 else []
        meta = list(range(1, args.world_size)) if rng.random() < 0.5 else []
        cases.append({"name": f"{name} {layout} layout, drop {drop}, meta on {meta}", "path": src,
                      "dtype": "float32", "seed": 7, "state_dict": {"layout": layout, "drop": drop,
                                                                    "meta_on_ranks": meta},
                      "model_class": args.model_class,
                      # keep_in_fp32: a float64 parameter (OneFormer's) as the plain load holds it
                      "kwargs": {"allow_suspicious_missing_keys": True, "keep_in_fp32": True},
                      "out": os.path.join(args.workdir, "out", f"state_dict_{args.seed}_{i}_w{args.world_size}.pt")})
    failures = []
    for case, dump in zip(cases, run_torchrun(args.world_size, cases, args.workdir, timeout=1500)):
        errors = [r["error"] for r in dump["ranks"] if "error" in r]
        config = AutoConfig.from_pretrained(case["path"])
        model_class = concrete_class(case["path"])
        state = state_dict_of(case["path"], case["state_dict"]["layout"], model_class)
        for key in case["state_dict"]["drop"]:
            del state[key]
        torch.manual_seed(7)
        try:
            model = model_class.from_pretrained(None, config=config, state_dict=state, dtype=torch.float32)
        except Exception as e:
            if not errors:
                failures.append(f"{case['name']}: loaded, while the plain load fails: {type(e).__name__}: {e}")
            continue
        if errors:
            failures.append(f"{case['name']}: {errors[0]['type']}: {errors[0]['message'][:200]}")
            continue
        got = dump["rank0"]["state"]
        if differ := differing(got, model):
            failures.append(f"{case['name']}: {len(differ)} tensors differ from the plain load, e.g. {differ[:3]}")
    return explain(failures, cases)


def run_nvme(args, rng) -> list[str]:
    """NVMe parameter offload (ZeRO-Infinity): random configs large enough for DeepSpeed to swap their partitions
    (it swaps only those of at least 1 MiB), read in waves of random `staging_bytes`, loaded in fp32 or bf16."""
    import torch
    import transformers as T

    from hf_zero3_loader.deepspeed_setup import async_io_buildable
    from tests.conftest import run_torchrun
    from tests.test_nvme_offload import nvme_config

    if not async_io_buildable():
        # not "0 failures": nothing was checked
        raise SystemExit("nvme: DeepSpeed's async_io op needs libaio (apt-get install libaio-dev); nothing run")
    families = ["qwen3_moe", "mixtral", "deepseek_v3", "llama"]
    if args.model_class != "AutoModelForCausalLM":  # a causal LM's checkpoint loaded into a new head or a bare body
        from tests.test_families import known_to

        if not (families := list(known_to(args.model_class, families))):
            raise SystemExit(f"nvme: none of its model types is known to {args.model_class}")
    cases = []
    for i in range(args.cases):
        family = rng.choice(families)
        experts = rng.choice([5, 8])
        common = dict(vocab_size=rng.choice([3001, 4096]), hidden_size=rng.choice([384, 520]), num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=rng.random() < 0.3, pad_token_id=0, eos_token_id=1, bos_token_id=None)
        if family == "qwen3_moe":
            config = T.Qwen3MoeConfig(**common, head_dim=64, intermediate_size=rng.choice([300, 512]),
                                      moe_intermediate_size=rng.choice([200, 257]), num_experts=experts,
                                      num_experts_per_tok=2)
        elif family == "mixtral":
            config = T.MixtralConfig(**common, intermediate_size=rng.choice([300, 257]), num_local_experts=experts,
                                     num_experts_per_tok=2)
        elif family == "deepseek_v3":
            config = T.DeepseekV3Config(**common, intermediate_size=300, moe_intermediate_size=rng.choice([200, 257]),
                                        n_routed_experts=experts, n_shared_experts=1, first_k_dense_replace=1,
                                        kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                        v_head_dim=16, n_group=1, topk_group=1, num_experts_per_tok=2)
        else:
            config = T.LlamaConfig(**common, intermediate_size=rng.choice([1000, 1377]))
        saved_as, dtype = rng.choice([torch.bfloat16, torch.float32]), rng.choice(["bfloat16", "float32"])
        drawn = hashlib.sha1(f"{config.to_json_string()} {saved_as}".encode()).hexdigest()[:8]
        path = _save_random(config, os.path.join(args.workdir, "nvme", f"{family}_{drawn}"), saved_as, i,
                            rng.choice(["10GB", "3MB"]))
        ds_config = nvme_config(dtype, os.path.join(args.workdir, "nvme_swap", f"{args.seed}_{i}"))
        # fits the largest partition here (at 1 rank: the largest tensor)
        ds_config["zero_optimization"]["offload_param"]["buffer_size"] = 1 << (21 if args.world_size > 1 else 22)
        cases.append({"name": f"{family}#{i} {dtype} from {str(saved_as)[6:]}", "path": path, "dtype": dtype,
                      "seed": 0, "ds_config": ds_config, "model_class": args.model_class,
                      # keep_in_fp32: the plain load's dtypes for `_keep_in_fp32_modules` (DeepSeek-V3's router
                      # from transformers 5.24), which stay on the host, outside the swapper's dtype
                      "kwargs": {"staging_bytes": rng.choice([1 << 20, 3 << 20, 64 << 20]), "keep_in_fp32": True},
                      "out": os.path.join(args.workdir, "out", f"nvme_{args.seed}_{i}_w{args.world_size}.pt")})
    failures = []
    for case, dump in zip(cases, run_torchrun(args.world_size, cases, args.workdir, timeout=1500)):
        errors = [r["error"] for r in dump["ranks"] if "error" in r]
        if errors:
            failures.append(f"{case['name']}: {errors[0]['type']}: {errors[0]['message'][:200]}")
            continue
        swapped = [r["report"].get("nvme", {}).get("partitions_swapped_out", 0) for r in dump["ranks"]]
        print(f"  {case['name']}: partitions swapped out per rank {swapped}")  # 0: all under its size floor
        torch.manual_seed(0)
        model = getattr(T, args.model_class).from_pretrained(case["path"], dtype=getattr(torch, case["dtype"]))
        got = dump["rank0"]["state"]
        if differ := differing(got, model):
            failures.append(f"{case['name']}: {len(differ)} tensors differ from the plain load, e.g. {differ[:3]}")
    return explain(failures, cases)


MODES = {"configs": run_configs, "missing": run_missing, "ep": run_ep, "headers": run_headers, "stream": run_stream,
         "state_dict": run_state_dict, "nvme": run_nvme, "save": run_save}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=sorted(MODES))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--cases", type=int, default=16)
    ap.add_argument("--families", type=lambda v: v.split(","), help="comma-separated model types (default: 24 "
                    "dense and MoE ones; any the family sweep builds; ep: any of its expert-parallel families)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="configs and missing: the engine's dtype, compared with the plain load in it")
    ap.add_argument("--stream", action="store_true",
                    help="ep: one rank per \"node\", only node 0 with the files (expert shares streamed)")
    ap.add_argument("--model-class", default="AutoModelForCausalLM",
                    help="configs, missing, ep, nvme, save, state_dict, stream: the auto class loaded (AutoModel, "
                    "AutoModelForSequenceClassification, ...)")
    ap.add_argument("--workdir", default=os.path.join(REPO, "out", "fuzz"))
    args = ap.parse_args()
    os.makedirs(os.path.join(args.workdir, "out"), exist_ok=True)
    import torch
    import transformers

    # the plain loads here run with the ranks' one thread (run_torchrun: OMP_NUM_THREADS=1): LAPACK-based inits
    # round by thread count (RWKV's missing head through `orthogonal_`'s QR: 1 ulp in fp16, 1e-7 in fp32)
    torch.set_num_threads(1)

    transformers.logging.set_verbosity_error()  # the plain loads' reports; failures are printed below
    failures = MODES[args.mode](args, random.Random(f"{args.mode}/{args.seed}"))
    print(f"{args.mode} seed {args.seed} at {args.world_size} ranks: {len(failures)} failure(s)")
    for f in failures:
        print(f"  {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
