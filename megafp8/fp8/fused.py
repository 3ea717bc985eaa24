"""The neighbours of an FP8 GEMM fused into its casts (Transformer Engine's LayerNormLinear and
LayerNormMLP): a norm or an activation whose output is written straight into FP8, and in
backward the activation's gradient written straight into the FP8 gradient of the linear before,
and attention's query, key and value gradients cast together into the QKV projection's FP8
output gradient without being concatenated first.

Each is a *source*: a tensor not computed yet, which `scaling.cast` either quantizes in the
producer's own kernel (delayed scaling, whose scale is known before the cast) or materializes in
high precision and casts as usual (current scaling and the first cast of a history, which need
the tensor's amax before its scale). Under fine-grained scaling an activation and its gradient
are computed in the pair cast's read instead (megafp8.fp8.fine_grained). On CUDA the kernels
are Triton (norm_kernels, activation_kernels, fine_grained_kernels); elsewhere their torch
references run, so the CPU tests cover the same path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megafp8 import triton_support

from . import activation_kernels, norm_kernels, triton_kernels
from .quantize import quantize_torch
from .tensor import Fp8Tensor


class _Source:
    input: torch.Tensor

    @property
    def is_cuda(self) -> bool:
        return self.input.is_cuda


class NormSource(_Source):
    """LayerNorm or RMSNorm of the 2-D `x`; keeps the statistics its backward needs."""

    def __init__(self, x, weight, bias, eps: float, rms: bool):
        self.input = x
        self.x, self.weight, self.bias, self.eps, self.rms = x, weight, bias, eps, rms
        self.mean = self.rstd = None

    def materialize(self) -> torch.Tensor:
        y, self.mean, self.rstd = norm_kernels.norm_forward_torch(
            self.x, self.weight, self.bias, self.eps, self.rms
        )
        return y

    def quantize(
        self,
        fp8_dtype,
        scale,
        *,
        rowwise=True,
        columnwise=False,
        amax_out=None,
        saturation_out=None,
        col_sum=False,
    ) -> Fp8Tensor:
        assert not col_sum, "a norm's output is no gradient: it has no bias sum to give"
        q, self.mean, self.rstd = norm_kernels.norm_quantize(
            self.x,
            self.weight,
            self.bias,
            self.eps,
            self.rms,
            fp8_dtype,
            scale,
            rowwise=rowwise,
            columnwise=columnwise,
            amax_out=amax_out,
            saturation_out=saturation_out,
        )
        return q


class ActivationSource(_Source):
    """`kind` (activation_kernels.KINDS) applied to the 2-D pre-activation `h`."""

    def __init__(self, h, kind: str):
        self.input = h
        self.h, self.kind = h, kind

    def materialize(self) -> torch.Tensor:
        return activation_kernels.activation_torch(self.h, self.kind)

    def quantize(
        self,
        fp8_dtype,
        scale,
        *,
        rowwise=True,
        columnwise=False,
        amax_out=None,
        saturation_out=None,
        col_sum=False,
    ) -> Fp8Tensor:
        assert not col_sum, "an activation is no gradient: it has no bias sum to give"
        return activation_kernels.activation_quantize(
            self.h,
            self.kind,
            fp8_dtype,
            scale,
            rowwise=rowwise,
            columnwise=columnwise,
            amax_out=amax_out,
            saturation_out=saturation_out,
        )


class ActivationGradSource(_Source):
    """The gradient of `kind` at `h`, given the gradient `dout` of its output."""

    def __init__(self, dout, h, kind: str):
        self.input = dout
        self.dout, self.h, self.kind = dout, h, kind

    def materialize(self) -> torch.Tensor:
        # aten's backward ops themselves, as autograd would call them (tested bit for bit), not
        # autograd over a recomputed activation: that would run the forward again.
        return activation_kernels.activation_backward_torch(self.dout, self.h, self.kind)

    def quantize(
        self,
        fp8_dtype,
        scale,
        *,
        rowwise=True,
        columnwise=False,
        amax_out=None,
        saturation_out=None,
        col_sum=False,
    ) -> Fp8Tensor:
        return activation_kernels.activation_backward_quantize(
            self.dout,
            self.h,
            self.kind,
            fp8_dtype,
            scale,
            rowwise=rowwise,
            columnwise=columnwise,
            amax_out=amax_out,
            col_sum=col_sum,
            saturation_out=saturation_out,
        )


class HeadGradsSource(_Source):
    """The gradient of a QKV projection's output [tokens, groups * (queries per group + 2) *
    head_dim], laid out per key/value group as [its query heads, key, value] (parallel.layers.
    QKVParallelLinear), given as the gradients of the queries dq [tokens, groups * queries per
    group * head_dim] and of the keys and values dk, dv [tokens, groups * head_dim]: the three
    tensors attention's backward returns, which the unfused path concatenates first."""

    def __init__(self, dq, dk, dv, head_dim: int):
        self.input = dq
        self.dq, self.dk, self.dv, self.head_dim = dq, dk, dv, head_dim

    def materialize(self) -> torch.Tensor:
        tokens, groups = self.dq.shape[0], self.dk.shape[1] // self.head_dim
        per_group = (
            t.reshape(tokens, groups, -1, self.head_dim) for t in (self.dq, self.dk, self.dv)
        )
        return torch.cat(tuple(per_group), dim=2).reshape(tokens, -1)

    def quantize(
        self,
        fp8_dtype,
        scale,
        *,
        rowwise=True,
        columnwise=False,
        amax_out=None,
        saturation_out=None,
        col_sum=False,
    ) -> Fp8Tensor:
        if (
            self.is_cuda
            and triton_support.available()
            and all(t.stride(1) == 1 for t in (self.dq, self.dk, self.dv))
        ):
            return triton_kernels.quantize_heads(
                self.dq,
                self.dk,
                self.dv,
                self.head_dim,
                fp8_dtype,
                scale,
                rowwise,
                columnwise,
                amax_out,
                col_sum,
                saturation_out,
            )
        return quantize_torch(
            self.materialize(),
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


@dataclass(frozen=True)
class Norm:
    """A norm fused into the cast of the linear after it: the module (its parameters) and kind."""

    module: nn.Module
    rms: bool

    @property
    def eps(self) -> float:
        eps = self.module.eps
        # nn.RMSNorm's default
        return torch.finfo(self.module.weight.dtype).eps if eps is None else eps

    @staticmethod
    def of(module: nn.Module) -> Norm | None:
        """The fusable description of `module`, or None: an affine LayerNorm or RMSNorm over
        the last dimension."""
        if (
            isinstance(module, nn.LayerNorm)
            and module.elementwise_affine
            and len(module.normalized_shape) == 1
        ):
            return Norm(module, rms=False)
        if (
            isinstance(module, nn.RMSNorm)
            and module.elementwise_affine
            and len(module.normalized_shape) == 1
        ):
            return Norm(module, rms=True)
        return None


@dataclass(eq=False)
class GradHandoff:
    """The FP8 gradient of a linear's output, cast by what follows the linear (whose backward
    runs first) in the kernel that computed it: the activation's backward, or the cast that
    reads the query, key and value gradients of attention. The linear's backward takes it
    instead of casting its incoming gradient, which carries no values (`placeholder`)."""

    context: object = None  # the fp8_autocast context of the taking linear's forward (set there)
    # an Fp8Tensor; under fine-grained scaling a fine_grained.OutputGradient
    gradient: object = None
    placeholder: torch.Tensor | None = field(default=None, repr=False)

    @property
    def ready(self) -> bool:
        """Whether the linear that takes it runs in FP8 with fusion (its forward set `context`)."""
        return self.context is not None

    def hand_over(self, gradient, like: torch.Tensor) -> torch.Tensor:
        """Keep `gradient`; return the stand-in that autograd passes along in its place (the
        shape of `like`, no memory)."""
        self.gradient = gradient
        self.placeholder = torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape)
        return self.placeholder

    def take(self, incoming: torch.Tensor):
        """The handed-over gradient (`incoming` is its stand-in), or None if none was."""
        placeholder, gradient = self.placeholder, self.gradient
        self.gradient = self.placeholder = None
        if placeholder is None:
            return None
        if incoming.data_ptr() != placeholder.data_ptr() or incoming.numel() != placeholder.numel():
            raise RuntimeError(
                "a linear whose output gradient was handed over in FP8 got another gradient "
                "as well: its output must feed the fused activation alone (for QKV, the split "
                "into q, k, v alone)"
            )
        return gradient
