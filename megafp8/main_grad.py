"""The gradient-buffer protocol between the layers and data parallelism's gradient buffers
(Megatron's `main_grad`; the base layer: imports nothing of megafp8).

A parameter that data parallelism buffers (megafp8.parallel.data_parallel.GradientBuffer) carries
`main_grad`, its view into the buffer (fp32, or the buffer's bf16), and `main_grad_empty`, True while that view holds no
gradient of this step (the buffer is not cleared between steps: the step's first gradient
overwrites it). The layers that write their gradients there themselves (gradient-accumulation
fusion in megafp8.fp8.linear, the backward of megafp8.parallel.cuda_graphs) and the buffer's own
hook all go through these two functions.
"""

from __future__ import annotations

import torch


def accumulate_into_main_grad(param, grad: torch.Tensor) -> None:
    """Add `grad` into `param.main_grad`, or overwrite it if it holds no gradient of this step."""
    if param.main_grad_empty:
        param.main_grad.copy_(grad)
        param.main_grad_empty = False
    else:
        param.main_grad.add_(grad)


def claim_empty_main_grad(param) -> torch.Tensor | None:
    """`param.main_grad` if it holds no gradient of this step yet, to be overwritten with the
    gradient (claimed: it counts as written from now on); else None."""
    if not getattr(param, "main_grad_empty", False):
        return None
    param.main_grad_empty = False
    return param.main_grad
