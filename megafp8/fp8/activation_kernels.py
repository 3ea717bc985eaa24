"""The MLP's activation fused with an FP8 cast, forward and backward (Transformer Engine's
LayerNormMLP idea).

Forward, fc2 takes act(h) in FP8: unfused, the activation writes [tokens, ffn] in high precision
and the cast reads it back. `activation_quantize` reads h once and writes the two FP8 layouts.
Backward, fc1 takes the activation's gradient dh in FP8: `activation_backward_quantize` reads
the incoming gradient and h once and writes dh's two FP8 layouts (and its column sums, fc1's
bias gradient); dh is never stored in high precision.

The kernels follow aten's CUDA arithmetic step by step (libdevice's erf, tanh and exp, IEEE
division, every rounding to the storage dtype that the unfused autograd graph makes), so their
bytes are those of the unfused ops followed by `quantize_torch`; all but the gradient of GELU's
tanh form, which is computed as its sigmoid form (`_gelu_tanh_grad`), the same function with
fewer instructions and no cancellation: a value one rounding away from aten's, now and then.
Off CUDA the unfused torch ops run: `activation_torch`, `activation_backward_torch`, then
`quantize_torch`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megafp8.triton_support import INTERPRETING as _INTERPRETING
from megafp8.triton_support import wide_offsets

from .quantize import check_cast_counts, quantize_torch
from .tensor import Fp8Tensor, saturation_bound, underflow_bound

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from megafp8.triton_support import round_to as _round_to

    from .triton_kernels import count_cast, transpose_stored_tile
    from .triton_kernels import to_fp8 as _to_fp8
except ImportError:  # CPU-only installs: the torch reference runs instead.
    triton = None

KINDS = ("gelu", "gelu_tanh", "swiglu")

# Tiles of the output (for SwiGLU's forward, [BLOCK_M, BLOCK_N] of gate and of up; backward, of
# dout, gate and up), swept on an H100 (benchmarks/RESULTS.md, "Neighbour fusion").
FWD_BLOCK_M = 32
FWD_BLOCK_N = 128
BWD_BLOCK_M = 64
BWD_BLOCK_N = 64
NUM_WARPS = 4


def _f32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float64).float().item()


# aten's constants (ActivationGeluKernel.cu), products of the <cmath> doubles rounded to fp32 once.
_M_SQRT2, _M_2_SQRTPI, _M_SQRT1_2 = (
    1.41421356237309504880,
    1.12837916709551257390,
    0.707106781186547524401,
)
_SQRT1_2_F32 = _f32(_M_SQRT1_2)
_PDF_SCALE_F32 = _f32(_M_2_SQRTPI * _M_SQRT1_2 * 0.5)  # 1 / sqrt(2 pi)
_TANH_BETA_F32 = _f32(_M_SQRT2 * _M_2_SQRTPI * 0.5)  # sqrt(2 / pi)
_KAPPA_F32 = _f32(0.044715)
_KAPPA_3_F32 = (torch.tensor(3.0) * _KAPPA_F32).item()  # `opmath_t(3) * kKappa`, folded in fp32
_MINUS_2_LOG2E_F32 = _f32(-2.0 / math.log(2.0))  # exp(-2u) = exp2(u * -2 log2(e))

if triton is not None:
    SQRT1_2 = tl.constexpr(_SQRT1_2_F32)
    PDF_SCALE = tl.constexpr(_PDF_SCALE_F32)
    TANH_BETA = tl.constexpr(_TANH_BETA_F32)
    KAPPA = tl.constexpr(_KAPPA_F32)
    KAPPA_3 = tl.constexpr(_KAPPA_3_F32)
    MINUS_2_LOG2E = tl.constexpr(_MINUS_2_LOG2E_F32)

    # Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) has no libdevice: stand-ins below.
    if not _INTERPRETING:

        @triton.jit
        def _exp(x):
            return libdevice.exp(x)  # expf, as aten calls it (tl.exp is ex2.approx)

        @triton.jit
        def _erf(x):
            return libdevice.erf(x)

        @triton.jit
        def _tanh(x):
            return libdevice.tanh(x)

    else:
        # In fp64, rounded once: like libdevice and torch's CPU kernels, within an ulp of exact.
        @triton.jit
        def _exp(x):
            return tl.exp(x.to(tl.float64)).to(tl.float32)

        @triton.jit
        def _erf(x):
            return tl.erf(x.to(tl.float64)).to(tl.float32)

        @triton.jit
        def _tanh(x):
            e = tl.exp(-2.0 * tl.abs(x.to(tl.float64)))
            t = (1.0 - e) / (1.0 + e)
            return tl.where(x < 0, -t, t).to(tl.float32)

    @triton.jit
    def _gelu(x, TANH: tl.constexpr):
        # aten's GeluCUDAKernelImpl, its order of operations (nvcc contracts x + kKappa * x^3).
        if TANH:
            inner = TANH_BETA * (x + KAPPA * (x * x * x))
            y = 0.5 * x * (1.0 + _tanh(inner))
        else:
            y = x * 0.5 * (1.0 + _erf(x * SQRT1_2))
        return y

    @triton.jit
    def _gelu_grad(dy, x, TANH: tl.constexpr):
        if TANH:
            g = _gelu_tanh_grad(dy, x)
        else:  # aten's GeluBackwardCUDAKernelImpl, its order of operations
            cdf = 0.5 * (1.0 + _erf(x * SQRT1_2))
            pdf = _exp(-0.5 * x * x) * PDF_SCALE
            g = dy * (cdf + x * pdf)
        return g

    @triton.jit
    def _gelu_tanh_grad(dy, x):
        # 0.5 x (1 + tanh(u)) is x s with s = sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), and
        # its derivative s + 2 x s (1 - s) u'. aten's form, 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u)
        # u', cancels where tanh u is near -1 or 1 (both ends of GELU's input), and libdevice's
        # tanh costs dozens of instructions: with it the fused kernel was slower than aten's
        # backward and a separate cast (567 against 509 us at 16384 x 8192 on an H100). Here:
        # one ex2.approx and one approximate division, each within 2 ulp. Past x = -44,
        # exp2 overflows to inf and s to 0: the gradient's limit. At +-inf, NaN as in aten.
        x_sq = x * x
        inner = TANH_BETA * (x + KAPPA * (x_sq * x))
        s = 1.0 / (1.0 + tl.exp2(inner * MINUS_2_LOG2E))
        inner_derivative = TANH_BETA * (1.0 + KAPPA_3 * x_sq)
        return dy * (s + 2.0 * x * s * (1.0 - s) * inner_derivative)

    @triton.jit
    def activation_tile(h_ptr, r, c, mask, F, K, KIND: tl.constexpr):
        # KIND of h at rows r, output columns c (index tensors that broadcast to the tile, either
        # way round; int64 when the kernel runs WIDE, and so the offsets), rounded to h's dtype as
        # the unfused op stores it; 0 in the padding.
        dtype: tl.constexpr = h_ptr.dtype.element_ty
        x = tl.load(h_ptr + r * K + c, mask=mask, other=0.0).to(tl.float32)
        if KIND == "swiglu":
            up = tl.load(h_ptr + r * K + F + c, mask=mask, other=0.0).to(tl.float32)
            # F.silu(gate) (aten: x / (1 + expf(-x))) is stored, then multiplied by up.
            y = _round_to(tl.div_rn(x, 1.0 + _exp(-x)), dtype) * up
        else:
            y = _gelu(x, KIND == "gelu_tanh")
        return _round_to(y, dtype)

    @triton.jit
    def gelu_grad_tile(dout_ptr, h_ptr, r, c, mask, K, TANH: tl.constexpr):
        # dh at rows r, columns c as in `activation_tile`, rounded to h's dtype.
        dy = tl.load(dout_ptr + r * K + c, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(h_ptr + r * K + c, mask=mask, other=0.0).to(tl.float32)
        return _round_to(_gelu_grad(dy, x, TANH), h_ptr.dtype.element_ty)

    @triton.jit
    def _swiglu_grads(dy, gate, up, dtype: tl.constexpr):
        # (d gate, d up) of silu(gate) * up. Autograd's: MulBackward stores d up = dout *
        # silu(gate) and d silu = dout * up, then aten's silu_backward(d silu, gate); the
        # recomputed silu and the sigmoid share one expf.
        e = _exp(-gate)
        d_up = _round_to(dy * _round_to(tl.div_rn(gate, 1.0 + e), dtype), dtype)
        d_silu = _round_to(dy * up, dtype)
        sigmoid = tl.div_rn(1.0, 1.0 + e)
        d_gate = _round_to(d_silu * sigmoid * (1.0 + gate * (1.0 - sigmoid)), dtype)
        return d_gate, d_up

    @triton.jit
    def _swiglu_grad_tiles(dout_ptr, h_ptr, r, c, mask, F, K):
        # (d gate, d up) at rows r, columns c of dout, as in `activation_tile`.
        dy = tl.load(dout_ptr + r * F + c, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(h_ptr + r * K + c, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + r * K + F + c, mask=mask, other=0.0).to(tl.float32)
        return _swiglu_grads(dy, gate, up, h_ptr.dtype.element_ty)

    @triton.jit
    def swiglu_grad_tile(dout_ptr, h_ptr, r, c, mask, F, K, UP: tl.constexpr):
        # One half of dh at rows r, columns c of dout: d up (UP; it needs no `up`) or d gate,
        # the same values as `_swiglu_grad_tiles`'.
        dy = tl.load(dout_ptr + r * F + c, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(h_ptr + r * K + c, mask=mask, other=0.0).to(tl.float32)
        if UP:
            unused, g = _swiglu_grads(dy, gate, 0.0, h_ptr.dtype.element_ty)
        else:
            up = tl.load(h_ptr + r * K + F + c, mask=mask, other=0.0).to(tl.float32)
            g, unused = _swiglu_grads(dy, gate, up, h_ptr.dtype.element_ty)
        return g

    @triton.jit
    def _observe(
        y,
        mask,
        scale,
        amax_ptr,
        saturation_ptr,
        saturation_bound,
        flush_bound,
        SATURATION: tl.constexpr,
        BOUND_INCLUSIVE: tl.constexpr,
    ):
        # amax and the saturation and underflow counts of a tile of the rounded output (0 in the
        # padding: never the max, never counted). A NaN counts as +inf, as in triton_kernels._quantize_kernel.
        magnitude = tl.where(y == y, tl.abs(y), float("inf"))
        tl.atomic_max(amax_ptr, tl.max(tl.max(magnitude, axis=1), axis=0))
        if SATURATION:
            count_cast(
                y * scale, mask, saturation_ptr, saturation_bound, flush_bound, BOUND_INCLUSIVE
            )

    @triton.jit
    def _cast_gradient_tile(
        g,
        out_ptrs,
        mask,
        sum_ptrs,
        col_mask,
        SUM_AXIS: tl.constexpr,
        scale,
        amax_ptr,
        saturation_ptr,
        saturation_bound,
        flush_bound,
        COL_SUM: tl.constexpr,
        SATURATION: tl.constexpr,
        BOUND_INCLUSIVE: tl.constexpr,
    ):
        # A tile of dh cast to FP8 at out_ptrs, its statistics taken, and its column sums (the
        # columns of dh lie along SUM_AXIS of the tile) stored at sum_ptrs.
        tl.store(out_ptrs, _to_fp8(g * scale, out_ptrs.dtype.element_ty), mask=mask)
        _observe(
            g,
            mask,
            scale,
            amax_ptr,
            saturation_ptr,
            saturation_bound,
            flush_bound,
            SATURATION,
            BOUND_INCLUSIVE,
        )
        if COL_SUM:
            tl.store(sum_ptrs, tl.sum(g, axis=SUM_AXIS), mask=col_mask)

    @triton.jit
    def _activation_quantize_kernel(
        h_ptr,
        q_ptr,
        qt_ptr,
        scale_ptr,
        amax_ptr,
        scale_inv_ptr,
        saturation_ptr,
        M,
        F,
        K,
        saturation_bound,
        flush_bound,
        KIND: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        SATURATION: tl.constexpr,
        BOUND_INCLUSIVE: tl.constexpr,
        WIDE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # One [BLOCK_M, BLOCK_N] tile of act(h) [M, F]; h is [M, K], K = 2F for SwiGLU ([gate | up]).
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if WIDE:  # int64 rows and cols, and so every offset below (see megafp8.triton_support.wide_offsets)
            pid_m = pid_m.to(tl.int64)
            pid_n = pid_n.to(tl.int64)
        scale = tl.load(scale_ptr)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if ROWWISE:
            mask = (rows[:, None] < M) & (cols[None, :] < F)
            y = activation_tile(h_ptr, rows[:, None], cols[None, :], mask, F, K, KIND)
            _observe(
                y,
                mask,
                scale,
                amax_ptr,
                saturation_ptr,
                saturation_bound,
                flush_bound,
                SATURATION,
                BOUND_INCLUSIVE,
            )
            tl.store(
                q_ptr + rows[:, None] * F + cols[None, :],
                _to_fp8(y * scale, q_ptr.dtype.element_ty),
                mask=mask,
            )
        if COLUMNWISE:
            mask_t = (cols[:, None] < F) & (rows[None, :] < M)
            if ROWWISE:
                transpose_stored_tile(q_ptr, qt_ptr, rows[None, :], cols[:, None], mask_t, M, F)
            else:
                y_t = activation_tile(h_ptr, rows[None, :], cols[:, None], mask_t, F, K, KIND)
                _observe(
                    y_t,
                    mask_t,
                    scale,
                    amax_ptr,
                    saturation_ptr,
                    saturation_bound,
                    flush_bound,
                    SATURATION,
                    BOUND_INCLUSIVE,
                )
                tl.store(
                    qt_ptr + cols[:, None] * M + rows[None, :],
                    _to_fp8(y_t * scale, qt_ptr.dtype.element_ty),
                    mask=mask_t,
                )
        if (pid_m == 0) & (pid_n == 0):
            tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))

    @triton.jit
    def _activation_backward_quantize_kernel(
        dout_ptr,
        h_ptr,
        q_ptr,
        qt_ptr,
        scale_ptr,
        amax_ptr,
        scale_inv_ptr,
        col_sum_ptr,
        saturation_ptr,
        M,
        F,
        K,
        saturation_bound,
        flush_bound,
        KIND: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        COL_SUM: tl.constexpr,
        SATURATION: tl.constexpr,
        BOUND_INCLUSIVE: tl.constexpr,
        WIDE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # One [BLOCK_M, BLOCK_N] tile of dout [M, F]: the tile of dh [M, K] at the same place, and
        # for SwiGLU also the one F columns on (dh = [d gate | d up]). The first layout written
        # takes the statistics: amax, saturation, the column sums (per row block, reduced by the
        # caller: deterministic, unlike atomics).
        GATED: tl.constexpr = KIND == "swiglu"
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if WIDE:  # int64 rows and cols, and so the offsets below, the column sums' too; and F * M
            pid_m = pid_m.to(tl.int64)
            pid_n = pid_n.to(tl.int64)
            M = tl.cast(M, tl.int64)
        scale = tl.load(scale_ptr)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < F
        sums_ptr = col_sum_ptr + pid_m * K
        if ROWWISE:
            mask = (rows[:, None] < M) & col_mask[None, :]
            if GATED:
                g, g_up = _swiglu_grad_tiles(
                    dout_ptr, h_ptr, rows[:, None], cols[None, :], mask, F, K
                )
            else:
                g = gelu_grad_tile(
                    dout_ptr, h_ptr, rows[:, None], cols[None, :], mask, K, KIND == "gelu_tanh"
                )
            offsets = rows[:, None] * K + cols[None, :]
            _cast_gradient_tile(
                g,
                q_ptr + offsets,
                mask,
                sums_ptr + cols,
                col_mask,
                0,
                scale,
                amax_ptr,
                saturation_ptr,
                saturation_bound,
                flush_bound,
                COL_SUM,
                SATURATION,
                BOUND_INCLUSIVE,
            )
            if GATED:
                _cast_gradient_tile(
                    g_up,
                    q_ptr + offsets + F,
                    mask,
                    sums_ptr + F + cols,
                    col_mask,
                    0,
                    scale,
                    amax_ptr,
                    saturation_ptr,
                    saturation_bound,
                    flush_bound,
                    COL_SUM,
                    SATURATION,
                    BOUND_INCLUSIVE,
                )
        if COLUMNWISE:
            mask_t = col_mask[:, None] & (rows[None, :] < M)
            if ROWWISE:
                transpose_stored_tile(q_ptr, qt_ptr, rows[None, :], cols[:, None], mask_t, M, K)
                if GATED:
                    transpose_stored_tile(
                        q_ptr, qt_ptr, rows[None, :], F + cols[:, None], mask_t, M, K
                    )
            else:
                if GATED:
                    g, g_up = _swiglu_grad_tiles(
                        dout_ptr, h_ptr, rows[None, :], cols[:, None], mask_t, F, K
                    )
                else:
                    g = gelu_grad_tile(
                        dout_ptr,
                        h_ptr,
                        rows[None, :],
                        cols[:, None],
                        mask_t,
                        K,
                        KIND == "gelu_tanh",
                    )
                offsets_t = cols[:, None] * M + rows[None, :]
                _cast_gradient_tile(
                    g,
                    qt_ptr + offsets_t,
                    mask_t,
                    sums_ptr + cols,
                    col_mask,
                    1,
                    scale,
                    amax_ptr,
                    saturation_ptr,
                    saturation_bound,
                    flush_bound,
                    COL_SUM,
                    SATURATION,
                    BOUND_INCLUSIVE,
                )
                if GATED:
                    _cast_gradient_tile(
                        g_up,
                        qt_ptr + offsets_t + F * M,
                        mask_t,
                        sums_ptr + F + cols,
                        col_mask,
                        1,
                        scale,
                        amax_ptr,
                        saturation_ptr,
                        saturation_bound,
                        flush_bound,
                        COL_SUM,
                        SATURATION,
                        BOUND_INCLUSIVE,
                    )
        if (pid_m == 0) & (pid_n == 0):
            tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))


def activation_torch(h: torch.Tensor, kind: str) -> torch.Tensor:
    """The activation as models/transformer.py's MLP computes it: F.gelu (erf form), F.gelu
    with approximate="tanh", or F.silu(gate) * up with h = [gate | up] along the last dimension.
    The output is in h's dtype; for SwiGLU it has half h's last dimension."""
    _check_kind(kind)
    if kind == "gelu":
        return F.gelu(h)
    if kind == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def activation_backward_torch(dout: torch.Tensor, h: torch.Tensor, kind: str) -> torch.Tensor:
    """The gradient at h of `activation_torch(h, kind)` given `dout`, with the ops and roundings
    of torch's autograd: aten's gelu_backward; for SwiGLU, dout * silu(gate) and dout * up
    rounded to h's dtype (MulBackward), silu_backward of the latter, as [d gate | d up]."""
    _check_kind(kind)
    if kind == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        d_up = dout * F.silu(gate)
        d_gate = torch.ops.aten.silu_backward(dout * up, gate)
        return torch.cat([d_gate, d_up], dim=-1)
    return torch.ops.aten.gelu_backward(
        dout, h, approximate="tanh" if kind == "gelu_tanh" else "none"
    )


