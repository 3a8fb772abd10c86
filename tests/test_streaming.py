"""Ranks without the files: reader ranks stream each rank exactly its partition bytes, in bounded chunks.

Several "nodes" run on this machine: one `torchrun --nnodes N --node_rank K` launch per node, each with its own copy
of the checkpoint or none (`run_nodes`). Every gathered parameter and buffer must equal the plain single-process
load; the bounds are deterministic: receivers get exactly their share, stream buffers never exceed the chunk budget,
and the readers together read the checkpoint once.
"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

from tests.checkpoints import ep_config, make_checkpoint
from tests.conftest import run_nodes
from tests.dist_worker import ds_config_for

NOWHERE = "/nonexistent/checkpoint"  # a node without a copy
# family -> world sizes streamed in these tests (read by scripts/model_cards.py)
STREAMED = {"qwen3_moe": (2, 4), "llama": (2,), "mixtral": (3,)}
CHUNK = 4096  # smaller than most tensors here: every tensor crosses several chunks


def _plain(path: str, dtype=torch.float32, variant: str | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, variant=variant)
    return {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def _checkpoint_bytes(path: str) -> int:
    from hf_zero3_loader.checkpoint import open_checkpoint

    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith((".safetensors", ".bin")))
    return open_checkpoint(files).nbytes


def _check(case: dict, dump: dict, reference: str, dtype=torch.float32) -> None:
    ranks = dump["ranks"]
    for r in ranks:
        assert "error" not in r, f"{case['name']}: {r.get('error', {}).get('traceback')}"
    state = dump["rank0"]["state"]
    for name, want in _plain(reference, dtype, case["kwargs"].get("variant")).items():
        assert state[name].dtype == want.dtype and torch.equal(state[name], want), f"{case['name']} {name}"
    total = _checkpoint_bytes(reference)
    readers = [r for r in ranks if r["report"]["stream"]["reads_files"]]
    receivers = [r for r in ranks if not r["report"]["stream"]["reads_files"]]
    assert receivers, f"{case['name']}: nothing was streamed"
    # the readers together read the checkpoint exactly once (these models have no persistent buffers)
    assert sum(r["report"]["bytes_read"] for r in readers) == total, case["name"]
    for r in receivers:
        stream = r["report"]["stream"]
        assert r["report"]["bytes_read"] == 0
        # exactly its own share: the bytes its plan would have read from the files (fp32 here), in the load's dtype
        # where that is narrower (the reader casts: a bf16 load of an fp32 checkpoint receives half the bytes)
        assert stream["bytes_received"] == r["report"]["bytes_to_read"] * min(dtype.itemsize, 4) // 4, case["name"]
    sent = sum(r["report"]["stream"]["bytes_sent"] for r in ranks)
    assert sent == sum(r["report"]["stream"]["bytes_received"] for r in ranks)
    budget = case["kwargs"].get("stream_chunk_bytes", 64 << 20)
    for r in ranks:
        assert r["report"]["stream"]["largest_stream_buffer_bytes"] <= budget, case["name"]


@pytest.fixture(scope="module")
def ckpts(workdir):
    return {"qwen": make_checkpoint(os.path.join(workdir, "qwen3_moe_sharded"), "qwen3_moe", sharded=True),
            "llama": make_checkpoint(os.path.join(workdir, "llama_tied"), "llama_tied"),
            "mixtral": make_checkpoint(os.path.join(workdir, "mixtral"), "mixtral")}


def test_two_nodes_only_the_first_with_the_files(ckpts, workdir):
    cases = [{"name": f"w2/{name}/{dtype}", "path_by_node": {"0": ckpts[name], "1": NOWHERE}, "dtype": dtype,
              "kwargs": {"stream_chunk_bytes": CHUNK}, "out": os.path.join(workdir, f"stream_w2_{name}_{dtype}.pt")}
             for name, dtype in (("qwen", "float32"), ("llama", "bfloat16"))]
    for case, dump in zip(cases, run_nodes(2, 1, cases, workdir)):
        _check(case, dump, case["path_by_node"]["0"], getattr(torch, case["dtype"]))
        assert dump["ranks"][1]["report"]["stream"]["receives_from"] == 0


@pytest.mark.sweep
def test_a_variant_checkpoint_streams(ckpts, workdir):
    """`variant=`: the reader finds the files transformers picks for it (model.ema-0000k-of-0000n.safetensors and
    model.safetensors.index.ema.json), so the rank without them is streamed its share."""
    from transformers import AutoModelForCausalLM

    folder = os.path.join(workdir, "qwen3_moe_variant")
    if not os.path.isdir(folder):
        AutoModelForCausalLM.from_pretrained(ckpts["qwen"]).save_pretrained(folder, variant="ema", max_shard_size="20KB")
    case = {"name": "variant", "path_by_node": {"0": folder, "1": NOWHERE}, "dtype": "float32",
            "kwargs": {"stream_chunk_bytes": CHUNK, "variant": "ema"}, "out": os.path.join(workdir, "stream_variant.pt")}
    (dump,) = run_nodes(2, 1, [case], workdir)
    _check(case, dump, folder)
    assert dump["ranks"][1]["report"]["stream"]["receives_from"] == 0


def test_files_a_model_reads_beside_its_weights_reach_the_ranks_without_them(workdir):
    """Qwen2.5-Omni's from_pretrained reads its speakers (spk_dict.pt, a pickle) beside the weights: the reader hands
    it over with the config, so the rank without the files loads too (its stub folder lacked it: an OSError there)."""
    from tests.families import head_checkpoint
    from tests.test_families import load_failure

    path = head_checkpoint(workdir, "AutoModelForTextToWaveform", "qwen2_5_omni")
    case = {"name": "omni", "path_by_node": {"0": path, "1": NOWHERE}, "dtype": "float32", "seed": 0,
            "model_class": "AutoModelForTextToWaveform", "kwargs": {"stream_chunk_bytes": CHUNK},
            "out": os.path.join(workdir, "stream_omni.pt")}
    (dump,) = run_nodes(2, 1, [case], workdir)
    for r in dump["ranks"]:
        assert "error" not in r, r["error"]["message"]
    assert dump["ranks"][1]["report"]["stream"]["bytes_received"] > 0
    # every parameter and buffer (tied names too), bit and dtype, against the seeded plain load of the reader's copy
    assert load_failure({**case, "path": path}, dump, seed=0) is None


def test_a_reader_hands_over_small_files_but_no_other_weights(tmp_path):
    """The bundle for ranks without the files: config, index, code and small pickles that are not weights; never
    weight files of another format or variant, nor files over SMALL_FILE_BYTES."""
    from safetensors.torch import save_file

    from hf_zero3_loader.streaming import SMALL_FILE_BYTES, collect_small_files

    save_file({"w": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    for name in ("config.json", "modeling_custom.py", "spk_dict.pt", "pytorch_model.bin", "model.ema.safetensors",
                 "consolidated.00.pth", "model-00001-of-00002.bin", "big_table.pt"):
        (tmp_path / name).write_bytes(b"x")
    os.truncate(tmp_path / "big_table.pt", SMALL_FILE_BYTES + 1)
    bundle = collect_small_files(str(tmp_path), [str(tmp_path / "model.safetensors")])
    assert sorted(bundle["small"]) == ["config.json", "modeling_custom.py", "spk_dict.pt"]
    assert list(bundle["weights"]) == ["model.safetensors"]


@pytest.mark.sweep
def test_three_nodes_two_without_files_sizes_that_do_not_divide(ckpts, workdir):
    cases = [{"name": "w3", "path_by_node": {"0": ckpts["mixtral"], "1": NOWHERE, "2": NOWHERE},
              "dtype": "float16", "kwargs": {"stream_chunk_bytes": CHUNK}, "out": os.path.join(workdir, "stream_w3.pt")}]
    (dump,) = run_nodes(3, 1, cases, workdir)
    _check(cases[0], dump, ckpts["mixtral"], torch.float16)  # the fp32 checkpoint travels as fp16: half the bytes
    assert dump["ranks"][0]["report"]["stream"]["streams_to"] == [1, 2]


@pytest.mark.sweep
def test_four_ranks_mixed_and_one_reader_per_node(ckpts, workdir):
    """Mixed: node 0's two ranks read, node 1's two receive (one from each reader). Stream mode with a copy on each
    node: one reader per node, each serving its node, each node's copy read once between them."""
    copy = os.path.join(workdir, "qwen_copy_node1")
    if not os.path.exists(copy):
        shutil.copytree(ckpts["qwen"], copy)
    cases = [
        {"name": "mixed", "path_by_node": {"0": ckpts["qwen"], "1": NOWHERE}, "dtype": "float32",
         "kwargs": {"stream_chunk_bytes": CHUNK}, "out": os.path.join(workdir, "stream_w4_mixed.pt")},
        {"name": "one reader per node", "path_by_node": {"0": ckpts["qwen"], "1": copy}, "dtype": "float32",
         "kwargs": {"stream_chunk_bytes": CHUNK, "load_from": "stream"}, "out": os.path.join(workdir, "stream_w4_rpn.pt")},
    ]
    mixed, per_node = run_nodes(2, 2, cases, workdir)
    _check(cases[0], mixed, ckpts["qwen"])
    assert {r["rank"]: r["report"]["stream"].get("receives_from") for r in mixed["ranks"]} == {0: None, 1: None, 2: 0, 3: 1}
    _check(cases[1], per_node, ckpts["qwen"])
    assert {r["rank"]: r["report"]["stream"].get("receives_from") for r in per_node["ranks"]} == {0: None, 1: 0, 2: None, 3: 2}


