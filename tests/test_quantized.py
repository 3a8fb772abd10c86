"""Quantized checkpoints dequantized on read, and every loading op of transformers 5.23 covered.

FP8 (fine-grained, block-scaled) and MXFP4 (GPT-OSS experts) checkpoints in transformers' exact on-disk format, loaded
at world sizes 1 to 4: every gathered parameter equals, bit for bit and in dtype, the plain single-process
`from_pretrained(..., quantization_config=...(dequantize=True))`; each rank reads its share of the quantized bytes
and the scales its range touches; Ernie 4.5 VL MoE (ErnieFuseAndSplitTextVisionExperts) loads bit-exact.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.checkpoints import (ernie4_5_vl_moe_config, fp8_checkpoint, gguf_checkpoint, gpt_oss_config,
                               make_checkpoint, mxfp4_checkpoint, pickled_checkpoint)
from tests.conftest import params_kept_in_fp32, run_torchrun
from tests.dist_worker import quantization_config

WORLD_SIZES = (1, 2, 3, 4)
# format -> families loaded in that format here (read by scripts/model_cards.py)
FORMATS = {"fp8": ("qwen3_moe", "llama", "deepseek_v3", "minimax_m2"), "mxfp4": ("gpt_oss",)}


def _qwen_fp8_config():
    from transformers import Qwen3MoeConfig

    # 192 rows: not a multiple of the 128 block (transformers then splits the 2-row scale grid into blocks of 96)
    return Qwen3MoeConfig(vocab_size=101, hidden_size=256, head_dim=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=384, moe_intermediate_size=192, num_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)


def _deepseek_v3_fp8_config():
    from transformers import DeepseekV3Config

    # DeepSeek-V3 ships in FP8: MLA's low-rank projections (kv_a 96 rows, kv_b 64 columns: part of a block), shared
    # experts, a dense first layer, its router's bias buffer
    return DeepseekV3Config(vocab_size=101, hidden_size=256, intermediate_size=384, moe_intermediate_size=192,
                            n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64,
                            qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, n_group=2, topk_group=1,
                            num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)


def _minimax_m2_fp8_config():
    from transformers import MiniMaxM2Config

    return MiniMaxM2Config(vocab_size=101, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2)


def _llama_fp8_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=101, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def ckpts(workdir):
    d = lambda name: os.path.join(workdir, "quant", name)  # noqa: E731
    qwen = make_checkpoint(d("qwen_bf16"), "q", dtype=torch.bfloat16, config=_qwen_fp8_config())
    llama = make_checkpoint(d("llama_bf16"), "l", dtype=torch.bfloat16, config=_llama_fp8_config())
    gpt_oss = make_checkpoint(d("gpt_oss_bf16"), "g", dtype=torch.bfloat16, config=gpt_oss_config())
    deepseek = make_checkpoint(d("deepseek_v3_bf16"), "d", dtype=torch.bfloat16, config=_deepseek_v3_fp8_config())
    minimax = make_checkpoint(d("minimax_m2_bf16"), "m", dtype=torch.bfloat16, config=_minimax_m2_fp8_config())
    from transformers import AutoModelForImageTextToText

    fp8, mxfp4 = {"quant_method": "fp8", "dequantize": True}, {"quant_method": "mxfp4", "dequantize": True}
    return {
        # name: (path, quant spec or None, model class)
        "fp8 qwen3_moe": (fp8_checkpoint(qwen, d("qwen_fp8")), fp8, "AutoModelForCausalLM"),
        # a non-square scale grid (blocks of 128 x 64), a dense family, and transformers switching to dequantize by
        # itself (no GPU here), with its own warning
        "fp8 llama 128x64": (fp8_checkpoint(llama, d("llama_fp8"), block=(128, 64)), None, "AutoModelForCausalLM"),
        "fp8 deepseek_v3": (fp8_checkpoint(deepseek, d("deepseek_v3_fp8")), fp8, "AutoModelForCausalLM"),
        "fp8 minimax_m2": (fp8_checkpoint(minimax, d("minimax_m2_fp8")), fp8, "AutoModelForCausalLM"),
        "mxfp4 gpt_oss": (mxfp4_checkpoint(gpt_oss, d("gpt_oss_mxfp4")), mxfp4, "AutoModelForCausalLM"),
        # the same quantized tensors in a pickled `.bin`: dequantized from the unpickled tensors, not the file's bytes
        "pickled fp8 qwen3_moe": (pickled_checkpoint(d("qwen_fp8"), d("qwen_fp8_bin")), fp8, "AutoModelForCausalLM"),
        "pickled mxfp4 gpt_oss": (pickled_checkpoint(d("gpt_oss_mxfp4"), d("gpt_oss_mxfp4_bin")), mxfp4,
                                  "AutoModelForCausalLM"),
        "ernie4_5_vl_moe": (make_checkpoint(d("ernie_vl"), "e", config=ernie4_5_vl_moe_config(),
                                            model_class=AutoModelForImageTextToText), None,
                            "AutoModelForImageTextToText"),
    }


_dumps: dict = {}


def dumps(ckpts, workdir, world_size):
    if world_size not in _dumps:
        cases = [{"name": name, "path": path, "dtype": "bfloat16", "model_class": cls,
                  # a plain load keeping routers in fp32 (`_keep_in_fp32_modules_strict`: Ernie's, and DeepSeek-V3's
                  # from transformers 5.24) is compared with `keep_in_fp32=True`, which keeps the plain dtypes
                  "kwargs": {**({"quantization_config": spec} if spec else {}),
                             "keep_in_fp32": bool(plain_fp32_params(path, _quant_key(spec), cls))},
                  "out": os.path.join(workdir, f"quant_w{world_size}_{name.replace(' ', '_')}.pt")}
                 for name, (path, spec, cls) in ckpts.items()
                 if not (name == "ernie4_5_vl_moe" and world_size == 1)
                 and (world_size == 3 or not name.startswith("pickled"))]  # pickled copies: at 3 ranks only
        if world_size == 3:  # the loaded model saved back (each rank its partitions), see the save test below
            for case in cases:
                if case["name"] in SAVED:
                    case["save"] = {"dir": os.path.join(workdir, "quant_saved", case["name"].replace(" ", "_"))}
            by_name = {c["name"]: c for c in cases}
            for name, chunk in STREAMED:  # rank 1 without the files: streamed by rank 0
                case = by_name[name]
                kwargs = {**case["kwargs"], **({"stream_chunk_bytes": chunk} if chunk else {})}
                cases.append({**case, "name": f"streamed {name} {chunk or 'default'}", "kwargs": kwargs,
                              "path_by_rank": {"1": os.path.join(workdir, "quant", "not_on_this_rank")},
                              "out": case["out"].replace(".pt", f"_streamed_{chunk}.pt")})
        _dumps[world_size] = list(zip(cases, run_torchrun(world_size, cases, workdir)))
    return _dumps[world_size]


def _quant_key(spec: dict | None) -> tuple | None:
    return tuple(sorted(spec.items())) if spec else None


@functools.lru_cache(maxsize=None)
def _plain_load(path: str, quant: tuple | None, model_class: str) -> tuple[dict, frozenset]:
    import transformers

    kwargs = {"quantization_config": quantization_config(dict(quant))} if quant else {}
    model = getattr(transformers, model_class).from_pretrained(path, dtype=torch.bfloat16, **kwargs)
    fp32_params = params_kept_in_fp32(model, torch.bfloat16)
    return {n: t.detach() for n, t in [*model.named_parameters(remove_duplicate=False),
                                        *model.named_buffers(remove_duplicate=False)]}, fp32_params


def plain(path: str, quant: tuple | None, model_class: str) -> dict:
    """Every parameter and buffer of the plain (bf16) load."""
    return _plain_load(path, quant, model_class)[0]


def plain_fp32_params(path: str, quant: tuple | None, model_class: str) -> frozenset:
    """The parameters the plain bf16 load keeps in fp32."""
    return _plain_load(path, quant, model_class)[1]


SAVED = ("fp8 deepseek_v3", "fp8 llama 128x64", "mxfp4 gpt_oss")
# (case, stream_chunk_bytes or None for the default) loaded at 3 ranks with rank 1 streamed its bytes
STREAMED = (("fp8 deepseek_v3", None), ("mxfp4 gpt_oss", None), ("fp8 llama 128x64", 4096), ("mxfp4 gpt_oss", 2048),
            ("pickled fp8 qwen3_moe", None))  # a `.bin`: the reader's entries hold tensors, the receiver's are stubs


def test_a_rank_without_the_files_is_streamed_the_stored_bytes_and_dequantizes_them(ckpts, workdir):
    """A receiving rank gets the FP8/MXFP4 bytes and scales its reads would have fetched (0.5x and 0.27x the
    dequantized bf16 elements here), and computes its partitions from them as a reader does: bit-exact (the test
    above), the same bytes as its own reads. A chunk of a few elements whose stored bytes are no fewer (the whole
    scales a run touches, MXFP4's 32-value blocks) goes as elements."""
    runs = {case["name"]: dump for case, dump in dumps(ckpts, workdir, 3)}
    for name, chunk in STREAMED:
        streamed = runs[f"streamed {name} {chunk or 'default'}"]
        reader, receiver = streamed["ranks"][0], streamed["ranks"][1]
        stream = receiver["report"]["stream"]
        assert stream["receives_from"] == 0 and receiver["report"]["bytes_read"] == 0, (name, stream)
        assert reader["report"]["stream"]["bytes_sent"] == stream["bytes_received"]
        forms = reader["report"]["stream"]["chunks_sent"]
        assert forms["stored bytes"] > 0, (name, forms)
        assert reader["report"]["stream"]["largest_stream_buffer_bytes"] <= (chunk or 64 << 20)
        if chunk is None:  # whole items in each chunk: exactly what rank 1 reads when it has the files
            assert stream["bytes_received"] == runs[name]["ranks"][1]["report"]["bytes_read"], name
        if chunk == 2048:  # some of its chunks fall back to elements
            assert forms["elements"] > 0, forms


def test_a_dequantized_model_saves_its_dequantized_weights_in_the_checkpoints_layout(ckpts, workdir):
    """transformers 5.23's save_pretrained fails on a model loaded with FP8 MoE experts dequantized ("Undefined
    Operation encountered!"), and writes a dense FP8 or an MXFP4 one as quantized tensors under a config that no longer
    says so (they load back wrong). Ours writes what the model holds: the dequantized weights under the checkpoint's
    own keys (per-expert for DeepSeek-V3), no scales, no quantization_config, loading back as the same model."""
    import json

    from safetensors import safe_open

    import transformers

    def keys(folder):
        out = set()
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(folder, name), "pt") as f:
                    out.update(f.keys())
        return out

    for case, dump in dumps(ckpts, workdir, 3):
        if "save" not in case:
            continue
        for r in dump["ranks"]:
            assert "save_error" not in r, f"{case['name']}: {r['save_error']['traceback']}"
        folder = case["save"]["dir"]
        with open(os.path.join(folder, "config.json")) as f:
            assert "quantization_config" not in json.load(f), case["name"]
        stored = keys(case["path"])
        weights = {k.removesuffix("_blocks") for k in stored if not k.endswith(("_scale_inv", "activation_scale",
                                                                                 "_scales"))}
        assert keys(folder) == weights, case["name"]
        model, info = getattr(transformers, case["model_class"]).from_pretrained(folder, dtype=torch.bfloat16,
                                                                                 output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (case["name"], info)
        spec = case["kwargs"].get("quantization_config")  # none: transformers dequantizes by itself (no GPU)
        reference = plain(case["path"], _quant_key(spec), case["model_class"])
        for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
            want = reference[name]
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), f"{case['name']} {name}"


