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

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

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
        ops, from_prev, from_next = [], None, None
        # The fixed order that makes NCCL's in-order matching pair them up (module docstring).
        if send_next is not None:
            ops.append(
                (
                    "send",
                    self._check(send_next, "output activation"),
                    self.next_rank,
                    ACTIVATION_TAG,
                )
            )
        if recv_prev:
            from_prev = self._buffer()
            ops.append(("recv", from_prev, self.prev_rank, ACTIVATION_TAG))
        if send_prev is not None:
            ops.append(
                ("send", self._check(send_prev, "input gradient"), self.prev_rank, GRADIENT_TAG)
            )
        if recv_next:
            from_next = self._buffer()
            ops.append(("recv", from_next, self.next_rank, GRADIENT_TAG))
        if ops:
            p2p_ops = [
                dist.P2POp(
                    dist.isend if op == "send" else dist.irecv, tensor, peer, self.group, tag
                )
                for op, tensor, peer, tag in ops
            ]
            for request in dist.batch_isend_irecv(p2p_ops):
                request.wait()
            if self.log is not None:
                self.log.extend(
                    (op, peer, "activation" if tag == ACTIVATION_TAG else "gradient")
                    for op, _, peer, tag in ops
                )
        if from_prev is not None and requires_grad:
            from_prev.requires_grad_(True)
        return from_prev, from_next
