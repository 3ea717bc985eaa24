"""The FP8 GEMM: `torch._scaled_mm`, on Hopper GPUs and on the CPU alike."""

from __future__ import annotations

import torch

_FUSED_BIAS_DTYPES = (torch.bfloat16, torch.float16)


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    fast_accum: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`(a * a_scale_inv) @ (b * b_scale_inv).T` for row-major FP8 `a` [M, K] and `b` [N, K].

    `b` in nn.Linear's weight layout is exactly the column-major second operand that
    `_scaled_mm` wants. `fast_accum` trades accumulation precision for speed on Hopper and is
    meant for the forward GEMM only (as Transformer Engine and torchao do). `out`: the result is written there
    (of `out_dtype`, contiguous), e.g. an fp32 weight gradient into main_grad or a block of rows
    of a larger output.
    """
    fuse_bias = bias is not None and out_dtype in _FUSED_BIAS_DTYPES and bias.dtype == out_dtype
    result = torch._scaled_mm(
        a,
        b.t(),
        scale_a=a_scale_inv,
        scale_b=b_scale_inv,
        bias=bias if fuse_bias else None,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
        **({} if out is None else {"out": out}),
    )
    if bias is not None and not fuse_bias:
        if out is None:
            return result + bias.to(out_dtype)
        result += bias.to(out_dtype)
    return result
