"""`fp8_autocast`: the one switch for FP8, and the end-of-pass hooks of delayed scaling.

Forward amaxes are applied when the context exits; backward amaxes when the autograd pass
that produced them ends (an engine callback). Either way, one collective per pass.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .recipe import DelayedScaling, Recipe
from .scaling import AmaxPass


@dataclass(frozen=True)
class Fp8Context:
    """What an Fp8Linear needs to know about the fp8_autocast it runs under. `replay_scales`
    (id of a ScalingState -> the scale it cast with) marks the recomputation of a forward;
    `collect_saturation` makes each cast count its saturated elements (forward and backward)."""

    recipe: Recipe
    amax_reduction_group: Optional[dist.ProcessGroup]
    forward_pass: AmaxPass
    replay_scales: Optional[dict] = None
    collect_saturation: bool = False


_local = threading.local()


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current_fp8_context() -> Optional[Fp8Context]:
    """The innermost enabled fp8_autocast, or None when FP8 is off here."""
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    recipe: Optional[Recipe] = None,
    amax_reduction_group: Optional[dist.ProcessGroup] = None,
    collect_saturation: bool = False,
):
    """Run every Fp8Linear inside in FP8 with `recipe` (default: DelayedScaling()).

    `amax_reduction_group` holds every rank with a shard or replica of the same layers
    (tensor x data parallel); delayed-scaling amaxes are MAX-reduced over it once per pass, so
    all of them keep identical scales. Nested contexts override; `enabled=False` turns FP8 off.
    The forward amaxes are applied on a normal exit only: after an exception no collective
    runs, since the other ranks may never reach it.
    `collect_saturation=True` also counts, in each ScalingState's `saturation`, the elements
    every cast saturates, in this forward and in the backward built from it: an extra read of
    each cast tensor, for the micro-batches whose statistics are logged. Numerics are unchanged.
    """
    if recipe is None:
        recipe = DelayedScaling()
    elif not isinstance(recipe, Recipe):
        raise TypeError(
            f"fp8_autocast: recipe must be a Recipe (DelayedScaling or CurrentScaling), got {type(recipe).__name__}"
        )
    context = (
        Fp8Context(recipe, amax_reduction_group, AmaxPass(amax_reduction_group), collect_saturation=collect_saturation)
        if enabled else None
    )
    stack = _stack()
    stack.append(context)
    try:
        yield
    finally:
        stack.pop()
    if context is not None:
        context.forward_pass.flush()


@contextlib.contextmanager
def fp8_recompute(context: Optional[Fp8Context], scales: dict):
    """Recompute a forward that ran under `context` (None: without FP8) exactly as it ran: the
    same recipe and group, each cast with the scale it used then (`scales`, filled after that
    forward), and no amax recorded twice. For activation checkpointing."""
    if context is None:
        with fp8_autocast(enabled=False):
            yield
        return
    stack = _stack()
    stack.append(Fp8Context(context.recipe, context.amax_reduction_group, AmaxPass(), replay_scales=scales))
    try:
        yield
    finally:
        stack.pop()


# Backward amaxes, per autograd graph task and reduction group, applied when that task ends.
_backward_passes: dict = {}
_backward_lock = threading.Lock()


def backward_pass(group: Optional[dist.ProcessGroup]) -> AmaxPass:
    """The AmaxPass collecting gradient amaxes of the autograd pass now running.

    Must be called from within a backward. Its first call in a pass queues the flush that
    runs once the engine has finished the whole pass.
    """
    task = torch._C._current_graph_task_id()
    with _backward_lock:
        passes = _backward_passes.get(task)
        if passes is None:
            passes = _backward_passes[task] = {}
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _flush_backward(task))
        amax_pass = passes.get(id(group))
        if amax_pass is None:
            amax_pass = passes[id(group)] = AmaxPass(group)
    return amax_pass


def _flush_backward(task: int) -> None:
    with _backward_lock:
        passes = _backward_passes.pop(task, {})
    for amax_pass in passes.values():
        amax_pass.flush()