# 2 and 3 ranks (that divide the tensors and that do not) in the default tier, 1 and 4 in the sweep
@pytest.mark.parametrize("world_size", [w if w in (2, 3) else pytest.param(w, marks=pytest.mark.sweep)
                                        for w in WORLD_SIZES])
def test_dequantized_on_read_equals_the_plain_dequantized_load(ckpts, workdir, world_size):
    for case, dump in dumps(ckpts, workdir, world_size):
        got = dump["rank0"]
        assert "error" not in got, f"{case['name']}: {got.get('error', {}).get('traceback')}"
        spec = case["kwargs"].get("quantization_config")
        reference = plain(case["path"], _quant_key(spec), case["model_class"])
        assert set(got["state"]) == set(reference), case["name"]
        for name, want in reference.items():
            actual = got["state"][name]
            assert actual.dtype == want.dtype, f"{case['name']} {name}: {actual.dtype} vs {want.dtype}"
            assert torch.equal(actual, want), f"{case['name']} {name}: values differ at world size {world_size}"


@pytest.mark.parametrize("world_size", (2, 3))
def test_each_rank_reads_its_share_of_the_quantized_bytes_and_the_scales_it_touches(ckpts, workdir, world_size):
    from hf_zero3_loader.checkpoint import open_checkpoint

    for case, dump in dumps(ckpts, workdir, world_size):
        if not case["name"].startswith(("fp8", "mxfp4")):
            continue
        entries = open_checkpoint([os.path.join(case["path"], "model.safetensors")]).entries
        total = sum(e.nbytes for e in entries.values())
        scales = sum(e.nbytes for k, e in entries.items() if k.endswith(("_scale_inv", "_scales")))
        read = [r["report"]["bytes_read"] for r in dump["ranks"]]
        # every quantized and stored byte once; a scale may be read by the two ranks its block straddles, and MXFP4
        # reads whole 32-value blocks (and, where a partition starts mid-row, that row's blocks) at a boundary
        assert total <= sum(read), (case["name"], read, total)
        slack = 2 * scales if case["name"].startswith("fp8") else total // world_size
        assert sum(read) <= total + slack, (case["name"], read, total)
        assert max(read) <= total / world_size + slack, (case["name"], read, total)
        for r in dump["ranks"]:  # no tensor of a whole parameter is allocated (dequantizing works in chunks)
            assert r["largest_allocation_numel"] <= r["report"]["largest_partition_numel"] * 2 + (1 << 20), r


