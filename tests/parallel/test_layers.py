"""Tensor- and sequence-parallel linears (gloo, tp = 2 and 4) against the same layers at tp = 1."""

import pytest
import torch
import torch.distributed as dist
from megafp8.parallel.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

from megafp8 import DelayedScaling, collectives, fp8_autocast

from ..fp8.helpers import gemm_error_bound, rel_err
from ..multiprocess import run_on_ranks

HIDDEN, FFN, SEQ, BATCH = 32, 64, 16, 4
RECIPE = DelayedScaling(amax_history_len=4)


def build(group, sequence_parallel, overlap=False):
    """An MLP's two linears, from the global seed (the same full weights at any tp size);
    `overlap`: their collectives overlapped with the GEMMs (tp_comm_overlap)."""
    torch.manual_seed(0)
    fc1 = ColumnParallelLinear(
        HIDDEN, FFN, tp_group=group, sequence_parallel=sequence_parallel, tp_comm_overlap=overlap
    )
    fc2 = RowParallelLinear(
        FFN,
        HIDDEN,
        tp_group=group,
        input_is_parallel=True,
        sequence_parallel=sequence_parallel,
        tp_comm_overlap=overlap,
    )
    generator = torch.Generator().manual_seed(1)  # non-zero biases, the same on every rank
    full_b1, full_b2 = (
        torch.randn(FFN, generator=generator),
        torch.randn(HIDDEN, generator=generator),
    )
    with torch.no_grad():
        fc1.bias.copy_(full_b1.chunk(fc1.tp_size)[dist.get_rank(group) if group else 0])
        fc2.bias.copy_(full_b2)
    return fc1, fc2


def mlp_step(fc1, fc2, x, dy, fp8, group):
    x = x.clone().requires_grad_(True)
    for p in (*fc1.parameters(), *fc2.parameters()):
        p.grad = None
    with fp8_autocast(enabled=fp8, recipe=RECIPE, amax_reduction_group=group):
        y = fc2(torch.nn.functional.gelu(fc1(x)))
    y.backward(dy)
    return y.detach(), x.grad, fc1.weight.grad, fc1.bias.grad, fc2.weight.grad, fc2.bias.grad


def scales_of(fc1, fc2):
    return {
        f"{name}.{role}": layer.fp8_scaling[role].scale.item()
        for name, layer in (("fc1", fc1), ("fc2", fc2))
        for role in layer.fp8_scaling
    }


def compare_mlp(rank, tp, group):
    """For each (fp8, sequence_parallel, tp_comm_overlap): the worst relative error of every output
    and gradient against this rank's part of the tp = 1 result, over three steps; the final
    scales; and for each fp8, the largest difference of the overlapped run from the plain one."""
    g = torch.Generator().manual_seed(2)
    batches = [
        (torch.randn(SEQ, BATCH, HIDDEN, generator=g), torch.randn(SEQ, BATCH, HIDDEN, generator=g))
        for _ in range(3)
    ]
    errors, scales = {}, {}
    for fp8 in (False, True):
        ref1, ref2 = build(None, False)
        refs = [mlp_step(ref1, ref2, x, dy, fp8, None) for x, dy in batches]
        if fp8:
            scales["reference"] = scales_of(ref1, ref2)
        runs = {}
        for sp, overlap in ((False, False), (True, False), (True, True)):
            fc1, fc2 = build(group, sp, overlap)
            assert torch.equal(fc1.weight, ref1.weight.chunk(tp, 0)[rank])
            assert torch.equal(fc2.weight, ref2.weight.chunk(tp, 1)[rank])
            shard = (lambda t: t.chunk(tp, 0)[rank]) if sp else (lambda t: t)
            worst, runs[overlap] = 0.0, []
            for (x, dy), ref in zip(batches, refs):
                out = mlp_step(fc1, fc2, shard(x), shard(dy), fp8, group)
                runs[overlap].append(out)
                b2 = out[5].clone()
                if sp:  # the row bias gradient covers this rank's sequence shard: sum it
                    dist.all_reduce(b2, group=group)
                expected = (
                    shard(ref[0]),
                    shard(ref[1]),
                    ref[2].chunk(tp, 0)[rank],
                    ref[3].chunk(tp, 0)[rank],
                    ref[4].chunk(tp, 1)[rank],
                    ref[5],
                )
                for got, want in zip((*out[:5], b2), expected):
                    worst = max(worst, rel_err(got, want))
            errors[(fp8, sp, overlap)] = worst
            if fp8:
                scales[(sp, overlap)] = scales_of(fc1, fc2)
        errors[(fp8, "overlapped vs plain")] = max(
            (a - b).abs().max().item()
            for plain, overlapped in zip(runs[False], runs[True])
            for a, b in zip(plain, overlapped)
        )
    return errors, scales


