"""Delayed scaling as docs/fp8.md states it ("Recipes"), driven through Fp8Linear one pass at a time;
the GPU's fused update kernel against the torch path in Triton's interpreter."""

import importlib.util

import pytest
import torch

from megafp8 import DelayedScaling, Format, Fp8Linear, fp8_autocast
from megafp8.fp8.scaling import ScalingState, _update_delayed_torch

from ..interpreter import run_interpreted_checks
from .helpers import random_amax


def forward_passes(amaxes, recipe, layer=None):
    """One forward pass per amax (inputs with exactly that amax); the input scale after each."""
    torch.manual_seed(0)
    layer = layer or Fp8Linear(16, 16)
    scales = []
    for amax in amaxes:
        with fp8_autocast(recipe=recipe):
            layer(random_amax((16, 16), amax))
        scales.append(layer.fp8_scaling["input"].scale.item())
    return scales, layer


WORKED = dict(
    amax_history_len=4, amax_compute_algo="max", margin=0, fp8_format=Format.E4M3, interval=1
)


def test_worked_example_max():
    scales, _ = forward_passes([2, 8, 1, 1, 1, 1], DelayedScaling(**WORKED))
    assert scales == [224, 56, 56, 56, 56, 448]


def test_worked_example_most_recent():
    recipe = DelayedScaling(**{**WORKED, "amax_compute_algo": "most_recent"})
    scales, _ = forward_passes([2, 8, 1], recipe)
    assert scales == [224, 56, 448]


