"""One rank of a benchmark/demo launch: load a checkpoint one way and measure it. Run by torchrun.

    torchrun --nproc_per_node W scripts/_bench_worker.py --variant {ours,upstream,floor} --path CKPT --result R.json
        [--spans-out S.json]       (ours) write every rank's planned byte ranges, for the floor
        [--spans-in S.json]        (floor) the ranges to read
        [--state-out F]            gather all params and buffers, rank 0 writes F.state.json (dtype, shape, sha256 per
                                   tensor) and with --full-state also F.state.pt (the tensors)
        [--compare-with F]         rank 0 compares its gathered tensors with F.state.json (and F.state.pt when present)
        [--ep-size N]              expert parallelism (AutoEP, ep_size N): ours loads straight into it, upstream
                                   gets it from deepspeed.initialize (engine-side AutoEP); the measured window then
                                   runs through the end of deepspeed.initialize for both

Every variant runs in a fresh process: imports, `init_distributed`, the model module import and transformers' one-time
conversion-mapping table happen before the baseline, so the measured window is only the load. Per rank it records wall
seconds of the load, the peak RSS growth over the baseline (the kernel's VmHWM, reset at the baseline), bytes through
torch.distributed collectives (tests/instrument.py CollectiveCounter) and /proc/self/io deltas.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.instrument import CollectiveCounter  # noqa: E402

DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
PIECE = 64 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class RssSampler:
    """Peak RSS growth of this process over a block. The total comes from the kernel's own high-water mark (VmHWM,
    reset at entry through /proc/self/clear_refs): exact, and no thread competing with the load for the GIL. A
    sampling thread every 5 ms made our loads 1.5-5x slower and erratic on 2 cores (each preadv's return waits for
    the GIL) while barely touching the floor's few long reads, so the file-backed / anonymous split (`shared`,
    `anon`) is sampled only every `period` s (default 50 ms) and is approximate."""

    def __init__(self, period: float = float(os.environ.get("BENCH_RSS_PERIOD", "0.05"))):
        self.proc = psutil.Process()
        self.period = period
        self._stop = threading.Event()
        m = self.proc.memory_info()
        self.base = {"rss": m.rss, "shared": m.shared, "anon": m.rss - m.shared}
        self.peak = dict(self.base)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._hwm = True

    def _sample(self):
        m = self.proc.memory_info()
        for k, v in (("rss", m.rss), ("shared", m.shared), ("anon", m.rss - m.shared)):
            if v > self.peak[k]:
                self.peak[k] = v

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period)

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := current RSS
        except OSError:
            self._hwm = False  # no permission: the sampled peak is all there is
        if self.period > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sample()
        if self._hwm:
            self.peak["rss"] = max(self.peak["rss"], _status_kib("VmHWM") * 1024)
        return False

    def growth(self) -> dict:
        return {k: self.peak[k] - self.base[k] for k in self.base}


class SafetensorsBytes:
    """Bytes of tensors transformers materialises through `safetensors.safe_open(...).get_tensor` (mmap reads,
    which /proc/self/io rchar does not see), counted by wrapping `transformers.modeling_utils.safe_open`."""

    def __init__(self):
        self.bytes = 0
        self.tensors = 0

    def __enter__(self):
        import transformers.modeling_utils as mu

        self._mu, self._orig = mu, mu.safe_open
        counter = self

        class Counting:
            def __init__(self, *args, **kwargs):
                self._inner = counter._orig(*args, **kwargs)

            def __enter__(self):
                self._entered = self._inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self._inner.__exit__(*exc)

            def get_tensor(self, key):
                t = (getattr(self, "_entered", None) or self._inner).get_tensor(key)
                counter.bytes += t.numel() * t.element_size()
                counter.tensors += 1
                return t

            def __getattr__(self, name):
                inner = self.__dict__.get("_entered") or self.__dict__.get("_inner")
                if inner is None:  # not constructed yet (copy, pickle): no recursion into ourselves
                    raise AttributeError(name)
                return getattr(inner, name)

        mu.safe_open = Counting
        return self

    def __exit__(self, *exc):
        self._mu.safe_open = self._orig
        return False


def io_counters() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


# -- the three variants ------------------------------------------------------------------------------------
def ds_config(ep_size: int) -> dict:
    if not ep_size:
        return DS_CONFIG
    return {**DS_CONFIG, "expert_parallel": {"enabled": True, "autoep_size": ep_size}}


EXTRA_KWARGS: dict = {}  # e.g. quantization_config for a quantized checkpoint (--dequantize)


STATE_DICT: dict = {}  # --state-dict: the checkpoint's tensors, held before the window (meta where not held)


def state_dict_of(path: str, holds: bool) -> dict:
    """The checkpoint's tensors (`load_file` of every shard), or meta tensors of their shapes and dtypes."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from hf_zero3_loader.checkpoint import SAFETENSORS_DTYPES

    state = {}
    for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        if holds:
            state.update(load_file(os.path.join(path, name)))
            continue
        with safe_open(os.path.join(path, name), "pt") as f:
            for key in f.keys():
                info = f.get_slice(key)
                state[key] = torch.empty(info.get_shape(), dtype=SAFETENSORS_DTYPES[info.get_dtype()], device="meta")
    return state


