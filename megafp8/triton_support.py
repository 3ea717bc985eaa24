"""What every Triton kernel of megafp8 shares (the FP8 casts, RoPE, the fused AdamW, the
vocabulary-parallel cross-entropy): whether Triton is there, whether its CPU interpreter runs the
kernels, int64 offsets for huge tensors, and rounding that is exact in the interpreter too (the
base layer: imports nothing of megafp8).
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: every caller has a torch path.
    triton = None


def available() -> bool:
    return triton is not None


# Triton's interpreter (TRITON_INTERPRET=1: the CPU tests run the kernels in it) truncates casts to
# bf16 and neither rounds nor saturates casts to FP8 correctly: `round_to` below (and
# megafp8.fp8.triton_kernels' `to_fp8`) are exact there too.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


# The FP8 cast kernels (fp8.triton_kernels, norm_kernels, activation_kernels) form element offsets
# in int32, which overflow from 2^31 elements on: a [65536, 49152] MLP activation (micro-batch 8 x 8192 tokens at
# hidden 12288) made an illegal memory access. A launch that indexes such a tensor passes WIDE, under
# which the kernel widens its row and column indices (and so every offset formed from them) to
# int64; smaller launches run the int32 code, as fast as ever.
OFFSET_LIMIT = 2**31


def wide_offsets(*tensors) -> bool:
    """Whether a kernel that indexes `tensors` (None skipped) needs int64 offsets: whether an
    element offset into one of them can reach 2^31 - 1 (a row-strided view reaches further than
    its numel)."""
    for t in tensors:
        if t is None:
            continue
        reach = (
            t.numel()
            if t.is_contiguous()
            else 1 + sum((n - 1) * step for n, step in zip(t.shape, t.stride()))
        )
        if reach >= OFFSET_LIMIT:
            return True
    return False


if triton is not None:
    if not INTERPRETING:

        @triton.jit
        def round_to(y, dtype: tl.constexpr):
            # y rounded to nearest even in `dtype` and back to fp32: where aten stores a tensor.
            if dtype != tl.float32:
                y = y.to(dtype).to(tl.float32)
            return y

    else:

        @triton.jit
        def round_to(y, dtype: tl.constexpr):
            # on the bits, as cvt.rn does; NaN, whose bits would carry, kept
            if dtype == tl.bfloat16:
                bits = y.to(tl.uint32, bitcast=True)
                bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
                y = tl.where(y == y, bits.to(tl.float32, bitcast=True), y)
            elif dtype == tl.float16:
                y = y.to(tl.float16).to(tl.float32)
            return y
