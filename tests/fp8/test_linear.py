import pickle
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megafp8 import CurrentScaling, DelayedScaling, Format, Fp8Linear, fp8_autocast

from .helpers import emulate, gemm_error_bound, rel_err

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {
    "delayed-hybrid": DelayedScaling(amax_history_len=16),
    "delayed-e4m3": DelayedScaling(amax_history_len=16, fp8_format=Format.E4M3),
    "current-hybrid": CurrentScaling(),
    "current-e4m3": CurrentScaling(fp8_format=Format.E4M3),
}


def run_pass(layer, recipe, x, dy):
    """One FP8 forward + backward; returns (y, dx, dW, db) and the scales each cast used."""
    x = x.clone().requires_grad_(True)
    layer.zero_grad()
    scales = {role: state.scale.clone() for role, state in layer.fp8_scaling.items()}
    with fp8_autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)
    if isinstance(recipe, CurrentScaling):  # the cast used the tensor's own scale
        scales = {role: state.scale.clone() for role, state in layer.fp8_scaling.items()}
    bias_grad = None if layer.bias is None else layer.bias.grad
    return (y, x.grad, layer.weight.grad, bias_grad), scales


def fp64_reference(layer, x, dy):
    w, b = layer.weight.double(), None if layer.bias is None else layer.bias.double()
    x2, dy2 = x.double().reshape(-1, x.shape[-1]), dy.double().reshape(-1, dy.shape[-1])
    y = x2 @ w.t() + (0 if b is None else b)
    return y.reshape(dy.shape), (dy2 @ w).reshape(x.shape), dy2.t() @ x2, dy2.sum(0)


def fresh_layer(in_features=64, out_features=48, bias=True):
    torch.manual_seed(1)
    layer = Fp8Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.bias is not None and layer.bias.normal_()
    return layer


def fresh_batch(in_features=64, out_features=48, lead=(4, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*lead, in_features, generator=g), torch.randn(
        *lead, out_features, generator=g
    )


@pytest.mark.parametrize("name", RECIPES)
def test_fp8_linear_matches_fp64_within_the_fp8_rounding_bound(name):
    recipe = RECIPES[name]
    layer = fresh_layer()
    run_pass(layer, recipe, *fresh_batch(seed=10))  # delayed scaling: fill the history first
    x, dy = fresh_batch(seed=11)
    (y, dx, dw, db), _ = run_pass(layer, recipe, x, dy)
    ref_y, ref_dx, ref_dw, ref_db = fp64_reference(layer, x, dy)
    grad_dtype = recipe.fp8_format.backward_dtype
    assert rel_err(y, ref_y) < gemm_error_bound(E4M3, E4M3)
    assert rel_err(dx, ref_dx) < gemm_error_bound(grad_dtype, E4M3)
    assert rel_err(dw, ref_dw) < gemm_error_bound(grad_dtype, E4M3)
    assert rel_err(db, ref_db) < 1e-6  # the bias gradient is a plain fp32 sum
    # ... and the error is FP8's: far above fp32 rounding.
    assert rel_err(y, ref_y) > 1e-3 and rel_err(dw, ref_dw) > 1e-3


@pytest.mark.parametrize("name", RECIPES)
def test_fp8_linear_computes_exactly_the_emulated_fp8_gemms(name):
    """Given the scales each cast used, all three GEMMs equal fp64 GEMMs of the FP8-rounded
    operands: right formats (E4M3 forward, E5M2 gradients under HYBRID), scales and layouts."""
    recipe = RECIPES[name]
    layer = fresh_layer()
    run_pass(layer, recipe, *fresh_batch(seed=20))
    x, dy = fresh_batch(seed=21)
    w_scale_before = layer.fp8_scaling["weight"].scale.clone()
    (y, dx, dw, _), s = run_pass(layer, recipe, x, dy)
    if isinstance(recipe, DelayedScaling):
        s["weight"] = w_scale_before
    g = recipe.fp8_format.backward_dtype
    xq = emulate(x.reshape(-1, 64), s["input"], E4M3)
    wq = emulate(layer.weight, s["weight"], E4M3)
    dyq = emulate(dy.reshape(-1, 48), s["grad_output"], g)
    assert rel_err(y.reshape(-1, 48), xq @ wq.t() + layer.bias.double()) < 1e-5
    assert rel_err(dx.reshape(-1, 64), dyq @ wq) < 1e-5
    assert rel_err(dw, dyq.t() @ xq) < 1e-5


@pytest.mark.parametrize("index, gemm", list(enumerate(["fprop", "dgrad", "wgrad"])))
def test_each_override_flag_runs_its_gemm_in_high_precision(index, gemm):
    flags = [False, False, False]
    flags[index] = True
    recipe = DelayedScaling(override_linear_precision=tuple(flags))
    layer = fresh_layer()
    run_pass(layer, recipe, *fresh_batch(seed=30))
    x, dy = fresh_batch(seed=31)
    outputs, _ = run_pass(layer, recipe, x, dy)
    errors = [rel_err(out, ref) for out, ref in zip(outputs[:3], fp64_reference(layer, x, dy)[:3])]
    for i, error in enumerate(errors):
        if i == index:
            assert error < 1e-5, f"{gemm} should be high precision"
        else:
            assert 1e-3 < error < gemm_error_bound(E5M2, E4M3), f"GEMM {i} should stay in FP8"


def test_all_overrides_is_plain_linear():
    layer, (x, _) = fresh_layer(), fresh_batch()
    with fp8_autocast(recipe=DelayedScaling(override_linear_precision=(True, True, True))):
        y = layer(x)
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias))