def test_pickled_checkpoint_and_expert_parallel_stream(ckpts, workdir):
    from safetensors.torch import load_file

    folder = os.path.join(workdir, "qwen_bin")
    if not os.path.exists(folder):
        os.makedirs(folder)
        base = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
        for f in ("config.json", "generation_config.json"):
            shutil.copy(os.path.join(base, f), folder)
        torch.save(load_file(os.path.join(base, "model.safetensors")), os.path.join(folder, "pytorch_model.bin"))
    ep_path = make_checkpoint(os.path.join(workdir, "ep_qwen3_moe"), "qwen3_moe", config=ep_config("qwen3_moe"))
    ep_ds = ds_config_for("bfloat16", {"expert_parallel": {"enabled": True, "autoep_size": 2, "use_grouped_mm": False}})
    from tests.test_expert_parallel import REMOTE, expected, load_kwargs, plain_load
    from tests.test_expert_parallel import checkpoint as ep_checkpoint

    remote_path = ep_checkpoint(workdir, REMOTE)
    cases = [
        {"name": "bin", "path_by_node": {"0": folder, "1": NOWHERE}, "dtype": "float32",
         "kwargs": {"stream_chunk_bytes": CHUNK}, "out": os.path.join(workdir, "stream_bin.pt")},
        {"name": "ep", "path_by_node": {"0": ep_path, "1": NOWHERE}, "dtype": "bfloat16", "ds_config": ep_ds,
         "kwargs": {"stream_chunk_bytes": CHUNK}, "all_ranks_state": True, "out": os.path.join(workdir, "stream_ep.pt")},
        # the hub's own modeling code, one module per expert: the code travels with the small files
        {"name": "ep_remote", "path_by_node": {"0": remote_path, "1": NOWHERE}, "dtype": "bfloat16", "ds_config": ep_ds,
         "kwargs": {"stream_chunk_bytes": CHUNK, **load_kwargs(remote_path)}, "all_ranks_state": True,
         "out": os.path.join(workdir, "stream_ep_remote.pt")},
    ]
    binary, *eps = run_nodes(2, 2, cases, workdir)
    _check(cases[0], binary, folder)
    # expert parallelism: each receiving rank gets its own local experts' share, equal to the load that reads
    for path, ep in zip((ep_path, remote_path), eps):
        plain = plain_load(path, "bfloat16")
        for r in ep["ranks"]:
            assert "error" not in r, r.get("error", {}).get("traceback")
            for name, actual in r["state"].items():
                if not name.endswith(".tokens_per_expert"):
                    _, want = expected(name, plain, r["rank"] % 2, 2)
                    # DeepSeek-V3's router, which a plain load keeps in fp32: in the engine's dtype, as documented
                    assert torch.equal(actual, want.to(actual.dtype)), f"{path} {name} rank {r['rank']}"
            if r["rank"] >= 2:  # its plan's fp32 bytes, sent as the bf16 its partitions hold (DeepSeek-V3's
                # e_score_correction_bias, a buffer, stays fp32)
                received, planned = r["report"]["stream"]["bytes_received"], r["report"]["bytes_to_read"]
                assert received * 2 == planned if path == ep_path else planned / 2 < received < planned


