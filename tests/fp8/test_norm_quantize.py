"""norm_kernels: LayerNorm / RMSNorm written directly in FP8, and the norm's backward.

The torch path against torch.nn.functional (in fp64), aten's statistics and quantize_torch; the
Triton kernels in Triton's interpreter (a fresh process) and on a GPU against the torch path.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from megafp8.fp8 import norm_kernels
from megafp8.fp8.formats import fp8_max
from megafp8.fp8.norm_kernels import (
    norm_backward,
    norm_backward_torch,
    norm_forward_torch,
    norm_quantize,
)
from megafp8.fp8.quantize import quantize_torch
from megafp8.fp8.tensor import saturates, underflows

from ..interpreter import run_interpreted_checks
from .helpers import HUGE, HUGE_CHUNK, assert_same_bits, launch_with_offsets, needs_40gb, rel_err

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-5
# Relative error of a rounding to each dtype (its unit roundoff), and fp32's after a few operations.
ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2e-6}
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def make_inputs(M, N, dtype, rms, *, weight_dtype=None, offset=3.0, seed=0, device="cpu"):
    """x with an offset mean and a different spread per row, a weight around 1 and a bias."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, N, generator=g) * 2 + offset) * (torch.rand(M, 1, generator=g) + 0.5)
    weight = torch.randn(N, generator=g) * 0.5 + 1
    bias = None if rms else torch.randn(N, generator=g) * 0.5
    weight_dtype = weight_dtype or dtype
    return (
        x.to(device, dtype),
        weight.to(device, weight_dtype),
        None if bias is None else bias.to(device, weight_dtype),
    )


def fitted_scale(y, fp8_dtype, headroom=0.9):
    """A delayed scale as a history would give: close to fp8_max / amax, here a bit under."""
    return (fp8_max(fp8_dtype) * headroom / y.float().abs().max()).reshape(())


def functional64(x, weight, bias, rms):
    """(y, mean, rstd) in fp64 through torch.nn.functional (mean None for RMSNorm)."""
    xd, wd = x.double(), weight.double()
    n = x.shape[1]
    if rms:
        return F.rms_norm(xd, (n,), wd, EPS), None, (xd.pow(2).mean(1) + EPS).rsqrt()
    var, mean = torch.var_mean(xd, 1, unbiased=False)
    return F.layer_norm(xd, (n,), wd, bias.double(), EPS), mean, (var + EPS).rsqrt()


def autograd64(dy, x, weight, bias, rms):
    """(dx, dweight, dbias) of F.layer_norm / F.rms_norm by autograd, in fp64."""
    xd = x.double().requires_grad_()
    wd = weight.double().requires_grad_()
    leaves = [xd, wd]
    if rms:
        y = F.rms_norm(xd, (x.shape[1],), wd, EPS)
    else:
        bd = bias.double().requires_grad_()
        leaves.append(bd)
        y = F.layer_norm(xd, (x.shape[1],), wd, bd, EPS)
    grads = torch.autograd.grad(y, leaves, dy.double())
    return grads if not rms else (*grads, None)


def assert_backward_close(grads, ref, x_dtype, weight_dtype, what, floor=1e-5):
    dtypes = (x_dtype, weight_dtype, weight_dtype)
    for name, out, expected, dtype in zip(("dx", "dweight", "dbias"), grads, ref, dtypes):
        if expected is None:
            assert out is None, (what, name)
            continue
        assert out.dtype == dtype, (what, name, out.dtype)
        # Rounded once to its dtype, after fp32 arithmetic.
        bound = max(ROUNDING[dtype], floor)
        assert rel_err(out, expected) < bound, (what, name, rel_err(out, expected))


# -- the torch path, always --------------------------------------------------------------------------


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_torch_is_the_functional_norm_rounded_once(rms, dtype):
    x, weight, bias = make_inputs(37, 200, dtype, rms)
    y, mean, rstd = norm_forward_torch(x, weight, bias, EPS, rms)
    ref_y, ref_mean, ref_rstd = functional64(x, weight, bias, rms)
    assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (37,)
    assert rel_err(y, ref_y) < ROUNDING[dtype]
    assert rel_err(rstd, ref_rstd) < 1e-6
    if rms:
        assert mean is None
    else:
        assert mean.dtype == torch.float32 and rel_err(mean, ref_mean) < 1e-6
    # What the norm module outputs in its own dtype: at most a rounding apart.
    module = (
        F.rms_norm(x, (200,), weight, EPS) if rms else F.layer_norm(x, (200,), weight, bias, EPS)
    )
    assert rel_err(y, module) < 2 * ROUNDING[dtype]