def test_outside_autocast_or_disabled_it_is_nn_linear():
    layer, (x, _) = fresh_layer(), fresh_batch()
    expected = F.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer(x), expected)
    with fp8_autocast():
        with fp8_autocast(enabled=False):
            assert torch.equal(layer(x), expected)


def test_no_bias_and_any_leading_dims():
    layer = fresh_layer(bias=False)
    x, dy = fresh_batch(lead=(2, 3, 8))
    (y, dx, dw, db), _ = run_pass(layer, DelayedScaling(), x, dy)
    assert y.shape == (2, 3, 8, 48) and dx.shape == x.shape and db is None
    assert rel_err(y, fp64_reference(layer, x, dy)[0]) < gemm_error_bound(E4M3, E4M3)


def test_input_is_saved_for_backward_in_fp8():
    layer, (x, _) = fresh_layer(), fresh_batch()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with fp8_autocast():
            layer(x.requires_grad_(True))
    big = [t for t in saved if t.numel() >= x.numel()]
    assert big and all(t.dtype == E4M3 for t in big), [(t.dtype, t.shape) for t in saved]


def test_state_dict_round_trip_resumes_with_the_same_scales():
    recipe = DelayedScaling(amax_history_len=8)
    layer = fresh_layer()
    for seed in range(3):
        run_pass(layer, recipe, *fresh_batch(seed=seed))
    state = pickle.loads(pickle.dumps(layer.state_dict()))
    assert state["fp8_scaling.input.amax_history"].shape == (8,)
    resumed = Fp8Linear(64, 48)
    resumed.load_state_dict(state)
    for role in ("input", "weight", "grad_output"):
        a, b = layer.fp8_scaling[role], resumed.fp8_scaling[role]
        assert torch.equal(a.scale, b.scale) and torch.equal(a.amax_history, b.amax_history)
        assert a.update_count == b.update_count == 3
    batch = fresh_batch(seed=9)
    out_a, _ = run_pass(layer, recipe, *batch)
    out_b, _ = run_pass(resumed, recipe, *batch)
    for a, b in zip(out_a, out_b):
        assert torch.equal(a, b)


