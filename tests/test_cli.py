"""The command line: `plan` (what each rank reads, predicted memory, does it fit, the smallest ep_size that would) and
`verify` (a real multi-rank load compared with the plain one). `plan`'s load predictions are checked against the
measured peaks of real loads, ours and transformers' own ZeRO-3 path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.checkpoints import ep_config, make_checkpoint
from tests.conftest import ROOT, python_path
from tests.test_expert_parallel import plain_fp32_params

sys.path.insert(0, os.path.join(ROOT, "scripts"))

MiB = 1 << 20


def _cli(*args: str, own_process: bool = False) -> subprocess.CompletedProcess:
    """`hf-zero3-loader ARGS`. `plan` reads headers only: it runs in this process (the command's `main`, its output
    captured), which spares each call a new interpreter's imports; `verify` launches ranks, and `own_process` runs
    the console entry itself."""
    if args[0] != "plan" or own_process:
        return subprocess.run([sys.executable, "-m", "hf_zero3_loader.cli", *args], capture_output=True, text=True,
                              timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": python_path()})
    import contextlib
    import io

    from hf_zero3_loader.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's refusals
            code = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def bench_checkpoint(workdir):
    """~130 MB of bf16 Qwen3-MoE (32 experts, 4 layers): experts dominate, as in real MoE models."""
    from _bench_common import make_checkpoint as make_bench_checkpoint

    path = os.path.join(workdir, "bench_test_ckpt")
    make_bench_checkpoint(path, "test")
    return path


def test_plan_prints_reads_memory_and_the_smallest_ep_size_that_fits(bench_checkpoint):
    path = bench_checkpoint
    human = _cli("plan", path, "--world-size", "4", own_process=True)
    assert human.returncode == 0, human.stderr[-3000:]
    for part in ("qwen3_moe", "world size 4", "conversions: Concatenate, MergeModulelist", "read", "ours host",
                 "after deepspeed.initialize", "largest all-gather in a forward pass: model.layers.0.mlp.experts"):
        assert part in human.stdout, (part, human.stdout)
    plain = json.loads(_cli("plan", path, "--world-size", "4", "--json").stdout)
    ep = json.loads(_cli("plan", path, "--world-size", "4", "--ep-size", "2", "--json").stdout)
    # the same bytes are read either way, split differently
    assert sum(r["bytes_to_read"] for r in plain["ranks"]) == sum(r["bytes_to_read"] for r in ep["ranks"]) == \
        plain["checkpoint_bytes"]
    # expert parallelism gathers half of a MoE layer's experts
    assert ep["train"]["largest_layer_params"] * 2 == plain["train"]["largest_layer_params"]
    # a device too small for plain ZeRO-3, big enough with the experts split
    need_plain, need_ep = plain["train"]["device_bytes"], ep["train"]["device_bytes"]
    assert need_ep < need_plain
    gib = (need_ep + need_plain) / 2 / (1 << 30)
    tight = json.loads(_cli("plan", path, "--world-size", "4", "--device-memory", str(gib), "--json").stdout)
    assert tight["fits"] is False and tight["smallest_ep_size_that_fits"] in (2, 4)


def test_plan_predicts_the_host_memory_of_the_accelerator_path_and_of_offloading(bench_checkpoint):
    """On an accelerator the partitions reach the device through the staging buffer (64 MiB by default), so the host
    holds that, not the share (measured on an H100: README, "GPU"); partitions offloaded to the host are the share in
    host memory; to NVMe, a wave of the staging budget and DeepSpeed's swap buffers. Nothing on the device."""
    from hf_zero3_loader.cli import plan_report
    from hf_zero3_loader.planner.memory import OURS_OVERHEAD
    from hf_zero3_loader.staging import DEFAULT_STAGING_BYTES

    on_device = plan_report(bench_checkpoint, 1, device="cuda")["ranks"]  # a share over 64 MiB
    on_host = plan_report(bench_checkpoint, 1, device="cpu")["ranks"]
    for device_rank, host_rank in zip(on_device, on_host):
        share = host_rank["load_ours_host_bytes"] - OURS_OVERHEAD
        assert share > DEFAULT_STAGING_BYTES
        assert device_rank["load_ours_host_bytes"] == DEFAULT_STAGING_BYTES + OURS_OVERHEAD
        assert device_rank["load_ours_device_bytes"] == share
    for device in ("cpu", "nvme"):
        config = {"zero_optimization": {"stage": 3, "offload_param": {"device": device, "buffer_count": 4,
                                                                      "buffer_size": 1e6}}, "bf16": {"enabled": True}}
        for offloaded, host_rank in zip(plan_report(bench_checkpoint, 1, ds_config=config)["ranks"], on_host):
            nvme = DEFAULT_STAGING_BYTES + 4 * 10**6 * 2 + OURS_OVERHEAD  # a wave, and 4 swap buffers of bf16
            want = nvme if device == "nvme" else host_rank["load_ours_host_bytes"]
            assert offloaded["load_ours_host_bytes"] == want
            assert offloaded["load_ours_device_bytes"] == 0


