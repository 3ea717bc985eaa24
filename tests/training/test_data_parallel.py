"""Data parallelism and the mixed-precision optimizer: dp = 2 and the distributed optimizer
train exactly like one process on the same global batch."""

import math

import pytest
import torch
from megafp8.models import preset
from megafp8.models.transformer import TransformerLM
from megafp8.parallel import ParallelGroups
from megafp8.parallel.data_parallel import GradientBuffer

from megafp8.training.optimizer import MixedPrecisionAdamW

from ..multiprocess import run_on_ranks

GLOBAL_BATCH, SEQ, STEPS = 4, 32, 3


def global_batches(vocab):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def train_tiny(
    rank, world_size, distributed, bucket_size, dtype=torch.float32, poison_step=None, lazy=False
):
    groups = ParallelGroups()
    config = preset("gpt-tiny")
    model = TransformerLM(config, seed=0, dtype=dtype)
    buffer = GradientBuffer(
        model.parameters(), groups.dp_group, bucket_size=bucket_size, shard=distributed
    )
    optimizer = MixedPrecisionAdamW(
        model.named_parameters(),
        buffer,
        lr=1e-2,
        weight_decay=0.1,
        clip_grad=0.5,
        dp_group=groups.dp_group,
        distributed=distributed,
    )
    per_rank = GLOBAL_BATCH // world_size
    losses, norms, applied = [], [], []
    for step, batch in enumerate(global_batches(config.vocab_size)):
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        if lazy:  # stale values, which the first writer of each main_grad must not add to
            buffer.data.fill_(float("nan"))
        buffer.zero(lazy=lazy)
        total = torch.zeros(())
        for i in range(per_rank):  # micro-batches of one sequence
            buffer.set_sync(i == per_rank - 1)
            tokens = mine[i : i + 1]
            loss = model(tokens[:, :-1], tokens[:, 1:]).float().mean()
            if step == poison_step:
                loss = loss * float("nan")
            (loss / per_rank).backward()
            total += loss.detach()
        buffer.finish()
        ok, norm = optimizer.step()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / GLOBAL_BATCH)
        norms.append(norm)
        applied.append(ok)
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return losses, norms, applied, params, optimizer.state_for_checkpoint()


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(train_tiny, 1, False, 10_000)[0]


@pytest.mark.parametrize(
    "distributed,bucket_size,lazy",
    [
        (False, 10_000, False),
        (True, 10_000, False),
        (True, 1_000_000, False),
        (False, 10_000, True),
    ],
)
def test_dp2_matches_one_process(reference, distributed, bucket_size, lazy):
    ref_losses, ref_norms, _, ref_params, ref_states = reference
    for losses, norms, applied, params, states in run_on_ranks(
        train_tiny, 2, distributed, bucket_size, torch.float32, None, lazy
    ):
        assert all(applied)
        for a, b in zip(losses, ref_losses):
            assert math.isclose(a, b, rel_tol=1e-5), (losses, ref_losses)
        for a, b in zip(norms, ref_norms):
            assert math.isclose(a, b, rel_tol=1e-4), (norms, ref_norms)
        # atol: the key biases' true gradient is 0 (softmax ignores a shift shared by all keys), so
        # Adam turns their rounding noise into steps of up to ~lr * 1e-3 that differ per layout.
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=5e-5, msg=name)
        # The distributed optimizer's assembled states equal the whole-model optimizer's.
        for name, entry in states.items():
            for key, tensor in entry.items():
                torch.testing.assert_close(
                    tensor,
                    ref_states[name][key],
                    rtol=1e-3,
                    atol=5e-5 if key == "master" else 1e-6,
                    msg=f"{name} {key}",
                )


def test_buckets_overlap_and_cover_every_parameter():
    model = TransformerLM(preset("gpt-tiny"), seed=0)
    buffer = GradientBuffer(model.parameters(), None, bucket_size=5_000)
    assert len(buffer.buckets) > 3
    covered = sorted(
        (p.main_grad_offset, p.main_grad_offset + p.numel()) for p in model.parameters()
    )
    assert covered[0][0] == 0 and covered[-1][1] == buffer.numel
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # contiguous, no overlap
    # The first bucket holds the last parameters: backward produces their gradients first.
    assert buffer.buckets[0].params[0] is list(model.parameters())[-1]


