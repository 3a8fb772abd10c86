"""Saving without a gather (`hf_zero3_loader.save_pretrained`): load, train a few optimizer steps, save from every
rank's partitions; then

- a plain single-process `from_pretrained` of the saved folder reports no missing or unexpected key and equals the
  gathered trained parameters bit for bit and dtype for dtype (under expert parallelism: each rank's local experts
  are the matching slices of transformers' fused experts);
- the folder's files equal, byte for byte, what transformers' own `save_pretrained` writes for the gathered model
  (same file names, keys, dtypes, shapes, shard assignment, index, config, generation config);
- each rank writes exactly its partitions' bytes, no collective runs, no buffer larger than the staging budget;
- a failure on any rank leaves no checkpoint that looks complete, and every rank raises the same error;
- ranks that cannot see the folder stream their bytes to a rank that can.

World sizes 1-4, dense and MoE, tied and untied, with and without expert parallelism, sizes that do and do not divide.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.checkpoints import ep_config, make_checkpoint
from tests.conftest import params_kept_in_fp32, run_nodes, run_ranks, run_torchrun
from tests.dist_worker import ds_config_for
from tests.test_expert_parallel import REMOTE, ep_ds_config, expected, load_kwargs
from tests.test_expert_parallel import checkpoint as ep_checkpoint

MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "minimax_m2")
STAGING = 4096  # a small staging budget, so the bound below means something

# world size -> [(family, ep_size or None, engine dtype, max_shard_size)]
SAVES = {
    1: [("llama_tied", None, "bfloat16", "10GB"), ("qwen3_moe", None, "float32", "20KB")],
    2: [("llama_untied", None, "bfloat16", "20KB"), ("mixtral", None, "bfloat16", "20KB"),
        ("qwen3_moe", 2, "bfloat16", "20KB"), ("minimax_m2", 2, "bfloat16", "20KB"),  # (no AutoEP preset: named)
        (REMOTE, 2, "bfloat16", "20KB")],  # the hub's own code, one module per expert
    3: [("llama_tied", None, "bfloat16", "20KB"), ("qwen3_moe", None, "bfloat16", "20KB"),
        ("qwen2_moe", 3, "float32", "10GB")],
    4: [("qwen3_moe", None, "bfloat16", "20KB"), ("deepseek_v3", 2, "bfloat16", "20KB")],
}


def source(workdir: str, family: str, ep: int | None) -> str:
    if family == REMOTE:
        return ep_checkpoint(workdir, REMOTE)
    if ep is not None or family == "deepseek_v3":
        return make_checkpoint(os.path.join(workdir, f"ep_{family}"), family, config=ep_config(family))
    return make_checkpoint(os.path.join(workdir, family), family)


def save_case(workdir: str, world_size: int, family: str, ep: int | None, dtype: str, shard: str, **extra) -> dict:
    name = f"w{world_size}_{family}_ep{ep}_{dtype}"
    folder = os.path.join(workdir, "saved", name)
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(folder + ".reference", ignore_errors=True)
    return {"name": name, "family": family, "ep_size": ep, "path": source(workdir, family, ep), "dtype": dtype,
            "ds_config": ep_ds_config(ep, dtype, family) if ep else ds_config_for(dtype), "train_steps": 2,
            "kwargs": {"experts_implementation": "eager"} if family in MOE else load_kwargs(source(workdir, family, ep)),
            "all_ranks_state": ep is not None, "out": os.path.join(workdir, f"save_{name}.pt"),
            "save": {"dir": folder, "reference": True,
                     "kwargs": {"max_shard_size": shard, "staging_bytes": STAGING, "write_threads": 1}}, **extra}


_dumps: dict = {}


def dumps(workdir: str, world_size: int) -> list[tuple[dict, dict]]:
    if world_size not in _dumps:
        cases = [save_case(workdir, world_size, *spec) for spec in SAVES[world_size]]
        _dumps[world_size] = list(zip(cases, run_torchrun(world_size, cases, workdir)))
    return _dumps[world_size]


def plain_load(folder: str):
    from transformers import AutoModelForCausalLM

    # a folder saved from remote code holds that code (`auto_map`), as transformers' own save copies it
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, trust_remote_code=True)
    return model, info


def same_files(a: str, b: str) -> None:
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b)), (names, sorted(os.listdir(b)))
    for name in names:
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), f"{name} differs between {a} and {b}"


# the default tier saves at 2 and 3 ranks (3 does not divide the tensors); 1 and 4 are sweep cases
SAVED_WORLD_SIZES = [w if w == 3 else pytest.param(w, marks=pytest.mark.sweep) for w in sorted(SAVES)]


@pytest.mark.parametrize("world_size", SAVED_WORLD_SIZES)
def test_saved_folder_loads_back_as_the_trained_model_and_equals_plain_save_pretrained(workdir, world_size):
    for case, dump in dumps(workdir, world_size):
        for r in dump["ranks"]:
            assert "error" not in r and "save_error" not in r, (case["name"], r.get("error") or r.get("save_error"))
        folder = case["save"]["dir"]
        model, info = plain_load(folder)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (case["name"], info)
        plain = {n: t.detach() for n, t in [*model.named_parameters(remove_duplicate=False),
                                             *model.named_buffers(remove_duplicate=False)]}
        if case["ep_size"] is None:
            trained = dump["rank0"]["trained_state"]
            assert set(trained) == set(plain), (case["name"], set(trained) ^ set(plain))
            for name, want in trained.items():
                got = plain[name]
                assert got.dtype == want.dtype and torch.equal(got, want), f"{case['name']}: {name}"
            same_files(folder, folder + ".reference")  # transformers' save_pretrained of the gathered model
        else:
            # a router the plain load keeps in fp32 (`_keep_in_fp32_modules_strict`: DeepSeek-V3's from transformers
            # 5.24) is trained and saved in the engine's dtype: compared, and saved for reference, in that dtype
            engine_dtype = getattr(torch, case["dtype"])
            kept = params_kept_in_fp32(model, engine_dtype)
            for r in dump["ranks"]:  # each rank gathered its own experts (over its expert-data-parallel group)
                ep_rank = r["rank"] % case["ep_size"]
                for name, actual in r["trained_state"].items():
                    if name.endswith(".tokens_per_expert"):
                        continue
                    sources, want = expected(name, plain, ep_rank, case["ep_size"])
                    want = want.to(engine_dtype) if set(sources) <= kept else want
                    assert actual.dtype == want.dtype and torch.equal(actual, want), f"{case['name']}: {name}"
            for name in kept:
                model.get_parameter(name).data = model.get_parameter(name).data.to(engine_dtype)
            reference = folder + ".reference"
            shutil.rmtree(reference, ignore_errors=True)
            model.save_pretrained(reference, max_shard_size=case["save"]["kwargs"]["max_shard_size"])
            same_files(folder, reference)


@pytest.mark.parametrize("world_size", SAVED_WORLD_SIZES)
def test_each_rank_writes_its_share_runs_no_collective_and_stays_in_the_staging_budget(workdir, world_size):
    from hf_zero3_loader.checkpoint import open_checkpoint

    for case, dump in dumps(workdir, world_size):
        folder = case["save"]["dir"]
        files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
        total = open_checkpoint(files).nbytes
        ranks = dump["ranks"]
        shares = [r["save"]["partition_bytes"] for r in ranks]
        for r in ranks:
            save = r["save"]
            assert save["bytes_written"] == save["partition_bytes"], (case["name"], save)
            assert r["save_collectives"]["calls"] == {}, (case["name"], r["save_collectives"])
            assert save["largest_staging_bytes"] <= STAGING, (case["name"], save)
            assert r["save_largest_allocation_bytes"] <= STAGING, (case["name"], r["save_largest_allocation_bytes"])
        # every parameter byte written once, by the rank holding it; persistent buffers once, by the writing rank
        assert sum(shares) == total, (case["name"], shares, total)
        # ZeRO-3 partitions are even, up to one element of padding per tensor per rank
        slack = 4 * world_size * len(open_checkpoint(files).entries) + _buffer_bytes(files, case)
        assert max(shares) - min(shares) <= slack, (
            case["name"], shares)


def _buffer_bytes(files, case) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_zero3_loader.checkpoint import open_checkpoint

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(os.path.dirname(files[0])))
    buffers = {n for n, _ in model.named_buffers()}
    entries = open_checkpoint(files).entries
    return sum(e.nbytes for k, e in entries.items() if k in buffers)


@pytest.mark.sweep
def test_a_failing_or_dead_rank_leaves_no_checkpoint_and_every_rank_raises_the_same_error(workdir):
    parent = os.path.join(workdir, "saved_faults")
    os.makedirs(parent, exist_ok=True)
    cases = []
    for kind in ("raise_in_write", "die_in_write"):
        case = save_case(workdir, 2, "qwen3_moe", None, "bfloat16", "20KB")
        case["save"] = {"dir": os.path.join(parent, kind), "kwargs": {"max_shard_size": "20KB",
                                                                     "liveness_timeout_s": 5}}
        case.update(name=kind, out=os.path.join(workdir, f"save_fault_{kind}.pt"),
                    save_inject={"rank": 1, "kind": kind, "after": 3})
        cases.append(case)
    raised, died = run_ranks(2, cases, workdir, timeout=300)
    messages = {r["save_error"]["message"] for r in raised}
    assert len(messages) == 1 and "No space left on device (injected)" in messages.pop(), raised
    assert all("OSError" in r["save_error"]["mro"] for r in raised), [r["save_error"] for r in raised]
    survivor = died[0]["save_error"]
    assert "DistributedLoadError" in survivor["mro"] and "rank 1" in survivor["message"], survivor
    assert died[1] is None or "save" not in died[1]
    for kind in ("raise_in_write", "die_in_write"):
        assert not os.path.exists(os.path.join(parent, kind))
    assert os.listdir(parent) == [], os.listdir(parent)  # no temporary folder left behind


def _temp_folders(parent: str) -> list[str]:
    """The save's temporary folders in `parent` and in the folders inside it."""
    found = [os.path.join(parent, n) for n in os.listdir(parent) if ".hf_zero3_tmp-" in n]
    for n in os.listdir(parent):
        if os.path.isdir(os.path.join(parent, n)):
            found += [os.path.join(parent, n, m) for m in os.listdir(os.path.join(parent, n)) if ".hf_zero3_tmp-" in m]
    return found