@pytest.fixture(scope="module")
def measured(workdir, bench_checkpoint):
    """Real 2-rank loads (ours, transformers' ZeRO-3 path) of a ~130 MB checkpoint, measured as the benchmark does."""
    from _bench_common import launch, warm_page_cache

    ckpt = bench_checkpoint
    out = {}
    for variant in ("ours", "upstream"):
        result = os.path.join(workdir, f"measured_{variant}.json")
        warm_page_cache(ckpt)
        wall, rc = launch(2, ["--variant", variant, "--path", ckpt, "--result", result], result + ".log", 600)
        assert rc == 0, open(result + ".log").read()[-4000:]
        with open(result) as f:
            out[variant] = json.load(f)
    return ckpt, out


@pytest.mark.sweep
def test_plan_predicts_the_memory_of_real_loads(measured):
    """Host memory on CPU ranks: predicted vs the measured peak RSS growth, within 20% + 32 MiB."""
    ckpt, runs = measured
    report = json.loads(_cli("plan", ckpt, "--world-size", "2", "--device", "cpu", "--json").stdout)
    for variant, key in (("ours", "load_ours_host_bytes"), ("upstream", "load_upstream_host_bytes")):
        for r in runs[variant]:
            predicted = report["ranks"][r["rank"]][key]
            actual = r["rss_growth"]
            assert abs(actual - predicted) <= 0.2 * predicted + 32 * MiB, (
                f"{variant} rank {r['rank']}: predicted {predicted / MiB:.0f} MiB, measured {actual / MiB:.0f} MiB")
    # and the bytes each rank reads are exactly the plan's
    assert [r["bytes_read"] for r in runs["ours"]] == [r["bytes_to_read"] for r in report["ranks"]]


@pytest.mark.sweep
def test_verify_compares_a_real_load_with_the_plain_one(workdir):
    """With expert parallelism (the next test verifies a load without it)."""
    path = make_checkpoint(os.path.join(workdir, "ep_qwen3_moe"), "qwen3_moe", config=ep_config("qwen3_moe"))
    for args in (("--world-size", "2", "--ep-size", "2"),):
        result = _cli("verify", path, *args, "--json")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        report = json.loads(result.stdout)
        assert report["ok"] and report["compared"] >= 27 and not report["problems"], report


