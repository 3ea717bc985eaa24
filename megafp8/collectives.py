"""Collectives on process groups passed in by the caller: the one place that knows torch's
collective names across versions and what to do where a backend lacks reduce-scatter.

It sits below every package (the FP8 core gathers its sequence-parallel inputs with it; the
parallel engines, the optimizer and checkpoints use it too) and keeps no state but that.
Tensors are split along dim 0 unless a dim is given. One-byte tensors (FP8) travel as raw
bytes: every backend moves uint8, and an FP8 all-gather moves half of what a bf16 one does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the single-tensor collectives; earlier versions only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Backends found not to implement reduce-scatter (older gloo) take the all-reduce fallback.
backends_without_reduce_scatter: set = set()


def group_size(group) -> int:
    """The number of ranks in `group` (1 without one)."""
    return dist.get_world_size(group) if group is not None else 1


def rank_in(group) -> int:
    """This process's rank within `group` (0 without one)."""
    return dist.get_rank(group) if group_size(group) > 1 else 0


# -- into preallocated outputs (flat buffers, asynchronous) --------------------------------------


def all_gather_into(out: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """Every rank's `tensor` concatenated along dim 0 into `out` (size x as many rows)."""
    return _all_gather_single(_bytes(out), _bytes(tensor), group=group, async_op=async_op)


class _Finishing:
    """A collective's handle whose wait() also runs what must follow it (the fallback's copy, a
    reordering) and returns that follow-up's result."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self):
        """Wait for the collective; returns what the follow-up returns."""
        if self.work is not None:
            self.work.wait()
        return self.then()


def reduce_scatter_into(out: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """The sum of `tensor` over the ranks, this rank's equal slice of dim 0 written into `out`.

    Where the backend has no reduce-scatter, the sum is an all-reduce: of `tensor` itself when
    `out` is its own slice (a flat buffer, which then holds the whole sum), else of a copy;
    the slice is copied into `out` on wait().
    """
    backend = dist.get_backend(group)
    if backend not in backends_without_reduce_scatter:
        try:
            return _reduce_scatter_single(out, tensor, group=group, async_op=async_op)
        except RuntimeError:  # refused before any communication, alike on every rank
            backends_without_reduce_scatter.add(backend)
    start = tensor.data_ptr()
    in_place = start <= out.data_ptr() < start + tensor.numel() * tensor.element_size()
    summed = tensor if in_place else tensor.clone()
    work = dist.all_reduce(summed, group=group, async_op=async_op)
    mine = summed.chunk(group_size(group), dim=0)[rank_in(group)]

    def copy():
        if out.data_ptr() != mine.data_ptr():
            out.copy_(mine)

    handle = _Finishing(work, copy)
    if not async_op:
        handle.wait()
        return None
    return handle


def exchange(send: torch.Tensor, to: int, receive: torch.Tensor, source: int, group) -> list:
    """Send `send` to rank `to` of `group` while receiving into `receive` from rank `source`
    (ranks within the group), asynchronously: the handles to wait for."""
    ops = [
        dist.P2POp(dist.isend, _bytes(send), dist.get_global_rank(group, to), group),
        dist.P2POp(dist.irecv, _bytes(receive), dist.get_global_rank(group, source), group),
    ]
    return dist.batch_isend_irecv(ops)


# -- returning new tensors ------------------------------------------------------------------------


def all_gather(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    size = group_size(group)
    if size == 1:
        return x
    out = (
        x.new_empty((size * x.shape[0], *x.shape[1:]))
        if dim == 0
        else x.new_empty((size, *x.shape))
    )
    all_gather_into(out, x.contiguous() if dim == 0 else x.unsqueeze(0).contiguous(), group)
    return out if dim == 0 else torch.cat(out.unbind(0), dim=dim)


def all_gather_columns(t: torch.Tensor, group, async_op: bool = False):
    """Concatenate every rank's 2-D `t` along dim 1, in rank order (as one contiguous tensor).
    With `async_op`, a handle whose wait() returns it."""
    size = group_size(group)
    if size == 1:
        return _Finishing(None, lambda: t) if async_op else t
    stacked = t.new_empty((size, *t.shape))
    work = all_gather_into(stacked, t.unsqueeze(0).contiguous(), group, async_op=async_op)
    handle = _Finishing(work, lambda: side_by_side(stacked))
    return handle if async_op else handle.wait()


def side_by_side(stacked: torch.Tensor) -> torch.Tensor:
    """The blocks of `stacked` (blocks, rows, columns) side by side, (rows, blocks x columns): a
    concatenation of byte views, which torch copies with wide loads (a permutation of FP8 data
    copies byte by byte, several times slower)."""
    return torch.cat(stacked.view(torch.uint8).unbind(0), dim=1).view(stacked.dtype)


def reduce_scatter(t: torch.Tensor, group, async_op: bool = False):
    """Sum `t` over the ranks and keep this rank's equal slice of dim 0. With `async_op`, a
    handle whose wait() returns it."""
    size = group_size(group)
    if size == 1:
        return _Finishing(None, lambda: t) if async_op else t
    if t.shape[0] % size:
        raise ValueError(f"cannot reduce-scatter {t.shape[0]} rows over {size} ranks")
    out = t.new_empty((t.shape[0] // size, *t.shape[1:]))
    handle = reduce_scatter_into(out, t.contiguous(), group, async_op=async_op)
    return _Finishing(handle, lambda: out) if async_op else out


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over the ranks, in place where `x` is contiguous; returns the result."""
    if group_size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


def split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's equal slice of `x` along `dim` (contiguous)."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(
            f"cannot split dimension {dim} of size {x.shape[dim]} into {size} equal parts"
        )
    return x.chunk(size, dim=dim)[rank_in(group)].contiguous()


def max_over(amax: torch.Tensor, group) -> torch.Tensor:
    """The MAX of `amax` over `group`; NaN counts as +inf, so every rank sees it."""
    amax = torch.nan_to_num(amax.float(), nan=float("inf"), posinf=float("inf"))
    if group_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t
