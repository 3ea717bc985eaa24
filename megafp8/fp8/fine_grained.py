"""Fine-grained scaling: an Fp8Linear's GEMMs with scales finer than one per tensor, each fitted
at the cast to its own block of an operand (no history, no collective), along the dimension the
GEMM sums over:

- rowwise (RowwiseScaling, torchao's rowwise): a scale per row of each operand, through
  `torch._scaled_mm`'s rowwise mode (Hopper GPUs through cuBLAS, and the CPU);
- blockwise (BlockwiseScaling, DeepSeek-V3's recipe): activations and gradients a scale per
  1 x 128 block, weights per 128 x 128 block; the GEMM emulated from the dequantized operands
  (fp32 products and sums), the reference that cuBLAS's blockwise mode is to be checked against.

For `y = x W^T` (x [M, K] tokens by input channels, W [N, K]):

    fprop   y  = x W^T      x per token (over K),           W per output channel (over K)
    dgrad   dx = dy W       dy per token (over N),          W per input channel (over N)
    wgrad   dW = dy^T x     dy per output channel (over M), x per input channel (over M)

so x and dy are each cast twice, once for each GEMM they enter; so is the weight under rowwise
scaling, while its 128 x 128 blocks serve both of its GEMMs, transposed for dgrad. The casts run in torch ops (fused kernels are
the next step).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from megafp8 import collectives
from megafp8.main_grad import accumulate_into_main_grad

from .autocast import Fp8Context
from .formats import fp8_max
from .tensor import saturates, scale_from_amax, underflows

# The blockwise recipe's block: 1 x 128 for activations and gradients, 128 x 128 for weights
BLOCK = 128


class ScaledFp8(NamedTuple):
    """A 2-D tensor in FP8 with a scale per block: `data` [rows, cols]; `scale_inv` fp32
    [rows / block rows, cols / block cols] ([rows, 1] for a scale per row); the value of an
    element is its byte times its block's `scale_inv`."""

    data: torch.Tensor
    scale_inv: torch.Tensor


class WeightCasts(NamedTuple):
    """A weight [N, K] cast for both GEMMs it enters: `rows` for fprop (its scales over K), and
    `columns`, the transpose [K, N], for dgrad (over N)."""

    rows: ScaledFp8
    columns: ScaledFp8


