"""Fused Triton kernels of the FP8 core, used on CUDA (the CPU path is plain torch).

- `quantize`: amax, scale, saturate, cast and the transposed copy in one launch, reading the
  input from device memory once and writing each output once (and, when asked, the column
  sums that are a linear layer's bias gradient, or the count of saturated elements). Eager
  torch needs several passes; on a 16384 x 2048 bf16 tensor that took longer than the FP8
  GEMM it fed.
- `quantize_heads`: the same cast of a QKV projection's output gradient, read from the
  query, key and value gradients that attention's backward returns, never concatenated.
- `update_delayed`: the end-of-pass delayed-scaling update of every layer at once, one launch
  through a table of history/scale addresses, instead of ~25 small torch ops per pass.
"""

from __future__ import annotations

import torch

from megafp8.triton_support import INTERPRETING, wide_offsets

from .formats import fp8_max
from .tensor import Fp8Tensor, absmax, saturation_bound, underflow_bound

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the callers fall back to torch.
    triton = None


# Tile shape chosen by `bench_fp8_linear.py --sweep-tiles` on an H100 (benchmarks/RESULTS.md).
BLOCK_M = 64
BLOCK_N = 128
NUM_WARPS = 4

if triton is not None:
    if not INTERPRETING:

        @triton.jit
        def to_fp8(v, dtype: tl.constexpr):
            # cvt.rn.satfinite (sm_89+) saturates to ±fp8_max and keeps NaN: the torch path's
            # clamp-then-cast, without the clamp.
            return v.to(dtype)

    else:

        @triton.jit
        def to_fp8(v, dtype: tl.constexpr):
            # Saturate, then round to the FP8 grid in fp32 (adding 1.5 * 2^23 quanta rounds to a
            # whole quantum, to nearest even), so that the interpreter's cast is exact.
            if dtype == tl.float8e4nv:
                v = tl.minimum(tl.maximum(v, -448.0), 448.0)
                quantum_exponent = (
                    tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6) - 3
                )
            else:
                v = tl.minimum(tl.maximum(v, -57344.0), 57344.0)
                quantum_exponent = (
                    tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -14) - 2
                )
            magic = ((quantum_exponent + 127) << 23).to(tl.float32, bitcast=True) * 12582912.0
            r = (v + magic) - magic
            r = tl.where(r == 0.0, v * 0.0, r)  # the sign of an underflow to zero
            nan = tl.full(v.shape, 0x7F, tl.uint8).to(dtype, bitcast=True)
            return tl.where(v == v, r.to(dtype), nan)

    @triton.jit
    def cast_outcomes(magnitude, saturation_bound, flush_bound, INCLUSIVE: tl.constexpr):
        # Of each |x * scale| an FP8 cast takes: whether the cast saturates it and whether it
        # flushes a nonzero to zero, as int32 (megafp8.fp8.tensor's saturates and underflows;
        # the bounds are theirs). Every fused cast counts through this one predicate.
        hits = magnitude >= saturation_bound if INCLUSIVE else magnitude > saturation_bound
        flushed = (magnitude != 0.0) & (magnitude <= flush_bound)
        return hits.to(tl.int32), flushed.to(tl.int32)

    @triton.jit
    def count_cast(
        scaled, mask, counts_ptr, saturation_bound, flush_bound, INCLUSIVE: tl.constexpr
    ):
        # A 2-D tile's (saturated, cast, nonzero flushed to zero) added into the int64 triple at
        # counts_ptr: `scaled` is x * scale as the cast takes it (0 in the padding, never
        # counted), `mask` the tile's elements.
        hits, flushed = cast_outcomes(tl.abs(scaled), saturation_bound, flush_bound, INCLUSIVE)
        tl.atomic_add(counts_ptr, tl.sum(tl.sum(hits, axis=1), axis=0).to(tl.int64))
        tl.atomic_add(
            counts_ptr + 1, tl.sum(tl.sum(mask.to(tl.int32), axis=1), axis=0).to(tl.int64)
        )
        tl.atomic_add(counts_ptr + 2, tl.sum(tl.sum(flushed, axis=1), axis=0).to(tl.int64))

    @triton.jit
    def _load_input(
        x_ptr,
        k_ptr,
        v_ptr,
        rows,
        cols,
        mask,
        N,
        stride_q,
        stride_kv,
        HEADS: tl.constexpr,
        QPG: tl.constexpr,
        D: tl.constexpr,
    ):
        # The input [M, N] at rows x cols (index tensors that broadcast to the tile, either way
        # round) in fp32. HEADS: the input is a QKV projection's output gradient, laid out per
        # key/value group as [QPG query heads, key, value] of D features each, read from the
        # three gradients instead: queries [M, groups * QPG * D] at x_ptr (row stride stride_q),
        # keys and values [M, groups * D] (row stride stride_kv). The offsets are int64 where rows
        # and cols are (WIDE).
        if HEADS:
            slot = (cols // D) % (QPG + 2)
            group = cols // (D * (QPG + 2))
            within = cols % D
            is_q = slot < QPG
            is_k = slot == QPG
            x_q = tl.load(
                x_ptr + rows * stride_q + (group * QPG + slot) * D + within,
                mask=mask & is_q,
                other=0.0,
            )
            x_k = tl.load(
                k_ptr + rows * stride_kv + group * D + within, mask=mask & is_k, other=0.0
            )
            x_v = tl.load(
                v_ptr + rows * stride_kv + group * D + within, mask=mask & (slot > QPG), other=0.0
            )
            x = tl.where(is_q, x_q, tl.where(is_k, x_k, x_v))
        else:
            x = tl.load(x_ptr + rows * N + cols, mask=mask, other=0.0)
        return x.to(tl.float32)

    @triton.jit
    def _quantize_kernel(
        x_ptr,
        k_ptr,
        v_ptr,
        q_ptr,
        qt_ptr,
        scale_ptr,
        amax_ptr,
        scale_out_ptr,
        scale_inv_ptr,
        col_sum_ptr,
        saturation_ptr,
        M,
        N,
        stride_q,
        stride_kv,
        fp8_max,
        margin_factor,
        saturation_bound,
        flush_bound,
        CURRENT: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        WRITE_SCALE: tl.constexpr,
        COL_SUM: tl.constexpr,
        SATURATION: tl.constexpr,
        BOUND_INCLUSIVE: tl.constexpr,
        HEADS: tl.constexpr,
        QPG: tl.constexpr,
        D: tl.constexpr,
        WIDE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if WIDE:  # int64 rows and cols, and so every offset below, col_sum's too (see wide_offsets)
            pid_m = pid_m.to(tl.int64)
            pid_n = pid_n.to(tl.int64)
        if CURRENT:
            # amax_ptr holds this tensor's amax, computed just before; derive the scale here,
            # with IEEE division (plain `/` is approximate in Triton) to match torch bit for bit.
            amax = tl.load(amax_ptr)
            scale = tl.div_rn(fp8_max, amax) * margin_factor
            usable = (amax > 0) & (amax < float("inf")) & (scale < float("inf"))
            scale = tl.where(usable, scale, 1.0)
        else:
            scale = tl.load(scale_ptr)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = _load_input(
            x_ptr,
            k_ptr,
            v_ptr,
            rows[:, None],
            cols[None, :],
            mask,
            N,
            stride_q,
            stride_kv,
            HEADS,
            QPG,
            D,
        )
        if not CURRENT:
            # Delayed scaling observes the amax while casting; a NaN counts as +inf.
            magnitude = tl.where(x == x, tl.abs(x), float("inf"))
            tl.atomic_max(amax_ptr, tl.max(tl.max(magnitude, axis=1), axis=0))
        if COL_SUM:
            # Per-tile partial sums, reduced by the caller: deterministic, unlike atomics.
            tl.store(col_sum_ptr + pid_m * N + cols, tl.sum(x, axis=0), mask=cols < N)
        if SATURATION:
            # The opt-in counts of quantize.saturates and quantize.underflows, on the very product
            # the cast takes (padding is 0, never counted), and of the elements cast: no extra
            # launch on the host.
            count_cast(
                x * scale, mask, saturation_ptr, saturation_bound, flush_bound, BOUND_INCLUSIVE
            )
        # No clamp: the FP8 conversion (cvt.rn.satfinite on sm_89+) saturates out-of-range
        # values and inf to ±fp8_max and keeps NaN, exactly the torch path's clamp-then-cast.
        if ROWWISE:
            tl.store(
                q_ptr + rows[:, None] * N + cols[None, :],
                (x * scale).to(q_ptr.dtype.element_ty),
                mask=mask,
            )
        if COLUMNWISE:
            # Read the tile again, transposed (it is in L2 now), instead of tl.trans: with
            # Triton 3.6 on an H100, FP8 stores of a tl.trans'ed tile scrambled some bytes,
            # whatever the formulation (benchmarks/RESULTS.md). This one is exact and as fast.
            mask_t = (cols[:, None] < N) & (rows[None, :] < M)
            x_t = _load_input(
                x_ptr,
                k_ptr,
                v_ptr,
                rows[None, :],
                cols[:, None],
                mask_t,
                N,
                stride_q,
                stride_kv,
                HEADS,
                QPG,
                D,
            )
            tl.store(
                qt_ptr + cols[:, None] * M + rows[None, :],
                (x_t * scale).to(qt_ptr.dtype.element_ty),
                mask=mask_t,
            )
        if (pid_m == 0) & (pid_n == 0):
            tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))
            if WRITE_SCALE:
                tl.store(scale_out_ptr, scale)

    @triton.jit
    def transpose_stored_tile(q_ptr, qt_ptr, rows, cols, mask_t, M, N):
        # The FP8 tile this program has just stored in q [M, N] (rows, cols: index tensors of the
        # transposed tile), copied into qt [N, M] as bytes: the transposed layout of a fused
        # producer (a norm, an activation) without computing its tile twice. Not tl.trans: see
        # _quantize_kernel. The barrier makes the tile's stores visible to all of the program's
        # threads first. Offsets in int64 where rows and cols are: a caller launched WIDE passes
        # int64 ones, since rows * N and cols * M overflow int32 for 2^31 elements or more.
        tl.debug_barrier()
        q_bytes = q_ptr.to(tl.pointer_type(tl.uint8))
        qt_bytes = qt_ptr.to(tl.pointer_type(tl.uint8))
        tile = tl.load(q_bytes + rows * N + cols, mask=mask_t, other=0)
        tl.store(qt_bytes + cols * M + rows, tile, mask=mask_t)

    @triton.jit
    def _delayed_update_kernel(
        table,
        count,
        history_len,
        fp8_max,
        margin_factor,
        USE_MAX: tl.constexpr,
        RECOMPUTE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # table rows: amax accumulator, history and scale addresses, reset flag; a column per state.
        i = tl.program_id(0)
        amax_ptr = tl.load(table + i).to(tl.pointer_type(tl.float32))
        amax = tl.load(amax_ptr)
        finite = (amax == amax) & (amax < float("inf"))
        newest = tl.where(finite, amax, 0.0)
        history = tl.load(table + count + i).to(tl.pointer_type(tl.float32))
        offsets = tl.arange(0, BLOCK)
        keep = offsets < history_len - 1
        older = tl.load(history + offsets, mask=keep, other=0.0)
        tl.debug_barrier()  # every thread has read the history before any shifts it
        tl.store(history + 1 + offsets, older, mask=keep)
        tl.store(history, newest)
        if tl.load(table + 3 * count + i) != 0:
            tl.store(amax_ptr, 0.0)
        if RECOMPUTE:
            if USE_MAX:
                amax = tl.maximum(tl.max(older, axis=0), newest)
            else:
                amax = newest
            scale_ptr = tl.load(table + 2 * count + i).to(tl.pointer_type(tl.float32))
            scale = tl.div_rn(fp8_max, amax) * margin_factor
            usable = finite & (amax > 0) & (scale < float("inf"))
            tl.store(scale_ptr, tl.where(usable, scale, tl.load(scale_ptr)))


def quantize(
    x,
    fp8_dtype,
    scale,
    margin,
    rowwise,
    columnwise,
    scale_out: torch.Tensor | None,
    amax_out: torch.Tensor | None,
    col_sum: bool,
    saturation_out: torch.Tensor | None = None,
    out: Fp8Tensor | None = None,
):
    M, N = x.shape
    current = scale is None
    if current:
        amax = absmax(x)
        if amax_out is not None:
            amax = torch.maximum(amax_out, amax, out=amax_out)
    else:
        amax = (
            amax_out
            if amax_out is not None
            else torch.zeros((), device=x.device, dtype=torch.float32)
        )
    return _launch(
        x,
        None,
        M,
        N,
        fp8_dtype,
        scale,
        margin,
        amax,
        rowwise,
        columnwise,
        scale_out,
        col_sum,
        saturation_out,
        out,
    )


def quantize_heads(
    dq,
    dk,
    dv,
    head_dim: int,
    fp8_dtype,
    scale,
    rowwise,
    columnwise,
    amax_out: torch.Tensor | None,
    col_sum: bool,
    saturation_out: torch.Tensor | None = None,
):
    """`quantize` (delayed scaling: `scale` given) of the gradient of a QKV projection's output
    [M, groups * (queries per group + 2) * head_dim], laid out per key/value group as [its
    query heads, key, value], read from the 2-D gradients dq [M, groups * queries per group *
    head_dim], dk and dv [M, groups * head_dim] (each with unit column stride): the
    concatenation is never written."""
    M = dq.shape[0]
    groups = dk.shape[1] // head_dim
    queries_per_group = dq.shape[1] // (groups * head_dim)
    amax = (
        amax_out if amax_out is not None else torch.zeros((), device=dq.device, dtype=torch.float32)
    )
    return _launch(
        dq,
        (dk, dv, queries_per_group, head_dim),
        M,
        groups * (queries_per_group + 2) * head_dim,
        fp8_dtype,
        scale,
        margin=0,
        amax=amax,
        rowwise=rowwise,
        columnwise=columnwise,
        scale_out=None,
        col_sum=col_sum,
        saturation_out=saturation_out,
        out=None,
    )


def _launch(
    x,
    heads,
    M,
    N,
    fp8_dtype,
    scale,
    margin,
    amax,
    rowwise,
    columnwise,
    scale_out,
    col_sum,
    saturation_out,
    out,
):
    current = scale is None
    device = x.device
    if out is not None:  # overwrite an earlier cast in place (see quantize.quantize)
        q, qt, scale_inv = (
            out.data if rowwise else None,
            out.data_t if columnwise else None,
            out.scale_inv,
        )
    else:
        q = torch.empty((M, N), device=device, dtype=fp8_dtype) if rowwise else None
        qt = torch.empty((N, M), device=device, dtype=fp8_dtype) if columnwise else None
        scale_inv = torch.empty((), device=device, dtype=torch.float32)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    partial_sums = (
        torch.empty((grid[0], N), device=device, dtype=torch.float32) if col_sum else None
    )
    write_scale = current and scale_out is not None
    bound, inclusive = saturation_bound(fp8_dtype)
    k, v, queries_per_group, head_dim = heads if heads is not None else (x, x, 1, 1)
    wide = wide_offsets(x, k, v, q, qt, partial_sums)
    _quantize_kernel[grid](
        x,
        k,
        v,
        q if rowwise else qt,
        qt if columnwise else q,
        amax if current else scale,
        amax,
        scale_out if write_scale else scale_inv,
        scale_inv,
        partial_sums if col_sum else scale_inv,
        saturation_out if saturation_out is not None else scale_inv,
        M,
        N,
        x.stride(0),
        k.stride(0),
        fp8_max(fp8_dtype),
        1.0 / (2.0**margin),
        bound,
        underflow_bound(fp8_dtype),
        CURRENT=current,
        ROWWISE=rowwise,
        COLUMNWISE=columnwise,
        WRITE_SCALE=write_scale,
        COL_SUM=col_sum,
        SATURATION=saturation_out is not None,
        BOUND_INCLUSIVE=inclusive,
        HEADS=heads is not None,
        QPG=queries_per_group,
        D=head_dim,
        WIDE=wide,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        num_warps=NUM_WARPS,
    )
    return Fp8Tensor(q, qt, scale_inv, amax, partial_sums.sum(0) if col_sum else None)


_address_tables: dict = {}


def _address_table(states, resets) -> torch.Tensor:
    # Cached by the addresses themselves: a pass over the same layers reuses its table, so
    # the host-to-device copy happens only when the set of layers (or their storage) changes.
    key = (
        tuple(s.amax.data_ptr() for s in states)
        + tuple(s.amax_history.data_ptr() for s in states)
        + tuple(s.scale.data_ptr() for s in states)
        + tuple(int(reset) for reset in resets)
    )
    table = _address_tables.get(key)
    if table is None:
        if len(_address_tables) > 256:
            _address_tables.clear()
        table = _address_tables[key] = torch.tensor(key, dtype=torch.int64).to(
            states[0].amax.device
        )
    return table


def update_delayed(states, resets, fp8_max_value, margin, algo, recompute) -> None:
    length = states[0].amax_history.numel()
    _delayed_update_kernel[(len(states),)](
        _address_table(states, resets),
        len(states),
        length,
        fp8_max_value,
        1.0 / (2.0**margin),
        USE_MAX=algo == "max",
        RECOMPUTE=recompute,
        BLOCK=triton.next_power_of_2(max(length - 1, 1)),
        num_warps=4,
    )
