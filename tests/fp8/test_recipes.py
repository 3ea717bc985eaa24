import pytest

from megafp8 import CurrentScaling, DelayedScaling, Format, OverrideLinearPrecision
from megafp8.fp8 import BlockwiseScaling, RowwiseScaling


def test_defaults_match_the_design():
    r = DelayedScaling()
    assert (r.margin, r.interval, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (
        0,
        1,
        Format.HYBRID,
        1024,
        "max",
    )
    assert r.override_linear_precision == OverrideLinearPrecision(False, False, False)
    assert r.reduce_amax is True
    assert CurrentScaling().fp8_format is Format.HYBRID
    # the activations the casts compute as they read: where it was measured to pay
    assert set(r.fused_activations) == {"gelu", "gelu_tanh", "swiglu"}
    assert CurrentScaling().fused_activations == RowwiseScaling().fused_activations == ()
    assert BlockwiseScaling().fused_activations == ("swiglu",)
    assert BlockwiseScaling(fused_activations=["gelu"]).fused_activations == ("gelu",)


def test_formats_accept_strings_and_coerce_overrides():
    r = DelayedScaling(fp8_format="e4m3", override_linear_precision=[False, True, False])
    assert r.fp8_format is Format.E4M3
    assert r.override_linear_precision.dgrad is True
    assert CurrentScaling(fp8_format="HYBRID").fp8_format is Format.HYBRID


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        (dict(margin=-1), "margin", ">= 0"),
        (dict(margin=0.5), "margin", ">= 0"),
        (dict(interval=0), "interval", "a positive integer"),
        (dict(amax_history_len=0), "amax_history_len", "a positive integer"),
        (dict(amax_compute_algo="mean"), "amax_compute_algo", "'most_recent'"),
        (dict(fp8_format=Format.E5M2), "fp8_format", "Format.HYBRID or Format.E4M3"),
        (dict(fp8_format="fp8"), "fp8_format", "Format.HYBRID or Format.E4M3"),
        (
            dict(override_linear_precision=(True, False)),
            "override_linear_precision",
            "three booleans",
        ),
        (dict(override_linear_precision=(1, 0, 0)), "override_linear_precision", "three booleans"),
        (dict(reduce_amax="yes"), "reduce_amax", "True or False"),
    ],
)
def test_delayed_scaling_errors_name_the_field_and_the_allowed_values(kwargs, field, allowed):
    with pytest.raises(ValueError) as error:
        DelayedScaling(**kwargs)
    message = str(error.value)
    assert f"DelayedScaling.{field}" in message and allowed in message


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(margin=-2), "margin"), (dict(fp8_format=Format.E5M2), "fp8_format")],
)
def test_current_scaling_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"CurrentScaling.{field}"):
        CurrentScaling(**kwargs)


@pytest.mark.parametrize("recipe", [RowwiseScaling, BlockwiseScaling])
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(margin=-1), "margin"),
        (dict(fp8_format=Format.E5M2), "fp8_format"),
        (dict(override_linear_precision=(True, False)), "override_linear_precision"),
        (dict(power_of_two_scales="yes"), "power_of_two_scales"),
        (dict(fused_activations=("relu",)), "fused_activations"),
        (dict(fused_activations="swiglu"), "fused_activations"),
    ],
)
def test_fine_grained_scaling_errors_name_the_field(recipe, kwargs, field):
    with pytest.raises(ValueError, match=f"{recipe.__name__}.{field}"):
        recipe(**kwargs)
