import pytest
import torch

from megafp8 import fp8_max, quantize, scale_from_amax

from .helpers import UNIT_ROUNDOFF

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


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
    subnormal_step = finfo.smallest_normal / 2 ** (finfo.bits - 1 - (5 if dtype == torch.float8_e4m3fn else 6))
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