@pytest.mark.sweep  # copies that differ between ranks: tests/test_hardening.py in the default tier
def test_nodes_whose_copies_differ_fail_clearly(ckpts, workdir):
    other = make_checkpoint(os.path.join(workdir, "copies", "other_values"), "qwen3_moe", seed=1)
    cases = [{"name": "differ", "path_by_node": {"0": make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe"),
                                                  "1": other},
              "dtype": "float32", "kwargs": {"load_from": "stream"}, "out": os.path.join(workdir, "stream_differ.pt")}]
    (dump,) = run_nodes(2, 2, cases, workdir)
    errors = [r["error"] for r in dump["ranks"]]
    assert len({e["message"] for e in errors}) == 1, errors
    assert "not loading the same checkpoint" in errors[0]["message"] and "differs" in errors[0]["message"]


def test_a_reader_that_fails_mid_stream_fails_every_rank_alike(ckpts, workdir):
    cases = [{"name": "reader fails", "path_by_node": {"0": ckpts["qwen"], "1": NOWHERE}, "dtype": "float32",
              "kwargs": {"stream_chunk_bytes": CHUNK}, "inject": {"rank": 0, "kind": "raise_in_read"},
              "out": os.path.join(workdir, "stream_reader_fails.pt")}]
    (dump,) = run_nodes(2, 1, cases, workdir)
    errors = [r["error"] for r in dump["ranks"]]
    assert len({(e["type"], e["message"]) for e in errors}) == 1, errors
    assert "OSError" in errors[0]["mro"] and "[rank 0] injected read failure" in errors[0]["message"]
    assert max(e["seconds"] for e in errors) < 60


