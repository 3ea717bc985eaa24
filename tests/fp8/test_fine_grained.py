"""Fine-grained scaling (megafp8.fp8.fine_grained): rowwise (RowwiseScaling) and blockwise
(BlockwiseScaling) casts, their GEMMs, and an Fp8Linear's three GEMMs under each, against fp64
on fresh random data."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megafp8.parallel.data_parallel import GradientBuffer

from megafp8 import fp8_max
from megafp8.fp8 import (
    BlockwiseScaling,
    CurrentScaling,
    Fp8Linear,
    RowwiseScaling,
    fp8_autocast,
    fp8_health,
)
from megafp8.fp8.fine_grained import (
    blockwise_gemm,
    dequantize,
    quantize_blocks,
    quantize_rows,
    rowwise_gemm,
)

from ..multiprocess import run_on_ranks
from .helpers import UNIT_ROUNDOFF, gemm_error_bound, rel_err

E4M3 = torch.float8_e4m3fn


def fresh(*shape, seed=0):
    """Rows of different magnitudes (2^-6 .. 2^6), as tokens and channels are."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = 2.0 ** torch.randint(-6, 7, (shape[0], 1), generator=generator)
    return torch.randn(*shape, generator=generator) * magnitudes


def test_each_row_is_scaled_to_its_own_amax():
    """A row's largest magnitude lands on fp8_max; every element comes back within the
    format's unit roundoff (relative, above the row's subnormals); a row of zeros or one with
    an inf takes scale 1, without NaN elsewhere."""
    x = fresh(64, 96)
    x[3] = 0.0
    x[5, 7] = float("inf")
    counts = torch.zeros(3, dtype=torch.int64)
    q = quantize_rows(x, E4M3, saturation_out=counts)
    assert q.data.shape == (64, 96) and q.scale_inv.shape == (64, 1)
    assert quantize_rows(x.t(), E4M3).data.is_contiguous()  # row-major, as the GEMM takes it
    assert q.scale_inv[3].item() == 1.0 and q.scale_inv[5].item() == 1.0
    finite = [r for r in range(64) if r not in (3, 5)]
    values = q.data.float() * q.scale_inv
    peaks = q.data[finite].float().abs().amax(dim=1)
    assert torch.equal(peaks, torch.full_like(peaks, fp8_max(E4M3)))
    rows = x[finite]
    normal = rows.abs() >= rows.abs().amax(dim=1, keepdim=True) * 2.0**-8  # E4M3's normal span
    error = (values[finite] - rows).abs() / rows.abs()
    assert error[normal].max() <= UNIT_ROUNDOFF[E4M3]
    assert counts[1] == x.numel()


def test_power_of_two_scales_keep_each_row_within_a_factor_two_of_the_range():
    """Rounded down to a power of two (RowwiseScaling's default, as torchao's): a row's peak
    lands in [fp8_max / 2, fp8_max] (the lower end by rounding), nothing saturates, and the
    values come back within the format's rounding."""
    x = fresh(64, 96, seed=18)
    q = quantize_rows(x, E4M3, power_of_two=True)
    scales = q.scale_inv.reciprocal()
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))
    peaks = q.data.float().abs().amax(dim=1)
    assert (peaks >= fp8_max(E4M3) / 2).all() and (peaks <= fp8_max(E4M3)).all()
    normal = x.abs() >= x.abs().amax(dim=1, keepdim=True) * 2.0**-7
    error = ((q.data.float() * q.scale_inv) - x).abs() / x.abs()
    assert error[normal].max() <= UNIT_ROUNDOFF[E4M3]
    layer = Fp8Linear(96, 32, dtype=torch.float32)
    with fp8_autocast(recipe=RowwiseScaling(), collect_saturation=True):
        layer(x)
    scale = layer.fp8_scaling["input"].scale
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))


def test_an_outlier_costs_only_its_own_row():
    """One token with a 10^4 outlier: per-tensor scaling flushes the small rows, rowwise keeps
    each of them within its own rounding."""
    x = fresh(64, 128, seed=1) * 1e-3
    x[0, 0] = 1e4
    q = quantize_rows(x, E4M3)
    rowwise_error = rel_err((q.data.float() * q.scale_inv)[1:], x[1:])
    tensor_scale = fp8_max(E4M3) / x.abs().max()
    per_tensor = (x * tensor_scale).to(E4M3).float() / tensor_scale
    assert rowwise_error <= UNIT_ROUNDOFF[E4M3]
    assert rel_err(per_tensor[1:], x[1:]) > 10 * rowwise_error


def test_the_rowwise_gemm_is_the_product_of_the_dequantized_operands():
    a, b = quantize_rows(fresh(32, 64, seed=2), E4M3), quantize_rows(fresh(48, 64, seed=3), E4M3)
    want = (a.data.double() * a.scale_inv.double()) @ (b.data.double() * b.scale_inv.double()).t()
    got = rowwise_gemm(a, b, torch.float32)
    assert got.dtype == torch.float32 and rel_err(got, want) < 2.0**-8  # bf16 output