def test_verify_takes_a_deepspeed_config_and_a_port_and_reports_a_ranks_error_in_one_line(workdir, tmp_path):
    """--ds-config is the ranks' DeepSpeed config (its dtype, with no --dtype, is both loads'), --port torchrun's. A
    rank's error is one line naming the rank (not both ranks' tracebacks and torchrun's ChildFailedError); the ranks'
    whole output is in the log file the line names."""
    import re

    from tests.conftest import free_port

    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    config = tmp_path / "ds_fp32.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}))
    result = _cli("verify", path, "--world-size", "2", "--ds-config", str(config), "--port", str(free_port()),
                  "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["dtype"] == "float32" and report["compared"] >= 27, report

    weightless = tmp_path / "weightless"  # a folder with the config and no weights: every rank's load fails
    weightless.mkdir()
    (weightless / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    failed = _cli("verify", str(weightless), "--world-size", "2")
    assert failed.returncode == 1 and "Traceback" not in failed.stderr and "ChildFailedError" not in failed.stderr
    lines = failed.stderr.strip().splitlines()[-2:]
    assert re.fullmatch(r"hf-zero3-loader verify: ranks? [\d, ]+: OSError: .*no file named model\.safetensors.*",
                        lines[0]), failed.stderr[-3000:]
    log = re.fullmatch(r"hf-zero3-loader verify: the ranks' full output is in (\S+) .*", lines[1])
    assert log and "Traceback" in open(log[1]).read(), lines[1]
    os.remove(log[1])


def test_verify_refuses_what_it_cannot_launch_in_one_line(workdir, tmp_path, capsys):
    """Before launching anything: a checkpoint folder that is not there (a typo), a --ds-config that is missing, not
    ZeRO-3, or in another dtype than --dtype."""
    from hf_zero3_loader.cli import main

    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    zero2, bf16 = tmp_path / "zero2.json", tmp_path / "bf16.json"
    zero2.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    bf16.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    typo = path + "_typo"
    capsys.readouterr()  # the checkpoint's writing
    for args, said in (([typo], f"no such folder: {typo}"),
                       ([path, "--ds-config", str(tmp_path / "none.json")], "cannot read --ds-config"),
                       ([path, "--ds-config", str(zero2)], "is ZeRO stage 2: verify checks ZeRO-3 loads"),
                       ([path, "--ds-config", str(bf16), "--dtype", "float32"],
                        "--dtype float32 conflicts with --ds-config")):
        assert main(["verify", *args, "--world-size", "2"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("hf-zero3-loader verify: ") and said in err, err


def test_plan_prints_sizes_in_units_that_suit_them_and_words_a_cpu_run_so(workdir, capsys):
    """A small model: thousands of parameters (not "0.00B"), KiB read (not a "GiB" column of KiB); with --device cpu
    (the default on a machine without a GPU) the partitions are in host memory, and no column or line says device."""
    import re

    from hf_zero3_loader.cli import default_device, main

    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    capsys.readouterr()
    assert main(["plan", path, "--world-size", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"qwen3_moe, \d+\.\dK parameters, [\d.]+ KiB on disk", out), out
    assert "partitions on the CPU (host memory)" in out and "dev" not in out and "device" not in out, out
    assert re.search(r"^\s+0\s+[\d.]+ KiB\s+\d+ \|", out, re.M), out
    assert re.search(r"per rank: [\d.]+ KiB of host memory", out), out
    assert main(["plan", path, "--world-size", "2"]) == 0
    default = capsys.readouterr().out
    assert ("partitions on the CPU" in default) == (default_device() == "cpu"), default


def test_a_dependency_warning_repeated_per_layer_shows_once_while_the_loader_runs():
    """AutoEP warns once per MoE layer it replaces (DeepSeek-V3's `routed_scaling_factor`: 58 identical lines per
    rank, for every ep_size `plan` tries): while the loader runs, each distinct DeepSpeed message shows once; outside
    it, DeepSpeed's logging is as it was."""
    import logging

    from deepspeed.utils import logger as deepspeed_logger

    from hf_zero3_loader.log import each_dependency_message_once

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    deepspeed_logger.addHandler(handler)
    try:
        with each_dependency_message_once():
            for layer in range(3):
                deepspeed_logger.warning("AutoEP: routed_scaling_factor=%s overrides route_scale=%s.", 2.5, 2.5)
                deepspeed_logger.warning("layer %d replaced", layer)
        deepspeed_logger.warning("AutoEP: routed_scaling_factor=%s overrides route_scale=%s.", 2.5, 2.5)
    finally:
        deepspeed_logger.removeHandler(handler)
    assert seen == ["AutoEP: routed_scaling_factor=2.5 overrides route_scale=2.5.", "layer 0 replaced",
                    "layer 1 replaced", "layer 2 replaced",
                    "AutoEP: routed_scaling_factor=2.5 overrides route_scale=2.5."]


@pytest.mark.sweep
def test_verify_compares_a_router_the_plain_load_keeps_in_fp32_in_the_engines_dtype(workdir):
    """GLM-4.5 MoE's router, which transformers 5.24 keeps in fp32 (`_keep_in_fp32_modules_strict`; 5.23 does not):
    loaded in the engine's dtype by default (as zero.Init casts it), it equals the plain values cast, and is listed;
    with `keep_in_fp32` it equals them in fp32."""
    path = make_checkpoint(os.path.join(workdir, "ep_glm4_moe"), "glm4_moe", config=ep_config("glm4_moe"))
    ep = ("--ep-size", "2", "--expert-parallel", '{"preset_model": "deepseek_v3"}')
    for args, kept in ((ep, False), ((), True)):
        keep = ("--keep-in-fp32",) if kept else ()
        result = _cli("verify", path, "--world-size", "2", *args, *keep, "--json")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        report = json.loads(result.stdout)
        assert report["ok"] and not report["problems"], report
        routers = [n for n in report["in_engine_dtype"] if "gate.weight" in n]
        kept_by_plain = any("gate.weight" in n for n in plain_fp32_params(path, "bfloat16"))
        assert not (kept and report["in_engine_dtype"]) and (kept or bool(routers) == kept_by_plain), report


@pytest.mark.sweep
def test_plan_and_verify_take_the_structure_named_for_a_model_type_without_an_autoep_preset(workdir):
    """MiniMax-M2 has no DeepSpeed AutoEP preset; a config naming one of the same structure gives it EP in `plan`
    (its `--ds-config`) and in `verify` (`--expert-parallel`), as in a load. Without it, `plan` says how to name it."""
    path = make_checkpoint(os.path.join(workdir, "ep_minimax_m2"), "minimax_m2", config=ep_config("minimax_m2"))
    refused = _cli("plan", path, "--world-size", "2", "--ep-size", "2")
    assert refused.returncode != 0 and "'minimax_m2' has none" in refused.stderr and "preset_model" in refused.stderr
    config = os.path.join(workdir, "ds_minimax_m3_preset.json")
    with open(config, "w") as f:
        json.dump({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                   "expert_parallel": {"preset_model": "minimax_m3"}}, f)
    plain = json.loads(_cli("plan", path, "--world-size", "2", "--json").stdout)
    ep = json.loads(_cli("plan", path, "--world-size", "2", "--ep-size", "2", "--ds-config", config, "--json").stdout)
    assert ep["ep_size"] == 2 and ep["train"]["largest_layer_params"] < plain["train"]["largest_layer_params"]
    with open(config, "w") as f:  # EP asked in the config alone, as a load takes it
        json.dump({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                   "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "minimax_m3"}}, f)
    assert json.loads(_cli("plan", path, "--world-size", "2", "--ds-config", config, "--json").stdout) == ep
    result = _cli("verify", path, "--world-size", "2", "--ep-size", "2", "--expert-parallel",
                  '{"preset_model": "minimax_m3"}', "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["ep_size"] == 2 and not report["problems"], report


@pytest.mark.sweep
def test_plan_and_verify_take_expert_parallelism_over_one_module_per_expert(workdir):
    """DeepSeek-V3 with its hub code (`--trust-remote-code`; one module per expert): `plan` gives each rank its local
    experts' share, and `verify` finds AutoEP's stacked expert tensors equal to the plain load's expert modules."""
    from tests.test_expert_parallel import REMOTE
    from tests.test_expert_parallel import checkpoint as ep_checkpoint

    path = ep_checkpoint(workdir, REMOTE)
    plain = json.loads(_cli("plan", path, "--world-size", "2", "--trust-remote-code", "--json").stdout)
    result = _cli("plan", path, "--world-size", "2", "--ep-size", "2", "--trust-remote-code", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    ep = json.loads(result.stdout)
    assert ep["ep_size"] == 2 and ep["train"]["largest_layer_params"] < plain["train"]["largest_layer_params"]
    result = _cli("verify", path, "--world-size", "2", "--ep-size", "2", "--trust-remote-code", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["ep_size"] == 2 and not report["problems"] and report["compared"] >= 30, report


@pytest.mark.sweep
def test_plan_and_verify_pick_a_vision_language_models_own_auto_class(workdir):
    """A Qwen3-VL-MoE checkpoint (its config names `Qwen3VLMoeForConditionalGeneration`, which no causal-LM class
    builds): without --model-class, `plan` and `verify` load it through `AutoModelForImageTextToText`, and take EP
    from the structure the config names (its language model's layers, its top_k)."""
    from transformers import AutoModelForImageTextToText

    from tests.checkpoints import EP_NAMED_STRUCTURE

    path = make_checkpoint(os.path.join(workdir, "ep_qwen3_vl_moe"), "qwen3_vl_moe", config=ep_config("qwen3_vl_moe"),
                           model_class=AutoModelForImageTextToText)
    config = os.path.join(workdir, "ds_qwen3_vl_moe.json")
    with open(config, "w") as f:
        json.dump({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                   "expert_parallel": {"enabled": True, "autoep_size": 2, **EP_NAMED_STRUCTURE["qwen3_vl_moe"]}}, f)
    result = _cli("plan", path, "--world-size", "2", "--ds-config", config, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["model_type"] == "qwen3_vl_moe" and report["ep_size"] == 2
    result = _cli("verify", path, "--world-size", "2", "--ep-size", "2", "--expert-parallel",
                  json.dumps(EP_NAMED_STRUCTURE["qwen3_vl_moe"]), "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["ep_size"] == 2 and not report["problems"], report


def test_plan_takes_a_dense_model_under_a_config_with_expert_parallelism_as_the_load_does(workdir):
    """A MoE run's config (`expert_parallel` enabled) given for a dense model: the load loads it as plain ZeRO-3, and
    so `plan` plans it, saying why; EP asked of the plan itself (`--ep-size`) is refused, as by a load."""
    from hf_zero3_loader.cli import plan_report
    from hf_zero3_loader.errors import ConfigError

    path = make_checkpoint(os.path.join(workdir, "plan_dense_llama"), "llama_untied")
    config = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
              "expert_parallel": {"enabled": True, "autoep_size": 2}}
    report = plan_report(path, 2, ds_config=config)
    plain = plan_report(path, 2)
    assert report["ranks"] == plain["ranks"] and report["train"] == plain["train"]
    assert any("has no experts: planned as plain ZeRO-3" in w for w in report["warnings"]), report["warnings"]
    with pytest.raises(ConfigError, match="'llama' has none"):
        plan_report(path, 2, ep_size=2)


@pytest.mark.sweep
def test_verify_checks_params_the_models_init_never_writes_are_zeros_and_lists_them(workdir):
    """A plain load leaves uninitialised memory in them: nothing to compare, so they are checked to be zeros instead
    of reported as mismatches."""
    from tests.families import TALKER_EXPERTS, omni_without_talker_experts

    result = _cli("verify", omni_without_talker_experts(workdir), "--world-size", "2", "--dtype", "float32",
                  "--model-class", "AutoModelForTextToWaveform")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.startswith("OK: ") and "4 missing tensors that the model's own init never writes are " \
        "zeros here" in result.stdout, result.stdout
    listed = result.stdout.splitlines()[-1].split(": ", 1)[1].split(", ")
    assert len(listed) == 4 and all(TALKER_EXPERTS.match(name) for name in listed), listed


@pytest.mark.sweep
def test_plan_and_verify_take_the_location_keywords_of_from_pretrained(workdir, monkeypatch):
    """--subfolder, --cache-dir, --variant, --no-safetensors, --trust-remote-code: the files and the code
    `from_pretrained(...)` with the same keywords would use (a hub repo with its own modeling code, a model in a
    subfolder, a repo id in a hub cache of its own)."""
    import shutil

    from tests.checkpoints import remote_code_checkpoint

    llama = make_checkpoint(os.path.join(workdir, "llama_untied"), "llama_untied")
    custom = remote_code_checkpoint(llama, os.path.join(workdir, "remote_code"))
    refused = _cli("plan", custom, "--world-size", "2")
    assert refused.returncode == 2 and "--trust-remote-code" in refused.stderr, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    result = _cli("plan", custom, "--world-size", "2", "--trust-remote-code", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["model_type"] == "custom_llama" and not report["warnings"], report
    assert sum(r["bytes_to_read"] for r in report["ranks"]) == report["checkpoint_bytes"]

    root = os.path.join(workdir, "cli_hub_layout")
    if not os.path.exists(os.path.join(root, "lm")):
        shutil.copytree(llama, os.path.join(root, "lm"))
    inner = json.loads(_cli("plan", os.path.join(root, "lm"), "--world-size", "3", "--json").stdout)
    nested = json.loads(_cli("plan", root, "--subfolder", "lm", "--world-size", "3", "--json").stdout)
    assert nested["ranks"] == inner["ranks"]
    cache = os.path.join(workdir, "cli_hub_cache")  # a repo id in a hub cache named by --cache-dir (cache_dir=)
    snapshot = os.path.join(cache, "models--org--llama", "snapshots", "2" * 40)
    if not os.path.exists(snapshot):
        shutil.copytree(llama, snapshot)
        os.makedirs(os.path.join(cache, "models--org--llama", "refs"))
        with open(os.path.join(cache, "models--org--llama", "refs", "main"), "w") as f:
            f.write("2" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached = json.loads(_cli("plan", "org/llama", "--cache-dir", cache, "--world-size", "3", "--json").stdout)
    assert cached["ranks"] == inner["ranks"]

    result = _cli("verify", custom, "--world-size", "2", "--dtype", "float32", "--trust-remote-code", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] and not report["problems"] and report["compared"] >= 13, report


def test_plan_says_what_the_load_refuses_in_a_checkpoint_short_of_experts(workdir):
    """A checkpoint lacking one expert's tensors: `plan` warns that the load refuses the fused tensor (naming it) as
    the load does; lacking one expert's gate projection only, `plan` fails with the load's own refusal."""
    from tests.checkpoints import rewrite_checkpoint
    from transformers import AutoModelForCausalLM

    from hf_zero3_loader.cli import plan_report
    from hf_zero3_loader.errors import CheckpointError

    single = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    no_expert = rewrite_checkpoint(single, os.path.join(workdir, "cli_missing_expert"), lambda t: {
        k: v for k, v in t.items() if ".layers.1.mlp.experts.3." not in k})
    report = plan_report(no_expert, 2, None, None, None, "cuda", AutoModelForCausalLM)
    assert any("have another shape in the checkpoint" in w and "model.layers.1.mlp.experts.down_proj" in w
               and "the load refuses them" in w for w in report["warnings"]), report["warnings"]
    no_gate = rewrite_checkpoint(single, os.path.join(workdir, "cli_missing_gate_proj"), lambda t: {
        k: v for k, v in t.items() if k != "model.layers.1.mlp.experts.3.gate_proj.weight"})
    with pytest.raises(CheckpointError, match=r"gate_up_proj: lacks model\.layers\.1\.mlp\.experts\.3\.gate_proj"):
        plan_report(no_gate, 2, None, None, None, "cuda", AutoModelForCausalLM)


def test_plan_says_the_load_refuses_a_head_whose_body_transformers_does_not_map(workdir):
    """Qwen3-MoE's question-answering head (body `transformer.`) from its causal LM's checkpoint (`model.`): `plan`
    says the load refuses the body's tensors, naming a pair, as the load does (ConversionMismatchError)."""
    from transformers import AutoModelForQuestionAnswering

    from hf_zero3_loader.cli import plan_report

    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    report = plan_report(path, 2, None, None, None, "cuda", AutoModelForQuestionAnswering)
    assert any("transformer.embed_tokens.weight <- model.embed_tokens.weight" in w and "ConversionMismatchError" in w
               for w in report["warnings"]), report["warnings"]


def test_plan_refuses_a_config_that_is_not_zero3_saying_what_the_load_does_there(workdir, tmp_path, capsys):
    """Under ZeRO-0/1/2 every rank loads the whole model: no partitions to predict (it printed ZeRO-3 figures)."""
    from hf_zero3_loader.cli import main

    path = make_checkpoint(os.path.join(workdir, "qwen3_moe"), "qwen3_moe")
    config = tmp_path / "zero2.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    assert main(["plan", path, "--world-size", "2", "--ds-config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "ZeRO stage 2: there every rank loads the whole model" in err, err
