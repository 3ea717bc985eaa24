"""Cast a 2-D high-precision tensor to FP8: amax, scale, saturate, cast, and the transposed copy.

`quantize` runs the fused Triton kernel on CUDA and plain torch elsewhere; both give the same
bytes. The transposed copy (`data_t`) is what the weight-gradient and data-gradient GEMMs need,
because `torch._scaled_mm` takes its first operand row-major and its second column-major.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .formats import fp8_max


class Fp8Tensor(NamedTuple):
    """A tensor in FP8: `data` [M, K] and/or `data_t` [K, M], both row-major.

    The high-precision value is `data * scale_inv`; `amax` is the largest |x| of the input
    (non-finite if the input held inf or NaN); `col_sum`, when asked for, is the input's sum
    over rows in fp32 (a linear layer's bias gradient, computed on the same read).
    """

    data: Optional[torch.Tensor]
    data_t: Optional[torch.Tensor]
    scale_inv: torch.Tensor
    amax: torch.Tensor
    col_sum: Optional[torch.Tensor] = None


def scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """`fp8_max / amax / 2**margin`, or 1 where amax is 0, inf or NaN."""
    # A tensor numerator: `float / tensor` would compute float * (1 / tensor), rounding twice.
    candidate = (torch.full_like(amax, fp8_max(fp8_dtype)) / amax) / (2.0**margin)
    usable = (amax > 0) & torch.isfinite(amax) & torch.isfinite(candidate)
    return torch.where(usable, candidate, torch.ones_like(candidate))


def absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| in fp32 in one read, without materialising |x|; NaN if x holds a NaN."""
    return torch.linalg.vector_norm(x, ord=float("inf"), dtype=torch.float32)


def quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    *,
    margin: int = 0,
    rowwise: bool = True,
    columnwise: bool = False,
    scale_out: Optional[torch.Tensor] = None,
    amax_out: Optional[torch.Tensor] = None,
    col_sum: bool = False,
) -> Fp8Tensor:
    """Cast the 2-D tensor `x` to `fp8_dtype`, saturating at ±fp8_max.

    With `scale` (delayed scaling) the cast uses it and the observed amax is returned for the
    history. Without it (current scaling) the scale comes from x's own amax and `margin`, and is
    also written into `scale_out` when given. `amax_out`, when given, is an accumulator the
    observed amax is maxed into (and returned as `amax`): delayed scaling's per-pass record.
    `rowwise`/`columnwise` ask for `data`/`data_t`, `col_sum` for the fp32 column sums of x.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    if not (rowwise or columnwise):
        raise ValueError("quantize: ask for at least one of rowwise and columnwise")
    x = x.contiguous()
    if x.is_cuda:
        from . import triton_kernels

        if triton_kernels.available():
            return triton_kernels.quantize(
                x, fp8_dtype, scale, margin, rowwise, columnwise, scale_out, amax_out, col_sum
            )
    return _quantize_torch(x, fp8_dtype, scale, margin, rowwise, columnwise, scale_out, amax_out, col_sum)


def _quantize_torch(
    x, fp8_dtype, scale, margin, rowwise, columnwise, scale_out=None, amax_out=None, col_sum=False
) -> Fp8Tensor:
    amax = absmax(x)
    if scale is None:
        scale = scale_from_amax(amax, fp8_dtype, margin)
        if scale_out is not None:
            scale_out.copy_(scale)
    if amax_out is not None:
        amax = torch.maximum(amax_out, amax, out=amax_out)
    limit = fp8_max(fp8_dtype)
    # Saturate first: a plain .to(float8) may turn out-of-range values into NaN or inf.
    q = (x.float() * scale).clamp_(-limit, limit).to(fp8_dtype)
    return Fp8Tensor(
        data=q if rowwise else None,
        data_t=q.t().contiguous() if columnwise else None,
        scale_inv=scale.float().reciprocal(),
        amax=amax,
        col_sum=x.sum(0, dtype=torch.float32) if col_sum else None,
    )
