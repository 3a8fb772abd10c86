"""The symbolic planner against transformers' real conversion ops, and whole plans against real checkpoints.

Part 1 (op level): for every supported conversion op and the op chains transformers' `conversion_mapping.py`
uses, random source tensors with odd sizes go through transformers' real `WeightConverter.convert`; the same
converter holding `Sym` leaves goes through `apply_converter`. Every ZeRO-3 partition range (world sizes 1..5)
and random windows resolved with `to_leaf_runs` must equal the real output bit for bit, as must `materialize`.

Part 2: ops without a shard-on-read rule raise `UnsupportedConversionError` naming the op and the model type.

Part 3 (plan level): real checkpoints written by `save_pretrained`, planned for every rank of W in 1..4 from
header-only (truncated) copies with data reads patched to fail; reads executed with the real reader reproduce
plain `from_pretrained` bit for bit. Byte accounting tested:
  - every checkpoint element is read by exactly one rank (buffers: by every rank), so
    sum_r bytes_r == checkpoint bytes + (W - 1) * B   (B = bytes of loaded buffers; none in these models);
  - rank r reads exactly its ZeRO-3 ranges [r*ceil(n/W), min(n, (r+1)*ceil(n/W))) of each parameter (plans read
    no row slack: boxes are element-exact), hence, with P the loaded parameter bytes, N the loaded parameters
    and s the element size:  P/W - (W-1)*N*s  <=  bytes_r - B  <=  sum_p ceil(n_p/W)*s  <=  P/W + N*s;
  - FileReader.stats.bytes_read == plan.bytes_to_read (these plans hold only contiguous items).

CPU only, no torch.distributed.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import random
import shutil
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from transformers import PretrainedConfig
from transformers import core_model_loading as cml

from hf_zero3_loader.checkpoint import open_checkpoint
from hf_zero3_loader.errors import CheckpointError, UnsupportedConversionError
from hf_zero3_loader.planner.ops import ConversionInputError, apply_converter
from hf_zero3_loader.planner.plan import PartitionGroup, build_plan, check_plan_is_exact, runs_to_read_items
from hf_zero3_loader.planner.symbolic import Sym, materialize, to_leaf_runs
from hf_zero3_loader.reader import FileReader, execute_read
from tests.checkpoints import make_checkpoint

pytestmark = pytest.mark.timeout(300)

OP_WORLD_SIZES = (1, 2, 3, 4, 5)
PLAN_WORLD_SIZES = (1, 2, 3, 4)


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def zero3_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """ZeRO-3's partition of a flat tensor, written out independently of the package."""
    per_rank = math.ceil(numel / world_size)
    start = min(numel, rank * per_rank)
    return start, min(numel, (rank + 1) * per_rank)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A view of the raw bits, so comparisons are bitwise (signed zeros, NaN payloads)."""
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not torch.equal(bits(actual), bits(expected)):
        diff = (bits(actual) != bits(expected)).reshape(-1).nonzero().reshape(-1)
        raise AssertionError(f"{what}: {diff.numel()} of {expected.numel()} elements differ, first at flat {diff[:8].tolist()}")


def resolve(sym: Sym, leaves: dict[str, torch.Tensor], start: int, length: int) -> torch.Tensor:
    """Elements [start, start+length) of `sym`, gathered from the leaves through `to_leaf_runs`."""
    runs = to_leaf_runs(sym, start, length)
    assert sum(r.length for r in runs) == max(length, 0), "runs do not cover the range exactly"
    parts = []
    for run in runs:
        assert run.sym.mapper is None and run.sym.key in leaves, f"run does not end at a leaf: {run}"
        assert run.length > 0 and run.stride >= 1, run
        flat = leaves[run.sym.key].reshape(-1)
        last = run.start + (run.length - 1) * run.stride
        assert 0 <= run.start and last < flat.numel(), f"run outside its leaf {run.sym.key} ({flat.numel()}): {run}"
        parts.append(flat[run.start : last + 1 : run.stride])
    dtype = next(iter(leaves.values())).dtype
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)


class FakeModel:
    """What `Split` and `Transpose(check_dims=True)` ask of the model: `get_parameter(name).shape`."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes

    def get_parameter(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise AttributeError(f"no parameter {name}")
        return torch.empty(self.shapes[name], device="meta")


def plain_config(**kwargs) -> PretrainedConfig:
    return PretrainedConfig(**kwargs)


def vision_config(top_heads: int, vision_heads: int) -> PretrainedConfig:
    """A config whose `vision_config` has a different head count, so using the wrong one is caught."""
    config = PretrainedConfig(num_attention_heads=top_heads)
    config.vision_config = PretrainedConfig(num_attention_heads=vision_heads)
    return config


@dataclass
class OpCase:
    id: str
    make: Callable[[], cml.WeightTransform]  # a fresh converter (each gets its own collected_tensors)
    sources: dict[str, list[tuple[int, ...]]]  # pattern -> shapes, in collection order
    layer_name: str  # what transformers passes as `first_param_name` (the renamed first key)
    expected_keys: list[str]
    config: PretrainedConfig | None = None
    model_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32


def W(sources, targets, ops):
    return lambda: cml.WeightConverter(source_patterns=sources, target_patterns=targets, operations=ops())


L0 = "model.layers.0."
E = 3  # experts: odd


OP_CASES = [
    # --- MergeModulelist / Concatenate (MoE experts) ---
    OpCase("merge_dim0_down_proj",
           W("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", lambda: [cml.MergeModulelist(dim=0)]),
           {"mlp.experts.*.down_proj.weight": [(7, 5)] * E},
           "model.layers.1.mlp.experts.down_proj", ["model.layers.1.mlp.experts.down_proj"]),
    OpCase("merge_dim1",
           W("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", lambda: [cml.MergeModulelist(dim=1)]),
           {"mlp.experts.*.down_proj.weight": [(7, 5)] * E},
           L0 + "mlp.experts.down_proj", [L0 + "mlp.experts.down_proj"]),
    OpCase("merge_concat_gate_up_qwen",
           W(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"], "mlp.experts.gate_up_proj",
             lambda: [cml.MergeModulelist(dim=0), cml.Concatenate(dim=1)]),
           {"mlp.experts.*.gate_proj.weight": [(5, 7)] * E, "mlp.experts.*.up_proj.weight": [(5, 7)] * E},
           L0 + "mlp.experts.gate_up_proj", [L0 + "mlp.experts.gate_up_proj"]),
    OpCase("merge_concat_gate_up_mixtral_unequal",
           W([".experts.*.w1.weight", ".experts.*.w3.weight"], ".experts.gate_up_proj",
             lambda: [cml.MergeModulelist(dim=0), cml.Concatenate(dim=1)]),
           {".experts.*.w1.weight": [(5, 7)] * 5, ".experts.*.w3.weight": [(3, 7)] * 5},
           L0 + "mlp.experts.gate_up_proj", [L0 + "mlp.experts.gate_up_proj"]),
    OpCase("merge_concat_one_expert",
           W(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"], "mlp.experts.gate_up_proj",
             lambda: [cml.MergeModulelist(dim=0), cml.Concatenate(dim=1)]),
           {"mlp.experts.*.gate_proj.weight": [(5, 7)], "mlp.experts.*.up_proj.weight": [(5, 7)]},
           L0 + "mlp.experts.gate_up_proj", [L0 + "mlp.experts.gate_up_proj"]),
    OpCase("concat_dim0_two_patterns_reverse_collection_order",
           W(["wte.embedding", "wte.new_embedding"], "embed_tokens.weight", lambda: [cml.Concatenate(dim=0)]),
           {"wte.new_embedding": [(4, 7)], "wte.embedding": [(11, 7)]},
           "model.transformer.embed_tokens.weight", ["model.transformer.embed_tokens.weight"]),
    OpCase("concat_dim1_3d",
           W(["a_part.weight", "b_part.weight"], "ab.weight", lambda: [cml.Concatenate(dim=1)]),
           {"a_part.weight": [(3, 5, 7)], "b_part.weight": [(3, 2, 7)]},
           "model.ab.weight", ["model.ab.weight"]),
    OpCase("concat_dim_last_3d",
           W(["a_part.weight", "b_part.weight"], "ab.weight", lambda: [cml.Concatenate(dim=2)]),
           {"a_part.weight": [(3, 5, 7)], "b_part.weight": [(3, 5, 2)]},
           "model.ab.weight", ["model.ab.weight"]),
    # --- Chunk ---
    OpCase("chunk_dim0_odd_2",
           W("mlp.ff_proj.weight", ["mlp.up_proj.weight", "mlp.gate_proj.weight"], lambda: [cml.Chunk(dim=0)]),
           {"mlp.ff_proj.weight": [(23, 7)]},
           L0 + "mlp.up_proj.weight", [L0 + "mlp.up_proj.weight", L0 + "mlp.gate_proj.weight"]),
    OpCase("chunk_dim0_qkv_3",
           W(r"\.self_attn\.qkv\.weight", [r".self_attn.q_proj.weight", r".self_attn.k_proj.weight",
                                           r".self_attn.v_proj.weight"], lambda: [cml.Chunk(dim=0)]),
           {r"\.self_attn\.qkv\.weight": [(27, 5)]},
           L0 + "self_attn.q_proj.weight",
           [L0 + "self_attn.q_proj.weight", L0 + "self_attn.k_proj.weight", L0 + "self_attn.v_proj.weight"]),
    OpCase("chunk_dim1_3d",
           W("mlp.experts.gate_up_proj", ["mlp.experts.gate_proj", "mlp.experts.up_proj"], lambda: [cml.Chunk(dim=1)]),
           {"mlp.experts.gate_up_proj": [(3, 14, 5)]},
           L0 + "mlp.experts.gate_proj", [L0 + "mlp.experts.gate_proj", L0 + "mlp.experts.up_proj"]),
    OpCase("chunk_dim_last_odd",
           W("w.fused", ["w.a", "w.b", "w.c"], lambda: [cml.Chunk(dim=1)]),
           {"w.fused": [(5, 11)]},
           "model.w.a", ["model.w.a", "model.w.b", "model.w.c"]),
    OpCase("chunk_fewer_chunks_than_targets",  # torch.chunk(5 rows, 4) returns 3 chunks: 2, 2, 1
           W("w.fused", ["w.a", "w.b", "w.c", "w.d"], lambda: [cml.Chunk(dim=0)]),
           {"w.fused": [(5, 3)]},
           "model.w.a", ["model.w.a", "model.w.b", "model.w.c"]),
    OpCase("chunk_num_shards_attribute",
           W("ngram_embed.weight", "ngram_embed.*.weight", lambda: [cml.Chunk(dim=0, num_shards_attribute="n_parts")]),
           {"ngram_embed.weight": [(20, 5)]},
           "model.ngram_embed.*.weight",
           ["model.ngram_embed.0.weight", "model.ngram_embed.1.weight", "model.ngram_embed.2.weight"],
           config=plain_config(n_parts=3)),
    # --- Split (sizes from the model's parameters) ---
    OpCase("split_dim0_molmo_att_proj",
           W("self_attn.att_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             lambda: [cml.Split(dim=0)]),
           {"self_attn.att_proj": [(19, 7)]},
           L0 + "self_attn.q_proj.weight",
           [L0 + "self_attn.q_proj.weight", L0 + "self_attn.k_proj.weight", L0 + "self_attn.v_proj.weight"],
           model_shapes={L0 + "self_attn.q_proj.weight": (9, 7), L0 + "self_attn.k_proj.weight": (5, 7),
                         L0 + "self_attn.v_proj.weight": (5, 7)}),
    OpCase("split_dim1",
           W("proj.fused", ["proj.a", "proj.b"], lambda: [cml.Split(dim=1)]),
           {"proj.fused": [(5, 11)]},
           "model.proj.a", ["model.proj.a", "model.proj.b"],
           model_shapes={"model.proj.a": (5, 8), "model.proj.b": (5, 3)}),
    # --- Interleave ---
    OpCase("interleave_dim0",
           W("w13.weight", "gate_up.weight", lambda: [cml.Interleave(dim=0)]),
           {"w13.weight": [(10, 7)]}, "model.gate_up.weight", ["model.gate_up.weight"]),
    OpCase("interleave_dim0_inverse",
           W("w13.weight", "gate_up.weight", lambda: [cml.Interleave(dim=0, inverse=True)]),
           {"w13.weight": [(18, 5)]}, "model.gate_up.weight", ["model.gate_up.weight"]),
    OpCase("interleave_dim1_3d_inkling_experts",
           W(r"mlp\.experts\.w13_weight", r"mlp.experts.gate_up_proj", lambda: [cml.Interleave(dim=1)]),
           {r"mlp\.experts\.w13_weight": [(3, 10, 7)]},
           L0 + "mlp.experts.gate_up_proj", [L0 + "mlp.experts.gate_up_proj"]),
    OpCase("interleave_last_dim_2d",
           W("w13.weight", "gate_up.weight", lambda: [cml.Interleave(dim=1)]),
           {"w13.weight": [(7, 10)]}, "model.gate_up.weight", ["model.gate_up.weight"]),
    OpCase("interleave_last_dim_3d_inverse",
           W("w13.weight", "gate_up.weight", lambda: [cml.Interleave(dim=2, inverse=True)]),
           {"w13.weight": [(3, 5, 14)]}, "model.gate_up.weight", ["model.gate_up.weight"]),
    OpCase("interleave_chunk_dim0",
           W("mlp.w13_dn.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
             lambda: [cml.Interleave(dim=0), cml.Chunk(dim=0)]),
           {"mlp.w13_dn.weight": [(18, 7)]},
           L0 + "mlp.gate_proj.weight", [L0 + "mlp.gate_proj.weight", L0 + "mlp.up_proj.weight"]),
    OpCase("interleave_chunk_dim1_2d",
           W("shared_w13_weight", ["gate_proj", "up_proj"], lambda: [cml.Interleave(dim=1), cml.Chunk(dim=1)]),
           {"shared_w13_weight": [(7, 18)]},
           L0 + "mlp.shared_experts.gate_proj",
           [L0 + "mlp.shared_experts.gate_proj", L0 + "mlp.shared_experts.up_proj"]),
    OpCase("interleave_chunk_dim1_3d",
           W("shared_w13_weight", ["gate_proj", "up_proj"], lambda: [cml.Interleave(dim=1), cml.Chunk(dim=1)]),
           {"shared_w13_weight": [(3, 14, 5)]},
           L0 + "mlp.shared_experts.gate_proj",
           [L0 + "mlp.shared_experts.gate_proj", L0 + "mlp.shared_experts.up_proj"]),
    # --- PermuteForRope (3 heads, half head 5: dim0 = 30; odd everywhere) ---
    *[
        OpCase(f"rope_{nd}d_{'inverse' if inv else 'forward'}",
               W("q_proj.weight", "q_proj.weight", lambda inv=inv: [cml.PermuteForRope(inverse=inv)]),
               {"q_proj.weight": [shape]}, L0 + "self_attn.q_proj.weight", [L0 + "self_attn.q_proj.weight"],
               config=plain_config(num_attention_heads=3))
        for nd, shape in ((1, (30,)), (2, (30, 7)))
        for inv in (False, True)
    ],
    *[
        OpCase(f"rope_pixtral_subconfig_{name}",
               W(r"attention\.wq\.", "attention.q_proj.", lambda: [cml.PermuteForRope(subconfig_key="vision_config")]),
               {r"attention\.wq\.": [shape]}, f"vision_encoder.layers.0.attention.q_proj.{name}",
               [f"vision_encoder.layers.0.attention.q_proj.{name}"], config=vision_config(5, 3))
        for name, shape in (("weight", (30, 7)), ("bias", (30,)))
    ],
    *[
        OpCase(f"chunk_rope_subconfig_{name}{'_inverse' if inv else ''}",
               W(rf"attn\.in_proj_{name}", [rf"attn.q_proj.{name}", rf"attn.k_proj.{name}", rf"attn.v_proj.{name}"],
                 lambda inv=inv: [cml.Chunk(dim=0), cml.PermuteForRope(subconfig_key="vision_config",
                                                                        permute_layer_names=["q_proj", "k_proj"],
                                                                        inverse=inv)]),
               {rf"attn\.in_proj_{name}": [shape]}, f"vision.blocks.0.attn.q_proj.{name}",
               [f"vision.blocks.0.attn.{p}_proj.{name}" for p in "qkv"], config=vision_config(5, 3))
        for name, shape in (("weight", (90, 7)), ("bias", (90,)))
        for inv in (False, True)
    ],
    OpCase("chunk_rope_no_subconfig",
           W(r"self_attn\.in_proj\.weight", ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"],
             lambda: [cml.Chunk(dim=0), cml.PermuteForRope(permute_layer_names=["q_proj", "k_proj"])]),
           {r"self_attn\.in_proj\.weight": [(90, 11)]}, L0 + "self_attn.q_proj.weight",
           [L0 + f"self_attn.{p}_proj.weight" for p in "qkv"], config=plain_config(num_attention_heads=3)),
    # --- Transpose ---
    OpCase("transpose_01_2d_cosmos_gate",
           W("mlp.gate.weight_1", "mlp.vision_moe.gate.weight", lambda: [cml.Transpose(dim0=0, dim1=1)]),
           {"mlp.gate.weight_1": [(7, 5)]}, L0 + "mlp.vision_moe.gate.weight", [L0 + "mlp.vision_moe.gate.weight"]),
    OpCase("transpose_12_3d",
           W(r"\.mixer\.experts\.down_projs", r"\.mixer\.experts\.down_proj", lambda: [cml.Transpose(1, 2)]),
           {r"\.mixer\.experts\.down_projs": [(3, 5, 7)]},
           "backbone.layers.0.mixer.experts.down_proj", ["backbone.layers.0.mixer.experts.down_proj"]),
    OpCase("transpose_check_dims_already_matching",
           W("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj", lambda: [cml.Transpose(1, 2, check_dims=True)]),
           {"mlp.experts.gate_up_proj": [(3, 5, 7)]},
           L0 + "mlp.experts.gate_up_proj", [L0 + "mlp.experts.gate_up_proj"],
           model_shapes={L0 + "mlp.experts.gate_up_proj": (3, 5, 7)}),
    OpCase("transpose_check_dims_mismatching",
           W("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj", lambda: [cml.Transpose(1, 2, check_dims=True)]),
           {"mlp.experts.gate_up_proj": [(3, 7, 5)]},
           L0 + "mlp.experts.gate_up_proj", [L0 + "mlp.experts.gate_up_proj"],
           model_shapes={L0 + "mlp.experts.gate_up_proj": (3, 5, 7)}),
    OpCase("transpose_01_3d_not_last",
           W("w.src", "w.dst", lambda: [cml.Transpose(0, 1)]), {"w.src": [(3, 5, 7)]}, "model.w.dst", ["model.w.dst"]),
    OpCase("transpose_02_3d",
           W("w.src", "w.dst", lambda: [cml.Transpose(0, 2)]), {"w.src": [(3, 5, 7)]}, "model.w.dst", ["model.w.dst"]),
    OpCase("transpose_negative_reversed_dims",
           W("w.src", "w.dst", lambda: [cml.Transpose(-1, -2)]), {"w.src": [(3, 5, 7)]}, "model.w.dst", ["model.w.dst"]),
    OpCase("transpose_12_4d_middle",
           W("w.src", "w.dst", lambda: [cml.Transpose(1, 2)]), {"w.src": [(2, 3, 5, 7)]}, "model.w.dst", ["model.w.dst"]),
    OpCase("transpose_then_chunk",
           W("w.fused", ["w.a", "w.b"], lambda: [cml.Transpose(0, 1), cml.Chunk(dim=0)]),
           {"w.fused": [(5, 9)]}, "model.w.a", ["model.w.a", "model.w.b"]),
    # --- Conv3dToLinear ---
    OpCase("conv3d_to_linear_5d",
           W(r"patch_embed\.proj\.weight", r"patch_embed\.linear_proj\.weight",
             lambda: [cml.Conv3dToLinear(in_channels=3, kernel_size=(2, 3, 3))]),
           {r"patch_embed\.proj\.weight": [(5, 3, 2, 3, 3)]},
           "model.visual.patch_embed.linear_proj.weight", ["model.visual.patch_embed.linear_proj.weight"]),
    OpCase("conv3d_to_linear_2d_passthrough",
           W(r"patch_embed\.proj\.weight", r"patch_embed\.linear_proj\.weight",
             lambda: [cml.Conv3dToLinear(in_channels=3, kernel_size=(2, 3, 3))]),
           {r"patch_embed\.proj\.weight": [(5, 54)]},
           "model.visual.patch_embed.linear_proj.weight", ["model.visual.patch_embed.linear_proj.weight"]),
    # --- plain renaming, and other dtypes ---
    OpCase("weight_renaming",
           lambda: cml.WeightRenaming("model.layers.0.old.weight", "model.layers.0.new.weight"),
           {"model.layers.0.old.weight": [(5, 7)]}, "model.layers.0.new.weight", ["model.layers.0.new.weight"]),
    OpCase("merge_concat_bf16",
           W(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"], "mlp.experts.gate_up_proj",
             lambda: [cml.MergeModulelist(dim=0), cml.Concatenate(dim=1)]),
           {"mlp.experts.*.gate_proj.weight": [(5, 7)] * E, "mlp.experts.*.up_proj.weight": [(5, 7)] * E},
           L0 + "mlp.experts.gate_up_proj", [L0 + "mlp.experts.gate_up_proj"], dtype=torch.bfloat16),
    # --- negative dims that happen to work (dim + 1 != 0), 1-D interleave ---
    OpCase("merge_concat_dim_neg2_3d",
           W(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"], "mlp.experts.gate_up_proj",
             lambda: [cml.MergeModulelist(dim=0), cml.Concatenate(dim=-2)]),
           {"mlp.experts.*.gate_proj.weight": [(5, 7)] * E, "mlp.experts.*.up_proj.weight": [(3, 7)] * E},
           L0 + "mlp.experts.gate_up_proj", [L0 + "mlp.experts.gate_up_proj"]),
    OpCase("chunk_dim_neg2_3d",
           W("w.fused", ["w.a", "w.b"], lambda: [cml.Chunk(dim=-2)]), {"w.fused": [(3, 6, 5)]},
           "model.w.a", ["model.w.a", "model.w.b"]),
    OpCase("interleave_1d", W("w13.bias", "gate_up.bias", lambda: [cml.Interleave(dim=0)]),
           {"w13.bias": [(14,)]}, "model.gate_up.bias", ["model.gate_up.bias"]),
    OpCase("interleave_1d_inverse", W("w13.bias", "gate_up.bias", lambda: [cml.Interleave(dim=0, inverse=True)]),
           {"w13.bias": [(14,)]}, "model.gate_up.bias", ["model.gate_up.bias"]),
    OpCase("transpose_12_3d_bf16",
           W("w.src", "w.dst", lambda: [cml.Transpose(1, 2)]), {"w.src": [(3, 5, 7)]}, "model.w.dst", ["model.w.dst"],
           dtype=torch.bfloat16),
    # --- ops transformers 5.24 added (Inkling2 and Inkling2Loop checkpoints) ---
    *([OpCase("inkling2_unpad_vocab",
              W(r"lm_head\.weight", r"lm_head.weight", lambda: [cml.Inkling2UnpadVocab()]),
              {r"lm_head\.weight": [(11, 5)]}, "lm_head.weight", ["lm_head.weight"],
              config=plain_config(unpadded_vocab_size=7), model_shapes={"lm_head.weight": (7, 5)}),
       OpCase("inkling2_unpad_vocab_already_unpadded",  # fewer rows than `unpadded_vocab_size`: kept whole
              W(r"lm_head\.weight", r"lm_head.weight", lambda: [cml.Inkling2UnpadVocab()]),
              {r"lm_head\.weight": [(11, 5)]}, "lm_head.weight", ["lm_head.weight"],
              config=plain_config(unpadded_vocab_size=200058), model_shapes={"lm_head.weight": (11, 5)}),
       OpCase("inkling2_loop_merge_message_queries",
              W([r"middle_cycle_cross_pass_queries", r"middle_cycle_cross_pass_kv_queries"], r"message_input.query",
                lambda: [cml.Inkling2LoopMergeMessageQueries()]),
              {r"middle_cycle_cross_pass_queries": [(6, 5)], r"middle_cycle_cross_pass_kv_queries": [(6, 5)]},
              "model.message_input.query", ["model.message_input.query"]),
       OpCase("inkling2_loop_unquantized_experts_interleave",  # as `save_pretrained` writes them: no scales
              W([r"mlp\.experts\.w13_weight", r"mlp\.experts\.w13_weight_scale", r"mlp\.experts\.w13_weight_amax",
                 r"mlp\.experts\.w13_weight_outer_scale_denominator"], r"mlp.experts.gate_up_proj",
                lambda: [cml.Inkling2LoopDequantizeExperts(), cml.Interleave(dim=1)]),
              {r"mlp\.experts\.w13_weight": [(3, 10, 7)]},
              L0 + "mlp.experts.gate_up_proj", [L0 + "mlp.experts.gate_up_proj"])]
      if hasattr(cml, "Inkling2UnpadVocab") else []),
]


def build_case(case: OpCase, seed: int):
    """Real outputs (transformers) and symbolic outputs (ours) for one case, plus the leaves."""
    generator = torch.Generator().manual_seed(seed)
    real, symbolic = case.make(), case.make()
    leaves: dict[str, torch.Tensor] = {}
    for pattern, shapes in case.sources.items():
        for i, shape in enumerate(shapes):
            key = f"{pattern}[{i}]"
            tensor = torch.randn(shape, generator=generator).to(case.dtype)
            leaves[key] = tensor
            real.collected_tensors[pattern].append(tensor.clone())
            symbolic.collected_tensors[pattern].append(Sym(tuple(shape), key=key))
    model = FakeModel(case.model_shapes)
    expected = real.convert(case.layer_name, model=model, config=case.config)
    expected = {k: (v[0] if isinstance(v, list) else v) for k, v in expected.items()}
    ctx = {"config": case.config, "model_type": "symbolic_test",
           "shape_of": lambda name: tuple(model.get_parameter(name).shape)}
    got = apply_converter(symbolic, case.layer_name, ctx)
    return leaves, expected, got


@pytest.mark.parametrize("case", OP_CASES, ids=[c.id for c in OP_CASES])
def test_symbolic_op_matches_transformers(case: OpCase):
    seed = sum(map(ord, case.id))
    leaves, expected, got = build_case(case, seed)
    # every source element distinct (bf16 only nearly), so a misplaced element cannot go unnoticed
    all_values = torch.cat([t.reshape(-1).float() for t in leaves.values()])
    if case.dtype == torch.float32:
        assert torch.unique(all_values).numel() == all_values.numel()

    assert sorted(expected) == sorted(case.expected_keys), f"the real op produced {list(expected)}"
    assert sorted(got) == sorted(expected)
    rng = random.Random(seed)
    for name, exp in expected.items():
        sym = got[name]
        sym = sym[0] if isinstance(sym, list) else sym
        assert isinstance(sym, Sym), name
        assert tuple(sym.shape) == tuple(exp.shape), f"{name}: {sym.shape} != {tuple(exp.shape)}"
        flat = exp.contiguous().reshape(-1)
        n = flat.numel()
        for world_size in OP_WORLD_SIZES:
            for rank in range(world_size):
                start, end = zero3_range(n, world_size, rank)
                assert_bitwise_equal(resolve(sym, leaves, start, end - start), flat[start:end],
                                     f"{case.id} {name} W={world_size} rank={rank} [{start}:{end})")
        for _ in range(25):  # arbitrary windows too, crossing rows, chunks and experts
            start = rng.randrange(n)
            length = rng.randint(1, n - start)
            assert_bitwise_equal(resolve(sym, leaves, start, length), flat[start : start + length],
                                 f"{case.id} {name} window [{start}:{start + length})")
        assert_bitwise_equal(materialize(sym, leaves), exp.contiguous(), f"{case.id} {name} materialize")


@pytest.fixture(scope="module")
def leaf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("op_leaves")


@pytest.mark.parametrize("case", OP_CASES, ids=[c.id for c in OP_CASES])
def test_read_items_reproduce_op_output(case: OpCase, leaf_dir):
    """The same ranges through `runs_to_read_items` and the real reader, from a safetensors file of the leaves."""
    from safetensors.torch import save_file

    leaves, expected, got = build_case(case, sum(map(ord, case.id)))
    path = str(leaf_dir / f"{case.id}.safetensors")
    save_file({k: v.contiguous() for k, v in leaves.items()}, path)
    checkpoint = open_checkpoint([path])
    itemsize = case.dtype.itemsize
    for name, exp in expected.items():
        sym = got[name][0] if isinstance(got[name], list) else got[name]
        flat = exp.contiguous().reshape(-1)
        for world_size in OP_WORLD_SIZES:
            for rank in range(world_size):
                start, end = zero3_range(flat.numel(), world_size, rank)
                items = runs_to_read_items(to_leaf_runs(sym, start, end - start), checkpoint)
                assert sum(i.numel for i in items) == end - start
                spans = 0
                for item in items:  # every box inside its own tensor
                    span = (item.rows - 1) * item.row_stride + item.cols
                    assert item.src_offset >= 0 and item.src_offset + span <= checkpoint.entries[item.key].numel, item
                    spans += span
                dst = torch.zeros(end - start, dtype=case.dtype)
                reader = FileReader()
                try:
                    for item in items:
                        execute_read(reader, item, checkpoint.entries[item.key], dst)
                finally:
                    reader.close()
                what = f"{case.id} {name} W={world_size} rank={rank} [{start}:{end}) via ReadItems"
                assert_bitwise_equal(dst, flat[start:end], what)
                # exact for contiguous items; a box may be read as its covering span
                assert (end - start) * itemsize <= reader.stats.bytes_read <= spans * itemsize, what


# Valid inputs that once disagreed: negative dims, and PermuteForRope leaving 3-D tensors unchanged.
EDGE_CASES = [
    pytest.param(OpCase("merge_dim_neg1",
                        W("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj",
                          lambda: [cml.MergeModulelist(dim=-1)]),
                        {"mlp.experts.*.down_proj.weight": [(5, 3)] * E},
                        L0 + "mlp.experts.down_proj", [L0 + "mlp.experts.down_proj"]),
                 id="merge_dim_neg1"),
    pytest.param(OpCase("concat_dim_neg1",
                        W(["a_part.weight", "b_part.weight"], "ab.weight", lambda: [cml.Concatenate(dim=-1)]),
                        {"a_part.weight": [(3, 5)], "b_part.weight": [(3, 2)]}, "model.ab.weight", ["model.ab.weight"]),
                 id="concat_dim_neg1"),
    pytest.param(OpCase("chunk_dim_neg1",
                        W("w.fused", ["w.a", "w.b"], lambda: [cml.Chunk(dim=-1)]), {"w.fused": [(3, 6)]},
                        "model.w.a", ["model.w.a", "model.w.b"]),
                 id="chunk_dim_neg1"),
    pytest.param(OpCase("split_dim_neg1",
                        W("proj.fused", ["proj.a", "proj.b"], lambda: [cml.Split(dim=-1)]), {"proj.fused": [(3, 10)]},
                        "model.proj.a", ["model.proj.a", "model.proj.b"],
                        model_shapes={"model.proj.a": (3, 6), "model.proj.b": (3, 4)}),
                 id="split_dim_neg1"),
    pytest.param(OpCase("rope_3d_passthrough",
                        W("q_proj.weight", "q_proj.weight", lambda: [cml.PermuteForRope()]),
                        {"q_proj.weight": [(30, 2, 3)]}, "model.q_proj.weight", ["model.q_proj.weight"],
                        config=plain_config(num_attention_heads=3)),
                 id="rope_3d_passthrough"),
]


@pytest.mark.parametrize("case", EDGE_CASES)
def test_symbolic_op_edge_cases(case: OpCase):
    test_symbolic_op_matches_transformers(case)


# Malformed inputs: transformers' op raises (so `from_pretrained` fails with a conversion error); the planner
# must refuse too, never plan reads.
MALFORMED_CASES = [
    OpCase("interleave_odd_dim", W("w13.weight", "gate_up.weight", lambda: [cml.Interleave(dim=0)]),
           {"w13.weight": [(5, 3)]}, "model.gate_up.weight", []),
    OpCase("rope_dim0_not_multiple_of_2_heads", W("q_proj.weight", "q_proj.weight", lambda: [cml.PermuteForRope()]),
           {"q_proj.weight": [(10, 3)]}, "model.q_proj.weight", [], config=plain_config(num_attention_heads=3)),
    OpCase("rope_two_tensors_for_one_key", W("q_proj.weight", "q_proj.weight", lambda: [cml.PermuteForRope()]),
           {"q_proj.weight": [(6, 3), (6, 3)]}, "model.q_proj.weight", [], config=plain_config(num_attention_heads=3)),
    OpCase("split_sizes_below_source", W("proj.fused", ["proj.a", "proj.b"], lambda: [cml.Split(dim=0)]),
           {"proj.fused": [(10, 3)]}, "model.proj.a", [], model_shapes={"model.proj.a": (3, 3), "model.proj.b": (3, 3)}),
    OpCase("split_sizes_over_source", W("proj.fused", ["proj.a", "proj.b"], lambda: [cml.Split(dim=0)]),
           {"proj.fused": [(10, 3)]}, "model.proj.a", [], model_shapes={"model.proj.a": (6, 3), "model.proj.b": (6, 3)}),
    OpCase("merge_unequal_experts", W("e.*.w", "experts.w", lambda: [cml.MergeModulelist(dim=0)]),
           {"e.*.w": [(5, 3), (4, 3)]}, "model.experts.w", []),
    OpCase("concat_other_dims_differ", W(["a_part.weight", "b_part.weight"], "ab.weight",
                                         lambda: [cml.Concatenate(dim=1)]),
           {"a_part.weight": [(3, 5)], "b_part.weight": [(4, 5)]}, "model.ab.weight", []),
    OpCase("transpose_1d", W("w.src", "w.dst", lambda: [cml.Transpose(0, 1)]), {"w.src": [(5,)]}, "model.w.dst", []),
    # fused experts whose checkpoint holds only the up projections of a layer: the merge's one output is named
    # for the target, and the concatenation finds none of its sources (torch.cat of nothing)
    OpCase("merge_then_concat_with_one_source_absent",
           W(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"], "mlp.experts.gate_up_proj",
             lambda: [cml.MergeModulelist(dim=0), cml.Concatenate(dim=1)]),
           {"mlp.experts.*.up_proj.weight": [(4, 3)] * E}, L0 + "mlp.experts.gate_up_proj", []),
    # 0-dim tensors (a header whose shape is []) where an op needs a dim
    OpCase("concat_0d", W(["a_part.weight", "b_part.weight"], "ab.weight", lambda: [cml.Concatenate(dim=0)]),
           {"a_part.weight": [()], "b_part.weight": [()]}, "model.ab.weight", []),
    OpCase("interleave_0d", W("w13.bias", "gate_up.bias", lambda: [cml.Interleave(dim=0)]),
           {"w13.bias": [()]}, "model.gate_up.bias", []),
    OpCase("chunk_0d", W("w.fused", ["w.a", "w.b"], lambda: [cml.Chunk(dim=0)]), {"w.fused": [()]},
           "model.w.a", []),
    OpCase("split_0d", W("proj.fused", ["proj.a", "proj.b"], lambda: [cml.Split(dim=0)]), {"proj.fused": [()]},
           "model.proj.a", [], model_shapes={"model.proj.a": (1,), "model.proj.b": (1,)}),
    # dims past the tensor's (torch refuses them; a modulo would wrap them onto another dim silently)
    OpCase("interleave_dim1_of_1d", W("w13.bias", "gate_up.bias", lambda: [cml.Interleave(dim=1)]),
           {"w13.bias": [(6,)]}, "model.gate_up.bias", []),
    OpCase("transpose_dims_past_2d", W("w.src", "w.dst", lambda: [cml.Transpose(1, 2)]), {"w.src": [(5, 3)]},
           "model.w.dst", []),
    OpCase("merge_dim_out_of_range", W("e.*.w", "experts.w", lambda: [cml.MergeModulelist(dim=3)]),
           {"e.*.w": [(5, 3), (5, 3)]}, "model.experts.w", []),
]


@pytest.mark.parametrize("case", MALFORMED_CASES, ids=[c.id for c in MALFORMED_CASES])
def test_malformed_input_is_rejected_by_transformers(case: OpCase):
    """The cases below really are malformed: transformers' own op raises on them."""
    real = case.make()
    for pattern, shapes in case.sources.items():
        for shape in shapes:
            real.collected_tensors[pattern].append(torch.randn(shape))
    with pytest.raises(Exception):
        real.convert(case.layer_name, model=FakeModel(case.model_shapes), config=case.config)


@pytest.mark.parametrize("case", MALFORMED_CASES, ids=[c.id for c in MALFORMED_CASES])
def test_malformed_input_refused_by_planner(case: OpCase):
    symbolic = case.make()
    leaf_numel = {}
    for pattern, shapes in case.sources.items():
        for i, shape in enumerate(shapes):
            symbolic.collected_tensors[pattern].append(Sym(tuple(shape), key=f"{pattern}[{i}]"))
            leaf_numel[f"{pattern}[{i}]"] = math.prod(shape)
    model = FakeModel(case.model_shapes)
    ctx = {"config": case.config, "model_type": "symbolic_test",
           "shape_of": lambda name: tuple(model.get_parameter(name).shape)}
    try:
        runs = []
        for sym in apply_converter(symbolic, case.layer_name, ctx).values():
            sym = sym[0] if isinstance(sym, list) else sym
            runs.extend(to_leaf_runs(sym, 0, sym.numel))
    except ConversionInputError:
        return  # refused, like transformers, with the op's complaint (the load names the target with it)
    past_end = [r for r in runs if r.start + (r.length - 1) * r.stride >= leaf_numel[r.sym.key]]
    raise AssertionError(f"planned silently where transformers raises; runs past the end of a leaf: {past_end}")


def test_transpose_of_last_dim_after_merge_is_refused_not_wrong():
    """A strided run into a non-leaf (merge then transpose of the last dim) must raise, never return wrong data."""
    make = W("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj",
             lambda: [cml.MergeModulelist(dim=0), cml.Transpose(1, 2)])
    symbolic = make()
    for i in range(3):
        symbolic.collected_tensors["mlp.experts.*.down_proj.weight"].append(Sym((5, 7), key=f"e{i}"))
    ctx = {"config": None, "model_type": "symbolic_test", "shape_of": None}
    out = apply_converter(symbolic, L0 + "mlp.experts.down_proj", ctx)
    sym = out[L0 + "mlp.experts.down_proj"]
    assert sym.shape == (3, 7, 5)
    with pytest.raises(UnsupportedConversionError):
        to_leaf_runs(sym, 0, sym.numel)


# ----------------------------------------------------------------------------------------------------------------
# unsupported ops
# ----------------------------------------------------------------------------------------------------------------


class CustomScaleOp(cml.ConversionOps):
    """A user op that changes values: the planner cannot know where bytes go, so it must refuse."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {k: [t * 2 for t in v] if isinstance(v, list) else v * 2 for k, v in input_dict.items()}


def _unsupported_cases():
    custom = cml.WeightConverter("w.fused", ["w.a", "w.b"], operations=[cml.Chunk(dim=0), CustomScaleOp()])
    split_modulelist = cml.WeightConverter("mlp.experts.down_proj", "mlp.experts.*.down_proj.weight",
                                           operations=[cml.SplitModulelist(dim=0)])
    linear_to_conv = cml.WeightConverter("linear_proj.weight", "proj.weight",
                                         operations=[cml.LinearToConv3d(in_channels=3, kernel_size=(2, 3, 3))])
    return [
        ("CustomScaleOp", "my_custom_model", custom, {"w.fused": [(6, 5)]}),
        ("SplitModulelist", "some_model", split_modulelist, {"mlp.experts.down_proj": [(3, 5, 7)]}),
        ("LinearToConv3d", "qwen2_vl", linear_to_conv, {"linear_proj.weight": [(5, 54)]}),
    ] + ([("Inkling2LoopDequantizeExperts", "inkling2_loop_text",  # NVFP4 experts of an original checkpoint
           cml.WeightConverter([r"mlp\.experts\.w2_weight", r"mlp\.experts\.w2_weight_scale",
                                r"mlp\.experts\.w2_weight_amax", r"mlp\.experts\.w2_weight_outer_scale_denominator"],
                               r"mlp.experts.down_proj", operations=[cml.Inkling2LoopDequantizeExperts()]),
           {r"mlp\.experts\.w2_weight": [(3, 5, 4)], r"mlp\.experts\.w2_weight_scale": [(3, 5, 1)],
            r"mlp\.experts\.w2_weight_amax": [(3,)], r"mlp\.experts\.w2_weight_outer_scale_denominator": [(1,)]})]
         if hasattr(cml, "Inkling2LoopDequantizeExperts") else [])


@pytest.mark.parametrize("op_name,model_type,converter,sources", _unsupported_cases(),
                         ids=[c[0] for c in _unsupported_cases()])
def test_unsupported_op_raises(op_name, model_type, converter, sources):
    for pattern, shapes in sources.items():
        for i, shape in enumerate(shapes):
            converter.collected_tensors[pattern].append(Sym(shape, key=f"{pattern}[{i}]"))
    ctx = {"config": plain_config(), "model_type": model_type, "shape_of": lambda name: None}
    with pytest.raises(UnsupportedConversionError) as info:
        apply_converter(converter, "model.layers.0.some.param", ctx)
    message = str(info.value)
    assert op_name in message and model_type in message, message


# ----------------------------------------------------------------------------------------------------------------
# plans against real checkpoints
# ----------------------------------------------------------------------------------------------------------------

PLAN_CHECKPOINTS = {
    # name: (family, sharded, expected missing keys (tied lm_head is tied after loading, not read))
    "qwen3_moe": ("qwen3_moe", False, set()),
    "qwen3_moe_sharded": ("qwen3_moe", True, set()),
    "llama_tied": ("llama_tied", False, {"lm_head.weight"}),
    "mixtral_sharded": ("mixtral", True, set()),
}


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("symbolic_plan_ckpts")


def meta_skeleton(path: str):
    """The skeleton exactly as `from_pretrained` builds it outside ZeRO-3: its own init contexts (meta device,
    weights not tied), its dtype plan and its conversion mapping."""
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.utils.generic import ContextManagers

    config = AutoConfig.from_pretrained(path)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with ContextManagers(cls.get_init_context(torch.float32, False, False, None)):
        model = cls(config)
    assert all(p.device.type == "meta" for p in model.parameters())
    return model, get_model_conversion_mapping(model), model._get_dtype_plan(torch.float32)


def header_only_copy(src_dir: str, dst_dir: str):
    """Copy the safetensors files and open them; then cut every copy to its header. Returns the Checkpoint."""
    os.makedirs(dst_dir)
    files = []
    for f in sorted(glob.glob(os.path.join(src_dir, "*.safetensors"))):
        shutil.copy(f, os.path.join(dst_dir, os.path.basename(f)))
        files.append(os.path.join(dst_dir, os.path.basename(f)))
    checkpoint = open_checkpoint(files)
    for f in files:
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
        os.truncate(f, 8 + header_len)
    with pytest.raises(CheckpointError, match="truncated"):  # really no tensor data left
        open_checkpoint(files)
    return checkpoint


class NoDataReads:
    """Makes every positional/plain file read and safetensors open fail while planning."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def __enter__(self):
        def refuse(*args, **kwargs):
            raise AssertionError("planning read file data")

        import safetensors
        import safetensors.torch

        for mod, name in ((os, "preadv"), (os, "pread"), (os, "read"), (safetensors, "safe_open"),
                          (safetensors.torch, "safe_open"), (safetensors.torch, "load_file")):
            self.monkeypatch.setattr(mod, name, refuse)
        return self

    def __exit__(self, *exc):
        self.monkeypatch.undo()
        return False


@pytest.mark.parametrize("name", list(PLAN_CHECKPOINTS))
def test_plan_reads_exactly_each_ranks_bytes(name, ckpt_root, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    family, sharded, expected_missing = PLAN_CHECKPOINTS[name]
    path = make_checkpoint(str(ckpt_root / name), family, torch.float32, sharded)
    real_files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    assert (len(real_files) > 1) == sharded
    real_checkpoint = open_checkpoint(real_files)
    header_checkpoint = header_only_copy(path, str(ckpt_root / f"{name}_headers"))
    assert {k: (e.shape, e.dtype, e.data_start) for k, e in header_checkpoint.entries.items()} == {
        k: (e.shape, e.dtype, e.data_start) for k, e in real_checkpoint.entries.items()}
    to_real = {f: os.path.join(path, os.path.basename(f)) for f in header_checkpoint.files}

    model, mapping, dtype_plan = meta_skeleton(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref_state = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}
    ref_state.update({n: b.detach() for n, b in reference.named_buffers(remove_duplicate=False)})
    raw = {}
    for f in real_files:
        raw.update(load_file(f))

    params = dict(model.named_parameters(remove_duplicate=False))
    assert {e.dtype for e in real_checkpoint.entries.values()} == {torch.float32}  # 4 bytes an element below
    for world_size in PLAN_WORLD_SIZES:
        with NoDataReads(monkeypatch):
            plans = [
                build_plan(model, header_checkpoint, mapping, torch.float32, dtype_plan,
                           group_of=lambda n, r=rank: PartitionGroup("world", world_size, r),
                           rank=rank, world_size=world_size)
                for rank in range(world_size)
            ]
        loaded = {n for n, t in plans[0].tensors.items() if t.status == "load"}
        for plan in plans:
            check_plan_is_exact(plan)
            assert plan.missing_keys == expected_missing
            assert plan.unexpected_keys == set() and plan.mismatched_keys == set()
            assert {n for n, t in plan.tensors.items() if t.status == "load"} == loaded
        assert loaded == set(model.state_dict()) - expected_missing

        # --- bytes: each checkpoint element read once over all ranks (buffers: once per rank) ---
        reads_per_element = {k: torch.zeros(e.numel, dtype=torch.int32) for k, e in header_checkpoint.entries.items()}
        buffer_bytes = 0
        for plan in plans:
            for t in plan.tensors.values():
                for item in t.reads:
                    for row in range(item.rows):
                        s = item.src_offset + row * item.row_stride
                        reads_per_element[item.key][s : s + item.cols] += 1
        for t in plans[0].tensors.values():
            if t.kind == "buffer" and t.status == "load":
                buffer_bytes += sum(r.numel * r.src_dtype.itemsize for r in t.reads)
        buffer_keys = {i.key for t in plans[0].tensors.values() if t.kind == "buffer" for i in t.reads}
        for key, counts in reads_per_element.items():
            want = world_size if key in buffer_keys else 1
            assert bool((counts == want).all()), f"W={world_size}: {key} elements read {counts.unique().tolist()} times"
        assert sum(p.bytes_to_read for p in plans) == real_checkpoint.nbytes + (world_size - 1) * buffer_bytes

        # --- per rank: exactly its partitions; bound: |bytes_r - B - P/W| within ceil rounding per param ---
        param_bytes = sum(math.prod(t.shape) * 4 for t in plans[0].tensors.values()
                          if t.kind == "param" and t.status == "load")
        n_params = sum(1 for t in plans[0].tensors.values() if t.kind == "param" and t.status == "load")
        for rank, plan in enumerate(plans):
            exact = 0
            for t in plan.tensors.values():
                if t.status != "load":
                    continue
                assert t.kind == ("param" if t.name in params else "buffer")
                start, end = zero3_range(math.prod(t.shape), world_size, rank) if t.kind == "param" else (0, t.numel)
                assert (t.start, t.end) == (start, end), t.name
                exact += (end - start) * 4
            assert plan.bytes_to_read == exact, f"W={world_size} rank={rank}"
            rank_param_bytes = plan.bytes_to_read - buffer_bytes
            # ranks hold ceil(n/W) elements, the last ones fewer: n/W - (W-1) <= share <= n/W + 1 per param
            assert param_bytes / world_size - (world_size - 1) * n_params * 4 <= rank_param_bytes
            assert rank_param_bytes <= param_bytes / world_size + n_params * 4
            assert rank_param_bytes <= sum(math.ceil(math.prod(t.shape) / world_size) * 4
                                           for t in plan.tensors.values() if t.kind == "param" and t.status == "load")

        # --- execute the reads (real files) into zeroed partitions and compare with from_pretrained ---
        gathered = {n: [] for n in loaded}
        for rank, plan in enumerate(plans):
            reader = FileReader()
            try:
                for n in loaded:
                    t = plan.tensors[n]
                    dst = torch.zeros(t.partition_numel, dtype=t.dtype)
                    for item in t.reads:
                        item = dataclasses.replace(item, file=to_real[item.file])
                        execute_read(reader, item, real_checkpoint.entries[item.key], dst)
                    assert not dst[t.end - t.start :].any(), f"{n}: padding written"
                    gathered[n].append(dst[: t.end - t.start])
            finally:
                reader.close()
            # exact: these models' plans hold only contiguous items (a box may be read as its covering span)
            assert all(i.rows == 1 for t in plan.tensors.values() for i in t.reads)
            assert reader.stats.bytes_read == plan.bytes_to_read, f"W={world_size} rank={rank}"
        for n in loaded:
            full = torch.cat(gathered[n]).view(ref_state[n].shape)
            assert_bitwise_equal(full, ref_state[n], f"{name} W={world_size} {n}")
            if n in raw:  # not converted: also the raw checkpoint tensor
                assert_bitwise_equal(full, raw[n], f"{name} W={world_size} {n} vs load_file")


def test_plan_unsupported_op_names_model_type(ckpt_root):
    """An unsupported op in a real model's mapping fails planning with the op and the model type."""
    path = make_checkpoint(str(ckpt_root / "qwen3_moe"), "qwen3_moe", torch.float32, False)
    model, mapping, dtype_plan = meta_skeleton(path)
    checkpoint = open_checkpoint(sorted(glob.glob(os.path.join(path, "*.safetensors"))))
    patched = []
    for entry in mapping:
        if isinstance(entry, cml.WeightConverter) and "gate_up_proj" in entry.target_patterns[0]:
            entry = cml.WeightConverter(entry._original_source_patterns, entry._original_target_patterns,
                                        operations=[cml.MergeModulelist(dim=0), CustomScaleOp(), cml.Concatenate(dim=1)])
        patched.append(entry)
    with pytest.raises(UnsupportedConversionError) as info:
        build_plan(model, checkpoint, patched, torch.float32, dtype_plan,
                   group_of=lambda n: PartitionGroup("world", 2, 0), rank=0, world_size=2)
    assert "CustomScaleOp" in str(info.value) and "qwen3_moe" in str(info.value)


def test_checkpoint_keys_are_ordered_as_transformers_orders_them(ckpt_root):
    """The planner sorts checkpoint keys with transformers' `dot_natural_key` computed once per dot-separated part:
    the same order, and the same sort key, for a real checkpoint's keys shuffled and for odd names."""
    from hf_zero3_loader.planner.plan import _natural_key_by_parts

    path = make_checkpoint(str(ckpt_root / "qwen3_moe"), "qwen3_moe", torch.float32, False)
    keys = list(open_checkpoint(sorted(glob.glob(os.path.join(path, "*.safetensors")))).entries)
    keys += ["a.b0.c", "a.b10.c", "a.b2", "x..y", "", ".", "a.1.b", "a.01.b", "a.b.", "shard_2", "shard_11",
             "a.0x1", "layers.10.experts.2.w1", "layers.9.experts.11.w1", "layers.9.experts.2.w1"]
    random.Random(0).shuffle(keys)
    key = _natural_key_by_parts()
    assert sorted(keys, key=key) == sorted(keys, key=cml.dot_natural_key)
    assert all(key(k) == cml.dot_natural_key(k) for k in keys)
