"""Symbolic versions of transformers' conversion ops (`transformers.core_model_loading`, 5.23 and 5.24).

Each rule takes the same `input_dict` a real op gets (pattern -> list of tensors, or tensor), but holding
`Sym`s, and returns the same output keys with `Sym`s whose mappers say where every element comes from.
Key routing reuses the ops' own `get_target_pattern(s)` methods so names always match transformers.
An op without a rule raises `UnsupportedConversionError`, never a wrong tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import _transformers_private as hf_private
from .._transformers_private import WeightConverter, WeightTransform
from ..dequantize import Computation
from ..errors import UnsupportedConversionError
from .symbolic import Concat, Permute, Piece, Same, Sym, Transpose, slice_along, stack_along


def _first(value) -> Sym:
    return value[0] if isinstance(value, list) else value


class ConversionInputError(ValueError):
    """The checkpoint's tensors do not fit a conversion op (the real op refuses them too, or would mangle them)."""


def _check(ok: bool, message: str) -> None:
    """Refuse inputs the real op would refuse (or silently mangle): never plan reads for them."""
    if not ok:
        raise ConversionInputError(message)


def _dim(dim: int, ndim: int, what: str) -> int:
    """`dim` as torch reads it for `ndim` dims (negative: from the end); out of range refused, as torch refuses it
    (a plain modulo would wrap it silently onto another dim)."""
    _check(-ndim <= dim < ndim, f"{what}: dim {dim} is out of range for {ndim} dims")
    return dim % ndim


def _stack(syms: list[Sym], dim: int, what: str) -> Sym:
    """torch.stack(syms, dim)."""
    _check(all(s.shape == syms[0].shape for s in syms), f"{what}: unequal shapes {[s.shape for s in syms]}")
    return stack_along(syms, _dim(dim, len(syms[0].shape) + 1, what))


def _cat(syms: list[Sym], dim: int, what: str) -> Sym:
    """torch.cat(syms, dim)."""
    # e.g. fused experts whose checkpoint lacks every gate projection of a layer: torch.cat of no tensors
    _check(bool(syms), f"{what}: nothing to concatenate")
    dim = _dim(dim, len(syms[0].shape), what)
    others = {tuple(d for i, d in enumerate(s.shape) if i != dim) for s in syms}
    _check(len(others) == 1 and len({len(s.shape) for s in syms}) == 1,
           f"{what}: shapes differ outside the dim: {[s.shape for s in syms]}")
    shape = list(syms[0].shape)
    shape[dim] = sum(s.shape[dim] for s in syms)
    return Sym(tuple(shape), mapper=Concat(dim, tuple(shape), [Piece(s, 0, s.shape[dim], s.shape[dim]) for s in syms]))


def _merge_modulelist(op, inputs, source_patterns, target_patterns, ctx):
    out = {}
    n_inputs = len(inputs)
    for pattern in list(inputs):
        syms = inputs[pattern]
        key = op.get_target_pattern(n_inputs, pattern, target_patterns)
        out[key] = syms if isinstance(syms, Sym) else _stack(syms, op.dim, "MergeModulelist")
    return out


def _concatenate(op, inputs, source_patterns, target_patterns, ctx):
    syms: list[Sym] = []
    for pattern in source_patterns:
        if pattern not in inputs:
            continue
        value = inputs[pattern]
        syms.extend(value if isinstance(value, list) else [value])
    return {op.get_target_pattern(target_patterns): _cat(syms, op.dim, f"Concatenate(dim={op.dim})")}


def _ernie_fuse_and_split(op, inputs, source_patterns, target_patterns, ctx):
    """ErnieFuseAndSplitTextVisionExperts: each source's expert list is split into len(targets) groups (ceil-sized),
    each group stacked on `stack_dim`; target k concatenates group k of every source on `concat_dim`."""
    parts: dict[str, list[Sym]] = {}
    for pattern in source_patterns:
        if pattern not in inputs:
            raise ConversionInputError(f"Expected pattern {pattern} in collected tensors but only found tensors "
                                       f"for: {inputs.keys()}")
        syms = inputs[pattern] if isinstance(inputs[pattern], list) else [inputs[pattern]]
        size = math.ceil(len(syms) / len(target_patterns))
        for k, target in enumerate(target_patterns):
            group = syms[k * size:(k + 1) * size]
            _check(bool(group), f"ErnieFuseAndSplitTextVisionExperts: no experts left for {target}")
            parts.setdefault(target, []).append(_stack(group, op.stack_dim, "ErnieFuseAndSplitTextVisionExperts"))
    return {t: _cat(p, op.concat_dim, "ErnieFuseAndSplitTextVisionExperts") for t, p in parts.items()}


