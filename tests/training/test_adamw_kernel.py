"""The fused AdamW pass (megafp8/training/optimizer/adamw_kernel.py) of MixedPrecisionAdamW: in
Triton's interpreter against torch.optim.AdamW on the CPU, and on a GPU bit for bit against
torch's fused AdamW followed by the copy into the parameters."""

import importlib.util
import math

import pytest
import torch
from megafp8.parallel.data_parallel import GradientBuffer

from megafp8.fp8.autocast import fp8_autocast
from megafp8.fp8.linear import Fp8Linear
from megafp8.fp8.quantize import quantize_torch
from megafp8.fp8.recipe import CurrentScaling, DelayedScaling
from megafp8.training.optimizer import MixedPrecisionAdamW
from megafp8.training.optimizer.adamw import (
    dequantize_moment,
    join_master,
    quantize_moment,
    split_master,
)

from ..interpreter import run_interpreted_checks
from ..multiprocess import run_on_ranks

# Odd sizes, tensors of one, two and three kernel chunks (16384 elements each); 1-D ones and
# biases take no weight decay.
SHAPES = {
    "a.weight": (37, 19),
    "a.bias": (19,),
    "b.weight": (131, 257),
    "c.weight": (3, 5, 7),
    "norm.weight": (16385,),
    "d.weight": (128, 128),
}
STEPS = 4
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def make_params(shapes, dtype, device):
    g = torch.Generator().manual_seed(0)
    return [
        (name, torch.nn.Parameter(torch.randn(shape, generator=g).to(device, dtype)))
        for name, shape in shapes.items()
    ]


def make_optimizer(
    params, fused, group=None, distributed=False, main_grads_dtype=torch.float32, **lean
):
    buffer = GradientBuffer(
        [p for _, p in params], group, bucket_size=20_000, shard=distributed, dtype=main_grads_dtype
    )
    optimizer = MixedPrecisionAdamW(
        params,
        buffer,
        lr=1e-2,
        weight_decay=0.1,
        clip_grad=1.0,
        dp_group=group,
        distributed=distributed,
        fused=fused,
        **lean,
    )
    return buffer, optimizer


def train(params, buffer, optimizer, steps, rank=0, grads_in=torch.float32, after_step=None):
    """Fresh random gradients each step (drawn from the step and the rank, so that a resumed run
    sees the same ones; rounded to `grads_in`); every other step's are large enough to be
    clipped. `after_step(optimizer)` runs after each step."""
    norms = []
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        buffer.zero()
        for _, p in params:
            grad = (
                torch.randn(p.shape, generator=g)
                * torch.rand(p.shape, generator=g)
                * (3.0 if step % 2 else 0.01)
            )
            p.main_grad.add_(grad.to(grads_in).to(p.main_grad.device))
        buffer.finish()
        applied, norm = optimizer.step()
        assert applied
        norms.append(norm)
        if after_step is not None:
            after_step(optimizer)
    return norms


def snapshot(params, optimizer):
    states = {
        name: {k: v.clone() for k, v in entry.items()}
        for name, entry in optimizer.state_for_checkpoint().items()
    }
    return {name: p.detach().clone() for name, p in params}, states


def assert_same_snapshot(first, second):
    for a, b in zip(first, second):
        assert a.keys() == b.keys()
        for name in a:
            if isinstance(a[name], dict):
                assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
            else:
                assert torch.equal(a[name], b[name]), name


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# -- in Triton's interpreter, on the CPU ----------------------------------------------------------
# The interpreter rounds fma's product and sum apart, and torch's CPU AdamW is another formula
# (1 - beta in double, where the CUDA kernels take it from fp32 betas: 1 - 0.95f is 2.4e-7 off
# 0.05), so the two meet to ~5e-7 relative error after four steps. The weights the kernel writes
# must be exactly the masters' rounding, and a resumed run exactly the straight one.


