"""Fused FP8 quantization on CUDA: one pass over memory for amax, scale, saturate, cast and
the transposed copy.

Eager torch needs several passes (abs, max, multiply, clamp, cast, transpose); on a
16384 x 2048 bf16 tensor that took longer than the FP8 GEMM it fed. Here each program loads one
tile, folds its |max| into the amax with an atomic, and stores the FP8 tile both as it is and
transposed, so the input is read once and each output written once.
"""
from __future__ import annotations

from typing import Optional

import torch

from .formats import fp8_max

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: quantize() falls back to torch.
    triton = None


def available() -> bool:
    return triton is not None


# Tile shape and warps chosen by benchmarks/bench_quantize.py on an H100 (see RESULTS.md).
BLOCK_M = 64
BLOCK_N = 128
NUM_WARPS = 8

if triton is not None:

    @triton.jit
    def _quantize_kernel(
        x_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, scale_out_ptr, scale_inv_ptr,
        M, N, fp8_max, margin_factor,
        CURRENT: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
        WRITE_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if CURRENT:
            # amax_ptr holds this tensor's amax, computed just before; derive the scale here.
            amax = tl.load(amax_ptr)
            # IEEE division (plain `/` is approximate in Triton), to match torch bit for bit.
            scale = tl.div_rn(fp8_max, amax) * margin_factor
            usable = (amax > 0) & (amax < float("inf")) & (scale < float("inf"))
            scale = tl.where(usable, scale, 1.0)
        else:
            scale = tl.load(scale_ptr)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if not CURRENT:
            # Delayed scaling observes the amax while casting; a NaN counts as +inf.
            magnitude = tl.where(x == x, tl.abs(x), float("inf"))
            tl.atomic_max(amax_ptr, tl.max(tl.max(magnitude, axis=1), axis=0))
        y = tl.clamp(x * scale, -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)
        y = y.to(q_ptr.dtype.element_ty)
        if ROWWISE:
            tl.store(q_ptr + rows[:, None] * N + cols[None, :], y, mask=mask)
        if COLUMNWISE:
            tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(y), mask=tl.trans(mask))
        if (pid_m == 0) & (pid_n == 0):
            tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))
            if WRITE_SCALE:
                tl.store(scale_out_ptr, scale)


def quantize(x, fp8_dtype, scale, margin, rowwise, columnwise, scale_out: Optional[torch.Tensor]):
    from .quantize import Fp8Tensor, absmax

    M, N = x.shape
    current = scale is None
    if current:
        amax = absmax(x)
    else:
        amax = torch.zeros((), device=x.device, dtype=torch.float32)
    q = torch.empty((M, N), device=x.device, dtype=fp8_dtype) if rowwise else None
    qt = torch.empty((N, M), device=x.device, dtype=fp8_dtype) if columnwise else None
    scale_inv = torch.empty((), device=x.device, dtype=torch.float32)
    write_scale = current and scale_out is not None
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _quantize_kernel[grid](
        x,
        q if rowwise else qt,
        qt if columnwise else q,
        amax if current else scale,
        amax,
        scale_out if write_scale else scale_inv,
        scale_inv,
        M,
        N,
        fp8_max(fp8_dtype),
        1.0 / (2.0**margin),
        CURRENT=current,
        ROWWISE=rowwise,
        COLUMNWISE=columnwise,
        WRITE_SCALE=write_scale,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        num_warps=NUM_WARPS,
    )
    return Fp8Tensor(q, qt, scale_inv, amax)
