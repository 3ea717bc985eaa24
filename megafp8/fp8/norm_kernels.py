"""LayerNorm / RMSNorm whose output is written directly in FP8, and the norm's backward.

The QKV and fc1 GEMMs take the norm's output in FP8, row-major and transposed. Unfused, the norm
writes y in bf16 and `quantize` reads it back: 8 bytes of traffic per element. `norm_quantize`
does the statistics, the normalisation, the amax and both FP8 layouts in one Triton launch
(Transformer Engine's LayerNormLinear idea), reading x from device memory once (its re-read
hits L1/L2) and writing 1 + 1 bytes per element; the transposed layout is the row-major tile
just stored, copied as bytes. y is rounded to x's dtype before the cast, so the bytes are those
of the unfused norm module followed by `quantize_torch`.

`norm_backward` takes the forward's statistics to aten's backward kernels on CUDA.

Off CUDA (or without triton) both run the plain torch reference, `norm_forward_torch` +
`quantize_torch` and `norm_backward_torch`, in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megafp8.triton_support import available, wide_offsets

from .quantize import check_cast_counts, quantize_torch
from .tensor import Fp8Tensor, saturation_bound, underflow_bound

try:
    import triton
    import triton.language as tl

    from megafp8.triton_support import round_to

    from .triton_kernels import cast_outcomes, to_fp8, transpose_stored_tile
except ImportError:  # CPU-only installs: the torch reference runs instead.
    triton = None

__all__ = [
    "available",
    "norm_backward",
    "norm_backward_torch",
    "norm_forward_torch",
    "norm_quantize",
    "norm_quantize_triton",
]

# Tiles and warps swept on an H100 (benchmarks/RESULTS.md, "Neighbour fusion"): 32 rows of 256
# columns, 8 warps, one program a block, 104 us for 16384 x 2048 against the unfused 120 us; a
# persistent launch that bounded the rows in flight to keep the re-reads in L2 was slower.
BLOCK_M = 32  # rows per block: 32 FP8 bytes per column of data_t, one 32-byte sector
BLOCK_N = 256
NUM_WARPS = 8


def norm_forward_torch(
    x, weight, bias, eps: float, rms: bool
) -> tuple[Tensor, Tensor | None, Tensor]:
    """(y, mean, rstd): the norm of each row of `x` [M, N] in fp32, y rounded to x.dtype;
    mean [M] (None when `rms`) and rstd [M] fp32, aten's conventions (biased variance)."""
    xf = x.float()
    if rms:
        mean = None
        rstd = torch.sqrt((xf * xf).mean(1) + eps).reciprocal()
        xhat = xf * rstd[:, None]
    else:
        mean = xf.mean(1)
        centred = xf - mean[:, None]
        rstd = torch.sqrt((centred * centred).mean(1) + eps).reciprocal()
        xhat = centred * rstd[:, None]
    y = xhat * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


