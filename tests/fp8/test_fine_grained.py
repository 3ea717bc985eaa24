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
    fine_grained_kernels,
    fp8_autocast,
    fp8_health,
)
from megafp8.fp8.fine_grained import (
    ScaledFp8,
    blockwise_gemm,
    dequantize,
    gemm_into,
    quantize_blocks,
    quantize_rows,
    rowwise_gemm,
    takes_bias,
    writes_into,
)

from ..interpreter import run_interpreted_checks
from ..multiprocess import run_on_ranks
from .helpers import (
    UNIT_ROUNDOFF,
    assert_same_bits,
    gemm_error_bound,
    launch_with_offsets,
    rel_err,
)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


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


@pytest.mark.parametrize("name", ["rowwise", "blockwise"])
def test_a_graphed_layer_recasts_its_weight_where_its_graphs_read_it(name):
    """A CUDA-graphed layer (`keep_weight_cast_addresses`) casts its weight after each optimizer
    step into the buffers its graphs captured, as a fresh cast would; an eager layer takes new
    ones (a backward still to run keeps the old)."""
    layer = Fp8Linear(256, 128, dtype=torch.float32)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    x = fresh(128, 256, seed=27)
    for graphed in (True, False):
        layer.keep_weight_cast_addresses = graphed
        with fp8_autocast(recipe=RECIPES[name]()):
            layer(x).sum().backward()
        before = layer._weight_fp8[1]
        addresses = [t.data_ptr() for t in (*before.rows, *before.columns)]
        optimizer.step()
        with fp8_autocast(recipe=RECIPES[name]()):
            layer(x)
        after = layer._weight_fp8[1]
        assert ([t.data_ptr() for t in (*after.rows, *after.columns)] == addresses) == graphed
        layer._weight_fp8 = None  # a fresh cast of the stepped weight: the same bytes and scales
        with fp8_autocast(recipe=RECIPES[name]()):
            layer(x)
        assert_same_bits(tuple(after), tuple(layer._weight_fp8[1]), (name, graphed))


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


