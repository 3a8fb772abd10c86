"""model_cards/ is generated from the tests' own definitions; CI fails when a card says anything else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.conftest import ROOT, python_path


def _check(folder: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "model_cards.py"), "--check", "--folder", folder],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": python_path()})


def test_committed_cards_are_exactly_what_the_tests_verify():
    result = _check(os.path.join(ROOT, "model_cards"))
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


def test_a_card_claiming_an_unverified_world_size_or_family_fails_the_check(tmp_path):
    cards = tmp_path / "cards"
    shutil.copytree(os.path.join(ROOT, "model_cards"), cards)
    with open(cards / "llama.md", "a") as f:
        f.write("- world sizes 8, 16: bit-exact\n")
    assert _check(str(cards)).returncode == 1
    shutil.rmtree(cards)
    shutil.copytree(os.path.join(ROOT, "model_cards"), cards)
    (cards / "falcon.md").write_text("# Falcon\n\n- world sizes 2: bit-exact\n")
    result = _check(str(cards))
    assert result.returncode == 1 and "falcon.md is not generated" in result.stdout
