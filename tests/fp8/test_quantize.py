import importlib.util

import pytest
import torch

from megafp8 import fp8_max, quantize, scale_from_amax, triton_support
from megafp8.fp8 import triton_kernels
from megafp8.fp8.fused import HeadGradsSource

from ..interpreter import run_interpreted_checks
from .helpers import UNIT_ROUNDOFF, assert_same_bits, launch_with_offsets

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
E4M3, E5M2 = FP8_DTYPES
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def test_fp8_max_values():
    assert fp8_max(torch.float8_e4m3fn) == 448.0
    assert fp8_max(torch.float8_e5m2) == 57344.0


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_every_finite_fp8_value_round_trips_exactly(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    values = codes.float()
    values = values[torch.isfinite(values)].reshape(1, -1)
    values = values[:, : values.shape[1] // 2 * 2].reshape(2, -1)
    q = quantize(values, dtype, torch.tensor(1.0))
    assert torch.equal(q.data.float(), values)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_within_unit_roundoff(dtype, hp_dtype):
    x = (torch.randn(64, 96) * 5).to(hp_dtype)
    q = quantize(x, dtype, columnwise=True)  # current scaling: fitted to x
    back = q.data.float() * q.scale_inv
    xf = x.float()
    # Elements in FP8's normal range carry at most the unit roundoff; tiny ones at most half
    # the smallest subnormal step.
    finfo = torch.finfo(dtype)
    normal = xf.abs() / q.scale_inv >= finfo.smallest_normal
    assert ((back - xf).abs()[normal] <= UNIT_ROUNDOFF[dtype] * xf.abs()[normal]).all()
    subnormal_step = finfo.smallest_normal / 2 ** (
        finfo.bits - 1 - (5 if dtype == torch.float8_e4m3fn else 6)
    )
    assert ((back - xf).abs()[~normal] <= subnormal_step / 2 * q.scale_inv).all()
    assert torch.equal(q.data_t, q.data.t().contiguous())
    assert q.amax.item() == xf.abs().max().item()
    assert q.scale_inv.item() == pytest.approx(xf.abs().max().item() / fp8_max(dtype), rel=1e-6)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_casts_saturate_instead_of_overflowing_to_nan(dtype):
    limit = fp8_max(dtype)
    x = torch.randn(16, 32)
    x[0, 0], x[1, 1], x[2, 2] = 10 * limit, -10 * limit, float("inf")
    q = quantize(x, dtype, torch.tensor(1.0))
    values = q.data.float()
    assert not torch.isnan(values).any()
    assert (values[0, 0], values[1, 1], values[2, 2]) == (limit, -limit, limit)


def test_delayed_cast_uses_the_given_scale_and_reports_the_amax():
    x = torch.randn(32, 48)
    scale = torch.tensor(3.0)
    q = quantize(x, torch.float8_e4m3fn, scale, rowwise=False, columnwise=True)
    assert q.data is None
    expected = (x * 3.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.data_t.float(), expected.t().float())
    assert q.scale_inv.item() == pytest.approx(1 / 3)
    assert q.amax.item() == x.abs().max().item()


def test_current_scaling_writes_its_scale_and_honours_the_margin():
    x = torch.randn(16, 16)
    x[3, 4] = 7.0
    out = torch.zeros(())
    quantize(x, torch.float8_e4m3fn, margin=2, scale_out=out)
    assert out.item() == pytest.approx(448 / 7 / 4)


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_scale_from_an_unusable_amax_is_one(bad):
    assert scale_from_amax(torch.tensor(bad), torch.float8_e4m3fn).item() == 1.0


def test_non_finite_inputs_give_non_finite_amax_and_keep_nan():
    x = torch.randn(16, 16)
    x[0, 0] = float("nan")
    q = quantize(x, torch.float8_e4m3fn, torch.tensor(1.0))
    assert not torch.isfinite(q.amax)
    assert torch.isnan(q.data.float()[0, 0])
    x[0, 0] = float("inf")
    assert quantize(x, torch.float8_e4m3fn, torch.tensor(1.0)).amax.item() == float("inf")


def test_quantize_rejects_bad_arguments():
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(2, 3, 4), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="rowwise and columnwise"):
        quantize(torch.randn(2, 3), torch.float8_e4m3fn, rowwise=False)


def test_kernels_take_int64_offsets_from_2_31_elements_or_an_offset_that_far():
    meta = dict(device="meta", dtype=torch.bfloat16)
    below, at = torch.empty(2**16, 2**15 - 1, **meta), torch.empty(2**16, 2**15, **meta)
    assert not triton_support.wide_offsets(below, below.t(), None)
    assert triton_support.wide_offsets(below, at) and triton_support.wide_offsets(at.t())
    # A row-strided view (a query gradient in a wider buffer, say): few elements, but its last
    # row starts 2^31 elements on.
    view = torch.empty(2**16 + 1, 2**15, **meta)[:, :16]
    assert view.numel() < 2**31 and triton_support.wide_offsets(view)
    assert not triton_support.wide_offsets(view[:-1])


# -- the Triton kernels in Triton's interpreter, on the CPU ------------------------------------------------


def interpreted_checks():
    """The int64-offset path (WIDE: what a tensor of 2^31 elements or more takes) of quantize and
    quantize_heads gives the int32 path's bits, on small tensors."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(70, 130, generator=g) * 7).bfloat16()  # partial tiles both ways
    x[3, 5] = 1e6  # saturates under the delayed scale, E5M2 too
    for fp8_dtype in FP8_DTYPES:
        for scale in (torch.tensor(0.37), None):
            for rowwise, columnwise, col_sum in ((True, True, True), (False, True, False)):

                def cast():
                    amax, scale_out, counts = (
                        torch.tensor(0.5),
                        torch.zeros(()),
                        torch.zeros(3, dtype=torch.int64),
                    )
                    q = triton_kernels.quantize(
                        x,
                        fp8_dtype,
                        scale,
                        1,
                        rowwise,
                        columnwise,
                        scale_out,
                        amax,
                        col_sum,
                        counts,
                    )
                    return q, scale_out, counts

                narrow, wide = (
                    launch_with_offsets(w, triton_kernels, "_quantize_kernel", cast)
                    for w in (False, True)
                )
                assert_same_bits(narrow, wide, (fp8_dtype, scale, rowwise, columnwise))
                assert narrow[2][1] == x.numel() and (scale is None or narrow[2][0] > 0)

    # A QKV gradient of 2 groups of 3 query heads of 16 features, the query gradient a row-strided view.
    dq = (torch.randn(70, 120, generator=g) * 3).bfloat16()[:, :96]
    dk, dv = ((torch.randn(70, 32, generator=g) * 3).bfloat16() for _ in range(2))
    scale = torch.tensor(57344.0 / 4)  # values beyond 4 saturate

    def cast_heads():
        amax, counts = torch.zeros(()), torch.zeros(3, dtype=torch.int64)
        return triton_kernels.quantize_heads(
            dq, dk, dv, 16, E5M2, scale, True, True, amax, True, counts
        ), counts

    narrow, wide = (
        launch_with_offsets(w, triton_kernels, "_quantize_kernel", cast_heads)
        for w in (False, True)
    )
    assert_same_bits(narrow, wide, "quantize_heads")
    counts = torch.zeros(3, dtype=torch.int64)
    concatenated = triton_kernels.quantize(
        HeadGradsSource(dq, dk, dv, 16).materialize(),
        E5M2,
        scale,
        0,
        True,
        True,
        None,
        torch.zeros(()),
        True,
        counts,
    )
    assert_same_bits((concatenated, counts), narrow, "quantize of the concatenation")
    assert counts[0] > 0


@needs_triton
def test_kernels_in_the_triton_interpreter():
    run_interpreted_checks(__name__)