def activation_quantize(
    h, kind, fp8_dtype, scale, *, rowwise=True, columnwise=True, amax_out=None, saturation_out=None
) -> Fp8Tensor:
    """`quantize_torch(activation_torch(h, kind), fp8_dtype, scale, ...)` of the 2-D h [M, K]
    (output [M, F], F = K / 2 for SwiGLU): `scale` a 0-dim fp32 tensor (delayed scaling),
    `rowwise`/`columnwise` ask for `data`/`data_t`, `amax_out` and `saturation_out` as in
    `quantize`. On CUDA one Triton launch reads h once and writes the FP8 layouts only."""
    _check_input(h, kind, scale, rowwise, columnwise)
    check_cast_counts(saturation_out, h, "activation_quantize")
    h = h.contiguous()
    if _use_triton(h):
        return _activation_quantize_triton(
            h, kind, fp8_dtype, scale, rowwise, columnwise, amax_out, saturation_out
        )
    return quantize_torch(
        activation_torch(h, kind),
        fp8_dtype,
        scale,
        0,
        rowwise,
        columnwise,
        None,
        amax_out,
        False,
        saturation_out,
    )


def activation_backward_quantize(
    dout,
    h,
    kind,
    fp8_dtype,
    scale,
    *,
    rowwise=True,
    columnwise=True,
    amax_out=None,
    col_sum=False,
    saturation_out=None,
) -> Fp8Tensor:
    """`quantize_torch(activation_backward_torch(dout, h, kind), fp8_dtype, scale, ...)`: the
    gradient dh [M, K] at h [M, K] of the activation whose output gradient is `dout` [M, F],
    cast to FP8, with `col_sum` its fp32 column sums (the bias gradient of the linear that
    produced h). On CUDA one Triton launch reads dout and h once; dh is never stored in high
    precision."""
    _check_input(h, kind, scale, rowwise, columnwise)
    expected = (h.shape[0], h.shape[1] // 2 if kind == "swiglu" else h.shape[1])
    if tuple(dout.shape) != expected or dout.dtype != h.dtype:
        raise ValueError(
            f"activation_backward_quantize: dout must be {expected} in {h.dtype}, got "
            f"{tuple(dout.shape)} in {dout.dtype}"
        )
    check_cast_counts(saturation_out, h, "activation_backward_quantize")
    h, dout = h.contiguous(), dout.contiguous()
    if _use_triton(h):
        return _activation_backward_quantize_triton(
            dout, h, kind, fp8_dtype, scale, rowwise, columnwise, amax_out, col_sum, saturation_out
        )
    return quantize_torch(
        activation_backward_torch(dout, h, kind),
        fp8_dtype,
        scale,
        0,
        rowwise,
        columnwise,
        None,
        amax_out,
        col_sum,
        saturation_out,
    )


def _check_kind(kind):
    if kind not in KINDS:
        raise ValueError(f"unknown activation {kind!r}: expected one of {KINDS}")


def _check_input(h, kind, scale, rowwise, columnwise):
    _check_kind(kind)
    if h.dim() != 2:
        raise ValueError(f"the fused activation casts a 2-D tensor, got shape {tuple(h.shape)}")
    if kind == "swiglu" and h.shape[1] % 2:
        raise ValueError(f"SwiGLU's input is [gate | up]: an even last dimension, got {h.shape[1]}")
    if scale is None:
        raise ValueError("the fused activation casts with a given scale (delayed scaling)")
    if not (rowwise or columnwise):
        raise ValueError(
            "the fused activation cast: ask for at least one of rowwise and columnwise"
        )


def _use_triton(h: torch.Tensor) -> bool:
    return triton is not None and (h.is_cuda or _INTERPRETING)


def _launch_outputs(M, N, fp8_dtype, rowwise, columnwise, amax_out, device):
    q = torch.empty((M, N), device=device, dtype=fp8_dtype) if rowwise else None
    qt = torch.empty((N, M), device=device, dtype=fp8_dtype) if columnwise else None
    amax = amax_out if amax_out is not None else torch.zeros((), device=device, dtype=torch.float32)
    return q, qt, amax, torch.empty((), device=device, dtype=torch.float32)


def _activation_quantize_triton(
    h, kind, fp8_dtype, scale, rowwise, columnwise, amax_out, saturation_out
):
    M, K = h.shape
    F = K // 2 if kind == "swiglu" else K
    q, qt, amax, scale_inv = _launch_outputs(
        M, F, fp8_dtype, rowwise, columnwise, amax_out, h.device
    )
    bound, inclusive = saturation_bound(fp8_dtype)
    grid = (triton.cdiv(M, FWD_BLOCK_M), triton.cdiv(F, FWD_BLOCK_N))
    _activation_quantize_kernel[grid](
        h,
        q if rowwise else qt,
        qt if columnwise else q,
        scale,
        amax,
        scale_inv,
        saturation_out if saturation_out is not None else scale_inv,
        M,
        F,
        K,
        bound,
        underflow_bound(fp8_dtype),
        KIND=kind,
        ROWWISE=rowwise,
        COLUMNWISE=columnwise,
        SATURATION=saturation_out is not None,
        BOUND_INCLUSIVE=inclusive,
        WIDE=wide_offsets(h, q, qt),
        BLOCK_M=FWD_BLOCK_M,
        BLOCK_N=FWD_BLOCK_N,
        num_warps=NUM_WARPS,
        enable_reflect_ftz=False,  # libdevice without flush-to-zero, as nvcc builds aten's kernels
    )
    return Fp8Tensor(q, qt, scale_inv, amax)


def _activation_backward_quantize_triton(
    dout, h, kind, fp8_dtype, scale, rowwise, columnwise, amax_out, col_sum, saturation_out
):
    M, K = h.shape
    F = dout.shape[1]
    q, qt, amax, scale_inv = _launch_outputs(
        M, K, fp8_dtype, rowwise, columnwise, amax_out, h.device
    )
    bound, inclusive = saturation_bound(fp8_dtype)
    grid = (triton.cdiv(M, BWD_BLOCK_M), triton.cdiv(F, BWD_BLOCK_N))
    partial_sums = (
        torch.empty((grid[0], K), device=h.device, dtype=torch.float32) if col_sum else None
    )
    _activation_backward_quantize_kernel[grid](
        dout,
        h,
        q if rowwise else qt,
        qt if columnwise else q,
        scale,
        amax,
        scale_inv,
        partial_sums if col_sum else scale_inv,
        saturation_out if saturation_out is not None else scale_inv,
        M,
        F,
        K,
        bound,
        underflow_bound(fp8_dtype),
        KIND=kind,
        ROWWISE=rowwise,
        COLUMNWISE=columnwise,
        COL_SUM=col_sum,
        SATURATION=saturation_out is not None,
        BOUND_INCLUSIVE=inclusive,
        WIDE=wide_offsets(dout, h, q, qt, partial_sums),
        BLOCK_M=BWD_BLOCK_M,
        BLOCK_N=BWD_BLOCK_N,
        num_warps=NUM_WARPS,
        enable_reflect_ftz=False,
    )
    return Fp8Tensor(q, qt, scale_inv, amax, partial_sums.sum(0) if col_sum else None)
