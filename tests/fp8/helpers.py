"""Shared pieces of the FP8 tests: fresh random data, relative error, FP8 emulation in fp64."""
from __future__ import annotations

import torch

from megafp8 import fp8_max

# Unit roundoff of round-to-nearest with 3 (E4M3) and 2 (E5M2) stored mantissa bits.
UNIT_ROUNDOFF = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}


def gemm_error_bound(dtype_a: torch.dtype, dtype_b: torch.dtype) -> float:
    """Relative error ‖Ŷ − Y‖/‖Y‖ allowed for a GEMM of two FP8-rounded operands.

    Each rounded operand satisfies ‖Â − A‖ ≤ u‖A‖ (u: unit roundoff, scale fitted so nothing
    saturates). The product's error ΔA·B + A·ΔB + ΔA·ΔB is then, for uncorrelated data where
    ‖A·B‖ ≈ ‖A‖‖B‖/√k like the error terms, at most (u_a + u_b + u_a·u_b)·‖Y‖:
    0.129 for E4M3 x E4M3, 0.195 for E5M2 x E4M3. Accumulation in fp32 adds ~1e-6.
    """
    ua, ub = UNIT_ROUNDOFF[dtype_a], UNIT_ROUNDOFF[dtype_b]
    return ua + ub + ua * ub


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output holds inf or NaN"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def emulate(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the FP8 path computes with: t cast with `scale` (saturating), dequantized, in fp64."""
    limit = fp8_max(dtype)
    q = (t.float() * scale.float()).clamp(-limit, limit).to(dtype)
    return q.double() * scale.float().reciprocal().double()


def random_amax(shape, amax: float, generator=None) -> torch.Tensor:
    """Random values in (-amax, amax) with exactly one element equal to amax."""
    t = (torch.rand(shape, generator=generator) * 2 - 1) * amax * 0.99
    t.view(-1)[0] = amax
    return t