def check_against_torch(dtype):
    straight = make_params(SHAPES, dtype, "cpu")
    fused_params = make_params(SHAPES, dtype, "cpu")
    buffer, optimizer = make_optimizer(straight, fused=False)
    fused_buffer, fused = make_optimizer(fused_params, fused=True)
    assert train(straight, buffer, optimizer, range(STEPS)) == train(
        fused_params, fused_buffer, fused, range(STEPS)
    )
    params, states = snapshot(straight, optimizer)
    fused_out, fused_states = snapshot(fused_params, fused)
    for name, entry in states.items():
        for key, ref in entry.items():
            assert rel_err(fused_states[name][key], ref) < 1e-6, (dtype, name, key)
        assert torch.equal(fused_out[name], fused_states[name]["master"].to(dtype)), (dtype, name)
    for *_, master in fused.shards:  # torch.optim.AdamW's state, so torch could go on from it
        assert set(fused.optimizer.state[master]) == {"step", "exp_avg", "exp_avg_sq"}
        assert fused.optimizer.state[master]["step"].item() == STEPS


def check_resume_is_exact():
    params = make_params(SHAPES, torch.bfloat16, "cpu")
    buffer, optimizer = make_optimizer(params, fused=True)
    train(params, buffer, optimizer, range(2))
    _, saved = snapshot(params, optimizer)
    train(params, buffer, optimizer, range(2, STEPS))
    resumed_params = make_params(SHAPES, torch.bfloat16, "cpu")
    resumed_buffer, resumed = make_optimizer(resumed_params, fused=True)
    resumed.load_checkpoint_state(saved, 2)
    train(resumed_params, resumed_buffer, resumed, range(2, STEPS))
    assert_same_snapshot(snapshot(params, optimizer), snapshot(resumed_params, resumed))


def distributed_body(rank, world_size, fused):
    params = make_params(SHAPES, torch.bfloat16, "cpu")
    buffer, optimizer = make_optimizer(
        params, fused, torch.distributed.group.WORLD, distributed=True
    )
    train(params, buffer, optimizer, range(STEPS), rank)
    return snapshot(params, optimizer)


def check_distributed():
    torch_ranks = run_on_ranks(distributed_body, 2, False)
    fused_ranks = run_on_ranks(distributed_body, 2, True)
    for (params, states), (ref_params, ref_states) in zip(fused_ranks, torch_ranks):
        for name, entry in states.items():
            for key, tensor in entry.items():
                assert rel_err(tensor, ref_states[name][key]) < 1e-6, (name, key)
            # Each rank wrote its slice into the all-gather's input: all of it arrived, rounded.
            assert torch.equal(params[name], entry["master"].to(torch.bfloat16)), name
    assert all(torch.equal(fused_ranks[0][0][name], fused_ranks[1][0][name]) for name in SHAPES)


def check_fp8_weight_casts_follow_the_step(device):
    """An FP8 linear's cached weight cast is refreshed after a fused step, which writes the
    weight through its address: the next forward is that of a freshly cast weight (current
    scaling: the cast depends on the weight alone). It was not, for a while: the FP8 linears
    trained with their first weights on every GPU run."""
    torch.manual_seed(0)
    layer = Fp8Linear(64, 32, device=device, dtype=torch.bfloat16)
    buffer, optimizer = make_optimizer(list(layer.named_parameters()), fused=True)
    x = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    for _ in range(2):
        with fp8_autocast(recipe=CurrentScaling()):
            y = layer(x)
        buffer.zero()
        y.float().square().sum().backward()
        buffer.finish()
        applied, _ = optimizer.step()
        assert applied
        with fp8_autocast(recipe=CurrentScaling()):
            cached = layer(x)
        layer.clear_fp8_weight_cache()
        with fp8_autocast(recipe=CurrentScaling()):
            fresh = layer(x)
        assert torch.equal(cached, fresh)
        assert not torch.equal(cached, y)


