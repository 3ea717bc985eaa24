"""Neighbour fusion (megafp8.fp8.fused): the norm before the QKV and fc1 GEMMs and the MLP's
activation written straight into those GEMMs' FP8 inputs, the activation's gradient straight
into fc1's FP8 output gradient, and attention's query, key and value gradients cast together
into the QKV GEMM's FP8 output gradient. Trained with and without it, a model follows the same path: the
same losses, gradients and FP8 scaling state, to the rounding the fused kernels may differ in.
On the CPU the fused path runs the kernels' torch references; on a GPU, the Triton kernels."""

import dataclasses

import pytest
import torch
from megafp8.models import preset
from megafp8.models.transformer import TransformerLM
from megafp8.parallel import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

from megafp8 import DelayedScaling, Fp8Linear, fp8_autocast, triton_support
from megafp8.fp8.formats import fp8_max
from megafp8.fp8.fused import GradHandoff, HeadGradsSource
from megafp8.fp8.quantize import quantize

from .helpers import gemm_error_bound, rel_err

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

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
STEPS = 3  # the first casts fit their scales (materialized neighbours), the later ones fuse


def train(model, tokens, fuse, recipe, steps=STEPS):
    """Per step: the loss, every parameter's gradient, every linear's scaling state."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.fuse_neighbours = fuse
    record = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        with fp8_autocast(recipe=recipe):
            loss = model(tokens[step, :, :-1], labels=tokens[step, :, 1:]).float().mean()
        loss.backward()
        grads = {
            name: p.grad.detach().clone()
            for name, p in model.named_parameters()
            if p.grad is not None
        }
        states = {
            name: (m.fp8_scaling[role].scale.clone(), m.fp8_scaling[role].amax_history.clone())
            for name, m in model.named_modules()
            if isinstance(m, Fp8Linear)
            for role in m.fp8_scaling
        }
        record.append((loss.item(), grads, states))
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)  # move the weights, so each step casts them again
    return record


def model_pair(name, device, dtype=torch.bfloat16):
    """Two equal models of preset `name` ("preset:activation" swaps the activation in)."""
    name, _, activation = name.partition(":")
    config = preset(name)
    if activation:
        config = dataclasses.replace(config, activation=activation)
    models = [TransformerLM(config, seed=3, dtype=dtype, device=device) for _ in range(2)]
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (STEPS, 2, 33), generator=g).to(device)
    return models, tokens


@pytest.mark.parametrize("device", DEVICES)
# LayerNorm + GELU's tanh form (its gradient in the sigmoid form),
# LayerNorm + GELU, RMSNorm + SwiGLU.
@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-tiny:gelu", "llama-tiny"])
def test_a_model_trains_alike_with_and_without_neighbour_fusion(name, device):
    (fused_model, plain_model), tokens = model_pair(name, device)
    recipe = DelayedScaling(amax_history_len=4)
    fused = train(fused_model, tokens, True, recipe)
    plain = train(plain_model, tokens, False, recipe)
    for step, ((loss, grads, states), (ref_loss, ref_grads, ref_states)) in enumerate(
        zip(fused, plain)
    ):
        assert loss == pytest.approx(ref_loss, rel=2e-3), step
        assert grads.keys() == ref_grads.keys()
        for key, grad in grads.items():
            # A rounding flip in a fused kernel moves an FP8 byte by a step (E5M2's 2^-3 for
            # gradients), which the layers below carry on: within an FP8 GEMM's error bound.
            assert rel_err(grad, ref_grads[key]) < gemm_error_bound(E5M2, E4M3), (step, key)
        for key, (scale, history) in states.items():
            # An amax is one element of a tensor (a gradient deep in backward, carried through
            # as many FP8 GEMMs as the gradients above): held to the bound those gradients meet
            # (measured: 8.6% apart once, the first layer's QKV output gradient at step 2).
            bound = gemm_error_bound(E5M2, E4M3)
            torch.testing.assert_close(
                scale, ref_states[key][0], rtol=bound, atol=0, msg=f"{step} {key}"
            )
            torch.testing.assert_close(
                history, ref_states[key][1], rtol=bound, atol=0, msg=f"{step} {key}"
            )


def test_on_the_cpu_rmsnorm_and_swiglu_fused_are_the_unfused_path_bit_for_bit():
    # Their torch references compute as the unfused modules do on the CPU (LayerNorm's fp32
    # reference differs from aten's CPU kernel, which keeps bf16 statistics, by rounding).
    (fused_model, plain_model), tokens = model_pair("llama-tiny", "cpu")
    recipe = DelayedScaling(amax_history_len=4)
    fused = train(fused_model, tokens, True, recipe)
    plain = train(plain_model, tokens, False, recipe)
    for (loss, grads, states), (ref_loss, ref_grads, ref_states) in zip(fused, plain):
        assert loss == ref_loss
        assert all(torch.equal(grad, ref_grads[key]) for key, grad in grads.items())
        for key, (scale, history) in states.items():
            assert torch.equal(scale, ref_states[key][0]) and torch.equal(
                history, ref_states[key][1]
            ), key


@pytest.mark.parametrize("name", ["gpt-tiny:gelu", "llama-tiny"])
def test_on_the_cpu_fine_grained_fusion_is_the_unfused_path_bit_for_bit(name, monkeypatch):
    """Under rowwise scaling with the activation fused, the activation, its gradient and QKV's
    q, k, v gradients are handed over as fine-grained casts
    (megafp8.fp8.fine_grained.OutputGradient): on the CPU the same numbers as the unfused layers."""
    from megafp8 import RowwiseScaling
    from megafp8.fp8 import fine_grained
    from megafp8.fp8.activation_kernels import KINDS

    handed, cast = [], fine_grained.cast_output_gradient
    monkeypatch.setattr(
        fine_grained,
        "cast_output_gradient",
        lambda source, *args: handed.append(type(source).__name__) or cast(source, *args),
    )
    (fused_model, plain_model), tokens = model_pair(name, "cpu")
    recipe = RowwiseScaling(fused_activations=KINDS)
    fused = train(fused_model, tokens, True, recipe)
    assert set(handed) == {"ActivationGradSource", "HeadGradsSource"}
    handed.clear()
    plain = train(plain_model, tokens, False, recipe)
    assert not handed
    for (loss, grads, _), (ref_loss, ref_grads, _) in zip(fused, plain):
        assert loss == ref_loss
        assert all(torch.equal(grad, ref_grads[key]) for key, grad in grads.items())


@pytest.mark.parametrize("recipe", ["current", "override"])
def test_fusion_stands_aside_where_the_scale_needs_the_tensor_first(recipe):
    from megafp8 import CurrentScaling

    recipe = (
        CurrentScaling()
        if recipe == "current"
        else DelayedScaling(override_linear_precision=(False, False, True))
    )
    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 32)
    norm = torch.nn.LayerNorm(64)
    x = torch.randn(16, 64)
    with fp8_autocast(recipe=recipe):
        fusion, out = layer.fusion(layer.fp8_context(x), x, norm=norm)
    assert fusion.norm is None and torch.equal(out, norm(x))


def test_the_activation_input_must_feed_the_fused_activation_alone():
    torch.manual_seed(0)
    fc1, fc2 = ColumnParallelLinear(64, 128), RowParallelLinear(128, 64, input_is_parallel=True)
    x = torch.randn(32, 64, requires_grad=True)
    recipe = DelayedScaling()
    for step in range(2):  # the second step has a scale history: fused
        handoff = GradHandoff()
        with fp8_autocast(recipe=recipe):
            h = fc1(x, grad_from=handoff)
            y = fc2(h, activation="gelu", grad_to=(fc1, handoff))
            if step == 1:
                y = y + h.sum()  # a second use of h: its gradient is no longer the handed-over one
        if step == 1:
            with pytest.raises(RuntimeError, match="fused activation alone"):
                y.sum().backward()
        else:
            y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 32)], ids=["mha", "gqa"])
def test_qkv_gradients_cast_unconcatenated_are_the_concatenated_cast_bit_for_bit(
    heads, kv_heads, head_dim, device, monkeypatch
):
    # The fused path casts the same values in the same tiles as the concatenation's cast: every
    # gradient, bias sum and scaling state is equal, and the fused cast did run.
    fused_casts = []
    original = HeadGradsSource.quantize
    monkeypatch.setattr(
        HeadGradsSource,
        "quantize",
        lambda self, *a, **k: fused_casts.append(1) or original(self, *a, **k),
    )
    torch.manual_seed(0)
    layers = [
        QKVParallelLinear(
            64, heads, kv_heads, head_dim, bias=True, dtype=torch.bfloat16, device=device
        )
        for _ in range(2)
    ]
    layers[1].load_state_dict(layers[0].state_dict())
    recipe = DelayedScaling(amax_history_len=4)
    results = []
    for fused_cast, layer in zip((True, False), layers):
        g = torch.Generator().manual_seed(1)
        grads = []
        # the first cast fits its scale from the tensor: fused from the second on
        for step in range(3):
            x = (
                (torch.randn(24, 2, 64, generator=g) * (step + 1))
                .to(device, torch.bfloat16)
                .requires_grad_()
            )
            with fp8_autocast(recipe=recipe):
                q, k, v = layer.heads(x) if fused_cast else layer.split_heads(layer(x))
            out = (
                (q * torch.randn(q.shape, generator=g).to(device, q.dtype)).sum()
                + (k * 2).sum()
                + (v**2).sum()
            )
            out.backward()
            grads.append(
                (
                    x.grad,
                    layer.weight.grad.clone(),
                    layer.bias.grad.clone(),
                    layer.fp8_scaling["grad_output"].amax_history.clone(),
                )
            )
            layer.zero_grad()
        results.append(grads)
    assert len(fused_casts) == 2
    for fused_step, plain_step in zip(*results):
        for a, b in zip(fused_step, plain_step):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_support.available()), reason="needs CUDA and triton"
)
@pytest.mark.parametrize(
    "groups,queries_per_group,head_dim", [(16, 1, 128), (4, 4, 64), (2, 3, 48)]
)
@pytest.mark.parametrize("tokens", [4096, 1000])
@pytest.mark.parametrize("fp8_dtype", [E5M2, E4M3])
def test_quantize_heads_kernel_equals_quantize_of_the_concatenation(
    groups, queries_per_group, head_dim, tokens, fp8_dtype
):
    torch.manual_seed(0)
    dq, dk, dv = (
        torch.randn(tokens, groups * n * head_dim, device="cuda", dtype=torch.bfloat16) * 3
        for n in (queries_per_group, 1, 1)
    )
    source = HeadGradsSource(dq, dk, dv, head_dim)
    scale = torch.tensor(fp8_max(fp8_dtype) / 4, device="cuda")  # values beyond 4 saturate
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        counts = [torch.zeros(3, dtype=torch.int64, device="cuda") for _ in range(2)]
        fused_q = source.quantize(
            fp8_dtype,
            scale,
            rowwise=rowwise,
            columnwise=columnwise,
            col_sum=True,
            saturation_out=counts[0],
        )
        plain_q = quantize(
            source.materialize(),
            fp8_dtype,
            scale,
            rowwise=rowwise,
            columnwise=columnwise,
            col_sum=True,
            saturation_out=counts[1],
        )
        for a, b in ((fused_q.data, plain_q.data), (fused_q.data_t, plain_q.data_t)):
            assert (a is None) == (b is None) and (
                a is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            )
        assert torch.equal(fused_q.amax, plain_q.amax) and torch.equal(
            fused_q.scale_inv, plain_q.scale_inv
        )
        assert torch.equal(fused_q.col_sum, plain_q.col_sum) and torch.equal(counts[0], counts[1])
        assert counts[0][0] > 0