def fp8_gather_body(rank, world_size, name, tokens):
    """Sequence parallelism's two linears on this rank's weights, against the same weights applied
    to the whole input in this one process: the output of the first, the input gradient of the
    second, both weight gradients, bit for bit, and the dtypes the ranks gathered."""
    from megafp8 import collectives

    group, recipe = dist.group.WORLD, RECIPES[name]()
    gathered, originals = [], (collectives.all_gather, collectives.all_gather_columns)

    def recording(gather):
        def gather_and_record(t, *args, **kwargs):
            gathered.append(t.dtype)
            return gather(t, *args, **kwargs)

        return gather_and_record

    collectives.all_gather, collectives.all_gather_columns = map(recording, originals)
    torch.manual_seed(30 + rank)  # this rank's shards of the two weights
    part1, part2 = Fp8Linear(128, 128, dtype=torch.float32), Fp8Linear(128, 128, bias=False)
    twin1, twin2 = Fp8Linear(128, 128, dtype=torch.float32), Fp8Linear(128, 128, bias=False)
    twin1.load_state_dict(part1.state_dict())
    twin2.load_state_dict(part2.state_dict())
    x, dy = fresh(tokens, 128, seed=31), fresh(tokens, 128, seed=32)
    rows = slice(tokens // 2 * rank, tokens // 2 * (rank + 1))
    with fp8_autocast(recipe=recipe):
        shard = x[rows].clone().requires_grad_()
        h = part1.fp8_linear(shard, part1.bias, part1.fp8_context(shard, 2), gather_group=group)
        h.retain_grad()
        y = part2.fp8_linear(h, None, part2.fp8_context(h), scatter_group=group)
    y.backward(dy[rows])
    collectives.all_gather, collectives.all_gather_columns = originals
    with fp8_autocast(recipe=recipe):
        h_whole = twin1(x)
        h_whole.retain_grad()
        twin2(h_whole).backward(dy)
    same = [
        torch.equal(a, b)
        for a, b in (
            (h, h_whole),
            (h.grad, h_whole.grad),
            (part1.weight.grad, twin1.weight.grad),
            (part1.bias.grad, twin1.bias.grad),
            (part2.weight.grad, twin2.weight.grad),
        )
    ]
    return same, sorted({str(dtype) for dtype in gathered})


@pytest.mark.parametrize("name", ["rowwise", "blockwise"])
def test_sequence_parallel_inputs_and_gradients_are_gathered_in_fp8(name):
    """The input before the column-parallel linear and the output gradient of the row-parallel
    one are cast by each rank and gathered in FP8, bytes and scales: what the GEMMs get is the cast
    of the whole tensor, bit for bit (a rowwise column's scale from the amax over every rank)."""
    for same, dtypes in run_on_ranks(fp8_gather_body, 2, name, 256):
        assert all(same), same
        assert dtypes == ["torch.float32", "torch.float8_e4m3fn"]  # FP8 bytes, fp32 scales


def test_blocks_that_would_straddle_two_ranks_are_gathered_in_high_precision():
    """Blockwise, 64 tokens a rank: a 128-token block of the transposed cast would hold two
    ranks' tokens, so the input is gathered as it is and cast whole; the same results."""
    for same, dtypes in run_on_ranks(fp8_gather_body, 2, "blockwise", 128):
        assert all(same), same
        assert dtypes == ["torch.float32"]


@pytest.mark.parametrize("name", ["rowwise", "blockwise"])
def test_sequence_parallel_linears_match_the_whole_layers(name):
    assert all(all(checks) for checks in run_on_ranks(tensor_parallel_body, 2, name))


def mlp_with_and_without_fusion(device, name, kind, tokens=256, hidden=128, ffn=384, recipe=None):
    """An MLP's fc1 -> activation -> fc2 under recipe `name` (by default with the activation
    among its fused ones; else `recipe`), with neighbour fusion (the cast of fc2's input computes
    the activation; its backward casts fc1's output gradient) and without: for each, the output,
    every gradient, and how many output gradients were handed over."""
    from megafp8.fp8 import fine_grained
    from megafp8.fp8.fused import GradHandoff

    torch.manual_seed(60)
    width = 2 * ffn if kind == "swiglu" else ffn
    fc1 = Fp8Linear(hidden, width, device=device, dtype=torch.bfloat16)
    fc2 = Fp8Linear(ffn, hidden, device=device, dtype=torch.bfloat16)
    x = fresh(tokens, hidden, seed=61).to(device, torch.bfloat16)
    dy = fresh(tokens, hidden, seed=62).to(device, torch.bfloat16)
    results, cast = [], fine_grained.cast_output_gradient
    for fuse in (True, False):
        handed = []
        fine_grained.cast_output_gradient = lambda *args: handed.append(1) or cast(*args)
        try:
            for layer in (fc1, fc2):
                layer.fuse_neighbours = fuse
                layer.zero_grad(set_to_none=True)
            x_in = x.clone().requires_grad_()
            handoff = GradHandoff()
            with fp8_autocast(recipe=recipe or RECIPES[name](fused_activations=(kind,))):
                y = fc2(fc1(x_in, grad_from=handoff), activation=kind, grad_to=(fc1, handoff))
            y.backward(dy)
        finally:
            fine_grained.cast_output_gradient = cast
        grads = [t.grad for t in (x_in, fc1.weight, fc1.bias, fc2.weight, fc2.bias)]
        results.append((y.detach(), grads, len(handed)))
    return results


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_on_the_cpu_the_fused_activation_is_the_unfused_path_bit_for_bit(name, kind):
    """Off CUDA the fused path runs the torch activation ops before the casts: the same numbers,
    through the handover of fc1's output gradient."""
    (y, grads, handed), (ref_y, ref_grads, unfused_handed) = mlp_with_and_without_fusion(
        "cpu", name, kind
    )
    assert handed == 1 and unfused_handed == 0
    assert torch.equal(y, ref_y)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "swiglu"])