def check_the_pass_casts_fp8_weights(device, dtype):
    """Given the FP8 linears, the fused pass also writes their weights' casts (delayed scaling),
    and their forwards take them: a run equals, bit for bit, one whose forwards cast the weights
    themselves (outputs, weights, scales and histories, and a log step's saturation counts),
    and after each step the cached casts are those of the new weights."""
    runs = []
    for pass_casts in (False, True):
        torch.manual_seed(0)
        # [144, 80] and [48, 144]: partial kernel tiles (64 x 128) both ways.
        layers = torch.nn.ModuleList(
            [
                Fp8Linear(80, 144, device=device, dtype=dtype),
                Fp8Linear(144, 48, device=device, dtype=dtype),
            ]
        )
        for layer in layers:  # the fused pass sets this for its own; both runs alike
            layer.keep_weight_cast_addresses = True
        params = list(layers.named_parameters())
        buffer = GradientBuffer([p for _, p in params], bucket_size=20_000)
        optimizer = MixedPrecisionAdamW(
            params,
            buffer,
            lr=1e-2,
            weight_decay=0.1,
            clip_grad=1.0,
            fused=True,
            fp8_linears=list(layers) if pass_casts else (),
        )
        x = torch.randn(32, 80, device=device, dtype=dtype)
        outputs = []
        for step in range(4):
            with fp8_autocast(
                recipe=DelayedScaling(amax_history_len=4), collect_saturation=step == 2
            ):
                y = layers[1](layers[0](x))
            buffer.zero()
            y.float().square().sum().backward()
            buffer.finish()
            assert optimizer.step()[0]
            outputs.append(y.detach())
            for layer in layers:
                assert layer._weight_cast_by_optimizer == pass_casts
                if pass_casts:
                    q = layer._weight_fp8[1]
                    ref = quantize_torch(
                        layer.weight.detach(),
                        q.data.dtype,
                        layer.fp8_scaling["weight"].scale,
                        0,
                        True,
                        True,
                    )
                    for got, want in (
                        (q.data, ref.data),
                        (q.data_t, ref.data_t),
                        (q.scale_inv, ref.scale_inv),
                        (layer.fp8_scaling["weight"].amax, ref.amax),
                    ):
                        assert torch.equal(
                            got.view(torch.uint8) if got.element_size() == 1 else got,
                            want.view(torch.uint8) if want.element_size() == 1 else want,
                        ), step
        state = {
            k: v.clone() for k, v in layers.state_dict().items() if isinstance(v, torch.Tensor)
        }
        saturation = [s.cast_counts.clone() for layer in layers for s in layer.fp8_scaling.values()]
        runs.append((outputs, state, saturation))
    (outputs, state, saturation), (ref_outputs, ref_state, ref_saturation) = runs
    assert all(torch.equal(a, b) for a, b in zip(outputs, ref_outputs))
    assert state.keys() == ref_state.keys() and all(
        torch.equal(state[k], ref_state[k]) for k in state
    )
    assert (
        all(torch.equal(a, b) for a, b in zip(saturation, ref_saturation)) and saturation[1][1] > 0
    )


def check_a_non_finite_step_is_skipped():
    """The fused pass decides on the device: a step with an inf gradient leaves masters, moments,
    step counts and weights as they were, and the run goes on as if it had not happened."""
    runs = []
    for bad_step in (None, 1):
        params = make_params(SHAPES, torch.bfloat16, "cpu")
        buffer, optimizer = make_optimizer(params, fused=True)
        train(params, buffer, optimizer, range(1))
        if bad_step is not None:
            before = snapshot(params, optimizer)
            buffer.zero()
            for _, p in params:
                p.main_grad.normal_()
            params[2][1].main_grad[0, 0] = float("inf")
            buffer.finish()
            applied, norm = optimizer.step()
            assert not applied and math.isnan(norm) and optimizer.step_count() == 1
            assert all(
                optimizer.optimizer.state[m]["step"].item() == 1 for *_, m in optimizer.shards
            )
            assert_same_snapshot(before, snapshot(params, optimizer))
        train(params, buffer, optimizer, range(1, STEPS))
        runs.append(snapshot(params, optimizer))
    assert_same_snapshot(*runs)


# -- lean states: bf16 moments, a bf16 gradient buffer, masters as bf16 parameters + remainders --

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
LEAN = {
    "bf16 moments": dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16),
    "bf16 gradients": dict(main_grads_dtype=BF16),
    "remainders": dict(store_param_remainders=True),
    "all": dict(
        exp_avg_dtype=BF16,
        exp_avg_sq_dtype=BF16,
        main_grads_dtype=BF16,
        store_param_remainders=True,
    ),
    "fp8 exp_avg": dict(
        exp_avg_dtype=FP8,
        exp_avg_sq_dtype=BF16,
        main_grads_dtype=BF16,
        store_param_remainders=True,
    ),
}