def test_a_reader_that_dies_mid_stream_fails_its_receivers_within_the_liveness_bound(ckpts, workdir):
    cases = [{"name": "reader dies", "path_by_node": {"0": ckpts["qwen"], "1": NOWHERE}, "dtype": "float32",
              "kwargs": {"stream_chunk_bytes": CHUNK, "liveness_timeout_s": 10},
              "inject": {"rank": 1, "kind": "die_in_stream"}, "out": os.path.join(workdir, "stream_reader_dies.pt")}]
    # ranks 0, 1 on node 0 read; 2, 3 on node 1 receive, from 0 and 1: rank 1 dies while streaming to rank 3
    (ranks,) = run_nodes(2, 2, cases, workdir, per_rank=True)
    assert ranks[1] is None
    survivors = [r for r in ranks if r is not None]
    assert survivors and all("error" in r for r in survivors), survivors
    # torchrun takes rank 1's whole node down (rank 0 and the store it hosts with it): the same error on node 1
    assert len({(r["error"]["type"], r["error"]["message"]) for r in survivors}) == 1, survivors
    for r in survivors:
        error = r["error"]
        assert "DistributedLoadError" in error["mro"], error
        assert any(said in error["message"] for said in ("rank 1's process is gone", "rank 0's process is gone",
                                                         "processes of ranks", "store stopped answering")), error
        assert error["seconds"] < 45, error


def test_decide_who_reads_and_who_receives():
    from hf_zero3_loader.errors import CheckpointError
    from hf_zero3_loader.streaming import Peer, decide

    peers = [Peer(0, "a", True), Peer(1, "a", True), Peer(2, "b", False), Peer(3, "b", False), Peer(4, "a", False)]
    auto = decide(peers, "auto")
    assert auto.source_of == {2: 0, 3: 1, 4: 0}  # same node first (4 on a), then the least loaded
    stream = decide(peers, "stream")
    assert stream.source_of == {1: 0, 2: 0, 3: 0, 4: 0}  # one reader per node that has the files
    assert decide([Peer(0, "a", True), Peer(1, "b", True)], "auto").streaming is False
    with pytest.raises(CheckpointError, match="load_from='read', but ranks 2, 3, 4 cannot read"):
        decide(peers, "read")
    assert decide([Peer(0, "a", False, "gone"), Peer(1, "b", False, "gone")], "auto").streaming is False


