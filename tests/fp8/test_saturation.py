"""Opt-in counts of saturated and flushed (underflowed) elements: `quantize(saturation_out=...)` and
`fp8_autocast(collect_saturation=True)`."""

import copy

import pytest
import torch

from megafp8 import Fp8Linear, fp8_autocast, fp8_max, quantize
from megafp8.fp8.scaling import take_cast_counts
from megafp8.fp8.tensor import saturates, underflow_bound, underflows

from ..interpreter import run_interpreted_checks

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def counter():
    return torch.zeros(3, dtype=torch.int64)  # saturated, cast, flushed to zero


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_known_outliers_give_exactly_their_fraction(dtype):
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor(100.0)
    x = torch.rand(32, 64, generator=g) * 2 - 1  # |x * scale| <= 100: in range for both formats
    outliers = torch.randperm(x.numel(), generator=g)[:37]
    signs = torch.where(torch.rand(37, generator=g) < 0.5, -1.0, 1.0)
    x.view(-1)[outliers] = signs * 2 * fp8_max(dtype) / 100  # twice fp8_max once scaled
    out = counter()
    q = quantize(x, dtype, scale, columnwise=True, saturation_out=out)
    assert out.tolist()[:2] == [37, x.numel()]
    assert (q.data.float().abs() == fp8_max(dtype)).sum() == 37


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(2, dtype=torch.int64),
        torch.zeros(3, dtype=torch.int32),
        torch.zeros(1, 3, dtype=torch.int64),
    ],
    ids=["two counts", "int32", "2-D"],
)
def test_a_counts_buffer_the_kernels_would_overrun_is_refused(bad):
    from megafp8.fp8.activation_kernels import activation_quantize
    from megafp8.fp8.norm_kernels import norm_quantize

    x, scale = torch.randn(8, 16), torch.tensor(1.0)
    calls = [
        lambda: quantize(x, E4M3, scale, saturation_out=bad),
        lambda: norm_quantize(x, torch.ones(16), None, 1e-5, True, E4M3, scale, saturation_out=bad),
        lambda: activation_quantize(x, "swiglu", E4M3, scale, saturation_out=bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="3 counts"):
            call()
    assert bad.eq(0).all()  # nothing was added before the refusal


@pytest.mark.parametrize(
    "dtype, clamped, kept",
    [
        # E4M3 steps by 32 below 448: up to 464 (the tie rounds to even, 448) nothing is lost.
        (
            E4M3,
            [464.5, 480.0, 1e4, float("inf"), -465.0],
            [448.0, 460.0, 464.0, -464.0, float("nan")],
        ),
        # E5M2 steps by 8192: 61440 is the tie, and rounds to even, which is infinity.
        (E5M2, [61440.0, 7e4, float("-inf")], [57344.0, 61439.0, -61439.0]),
    ],
)
def test_counts_values_the_clamp_changes_not_those_that_round_to_fp8_max(dtype, clamped, kept):
    values = torch.tensor(clamped + kept)
    assert saturates(values, dtype).tolist() == [True] * len(clamped) + [False] * len(kept)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_underflow_is_exactly_where_the_cast_turns_a_nonzero_value_into_zero(dtype):
    # Around half the smallest subnormal (the tie, which rounds to even: zero), and fresh random
    # values over the whole range down there.
    bound = underflow_bound(dtype)
    edges = torch.tensor([bound, -bound, bound * 1.001, bound * 0.999, 0.0, -0.0, 2 * bound, 1e-30])
    g = torch.Generator().manual_seed(3)
    spread = torch.randn(4096, generator=g) * torch.exp2(
        torch.randint(-24, 4, (4096,), generator=g).float()
    )
    for scaled in (edges, spread):
        flushed = (scaled != 0) & (scaled.to(dtype).float() == 0)
        assert torch.equal(underflows(scaled, dtype), flushed)
    assert underflows(edges, dtype).tolist() == [True, True, False, True, False, False, False, True]


def test_quantize_counts_the_flushed_elements_of_a_tensor_with_a_wide_range():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 96, generator=g) * torch.exp2(
        torch.randint(-20, 0, (64, 96), generator=g).float()
    )
    x[0, 0] = 0.0  # zero stays zero: not an underflow
    scale = torch.tensor(1.0)
    out = counter()
    q = quantize(x, E4M3, scale, columnwise=True, saturation_out=out)
    expected = ((x != 0) & (q.data.float() == 0)).sum().item()
    assert out.tolist() == [0, x.numel(), expected] and 0 < expected < x.numel()


def test_linear_counts_underflow_per_role():
    layer, x = fitted_layer()
    x = x.clone()
    x[5, :9] = 1e-6  # far below the input's smallest subnormal under its delayed scale (448 / amax)
    scale = layer.fp8_scaling["input"].scale.clone()  # what the cast uses; the pass then updates it
    with fp8_autocast(collect_saturation=True):
        layer(x).sum().backward()
    counts = dict(zip(layer.fp8_scaling.keys(), take_cast_counts(list(layer.fp8_scaling.values()))))
    assert counts["input"][2] == underflows(x * scale, E4M3).sum().item() >= 9


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_a_scale_fitted_to_the_tensor_saturates_nothing(dtype):
    # fp8_max / amax * amax exceeds fp8_max by an fp32 ulp about one time in ten: not saturation.
    g = torch.Generator().manual_seed(1)
    out = counter()
    for _ in range(50):
        quantize(torch.randn(16, 32, generator=g) * 10, dtype, saturation_out=out)
    assert out.tolist()[:2] == [0, 50 * 16 * 32]