def _vision_fuse_and_permute_for_rope(op, inputs, source_patterns, target_patterns, ctx):
    """VisionFuseAndPermuteForRope = PermuteForRope(subconfig vision_config) then Concatenate, as the op runs them."""
    permuted = _permute_for_rope(op.permute_op, inputs, source_patterns, target_patterns, ctx)
    return _concatenate(op.concat_op, permuted, source_patterns, target_patterns, ctx)


def _fp8_dequantize(op, inputs, source_patterns, target_patterns, ctx):
    """Fp8Dequantize (first in a chain, or alone on a plain weight): each FP8 weight with its `weight_scale_inv`
    becomes a computed tensor (dequantize.Fp8Dequantized); activation scales are dropped, as the op drops them."""
    layer = ctx["full_layer_name"]
    out_dtype = ctx["dtype_of"](layer)

    def dequantized(weight: Sym, scale: Sym) -> Sym:
        entry = ctx["entry"](weight.key)
        if entry.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise UnsupportedConversionError(
                f"Fp8Dequantize of {weight.key}: stored as {entry.dtype}, not FP8 (packed FP4 weights have no "
                "shard-on-read rule)")
        rows, cols = weight.shape[-2:]
        scale_rows, scale_cols = scale.shape[-2:] if len(scale.shape) >= 2 else (1, 1)
        if rows % scale_rows or cols % scale_cols:  # transformers' own check, its own words
            raise ConversionInputError(
                f"Weight shape ({rows}, {cols}) not divisible by scale grid ({scale_rows}, {scale_cols}).")
        scale_entry = ctx["entry"](scale.key)
        dtype = out_dtype or (scale_entry.dtype if scale_entry.dtype.is_floating_point and scale_entry.itemsize >= 2
                              else torch.bfloat16)
        computation = Computation("fp8", (weight.key, scale.key), dtype, tuple(weight.shape))
        ctx["computed"][computation.key] = computation
        return Sym(weight.shape, key=computation.key)

    if "weight" in inputs:  # a plain weight: converter ["weight", "weight_scale_inv", ...] -> "weight"
        weight = _first(inputs["weight"])
        if "weight_scale_inv" not in inputs:
            return {layer: weight}
        return {layer: dequantized(weight, _first(inputs["weight_scale_inv"]))}
    out = {}
    for key, value in inputs.items():
        if "activation_scale" in key or "weight_scale_inv" in key:
            continue
        scale_key = f"{key}_scale_inv"
        if scale_key not in inputs:
            out[key] = value
            continue
        weights = value if isinstance(value, list) else [value]
        scales = inputs[scale_key] if isinstance(inputs[scale_key], list) else [inputs[scale_key]]
        if len(weights) != len(scales):
            raise ConversionInputError(f"Fp8Dequantize: weight/scale count mismatch for {key} ({len(weights)} "
                                       f"weights vs {len(scales)} scales).")
        out[key] = [dequantized(w, s) for w, s in zip(weights, scales)]
    return out


def _mxfp4_dequantize(op, inputs, source_patterns, target_patterns, ctx):
    """Mxfp4Dequantize (GPT-OSS experts): `{proj}_blocks` [E, R, G, 16] and `{proj}_scales` [E, R, G] become the
    computed [E, G * 32, R] tensor (dequantize.Mxfp4Dequantized), in the parameter's dtype."""
    layer = ctx["full_layer_name"]
    proj = "gate_up_proj" if "gate_up_proj" in layer else "down_proj"
    blocks, scales = _first(inputs[f"{proj}_blocks"]), _first(inputs[f"{proj}_scales"])
    _check(len(blocks.shape) == 4 and tuple(blocks.shape[:-1]) == tuple(scales.shape),
           f"Mxfp4Dequantize: blocks {blocks.shape} and scales {scales.shape} do not match")
    experts, rows, groups, block_bytes = blocks.shape
    computation = Computation("mxfp4", (blocks.key, scales.key), ctx["dtype_of"](layer) or torch.bfloat16,
                              (experts, groups * block_bytes * 2, rows))
    ctx["computed"][computation.key] = computation
    return {layer: Sym(computation.shape, key=computation.key)}