def test_a_recipe_fuses_only_its_own_activations(name, kind):
    """By default rowwise fuses no activation and blockwise SwiGLU alone: the rest compute the
    activation apart, as without fusion, bit for bit."""
    recipe = RECIPES[name]()
    (y, grads, handed), (ref_y, ref_grads, _) = mlp_with_and_without_fusion(
        "cpu", name, kind, recipe=recipe
    )
    fused = (name, kind) == ("blockwise", "swiglu")
    assert handed == fused and (kind in recipe.fused_activations) == fused
    assert torch.equal(y, ref_y)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


def check_fused_mlp(device):
    """With the kernels computing the activation and its gradient: where a value rounds the
    other way (`check_fused_activations`) an FP8 byte moves by a step, which the layers carry
    on: within an FP8 GEMM's error bound of the unfused layers."""
    # the last: SwiGLU's gradient halves do not split into tiles (208 columns), computed first
    cases = [(name, kind, 384) for name in RECIPES for kind in ("gelu", "swiglu")]
    for name, kind, ffn in [*cases, ("rowwise", "swiglu", 208)]:
        (y, grads, handed), (ref_y, ref_grads, _) = mlp_with_and_without_fusion(
            device, name, kind, ffn=ffn
        )
        assert handed == 1, (name, kind)
        assert rel_err(y, ref_y) < gemm_error_bound(E4M3, E4M3), (name, kind)
        for g, r in zip(grads, ref_grads):
            assert rel_err(g, r) < gemm_error_bound(E4M3, E4M3), (name, kind)


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


needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 tensor cores",
)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("fast_accum", [False, True])
def test_cublas_rowwise_gemm_equals_the_cpu_one(fast_accum):
    a, b = (
        quantize_rows(fresh(256, 512, seed=16), E4M3),
        quantize_rows(fresh(384, 512, seed=17), E4M3),
    )
    cpu = rowwise_gemm(a, b, torch.bfloat16).float()
    cuda = rowwise_gemm(
        *(type(t)(*(f.cuda() for f in t)) for t in (a, b)), torch.bfloat16, fast_accum
    )
    assert rel_err(cuda.float().cpu(), cpu) < 2.0**-7  # each rounded to bf16 once


def awkward(rows, cols, seed, dtype=torch.bfloat16):
    """`fresh` rows with magnitudes along the columns too, a block of zeros, an inf, a NaN and
    elements small enough to flush: each path of a cast."""
    x = fresh(rows, cols, seed=seed) * fresh(1, cols, seed=seed + 1).abs()
    x[:3, :5] = 0.0
    x[4, 6] = float("inf")
    x[-1, -2] = float("nan")
    x[5, :] *= 1e-6
    return x.to(dtype)


def reference_pair(x, fp8_dtype, blockwise, margin, power_of_two):
    """The torch casts of `x` along its rows and columns, and their summed counts."""
    counts = torch.zeros(3, dtype=torch.int64)
    block = (1, 128) if blockwise else (1, None)
    pair = tuple(
        quantize_blocks(t, fp8_dtype, block, margin, counts, power_of_two) for t in (x, x.t())
    )
    return pair, counts


def assert_same_fp8(a: torch.Tensor, b: torch.Tensor, what) -> None:
    """Alike bit for bit, but for the sign and payload of a NaN (its byte is the cast's to pick)."""
    nan = a.float().isnan()
    assert torch.equal(nan, b.float().isnan()), what
    assert torch.equal(a.view(torch.uint8)[~nan], b.view(torch.uint8)[~nan]), what