def test_statistics_follow_aten():
    """mean and rstd are aten's (biased variance, [M] for aten's [M, 1]): its backward takes them."""
    x, weight, bias = make_inputs(37, 200, torch.float32, False)
    _, mean, rstd = norm_forward_torch(x, weight, bias, EPS, False)
    _, aten_mean, aten_rstd = torch.native_layer_norm(x, [200], weight, bias, EPS)
    assert rel_err(mean, aten_mean.flatten()) < 1e-6 and rel_err(rstd, aten_rstd.flatten()) < 1e-6
    dy = torch.randn(37, 200, generator=torch.Generator().manual_seed(1))
    aten_grads = torch.ops.aten.native_layer_norm_backward(
        dy, x, [200], mean[:, None], rstd[:, None], weight, bias, [True, True, True]
    )
    for out, expected in zip(norm_backward(dy, x, weight, mean, rstd, False), aten_grads):
        assert rel_err(out, expected) < 1e-6
    x, weight, _ = make_inputs(37, 200, torch.float32, True)
    _, none, rstd = norm_forward_torch(x, weight, None, EPS, True)
    _, aten_rstd = torch.ops.aten._fused_rms_norm(x, [200], weight, EPS)
    assert none is None and rel_err(rstd, aten_rstd.flatten()) < 1e-6


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize(
    "layout", [(True, True), (True, False), (False, True)], ids=["both", "rowwise", "columnwise"]
)
def test_torch_path_casts_the_norm_as_quantize_does(rms, fp8_dtype, layout):
    rowwise, columnwise = layout
    x, weight, bias = make_inputs(37, 200, torch.bfloat16, rms)
    y = norm_forward_torch(x, weight, bias, EPS, rms)[0]
    # Twice the fitted scale: the upper half of the values saturates.
    scale = fitted_scale(y, fp8_dtype, headroom=2.0)
    amax_out = torch.tensor(0.5)  # below this y's amax: the max is the new one
    saturation = torch.tensor([3, 5, 2])
    q, mean, rstd = norm_quantize(
        x,
        weight,
        bias,
        EPS,
        rms,
        fp8_dtype,
        scale,
        rowwise=rowwise,
        columnwise=columnwise,
        amax_out=amax_out,
        saturation_out=saturation,
    )
    ref_saturation = torch.tensor([3, 5, 2])
    ref = quantize_torch(
        y, fp8_dtype, scale, 0, rowwise, columnwise, None, torch.tensor(0.5), False, ref_saturation
    )
    for out, expected in ((q.data, ref.data), (q.data_t, ref.data_t)):
        assert (out is None) == (expected is None)
        if out is not None:
            assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(q.scale_inv, ref.scale_inv) and torch.equal(q.amax, ref.amax)
    assert q.amax is amax_out and amax_out.item() == y.float().abs().max().item()
    assert torch.equal(saturation, ref_saturation) and saturation[1].item() == 5 + y.numel()
    assert 0 < saturation[0].item() - 3 < y.numel()
    assert torch.equal(rstd, norm_forward_torch(x, weight, bias, EPS, rms)[2])
    assert (mean is None) == rms
    # An accumulator above this y's amax keeps its value.
    amax_out = torch.tensor(1e4)
    assert (
        norm_quantize(x, weight, bias, EPS, rms, fp8_dtype, scale, amax_out=amax_out)[0].amax.item()
        == 1e4
    )


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize(
    "dtype, weight_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
    ],
)
def test_backward_torch_matches_autograd_in_fp64(rms, dtype, weight_dtype):
    x, weight, bias = make_inputs(37, 200, dtype, rms, weight_dtype=weight_dtype)
    dy = torch.randn(37, 200, generator=torch.Generator().manual_seed(1)).to(dtype)
    _, mean, rstd = norm_forward_torch(x, weight, bias, EPS, rms)
    grads = norm_backward(dy, x, weight, mean, rstd, rms)
    assert_backward_close(grads, autograd64(dy, x, weight, bias, rms), dtype, weight_dtype, "torch")
    dx, dweight, dbias = norm_backward(
        dy, x, weight, mean, rstd, rms, need_weight_grad=False, need_bias_grad=False
    )
    assert dweight is None and dbias is None and torch.equal(dx, grads[0])