def _call(path: str):
    """(model class, path, kwargs): the Auto class and the folder, or with --state-dict the concrete class
    (transformers' Auto classes need a folder), no path, and the config and state dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not STATE_DICT:
        return AutoModelForCausalLM, path, {}
    config = AutoConfig.from_pretrained(path)
    return AutoModelForCausalLM._model_mapping[type(config)], None, {"config": config, "state_dict": STATE_DICT}


def load_ours(path: str, config: dict, **kwargs):
    import hf_zero3_loader

    if os.environ.get("HF_ZERO3_BENCH_READ_THREADS"):  # bench_load.py --read-threads
        kwargs.setdefault("read_threads", int(os.environ["HF_ZERO3_BENCH_READ_THREADS"]))
    model_class, path, call_kwargs = _call(path)
    return hf_zero3_loader.from_pretrained(model_class, path, ds_config=config, **EXTRA_KWARGS, **call_kwargs,
                                           **kwargs)


def load_upstream(path: str, config: dict):
    model_class, path, call_kwargs = _call(path)
    return model_class.from_pretrained(path, dtype=torch.bfloat16, **EXTRA_KWARGS, **call_kwargs)


def load_plain(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **EXTRA_KWARGS)


def initialize(model, config: dict):
    """deepspeed.initialize without an optimizer: the engine partitions (upstream: after engine-side AutoEP
    replaced and repacked the MoE blocks); optimizer states would be the same for both and are left out."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine


def read_spans(spans: list, threads: int, populate: bool = False) -> torch.Tensor:
    """The floor: positional reads of exactly these (file, offset, nbytes) spans into one fresh buffer. With
    `populate`, each piece's pages are mapped in one call first, as the loader does (reader.populate_for_write)."""
    from hf_zero3_loader.reader import populate_for_write

    total = sum(n for _, _, n in spans)
    buf = torch.empty(total, dtype=torch.uint8)
    view = buf.numpy()
    fds = {f: os.open(f, os.O_RDONLY) for f in {f for f, _, _ in spans}}
    pieces, pos = [], 0
    for f, off, n in spans:
        for i in range(0, n, PIECE):
            m = min(PIECE, n - i)
            pieces.append((fds[f], off + i, pos + i, m))
        pos += n

    def one(piece):
        fd, off, dst, n = piece
        done = 0
        if populate:
            populate_for_write(buf[dst:dst + n])
        while done < n:
            got = os.preadv(fd, [view[dst + done:dst + n]], off + done)
            if got <= 0:
                raise OSError(f"short read at {off + done}")
            done += got

    try:
        if threads <= 1:
            for p in pieces:
                one(p)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, pieces))
    finally:
        for fd in fds.values():
            os.close(fd)
    return buf


def plan_spans(model) -> list:
    """This rank's reads, from our plan, as (file, absolute byte offset, nbytes) runs."""
    from _bench_common import spans_of
    from hf_zero3_loader.checkpoint import open_checkpoint

    plan = model.hf_zero3_load_report.plan
    files = sorted({r.file for t in plan.tensors.values() for r in t.reads})
    return spans_of(plan, open_checkpoint(files).entries)


# -- gathered state, for equality checks --------------------------------------------------------------------
def gathered_state(model, keep: bool):
    """Rank 0: {name: (dtype, shape, sha256)} of every gathered parameter and buffer, and the tensors if `keep`."""
    import deepspeed

    meta, tensors = {}, {}

    def record(name, t, kind):
        t = t.detach().contiguous().cpu()
        raw = t.view(-1).view(torch.uint8).numpy() if t.numel() else b""
        meta[name] = {"kind": kind, "dtype": str(t.dtype), "shape": list(t.shape),
                      "sha256": hashlib.sha256(raw).hexdigest()}
        if keep:
            tensors[name] = t.clone()

    for name, p in model.named_parameters(remove_duplicate=False):
        with deepspeed.zero.GatheredParameters([p]):
            if dist.get_rank() == 0:
                record(name, p, "parameter")
    if dist.get_rank() == 0:
        for name, b in model.named_buffers(remove_duplicate=False):
            record(name, b, "buffer")
    return meta, tensors


