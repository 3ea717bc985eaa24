"""The MLP activation fused with its FP8 cast (megafp8/fp8/activation_kernels.py). On the CPU the
torch path gives the bytes of the unfused ops (the MLP's activation, or its autograd gradient)
followed by `quantize_torch`; the Triton kernels meet that reference in Triton's interpreter, and
on a GPU match torch's CUDA ops byte for byte but where the last ulp of a transcendental function
differs: there one FP8 step apart. GELU-tanh's gradient, computed in another form, is held to
the exact gradient (fp64) instead, no less accurately than aten's."""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from megafp8.fp8 import activation_kernels
from megafp8.fp8.activation_kernels import (
    KINDS,
    activation_backward_quantize,
    activation_backward_torch,
    activation_quantize,
    activation_torch,
)
from megafp8.fp8.quantize import quantize_torch
from megafp8.fp8.tensor import Fp8Tensor

from ..interpreter import run_interpreted_checks
from .helpers import HUGE, HUGE_CHUNK, assert_same_bits, launch_with_offsets, needs_40gb

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [torch.bfloat16, torch.float32]
LAYOUTS = [(True, True), (True, False), (False, True)]  # (rowwise, columnwise)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def make_inputs(kind, dtype, M, F_, seed=0, device="cpu"):
    """h [M, K] (K = 2F for SwiGLU) of spread 3, as fc1's output; dout [M, F] as fc2's dgrad."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, 2 * F_ if kind == "swiglu" else F_, generator=g) * 3
    dout = torch.randn(M, F_, generator=g) * 0.01
    return h.to(device, dtype), dout.to(device, dtype)


def mlp_activation(h, kind):
    """The activation as models/transformer.py's MLP computed it before the fusion."""
    if kind == "swiglu":
        gate, up = rearrange(h, "... (two ffn) -> two ... ffn", two=2)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh" if kind == "gelu_tanh" else "none")


def autograd_dh(dout, h, kind, activation=mlp_activation):
    with torch.enable_grad():
        h = h.detach().requires_grad_()
        return torch.autograd.grad(activation(h, kind), h, dout)[0]


def scales(h, dout, kind):
    """(forward, backward) delayed scales that saturate the top 5% or so of the values (a stale
    history after the values grew), neither a power of two: ties in the FP8 rounding stay rare."""
    y, dh = activation_torch(h, kind).float(), activation_backward_torch(dout, h, kind).float()
    return (
        torch.tensor(448.0 / (0.6 * y.abs().max().item()), device=h.device),
        torch.tensor(57344.0 / (0.6 * dh.abs().max().item()), device=h.device),
    )


def same_bits(a, b):
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def assert_same_cast(q, ref):
    assert (q.data is None) == (ref.data is None) and (q.data_t is None) == (ref.data_t is None)
    for name in ("data", "data_t"):
        if getattr(ref, name) is not None:
            assert same_bits(getattr(q, name), getattr(ref, name)), name
    assert same_bits(q.scale_inv, ref.scale_inv)
    assert torch.equal(q.amax, ref.amax)
    if ref.col_sum is not None:
        assert same_bits(q.col_sum, ref.col_sum)


# -- the torch path, on the CPU: exactly the unfused ops ----------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_activation_and_its_gradient_are_the_mlps(kind, dtype):
    h, dout = make_inputs(kind, dtype, 37, 200)
    assert same_bits(activation_torch(h, kind), mlp_activation(h, kind))
    dh = activation_backward_torch(dout, h, kind)
    assert same_bits(dh, autograd_dh(dout, h, kind))
    assert same_bits(dh, autograd_dh(dout, h, kind, activation_torch))