def test_gguf_files_load_like_the_plain_load(workdir):
    """A Llama GGUF, float32 and with Q8_0 linear weights, at 3 ranks: transformers' legacy GGUF loader (every
    architecture but lfm2 and Qwen3.5 in 5.23) dequantizes the file into a state dict on every rank, and each rank
    copies its partitions from it, equal to the plain load bit for bit and in dtype. The Q8_0 model saved back
    (transformers' own save_pretrained refuses: its GGUF quantizer is not serializable) is a plain safetensors
    checkpoint of those values, without the GGUF quantization_config."""
    import json

    from transformers import AutoModelForCausalLM

    folder = os.path.join(workdir, "gguf")
    files = [gguf_checkpoint(folder, "llama_f32.gguf", quantized=False),
             gguf_checkpoint(folder, "llama_q8_0.gguf", quantized=True)]
    saved = os.path.join(workdir, "gguf_saved")
    cases = [{"name": name, "path": folder, "dtype": "float32", "kwargs": {"gguf_file": name},
              "out": os.path.join(workdir, f"gguf_{name}.pt")} for name in files]
    cases[1]["save"] = {"dir": saved}
    for case, dump in zip(cases, run_torchrun(3, cases, workdir)):
        got = dump["rank0"]
        assert "error" not in got, f"{case['name']}: {got.get('error', {}).get('traceback')}"
        plain = AutoModelForCausalLM.from_pretrained(folder, gguf_file=case["name"], dtype=torch.float32)
        want = {n: t.detach() for n, t in [*plain.named_parameters(remove_duplicate=False),
                                            *plain.named_buffers(remove_duplicate=False)]}
        assert set(got["state"]) == set(want), case["name"]
        for name, expected in want.items():
            actual = got["state"][name]
            assert actual.dtype == expected.dtype and torch.equal(actual, expected), f"{case['name']} {name}"
    assert "save_error" not in got, got.get("save_error", {}).get("traceback")
    with open(os.path.join(saved, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    model, info = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name


def test_plan_shows_the_quantized_bytes(ckpts):
    from hf_zero3_loader.planner.inspect import plan_ranks

    path = ckpts["fp8 qwen3_moe"][0]
    plans = plan_ranks(path, 2)
    bf16 = sum(t.numel * 2 for t in plans[0].tensors.values() if t.status == "load")
    fp8 = sum(p.bytes_to_read for p in plans)
    assert fp8 < 0.75 * bf16, (fp8, bf16)  # about half: most weights are FP8


def test_plans_of_quantized_checkpoints_are_the_loads_plans(ckpts, workdir):
    """`plan` (and `plan_ranks`) dequantize FP8/MXFP4 as the load does: the scales are inputs, not unused tensors,
    and each rank's bytes are the load's; a checkpoint the load hands to transformers' own path (bitsandbytes) is
    refused with why, rather than planned as if dense."""
    from hf_zero3_loader.errors import ConfigError
    from hf_zero3_loader.planner.inspect import plan_ranks

    runs = {case["name"]: dump for case, dump in dumps(ckpts, workdir, 3)}
    for name in ("fp8 deepseek_v3", "mxfp4 gpt_oss"):
        plans = plan_ranks(ckpts[name][0], 3, dtype=torch.bfloat16)
        assert all(not p.unexpected_keys for p in plans), (name, plans[0].unexpected_keys)
        assert [p.bytes_to_read for p in plans] == [r["report"]["bytes_to_read"] for r in runs[name]["ranks"]], name
    pytest.importorskip("bitsandbytes")
    import transformers

    folder = os.path.join(workdir, "quant", "llama_nf4")
    if not os.path.exists(folder):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.join(workdir, "quant", "llama_bf16"), dtype=torch.bfloat16,
            quantization_config=quantization_config({"quant_method": "bitsandbytes_4bit"}))
        model.save_pretrained(folder)
    with pytest.raises(ConfigError, match="bitsandbytes-quantized weights, which from_pretrained loads through"):
        plan_ranks(folder, 2)


def test_keeping_weights_quantized_is_refused_with_what_to_pass():
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    from hf_zero3_loader.errors import ConfigError
    from hf_zero3_loader.zero3_load import Zero3Load

    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config())
    with pytest.raises(ConfigError, match=r"FineGrainedFP8Config\(dequantize=True\)"):
        Zero3Load._check_quantizer(quantizer)
    Zero3Load._check_quantizer(FineGrainedFP8HfQuantizer(FineGrainedFP8Config(dequantize=True)))