def compare(meta: dict, tensors: dict, other: str) -> dict:
    with open(other + ".state.json") as f:
        ref = json.load(f)
    problems = []
    for name in sorted(set(meta) | set(ref)):
        if name not in meta or name not in ref:
            problems.append(f"{name}: only in {'this run' if name in meta else 'reference'}")
            continue
        dt, shape, digest = meta[name]["dtype"], meta[name]["shape"], meta[name]["sha256"]
        rdt, rshape, rdigest = ref[name]["dtype"], ref[name]["shape"], ref[name]["sha256"]
        if meta[name]["kind"] != ref[name]["kind"]:
            problems.append(f"{name}: {meta[name]['kind']} here, {ref[name]['kind']} in the reference")
        elif dt != rdt:
            problems.append(f"{name}: dtype {dt} vs {rdt}")
        elif shape != rshape:
            problems.append(f"{name}: shape {shape} vs {rshape}")
        elif digest != rdigest:
            problems.append(f"{name}: sha256 differs")
    full = None
    if tensors and os.path.exists(other + ".state.pt"):
        ref_t = torch.load(other + ".state.pt")
        full = 0
        for name, t in tensors.items():
            r = ref_t.get(name)
            if r is None or r.dtype != t.dtype or r.shape != t.shape or not torch.equal(
                    r.view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)):
                if not any(p.startswith(name + ":") for p in problems):
                    problems.append(f"{name}: tensor bits differ")
            else:
                full += 1
    kinds = [m["kind"] for m in meta.values()]
    return {"tensors": len(meta), "parameters": kinds.count("parameter"), "buffers": kinds.count("buffer"),
            "reference_tensors": len(ref), "problems": problems, "equal": not problems,
            "bitwise_tensor_compares": full}


