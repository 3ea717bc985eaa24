"""Rowwise scaling (megafp8.fp8.recipe.RowwiseScaling): an Fp8Linear's GEMMs with a scale per
row of each operand, along the dimension the GEMM sums over, through `torch._scaled_mm`'s
rowwise mode (Hopper GPUs through cuBLAS, and the CPU).

For `y = x W^T` (x [M, K] tokens by input channels, W [N, K]):

    fprop   y  = x W^T      x per token (over K),         W per output channel (over K)
    dgrad   dx = dy W       dy per token (over N),        W per input channel (over N)
    wgrad   dW = dy^T x     dy per output channel (over M), x per input channel (over M)

so x, W and dy are each cast twice, once for each GEMM they enter, each cast fitted to its rows'
own amaxes (no history, no collective). The transposed casts are made from the transposes in
torch; the casts run in torch ops too (a fused kernel is the next step).
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


class RowwiseFp8(NamedTuple):
    """A 2-D tensor in FP8 with a scale per row: `data` [rows, cols], its value
    `data * scale_inv` with `scale_inv` [rows, 1] in fp32."""

    data: torch.Tensor
    scale_inv: torch.Tensor


class RowwiseWeight(NamedTuple):
    """A weight [N, K] cast for both GEMMs it enters: `rows` per output channel (fprop), and
    `columns`, its transpose [K, N], per input channel (dgrad)."""

    rows: RowwiseFp8
    columns: RowwiseFp8


def quantize_rows(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    saturation_out=None,
    power_of_two: bool = False,
) -> RowwiseFp8:
    """Cast the 2-D `x` to `fp8_dtype` with each row's scale fitted to its own amax
    (`fp8_max / amax / 2**margin`, 1 for a row of zeros or one holding inf/NaN; with
    `power_of_two`, the power of two at or below it), saturating;
    `saturation_out`, an int64 triple, takes (elements saturated, elements cast, nonzero
    elements flushed to zero) as megafp8.fp8.quantize counts them. The bytes are row-major."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows expects a 2-D tensor, got shape {tuple(x.shape)}")
    # row-major, as the GEMM's first operand must be (a transpose is laid out in x's dtype)
    values = x.contiguous().float()
    amax = values.abs().amax(dim=1, keepdim=True)
    scale = scale_from_amax(amax, fp8_dtype, margin)
    if power_of_two:  # dequantizing is then exact in any precision
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = values * scale
    if saturation_out is not None:
        saturation_out[0] += saturates(scaled, fp8_dtype).sum()
        saturation_out[1] += x.numel()
        saturation_out[2] += underflows(scaled, fp8_dtype).sum()
    limit = fp8_max(fp8_dtype)
    return RowwiseFp8(scaled.clamp_(-limit, limit).to(fp8_dtype), scale.reciprocal())


def rowwise_gemm(a: RowwiseFp8, b: RowwiseFp8, out_dtype: torch.dtype) -> torch.Tensor:
    """`(a.data * a.scale_inv) @ (b.data * b.scale_inv)^T` for `a` [M, K] and `b` [N, K], each
    scaled per row: [M, N] in `out_dtype`. The GEMM writes bf16 (what cuBLAS's rowwise
    scaling writes on Hopper), converted after."""
    y = torch._scaled_mm(
        a.data,
        b.data.t(),
        scale_a=a.scale_inv,
        scale_b=b.scale_inv.reshape(1, -1),
        out_dtype=torch.bfloat16,
    )
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


def rowwise_linear(
    module, x: torch.Tensor, bias, context: Fp8Context, gather_group=None, scatter_group=None
) -> torch.Tensor:
    """`x W^T + bias` for Fp8Linear `module` under a RowwiseScaling `context`. With
    `gather_group`, `x` is this rank's dim-0 shard, all-gathered (in high precision: each
    rank's rows are cast after the gather) before the GEMM; with `scatter_group`, the output is
    summed over the group and this rank keeps its dim-0 shard."""
    if module.fp8_primary_weight:
        raise ValueError(
            f"{module}: its weight is held in FP8 with a delayed scale (FP8 primary weights), "
            "which rowwise scaling cannot use: keep high-precision weights"
        )
    return _RowwiseLinear.apply(
        x, module.weight, bias, module, context, gather_group, scatter_group
    )


def _cast(x: torch.Tensor, fp8_dtype, recipe, counts) -> RowwiseFp8:
    return quantize_rows(x, fp8_dtype, recipe.margin, counts, recipe.power_of_two_scales)


def _counts(module, role: str, context: Fp8Context):
    return module.fp8_scaling[role].cast_counts if context.collect_saturation else None


def cast_weight(module, context: Fp8Context) -> RowwiseWeight:
    """`module`'s weight cast for both of its GEMMs, its scales noted for the health metrics."""
    recipe = context.recipe
    weight = module.weight.detach()
    counts = _counts(module, "weight", context)
    rows = _cast(weight, recipe.fp8_format.forward_dtype, recipe, counts)
    columns = _cast(weight.t(), recipe.fp8_format.forward_dtype, recipe, counts)
    _note_scale(module, "weight", rows)
    return RowwiseWeight(rows, columns)


def _note_scale(module, role: str, q: RowwiseFp8) -> None:
    # What the health metrics read of a role's scale: the smallest of its rows' (the tightest).
    module.fp8_scaling[role].scale.copy_(q.scale_inv.max().reciprocal())


class _RowwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, context: Fp8Context, gather, scatter):
        recipe = context.recipe
        fprop_hp, dgrad_hp, wgrad_hp = recipe.override_linear_precision
        forward_dtype = recipe.fp8_format.forward_dtype
        x2 = x.reshape(-1, x.shape[-1])
        if gather is not None:
            x2 = collectives.all_gather(x2, gather)
        wgrad_fp8 = weight.requires_grad and not wgrad_hp
        dgrad_fp8 = x.requires_grad and not dgrad_hp
        cast = module.rowwise_weight_cast(context) if not fprop_hp or dgrad_fp8 else None
        if fprop_hp:
            y = F.linear(x2, weight.to(x2.dtype))
        else:
            qx = _cast(x2, forward_dtype, recipe, _counts(module, "input", context))
            _note_scale(module, "input", qx)
            y = rowwise_gemm(qx, cast.rows, x2.dtype)
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
        x_saved = RowwiseFp8(saved.pop(0), saved.pop(0)) if wgrad_fp8 else saved.pop(0)
        w_saved = RowwiseFp8(saved.pop(0), saved.pop(0)) if dgrad_fp8 else saved.pop(0)
        module, context = ctx.module, ctx.context
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
                _note_scale(module, "grad_output", qdy)
                dx = rowwise_gemm(qdy, w_saved, dy.dtype)
            else:
                dx = dy2 @ w_saved.to(dy.dtype)
            if ctx.gather is not None:
                dx = collectives.reduce_scatter(dx, ctx.gather)
            dx = dx.view(ctx.input_shape[:-1] + dx.shape[-1:])
        if need_dw:
            if wgrad_fp8:
                dw = rowwise_gemm(
                    _cast(dy2.t(), backward_dtype, context.recipe, counts), x_saved, dy.dtype
                )
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
