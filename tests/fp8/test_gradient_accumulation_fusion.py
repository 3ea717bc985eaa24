"""Gradient-accumulation fusion: the linears write their weight and bias gradients into the fp32
`main_grad` of a GradientBuffer themselves. The FP8 wgrad overwrites a main_grad that holds no
gradient yet with the GEMM's fp32 result (CPU and GPU); the bf16 wgrad adds into it inside the
GEMM (GPU only). Either way the accumulated gradient equals the unfused path's to bf16 rounding,
with the step's first micro-batch not rounded to bf16 at all. A buffer zeroed lazily (its old
values left in place) gives the same gradients as a cleared one."""

import pytest
import torch
from megafp8.parallel.data_parallel import GradientBuffer

from megafp8 import CurrentScaling, Fp8Linear, fp8_autocast

from ..multiprocess import run_on_ranks
from .helpers import rel_err

MICRO_BATCHES = 3


def layer_pair(dtype, device="cpu", out_features=48, grads_in=torch.float32):
    """The same layer twice, fused and unfused, each with its gradient buffer (of `grads_in`)."""
    layers = []
    for fused in (True, False):
        torch.manual_seed(5)
        layer = Fp8Linear(64, out_features, dtype=dtype, device=device)
        layer.fuse_wgrad_accumulation = fused
        layers.append((layer, GradientBuffer(layer.parameters(), dtype=grads_in)))
    return layers


def accumulate(layer, buffer, batches, fp8, twice=False):
    """main_grad of weight and bias after each micro-batch."""
    buffer.zero()
    after = []
    for x, dy in batches:
        with fp8_autocast(enabled=fp8, recipe=CurrentScaling()):
            y = layer(layer(x)) if twice else layer(x)
        y.backward(dy)
        assert layer.weight.grad is None and layer.bias.grad is None
        after.append((layer.weight.main_grad.clone(), layer.bias.main_grad.clone()))
    return after


def batches(dtype, device="cpu", out_features=48):
    g = torch.Generator(device=device).manual_seed(11)
    return [
        (
            torch.randn(32, 64, generator=g, device=device).to(dtype),
            torch.randn(32, out_features, generator=g, device=device).to(dtype),
        )
        for _ in range(MICRO_BATCHES)
    ]


def is_bf16_rounded(t):
    return torch.equal(t, t.bfloat16().float())


def test_fp8_wgrad_goes_into_a_zero_main_grad_in_fp32_then_accumulates_as_before():
    (fused, fused_buffer), (unfused, unfused_buffer) = layer_pair(torch.bfloat16)
    data = batches(torch.bfloat16)
    assert fused.weight.main_grad_empty
    got = accumulate(fused, fused_buffer, data, fp8=True)
    assert not fused.weight.main_grad_empty and not fused.bias.main_grad_empty
    want = accumulate(unfused, unfused_buffer, data, fp8=True)
    # First micro-batch: the GEMM's fp32 result itself, where the unfused path rounds it to bf16.
    assert not is_bf16_rounded(got[0][0]) and is_bf16_rounded(want[0][0])
    assert not is_bf16_rounded(got[0][1]) and is_bf16_rounded(want[0][1])
    for (w, b), (w_ref, b_ref) in zip(got, want):
        assert rel_err(w, w_ref) < 2.0**-8 and rel_err(b, b_ref) < 2.0**-8
    # Zeroed again, the next step overwrites again.
    again = accumulate(fused, fused_buffer, data, fp8=True)
    assert all(
        torch.equal(a, b) for pair_a, pair_b in zip(again, got) for a, b in zip(pair_a, pair_b)
    )


def test_the_fp8_bias_gradient_accumulates_in_fp32_on_every_micro_batch():
    """The column sums go into main_grad unrounded; the unfused path rounds each to bf16."""
    (fused, fused_buffer), (unfused, unfused_buffer) = layer_pair(torch.bfloat16)
    data = batches(torch.bfloat16)
    got = accumulate(fused, fused_buffer, data, fp8=True)
    want = accumulate(unfused, unfused_buffer, data, fp8=True)
    for k, ((_, b), (_, b_ref)) in enumerate(zip(got, want)):
        exact = sum(dy.double().sum(0) for _, dy in data[: k + 1])
        assert rel_err(b, exact) < 1e-6  # fp32 sums of bf16 values
        assert rel_err(b_ref, exact) > 1e-4  # each micro-batch's sum rounded to bf16


def test_a_weight_used_twice_in_one_backward_counts_both_uses():
    (fused, fused_buffer), (unfused, unfused_buffer) = layer_pair(torch.bfloat16, out_features=64)
    data = batches(torch.bfloat16, out_features=64)
    got = accumulate(fused, fused_buffer, data, fp8=True, twice=True)
    want = accumulate(unfused, unfused_buffer, data, fp8=True, twice=True)
    for (w, b), (w_ref, b_ref) in zip(got, want):
        assert rel_err(w, w_ref) < 2.0**-7 and rel_err(b, b_ref) < 2.0**-7


