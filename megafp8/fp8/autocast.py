"""`fp8_autocast`: the one switch for FP8, and the end-of-pass hooks of delayed scaling.

Forward amaxes are applied when the context exits; backward amaxes when the autograd pass
that produced them ends (an engine callback). Either way, one collective per pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .recipe import DelayedScaling, Recipe
from .scaling import AmaxPass


@dataclass(frozen=True)
class Fp8Context:
    """What an Fp8Linear needs to know about the fp8_autocast it runs under. `replay_scales`
    (id of a ScalingState -> the scale it cast with) marks the recomputation of a forward;
    `collect_saturation` makes each cast count its saturated and flushed elements (forward and
    backward)."""

    recipe: Recipe
    amax_reduction_group: dist.ProcessGroup | None
    forward_pass: AmaxPass
    replay_scales: dict | None = None
    collect_saturation: bool = False


_local = threading.local()


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current_fp8_context() -> Fp8Context | None:
    """The innermost enabled fp8_autocast, or None when FP8 is off here."""
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    recipe: Recipe | None = None,
    amax_reduction_group: dist.ProcessGroup | None = None,
    collect_saturation: bool = False,
):
    """Run every Fp8Linear inside in FP8 with `recipe` (default: DelayedScaling()).

    `amax_reduction_group` holds every rank with a shard or replica of the same layers
    (tensor x data parallel); delayed-scaling amaxes are MAX-reduced over it once per pass, so
    all of them keep identical scales. Nested contexts override; `enabled=False` turns FP8 off.
    The forward amaxes are applied on a normal exit only: after an exception no collective
    runs, since the other ranks may never reach it.
    `collect_saturation=True` also counts, in each ScalingState's `cast_counts`, the elements
    every cast saturates and the nonzero ones it flushes to zero, in this forward and in the
    backward built from it: for the micro-batches whose statistics are logged, in the casting
    kernels themselves. Numerics are unchanged.
    """
    if recipe is None:
        recipe = DelayedScaling()
    elif not isinstance(recipe, Recipe):
        raise TypeError(
            f"fp8_autocast: recipe must be a Recipe (DelayedScaling or CurrentScaling), got {type(recipe).__name__}"
        )
    context = (
        Fp8Context(
            recipe,
            amax_reduction_group,
            AmaxPass(amax_reduction_group),
            collect_saturation=collect_saturation,
        )
        if enabled
        else None
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
def fp8_recompute(context: Fp8Context | None, scales: dict):
    """Recompute a forward that ran under `context` (None: without FP8) exactly as it ran: the
    same recipe and group, each cast with the scale it used then (`scales`, filled after that
    forward), and no amax recorded twice. For activation checkpointing."""
    if context is None:
        with fp8_autocast(enabled=False):
            yield
        return
    stack = _stack()
    stack.append(
        Fp8Context(context.recipe, context.amax_reduction_group, AmaxPass(), replay_scales=scales)
    )
    try:
        yield
    finally:
        stack.pop()


# Backward amaxes, per autograd graph task and reduction group, applied when that task ends.
_backward_passes: dict = {}
_backward_lock = threading.Lock()


def backward_pass(group: dist.ProcessGroup | None) -> AmaxPass:
    """The AmaxPass collecting gradient amaxes of the autograd pass now running.

    Must be called from within a backward. Its first call in a pass queues the flush that
    runs once the engine has finished the whole pass.
    """
    if _recording is not None:
        return _recording.backward_pass(group)
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


class AmaxRecording:
    """The amax observations of forwards and backwards run under `record_amaxes`: what a CUDA
    graph capture saw, to be recorded again at each replay (`take`)."""

    def __init__(self, group):
        self.forward = AmaxPass(group)
        self.backward: dict = {}  # id(group) -> (group, AmaxPass)

    def backward_pass(self, group) -> AmaxPass:
        return self.backward.setdefault(id(group), (group, AmaxPass(group)))[1]

    def take(self) -> tuple[list, list]:
        """(forward observations, [(group, backward observations)]) since the last call."""
        forward = list(self.forward.observations.values())
        backward = [
            (group, list(amax_pass.observations.values()))
            for group, amax_pass in self.backward.values()
        ]
        self.forward.observations, self.backward = {}, {}
        return forward, backward


_recording: AmaxRecording | None = None  # global: backward runs on autograd's own threads


@contextlib.contextmanager
def record_amaxes(context: Fp8Context | None):
    """Run forwards (under `context`, or without FP8 when None) and backwards whose amax
    observations go to the AmaxRecording yielded instead of the passes they belong to: nothing
    is flushed, no end-of-pass callback is queued. For capturing CUDA graphs, whose kernels do
    not run at capture; the replays record what the capture saw (`replay_amaxes`)."""
    global _recording
    if _recording is not None:
        raise RuntimeError("record_amaxes does not nest")
    recording = AmaxRecording(None if context is None else context.amax_reduction_group)
    stack = _stack()
    stack.append(
        None if context is None else dataclasses.replace(context, forward_pass=recording.forward)
    )
    _recording = recording
    try:
        yield recording
    finally:
        _recording = None
        stack.pop()


def replay_forward_amaxes(context: Fp8Context | None, observations: list) -> None:
    """Record, in `context`'s forward pass, what a captured forward observed (`AmaxRecording.take`)."""
    for o in observations:
        context.forward_pass.record(o.state, o.fp8_max, o.recipe, o.keep_amax)


def replay_backward_amaxes(groups_observations: list) -> None:
    """Record, in the backward pass now running, what a captured backward observed."""
    for group, observations in groups_observations:
        amax_pass = backward_pass(group)
        for o in observations:
            amax_pass.record(o.state, o.fp8_max, o.recipe, o.keep_amax)
