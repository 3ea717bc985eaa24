"""Fused Triton casts of fine-grained scaling (megafp8.fp8.fine_grained), used on CUDA and in
Triton's interpreter; elsewhere the torch reference runs.

A GEMM operand is cast along the dimension its GEMM sums over, so an activation x [M, K] enters
fprop scaled along its rows and wgrad transposed, scaled along its columns. `quantize_pair` reads
x once, 128 x 128 tiles at a time, and writes both casts: the row cast [M, K] and the column
cast [K, M], each with its inverse scales. Eager torch needs a dozen passes for the two.

- blockwise (1 x 128 blocks): each tile holds whole blocks of both casts, so one launch fits
  the scales and casts. The inverse scales are written as cuBLAS's blockwise GEMM takes them:
  [rows, cols / 128], outer-dim-major (stride (1, rows)).
- rowwise (a scale per whole row): a first launch maxes each tile's row and column amaxes into
  every row's and column's, a second fits the scales and casts; x is read twice.
- a weight's 128 x 128 blocks (`quantize_squares`): one scale per tile, the tile written to the
  row cast and, transposed, to the column cast; the inverse scales [rows / 128, cols / 128]
  row-major with the row stride rounded up to 4, cuBLAS's padding for 128 x 128 scales.

The arithmetic is the torch reference's: the scale fitted to the block's amax with IEEE division
(fp8_max / amax / 2^margin, 1 for a block of zeros or one holding inf/NaN), rounded down to a
power of two when asked, a saturating cast; the bytes and scales are the reference's, bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megafp8 import collectives
from megafp8.triton_support import INTERPRETING, wide_offsets

from .formats import fp8_max
from .tensor import ScaledFp8, saturation_bound, underflow_bound

try:
    import triton
    import triton.language as tl

    from .activation_kernels import activation_tile, gelu_grad_tile, swiglu_grad_tile
    from .triton_kernels import cast_outcomes, to_fp8
except ImportError:  # CPU-only installs: the torch reference runs instead.
    triton = None

TILE = 128  # a tile holds whole 1 x 128 and 128 x 128 blocks, along both of its axes
NUM_WARPS = 8


def runs_on(x: torch.Tensor) -> bool:
    """Whether the fused casts run for `x`: on CUDA with Triton, or in Triton's interpreter."""
    return triton is not None and (x.is_cuda or INTERPRETING)


