"""The gradient-buffer protocol between the layers and data parallelism's gradient buffers
(Megatron's `main_grad`; the base layer: imports nothing of megafp8 above the base).

A parameter that data parallelism buffers (megafp8.parallel.data_parallel.GradientBuffer) carries
`main_grad`, its view into the buffer (fp32, or the buffer's bf16), and `main_grad_empty`, True while that view holds no
gradient of this step (the buffer is not cleared between steps: the step's first gradient
overwrites it). The layers that write their gradients there themselves (gradient-accumulation
fusion in megafp8.fp8.linear, the backward of megafp8.parallel.cuda_graphs) and the buffer's own
hook all go through `accumulate_into_main_grad` and `claim_empty_main_grad`.

A bf16 gradient added into an fp32 `main_grad` (an FP8 layer's weight gradient from a step's
second micro-batch on: `_scaled_mm` cannot add into its output) takes torch's mixed-dtype add
kernel, which loads element by element: about half of the GPU's memory bandwidth. On CUDA (and in
Triton's interpreter) a Triton kernel loads both in vectors and adds them as torch would, to the
bit.
"""

from __future__ import annotations

import torch

from . import triton_support

triton = triton_support.triton
if triton is not None:
    import triton.language as tl


def accumulate_into_main_grad(param, grad: torch.Tensor) -> None:
    """Add `grad` into `param.main_grad`, or overwrite it if it holds no gradient of this step."""
    if param.main_grad_empty:
        param.main_grad.copy_(grad)
        param.main_grad_empty = False
    else:
        add_into(param.main_grad, grad)


def claim_empty_main_grad(param) -> torch.Tensor | None:
    """`param.main_grad` if it holds no gradient of this step yet, to be overwritten with the
    gradient (claimed: it counts as written from now on); else None."""
    if not getattr(param, "main_grad_empty", False):
        return None
    param.main_grad_empty = False
    return param.main_grad


def add_into(total: torch.Tensor, addend: torch.Tensor) -> None:
    """`total += addend`, bit for bit as torch adds them (the sum in `total`'s dtype)."""
    if not _by_kernel(total, addend):
        total.add_(addend)
        return
    n = total.numel()
    _add_kernel[(triton.cdiv(n, BLOCK),)](
        total,
        addend.view(torch.int16),
        n,
        BF16=addend.dtype == torch.bfloat16,
        WIDE=n + BLOCK >= triton_support.OFFSET_LIMIT,
        BLOCK=BLOCK,
        num_warps=8,
    )


def prepare_add_into(total: torch.Tensor, addend: torch.Tensor) -> None:
    """Compile and load the kernel that `add_into(total, addend)` launches, by a launch on spare
    tensors laid out as these (Triton specializes a kernel on its pointers' alignment): its first
    launch inside a CUDA graph capture would do both there (megafp8.parallel.cuda_graphs warms
    it before capturing)."""
    if _by_kernel(total, addend):
        add_into(_spare_like(total), _spare_like(addend))


def _by_kernel(total: torch.Tensor, addend: torch.Tensor) -> bool:
    return (
        triton is not None
        and total.dtype == torch.float32
        and addend.dtype in (torch.bfloat16, torch.float16)
        and (total.is_cuda or triton_support.INTERPRETING)
        and total.device == addend.device
        and total.shape == addend.shape
        and total.is_contiguous()
        and addend.is_contiguous()
    )


def _spare_like(t: torch.Tensor) -> torch.Tensor:
    """A zeroed tensor like `t` whose address has the same remainder modulo 16 bytes."""
    spare = torch.zeros(t.numel() + 16, dtype=t.dtype, device=t.device)
    shift = (t.data_ptr() - spare.data_ptr()) % 16 // t.element_size()
    return spare[shift : shift + t.numel()].view_as(t)


BLOCK = 4096  # elements per program: 16 a thread, four 16-byte loads of fp32 and two of bf16

if triton is not None:

    @triton.jit
    def _add_kernel(total, addend, n, BF16: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr):
        # `addend` as its bits: the interpreter has no bf16, and widening them is exact
        start = tl.program_id(0)
        if WIDE:
            start = start.to(tl.int64)
        offsets = start * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        bits = tl.load(addend + offsets, mask=mask, other=0)
        if BF16:  # a bf16's bits are an fp32's upper half
            value = (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
                tl.float32, bitcast=True
            )
        else:
            value = bits.to(tl.float16, bitcast=True).to(tl.float32)
        tl.store(total + offsets, tl.load(total + offsets, mask=mask) + value, mask=mask)