def test_stream_chunks_cover_every_item_once_within_the_budget():
    from hf_zero3_loader.planner.inspect import plan_ranks
    from hf_zero3_loader.streaming import _largest_chunk, stream_bytes, stream_chunks

    from tests.checkpoints import make_checkpoint as make

    def plan_items(plan):
        return sum(len(t.reads) for t in plan.tensors.values() if t.status == "load")

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = make(os.path.join(d, "m"), "mixtral", sharded=True)
        for plan in plan_ranks(path, 3):
            for budget in (64, 1000, 4096, 1 << 20):
                covered = {}
                for _, chunks in stream_chunks(plan, budget):
                    for chunk in chunks:
                        assert chunk[-1].offset + chunk[-1].nbytes <= budget
                        for piece in chunk:
                            assert piece.offset % 8 == 0
                            key = (piece.tensor, piece.item)
                            covered[key] = covered.get(key, 0) + (piece.r1 - piece.r0) * (piece.c1 - piece.c0)
                expected = {(t.name, i): i.numel for t in plan.tensors.values() if t.status == "load" for i in t.reads}
                assert covered == expected
                assert sum(p.nbytes for _, chunks in stream_chunks(plan, budget) for c in chunks for p in c) == (
                    stream_bytes(plan))  # what the progress bars count
                # the buffers are sized to the largest chunk: a stream smaller than the budget needs no more
                stream = stream_chunks(plan, budget)
                largest = _largest_chunk(chunks for _, chunks in stream)
                assert largest == max(c[-1].offset + c[-1].nbytes for _, chunks in stream for c in chunks) <= budget
                if budget == 1000:  # loaded in bf16, the fp32 pieces travel as bf16: half the bytes, reads as before
                    narrow = copy.deepcopy(plan)
                    for t in narrow.tensors.values():
                        t.dtype = torch.bfloat16
                    pieces = [p for _, chunks in stream_chunks(narrow, budget) for c in chunks for p in c]
                    assert {p.dtype for p in pieces} == {torch.bfloat16}
                    assert stream_bytes(narrow) * 2 == stream_bytes(plan) == plan.bytes_to_read
                    assert [(p.item, p.r0, p.r1, p.c0, p.c1) for p in pieces] == [
                        (p.item, p.r0, p.r1, p.c0, p.c1) for _, chunks in stream_chunks(plan, budget) for c in chunks
                        for p in c]  # the same pieces (each read at most `budget` bytes), packed twice as densely
                    assert sum(len(c) for _, c in stream_chunks(narrow, budget)) < sum(
                        len(c) for _, c in stream_chunks(plan, budget))
                if budget == 1 << 20:  # every file's pieces fit one chunk: the buffer is one file's share, padded
                    shares = [sum(p.nbytes for c in chunks for p in c) for _, chunks in stream]
                    assert max(shares) <= largest < max(shares) + 8 * plan_items(plan) < budget


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "fp32 with fp8 experts"])
def test_chunks_a_reader_packs_place_what_a_reading_rank_reads(workdir, quantized):
    """In process, no wire: every chunk of each rank's stream packed as a reader packs it (pieces cast to the bf16
    partitions on the way, FP8 weights as their stored bytes) and placed as a receiver places it fills the partitions
    bit for bit as the rank's own reads would (`execute_read`), at 3 ranks and chunk budgets that cut every tensor."""
    from hf_zero3_loader.planner.inspect import plan_ranks
    from hf_zero3_loader.reader import FileReader, execute_read
    from hf_zero3_loader.streaming import STORED, Streamer, stream_chunks
    from tests.checkpoints import fp8_checkpoint
    from tests.test_quantized import _deepseek_v3_fp8_config

    path = make_checkpoint(os.path.join(workdir, "mixtral"), "mixtral")
    if quantized:  # fp32 norms, embeddings and router next to FP8 expert weights: both forms in one chunk
        fp32 = make_checkpoint(os.path.join(workdir, "deepseek_v3_fp32"), "d", config=_deepseek_v3_fp8_config())
        path = fp8_checkpoint(fp32, os.path.join(workdir, "deepseek_v3_fp32_fp8"))
    plans, _, checkpoint, _, _ = plan_ranks(path, 3, dtype=torch.bfloat16, with_model=True)
    reader = FileReader()
    forms = set()
    for plan in plans:
        loaded = [t for t in plan.tensors.values() if t.status == "load"]
        read = {t.name: torch.zeros(t.partition_numel, dtype=t.dtype) for t in loaded}
        for t in loaded:
            for item in t.reads:
                execute_read(reader, item, checkpoint.entry(item.key), read[t.name])
        for budget in (256, 4096):
            streamer = Streamer(budget, torch.device("cpu"))
            streamed = {t.name: torch.zeros(t.partition_numel, dtype=t.dtype) for t in loaded}
            buf = torch.empty(budget, dtype=torch.uint8)
            for _, chunks in stream_chunks(plan, budget):
                for chunk in chunks:
                    size, form, _ = streamer._pack(chunk, buf, checkpoint, reader)
                    forms.add(form)
                    streamer._place(chunk, buf[:size].clone(), form, checkpoint, streamed)
            for name, want in read.items():
                assert torch.equal(streamed[name].view(torch.uint8), want.view(torch.uint8)), (budget, name)
        assert sum(t.dtype == torch.bfloat16 for t in loaded) > len(loaded) // 2  # most are narrowed on the way
    assert (STORED in forms) == quantized