def test_non_finite_input_gives_non_finite_amax_and_keeps_nan():
    x, weight, bias = make_inputs(37, 200, torch.bfloat16, False)
    x[5, 7] = float("nan")
    y = norm_forward_torch(x, weight, bias, EPS, False)[0]
    q, mean, rstd = norm_quantize(x, weight, bias, EPS, False, E4M3, fitted_scale(y[:5], E4M3))
    assert not torch.isfinite(q.amax) and torch.isnan(mean[5])
    assert torch.isnan(q.data.float()[5]).all() and torch.isnan(q.data_t.float()[:, 5]).all()
    assert torch.isfinite(q.data.float()[:5]).all()


def test_norm_quantize_rejects_bad_arguments():
    x, weight, bias = make_inputs(4, 8, torch.float32, False)
    scale = torch.tensor(1.0)
    with pytest.raises(ValueError, match="2-D"):
        norm_quantize(x[None], weight, bias, EPS, False, E4M3, scale)
    with pytest.raises(ValueError, match="rowwise and columnwise"):
        norm_quantize(x, weight, bias, EPS, False, E4M3, scale, rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="no bias"):
        norm_quantize(x, weight, bias, EPS, True, E4M3, scale)
    with pytest.raises(ValueError, match="delayed"):
        norm_quantize(x, weight, bias, EPS, False, E4M3, None)


# -- the Triton kernels in Triton's interpreter, on the CPU ------------------------------------------------
# The kernel casts to FP8 with triton_kernels.to_fp8, exact in the interpreter too: its bytes are
# compared with the torch path's (quantize_torch's saturate-then-cast).


def torch_cast(y, scale, fp8_dtype):
    """The torch path's saturated y * scale in FP8."""
    limit = fp8_max(fp8_dtype)
    return (y.float() * scale).clamp(-limit, limit).to(fp8_dtype)


def same_fraction(a, b):
    """The fraction of equal bytes of two FP8 tensors."""
    return (
        (a.contiguous().view(torch.uint8) == b.contiguous().view(torch.uint8)).float().mean().item()
    )


def check_forward(
    x, weight, bias, rms, fp8_dtype, layout, saturate=False, same_bytes=0.999, y_error=None
):
    """The kernel against the torch path; `y_error`: how far y may be off, relative (its dtype's
    rounding by default)."""
    rowwise, columnwise = layout
    y, ref_mean, ref_rstd = norm_forward_torch(x, weight, bias, EPS, rms)
    scale = fitted_scale(y, fp8_dtype, headroom=2.0 if saturate else 0.9)
    amax_out, saturation = torch.tensor(0.25), torch.tensor([7, 11, 13])
    q, mean, rstd = norm_kernels.norm_quantize_triton(
        x, weight, bias, EPS, rms, fp8_dtype, scale, rowwise, columnwise, amax_out, saturation
    )
    what = (tuple(x.shape), x.dtype, weight.dtype, rms, fp8_dtype, layout)
    assert rel_err(rstd, ref_rstd) < 1e-5 and ((rstd - ref_rstd).abs() <= 1e-5 * ref_rstd).all(), (
        what
    )
    if rms:
        assert mean is None, what
    else:
        assert rel_err(mean, ref_mean) < 1e-5, what
    expected = torch_cast(y, scale, fp8_dtype)
    assert (q.data is not None) == rowwise and (q.data_t is not None) == columnwise, what
    if rowwise:
        assert same_fraction(q.data, expected) >= same_bytes, (
            what,
            same_fraction(q.data, expected),
        )
    if columnwise:
        assert same_fraction(q.data_t, expected.t()) >= same_bytes, (
            what,
            same_fraction(q.data_t, expected.t()),
        )
    ref_amax = y.float().abs().max()
    assert (
        q.amax is amax_out and abs(q.amax - ref_amax) <= (y_error or ROUNDING[x.dtype]) * ref_amax
    ), what
    assert q.scale_inv.item() == scale.reciprocal().item(), what
    ref_saturated = saturates(y.float() * scale, fp8_dtype).sum().item()
    assert saturation[1].item() == 11 + y.numel(), what
    assert abs(saturation[0].item() - 7 - ref_saturated) <= 1e-3 * y.numel(), what
    ref_flushed = underflows(y.float() * scale, fp8_dtype).sum().item()
    assert abs(saturation[2].item() - 13 - ref_flushed) <= 1e-3 * y.numel(), what
    assert (ref_saturated > 0) == saturate, what
    return q, mean, rstd


