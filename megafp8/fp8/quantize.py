"""Cast a 2-D high-precision tensor to FP8: amax, scale, saturate, cast, and the transposed copy.

`quantize` runs the fused Triton kernel on CUDA and plain torch elsewhere; both give the same
bytes. The transposed copy (`data_t`) is what the weight-gradient and data-gradient GEMMs need,
because `torch._scaled_mm` takes its first operand row-major and its second column-major.
"""

from __future__ import annotations

import torch

from megafp8 import triton_support

from . import triton_kernels
from .formats import fp8_max
from .tensor import Fp8Tensor, absmax, saturates, scale_from_amax, underflows


def quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    *,
    margin: int = 0,
    rowwise: bool = True,
    columnwise: bool = False,
    scale_out: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    col_sum: bool = False,
    saturation_out: torch.Tensor | None = None,
    out: Fp8Tensor | None = None,
) -> Fp8Tensor:
    """Cast the 2-D tensor `x` to `fp8_dtype`, saturating at ±fp8_max.

    With `scale` (delayed scaling) the cast uses it and the observed amax is returned for the
    history. Without it (current scaling) the scale comes from x's own amax and `margin`, and is
    also written into `scale_out` when given. `amax_out`, when given, is an accumulator the
    observed amax is maxed into (and returned as `amax`): delayed scaling's per-pass record.
    `rowwise`/`columnwise` ask for `data`/`data_t`, `col_sum` for the fp32 column sums of x.
    `saturation_out`, when given, is an int64 triple that (elements saturated, elements cast,
    nonzero elements flushed to zero) are added to (`saturation_bound` and `underflow_bound` say
    which), on the device and without a host sync.
    `out`, when given, is an earlier cast of the same shape and layout whose `data`, `data_t`
    and `scale_inv` are overwritten in place: a cast cached across passes (a weight's) keeps
    the addresses a CUDA graph captured.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    if not (rowwise or columnwise):
        raise ValueError("quantize: ask for at least one of rowwise and columnwise")
    check_cast_counts(saturation_out, x, "quantize")
    x = x.contiguous()
    if x.is_cuda and triton_support.available():
        return triton_kernels.quantize(
            x,
            fp8_dtype,
            scale,
            margin,
            rowwise,
            columnwise,
            scale_out,
            amax_out,
            col_sum,
            saturation_out,
            out,
        )
    q = quantize_torch(
        x,
        fp8_dtype,
        scale,
        margin,
        rowwise,
        columnwise,
        scale_out,
        amax_out,
        col_sum,
        saturation_out,
    )
    if out is None:
        return q
    for target, value in ((out.data, q.data), (out.data_t, q.data_t), (out.scale_inv, q.scale_inv)):
        if value is not None:
            target.copy_(value)
    return q._replace(data=out.data, data_t=out.data_t, scale_inv=out.scale_inv)


def check_cast_counts(counts: torch.Tensor | None, x: torch.Tensor, caller: str) -> None:
    """Refuse a `saturation_out` the kernels would index past: they add three int64 counts in
    place, unchecked, on the device."""
    if counts is None:
        return
    if counts.shape != (3,) or counts.dtype != torch.int64 or counts.device != x.device:
        raise ValueError(
            f"{caller}: saturation_out must be an int64 tensor of 3 counts (saturated, cast, flushed) on "
            f"{x.device}, got shape {tuple(counts.shape)}, {counts.dtype} on {counts.device}; make it with "
            f"torch.zeros(3, dtype=torch.int64, device=...)"
        )


def quantize_torch(
    x,
    fp8_dtype,
    scale,
    margin,
    rowwise,
    columnwise,
    scale_out=None,
    amax_out=None,
    col_sum=False,
    saturation_out=None,
) -> Fp8Tensor:
    """`quantize` in plain torch (its arguments positional): what runs off CUDA, and the
    reference the Triton kernel is tested and benchmarked against."""
    amax = absmax(x)
    if scale is None:
        scale = scale_from_amax(amax, fp8_dtype, margin)
        if scale_out is not None:
            scale_out.copy_(scale)
    if amax_out is not None:
        amax = torch.maximum(amax_out, amax, out=amax_out)
    scaled = x.float() * scale
    if saturation_out is not None:
        saturation_out[0] += saturates(scaled, fp8_dtype).sum()
        saturation_out[1] += x.numel()
        saturation_out[2] += underflows(scaled, fp8_dtype).sum()
    limit = fp8_max(fp8_dtype)
    # Saturate first: a plain .to(float8) may turn out-of-range values into NaN or inf.
    q = scaled.clamp_(-limit, limit).to(fp8_dtype)
    return Fp8Tensor(
        data=q if rowwise else None,
        data_t=q.t().contiguous() if columnwise else None,
        scale_inv=scale.float().reciprocal(),
        amax=amax,
        col_sum=x.sum(0, dtype=torch.float32) if col_sum else None,
    )
