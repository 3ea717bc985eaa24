"""Fp8Linear: a drop-in nn.Linear whose three GEMMs run in FP8 under fp8_autocast."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from megafp8 import collective_gemm, collectives
from megafp8.main_grad import accumulate_into_main_grad, claim_empty_main_grad

from . import fine_grained, norm_kernels
from .autocast import Fp8Context, backward_pass, current_fp8_context
from .formats import FP8_DTYPES
from .fused import ActivationGradSource, ActivationSource, GradHandoff, Norm, NormSource
from .gemm import fp8_gemm
from .quantize import quantize
from .scaling import cast, record_reuse, scaling_states
from .tensor import Fp8Tensor, WeightCast, absmax, scale_from_amax

# torch._scaled_mm needs every GEMM dimension (tokens, in and out features) divisible by 16.
GEMM_ALIGNMENT = 16

# Bumped after every torch.optim optimizer step, which invalidates every cached weight cast.
# The parameter's version counter is not enough: fused AdamW (fused=True) updates weights
# without bumping it. The counting hook is global (torch has no per-parameter step hook); the
# first Fp8Linear built installs it, so importing the package alone changes nothing.
_optimizer_steps = 0
_optimizer_step_hook = None


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _watch_optimizer_steps() -> None:
    global _optimizer_step_hook
    if _optimizer_step_hook is None:
        _optimizer_step_hook = register_optimizer_step_post_hook(_count_optimizer_step)


@functools.cache
def _has_fp8_tensor_cores(device_index) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


@dataclass(frozen=True)
class Fusion:
    """The neighbours an FP8 linear takes into its own kernels (megafp8.fp8.fused), so that
    their outputs are never stored in high precision. At most one of `norm` and `activation`.

    - `norm`: the input is the input of this norm, whose output the cast writes in FP8 directly;
      in backward, the norm's backward follows the dgrad GEMM (after `input_grad_group`'s
      all-reduce: the norm's input was replicated over those tensor-parallel ranks).
    - `activation` (activation_kernels.KINDS): the input is the input of this activation.
      With `grad_to` = (the linear that produced that input, a GradHandoff), backward also casts
      the activation's gradient in FP8 for that linear, in the kernel that computes it.
    - `grad_from`: this linear takes its output gradient from this GradHandoff, already in FP8.
    """

    norm: Norm | None = None
    input_grad_group: object = None
    activation: str | None = None
    grad_to: tuple | None = None
    grad_from: GradHandoff | None = None

    def activation_backward(self, dout: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The gradient of the fused activation at `h`, given `dout`: cast in FP8 for the linear
        that produced `h` and handed over to it (autograd then carries a stand-in), or in high
        precision."""
        source = ActivationGradSource(dout, h, self.activation)
        producer, handoff = self.grad_to if self.grad_to is not None else (None, None)
        if handoff is None or not handoff.ready:
            return source.materialize()
        return hand_over_gradient(source, producer, handoff, like=h)


NO_FUSION = Fusion()