def interpreted_checks():
    both, rowwise, columnwise = (True, True), (True, False), (False, True)
    for rms in (False, True):
        # Odd sizes: a partial row block and a partial last chunk.
        x, weight, bias = make_inputs(37, 200, torch.bfloat16, rms)
        for fp8_dtype in (E4M3, E5M2):
            for layout in (both, rowwise, columnwise):
                check_forward(x, weight, bias, rms, fp8_dtype, layout)
        check_forward(x, weight, bias, rms, E4M3, both, saturate=True)
        check_forward(x, weight, bias, rms, E5M2, columnwise, saturate=True)
        for dtype, weight_dtype in (
            (torch.float16, torch.float16),
            (torch.float32, torch.float32),
            (torch.bfloat16, torch.float32),
        ):
            check_forward(
                *make_inputs(37, 200, dtype, rms, weight_dtype=weight_dtype), rms, E4M3, both
            )
        # The model's widths, a few rows.
        check_forward(*make_inputs(5, 2048, torch.bfloat16, rms), rms, E4M3, both)
        check_forward(*make_inputs(3, 4096, torch.bfloat16, rms), rms, E4M3, rowwise)
        # |mean| >> std, where merging unshifted chunk statistics lost digits of the variance. Here
        # x - mean itself is uncertain by |mean| * 2^-24 (as much in torch): fp32 y by ~1e-4 of
        # its amax, which moves it across an FP8 rounding boundary now and then.
        check_forward(
            *make_inputs(40, 300, torch.float32, rms, offset=3000.0),
            rms,
            E4M3,
            both,
            same_bytes=0.99,
            y_error=1e-4,
        )
    check_non_finite()
    check_wide_offsets()


def check_non_finite():
    x, weight, bias = make_inputs(37, 200, torch.bfloat16, False)
    x[5, 7] = float("nan")
    y = norm_forward_torch(x, weight, bias, EPS, False)[0]
    scale = fitted_scale(y[:5], E4M3)
    saturation = torch.zeros(3, dtype=torch.int64)
    q, mean, rstd = norm_kernels.norm_quantize_triton(
        x, weight, bias, EPS, False, E4M3, scale, True, True, None, saturation
    )
    assert q.amax.item() == float("inf")  # a NaN counts as +inf, as in triton_kernels.quantize
    assert torch.isnan(mean[5]) and torch.isnan(rstd[5])
    # Row 5 is NaN, which the interpreter's cast encodes as a number that depends on the NaN's
    # bits (the GPU test checks the encoding); the other rows are unaffected.
    expected = torch_cast(y, scale, E4M3)
    rows = torch.arange(37) != 5
    assert same_fraction(q.data[rows], expected[rows]) == 1.0
    assert same_fraction(q.data_t[:, rows], expected.t()[:, rows]) == 1.0
    assert saturation[0].item() == saturates(y.float() * scale, E4M3).sum().item()


def check_wide_offsets():
    """The kernel's int64-offset path (WIDE: what a tensor of 2^31 elements or more takes) gives the
    int32 path's bits: both norms, each layout, the statistics and counts too."""
    for rms in (False, True):
        # a partial row block and last chunk
        x, weight, bias = make_inputs(37, 300, torch.bfloat16, rms)
        scale = fitted_scale(norm_forward_torch(x, weight, bias, EPS, rms)[0], E4M3, headroom=2.0)
        for layout in ((True, True), (True, False), (False, True)):

            def cast():
                amax, counts = torch.tensor(0.25), torch.zeros(3, dtype=torch.int64)
                q, mean, rstd = norm_kernels.norm_quantize_triton(
                    x, weight, bias, EPS, rms, E4M3, scale, *layout, amax, counts
                )
                return q, mean, rstd, counts

            narrow, wide = (
                launch_with_offsets(w, norm_kernels, "_norm_quantize_kernel", cast)
                for w in (False, True)
            )
            assert_same_bits(narrow, wide, (rms, layout))
            assert narrow[3][0] > 0