def test_weight_cast_is_cached_across_micro_batches_and_refreshed_by_the_optimizer():
    recipe = DelayedScaling()
    layer = fresh_layer()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    run_pass(layer, recipe, *fresh_batch(seed=0))
    cached = layer._weight_fp8[1]
    run_pass(layer, recipe, *fresh_batch(seed=1))  # a second micro-batch: same cast object
    assert layer._weight_fp8[1] is cached
    optimizer.step()
    x, dy = fresh_batch(seed=2)
    scale = layer.fp8_scaling["weight"].scale.clone()
    (y, *_), s = run_pass(layer, recipe, x, dy)
    assert layer._weight_fp8[1] is not cached
    expected = emulate(x.reshape(-1, 64), s["input"], E4M3) @ emulate(layer.weight, scale, E4M3).t()
    assert rel_err(y.reshape(-1, 48), expected + layer.bias.double()) < 1e-5


def test_writes_through_weight_data_need_an_explicit_refresh():
    layer = fresh_layer()
    run_pass(layer, DelayedScaling(), *fresh_batch())
    cached = layer._weight_fp8[1]
    layer.weight.data.mul_(2)  # invisible to autograd's version counter
    run_pass(layer, DelayedScaling(), *fresh_batch())
    assert layer._weight_fp8[1] is cached
    layer.clear_fp8_weight_cache()
    run_pass(layer, DelayedScaling(), *fresh_batch())
    assert layer._weight_fp8[1] is not cached


@pytest.mark.parametrize(
    "in_features, out_features, lead", [(20, 48, (16,)), (64, 40, (16,)), (64, 48, (3, 5))]
)
def test_shapes_fp8_cannot_take_run_in_high_precision_with_one_warning(
    in_features, out_features, lead
):
    layer = fresh_layer(in_features, out_features)
    x = torch.randn(*lead, in_features, requires_grad=True)
    with pytest.warns(UserWarning, match="divisible by 16") as record:
        for _ in range(2):
            with fp8_autocast():
                y = layer(x)
            y.sum().backward()
    assert len(record) == 1
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias))


def test_bf16_layer_runs_fp8_and_returns_bf16():
    layer = fresh_layer().to(torch.bfloat16)
    x, dy = (t.to(torch.bfloat16) for t in fresh_batch())
    (y, dx, dw, db), _ = run_pass(layer, DelayedScaling(), x, dy)
    assert y.dtype == dx.dtype == dw.dtype == db.dtype == torch.bfloat16
    assert rel_err(y, fp64_reference(layer, x, dy)[0]) < gemm_error_bound(E4M3, E4M3)


def test_scaling_state_stays_fp32_when_the_layer_changes_dtype():
    layer = fresh_layer().to(torch.bfloat16)
    run_pass(layer, DelayedScaling(), *(t.to(torch.bfloat16) for t in fresh_batch()))
    for state in layer.fp8_scaling.values():
        assert state.scale.dtype == state.amax_history.dtype == torch.float32


def test_any_torch_optimizer_step_refreshes_the_weight_cast_even_without_a_version_bump():
    layer = fresh_layer()
    run_pass(layer, DelayedScaling(), *fresh_batch())
    cached = layer._weight_fp8[1]

    class DataWriter(torch.optim.Optimizer):  # updates like fused AdamW: version unchanged
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(1.0)

    version = layer.weight._version
    DataWriter(layer.parameters(), {}).step()
    assert layer.weight._version == version
    run_pass(layer, DelayedScaling(), *fresh_batch())
    assert layer._weight_fp8[1] is not cached


def test_the_optimizer_step_hook_comes_with_the_first_fp8_linear_not_with_the_import():
    code = (
        "import torch.optim.optimizer as o\n"
        "import megafp8.fp8\n"
        "print(len(o._global_optimizer_post_hooks))\n"
        "megafp8.fp8.Fp8Linear(16, 16), megafp8.fp8.Fp8Linear(16, 16)\n"
        "print(len(o._global_optimizer_post_hooks))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["0", "1"]