class Fp8Linear(nn.Linear):
    """`y = x W^T + b` like nn.Linear; under fp8_autocast its GEMMs run in FP8.

    forward (fprop) E4M3 x E4M3; dgrad and wgrad take the gradient in E5M2 under HYBRID (E4M3
    under E4M3); each falls back to high precision per `override_linear_precision`. The input
    is saved for backward in FP8 (transposed, ready for wgrad). The weight is cast once and
    reused across micro-batches until it changes: any torch.optim step (the first Fp8Linear
    built installs a global optimizer step post-hook that counts them), and any in-place
    update autograd sees (`copy_`, load_state_dict, MixedPrecisionAdamW's fused pass, which
    bumps the version counters of what it writes), refreshes the cast; call
    `clear_fp8_weight_cache()` after writing through `weight.data` or outside torch.optim.
    An optimizer that writes the weight may write that cast too (`weight_cast_target`, as
    MixedPrecisionAdamW's fused pass does under delayed scaling).
    Scaling state per role lives in `fp8_scaling["input" | "weight" | "grad_output"]` and in
    the state_dict.

    Neighbour fusion (Transformer Engine's LayerNormLinear / LayerNormMLP, on unless
    `fuse_neighbours` is False): `forward(x, norm=...)` normalizes `x` and `forward(h,
    activation=...)` applies the activation inside the input's FP8 cast, and an activation's
    backward writes the FP8 gradient of the linear before it (see `Fusion`). With every GEMM in
    FP8, under delayed scaling (the cast's scale is known before the tensor) and, the activations
    the recipe lists in `fused_activations` only, under rowwise and blockwise scaling (whose
    casts read the tensor in tiles that hold its blocks); otherwise the neighbour runs on its own
    first, with the same result.

    Gradient-accumulation fusion (Megatron's, on unless `fuse_wgrad_accumulation` is False): when
    the weight carries a `main_grad` (megafp8.parallel.data_parallel.GradientBuffer), the
    weight and bias gradients go there straight from the GEMM in its dtype (fp32, or bf16), with
    no bf16 gradient and no accumulation pass: the FP8 wgrad overwrites a `main_grad` that holds
    no gradient yet (`main_grad_empty`: a step's first micro-batch; `_scaled_mm` cannot add), and
    on a GPU the high-precision wgrad adds into it inside the GEMM (addmm with its output). The
    bias gradient, a column sum in fp32, goes into its `main_grad` on every micro-batch.
    Autograd then gets no gradient for them, which the GradientBuffer's hook understands.

    FP8 primary weights (`make_weight_fp8`; Transformer Engine's fp8_model_init, Megatron's
    --fp8-param-gather): the weight parameter becomes its FP8 cast, with the transpose beside
    it, and no high-precision copy is kept. An optimizer holding the fp32 master writes it
    (`write_weight`, or the pass that `weight_cast_target` describes) with the weight's delayed
    scale; a GEMM that does not run in FP8 reads it dequantized. Its gradient always goes to
    `main_grad` (a GradientBuffer's), in high precision.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        _watch_optimizer_steps()
        self.fp8_scaling = scaling_states(device)
        self._weight_fp8 = None  # (cache key, Fp8Tensor); an FP8 primary weight's: (None, it)
        self._high_precision_dtype = None  # an FP8 primary weight's dtype before make_weight_fp8
        # the ranks an FP8 primary weight's first scale agrees over, and its recipe's margin
        self._weight_amax_group, self._weight_margin = None, 0
        # An FP8 primary weight's last cast's saturation counts, and whether no forward that
        # collects them has taken them yet (CUDA graphs' warm-up puts it back)
        self._weight_cast_counts = None
        self.weight_counts_pending = False
        self._weight_cast_by_optimizer = False  # the cached cast came from weight_cast_target
        self._weight_cast_counted = False  # a fine-grained cast counted its saturation
        self.keep_weight_cast_addresses = False  # set by CUDA graphs (megafp8.parallel.cuda_graphs)
        self.fuse_wgrad_accumulation = True
        self.fuse_neighbours = True
        self._warned_fallback = False

    def clear_fp8_weight_cache(self) -> None:
        if not self.fp8_primary_weight:  # else the cast is the weight
            self._weight_fp8 = None

    # -- FP8 primary weights -------------------------------------------------------------------

    @property
    def fp8_primary_weight(self) -> bool:
        """Whether the weight is held only in FP8 (`make_weight_fp8`)."""
        return self.weight.dtype in FP8_DTYPES

    @torch.no_grad()
    def make_weight_fp8(
        self,
        fp8_dtype=torch.float8_e4m3fn,
        value: torch.Tensor | None = None,
        amax_reduction_group=None,
        margin: int = 0,
    ):
        """Hold the weight only as its FP8 cast from now on: the parameter becomes the cast's
        bytes ([out, in], same shape, `fp8_dtype`) and the transpose a buffer beside it, cast
        from `value` (default: the weight itself; an optimizer passes its fp32 master) with the
        weight's delayed scale (fitted to `value` while there is no history, over the ranks of
        `amax_reduction_group` and with the recipe's `margin`, as a first forward cast would be).
        The high-precision copy is freed. The parameter object stays the same, with its
        attributes."""
        if self.fp8_primary_weight:
            raise ValueError(f"{self}: the weight is in FP8 already")
        weight = self.weight
        value = weight.detach() if value is None else value
        self._high_precision_dtype = weight.dtype
        shape, device = weight.shape, weight.device
        cast = Fp8Tensor(
            torch.empty(shape, dtype=fp8_dtype, device=device),
            torch.empty(shape[::-1], dtype=fp8_dtype, device=device),
            torch.ones((), device=device),
            self.fp8_scaling["weight"].amax,
        )
        self._weight_fp8 = (None, cast)
        self._weight_amax_group, self._weight_margin = amax_reduction_group, margin
        self._weight_cast_counts = torch.zeros(3, dtype=torch.int64, device=device)
        weight.data = cast.data
        self.write_weight(value)

    @torch.no_grad()
    def write_weight(self, value: torch.Tensor) -> None:
        """Cast `value` (the weight's shape, high precision) into the FP8 primary weight with
        the weight's delayed scale, fitted to `value` while the scale has no history; the amax
        accumulator takes its amax, as after the optimizer pass's own cast."""
        state = self.fp8_scaling["weight"]
        cast = self._weight_fp8[1]
        value = value.reshape(self.weight.shape)
        if state.update_count == 0:
            amax = collectives.max_over(absmax(value), self._weight_amax_group)
            state.scale.copy_(scale_from_amax(amax, cast.data.dtype, self._weight_margin))
        state.amax.zero_()
        self._weight_cast_counts.zero_()
        quantize(
            value,
            cast.data.dtype,
            state.scale,
            columnwise=True,
            amax_out=state.amax,
            saturation_out=self._weight_cast_counts,
            out=cast,
        )
        self.weight_counts_pending = True

    @torch.no_grad()
    def weight_bytes_written(self) -> None:
        """The FP8 primary weight's bytes were written in place from a cast with its scale (the
        distributed optimizer all-gathers the slices its ranks cast): make the transpose and
        the inverse scale agree with them."""
        cast = self._weight_fp8[1]
        cast.data_t.view(torch.uint8).copy_(cast.data.view(torch.uint8).t())
        cast.scale_inv.copy_(self.fp8_scaling["weight"].scale.reciprocal())

    @property
    def high_precision_dtype(self) -> torch.dtype:
        """The weight's dtype, or an FP8 primary weight's before `make_weight_fp8`: its
        gradient's and its dequantized values'."""
        return self._high_precision_dtype if self.fp8_primary_weight else self.weight.dtype

    def dequantized_weight(self) -> torch.Tensor:
        """The weight in high precision: itself, or an FP8 primary weight's values in the dtype
        it had (no autograd history)."""
        if not self.fp8_primary_weight:
            return self.weight.detach()
        cast = self._weight_fp8[1]
        return (cast.data.float() * cast.scale_inv).to(self._high_precision_dtype)

    def high_precision_weight(self) -> torch.Tensor:
        """The weight for a GEMM in high precision: the parameter, or an FP8 primary weight
        dequantized, whose gradient autograd then hands to `main_grad`."""
        if not self.fp8_primary_weight:
            return self.weight
        return _DequantizedFp8Weight.apply(self.weight, self)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.fp8_primary_weight:  # the values, not bytes that mean nothing without the scale
            destination[prefix + "weight"] = self.dequantized_weight()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *args):
        value = state_dict.get(prefix + "weight")
        if not self.fp8_primary_weight or value is None or value.dtype in FP8_DTYPES:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *args)
        # High-precision values into the FP8 weight: cast with the scale that comes with them
        # (its state loads after this module's own entries; loaded here first, then again).
        missing_keys = args[0]
        rest = {k: v for k, v in state_dict.items() if k != prefix + "weight"}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, *args)
        missing_keys.remove(prefix + "weight")
        self.fp8_scaling["weight"]._load_from_state_dict(
            state_dict, prefix + "fp8_scaling.weight.", local_metadata, False, [], [], []
        )
        self.write_weight(value.to(self.weight.device))

    def reseed_fp8_scaling(self) -> None:
        """Start the scales over (ScalingState.reseed of every role) and recast the weight at
        the next forward, into the buffers it has (a CUDA graph reads them). An FP8 primary
        weight keeps its scale: its bytes are cast with it."""
        for role, state in self.fp8_scaling.items():
            if not (role == "weight" and self.fp8_primary_weight):  # its bytes hold that scale
                state.reseed()
        if self._weight_fp8 is not None and not self.fp8_primary_weight:
            (_, *rest), q = self._weight_fp8
            self._weight_fp8 = ((None, *rest), q)  # a key no forward makes: stale

    def forward(
        self,
        x: torch.Tensor,
        *,
        norm: nn.Module | None = None,
        activation: str | None = None,
        grad_to: tuple | None = None,
        grad_from: GradHandoff | None = None,
    ) -> torch.Tensor:
        """`norm(x) W^T + b` with a norm module, `act(x) W^T + b` with an activation, else
        `x W^T + b`; `grad_to` and `grad_from` pair an activation's linear with the linear
        before it (`Fusion`)."""
        context = self.fp8_context(x)
        fusion, x = self.fusion(
            context, x, norm=norm, activation=activation, grad_to=grad_to, grad_from=grad_from
        )
        return self.linear(x, self.bias, context, fusion)

    def linear(
        self, x: torch.Tensor, bias, context: Fp8Context | None, fusion: Fusion = NO_FUSION
    ) -> torch.Tensor:
        """`x W^T + bias` under `context` (from `fp8_context`; None: high precision), with the
        neighbours of `fusion` (from `fusion`). A subclass may add its bias later."""
        if context is None:
            return self.high_precision_linear(x, bias)
        return self.fp8_linear(x, bias, context, fusion=fusion)

    def fusion(
        self,
        context: Fp8Context | None,
        x: torch.Tensor,
        *,
        norm=None,
        activation=None,
        grad_to=None,
        grad_from=None,
        input_grad_group=None,
    ) -> tuple[Fusion, torch.Tensor]:
        """(the Fusion of these neighbours this layer runs under `context`, its input): the
        neighbours it cannot fuse are applied to `x` here, unfused."""
        # A delayed scale is known before the tensor, and a fine-grained cast's blocks lie in
        # its own tiles (rowwise: its amax pass reads them too): both casts can compute what
        # they read. Current scaling needs the tensor's amax first. An activation only where
        # the recipe says computing it in the cast pays.
        fine_grained_context = context is not None and context.recipe.granularity != "tensor"
        fusable = (
            context is not None
            and self.fuse_neighbours
            and (context.recipe.delayed or fine_grained_context)
            and (activation is None or activation in context.recipe.fused_activations)
            and not any(context.recipe.override_linear_precision)
            and not torch.is_autocast_enabled(x.device.type)
        )
        # the fine-grained casts read 128 x 128 tiles, not the whole rows a norm needs
        fused_norm = (
            Norm.of(norm) if fusable and not fine_grained_context and norm is not None else None
        )
        if norm is not None and fused_norm is None:
            x = norm(x)
        if activation is not None and not fusable:
            x = ActivationSource(x, activation).materialize()
        if not fusable:
            return NO_FUSION, x
        if grad_from is not None:  # this linear's FP8 backward will take the gradient
            grad_from.context = context
        return Fusion(
            norm=fused_norm,
            input_grad_group=input_grad_group if fused_norm else None,
            activation=activation,
            grad_to=grad_to if activation else None,
            grad_from=grad_from,
        ), x

    def high_precision_linear(
        self, x: torch.Tensor, bias, *, gather_group=None, scatter_group=None
    ) -> torch.Tensor:
        """F.linear, with its weight gradient added into `main_grad` by the GEMM where it can be.
        With `gather_group` (`x` is this rank's dim-0 shard, all-gathered over the group first) or
        `scatter_group` (the output summed over the group, this rank keeping its dim-0 shard), the
        collective runs in blocks beside the GEMM, forward and backward (megafp8.collective_gemm)."""
        into_main_grad = (
            self.fuse_wgrad_accumulation
            and x.is_cuda
            and _ADDMM_INTO_FP32
            and getattr(self.weight, "main_grad", None) is not None
            and self.weight.requires_grad
            and x.dtype == self.weight.dtype in (torch.bfloat16, torch.float16)
            and not torch.is_autocast_enabled(x.device.type)
        )
        weight = self.high_precision_weight()
        comm = _Collectives(gather_group, scatter_group, overlap=True)
        if comm.gather is not None or comm.scatter is not None:
            if torch.is_autocast_enabled(x.device.type):
                raise ValueError(
                    "the overlapped collectives of a high-precision linear do not run under torch.autocast"
                )
            return _HighPrecisionLinearBesideCollective.apply(x, weight, bias, comm, into_main_grad)
        if into_main_grad:
            return _LinearIntoMainGrad.apply(x, weight, bias)
        return F.linear(x, weight, bias)

    def fp8_context(self, x: torch.Tensor, gathered_ranks: int = 1) -> Fp8Context | None:
        """The fp8_autocast this layer's GEMMs run under for the input `x` (one of
        `gathered_ranks` shards gathered before the GEMM), or None to compute in high precision:
        outside fp8_autocast, with every GEMM overridden, or for shapes or a GPU FP8 cannot
        take (warned once per layer)."""
        context = current_fp8_context()
        if context is None or all(context.recipe.override_linear_precision):
            return None
        # blockwise scaling splits every dimension a GEMM multiplies over into blocks of 128
        alignment = fine_grained.BLOCK if context.recipe.granularity == "block" else GEMM_ALIGNMENT
        reason = self._fp8_unsupported(x, gathered_ranks, alignment)
        if reason is None:
            return context
        if not self._warned_fallback:
            self._warned_fallback = True
            warnings.warn(
                f"{self}: {reason}; this layer runs in {x.dtype} instead of FP8", stacklevel=3
            )
        return None

    def fp8_linear(
        self,
        x: torch.Tensor,
        bias,
        context: Fp8Context,
        gather_group=None,
        fusion: Fusion = NO_FUSION,
        scatter_group=None,
        overlap: bool = False,
    ) -> torch.Tensor:
        """`x W^T + bias` in FP8 under `context` (from `fp8_context`), with the neighbours of
        `fusion`. With `gather_group`, `x` is this rank's dim-0 shard of the input, all-gathered
        over that group first, in FP8 when the forward GEMM is FP8 (half the bytes of bf16); its
        gradient comes back reduce-scattered to the shard. With `scatter_group`, the output is
        summed over that group and this rank keeps its dim-0 shard (the gradient all-gathered).
        `overlap`: either collective runs block by block beside the GEMM (megafp8.collective_gemm)."""
        norm = fusion.norm.module if fusion.norm is not None else None
        norm_params = (
            (norm.weight, getattr(norm, "bias", None)) if norm is not None else (None, None)
        )
        comm = _Collectives(gather_group, scatter_group, overlap)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
            with torch.autocast(x.device.type, enabled=False):
                return self.fp8_linear(
                    x, bias, context, gather_group, fusion, scatter_group, overlap
                )
        if context.recipe.granularity != "tensor":
            return fine_grained.fine_grained_linear(
                self, x, bias, context, gather_group, scatter_group, fusion
            )
        return _Fp8LinearFunction.apply(
            x, self.weight, bias, *norm_params, self, context, comm, fusion
        )

    def _fp8_unsupported(self, x: torch.Tensor, gathered_ranks: int, alignment: int):
        if not x.is_floating_point() or x.numel() == 0:
            return f"input of dtype {x.dtype} and {x.numel()} elements"
        tokens = x.numel() // x.shape[-1] * gathered_ranks
        dims = {
            "in_features": self.in_features,
            "out_features": self.out_features,
            "tokens": tokens,
        }
        odd = [f"{name}={value}" for name, value in dims.items() if value % alignment]
        if odd:
            return f"FP8 GEMMs need dimensions divisible by {alignment} ({', '.join(odd)})"
        if x.is_cuda and not _has_fp8_tensor_cores(x.device.index):
            return "FP8 GEMMs need a GPU of compute capability 8.9 or newer"
        return None

    def refresh_weight_cast(self, context: Fp8Context) -> None:
        """Make the weight cast that a forward under `context` would use, if it is stale (the
        first micro-batch of a step), else record its reuse, as that forward would. A CUDA-graphed
        layer calls this before each replay: the captured graph reads the cast, never makes it.
        Only for a layer that has cast its weight before (its first forward is eager)."""
        if self.fp8_primary_weight:
            self._quantized_weight(context, context.recipe.fp8_format.forward_dtype)
            return
        if self._weight_fp8 is None:
            return
        *_, fp8_dtype, recipe = self._weight_fp8[0]  # the cache key's last two fields
        if recipe == context.recipe and recipe.granularity != "tensor":
            self.fine_grained_weight_cast(context)
        elif recipe == context.recipe:
            self._quantized_weight(context, fp8_dtype)

    def _weight_cast_key(self, fp8_dtype, recipe) -> tuple:
        weight = self.weight
        return (_optimizer_steps, weight._version, weight.data_ptr(), fp8_dtype, recipe)

    def _quantized_weight(self, context: Fp8Context, fp8_dtype) -> Fp8Tensor:
        if self.fp8_primary_weight:
            return self._fp8_primary_cast(context, fp8_dtype)
        weight = self.weight
        state = self.fp8_scaling["weight"]
        key = self._weight_cast_key(fp8_dtype, context.recipe)
        # A cast the optimizer made counted no saturation: a forward that counts makes its own.
        uncounted = context.collect_saturation and self._weight_cast_by_optimizer
        if self._weight_fp8 is None or self._weight_fp8[0] != key or uncounted:
            self._refuse_recast_in_capture()
            # The weight's accumulator holds the amax of its current cast, kept across passes.
            state.amax.zero_()
            q = cast(
                weight.detach(),
                state,
                fp8_dtype,
                context,
                context.forward_pass,
                keep_amax=True,
                rowwise=True,
                columnwise=True,
                out=self._reusable_weight_cast(fp8_dtype),
            )
            self._weight_fp8 = (key, q)
            self._weight_cast_by_optimizer = False
            return q
        record_reuse(state, fp8_dtype, context)
        return self._weight_fp8[1]

    def _refuse_recast_in_capture(self) -> None:
        """A graphed forward reads the weight cast it was captured with: one cast afresh inside
        the capture would be baked into the graph (refresh_weight_cast makes it before)."""
        if self.weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{self}: a CUDA graph capture met a stale FP8 weight cast; "
                "call refresh_weight_cast before capturing"
            )

    def fine_grained_weight_cast(self, context: Fp8Context) -> fine_grained.WeightCasts:
        """The weight cast for both of its GEMMs under a rowwise or blockwise `context`
        (megafp8.fp8.fine_grained), made once per optimizer step as the tensorwise cast is."""
        key = self._weight_cast_key(context.recipe.fp8_format.forward_dtype, context.recipe)
        uncounted = context.collect_saturation and not self._weight_cast_counted
        if self._weight_fp8 is None or self._weight_fp8[0] != key or uncounted:
            self._refuse_recast_in_capture()
            cached = self._weight_fp8
            # a graphed layer's graphs read the cast where they were captured: cast into it again
            reusable = (
                cached[1]
                if self.keep_weight_cast_addresses
                and cached is not None
                and cached[0][-1] == context.recipe
                else None
            )
            self._weight_fp8 = (key, fine_grained.cast_weight(self, context, reusable))
            self._weight_cast_counted = context.collect_saturation
        return self._weight_fp8[1]

    def _fp8_primary_cast(self, context: Fp8Context, fp8_dtype) -> Fp8Tensor:
        """The FP8 primary weight, for a forward under `context`: its scale is delayed scaling's,
        which the optimizer casts with, and whose history this forward extends."""
        cast = self._weight_fp8[1]
        if not context.recipe.delayed or cast.data.dtype != fp8_dtype:
            raise ValueError(
                f"{self}: its weight is held in {cast.data.dtype} with a delayed scale (FP8 primary "
                f"weights), which a forward in {fp8_dtype} under "
                f"{'delayed' if context.recipe.delayed else 'current'} scaling cannot use: train "
                "it under delayed scaling, or keep high-precision weights"
            )
        state = self.fp8_scaling["weight"]
        if context.collect_saturation and self.weight_counts_pending:  # what its cast counted
            state.cast_counts.add_(self._weight_cast_counts)
            self.weight_counts_pending = False
        record_reuse(state, fp8_dtype, context)
        return cast

    def weight_cast_target(self) -> WeightCast | None:
        """Where an optimizer that writes this layer's weight may write, in the same pass, the
        FP8 cast the next forward would make of it (megafp8.training.optimizer.adamw_kernel): the
        cached cast's buffers and the weight's scale and amax accumulator. None when that cast is not
        known ahead: no forward has cast the weight yet, or not under delayed scaling with a
        scale history (current scaling fits the scale to the new weight), or the cast's buffers
        are not kept from step to step (`keep_weight_cast_addresses`). After writing it, call
        `weight_cast_written`. An FP8 primary weight always has one: it is the weight."""
        if self.fp8_primary_weight:
            cast = self._weight_fp8[1]
            state = self.fp8_scaling["weight"]
            return WeightCast(
                cast.data,
                cast.data_t,
                state.scale,
                state.amax,
                cast.scale_inv,
                self._weight_cast_counts,
            )
        if self._weight_fp8 is None or not self.keep_weight_cast_addresses:
            return None
        (*_, recipe), q = self._weight_fp8
        state = self.fp8_scaling["weight"]
        if not recipe.delayed or state.update_count == 0 or q.data is None or q.data_t is None:
            return None
        return WeightCast(q.data, q.data_t, state.scale, state.amax, q.scale_inv)

    def weight_cast_written(self) -> None:
        """The optimizer has just written the weight and, where `weight_cast_target` said, its
        cast: the next forward uses that cast, as if it had made it."""
        if self.fp8_primary_weight:
            self.weight_counts_pending = True
            return
        (*_, fp8_dtype, recipe), q = self._weight_fp8
        self._weight_fp8 = (self._weight_cast_key(fp8_dtype, recipe), q)
        self._weight_cast_by_optimizer = True

    def _reusable_weight_cast(self, fp8_dtype) -> Fp8Tensor | None:
        """The cached cast's buffers, to cast into again, when the layer is CUDA-graphed (its
        graphs captured their addresses); eager layers take fresh ones, so a backward still
        to run keeps the cast its forward used."""
        cached = self._weight_fp8[1] if self._weight_fp8 is not None else None
        if (
            not self.keep_weight_cast_addresses
            or not isinstance(cached, Fp8Tensor)
            or cached.data.dtype != fp8_dtype
        ):
            return None
        return cached


