"""The accelerator path (skipped without one): world size 1 over NCCL, partitions on the GPU (or offloaded to the
host), every gathered parameter and buffer bit- and dtype-equal to the plain load; expert parallelism on the GPU trains
like engine-side AutoEP."""

from __future__ import annotations

import os

import pytest
import torch

from tests.checkpoints import make_checkpoint, remote_code_moe_checkpoint
from tests.conftest import run_torchrun
from tests.dist_worker import ds_config_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NCCL = {"HF_ZERO3_TEST_BACKEND": "nccl"}
TORCH_ADAM = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}  # no JIT-built fused Adam


def _plain(path: str, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return {n: t.detach() for n, t in [*model.named_parameters(remove_duplicate=False),
                                        *model.named_buffers(remove_duplicate=False)]}


def test_gpu_load_equals_plain_load(workdir):
    cases = []
    for family, sharded in (("qwen3_moe", True), ("llama_tied", False), ("mixtral", False)):
        path = make_checkpoint(os.path.join(workdir, f"gpu_{family}"), family, sharded=sharded)
        for dtype in ("bfloat16", "float32"):
            cases.append({"name": f"{family}/{dtype}", "path": path, "dtype": dtype,
                          "out": os.path.join(workdir, f"gpu_{family}_{dtype}.pt")})
    for case, dump in zip(cases, run_torchrun(1, cases, workdir, env=NCCL)):
        got = dump["rank0"]
        assert "error" not in got, f"{case['name']}: {got.get('error', {}).get('traceback')}"
        ref = _plain(case["path"], getattr(torch, case["dtype"]))
        assert set(got["state"]) == set(ref), case["name"]
        for name, want in ref.items():
            actual = got["state"][name]
            assert actual.dtype == want.dtype and torch.equal(actual, want), f"{case['name']} {name}"


def test_gpu_expert_parallel_trains_like_engine_side_autoep(workdir):
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    # sizes a multiple of 8 elements: DeepSpeed's grouped GEMM on the GPU needs 16-byte strides
    config_ = Qwen3MoeConfig(vocab_size=128, hidden_size=64, head_dim=16, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                             num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    fused = make_checkpoint(os.path.join(workdir, "gpu_ep_qwen3_moe"), "qwen3_moe", config=config_)
    # and the hub's DeepSeek-V3 code, one module per expert (AutoEP's per-expert storage, stacked on the GPU)
    remote = remote_code_moe_checkpoint(os.path.join(workdir, "gpu_ep_deepseek_v3_remote"), config=DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, n_group=2, topk_group=1, max_position_embeddings=64, tie_word_embeddings=False))
    config = ds_config_for("bfloat16", {"expert_parallel": {"enabled": True, "autoep_size": 1}, **TORCH_ADAM})
    cases = [{"name": f"{kind} {variant}", "path": path, "dtype": "bfloat16", "ds_config": config,
              "upstream": variant == "engine", "train_steps": 3, "kwargs": kwargs,
              "out": os.path.join(workdir, f"gpu_ep_{kind}_{variant}.pt")}
             for kind, path, kwargs in (("fused", fused, {}), ("remote", remote, {"trust_remote_code": True}))
             for variant in ("ours", "engine")]
    dumps = run_torchrun(1, cases, workdir, env=NCCL)
    for dump in dumps:
        assert "error" not in dump["rank0"], dump["rank0"].get("error", {}).get("traceback")
    for ours, engine in (dumps[0:2], dumps[2:4]):
        assert ours["rank0"]["report"]["init_context"] == "ep-meta"
        assert ours["rank0"]["losses"] == engine["rank0"]["losses"]


def test_gpu_staging_is_bounded_by_the_budget_and_bit_exact(workdir):
    """Partitions on the GPU are filled through one pinned host buffer of `staging_bytes`: no host allocation while
    filling them exceeds it, however large the partitions (the whole checkpoint here, at world size 1)."""
    budget = 16 << 10  # 2 slots of 8 KiB; the bf16 checkpoint is ~57 KiB
    path = make_checkpoint(os.path.join(workdir, "gpu_staging_qwen3_moe"), "qwen3_moe", sharded=True)
    cases = [{"name": f"staging/{dtype}", "path": path, "dtype": dtype, "measure_staging": True,
              "kwargs": {"staging_bytes": budget, "read_threads": 1},
              "out": os.path.join(workdir, f"gpu_staging_{dtype}.pt")} for dtype in ("bfloat16", "float32")]
    for case, dump in zip(cases, run_torchrun(1, cases, workdir, env=NCCL)):
        got = dump["rank0"]
        assert "error" not in got, f"{case['name']}: {got.get('error', {}).get('traceback')}"
        staging = got["report"]["staging"]
        assert staging["pinned"] and staging["buffer_bytes"] <= budget
        assert staging["bytes_copied"] > budget  # more than the budget went through it
        assert 0 < got["staging_largest_allocation_bytes"] <= budget, got["staging_largest_allocation_bytes"]
        ref = _plain(case["path"], getattr(torch, case["dtype"]))
        assert set(got["state"]) == set(ref), case["name"]
        for name, want in ref.items():
            actual = got["state"][name]
            assert actual.dtype == want.dtype and torch.equal(actual, want), f"{case['name']} {name}"


def test_gpu_offloaded_partitions_are_read_in_place(workdir):
    """`offload_param: cpu`: the partitions live on the host, page-locked as zero.Init pins them, so they are read in
    place; nothing goes through the staging buffer (no parameter persists on the device with the persistence
    threshold at 0, and this model loads no buffer), and the gathered state is the plain load's."""
    path = make_checkpoint(os.path.join(workdir, "gpu_offload_qwen3_moe"), "qwen3_moe", sharded=True)
    zero = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}, "stage3_param_persistence_threshold": 0}
    case = {"name": "offload_param", "path": path, "dtype": "bfloat16", "ds_config": ds_config_for("bfloat16",
            {"zero_optimization": zero}), "out": os.path.join(workdir, "gpu_offload.pt")}
    (dump,) = run_torchrun(1, [case], workdir, env=NCCL)
    got = dump["rank0"]
    assert "error" not in got, got.get("error", {}).get("traceback")
    assert "staging" not in got["report"], got["report"]["staging"]
    partitions = got["partitions"]
    assert partitions["devices"] == ["cpu"] and partitions["pinned"] == partitions["count"] > 0, partitions
    ref = _plain(path, torch.bfloat16)
    assert set(got["state"]) == set(ref)
    for name, want in ref.items():
        actual = got["state"][name]
        assert actual.dtype == want.dtype and torch.equal(actual, want), name