def _contents(folder: str) -> dict:
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def test_a_save_killed_on_either_rank_leaves_nothing_loadable_and_the_next_save_removes_what_it_left(workdir):
    """A save killed part-way: on the writing rank (rank 0, into an existing checkpoint folder), the folder stays the
    earlier checkpoint, byte for byte, and the temporary folder left beside it holds no file a loader looks for (its
    weights and index are `*.partial`): transformers' plain from_pretrained of it fails, saying there are no weights.
    The next save into the folder removes it. On another rank (into a new folder): no folder, nothing left. Killed
    while it moves the finished files into the existing folder (which other files share, so they are moved one by
    one): the folder then holds no checkpoint transformers loads (the old index went first, the new one comes last),
    never old and new shards under one index; the next save removes the temporary folder and publishes whole."""
    from transformers import AutoModelForCausalLM

    parent = os.path.join(workdir, "saved_killed")
    shutil.rmtree(parent, ignore_errors=True)
    os.makedirs(parent)
    existing, fresh = os.path.join(parent, "existing"), os.path.join(parent, "fresh")
    shutil.copytree(make_checkpoint(os.path.join(workdir, "qwen3_moe_sharded"), "qwen3_moe", sharded=True), existing)
    before = _contents(existing)

    def case(name: str, folder: str, dies: int | None = None) -> dict:
        c = save_case(workdir, 2, "qwen3_moe", None, "float32", "20KB", train_steps=0)
        c["save"] = {"dir": folder, "kwargs": {"max_shard_size": "20KB", "liveness_timeout_s": 5, "write_threads": 1}}
        c.update(name=name, out=os.path.join(workdir, f"save_killed_{name}.pt"))
        if dies is not None:
            c["save_inject"] = {"rank": dies, "kind": "die_in_write", "after": 3}
        return c

    (writer_died,) = run_ranks(2, [case("writer_dies", existing, dies=0)], workdir, timeout=300)
    assert writer_died[0] is None or "save" not in writer_died[0], writer_died[0]
    assert "DistributedLoadError" in writer_died[1]["save_error"]["mro"], writer_died[1]["save_error"]
    assert _contents(existing) == before  # the earlier checkpoint, untouched
    (left,) = _temp_folders(parent)
    assert os.path.dirname(left) == parent  # beside the folder, not inside it
    assert not [n for n in os.listdir(left) if n.endswith((".safetensors", ".json")) and n != "config.json"
                and n != "generation_config.json"], os.listdir(left)
    assert any(n.endswith(".safetensors.partial") for n in os.listdir(left)), os.listdir(left)
    with pytest.raises(OSError, match="no file named model.safetensors"):
        AutoModelForCausalLM.from_pretrained(left)

    mid_publish = case("writer_dies_publishing", existing)
    mid_publish["save_inject"] = {"rank": 0, "kind": "die_in_publish", "after": 2}
    (publish_died,) = run_ranks(2, [mid_publish], workdir, timeout=300)
    assert publish_died[0] is None or "save" not in publish_died[0], publish_died[0]
    assert "DistributedLoadError" in publish_died[1]["save_error"]["mro"], publish_died[1]["save_error"]
    assert sum(n.endswith(".safetensors") for n in os.listdir(existing)) >= 2  # shards moved in, or left
    with pytest.raises(OSError, match="no file named model.safetensors"):
        AutoModelForCausalLM.from_pretrained(existing)
    (left_publishing,) = _temp_folders(parent)  # the first killed save's was removed by this one
    assert left_publishing != left and not os.path.exists(left)

    again, other_died = run_ranks(2, [case("next_save", existing), case("other_dies", fresh, dies=1)], workdir,
                                  timeout=300)
    assert all("save_error" not in r for r in again), [r.get("save_error") for r in again]
    assert not os.path.exists(left_publishing)
    model, info = plain_load(existing)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state = torch.load(os.path.join(workdir, "save_killed_next_save.pt"), weights_only=False)["rank0"]["state"]
    plain = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    for name, want in state.items():
        assert torch.equal(plain[name], want), name
    survivor = other_died[0]["save_error"]
    assert "DistributedLoadError" in survivor["mro"] and "rank 1" in survivor["message"], survivor
    assert not os.path.exists(fresh)
    assert _temp_folders(parent) == [], _temp_folders(parent)


