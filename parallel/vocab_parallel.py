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

from megafp8.collectives import all_reduce, group_size, rank_in

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

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group=None, sequence_parallel: bool = False,
                 init_method: InitMethod = normal_init(0.02), dtype=None, device=None):
        super().__init__()
        tp = group_size(tp_group)
        if num_embeddings % tp:
            raise ValueError(f"VocabParallelEmbedding: num_embeddings={num_embeddings} does not divide over "
                             f"{tp} tensor-parallel ranks (pad the vocabulary)")
        rows = num_embeddings // tp
        self.vocab_start = rank_in(tp_group) * rows
        self.vocab_end = self.vocab_start + rows
        self.weight = mark_partitioned(nn.Parameter(master_slice(
            (num_embeddings, embedding_dim), 0, rank_in(tp_group), tp, init_method,
            dtype or torch.get_default_dtype(), device)), 0)
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
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
                f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocabulary-sharded logits; fp32 inside, one fp32 logits-sized buffer
    (the softmax) kept for backward, which turns it into the gradient in place."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, vocab_size):
        vocab_local = logits.shape[-1]
        start = rank_in(group) * vocab_local
        vocab = vocab_local * group_size(group) if vocab_size is None else vocab_size
        valid = max(0, min(vocab_local, vocab - start))  # this shard's columns that are tokens

        # Shift by the global max so exp cannot overflow; the shift cancels in the loss.
        logits_max = logits.amax(dim=-1).float()
        if group_size(group) > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits.to(torch.float32, copy=True).sub_(logits_max.unsqueeze(-1))

        owned = (target >= start) & (target < start + vocab_local)
        local_target = (target - start).masked_fill(~owned, 0)
        # Per-token partial sums, all-reduced together: target logit (from its owner only),
        # [sum of logits, for label smoothing,] sum of exp.
        partial = [shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)]
        if label_smoothing:
            partial.append(shifted[..., :valid].sum(dim=-1))
        exp = shifted.exp_()
        exp[..., valid:] = 0.0  # padding: no probability, and so no gradient
        partial.append(exp.sum(dim=-1))
        sums = all_reduce(torch.stack(partial), group)

        log_sum_exp = sums[-1].log()
        loss = log_sum_exp - sums[0]
        if label_smoothing:
            # As F.cross_entropy: (1 - ε)·(-log p_target) + ε·mean over the vocabulary of -log p.
            loss = (1 - label_smoothing) * loss + label_smoothing * (log_sum_exp - sums[1] / vocab)
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.div_(sums[-1].unsqueeze(-1))
        ctx.save_for_backward(softmax, owned, local_target, ignored)
        ctx.dtype, ctx.vocab, ctx.valid, ctx.label_smoothing = logits.dtype, vocab, valid, label_smoothing
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss / d logits = softmax − (1 − ε)·one_hot(target) − ε/V, on the saved softmax in place
        # (a second backward through this graph then fails autograd's version check, loudly).
        grad, owned, local_target, ignored = ctx.saved_tensors
        smoothing = ctx.label_smoothing
        grad.scatter_add_(-1, local_target.unsqueeze(-1), owned.unsqueeze(-1).to(grad.dtype) * -(1 - smoothing))
        if smoothing:
            grad[..., :ctx.valid].sub_(smoothing / ctx.vocab)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None,
                                 ignore_index: int = -100, label_smoothing: float = 0.0,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy, as F.cross_entropy(reduction="none") on the full logits.

    `logits` [..., vocab/tp] is this rank's contiguous vocabulary shard (any dtype; computed in
    fp32, gradient returned in the logits' dtype); `target` [...] holds global token ids, the
    same on every rank. Returns the fp32 loss [...]; tokens whose target is `ignore_index` get
    loss 0 and gradient 0. The full logits are never gathered: only per-token statistics travel.
    `vocab_size`: the real vocabulary when the logits carry padding columns past it (Megatron's
    padded vocabulary); those get no probability and no gradient, as if masked to -inf.
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} is not in [0, 1]")
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, ignore_index, label_smoothing, vocab_size)