@pytest.mark.parametrize("rowwise,columnwise", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_torch_path_is_unfused_then_quantize(kind, dtype, rowwise, columnwise):
    h, dout = make_inputs(kind, dtype, 37, 200)
    scale, grad_scale = scales(h, dout, kind)
    layouts = dict(rowwise=rowwise, columnwise=columnwise)
    counts, ref_counts = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    amax_out, ref_amax_out = torch.tensor(1e-3), torch.tensor(1e-3)
    q = activation_quantize(
        h, kind, E4M3, scale, **layouts, amax_out=amax_out, saturation_out=counts
    )
    ref = quantize_torch(
        mlp_activation(h, kind),
        E4M3,
        scale,
        0,
        rowwise,
        columnwise,
        None,
        ref_amax_out,
        False,
        ref_counts,
    )
    assert_same_cast(q, ref)
    assert q.amax is amax_out and torch.equal(amax_out, ref_amax_out)
    assert torch.equal(counts, ref_counts) and counts[0] > 0 and counts[1] == 37 * 200

    counts.zero_()
    ref_counts.zero_()
    q = activation_backward_quantize(
        dout, h, kind, E5M2, grad_scale, **layouts, col_sum=True, saturation_out=counts
    )
    ref = quantize_torch(
        autograd_dh(dout, h, kind),
        E5M2,
        grad_scale,
        0,
        rowwise,
        columnwise,
        None,
        None,
        True,
        ref_counts,
    )
    assert_same_cast(q, ref)
    assert torch.equal(counts, ref_counts) and counts[0] > 0 and counts[1] == h.numel()


@pytest.mark.parametrize("kind", KINDS)
def test_torch_path_non_finite_inputs(kind):
    h, dout = make_inputs(kind, torch.bfloat16, 16, 24)
    h[3, 5], h[7, 2] = float("nan"), float("inf")
    q = activation_quantize(h, kind, E4M3, torch.tensor(1.0))
    assert not torch.isfinite(q.amax)
    assert torch.isnan(q.data.float()[3, 5]) and torch.isnan(q.data_t.float()[5, 3])
    dq = activation_backward_quantize(dout, h, kind, E5M2, torch.tensor(1.0), col_sum=True)
    assert not torch.isfinite(dq.amax)
    assert torch.isnan(dq.data.float()[3, 5]) and torch.isnan(dq.col_sum[5])


def test_bad_arguments_are_refused():
    h, dout = make_inputs("swiglu", torch.bfloat16, 4, 6)
    scale = torch.tensor(1.0)
    with pytest.raises(ValueError, match="unknown activation"):
        activation_quantize(h, "relu", E4M3, scale)
    with pytest.raises(ValueError, match="2-D"):
        activation_quantize(h[None], "gelu", E4M3, scale)
    with pytest.raises(ValueError, match="even"):
        activation_quantize(h[:, :5], "swiglu", E4M3, scale)
    with pytest.raises(ValueError, match="delayed"):
        activation_quantize(h, "gelu", E4M3, None)
    with pytest.raises(ValueError, match="rowwise and columnwise"):
        activation_quantize(h, "gelu", E4M3, scale, rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="dout must be"):
        activation_backward_quantize(dout[:, :5], h, "swiglu", E5M2, scale)
    with pytest.raises(ValueError, match="dout must be"):
        activation_backward_quantize(dout.float(), h, "swiglu", E5M2, scale)


# -- the Triton kernels, against the torch path ----------------------------------------------------


def compare(q, ref, x, exact_fraction, what, magnitude=None):
    """The kernel's cast `q` against the torch path's `ref`; x: h (GELU) or the gate (SwiGLU) at
    each element of the activation or of the gradient's first half; `magnitude`: the column sums
    and maxima of |dh| and the unit roundoff of its dtype, the scales of col_sum's rounding."""
    for name in ("data", "data_t"):
        a, b = getattr(q, name), getattr(ref, name)
        assert (a is None) == (b is None), (what, name)
        if a is None:
            continue
        if name == "data_t":
            a, b = a.t(), b.t()
        differ = a.view(torch.uint8) != b.view(torch.uint8)
        differ &= ~((a.float() == 0) & (b.float() == 0))  # a signed zero, below
        # Past x = -3.5, GELU and its gradient are a cancellation (1 + tanh or 1 + erf near 0)
        # that the last ulp of tanh or erf decides, and torch's CPU kernels (Sleef, its own erf; a
        # signed zero) differ there from libdevice: values 1e-4 of the amax, not held to the
        # same bytes (x = -3.98 in bf16 gave one FP8 step of difference in the interpreter).
        tail = torch.zeros_like(differ)
        tail[:, : x.shape[1]] = x < -3.5
        fraction = differ[~tail].float().mean().item()
        assert fraction <= 1 - exact_fraction, (
            f"{what} {name}: {differ[~tail].sum().item()} bytes differ"
        )
        # Where bytes differ, by one step of the FP8 grid: a value one rounding apart before the cast.
        finite = torch.isfinite(b.float())
        assert torch.equal(torch.isfinite(a.float()), finite), (what, name)
        off = (a.float() - b.float()).abs()[finite & ~tail]
        assert (
            off
            <= fp8_step(torch.maximum(a.float().abs(), b.float().abs())[finite & ~tail], a.dtype)
        ).all(), (what, name, off.max().item())
        gap = (a.float() - b.float()).abs()[tail] * ref.scale_inv
        assert gap.numel() == 0 or gap.max().item() <= 1e-4 * ref.amax.item(), (what, name)
    if q.data is not None and q.data_t is not None:
        assert same_bits(q.data_t, q.data.t().contiguous()), what
    assert same_bits(q.scale_inv, ref.scale_inv), what
    # Rounded to bf16 or fp32 as the activation is: one rounding apart at most.
    assert abs(q.amax.item() - ref.amax.item()) <= 2**-8 * ref.amax.item(), (what, q.amax, ref.amax)
    if ref.col_sum is not None:
        # fp32 rounding of the sum; and where a transcendental function differs in its last bit,
        # an element of dh may round the other way in its dtype (in the interpreter: once or so
        # in a few thousand bf16 elements).
        magnitude, largest, ulp = magnitude
        assert ((q.col_sum - ref.col_sum).abs() <= 1e-5 * magnitude + ulp * largest).all(), what


def fp8_step(values, fp8_dtype):
    """The spacing of the FP8 grid at `values` (FP8 units), subnormals included."""
    finfo = torch.finfo(fp8_dtype)
    exponent = torch.floor(torch.log2(values.abs().clamp_min(finfo.smallest_normal)))
    return torch.exp2(exponent - (3 if fp8_dtype == E4M3 else 2))


def check_kernels(kind, dtype, M, F_, layouts, device, exact_fraction, seed=0):
    """Forward and backward casts of the kernels (what the public functions run on `device`)
    against the torch path: bytes, amax (accumulated into a given one), saturation counts, and
    the gradient's column sums."""
    h, dout = make_inputs(kind, dtype, M, F_, seed, device)
    scale, grad_scale = scales(h, dout, kind)
    x = h[:, :F_]
    for rowwise, columnwise in layouts:
        what = f"{kind} {dtype} {M}x{F_} rowwise={rowwise} columnwise={columnwise}"
        counts = torch.zeros(3, dtype=torch.int64, device=device)
        ref_counts = torch.zeros(3, dtype=torch.int64, device=device)
        amax_out = torch.tensor(1e-3, device=device)
        q = activation_quantize(
            h,
            kind,
            E4M3,
            scale,
            rowwise=rowwise,
            columnwise=columnwise,
            amax_out=amax_out,
            saturation_out=counts,
        )
        y = activation_torch(h, kind)
        ref = quantize_torch(y, E4M3, scale, 0, rowwise, columnwise, None, None, False, ref_counts)
        assert q.amax is amax_out
        compare(q, ref, x, exact_fraction, what + " forward")
        assert counts[1] == ref_counts[1], what
        assert abs(counts[0] - ref_counts[0]) <= 1e-3 * counts[1], what  # saturated
        # Flushed to zero: where the activation is far below the smallest subnormal, the kernel's
        # formula and aten's may give a tiny value and an exact zero, both cast to zero.
        assert abs(counts[2] - ref_counts[2]) <= 1e-3 * counts[1] + (y == 0).sum(), what
        # An accumulator larger than the tensor's amax keeps its value.
        large = torch.tensor(1e6, device=device)
        activation_quantize(
            h, kind, E4M3, scale, rowwise=rowwise, columnwise=columnwise, amax_out=large
        )
        assert large.item() == 1e6

        counts.zero_()
        ref_counts.zero_()
        q = activation_backward_quantize(
            dout,
            h,
            kind,
            E5M2,
            grad_scale,
            rowwise=rowwise,
            columnwise=columnwise,
            col_sum=True,
            saturation_out=counts,
        )
        dh = activation_backward_torch(dout, h, kind)
        ref = quantize_torch(
            dh, E5M2, grad_scale, 0, rowwise, columnwise, None, None, True, ref_counts
        )
        magnitude = dh.float().abs()
        compare(
            q,
            ref,
            x,
            exact_fraction,
            what + " backward",
            (magnitude.sum(0), magnitude.amax(0), torch.finfo(dtype).eps),
        )
        assert counts[1] == ref_counts[1], what
        assert abs(counts[0] - ref_counts[0]) <= 1e-3 * counts[1], what  # saturated
        # as forward
        assert abs(counts[2] - ref_counts[2]) <= 1e-3 * counts[1] + (dh == 0).sum(), what


def check_non_finite(kind, device):
    """NaN and inf in h: a non-finite amax from kernel and reference alike (the kernel counts NaN
    as +inf, as triton_kernels' quantize does), NaN bytes where the output is NaN."""
    h, dout = make_inputs(kind, torch.bfloat16, 37, 200, device=device)
    h[3, 5], h[20, 150] = float("nan"), float("inf")
    one = torch.tensor(1.0, device=device)
    q = activation_quantize(h, kind, E4M3, one)
    ref = quantize_torch(activation_torch(h, kind), E4M3, one, 0, True, True)
    assert not torch.isfinite(q.amax) and not torch.isfinite(ref.amax), kind
    # NaN where the activation is NaN. Not ref's NaN: torch's vectorised CPU GELU in fp32 and
    # bf16 gives NaN at +inf where CUDA, fp64 and the math give +inf.
    nan = torch.isnan(activation_torch(h.double(), kind))
    assert torch.equal(torch.isnan(q.data.float()), nan), kind
    assert torch.equal(torch.isnan(q.data_t.float()), nan.t()), kind
    dq = activation_backward_quantize(dout, h, kind, E5M2, one, col_sum=True)
    dref = quantize_torch(
        activation_backward_torch(dout, h, kind), E5M2, one, 0, True, True, col_sum=True
    )
    assert not torch.isfinite(dq.amax) and not torch.isfinite(dref.amax), kind
    assert torch.equal(torch.isnan(dq.data.float()), torch.isnan(dref.data.float())), kind
    assert torch.equal(torch.isnan(dq.col_sum), torch.isnan(dref.col_sum)), kind


def check_gelu_tanh_gradient_accuracy(M, F_, device):
    """The kernel computes GELU-tanh's gradient in its sigmoid form, not aten's: against the
    exact gradient (fp64, rounded once to the dtype, then cast), its FP8 bytes are off no more
    often than aten's (on an H100 in fp32: 15 against 241,607 of 8.4M), and by one step of the
    grid where they are; but where GELU's gradient crosses zero (x = -0.75), a cancellation in
    fp32 in either form: there by 1e-6 of the largest value (seen: 4e-9)."""
    for dtype in DTYPES:
        h, dout = make_inputs("gelu_tanh", dtype, M, F_, seed=3, device=device)
        _, grad_scale = scales(h, dout, "gelu_tanh")
        exact = activation_backward_torch(dout.double(), h.double(), "gelu_tanh").to(dtype)
        truth = quantize_torch(exact, E5M2, grad_scale, 0, True, False).data.float()
        ours = activation_backward_quantize(
            dout, h, "gelu_tanh", E5M2, grad_scale, columnwise=False
        ).data.float()
        atens = quantize_torch(
            activation_backward_torch(dout, h, "gelu_tanh"), E5M2, grad_scale, 0, True, False
        ).data.float()
        ours_off, atens_off = (ours != truth).sum().item(), (atens != truth).sum().item()
        assert ours_off <= atens_off + 1e-4 * h.numel(), (dtype, ours_off, atens_off)
        off = (ours - truth).abs()
        bound = torch.maximum(
            fp8_step(torch.maximum(ours.abs(), truth.abs()), E5M2), 1e-6 * truth.abs().max()
        )
        assert (off <= bound).all(), (dtype, (off - bound).max().item())


def interpreted_checks():
    # else the public functions run torch on the CPU
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for kind in KINDS:
        for dtype in DTYPES:
            check_kernels(kind, dtype, 37, 200, LAYOUTS, "cpu", exact_fraction=0.999)
        check_kernels(
            kind, torch.bfloat16, 70, 130, LAYOUTS[:1], "cpu", exact_fraction=0.999, seed=1
        )
        check_non_finite(kind, "cpu")
    check_gelu_tanh_gradient_accuracy(300, 256, "cpu")
    check_wide_offsets()


def check_wide_offsets():
    """The kernels' int64-offset path (WIDE: what a tensor of 2^31 elements or more takes) gives the
    int32 path's bits: each activation and layout, forward and backward, counts and column sums too."""
    for kind in KINDS:
        # partial tiles both ways, forward and backward
        h, dout = make_inputs(kind, torch.bfloat16, 37, 72)
        scale, grad_scale = scales(h, dout, kind)
        for rowwise, columnwise in LAYOUTS:

            def forward():
                counts = torch.zeros(3, dtype=torch.int64)
                return activation_quantize(
                    h,
                    kind,
                    E4M3,
                    scale,
                    rowwise=rowwise,
                    columnwise=columnwise,
                    amax_out=torch.tensor(1e-3),
                    saturation_out=counts,
                ), counts

            def backward():
                counts = torch.zeros(3, dtype=torch.int64)
                return activation_backward_quantize(
                    dout,
                    h,
                    kind,
                    E5M2,
                    grad_scale,
                    rowwise=rowwise,
                    columnwise=columnwise,
                    col_sum=True,
                    saturation_out=counts,
                ), counts

            what = (kind, rowwise, columnwise)
            for kernel, cast in (
                ("_activation_quantize_kernel", forward),
                ("_activation_backward_quantize_kernel", backward),
            ):
                narrow, wide = (
                    launch_with_offsets(w, activation_kernels, kernel, cast) for w in (False, True)
                )
                assert_same_bits(narrow, wide, (what, kernel))
                assert narrow[1][0] > 0, (what, kernel)


@needs_triton
def test_kernels_in_the_triton_interpreter():
    run_interpreted_checks(__name__, "-W", "ignore::RuntimeWarning")


needs_cuda_triton = pytest.mark.skipif(
    not (
        torch.cuda.is_available()
        and importlib.util.find_spec("triton") is not None
        and torch.cuda.get_device_capability() >= (8, 9)
    ),
    reason="needs a CUDA GPU with FP8 (compute capability 8.9+) and triton",
)


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_kernels_match_torchs_cuda_ops(kind, dtype):
    # On the GPU the reference is aten's CUDA kernels, the same arithmetic but not the same build
    # of erf, tanh and exp (CUDA's math library against Triton's libdevice): 0.14% of GELU's
    # bytes differed by one FP8 step on an H100 (CUDA 13, Triton 3.6).
    for M, F_, seed in ((37, 200, 0), (4096, 1376, 1), (1000, 64, 2)):
        check_kernels(kind, dtype, M, F_, LAYOUTS, "cuda", exact_fraction=0.995, seed=seed)
    check_non_finite(kind, "cuda")


@pytest.mark.gpu
@needs_cuda_triton
def test_gpu_gelu_tanh_gradient_is_as_accurate_as_atens():
    check_gelu_tanh_gradient_accuracy(4096, 2048, "cuda")


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_backward_is_deterministic(kind):
    h, dout = make_inputs(kind, torch.bfloat16, 2048, 1024, device="cuda")
    scale = torch.tensor(1000.0, device="cuda")
    first = activation_backward_quantize(dout, h, kind, E5M2, scale, col_sum=True)
    again = activation_backward_quantize(dout, h, kind, E5M2, scale, col_sum=True)
    assert same_bits(first.data, again.data) and same_bits(first.col_sum, again.col_sum)


@pytest.mark.gpu
@needs_cuda_triton
@needs_40gb
def test_gpu_gelu_of_more_than_2_31_elements():
    """Forward and backward casts of GELU past int32 offsets, both layouts, against the unfused CUDA
    ops and quantize_torch a block of rows at a time, as `compare` holds them (the transposed layout
    is the row-major one's bytes)."""
    M, F_ = HUGE
    g = torch.Generator("cuda").manual_seed(0)
    h = torch.randn(HUGE, device="cuda", dtype=torch.bfloat16, generator=g).mul_(3)
    # Peaks that saturate, the largest (GELU(40) = 40, the amax) in the last element: past 2^31
    # elements in both layouts.
    peaks = [(0, 0), (M - 8, 5), (M - 1, F_ - 1)]
    for i, (row, col) in enumerate(peaks):
        h[row, col] = 30.0 + 5 * i
    scale = torch.tensor(448.0 / 24, device="cuda")  # beyond 24 saturates: the peaks alone
    counts, ref_counts = (torch.zeros(3, dtype=torch.int64, device="cuda") for _ in range(2))
    amax_out = torch.tensor(1e-3, device="cuda")
    q = activation_quantize(h, "gelu", E4M3, scale, amax_out=amax_out, saturation_out=counts)
    assert q.amax is amax_out and amax_out.item() == 40.0
    zeros = 0
    for i, (rows, data, data_t) in enumerate(
        zip(h.split(HUGE_CHUNK), q.data.split(HUGE_CHUNK), q.data_t.split(HUGE_CHUNK, dim=1))
    ):
        y = activation_torch(rows, "gelu")
        ref = quantize_torch(y, E4M3, scale, 0, True, False, None, None, False, ref_counts)
        what = f"forward, rows from {i * HUGE_CHUNK}"
        compare(
            Fp8Tensor(data, None, q.scale_inv, q.amax), ref._replace(amax=q.amax), rows, 0.995, what
        )
        assert same_bits(data_t, data.t()), what
        zeros += (y == 0).sum().item()
    assert counts[0] == ref_counts[0] == len(peaks) and counts[1] == ref_counts[1] == M * F_
    assert abs(counts[2] - ref_counts[2]) <= 1e-3 * counts[1] + zeros  # as check_kernels has it
    del q, data, data_t

    dout = torch.randn(HUGE, device="cuda", dtype=torch.bfloat16, generator=g).mul_(0.01)
    grad_scale = torch.tensor(57344.0 / 0.03, device="cuda")  # the largest gradients saturate
    counts.zero_()
    ref_counts.zero_()
    dq = activation_backward_quantize(
        dout, h, "gelu", E5M2, grad_scale, col_sum=True, saturation_out=counts
    )
    col_sum, magnitude = (torch.zeros(F_, device="cuda", dtype=torch.float64) for _ in range(2))
    ref_amax, zeros = 0.0, 0
    for i, (d, rows, data, data_t) in enumerate(
        zip(
            dout.split(HUGE_CHUNK),
            h.split(HUGE_CHUNK),
            dq.data.split(HUGE_CHUNK),
            dq.data_t.split(HUGE_CHUNK, dim=1),
        )
    ):
        dh = activation_backward_torch(d, rows, "gelu")
        ref = quantize_torch(dh, E5M2, grad_scale, 0, True, False, None, None, False, ref_counts)
        what = f"backward, rows from {i * HUGE_CHUNK}"
        compare(
            Fp8Tensor(data, None, dq.scale_inv, dq.amax),
            ref._replace(amax=dq.amax),
            rows,
            0.995,
            what,
        )
        assert same_bits(data_t, data.t()), what
        col_sum += dh.sum(0, dtype=torch.float64)
        magnitude += dh.abs().sum(0, dtype=torch.float64)
        ref_amax = max(ref_amax, ref.amax.item())
        zeros += (dh == 0).sum().item()
    assert abs(dq.amax.item() - ref_amax) <= 2**-8 * ref_amax
    assert counts[1] == ref_counts[1] == M * F_ and counts[0] > 0
    assert abs(counts[0] - ref_counts[0]) <= 1e-3 * counts[1]
    assert abs(counts[2] - ref_counts[2]) <= 1e-3 * counts[1] + zeros
    # fp32 rounding of the sums, and the elements of dh that round the other way in bf16 where
    # libdevice and CUDA's math library differ in a last bit (one bf16 step, 2^-8 of the element,
    # in a small fraction of the 65544 rows): 1e-4 of the column's sum of |dh|.
    assert ((dq.col_sum - col_sum).abs() <= 1e-4 * magnitude).all()