def test_every_loading_op_of_transformers_has_a_rule():
    """The ops in transformers' conversion mappings, and the dequantize ops its quantizers put first in a chain."""
    from hf_zero3_loader import _transformers_private as hf_private
    from hf_zero3_loader.planner.ops import RULES

    used = hf_private.loading_conversion_ops()
    assert used, "no conversion op found: the mapping API moved"
    missing = sorted(op.__name__ for op in used if op not in RULES and op.__name__ not in NOT_COVERED)
    assert not missing, f"conversion ops without a shard-on-read rule: {missing}"


# dequantize ops of other quantizers: refused with UnsupportedConversionError naming the op (README, issue notes)
NOT_COVERED = {
    "CompressedTensorsDequantize": "decompresses through the compressed-tensors library's own compressors",
    "MetalDequantize": "Apple MPS affine integer quantization",
}


def test_verify_compares_quantized_checkpoints_dequantized(ckpts):
    """`hf-zero3-loader verify` of an FP8 or MXFP4 checkpoint loads it dequantized both ways (ZeRO-3 trains dequantized
    weights; on a GPU the plain load would otherwise keep FP8 and ours refuse to)."""
    from transformers import FineGrainedFP8Config, Mxfp4Config

    from hf_zero3_loader.verify import dequantize_config

    fp8 = dequantize_config(ckpts["fp8 deepseek_v3"][0], {})
    mxfp4 = dequantize_config(ckpts["mxfp4 gpt_oss"][0], {})
    assert isinstance(fp8, FineGrainedFP8Config) and fp8.dequantize
    assert isinstance(mxfp4, Mxfp4Config) and mxfp4.dequantize
    assert dequantize_config(ckpts["ernie4_5_vl_moe"][0], {}) is None