def test_without_fusion_or_a_buffer_autograd_gets_the_gradients():
    torch.manual_seed(5)
    layer = Fp8Linear(64, 48, dtype=torch.bfloat16)
    x, dy = batches(torch.bfloat16)[0]
    with fp8_autocast(recipe=CurrentScaling()):
        layer(x).backward(dy)
    assert layer.weight.grad is not None and layer.bias.grad is not None


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_lazily_zeroed_buffer_gives_the_gradients_of_a_cleared_one(device, fp8):
    # Its stale values (NaN here) are overwritten by each main_grad's first writer, fused GEMM
    # (beta = 0 for bf16 on the GPU) or autograd hook alike; finish() zeroes those nobody wrote.
    torch.manual_seed(5)
    model = torch.nn.ModuleDict(
        {
            "fused": Fp8Linear(64, 48, dtype=torch.bfloat16, device=device),
            "plain": torch.nn.Linear(48, 16, dtype=torch.bfloat16, device=device),
            "unused": torch.nn.Linear(4, 4, device=device),
        }
    )
    buffer = GradientBuffer(model.parameters())
    data = [(x, dy[:, :16]) for x, dy in batches(torch.bfloat16, device)]
    results = []
    for lazy in (False, True):
        buffer.data.fill_(float("nan"))
        buffer.zero(lazy=lazy)
        for x, dy in data:
            with fp8_autocast(enabled=fp8, recipe=CurrentScaling()):
                model["plain"](model["fused"](x)).backward(dy)
        buffer.finish()
        results.append(buffer.data.clone())
    assert not results[1].isnan().any()
    assert torch.equal(results[0], results[1])
    assert not model["unused"].weight.main_grad.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_on_the_gpu_the_fused_gradients_equal_the_unfused_to_bf16_rounding(fp8):
    (fused, fused_buffer), (unfused, unfused_buffer) = layer_pair(torch.bfloat16, "cuda")
    data = batches(torch.bfloat16, "cuda")
    got = accumulate(fused, fused_buffer, data, fp8=fp8)
    want = accumulate(unfused, unfused_buffer, data, fp8=fp8)
    assert not is_bf16_rounded(got[0][0]) and is_bf16_rounded(want[0][0])
    for (w, b), (w_ref, b_ref) in zip(got, want):
        assert rel_err(w, w_ref) < 2.0**-8 and rel_err(b, b_ref) < 2.0**-8
    # Against fp64 over all micro-batches (the bf16 GEMM's own rounding aside), fused is closer.
    if not fp8:
        ref = sum(dy.double().t() @ x.double() for x, dy in data)
        assert rel_err(got[-1][0], ref) <= rel_err(want[-1][0], ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_bf16_buffer_takes_the_fused_gradients_in_bf16(device, fp8):
    """--main-grads-dtype bf16: the FP8 wgrad overwrites the empty bf16 main_grad with the GEMM's
    bf16 result, which is what the unfused path hands autograd, so the two accumulate alike, bit
    for bit; the bf16 GEMM on the GPU adds into it inside the GEMM, the unfused path after
    rounding the gradient, the same to bf16 rounding."""
    if device == "cpu" and not fp8:
        pytest.skip("the bf16 GEMM into main_grad is the GPU's (addmm with its output)")
    pair = layer_pair(torch.bfloat16, device, grads_in=torch.bfloat16)
    (fused, fused_buffer), (unfused, unfused_buffer) = pair
    assert fused.weight.main_grad.dtype == torch.bfloat16
    data = batches(torch.bfloat16, device)
    got = accumulate(fused, fused_buffer, data, fp8=fp8)
    want = accumulate(unfused, unfused_buffer, data, fp8=fp8)
    for (w, b), (w_ref, b_ref) in zip(got, want):
        if fp8:
            assert torch.equal(w, w_ref)
        else:
            assert rel_err(w, w_ref) < 2.0**-7
        assert rel_err(b, b_ref) < 2.0**-7


def beside_collective_body(rank, size):
    torch.manual_seed(5)
    layer = Fp8Linear(64, 48, dtype=torch.float32)
    buffer = GradientBuffer(layer.parameters())
    layer.fuse_wgrad_accumulation = False
    before = [(p.main_grad.clone(), p.main_grad_empty) for p in layer.parameters()]
    x = torch.randn(8, 64, requires_grad=True)
    y = layer.high_precision_linear(x, layer.bias, gather_group=torch.distributed.group.WORLD)
    # as the warm-up
    grads = torch.autograd.grad(y, (x, layer.weight, layer.bias), torch.randn_like(y))
    untouched = all(
        torch.equal(p.main_grad, grad) and p.main_grad_empty == empty
        for p, (grad, empty) in zip(layer.parameters(), before)
    )
    del buffer
    return untouched, all(grad is not None for grad in grads)


def test_without_fusion_a_linear_beside_its_collective_leaves_main_grad_alone():
    """The CUDA graphs' warm-up turns the fusion off for a backward whose gradients it throws
    away: the overlapped high-precision linear must then hand both to autograd."""
    for untouched, autograd_has_them in run_on_ranks(beside_collective_body, 2):
        assert untouched and autograd_has_them
