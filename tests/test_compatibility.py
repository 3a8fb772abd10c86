"""An untested transformers or DeepSpeed (docs/compatibility.md): a warning at import naming the versions, and a check
at the first load of every private hook the package touches. A hook missing or changed sends the load through
transformers' own ZeRO-3 path (the same model, with a warning saying so); a save is refused. The missing hook is
simulated with HF_ZERO3_LOADER_SIMULATE_MISSING_HOOK (test-only), set for the ranks."""

from __future__ import annotations

import os

import pytest
import torch

from hf_zero3_loader import compat
from hf_zero3_loader._hooks import SIMULATE_ENV, Hook
from tests.checkpoints import make_checkpoint
from tests.conftest import run_torchrun
from tests.dist_worker import CapturedWarnings, ds_config_for


@pytest.fixture
def captured():
    with CapturedWarnings() as handler:  # the package logger's warnings, as the ranks capture them
        yield handler.messages


@pytest.fixture
def fresh_check(monkeypatch):
    monkeypatch.delenv(SIMULATE_ENV, raising=False)
    compat.forget()
    yield
    compat.forget()


def test_every_hook_is_there_on_the_installed_versions(fresh_check):
    assert compat.untested_versions() == []
    assert compat.missing_hooks() == []


def test_an_untested_version_warns_once_naming_it(monkeypatch, captured):
    monkeypatch.setenv("RANK", "0")
    faked = {"transformers": "5.26.0", "deepspeed": "0.19.8"}
    monkeypatch.setattr(compat, "installed_version", faked.get)
    compat.warn_if_untested()
    compat.warn_if_untested()
    assert len(captured) == 1, captured
    assert "transformers 5.26.0 (tested: 5.23 and 5.24)" in captured[0]
    assert "deepspeed 0.19.8" not in captured[0].lower()  # the tested one is not named
    assert "docs/compatibility.md" in captured[0]
    faked["deepspeed"] = "0.20.0"  # another set of versions: its own warning
    compat.warn_if_untested()
    assert len(captured) == 2 and "deepspeed 0.20.0 (tested: 0.19.8)" in captured[1]
    faked["transformers"], faked["deepspeed"] = "5.24.3", "0.19.8"  # a patch release of a tested one: no warning
    compat.warn_if_untested()
    assert len(captured) == 2
    monkeypatch.setattr(compat, "installed_version", lambda package: 1 / 0)  # whatever fails, import goes on
    compat.warn_if_untested()


def test_a_missing_or_changed_hook_is_named(monkeypatch, fresh_check):
    mu = "transformers.modeling_utils"
    assert Hook(f"{mu}:PreTrainedModel._no_such_hook").problem() == "not found"
    assert Hook("transformers.no_such_module:x").problem().startswith("module transformers.no_such_module cannot")
    assert "expected (model, state_dict)" in Hook(f"{mu}:PreTrainedModel._load_pretrained_model",
                                                  params=("model", "state_dict"), exact=True).problem()
    assert Hook(f"{mu}:PreTrainedModel._get_dtype_plan", static=True).problem() == "no longer a staticmethod"
    assert "takes no nope" in Hook(f"{mu}:_tied_params_are_equal", keywords=("source", "nope")).problem()
    assert "has no field gone" in Hook(f"{mu}:LoadStateDictConfig", fields=("dtype", "gone")).problem()
    monkeypatch.setenv(SIMULATE_ENV, "_tied_params_are_equal")
    missing = compat.missing_hooks(compat.LOAD)
    assert missing == ["transformers.modeling_utils._tied_params_are_equal: not found (simulated: "
                       f"{SIMULATE_ENV})"]
    assert compat.missing_hooks(compat.SAVE) == []  # a save does not need it


def test_missing_hook_loads_through_transformers_path_equal_to_it(workdir):
    """At 2 ranks, a load hook and a save hook reported missing: `from_pretrained` loads through transformers' own
    ZeRO-3 path, every gathered parameter equal (bit for bit, dtype for dtype) to an upstream load in the same launch,
    with one warning on rank 0 naming the hook; a save is refused on every rank; expert parallelism asked of the load
    only is refused, and asked in the config is left to the engine."""
    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    ep_config = ds_config_for("bfloat16", {"expert_parallel": {"enabled": True, "use_grouped_mm": False,
                                                               "autoep_size": 2}})
    cases = [
        {"name": "compat/fallback", "path": path, "dtype": "bfloat16",
         "save": {"dir": os.path.join(workdir, "compat_save")}, "out": os.path.join(workdir, "compat_fallback.pt")},
        {"name": "compat/ep_size", "path": path, "dtype": "bfloat16", "kwargs": {"ep_size": 2},
         "out": os.path.join(workdir, "compat_ep_size.pt")},
        {"name": "compat/ep_by_config", "path": path, "dtype": "bfloat16", "ds_config": ep_config,
         "out": os.path.join(workdir, "compat_ep_config.pt")},
        {"name": "compat/upstream", "path": path, "dtype": "bfloat16", "upstream": True,
         "out": os.path.join(workdir, "compat_upstream.pt")},
    ]
    env = {SIMULATE_ENV: "PreTrainedModel._load_pretrained_model,safe_save_file"}
    fallback, ep_size, ep_by_config, upstream = run_torchrun(2, cases, workdir, env=env)
    for dump in (fallback, ep_by_config, upstream):
        assert "error" not in dump["rank0"], dump["rank0"].get("error", {}).get("traceback")
    want = upstream["rank0"]["state"]
    for dump in (fallback, ep_by_config):
        got = dump["rank0"]["state"]
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), f"{key}: values differ from transformers' ZeRO-3 path"
        assert [r["report"]["init_context"] for r in dump["ranks"]] == ["zero.Init", "zero.Init"]
    hook = "transformers.modeling_utils.PreTrainedModel._load_pretrained_model"
    said = [w for w in fallback["ranks"][0]["warnings"] if hook in w]
    assert len(said) == 1, fallback["ranks"][0]["warnings"]
    assert "transformers' own ZeRO-3 path" in said[0] and "slower" in said[0] and "same model" in said[0]
    assert not [w for w in fallback["ranks"][1]["warnings"] if hook in w]  # rank 0 says it
    assert [w for w in ep_by_config["ranks"][0]["warnings"] if "left to deepspeed.initialize" in w]
    for r in fallback["ranks"]:  # every rank refuses the save, naming the hook
        assert r["save_error"]["type"] == "ConfigError", r.get("save_error")
        assert "safe_save_file" in r["save_error"]["message"]
    assert not os.path.exists(os.path.join(workdir, "compat_save", "config.json"))
    for r in ep_size["ranks"]:
        assert r["error"]["type"] == "ConfigError", r["error"]
        assert hook in r["error"]["message"] and "expert_parallel" in r["error"]["message"]


