"""The CUDA path: fused Triton quantization equals the torch path bit for bit; Fp8Linear on GPU."""

import pytest
import torch

from megafp8 import (
    CurrentScaling,
    DelayedScaling,
    Fp8Linear,
    fp8_autocast,
    scale_from_amax,
    triton_support,
)
from megafp8.fp8 import triton_kernels
from megafp8.fp8.quantize import quantize_torch
from megafp8.fp8.scaling import ScalingState, _update_delayed_torch

from .helpers import HUGE, HUGE_CHUNK, emulate, gemm_error_bound, needs_40gb, random_amax, rel_err

pytestmark = pytest.mark.gpu
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def assert_same_bytes(a, b, what):
    if a is None and b is None:
        return
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    differ = (a != b).nonzero()
    assert len(differ) == 0, (
        f"{what}: {len(differ)} of {a.numel()} bytes differ, first at {differ[:4].tolist()}: "
        f"{a[tuple(differ[:4].t())].tolist()} vs {b[tuple(differ[:4].t())].tolist()}"
    )


@pytest.mark.skipif(not triton_support.available(), reason="needs triton")
@pytest.mark.parametrize("shape", [(16, 16), (100, 300), (1024, 2048), (4096, 768)])
@pytest.mark.parametrize("hp_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("delayed", [True, False])
def test_triton_quantize_equals_torch(shape, hp_dtype, fp8_dtype, delayed):
    x = (torch.randn(shape, device="cuda") * 7).to(hp_dtype)
    # An outlier beyond E4M3's range at the delayed scale below (and E5M2's, where the input
    # dtype can hold it): exercises saturation. Half the dtype's max keeps fp16 finite.
    x.view(-1)[3] = min(1e6, torch.finfo(hp_dtype).max / 2)
    scale = torch.tensor(0.37, device="cuda") if delayed else None
    for rowwise, columnwise, col_sum in [
        (True, True, True),
        (True, False, False),
        (False, True, False),
    ]:
        out_a, out_b = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
        a = triton_kernels.quantize(
            x, fp8_dtype, scale, 2, rowwise, columnwise, out_a, None, col_sum
        )
        b = quantize_torch(
            x, fp8_dtype, scale, 2, rowwise, columnwise, scale_out=out_b, col_sum=col_sum
        )
        assert_same_bytes(a.data, b.data, "data")
        assert_same_bytes(a.data_t, b.data_t, "data_t")
        assert torch.equal(a.amax, b.amax) and torch.equal(a.scale_inv, b.scale_inv)
        assert torch.equal(out_a, out_b)
        if col_sum:  # summed in another order: equal to fp32 rounding
            assert rel_err(a.col_sum, b.col_sum) < 1e-6


@pytest.mark.skipif(not triton_support.available(), reason="needs triton")
def test_triton_quantize_non_finite_inputs():
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    x[5, 7] = float("nan")
    q = triton_kernels.quantize(
        x, E4M3, torch.tensor(1.0, device="cuda"), 0, True, True, None, None, False
    )
    assert not torch.isfinite(q.amax)
    assert torch.isnan(q.data.float()[5, 7]) and torch.isnan(q.data_t.float()[7, 5])


@pytest.mark.skipif(not triton_support.available(), reason="needs triton")
@pytest.mark.parametrize("delayed", [True, False])
def test_triton_quantize_maxes_into_the_amax_accumulator(delayed):
    scale = torch.tensor(2.0, device="cuda") if delayed else None
    accumulator = torch.tensor(3.0, device="cuda")
    for peak, expected in [(1.5, 3.0), (5.0, 5.0)]:
        x = torch.randn(128, 256, device="cuda").clamp(-1, 1)
        x[7, 9] = peak
        q = triton_kernels.quantize(x, E4M3, scale, 0, True, False, None, accumulator, False)
        assert q.amax is accumulator and accumulator.item() == expected


@pytest.mark.skipif(not triton_support.available(), reason="needs triton")
@needs_40gb
@pytest.mark.parametrize("delayed", [True, False])
def test_triton_quantize_of_more_than_2_31_elements(delayed):
    # Both layouts, the column sums and the counts of a tensor past int32 offsets, against the torch
    # path a block of rows at a time.
    M, N = HUGE
    x = torch.randn(
        HUGE, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(0)
    )
    assert x.numel() > 2**31 and triton_support.wide_offsets(x)
    # Outliers, the largest in the last element, past 2^31 elements in both layouts.
    outliers = [(0, 0), (M // 2, 7), (M - 8, 3), (M - 3, N - 5), (M - 1, N - 1)]
    for i, (row, col) in enumerate(outliers):
        x[row, col] = (100.0 + i) * (-1) ** i
    # beyond 16 saturates: the outliers
    scale = torch.tensor(448.0 / 16, device="cuda") if delayed else None
    scale_out, counts = (
        torch.zeros((), device="cuda"),
        torch.zeros(3, dtype=torch.int64, device="cuda"),
    )
    q = triton_kernels.quantize(x, E4M3, scale, 0, True, True, scale_out, None, True, counts)
    assert q.amax.item() == 100.0 + len(outliers) - 1
    if not delayed:
        scale = scale_from_amax(q.amax.clone(), E4M3)
        assert torch.equal(scale_out, scale)
    assert torch.equal(q.scale_inv, scale.reciprocal())
    ref_counts = torch.zeros(3, dtype=torch.int64, device="cuda")
    col_sum, magnitude = (torch.zeros(N, device="cuda", dtype=torch.float64) for _ in range(2))
    blocks = zip(x.split(HUGE_CHUNK), q.data.split(HUGE_CHUNK), q.data_t.split(HUGE_CHUNK, dim=1))
    for i, (rows, data, data_t) in enumerate(blocks):
        ref = quantize_torch(rows, E4M3, scale, 0, True, False, saturation_out=ref_counts)
        assert_same_bytes(data, ref.data, f"data, rows from {i * HUGE_CHUNK}")
        assert_same_bytes(data_t, ref.data.t(), f"data_t, rows from {i * HUGE_CHUNK}")
        col_sum += rows.sum(0, dtype=torch.float64)
        magnitude += rows.abs().sum(0, dtype=torch.float64)
    assert torch.equal(counts, ref_counts)
    assert counts[:2].tolist() == [len(outliers) if delayed else 0, M * N]
    # Summed in another order, in fp32: the rounding of sums of |x|.
    assert ((q.col_sum - col_sum).abs() <= 1e-5 * magnitude).all()


@pytest.mark.skipif(not triton_support.available(), reason="needs triton")
@pytest.mark.parametrize("length", [1, 4, 1000, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("recompute", [True, False])
def test_fused_delayed_update_equals_torch(length, algo, recompute):
    torch.manual_seed(length)
    amaxes = torch.rand(7, device="cuda") * 100
    amaxes[1], amaxes[2], amaxes[3] = float("inf"), float("nan"), 0.0
    resets = [True, False, True, True, False, True, True]
    states = []
    for _ in range(2):
        group = [ScalingState().cuda() for _ in range(7)]
        for s, amax in zip(group, amaxes):
            s.fit_history(length)
            s.amax.copy_(amax)
            s.scale.fill_(3.0)
        states.append(group)
    for s, t in zip(*states):
        s.amax_history.uniform_(0, 50)
        t.amax_history.copy_(s.amax_history)
    triton_kernels.update_delayed(states[0], resets, 448.0, 1, algo, recompute)
    _update_delayed_torch(states[1], resets, 448.0, 1, algo, recompute)
    for fused, reference, reset in zip(*states, resets):
        assert torch.equal(fused.amax_history, reference.amax_history)
        assert torch.equal(fused.scale, reference.scale)
        assert torch.equal(fused.amax, reference.amax)
        assert (fused.amax.item() == 0) == reset  # consumed accumulators are zeroed, kept ones not


@pytest.mark.parametrize(
    "recipe", [DelayedScaling(amax_history_len=16), CurrentScaling()], ids=["delayed", "current"]
)
def test_fp8_linear_on_gpu_computes_the_emulated_fp8_gemms(recipe):
    torch.manual_seed(0)
    layer = Fp8Linear(256, 512, device="cuda")
    x = torch.randn(8, 64, 256, device="cuda")
    layer(x)  # nothing: outside autocast
    for seed in range(2):
        torch.manual_seed(seed)
        x = torch.randn(8, 64, 256, device="cuda", requires_grad=True)
        dy = torch.randn(8, 64, 512, device="cuda")
        scales = {r: s.scale.clone() for r, s in layer.fp8_scaling.items()}
        with fp8_autocast(recipe=recipe):
            y = layer(x)
        y.backward(dy)
        layer.zero_grad(set_to_none=False) if seed == 0 else None
    if isinstance(recipe, CurrentScaling):
        scales = {r: s.scale.clone() for r, s in layer.fp8_scaling.items()}
    xq = emulate(x.detach().reshape(-1, 256), scales["input"], E4M3)
    wq = emulate(layer.weight.detach(), scales["weight"], E4M3)
    dyq = emulate(dy.reshape(-1, 512), scales["grad_output"], E5M2)
    # Hopper's FP8 tensor cores accumulate with fewer bits than fp32 (measured on an H100:
    # 1.9e-4 with the forward's fast accumulation, 1.0e-4 without): allow 5e-4, still ~100x
    # under FP8's own rounding error, so wrong scales, formats or layouts cannot pass.
    assert rel_err(y.detach().reshape(-1, 512), xq @ wq.t() + layer.bias.double()) < 5e-4
    assert rel_err(x.grad.reshape(-1, 256), dyq @ wq) < 5e-4
    assert rel_err(layer.weight.grad, dyq.t() @ xq) < 5e-4
    w, b = layer.weight.double(), layer.bias.double()
    x64 = x.detach().double().reshape(-1, 256)
    assert rel_err(y.detach().reshape(-1, 512), x64 @ w.t() + b) < gemm_error_bound(E4M3, E4M3)


def test_worked_example_on_gpu():
    torch.manual_seed(0)
    layer = Fp8Linear(16, 16, device="cuda")
    recipe = DelayedScaling(amax_history_len=4, fp8_format="e4m3")
    scales = []
    for amax in [2, 8, 1, 1, 1, 1]:
        with fp8_autocast(recipe=recipe):
            layer(random_amax((16, 16), amax).cuda())
        scales.append(layer.fp8_scaling["input"].scale.item())
    assert scales == [224, 56, 56, 56, 56, 448]


def test_fused_adamw_step_refreshes_the_weight_cast():
    torch.manual_seed(0)
    layer = Fp8Linear(64, 64, device="cuda", dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    with fp8_autocast():
        layer(x).float().pow(2).sum().backward()
    cached = layer._weight_fp8[1]
    optimizer.step()
    with fp8_autocast():
        layer(x)
    assert layer._weight_fp8[1] is not cached
