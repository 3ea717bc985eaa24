"""GPT and Llama at tensor-parallel size 2 against the same model at size 1 (gloo): logits,
per-token loss and every parameter gradient, in fp32 and in FP8."""

import pytest
import torch
import torch.distributed as dist
from megafp8.models.config import preset
from megafp8.models.transformer import TransformerLM

from megafp8 import DelayedScaling, fp8_autocast

from ..fp8.helpers import rel_err
from ..multiprocess import run_on_ranks


def step(model, tokens, labels, fp8, group):
    """Logits, per-token loss and every gradient of one forward + backward."""
    model.zero_grad(set_to_none=True)
    with fp8_autocast(
        enabled=fp8, recipe=DelayedScaling(amax_history_len=4), amax_reduction_group=group
    ):
        logits = model(tokens)
        loss = model(tokens, labels=labels)
    loss.mean().backward()
    return {
        "logits": logits.detach(),
        "loss": loss.detach(),
        **{name: param.grad for name, param in model.named_parameters()},
    }


def shard_of(name, full, local, tp, rank, config):
    """This rank's part of a tensor of the tp = 1 model (the logits: their vocabulary slice)."""
    if local.shape == full.shape:
        return full
    if name.endswith("mlp.fc1.weight") or name.endswith("mlp.fc1.bias"):
        stacked = 2 if config.activation == "swiglu" else 1  # each stacked matrix is split alone
        return torch.cat([part.chunk(tp, 0)[rank] for part in full.chunk(stacked, 0)])
    dim = next(d for d in range(local.dim()) if local.shape[d] != full.shape[d])
    return full.chunk(tp, dim)[rank]


def relative_errors(ours, reference, tp, rank, config):
    errors = {}
    for name, local in ours.items():
        full = shard_of(name, reference[name], local, tp, rank, config)
        padding = torch.isinf(full)  # the padded vocabulary's logits: -inf in both
        assert torch.equal(padding, torch.isinf(local))
        errors[name] = rel_err(local.masked_fill(padding, 0), full.masked_fill(padding, 0))
    return errors


def batch(config, seed):
    """Random tokens and labels [2, 32], the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, config.vocab_size, (2, 32), generator=g) for _ in range(2))


def body(rank, tp, name):
    group = dist.group.WORLD
    config = preset(name)
    tokens, labels = batch(config, 5)
    results = {}
    for fp8 in (False, True):
        torch.manual_seed(0)
        reference = step(TransformerLM(config), tokens, labels, fp8, None)
        torch.manual_seed(0)
        sharded = step(TransformerLM(config, tp_group=group), tokens, labels, fp8, group)
        results[fp8] = (reference, relative_errors(sharded, reference, tp, rank, config))
    # FP8's own error: the tp = 1 FP8 model against the tp = 1 fp32 model, on replicated tensors.
    fp8_error = max(
        rel_err(results[True][0][n], results[False][0][n])
        for n in ("loss", "final_norm.weight", "layers.0.input_norm.weight")
    )
    return {
        "fp32": max(results[False][1].values()),
        "fp8": max(results[True][1].values()),
        "fp8_own_error": fp8_error,
    }


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_tp2_model_equals_tp1(name):
    for result in run_on_ranks(body, 2, name):
        assert result["fp32"] < 1e-5, result  # the same sums in another order
        # FP8: the same scales (amaxes reduced over tp) and values, but a residual-stream sum in
        # another order can move a value across an FP8 rounding boundary, and such flips compound
        # layer by layer in backward. Sharding must add far less than FP8's own error.
        assert result["fp8"] < 0.25 * result["fp8_own_error"], result


def sequence_parallel_body(rank, tp, name):
    """The same tp = 2 model with and without sequence parallelism, fp32 and FP8: the largest
    relative difference of logits, loss and every gradient (the gradients of parameters used on
    the sequence shard summed over tp first, as the trainer does)."""
    group = dist.group.WORLD
    config = preset(name)
    tokens, labels = batch(config, 6)
    differences = {}
    for fp8 in (False, True):
        results = []
        for sp in (False, True):
            torch.manual_seed(0)
            model = TransformerLM(config, tp_group=group, sequence_parallel=sp)
            layer = model.layers["0"]
            assert model.embedding.sequence_parallel == layer.attention.qkv.sequence_parallel == sp
            assert (
                layer.mlp.fc2.sequence_parallel == sp
                and hasattr(layer.input_norm.weight, "sequence_parallel") == sp
            )
            result = step(model, tokens, labels, fp8, group)
            for param_name, param in model.named_parameters():
                if getattr(param, "sequence_parallel", False):
                    dist.all_reduce(result[param_name], group=group)
            results.append(result)
        plain, sharded = results
        differences[fp8] = max(
            rel_err(
                sharded[n].masked_fill(torch.isinf(plain[n]), 0),
                plain[n].masked_fill(torch.isinf(plain[n]), 0),
            )
            for n in plain
        )
    return differences


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_sequence_parallel_model_equals_plain_tensor_parallel(name):
    for differences in run_on_ranks(sequence_parallel_body, 2, name):
        assert differences[False] < 1e-5, differences
        # The same scales (agreed over tp) and the same values: FP8 changes nothing here either.
        assert differences[True] < 1e-5, differences