@needs_triton
def test_kernels_in_the_triton_interpreter():
    run_interpreted_checks(__name__)


# -- on a GPU: the real kernels against the torch path ------------------------------------------------------

needs_cuda_triton = pytest.mark.skipif(not norm_kernels.available(), reason="needs triton")
GPU_SHAPES = [(16384, 2048), (8192, 4096), (37, 200), (1000, 4096)]


def fp8_step(values, fp8_dtype):
    """The spacing of FP8 values around `values` (FP8 units), subnormals included."""
    finfo = torch.finfo(fp8_dtype)
    mantissa_bits = 3 if fp8_dtype == E4M3 else 2
    exponent = torch.floor(torch.log2(values.abs().clamp_min(finfo.smallest_normal)))
    return torch.exp2(exponent - mantissa_bits)


def assert_fp8_close(out, expected, scale, fp8_dtype, what):
    """The kernel's FP8 bytes against the torch path's: 99.9% the same, the others one FP8 step off."""
    assert same_fraction(out, expected) >= 0.999, (what, same_fraction(out, expected))
    a, b = out.float(), expected.float()
    # Where the bias cancels the normalised term, y is ~0 and the kernel's fused
    # multiply-add and torch's separate ops differ by the fp32 rounding of the terms
    # (~1e-7 of y): E5M2's smallest steps (2^-16) resolve that after the scale.
    cancellation = 1e-6 * scale.item()
    far = ~(
        (a - b).abs()
        <= torch.clamp_min(fp8_step(torch.maximum(a.abs(), b.abs()), fp8_dtype), cancellation)
    )
    assert not far.any(), (what, a[far][:8], b[far][:8], far.nonzero()[:8].tolist(), scale.item())


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_gpu_forward_matches_the_torch_path(shape, rms, fp8_dtype):
    x, weight, bias = make_inputs(*shape, torch.bfloat16, rms, device="cuda")
    y, ref_mean, ref_rstd = norm_forward_torch(x, weight, bias, EPS, rms)
    for layout in [(True, True), (True, False), (False, True)]:
        for saturate in (False, True):
            scale = fitted_scale(y, fp8_dtype, headroom=2.0 if saturate else 0.9)
            amax_out = torch.tensor(0.25, device="cuda")
            saturation = torch.tensor([7, 11, 13], device="cuda")
            q, mean, rstd = norm_quantize(
                x,
                weight,
                bias,
                EPS,
                rms,
                fp8_dtype,
                scale,
                rowwise=layout[0],
                columnwise=layout[1],
                amax_out=amax_out,
                saturation_out=saturation,
            )
            ref_saturation = torch.tensor([7, 11, 13], device="cuda")
            ref = quantize_torch(
                y,
                fp8_dtype,
                scale,
                0,
                *layout,
                None,
                torch.tensor(0.25, device="cuda"),
                False,
                ref_saturation,
            )
            what = (shape, rms, fp8_dtype, layout, saturate)
            assert rel_err(rstd, ref_rstd) < 1e-5 and (rms or rel_err(mean, ref_mean) < 1e-5), what
            for out, expected in ((q.data, ref.data), (q.data_t, ref.data_t)):
                assert (out is None) == (expected is None), what
                if out is None:
                    continue
                assert_fp8_close(out, expected, scale, fp8_dtype, what)
            assert (
                abs(q.amax - ref.amax) <= ROUNDING[torch.bfloat16] * ref.amax and q.amax is amax_out
            ), what
            assert torch.equal(q.scale_inv, ref.scale_inv), what
            assert saturation[1] == ref_saturation[1], what
            assert abs(saturation[0] - ref_saturation[0]).item() <= 1e-3 * y.numel(), what
            assert abs(saturation[2] - ref_saturation[2]).item() <= 1e-3 * y.numel(), what


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_gpu_backward_matches_the_torch_path_and_autograd(shape, rms, weight_dtype):
    x, weight, bias = make_inputs(
        *shape, torch.bfloat16, rms, weight_dtype=weight_dtype, device="cuda"
    )
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    _, mean, rstd = norm_forward_torch(x, weight, bias, EPS, rms)
    grads = norm_backward(dy, x, weight, mean, rstd, rms)
    assert_backward_close(
        grads, autograd64(dy, x, weight, bias, rms), torch.bfloat16, weight_dtype, shape
    )
    for out, expected in zip(grads, norm_backward_torch(dy, x, weight, mean, rstd, rms)):
        assert (out is None) == (expected is None)
        if out is not None:
            assert rel_err(out, expected) < max(ROUNDING[out.dtype] / 8, 1e-6), (
                shape,
                rel_err(out, expected),
            )
    again = norm_backward(dy, x, weight, mean, rstd, rms)
    assert all(a is None or torch.equal(a, b) for a, b in zip(grads, again)), "not deterministic"