def test_save_arguments_refused_or_unlike_across_ranks_fail_alike_and_publish_nothing(workdir):
    """Refused arguments, and arguments that shape the files or the streams given on one rank only. A rank asking
    for another write mode once left its partitions unwritten in the folder the writer published (zeros, no error
    there; the other rank timed out); the arguments now agree first."""
    parent = os.path.join(workdir, "saved_unlike")
    shutil.rmtree(parent, ignore_errors=True)
    os.makedirs(parent)
    unlike = "did not call save_pretrained alike: "
    expected = {  # name: (arguments of every rank, of rank 1 only, what the error says)
        "write_mode": ({}, {"write_mode": "stream"}, unlike + "write_mode differs ("),
        "max_shard_size": ({}, {"max_shard_size": "20KB"}, unlike + "the planned files (from the model, "
                           "max_shard_size, variant, file_layout, save_original_format) differs"),
        "safe_serialization": ({"safe_serialization": False}, {}, "writes safetensors only"),
        "push_to_hub": ({"push_to_hub": True}, {}, "push_to_hub is not supported"),
        "state_dict": ({"state_dict": {}}, {}, "a `state_dict` would have to be gathered first"),
    }
    cases = []
    for name, (every, alone, _) in expected.items():
        case = save_case(workdir, 2, "llama_untied", None, "float32", "50GB", train_steps=0)
        case["save"] = {"dir": os.path.join(parent, name), "kwargs": every, "kwargs_by_rank": {"1": alone}}
        case.update(name=name, out=os.path.join(workdir, f"save_unlike_{name}.pt"))
        cases.append(case)
    for case, ranks in zip(cases, run_ranks(2, cases, workdir, timeout=300)):
        errors = [r["save_error"] for r in ranks]
        assert len({(e["type"], e["message"]) for e in errors}) == 1, errors
        assert "ConfigError" in errors[0]["mro"], errors[0]
        assert expected[case["name"]][2] in errors[0]["message"], errors[0]["message"]
        if case["name"] == "write_mode":  # the first rank to arrive is the reference: either order
            assert "auto on rank 0" in errors[0]["message"] and "stream on rank 1" in errors[0]["message"]
    assert os.listdir(parent) == [], os.listdir(parent)


