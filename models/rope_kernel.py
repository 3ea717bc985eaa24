"""RoPE in one Triton kernel per direction.

`apply_rotary`'s torch form, x * cos + rotate_half(x) * sin in fp32, runs as seven elementwise
kernels forward (the fp32 copy, the halves' negation and concatenation, two products, the sum,
the cast back) and as many backward, each reading and writing the whole of q or k in fp32. Here
one launch reads x (any strides over sequence, batch and heads; head_dim contiguous) and both
tables once and writes the rotated x in x's dtype; backward is the same kernel applying the
transposed rotation to the gradient. The arithmetic is the torch form's, in fp32, rounded once to
x's dtype at the end, with any tables (not only the equal-halves ones `rotary_tables` builds).
"""

from __future__ import annotations

import torch

from megafp8.triton_support import available

try:
    import triton
    import triton.language as tl

    from megafp8.triton_support import round_to
except ImportError:  # CPU-only installs: apply_rotary's torch form runs instead.
    triton = None

__all__ = ["available", "rotary_triton"]

BLOCK_HEADS = 16


if triton is not None:

    @triton.jit
    def _rotary_kernel(
        x_ptr,
        out_ptr,
        cos_ptr,
        sin_ptr,
        batch,
        heads,
        stride_xs,
        stride_xb,
        stride_xh,
        stride_cs,
        stride_cb,
        HALF: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        TRANSPOSED: tl.constexpr,
        OUT_DTYPE: tl.constexpr,
    ):
        # One program: one token (sequence position s, batch entry b) and BLOCK_H of its heads.
        token = tl.program_id(0)
        s = token // batch
        b = token % batch
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        in_half = d < HALF
        mask = (h[:, None] < heads) & in_half[None, :]
        table = s.to(tl.int64) * stride_cs + b.to(tl.int64) * stride_cb
        cos_first = tl.load(cos_ptr + table + d, mask=in_half, other=0.0)[None, :]
        cos_second = tl.load(cos_ptr + table + HALF + d, mask=in_half, other=0.0)[None, :]
        sin_first = tl.load(sin_ptr + table + d, mask=in_half, other=0.0)[None, :]
        sin_second = tl.load(sin_ptr + table + HALF + d, mask=in_half, other=0.0)[None, :]
        x_at = (
            x_ptr
            + s.to(tl.int64) * stride_xs
            + b.to(tl.int64) * stride_xb
            + h[:, None] * stride_xh
            + d[None, :]
        )
        first = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(x_at + HALF, mask=mask, other=0.0).to(tl.float32)
        if TRANSPOSED:  # backward: the gradient through x*cos + [-second, first]*sin
            out_first = first * cos_first + second * sin_second
            out_second = second * cos_second - first * sin_first
        else:
            out_first = first * cos_first - second * sin_first
            out_second = second * cos_second + first * sin_second
        # out is contiguous [s, b, heads, 2 * HALF].
        out_at = out_ptr + (token.to(tl.int64) * heads + h[:, None]) * (2 * HALF) + d[None, :]
        tl.store(out_at, round_to(out_first, OUT_DTYPE).to(OUT_DTYPE), mask=mask)
        tl.store(out_at + HALF, round_to(out_second, OUT_DTYPE).to(OUT_DTYPE), mask=mask)

    _TRITON_DTYPES = {
        torch.bfloat16: tl.bfloat16,
        torch.float16: tl.float16,
        torch.float32: tl.float32,
    }


def _launch(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transposed: bool
) -> torch.Tensor:
    seq, batch, heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((seq, batch, heads, head_dim), dtype=x.dtype, device=x.device)
    # per-token tables, or one per position
    cos_batch_stride = cos.stride(1) if cos.dim() == 3 else 0
    grid = (seq * batch, triton.cdiv(heads, BLOCK_HEADS))
    _rotary_kernel[grid](
        x,
        out,
        cos,
        sin,
        batch,
        heads,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        cos.stride(0),
        cos_batch_stride,
        HALF=head_dim // 2,
        BLOCK_D=triton.next_power_of_2(head_dim // 2),
        BLOCK_H=BLOCK_HEADS,
        TRANSPOSED=transposed,
        OUT_DTYPE=_TRITON_DTYPES[x.dtype],
        num_warps=4,
    )
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, transposed=False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _launch(grad, cos, sin, transposed=True), None, None


def rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` in one kernel each way: x [seq, batch, heads, head_dim]; cos and sin fp32,
    [>= seq, head_dim] (one row per position) or [seq, batch, head_dim] (per token), with
    head_dim contiguous. The tables take no gradient."""
    if cos.dim() == 2:
        cos, sin = cos[: x.shape[0]], sin[: x.shape[0]]
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    return _Rotary.apply(x, cos.float(), sin.float())