def test_gpu_missing_keys_are_initialised_as_the_plain_load_does(workdir):
    """A checkpoint without its second layer: the missing params are gathered on the GPU but initialised in host
    memory (`missing_init.on_host`), so a seeded load gives the plain CPU load's values, not CUDA's generator's; in
    one step (default budget) and one param at a time (a 4 KiB budget). Qwen3-Next's init also draws beside a loaded
    param, shaped and placed by it: that draw takes the CPU generator too (host stand-ins), or the later ones differ."""
    from tests.checkpoints import rewrite_checkpoint
    from tests.families import small_config
    from tests.test_families import load_failure

    def dropped(key: str) -> bool:  # Qwen3-Next: also layer 0's `dt_bias`, beside a loaded `A_log` whose init draws
        return ".layers.1." in key or key.endswith("dt_bias")  # (`torch.empty(n, device=A_log.device).uniform_()`)

    cases = []
    for family in ("qwen3_moe", "llama_tied", "qwen3_next"):
        config = small_config(family) if family == "qwen3_next" else None
        src = make_checkpoint(os.path.join(workdir, f"gpu_full_{family}"), family, config=config)
        path = rewrite_checkpoint(src, os.path.join(workdir, f"gpu_missing_{family}"),
                                  lambda tensors: {k: v for k, v in tensors.items() if not dropped(k)})
        for budget in (None, 4096):
            kwargs = {"allow_suspicious_missing_keys": True, **({"missing_init_budget_bytes": budget} if budget else {})}
            cases.append({"name": f"{family}, budget {budget}", "path": path, "dtype": "float32", "seed": 11,
                          "kwargs": kwargs, "out": os.path.join(workdir, f"gpu_missing_{family}_{budget}.pt")})
    dumps = run_torchrun(1, cases, workdir, env=NCCL)
    failures = [f for case, dump in zip(cases, dumps) if (f := load_failure(case, dump, seed=11))]
    assert not failures, "\n".join(failures)


def test_gpu_every_family_in_the_sweep_equals_the_plain_load(workdir):
    """The staged path as users get it (pinned slots, copies on a side stream, slots reused after their copy's event)
    over every family in the sweep, at world size 1 with a 64 KiB budget and 2 reader threads: bit- and dtype-equal
    to the plain load."""
    from tests.families import SWEEP, sweep_checkpoint
    from tests.test_families import load_failure

    cases = [{"name": t, "path": sweep_checkpoint(workdir, t), "dtype": "float32",
              "kwargs": {"staging_bytes": 64 << 10, "read_threads": 2},
              "out": os.path.join(workdir, f"gpu_sweep_{t}.pt")} for t in SWEEP]
    dumps = run_torchrun(1, cases, workdir, timeout=1500, env=NCCL)
    failures = [f for case, dump in zip(cases, dumps) if (f := load_failure(case, dump))]
    failures += [f"{case['name']}: not staged" for case, dump in zip(cases, dumps)
                 if "error" not in dump["rank0"] and not dump["rank0"]["report"].get("staging", {}).get("pinned")]
    assert not failures, "\n".join(failures)