@dataclass(frozen=True)
class _Collectives:
    """The sequence-parallel collective around one linear (the gather and scatter groups of
    Fp8Linear.fp8_linear and high_precision_linear); groups of one rank count as none."""

    gather: object = None
    scatter: object = None
    overlap: bool = False

    def __post_init__(self):
        for name in ("gather", "scatter"):
            if collectives.group_size(getattr(self, name)) <= 1:
                object.__setattr__(self, name, None)

    def check_bias(self, bias) -> None:
        """A reduce-scattered output is a partial sum until the scatter: its bias comes after,
        or, overlapped, in the GEMM of this rank's own block of the sum alone."""
        if self.scatter is not None and not self.overlap and bias is not None:
            raise ValueError(
                "a linear whose output is reduce-scattered after its GEMM adds its bias after the "
                "sum, not in the GEMM"
            )


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        norm_weight,
        norm_bias,
        module: Fp8Linear,
        context: Fp8Context,
        comm: _Collectives,
        fusion: Fusion,
    ):
        recipe = context.recipe
        fprop_hp, dgrad_hp, wgrad_hp = recipe.override_linear_precision
        fmt = recipe.fp8_format
        x2 = x.reshape(-1, x.shape[-1])
        wgrad_fp8 = weight.requires_grad and not wgrad_hp
        dgrad_fp8 = x.requires_grad and not dgrad_hp
        gather, scatter = comm.gather, comm.scatter
        comm.check_bias(bias)
        fp8_gather = gather is not None and not fprop_hp
        if gather is not None and not fp8_gather:
            x2 = collectives.all_gather(x2, gather)  # a high-precision forward GEMM

        # What the cast reads: the input itself, or the norm or activation of it (Fusion).
        source = x2
        if fusion.norm is not None:
            source = NormSource(x2, norm_weight, norm_bias, fusion.norm.eps, fusion.norm.rms)
        elif fusion.activation is not None:
            source = ActivationSource(x2, fusion.activation)
        qx = None
        if not fprop_hp or wgrad_fp8:
            qx = cast(
                source,
                module.fp8_scaling["input"],
                fmt.forward_dtype,
                context,
                context.forward_pass,
                gather_group=gather if fp8_gather else None,
                rowwise=not fprop_hp,
                columnwise=wgrad_fp8,
            )
        qw = (
            module._quantized_weight(context, fmt.forward_dtype)
            if not fprop_hp or dgrad_fp8
            else None
        )

        # an FP8 primary weight's values, for a GEMM in high precision
        hp_weight = (
            module.dequantized_weight()
            if module.fp8_primary_weight and (fprop_hp or not dgrad_fp8)
            else weight
        )
        if fprop_hp:
            y = F.linear(x2, hp_weight.to(x2.dtype))
            if scatter is not None:
                y = collectives.reduce_scatter(y, scatter)
                scatter = None  # done
            if bias is not None:
                y = y + bias.to(x2.dtype)
        else:

            def gemm(rows, out=None, bias=bias):
                return fp8_gemm(
                    rows,
                    qw.data,
                    qx.scale_inv,
                    qw.scale_inv,
                    x2.dtype,
                    bias=bias,
                    fast_accum=True,
                    out=out,
                )

            if fp8_gather and comm.overlap:
                y = x2.new_empty((collectives.group_size(gather) * x2.shape[0], weight.shape[0]))
                collective_gemm.gathered_gemm(qx.data, gather, gemm, y, keep_gathered=False)
            elif scatter is not None and comm.overlap:
                y = collective_gemm.gemm_reduce_scatter(
                    qx.data,
                    scatter,
                    functools.partial(gemm, bias=None),
                    weight.shape[0],
                    x2.dtype,
                    own_gemm=gemm,
                )
                scatter = None  # done
            else:
                y = gemm(collectives.all_gather(qx.data, gather) if fp8_gather else qx.data)
        if scatter is not None:
            y = collectives.reduce_scatter(y, scatter)

        # For backward: the input transposed in FP8 (this rank's shard of it, gathered again in
        # backward, when the forward gathered in FP8; as it is, for a high-precision wgrad), and
        # the weight transposed in FP8 (or the parameter itself, for a high-precision dgrad); a
        # fused neighbour's input and statistics, for its backward.
        x_saved, x_scale_inv = (qx.data_t, qx.scale_inv) if wgrad_fp8 else (x2, None)
        w_saved, w_scale_inv = (qw.data_t, qw.scale_inv) if dgrad_fp8 else (hp_weight, None)
        neighbour = ()
        if fusion.norm is not None:
            neighbour = (x2, norm_weight, source.mean, source.rstd)
        elif fusion.activation is not None:
            neighbour = (x2,)
        ctx.save_for_backward(x_saved, x_scale_inv, w_saved, w_scale_inv, *neighbour)
        ctx.module, ctx.context, ctx.weight_dtype = module, context, module.high_precision_dtype
        ctx.fuse_wgrad_accumulation = module.fuse_wgrad_accumulation
        ctx.fp8 = (dgrad_fp8, wgrad_fp8)
        ctx.has_bias = bias is not None
        ctx.comm, ctx.fp8_gather = comm, fp8_gather
        ctx.fusion, ctx.input_shape = fusion, x.shape
        return y.view(-1, *x.shape[1:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x_saved, x_scale_inv, w_saved, w_scale_inv, *neighbour = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dgrad_fp8, wgrad_fp8 = ctx.fp8
        dgrad_fp8 &= need_dx
        wgrad_fp8 &= need_dw
        context, fusion, comm = ctx.context, ctx.fusion, ctx.comm
        need_dx |= any(ctx.needs_input_grad[3:5])  # the norm's parameters need the dgrad too
        # The output was reduce-scattered: its gradient is gathered, in high precision before the
        # cast, or with overlap in FP8 (each rank casts its shard) beside the dgrad GEMM.
        gather_dy_fp8 = (
            comm.scatter is not None
            and comm.overlap
            and dgrad_fp8
            and (wgrad_fp8 or not need_dw)
            and fusion.grad_from is None
        )
        # A bias in the GEMM of this rank's block of a reduce-scattered output: its gradient is
        # this rank's rows' sum (summed over the group with the other sequence-parallel ones).
        bias_grad = None
        if comm.scatter is not None and not gather_dy_fp8:
            if need_db and ctx.has_bias:
                bias_grad = dy.reshape(-1, dy.shape[-1]).sum(0, dtype=torch.float32)
            dy = collectives.all_gather(dy.contiguous(), comm.scatter)
        # With overlap, the forward's FP8 input shard is gathered again for wgrad beside the dgrad GEMM.
        x_gathered = None
        if wgrad_fp8 and ctx.fp8_gather and comm.overlap:
            x_gathered = collective_gemm.all_gather_columns(x_saved, comm.gather)

        # The output gradient in FP8: handed over by the activation after this layer, or cast here.
        qdy = fusion.grad_from.take(dy) if fusion.grad_from is not None else None
        dy2 = dy.reshape(-1, dy.shape[-1]) if qdy is None else None
        if qdy is None and (dgrad_fp8 or wgrad_fp8):
            qdy = cast(
                dy2,
                ctx.module.fp8_scaling["grad_output"],
                context.recipe.fp8_format.backward_dtype,
                context,
                backward_pass(context.amax_reduction_group),
                rowwise=dgrad_fp8,
                columnwise=wgrad_fp8,
                col_sum=need_db and ctx.has_bias,
                gather_group=comm.scatter if gather_dy_fp8 else None,
            )

        dx = dw = db = dnorm_weight = dnorm_bias = None
        dy_t = qdy.data_t if wgrad_fp8 else None  # gathered below when dy is gathered in FP8

        def dgrad(rows, out=None):
            if dgrad_fp8:
                return fp8_gemm(rows, w_saved, qdy.scale_inv, w_scale_inv, dy.dtype, out=out)
            return torch.mm(rows, w_saved.to(dy.dtype), out=out)

        if gather_dy_fp8:  # (implies dgrad_fp8)
            # the transposed blocks for wgrad are gathered beside the dgrad GEMM of the others' rows
            dx = dy2.new_empty(
                (collectives.group_size(comm.scatter) * dy2.shape[0], w_saved.shape[0])
            )
            if wgrad_fp8:
                dy_t = collective_gemm.gathered_gemm_and_columns(
                    qdy.data, qdy.data_t, comm.scatter, dgrad, dx
                ).wait()
            else:
                collective_gemm.gathered_gemm(
                    qdy.data, comm.scatter, dgrad, dx, keep_gathered=False
                )
        elif need_dx:
            rows = qdy.data if dgrad_fp8 else dy2
            if comm.gather is not None and comm.overlap:  # the reduce-scatter beside the wgrad GEMM
                dx = collective_gemm.gemm_then_reduce_scatter(
                    rows, comm.gather, dgrad, ctx.input_shape[-1], dy.dtype
                )
            else:
                dx = dgrad(rows)
                if comm.gather is not None:
                    dx = collectives.reduce_scatter(dx, comm.gather)
        if need_dw:
            if wgrad_fp8:
                if ctx.fp8_gather:
                    x_saved = (
                        x_gathered.wait()
                        if x_gathered is not None
                        else collectives.all_gather_columns(x_saved, comm.gather)
                    )
                main_grad = (
                    claim_empty_main_grad(ctx.module.weight)
                    if ctx.fuse_wgrad_accumulation
                    else None
                )
                if main_grad is None:
                    dw = fp8_gemm(dy_t, x_saved, qdy.scale_inv, x_scale_inv, ctx.weight_dtype)
                else:  # dw stays None: the gradient is in main_grad
                    fp8_gemm(
                        dy_t, x_saved, qdy.scale_inv, x_scale_inv, main_grad.dtype, out=main_grad
                    )
            else:
                if ctx.fp8_gather:  # the forward gathered its input in FP8: gather it again here
                    x_saved = collectives.all_gather(x_saved, comm.gather)
                dw = (dy2.t() @ x_saved.to(dy.dtype)).to(ctx.weight_dtype)
            if dw is not None and ctx.fuse_wgrad_accumulation and ctx.module.fp8_primary_weight:
                _hand_to_main_grad(ctx.module.weight, dw)  # autograd would cast it to FP8
                dw = None
        if need_db and ctx.has_bias:
            if bias_grad is not None:
                db = bias_grad
            elif qdy is not None:
                db = qdy.col_sum
            else:
                db = dy2.sum(0, dtype=torch.float32)
            db = _bias_grad(ctx.module.bias, db, ctx.fuse_wgrad_accumulation)
        if need_dx:
            if comm.gather is not None and comm.overlap:
                dx = dx.wait()
            if fusion.norm is not None:
                if fusion.input_grad_group is not None:
                    dx = collectives.all_reduce(dx, fusion.input_grad_group)
                x_in, norm_weight, mean, rstd = neighbour
                dx, dnorm_weight, dnorm_bias = norm_kernels.norm_backward(
                    dx,
                    x_in,
                    norm_weight,
                    mean,
                    rstd,
                    fusion.norm.rms,
                    need_weight_grad=ctx.needs_input_grad[3],
                    need_bias_grad=ctx.needs_input_grad[4],
                )
            elif fusion.activation is not None:
                dx = fusion.activation_backward(dx, neighbour[0])
            dx = dx.view(ctx.input_shape[:-1] + dx.shape[-1:])
        return dx, dw, db, dnorm_weight, dnorm_bias, None, None, None, None


def hand_over_gradient(
    source, producer: Fp8Linear, handoff: GradHandoff, like: torch.Tensor
) -> torch.Tensor:
    """Cast `source` (megafp8.fp8.fused: the output gradient of `producer`, not computed yet) in
    FP8 for `producer`'s backward, under the fp8_autocast of its forward, in the kernel that
    computes it, and hand it over (`handoff.ready`: `producer` takes it). Returns the stand-in
    that autograd carries to `producer` in its place (the shape of `like`). Under fine-grained
    scaling, both of its casts and its column sums (fine_grained.OutputGradient)."""
    context = handoff.context
    if context.recipe.granularity != "tensor":
        gradient = fine_grained.cast_output_gradient(source, producer, context)
        return handoff.hand_over(gradient, like=like)
    weight, bias = producer.weight, producer.bias
    q = cast(
        source,
        producer.fp8_scaling["grad_output"],
        context.recipe.fp8_format.backward_dtype,
        context,
        backward_pass(context.amax_reduction_group),
        rowwise=True,
        columnwise=weight.requires_grad,
        col_sum=bias is not None and bias.requires_grad,
    )
    return handoff.hand_over(q, like=like)


def _hand_to_main_grad(weight, grad: torch.Tensor) -> None:
    """Add an FP8 primary weight's high-precision gradient into its `main_grad`."""
    if getattr(weight, "main_grad", None) is None:
        raise RuntimeError(
            "an FP8 primary weight (Fp8Linear.make_weight_fp8) takes its gradient in main_grad: "
            "build a GradientBuffer (megafp8.parallel.data_parallel) over the model's parameters"
        )
    accumulate_into_main_grad(weight, grad)


class _DequantizedFp8Weight(torch.autograd.Function):
    """An FP8 primary weight in high precision, for a GEMM that does not run in FP8; its gradient
    goes to `main_grad` (with gradient-accumulation fusion off, to autograd, which casts it to
    the parameter's FP8 dtype: only CUDA graphs' warm-up, which discards it, turns it off)."""

    @staticmethod
    def forward(ctx, weight, module: Fp8Linear):
        ctx.module = module
        return module.dequantized_weight()

    @staticmethod
    def backward(ctx, grad):
        if not ctx.module.fuse_wgrad_accumulation:
            return grad, None
        _hand_to_main_grad(ctx.module.weight, grad)
        return None, None


# addmm with bf16/fp16 factors and an fp32 output (torch >= 2.8, CUDA only).
_ADDMM_INTO_FP32 = hasattr(torch.ops.aten.addmm, "dtype_out")


class _LinearIntoMainGrad(torch.autograd.Function):
    """F.linear whose weight and bias gradients are added into their `main_grad` by the
    GEMM itself (beta = 1; beta = 0 overwrites an empty one) and the bias reduction, instead of
    returned in bf16."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.weight, ctx.bias = weight, bias  # parameters (leaves): no reference cycle
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = (dy2 @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        _, db = _weight_and_bias_grads(
            ctx.weight,
            ctx.bias,
            dy2,
            x2,
            into_main_grad=True,
            need_db=ctx.has_bias and ctx.needs_input_grad[2],
        )
        return dx, None, db


def _weight_and_bias_grads(
    weight, bias, dy2, x2, into_main_grad: bool, need_db: bool, bias_rows=None
):
    """The weight and bias gradients of `x W^T + b` (2-D `dy2` and `x2`; the bias's from the rows
    of `bias_rows`, default `dy2`): added into `main_grad` by the GEMM itself (`into_main_grad`:
    beta = 1, or beta = 0 over an empty one) and by the bias reduction where the bias has one,
    those returned as None."""
    dw = db = None
    if into_main_grad:
        beta = 0 if weight.main_grad_empty else 1  # beta = 0 reads nothing of the old values
        if weight.main_grad.dtype == dy2.dtype:  # a bf16 buffer
            torch.addmm(weight.main_grad, dy2.t(), x2, beta=beta, out=weight.main_grad)
        else:
            torch.ops.aten.addmm.dtype_out(
                weight.main_grad, dy2.t(), x2, torch.float32, beta=beta, out=weight.main_grad
            )
        weight.main_grad_empty = False
    elif weight.requires_grad:
        dw = dy2.t() @ x2
    if need_db:
        db = (dy2 if bias_rows is None else bias_rows).sum(0, dtype=torch.float32)
        db = _bias_grad(bias, db, into_main_grad)
    return dw, db


def _bias_grad(bias, db: torch.Tensor, into_main_grad: bool) -> torch.Tensor | None:
    """A bias's gradient `db` (an fp32 column sum) added into its `main_grad` where it has one and
    `into_main_grad` (on every micro-batch, never rounded to bf16), then None; else autograd's, in
    the bias's dtype (the graphs' warm-up turns the fusion off and must leave main_grad alone)."""
    if into_main_grad and getattr(bias, "main_grad", None) is not None:
        accumulate_into_main_grad(bias, db)
        return None
    return db.to(bias.dtype)


class _HighPrecisionLinearBesideCollective(torch.autograd.Function):
    """`x W^T + b` in high precision with its sequence-parallel all-gather (of `x`, over
    `comm.gather`) or reduce-scatter (of the output, over `comm.scatter`) in blocks beside the
    GEMMs: forward as megafp8.collective_gemm does it; backward the input gradient's
    reduce-scatter beside the wgrad GEMM, or the output gradient's gather beside the dgrad GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm: _Collectives, into_main_grad: bool):
        x2 = x.reshape(-1, x.shape[-1])

        def gemm(rows, out):
            if bias is None:
                return torch.mm(rows, weight.t(), out=out)
            return torch.addmm(bias, rows, weight.t(), out=out)

        if comm.gather is not None:
            y = x2.new_empty((collectives.group_size(comm.gather) * x2.shape[0], weight.shape[0]))
            # kept for wgrad
            x2 = collective_gemm.gathered_gemm(x2.contiguous(), comm.gather, gemm, y)
        else:  # the bias in the GEMM of this rank's own block
            y = collective_gemm.gemm_reduce_scatter(
                x2,
                comm.scatter,
                lambda rows, out: torch.mm(rows, weight.t(), out=out),
                weight.shape[0],
                x2.dtype,
                own_gemm=gemm,
            )
        ctx.save_for_backward(x2, weight)
        ctx.weight, ctx.bias = weight, bias  # parameters (leaves): no reference cycle
        ctx.comm, ctx.into_main_grad, ctx.input_shape = comm, into_main_grad, x.shape
        return y.view(-1, *x.shape[1:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        comm = ctx.comm
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        rows_of_bias = dy2  # this rank's rows: a reduce-scattered output's bias is in its own block
        # the output gradient gathered beside the dgrad of this rank's rows
        if comm.scatter is not None:
            dx = dy2.new_empty((x2.shape[0], weight.shape[1]))
            dy2 = collective_gemm.gathered_gemm(
                dy2, comm.scatter, lambda rows, out: torch.mm(rows, weight, out=out), dx
            )
        else:  # the input gradient's reduce-scatter beside the wgrad GEMM
            dx = collective_gemm.gemm_then_reduce_scatter(
                dy2,
                comm.gather,
                lambda rows, out: torch.mm(rows, weight, out=out),
                weight.shape[1],
                dy2.dtype,
            )
        dw, db = _weight_and_bias_grads(
            ctx.weight,
            ctx.bias,
            dy2,
            x2,
            ctx.into_main_grad,
            need_db=ctx.bias is not None and ctx.needs_input_grad[2],
            bias_rows=rows_of_bias,
        )
        if comm.gather is not None:
            dx = dx.wait()
        return dx.view(ctx.input_shape[:-1] + dx.shape[-1:]), dw, db, None, None
