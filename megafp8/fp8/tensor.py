"""What a cast to FP8 produces and the arithmetic around it: the leaf of the FP8 core, imported
by the torch and the Triton quantize alike."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .formats import fp8_max


class Fp8Tensor(NamedTuple):
    """A tensor in FP8: `data` [M, K] and/or `data_t` [K, M], both row-major.

    The high-precision value is `data * scale_inv`; `amax` is the largest |x| of the input
    (non-finite if the input held inf or NaN); `col_sum`, when asked for, is the input's sum
    over rows in fp32 (a linear layer's bias gradient, computed on the same read).
    """

    data: torch.Tensor | None
    data_t: torch.Tensor | None
    scale_inv: torch.Tensor
    amax: torch.Tensor
    col_sum: torch.Tensor | None = None


class ScaledFp8(NamedTuple):
    """A 2-D tensor in FP8 with a scale per block (fine-grained scaling, megafp8.fp8.fine_grained):
    `data` [rows, cols]; `scale_inv` fp32 [rows / block rows, cols / block cols] ([rows, 1] for a
    scale per row), of any strides; the value of an element is its byte times its block's
    `scale_inv`."""

    data: torch.Tensor
    scale_inv: torch.Tensor


class WeightCast(NamedTuple):
    """Where an optimizer's pass writes the FP8 cast of a 2-D weight [rows, cols] that it has
    just updated (Fp8Linear.weight_cast_target, megafp8.training.optimizer.adamw_kernel): `data`
    [rows, cols] and `data_t` [cols, rows] in one FP8 dtype, cast with the fp32 `scale` it reads;
    the largest magnitude is maxed into `amax` (zeroed first) and 1 / scale written to
    `scale_inv`. `counts`, when given (an FP8 primary weight's), takes (elements saturated,
    elements cast, nonzero elements flushed to zero) of the cast (zeroed first; `saturates`,
    `underflows`)."""

    data: torch.Tensor
    data_t: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    scale_inv: torch.Tensor
    counts: torch.Tensor | None = None


def scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """`fp8_max / amax / 2**margin`, or 1 where amax is 0, inf or NaN."""
    # A tensor numerator: `float / tensor` would compute float * (1 / tensor), rounding twice.
    candidate = (torch.full_like(amax, fp8_max(fp8_dtype)) / amax) / (2.0**margin)
    usable = (amax > 0) & torch.isfinite(amax) & torch.isfinite(candidate)
    return torch.where(usable, candidate, torch.ones_like(candidate))


def power_of_two_below(scale: torch.Tensor) -> torch.Tensor:
    """The power of two at or below each positive normal `scale`, exactly (its exponent alone);
    a scale so rounded makes dequantizing exact in any precision."""
    _, exponent = torch.frexp(scale)
    return torch.ldexp(torch.ones_like(scale), exponent - 1)


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


def underflow_bound(fp8_dtype: torch.dtype) -> float:
    """The cast of x * scale flushes a nonzero value to zero when |x * scale| <= this bound: half
    the smallest subnormal (2^-10 in E4M3, 2^-17 in E5M2; the tie rounds to even, which is 0)."""
    info = torch.finfo(fp8_dtype)
    return info.smallest_normal * info.eps / 2


def underflows(scaled: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Where the cast of `scaled` (= x * scale, fp32) turns a nonzero value into zero."""
    return (scaled != 0) & (scaled.abs() <= underflow_bound(fp8_dtype))