def test_bitsandbytes_4bit_qlora_loads_through_transformers_zero3_path(ckpts, workdir):
    """QLoRA under ZeRO-3 (PEFT's documented setup: NF4 weights kept quantized, `bnb_4bit_quant_storage` in the
    engine dtype so zero.Init partitions them) was refused ("keeping the weights quantized is not supported"), which
    broke it for `import hf_zero3_loader.auto` users. It now takes transformers' own ZeRO-3 path, as without this
    library: the same partitions, bit for bit, and the same training losses; asked for on meta it is refused."""
    pytest.importorskip("bitsandbytes")
    bnb = {"quant_method": "bitsandbytes_4bit"}
    sources = {"llama": os.path.join(workdir, "quant", "llama_bf16"),
               "qwen3_moe": os.path.join(workdir, "quant", "qwen_bf16")}
    cases = [{"name": f"{name}/{variant}", "path": path, "dtype": "bfloat16", "upstream": variant == "upstream",
              "kwargs": {"quantization_config": bnb, "experts_implementation": "eager"}, "train_steps": 2,
              "out": os.path.join(workdir, f"bnb_{name}_{variant}.pt")}
             for name, path in sources.items() for variant in ("ours", "upstream")]
    cases.append({"name": "on meta", "path": sources["llama"], "dtype": "bfloat16",
                  "kwargs": {"quantization_config": bnb, "init_context": "meta"},
                  "out": os.path.join(workdir, "bnb_meta.pt")})
    dumps = dict(zip((c["name"] for c in cases), run_torchrun(2, cases, workdir)))
    for name in sources:
        ours, upstream = dumps[f"{name}/ours"]["rank0"], dumps[f"{name}/upstream"]["rank0"]
        assert "error" not in ours, ours.get("error", {}).get("traceback")
        assert ours["report"]["init_context"] == "zero.Init", ours["report"]
        assert "Bnb4BitHfQuantizer (bitsandbytes) keeps the weights quantized" in ours["report"]["reason"]
        assert set(ours["state"]) == set(upstream["state"]), name
        for key, want in upstream["state"].items():  # packed NF4 bytes: compared as bytes (some read as NaN)
            got = ours["state"][key]
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key
        assert ours["losses"] == upstream["losses"], name
    for r in dumps["on meta"]["ranks"]:
        assert r["error"]["type"] == "ConfigError", r["error"]
        assert "only transformers' own ZeRO-3 path" in r["error"]["message"], r["error"]["message"]


