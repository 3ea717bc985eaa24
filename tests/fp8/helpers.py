"""Shared pieces of the FP8 tests: fresh random data, relative error, FP8 emulation in fp64, bitwise
comparison, the kernels' int64-offset path on small tensors."""

from __future__ import annotations

import pytest
import torch

from megafp8 import fp8_max

# Unit roundoff of round-to-nearest with 3 (E4M3) and 2 (E5M2) stored mantissa bits.
UNIT_ROUNDOFF = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}

# Just over 2^31 elements, 4.3 GB in bf16: offsets into it overflow int32, as those of a [65536,
# 49152] MLP activation (micro-batch 8 x 8192 tokens at hidden 12288) did on an H100, so the cast
# kernels take int64 ones. The GPU tests' references run HUGE_CHUNK rows at a time (an fp32 copy of
# the whole would be 8.6 GB), and the tests need a GPU of 40 GB.
HUGE = (65536 + 8, 32768)
HUGE_CHUNK = 8192
needs_40gb = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 40 * 2**30,
    reason="needs a GPU with 40 GB of memory",
)


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


def assert_same_bits(a, b, what=None) -> None:
    """Two tensors, or tuples of them (an Fp8Tensor, say), alike bit for bit: shapes, dtypes, bytes
    (NaNs too); None where the other is None."""
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b), what
        for name, x, y in zip(getattr(a, "_fields", range(len(a))), a, b):
            assert_same_bits(x, y, (what, name))
        return
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def launch_with_offsets(wide: bool, module, kernel: str, call):
    """call()'s result, its launches of `module.kernel` taking the kernels' int64-offset path
    (WIDE) if `wide`, the int32 one if not; asserts they did. Wide, triton_support.OFFSET_LIMIT is
    lowered to one element meanwhile: small tensors take the path of 2^31 elements or more."""
    from megafp8 import triton_support

    original, limit, flags = getattr(module, kernel), triton_support.OFFSET_LIMIT, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                flags.append(kwargs["WIDE"])
                return original[grid](*args, **kwargs)

            return launch

    setattr(module, kernel, Spy())
    if wide:
        triton_support.OFFSET_LIMIT = 1
    try:
        result = call()
    finally:
        setattr(module, kernel, original)
        triton_support.OFFSET_LIMIT = limit
    assert flags and all(flag == wide for flag in flags), (kernel, wide, flags)
    return result
