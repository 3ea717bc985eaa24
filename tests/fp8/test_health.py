"""FP8 health (megafp8.fp8.health): scales, saturation and underflow per layer and role, over
one rank or a process group."""

import math

import torch
from megafp8.models import TransformerLM, preset
from torch import nn

from megafp8 import Fp8Linear, fp8_autocast, fp8_health

from ..multiprocess import run_on_ranks


def test_saturation_fraction_on_the_cpu_path():
    torch.manual_seed(0)
    # the gradient into the FP8 layer: x-free
    model = nn.Sequential(Fp8Linear(64, 32), nn.Linear(32, 16))
    x = torch.randn(16, 64)
    with fp8_autocast():  # fits the delayed scales to x
        model(x).sum().backward()
    x[:2, :10] = 3 * x.abs().max()  # 20 inputs beyond the input scale
    with fp8_autocast(collect_saturation=True):
        model(x).sum().backward()
    health = fp8_health(model)
    roles = health["fp8_layers"]["0"]["roles"]
    assert roles["input"]["saturation"] == 20 / x.numel()
    assert roles["grad_output"]["saturation"] == 0.0
    assert roles["weight"]["saturation"] is None  # the cached weight cast was not redone
    assert health["fp8_saturation"] == 20 / (16 * 64 + 16 * 32)
    assert fp8_health(model)["fp8_saturation"] is None  # read once, then reset


def test_fp8_health_of_a_tiny_gpt():
    torch.manual_seed(0)
    model = TransformerLM(preset("gpt-tiny"))  # fp32 parameters on the CPU
    tokens = torch.randint(0, 1000, (2, 32))
    with fp8_autocast(collect_saturation=True):
        model(tokens, labels=tokens).mean().backward()
    health = fp8_health(model)
    layers = health["fp8_layers"]
    assert sorted(layers) == sorted(
        f"layers.{i}.{name}"
        for i in range(2)
        for name in ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2")
    )
    scales = [r["scale"] for layer in layers.values() for r in layer["roles"].values()]
    assert len(scales) == 2 * 4 * 3 and all(math.isfinite(s) and s > 0 for s in scales)
    assert health["fp8_scale_min"] == min(scales) and health["fp8_scale_max"] == max(scales)
    for layer in layers.values():
        assert layer["scale_min"] == min(r["scale"] for r in layer["roles"].values())
        # Every scale was fitted to its own tensor on the first pass: nothing saturates.
        assert [r["saturation"] for r in layer["roles"].values()] == [0.0, 0.0, 0.0]
    assert health["fp8_saturation"] == 0.0
    assert "fp8_layers" not in fp8_health(model, per_layer=False)


def saturation_counts(model):
    return [s.cast_counts.tolist() for s in model.modules() if hasattr(s, "amax_history")]


def test_recomputation_does_not_count_twice():
    tokens = torch.randint(0, 1000, (2, 32))
    counts = []
    for recompute in ("none", "full", "selective"):
        model = TransformerLM(preset("gpt-tiny"), recompute=recompute)
        with fp8_autocast(collect_saturation=True):
            model(tokens, labels=tokens).mean().backward()
        counts.append(saturation_counts(model))
    assert counts[0] == counts[1] == counts[2]
    assert all(cast > 0 for _, cast, _ in counts[0])


def test_collection_off_leaves_nothing_to_report():
    model = TransformerLM(preset("gpt-tiny"))
    tokens = torch.randint(0, 1000, (2, 32))
    with fp8_autocast():
        model(tokens, labels=tokens).mean().backward()
    assert all(c == [0, 0, 0] for c in saturation_counts(model))
    health = fp8_health(model)
    assert (
        health["fp8_saturation"] is None
        and health["fp8_underflow"] is None
        and health["fp8_scale_min"] > 0
    )


def test_a_model_without_fp8_reports_none():
    model = TransformerLM(preset("gpt-tiny"))
    assert fp8_health(model, per_layer=False) == {
        "fp8_scale_min": None,
        "fp8_scale_max": None,
        "fp8_saturation": None,
        "fp8_underflow": None,
    }


def _health_over_ranks(rank, world_size):
    layer = Fp8Linear(16, 16)
    layer.fp8_scaling["input"].scale.fill_(2.0 ** (rank + 1))
    layer.fp8_scaling["input"].cast_counts.copy_(torch.tensor([rank + 1, 100, 2 * rank]))
    return fp8_health(layer, group=torch.distributed.group.WORLD, per_layer=False)


def test_health_reduced_over_a_group():
    results = run_on_ranks(_health_over_ranks, 2)
    expected = {
        "fp8_scale_min": 2.0,
        "fp8_scale_max": 4.0,
        "fp8_saturation": 3 / 200,
        "fp8_underflow": 2 / 200,
    }
    assert results == [expected, expected]


def _layers_over_ranks(rank, world_size):
    # Two pipeline stages: rank 0 holds layer 0 (and a second copy of layer 2's input state, as a
    # data-parallel replica would), rank 1 layers 2 and 10: one record with every layer, in order.
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {str(i): Fp8Linear(16, 16) for i in ((0, 2) if rank == 0 else (2, 10))}
    )
    for i, layer in model.items():
        layer.fp8_scaling["input"].scale.fill_(2.0 ** (int(i) + rank))
        layer.fp8_scaling["input"].cast_counts.copy_(torch.tensor([1, 100, 10 * (rank + 1)]))
    return fp8_health(model, group=torch.distributed.group.WORLD)


def test_per_layer_health_gathered_over_a_group():
    results = run_on_ranks(_layers_over_ranks, 2)
    assert results[0] == results[1]
    health = results[0]
    assert list(health["fp8_layers"]) == ["0", "2", "10"]
    # the smaller scale, summed counts
    assert health["fp8_layers"]["2"]["roles"]["input"] == {
        "scale": 4.0,
        "saturation": 2 / 200,
        "underflow": 30 / 200,
    }
    assert health["fp8_layers"]["10"]["underflow"] == 20 / 100
    assert health["fp8_saturation"] == 4 / 400 and health["fp8_underflow"] == 60 / 400
    assert health["fp8_scale_min"] == 1.0 and health["fp8_scale_max"] == 2.0**11