def test_stored_reads_are_the_reads_the_dequantization_makes(ckpts):
    """A reading rank streams `stored_reads` without computing; the receiver's computation must ask for exactly
    those reads, in that order (record and replay), and compute from them what a reader computes from the file."""
    import random

    from hf_zero3_loader.checkpoint import open_checkpoint
    from hf_zero3_loader.dequantize import Fp8Dequantized, Mxfp4Dequantized
    from hf_zero3_loader.reader import FileReader, read_stored

    class Recorder:
        def __init__(self, reader):
            self.reader, self.calls = reader, []

        def read_stored(self, entry, start, out):
            self.calls.append((entry.key, start, out.numel()))
            read_stored(self.reader, entry, start, out)

    fp8 = open_checkpoint([os.path.join(ckpts["fp8 deepseek_v3"][0], "model.safetensors")]).entries
    mxfp4 = open_checkpoint([os.path.join(ckpts["mxfp4 gpt_oss"][0], "model.safetensors")]).entries
    computed = []
    for key, scale in [(k.removesuffix("_scale_inv"), e) for k, e in fp8.items() if k.endswith("_scale_inv")][:6]:
        weight = fp8[key]
        computed.append(Fp8Dequantized(key, torch.bfloat16, weight.shape, weight=weight, scale=scale))
    for key in [k.removesuffix("_blocks") for k in mxfp4 if k.endswith("_blocks")][:4]:
        blocks, scales = mxfp4[key + "_blocks"], mxfp4[key + "_scales"]
        e, r, g, b = blocks.shape
        computed.append(Mxfp4Dequantized(key, torch.bfloat16, (e, g * b * 2, r), blocks=blocks, scales=scales))
    rng, reader = random.Random(0), FileReader()
    for entry in computed:
        numel = entry.numel
        for _ in range(20):
            cols = rng.randint(1, min(numel, 700))
            rows = rng.randint(1, 3)
            row_stride = rng.randint(cols, max(cols, numel // rows))
            src_offset = rng.randint(0, numel - ((rows - 1) * row_stride + cols))
            recorder = Recorder(reader)
            box = entry.read_box(recorder, src_offset, rows, cols, row_stride)
            planned = [(e.key, first, count)
                       for e, first, count in entry.stored_reads(src_offset, rows, cols, row_stride)]
            assert recorder.calls == planned, entry.key
            assert torch.equal(box.view(torch.int16), entry.read_box(reader, src_offset, rows, cols, row_stride)
                               .view(torch.int16)), entry.key
