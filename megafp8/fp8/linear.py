"""Fp8Linear: a drop-in nn.Linear whose three GEMMs run in FP8 under fp8_autocast."""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import collectives
from .autocast import Fp8Context, backward_pass, current_fp8_context
from .formats import fp8_max
from .gemm import fp8_gemm
from .quantize import Fp8Tensor, absmax, quantize, scale_from_amax
from .recipe import CurrentScaling
from .scaling import AmaxPass, scaling_states

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
        self.fp8_scaling = scaling_states(device)
        self._weight_fp8 = None  # (cache key, Fp8Tensor)
        self._warned_fallback = False

    def clear_fp8_weight_cache(self) -> None:
        self._weight_fp8 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)

    def _linear(self, x: torch.Tensor, bias, gather_group=None) -> torch.Tensor:
        """`x W^T + bias`; with `gather_group`, `x` is this rank's dim-0 shard of the input,
        all-gathered over that group first: in FP8 when the forward GEMM is FP8 (half the bytes
        of bf16), and the input gradient comes back reduce-scattered to the shard."""
        context = current_fp8_context()
        fp8 = context is not None and not all(context.recipe.override_linear_precision)
        if fp8:
            reason = self._fp8_unsupported(x, collectives.group_size(gather_group))
            if reason is not None:
                fp8 = False
                if not self._warned_fallback:
                    self._warned_fallback = True
                    warnings.warn(f"{self}: {reason}; this layer runs in {x.dtype} instead of FP8", stacklevel=3)
        if not fp8:
            if collectives.group_size(gather_group) > 1:
                x = _GatherRows.apply(x, gather_group)
            return F.linear(x, self.weight, bias)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
            with torch.autocast(x.device.type, enabled=False):
                return _Fp8LinearFunction.apply(x, self.weight, bias, self, context, gather_group)
        return _Fp8LinearFunction.apply(x, self.weight, bias, self, context, gather_group)

    def _fp8_unsupported(self, x: torch.Tensor, gathered_ranks: int = 1):
        if not x.is_floating_point() or x.numel() == 0:
            return f"input of dtype {x.dtype} and {x.numel()} elements"
        tokens = x.numel() // self.in_features * gathered_ranks
        dims = {"in_features": self.in_features, "out_features": self.out_features, "tokens": tokens}
        odd = [f"{name}={value}" for name, value in dims.items() if value % GEMM_ALIGNMENT]
        if odd:
            return f"FP8 GEMMs need dimensions divisible by {GEMM_ALIGNMENT} ({', '.join(odd)})"
        if x.is_cuda and not _has_fp8_tensor_cores(x.device.index):
            return "FP8 GEMMs need a GPU of compute capability 8.9 or newer"
        return None

    def _quantize(self, tensor, role, fp8_dtype, context: Fp8Context, amax_pass: AmaxPass,
                  gather_group=None, **layout) -> Fp8Tensor:
        """Cast `tensor` for `role`. Shards that will be gathered over `gather_group` after
        the cast must share one scale, so theirs is fitted to the amax of all of them."""
        state = self.fp8_scaling[role]
        recipe = context.recipe
        if context.replay_scales is not None and id(state) in context.replay_scales:
            # Recomputing a forward: cast exactly as it did; its amax is already recorded.
            return quantize(tensor, fp8_dtype, context.replay_scales[id(state)], margin=recipe.margin, **layout)
        delayed = not isinstance(recipe, CurrentScaling)
        agree_over = gather_group if collectives.group_size(gather_group) > 1 else None
        if delayed:
            state.fit_history(recipe.amax_history_len)
            if state.update_count > 0:
                if agree_over is not None:
                    _check_scales_agree(context, agree_over)
                scale = state.scale
            else:
                # With an empty history there is no earlier scale: fit this first cast to the
                # tensor itself (Transformer Engine casts with 1.0, which underflows small
                # gradients), agreed over every rank that shares the layer's scales.
                scale = None
                if recipe.reduce_amax and collectives.group_size(context.amax_reduction_group) > 1:
                    agree_over = context.amax_reduction_group
        else:
            scale = None
        if scale is None and agree_over is not None:
            amax = collectives.max_over(absmax(tensor), agree_over)
            scale = scale_from_amax(amax, fp8_dtype, recipe.margin)
            state.scale.copy_(scale)
        q = quantize(
            tensor,
            fp8_dtype,
            scale,
            margin=recipe.margin,
            scale_out=state.scale if scale is None else None,
            amax_out=state.amax if delayed else None,
            saturation_out=state.saturation if context.collect_saturation else None,
            **layout,
        )
        if delayed:
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