def test_a_parameter_can_have_a_bucket_of_its_own():
    # The tied embedding's rule: a bucket holding only it, so two pipeline stages whose other
    # parameters differ still split it over dp at the same elements (the 4- and 8-process
    # trainer tests check the sharded case).
    model = TransformerLM(preset("gpt-tiny"), seed=0)
    params = list(model.parameters())
    middle = params[len(params) // 2]
    buffer = GradientBuffer(params, None, bucket_size=10**9, own_bucket=[middle])
    # One bucket would hold everything; the chosen parameter splits it into three.
    assert [b.params for b in buffer.buckets] == [
        params[: len(params) // 2 : -1],
        [middle],
        params[len(params) // 2 - 1 :: -1],
    ]
    alone = buffer.bucket_of[middle]
    assert alone.end - alone.start == middle.numel() == (alone.end - middle.main_grad_offset)
    with pytest.raises(ValueError, match="bucket_size"):
        GradientBuffer(params, None, bucket_size=0)


def test_the_gradient_norm_is_accurate_whatever_the_size():
    # The CPU's fp32 norm adds in sequence: 4e-4 off at 4M elements, and dp slices rounded apart.
    from megafp8.training.optimizer import squared_norm

    g = torch.Generator().manual_seed(5)
    for n in (1000, 262_144, 4_000_000):
        x = torch.randn(n, generator=g) * torch.rand(n, generator=g)
        exact = x.double().square().sum()
        assert abs(squared_norm(x).double() - exact) / exact < 1e-6, n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gradient_norms_on_the_gpu_are_accurate_and_keep_non_finite_values():
    from megafp8.training.optimizer import squared_norms

    g = torch.Generator().manual_seed(5)
    tensors = [
        (torch.randn(n, generator=g) * torch.rand(n, generator=g)).cuda()
        for n in (7, 1000, 70_000, 4_000_000)
    ]
    exact = torch.stack([t.double().square().sum() for t in tensors])
    norms = squared_norms(tensors)
    assert norms.dtype == torch.float32 and ((norms.double() - exact).abs() / exact).max() < 1e-6
    tensors[1][3] = float("inf")
    tensors[2][5] = float("nan")
    norms = squared_norms(tensors)
    assert norms[1].isinf() and norms[2].isnan() and norms[3].isfinite()


def deferred_param_gather(rank, world_size):
    """One distributed-optimizer step with overlap_param_gather: (parameters unchanged before any
    wait, the first layer's changed by its wait and no other, all equal to a gather at once after
    finish_param_gather)."""
    groups = ParallelGroups()
    config = preset("gpt-tiny")
    tokens = global_batches(config.vocab_size)[0][rank : rank + 1]
    results = []
    for overlap in (False, True):
        model = TransformerLM(config, seed=0)
        buffer = GradientBuffer(model.parameters(), groups.dp_group, bucket_size=10_000, shard=True)
        optimizer = MixedPrecisionAdamW(
            model.named_parameters(),
            buffer,
            lr=1e-2,
            dp_group=groups.dp_group,
            distributed=True,
            overlap_param_gather=overlap,
        )
        buffer.zero()
        model(tokens[:, :-1], tokens[:, 1:]).float().mean().backward()
        buffer.finish()
        before = [p.detach().clone() for p in model.parameters()]
        assert optimizer.step()[0]
        results.append((model, optimizer, before))
    (plain, _, _), (model, optimizer, before) = results
    unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    first_layer = list(model.layers["0"].parameters())
    optimizer.wait_for_params(first_layer)
    first_changed = all(
        not torch.equal(p, b)
        for p, b in zip(model.parameters(), before)
        if any(p is q for q in first_layer)
    )
    others_unchanged = all(
        torch.equal(p, b)
        for p, b in zip(model.parameters(), before)
        if not any(p is q for q in first_layer)
        and buffer.bucket_of[p] not in {buffer.bucket_of[q] for q in first_layer}
    )
    optimizer.finish_param_gather()
    equal = all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    return unchanged, first_changed, others_unchanged, equal


def test_overlapped_param_gather_is_deferred_to_the_forward_that_needs_it():
    for unchanged, first_changed, others_unchanged, equal in run_on_ranks(deferred_param_gather, 2):
        assert unchanged and first_changed and others_unchanged and equal


def test_nonfinite_step_is_skipped_on_every_rank():
    results = run_on_ranks(train_tiny, 2, True, 10_000, torch.float32, 1)
    for _, norms, applied, _, _ in results:
        assert applied == [True, False, True]
        assert math.isnan(norms[1])


def test_bf16_parameters_keep_fp32_masters():
    losses, _, applied, params, states = run_on_ranks(train_tiny, 1, False, 10_000, torch.bfloat16)[
        0
    ]
    assert all(applied)
    for name, entry in states.items():
        assert entry["master"].dtype == torch.float32
        torch.testing.assert_close(
            entry["master"].to(torch.bfloat16).float(), params[name], rtol=0, atol=0
        )