AUTO_SCRIPT = r"""
import logging, sys
import deepspeed, torch
from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig
import hf_zero3_loader
import hf_zero3_loader.auto  # every from_pretrained under ZeRO-3 routed through the loader

path, out = sys.argv[1], sys.argv[2]
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
warnings = []


class Captured(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())


logging.getLogger("hf_zero3_loader").addHandler(Captured(logging.WARNING))
fallbacks, fall_back = [], hf_zero3_loader.loader._load_without_missing_hooks


def counted(*args, **kwargs):
    fallbacks.append(1)
    return fall_back(*args, **kwargs)


hf_zero3_loader.loader._load_without_missing_hooks = counted
held = HfDeepSpeedConfig(config)  # as the Trainer and accelerate hold it
models = [AutoModelForCausalLM.from_pretrained(path),  # through the auto hook
          hf_zero3_loader.from_pretrained(AutoModelForCausalLM, path, ds_config=config)]  # direct, the hook installed


def gathered(model):
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


torch.save({"contexts": [m.hf_zero3_load_report.init_context for m in models], "warnings": warnings,
            "fallbacks": len(fallbacks),
            "states": [gathered(m) for m in models]}, out)
"""


def test_missing_hook_fallback_through_the_auto_hook_does_not_recurse(workdir):
    """`import hf_zero3_loader.auto`: a plain `from_pretrained`, and a direct `hf_zero3_loader.from_pretrained` with
    the hook installed, both fall back to transformers' path once (the hook does not route the fallback's own
    `from_pretrained` back into the loader) and give the plain load's parameters. One process, world size 1."""
    import subprocess
    import sys

    from tests.conftest import ROOT, rank_env

    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    out = os.path.join(workdir, "compat_auto.pt")
    env = rank_env({SIMULATE_ENV: "PreTrainedModel._load_pretrained_model"})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # no launcher: world size 1
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", AUTO_SCRIPT, path, out], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = torch.load(out, weights_only=False)
    assert got["contexts"] == ["zero.Init", "zero.Init"]
    assert got["fallbacks"] == 2  # one per load: the fallback's own from_pretrained is transformers' alone
    said = [w for w in got["warnings"] if "PreTrainedModel._load_pretrained_model" in w]
    assert len(said) == 1, got["warnings"]  # once per process
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    want = dict(plain.named_parameters())
    for state in got["states"]:
        assert set(state) == set(want)
        for key, value in want.items():
            assert state[key].dtype == value.dtype and torch.equal(state[key], value.detach()), key


# the standard library's own names with a leading underscore that are documented API (not a private touch)
_DOCUMENTED_UNDERSCORE_NAMES = {"_exit"}  # os._exit
_PRIVATE_MODULES = {"_transformers_private.py", "_deepspeed_private.py", "_hooks.py"}
_DEPENDENCIES = ("transformers", "deepspeed", "accelerate", "torch", "huggingface_hub", "safetensors")


def _private_name(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_private_api_is_touched_only_in_the_private_modules():
    """Every private name of a dependency the package touches is in `_transformers_private.py` or
    `_deepspeed_private.py` (docs/compatibility.md): elsewhere, no `from <dependency> import _name` and no attribute
    `x._name` unless the package defines `_name` itself (a function, class, argument, variable or attribute set
    outside those two modules)."""
    import ast
    import pathlib

    import hf_zero3_loader

    root = pathlib.Path(hf_zero3_loader.__file__).parent
    files = sorted(p for p in root.rglob("*.py") if p.name not in _PRIVATE_MODULES)
    trees = {p: ast.parse(p.read_text(), str(p)) for p in files}
    own = set(_DOCUMENTED_UNDERSCORE_NAMES)
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                own.add(node.asname)
    found = []
    for path, tree in trees.items():
        where = path.relative_to(root.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] in _DEPENDENCIES:
                private_module = any(_private_name(part) for part in node.module.split("."))
                for alias in node.names:
                    if private_module or _private_name(alias.name):
                        found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] in _DEPENDENCIES and any(_private_name(part) for part in parts):
                        found.append(f"{where}:{node.lineno}: import {alias.name}")
            elif isinstance(node, ast.Attribute) and _private_name(node.attr) and node.attr not in own:
                found.append(f"{where}:{node.lineno}: .{node.attr}")
    assert not found, ("private names of a dependency touched outside _transformers_private.py / "
                       "_deepspeed_private.py:\n" + "\n".join(sorted(found)))