def test_second_pass_casts_with_224_and_saturates_at_448():
    torch.manual_seed(0)
    layer = Fp8Linear(16, 16)
    recipe = DelayedScaling(**WORKED)
    with fp8_autocast(recipe=recipe):
        layer(random_amax((16, 16), 2.0))
    x = random_amax((16, 16), 8.0)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with fp8_autocast(recipe=recipe):
            y = layer(x)
    (x_t_fp8,) = [
        t
        for t in saved
        if t.dtype == torch.float8_e4m3fn
        and t.shape == (16, 16)
        and t.data_ptr() != layer._weight_fp8[1].data_t.data_ptr()
    ]
    values = x_t_fp8.float().t()
    assert not torch.isnan(values).any()
    assert values[0, 0].item() == 448.0  # 8 x 224 = 1792, saturated
    assert torch.equal(values, (x * 224).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert torch.isfinite(y).all()


def test_history_rolls_newest_first():
    _, layer = forward_passes([2, 8, 1], DelayedScaling(**WORKED))
    assert layer.fp8_scaling["input"].amax_history.tolist() == [1, 8, 2, 0]


def test_interval_recomputes_the_scale_every_interval_updates():
    recipe = DelayedScaling(**{**WORKED, "interval": 2})
    scales, _ = forward_passes([2, 8, 1, 1, 1, 1, 1], recipe)
    # Recomputed at updates 1, 3, 5, 7; the history still takes every amax.
    assert scales == [224, 224, 56, 56, 56, 56, 448]


def test_margin_divides_the_scale_by_a_power_of_two():
    scales, _ = forward_passes([2, 8], DelayedScaling(**{**WORKED, "margin": 1}))
    assert scales == [112, 28]


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_zero_inf_or_nan_amax_keeps_the_previous_scale(bad):
    recipe = DelayedScaling(**{**WORKED, "amax_compute_algo": "most_recent"})
    torch.manual_seed(0)
    layer = Fp8Linear(16, 16)
    for x in [random_amax((16, 16), 2.0), torch.full((16, 16), bad), random_amax((16, 16), 4.0)]:
        with fp8_autocast(recipe=recipe):
            layer(x)
        if x.abs().max().item() == 2.0:
            assert layer.fp8_scaling["input"].scale.item() == 224
        elif x.abs().max().item() == 4.0:
            assert layer.fp8_scaling["input"].scale.item() == 112  # recovers at once
        else:
            assert layer.fp8_scaling["input"].scale.item() == 224


def test_non_finite_amax_does_not_freeze_the_max_history():
    scales, layer = forward_passes([2, float("inf"), 1], DelayedScaling(**WORKED))
    history = layer.fp8_scaling["input"].amax_history
    assert torch.isfinite(history).all()
    assert scales == [224, 224, 224]  # max(1, 0, 2) = 2: the next finite amax is used at once


def test_gradient_scales_use_e5m2_under_hybrid_and_update_once_per_backward():
    torch.manual_seed(0)
    first, second = Fp8Linear(16, 32), Fp8Linear(32, 16)
    recipe = DelayedScaling(amax_history_len=4, fp8_format=Format.HYBRID)
    for amax in [2.0, 8.0]:
        x = torch.randn(16, 16, requires_grad=True)
        with fp8_autocast(recipe=recipe):
            y = second(first(x))
        y.backward(random_amax(y.shape, amax))
    state = second.fp8_scaling["grad_output"]
    assert state.update_count == 2 and first.fp8_scaling["grad_output"].update_count == 2
    assert state.scale.item() == 57344 / 8
    assert state.amax_history.tolist()[:2] == [8.0, 2.0]


def test_history_length_follows_the_recipe_keeping_the_newest():
    _, layer = forward_passes([2, 8, 1], DelayedScaling(**WORKED))
    forward_passes([4], DelayedScaling(**{**WORKED, "amax_history_len": 2}), layer)
    assert layer.fp8_scaling["input"].amax_history.tolist() == [4, 1]


# -- the fused update kernel (what CUDA runs) in Triton's interpreter, on the CPU ------------------------------


def interpreted_checks():
    """The kernel gives the torch path's histories, scales and accumulators bit for bit, on histories
    whose max is an older amax than the newest: at the front, in the middle, at the last place kept
    and at the place the roll drops (where the newest or the one before it is the max)."""
    from megafp8.fp8 import triton_kernels

    g = torch.Generator().manual_seed(0)
    for length in (1, 2, 5, 8):
        for algo in ("max", "most_recent"):
            for recompute in (True, False):
                amaxes = torch.rand(7, generator=g) * 4 + 1
                amaxes[1], amaxes[2], amaxes[3] = float("inf"), float("nan"), 0.0
                resets = [True, False, True, True, False, True, True]
                histories = torch.rand(7, length, generator=g) * 4 + 1
                for row, place in zip(
                    histories, (0, length // 2, length - 2, length - 1, 0, 1, length - 1)
                ):
                    # the max, older than the newest amax
                    row[place % length] = 40.0 + place % length
                states = []
                for _ in range(2):
                    group = [ScalingState() for _ in range(7)]
                    for state, amax, history in zip(group, amaxes, histories):
                        state.fit_history(length)
                        state.amax_history.copy_(history)
                        state.amax.copy_(amax)
                        state.scale.fill_(3.0)
                    states.append(group)
                triton_kernels.update_delayed(states[0], resets, 448.0, 1, algo, recompute)
                _update_delayed_torch(states[1], resets, 448.0, 1, algo, recompute)
                for fused, reference, reset in zip(*states, resets):
                    what = (length, algo, recompute, reference.amax_history.tolist())
                    assert torch.equal(fused.amax_history, reference.amax_history), what
                    assert torch.equal(fused.scale, reference.scale), (
                        what,
                        fused.scale,
                        reference.scale,
                    )
                    assert (
                        torch.equal(fused.amax, reference.amax)
                        and (fused.amax.item() == 0) == reset
                    ), what
                # The reference scales from the history's max, not the newest amax, where it should.
                newest, first = amaxes[0].item(), states[1][0]
                older_max = first.amax_history.max().item()
                if recompute and algo == "max" and length > 1:
                    assert older_max > newest and first.scale.item() == pytest.approx(
                        448.0 / older_max / 2, rel=1e-6
                    )
                elif recompute:
                    assert first.scale.item() == pytest.approx(448.0 / newest / 2, rel=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_fused_update_kernel_in_the_triton_interpreter():
    run_interpreted_checks(__name__)
