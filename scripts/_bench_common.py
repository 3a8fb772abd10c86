"""Helpers shared by bench_load.py, bench_save.py and demo.py: make checkpoints, warm the page cache, launch torchrun, tables."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(SCRIPTS)
MiB = 1 << 20


def make_checkpoint(out: str, size: str) -> dict:
    """Write (once) the checkpoint in a subprocess, so this process stays small."""
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "_ckpt.py"), "--out", out, "--size", size],
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"checkpoint generation failed ({size})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def checkpoint_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def warm_page_cache(path: str) -> int:
    """Read every checkpoint file once, so every variant starts from the same warm page cache."""
    total = 0
    for f in checkpoint_files(path):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(16 * MiB):
                total += len(chunk)
    return total


def device_read_bytes() -> int:
    """Bytes this process has had fetched from the storage device so far (/proc/self/io; Linux)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def evict_page_cache(path: str) -> int:
    """Drop every checkpoint file from the page cache (posix_fadvise DONTNEED), so the next launch reads cold."""
    total = 0
    for f in checkpoint_files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, worker_args: list[str], log: str, timeout: float,
           worker: str = "_bench_worker.py") -> tuple[float, int]:
    """`torchrun --nproc_per_node world scripts/<worker> ...`; returns (wall seconds, return code)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(SCRIPTS, worker), *worker_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks; explicit, and silences its warning
    start = time.perf_counter()
    with open(log, "w") as fh:
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return time.perf_counter() - start, rc


def log_tail(log: str, lines: int = 40) -> str:
    with open(log) as fh:
        return "".join(fh.readlines()[-lines:])


def read_mib(r: dict) -> float:
    """Checkpoint bytes this rank pulled in. ours: its report's bytes_read; floor: the bytes it read; upstream:
    read() bytes (/proc/self/io rchar delta) + bytes of the tensors it took from the mmapped shards through
    safetensors `get_tensor` (mmap page faults are not read() calls, so rchar alone misses them)."""
    return r["bytes_read"] / MiB


def table(results: list[dict]) -> str:
    device = any(r.get("device_peak_growth") is not None for r in results)
    rows = ["| variant | rank | load s | peak RSS growth MiB |" + (" device peak MiB |" if device else "") +
            " collective MiB | read MiB |",
            "|---|---|---|---|" + ("---|" if device else "") + "---|---|"]
    for r in results:
        coll = "-" if r["variant"].startswith("floor") else f"{r['collective_bytes'] / MiB:.1f}"
        dev = (f" {r['device_peak_growth'] / MiB:.1f} |" if r.get("device_peak_growth") is not None else " - |") if device else ""
        rows.append(f"| {r['variant']} | {r['rank']} | {r['seconds']:.3f} | {r['rss_growth'] / MiB:.1f} |{dev} {coll} | "
                    f"{read_mib(r):.1f} |")
    return "\n".join(rows)


def spans_of(plan, entries: dict) -> list:
    """A plan's reads as (file, absolute byte offset, nbytes) runs: one per read item, one per row of a strided box."""
    spans = []
    for t in plan.tensors.values():
        for r in t.reads:
            size = r.src_dtype.itemsize
            start = entries[r.key].data_start + r.src_offset * size
            if r.rows == 1 or r.row_stride == r.cols:
                spans.append((r.file, start, r.numel * size))
            else:
                spans.extend((r.file, start + i * r.row_stride * size, r.cols * size) for i in range(r.rows))
    return spans
