"""Whether this thread's `PreTrainedModel.from_pretrained` calls go to transformers' own, not back into the loader.

`import hf_zero3_loader.auto` routes `from_pretrained` to the loader (integrations/transformers_hook.py), and the
loader calls transformers' `from_pretrained` itself (its meta skeleton, its fallback to transformers' ZeRO-3 path):
those calls must not be routed back. Kept below both, so neither imports the other for it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_state = threading.local()


def inside_loader() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextmanager
def bypassed():
    """`from_pretrained` calls inside go to transformers' own, not back into the loader."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
