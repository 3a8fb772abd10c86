"""The collector is paused while a load plans and restored as it was, also when the load fails."""

import gc

import pytest

from hf_zero3_loader.gc_pause import paused_gc


@pytest.mark.parametrize("enabled", [True, False])
def test_paused_gc_restores_the_callers_state(enabled):
    (gc.enable if enabled else gc.disable)()
    try:
        with paused_gc():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(RuntimeError), paused_gc():
            raise RuntimeError("the load failed")
        assert gc.isenabled() == enabled
    finally:
        gc.enable()
