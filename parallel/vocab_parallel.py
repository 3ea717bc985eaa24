"""The vocabulary-parallel ends of the model: the input embedding and the cross-entropy on the
output logits, each with the vocabulary split into contiguous ranges over the tensor-parallel
ranks (rank r holds token ids [r·V/tp, (r+1)·V/tp)).

Neither ever holds the full vocabulary on one rank: the embedding sums partial lookups, and the
cross-entropy combines per-token statistics (max, sum of exp, target logit), never the logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megafp8.collectives import all_reduce, group_size, max_over, rank_in
from megafp8.triton_support import available as triton_available

from . import cross_entropy_kernels
from .communication import reduce_from_tensor_parallel, reduce_scatter_to_sequence_parallel
from .initialization import InitMethod, master_slice, normal_init
from .sharding import mark_partitioned


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by rows (token ids) over the tensor-parallel ranks.

    Each rank looks up the ids in its range and contributes zeros for the others; the partial
    results are summed over the ranks. With `sequence_parallel` the sum is a reduce-scatter
    along dim 0, so pass ids shaped [sequence, batch] and get back this rank's sequence shard
    [sequence/tp, batch, embedding_dim]; without it every rank gets the full [..., embedding_dim].
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_group=None,
        sequence_parallel: bool = False,
        init_method: InitMethod = normal_init(0.02),
        dtype=None,
        device=None,
    ):
        super().__init__()
        tp = group_size(tp_group)
        if num_embeddings % tp:
            raise ValueError(
                f"VocabParallelEmbedding: num_embeddings={num_embeddings} does not divide over "
                f"{tp} tensor-parallel ranks (pad the vocabulary)"
            )
        rows = num_embeddings // tp
        self.vocab_start = rank_in(tp_group) * rows
        self.vocab_end = self.vocab_start + rows
        self.weight = mark_partitioned(
            nn.Parameter(
                master_slice(
                    (num_embeddings, embedding_dim),
                    0,
                    rank_in(tp_group),
                    tp,
                    init_method,
                    dtype or torch.get_default_dtype(),
                    device,
                )
            ),
            0,
        )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.tp_size = tp_group, tp
        self.sequence_parallel = sequence_parallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # no masking, so an out-of-range id still raises as in nn.Embedding
            out = F.embedding(ids, self.weight)
        else:
            # Other ranks' ids look up row 0, then are zeroed: their rows get no gradient here.
            elsewhere = (ids < self.vocab_start) | (ids >= self.vocab_end)
            out = F.embedding((ids - self.vocab_start).masked_fill(elsewhere, 0), self.weight)
            out = out.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(out, self.tp_group)
        return reduce_from_tensor_parallel(out, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
            f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}"
        )


def _shard(logits, group, vocab_size):
    """(first column of this rank's shard, its width, the real vocabulary, how many of its
    columns are tokens rather than padding)."""
    vocab_local = logits.shape[-1]
    start = rank_in(group) * vocab_local
    vocab = vocab_local * group_size(group) if vocab_size is None else vocab_size
    return start, vocab_local, vocab, max(0, min(vocab_local, vocab - start))


def _loss(sums, ignored, label_smoothing, vocab):
    """The per-token loss from the all-reduced sums: target logit, [sum of valid logits,] sum
    of exp, each shifted by the global max."""
    log_sum_exp = sums[-1].log()
    loss = log_sum_exp - sums[0]
    if label_smoothing:
        # As F.cross_entropy: (1 - ε)·(-log p_target) + ε·mean over the vocabulary of -log p.
        loss = (1 - label_smoothing) * loss + label_smoothing * (log_sum_exp - sums[1] / vocab)
    return loss.masked_fill(ignored, 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocabulary-sharded logits; fp32 inside, one fp32 logits-sized buffer
    (the softmax) kept for backward, which turns it into the gradient in place."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, vocab_size):
        start, vocab_local, vocab, valid = _shard(logits, group, vocab_size)

        # Shift by the global max so exp cannot overflow; the shift cancels in the loss.
        logits_max = logits.amax(dim=-1).float()
        if group_size(group) > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits.to(torch.float32, copy=True).sub_(logits_max.unsqueeze(-1))

        owned = (target >= start) & (target < start + vocab_local)
        local_target = (target - start).masked_fill(~owned, 0)
        # Per-token partial sums, all-reduced together: target logit (from its owner only),
        # [sum of logits, for label smoothing,] sum of exp.
        partial = [
            shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        ]
        if label_smoothing:
            partial.append(shifted[..., :valid].sum(dim=-1))
        exp = shifted.exp_()
        exp[..., valid:] = 0.0  # padding: no probability, and so no gradient
        partial.append(exp.sum(dim=-1))
        sums = all_reduce(torch.stack(partial), group)
        ignored = target == ignore_index
        loss = _loss(sums, ignored, label_smoothing, vocab)

        softmax = exp.div_(sums[-1].unsqueeze(-1))
        ctx.save_for_backward(softmax, owned, local_target, ignored)
        ctx.dtype, ctx.vocab, ctx.valid, ctx.label_smoothing = (
            logits.dtype,
            vocab,
            valid,
            label_smoothing,
        )
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss / d logits = softmax − (1 − ε)·one_hot(target) − ε/V, on the saved softmax in place
        # (a second backward through this graph then fails autograd's version check, loudly).
        grad, owned, local_target, ignored = ctx.saved_tensors
        smoothing = ctx.label_smoothing
        grad.scatter_add_(
            -1, local_target.unsqueeze(-1), owned.unsqueeze(-1).to(grad.dtype) * -(1 - smoothing)
        )
        if smoothing:
            grad[..., : ctx.valid].sub_(smoothing / ctx.vocab)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """The same cross-entropy with the Triton kernels of cross_entropy_kernels (CUDA): keeps the
    logits themselves, not an fp32 copy, and two fp32 numbers per token for backward, which
    recomputes the softmax and writes the gradient in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, vocab_size):
        start, vocab_local, vocab, valid = _shard(logits, group, vocab_size)
        flat_target = target.reshape(-1).contiguous()
        local_max, local_sum_exp, target_logit, logit_sum = cross_entropy_kernels.statistics(
            cross_entropy_kernels.as_rows(logits), flat_target, start, valid, label_smoothing > 0
        )

        # As the torch path, shift by the global max; each rank rescales its sum of exp to it.
        logits_max = max_over(local_max, group)
        owned = (flat_target >= start) & (flat_target < start + vocab_local)
        partial = [(target_logit - logits_max).masked_fill(~owned, 0.0)]
        if label_smoothing:
            partial.append(logit_sum - valid * logits_max)
        partial.append(local_sum_exp * (local_max - logits_max).exp())
        sums = all_reduce(torch.stack(partial), group)

        ctx.save_for_backward(logits, flat_target, logits_max, sums[-1])
        ctx.start, ctx.valid, ctx.vocab = start, valid, vocab
        ctx.ignore_index, ctx.label_smoothing = ignore_index, label_smoothing
        return _loss(sums, flat_target == ignore_index, label_smoothing, vocab).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, flat_target, logits_max, sum_exp = ctx.saved_tensors
        grad = cross_entropy_kernels.gradient(
            cross_entropy_kernels.as_rows(logits),
            flat_target,
            logits_max,
            sum_exp,
            grad_loss.reshape(-1).contiguous(),
            ctx.start,
            ctx.valid,
            ctx.vocab,
            ctx.ignore_index,
            ctx.label_smoothing,
        )
        return grad.view(logits.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group=None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy, as F.cross_entropy(reduction="none") on the full logits.

    `logits` [..., vocab/tp] is this rank's contiguous vocabulary shard (any dtype; computed in
    fp32, gradient returned in the logits' dtype); `target` [...] holds global token ids, the
    same on every rank. Returns the fp32 loss [...]; tokens whose target is `ignore_index` get
    loss 0 and gradient 0. The full logits are never gathered: only per-token statistics travel.
    `vocab_size`: the real vocabulary when the logits carry padding columns past it (Megatron's
    padded vocabulary); those get no probability and no gradient, as if masked to -inf.
    On CUDA with Triton installed, fused kernels compute it without an fp32 copy of the logits.
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} is not in [0, 1]")
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target {tuple(target.shape)} does not match logits {tuple(logits.shape)} without "
            f"their last (vocabulary) dimension"
        )
    fused = logits.is_cuda and triton_available()
    function = _FusedVocabParallelCrossEntropy if fused else _VocabParallelCrossEntropy
    return function.apply(logits, target, tp_group, ignore_index, label_smoothing, vocab_size)
