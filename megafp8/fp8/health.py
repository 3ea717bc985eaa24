"""FP8 health: the scales of a model's FP8 layers and the fractions of elements their casts
saturated or flushed to zero, per layer and role, over one rank or a whole process group (what
the trainer logs beside the loss, and `tools/fp8_layer_table.py` reads).

    with fp8_autocast(collect_saturation=True):
        ...
    fp8_health(model)   # {"fp8_scale_min", "fp8_scale_max", "fp8_saturation", "fp8_underflow", "fp8_layers"}
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .scaling import ScalingState, take_cast_counts


def fp8_health(model: nn.Module, group=None, per_layer: bool = True) -> dict:
    """The FP8 scales of `model`'s Fp8Linear layers and the fractions of elements saturated and
    flushed to zero.

    Returns `fp8_scale_min`, `fp8_scale_max` (current scales over every layer and role),
    `fp8_saturation` (saturated / cast elements) and `fp8_underflow` (nonzero elements the cast
    turned into zero / cast elements), the fractions over the casts made under
    `fp8_autocast(collect_saturation=True)` since the last call, which resets the counts (None
    when nothing was counted), ready to merge into a `MetricsLogger` record; with `per_layer`
    also `fp8_layers`: {layer path: {scale_min, scale_max, saturation, underflow, roles: {role:
    {scale, saturation, underflow}}}}. Scaling states that never cast (layers kept in high
    precision) are left out.

    With `group`, the numbers cover every rank of it (collectives: all of its ranks must call),
    e.g. the whole world, so the logging rank sees every pipeline stage's layers: per layer, the
    smallest scale of its ranks and the counts of all of them (layer paths hold the global layer
    index, so one layer has one path on every rank).
    """
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, ScalingState)]
    states = [m for _, m in named]
    scales = torch.stack([m.scale for m in states]).tolist() if states else []
    counts = take_cast_counts(states)
    layers: dict = {}
    for (name, state), scale, (saturated, cast, flushed) in zip(named, scales, counts):
        # Never cast: the initial scale, no delayed-scaling update, nothing counted.
        if state.update_count == 0 and cast == 0 and scale == 1.0:
            continue
        path, _, role = name.rpartition(".")
        # the layer's own path
        path = "" if path == "fp8_scaling" else path.removesuffix(".fp8_scaling")
        layers.setdefault(path, {})[role] = (scale, saturated, cast, flushed)

    distributed = group is not None and dist.get_world_size(group) > 1
    used = [entry for roles in layers.values() for entry in roles.values()]
    scale_min = min((s for s, *_ in used), default=math.inf)
    scale_max = max((s for s, *_ in used), default=-math.inf)
    totals = [sum(entry[i] for entry in used) for i in (1, 2, 3)]
    if distributed:
        scale_min, scale_max, totals = _reduce_health(scale_min, scale_max, totals, group)
    saturated, cast, flushed = totals

    health = {
        "fp8_scale_min": scale_min if math.isfinite(scale_min) else None,
        "fp8_scale_max": scale_max if math.isfinite(scale_max) else None,
        "fp8_saturation": _fraction(saturated, cast),
        "fp8_underflow": _fraction(flushed, cast),
    }
    if per_layer:
        if distributed:
            layers = _merge_layers(layers, group)
        health["fp8_layers"] = {path: _layer_health(roles) for path, roles in layers.items()}
    return health


def _layer_health(roles: dict) -> dict:
    cast = sum(c for _, _, c, _ in roles.values())
    return {
        "scale_min": min(s for s, *_ in roles.values()),
        "scale_max": max(s for s, *_ in roles.values()),
        "saturation": _fraction(sum(n for _, n, _, _ in roles.values()), cast),
        "underflow": _fraction(sum(f for *_, f in roles.values()), cast),
        "roles": {
            role: {"scale": s, "saturation": _fraction(n, c), "underflow": _fraction(f, c)}
            for role, (s, n, c, f) in roles.items()
        },
    }


def _fraction(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _reduce_health(scale_min, scale_max, totals, group):
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else None
    )
    extremes = torch.tensor([-scale_min, scale_max], dtype=torch.float64, device=device)
    summed = torch.tensor(totals, dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(summed, group=group)
    (neg_min, scale_max) = extremes.tolist()
    return -neg_min, scale_max, summed.tolist()


def _merge_layers(layers: dict, group) -> dict:
    """Every rank's {path: {role: (scale, saturated, cast, flushed)}} in one: the smallest scale
    of a layer's ranks (tensor-parallel ranks share it; data-parallel replicas may not, with no
    amax reduction over them), the sum of their counts."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, layers, group=group)
    merged: dict = {}
    for rank_layers in gathered:
        for path, roles in rank_layers.items():
            for role, (scale, saturated, cast, flushed) in roles.items():
                entry = merged.setdefault(path, {}).get(role)
                merged[path][role] = (
                    (scale, saturated, cast, flushed)
                    if entry is None
                    else (
                        min(entry[0], scale),
                        entry[1] + saturated,
                        entry[2] + cast,
                        entry[3] + flushed,
                    )
                )
    return dict(sorted(merged.items(), key=lambda item: _path_key(item[0])))


def _path_key(path: str) -> tuple:
    """Sort key of a layer path: its numbers (the layer index), so layers.10 follows layers.9; a
    stable sort keeps one layer's linears in the order the model runs them."""
    return tuple(int(part) for part in path.split(".") if part.isdigit())