def sequence_parallel_traffic(rank, tp, group):
    """dtypes and sizes of the all-gathers of one FP8 sequence-parallel step."""
    gathered = []
    original = collectives._all_gather_single

    def recording(out, inp, group=None, async_op=False):
        gathered.append((str(inp.dtype), inp.numel()))
        return original(out, inp, group=group, async_op=async_op)

    collectives._all_gather_single = recording
    try:
        fc1, _ = build(group, True)
        x = torch.randn(SEQ // tp, BATCH, HIDDEN, requires_grad=True)
        with fp8_autocast(recipe=RECIPE, amax_reduction_group=group):
            y = fc1(x)
        y.sum().backward()
    finally:
        collectives._all_gather_single = original
    return gathered


def errors_for_bad_sizes(group):
    messages = []
    for make in (
        lambda: ColumnParallelLinear(HIDDEN, 33, tp_group=group),
        lambda: RowParallelLinear(33, HIDDEN, tp_group=group),
        lambda: QKVParallelLinear(HIDDEN, 6, 3, 8, tp_group=group),
        lambda: RowParallelLinear(FFN, HIDDEN, tp_group=group, sequence_parallel=True),
    ):
        try:
            make()
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    # Delayed scaling without an amax group that covers tp cannot give the shards one scale.
    fc1, _ = build(group, True)
    x = torch.randn(SEQ // dist.get_world_size(group), BATCH, HIDDEN)
    try:
        for _ in range(2):
            with fp8_autocast(recipe=RECIPE):
                fc1(x)
        messages.append(None)
    except ValueError as error:
        messages.append(str(error))
    return messages


def compare_qkv(rank, tp, group):
    """Worst relative error of q, k, v and the input gradient against the tp = 1 layer's
    heads (this rank holds whole key/value groups), FP8 on and off."""
    heads, kv_heads, head_dim = 8, 4, 8
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(3))
    worst = 0.0
    for fp8 in (False, True):
        outputs = []
        for layer_group in (None, group):
            torch.manual_seed(0)
            qkv = QKVParallelLinear(HIDDEN, heads, kv_heads, head_dim, tp_group=layer_group)
            xi = x.clone().requires_grad_(True)
            with fp8_autocast(enabled=fp8, recipe=RECIPE, amax_reduction_group=layer_group):
                q, k, v = qkv.split_heads(qkv(xi))
            (q.sum() + 2 * k.sum() + 3 * v.sum()).backward()
            outputs.append((q, k, v, xi.grad))
        (q0, k0, v0, dx0), (q1, k1, v1, dx1) = outputs
        worst = max(
            worst,
            rel_err(q1, q0.chunk(tp, -2)[rank]),
            rel_err(k1, k0.chunk(tp, -2)[rank]),
            rel_err(v1, v0.chunk(tp, -2)[rank]),
            rel_err(dx1, dx0),
        )
    return worst


def body(rank, tp):
    group = dist.group.WORLD
    errors, scales = compare_mlp(rank, tp, group)
    return {
        "errors": errors,
        "scales": scales,
        "traffic": sequence_parallel_traffic(rank, tp, group),
        "bad": errors_for_bad_sizes(group),
        "qkv": compare_qkv(rank, tp, group),
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_mlp_equals_tp1(tp):
    results = run_on_ranks(body, tp)
    for rank, result in enumerate(results):
        errors = result["errors"]
        # Without FP8: the same sums in another order, so fp32 rounding.
        for layout in ((False, False), (True, False), (True, True)):
            assert errors[(False, *layout)] < 2e-6, errors
        # With FP8: amaxes reduced over tp give every shard the scales of the full tensors, so the
        # same values are quantized as at tp = 1 and only the summation order differs.
        for layout in ((False, False), (True, False), (True, True)):
            assert errors[(True, *layout)] < 1e-5, errors
        # The overlapped collectives (blocks of rows, a ring of partial sums, the bias added in the
        # GEMM of the rank's own block rather than after the sum) change only that order.
        for fp8 in (False, True):
            assert errors[(fp8, "overlapped vs plain")] < 1e-5, errors
        scales = result["scales"]
        reference = scales["reference"]
        assert scales[(False, False)] == scales[(True, False)] == scales[(True, True)] == reference
        assert reference == results[0]["scales"][(False, False)]

        k, m_local = HIDDEN, SEQ // tp * BATCH
        traffic = result["traffic"]
        assert ("torch.uint8", m_local * k) in traffic  # the input, gathered in FP8 for fprop
        assert traffic.count(("torch.uint8", m_local * k)) == 2  # and again, transposed, for wgrad
        assert not [t for t in traffic if t[0] != "torch.uint8" and t[1] >= m_local * k]

        assert result["qkv"] < 1e-5, result["qkv"]

        bad = result["bad"]
        assert "out_features=33 does not divide over" in bad[0]
        assert "in_features=33 does not divide over" in bad[1]
        assert "num_kv_heads=3 does not divide over" in bad[2]
        assert "needs input_is_parallel=True" in bad[3]
        assert "amax_reduction_group" in bad[4]


def test_fp8_error_against_fp64_stays_within_the_bound():
    torch.manual_seed(0)
    fc1 = ColumnParallelLinear(HIDDEN, FFN)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    with fp8_autocast(recipe=RECIPE):
        y = fc1(x)
    ref = x.double() @ fc1.weight.double().t() + fc1.bias.double()
    assert rel_err(y, ref) < gemm_error_bound(torch.float8_e4m3fn, torch.float8_e4m3fn)


def test_qkv_heads_split_into_groups():
    torch.manual_seed(0)
    qkv = QKVParallelLinear(HIDDEN, num_heads=8, num_kv_heads=2, head_dim=4)
    x = torch.randn(3, 5, HIDDEN)
    q, k, v = qkv.split_heads(qkv(x))
    assert q.shape == (3, 5, 8, 4) and k.shape == v.shape == (3, 5, 2, 4)
    full = qkv(x).view(3, 5, 2, 6, 4)  # per kv group: 4 query heads, k, v
    assert torch.equal(q[..., 4:8, :], full[..., 1, :4, :]) and torch.equal(
        v[..., 1, :], full[..., 1, 5, :]
    )
    with pytest.raises(ValueError, match="num_heads=8 is not a multiple of num_kv_heads=3"):
        QKVParallelLinear(HIDDEN, num_heads=8, num_kv_heads=3, head_dim=4)


def overridden_gemms_against_tp1(rank, tp):
    """For each GEMM overridden to high precision in turn, and the sequence-parallel MLP plain and
    overlapped: the worst relative error of its output and gradients against this rank's part of
    the tp = 1 MLP's (the row bias gradient summed over the group)."""
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(4)
    x, dy = (
        torch.randn(SEQ, BATCH, HIDDEN, generator=g),
        torch.randn(SEQ, BATCH, HIDDEN, generator=g),
    )
    shard = lambda t: t.chunk(tp, 0)[rank]  # noqa: E731
    errors = {}
    for override in ((True, False, False), (False, True, False), (False, False, True)):
        recipe = DelayedScaling(amax_history_len=4, override_linear_precision=override)
        for overlap in (None, False, True):  # None: tp = 1
            fc1, fc2 = build(None, False) if overlap is None else build(group, True, overlap)
            x_in = (x if overlap is None else shard(x)).clone().requires_grad_(True)
            with fp8_autocast(
                recipe=recipe, amax_reduction_group=None if overlap is None else group
            ):
                y = fc2(torch.nn.functional.gelu(fc1(x_in)))
            y.backward(dy if overlap is None else shard(dy))
            got = [y.detach(), x_in.grad, fc2.weight.grad, fc2.bias.grad, fc1.weight.grad]
            if overlap is None:
                reference = [
                    shard(got[0]),
                    shard(got[1]),
                    got[2].chunk(tp, 1)[rank],
                    got[3],
                    got[4].chunk(tp, 0)[rank],
                ]
                continue
            dist.all_reduce(got[3], group=group)
            errors[(override, overlap)] = max(map(rel_err, got, reference))
    return errors


def test_sequence_parallel_mlp_with_any_gemm_overridden_equals_tp1():
    # The overlapped row-parallel linear adds its bias in its own block's GEMM, once in the sum;
    # a high-precision wgrad gathers the input the forward gathered in FP8.
    for errors in run_on_ranks(overridden_gemms_against_tp1, 2):
        assert all(error < 2e-5 for error in errors.values()), errors