def reference(layer, x, dy):
    """y, dx, dW, db of `layer` in fp64."""
    x64 = x.detach().double().requires_grad_()
    w64 = layer.weight.detach().double().requires_grad_()
    b64 = layer.bias.detach().double().requires_grad_()
    y = x64 @ w64.t() + b64
    y.backward(dy.double())
    return y.detach(), x64.grad, w64.grad, b64.grad


RECIPES = {"rowwise": RowwiseScaling, "blockwise": BlockwiseScaling}


def test_blocks_are_scaled_to_their_own_amaxes():
    """1 x 128 and 128 x 128 blocks: each block's peak lands on fp8_max, every element comes
    back within the format's rounding, and the inverse scales are laid out by block."""
    x = fresh(256, 384, seed=19) * fresh(1, 384, seed=20).abs()  # magnitudes along both axes
    for block, grid in (((1, 128), (256, 3)), ((128, 128), (2, 3))):
        q = quantize_blocks(x, E4M3, block)
        assert q.scale_inv.shape == grid and q.data.is_contiguous()
        tiles = q.data.float().abs().view(grid[0], -1, grid[1], 128).amax(dim=(1, 3))
        assert torch.equal(tiles, torch.full_like(tiles, fp8_max(E4M3)))
        values = dequantize(q)
        block_peak = x.abs().view(grid[0], -1, grid[1], 128).amax(dim=(1, 3), keepdim=True)
        normal = (x.abs().view(grid[0], -1, grid[1], 128) >= block_peak * 2.0**-8).view_as(x)
        error = (values - x).abs() / x.abs()
        assert error[normal].max() <= UNIT_ROUNDOFF[E4M3]
    with pytest.raises(ValueError, match="does not split into blocks of 1 x 128"):
        quantize_blocks(fresh(8, 96), E4M3, (1, 128))


def test_the_blockwise_gemm_is_the_product_of_the_dequantized_operands():
    a = quantize_blocks(fresh(128, 256, seed=21), E4M3, (1, 128))
    b = quantize_blocks(fresh(256, 256, seed=22), E4M3, (128, 128))
    want = dequantize(a).double() @ dequantize(b).double().t()
    assert rel_err(blockwise_gemm(a, b, torch.float32), want) < 1e-6