@pytest.mark.gpu
@needs_cuda_triton
def test_gpu_non_finite_input():
    x, weight, bias = make_inputs(100, 300, torch.bfloat16, False, device="cuda")
    x[5, 7] = float("nan")
    scale = torch.tensor(20.0, device="cuda")
    q, mean, rstd = norm_quantize(x, weight, bias, EPS, False, E4M3, scale)
    assert q.amax.item() == float("inf")
    assert torch.isnan(q.data.float()[5]).all() and torch.isnan(q.data_t.float()[:, 5]).all()
    assert torch.isfinite(q.data.float()[6:]).all()


@pytest.mark.gpu
@needs_cuda_triton
@needs_40gb
def test_gpu_layernorm_of_more_than_2_31_elements():
    """norm_quantize past int32 offsets, both layouts and the transposed one alone, against the torch
    path a block of rows at a time (an fp32 copy of x would be 8.6 GB)."""
    M, N = HUGE
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(HUGE, device="cuda", dtype=torch.bfloat16, generator=g).mul_(2).add_(3)
    x.mul_(torch.rand(M, 1, device="cuda", generator=g).add_(0.5).bfloat16())  # a spread per row
    weight = (torch.randn(N, device="cuda", generator=g) * 0.5 + 1).bfloat16()
    bias = (torch.randn(N, device="cuda", generator=g) * 0.5).bfloat16()
    # A spike in the last element, under unit weight and no bias: y there (~180) is the amax, past
    # 2^31 elements in both layouts, and saturates.
    x[M - 1, N - 1], weight[N - 1], bias[N - 1] = 3000.0, 1.0, 0.0
    scale = torch.tensor(448.0 / 32, device="cuda")
    amax_out = torch.tensor(0.25, device="cuda")
    counts, ref_counts = (torch.zeros(3, dtype=torch.int64, device="cuda") for _ in range(2))
    q, mean, rstd = norm_quantize(
        x, weight, bias, EPS, False, E4M3, scale, amax_out=amax_out, saturation_out=counts
    )
    alone = norm_quantize(x, weight, bias, EPS, False, E4M3, scale, rowwise=False)[0].data_t
    ref_amax = 0.0
    blocks = zip(
        x.split(HUGE_CHUNK),
        q.data.split(HUGE_CHUNK),
        q.data_t.split(HUGE_CHUNK, dim=1),
        alone.split(HUGE_CHUNK, dim=1),
        mean.split(HUGE_CHUNK),
        rstd.split(HUGE_CHUNK),
    )
    for i, (rows, data, data_t, data_t_alone, block_mean, block_rstd) in enumerate(blocks):
        y, ref_mean, ref_rstd = norm_forward_torch(rows, weight, bias, EPS, False)
        expected = quantize_torch(
            y, E4M3, scale, 0, True, False, None, None, False, ref_counts
        ).data
        what = f"rows from {i * HUGE_CHUNK}"
        assert rel_err(block_rstd, ref_rstd) < 1e-5 and rel_err(block_mean, ref_mean) < 1e-5, what
        assert_fp8_close(data, expected, scale, E4M3, what)
        # the stored tile's bytes
        assert torch.equal(data_t.view(torch.uint8), data.view(torch.uint8).t()), what
        assert_fp8_close(data_t_alone, expected.t(), scale, E4M3, what + ", columnwise alone")
        ref_amax = max(ref_amax, y.float().abs().max().item())
    assert q.amax is amax_out and ref_amax > 100
    assert abs(q.amax.item() - ref_amax) <= ROUNDING[torch.bfloat16] * ref_amax
    assert counts[1] == ref_counts[1] == M * N and counts[0] > 0
    assert (
        abs(counts[0] - ref_counts[0]) <= 1e-3 * M * N
        and abs(counts[2] - ref_counts[2]) <= 1e-3 * M * N
    )