def quantize_blocks(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    block: tuple[int, int | None] = (1, None),
    margin: int = 0,
    saturation_out=None,
    power_of_two: bool = False,
) -> ScaledFp8:
    """Cast the 2-D `x` to `fp8_dtype` with a scale per `block` (rows, columns; None columns: a
    whole row), each fitted to its block's amax (`fp8_max / amax / 2**margin`, 1 for a block of
    zeros or one holding inf/NaN; with `power_of_two`, the power of two at or below it),
    saturating. `saturation_out`, an int64 triple, takes (elements saturated, elements cast,
    nonzero elements flushed to zero) as megafp8.fp8.quantize counts them. The bytes are
    row-major (a transposed `x` is laid out first, in its own dtype)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_blocks expects a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    block_rows, block_cols = block[0], block[1] or cols
    if rows % block_rows or cols % block_cols:
        raise ValueError(
            f"a tensor of shape {tuple(x.shape)} does not split into blocks of {block_rows} x "
            f"{block_cols}"
        )
    tiles = (
        x.contiguous().float().view(rows // block_rows, block_rows, cols // block_cols, block_cols)
    )
    scale = scale_from_amax(tiles.abs().amax(dim=(1, 3)), fp8_dtype, margin)
    if power_of_two:  # dequantizing is then exact in any precision
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = (tiles * scale[:, None, :, None]).view(rows, cols)
    if saturation_out is not None:
        saturation_out[0] += saturates(scaled, fp8_dtype).sum()
        saturation_out[1] += x.numel()
        saturation_out[2] += underflows(scaled, fp8_dtype).sum()
    limit = fp8_max(fp8_dtype)
    return ScaledFp8(scaled.clamp_(-limit, limit).to(fp8_dtype), scale.reciprocal())


def quantize_rows(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    saturation_out=None,
    power_of_two: bool = False,
) -> ScaledFp8:
    """`quantize_blocks` with a scale per row."""
    return quantize_blocks(x, fp8_dtype, (1, None), margin, saturation_out, power_of_two)


def dequantize(q: ScaledFp8) -> torch.Tensor:
    """The fp32 values of `q`: each byte times its block's inverse scale."""
    rows, cols = q.data.shape
    grid_rows, grid_cols = q.scale_inv.shape
    tiles = q.data.float().view(grid_rows, rows // grid_rows, grid_cols, cols // grid_cols)
    return (tiles * q.scale_inv[:, None, :, None]).view(rows, cols)


def rowwise_gemm(a: ScaledFp8, b: ScaledFp8, out_dtype: torch.dtype) -> torch.Tensor:
    """`dequantize(a) @ dequantize(b)^T` for `a` [M, K] and `b` [N, K], each scaled per row,
    through `torch._scaled_mm`: [M, N] in `out_dtype`. The GEMM writes bf16 (what cuBLAS's
    rowwise scaling writes on Hopper), converted after."""
    y = torch._scaled_mm(
        a.data,
        b.data.t(),
        scale_a=a.scale_inv,
        scale_b=b.scale_inv.reshape(1, -1),
        out_dtype=torch.bfloat16,
    )
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


def blockwise_gemm(a: ScaledFp8, b: ScaledFp8, out_dtype: torch.dtype) -> torch.Tensor:
    """`dequantize(a) @ dequantize(b)^T` for `a` [M, K] and `b` [N, K] scaled by blocks, from
    the dequantized operands: fp32 products and sums, then `out_dtype`."""
    with torch.autocast(a.data.device.type, enabled=False):
        return (dequantize(a) @ dequantize(b).t()).to(out_dtype)


class _Scheme(NamedTuple):
    """How a granularity casts an operand along its rows (`block`: rows, columns of a scale's
    block), casts a weight for both GEMMs, and multiplies."""

    block: tuple
    weight_block: tuple
    gemm: object
    transposed_weight: bool  # the weight's blocks serve dgrad transposed (square blocks)


SCHEMES = {
    "row": _Scheme((1, None), (1, None), rowwise_gemm, False),
    "block": _Scheme((1, BLOCK), (BLOCK, BLOCK), blockwise_gemm, True),
}


def fine_grained_linear(
    module, x: torch.Tensor, bias, context: Fp8Context, gather_group=None, scatter_group=None
) -> torch.Tensor:
    """`x W^T + bias` for Fp8Linear `module` under a rowwise or blockwise `context`. With
    `gather_group`, `x` is this rank's dim-0 shard, all-gathered (in high precision: each
    rank's rows are cast after the gather) before the GEMM; with `scatter_group`, the output is
    summed over the group and this rank keeps its dim-0 shard."""
    if module.fp8_primary_weight:
        raise ValueError(
            f"{module}: its weight is held in FP8 with a delayed scale (FP8 primary weights), "
            f"which {type(context.recipe).__name__} cannot use: keep high-precision weights"
        )
    return _FineGrainedLinear.apply(
        x, module.weight, bias, module, context, gather_group, scatter_group
    )


def _cast(x: torch.Tensor, fp8_dtype, recipe, counts, block=None) -> ScaledFp8:
    scheme = SCHEMES[recipe.granularity]
    return quantize_blocks(
        x, fp8_dtype, block or scheme.block, recipe.margin, counts, recipe.power_of_two_scales
    )


def _counts(module, role: str, context: Fp8Context):
    return module.fp8_scaling[role].cast_counts if context.collect_saturation else None


def cast_weight(module, context: Fp8Context) -> WeightCasts:
    """`module`'s weight cast for both of its GEMMs, its scales noted for the health metrics."""
    recipe = context.recipe
    scheme = SCHEMES[recipe.granularity]
    weight, dtype = module.weight.detach(), recipe.fp8_format.forward_dtype
    counts = _counts(module, "weight", context)
    rows = _cast(weight, dtype, recipe, counts, scheme.weight_block)
    if scheme.transposed_weight:
        columns = ScaledFp8(rows.data.t().contiguous(), rows.scale_inv.t().contiguous())
    else:
        columns = _cast(weight.t(), dtype, recipe, counts, scheme.weight_block)
    _note_scale(module, "weight", rows, context)
    return WeightCasts(rows, columns)


def _note_scale(module, role: str, q: ScaledFp8, context: Fp8Context) -> None:
    # What the health metrics read of a role's scale: the smallest of its blocks' (the tightest),
    # noted where they are collected, as the saturation counts are.
    if context.collect_saturation:
        module.fp8_scaling[role].scale.copy_(q.scale_inv.max().reciprocal())


class _FineGrainedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, context: Fp8Context, gather, scatter):
        recipe = context.recipe
        gemm = SCHEMES[recipe.granularity].gemm
        fprop_hp, dgrad_hp, wgrad_hp = recipe.override_linear_precision
        forward_dtype = recipe.fp8_format.forward_dtype
        x2 = x.reshape(-1, x.shape[-1])
        if gather is not None:
            x2 = collectives.all_gather(x2, gather)
        wgrad_fp8 = weight.requires_grad and not wgrad_hp
        dgrad_fp8 = x.requires_grad and not dgrad_hp
        cast = module.fine_grained_weight_cast(context) if not fprop_hp or dgrad_fp8 else None
        if fprop_hp:
            y = F.linear(x2, weight.to(x2.dtype))
        else:
            qx = _cast(x2, forward_dtype, recipe, _counts(module, "input", context))
            _note_scale(module, "input", qx, context)
            y = gemm(qx, cast.rows, x2.dtype)
        if scatter is not None:
            y = collectives.reduce_scatter(y, scatter)
        if bias is not None:
            y = y + bias.to(y.dtype)
        # For backward: the input per input channel (transposed), the weight per input channel.
        x_saved = (
            _cast(x2.t(), forward_dtype, recipe, _counts(module, "input", context))
            if wgrad_fp8
            else x2
        )
        w_saved = cast.columns if dgrad_fp8 else None
        ctx.save_for_backward(
            *(x_saved if wgrad_fp8 else (x_saved,)),
            *(w_saved if dgrad_fp8 else (weight,)),
        )
        ctx.fp8, ctx.module, ctx.context = (dgrad_fp8, wgrad_fp8), module, context
        ctx.gather, ctx.scatter, ctx.has_bias = gather, scatter, bias is not None
        ctx.input_shape, ctx.weight_dtype = x.shape, weight.dtype
        return y.view(-1, *x.shape[1:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        dgrad_fp8, wgrad_fp8 = ctx.fp8
        saved = list(ctx.saved_tensors)
        x_saved = ScaledFp8(saved.pop(0), saved.pop(0)) if wgrad_fp8 else saved.pop(0)
        w_saved = ScaledFp8(saved.pop(0), saved.pop(0)) if dgrad_fp8 else saved.pop(0)
        module, context = ctx.module, ctx.context
        gemm = SCHEMES[context.recipe.granularity].gemm
        backward_dtype = context.recipe.fp8_format.backward_dtype
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy2 = dy.reshape(-1, dy.shape[-1])
        db = None
        if need_db and ctx.has_bias:  # the bias joined this rank's rows after the scatter
            db = dy2.sum(0, dtype=torch.float32)
        if ctx.scatter is not None:
            dy2 = collectives.all_gather(dy2.contiguous(), ctx.scatter)
        counts = _counts(module, "grad_output", context)
        dx = dw = None
        if need_dx:
            if dgrad_fp8:
                qdy = _cast(dy2, backward_dtype, context.recipe, counts)
                _note_scale(module, "grad_output", qdy, context)
                dx = gemm(qdy, w_saved, dy.dtype)
            else:
                dx = dy2 @ w_saved.to(dy.dtype)
            if ctx.gather is not None:
                dx = collectives.reduce_scatter(dx, ctx.gather)
            dx = dx.view(ctx.input_shape[:-1] + dx.shape[-1:])
        if need_dw:
            if wgrad_fp8:
                dw = gemm(_cast(dy2.t(), backward_dtype, context.recipe, counts), x_saved, dy.dtype)
            else:
                dw = dy2.t() @ x_saved.to(dy.dtype)
            dw = _into_main_grad(module, module.weight, dw, ctx.weight_dtype)
        if db is not None:
            db = _into_main_grad(module, module.bias, db, ctx.weight_dtype)
        return dx, dw, db, None, None, None, None


def _into_main_grad(module, param, grad: torch.Tensor, dtype: torch.dtype):
    """With gradient-accumulation fusion, `grad` is added into the parameter's main_grad and
    autograd gets none; else it is autograd's, in the parameter's dtype."""
    if module.fuse_wgrad_accumulation and getattr(param, "main_grad", None) is not None:
        accumulate_into_main_grad(param, grad)
        return None
    return grad.to(dtype)
