#!/usr/bin/env bash
# The GPU checks, for a session that the `device` tool lends a GPU. The device image has PyTorch, accelerate,
# safetensors and the hub client, but neither DeepSpeed nor transformers 5.23, and no network; so:
#   here, once:        bash scripts/gpu_check.sh wheels    # fills .whl/ (git-ignored) with what the image lacks
#   on the device:     device run, command "bash scripts/gpu_check.sh run tests", carry [".whl"]
#                      then "bash scripts/gpu_check.sh run bench" (a call may run 10 minutes; `run` does both)
#                      "run fuzz": scripts/fuzz.py's modes at world size 1 on NCCL (partitions on the GPU);
#                      FUZZ_MODES="missing 8,save 4" picks modes and cases, FUZZ_TIMEOUT bounds each (s)
# With 15 minutes of device time (one start, one call of <= 10 minutes), one call: "timeout 330 bash
# scripts/gpu_check.sh run tests; FUZZ_MODES='missing 10,configs 10' FUZZ_TIMEOUT=60 bash scripts/gpu_check.sh run
# fuzz" (on an H200 the first four tests took ~3 minutes; the sweep and NVMe tests are the long ones), then give it back.
# Measured on an H200, 2026-11-27: GPU_TESTS=missing_keys alone 38 s; GPU_TESTS='not missing_keys and not nvme' (six
# tests, the sweep included) inside 260 s; the NVMe test alone did not finish in 170 s on a fresh machine (its first
# use builds DeepSpeed's async_io op): give it ~5 minutes of its own. OUT=$OUT/a ... keeps each part's logs apart.
# On an H100, 2026-11-27: GPU_TESTS=nvme alone 88 s on a fresh machine (the op build included), the other 7 tests
# 158 s, `run bench` 208 s for the warm rows with EP and 117 s for the cold ones (325 s in all): tests and bench fit
# one start only on a fast machine; in two calls on the warm machine they took 390 + 118 + 165 s of the 900.
# On an H200, 2026-11-29 (transformers 5.24): GPU_TESTS='not nvme' (7 tests) 187 s, then `run bench` in the same call's
# remaining 245 s got through the warm rows and one EP launch only; NVMe alone 96 s on the warm machine. So in one
# session: call 1 "run tests" with GPU_TESTS='not nvme', then with GPU_TESTS=nvme (~300 s together); call 2, at once,
# on the warm machine: "run bench" (~330 s); the 900 s hold both only if the machine starts fast.
# `run` installs the wheels into /tmp/site, then runs tests/test_gpu.py and the GPU rows of bench_load.py (warm with
# EP, then cold; `run nvme`: NVMe offload), keeping every log in $OUT (out/gpu when run by hand). Update the README's
# GPU section from them. The image has no libaio either (DeepSpeed's async_io op, NVMe offload): `wheels` copies this
# machine's (`apt install libaio-dev`) into .whl/libaio, and `run` points the op's build at it.
# Checked without a GPU: the same wheels (their cp311 builds) over a venv holding the image's packages
# (transformers 5.17, no pydantic) pass a 2-rank fidelity test and run bench_load.py.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the device image lacks (its pip list: /work/.library/device/KINDS.md), at the versions CI installs here.
WHEELS=(transformers==5.24.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
        hjson==3.1.0 regex==2026.5.9)