def assert_column_sums(got: torch.Tensor, x: torch.Tensor) -> None:
    """The fp32 column sums of `x` (a bias gradient), added in the kernel's own order: within
    fp32 rounding of the fp64 sums, relative to each column's sum of magnitudes (the error a sum
    of mixed signs can have), with inf and NaN where the column has them."""
    want = x.double().sum(0)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    error = (got.double() - want)[finite].abs()
    assert (error <= 2.0**-18 * x.double().abs().sum(0)[finite]).all(), error.max()


def check_fused_casts(device):
    """quantize_pair and quantize_squares give the torch casts' bytes, scales and counts, bit for
    bit: both granularities, both formats, margins, power-of-two scales, partial tiles (rowwise)."""
    cases = [
        (True, (256, 384), E4M3, 0, False),
        (True, (128, 256), E5M2, 1, True),
        (False, (200, 136), E4M3, 0, True),
        (False, (144, 272), E5M2, 2, False),
    ]
    for seed, (blockwise, shape, fp8_dtype, margin, power_of_two) in enumerate(cases):
        x = awkward(*shape, seed=seed)
        want, want_counts = reference_pair(x, fp8_dtype, blockwise, margin, power_of_two)
        counts = torch.zeros(3, dtype=torch.int64, device=device)
        col_sums = torch.empty(shape[1], device=device)
        got = fine_grained_kernels.quantize_pair(
            x.to(device),
            fp8_dtype,
            blockwise,
            margin,
            power_of_two,
            saturation_out=counts,
            col_sum_out=col_sums,
        )
        assert_column_sums(col_sums.cpu(), x)
        what = (blockwise, shape, fp8_dtype)
        for g, w in zip(got, want):
            assert_same_fp8(g.data.cpu(), w.data, what)
            assert_same_bits(g.scale_inv.cpu().contiguous(), w.scale_inv.contiguous(), what)
        assert torch.equal(counts.cpu(), want_counts), (what, counts, want_counts)
        assert want_counts[0] > 0 and want_counts[2] > 0, what  # saturated, flushed: both seen
        rows_only = fine_grained_kernels.quantize_pair(
            x.to(device),
            fp8_dtype,
            blockwise,
            margin,
            power_of_two,
            columns=False,
            col_sum_out=col_sums,
        )
        assert rows_only[1] is None
        assert_column_sums(col_sums.cpu(), x)  # summed from the row read: no transposed one
        assert_same_fp8(rows_only[0].data.cpu(), want[0].data, what)
    w = awkward(256, 384, seed=9)
    quantize_squares = fine_grained_kernels.quantize_squares
    counts = torch.zeros(3, dtype=torch.int64, device=device)
    rows, columns = quantize_squares(w.to(device), E4M3, 1, False, counts)
    want_counts = torch.zeros(3, dtype=torch.int64)
    want = quantize_blocks(w, E4M3, (128, 128), 1, want_counts)
    assert_same_fp8(rows.data.cpu(), want.data, "squares")
    assert_same_fp8(columns.data.cpu(), want.data.t().contiguous(), "squares, transposed")
    assert torch.equal(rows.scale_inv.cpu(), want.scale_inv)
    assert torch.equal(columns.scale_inv.cpu(), want.scale_inv.t())
    assert rows.scale_inv.stride() == (4, 1) and columns.scale_inv.stride() == (4, 1)
    assert torch.equal(counts.cpu(), want_counts)
    # written again in place (a CUDA-graphed layer's weight), as a fresh cast
    for blockwise, cast in ((True, quantize_squares), (False, None)):
        w2 = (w * 3).to(device)
        if blockwise:
            first = cast(w.to(device), E4M3)
            again, fresh_cast = cast(w2, E4M3, out=first), cast(w2, E4M3)
        else:
            first = fine_grained_kernels.quantize_pair(w.to(device), E4M3, False)
            again = fine_grained_kernels.quantize_pair(w2, E4M3, False, out=first)
            fresh_cast = fine_grained_kernels.quantize_pair(w2, E4M3, False)
        assert [t.data_ptr() for t in (*again[0], *again[1])] == [
            t.data_ptr() for t in (*first[0], *first[1])
        ]
        assert_same_bits(again, fresh_cast, blockwise)


