"""Shared fixtures: small real checkpoints and real multi-process (torchrun) runs of tests/dist_worker.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# The ranks run with one thread (OMP_NUM_THREADS=1 below), so every in-process plain load a test compares with does
# too: LAPACK-based inits (`orthogonal_`'s QR, for a missing tensor) round differently by thread count
torch.set_num_threads(1)


def params_kept_in_fp32(model, dtype: torch.dtype) -> frozenset:
    """The parameters a plain load in `dtype` kept in fp32 anyway (`_keep_in_fp32_modules[_strict]`, e.g. DeepSeek-V3's
    router from transformers 5.24): found from the loaded model itself, not from the class attributes."""
    return frozenset(n for n, p in model.named_parameters() if p.dtype == torch.float32 and dtype != torch.float32)


def python_path() -> str:
    """The repo first, then whatever PYTHONPATH the suite runs with (e.g. packages carried to a GPU machine)."""
    return os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(world_size: int, cases: list[dict], workdir: str, timeout: float = 540, env: dict | None = None) -> list[dict]:
    """Run the cases in one real torchrun job of `world_size` processes; return rank 0's dumps, in order."""
    cases_file = os.path.join(workdir, f"cases_w{world_size}_{abs(hash(json.dumps(cases)))}.json")
    with open(cases_file, "w") as f:
        json.dump(cases, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(ROOT, "tests", "dist_worker.py"), cases_file]
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [torch.load(c["out"], weights_only=False) for c in cases]


def run_nodes(nodes: int, nproc_per_node: int, cases: list[dict], workdir: str, timeout: float = 300,
              per_rank: bool = False) -> list:
    """Several "nodes" on this machine: one `torchrun --nnodes N --node_rank K` launch per node (each its own agent,
    GROUP_RANK and, through a case's `path_by_node`, its own checkpoint copy or none). Returns rank 0's dumps; with
    `per_rank`, every rank's own dump of each case (None for a rank that died), whatever the launches returned."""
    if per_rank:
        cases = [{**c, "per_rank_out": True} for c in cases]
    cases_file = os.path.join(workdir, f"nodes{nodes}x{nproc_per_node}_{abs(hash(json.dumps(cases)))}.json")
    with open(cases_file, "w") as f:
        json.dump(cases, f)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(node),
         "--nproc_per_node", str(nproc_per_node), "--master_addr", "127.0.0.1", "--master_port", str(port),
         os.path.join(ROOT, "tests", "dist_worker.py"), cases_file],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in range(nodes)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0])
    if per_rank:
        world = nodes * nproc_per_node
        return [[torch.load(f"{c['out']}.rank{r}", weights_only=False) if os.path.exists(f"{c['out']}.rank{r}")
                 else None for r in range(world)] for c in cases]
    if any(p.returncode for p in procs):
        raise AssertionError("node launches failed: " + " | ".join(
            f"node {i} rc={p.returncode}: {out[-4000:]}" for i, (p, out) in enumerate(zip(procs, outputs))))
    return [torch.load(c["out"], weights_only=False) for c in cases]


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hfz3"))


def run_ranks(world_size: int, cases: list[dict], workdir: str, timeout: float = 240,
              stopped: tuple[int, ...] = ()) -> list[dict]:
    """Start each rank as its own process (the env torchrun would set) and return every rank's dump of each
    case; unlike torchrun, one rank dying does not take the others down, so their own errors are seen.
    Ranks in `stopped` are expected to stop themselves (SIGSTOP): they are killed once the others are done."""
    import time

    cases = [{**c, "per_rank_out": True} for c in cases]
    cases_file = os.path.join(workdir, f"ranks_w{world_size}_{abs(hash(json.dumps(cases)))}.json")
    with open(cases_file, "w") as f:
        json.dump(cases, f)
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "dist_worker.py"), cases_file],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    hung = []
    last = cases[-1]["out"]
    for rank, p in enumerate(procs):
        if rank in stopped:
            continue
        # done when it exits, or (a peer stopped) once it wrote its outcome: its teardown then waits on the peer
        while p.poll() is None and time.monotonic() < deadline:
            if stopped and os.path.exists(f"{last}.rank{rank}"):
                break
            time.sleep(0.2)
        if p.poll() is None and not (stopped and os.path.exists(f"{last}.rank{rank}")):
            hung.append(p.pid)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    assert not hung, f"processes still running after {timeout}s: {hung}"
    out = []
    for c in cases:
        ranks = []
        for rank in range(world_size):
            path = f"{c['out']}.rank{rank}"
            ranks.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        out.append(ranks)
    return out