def test_saving_into_a_folder_with_other_files_replaces_the_checkpoint_and_keeps_the_rest(workdir):
    """Into a folder holding an earlier save and other files: the earlier save's weights go, whichever form they had
    (an earlier single file left beside new shards is what transformers and this loader would load: transformers'
    own save_pretrained leaves it, and the index of earlier shards beside a new single file); the rest stays."""
    cases, kept = [], {"tokenizer.json", "checkpoint-10"}
    for shard, earlier in (("20KB", ["model-00001-of-00009.safetensors", "model-00009-of-00009.safetensors",
                                     "model.safetensors.index.json", "model.safetensors"]),
                           ("50GB", ["model-00001-of-00002.safetensors", "model.safetensors.index.json"])):
        case = save_case(workdir, 2, "llama_untied", None, "bfloat16", shard)
        folder = case["save"]["dir"] = os.path.join(workdir, f"saved_existing_{shard}")
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(folder + ".reference", ignore_errors=True)
        os.makedirs(os.path.join(folder, "checkpoint-10"))
        for name in [*earlier, "tokenizer.json", "checkpoint-10/optimizer.pt"]:
            with open(os.path.join(folder, name), "w") as f:
                f.write("old")
        case.update(name=f"existing_{shard}", out=os.path.join(workdir, f"save_existing_{shard}.pt"))
        cases.append(case)
    for case, dump in zip(cases, run_torchrun(2, cases, workdir)):
        assert "save_error" not in dump["rank0"], dump["rank0"].get("save_error")
        folder = case["save"]["dir"]
        assert kept <= set(os.listdir(folder)), os.listdir(folder)
        for name in kept:
            shutil.move(os.path.join(folder, name), os.path.join(workdir, f"kept_{case['name']}_{name}"))
        same_files(folder, folder + ".reference")  # transformers' save into a new folder: no earlier file left


