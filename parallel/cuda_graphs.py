"""CUDA graphs of a model's layers, FP8 included (Megatron-core's `--enable-cuda-graph`,
Transformer Engine's `make_graphed_callables(fp8_enabled=True)`).

Each unit (a transformer layer, or a group of layers recomputed together) has its forward and
its backward captured as two CUDA graphs and replayed, so a layer costs the host a few launches
instead of a few hundred. A set's graphs are captured in the order a training micro-batch runs
them (forwards first to last, backwards last to first) and replayed in that order.

Several micro-batches may be in flight (forward replayed, backward not yet), as a pipeline
schedule keeps them: each takes a slot, and each slot has its own sets and memory pool, so no
micro-batch's replay writes into another's activations. The sets of one slot share its pool,
as one slot's micro-batches run one after the other. A micro-batch's input gradient leaves
its slot as a copy: the slot's next forward may reuse that memory before an asynchronous reader
(a pipeline send) is done with it. Backwards come in the order of the
forwards (first in, first out: 1F1B and its interleaved form per model chunk, and gradient
accumulation, where one micro-batch is in flight at a time).

What the FP8 core does on the host around its kernels is done again at each replay, so a graphed
step equals an eager one bit for bit:
- the weight casts stay outside the graphs: before each forward replay every FP8 linear of the
  unit refreshes its cast if stale (the step's first micro-batch) into the buffers the graph
  reads, or records its reuse;
- the amaxes a capture saw are recorded again into the forward pass and the backward pass now
  running, so delayed scaling's end-of-pass update (eager, one collective per pass) covers them;
- parameter gradients are added into `param.main_grad` inside the backward graph (the fp32
  gradient buffer), then `grads_ready` is told, for the overlapped data-parallel reduction. A
  `main_grad` that holds no gradient yet (`main_grad_empty`: a step's first micro-batch) is
  overwritten instead (FP8 weight gradients straight from the GEMM: gradient-accumulation
  fusion in megafp8.fp8.linear; the protocol: megafp8.main_grad), so which `main_grad`s are empty when the backward runs is part
  of a graph set's signature: those of the forward's time with no other micro-batch in flight,
  none otherwise (the backwards in flight before it will have written them all).
Scales, amax accumulators and the gradient buffer live at fixed addresses, which the graphs read
and write in place. A capture is made at the first call with a new signature (FP8 recipe and
reduction group, saturation counting, which gradients are still empty, shapes); calls a graph
cannot serve return None. A capture synchronizes the device first (torch.cuda.graph), so under a
pipeline every transfer posted before it must be able to finish without the peer's next step
(tests/parallel/test_schedule_transfers.py checks the schedules' capturing step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from megafp8 import symmetric_memory
from megafp8.fp8 import Fp8Linear
from megafp8.fp8.autocast import (
    current_fp8_context,
    record_amaxes,
    replay_backward_amaxes,
    replay_forward_amaxes,
)
from megafp8.main_grad import accumulate_into_main_grad, prepare_add_into

# Only this thread may not make calls a capture forbids: the data loader's pin-memory thread keeps
# allocating pinned memory while a step captures, which the default ("global") would fail on.
_CAPTURE_MODE = "thread_local"


class _GraphSet:
    """The captured graphs of every unit for one signature, and their static tensors."""

    def __init__(self, count: int, slot: int):
        self.forward_graphs: list = [None] * count
        self.backward_graphs: list = [None] * count
        # static input of each unit (unit i+1's is unit i's output)
        self.inputs: list = [None] * count
        self.outputs: list = [None] * count
        self.extras: tuple = ()  # static extra arguments, shared by the units
        self.grad_outputs: list = [None] * count  # unit i's is unit i+1's grad_input
        self.grad_inputs: list = [None] * count
        self.forward_amaxes: list = [[] for _ in range(count)]
        self.backward_amaxes: list = [[] for _ in range(count)]
        self.written: list = [[] for _ in range(count)]  # the parameters each backward graph writes
        self.slot = slot  # of the micro-batches in flight (MicroBatchSlots)


class MicroBatchSlots:
    """The slots of the micro-batches in flight (forward replayed, backward not yet): each forward
    takes the first free slot, and its last backward frees it. Backwards come in the order of the
    forwards, so a forward that finds another micro-batch in flight will see its main_grads
    written before its own backward."""

    def __init__(self):
        self.busy: list = []

    def take(self) -> tuple:
        """(slot, whether another micro-batch is in flight)."""
        follows_another = any(self.busy)
        if all(self.busy):
            self.busy.append(False)
        slot = self.busy.index(False)
        self.busy[slot] = True
        return slot, follows_another

    def release(self, slot: int) -> None:
        self.busy[slot] = False


class LayerGraphs:
    """CUDA graphs of `units`: each a (function(x, *extras) -> y shaped like x, module holding
    its parameters and FP8 linears). `graphs(x, *extras)` runs every unit in turn, replaying
    their graphs, and returns the last output; or returns None without running anything when
    the call cannot be graphed (no grad, not on CUDA, an `x` that needs no gradient, a
    recomputed forward), so that the caller runs the units eagerly. Extra tensors given at the
    capture are kept and, when a later call passes other tensors, overwritten with their values;
    a None extra stays None.

    Parameters must carry `main_grad` (megafp8.parallel.data_parallel.GradientBuffer).
    `params_needed(params)` is called before a unit's forward reads its parameters (a
    distributed optimizer that gathers them beside the forward waits there).
    """

    def __init__(
        self,
        units: Sequence[tuple[Callable, nn.Module]],
        grads_ready: Callable[[list], None] | None = None,
        params_needed: Callable[[list], None] | None = None,
    ):
        self.functions = [function for function, _ in units]
        self.params = [[p for p in module.parameters() if p.requires_grad] for _, module in units]
        self.all_params = [p for params in self.params for p in params]
        self.linears = [
            [m for m in module.modules() if isinstance(m, Fp8Linear)] for _, module in units
        ]
        missing = [p for p in self.all_params if not hasattr(p, "main_grad")]
        if missing:
            raise ValueError(
                "LayerGraphs adds gradients into param.main_grad: build the GradientBuffer "
                f"before graphing ({len(missing)} parameters have none)"
            )
        self.grads_ready, self.params_needed = grads_ready, params_needed
        self.sets: dict = {}
        self.slots = MicroBatchSlots()
        self.pools: list = []  # one memory pool per slot
        self.stream = torch.cuda.Stream()
        for linear in (m for linears in self.linears for m in linears):
            linear.keep_weight_cast_addresses = True

    def __call__(self, x: torch.Tensor, *extras) -> torch.Tensor | None:
        context = current_fp8_context()
        if not (torch.is_grad_enabled() and x.is_cuda and x.requires_grad) or (
            context is not None and context.replay_scales is not None
        ):
            return None
        slot, follows_another = self.slots.take()  # following another, its backward accumulates
        if slot == len(self.pools):
            self.pools.append(torch.cuda.graph_pool_handle())
        key = (
            slot,
            None
            if context is None
            else (context.recipe, id(context.amax_reduction_group), context.collect_saturation),
            None if follows_another else self._empty_main_grads(),
            _layout(x),
            tuple(None if e is None else _layout(e) for e in extras),
        )
        graphs = self.sets.get(key)
        if graphs is None:
            if self.params_needed is not None:  # the capture runs every unit first
                self.params_needed(self.all_params)
            graphs = self.sets[key] = self._capture(x, extras, context, slot, follows_another)
        for static, value in zip(graphs.extras, extras):
            if value is not None:
                _copy_into(static, value)
        for index in range(len(self.functions)):
            x = _ReplayUnit.apply(self, graphs, index, context, x)
        return x

    def _empty_main_grads(self) -> tuple:
        return tuple(getattr(p, "main_grad_empty", False) for p in self.all_params)

    def _set_empty_main_grads(self, flags) -> None:
        for p, flag in zip(self.all_params, flags):
            p.main_grad_empty = flag

    # -- replay ---------------------------------------------------------------------------------

    def replay_forward(self, graphs: _GraphSet, index: int, context, x) -> torch.Tensor:
        if self.params_needed is not None:
            self.params_needed(self.params[index])
        if context is not None:
            for linear in self.linears[index]:
                linear.refresh_weight_cast(context)
            replay_forward_amaxes(context, graphs.forward_amaxes[index])
        _copy_into(graphs.inputs[index], x)
        graphs.forward_graphs[index].replay()
        return graphs.outputs[index]

    def replay_backward(self, graphs: _GraphSet, index: int, grad_output) -> torch.Tensor:
        _copy_into(graphs.grad_outputs[index], grad_output)
        graphs.backward_graphs[index].replay()
        replay_backward_amaxes(graphs.backward_amaxes[index])
        for param in graphs.written[index]:
            param.main_grad_empty = False
        if self.grads_ready is not None:
            self.grads_ready(self.params[index])
        if index == 0:  # the micro-batch's last backward: its slot is free
            self.slots.release(graphs.slot)
            # The gradient leaves the graphs as a copy: the slot's next forward replay may write
            # over the pool memory it sits in while its reader still runs (a pipeline's send of
            # it to the previous stage, on NCCL's stream, waited only by the next backward).
            return graphs.grad_inputs[0].clone()
        return graphs.grad_inputs[index]

    # -- capture --------------------------------------------------------------------------------

    def _capture(self, x, extras, context, slot: int, accumulate: bool) -> _GraphSet:
        """The graphs of every unit for one signature, in `slot`'s pool; `accumulate`: their
        backwards add into every main_grad (another micro-batch's backward runs first)."""
        if context is not None:  # the graphs read this step's weight casts; make them now
            for linear in (m for linears in self.linears for m in linears):
                linear.refresh_weight_cast(context)
        graphs, pool = _GraphSet(len(self.functions), slot), self.pools[slot]
        graphs.extras = tuple(None if e is None else e.detach() for e in extras)
        first_input = torch.empty_like(x).requires_grad_()
        self._warm_up(first_input, graphs.extras, context)
        # The backward captures claim empty main_grads, as an eager backward would; the claims
        # are the replays' to make, the capture itself runs nothing.
        empty_main_grads = self._empty_main_grads()
        if accumulate:
            self._set_empty_main_grads((False,) * len(empty_main_grads))
        self.stream.wait_stream(torch.cuda.current_stream())
        with record_amaxes(context) as recording:
            inputs = first_input
            for index, function in enumerate(self.functions):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    graph, pool=pool, stream=self.stream, capture_error_mode=_CAPTURE_MODE
                ):
                    output = function(inputs, *graphs.extras)
                    symmetric_memory.join_copy_streams()
                graphs.forward_graphs[index], graphs.inputs[index], graphs.outputs[index] = (
                    graph,
                    inputs,
                    output,
                )
                graphs.forward_amaxes[index], _ = recording.take()
                # the next unit reads this output in place
                inputs = output.detach().requires_grad_()
            grad_output = torch.empty_like(graphs.outputs[-1])
            for index in reversed(range(len(self.functions))):
                graph, params = torch.cuda.CUDAGraph(), self.params[index]
                with torch.cuda.graph(
                    graph, pool=pool, stream=self.stream, capture_error_mode=_CAPTURE_MODE
                ):
                    empty = [p.main_grad_empty for p in params]
                    grads = torch.autograd.grad(
                        graphs.outputs[index],
                        (graphs.inputs[index], *params),
                        grad_outputs=grad_output,
                        allow_unused=True,
                    )
                    for param, grad in zip(params, grads[1:]):
                        if grad is not None:
                            accumulate_into_main_grad(param, grad)
                    symmetric_memory.join_copy_streams()
                # Written: by the layers themselves (claimed), or from autograd's gradient.
                graphs.written[index] = [
                    p for p, was_empty in zip(params, empty) if was_empty and not p.main_grad_empty
                ]
                graphs.backward_graphs[index], graphs.grad_outputs[index] = graph, grad_output
                graphs.grad_inputs[index] = grad_output = grads[0]
                _, graphs.backward_amaxes[index] = recording.take()
                del grads
        self._set_empty_main_grads(empty_main_grads)
        # The graphs' outputs hold no autograd history: the replays give them theirs.
        graphs.outputs = [output.detach() for output in graphs.outputs]
        torch.cuda.current_stream().wait_stream(self.stream)
        return graphs

    def _warm_up(self, first_input, extras, context) -> None:
        """One forward and backward of every unit on the capture stream before capturing (cuBLAS
        and the like set up per stream, and a Triton kernel compiles and loads at its first
        launch, which a capture must not do), leaving no trace: the scaling state it touches and
        the CUDA generator are restored, no gradient is kept (the linears do not write main_grad
        meanwhile; the kernel that adds into it is loaded on spare tensors)."""
        linears = [m for linears in self.linears for m in linears]
        states = [
            t
            for m in linears
            for s in m.fp8_scaling.values()
            for t in (s.scale, s.amax, s.cast_counts)
        ]
        saved, rng = [t.clone() for t in states], torch.cuda.get_rng_state()
        pending = [m.weight_counts_pending for m in linears]  # FP8 primary weights' counts
        fused = [m.fuse_wgrad_accumulation for m in linears]
        for m in linears:
            m.fuse_wgrad_accumulation = False
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream), record_amaxes(context):
            inputs = first_input
            for function, params in zip(self.functions, self.params):
                output = function(inputs, *extras)
                grads = torch.autograd.grad(
                    output,
                    (inputs, *params),
                    grad_outputs=torch.ones_like(output),
                    allow_unused=True,
                )
                for param, grad in zip(params, grads[1:]):
                    if grad is not None and getattr(param, "main_grad", None) is not None:
                        prepare_add_into(param.main_grad, grad)
                inputs = output.detach().requires_grad_()
        torch.cuda.current_stream().wait_stream(self.stream)
        if states:  # units without FP8 linears have no scaling state
            torch._foreach_copy_(states, saved)
        torch.cuda.set_rng_state(rng)
        for m, fuse, counts in zip(linears, fused, pending):
            m.fuse_wgrad_accumulation = fuse
            m.weight_counts_pending = counts


class _ReplayUnit(torch.autograd.Function):
    """One unit's forward graph, and its backward graph when autograd gets there. The parameters
    are no inputs: their gradients go to main_grad inside the graph, not through autograd."""

    @staticmethod
    def forward(ctx, owner: LayerGraphs, graphs: _GraphSet, index: int, context, x):
        ctx.owner, ctx.graphs, ctx.index = owner, graphs, index
        return owner.replay_forward(graphs, index, context, x).detach()

    @staticmethod
    def backward(ctx, grad_output):
        return (
            None,
            None,
            None,
            None,
            ctx.owner.replay_backward(ctx.graphs, ctx.index, grad_output).detach(),
        )


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.device


@torch.no_grad()
def _copy_into(static: torch.Tensor, value: torch.Tensor) -> None:
    if value.data_ptr() != static.data_ptr():
        static.copy_(value)