def round_moments_like(lean):
    """after_step for torch.optim.AdamW's run: its moments rounded as the lean run keeps them."""

    def round_moments(optimizer):
        for *_, master in optimizer.shards:
            state = optimizer.optimizer.state[master]
            for key in ("exp_avg", "exp_avg_sq"):
                dtype = lean.get(f"{key}_dtype", torch.float32)
                if dtype == FP8:
                    state[key].copy_(dequantize_moment(*quantize_moment(state[key])))
                else:
                    state[key].copy_(state[key].to(dtype))

    return round_moments


def assert_close_to_rounding(got, want, rounded_in, what):
    """`got` and `want` are states of runs whose arithmetic differs in the last fp32 bits (the
    interpreter's against torch's CPU formula): fp32 ones to 1e-5 relative error; bf16-kept ones
    may round the other way where that difference straddles a rounding boundary, and later steps
    carry it on, so each element is within two steps of its format (bf16: 2^-6 of its magnitude;
    FP8 E4M3: 2^-2; or of a small share of the largest where later steps nearly cancel it), and
    few of them differ at all."""
    if rounded_in == torch.float32:
        assert rel_err(got, want) < 1e-5, what
        return
    two_steps = 2.0**-2 if rounded_in == FP8 else 2.0**-6
    steps = (want.abs() + want.abs().max() * 2.0**-10) * two_steps
    assert ((got - want).abs() <= steps).all(), what
    assert (got != want).sum().item() <= max(3, want.numel() // 1000), what


def check_lean_states_against_torch(device, name, exact):
    """The lean pass equals torch.optim.AdamW on fp32 states that are rounded as the lean run
    keeps them (moments after each step, gradients before): bit for bit where `exact` (a GPU:
    both are torch's fused arithmetic), else up to rounding (`assert_close_to_rounding`). The
    lean run's weights are its masters' rounding, with remainders their high halves."""
    lean = LEAN[name]
    grads_in = lean.get("main_grads_dtype", torch.float32)
    ref_params = make_params(SHAPES, BF16, device)
    ref_buffer, ref = make_optimizer(ref_params, fused=False)
    lean_params = make_params(SHAPES, BF16, device)
    lean_buffer, lean_optimizer = make_optimizer(lean_params, fused=True, **lean)
    assert lean_optimizer.optimizer is None and lean_optimizer.fused
    ref_norms = train(
        ref_params,
        ref_buffer,
        ref,
        range(STEPS),
        grads_in=grads_in,
        after_step=round_moments_like(lean),
    )
    assert ref_norms == train(
        lean_params, lean_buffer, lean_optimizer, range(STEPS), grads_in=grads_in
    )
    params, states = snapshot(ref_params, ref)
    lean_out, lean_states = snapshot(lean_params, lean_optimizer)
    for param_name, entry in states.items():
        for key, want in entry.items():
            got, what = lean_states[param_name][key], (name, param_name, key)
            if exact:
                assert torch.equal(got, want), what
            else:
                assert_close_to_rounding(got, want, lean.get(f"{key}_dtype", torch.float32), what)
        if lean.get("store_param_remainders"):
            high, low = split_master(lean_states[param_name]["master"])
            assert torch.equal(lean_out[param_name], high), (name, param_name)
        else:
            assert torch.equal(lean_out[param_name], lean_states[param_name]["master"].to(BF16))
    for *_, master in lean_optimizer.shards:
        state = lean_optimizer.state[master]
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == lean.get(f"{key}_dtype", torch.float32), (name, key)
        assert state["step"].item() == STEPS
    assert lean_buffer.data.dtype == grads_in


def check_remainders_keep_the_fp32_master_exactly():
    """With remainders the run is that of fp32 masters, bit for bit (masters and moments; the
    fused pass's arithmetic is the same), in 2 bytes a parameter instead of 4."""
    runs = []
    for remainders in (False, True):
        params = make_params(SHAPES, BF16, "cpu")
        buffer, optimizer = make_optimizer(
            params, fused=True, exp_avg_dtype=BF16, store_param_remainders=remainders
        )
        train(params, buffer, optimizer, range(STEPS))
        runs.append(snapshot(params, optimizer)[1])
        masters = [master for *_, master in optimizer.shards]
        assert {m.dtype for m in masters} == {torch.int16 if remainders else torch.float32}
    assert_same_snapshot([runs[0]], [runs[1]])


def distributed_lean_body(rank, world_size, distributed):
    params = make_params(SHAPES, BF16, "cpu")
    buffer, optimizer = make_optimizer(
        params, True, torch.distributed.group.WORLD, distributed=distributed, **LEAN["all"]
    )
    train(params, buffer, optimizer, range(STEPS), rank, grads_in=BF16)
    return snapshot(params, optimizer)


def check_distributed_lean_states():
    """The distributed optimizer with every lean state is the replicated optimizer with them (up
    to the rounding of its gradient norm, summed from slices): each rank's remainders complete
    its slice of the all-gather's input, which holds the masters' high halves from the start,
    and every rank's parameters are the gathered high halves."""
    sharded = run_on_ranks(distributed_lean_body, 2, True)
    replicated = run_on_ranks(distributed_lean_body, 2, False)
    for (params, states), (ref_params, ref_states) in zip(sharded, replicated):
        for name, entry in states.items():
            for key, tensor in entry.items():
                rounded_in = torch.float32 if key == "master" else BF16
                assert_close_to_rounding(tensor, ref_states[name][key], rounded_in, (name, key))
            assert torch.equal(params[name], split_master(entry["master"])[0]), name
    assert all(torch.equal(sharded[0][0][name], sharded[1][0][name]) for name in SHAPES)


def check_lean_resume_is_exact_and_takes_any_checkpoint():
    """A lean run saved and resumed equals the straight run, bit for bit (checkpoints hold fp32,
    which bf16 states and remainders come back from exactly); and a checkpoint of fp32 states
    resumes lean (rounded) as a lean one resumes with fp32 states."""
    for lean in (LEAN["all"], LEAN["fp8 exp_avg"], {}):
        grads_in = lean.get("main_grads_dtype", torch.float32)
        params = make_params(SHAPES, BF16, "cpu")
        buffer, optimizer = make_optimizer(params, fused=True, **lean)
        train(params, buffer, optimizer, range(2), grads_in=grads_in)
        _, saved = snapshot(params, optimizer)
        train(params, buffer, optimizer, range(2, STEPS), grads_in=grads_in)
        others = () if lean is LEAN["fp8 exp_avg"] else (LEAN["all"] if not lean else {},)
        for resumed_with in (lean, *others):
            resumed_params = make_params(SHAPES, BF16, "cpu")
            resumed_buffer, resumed = make_optimizer(resumed_params, fused=True, **resumed_with)
            resumed.load_checkpoint_state(saved, 2)
            train(resumed_params, resumed_buffer, resumed, range(2, STEPS), grads_in=grads_in)
            if resumed_with is lean:
                assert_same_snapshot(snapshot(params, optimizer), snapshot(resumed_params, resumed))
            else:  # other options: the same run up to their rounding
                for name, entry in snapshot(resumed_params, resumed)[1].items():
                    for key, tensor in entry.items():
                        want = snapshot(params, optimizer)[1][name][key]
                        assert rel_err(tensor, want) < 2e-2, (name, key)


def check_lean_states_leave_the_weight_casts_to_the_forward():
    """With lean states the pass steps FP8 linears' weights without casting them (faster: the
    forward's own cast and the plain pass beat the casting pass); the forward casts them, as
    after any step (check_fp8_weight_casts_follow_the_step)."""
    torch.manual_seed(0)
    layer = Fp8Linear(64, 32, dtype=BF16)
    buffer = GradientBuffer(layer.parameters())
    lean_with_casts = MixedPrecisionAdamW(
        list(layer.named_parameters()),
        buffer,
        lr=1e-2,
        fused=True,
        fp8_linears=[layer],
        exp_avg_dtype=BF16,
        store_param_remainders=True,
    )
    x = torch.randn(16, 64, dtype=BF16)
    for _ in range(2):
        with fp8_autocast(recipe=DelayedScaling()):
            y = layer(x)
        buffer.zero()
        y.float().square().sum().backward()
        buffer.finish()
        before = layer.weight.detach().clone()
        assert lean_with_casts.step()[0]
        assert not layer._weight_cast_by_optimizer and not layer.keep_weight_cast_addresses
        assert not torch.equal(before, layer.weight)


def interpreted_checks():
    for dtype in (torch.bfloat16, torch.float32):
        check_against_torch(dtype)
    check_resume_is_exact()
    for name in LEAN:
        check_lean_states_against_torch("cpu", name, exact=False)
    check_remainders_keep_the_fp32_master_exactly()
    check_distributed_lean_states()
    check_lean_resume_is_exact_and_takes_any_checkpoint()
    check_lean_states_leave_the_weight_casts_to_the_forward()
    check_distributed()
    check_fp8_weight_casts_follow_the_step("cpu")
    for dtype in (torch.bfloat16, torch.float32):
        check_the_pass_casts_fp8_weights("cpu", dtype)
    check_a_non_finite_step_is_skipped()


@needs_triton
def test_fused_pass_in_the_triton_interpreter():
    run_interpreted_checks(__name__)


def test_fused_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    params = make_params({"w": (4, 4)}, torch.float32, "cpu")
    assert not make_optimizer(params, fused=None)[1].fused  # the CPU's default: torch.optim.AdamW
    with pytest.raises(ValueError, match="fused=True"):
        make_optimizer(make_params({"w": (4, 4)}, torch.float32, "cpu"), fused=True)


def test_master_remainders_give_the_fp32_master_back_exactly():
    """split_master / join_master on fresh random fp32 of every magnitude and sign, zeros,
    subnormals and the largest finite: the high half is within half a bf16 step of the master
    (rounded half away from zero), and the two halves give the master's bits back."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(100_000, generator=g) * torch.exp(torch.randn(100_000, generator=g) * 20)
    edges = torch.tensor(
        [
            0.0,
            -0.0,
            1e-45,
            -1e-45,
            1e-39,
            torch.finfo(torch.float32).max,
            1.0 + 2**-8,
            -(1.0 + 2**-8),
        ]
    )
    masters = torch.cat([values, edges])
    high, low = split_master(masters)
    assert high.dtype == torch.bfloat16 and low.dtype == torch.int16
    assert torch.equal(join_master(high, low).view(torch.int32), masters.view(torch.int32))
    finite = high.isfinite()
    # half a bf16 step at most: 2^-8 of the magnitude, or of the smallest subnormal's step
    step = (masters.abs() * 2.0**-8).clamp(min=2.0**-134)
    assert ((high[finite].double() - masters[finite].double()).abs() <= step[finite].double()).all()
    # A tie (exactly half a bf16 step) goes away from zero, not to even.
    assert high[-2].item() == 1.0 + 2**-7 and high[-1].item() == -(1.0 + 2**-7)


def test_fp8_moments_come_back_from_their_fp32_values_exactly():
    """quantize_moment on fresh random moments of every magnitude, an all-zero block and a last
    partial block: each block's largest magnitude scales into (224, 448] by a power of two, the
    values are within half an E4M3 step (2^-4 relative; a block's small ones, subnormal, within
    its largest's 2^-10), and the dequantized values quantize back to the same values (what
    makes a resumed run's FP8 first moment the saved one): the same bytes and scales, but for a
    block whose largest byte rounded down to 224, which comes back at twice the scale."""
    g = torch.Generator().manual_seed(0)
    moment = torch.randn(1000, generator=g) * torch.exp(torch.randn(1000, generator=g) * 8)
    moment[256:384] = 0
    q, scale_inv = quantize_moment(moment)
    assert q.dtype == FP8 and q.shape == moment.shape and scale_inv.shape == (8,)
    values = dequantize_moment(q, scale_inv)
    blocks = torch.nn.functional.pad(moment, (0, 24)).view(8, 128)
    amax = blocks.abs().amax(dim=1)
    scaled = amax / scale_inv
    assert ((scaled > 224) & (scaled <= 448))[amax > 0].all() and scale_inv[2] == 2.0**-126
    assert torch.log2(scale_inv).frac().eq(0).all()  # powers of two
    floor = (amax / 448 * 2.0**-6).repeat_interleave(128)[:1000]  # E4M3's subnormal step
    assert ((values - moment).abs() <= torch.maximum(moment.abs() * 2.0**-4, floor)).all()
    again, again_scale = quantize_moment(values)
    assert torch.equal(dequantize_moment(again, again_scale), values)
    stored_max = torch.nn.functional.pad(values, (0, 24)).view(8, 128).abs().amax(dim=1)
    rounded_down = stored_max / scale_inv == 224
    assert rounded_down.any()  # these random moments have such blocks
    assert torch.equal(again_scale, torch.where(rounded_down, scale_inv / 2, scale_inv))
    same = ~rounded_down.repeat_interleave(128)[:1000]
    assert torch.equal(again.view(torch.uint8)[same], q.view(torch.uint8)[same])


def test_lean_states_are_refused_with_the_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    params = make_params({"w": (4, 4)}, torch.bfloat16, "cpu")
    with pytest.raises(
        ValueError, match="exp_avg in torch.bfloat16: lean optimizer states need the fused"
    ):
        make_optimizer(params, fused=False, exp_avg_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gradients in torch.bfloat16: lean"):
        make_optimizer(params, fused=False, main_grads_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exp_avg_sq in torch.float16: it is kept in one of"):
        make_optimizer(params, fused=False, exp_avg_sq_dtype=torch.float16)
    with pytest.raises(ValueError, match="exp_avg_sq in torch.float8_e4m3fn: it is kept in one of"):
        make_optimizer(params, fused=False, exp_avg_sq_dtype=FP8)
    fp32 = make_params({"w": (4, 4)}, torch.float32, "cpu")
    with pytest.raises(ValueError, match="needs bf16 parameters, these are torch.float32"):
        make_optimizer(fp32, fused=False, store_param_remainders=True)
    with pytest.raises(ValueError, match="a gradient buffer holds one of"):
        GradientBuffer([p for _, p in params], dtype=torch.float16)


# -- on a GPU: bit for bit torch's fused AdamW ----------------------------------------------------

GPU_SHAPES = {**SHAPES, "embedding.weight": (5003, 771), "e.bias": (4099,)}


def assert_same_run(fused_run, torch_run):
    (params, states), (ref_params, ref_states) = fused_run, torch_run
    for name, entry in states.items():
        for key, tensor in entry.items():
            differ = (tensor != ref_states[name][key]).sum().item()
            assert differ == 0, f"{name} {key}: {differ} of {tensor.numel()} elements differ"
        assert torch.equal(params[name], ref_params[name]), name


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_pass_equals_torch_fused_adamw_on_cuda(dtype):
    runs = []
    for fused in (True, False):
        params = make_params(GPU_SHAPES, dtype, "cuda")
        buffer, optimizer = make_optimizer(params, fused=None if fused else False)
        assert optimizer.fused == fused  # on by default on CUDA
        norms = train(params, buffer, optimizer, range(STEPS))
        runs.append((norms, snapshot(params, optimizer)))
    assert runs[0][0] == runs[1][0]
    assert_same_run(runs[0][1], runs[1][1])


def distributed_cuda_body(rank, world_size):
    runs = []
    for fused in (True, False):
        params = make_params(GPU_SHAPES, torch.bfloat16, "cuda")
        buffer, optimizer = make_optimizer(
            params, fused, torch.distributed.group.WORLD, distributed=True
        )
        train(params, buffer, optimizer, range(STEPS), rank)
        runs.append(snapshot(params, optimizer))
    assert_same_run(*runs)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("name", list(LEAN))
def test_lean_states_equal_torch_fused_adamw_with_their_rounding_on_cuda(name):
    check_lean_states_against_torch("cuda", name, exact=True)


@pytest.mark.gpu
@needs_triton
def test_fused_pass_with_the_distributed_optimizer_on_cuda():
    run_on_ranks(distributed_cuda_body, 1, backend="nccl")


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 tensor cores",
)
def test_fp8_weight_casts_follow_the_fused_step_on_cuda():
    check_fp8_weight_casts_follow_the_step("cuda")


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 tensor cores",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_pass_casts_fp8_weights_on_cuda(dtype):
    check_the_pass_casts_fp8_weights("cuda", dtype)