def _slices(src: Sym, dim: int, sizes: list[int], targets: list[str]) -> dict[str, Sym]:
    out, offset = {}, 0
    for target, size in zip(targets, sizes):
        out[target] = slice_along(src, dim, offset, size)
        offset += size
    return out


def _chunk(op, inputs, source_patterns, target_patterns, ctx):
    if len(inputs) > 1:
        raise ConversionInputError("Undefined Operation encountered")
    src = _first(next(iter(inputs.values())))
    _dim(op.dim, len(src.shape), f"Chunk(dim={op.dim})")
    targets = op.get_target_patterns(target_patterns, config=ctx["config"])
    # torch.chunk's own sizes (it may return fewer chunks than asked)
    sizes = [c.shape[op.dim] for c in torch.chunk(torch.empty(src.shape, device="meta"), len(targets), dim=op.dim)]
    return _slices(src, op.dim, sizes, targets)


def _split(op, inputs, source_patterns, target_patterns, ctx):
    if len(inputs) > 1:
        raise ConversionInputError("Undefined Operation encountered")
    src = _first(next(iter(inputs.values())))
    _dim(op.dim, len(src.shape), f"Split(dim={op.dim})")
    layer = ctx["full_layer_name"]
    # the model's true (logical) shapes: never a ZeRO-3 placeholder
    sizes = [ctx["shape_of"](layer.replace(target_patterns[0], t))[op.dim] for t in target_patterns]
    _check(sum(sizes) == src.shape[op.dim],
           f"Split(dim={op.dim}): model sizes {sizes} do not add up to the checkpoint's {src.shape[op.dim]}")
    return _slices(src, op.dim, sizes, target_patterns)


def _interleave_perm(n: int, inverse: bool):
    half = n // 2
    if inverse:  # output b*2 + a <- input a*half + b
        return lambda j: (j % 2) * half + j // 2
    return lambda j: (j % half) * 2 + j // half  # output a*half + b <- input b*2 + a


def _interleave(op, inputs, source_patterns, target_patterns, ctx):
    src = _first(next(iter(inputs.values())))
    dim = _dim(op.dim, len(src.shape), f"Interleave(dim={op.dim})")
    n = src.shape[dim]
    _check(n % 2 == 0, f"Interleave(dim={op.dim}): odd size {n}")
    return {target_patterns[0]: Sym(src.shape, mapper=Permute(dim, src.shape, src, _interleave_perm(n, op.inverse)))}


def _transpose(op, inputs, source_patterns, target_patterns, ctx):
    key = op.get_target_pattern(inputs, source_patterns, target_patterns)
    src = _first(next(iter(inputs.values())))
    if op.check_dims and tuple(ctx["shape_of"](ctx["full_layer_name"])) == tuple(src.shape):
        return {key: src}  # as the real op: already the model's shape, kept as it is
    ndim = len(src.shape)
    _check(ndim >= 2, f"Transpose: a {ndim}-D tensor has no dims {op.dim0}, {op.dim1}")
    d0, d1 = sorted(_dim(d, ndim, f"Transpose({op.dim0}, {op.dim1})") for d in (op.dim0, op.dim1))
    shape = list(src.shape)
    shape[d0], shape[d1] = shape[d1], shape[d0]
    return {key: Sym(tuple(shape), mapper=Transpose(d0, d1, tuple(shape), src))}


def _rope_perm(dim0: int, n_heads: int, inverse: bool):
    half = dim0 // n_heads // 2
    head = 2 * half

    def perm(o: int) -> int:
        h, r = divmod(o, head)
        if inverse:  # view (2, half) -> output b*2 + a <- input a*half + b
            b, a = divmod(r, 2)
            return h * head + a * half + b
        a, b = divmod(r, half)  # view (half, 2) -> output a*half + b <- input b*2 + a
        return h * head + b * 2 + a

    return perm


