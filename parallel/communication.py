"""The autograd functions that move activations between tensor-parallel ranks (Megatron's f,
g and the sequence-parallel gather/scatter), on the collectives of megafp8.collectives.

All take the process group as an argument; none keeps global state. Sequence-parallel
tensors are split along dim 0 (Megatron's [sequence, batch, hidden] layout), tensor-parallel
outputs along the last dim.
"""

from __future__ import annotations

import torch

from megafp8.collectives import all_gather, all_reduce, group_size, reduce_scatter, split


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient (the input feeds every rank's shard)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce forward (sum of partial results); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.group, dim=-1), None


class _ScatterToTensorParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, dim=-1), None


class _GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather along the sequence (dim 0) forward; reduce-scatter the gradient, since each
    rank's copy of the gathered tensor fed a different shard of the next GEMM."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Sum partial results and keep this rank's sequence shard forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, dim=0), None


def copy_to_tensor_parallel(x, group):
    return _CopyToTensorParallel.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tensor_parallel(x, group):
    return _ReduceFromTensorParallel.apply(x, group) if group_size(group) > 1 else x


def gather_from_tensor_parallel(x, group):
    return _GatherFromTensorParallel.apply(x, group) if group_size(group) > 1 else x


def scatter_to_tensor_parallel(x, group):
    return _ScatterToTensorParallel.apply(x, group) if group_size(group) > 1 else x


def gather_from_sequence_parallel(x, group):
    return _GatherFromSequenceParallel.apply(x, group) if group_size(group) > 1 else x


def reduce_scatter_to_sequence_parallel(x, group):
    return _ReduceScatterToSequenceParallel.apply(x, group) if group_size(group) > 1 else x