def norm_backward_torch(
    dy, x, weight, mean, rstd, rms: bool, need_weight_grad=True, need_bias_grad=True
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """`norm_backward` in plain torch, fp32: what runs off CUDA, and the Triton kernel's reference."""
    xf, dyf = x.float(), dy.float()
    xhat = (xf if rms else xf - mean[:, None]) * rstd[:, None]
    wdy = dyf * weight.float()
    c1 = (xhat * wdy).mean(1, keepdim=True)
    if rms:
        dx = (wdy - xhat * c1) * rstd[:, None]
    else:
        dx = (wdy - (xhat * c1 + wdy.mean(1, keepdim=True))) * rstd[:, None]
    dweight = (dyf * xhat).sum(0).to(weight.dtype) if need_weight_grad else None
    dbias = dyf.sum(0).to(weight.dtype) if need_bias_grad and not rms else None
    return dx.to(x.dtype), dweight, dbias


def norm_quantize(
    x,
    weight,
    bias,
    eps: float,
    rms: bool,
    fp8_dtype,
    scale,
    *,
    rowwise=True,
    columnwise=True,
    amax_out=None,
    saturation_out=None,
) -> tuple[Fp8Tensor, Tensor | None, Tensor]:
    """(q, mean, rstd): the LayerNorm (RMSNorm when `rms`) of each row of `x` [M, N] (bf16, fp16
    or fp32), cast to FP8 with the delayed scale `scale` (a 0-dim fp32 tensor).

    LayerNorm: y = (x - mean) * rstd * weight + bias, rstd = 1 / sqrt(biased var + eps); RMSNorm:
    y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps), no bias. y is rounded to x.dtype and
    then cast exactly as `quantize_torch(y, fp8_dtype, scale, 0, rowwise, columnwise, None,
    amax_out, False, saturation_out)` would: q.data [M, N] and/or q.data_t [N, M], q.scale_inv =
    1 / scale, q.amax = max |y| (maxed into `amax_out` when given; non-finite if y is: inf for a
    NaN on CUDA, as triton_kernels.quantize has it, NaN in torch), `saturation_out`'s (saturated,
    cast, flushed) counts incremented. mean [M] (None when `rms`) and rstd [M] are fp32, for
    `norm_backward`.
    """
    if x.dim() != 2:
        raise ValueError(f"norm_quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    if not (rowwise or columnwise):
        raise ValueError("norm_quantize: ask for at least one of rowwise and columnwise")
    if rms and bias is not None:
        raise ValueError("norm_quantize: RMSNorm takes no bias")
    if scale is None:
        raise ValueError("norm_quantize casts with a given (delayed) scale")
    check_cast_counts(saturation_out, x, "norm_quantize")
    x = x.contiguous()
    if x.is_cuda and available():
        return norm_quantize_triton(
            x,
            weight,
            bias,
            eps,
            rms,
            fp8_dtype,
            scale,
            rowwise,
            columnwise,
            amax_out,
            saturation_out,
        )
    y, mean, rstd = norm_forward_torch(x, weight, bias, eps, rms)
    q = quantize_torch(
        y, fp8_dtype, scale, 0, rowwise, columnwise, None, amax_out, False, saturation_out
    )
    return q, mean, rstd


def norm_backward(
    dy, x, weight, mean, rstd, rms: bool, *, need_weight_grad=True, need_bias_grad=True
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(dx, dweight, dbias) of `norm_quantize`'s norm given dy [M, N] (x.dtype) and the forward's
    mean and rstd: dx in x.dtype, dweight and dbias in weight.dtype, None where not asked for
    (dbias always when `rms`). On CUDA aten's own backward kernels run (what the unfused norm's
    autograd runs; a Triton one took 231 us where they took 167 on an H100); elsewhere, and for
    a weight in another dtype than x (which aten's CUDA backward refuses), `norm_backward_torch`."""
    dy, x = dy.contiguous(), x.contiguous()
    need_bias_grad = need_bias_grad and not rms
    if x.is_cuda and weight.dtype == x.dtype:
        shape, rstd = [x.shape[1]], rstd[:, None]
        if rms:
            dx, dweight = torch.ops.aten._fused_rms_norm_backward(
                dy, x, shape, rstd, weight, [True, need_weight_grad]
            )
            return dx, dweight if need_weight_grad else None, None
        # The bias argument only gives dbias its dtype and shape: the weight's (one module's).
        dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
            dy,
            x,
            shape,
            mean[:, None],
            rstd,
            weight,
            weight,
            [True, need_weight_grad, need_bias_grad],
        )
        return dx, dweight if need_weight_grad else None, dbias if need_bias_grad else None
    return norm_backward_torch(dy, x, weight, mean, rstd, rms, need_weight_grad, need_bias_grad)


if triton is not None:

    @triton.jit
    def _normalise(x, mean, rstd, w, b, RMS: tl.constexpr, HAS_BIAS: tl.constexpr):
        # The torch reference's order of operations, so that y rounds the same.
        if RMS:
            y = x * rstd * w
        else:
            y = (x - mean) * rstd * w
        if HAS_BIAS:
            y = y + b
        return y

    @triton.jit
    def _observe(
        y,
        amax,
        saturated,
        flushed,
        scale,
        saturation_bound,
        flush_bound,
        SATURATION: tl.constexpr,
        BOUND_INCLUSIVE: tl.constexpr,
    ):
        # y: a tile of the rounded output, 0 in the padding. A NaN counts as +inf, as in
        # triton_kernels._quantize_kernel; the counts are those of quantize.saturates and
        # quantize.underflows.
        magnitude = tl.where(y == y, tl.abs(y), float("inf"))
        amax = tl.maximum(amax, tl.max(tl.max(magnitude, axis=1), axis=0))
        if SATURATION:
            hits, small = cast_outcomes(
                tl.abs(y * scale), saturation_bound, flush_bound, BOUND_INCLUSIVE
            )
            saturated += tl.sum(tl.sum(hits, axis=1), axis=0)
            flushed += tl.sum(tl.sum(small, axis=1), axis=0)
        return amax, saturated, flushed

    @triton.jit
    def _load_tile(ptr, rows, cols, M, N: tl.constexpr):
        # The [rows, cols] tile of a row-major [M, N] tensor in fp32, 0 outside it; and its mask.
        # Offsets in int64 where rows are (WIDE).
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        return tl.load(ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        ), mask

    @triton.jit
    def _row_statistics(
        x_ptr,
        rows,
        M,
        eps,
        N: tl.constexpr,
        RMS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # (mean, rstd) of the rows, chunk by chunk. LayerNorm: each chunk's mean and centred sum
        # of squares in registers, merged into the running ones (Chan et al.), on x less its first
        # chunk's mean: merging means of |mean| >> std would cancel their rounding errors into the
        # variance. IEEE division and square root, not rsqrt: rstd as the torch reference has it.
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        if RMS:
            for start in range(0, N, BLOCK_N):
                x, mask = _load_tile(x_ptr, rows, start + tl.arange(0, BLOCK_N), M, N)
                m2 += tl.sum(x * x, axis=1)
            mean = m2  # no mean: unused
        else:
            x, mask = _load_tile(x_ptr, rows, tl.arange(0, BLOCK_N), M, N)
            shift = tl.div_rn(tl.sum(x, axis=1), float(min(N, BLOCK_N)))
            mean = tl.zeros([BLOCK_M], dtype=tl.float32)
            seen = 0.0
            for start in range(0, N, BLOCK_N):
                x, mask = _load_tile(x_ptr, rows, start + tl.arange(0, BLOCK_N), M, N)
                x = tl.where(mask, x - shift[:, None], 0.0)
                count = tl.minimum(N - start, BLOCK_N).to(tl.float32)
                chunk_mean = tl.div_rn(tl.sum(x, axis=1), count)
                centred = tl.where(mask, x - chunk_mean[:, None], 0.0)
                delta = chunk_mean - mean
                total = seen + count
                mean += delta * tl.div_rn(count, total)
                m2 += tl.sum(centred * centred, axis=1) + delta * delta * tl.div_rn(
                    seen * count, total
                )
                seen = total
            mean += shift
        return mean, tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(m2, float(N)) + eps))

    @triton.jit
    def _norm_quantize_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        q_ptr,
        qt_ptr,
        mean_ptr,
        rstd_ptr,
        scale_ptr,
        scale_inv_ptr,
        amax_ptr,
        saturation_ptr,
        M,
        eps,
        saturation_bound,
        flush_bound,
        N: tl.constexpr,
        RMS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        SATURATION: tl.constexpr,
        BOUND_INCLUSIVE: tl.constexpr,
        WIDE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # One block of BLOCK_M rows: their statistics chunk by chunk, then each chunk normalised
        # and cast (its second read of x hits L1/L2).
        pid = tl.program_id(0)
        if WIDE:  # int64 rows, and cols below: offsets of 2^31 elements or more (see wide_offsets)
            pid = pid.to(tl.int64)
        dtype: tl.constexpr = x_ptr.dtype.element_ty
        scale = tl.load(scale_ptr)
        amax = 0.0
        saturated = 0
        flushed = 0
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mean, rstd = _row_statistics(x_ptr, rows, M, eps, N, RMS, BLOCK_M, BLOCK_N)
        if not RMS:
            tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            if WIDE:  # cols * M, the transposed layout's offsets
                cols = cols.to(tl.int64)
            col_mask = cols < N
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            b = w  # unused without a bias
            if HAS_BIAS:
                b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            if ROWWISE:
                x, mask = _load_tile(x_ptr, rows, cols, M, N)
                y = _normalise(
                    x, mean[:, None], rstd[:, None], w[None, :], b[None, :], RMS, HAS_BIAS
                )
                y = tl.where(mask, round_to(y, dtype), 0.0)
                amax, saturated, flushed = _observe(
                    y,
                    amax,
                    saturated,
                    flushed,
                    scale,
                    saturation_bound,
                    flush_bound,
                    SATURATION,
                    BOUND_INCLUSIVE,
                )
                tl.store(
                    q_ptr + rows[:, None] * N + cols[None, :],
                    to_fp8(y * scale, q_ptr.dtype.element_ty),
                    mask=mask,
                )
            if COLUMNWISE:
                mask_t = col_mask[:, None] & row_mask[None, :]
                if ROWWISE:
                    transpose_stored_tile(q_ptr, qt_ptr, rows[None, :], cols[:, None], mask_t, M, N)
                else:
                    x_t = tl.load(
                        x_ptr + rows[None, :] * N + cols[:, None], mask=mask_t, other=0.0
                    ).to(tl.float32)
                    y_t = _normalise(
                        x_t, mean[None, :], rstd[None, :], w[:, None], b[:, None], RMS, HAS_BIAS
                    )
                    y_t = tl.where(mask_t, round_to(y_t, dtype), 0.0)
                    amax, saturated, flushed = _observe(
                        y_t,
                        amax,
                        saturated,
                        flushed,
                        scale,
                        saturation_bound,
                        flush_bound,
                        SATURATION,
                        BOUND_INCLUSIVE,
                    )
                    tl.store(
                        qt_ptr + cols[:, None] * M + rows[None, :],
                        to_fp8(y_t * scale, qt_ptr.dtype.element_ty),
                        mask=mask_t,
                    )
        tl.atomic_max(amax_ptr, amax)
        if SATURATION:
            tl.atomic_add(saturation_ptr, saturated.to(tl.int64))
            tl.atomic_add(saturation_ptr + 1, tl.sum(row_mask.to(tl.int64), axis=0) * N)
            tl.atomic_add(saturation_ptr + 2, flushed.to(tl.int64))
        if pid == 0:
            tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))


