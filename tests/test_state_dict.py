"""`from_pretrained(None, config=..., state_dict=...)` under ZeRO-3: every rank copies its own partitions' elements
from the state dict it holds, through the same plan as a checkpoint on disk.

At 3 ranks (sizes it does not divide), and at 1, 2 and 4: the gathered model equals, bit for bit and in dtype, the
plain single-process load of the same state dict, for a state dict in the checkpoint's layout (per-expert keys the
conversion merges) and in the model's own (`state_dict()`: merged experts, tied weights under both names), with a key
missing; with the values on rank 0 only (meta tensors on the others, as transformers' own ZeRO-3 path allows) the others
receive their partitions' bytes from rank 0. At 3 ranks: a task head's state dict (its new head included) loads as
the plain load does; with expert parallelism each rank holds the experts the folder gives it; every family of the
sweep (tests/families.py) loads from a state dict like the plain load; ranks that pass different values, meta
tensors only, or no state dict at all, and a weight passed as a list, fail with the same clear error on every rank.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.checkpoints import make_checkpoint, state_dict_of
from tests.conftest import run_torchrun
from tests import tiers
from tests.families import SWEEP, sweep_checkpoint
from tests.test_expert_parallel import checkpoint as ep_checkpoint
from tests.test_expert_parallel import ep_ds_config

CASES = {
    # name: (family, layout, dropped keys, meta on ranks)
    "moe_checkpoint_layout": ("qwen3_moe", "checkpoint", [], []),
    "moe_model_layout_missing_key": ("qwen3_moe", "model", ["model.layers.1.mlp.experts.down_proj"], []),
    "tied_model_layout": ("llama_tied", "model", [], []),
    # as transformers' own ZeRO-3 path allows: the values on rank 0 only, meta tensors elsewhere (streamed from rank 0)
    "values_on_rank_0_only": ("qwen3_moe", "checkpoint", [], [1, 2]),
}
# through a task head: the state dict of the head's plain load, whose new head (not in the checkpoint) was initialised
# (seeded, the same on every rank)
HEAD_CASES = {"new_head_model_layout": ("llama_tied", "model", "AutoModelForSequenceClassification")}
REFUSED = {
    # name: (state dict spec, load kwargs, every rank's error: type and what it says)
    "differs_on_rank_2": ({"differs_on_rank": 2}, {}, "CheckpointError",
                          "are not loading the same checkpoint: state_dict (values) differs"),
    "differs_on_rank_2_meta_on_rank_1": ({"differs_on_rank": 2, "meta_on_ranks": [1]}, {}, "CheckpointError",
                                         "are not loading the same checkpoint: state_dict (values) differs"),
    "meta_on_every_rank": ({"meta_on_ranks": [0, 1, 2]}, {}, "CheckpointError", "no rank holds the values"),
    "meta_on_rank_1_read": ({"meta_on_ranks": [1]}, {"load_from": "read"}, "CheckpointError",
                            "load_from='read', but ranks 1 cannot read the checkpoint (its state_dict holds meta "
                            "tensors)"),
    # a weight passed as a list (a plain load fails on it); other values that are not tensors are skipped
    "weight_is_a_list": ({"as_list": ["model.norm.weight"]}, {}, "CheckpointError",
                         "1 weights the model loads are not tensors in the checkpoint (a plain load fails on them "
                         "too):\n  model.norm.weight: a list in the state_dict"),
    "only_rank_0": ({"only_rank": 0}, {}, "ConfigError",
                    "were not called with the same arguments and DeepSpeed config: state_dict= given differs"),
}


@pytest.fixture(scope="module")
def paths(workdir):
    return {f: make_checkpoint(os.path.join(workdir, f), f) for f in ("qwen3_moe", "llama_tied")}


@pytest.fixture(scope="module")
def dumps(paths, workdir):
    cases = [{"name": name, "path": paths[family], "dtype": "float32", "seed": 7,
              "state_dict": {"layout": layout, "drop": drop, "meta_on_ranks": meta},
              "kwargs": {"output_loading_info": True}, "out": os.path.join(workdir, f"state_dict_{name}.pt")}
             for name, (family, layout, drop, meta) in CASES.items()]
    cases += [{"name": name, "path": paths["llama_tied"], "dtype": "float32",
               "state_dict": {"layout": "checkpoint", **spec}, "kwargs": kwargs,
               "out": os.path.join(workdir, f"state_dict_{name}.pt")} for name, (spec, kwargs, _, _) in REFUSED.items()]
    cases += [{"name": name, "path": paths[family], "dtype": "float32", "model_class": model_class,
               "state_dict": {"layout": layout}, "out": os.path.join(workdir, f"state_dict_{name}.pt")}
              for name, (family, layout, model_class) in HEAD_CASES.items()]
    ep = {"path": ep_checkpoint(workdir, "qwen3_moe"), "dtype": "bfloat16", "ds_config": ep_ds_config(3),
          "all_ranks_state": True}  # expert parallelism over the 3 ranks: from the folder, and from a state dict
    cases += [{**ep, "name": "ep_folder", "out": os.path.join(workdir, "state_dict_ep_folder.pt")},
              {**ep, "name": "ep_state_dict", "state_dict": {"layout": "checkpoint"},
               "out": os.path.join(workdir, "state_dict_ep.pt")}]
    return {c["name"]: d for c, d in zip(cases, run_torchrun(3, cases, workdir))}


@functools.lru_cache(maxsize=None)
def plain(path: str, layout: str, drop: tuple = (), auto_class: str = "AutoModelForCausalLM") -> tuple[dict, dict]:
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    model_class = getattr(transformers, auto_class)._model_mapping[type(config)]
    state = state_dict_of(path, layout, model_class)
    for key in drop:
        del state[key]
    torch.manual_seed(7)
    model, info = model_class.from_pretrained(None, config=config, state_dict=state, dtype=torch.float32,
                                              output_loading_info=True)
    tensors = {n: t.detach() for n, t in [*model.named_parameters(remove_duplicate=False),
                                          *model.named_buffers(remove_duplicate=False)]}
    return tensors, {k: sorted(map(str, v)) for k, v in info.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_a_state_dict_loads_equal_to_the_plain_load_of_it(dumps, paths, name):
    check_case(name, dumps[name], paths, CASES[name][3])


OTHER_WORLD_SIZES = (1, 2, 4)  # one torchrun job each: sizes that divide the tensors, and one rank alone
_other_dumps: dict = {}


@pytest.mark.parametrize("world_size", [w if w != 2 else pytest.param(w, marks=pytest.mark.sweep)
                                        for w in OTHER_WORLD_SIZES])  # 2 ranks: a sweep case
def test_a_state_dict_loads_equal_to_the_plain_load_at_other_world_sizes(paths, workdir, world_size):
    """The same cases at 1, 2 and 4 ranks; "values on rank 0 only" gives every other rank meta tensors."""
    meta_of = lambda meta: list(range(1, world_size)) if meta else []  # noqa: E731
    if world_size not in _other_dumps:
        cases = [{"name": name, "path": paths[family], "dtype": "float32", "seed": 7,
                  "state_dict": {"layout": layout, "drop": drop, "meta_on_ranks": meta_of(meta)},
                  "kwargs": {"output_loading_info": True},
                  "out": os.path.join(workdir, f"state_dict_w{world_size}_{name}.pt")}
                 for name, (family, layout, drop, meta) in CASES.items()]
        _other_dumps[world_size] = dict(zip(CASES, run_torchrun(world_size, cases, workdir)))
    for name, (_, _, _, meta) in CASES.items():
        check_case(name, _other_dumps[world_size][name], paths, meta_of(meta))


def check_case(name: str, dump: dict, paths: dict, meta: list[int]) -> None:
    """Rank 0's gathered model equals the plain load of the same state dict, bit for bit, in dtype, with the same
    loading info; each rank copied about its share, from its own state dict or, holding meta tensors, from rank 0's."""
    family, layout, drop, _ = CASES[name]
    got = dump["rank0"]
    assert "error" not in got, got.get("error", {}).get("traceback")
    want, info = plain(paths[family], layout, tuple(drop))
    assert set(got["state"]) == set(want)
    for key, expected in want.items():
        actual = got["state"][key]
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), f"{name} {key}"
    assert got["loading_info"] == info
    assert sorted(info["missing_keys"]) == sorted(drop)
    total = sum(t.numel() * t.element_size() for t in want.values())
    world_size = len(dump["ranks"])
    share = 1.0 if world_size == 1 else 0.6 if world_size == 2 else 0.5  # its share, and the buffers every rank holds
    for rank in dump["ranks"]:
        report = rank["report"]
        if rank["rank"] in meta:
            assert report["bytes_read"] == 0 and report["stream"]["receives_from"] == 0, report
            assert 0 < report["stream"]["bytes_received"] < share * total
        elif meta:  # rank 0 copied its own share and sent the others theirs
            assert report["stream"]["streams_to"] == meta and report["bytes_read"] <= total, report
        else:
            assert 0 < report["bytes_read"] <= share * total


