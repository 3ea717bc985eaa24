"""One pipeline rank's share of the model: which layers it holds (`stage_layers`), its model
chunks seen as one module (`PipelineStage`), the tied embedding's two copies on the first and
last stage, and `finalize_grads`, what a step does between the last backward and the
optimizer (Megatron's finalize_model_grads).

    chunks = [TransformerLM(config, tp_group=groups.tp_group, sequence_parallel=sp, layers=span, seed=seed)
              for span in stage_layers(config.num_layers, groups.pp_size, groups.pp_rank, vpp)]
    stage = PipelineStage(chunks, groups)      # checks the tied embedding's copies agree
    buffer = GradientBuffer(stage.parameters(), groups.dp_group, own_bucket=stage.own_buckets)
    ... forward_backward(None, chunks, data_iterator=..., ..., grad_buffers=buffer)
    finalize_grads(chunks, groups, buffer)
    optimizer.step()

The chunks are duck-typed: modules with `layers` (a ModuleDict named by global layer index),
`config.tie_embeddings`, and where they hold them `embedding`, `position_embedding`,
`final_norm` and `output_layer`, as megafp8.models.TransformerLM has.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from megafp8.collectives import group_size
from megafp8.messages import check_integer

# The two parts of a transformer layer, in order. A pipeline stage may end between them: the
# residual stream after the attention is a boundary like the one between layers, so layer counts
# and ranges are multiples of half a layer (an int where whole).
LAYER_PARTS = ("attention", "mlp")


def stage_layers(
    num_layers: int,
    pp: int,
    pp_rank: int,
    vpp: int = 1,
    first_stage_layers: float | None = None,
    last_stage_layers: float | None = None,
    layout: Sequence[float] | None = None,
) -> list[tuple[float, float]]:
    """The layers of each model chunk of pipeline rank `pp_rank`: a list of `vpp` (first, last)
    ranges (last exclusive), one per chunk, for `TransformerLM(layers=...)`.

    There are pp * vpp virtual stages; chunk c of rank r is virtual stage c * pp + r. Layers
    are split evenly over them, unless `first_stage_layers` / `last_stage_layers` give the first
    / last virtual stage (which also carry the embedding / the output layer and loss) their
    own, usually smaller, count; the other stages split the rest evenly. Or `layout` gives every
    virtual stage's count, in order. Counts may end in a half (`layer_parts`: a stage then ends
    after a layer's attention, the next starts at its MLP). Every stage holds at least half a
    layer.

        stage_layers(8, 2, 0)                        # [(0, 4)]
        stage_layers(8, 2, 1, vpp=2)                 # [(2, 4), (6, 8)]
        stage_layers(10, 4, 0, first_stage_layers=1, last_stage_layers=3)   # [(0, 1)]; then 3, 3, 3
        stage_layers(24, 2, 0, 2, first_stage_layers=6.5, last_stage_layers=5.5)  # [(0, 6.5), (12.5, 18.5)]
        stage_layers(24, 2, 0, 2, layout=[6, 6.5, 6.5, 5])  # [(0, 6), (12.5, 19)]
    """
    for name, value in (("num_layers", num_layers), ("pp", pp), ("vpp", vpp)):
        check_integer(name, value)
    check_integer("pp_rank", pp_rank, minimum=0)
    if pp_rank >= pp:
        raise ValueError(f"pp_rank must be an int in 0..{pp - 1}, got {pp_rank!r}")
    halves = _stage_halves(num_layers, pp, vpp, first_stage_layers, last_stage_layers, layout)
    starts = [sum(halves[:stage]) for stage in range(pp * vpp + 1)]
    return [
        (_layers(starts[c * pp + pp_rank]), _layers(starts[c * pp + pp_rank + 1]))
        for c in range(vpp)
    ]


def layer_parts(first: float, last: float) -> list[tuple[int, tuple[str, ...]]]:
    """The layers a range of `stage_layers` touches, each with the parts of it the range holds:
    both for a whole layer, ("mlp",) where the range starts half-way into it, ("attention",) where
    it ends there.

        layer_parts(12.5, 15)   # [(12, ("mlp",)), (13, ("attention", "mlp")), (14, ("attention", "mlp"))]
    """
    return [
        (i, tuple(p for k, p in enumerate(LAYER_PARTS) if first <= i + k / 2 < last))
        for i in range(math.floor(first), math.ceil(last))
    ]


def _layers(halves: int) -> float:
    """`halves` half layers in layers: an int where whole."""
    return halves // 2 if halves % 2 == 0 else halves / 2


def half_layers(value) -> int | None:
    """`value` layers in half layers (a stage may end after a layer's attention): None unless it
    is a non-negative int or a float that is a whole multiple of 0.5.

        half_layers(3.5)   # 7
        half_layers(1.25)  # None
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return None
    return None if value * 2 % 1 else int(value * 2)


def _halves(name: str, value) -> int:
    """A layer count given in layers (a multiple of 0.5) in half layers; a ValueError otherwise."""
    halves = half_layers(value)
    if not halves:
        raise ValueError(
            f"{name} must be a positive int or half-int (a stage may end after a layer's "
            f"attention), got {value!r}: every stage holds at least half a layer"
        )
    return halves


def _stage_halves(
    num_layers: int,
    pp: int,
    vpp: int,
    first_stage_layers: float | None,
    last_stage_layers: float | None,
    layout: Sequence[float] | None = None,
) -> list[int]:
    """The half layers of each of the pp * vpp virtual stages, by `stage_layers`' rule; a
    ValueError saying why where the rule cannot split them."""
    stages = pp * vpp
    what = f"pp={pp} x vpp={vpp} = {stages}" if vpp > 1 else f"pp={pp}"
    if layout is not None:
        return _layout_halves(
            num_layers, stages, what, layout, first_stage_layers, last_stage_layers
        )
    fixed = {}  # virtual stage -> its given count, in half layers
    for name, value, stage in (
        ("first_stage_layers", first_stage_layers, 0),
        ("last_stage_layers", last_stage_layers, stages - 1),
    ):
        if value is None:
            continue
        halves = _halves(name, value)
        if stages == 1:
            if value != num_layers:
                raise ValueError(
                    f"{name}={value} with a single pipeline stage: it holds all num_layers={num_layers}"
                )
            continue
        fixed[stage] = halves
    rest, others = 2 * num_layers - sum(fixed.values()), stages - len(fixed)
    given = " and ".join(
        f"{name}={value}"
        for name, value in (
            ("first_stage_layers", first_stage_layers),
            ("last_stage_layers", last_stage_layers),
        )
        if value is not None and stages > 1
    )
    if others == 0:
        if rest != 0:
            raise ValueError(
                f"{given} add up to {_layers(2 * num_layers - rest)} layers, but the model has "
                f"num_layers={num_layers} and there are only {stages} pipeline stages ({what})"
            )
        per_stage = 0
    elif given and (rest < others or rest % others):
        left = _layers(rest)
        raise ValueError(
            f"the {left} layers left after {given} do not split evenly over the other {others} "
            f"pipeline stages ({what} stages, num_layers={num_layers})"
            + (f": {left} % {others} = {left % others}" if rest % 2 == 0 and rest > 0 else "")
            + ", and each stage needs at least half a layer"
        )
    elif not given and (num_layers < others or num_layers % others):
        raise ValueError(
            f"num_layers={num_layers} does not split evenly over {what} pipeline stages "
            f"({num_layers} % {stages} = {num_layers % stages}"
            f"{', fewer layers than stages' if num_layers < others else ''}): use a number of "
            f"layers divisible by {stages}, or first_stage_layers / last_stage_layers"
        )
    else:
        per_stage = rest // others
    return [fixed.get(stage, per_stage) for stage in range(stages)]


def _layout_halves(num_layers, stages, what, layout, first_stage_layers, last_stage_layers):
    """`layout`, every virtual stage's layers, in half layers; a ValueError saying what is wrong."""
    if first_stage_layers is not None or last_stage_layers is not None:
        raise ValueError(
            "layout gives every stage's layers, the first and last included: give it or "
            "first_stage_layers / last_stage_layers, not both"
        )
    if len(layout) != stages:
        raise ValueError(
            f"layout has {len(layout)} stages' layers ({', '.join(map(str, layout))}), but there "
            f"are {stages} pipeline stages ({what}): give one count per virtual stage, in order"
        )
    halves = [_halves(f"layout[{stage}]", value) for stage, value in enumerate(layout)]
    if sum(halves) != 2 * num_layers:
        raise ValueError(
            f"layout adds up to {_layers(sum(halves))} layers ({' + '.join(map(str, layout))}), "
            f"but the model has num_layers={num_layers}"
        )
    return halves


def balanced_stage_split(
    num_layers: int, pp: int, vpp: int = 1, output_layer_cost: float = 0.0
) -> tuple[float | None, float | None]:
    """The (first_stage_layers, last_stage_layers) for `stage_layers` that even out the pipeline
    ranks' work when the last virtual stage also runs the output layer and the loss, costing
    `output_layer_cost` layers' time; (None, None) where the even split is as good.

    A step's pace is its busiest rank's: the split minimises the largest rank's work (its layers,
    the output layer's cost on the last rank), then the number of stages that end inside a layer
    (a cut only where it lightens the busiest rank), then the largest virtual stage (the warm-up
    and drain of the schedule), then the distance from the even split. A layer's attention and its
    MLP count as half a layer's work each.

        balanced_stage_split(24, 2, vpp=2, output_layer_cost=1.7)   # (7, 5): stages of 7, 6, 6, 5
        balanced_stage_split(24, 2, vpp=2, output_layer_cost=1.3)   # (6.5, 5.5): 12.5 and 12.8
        balanced_stage_split(32, 2, vpp=2, output_layer_cost=0.8)   # (8.5, 7.5): 16.5 and 16.3
        balanced_stage_split(24, 2, vpp=2)                          # (None, None): 6 each is best
    """
    for name, value in (("num_layers", num_layers), ("pp", pp), ("vpp", vpp)):
        check_integer(name, value)
    if not output_layer_cost >= 0:
        raise ValueError(f"output_layer_cost must be a number >= 0, got {output_layer_cost!r}")
    stages = pp * vpp
    if pp == 1:
        return None, None

    def cost(halves):
        ranks = [sum(halves[stage] for stage in range(rank, stages, pp)) / 2 for rank in range(pp)]
        ranks[-1] += output_layer_cost
        cut = sum(h % 2 for h in halves)
        return max(ranks), cut, max(halves), sum(abs(h / 2 - num_layers / stages) for h in halves)

    # The even split first: a split of the same cost leaves it as it is.
    candidates = [(None, None)] + [
        (_layers(first), _layers(last))
        for first in range(1, 2 * num_layers)
        for last in range(1, 2 * num_layers - first + 1)
    ]
    best, best_cost = None, None
    for first, last in candidates:
        try:
            split_cost = cost(_stage_halves(num_layers, pp, vpp, first, last))
        except ValueError:  # stage_layers' rule cannot split the layers so
            continue
        if best_cost is None or split_cost < best_cost:
            best, best_cost = (first, last), split_cost
    if best is None:
        raise ValueError(
            f"num_layers={num_layers} cannot be split over pp={pp} x vpp={vpp} = {stages} pipeline "
            f"stages with at least half a layer each and the middle ones equal"
        )
    return best


class PipelineStage(nn.Module):
    """This rank's model chunks seen as one module whose parameter and state names are the
    whole model's (layers by global index), for the optimizer, checkpoints and metrics.

    With pp > 1 and tied embeddings, checks at once that the first and last stage's copies
    of the embedding agree (collective over the embedding group: build it on every rank), and
    marks the last stage's copy as `shared_embedding_copy` (the gradient norm counts the
    first stage's only). `own_buckets` lists what needs a gradient bucket of its own."""

    def __init__(self, chunks: Sequence[nn.Module], groups=None):
        super().__init__()
        names = [name for chunk in chunks for name in chunk.layers]
        if len(set(names)) < len(names):  # a layer is cut only between consecutive stages
            raise ValueError(
                f"two model chunks of one pipeline rank hold parts of the same layer ({names}): "
                "a layer may be cut only between stages on different ranks"
            )
        self.layers = nn.ModuleDict(
            {name: layer for chunk in chunks for name, layer in chunk.layers.items()}
        )
        for part in ("embedding", "position_embedding", "final_norm", "output_layer"):
            owners = [chunk for chunk in chunks if getattr(chunk, part, None) is not None]
            if owners:
                setattr(self, part, getattr(owners[0], part))
        check_embeddings_in_sync(chunks, groups)
        tied = tied_embedding(chunks, groups)
        if tied is not None and not groups.is_first_stage:
            tied.shared_embedding_copy = True
        self.own_buckets = [tied] if tied is not None else []


def finalize_grads(model_chunks: nn.Module | Sequence[nn.Module], groups, grad_buffers=()) -> None:
    """Finish a step's gradients after its last backward: wait for the data-parallel reductions
    (`grad_buffers`, a GradientBuffer or a list of them), sum the gradients of parameters used
    on a sequence shard (`param.sequence_parallel`: norms, row-parallel biases, positions) over
    the tensor-parallel ranks, and the tied embedding's over the first and last stage. Uses
    `main_grad` where a GradientBuffer gave one, else `.grad`."""
    model_chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    for buffer in [grad_buffers] if not isinstance(grad_buffers, (list, tuple)) else grad_buffers:
        buffer.finish()
    if groups is not None and group_size(groups.tp_group) > 1:
        for chunk in model_chunks:
            for param in chunk.parameters():
                if getattr(param, "sequence_parallel", False) and param.requires_grad:
                    # each rank saw one shard
                    dist.all_reduce(_gradient(param), group=groups.tp_group)
    _sum_tied_embedding_grads(model_chunks, groups)


def _gradient(param: nn.Parameter) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    if grad is None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
    return grad


def tied_embedding(model_chunks: nn.Module | Sequence[nn.Module], groups) -> nn.Parameter | None:
    """This rank's copy of the tied embedding weight, if it holds one and pp > 1: the first
    stage's input embedding (chunk 0) or the last stage's output-layer copy (last chunk).
    Give it its own gradient bucket (`GradientBuffer(own_bucket=...)`)."""
    model_chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    if groups is None or groups.pp_size == 1 or groups.embedding_group is None:
        return None
    chunk = model_chunks[0] if groups.is_first_stage else model_chunks[-1]
    config = getattr(chunk, "config", None)
    if config is None or not config.tie_embeddings or not hasattr(chunk, "embedding"):
        return None
    return chunk.embedding.weight


def _sum_tied_embedding_grads(model_chunks, groups) -> None:
    """Sum the tied embedding's gradient over the first and last stage (embedding group).

    With pp > 1 and tied embeddings the first stage's embedding and the last stage's output
    layer are two copies of one weight; each gets its part of the gradient. Run after every
    GradientBuffer.finish() (so each copy holds its dp-averaged gradient): both copies then
    take the same update and stay equal. A no-op with pp = 1, untied embeddings, or on the
    stages in between.

    With a sharded buffer (the distributed optimizer) each dp rank holds the reduced gradient
    only in the slice it owns, so both stages must slice the embedding alike: build each
    stage's buffer with `own_bucket=[tied_embedding(chunks, groups)]`.
    """
    weight = tied_embedding(model_chunks, groups)
    if weight is None:
        return
    dist.all_reduce(_gradient(weight), group=groups.embedding_group)


def check_embeddings_in_sync(
    model_chunks: nn.Module | Sequence[nn.Module], groups, atol: float = 0.0
) -> float:
    """Check that the first and last stage's copies of the tied embedding are equal; return
    the largest absolute difference (0.0 where there is nothing to compare).

    TransformerLM initialises both copies from the same seed, so they start equal; this
    catches a mismatch (another seed, a checkpoint loaded into one stage only) before it
    trains two different embeddings. Collective over the embedding group: call it on every
    rank. Raises RuntimeError on both stages when the difference exceeds `atol`.
    """
    weight = tied_embedding(model_chunks, groups)
    if weight is None:
        return 0.0
    first = weight.detach().clone()
    dist.broadcast(first, src=groups.embedding_ranks[0], group=groups.embedding_group)
    difference = (first.float() - weight.detach().float()).abs().max().reshape(1)
    dist.all_reduce(difference, op=dist.ReduceOp.MAX, group=groups.embedding_group)
    difference = difference.item()
    if not difference <= atol:
        raise RuntimeError(
            f"the tied embedding differs between the first and last pipeline stage (global ranks "
            f"{groups.embedding_ranks}): largest difference {difference:g} > {atol:g}. Build every stage "
            f"from the same config and seed, and load checkpoints into both copies"
        )
    return difference