if triton is not None:

    @triton.jit
    def _fitted_scale(amax, fp8_max, margin_factor, POWER_OF_TWO: tl.constexpr):
        # megafp8.fp8.tensor.scale_from_amax, in IEEE division (plain `/` is approximate here)
        scale = tl.div_rn(fp8_max, amax) * margin_factor
        usable = (amax > 0) & (amax < float("inf")) & (scale < float("inf"))
        scale = tl.where(usable, scale, 1.0)
        if POWER_OF_TWO:  # the exponent alone: the power of two at or below a positive normal
            scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        return scale

    @triton.jit
    def _tile_outcomes(scaled, saturation_bound, flush_bound, INCLUSIVE: tl.constexpr):
        # A tile's (saturated, nonzero flushed to zero) counts in one reduction, packed as
        # saturated + 2^16 flushed (each at most 128 x 128), unpacked here
        hits, flushed = cast_outcomes(tl.abs(scaled), saturation_bound, flush_bound, INCLUSIVE)
        packed = tl.sum(tl.sum(hits + flushed * 65536, axis=1), axis=0)
        return packed & 0xFFFF, packed >> 16

    @triton.jit
    def _line_scales(
        peaks,
        amax_ptr,
        index,
        count,
        square_scale,
        fp8_max,
        margin_factor,
        MODE: tl.constexpr,
        POWER_OF_TWO: tl.constexpr,
    ):
        # The scales of a tile's rows (or, transposed, its columns): fitted to their own `peaks`
        # (mode 0), to the whole lines' amaxes at amax_ptr[index] (mode 2), or the square's
        if MODE == 3:
            scale = tl.zeros_like(peaks) + square_scale
        else:
            if MODE == 2:
                peaks = tl.load(amax_ptr + index, mask=index < count, other=0.0)
            scale = _fitted_scale(peaks, fp8_max, margin_factor, POWER_OF_TWO)
        return scale

    @triton.jit
    def _read(
        x_ptr,
        h_ptr,
        r,
        c,
        mask,
        stride_x,
        F,
        KH,
        first_col,
        READ: tl.constexpr,
        KIND: tl.constexpr,
    ):
        # What the cast reads at rows r, columns c (index tensors that broadcast to the tile,
        # either way round), in fp32, 0 in the padding: x itself (READ 0); the activation KIND of
        # the activation input at x_ptr [M, KH] (1: F output columns, KH = 2F for SwiGLU); its
        # gradient (2), x_ptr the gradient of its output [M, F], h_ptr its input [M, KH], the
        # tile at column `first_col` of [d gate | d up] (SwiGLU: tiles hold one half's columns).
        # The activation's values are those of megafp8.fp8.activation_kernels, bit for bit.
        if READ == 1:
            v = activation_tile(x_ptr, r, c, mask, F, KH, KIND)
        elif READ == 2:
            if KIND == "swiglu":
                if first_col < F:
                    v = swiglu_grad_tile(x_ptr, h_ptr, r, c, mask, F, KH, False)
                else:
                    v = swiglu_grad_tile(x_ptr, h_ptr, r, c - F, mask, F, KH, True)
            else:
                v = gelu_grad_tile(x_ptr, h_ptr, r, c, mask, KH, KIND == "gelu_tanh")
        else:
            v = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32)
        return v

    @triton.jit
    def _pair_kernel(
        x_ptr,
        h_ptr,  # the activation's input, for its gradient (READ 2)
        q_ptr,
        s_ptr,
        qt_ptr,
        st_ptr,
        row_ptr,  # rowwise: each row's amax, maxed into (mode 1), then read (mode 2)
        col_ptr,  # the same of the columns
        counts_ptr,  # each tile's (saturated, flushed) casts, [tiles, 2]: no atomics
        col_sum_ptr,  # each tile row's column sums, [tiles along M, K]
        M,
        K,
        stride_x,
        F,
        KH,
        stride_s0,
        stride_s1,
        stride_st0,
        stride_st1,
        fp8_max,
        margin_factor,
        saturation_bound,
        flush_bound,
        MODE: tl.constexpr,  # 0: 1 x 128 blocks; 1: rowwise amaxes; 2: rowwise cast; 3: 128 x 128
        ROWS: tl.constexpr,
        COLUMNS: tl.constexpr,
        POWER_OF_TWO: tl.constexpr,
        COUNT: tl.constexpr,
        COL_SUM: tl.constexpr,
        INCLUSIVE: tl.constexpr,
        READ: tl.constexpr,  # what the tiles are: x, an activation of it, an activation's gradient
        KIND: tl.constexpr,  # the activation
        WIDE: tl.constexpr,
        T: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        if WIDE:  # int64 indices, and so int64 offsets (megafp8.triton_support.wide_offsets)
            pid_m = pid_m.to(tl.int64)
            pid_k = pid_k.to(tl.int64)
        rows = pid_m * T + tl.arange(0, T)
        cols = pid_k * T + tl.arange(0, T)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        first_col = pid_k * T
        x = _read(
            x_ptr, h_ptr, rows[:, None], cols[None, :], mask, stride_x, F, KH, first_col, READ, KIND
        )
        # The tile's column sums (partial: the caller adds the tiles', deterministic unlike
        # atomics), from the transposed read where there is one: a sum along the tile's second
        # axis, as its amaxes are taken, not a third reduction pattern
        if COL_SUM and not COLUMNS:
            tl.store(col_sum_ptr + pid_m * K + cols, tl.sum(x, axis=0), mask=cols < K)
        # a NaN counts as +inf: its block takes scale 1, as the reference's NaN amax gives
        magnitude = tl.where(x == x, tl.abs(x), float("inf"))
        if MODE == 1:  # order-free: the maxima of nonnegative floats
            tl.atomic_max(row_ptr + rows, tl.max(magnitude, axis=1), mask=rows < M)
            tl.atomic_max(col_ptr + cols, tl.max(magnitude, axis=0), mask=cols < K)
        else:
            scale = 1.0  # one 128 x 128 block's (mode 3)
            if MODE == 3:
                tile_amax = tl.max(tl.max(magnitude, axis=1), axis=0)
                scale = _fitted_scale(tile_amax, fp8_max, margin_factor, POWER_OF_TWO)
            row_scale = _line_scales(
                tl.max(magnitude, axis=1),
                row_ptr,
                rows,
                M,
                scale,
                fp8_max,
                margin_factor,
                MODE,
                POWER_OF_TWO,
            )
            if ROWS:
                scaled = x * row_scale[:, None]
                tl.store(
                    q_ptr + rows[:, None] * K + cols[None, :],
                    to_fp8(scaled, q_ptr.dtype.element_ty),
                    mask=mask,
                )
                if COUNT:
                    hits, flushed = _tile_outcomes(scaled, saturation_bound, flush_bound, INCLUSIVE)
                if (MODE == 0) | ((MODE == 2) & (pid_k == 0)):
                    tl.store(
                        s_ptr + rows * stride_s0 + pid_k * stride_s1,
                        tl.div_rn(1.0, row_scale),
                        mask=rows < M,
                    )
                if MODE == 3:
                    tl.store(s_ptr + pid_m * stride_s0 + pid_k * stride_s1, tl.div_rn(1.0, scale))
                    tl.store(
                        st_ptr + pid_k * stride_st0 + pid_m * stride_st1, tl.div_rn(1.0, scale)
                    )
            if COLUMNS:
                # The tile read again (an activation computed again), transposed, from L2; not
                # tl.trans'ed: FP8 stores of a tl.trans'ed tile scrambled bytes
                # (megafp8.fp8.triton_kernels._quantize_kernel).
                mask_t = (cols[:, None] < K) & (rows[None, :] < M)
                x_t = _read(
                    x_ptr,
                    h_ptr,
                    rows[None, :],
                    cols[:, None],
                    mask_t,
                    stride_x,
                    F,
                    KH,
                    first_col,
                    READ,
                    KIND,
                )
                if COL_SUM:
                    tl.store(col_sum_ptr + pid_m * K + cols, tl.sum(x_t, axis=1), mask=cols < K)
                col_scale = _line_scales(
                    tl.max(tl.where(x_t == x_t, tl.abs(x_t), float("inf")), axis=1),
                    col_ptr,
                    cols,
                    K,
                    scale,
                    fp8_max,
                    margin_factor,
                    MODE,
                    POWER_OF_TWO,
                )
                scaled_t = x_t * col_scale[:, None]
                tl.store(
                    qt_ptr + cols[:, None] * M + rows[None, :],
                    to_fp8(scaled_t, qt_ptr.dtype.element_ty),
                    mask=mask_t,
                )
                if COUNT and MODE != 3:  # a square block's transpose is the same cast
                    hits_t, flushed_t = _tile_outcomes(
                        scaled_t, saturation_bound, flush_bound, INCLUSIVE
                    )
                    if ROWS:
                        hits += hits_t
                        flushed += flushed_t
                    else:
                        hits, flushed = hits_t, flushed_t
                if (MODE == 0) | ((MODE == 2) & (pid_m == 0)):
                    tl.store(
                        st_ptr + cols * stride_st0 + pid_m * stride_st1,
                        tl.div_rn(1.0, col_scale),
                        mask=cols < K,
                    )
            if COUNT:
                tile = (pid_m * tl.num_programs(1) + pid_k) * 2
                tl.store(counts_ptr + tile, hits)
                tl.store(counts_ptr + tile + 1, flushed)


def _outer_dim_major(rows: int, blocks: int, device) -> torch.Tensor:
    """An fp32 [rows, blocks] with stride (1, rows): the 1 x 128 scales' layout cuBLAS takes."""
    return torch.empty((blocks, rows), device=device, dtype=torch.float32).t()


def padded_square_scales(grid_rows: int, grid_cols: int, device) -> torch.Tensor:
    """An fp32 [grid_rows, grid_cols] of 128 x 128 scales, row-major with the row stride rounded
    up to 4 (the padding, ones, is cuBLAS's: megafp8.fp8.fine_grained.blockwise_gemm)."""
    padded = -(-grid_cols // 4) * 4
    return torch.ones((grid_rows, padded), device=device, dtype=torch.float32)[:, :grid_cols]


class _Read(NamedTuple):
    """What `_pair_kernel` reads (its READ, KIND, h_ptr, F, KH) and the cast's shape [M, K]."""

    read: int
    kind: str | None
    h: torch.Tensor | None
    F: int
    KH: int
    shape: tuple


def _what_is_read(x, activation, activation_input) -> _Read:
    if activation is None:
        return _Read(0, None, None, 0, 0, tuple(x.shape))
    M, width = x.shape
    gated = activation == "swiglu"
    if activation_input is None:  # act(x): x is [M, KH], the cast [M, F]
        F = width // 2 if gated else width
        return _Read(1, activation, None, F, width, (M, F))
    h = activation_input.contiguous()
    if h.shape[0] != M or h.shape[1] != (2 * width if gated else width):
        raise ValueError(
            f"the gradient of {activation}'s output {tuple(x.shape)} does not fit its input "
            f"{tuple(h.shape)}"
        )
    return _Read(2, activation, h, width, h.shape[1], tuple(h.shape))


def fuses(activation: str | None, x: torch.Tensor, activation_input=None) -> bool:
    """Whether `quantize_pair` computes `activation` (or, with `activation_input`, its gradient)
    of `x` itself: always, but for SwiGLU's gradient whose halves do not split into whole tiles."""
    return not (activation == "swiglu" and activation_input is not None and x.shape[1] % TILE)


def _launch(
    x,
    mode: int,
    fp8_dtype,
    margin: int,
    power_of_two: bool,
    *,
    reads: _Read,
    q=None,
    s=None,
    qt=None,
    st=None,
    per_row=None,
    per_col=None,
    counts=None,
    col_sums=None,
):
    """`_pair_kernel` over what `x` and `reads` give, in `mode`, writing what is given (None:
    not written); `counts`, the (saturated, cast, flushed) triple, takes the casts' counts."""
    M, K = reads.shape
    bound, inclusive = saturation_bound(fp8_dtype)
    placeholder = x  # pointer arguments a mode does not touch
    grid = (triton.cdiv(M, TILE), triton.cdiv(K, TILE))
    per_tile = (
        torch.empty((grid[0] * grid[1], 2), device=x.device, dtype=torch.int32)
        if counts is not None
        else None
    )
    _pair_kernel[grid](
        x,
        reads.h if reads.h is not None else placeholder,
        q if q is not None else placeholder,
        s if s is not None else placeholder,
        qt if qt is not None else placeholder,
        st if st is not None else placeholder,
        per_row if per_row is not None else placeholder,
        per_col if per_col is not None else placeholder,
        per_tile if per_tile is not None else placeholder,
        col_sums if col_sums is not None else placeholder,
        M,
        K,
        x.stride(0),
        reads.F,
        reads.KH,
        *(s.stride() if s is not None else (0, 0)),
        *(st.stride() if st is not None else (0, 0)),
        fp8_max(fp8_dtype),
        1.0 / (2.0**margin),
        bound,
        underflow_bound(fp8_dtype),
        MODE=mode,
        ROWS=q is not None,
        COLUMNS=qt is not None,
        POWER_OF_TWO=power_of_two,
        COUNT=counts is not None,
        COL_SUM=col_sums is not None,
        INCLUSIVE=inclusive,
        READ=reads.read,
        KIND=reads.kind,
        WIDE=wide_offsets(x, reads.h, q, qt),
        T=TILE,
        num_warps=NUM_WARPS,
    )
    if counts is not None:
        counts[0::2] += per_tile.sum(0)
        casts = 1 if mode == 3 else (q is not None) + (qt is not None)  # a square cast once
        counts[1] += casts * M * K


def quantize_pair(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    blockwise: bool,
    margin: int = 0,
    power_of_two: bool = False,
    rows: bool = True,
    columns: bool = True,
    saturation_out: torch.Tensor | None = None,
    out: tuple[ScaledFp8, ScaledFp8] | None = None,
    column_group=None,
    col_sum_out: torch.Tensor | None = None,
    activation: str | None = None,
    activation_input: torch.Tensor | None = None,
) -> tuple[ScaledFp8 | None, ScaledFp8 | None]:
    """The 2-D `x` [M, K] cast along its rows ([M, K], scales over K) and, transposed, along its
    columns ([K, M], scales over M), each when asked: by 1 x 128 blocks (`blockwise`; M and K
    multiples of 128) or by whole rows. `saturation_out` as fine_grained.quantize_blocks'.
    `out`: an earlier pair cast of a tensor like `x`, both casts, written again in place.
    `column_group` (rowwise): the columns' amaxes maxed over that group before the cast (`x`
    is this rank's rows of a tensor split over it). `col_sum_out` (fp32 [K]) takes the sums of
    the cast tensor's columns, from the same read (a linear layer's bias gradient).
    `activation` (activation_kernels.KINDS): the cast is of that activation of `x`, computed
    as it is read and never stored; with `activation_input` h, of the activation's gradient at
    h, `x` being the gradient of its output (`fuses` says where it can)."""
    if activation is not None and not fuses(activation, x, activation_input):
        raise ValueError(f"the pair cast does not compute {activation}'s gradient of {x.shape}")
    if x.stride(1) != 1 or activation is not None:
        x = x.contiguous()
    reads = _what_is_read(x, activation, activation_input)
    M, K = reads.shape
    device = x.device
    partial_sums = (
        torch.empty((triton.cdiv(M, TILE), K), device=device, dtype=torch.float32)
        if col_sum_out is not None
        else None
    )
    if out is not None:
        (q, s), (qt, st) = out
    else:
        q = torch.empty((M, K), device=device, dtype=fp8_dtype) if rows else None
        qt = torch.empty((K, M), device=device, dtype=fp8_dtype) if columns else None
    if blockwise:  # each tile holds whole blocks: one launch fits the scales and casts
        if M % TILE or K % TILE:
            raise ValueError(f"a tensor of shape {(M, K)} does not split into 1 x {TILE} blocks")
        if out is None:
            s = _outer_dim_major(M, K // TILE, device) if rows else None
            st = _outer_dim_major(K, M // TILE, device) if columns else None
        mode, amaxes = 0, {}
    else:  # rowwise: every row's and column's amax first, then the cast
        amax = torch.zeros(M + K, device=device, dtype=torch.float32)
        row_amax, col_amax = amax[:M], amax[M:]
        _launch(x, 1, fp8_dtype, margin, False, reads=reads, per_row=row_amax, per_col=col_amax)
        if column_group is not None:
            col_amax = collectives.max_over(col_amax, column_group)
        if out is None:
            s = torch.empty((M, 1), device=device, dtype=torch.float32) if rows else None
            st = torch.empty((K, 1), device=device, dtype=torch.float32) if columns else None
        mode, amaxes = 2, {"per_row": row_amax, "per_col": col_amax}
    _launch(
        x,
        mode,
        fp8_dtype,
        margin,
        power_of_two,
        reads=reads,
        q=q,
        s=s,
        qt=qt,
        st=st,
        counts=saturation_out,
        col_sums=partial_sums,
        **amaxes,
    )
    if col_sum_out is not None:
        torch.sum(partial_sums, dim=0, out=col_sum_out)
    return (ScaledFp8(q, s) if rows else None), (ScaledFp8(qt, st) if columns else None)


def quantize_squares(
    w: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_two: bool = False,
    saturation_out: torch.Tensor | None = None,
    out: tuple[ScaledFp8, ScaledFp8] | None = None,
) -> tuple[ScaledFp8, ScaledFp8]:
    """A weight [N, K] (multiples of 128) cast by 128 x 128 blocks: the row cast [N, K] and its
    transpose [K, N], the same bytes, with inverse scales [N/128, K/128] and [K/128, N/128] laid
    out padded (`padded_square_scales`). `saturation_out` counts the cast once. `out`: an
    earlier cast of a weight like `w`, written again in place."""
    if w.stride(1) != 1:
        w = w.contiguous()
    N, K = w.shape
    if N % TILE or K % TILE:
        raise ValueError(f"a tensor of shape {(N, K)} does not split into {TILE} x {TILE} blocks")
    device = w.device
    if out is not None:
        (q, s), (qt, st) = out
    else:
        q = torch.empty((N, K), device=device, dtype=fp8_dtype)
        qt = torch.empty((K, N), device=device, dtype=fp8_dtype)
        s = padded_square_scales(N // TILE, K // TILE, device)
        st = padded_square_scales(K // TILE, N // TILE, device)
    _launch(
        w,
        3,
        fp8_dtype,
        margin,
        power_of_two,
        reads=_what_is_read(w, None, None),
        q=q,
        s=s,
        qt=qt,
        st=st,
        counts=saturation_out,
    )
    return ScaledFp8(q, s), ScaledFp8(qt, st)
