"""Fp8Linear: a drop-in nn.Linear whose three GEMMs run in FP8 under fp8_autocast."""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .autocast import Fp8Context, backward_pass, current_fp8_context
from .formats import fp8_max
from .gemm import fp8_gemm
from .quantize import Fp8Tensor, quantize
from .recipe import CurrentScaling
from .scaling import ROLES, AmaxPass, ScalingState

# torch._scaled_mm needs every GEMM dimension (tokens, in and out features) divisible by 16.
GEMM_ALIGNMENT = 16

# Bumped after every torch.optim optimizer step, which invalidates every cached weight cast.
# The parameter's version counter is not enough: fused AdamW (fused=True) updates weights
# without bumping it.
_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


@functools.lru_cache(maxsize=None)
def _has_fp8_tensor_cores(device_index) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


class Fp8Linear(nn.Linear):
    """`y = x W^T + b` like nn.Linear; under fp8_autocast its GEMMs run in FP8.

    forward (fprop) E4M3 x E4M3; dgrad and wgrad take the gradient in E5M2 under HYBRID (E4M3
    under E4M3); each falls back to high precision per `override_linear_precision`. The input
    is saved for backward in FP8 (transposed, ready for wgrad). The weight is cast once and
    reused across micro-batches until it changes: any torch.optim step, and any in-place
    update autograd sees (`copy_`, load_state_dict), refreshes the cast; call
    `clear_fp8_weight_cache()` after writing through `weight.data` or outside torch.optim.
    Scaling state per role lives in `fp8_scaling["input" | "weight" | "grad_output"]` and in
    the state_dict.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp8_scaling = nn.ModuleDict({role: ScalingState() for role in ROLES}).to(device=device)
        self._weight_fp8 = None  # (cache key, Fp8Tensor)
        self._warned_fallback = False

    def clear_fp8_weight_cache(self) -> None:
        self._weight_fp8 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = current_fp8_context()
        if context is None or all(context.recipe.override_linear_precision):
            return F.linear(x, self.weight, self.bias)
        reason = self._fp8_unsupported(x)
        if reason is not None:
            if not self._warned_fallback:
                self._warned_fallback = True
                warnings.warn(
                    f"{self}: {reason}; this layer runs in {x.dtype} instead of FP8", stacklevel=2
                )
            return F.linear(x, self.weight, self.bias)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
            with torch.autocast(x.device.type, enabled=False):
                return _Fp8LinearFunction.apply(x, self.weight, self.bias, self, context)
        return _Fp8LinearFunction.apply(x, self.weight, self.bias, self, context)

    def _fp8_unsupported(self, x: torch.Tensor):
        if not x.is_floating_point() or x.numel() == 0:
            return f"input of dtype {x.dtype} and {x.numel()} elements"
        tokens = x.numel() // self.in_features
        dims = {"in_features": self.in_features, "out_features": self.out_features, "tokens": tokens}
        odd = [f"{name}={value}" for name, value in dims.items() if value % GEMM_ALIGNMENT]
        if odd:
            return f"FP8 GEMMs need dimensions divisible by {GEMM_ALIGNMENT} ({', '.join(odd)})"
        if x.is_cuda and not _has_fp8_tensor_cores(x.device.index):
            return "FP8 GEMMs need a GPU of compute capability 8.9 or newer"
        return None

    def _quantize(self, tensor, role, fp8_dtype, context: Fp8Context, amax_pass: AmaxPass, **layout) -> Fp8Tensor:
        state = self.fp8_scaling[role]
        recipe = context.recipe
        if isinstance(recipe, CurrentScaling):
            return quantize(tensor, fp8_dtype, margin=recipe.margin, scale_out=state.scale, **layout)
        state.fit_history(recipe.amax_history_len)
        # With an empty history there is no earlier scale to use: fit this first cast to the
        # tensor itself (Transformer Engine casts with 1.0, which underflows small gradients).
        first = state.update_count == 0
        q = quantize(
            tensor,
            fp8_dtype,
            None if first else state.scale,
            margin=recipe.margin,
            scale_out=state.scale if first else None,
            amax_out=state.amax,
            **layout,
        )
        amax_pass.record(state, fp8_max(fp8_dtype), recipe, keep_amax=role == "weight")
        return q

    def _quantized_weight(self, context: Fp8Context, fp8_dtype) -> Fp8Tensor:
        weight = self.weight
        state = self.fp8_scaling["weight"]
        key = (_optimizer_steps, weight._version, weight.data_ptr(), fp8_dtype, context.recipe)
        if self._weight_fp8 is None or self._weight_fp8[0] != key:
            # The weight's accumulator holds the amax of its current cast, kept across passes.
            state.amax.zero_()
            q = self._quantize(weight.detach(), "weight", fp8_dtype, context, context.forward_pass,
                               rowwise=True, columnwise=True)
            self._weight_fp8 = (key, q)
            return q
        if not isinstance(context.recipe, CurrentScaling):
            # Every pass records the weight's amax, so all three histories roll in step.
            state.fit_history(context.recipe.amax_history_len)
            context.forward_pass.record(state, fp8_max(fp8_dtype), context.recipe, keep_amax=True)
        return self._weight_fp8[1]


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module: Fp8Linear, context: Fp8Context):
        recipe = context.recipe
        fprop_hp, dgrad_hp, wgrad_hp = recipe.override_linear_precision
        fmt = recipe.fp8_format
        x2 = x.reshape(-1, x.shape[-1])
        wgrad_fp8 = weight.requires_grad and not wgrad_hp
        dgrad_fp8 = x.requires_grad and not dgrad_hp

        qx = None
        if not fprop_hp or wgrad_fp8:
            qx = module._quantize(x2, "input", fmt.forward_dtype, context, context.forward_pass,
                                  rowwise=not fprop_hp, columnwise=wgrad_fp8)
        qw = module._quantized_weight(context, fmt.forward_dtype) if not fprop_hp or dgrad_fp8 else None

        if fprop_hp:
            y = F.linear(x2, weight.to(x2.dtype), None if bias is None else bias.to(x2.dtype))
        else:
            y = fp8_gemm(qx.data, qw.data, qx.scale_inv, qw.scale_inv, x2.dtype, bias=bias, fast_accum=True)

        # For backward: the input transposed in FP8 (or as it is, for a high-precision wgrad),
        # the weight transposed in FP8 (or the parameter itself, for a high-precision dgrad).
        x_saved, x_scale_inv = (qx.data_t, qx.scale_inv) if wgrad_fp8 else (x2, None)
        w_saved, w_scale_inv = (qw.data_t, qw.scale_inv) if dgrad_fp8 else (weight, None)
        ctx.save_for_backward(x_saved, x_scale_inv, w_saved, w_scale_inv)
        ctx.module, ctx.context, ctx.weight_dtype = module, context, weight.dtype
        ctx.fp8 = (dgrad_fp8, wgrad_fp8)
        ctx.has_bias = bias is not None
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x_saved, x_scale_inv, w_saved, w_scale_inv = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dgrad_fp8, wgrad_fp8 = ctx.fp8
        dgrad_fp8 &= need_dx
        wgrad_fp8 &= need_dw
        context = ctx.context
        out_shape = dy.shape
        dy2 = dy.reshape(-1, dy.shape[-1])

        qdy = None
        if dgrad_fp8 or wgrad_fp8:
            qdy = ctx.module._quantize(
                dy2, "grad_output", context.recipe.fp8_format.backward_dtype, context,
                backward_pass(context.amax_reduction_group), rowwise=dgrad_fp8, columnwise=wgrad_fp8,
                col_sum=need_db and ctx.has_bias,
            )

        dx = dw = db = None
        if need_dx:
            if dgrad_fp8:
                dx = fp8_gemm(qdy.data, w_saved, qdy.scale_inv, w_scale_inv, dy.dtype)
            else:
                dx = dy2 @ w_saved.to(dy.dtype)
            dx = dx.view(*out_shape[:-1], dx.shape[-1])
        if need_dw:
            if wgrad_fp8:
                dw = fp8_gemm(qdy.data_t, x_saved, qdy.scale_inv, x_scale_inv, ctx.weight_dtype)
            else:
                dw = (dy2.t() @ x_saved.to(dy.dtype)).to(ctx.weight_dtype)
        if need_db and ctx.has_bias:
            db = qdy.col_sum if qdy is not None else dy2.sum(0, dtype=torch.float32)
            db = db.to(ctx.weight_dtype)
        return dx, dw, db, None, None