def norm_quantize_triton(
    x,
    weight,
    bias,
    eps,
    rms,
    fp8_dtype,
    scale,
    rowwise,
    columnwise,
    amax_out=None,
    saturation_out=None,
):
    """`norm_quantize` in one Triton launch (x contiguous, its arguments positional): what runs on
    CUDA, and in Triton's interpreter in the tests."""
    M, N = x.shape
    device = x.device
    q = torch.empty((M, N), device=device, dtype=fp8_dtype) if rowwise else None
    qt = torch.empty((N, M), device=device, dtype=fp8_dtype) if columnwise else None
    mean = None if rms else torch.empty(M, device=device, dtype=torch.float32)
    rstd = torch.empty(M, device=device, dtype=torch.float32)
    scale_inv = torch.empty((), device=device, dtype=torch.float32)
    amax = amax_out if amax_out is not None else torch.zeros((), device=device, dtype=torch.float32)
    bound, inclusive = saturation_bound(fp8_dtype)
    _norm_quantize_kernel[(triton.cdiv(M, BLOCK_M),)](
        x,
        weight,
        bias if bias is not None else weight,
        q if rowwise else qt,
        qt if columnwise else q,
        mean if mean is not None else rstd,
        rstd,
        scale,
        scale_inv,
        amax,
        saturation_out if saturation_out is not None else rstd,
        M,
        eps,
        bound,
        underflow_bound(fp8_dtype),
        N=N,
        RMS=rms,
        HAS_BIAS=bias is not None,
        ROWWISE=rowwise,
        COLUMNWISE=columnwise,
        SATURATION=saturation_out is not None,
        BOUND_INCLUSIVE=inclusive,
        WIDE=wide_offsets(x, q, qt),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        num_warps=NUM_WARPS,
    )
    return Fp8Tensor(q, qt, scale_inv, amax), mean, rstd
