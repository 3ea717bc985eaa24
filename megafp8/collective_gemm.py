"""GEMMs overlapped with the sequence-parallel collective around them (`--tp-comm-overlap`).

Under sequence parallelism the input of a column-parallel GEMM is all-gathered before it and the
output of a row-parallel GEMM reduce-scattered after it, on the critical path of every layer.
Here both are cut into blocks of rows, one per rank, so that a transfer runs while a block is
multiplied (the decomposition of Megatron's `--tp-comm-overlap` and of "collective matmul"):

- `gathered_gemm`: the all-gather runs while this rank multiplies its own block; the other
  ranks' blocks follow once they are in.
- `gemm_reduce_scatter`: a ring. At step s rank r multiplies block (r - s - 1) mod tp, adds the
  partial sum received from rank r - 1 and sends it on to rank r + 1 while the next block is
  multiplied; after tp steps each rank holds its own block summed over every rank. A bias goes
  into the epilogue of the GEMM of the rank's own block, so the sum holds it once.
- `gemm_then_reduce_scatter`: the GEMM whole, its output's reduce-scatter beside the caller's
  next GEMM (the backward of a column-parallel linear: the input gradient's reduce-scatter
  beside the weight-gradient GEMM).

The GEMM is a callable `gemm(rows, out)` writing `rows @ W` into `out` (the FP8 linears pass
theirs). Nothing waits on the host: the transfers run on NCCL's stream, or on the copy engines
where the group was given to `megafp8.symmetric_memory.use_copy_engines` (there the reduce-scatter
is no ring: each rank copies its block's partial sums from every peer beside its own block's
GEMM), ordered against the compute stream by events, so both work inside CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import symmetric_memory
from .collectives import all_gather_columns as _nccl_all_gather_columns
from .collectives import (
    all_gather_into,
    exchange,
    group_size,
    rank_in,
    reduce_scatter,
)

Gemm = Callable[[torch.Tensor, torch.Tensor], object]


def gathered_gemm(
    local: torch.Tensor, group, gemm: Gemm, out: torch.Tensor, keep_gathered: bool = True
) -> torch.Tensor | None:
    """`all_gather(local) @ W` into `out` (rows in rank order), the gather overlapped with the GEMM
    of this rank's own rows. Returns the gathered input, or None without `keep_gathered` (the
    copy engines then skip this rank's own block)."""
    return _gathered_gemm(local, group, gemm, out, keep_gathered)[0]


def gathered_gemm_and_columns(
    local: torch.Tensor, columns: torch.Tensor, group, gemm: Gemm, out: torch.Tensor
):
    """`gathered_gemm(local, group, gemm, out, keep_gathered=False)`, and a handle whose wait()
    returns `all_gather_columns(columns, group)`, gathered beside the GEMM of the other ranks'
    rows (the output gradient and its transpose, in the backward of a row-parallel linear). On
    the copy engines both travel in one round of barriers."""
    return _gathered_gemm(local, group, gemm, out, False, columns)[1]


def _gathered_gemm(local, group, gemm, out, keep_gathered, columns=None):
    size, rank, rows = group_size(group), rank_in(group), local.shape[0]
    gathered = local.new_empty((size * rows, *local.shape[1:]))
    copy_engines = symmetric_memory.workspace(group)
    columns_work = None
    if copy_engines is None:
        work = all_gather_into(gathered, local, group, async_op=True)
    elif columns is None:
        work = copy_engines.all_gather_into(gathered, local, own_block=keep_gathered)
    else:
        work, columns_work = copy_engines.all_gather_rows_and_columns(gathered, local, columns)
    mine = slice(rank * rows, (rank + 1) * rows)
    gemm(local, out[mine])
    work.wait()
    if columns is not None and columns_work is None:
        columns_work = _nccl_all_gather_columns(columns, group, async_op=True)
    for others in (slice(0, mine.start), slice(mine.stop, size * rows)):
        if others.stop > others.start:
            gemm(gathered[others], out[others])
    return (gathered if keep_gathered else None), columns_work


def gemm_reduce_scatter(
    a: torch.Tensor,
    group,
    gemm: Gemm,
    out_features: int,
    dtype: torch.dtype,
    own_gemm: Gemm | None = None,
) -> torch.Tensor:
    """This rank's block of rows of `sum over ranks (a @ W)` (a reduce-scatter of the GEMM's
    output), each block's transfer overlapped with the GEMM of the next (module docstring).
    `own_gemm` multiplies this rank's own block instead of `gemm` (`gemm` with a bias in its
    epilogue: the sum then holds the bias once, with no pass of its own)."""
    own_gemm = own_gemm or gemm
    size, rank = group_size(group), rank_in(group)
    if a.shape[0] % size:
        raise ValueError(f"cannot reduce-scatter {a.shape[0]} rows over {size} ranks")
    copy_engines = symmetric_memory.workspace(group)
    if copy_engines is not None:
        return copy_engines.gemm_reduce_scatter(a, gemm, own_gemm, out_features, dtype)
    rows = a.shape[0] // size
    partial = received = sent = None
    handles = ()
    for step in range(size):
        block = (rank - step - 1) % size
        partial = torch.empty((rows, out_features), dtype=dtype, device=a.device)
        (own_gemm if block == rank else gemm)(a[block * rows : (block + 1) * rows], partial)
        for handle in handles:
            handle.wait()
        if received is not None:
            partial += received
        if step < size - 1:  # `sent` stays referenced until its transfer is waited for
            sent, received = partial, torch.empty_like(partial)
            handles = exchange(sent, (rank + 1) % size, received, (rank - 1) % size, group)
    return partial


def gemm_then_reduce_scatter(
    a: torch.Tensor, group, gemm: Gemm, out_features: int, dtype: torch.dtype
):
    """A handle whose wait() returns this rank's block of rows of `sum over ranks (a @ W)`: the
    GEMM runs now, the reduce-scatter of its output while the caller computes until wait() (the
    weight-gradient GEMM, in the backward of a column-parallel linear). On the copy engines the
    GEMM writes straight into the buffer the peers read."""
    copy_engines = symmetric_memory.workspace(group)
    if copy_engines is not None:
        return copy_engines.reduce_scatter_after(
            lambda out: gemm(a, out), a.shape[0], out_features, dtype
        )
    out = torch.empty((a.shape[0], out_features), dtype=dtype, device=a.device)
    gemm(a, out)
    return reduce_scatter(out, group, async_op=True)


def all_gather_columns(t: torch.Tensor, group):
    """A handle whose wait() returns every rank's 2-D `t` concatenated along dim 1 (the
    transposed FP8 blocks the weight-gradient GEMM reads), gathered while other work runs."""
    copy_engines = symmetric_memory.workspace(group)
    if copy_engines is None:
        return _nccl_all_gather_columns(t, group, async_op=True)
    return copy_engines.all_gather_columns(t)
