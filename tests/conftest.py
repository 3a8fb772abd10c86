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


def pytest_addoption(parser):
    group = parser.getgroup("hf_zero3_loader tiers (docs/testing.md)")
    group.addoption("--tier", choices=("default", "sweep", "all"), default="default",
                    help="default: every capability once (scripts/dev.sh test); sweep: the exhaustive sweeps "
                         "(scripts/dev.sh sweep); all: both")
    group.addoption("--slice", default=None, metavar="K/N",
                    help="with --tier sweep: run the deterministic K-th of N slices of the sweep")


def pytest_configure(config):
    from tests import tiers

    config.addinivalue_line("markers", "sweep(by_type=False): the sweep tier; by_type: the test checks the model "
                                       "types of the slice (tests/tiers.py `sliced`) and runs in every slice")
    which = tiers.parse_slice(config.getoption("--slice"))
    if which is not None:
        if config.getoption("--tier") == "default":
            raise pytest.UsageError("--slice K/N slices the sweep: give it with --tier sweep")
        os.environ[tiers.SLICE_ENV] = f"{which[0]}/{which[1]}"
    else:
        os.environ.pop(tiers.SLICE_ENV, None)


def pytest_collection_modifyitems(config, items):
    from tests import tiers

    tier = config.getoption("--tier")
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("sweep")
        if tier == "default" and marker is not None or tier == "sweep" and marker is None:
            drop.append(item)
        elif marker is not None and not marker.kwargs.get("by_type") and not tiers.in_slice(item.nodeid):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter, config):
    """The sweep's summary, a line per section (a test function, all its parameters): outcomes, time, types."""
    from tests import tiers

    if config.getoption("--tier") == "default":
        return
    sections: dict = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if not hasattr(report, "nodeid") or (report.when != "call" and outcome == "passed"):
                continue
            row = sections.setdefault(report.nodeid.split("[")[0], {"passed": 0, "failed": 0, "skipped": 0,
                                                                     "error": 0, "seconds": 0.0})
            row[outcome] += 1
            row["seconds"] += getattr(report, "duration", 0.0)
    which = os.environ.get(tiers.SLICE_ENV)
    terminalreporter.section(f"sweep summary ({'slice ' + which if which else 'whole sweep'})")
    for name, row in sorted(sections.items()):
        types = tiers.checked.get(name)
        terminalreporter.write_line(
            f"{name}: {row['passed']} passed, {row['failed'] + row['error']} failed, {row['skipped']} skipped, "
            f"{row['seconds']:.0f} s" + (f", {types} model types/cases checked" if types is not None else ""))
    if which:
        terminalreporter.write_line(f"reproduce: bash scripts/dev.sh sweep --slice {which}")


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


def torchrun_command(world_size: int, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size),
            "--master_addr", "127.0.0.1", "--master_port", str(port), os.path.join(ROOT, "tests", "dist_worker.py"),
            *args]


def rank_env(env: dict | None = None) -> dict:
    return {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1", **(env or {})}


class TorchrunPool:
    """One real torchrun job of `world_size` ranks that runs many tests' cases, request after request
    (`dist_worker.serve`): the imports of torch, transformers and DeepSpeed and the process-group start are paid
    once per pool, not once per test. Each request starts from a fresh process's RNG; a request whose cases leave
    state in the process (fault injection, a ZeRO++ hpZ group, ...: `dist_worker.leaves_state`) retires the pool,
    and the next request starts a new one."""

    def __init__(self, world_size: int, env: dict | None, workdir: str):
        import tempfile

        self.folder = tempfile.mkdtemp(prefix=f"pool_w{world_size}_", dir=workdir)
        self.log_path = os.path.join(self.folder, "log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(torchrun_command(world_size, free_port(), "--serve", self.folder),
                                         stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env=rank_env({**(env or {}), "HF_ZERO3_TEST_POOL_OWNER": str(os.getpid())}))
        self.requests = 0

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _log_since(self, offset: int) -> str:
        with open(self.log_path, errors="replace") as f:
            f.seek(offset)
            return f.read()

    def run(self, cases: list[dict], timeout: float) -> None:
        import time

        n, self.requests = self.requests, self.requests + 1
        offset = os.path.getsize(self.log_path)
        request = os.path.join(self.folder, f"request_{n}.json")
        with open(request + ".tmp", "w") as f:
            json.dump(cases, f)
        os.replace(request + ".tmp", request)
        done, deadline = os.path.join(self.folder, f"done_{n}"), time.monotonic() + timeout
        while not os.path.exists(done):
            if not self.alive:
                log = self._log_since(offset)
                raise AssertionError(f"torchrun failed ({self.proc.returncode}):\n{log[-12000:]}")
            if time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"torchrun timed out after {timeout}s:\n{self._log_since(offset)[-12000:]}")
            time.sleep(0.05)
        with open(done) as f:
            if json.load(f)["retire"]:
                self.proc.wait(timeout=120)

    def close(self) -> None:
        if self.alive:
            open(os.path.join(self.folder, "stop"), "w").close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def needs_fresh_process(case: dict) -> bool:
    """Cases whose bounds hold for a new process only: a lowered descriptor limit (a pool's ranks hold more
    descriptors than a new process), NVMe offload (DeepSpeed's aio handles and swap files stay with the process)."""
    offload = (case.get("ds_config") or {}).get("zero_optimization", {}).get("offload_param", {})
    return bool(case.get("max_open_files")) or offload.get("device") == "nvme"


_pools: dict = {}
# idle pools hold their ranks' memory (about 0.5 GB a rank): the least recently used one is closed past this
MAX_POOLS = 6


def run_torchrun(world_size: int, cases: list[dict], workdir: str, timeout: float = 540, env: dict | None = None) -> list[dict]:
    """Run the cases in one real torchrun job of `world_size` processes; return rank 0's dumps, in order. The job is
    a pool's (`TorchrunPool`), shared with the other tests of this world size and environment, unless
    HF_ZERO3_TEST_POOL=0 asks for a launch of its own."""
    if os.environ.get("HF_ZERO3_TEST_POOL", "1") == "0" or any(needs_fresh_process(c) for c in cases):
        cases_file = os.path.join(workdir, f"cases_w{world_size}_{abs(hash(json.dumps(cases)))}.json")
        with open(cases_file, "w") as f:
            json.dump(cases, f)
        proc = subprocess.run(torchrun_command(world_size, free_port(), cases_file), capture_output=True, text=True,
                              timeout=timeout, env=rank_env(env), cwd=ROOT)
        if proc.returncode != 0:
            raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    else:
        key = (world_size, tuple(sorted((env or {}).items())))
        pool = _pools.pop(key, None)
        if pool is None or not pool.alive:
            pool = TorchrunPool(world_size, env, workdir)
        _pools[key] = pool  # the most recently used last
        while len(_pools) > MAX_POOLS:
            _pools.pop(next(iter(_pools))).close()
        pool.run(cases, timeout)
    return [torch.load(c["out"], weights_only=False) for c in cases]


@pytest.fixture(scope="session", autouse=True)
def _close_pools():
    yield
    # the pools live in the `tests.conftest` the tests import, which may be another module object than this one
    from tests import conftest

    for pools in {id(p): p for p in (_pools, conftest._pools)}.values():
        for pool in pools.values():
            pool.close()
        pools.clear()


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