def test_gpu_fp8_and_mxfp4_dequantized_on_read_equal_the_plain_dequantized_load(workdir):
    """FP8 (DeepSeek-V3 with 128x128 blocks, Llama with 128x64) and MXFP4 (GPT-OSS) checkpoints, dequantized while
    read as users ask for it on a GPU (`dequantize=True`): each computed piece goes through the pinned staging slots to
    the GPU partitions, bit- and dtype-equal to the plain dequantized load."""
    from tests.checkpoints import fp8_checkpoint, gpt_oss_config, mxfp4_checkpoint
    from tests.test_quantized import _deepseek_v3_fp8_config, _llama_fp8_config, _quant_key, plain, plain_fp32_params

    def d(name):
        return os.path.join(workdir, "gpu_quant", name)

    deepseek = make_checkpoint(d("deepseek_v3_bf16"), "d", dtype=torch.bfloat16, config=_deepseek_v3_fp8_config())
    llama = make_checkpoint(d("llama_bf16"), "l", dtype=torch.bfloat16, config=_llama_fp8_config())
    gpt_oss = make_checkpoint(d("gpt_oss_bf16"), "g", dtype=torch.bfloat16, config=gpt_oss_config())
    fp8, mxfp4 = {"quant_method": "fp8", "dequantize": True}, {"quant_method": "mxfp4", "dequantize": True}
    checkpoints = {"fp8 deepseek_v3": (fp8_checkpoint(deepseek, d("deepseek_v3_fp8")), fp8),
                   "fp8 llama 128x64": (fp8_checkpoint(llama, d("llama_fp8"), block=(128, 64)), fp8),
                   "mxfp4 gpt_oss": (mxfp4_checkpoint(gpt_oss, d("gpt_oss_mxfp4")), mxfp4)}
    # a plain load keeping routers in fp32 (DeepSeek-V3's `gate.weight` from transformers 5.24) is compared with
    # `keep_in_fp32=True`, as on CPU ranks (tests/test_quantized.py)
    cases = [{"name": name, "path": path, "dtype": "bfloat16",
              "kwargs": {"quantization_config": spec, "staging_bytes": 64 << 10,
                         "keep_in_fp32": bool(plain_fp32_params(path, _quant_key(spec), "AutoModelForCausalLM"))},
              "out": os.path.join(workdir, f"gpu_quant_{i}.pt")}
             for i, (name, (path, spec)) in enumerate(checkpoints.items())]
    for case, dump in zip(cases, run_torchrun(1, cases, workdir, env=NCCL)):
        got = dump["rank0"]
        assert "error" not in got, f"{case['name']}: {got.get('error', {}).get('traceback')}"
        assert got["report"]["staging"]["pinned"], case["name"]
        spec = case["kwargs"]["quantization_config"]
        reference = plain(case["path"], _quant_key(spec), "AutoModelForCausalLM")
        assert set(got["state"]) == set(reference), case["name"]
        for name, want in reference.items():
            actual = got["state"][name]
            assert actual.dtype == want.dtype and torch.equal(actual, want), f"{case['name']} {name}"


def test_gpu_nvme_offloaded_partitions_equal_the_plain_load_and_train_like_transformers(workdir):
    """`offload_param: nvme` on the GPU: partitions read in waves in host memory, swapped out to NVMe, the gathered
    state the plain load's; trained, the losses of transformers' own ZeRO-3 path (also from NVMe)."""
    from hf_zero3_loader.deepspeed_setup import async_io_buildable
    from tests.test_nvme_offload import WAVE, _moe_config, nvme_config

    if not async_io_buildable():
        pytest.skip("DeepSpeed's async_io op needs libaio")
    path = make_checkpoint(os.path.join(workdir, "gpu_nvme_qwen3_moe"), "qwen3_moe", dtype=torch.bfloat16,
                           config=_moe_config(vocab_size=1024))
    cases = [{"name": variant, "path": path, "dtype": "bfloat16", "upstream": variant == "upstream",
              "ds_config": nvme_config("bfloat16", os.path.join(workdir, "gpu_nvme_swap", variant)),
              "kwargs": {} if variant == "upstream" else {"staging_bytes": WAVE},
              "train_steps": 2, "out": os.path.join(workdir, f"gpu_nvme_{variant}.pt")}
             for variant in ("ours", "upstream")]
    for case in cases:  # at world size 1 a partition is a whole tensor: the fused experts are 2M elements
        case["ds_config"]["zero_optimization"]["offload_param"].update(buffer_size=1 << 21, buffer_count=16)
    ours, upstream = run_torchrun(1, cases, workdir, env=NCCL)
    for dump in (ours, upstream):
        assert "error" not in dump["rank0"], dump["rank0"].get("error", {}).get("traceback")
    nvme = ours["rank0"]["report"]["nvme"]
    assert nvme["partitions_swapped_out"] > 0 and nvme["waves"] >= 2, nvme
    want = _plain(path, torch.bfloat16)
    assert set(ours["rank0"]["state"]) == set(want)
    for name, expected in want.items():
        actual = ours["rank0"]["state"][name]
        assert actual.dtype == expected.dtype and torch.equal(actual.cpu(), expected), name
    assert ours["rank0"]["losses"] == upstream["rank0"]["losses"]