def test_counting_accumulates_and_leaves_the_cast_unchanged():
    x = torch.randn(16, 48)
    x[0, :5] = 100.0
    scale = torch.tensor(10.0)
    plain = quantize(x, E4M3, scale, columnwise=True)
    out = counter()
    for _ in range(3):
        counted = quantize(x, E4M3, scale, columnwise=True, saturation_out=out)
    assert out.tolist()[:2] == [15, 3 * x.numel()]
    assert torch.equal(counted.data.view(torch.uint8), plain.data.view(torch.uint8))
    assert torch.equal(counted.data_t.view(torch.uint8), plain.data_t.view(torch.uint8))


def fitted_layer():
    """An Fp8Linear after one delayed-scaling pass, and the input that fitted its input scale."""
    torch.manual_seed(0)
    layer = Fp8Linear(64, 32)
    x = torch.randn(16, 64)
    with fp8_autocast():
        layer(x).sum().backward()
    return layer, x


def test_linear_counts_each_role_under_collect_saturation():
    layer, x = fitted_layer()
    amax = x.abs().max()
    x = x.clone()
    x[3, :7] = 2 * amax  # the delayed input scale is 448 / amax: these reach 896
    with fp8_autocast(collect_saturation=True):
        layer(x).sum().backward()
    counts = dict(zip(layer.fp8_scaling.keys(), take_cast_counts(list(layer.fp8_scaling.values()))))
    assert counts["input"][:2] == (7, x.numel())
    # the same all-ones gradient as the fitting pass
    assert counts["grad_output"][:2] == (
        0,
        16 * 32,
    )
    assert counts["weight"] == (0, 0, 0)  # cached since the last cast: only a fresh cast is counted
    assert take_cast_counts(list(layer.fp8_scaling.values())) == [(0, 0, 0)] * 3  # reset when read


def test_a_fresh_weight_cast_is_counted():
    layer, x = fitted_layer()
    layer.clear_fp8_weight_cache()
    with fp8_autocast(collect_saturation=True):
        layer(x)
    assert take_cast_counts([layer.fp8_scaling["weight"]])[0][:2] == (0, layer.weight.numel())


def test_off_counts_nothing_and_on_changes_no_numerics():
    layer, x = fitted_layer()
    x = x.clone()
    x[0, 0] = 50.0
    layer.zero_grad(set_to_none=True)
    twin = copy.deepcopy(layer)
    results = []
    for module, collect in ((layer, False), (twin, True)):
        inp = x.clone().requires_grad_()
        with fp8_autocast(collect_saturation=collect):
            out = module(inp)
        out.square().sum().backward()
        results.append((out, inp.grad, module.weight.grad, module.bias.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert all(s.cast_counts.tolist() == [0, 0, 0] for s in layer.fp8_scaling.values())
    assert twin.fp8_scaling["input"].cast_counts.tolist()[:2] == [1, x.numel()]


def interpreted_checks():
    """The fused quantize kernel's counts against the torch path's, in Triton's interpreter (its
    FP8 bytes are the GPU test's: the interpreter's conversion is not the hardware's)."""
    from megafp8.fp8 import triton_kernels
    from megafp8.fp8.quantize import quantize_torch

    g = torch.Generator().manual_seed(5)
    x = torch.randn(70, 130, generator=g) * torch.exp2(
        torch.randint(-20, 4, (70, 130), generator=g).float()
    )
    # saturated; E4M3's tie; zero; E5M2's tie
    x[0, :4] = torch.tensor([1e4, 2.0**-10, 0.0, -(2.0**-17)])
    for dtype in (E4M3, E5M2):
        for scale in (torch.tensor(1.0), None):
            for layout in ((True, True), (False, True)):
                counts, ref_counts = counter(), counter()
                triton_kernels.quantize(
                    x.bfloat16(), dtype, scale, 0, *layout, None, None, False, counts
                )
                quantize_torch(
                    x.bfloat16(), dtype, scale, 0, *layout, None, None, False, ref_counts
                )
                assert torch.equal(counts, ref_counts), (dtype, scale, layout, counts, ref_counts)
                assert counts[2] > 0 and counts[1] == x.numel()


def test_quantize_kernel_counts_in_the_triton_interpreter():
    run_interpreted_checks(__name__)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("delayed", [True, False])
@pytest.mark.parametrize("layout", [dict(), dict(rowwise=False, columnwise=True)])
def test_gpu_kernel_counts_equal_the_cpu_counts(dtype, delayed, layout):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 272, generator=g)  # partial tiles both ways
    x.view(-1)[torch.randperm(x.numel(), generator=g)[:123]] *= 1000
    x[0, :3] = torch.tensor([61440.0, 464.0, 465.0]) / 8  # the rounding boundaries, under scale 8
    # E4M3's and E5M2's flush
    x[1, :4] = torch.tensor([2.0**-10, 2.0**-10 * 1.01, 2.0**-17, -(2.0**-17) * 1.01]) / 8
    scale = torch.tensor(8.0) if delayed else None
    for hp in (torch.float32, torch.bfloat16):
        cpu, gpu = counter(), counter().cuda()
        q_cpu = quantize(x.to(hp), dtype, scale, saturation_out=cpu, **layout)
        q_gpu = quantize(
            x.to(hp).cuda(),
            dtype,
            None if scale is None else scale.cuda(),
            saturation_out=gpu,
            **layout,
        )
        assert gpu.tolist() == cpu.tolist()
        assert cpu[1] == x.numel() and (cpu[0] > 0 if delayed else cpu[0] == 0)
        for a, b in ((q_gpu.data, q_cpu.data), (q_gpu.data_t, q_cpu.data_t)):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))
