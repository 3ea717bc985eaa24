"""Neighbour fusion (megafp8.fp8.fused): the norm before the QKV and fc1 GEMMs and the MLP's
activation written straight into those GEMMs' FP8 inputs, and the activation's gradient straight
into fc1's FP8 output gradient. Trained with and without it, a model follows the same path: the
same losses, gradients and FP8 scaling state, to the rounding the fused kernels may differ in.
On the CPU the fused path runs the kernels' torch references; on a GPU, the Triton kernels."""
import dataclasses

import pytest
import torch

from megafp8 import DelayedScaling, Fp8Linear, fp8_autocast
from megafp8.fp8.fused import GradHandoff
from megafp8.models import preset
from megafp8.models.transformer import TransformerLM
from megafp8.parallel import ColumnParallelLinear, RowParallelLinear

from .helpers import gemm_error_bound, rel_err

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]
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
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        states = {name: (m.fp8_scaling[role].scale.clone(), m.fp8_scaling[role].amax_history.clone())
                  for name, m in model.named_modules() if isinstance(m, Fp8Linear) for role in m.fp8_scaling}
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
# LayerNorm + GELU's tanh form (its backward unfused: activation_kernels.FUSED_BACKWARD_KINDS),
# LayerNorm + GELU, RMSNorm + SwiGLU.
@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-tiny:gelu", "llama-tiny"])
def test_a_model_trains_alike_with_and_without_neighbour_fusion(name, device):
    (fused_model, plain_model), tokens = model_pair(name, device)
    recipe = DelayedScaling(amax_history_len=4)
    fused = train(fused_model, tokens, True, recipe)
    plain = train(plain_model, tokens, False, recipe)
    for step, ((loss, grads, states), (ref_loss, ref_grads, ref_states)) in enumerate(zip(fused, plain)):
        assert loss == pytest.approx(ref_loss, rel=2e-3), step
        assert grads.keys() == ref_grads.keys()
        for key, grad in grads.items():
            # A rounding flip in a fused kernel moves an FP8 byte by a step (E5M2's 2^-3 for
            # gradients), which the layers below carry on: within an FP8 GEMM's error bound.
            assert rel_err(grad, ref_grads[key]) < gemm_error_bound(E5M2, E4M3), (step, key)
        for key, (scale, history) in states.items():
            # An amax is one element: of a gradient deep in backward, carried through as many
            # FP8 GEMMs as the gradients (2.1% apart once, for the first layer's QKV).
            torch.testing.assert_close(scale, ref_states[key][0], rtol=0.05, atol=0, msg=f"{step} {key}")
            torch.testing.assert_close(history, ref_states[key][1], rtol=0.05, atol=0, msg=f"{step} {key}")


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
            assert torch.equal(scale, ref_states[key][0]) and torch.equal(history, ref_states[key][1]), key


@pytest.mark.parametrize("recipe", ["current", "override"])
def test_fusion_stands_aside_where_the_scale_needs_the_tensor_first(recipe):
    from megafp8 import CurrentScaling
    recipe = CurrentScaling() if recipe == "current" else DelayedScaling(override_linear_precision=(False, False, True))
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