@pytest.mark.parametrize("name", list(HEAD_CASES))
def test_a_task_heads_state_dict_loads_equal_to_the_plain_load_of_it(dumps, paths, name):
    family, layout, model_class = HEAD_CASES[name]
    got = dumps[name]["rank0"]
    assert "error" not in got, got.get("error", {}).get("traceback")
    want, _ = plain(paths[family], layout, (), model_class)
    assert set(got["state"]) == set(want) and any(k.startswith("score.") for k in want)
    for key, expected in want.items():
        assert got["state"][key].dtype == expected.dtype and torch.equal(got["state"][key], expected), key


@pytest.mark.parametrize("name", list(REFUSED))
def test_state_dicts_that_ranks_do_not_share_are_refused_on_every_rank(dumps, name):
    _, _, error_type, message = REFUSED[name]
    for rank in dumps[name]["ranks"]:
        assert "error" in rank, f"rank {rank['rank']} loaded"
        assert rank["error"]["type"] == error_type and message in rank["error"]["message"], rank["error"]


def test_a_state_dict_loads_with_expert_parallelism_as_the_folder_does(dumps):
    folder, state_dict = dumps["ep_folder"]["ranks"], dumps["ep_state_dict"]["ranks"]
    for a, b in zip(folder, state_dict):  # each rank's own experts, and the same report of them
        assert "error" not in b, b.get("error", {}).get("traceback")
        assert a["report"]["expert_parallel"] == b["report"]["expert_parallel"]
        assert set(a["state"]) == set(b["state"])
        for key, value in a["state"].items():
            assert value.dtype == b["state"][key].dtype and torch.equal(value, b["state"][key]), key