# -- main ------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", required=True,
                    choices=("ours", "upstream", "floor", "stream", "plain", "ours_faulting", "floor_populated"))
    ap.add_argument("--path", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--spans-out")
    ap.add_argument("--spans-in")
    ap.add_argument("--state-out")
    ap.add_argument("--full-state", action="store_true")
    ap.add_argument("--compare-with")
    ap.add_argument("--floor-threads", type=int, default=0,
                    help="floor: reader threads (default: what the loader uses, the cores per local rank, at most 4)")
    ap.add_argument("--ep-size", type=int, default=0)
    ap.add_argument("--cold", action="store_true", help="floor: evict the files before each of its timed passes")
    ap.add_argument("--state-dict", choices=("every", "rank0"),
                    help="load from a state dict held before the window: on every rank, or on rank 0 (meta elsewhere)")
    ap.add_argument("--dequantize", action="store_true",
                    help="a quantized checkpoint: both variants pass FineGrainedFP8Config(dequantize=True)")
    ap.add_argument("--nvme-path", help="offload_param to NVMe (DeepSpeed's default swap buffers), swap files here")
    args = ap.parse_args()
    config = ds_config(args.ep_size)
    if args.nvme_path:
        config = {**config, "zero_optimization": {**config["zero_optimization"],
                                                  "offload_param": {"device": "nvme", "nvme_path": args.nvme_path}}}
    if args.variant == "ours_faulting":  # ours with the reads faulting pages in (no populate), for the A/B rows
        from hf_zero3_loader.reader import PREFAULT_ENV

        os.environ[PREFAULT_ENV] = "0"
    if args.dequantize:
        from transformers import FineGrainedFP8Config

        EXTRA_KWARGS["quantization_config"] = FineGrainedFP8Config(dequantize=True)

    import deepspeed
    import deepspeed.runtime.zero.partition_parameters  # noqa: F401
    # DeepSpeedConfig imports its AutoEP section's module (and AutoEP's presets) the first time it parses a config,
    # inside zero.Init on both paths (~0.01 s here): a lazy import like transformers', kept out of the window
    import deepspeed.module_inject.auto_ep_config  # noqa: F401
    import transformers
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401  (lazy import kept out of the window)
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    # transformers builds its table of conversion mappings for every model type once per process, at the first load
    # (~0.04 s here): a one-time cost like the lazy imports, paid before the window by every variant
    get_checkpoint_conversion_mapping("qwen3_moe")

    import hf_zero3_loader  # noqa: F401
    from hf_zero3_loader.reader import default_io_threads

    on_gpu = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = dist.get_rank(), dist.get_world_size()
    keep_alive = None
    if args.variant == "upstream":
        from transformers.integrations import HfDeepSpeedConfig

        from hf_zero3_loader import _deepspeed_private

        keep_alive = HfDeepSpeedConfig(config)  # noqa: F841  (transformers holds only a weakref)
        _deepspeed_private.allow_registry_get_default()  # AutoEP presets on a transformers 5.23 model need it
    spans = None
    if args.variant.startswith("floor"):
        with open(args.spans_in) as f:
            spans = json.load(f)[str(rank)]

    if args.state_dict:
        STATE_DICT.update(state_dict_of(args.path, holds=args.state_dict == "every" or rank == 0))
    result: dict = {"variant": args.variant, "rank": rank, "world_size": world}
    dist.barrier()
    counter, st_bytes = CollectiveCounter(), SafetensorsBytes()
    io0 = io_counters()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        device_base = torch.cuda.memory_allocated()
    with RssSampler() as rss:
        start = time.perf_counter()
        if args.variant.startswith("floor"):
            # one pass only: a second pass would land in memory the first just freed, which this VM hands back far
            # faster than fresh memory (first touch), so it would not be a floor for a load into fresh partitions
            threads = args.floor_threads or default_io_threads()
            if args.cold:  # the pass reads cold: rank 0 evicts between barriers
                dist.barrier()
                if rank == 0:
                    for path in sorted({f for f, _, _ in spans}):
                        fd = os.open(path, os.O_RDONLY)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        os.close(fd)
                dist.barrier()
            t0 = time.perf_counter()
            buf = read_spans(spans, threads, populate=args.variant == "floor_populated")
            seconds = time.perf_counter() - t0
            del buf
            result["floor_seconds_by_threads"] = {threads: seconds}
            model = None
        else:
            with counter, st_bytes:
                if args.variant == "stream":  # one reader (rank 0, this node's) streams every other rank its bytes
                    model = load_ours(args.path, config, load_from="stream")
                elif args.variant == "plain":  # single-process from_pretrained on rank 0 (no DeepSpeed), for scale
                    model = load_plain(args.path) if rank == 0 else None
                else:
                    model = (load_upstream if args.variant == "upstream" else load_ours)(args.path, config)
                if args.ep_size:
                    result["load_seconds"] = time.perf_counter() - start
                    engine = initialize(model, config)
                    model = engine.module
            seconds = time.perf_counter() - start
    io1 = io_counters()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result.update({
        "seconds": seconds,
        # accelerator memory: peak allocated during the window over what was allocated before it
        "device_peak_growth": (torch.cuda.max_memory_allocated() - device_base) if on_gpu else None,
        "rss_base": rss.base["rss"],
        "rss_growth": rss.growth()["rss"],
        "rss_growth_anon": rss.growth()["anon"],
        "rss_growth_shared": rss.growth()["shared"],
        "ru_maxrss_growth": maxrss - rss.base["rss"],
        # torch.distributed.* and DeepSpeed's captured all-gather/reduce-scatter references
        "collective_bytes": sum(counter.bytes.values()),
        "collective_bytes_by_op": counter.bytes,
        "collective_calls": counter.calls,
        "rchar": io1["rchar"] - io0["rchar"],
        "safetensors_get_tensor_bytes": st_bytes.bytes,
        "read_bytes_disk": io1["read_bytes"] - io0["read_bytes"],
    })
    if args.variant.startswith("floor"):
        result["bytes_read"] = sum(n for _, _, n in spans)
    elif args.variant in ("upstream", "plain"):
        result["bytes_read"] = result["rchar"] + st_bytes.bytes
    elif args.variant in ("ours", "stream", "ours_faulting"):
        summary = model.hf_zero3_load_report.summary()
        result["report"] = summary
        result["bytes_read"] = summary["bytes_read"]
    dist.barrier()

    if args.spans_out and args.variant == "ours":
        mine = plan_spans(model)
        result["plan_span_bytes"] = sum(n for _, _, n in mine)
        every = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            with open(args.spans_out, "w") as f:
                json.dump({str(r): s for r, s in enumerate(every)}, f)

    if args.variant != "plain" and (args.state_out or args.compare_with):
        t0 = time.perf_counter()
        keep = args.full_state or bool(args.compare_with and os.path.exists(args.compare_with + ".state.pt"))
        meta, tensors = gathered_state(model, keep=keep)
        if rank == 0:
            result["gather_seconds"] = time.perf_counter() - t0
            if args.state_out:
                with open(args.state_out + ".state.json", "w") as f:
                    json.dump(meta, f)
                if args.full_state:
                    torch.save(tensors, args.state_out + ".state.pt")
            if args.compare_with:
                result["comparison"] = compare(meta, tensors, args.compare_with)
        del tensors

    every = [None] * world
    dist.all_gather_object(every, result)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(every, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip finalisation: gloo threads can abort it (a known torch teardown race)


if __name__ == "__main__":
    main()
