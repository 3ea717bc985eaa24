"""Point-to-point exchange of activations and gradients between pipeline stages.

Every tensor that crosses a stage boundary has one shape, known before the step starts:
`[seq / tp if sequence parallel else seq, micro_batch, hidden]` in the parameters' dtype
(`pipeline_tensor_shape`). So receives are posted into freshly allocated buffers straight
away, with no per-micro-batch shape handshake (Megatron's `variable_seq_lengths=False`).

One call to `P2PCommunicator.communicate` is one `dist.batch_isend_irecv` of up to four
transfers: this stage's output to the next stage, its input gradient to the previous one,
and the matching receives. Activations always travel "forward" (to `next_stage_rank`, from
`prev_stage_rank`), gradients "backward"; both wrap around the pipeline, as the interleaved
schedule needs (the last rank feeds the first rank's next model chunk).

When the previous and next stage are the same rank (pp = 2), two transfers may go between
the same pair of ranks in one direction. NCCL matches transfers between a pair in the order
they are posted and ignores tags, so the order is fixed on every rank: sends to the next
stage before sends to the previous one, receives from the previous stage before receives
from the next. A rank's activations to its peer then always precede its gradients to that
peer, and the peer posts its receives in the same order. Gloo matches by tag as well: the
two directions carry different tags.

`communicate` waits for its transfers before it returns. `post` only posts them, as two batches,
activations (send_next, recv_prev) then gradients (send_prev, recv_next), and returns the
receive buffers with one `Exchange` per batch: the caller waits on an exchange just before it
uses what arrives (Megatron's `overlap_p2p_comm`). On NCCL a wait only orders the caller's CUDA
stream after the transfers, so the GPU goes on with the next forward or backward while they run
and a rank is held back only by the transfer it needs, not by its peer's whole pass. The order
of transfers between a pair of ranks is the same as in one batch, so they pair up the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megafp8.messages import check_integer

# Gloo matches a receive to a send by (peer, tag); NCCL ignores the tag (see the order above).
ACTIVATION_TAG, GRADIENT_TAG = 0, 1


def pipeline_tensor_shape(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    tp_size: int = 1,
    sequence_parallel: bool = False,
) -> tuple[int, int, int]:
    """The shape of every activation and gradient exchanged between stages:
    `(seq_length / tp, micro_batch_size, hidden_size)` with sequence parallelism over tp > 1
    ranks (each rank sends its own sequence shard), else `(seq_length, micro_batch_size, hidden_size)`."""
    for name, value in (
        ("seq_length", seq_length),
        ("micro_batch_size", micro_batch_size),
        ("hidden_size", hidden_size),
        ("tp_size", tp_size),
    ):
        check_integer(name, value)
    if sequence_parallel and tp_size > 1:
        if seq_length % tp_size:
            raise ValueError(
                f"seq_length={seq_length} does not split over tp_size={tp_size} tensor-parallel "
                f"ranks (sequence parallelism needs it to)"
            )
        seq_length //= tp_size
    return (seq_length, micro_batch_size, hidden_size)


# Pipeline groups whose communicator has been set up (see P2PCommunicator.__init__), by id;
# the group is kept as the value, so its id cannot be reused by another group.
_warmed_up: dict = {}


class P2PCommunicator:
    """Sends and receives one pipeline stage's activations and gradients.

        p2p = P2PCommunicator(groups, shape, torch.bfloat16, device)
        x, _ = p2p.communicate(recv_prev=True)                   # input of the next micro-batch
        _, dy = p2p.communicate(send_next=y, recv_next=True)     # send output, get its gradient
        p2p.communicate(send_prev=x.grad)                        # send the input gradient back

    `groups` is a ParallelGroups (its pp_group, next_stage_rank and prev_stage_rank are used).
    Received activations require grad, so the stage's backward fills their `.grad`.
    `log` (if a list) records every transfer as (op, peer, kind) in the order posted, for
    tests that check the pairing of sends and receives.
    """

    def __init__(self, groups, shape, dtype: torch.dtype, device, log: list | None = None):
        self.group = groups.pp_group
        self.next_rank, self.prev_rank = groups.next_stage_rank, groups.prev_stage_rank
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        self.log = log
        if groups.pp_size > 1 and id(self.group) not in _warmed_up:
            # NCCL: batch_isend_irecv must not be the first operation on a group unless every
            # rank of the group takes part in it. One tiny all-reduce, once per pipeline group,
            # creates the communicator on every rank together.
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
            _warmed_up[id(self.group)] = self.group

    def _check(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"pipeline {what} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, but the pipeline "
                f"exchanges {self.shape} [seq (/ tp with sequence parallelism), micro_batch, hidden] in "
                f"{self.dtype}: check seq_length, micro_batch_size, hidden_size, dtype and sequence_parallel"
            )
        return tensor.detach().contiguous()

    def _receive_buffers(self, recv_prev: bool, recv_next: bool, requires_grad: bool):
        """(the activation's buffer, the gradient's buffer), None for what is not received."""

        def empty(grad: bool) -> torch.Tensor:
            return torch.empty(self.shape, dtype=self.dtype, device=self.device, requires_grad=grad)

        return (empty(requires_grad) if recv_prev else None, empty(False) if recv_next else None)

    def communicate(
        self,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        requires_grad: bool = True,
    ):
        """Post the given transfers as one batch and wait for all of them.

        send_next: this stage's output activation, to the next stage.
        send_prev: the gradient of this stage's input, to the previous stage.
        recv_prev: receive an activation from the previous stage.
        recv_next: receive the gradient of this stage's output from the next stage.
        Returns (activation from prev or None, gradient from next or None); the activation
        requires grad unless `requires_grad=False` (forward only).
        """
        from_prev, from_next = self._receive_buffers(recv_prev, recv_next, requires_grad)
        # The fixed order that makes NCCL's in-order matching pair them up (module docstring).
        self._exchange(
            self._ops(send_next, from_prev, ACTIVATION_TAG)
            + self._ops(send_prev, from_next, GRADIENT_TAG)
        ).wait()
        return from_prev, from_next

    def post(
        self, send_next=None, send_prev=None, recv_prev=False, recv_next=False, requires_grad=True
    ):
        """Post the transfers of `communicate` (the same arguments) without waiting: activations
        as one batch, then gradients as another. Returns (activation buffer or None, gradient
        buffer or None, the activations' Exchange, the gradients' Exchange); a buffer holds what
        arrives once its exchange's `wait()` has run, and a sent tensor may change only after
        that too."""
        from_prev, from_next = self._receive_buffers(recv_prev, recv_next, requires_grad)
        activations = self._exchange(self._ops(send_next, from_prev, ACTIVATION_TAG))
        gradients = self._exchange(self._ops(send_prev, from_next, GRADIENT_TAG))
        return from_prev, from_next, activations, gradients

    def _ops(self, send, receive, tag: int) -> list:
        """One kind's transfers, the send first: activations go to the next stage and come from
        the previous one, gradients the other way round."""
        if tag == ACTIVATION_TAG:
            to, source, what = self.next_rank, self.prev_rank, "output activation"
        else:
            to, source, what = self.prev_rank, self.next_rank, "input gradient"
        ops = [] if send is None else [("send", self._check(send, what), to, tag)]
        return ops + ([] if receive is None else [("recv", receive, source, tag)])

    def _exchange(self, ops: list) -> Exchange:
        if not ops:
            return Exchange([], [])
        requests = dist.batch_isend_irecv(
            [
                dist.P2POp(
                    dist.isend if op == "send" else dist.irecv, tensor, peer, self.group, tag
                )
                for op, tensor, peer, tag in ops
            ]
        )
        if self.log is not None:
            self.log.extend(
                (op, peer, "activation" if tag == ACTIVATION_TAG else "gradient")
                for op, _, peer, tag in ops
            )
        return Exchange(requests, [tensor for op, tensor, _, _ in ops if op == "send"])


class Exchange:
    """One posted batch of transfers. `wait()` orders what the caller runs next after them: on
    NCCL the current CUDA stream waits (the host goes on), on gloo the host does. The sent
    tensors are kept until then, so their memory is not reused while a transfer reads it."""

    def __init__(self, requests: list, sent: list):
        self._requests, self._sent = requests, sent

    def wait(self) -> None:
        for request in self._requests:
            request.wait()
        self._requests, self._sent = [], []
