"""The two test tiers (docs/testing.md).

- default (`bash scripts/dev.sh test`): every capability and public path at least once, with representative families.
- sweep (`bash scripts/dev.sh sweep [--slice K/N]`): the exhaustive sweeps, marked `@pytest.mark.sweep`.

A sweep slice K/N is a deterministic 1/N of the sweep: a test marked `@pytest.mark.sweep(by_type=True)` runs in every
slice and checks the model types of that slice (`sliced`); any other sweep test runs in the one slice its node id
hashes to. The N slices together are the whole sweep.
"""

from __future__ import annotations

import os
import zlib

SLICE_ENV = "HF_ZERO3_SWEEP_SLICE"  # "K/N", set by tests/conftest.py from `--slice`
checked: dict[str, int] = {}  # section -> model types (or cases) it checked this run: the sweep's summary


def parse_slice(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    k, _, n = text.partition("/")
    try:
        k, n = int(k), int(n)
    except ValueError:
        raise ValueError(f"--slice takes K/N with 1 <= K <= N, e.g. 3/8; got {text!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"--slice takes K/N with 1 <= K <= N, e.g. 3/8; got {text!r}")
    return k, n


def in_slice(name: str, which: tuple[int, int] | None = None) -> bool:
    """Whether `name` (a model type, a case, a test id) is in the slice: a stable hash of the name, not Python's."""
    which = which or parse_slice(os.environ.get(SLICE_ENV))
    if which is None:
        return True
    k, n = which
    return zlib.crc32(name.encode()) % n == k - 1


def section() -> str:
    """The running test without its parameters (`tests/test_x.py::test_y`), from pytest's PYTEST_CURRENT_TEST."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    return current.split("[")[0]


def sliced(names, what: str = "model types", key=None) -> list:
    """The names of this run's slice (all of them outside a slice), counted for the summary; skips the test when the
    slice holds none of them. `key`: the name of an entry that is not a string itself."""
    import pytest

    chosen = [n for n in names if in_slice(key(n) if key else n)]
    checked[section()] = checked.get(section(), 0) + len(chosen)
    if not chosen:
        pytest.skip(f"none of its {what} in slice {os.environ.get(SLICE_ENV)}")
    return chosen
