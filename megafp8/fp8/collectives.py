"""Collectives along dim 0 (and the column gather the FP8 core needs), on process groups
passed in by the caller. The parallel engines build their autograd mappings on these.

One-byte tensors (FP8) travel as raw bytes: every backend moves uint8, and an FP8 all-gather
moves half of what a bf16 one does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the single-tensor collectives; 2.11 (the GPU machines) has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Backends found not to implement reduce-scatter (older gloo) take the all-reduce fallback.
_no_reduce_scatter: set = set()


def group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's `t` along dim 0, in rank order."""
    size = group_size(group)
    if size == 1:
        return t
    out = t.new_empty((size * t.shape[0], *t.shape[1:]))
    _all_gather_single(_bytes(out), _bytes(t.contiguous()), group=group)
    return out


def all_gather_columns(t: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's 2-D `t` along dim 1, in rank order."""
    size = group_size(group)
    if size == 1:
        return t
    stacked = all_gather_rows(t.unsqueeze(0), group)
    return stacked.permute(1, 0, 2).reshape(t.shape[0], size * t.shape[1])


def reduce_scatter_rows(t: torch.Tensor, group) -> torch.Tensor:
    """Sum `t` over the ranks and keep this rank's equal slice of dim 0."""
    size = group_size(group)
    if size == 1:
        return t
    if t.shape[0] % size:
        raise ValueError(f"cannot reduce-scatter {t.shape[0]} rows over {size} ranks")
    t = t.contiguous()
    backend = dist.get_backend(group)
    if backend not in _no_reduce_scatter:
        out = t.new_empty((t.shape[0] // size, *t.shape[1:]))
        try:
            _reduce_scatter_single(out, t, group=group)
            return out
        except RuntimeError:  # refused before any communication, alike on every rank
            _no_reduce_scatter.add(backend)
    summed = t.clone()
    dist.all_reduce(summed, group=group)
    return summed.chunk(size, dim=0)[dist.get_rank(group)].contiguous()


def max_over(amax: torch.Tensor, group) -> torch.Tensor:
    """The MAX of `amax` over `group`; NaN counts as +inf, so every rank sees it."""
    amax = torch.nan_to_num(amax.float(), nan=float("inf"), posinf=float("inf"))
    if group_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t
