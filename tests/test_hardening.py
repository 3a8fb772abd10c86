"""No silent mixes, no long waits: ranks prove they load the same checkpoint, a dead or stopped rank is noticed
within the liveness bound (a slow one is waited for), reads stop at the first failure or an interrupt, and the
awkward inputs (many shards under a low descriptor limit, legacy, strided and shared-storage `.bin`, no launcher) load.

Multi-rank cases run each rank as its own process (`run_ranks`), so each rank's own outcome is seen.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.checkpoints import make_checkpoint, rewrite_checkpoint
from tests.conftest import ROOT, python_path, run_nodes, run_ranks, run_torchrun

LIVENESS_S = 10  # the tests' liveness bound (default 30 s); detection must come within it plus a margin
MARGIN_S = 15


def _plain(path: str, dtype=torch.float32) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def _same_error_on(ranks: list, which: list[int]) -> dict:
    errors = [ranks[r]["error"] for r in which]
    assert len({(e["type"], e["message"]) for e in errors}) == 1, errors
    return errors[0]


# -- copies that differ ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def copies(workdir):
    base = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    d = os.path.join(workdir, "copies")
    other_values = make_checkpoint(os.path.join(d, "other_values"), "qwen3_moe", seed=1)
    other_split = make_checkpoint(os.path.join(workdir, "qwen3_moe_sharded"), "qwen3_moe", sharded=True)
    other_config = os.path.join(d, "other_config")
    if not os.path.exists(other_config):
        shutil.copytree(base, other_config)
        with open(os.path.join(other_config, "config.json")) as f:
            config = json.load(f)
        config["rms_norm_eps"] = 1e-5
        with open(os.path.join(other_config, "config.json"), "w") as f:
            json.dump(config, f)
    one_tensor = rewrite_checkpoint(base, os.path.join(d, "one_tensor"), lambda t: {
        **t, "model.norm.weight": t["model.norm.weight"] + 1})  # a small tensor the sampled blocks cover
    return {"base": base, "values": other_values, "split": other_split, "config": other_config,
            "one_tensor": one_tensor}


def test_ranks_with_different_copies_or_models_fail_alike_naming_what_differs(copies, workdir):
    """Different files, or the same files built into different models (a config argument, a model class, on one
    rank only: each rank would partition other parameters, and hang later in training) or resolved differently."""
    config = "the config (config.json with this call's config arguments) differs"
    expectations = {"values": "file model.safetensors differs (tensor 'lm_head.weight' holds other values",
                    "one_tensor": "file model.safetensors differs (tensor 'model.norm.weight' holds other values",
                    "split": "the list of files differs",
                    "config": config, "config_argument": config, "model_class": "the model class differs",
                    "key_mapping": "which checkpoint keys load into which tensors (key_mapping, transformers' "
                                   "conversions) differs"}
    swap_layers = {r"layers\.0\.": "layers.9.", r"layers\.1\.": "layers.0.", r"layers\.9\.": "layers.1."}
    by_rank = {"config_argument": {"kwargs_by_rank": {"1": {"num_hidden_layers": 1}}},
               "model_class": {"model_class_by_rank": {"1": "AutoModel"}},
               # each rank's partitions of layer 0 from another layer's keys: mixed weights, silently, before
               "key_mapping": {"kwargs_by_rank": {"1": {"key_mapping": swap_layers}}}}
    cases = [{"name": name, "path": copies["base"], "dtype": "float32",
              "out": os.path.join(workdir, f"copies_{name}.pt"),
              **(by_rank[name] if name in by_rank else {"path_by_rank": {"1": copies[name]}})} for name in expectations]
    for case, ranks in zip(cases, run_ranks(2, cases, workdir)):
        error = _same_error_on(ranks, [0, 1])
        assert error["type"] == "CheckpointError", error
        message = error["message"]
        assert "ranks 0 and 1 are not loading the same checkpoint" in message or \
            "ranks 1 and 0 are not loading the same checkpoint" in message, message
        assert expectations[case["name"]] in message, message
        assert error["seconds"] < 60


# -- copies that differ in a few values: exact digests ------------------------------------------------------------

def _flip_unsampled_byte(src: str, dst: str) -> str:
    """A copy of `src` with one byte changed in a small tensor no sampled block covers: one value a little off."""
    from hf_zero3_loader.checkpoint import open_checkpoint

    if not os.path.exists(dst):
        shutil.copytree(src, dst)
        path = os.path.join(dst, "model.safetensors")
        checkpoint = open_checkpoint([path])
        spans = checkpoint.fingerprints["model.safetensors"].sample_starts
        entry = min((e for e in checkpoint.entries.values() if not any(
            e.data_start < start + size and e.data_start + e.nbytes > start for start, size in spans)),
            key=lambda e: e.nbytes)
        with open(path, "r+b") as f:
            f.seek(entry.data_start)
            low = f.read(1)
            f.seek(entry.data_start)
            f.write(bytes([low[0] ^ 1]))  # the lowest mantissa bit of its first element
    return dst


def _hub_cache(root: str, folder: str) -> str:
    """`folder` laid out as the Hugging Face hub cache holds a download: `models--org--tiny/blobs/<digest>` (LFS files
    named by their sha256, others by their git blob id), `snapshots/<revision>/<name>` linking to them, `refs/main`.
    Returns the snapshot folder."""
    import hashlib

    repo, revision = os.path.join(root, "models--org--tiny"), "1" * 40
    snapshot = os.path.join(repo, "snapshots", revision)
    if os.path.exists(snapshot):
        return snapshot
    os.makedirs(os.path.join(repo, "blobs"))
    os.makedirs(snapshot)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(revision)
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        blob = (hashlib.sha256(data).hexdigest() if name.endswith(".safetensors")
                else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
        with open(os.path.join(repo, "blobs", blob), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
    return snapshot


@pytest.fixture(scope="module")
def exact(workdir):
    """Copies whose tensors differ in one value no sampled block reads, in hub caches, checked in full, or with the
    manifests `hf-zero3-loader digest` writes; and identical ones. One launch for every case."""
    from hf_zero3_loader.cli import main as cli

    base = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    d = os.path.join(workdir, "exact")
    copies = {name: (shutil.copytree(base, os.path.join(d, name)) if not os.path.exists(os.path.join(d, name))
                     else os.path.join(d, name)) for name in ("full", "digested", "cached")}
    off = {name: _flip_unsampled_byte(base, os.path.join(d, f"{name}_off")) for name in ("full", "digested", "hub")}
    for folder in (copies["digested"], off["digested"]):
        assert cli(["digest", folder]) == 0
    hub = {name: _hub_cache(os.path.join(d, f"cache_{name}"), folder)
           for name, folder in (("a", base), ("a_again", base), ("off", off["hub"]))}
    full = {"verify_checkpoint": "full"}
    cases = {  # name: (rank 0's folder, rank 1's, kwargs)
        "hub_differ": (hub["a"], hub["off"], {}), "hub_same": (hub["a"], hub["a_again"], {}),
        "full_differ": (copies["full"], off["full"], full), "manifest_differ": (copies["digested"], off["digested"], {}),
        "full_first": (copies["cached"], copies["cached"], full), "full_cached": (copies["cached"], copies["cached"], full),
    }
    runs = [{"name": name, "path": a, "path_by_rank": {"1": b}, "dtype": "float32", "kwargs": kwargs,
             "out": os.path.join(workdir, f"exact_{name}.pt")} for name, (a, b, kwargs) in cases.items()]
    cache = os.environ.get("HF_ZERO3_LOADER_CACHE")
    os.environ["HF_ZERO3_LOADER_CACHE"] = os.path.join(d, "digest_cache")  # the node's cache of digests, fresh
    try:
        outcomes = run_ranks(2, runs, workdir)
    finally:
        if cache is None:
            del os.environ["HF_ZERO3_LOADER_CACHE"]
        else:
            os.environ["HF_ZERO3_LOADER_CACHE"] = cache
    return {"cases": cases, "outs": {run["name"]: run["out"] for run in runs}, **dict(zip(cases, outcomes))}


def test_ranks_on_hub_cache_copies_that_differ_anywhere_fail_naming_the_file(exact):
    """The hub cache names each weight file by its sha256: ranks compare those, so copies that differ in one value
    the sampled blocks miss fail alike on every rank, naming the file; identical copies load as the plain load."""
    error = _same_error_on(exact["hub_differ"], [0, 1])
    assert error["type"] == "CheckpointError", error
    assert "are not loading the same checkpoint: file model.safetensors differs (sha256 " in error["message"], error
    assert "the copies differ in bytes the sampled check does not read" in error["message"], error
    ranks = exact["hub_same"]
    assert not any("error" in r for r in ranks), [r.get("error") for r in ranks]
    plain = _plain(exact["cases"]["hub_same"][0])
    state = torch.load(exact["outs"]["hub_same"], weights_only=False)["rank0"]["state"]
    for key, want in plain.items():
        assert torch.equal(state[key], want), key


def test_a_full_check_or_a_digest_manifest_finds_copies_that_differ_in_a_few_values(exact):
    """Copies that differ in one value no sampled block reads: with verify_checkpoint="full", or with the SHA256SUMS
    `hf-zero3-loader digest` wrote in each copy, every rank fails alike, naming the file."""
    for name in ("full_differ", "manifest_differ"):
        error = _same_error_on(exact[name], [0, 1])
        assert error["type"] == "CheckpointError", (name, error)
        assert "file model.safetensors differs (sha256 " in error["message"], (name, error)


def test_a_full_check_reads_each_copy_once_per_node_and_caches_its_digests(exact):
    """Two ranks on one node loading one folder with verify_checkpoint="full": the file is hashed once between them,
    and the next load reads nothing to check it (the node's cache, keyed by the file's identity)."""
    size = os.path.getsize(os.path.join(exact["cases"]["full_first"][0], "model.safetensors"))
    first, again = exact["full_first"], exact["full_cached"]
    for ranks in (first, again):
        assert not any("error" in r for r in ranks), [r.get("error") for r in ranks]
    assert sum(r["report"]["verify"]["hashed_bytes"] for r in first) == size, [r["report"]["verify"] for r in first]
    assert all(r["report"]["verify"] == {"hashed_bytes": 0, "cached_files": 1} for r in again), \
        [r["report"]["verify"] for r in again]
    plain = _plain(exact["cases"]["full_cached"][0])
    state = torch.load(exact["outs"]["full_cached"], weights_only=False)["rank0"]["state"]
    for key, want in plain.items():
        assert torch.equal(state[key], want), key


# An argument one rank passes alone either changes nothing (this rank's threads, buffers, timeouts, the kernels it
# computes with, what it reports) or fails the load alike on every rank: never a load that differs from the plain one.
ARGUMENTS_OF_ONE_RANK = {
    "read_threads": (1, "loads"), "staging_bytes": (4096, "loads"), "liveness_timeout_s": (20, "loads"),
    "agreement_timeout_s": (100, "loads"), "attn_implementation": ("eager", "loads"),
    "experts_implementation": ("eager", "loads"), "output_loading_info": (True, "loads"),
    "ignore_mismatched_sizes": (True, "loads"),  # nothing mismatched
    "dtype": ("bfloat16", "loads"),  # the engine's dtype wins, with a warning, as on transformers' path
    "strict_dtype": (True, None),  # it refuses that dtype: on this rank first, then on every rank
    "allow_suspicious_missing_keys": (True, "allow_suspicious_missing_keys differs"),
    "load_from": ("read", "load_from differs"),
    "verify_checkpoint": ("full", "verify_checkpoint differs"),  # a full check adds agreement points
}


def test_an_argument_one_rank_passes_alone_changes_nothing_or_fails_the_load_on_every_rank(workdir):
    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    cases = [{"name": name, "path": path, "dtype": "float32", "out": os.path.join(workdir, f"alone_{name}.pt"),
              "kwargs_by_rank": {"1": {name: value, **({"dtype": "bfloat16"} if name == "strict_dtype" else {})}}}
             for name, (value, _) in ARGUMENTS_OF_ONE_RANK.items()]
    plain = _plain(path)
    for case, ranks in zip(cases, run_ranks(2, cases, workdir)):
        name, (_, outcome) = case["name"], ARGUMENTS_OF_ONE_RANK[case["name"]]
        if outcome == "loads":
            assert not any("error" in r for r in ranks), (name, [r.get("error") for r in ranks])
            got = torch.load(case["out"], weights_only=False)["rank0"]["state"]  # the per-rank dumps hold no state
            assert got.keys() == plain.keys(), name
            for key, expected in plain.items():
                assert got[key].dtype == expected.dtype and torch.equal(got[key], expected), (name, key)
        else:
            error = _same_error_on(ranks, [0, 1])
            assert error["type"] == "ConfigError" and (outcome is None or outcome in error["message"]), (name, error)
            assert error["seconds"] < 60, (name, error)


# -- liveness ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def with_missing(workdir):
    """A checkpoint without the lm_head: finalize gathers it (a real collective) to initialise it."""
    from tests.checkpoints import rewrite_checkpoint

    base = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    return rewrite_checkpoint(base, os.path.join(workdir, "qwen_no_lm_head"),
                              lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})


# a process that ends is seen through its connection (the next test); the default tier checks a stopped one here
@pytest.mark.parametrize("kind", ["stop_in_read", *(pytest.param(k, marks=pytest.mark.sweep)
                                                    for k in ("die_in_read", "die_in_finalize", "stop_in_finalize"))])
def test_a_dead_or_stopped_rank_is_noticed_within_the_liveness_bound(with_missing, workdir, kind):
    case = {"name": kind, "path": with_missing, "dtype": "float32", "kwargs": {"liveness_timeout_s": LIVENESS_S},
            "inject": {"rank": 1, "kind": kind}, "out": os.path.join(workdir, f"live_{kind}.pt")}
    stopped = (1,) if kind.startswith("stop") else ()
    (ranks,) = run_ranks(2, [case], workdir, timeout=LIVENESS_S * 3 + 60, stopped=stopped)
    assert ranks[1] is None, "rank 1 died or was stopped before reporting"
    error = ranks[0]["error"]
    assert "DistributedLoadError" in error["mro"], error
    phase = "read checkpoint" if kind.endswith("read") else "missing-key init"
    # a process that ends closes its connection to rank 0: seen at once; a stopped one by its silence
    said = "rank 1's process is gone" if kind.startswith("die") else "rank 1 stopped answering"
    assert said in error["message"] and phase in error["message"], error["message"]
    # heartbeats stop; a collective in flight times out at the liveness bound (+5 s) and waits for the verdict
    assert error["seconds"] < LIVENESS_S * 2 + MARGIN_S, error


@pytest.mark.parametrize("killed,nproc", [(1, 1), *(pytest.param(*case, marks=pytest.mark.sweep)
                                                   for case in ((3, 2), (0, 1)))])
def test_a_killed_rank_is_reported_by_every_surviving_rank_under_two_launches(with_missing, workdir, killed, nproc):
    """A rank SIGKILLed mid-load, under two `torchrun --nnodes 2` launches (one per "node"). Its connection to rank 0
    (or, for rank 0, every rank's connection to it) closes with its process: every rank still running reports that
    process gone. The liveness bound is set far beyond the test's own timeout, so only the closed connection can
    have said so. (Its launcher takes the killed rank's node-mates down too; rank 0's node hosts the store, so a
    survivor may see that go first.)"""
    stamp = os.path.join(workdir, f"killed_{killed}_{nproc}.time")
    case = {"name": f"kill rank {killed}", "path": with_missing, "dtype": "float32",
            "kwargs": {"liveness_timeout_s": 3600}, "inject": {"rank": killed, "kind": "kill_in_read", "stamp": stamp},
            "out": os.path.join(workdir, f"killed_{killed}_{nproc}.pt")}
    (ranks,) = run_nodes(2, nproc, [case], workdir, per_rank=True, timeout=240)
    assert ranks[killed] is None
    survivors = [r for r in ranks if r is not None]
    assert survivors and all("error" in r for r in survivors), survivors
    with open(stamp) as f:
        killed_at = float(f.read())
    for r in survivors:
        error = r["error"]
        assert "DistributedLoadError" in error["mro"], error
        message = error["message"]
        # "rank 3's process is gone", or "the processes of ranks 2, 3 are gone" when its node-mate went with it
        said_gone = re.search(rf"(rank {killed}'s process|the processes of ranks [0-9, ]*\b{killed}\b[0-9, ]*) "
                              "(is|are) gone", message)
        assert said_gone or (killed == 0 and "store stopped answering" in message), message
        print(f"rank {r['rank']}: reported {error['at'] - killed_at:.2f}s after rank {killed} was killed: "
              f"{error['message']}")


@pytest.mark.sweep
def test_a_reader_that_stops_mid_stream_is_noticed_within_the_liveness_bound(workdir):
    """Rank 1, the only rank with the files, stopped (SIGSTOP) while it streams ranks 0 and 2 their partitions: both
    fail with the liveness verdict within the bound. Gloo's point-to-point receive ignores the process group's
    lowered timeout: before the streams were watched (`Agreement.run_watched`), the receivers waited out the group's
    30 minutes (by hand: no verdict in 150 s at a 5 s bound). (Rank 0 hosts the store here, so it cannot be the one
    stopped.)"""
    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    nowhere = os.path.join(workdir, "qwen3_moe_not_on_this_rank")
    case = {"name": "stop_in_stream", "path": path, "path_by_rank": {"0": nowhere, "2": nowhere}, "dtype": "float32",
            "kwargs": {"liveness_timeout_s": LIVENESS_S, "stream_chunk_bytes": 1024},
            "inject": {"rank": 1, "kind": "stop_in_stream"}, "out": os.path.join(workdir, "live_stop_in_stream.pt")}
    (ranks,) = run_ranks(3, [case], workdir, timeout=LIVENESS_S * 3 + 60, stopped=(1,))
    assert ranks[1] is None, "rank 1 was stopped before reporting"
    for r in (ranks[0], ranks[2]):
        error = r["error"]
        assert "DistributedLoadError" in error["mro"], error
        assert "rank 1 stopped answering" in error["message"] and "stream checkpoint bytes" in error["message"], error
        assert error["seconds"] < LIVENESS_S * 2 + MARGIN_S, error


@pytest.mark.sweep
def test_a_slow_but_live_rank_is_waited_for(workdir):
    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    slow = 2 * LIVENESS_S + 2
    case = {"name": "slow", "path": path, "dtype": "float32", "kwargs": {"liveness_timeout_s": LIVENESS_S},
            "inject": {"rank": 1, "kind": "slow_read", "seconds": slow}, "out": os.path.join(workdir, "live_slow.pt")}
    (ranks,) = run_ranks(2, [case], workdir, timeout=slow + 120)
    for r in ranks:
        assert "error" not in r, r.get("error")
        assert r["report"]["seconds"] >= slow - 1  # rank 0 waited for rank 1 at the agreement point
    # a wait longer than the liveness bound says where it is (a hang is then readable in the logs)
    notes = [w for w in ranks[0]["warnings"] if w.startswith("rank 0 has waited")]
    assert notes and "(1 of 2 are there)" in notes[0] and "not started" not in notes[0], ranks[0]["warnings"]


@pytest.mark.sweep
def test_a_rank_that_never_joins_is_named_while_waited_for_and_fails_the_load(workdir):
    """Rank 1 given a ZeRO-2 config loads without ZeRO-3 and never joins: rank 0 names it while it waits, and fails
    with the reason when the join timeout ends (a rank-0-only call looks the same)."""
    from tests.dist_worker import ds_config_for

    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    zero2 = {**ds_config_for("float32"), "zero_optimization": {"stage": 2}}
    case = {"name": "never_joins", "path": path, "dtype": "float32", "ds_config_by_rank": {"1": zero2},
            "kwargs": {"liveness_timeout_s": LIVENESS_S, "agreement_timeout_s": LIVENESS_S + 5},
            "out": os.path.join(workdir, "never_joins.pt")}
    (dump,) = run_torchrun(2, [case], workdir, timeout=240)
    error = dump["rank0"]["error"]
    assert "rank 1 did not start this load or save" in error["message"], error["message"]
    assert error["seconds"] < LIVENESS_S + 5 + MARGIN_S, error
    notes = [w for w in dump["rank0"]["warnings"] if w.startswith("rank 0 has waited")]
    assert notes and "not started this load yet: ranks 1 " in notes[0], dump["rank0"]["warnings"]


# -- reads stop at once --------------------------------------------------------------------------------------------

class _SlowReader:
    """A FileReader stand-in: each piece takes `seconds`; one piece may fail."""

    def __init__(self, seconds: float, fail_at: int | None = None):
        from hf_zero3_loader.reader import ReadStats

        self.stats, self.seconds, self.fail_at, self.calls = ReadStats(), seconds, fail_at, 0
        self.lock = threading.Lock()
        self.prefault = True

    def read_buffers(self, path, offset, buffers):
        with self.lock:
            self.calls += 1
            n = self.calls
        time.sleep(self.seconds)
        if n == self.fail_at:
            raise OSError("injected failure")


PIECE = 1 << 16  # elements: four 256 KiB pieces per 1 MiB staging slot


def _jobs(pieces: int):
    from hf_zero3_loader.checkpoint import TensorEntry
    from hf_zero3_loader.planner.plan import ReadItem

    dst = torch.empty(pieces * PIECE)
    entry = TensorEntry("t", "f", torch.float32, (pieces * 2 * PIECE,), 0)
    # gaps between the pieces on disk, so each stays a read of its own (adjacent ones would be coalesced into one)
    return [(ReadItem("f", "t", torch.float32, i * 2 * PIECE, 1, PIECE, PIECE, i * PIECE), entry, dst)
            for i in range(pieces)]


def _run(path: str, jobs, reader):
    """The in-place reads, or the staged ones (the accelerator path; 1 MiB: one slot that 4 threads take in turn)."""
    from hf_zero3_loader.reader import run_reads
    from hf_zero3_loader.staging import run_staged_reads

    if path == "staged":
        run_staged_reads(jobs, reader, staging_bytes=1 << 20, threads=4)
    else:
        run_reads(jobs, reader, threads=4)


def _reader_threads_end(before: set, seconds: float = 10.0) -> None:
    """Every thread the reads started ends: one left waiting (for a staging slot never given back, say) would hang
    the process at exit, when Python joins its pool threads."""
    deadline = time.monotonic() + seconds
    while (left := [t for t in threading.enumerate() if t not in before]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"threads still running: {left}"


@pytest.mark.parametrize("force_staging", [False, True])
def test_a_streaming_readers_own_read_stops_when_serving_fails(workdir, monkeypatch, force_staging):
    """A reader reads its own partitions in a thread while it serves the ranks without the files; when serving fails
    or is interrupted, that read is cancelled (its queued reads dropped), not run to its end before the error."""
    import glob

    from hf_zero3_loader.checkpoint import open_checkpoint
    from hf_zero3_loader.errors import LoaderError
    from hf_zero3_loader.planner.inspect import plan_ranks
    from hf_zero3_loader.report import LoadReport
    from hf_zero3_loader.zero3_load import Zero3Load

    if force_staging:
        monkeypatch.setenv("HF_ZERO3_LOADER_FORCE_STAGING", "1")
    path = make_checkpoint(os.path.join(workdir, "qwen3_moe_sharded"), "qwen3_moe", sharded=True)
    plan = plan_ranks(path, 1)[0]
    checkpoint = open_checkpoint(sorted(glob.glob(os.path.join(path, "*.safetensors"))))
    destinations = [(t, torch.empty(t.partition_numel, dtype=t.dtype)) for t in plan.tensors.values()
                    if t.status == "load"]
    loader = Zero3Load.__new__(Zero3Load)  # only what reading needs: a report, threads, a staging budget
    loader.report, loader.read_threads, loader.staging_bytes = LoadReport("zero3-meta", "test"), 1, 4096
    loader.partitioner = None  # no NVMe offload
    cancel = threading.Event()
    cancel.set()  # serving has failed
    with pytest.raises(LoaderError, match="cancelled: streaming failed"):
        loader._read_partitions(plan, checkpoint, destinations, cancel)
    assert 0 < loader.report.read.bytes_read < plan.bytes_to_read / 4, (loader.report.read.bytes_read,
                                                                        plan.bytes_to_read)


@pytest.mark.parametrize("path", ["in place", "staged"])
def test_a_failed_read_cancels_the_queued_reads(path):
    """A failed read stops the load at once, on either path: queued reads never start, and on the staged path the
    failing batch gives its slot back, so no thread waits for one forever."""
    reader, before = _SlowReader(0.05, fail_at=3), set(threading.enumerate())
    started = time.monotonic()
    with pytest.raises(OSError, match="injected failure"):
        _run(path, _jobs(200), reader)  # 200 pieces x 50 ms / 4 threads = 2.5 s if nothing stopped
    assert time.monotonic() - started < 1.0
    _reader_threads_end(before)
    assert reader.calls < 20, f"{reader.calls} reads ran after the failure"


@pytest.mark.parametrize("path", ["in place", "staged"])
def test_an_interrupt_cancels_the_queued_reads(path):
    import signal

    reader, before = _SlowReader(0.05), set(threading.enumerate())
    # a shell starts background jobs with SIGINT ignored, and Python then installs no Ctrl-C handler: install it
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # a real Ctrl-C, to any thread
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            _run(path, _jobs(200), reader)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < 1.5
    _reader_threads_end(before)
    assert reader.calls < 60, f"{reader.calls} reads ran after the interrupt"


# -- timeouts are validated -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -1, float("nan"), "30", True])
def test_invalid_timeouts_are_refused(value):
    from hf_zero3_loader.agreement import resolve_timeout
    from hf_zero3_loader.errors import ConfigError

    with pytest.raises(ConfigError, match="positive number of seconds"):
        resolve_timeout(value, "UNUSED_ENV", 30.0, "liveness_timeout_s")


def test_timeout_environment_is_parsed_at_use_with_a_clear_error():
    env = {**os.environ, "HF_ZERO3_LOADER_TIMEOUT": "abc", "PYTHONPATH": python_path()}
    code = ("import hf_zero3_loader\n"  # importing must not fail
            "from hf_zero3_loader.agreement import resolve_timeout, JOIN_ENV\n"
            "try:\n    resolve_timeout(None, JOIN_ENV, 300.0, 'agreement_timeout_s')\n"
            "except hf_zero3_loader.ConfigError as e:\n    print('ConfigError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ConfigError: HF_ZERO3_LOADER_TIMEOUT='abc' is not a number of seconds" in out.stdout
    from hf_zero3_loader.agreement import resolve_timeout

    assert resolve_timeout(float("inf"), "UNUSED_ENV", 30.0, "agreement_timeout_s") == float("inf")


# -- awkward inputs that must load --------------------------------------------------------------------------------------

def test_strided_copy_of_a_flat_range_matches_flatten():
    from hf_zero3_loader.reader import _copy_flat_range

    g = torch.Generator().manual_seed(0)
    for shape, perm in [((5, 7), (1, 0)), ((3, 4, 5), (2, 0, 1)), ((2, 3, 4, 5), (3, 1, 0, 2)), ((6,), (0,))]:
        src = torch.randn(shape, generator=g).permute(perm)
        flat = src.flatten()
        for start in range(0, flat.numel(), 3):
            for n in (1, 4, 11, flat.numel() - start):
                n = min(n, flat.numel() - start)
                out = torch.empty(n)
                _copy_flat_range(src, start, out)
                assert torch.equal(out, flat[start:start + n]), (shape, perm, start, n)


def _many_shards(workdir) -> str:
    """A checkpoint of over 200 shards, one per tensor, as one saved with a tiny max_shard_size is."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=24,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    base = make_checkpoint(os.path.join(workdir, "many_layers"), "many", config=config)
    path = os.path.join(workdir, "many_shards")
    if not os.path.exists(path):
        os.makedirs(path)
        shutil.copy(os.path.join(base, "config.json"), path)
        tensors = load_file(os.path.join(base, "model.safetensors"))
        weight_map = {}
        for i, (key, t) in enumerate(sorted(tensors.items())):
            name = f"model-{i + 1:05d}-of-{len(tensors):05d}.safetensors"
            save_file({key: t}, os.path.join(path, name), metadata={"format": "pt"})
            weight_map[key] = name
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def test_many_shards_under_a_low_descriptor_limit(workdir):
    """Over 200 shards under `ulimit -n 128`, read cold where this machine can evict them (so the headers are read
    several files at once, `checkpoint.read_headers`): every gathered parameter and buffer bit- and dtype-equal to
    the plain load."""
    path = _many_shards(workdir)
    shards = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(shards) > 200, len(shards)
    os.sync()  # clean pages only can be evicted
    for shard in shards:
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    case = {"name": "many", "path": path, "dtype": "float32", "max_open_files": 128,
            "out": os.path.join(workdir, "many_shards.pt")}
    (dump,) = run_torchrun(2, [case], workdir)
    got = dump["rank0"]
    assert "error" not in got, got.get("error", {}).get("traceback")
    plain = _plain(path)
    assert set(got["state"]) == set(plain)
    for name, want in plain.items():
        actual = got["state"][name]
        assert actual.dtype == want.dtype and torch.equal(actual, want), name


def test_headers_read_several_at_once_give_what_reading_in_turn_gives(workdir, monkeypatch, tmp_path):
    """From cold storage the headers of several files are read at once (`checkpoint.read_headers`): the same
    entries, identities and fingerprints as reading them in turn, and a damaged file fails the same way: the first
    damaged one in file order is named, whichever thread read it."""
    from hf_zero3_loader import checkpoint as ckpt
    from hf_zero3_loader.errors import CheckpointError

    folder = _many_shards(workdir)
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))

    def opened(threads: int, paths: list[str]):
        monkeypatch.setattr(ckpt, "HEADER_THREADS", threads)
        monkeypatch.setattr(ckpt, "_start_is_in_memory", lambda path: False)  # as from cold storage
        return ckpt.open_checkpoint(paths)

    in_turn, at_once = opened(1, files), opened(8, files)
    assert at_once.entries == in_turn.entries and list(at_once.entries) == list(in_turn.entries)
    assert at_once.identities == in_turn.identities and at_once.fingerprints == in_turn.fingerprints
    assert (at_once.header_bytes, at_once.sampled_bytes, at_once.metadata) == \
        (in_turn.header_bytes, in_turn.sampled_bytes, in_turn.metadata)

    damaged = [str(tmp_path / os.path.basename(f)) for f in files[:40]]
    for src, dst in zip(files, damaged):
        shutil.copy(src, dst)
    for i in (37, 11):  # a header length past the end of the file
        with open(damaged[i], "r+b") as f:
            f.write((1 << 40).to_bytes(8, "little"))
    messages = set()
    for threads in (1, 8):
        with pytest.raises(CheckpointError, match="corrupt safetensors header") as e:
            opened(threads, damaged)
        messages.add(str(e.value))
    assert len(messages) == 1 and os.path.basename(damaged[11]) in messages.pop()