@pytest.mark.parametrize("name", ["rowwise", "blockwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("wgrad_hp", [False, True], ids=["fp8-wgrad", "hp-wgrad"])
def test_the_three_gemms_against_fp64(name, fmt, wgrad_hp):
    torch.manual_seed(4)
    layer = Fp8Linear(256, 128, dtype=torch.float32)
    x = fresh(128, 256, seed=5).requires_grad_()
    dy = fresh(128, 128, seed=6)
    recipe = RECIPES[name](fp8_format=fmt, override_linear_precision=(False, False, wgrad_hp))
    with fp8_autocast(recipe=recipe, collect_saturation=True):
        y = layer(x)
    y.backward(dy)
    y_ref, dx_ref, dw_ref, db_ref = reference(layer, x, dy)
    grad_dtype = recipe.fp8_format.backward_dtype
    assert rel_err(y, y_ref) < gemm_error_bound(E4M3, E4M3)
    assert rel_err(x.grad, dx_ref) < gemm_error_bound(grad_dtype, E4M3)
    assert rel_err(layer.weight.grad, dw_ref) < (
        1e-5 if wgrad_hp else gemm_error_bound(grad_dtype, E4M3)
    )
    assert rel_err(layer.bias.grad, db_ref) < 1e-5
    health = fp8_health(layer)
    assert 0.0 < health["fp8_scale_min"] <= health["fp8_scale_max"] and health["fp8_scale_max"] > 1
    assert health["fp8_saturation"] is not None


def test_micro_batches_accumulate_into_main_grad_and_the_weight_cast_follows_the_optimizer():
    """Gradient-accumulation fusion: each micro-batch's weight gradient is added into the
    fp32 main_grad, autograd gets none; the weight is cast once per optimizer step."""
    torch.manual_seed(7)
    layer = Fp8Linear(64, 48, dtype=torch.float32)
    buffer = GradientBuffer(list(layer.parameters()), bucket_size=10_000)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    xs, dys = (
        [fresh(32, 64, seed=8 + i) for i in range(2)],
        [fresh(32, 48, seed=10 + i) for i in range(2)],
    )
    buffer.zero()
    casts = []
    for x, dy in zip(xs, dys):
        with fp8_autocast(recipe=RowwiseScaling()):
            layer(x).backward(dy)
        casts.append(layer._weight_fp8[1])
    buffer.finish()
    assert casts[0] is casts[1] and layer.weight.grad is None
    want = sum(dy.double().t() @ x.double() for x, dy in zip(xs, dys))
    assert rel_err(layer.weight.main_grad, want) < gemm_error_bound(E4M3, E4M3)
    layer.weight.grad = layer.weight.main_grad.clone()
    optimizer.step()
    with fp8_autocast(recipe=RowwiseScaling()):
        layer(xs[0])
    assert layer._weight_fp8[1] is not casts[0]


def tensor_parallel_body(rank, world_size, name):
    """Column-parallel with the input gathered over the ranks, then row-parallel with the output
    reduce-scattered (sequence parallelism's two linears), against the same layers whole."""
    group = dist.group.WORLD
    torch.manual_seed(12)
    fc1, fc2 = Fp8Linear(128, 256, dtype=torch.float32), Fp8Linear(256, 128, dtype=torch.float32)
    x = fresh(128, 128, seed=13).requires_grad_()
    dy = fresh(128, 128, seed=14)
    # this rank's shards: rows of x, fc1's output rows, fc2's input columns
    rows, hidden = slice(64 * rank, 64 * rank + 64), slice(128 * rank, 128 * rank + 128)
    part1 = Fp8Linear(128, 128, dtype=torch.float32)
    part2 = Fp8Linear(128, 128, bias=False, dtype=torch.float32)
    with torch.no_grad():
        part1.weight.copy_(fc1.weight[hidden])
        part1.bias.copy_(fc1.bias[hidden])
        part2.weight.copy_(fc2.weight[:, hidden])
    shard = x.detach()[rows].requires_grad_()
    with fp8_autocast(recipe=RECIPES[name]()), torch.enable_grad():
        context = part1.fp8_context(shard, gathered_ranks=2)
        h = part1.fp8_linear(shard, part1.bias, context, gather_group=group)
        y = part2.fp8_linear(h, None, part2.fp8_context(h), scatter_group=group) + fc2.bias
    y.backward(dy[rows])
    x64 = x.detach().double().requires_grad_()
    y_ref = (x64 @ fc1.weight.double().t() + fc1.bias.double()) @ fc2.weight.double().t()
    y_ref = y_ref + fc2.bias.double()
    y_ref.backward(dy.double())
    bound = gemm_error_bound(E4M3, E4M3)
    return (
        rel_err(y, y_ref.detach()[rows]) < 2 * bound,
        rel_err(shard.grad, x64.grad[rows]) < 2 * bound,
    )


@pytest.mark.parametrize("name", ["rowwise", "blockwise"])
def test_sequence_parallel_linears_match_the_whole_layers(name):
    assert all(all(checks) for checks in run_on_ranks(tensor_parallel_body, 2, name))


def test_a_weights_square_blocks_serve_both_of_its_gemms():
    """Blockwise: the dgrad operand is the fprop cast transposed, bytes and scales."""
    layer = Fp8Linear(256, 128, dtype=torch.float32)
    with fp8_autocast(recipe=BlockwiseScaling()):
        layer(fresh(128, 256, seed=23))
    rows, columns = layer._weight_fp8[1]
    assert torch.equal(columns.data.view(torch.uint8), rows.data.t().view(torch.uint8))
    assert torch.equal(columns.scale_inv, rows.scale_inv.t())


def test_a_linear_blocks_do_not_divide_runs_in_high_precision_and_says_so():
    layer = Fp8Linear(192, 128, dtype=torch.float32)
    x = fresh(128, 192, seed=24)
    with pytest.warns(UserWarning, match="divisible by 128 \\(in_features=192\\)"):
        with fp8_autocast(recipe=BlockwiseScaling()):
            y = layer(x)
    ref = x.double() @ layer.weight.double().t() + layer.bias.double()
    assert rel_err(y, ref) < 1e-5


def test_fp8_primary_weights_and_rowwise_scaling_do_not_mix():
    layer = Fp8Linear(64, 48, dtype=torch.float32)
    layer.make_weight_fp8()
    with pytest.raises(ValueError, match="RowwiseScaling cannot use"):
        with fp8_autocast(recipe=RowwiseScaling()):
            layer(torch.randn(16, 64))


def test_a_layer_goes_from_rowwise_to_tensorwise_scaling_and_back():
    """The cached weight cast is the recipe's own: switching recipes recasts it."""
    layer = Fp8Linear(64, 48, dtype=torch.float32)
    x = fresh(16, 64, seed=15)
    outputs = []
    for recipe in (RowwiseScaling(), CurrentScaling(), RowwiseScaling()):
        with fp8_autocast(recipe=recipe):
            outputs.append(layer(x))
    assert torch.equal(outputs[0], outputs[2])
    ref = x.double() @ layer.weight.double().t() + layer.bias.double()
    assert all(rel_err(out, ref) < gemm_error_bound(E4M3, E4M3) for out in outputs)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 tensor cores",
)
def test_cublas_rowwise_gemm_equals_the_cpu_one():
    a, b = (
        quantize_rows(fresh(256, 512, seed=16), E4M3),
        quantize_rows(fresh(384, 512, seed=17), E4M3),
    )
    cpu = rowwise_gemm(a, b, torch.bfloat16).float()
    cuda = rowwise_gemm(*(type(t)(*(f.cuda() for f in t)) for t in (a, b)), torch.bfloat16)
    assert rel_err(cuda.float().cpu(), cpu) < 2.0**-7  # each rounded to bf16 once