def _permute_for_rope(op, inputs, source_patterns, target_patterns, ctx):
    out = {}
    for pattern, value in inputs.items():
        key = op.get_target_pattern(pattern, source_patterns, target_patterns)
        if op.permute_layer_names is None or any(name in pattern for name in op.permute_layer_names):
            _check(not isinstance(value, list) or len(value) == 1, "PermuteForRope expects a single tensor per key.")
            src = _first(value)
            if len(src.shape) not in (1, 2):  # transformers permutes 1-D and 2-D tensors only
                out[key] = src
                continue
            config = ctx["config"]
            if op.subconfig_key is not None:
                config = getattr(config, op.subconfig_key, config)
            n_heads = getattr(config, "num_attention_heads", 1)
            _check(src.shape[0] % (2 * n_heads) == 0,
                   f"PermuteForRope: {src.shape[0]} rows do not split into {n_heads} heads of even size")
            perm = _rope_perm(src.shape[0], n_heads, op.inverse)
            out[key] = Sym(src.shape, mapper=Permute(0, src.shape, src, perm))
        else:
            out[key] = value
    return out


def _conv3d_to_linear(op, inputs, source_patterns, target_patterns, ctx):
    key = hf_private.conv3d_to_linear_target_pattern(inputs, source_patterns, target_patterns)
    src = _first(next(iter(inputs.values())))
    if len(src.shape) == 5:
        return {key: Sym((src.shape[0], src.numel // max(src.shape[0], 1)), mapper=Same(src))}
    if len(src.shape) != 2:
        raise ConversionInputError(f"Conv3dToLinear expects a 5D or 2D tensor, got {len(src.shape)}D")
    return {key: src}


def _refuse_inverse(op, ctx) -> None:
    if getattr(op, "inverse", False):  # loading mappings run these forwards only
        raise UnsupportedConversionError(f"{type(op).__name__}(inverse=True) (model type {ctx['model_type']!r}) has no "
                                         "shard-on-read rule")


def _inkling2_unpad_vocab(op, inputs, source_patterns, target_patterns, ctx):
    """Inkling2UnpadVocab (transformers 5.24): the first `unpadded_vocab_size` rows of the padded unembedding."""
    _refuse_inverse(op, ctx)
    src = _first(next(iter(inputs.values())))
    rows = ctx["config"].get_text_config().unpadded_vocab_size
    _check(len(src.shape) >= 1 and rows >= 0,
           f"Inkling2UnpadVocab: unpadded_vocab_size {rows} does not fit the checkpoint's {tuple(src.shape)}")
    # `tensor[:rows]`, as the real op slices: a checkpoint with fewer rows (unpadded already) is kept whole
    rows = min(rows, src.shape[0])
    padded = ctx.get("zero_padded")
    if padded is not None and src.key is not None and rows < src.shape[0]:  # a save pads these rows with zeros
        padded[src.key] = rows * math.prod(src.shape[1:])
    return {target_patterns[0]: slice_along(src, 0, 0, rows)}


def _inkling2_loop_merge_message_queries(op, inputs, source_patterns, target_patterns, ctx):
    """Inkling2LoopMergeMessageQueries (transformers 5.24): two (2L, H) query tensors, [query, mlp] and [key, value]
    of each loop layer, become one (L, 4, H) of [query, key, value, mlp]."""
    _refuse_inverse(op, ctx)
    _check(all(p in inputs for p in source_patterns[:2]),
           f"Inkling2LoopMergeMessageQueries: expected {source_patterns[:2]}, found {list(inputs)}")
    queries, kv_queries = (_first(inputs[p]) for p in source_patterns[:2])
    _check(len(queries.shape) == 2 and queries.shape == kv_queries.shape and queries.shape[0] % 2 == 0,
           f"Inkling2LoopMergeMessageQueries: shapes {queries.shape} and {kv_queries.shape}")
    layers, hidden = queries.shape[0] // 2, queries.shape[1]
    q, kv = (Sym((layers, 2, hidden), mapper=Same(s)) for s in (queries, kv_queries))  # unflatten(0, (-1, 2))
    shape = (layers, 4, hidden)
    pieces = [Piece(q, 0, 1, 2), Piece(kv, 0, 2, 2), Piece(q, 1, 1, 2)]  # cat([q[:, :1], kv, q[:, 1:]], dim=1)
    return {target_patterns[0]: Sym(shape, mapper=Concat(1, shape, pieces))}


def _inkling2_loop_dequantize_experts(op, inputs, source_patterns, target_patterns, ctx):
    """Inkling2LoopDequantizeExperts (transformers 5.24): unquantized experts (one tensor, as `save_pretrained`
    writes them) pass through; the NVFP4 / MXFP8 experts of the original checkpoints have no shard-on-read rule."""
    if len(inputs) != 1:
        raise UnsupportedConversionError(
            f"Inkling2LoopDequantizeExperts of {ctx['full_layer_name']}: NVFP4 / MXFP8 experts (model type "
            f"{ctx['model_type']!r}) have no shard-on-read rule; load a checkpoint saved with them dequantized")
    return {target_patterns[0]: _first(next(iter(inputs.values())))}


def _version_rules() -> dict:
    """Rules for ops that only some supported transformers versions have."""
    rules = {"Inkling2UnpadVocab": _inkling2_unpad_vocab,
             "Inkling2LoopMergeMessageQueries": _inkling2_loop_merge_message_queries,
             "Inkling2LoopDequantizeExperts": _inkling2_loop_dequantize_experts}
    return {op: rules[name] for name, op in hf_private.conversion_ops(rules).items()}


def _quantizer_rules() -> dict:
    """The dequantize ops transformers' quantizers put first in a chain (loading with `dequantize=True`)."""
    rules = {"fp8": _fp8_dequantize, "mxfp4": _mxfp4_dequantize}
    return {op: rules[kind] for kind, op in hf_private.dequantize_ops().items()}


_BASE_RULES = {
    "MergeModulelist": _merge_modulelist,
    "Concatenate": _concatenate,
    "Chunk": _chunk,
    "Split": _split,
    "Interleave": _interleave,
    "Transpose": _transpose,
    "PermuteForRope": _permute_for_rope,
    "Conv3dToLinear": _conv3d_to_linear,
    "ErnieFuseAndSplitTextVisionExperts": _ernie_fuse_and_split,
    "VisionFuseAndPermuteForRope": _vision_fuse_and_permute_for_rope,
}
RULES = {
    # an op gone from an untested transformers does not fail the import: its hook is missing at the first load
    # (`_transformers_private.HOOKS`), which then goes through transformers' own ZeRO-3 path
    **{op: _BASE_RULES[name] for name, op in hf_private.conversion_ops(_BASE_RULES).items()},
    **_version_rules(),
    **_quantizer_rules(),
}


def apply_converter(converter: WeightTransform, layer_name: str, ctx: dict[str, Any]) -> dict[str, Sym]:
    """Symbolic `WeightConverter.convert` / `WeightRenaming.convert`: full target name -> Sym."""
    collected = {k: list(v) for k, v in converter.collected_tensors.items()}
    if not isinstance(converter, WeightConverter):
        return {converter.target_patterns[0]: collected[converter.source_patterns[0]]}
    value: dict = collected
    for op in converter.operations:
        rule = RULES.get(type(op))
        if rule is None:
            raise UnsupportedConversionError(
                f"conversion op {type(op).__name__} (model type {ctx['model_type']!r}, parameter {layer_name}) "
                "has no shard-on-read rule; supported: " + ", ".join(sorted(c.__name__ for c in RULES))
                + ". init_context='zero.Init' loads it through transformers' own ZeRO-3 path (rank 0 reads the "
                "checkpoint and broadcasts every parameter)"
            )
        value = rule(op, value, converter.source_patterns, converter.target_patterns, {**ctx, "full_layer_name": layer_name})
    # Same prefix/suffix expansion as WeightConverter.convert
    full_name = layer_name.replace("*.", "0.") if "*." in layer_name else layer_name
    try:
        prefix, _, suffix = next(full_name.partition(k) for k in value if k in full_name)
        value = {prefix + k + suffix: v for k, v in value.items()}
    except StopIteration:
        pass
    return value