case "${1:-}" in
  wheels)
    mkdir -p .whl  # git-ignored (.gitignore)
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "${WHEELS[@]}"
    # DeepSpeed publishes only a source archive: build its pure-Python wheel (its ops compile on first use)
    DS_BUILD_OPS=0 python -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
    if [[ -f /usr/include/libaio.h ]]; then
      mkdir -p .whl/libaio/include .whl/libaio/lib
      cp /usr/include/libaio.h .whl/libaio/include/
      lib=$(ls /usr/lib/x86_64-linux-gnu/libaio.so.1* | head -n 1)
      cp -L "$lib" .whl/libaio/lib/libaio.so && cp -L "$lib" .whl/libaio/lib/libaio.so.1  # real files, not links
    fi
    ls -l .whl
    ;;
  run)
    out="${OUT:-out/gpu}"
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    # DeepSpeed 0.19.8's op builder cannot parse an arch such as "9.0a" (int("0a")): name this GPU's plain one
    TORCH_CUDA_ARCH_LIST=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
    export TORCH_CUDA_ARCH_LIST
    if [[ -d .whl/libaio ]]; then  # DeepSpeed's libaio probe reads CFLAGS/LDFLAGS; the op's build, gcc's paths
      aio="$PWD/.whl/libaio"
      cuda=$(python3 -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or '')")
      export CFLAGS="-I$aio/include" LDFLAGS="-L$aio/lib" CPATH="$aio/include" \
        LIBRARY_PATH="$aio/lib:$cuda/lib64/stubs" LD_LIBRARY_PATH="$aio/lib:${LD_LIBRARY_PATH:-}"
    fi
    { nvidia-smi; python3 -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__,
      deepspeed.__version__, torch.cuda.get_device_name())"
      python3 -c "from deepspeed.accelerator import get_accelerator as a; b = a().create_op_builder('AsyncIOBuilder')
print('async_io buildable:', b.is_compatible(verbose=True))"; } > "$out/versions.txt" 2>&1 || true
    # (not built here: the first NVMe load builds it, ~1 minute on a fresh machine; a run without NVMe skips that)
    what="${2:-all}" status=0
    if [[ "$what" == all || "$what" == tests ]]; then
      python3 -m pytest -q tests/test_gpu.py ${GPU_TESTS:+-k "$GPU_TESTS"} 2>&1 | tee "$out/test_gpu.log" || status=1
    fi
    if [[ "$what" == all || "$what" == bench ]]; then
      python3 scripts/bench_load.py --world-sizes 1 --repeats 2 --ep --workdir /tmp/bench \
        --json "$out/bench_warm.json" > "$out/bench_warm.log" 2>&1 || status=1
      python3 scripts/bench_load.py --world-sizes 1 --repeats 2 --cold --workdir /tmp/bench \
        --json "$out/bench_cold.json" > "$out/bench_cold.log" 2>&1 || status=1
      tail -n 25 "$out/bench_warm.log" "$out/bench_cold.log"
    fi
    if [[ "$what" == fuzz ]]; then  # scripts/fuzz.py's modes through the GPU path, into one log
      IFS=, read -ra specs <<< "${FUZZ_MODES:-configs 14,missing 10,save 8,state_dict 6,nvme 3,ep 4}"
      for spec in "${specs[@]}"; do
        set -- $spec
        echo "== fuzz $1, $2 cases, world size 1, NCCL" >> "$out/fuzz.log"
        HF_ZERO3_TEST_BACKEND=nccl timeout "${FUZZ_TIMEOUT:-120}" python3 scripts/fuzz.py "$1" --world-size 1 \
          --cases "$2" --seed 7 --workdir /tmp/fuzz >> "$out/fuzz.log" 2>&1 || { rc=$?; status=1; echo "== rc $rc" >> "$out/fuzz.log"; }
      done
      grep -E "^==|failure|^  " "$out/fuzz.log" | tail -n 60
    fi
    if [[ "$what" == nvme ]]; then
      python3 scripts/bench_load.py --world-sizes 1 --repeats 2 --nvme --workdir /tmp/bench \
        --json "$out/bench_nvme.json" > "$out/bench_nvme.log" 2>&1 || status=1
      tail -n 25 "$out/bench_nvme.log"
    fi
    exit $status
    ;;
  *) echo "usage: bash scripts/gpu_check.sh wheels | run [all|tests|bench|fuzz|nvme]" >&2; exit 2 ;;
esac
