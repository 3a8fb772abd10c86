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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(world_size: int, cases: list[dict], workdir: str, timeout: float = 540) -> list[dict]:
    """Run the cases in one real torchrun job of `world_size` processes; return rank 0's dumps, in order."""
    cases_file = os.path.join(workdir, f"cases_w{world_size}_{abs(hash(json.dumps(cases)))}.json")
    with open(cases_file, "w") as f:
        json.dump(cases, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(ROOT, "tests", "dist_worker.py"), cases_file]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [torch.load(c["out"], weights_only=False) for c in cases]


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hfz3"))