@pytest.mark.sweep(by_type=True)
def test_every_family_in_the_sweep_loads_from_a_state_dict_like_the_plain_load(workdir):
    """The family sweep's checkpoints at 3 ranks, every other family's state dict in the checkpoint's layout, the
    rest in the model's own (`state_dict()`)."""
    chosen = set(tiers.sliced(SWEEP))
    cases = [{"name": t, "path": sweep_checkpoint(workdir, t), "dtype": "float32",
              "state_dict": {"layout": ("checkpoint", "model")[i % 2]},
              "out": os.path.join(workdir, f"state_dict_sweep_{t}.pt")} for i, t in enumerate(SWEEP) if t in chosen]
    failures = []
    for case, dump in zip(cases, run_torchrun(3, cases, workdir, timeout=1500)):
        got = dump["rank0"]
        if "error" in got:
            failures.append(f"{case['name']}: {got['error']['type']}: {got['error']['message'][:200]}")
            continue
        want, _ = plain(case["path"], case["state_dict"]["layout"])
        differ = sorted(set(want) ^ set(got["state"])) or [
            n for n, w in want.items() if not (got["state"][n].dtype == w.dtype and torch.equal(got["state"][n], w))]
        if differ:
            failures.append(f"{case['name']} ({case['state_dict']['layout']} layout): differ {differ[:3]}")
    assert not failures, "\n".join(failures)