def test_the_page_cache_probe_tells_a_file_in_memory_from_one_evicted(workdir):
    """Headers are read in turn when the checkpoint is in memory (threads would only add GIL handoffs) and several
    at once when it is not: the probe deciding it says in memory for a file just read and for one on tmpfs (which
    cannot answer `RWF_NOWAIT`), and not for one evicted (where this machine can evict it)."""
    from hf_zero3_loader.checkpoint import _start_is_in_memory

    folder = _many_shards(workdir)
    path = os.path.join(folder, sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0])
    with open(path, "rb") as f:
        f.read()
    if os.path.isdir("/dev/shm"):
        in_shm = os.path.join("/dev/shm", f"hf_zero3_loader_probe_{os.getpid()}")
        shutil.copy(path, in_shm)
        try:  # a timed read: one scheduling hiccup can exceed the bound, so the majority of a few decides
            assert sum(_start_is_in_memory(in_shm) for _ in range(5)) >= 3
        finally:
            os.unlink(in_shm)
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT here: only the timed read tells")
    assert _start_is_in_memory(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages only can be evicted
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _start_is_in_memory(path):
        pytest.skip("this machine kept the file in its page cache")


def test_legacy_strided_and_shared_storage_pickled_checkpoints_load_bit_exact(workdir):
    from safetensors.torch import load_file

    base = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    state = load_file(os.path.join(base, "model.safetensors"))
    folders = {}
    for name, legacy, strided in (("legacy", True, False), ("strided", False, True), ("shared", False, False)):
        folder = os.path.join(workdir, f"bin_{name}")
        if not os.path.exists(folder):
            os.makedirs(folder)
            for f in ("config.json", "generation_config.json"):
                shutil.copy(os.path.join(base, f), folder)
            tensors = {k: (v.t().contiguous().t() if strided and v.dim() == 2 else v) for k, v in state.items()}
            if strided:
                assert not all(t.is_contiguous() for t in tensors.values())
            if name == "shared":  # views into one storage at their own offsets, as torch.save keeps them
                assert len({t.dtype for t in tensors.values()}) == 1
                flat = torch.cat([t.reshape(-1) for t in tensors.values()])
                offsets = [0, *itertools.accumulate(t.numel() for t in tensors.values())]
                tensors = {k: flat[o:o + t.numel()].view(t.shape) for (k, t), o in zip(tensors.items(), offsets)}
            # with values that are not weights beside the tensors (skipped, as transformers skips them)
            torch.save({**tensors, "epoch": 3, "note": "not a weight"}, os.path.join(folder, "pytorch_model.bin"),
                       _use_new_zipfile_serialization=not legacy)
        folders[name] = folder
    cases = [{"name": n, "path": p, "dtype": "float32", "out": os.path.join(workdir, f"bin_{n}.pt")}
             for n, p in folders.items()]
    for case, dump in zip(cases, run_torchrun(2, cases, workdir)):
        got = dump["rank0"]
        assert "error" not in got, f"{case['name']}: {got.get('error', {}).get('traceback')}"
        plain = _plain(case["path"])
        for name, want in plain.items():
            assert got["state"][name].dtype == want.dtype and torch.equal(got["state"][name], want), name
        if case["name"] == "strided":  # read in place: no whole copy of any strided tensor
            largest = max(t.numel() for t in plain.values())
            assert all(r["largest_allocation_numel"] < largest for r in dump["ranks"])


def test_plain_python_without_a_launcher_loads_as_world_size_1(workdir):
    import re

    path = make_checkpoint(os.path.join(workdir, "llama_untied"), "llama_untied")
    out = os.path.join(workdir, "no_launcher.pt")
    code = f"""
import torch, deepspeed, hf_zero3_loader
from transformers import AutoModelForCausalLM
model = hf_zero3_loader.from_pretrained(AutoModelForCausalLM, {path!r},
                                        ds_config={{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": 3}}}})
state = {{}}
for name, p in model.named_parameters():
    with deepspeed.zero.GatheredParameters([p]):
        state[name] = p.detach().clone()
torch.save({{"state": state, "world": torch.distributed.get_world_size()}}, {out!r})
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**env, "PYTHONPATH": python_path()})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "loading as a single process (world size 1)" in proc.stderr
    # the load's line in plain words: "1 rank", what it built, what this rank read
    assert re.search(rf"loaded {re.escape(path)} on 1 rank in [\d.]+ s: ZeRO-3 partitions, this rank read [\d.]+ KiB",
                     proc.stderr), proc.stderr[-4000:]
    got = torch.load(out)
    assert got["world"] == 1
    for name, want in _plain(path).items():
        if name in got["state"]:
            assert torch.equal(got["state"][name], want), name
