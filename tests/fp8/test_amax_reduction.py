"""Delayed-scaling amaxes MAX-reduced over a gloo group: identical scales, one collective per pass."""

import torch
import torch.distributed as dist

from megafp8 import DelayedScaling, Fp8Linear, fp8_autocast

from ..multiprocess import run_on_ranks

ROLES = ("input", "weight", "grad_output")


def train_two_layers(rank, world_size, reduce_amax):
    calls = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    torch.manual_seed(0)  # same weights on every rank, as for a replicated layer
    layers = torch.nn.Sequential(Fp8Linear(32, 64), Fp8Linear(64, 16))
    torch.manual_seed(100 + rank)  # but each rank's own data, at its own magnitude
    recipe = DelayedScaling(amax_history_len=4, reduce_amax=reduce_amax)
    local_input_amaxes = []
    for _ in range(3):
        x = torch.randn(16, 32) * (rank + 1)
        local_input_amaxes.append(x.abs().max().item())
        with fp8_autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            y = layers(x)
        y.pow(2).mean().backward()
    dist.all_reduce = all_reduce
    states = {
        f"{i}.{role}": (
            layer.fp8_scaling[role].scale.clone(),
            layer.fp8_scaling[role].amax_history.clone(),
        )
        for i, layer in enumerate(layers)
        for role in ROLES
    }
    return states, calls, local_input_amaxes


def test_reduced_amaxes_give_identical_scales_with_one_collective_per_pass():
    results = run_on_ranks(train_two_layers, 2, True)
    (states0, calls0, amax0), (states1, calls1, amax1) = results
    # The first pass agrees each first cast's scale (one value per tensor: 4 forward, 2
    # backward), then every pass runs one collective carrying all of its amaxes.
    first_pass = [1, 1, 1, 1, 4, 1, 1, 2]
    assert calls0 == calls1 == first_pass + [4, 2] * 2
    for key in states0:
        assert torch.equal(states0[key][0], states1[key][0]), key
        assert torch.equal(states0[key][1], states1[key][1]), key
    # The first layer's input history holds the larger of the two ranks' amaxes, newest first.
    expected = [max(a, b) for a, b in zip(amax0, amax1)][::-1] + [0.0]
    assert states0["0.input"][1].tolist() == expected


def test_without_reduce_amax_each_rank_keeps_its_own_scales():
    (states0, calls0, _), (states1, calls1, _) = run_on_ranks(train_two_layers, 2, False)
    assert calls0 == calls1 == []
    assert not torch.equal(states0["0.input"][0], states1["0.input"][0])
