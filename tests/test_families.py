"""The family sweep (tests/families.py): every listed model type loads bit- and dtype-exact at world sizes 2, 3 and 4,
each world size one torchrun job over all families. The model cards name exactly these families."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import run_torchrun
from tests.families import SWEEP, SWEEP_WORLD_SIZES, sweep_checkpoint


@pytest.fixture(scope="module")
def checkpoints(workdir):
    return {t: sweep_checkpoint(workdir, t) for t in SWEEP}


@pytest.mark.parametrize("world_size", SWEEP_WORLD_SIZES)
def test_every_family_in_the_sweep_equals_the_plain_load(checkpoints, workdir, world_size):
    from transformers import AutoModelForCausalLM

    cases = [{"name": t, "path": path, "dtype": "float32", "out": os.path.join(workdir, f"sweep_{t}_w{world_size}.pt")}
             for t, path in checkpoints.items()]
    failures = []
    for case, dump in zip(cases, run_torchrun(world_size, cases, workdir, timeout=1500)):
        got = dump["rank0"]
        if "error" in got:
            failures.append(f"{case['name']}: {got['error']['type']}: {got['error']['message'][:200]}")
            continue
        plain = AutoModelForCausalLM.from_pretrained(case["path"], dtype=torch.float32)
        reference = {n: t.detach() for n, t in [*plain.named_parameters(remove_duplicate=False),
                                                 *plain.named_buffers(remove_duplicate=False)]}
        if set(got["state"]) != set(reference):
            failures.append(f"{case['name']}: names differ: {sorted(set(got['state']) ^ set(reference))[:4]}")
            continue
        differ = [n for n, want in reference.items()
                  if got["state"][n].dtype != want.dtype or not torch.equal(got["state"][n], want)]
        if differ:
            failures.append(f"{case['name']}: {len(differ)} tensors differ, e.g. {differ[:3]}")
    assert not failures, "\n".join(failures)