def test_ranks_that_cannot_see_the_folder_stream_their_partitions_to_a_rank_that_can(workdir):
    """Two nodes of two ranks. `write_mode='stream'`: one writer per node, the other rank of each node streams to it.
    `auto` with node 1's ranks unable to see the folder (another node's filesystem): they stream to node 0's ranks.
    Both folders equal transformers' save_pretrained of the gathered model."""
    cases = []
    for mode, inject in (("stream", None), ("auto", {"rank": [2, 3], "kind": "cannot_see_folder"})):
        case = save_case(workdir, 4, "qwen3_moe", None, "bfloat16", "20KB")
        case["save"]["dir"] = os.path.join(workdir, "saved", f"streamed_{mode}")
        case["save"]["kwargs"].update(write_mode=mode, stream_chunk_bytes=4096)
        case.update(name=mode, out=os.path.join(workdir, f"save_stream_{mode}.pt"), train_steps=1)
        if inject:
            case["save_inject"] = inject
        shutil.rmtree(case["save"]["dir"], ignore_errors=True)
        shutil.rmtree(case["save"]["dir"] + ".reference", ignore_errors=True)
        cases.append(case)
    for case, dump in zip(cases, run_nodes(2, 2, cases, workdir)):
        ranks = dump["ranks"]
        for r in ranks:
            assert "save_error" not in r, (case["name"], r.get("save_error"))
        same_files(case["save"]["dir"], case["save"]["dir"] + ".reference")
        streams = [r["save"]["stream"] for r in ranks]
        senders = [r for r, s in zip(ranks, streams) if "streams_to" in s]
        assert {r["rank"] for r in senders} == ({1, 3} if case["name"] == "stream" else {2, 3}), streams
        for r in senders:  # a sender writes nothing itself and sends exactly its partitions, in bounded chunks
            stream = r["save"]["stream"]
            assert r["save"]["bytes_written"] == 0 and stream["bytes_sent"] == r["save"]["partition_bytes"]
            assert stream["largest_stream_buffer_bytes"] <= 4096
            sent = sum(v for k, v in r["save_collectives"]["bytes"].items() if k in ("send", "isend"))
            assert sent <= 2 * stream["bytes_sent"] + 64 * r["save_collectives"]["calls"].get("isend", 0)
        received = sum(s["bytes_received"] for s in streams)
        assert received == sum(r["save"]["partition_bytes"] for r in senders)
        assert sum(r["save"]["bytes_written"] for r in ranks) == sum(r["save"]["partition_bytes"] for r in ranks)