def check_fused_activations(device):
    """The pair cast of an activation (forward) and of its gradient (backward), computed as the
    cast reads, against the same cast of the torch activation's output. The kernels' values are
    aten's but where a transcendental function differs in its last bit (CUDA's math library
    against libdevice, the interpreter's stand-ins against torch's CPU ones; GELU's tanh form's
    gradient by its formula, megafp8.fp8.activation_kernels): such a value may round the other
    way, moving a byte by one FP8 step, or a block's scale by one rounding."""
    from megafp8.fp8 import activation_kernels

    M, F = 256, 384  # SwiGLU's halves, 3 tiles each; rowwise and blockwise both
    for seed, (kind, blockwise) in enumerate(
        [("gelu", True), ("gelu_tanh", False), ("swiglu", True), ("swiglu", False)]
    ):
        width = 2 * F if kind == "swiglu" else F
        h = fresh(M, width, seed=40 + seed).to(torch.bfloat16)
        dout = fresh(M, F, seed=50 + seed).to(torch.bfloat16)
        for what, (x, activation_input, want_x) in {
            "forward": (h, None, activation_kernels.activation_torch(h, kind)),
            "backward": (dout, h, activation_kernels.activation_backward_torch(dout, h, kind)),
        }.items():
            cast = (kind, blockwise, what)
            want = fine_grained_kernels.quantize_pair(want_x.to(device), E4M3, blockwise)
            sums = torch.empty(want_x.shape[1], device=device)
            got = fine_grained_kernels.quantize_pair(
                x.to(device),
                E4M3,
                blockwise,
                col_sum_out=sums,
                activation=kind,
                activation_input=None if activation_input is None else activation_input.to(device),
            )
            for g, w in zip(got, want):
                assert g.data.shape == w.data.shape and g.scale_inv.shape == w.scale_inv.shape
                differ = g.data.view(torch.uint8) != w.data.view(torch.uint8)
                differ &= (g.data.float() != 0) | (w.data.float() != 0)  # a signed zero
                assert differ.float().mean() < 0.05, (cast, differ.float().mean())
                assert rel_err(dequantize(g).cpu(), dequantize(w).cpu()) < 2.0**-6, cast
            assert rel_err(sums.cpu(), want_x.double().sum(0)) < 2.0**-8, cast


def check_wide_offsets():
    x = awkward(256, 256, seed=11)
    for blockwise in (True, False):

        def cast():
            counts = torch.zeros(3, dtype=torch.int64)
            return fine_grained_kernels.quantize_pair(
                x, E4M3, blockwise, saturation_out=counts
            ), counts

        narrow, wide = (
            launch_with_offsets(w, fine_grained_kernels, "_pair_kernel", cast)
            for w in (False, True)
        )
        assert_same_bits(narrow, wide, blockwise)


def interpreted_checks():
    check_fused_casts("cpu")
    check_fused_activations("cpu")
    check_fused_mlp("cpu")
    check_wide_offsets()
    for name in RECIPES:  # the fused casts' column amaxes maxed over the ranks (rowwise)
        for same, _ in run_on_ranks(fp8_gather_body, 2, name, 256):
            assert all(same), (name, same)


@pytest.mark.skipif(not fine_grained_kernels.triton, reason="needs triton")
def test_fused_casts_in_the_triton_interpreter():
    run_interpreted_checks(__name__, "-W", "ignore::RuntimeWarning")


needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU (cuBLAS's blockwise scaling)",
)