def _check_scales_agree(context: Fp8Context, group) -> None:
    """Shards gathered over `group` in FP8 need one scale: delayed scaling gives them one only
    if their amaxes are reduced over a group that contains `group`."""
    amax_group = context.amax_reduction_group if context.recipe.reduce_amax else None
    key = (id(amax_group), id(group))
    if key in _agreeing_groups:
        return
    if amax_group is None or not _ranks(group) <= _ranks(amax_group):
        raise ValueError(
            "an FP8 sequence-parallel all-gather needs the input scale to agree on every "
            "tensor-parallel rank: pass fp8_autocast(amax_reduction_group=...) a group that contains "
            "the tensor-parallel group (tensor x data parallel), with reduce_amax=True"
        )
    _agreeing_groups.add(key)


_agreeing_groups: set = set()


def _ranks(group) -> set:
    return set(torch.distributed.get_process_group_ranks(group))


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 forward, reduce-scatter of the gradient backward (high precision)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return collectives.all_gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return collectives.reduce_scatter_rows(grad, ctx.group), None


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module: Fp8Linear, context: Fp8Context, gather_group):
        recipe = context.recipe
        fprop_hp, dgrad_hp, wgrad_hp = recipe.override_linear_precision
        fmt = recipe.fp8_format
        x2 = x.reshape(-1, x.shape[-1])
        wgrad_fp8 = weight.requires_grad and not wgrad_hp
        dgrad_fp8 = x.requires_grad and not dgrad_hp
        gather = gather_group if collectives.group_size(gather_group) > 1 else None
        fp8_gather = gather is not None and not fprop_hp
        if gather is not None and not fp8_gather:
            x2 = collectives.all_gather_rows(x2, gather)  # a high-precision forward GEMM

        qx = None
        if not fprop_hp or wgrad_fp8:
            qx = module._quantize(x2, "input", fmt.forward_dtype, context, context.forward_pass,
                                  gather_group=gather if fp8_gather else None,
                                  rowwise=not fprop_hp, columnwise=wgrad_fp8)
        qw = module._quantized_weight(context, fmt.forward_dtype) if not fprop_hp or dgrad_fp8 else None

        if fprop_hp:
            y = F.linear(x2, weight.to(x2.dtype), None if bias is None else bias.to(x2.dtype))
        else:
            x_data = collectives.all_gather_rows(qx.data, gather) if fp8_gather else qx.data
            y = fp8_gemm(x_data, qw.data, qx.scale_inv, qw.scale_inv, x2.dtype, bias=bias, fast_accum=True)

        # For backward: the input transposed in FP8 (this rank's shard of it, gathered again in
        # backward, when the forward gathered in FP8; as it is, for a high-precision wgrad), and
        # the weight transposed in FP8 (or the parameter itself, for a high-precision dgrad).
        x_saved, x_scale_inv = (qx.data_t, qx.scale_inv) if wgrad_fp8 else (x2, None)
        w_saved, w_scale_inv = (qw.data_t, qw.scale_inv) if dgrad_fp8 else (weight, None)
        ctx.save_for_backward(x_saved, x_scale_inv, w_saved, w_scale_inv)
        ctx.module, ctx.context, ctx.weight_dtype = module, context, weight.dtype
        ctx.fp8 = (dgrad_fp8, wgrad_fp8)
        ctx.has_bias = bias is not None
        ctx.gather, ctx.fp8_gather = gather, fp8_gather
        return y.view(-1, *x.shape[1:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x_saved, x_scale_inv, w_saved, w_scale_inv = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dgrad_fp8, wgrad_fp8 = ctx.fp8
        dgrad_fp8 &= need_dx
        wgrad_fp8 &= need_dw
        context = ctx.context
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
            if ctx.gather is not None:
                dx = collectives.reduce_scatter_rows(dx, ctx.gather)
            dx = dx.view(-1, *dy.shape[1:-1], dx.shape[-1])
        if need_dw:
            if wgrad_fp8:
                if ctx.fp8_gather:
                    x_saved = collectives.all_gather_columns(x_saved, ctx.gather)
                dw = fp8_gemm(qdy.data_t, x_saved, qdy.scale_inv, x_scale_inv, ctx.weight_dtype)
            else:
                dw = (dy2.t() @ x_saved.to(dy.dtype)).to(ctx.weight_dtype)
        if need_db and ctx.has_bias:
            db = qdy.col_sum if qdy is not None else dy2.sum(0, dtype=torch.float32)
            db = db.to(ctx.weight_dtype)
        return dx, dw, db, None, None, None
