"""Cast a 2-D high-precision tensor to FP8: amax, scale, saturate, cast, and the transposed copy.

`quantize` runs the fused Triton kernel on CUDA and plain torch elsewhere; both give the same
bytes. The transposed copy (`data_t`) is what the weight-gradient and data-gradient GEMMs need,
because `torch._scaled_mm` takes its first operand row-major and its second column-major.
"""
from __future__ import annotations

import math
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


def saturation_bound(fp8_dtype: torch.dtype) -> tuple[float, bool]:
    """(bound, inclusive): the cast of x * scale saturates a value that would not have rounded
    to ±fp8_max anyway when |x * scale| > bound (>= when inclusive). The bound is half an FP8
    step above fp8_max; the tie rounds to even, which is down to 448 in E4M3 (1.110b x 2^8)
    and up to infinity in E5M2 (1.11b x 2^15).

    Values just above fp8_max are not counted: they round to it regardless, and a freshly fitted
    scale (fp8_max / amax) puts the amax itself one fp32 ulp above fp8_max about one time in ten.
    """
    limit = fp8_max(fp8_dtype)
    step = torch.finfo(fp8_dtype).eps * 2.0 ** math.floor(math.log2(limit))
    return limit + step / 2, int(limit / step) % 2 == 1


def saturates(scaled: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Where the saturating cast of `scaled` (= x * scale, fp32) changes a value (`saturation_bound`)."""
    bound, inclusive = saturation_bound(fp8_dtype)
    return scaled.abs() >= bound if inclusive else scaled.abs() > bound


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
    saturation_out: Optional[torch.Tensor] = None,
) -> Fp8Tensor:
    """Cast the 2-D tensor `x` to `fp8_dtype`, saturating at ±fp8_max.

    With `scale` (delayed scaling) the cast uses it and the observed amax is returned for the
    history. Without it (current scaling) the scale comes from x's own amax and `margin`, and is
    also written into `scale_out` when given. `amax_out`, when given, is an accumulator the
    observed amax is maxed into (and returned as `amax`): delayed scaling's per-pass record.
    `rowwise`/`columnwise` ask for `data`/`data_t`, `col_sum` for the fp32 column sums of x.
    `saturation_out`, when given, is an int64 pair that (elements saturated, elements cast) are
    added to (`saturation_bound` says which), on the device and without a host sync.
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
                x, fp8_dtype, scale, margin, rowwise, columnwise, scale_out, amax_out, col_sum, saturation_out
            )
    return _quantize_torch(
        x, fp8_dtype, scale, margin, rowwise, columnwise, scale_out, amax_out, col_sum, saturation_out
    )


def _quantize_torch(
    x, fp8_dtype, scale, margin, rowwise, columnwise, scale_out=None, amax_out=None, col_sum=False,
    saturation_out=None,
) -> Fp8Tensor:
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
