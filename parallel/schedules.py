"""Pipeline parallelism's schedules: how one step's micro-batches run through this rank's model
chunks (Megatron-LM's schedules, without its global state). Which layers a stage holds, and
what follows the last backward, are in stages.py.

    chunks = [TransformerLM(config, tp_group=groups.tp_group, sequence_parallel=sp, layers=span, seed=seed)
              for span in stage_layers(config.num_layers, groups.pp_size, groups.pp_rank, vpp)]

    def forward_step(chunk_index, chunk, input_tensor, micro_batch):
        tokens, labels = micro_batch
        with fp8_autocast(recipe=recipe, amax_reduction_group=groups.amax_reduction_group):
            out = chunk(tokens if input_tensor is None else input_tensor,
                        labels if chunk.post_process else None)
        if not chunk.post_process:
            return out                                  # hidden states for the next stage
        loss = out.mean()
        return loss / num_micro_batches, loss.detach()  # (what backward runs on, what is reported)

    losses = forward_backward(None, chunks, data_iterator=micro_batches, forward_step=forward_step,
                              num_micro_batches=num_micro_batches, groups=groups, seq_length=seq_length,
                              micro_batch_size=micro_batch_size, hidden_size=hidden_size, dtype=dtype,
                              sequence_parallel=sequence_parallel, grad_buffers=buffers)
    finalize_grads(chunks, groups, buffers)             # dp reductions, sequence-parallel and tied grads
    optimizer.step()

Schedules (`forward_backward`'s first argument, or None to pick by the layout):

- "no_pipelining" (pp = 1): forward and backward of each micro-batch in turn; gradients
  accumulate (gradient accumulation).
- "1f1b" (pp > 1, one chunk per rank): stage r runs pp - r - 1 warm-up forwards, then
  alternates one forward and one backward, then the cool-down backwards. At most
  min(pp - r, num_micro_batches) micro-batches are in flight (forward done, backward not) on
  stage r: activation memory of pp micro-batches on the first stage, whatever the number of
  micro-batches.
- "interleaved_1f1b" (pp > 1, vpp > 1 chunks per rank): chunk c of rank r is virtual stage
  c * pp + r; micro-batches go through in groups of pp, which cuts the pipeline bubble by vpp
  at the cost of vpp times the point-to-point traffic. Needs num_micro_batches % pp == 0.

Each schedule also runs forward only (`forward_only=True`, for evaluation): no backward,
no activations kept, under torch.no_grad.

Memory: once a stage's output has been sent to the next stage, only its autograd node is needed
until its backward, not its values: the tensor's storage is replaced by one element (Megatron's
`deallocate_output_tensor`) and its backward started from its gradient edge. That frees one
micro-batch's hidden states per micro-batch in flight (pp of them on the first stage of 1F1B).

Point-to-point overlap (`overlap_p2p_comm`): each exchange between stages is posted, not waited
for; the next forward waits for the activations it receives, the next backward for the gradients.
So after a forward, the activation goes to the next stage while this rank runs its backward,
and a rank waits for its peer only where it needs the peer's data.

FP8: delayed scaling reduces amaxes at the end of every forward pass (each forward_step's
fp8_autocast) and every backward pass (each backward call here), over the amax-reduction
group: tensor x data parallel, every rank of one pipeline stage. Those collectives match up
because every rank of a stage runs the same sequence of forward and backward passes: the
order depends only on (schedule, pp, pp_rank, vpp, num_micro_batches), never on data or on
tp/dp rank. `stats["order"]` records it; the tests check it is identical within a stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from megafp8.messages import check_integer

from .p2p import P2PCommunicator, pipeline_tensor_shape


class _Step:
    """What every schedule shares: running forward and backward passes of the model chunks,
    the micro-batches, point-to-point communication, gradient-buffer sync and statistics."""

    def __init__(
        self,
        model_chunks,
        data_iterator,
        forward_step,
        num_micro_batches,
        groups,
        shape,
        dtype,
        forward_only,
        grad_buffers,
        stats,
        overlap_p2p_comm=False,
    ):
        self.chunks, self.forward_step, self.groups = model_chunks, forward_step, groups
        self.num_micro_batches, self.forward_only = num_micro_batches, forward_only
        self.pp = groups.pp_size if groups is not None else 1
        self.pp_rank = groups.pp_rank if groups is not None else 0
        self.buffers = grad_buffers
        self.data = iter(data_iterator)
        self.batches: dict = {}  # micro-batch index -> micro-batch, until its last chunk's forward
        self.fetched = 0
        self.losses: list = []
        device = next(iter(model_chunks[0].parameters())).device
        self.p2p_log = stats.setdefault("p2p", []) if stats is not None else None
        self.p2p = (
            P2PCommunicator(groups, shape, dtype, device, self.p2p_log) if self.pp > 1 else None
        )
        self.overlap_p2p_comm = overlap_p2p_comm
        # Posted, not yet waited for (overlap_p2p_comm): what the next forward / backward receives.
        self.arriving_activations: list = []
        self.arriving_gradients: list = []
        self.stats = stats
        self.live = self.max_live = 0
        self.forwards = [0] * len(model_chunks)
        self.backwards = [0] * len(model_chunks)
        self.order: list = []

    def is_first(self, chunk: int) -> bool:
        return self.pp_rank == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.pp_rank == self.pp - 1 and chunk == len(self.chunks) - 1

    def micro_batch(self, index: int, chunk: int):
        # Every chunk of this rank takes micro-batch `index` in turn, chunk 0 first.
        while self.fetched <= index:
            try:
                self.batches[self.fetched] = next(self.data)
            except StopIteration:
                raise ValueError(
                    f"data_iterator ran out after {self.fetched} of num_micro_batches="
                    f"{self.num_micro_batches} micro-batches"
                ) from None
            self.fetched += 1
        batch = self.batches[index]
        if chunk == len(self.chunks) - 1:
            del self.batches[index]
        return batch

    def forward(self, chunk: int, index: int, input_tensor):
        """Run forward_step on one micro-batch; the output to send on (None on the last virtual stage)."""
        _wait_all(self.arriving_activations)
        result = self.forward_step(
            chunk, self.chunks[chunk], input_tensor, self.micro_batch(index, chunk)
        )
        self.forwards[chunk] += 1
        self.order.append(("F", chunk, index))
        if not self.forward_only:
            self.live += 1
            self.max_live = max(self.max_live, self.live)
        if not self.is_last(chunk):
            if not isinstance(result, torch.Tensor):
                raise TypeError(
                    f"forward_step of chunk {chunk} (not the last pipeline stage) must return the "
                    f"output hidden states as one tensor, got {type(result).__name__}"
                )
            return result
        loss, report = result if isinstance(result, tuple) else (result, None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                "forward_step on the last pipeline stage must return the micro-batch's loss (a "
                "one-element tensor, divided by num_micro_batches) or a tuple (loss, report)"
            )
        self.losses.append(loss.detach() if report is None else report)
        return loss

    def communicate(self, *, send_next=None, **transfers):
        """`P2PCommunicator.communicate`, or with overlap_p2p_comm its `post`: the transfers are
        waited for by the next forward (activations) or backward (gradients) that may use them.
        An output sent to the next stage is then freed (only its autograd node stays, for its
        backward); the transfer keeps its values until it is done."""
        if self.overlap_p2p_comm:
            from_prev, from_next, activations, gradients = self.p2p.post(
                send_next=send_next, **transfers
            )
            received = from_prev, from_next
            self.arriving_activations.append(activations)
            self.arriving_gradients.append(gradients)
        else:
            received = self.p2p.communicate(send_next=send_next, **transfers)
        if send_next is not None and not self.forward_only:
            _free_values(send_next)
        return received

    def backward(self, chunk: int, index: int, input_tensor, output, output_grad):
        """Backward of one micro-batch through one chunk; the gradient of its input (None on
        the first virtual stage)."""
        self.backwards[chunk] += 1
        last = self.backwards[chunk] == self.num_micro_batches
        for buffer in self.buffers:
            # Only the chunk's last backward starts the overlapped data-parallel reduction.
            buffer.set_sync(last)
        self.order.append(("B", chunk, index))
        _wait_all(self.arriving_gradients)
        if self.is_last(chunk):
            torch.autograd.backward(output)  # the loss
        elif getattr(output, "values_freed", False):
            # From the output's gradient edge: its shape is the one autograd recorded, not the
            # one-element stand-in's.
            torch.autograd.backward(
                torch.autograd.graph.get_gradient_edge(output), grad_tensors=output_grad
            )
        else:
            torch.autograd.backward(output, grad_tensors=output_grad)
        self.live -= 1
        return None if input_tensor is None else input_tensor.grad

    def finish(self) -> list:
        _wait_all(self.arriving_activations)
        _wait_all(self.arriving_gradients)
        for buffer in self.buffers:
            buffer.set_sync(True)  # the buffer's default, whatever runs next
        expected = [self.num_micro_batches] * len(self.chunks)
        # Every rank of a stage must have run the same passes (the FP8 amax collectives).
        assert self.forwards == expected and (self.forward_only or self.backwards == expected), (
            self.forwards,
            self.backwards,
        )
        if self.stats is not None:
            self.stats.update(
                max_live_forwards=self.max_live,
                forwards=list(self.forwards),
                backwards=list(self.backwards),
                order=list(self.order),
            )
        return self.losses


def _wait_all(exchanges: list) -> None:
    while exchanges:
        exchanges.pop(0).wait()


def _free_values(output: torch.Tensor) -> None:
    """Replace the storage of `output`, already sent, by one element: its backward needs its
    autograd node only. Not for a view (its base would keep the values) or a tensor outside any
    graph (an input passed through a stage without layers: the received buffer itself)."""
    if output.grad_fn is None or output._base is not None:
        return
    output.data = torch.empty((1,), dtype=output.dtype, device=output.device)
    output.values_freed = True


def no_pipelining(step: _Step) -> list:
    """pp = 1: forward and backward of each micro-batch in turn, gradients accumulating."""
    for index in range(step.num_micro_batches):
        loss = step.forward(0, index, None)
        if not step.forward_only:
            step.backward(0, index, None, loss, None)
    return step.finish()


def one_f_one_b(step: _Step) -> list:
    """1F1B (PipeDream-Flush): warm-up forwards, steady one-forward-one-backward, cool-down."""
    num, forward_only = step.num_micro_batches, step.forward_only
    first, last = step.is_first(0), step.is_last(0)
    warmup = num if forward_only else min(step.pp - step.pp_rank - 1, num)
    inputs, outputs = [], []  # of the micro-batches in flight, oldest first
    forward_index = backward_index = 0

    def recv_forward():
        return step.communicate(recv_prev=True, requires_grad=not forward_only)[0]

    def send_forward(output):
        if not last:
            step.communicate(send_next=output)

    def run_forward(input_tensor):
        nonlocal forward_index
        output = step.forward(0, forward_index, input_tensor)
        forward_index += 1
        return output

    def run_backward(output_grad):
        nonlocal backward_index
        input_grad = step.backward(0, backward_index, inputs.pop(0), outputs.pop(0), output_grad)
        backward_index += 1
        return input_grad

    for _ in range(warmup):
        input_tensor = None if first else recv_forward()
        output = run_forward(input_tensor)
        send_forward(output)
        if not forward_only:
            inputs.append(input_tensor)
            outputs.append(output)

    remaining = num - warmup
    input_tensor = None if first or remaining == 0 else recv_forward()
    for i in range(remaining):
        output = run_forward(input_tensor)
        inputs.append(input_tensor)
        outputs.append(output)
        # Send this output and receive the gradient of the oldest micro-batch in flight.
        _, output_grad = step.communicate(send_next=None if last else output, recv_next=not last)
        input_grad = run_backward(output_grad)
        # Send its input gradient back and receive the input of the next micro-batch.
        input_tensor, _ = step.communicate(
            send_prev=None if first else input_grad, recv_prev=not first and i < remaining - 1
        )

    if not forward_only:
        for _ in range(warmup):
            _, output_grad = step.communicate(recv_next=not last)
            input_grad = run_backward(output_grad)
            if not first:
                step.communicate(send_prev=input_grad)
    return step.finish()


def interleaved_one_f_one_b(step: _Step) -> list:
    """Interleaved 1F1B over vpp model chunks per rank (Megatron's virtual pipeline)."""
    pp, rank, forward_only = step.pp, step.pp_rank, step.forward_only
    chunks, num = len(step.chunks), step.num_micro_batches
    total = num * chunks
    first_rank, last_rank = rank == 0, rank == pp - 1

    def chunk_of(k: int, forward: bool) -> int:
        # Passes go in groups of pp micro-batches through chunk 0, then 1, ...; backward in reverse.
        chunk = (k % (pp * chunks)) // pp
        return chunk if forward else chunks - 1 - chunk

    def micro_batch_of(k: int) -> int:
        return (k // (pp * chunks)) * pp + k % pp

    if forward_only:
        warmup, all_warmup = total, True
    elif num == pp:
        warmup, all_warmup = total, True  # every forward first, then every backward
    else:
        warmup, all_warmup = min((pp - rank - 1) * 2 + (chunks - 1) * pp, total), False
    remaining = total - warmup
    inputs = [[] for _ in range(chunks)]
    outputs = [[] for _ in range(chunks)]
    output_grads = [[] for _ in range(chunks)]

    def run_forward(k: int):
        chunk = chunk_of(k, True)
        input_tensor = None if step.is_first(chunk) else inputs[chunk][-1]
        if step.is_first(chunk):
            inputs[chunk].append(None)
        output = step.forward(chunk, micro_batch_of(k), input_tensor)
        if forward_only:
            inputs[chunk].pop()
        else:
            outputs[chunk].append(output)
        return output

    def run_backward(k: int):
        chunk = chunk_of(k, False)
        output_grad = None if step.is_last(chunk) else output_grads[chunk].pop(0)
        index = backward_counts[chunk]
        backward_counts[chunk] += 1
        return step.backward(chunk, index, inputs[chunk].pop(0), outputs[chunk].pop(0), output_grad)

    backward_counts = [0] * chunks

    # Warm-up: forwards only. Each iteration sends its output and receives the next input.
    if not first_rank:
        inputs[0].append(step.communicate(recv_prev=True, requires_grad=not forward_only)[0])
    for k in range(warmup):
        output = run_forward(k)
        next_chunk = chunk_of(k + 1, True)
        recv_prev = not (first_rank and next_chunk == 0) and k < total - 1
        send = None if step.is_last(chunk_of(k, True)) else output
        if k == warmup - 1 and not all_warmup:
            # The last warm-up forward also receives the first gradient.
            input_tensor, output_grad = step.communicate(
                send_next=send, recv_prev=recv_prev, recv_next=not last_rank
            )
            if not last_rank:
                output_grads[chunks - 1].append(output_grad)
        else:
            input_tensor, _ = step.communicate(
                send_next=send, recv_prev=recv_prev, requires_grad=not forward_only
            )
        if recv_prev:
            inputs[next_chunk].append(input_tensor)

    # Steady state: one forward and one backward, and an exchange in each direction. Posted
    # (overlap_p2p_comm), the forward's output leaves as soon as the forward is done, while the
    # backward runs; waited for, both directions go in one exchange after the backward.
    for i in range(remaining):
        forward_k, backward_k = warmup + i, i
        output = run_forward(forward_k)
        send_next = None if step.is_last(chunk_of(forward_k, True)) else output
        # Which chunk the arriving input / gradient belongs to. The first rank runs pp - 1
        # forwards ahead of the last rank, whose output it receives; symmetrically for grads.
        recv_prev = True
        if first_rank:
            next_forward_chunk = chunk_of(forward_k - (pp - 1), True)
            recv_prev = next_forward_chunk != chunks - 1
            next_forward_chunk += 1
        else:
            next_forward_chunk = chunk_of(forward_k + 1, True)
        if i == remaining - 1:
            recv_prev = False
        if step.overlap_p2p_comm:
            # Activations before gradients, as within one exchange: the transfers pair up alike.
            input_tensor, _ = step.communicate(send_next=send_next, recv_prev=recv_prev)
            send_next = None
        input_grad = run_backward(backward_k)
        send_prev = None if step.is_first(chunk_of(backward_k, False)) else input_grad
        recv_next = True
        if last_rank:
            next_backward_chunk = chunk_of(backward_k - (pp - 1), False)
            recv_next = next_backward_chunk != 0
            next_backward_chunk -= 1
        else:
            next_backward_chunk = chunk_of(backward_k + 1, False)
        if step.overlap_p2p_comm:
            _, output_grad = step.communicate(send_prev=send_prev, recv_next=recv_next)
        else:
            input_tensor, output_grad = step.communicate(
                send_next=send_next, send_prev=send_prev, recv_prev=recv_prev, recv_next=recv_next
            )
        if recv_prev:
            inputs[next_forward_chunk].append(input_tensor)
        if recv_next:
            output_grads[next_backward_chunk].append(output_grad)

    # Cool-down: the remaining backwards.
    if not forward_only:
        if all_warmup and not last_rank:
            output_grads[chunks - 1].append(step.communicate(recv_next=True)[1])
        for k in range(remaining, total):
            input_grad = run_backward(k)
            next_chunk = chunk_of(k + 1, False)
            recv_next = not (last_rank and next_chunk == chunks - 1) and k < total - 1
            send_prev = None if step.is_first(chunk_of(k, False)) else input_grad
            _, output_grad = step.communicate(send_prev=send_prev, recv_next=recv_next)
            if recv_next:
                output_grads[next_chunk].append(output_grad)
    return step.finish()


SCHEDULES = {
    "no_pipelining": no_pipelining,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_one_f_one_b,
}


def get_schedule(pp_size: int, num_chunks: int = 1) -> str:
    """The schedule for a layout: no_pipelining for pp = 1, 1f1b for one chunk per rank,
    interleaved_1f1b for several."""
    if pp_size == 1:
        return "no_pipelining"
    return "1f1b" if num_chunks == 1 else "interleaved_1f1b"


def forward_backward(
    schedule: str | Callable | None,
    model_chunks: nn.Module | Sequence[nn.Module],
    *,
    data_iterator: Iterable,
    forward_step: Callable,
    num_micro_batches: int,
    groups,
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    dtype: torch.dtype,
    sequence_parallel: bool = False,
    forward_only: bool = False,
    grad_buffers=None,
    stats: dict | None = None,
    overlap_p2p_comm: bool = False,
) -> list:
    """Run one step's `num_micro_batches` micro-batches forward (and backward) through this
    rank's pipeline stage; return the per-micro-batch losses on the last stage ([] elsewhere).

    schedule: "no_pipelining", "1f1b", "interleaved_1f1b", None (picked by `get_schedule`),
        or a function taking the internal step object (for new schedules).
    model_chunks: this rank's model chunk(s): one TransformerLM, or a list of vpp of them
        (chunk c holds virtual stage c * pp + pp_rank, see `stage_layers`).
    data_iterator: yields this rank's micro-batches; exactly num_micro_batches are taken, in
        order, on every rank (stages after the first may need them for labels, positions or
        document masks; a rank that needs none may yield None).
    forward_step(chunk_index, model_chunk, input_tensor, micro_batch): runs the chunk on one
        micro-batch inside the caller's fp8_autocast. `input_tensor` is None on the first
        virtual stage (take the tokens from micro_batch), else the previous stage's hidden
        states. Returns the output hidden states, or on the last virtual stage the loss to
        backpropagate (a one-element tensor, already divided by num_micro_batches) or a
        tuple (loss, report) whose `report` goes into the returned list instead of
        `loss.detach()`.
    groups: the ParallelGroups (None for a single process, pp = 1).
    seq_length, micro_batch_size, hidden_size, dtype, sequence_parallel: the shape and dtype
        of the tensors exchanged between stages (`pipeline_tensor_shape`).
    forward_only: evaluation; no backward, under torch.no_grad.
    grad_buffers: a GradientBuffer or a list of them (one per chunk, or one for all chunks):
        set_sync(True) only for the last backward of each chunk, so the overlapped
        data-parallel reduction starts in that backward; finish them after this returns
        (stages.finalize_grads).
    stats: a dict to fill with max_live_forwards (most micro-batch forwards held for
        backward at once), forwards / backwards (per chunk), order (the ("F"|"B", chunk,
        micro_batch) sequence) and p2p (every transfer, in order).
    overlap_p2p_comm: post each exchange between stages without waiting for it; the next
        forward waits for the activations, the next backward for the gradients (p2p.post).
        The same transfers, in the same order, and the same results.
    """
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    if not chunks:
        raise ValueError("model_chunks is empty")
    check_integer("num_micro_batches", num_micro_batches)
    pp = groups.pp_size if groups is not None else 1
    name = get_schedule(pp, len(chunks)) if schedule is None else schedule
    if isinstance(name, str):
        if name not in SCHEDULES:
            raise ValueError(
                f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
            )
        function = SCHEDULES[name]
    else:
        function = name
    if function is no_pipelining and (pp > 1 or len(chunks) > 1):
        raise ValueError(
            f"the no_pipelining schedule runs one model chunk on a single pipeline stage; "
            f"got pp={pp} and {len(chunks)} chunks (use 1f1b or interleaved_1f1b)"
        )
    if function is one_f_one_b and len(chunks) > 1:
        raise ValueError(
            f"the 1f1b schedule runs one model chunk per rank, got {len(chunks)} "
            f"(use interleaved_1f1b for virtual pipeline stages)"
        )
    if function is interleaved_one_f_one_b:
        if pp == 1:
            raise ValueError("the interleaved_1f1b schedule needs pipeline parallelism (pp > 1)")
        if num_micro_batches % pp:
            raise ValueError(
                f"the interleaved pipeline schedule needs num_micro_batches divisible by the pipeline-parallel "
                f"size: num_micro_batches={num_micro_batches} % pp={pp} = {num_micro_batches % pp} (micro-batches "
                f"go through the {len(chunks)} virtual stages of each rank in groups of pp)"
            )
    tp = groups.tp_size if groups is not None else 1
    shape = pipeline_tensor_shape(seq_length, micro_batch_size, hidden_size, tp, sequence_parallel)
    if grad_buffers is None:
        grad_buffers = []
    elif not isinstance(grad_buffers, (list, tuple)):
        grad_buffers = [grad_buffers]
    if stats is not None:
        stats.clear()
        stats["schedule"] = getattr(function, "__name__", str(function))
    step = _Step(
        chunks,
        data_iterator,
        forward_step,
        num_micro_batches,
        groups,
        shape,
        dtype,
        forward_only,
        list(grad_buffers),
        stats,
        overlap_p2p_comm,
    )
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        return function(step)
