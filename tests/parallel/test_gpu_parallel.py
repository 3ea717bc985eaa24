"""Tensor and sequence parallelism with FP8 on GPUs over NCCL (needs 2 GPUs)."""

import pytest
import torch
import torch.distributed as dist
from megafp8.parallel.layers import ColumnParallelLinear, RowParallelLinear

from megafp8 import DelayedScaling, fp8_autocast

from ..fp8.helpers import rel_err
from ..multiprocess import run_on_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]
HIDDEN, FFN, SEQ, BATCH = 256, 1024, 64, 4


def mlp(group, sequence_parallel):
    torch.manual_seed(0)
    kwargs = dict(tp_group=group, dtype=torch.bfloat16, device="cuda")
    return (
        ColumnParallelLinear(HIDDEN, FFN, sequence_parallel=sequence_parallel, **kwargs),
        RowParallelLinear(
            FFN, HIDDEN, input_is_parallel=True, sequence_parallel=sequence_parallel, **kwargs
        ),
    )


def step(layers, x, dy, group):
    x = x.clone().requires_grad_(True)
    with fp8_autocast(recipe=DelayedScaling(amax_history_len=4), amax_reduction_group=group):
        y = layers[1](torch.nn.functional.gelu(layers[0](x)))
    y.backward(dy)
    return y.float(), x.grad.float(), layers[0].weight.grad.float(), layers[1].weight.grad.float()


def body(rank, tp):
    group = dist.group.WORLD
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [
        (
            torch.randn(SEQ, BATCH, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16),
            torch.randn(SEQ, BATCH, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16),
        )
        for _ in range(3)
    ]
    ref, errors = mlp(None, False), []
    refs = [step(ref, x, dy, None) for x, dy in batches]
    for sp in (False, True):
        layers = mlp(group, sp)
        shard = (lambda t: t.chunk(tp, 0)[rank]) if sp else (lambda t: t)
        for (x, dy), r in zip(batches, refs):
            y, dx, dw1, dw2 = step(layers, shard(x), shard(dy), group)
            errors.append(
                max(
                    rel_err(y, shard(r[0])),
                    rel_err(dx, shard(r[1])),
                    rel_err(dw1, r[2].chunk(tp, 0)[rank]),
                    rel_err(dw2, r[3].chunk(tp, 1)[rank]),
                )
            )
    return errors


def test_fp8_tensor_and_sequence_parallel_over_nccl_equal_one_gpu():
    for errors in run_on_ranks(body, 2, backend="nccl"):
        # Same scales and values as one GPU; bf16 outputs and another summation order differ
        # by bf16 rounding at most (2^-8 relative per element).
        assert max(errors) < 4e-3, errors


def groups_body(rank, world_size):
    from megafp8.parallel import ParallelGroups

    sums = {}
    for tp, pp in ((2, 1), (1, 2)):
        groups = ParallelGroups(tp, pp)
        for name in ("tp", "dp", "pp", "model_parallel", "amax_reduction", "embedding"):
            t = torch.tensor([float(rank)], device="cuda")
            dist.all_reduce(t, group=getattr(groups, f"{name}_group"))
            sums[(tp, pp, name)] = (t.item(), float(sum(getattr(groups, f"{name}_ranks"))))
    return sums


def test_process_groups_over_nccl():
    for sums in run_on_ranks(groups_body, 2, backend="nccl"):
        assert all(got == expected for got, expected in sums.values()), sums