def test_a_model_saved_right_after_resize_token_embeddings_writes_what_plain_save_pretrained_writes(workdir):
    """transformers' ZeRO-3-aware `resize_token_embeddings` builds the new embedding outside zero.Init: it stays whole
    on every rank until `deepspeed.initialize` partitions it. A save before then (the extended tokenizer's model,
    saved before training) writes it once, from the writer rank, beside everyone's partitions: byte for byte the
    files of a plain save_pretrained, loading back to the same values (tied and untied, dense and MoE)."""
    from tests.test_families import save_failure

    cases = []
    for family, size in (("llama_tied", 120), ("qwen3_moe", 111)):
        folder = os.path.join(workdir, "saved", f"resized_{family}")
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(folder + ".reference", ignore_errors=True)
        cases.append({"name": f"resized_{family}", "path": source(workdir, family, None), "dtype": "float32",
                      "resize_to": size, "seed": 1, "out": os.path.join(workdir, f"save_resized_{family}.pt"),
                      "save": {"dir": folder, "reference": True, "kwargs": {"max_shard_size": "20KB"}}})
    for case, dump in zip(cases, run_torchrun(3, cases, workdir)):
        assert save_failure(case, dump) is None, save_failure(case, dump)
        assert dump["rank0"]["config"]["vocab_size"] == case["resize_to"]


def test_the_models_own_save_pretrained_writes_the_partitions_under_the_auto_import(workdir):
    """`model.save_pretrained(folder)` on every rank of a ZeRO-3 model: transformers alone writes each partitioned
    parameter as an empty tensor (dense: a checkpoint of `(0,)`-shaped weights, silently) or fails reverting MoE
    conversions. With `import hf_zero3_loader.auto` it is this library's save: the files of a plain save_pretrained of
    the gathered model, byte for byte, with its keywords (`max_shard_size`, `is_main_process`)."""
    from tests.test_families import save_failure

    cases = []
    for family in ("llama_tied", "qwen3_moe"):
        folder = os.path.join(workdir, "saved", f"direct_{family}")
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(folder + ".reference", ignore_errors=True)
        cases.append({"name": f"direct_{family}", "path": source(workdir, family, None), "dtype": "float32",
                      "out": os.path.join(workdir, f"save_direct_{family}.pt"),
                      "save": {"dir": folder, "reference": True, "direct": True,
                               "kwargs": {"max_shard_size": "20KB", "is_main_process": True, "token": None}}})
    for case, dump in zip(cases, run_torchrun(3, cases, workdir)):
        assert save_failure(case, dump) is None, save_failure(case, dump)
        assert len([f for f in os.listdir(case["save"]["dir"]) if f.endswith(".safetensors")]) > 1  # sharded
