"""The collectives under the parallel mappings, including the fallback for backends without
reduce-scatter (older gloo; torch 2.13's gloo has it, so the fallback is forced here)."""

import torch
import torch.distributed as dist

from megafp8 import collectives
from megafp8.collectives import all_gather, reduce_scatter, split

from ..multiprocess import run_on_ranks


def body(rank, world_size):
    group = dist.group.WORLD
    full = torch.randn(world_size * 6, 4 * world_size, generator=torch.Generator().manual_seed(0))
    out = {
        "gather_rows": torch.equal(all_gather(split(full, group, 0), group, 0), full),
        "gather_last_dim": torch.equal(all_gather(split(full, group, -1), group, -1), full),
        "gather_fp8_bytes": torch.equal(
            all_gather(split(full, group, 0).to(torch.float8_e4m3fn), group, 0).float(),
            full.to(torch.float8_e4m3fn).float(),
        ),
    }
    # Each rank contributes (rank + 1) * full; rank r keeps rows r of the sum.
    contribution = full * (rank + 1)
    expected = (full * sum(range(1, world_size + 1))).chunk(world_size)[rank]
    native = reduce_scatter(contribution, group)
    collectives.backends_without_reduce_scatter.add(dist.get_backend(group))
    try:
        fallback = reduce_scatter(contribution, group)
    finally:
        collectives.backends_without_reduce_scatter.discard(dist.get_backend(group))
    out["reduce_scatter"] = torch.allclose(native, expected, rtol=1e-6, atol=1e-6)
    out["fallback_equals_native"] = torch.equal(native, fallback)
    # The asynchronous forms: a handle whose wait() returns what the synchronous form does.
    out["reduce_scatter_async"] = torch.equal(
        reduce_scatter(contribution, group, async_op=True).wait(), native
    )
    columns = full.chunk(world_size, dim=1)[rank].contiguous()
    out["gather_columns"] = torch.equal(collectives.all_gather_columns(columns, group), full)
    out["gather_columns_async"] = torch.equal(
        collectives.all_gather_columns(columns, group, async_op=True).wait(), full
    )
    # FP8 columns (the transposed inputs the weight-gradient GEMM reads) travel and join as bytes.
    fp8 = full.to(torch.float8_e4m3fn)
    out["gather_fp8_columns"] = torch.equal(
        collectives.all_gather_columns(fp8.chunk(world_size, dim=1)[rank].contiguous(), group).view(
            torch.uint8
        ),
        fp8.view(torch.uint8),
    )
    return out


def test_collectives_and_reduce_scatter_fallback():
    for result in run_on_ranks(body, 2):
        assert all(result.values()), result
