#!/usr/bin/env bash
# The one entry point for a fresh clone: installs what is missing, then runs the demo or the tests.
#   bash scripts/dev.sh demo                 # a real 2-rank load of a bundled small MoE model, upstream vs ours
#   bash scripts/dev.sh test                 # the default test tier: every capability once (extra arguments go to pytest)
#   bash scripts/dev.sh sweep [--slice K/N]  # the exhaustive sweeps, or their K-th of N slices (docs/testing.md)
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import sys; sys.exit(sys.version_info < (3, 11))" \
  || { echo "Python 3.11 or newer is needed (transformers 5 requires it); found $(python -V 2>&1)" >&2; exit 2; }
# The CPU build of torch first, unless a torch the package takes (>= 2.6) is there: an unpinned torch (pulled by
# deepspeed) would fetch GBs of CUDA packages.
python -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 6))" 2>/dev/null \
  || pip install -q torch==2.13.0
# the package and the test extra (an install without `[test]` lacks pytest)
test_packages="('pytest', 'pytest_timeout', 'gguf', 'bitsandbytes')"  # the test extra's, found without importing
{ pip show -q hf_zero3_loader >/dev/null 2>&1 \
  && python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in $test_packages))"; } \
  || pip install -q -e ".[test]"
command="${1:-test}"
shift || true
case "$command" in
  demo) exec python scripts/demo.py "$@" ;;
  test|sweep)
    # NVMe offload tests need DeepSpeed's async_io op, built on first use against libaio: install it where apt can
    # (as root); elsewhere those tests skip
    if [ ! -e /usr/include/libaio.h ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      export DEBIAN_FRONTEND=noninteractive
      { timeout 300 apt-get install -y -q libaio-dev >/dev/null 2>&1 \
        || { timeout 300 apt-get update -q >/dev/null 2>&1 \
             && timeout 300 apt-get install -y -q libaio-dev >/dev/null 2>&1; }; } \
        || echo "libaio-dev could not be installed: the NVMe offload tests will be skipped" >&2
    fi
    if [ "$command" = sweep ]; then
      set -- --tier sweep "$@"
    fi
    exec python -m pytest -q "$@" ;;
  *) echo "usage: bash scripts/dev.sh demo | test [pytest arguments] | sweep [--slice K/N] [pytest arguments]" >&2
     exit 2 ;;
esac
