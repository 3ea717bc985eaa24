"""Per-tensor FP8 scaling: the state of each tensor role, the choice of scale for each cast
(`cast`, by the recipe), and the batched end-of-pass update of delayed scaling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from megafp8 import collectives, triton_support

from . import triton_kernels
from .formats import fp8_max
from .quantize import quantize
from .recipe import Recipe
from .tensor import Fp8Tensor, absmax, scale_from_amax

if TYPE_CHECKING:
    from .autocast import Fp8Context

ROLES = ("input", "weight", "grad_output")


class ScalingState(nn.Module):
    """The scale and amax history of one tensor role of one layer.

    `scale` multiplies the high-precision tensor before the cast; `amax_history[0]` is the
    newest amax. The history is sized by the recipe at first use (and resized, keeping the
    newest entries, if a later recipe asks for another length). Both are buffers, so they
    follow the module's device and live in its state_dict with the update count.
    `amax` accumulates what the casts of the current pass observe (the quantize kernel maxes
    into it, so no amax tensor is allocated per cast); the end-of-pass update consumes it.
    `cast_counts` counts (elements saturated, elements cast, nonzero elements flushed to zero)
    over the casts made under `fp8_autocast(collect_saturation=True)`, until `take_cast_counts`
    reads and resets it.
    """

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("amax_history", torch.zeros(0))
        self.register_buffer("amax", torch.zeros(()), persistent=False)
        self.register_buffer("cast_counts", torch.zeros(3, dtype=torch.int64), persistent=False)
        self.update_count = 0  # host-side, so `interval` needs no device sync

    @torch.no_grad()
    def reseed(self) -> None:
        """Forget the scale and its history, as a fresh state: the next cast fits its scale to
        the tensor (delayed scaling with no history yet)."""
        self.scale.fill_(1.0)
        self.amax_history.zero_()
        self.amax.zero_()
        self.update_count = 0

    def fit_history(self, length: int) -> None:
        history = self.amax_history
        if history.numel() != length:
            resized = history.new_zeros(length)
            keep = min(length, history.numel())
            resized[:keep] = history[:keep]
            self.amax_history = resized

    def _apply(self, fn, recurse=True):
        # module.to(torch.bfloat16) casts floating buffers too; scales and amaxes stay fp32.
        super()._apply(fn, recurse)
        self.scale = self.scale.float()
        self.amax_history = self.amax_history.float()
        self.amax = self.amax.float()
        return self

    def get_extra_state(self):
        return {"update_count": self.update_count}

    def set_extra_state(self, state):
        self.update_count = int(state["update_count"])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A checkpoint may hold another history length than this (possibly unused) module.
        saved = state_dict.get(prefix + "amax_history")
        if saved is not None:
            self.amax_history = self.amax_history.new_zeros(saved.shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"history_len={self.amax_history.numel()}, updates={self.update_count}"


def take_cast_counts(states: list[ScalingState]) -> list[tuple[int, int, int]]:
    """(elements saturated, elements cast, nonzero elements flushed to zero) of each state since
    the last call, then reset to 0. One device-to-host copy for all of them."""
    if not states:
        return []
    counts = torch.stack([s.cast_counts for s in states]).tolist()
    torch._foreach_zero_([s.cast_counts for s in states])
    return [tuple(c) for c in counts]


def scaling_states(device=None) -> nn.ModuleDict:
    """A fresh ScalingState for each role of a linear layer."""
    return nn.ModuleDict({role: ScalingState() for role in ROLES}).to(device=device)


def cast(
    tensor,
    state: ScalingState,
    fp8_dtype,
    context: Fp8Context,
    amax_pass: AmaxPass,
    *,
    gather_group=None,
    keep_amax: bool = False,
    **layout,
) -> Fp8Tensor:
    """Cast the 2-D `tensor` to FP8 with the scale `context.recipe` chooses for the tensor role
    whose state is `state`; `layout` is quantize's rowwise/columnwise/col_sum. `tensor` may be
    a source of megafp8.fp8.fused (a norm or activation not computed yet): it is quantized in
    its producer's kernel when the scale is known before the cast, else materialized first.

    Delayed scaling casts with the scale of the history before it and records the amax it
    observes in `amax_pass` (`keep_amax`: the accumulator describes a cached cast, kept across
    passes); current scaling fits the scale to the tensor itself. Shards that will be gathered
    over `gather_group` after the cast must share one scale: a fitted one is fitted to the amax
    of all of them. Recomputing a forward (`context.replay_scales`) casts exactly as it did.
    """
    recipe = context.recipe
    if context.replay_scales is not None and id(state) in context.replay_scales:
        return _quantize(
            tensor, fp8_dtype, context.replay_scales[id(state)], margin=recipe.margin, **layout
        )
    agree_over = gather_group if collectives.group_size(gather_group) > 1 else None
    scale = None  # fitted to the tensor
    if recipe.delayed:
        state.fit_history(recipe.amax_history_len)
        if state.update_count > 0:
            if agree_over is not None:
                _check_scales_agree(context, agree_over)
            scale = state.scale
        elif tensor.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "a CUDA graph capture met a delayed-scaling state with no history yet: "
                "capture after at least one eager training step"
            )
        elif recipe.reduce_amax and collectives.group_size(context.amax_reduction_group) > 1:
            # With an empty history there is no earlier scale: fit this first cast to the
            # tensor itself (Transformer Engine casts with 1.0, which underflows small
            # gradients), agreed over every rank that shares the layer's scales.
            agree_over = context.amax_reduction_group
    if scale is None and not isinstance(tensor, torch.Tensor):
        tensor = tensor.materialize()  # the scale needs the tensor's own amax first
    if scale is None and agree_over is not None:
        amax = collectives.max_over(absmax(tensor), agree_over)
        scale = scale_from_amax(amax, fp8_dtype, recipe.margin)
        state.scale.copy_(scale)
    q = _quantize(
        tensor,
        fp8_dtype,
        scale,
        margin=recipe.margin,
        scale_out=state.scale if scale is None else None,
        amax_out=state.amax if recipe.delayed else None,
        saturation_out=state.cast_counts if context.collect_saturation else None,
        **layout,
    )
    if recipe.delayed:
        amax_pass.record(state, fp8_max(fp8_dtype), recipe, keep_amax)
    return q


def _quantize(tensor, fp8_dtype, scale, *, margin: int, scale_out=None, **options) -> Fp8Tensor:
    if isinstance(tensor, torch.Tensor):
        return quantize(tensor, fp8_dtype, scale, margin=margin, scale_out=scale_out, **options)
    return tensor.quantize(fp8_dtype, scale, **options)  # a fused source: the scale is given


def record_reuse(state: ScalingState, fp8_dtype, context: Fp8Context) -> None:
    """A cached cast (a weight's, within one optimizer step) is used again in this forward:
    delayed scaling records its amax once more, so all of a layer's histories roll in step."""
    if context.recipe.delayed:
        state.fit_history(context.recipe.amax_history_len)
        context.forward_pass.record(state, fp8_max(fp8_dtype), context.recipe, keep_amax=True)


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
    return set(dist.get_process_group_ranks(group))


@dataclass
class _Observation:
    state: ScalingState
    fp8_max: float
    recipe: Recipe
    keep_amax: bool  # the weight's accumulator describes its cached cast: keep it across passes


@dataclass
class AmaxPass:
    """The scaling states whose casts ran in one forward or one backward pass.

    `flush` MAX-reduces every observed amax of the pass in one collective over `group`,
    then rolls the histories and recomputes the scales (one fused kernel on CUDA), whatever
    the number of layers. A layer observed twice in a pass (shared weights) keeps the larger
    amax, since both casts max into the same accumulator.
    """

    group: dist.ProcessGroup | None = None
    observations: dict = field(default_factory=dict)

    def record(self, state: ScalingState, fp8_max: float, recipe, keep_amax: bool = False) -> None:
        self.observations[id(state)] = _Observation(state, fp8_max, recipe, keep_amax)

    def flush(self) -> None:
        observations = list(self.observations.values())
        self.observations = {}
        if not observations:
            return
        reduced = [o.state.amax for o in observations if o.recipe.reduce_amax]
        if reduced and collectives.group_size(self.group) > 1:
            # one collective, NaN seen as inf
            amaxes = collectives.max_over(torch.stack(reduced), self.group)
            torch._foreach_copy_(reduced, list(amaxes.unbind(0)))

        batches: dict = {}
        for o in observations:
            recompute = o.state.update_count % o.recipe.interval == 0
            key = (
                o.fp8_max,
                o.recipe.margin,
                o.recipe.amax_compute_algo,
                o.recipe.amax_history_len,
                recompute,
            )
            batches.setdefault(key, []).append(o)
            o.state.update_count += 1
        for (fmax, margin, algo, _, recompute), batch in batches.items():
            states = [o.state for o in batch]
            resets = [not o.keep_amax for o in batch]
            _update_delayed(states, resets, fmax, margin, algo, recompute)


def _update_delayed(
    states, resets, fp8_max: float, margin: int, algo: str, recompute: bool
) -> None:
    """Roll each history, insert its `amax`, and (if `recompute`) refresh each scale; then
    zero the accumulators whose `resets` flag is set, ready for the next pass.

    A non-finite amax enters the history as 0 rather than itself: under "max" a stored inf
    would freeze the scale for a whole history length (Transformer Engine's behaviour); here
    that one pass keeps the old scale and the next finite amax counts at once.
    On CUDA one fused kernel does this for all states; this torch version is its reference.
    """
    if states[0].amax.is_cuda and triton_support.available():
        return triton_kernels.update_delayed(states, resets, fp8_max, margin, algo, recompute)
    _update_delayed_torch(states, resets, fp8_max, margin, algo, recompute)


def _update_delayed_torch(states, resets, fp8_max, margin, algo, recompute) -> None:
    amaxes = torch.stack([s.amax for s in states])
    finite = torch.isfinite(amaxes)
    newest = torch.where(finite, amaxes, torch.zeros_like(amaxes))
    histories = torch.stack([s.amax_history for s in states])
    histories = torch.cat([newest[:, None], histories[:, :-1]], dim=1)
    torch._foreach_copy_([s.amax_history for s in states], list(histories.unbind(0)))
    consumed = [s.amax for s, reset in zip(states, resets) if reset]
    if consumed:
        torch._foreach_zero_(consumed)
    if not recompute:
        return
    amax = histories.amax(dim=1) if algo == "max" else histories[:, 0]
    old = torch.stack([s.scale for s in states])
    candidate = (torch.full_like(amax, fp8_max) / amax) / (2.0**margin)  # one rounding, as on CUDA
    usable = finite & (amax > 0) & torch.isfinite(candidate)
    scales = torch.where(usable, candidate, old)
    torch._foreach_copy_([s.scale for s in states], list(scales.unbind(0)))