@pytest.mark.gpu
@needs_fp8_gpu
def test_gpu_fused_casts_equal_the_torch_ones():
    check_fused_casts("cuda")
    check_fused_activations("cuda")
    check_fused_mlp("cuda")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cublas_blockwise_gemms_equal_the_emulated_ones(out_dtype):
    """fprop/dgrad's 1 x 128 by 128 x 128 and wgrad's 1 x 128 by 1 x 128, scales as the fused
    casts lay them out and as the torch casts do (copied into cuBLAS's layout)."""
    a = quantize_blocks(fresh(512, 768, seed=23), E4M3, (1, 128))
    squares = quantize_blocks(fresh(640, 768, seed=24), E4M3, (128, 128))  # 6 K blocks: padded
    rows = quantize_blocks(fresh(384, 768, seed=25), E4M3, (1, 128))
    for b in (squares, rows):
        emulated = blockwise_gemm(a, b, torch.float32)
        cuda = blockwise_gemm(*(type(t)(*(f.cuda() for f in t)) for t in (a, b)), out_dtype)
        assert cuda.dtype == out_dtype
        # bf16: one rounding of the output. fp32: Hopper's FP8 tensor cores sum a block's 128
        # products in fewer bits than fp32 (about 2^-13 of relative error here).
        bound = 2.0**-7 if out_dtype == torch.bfloat16 else 2.0**-10
        assert rel_err(cuda.float().cpu(), emulated) < bound
    x = fresh(512, 768, seed=26).cuda()
    fused, _ = fine_grained_kernels.quantize_pair(x, E4M3, True, columns=False)
    w_rows, _ = fine_grained_kernels.quantize_squares(fresh(640, 768, seed=24).cuda(), E4M3)
    emulated = blockwise_gemm(
        *(type(t)(*(f.cpu() for f in t)) for t in (fused, w_rows)), torch.float32
    )
    assert rel_err(blockwise_gemm(fused, w_rows, torch.float32).cpu(), emulated) < 2.0**-10


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("granularity", ["row", "block"])
def test_the_weight_gradient_is_written_into_main_grad_on_hopper(granularity):
    """cuBLAS writes the wgrad GEMM's fp32 product straight into a weight's main_grad (no bf16
    product, no copy): the product of the dequantized operands within Hopper's accumulation."""
    block = (1, 128) if granularity == "block" else (1, None)
    a = quantize_blocks(fresh(384, 512, seed=33), E4M3, block)
    b = quantize_blocks(fresh(256, 512, seed=34), E4M3, block)
    assert writes_into(granularity, torch.float32, torch.device("cuda"))
    out = torch.full((384, 256), float("nan"), device="cuda")
    gemm_into(granularity, *(ScaledFp8(*(f.cuda() for f in q)) for q in (a, b)), out)
    want = dequantize(a).double() @ dequantize(b).double().t()
    assert rel_err(out.cpu(), want) < 2.0**-10


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("granularity", ["row", "block"])
def test_the_forward_gemm_adds_the_bias_where_it_says_it_can(granularity):
    """Where `takes_bias` says so, the GEMM adds the bias in its epilogue: the emulated product
    plus the bias, rounded to bf16 once; where it says not, the GEMM refuses a bias."""
    block = (1, 128) if granularity == "block" else (1, None)
    a = quantize_blocks(fresh(256, 384, seed=35), E4M3, block)
    b = quantize_blocks(
        fresh(384, 384, seed=36), E4M3, (128, 128) if granularity == "block" else block
    )
    bias = torch.randn(384).to(torch.bfloat16)
    gemm = blockwise_gemm if granularity == "block" else rowwise_gemm
    on_gpu = [ScaledFp8(*(f.cuda() for f in q)) for q in (a, b)]
    if takes_bias(granularity, torch.device("cuda")):
        got = gemm(*on_gpu, torch.bfloat16, bias=bias.cuda())
        want = dequantize(a).double() @ dequantize(b).double().t() + bias.double()
        assert rel_err(got.float().cpu(), want) < 2.0**-7
    else:
        with pytest.raises((RuntimeError, NotImplementedError, ValueError)):
            gemm(*on_gpu, torch.bfloat16, bias=bias.cuda())
