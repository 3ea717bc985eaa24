"""The tp x dp x pp rank grid and its process groups (gloo), against lists computed here from
Megatron's formula: global_rank = tp_rank + dp_rank*tp + pp_rank*tp*dp."""

import os

import pytest
import torch
import torch.distributed as dist
from megafp8.parallel.process_groups import ParallelGroups, ParallelSizes

from ..multiprocess import run_on_ranks

WORLD = 8
LAYOUTS = [(2, 2), (2, 1), (1, 4), (4, 2), (8, 1), (1, 1)]  # (tp, pp); dp = 8 // (tp * pp)
GROUPS = ("tp", "dp", "pp", "model_parallel", "embedding", "amax_reduction")


def expected(rank, world, tp, pp):
    """What rank `rank` should see, written out from the formula."""
    dp = world // (tp * pp)
    tp_rank, dp_rank, pp_rank = rank % tp, rank // tp % dp, rank // (tp * dp)

    def at(t, d, p):
        return t + d * tp + p * tp * dp

    pipeline = tuple(at(tp_rank, dp_rank, p) for p in range(pp))
    return {
        "sizes": (tp, pp, dp),
        "coords": (tp_rank, dp_rank, pp_rank),
        "tp": tuple(at(t, dp_rank, pp_rank) for t in range(tp)),
        "dp": tuple(at(tp_rank, d, pp_rank) for d in range(dp)),
        "pp": pipeline,
        "model_parallel": tuple(sorted(at(t, dp_rank, p) for t in range(tp) for p in range(pp))),
        "embedding": (pipeline[0],) if pp == 1 else (pipeline[0], pipeline[-1]),
        "amax_reduction": tuple(sorted(at(t, d, pp_rank) for t in range(tp) for d in range(dp))),
        "first": pp_rank == 0,
        "last": pp_rank == pp - 1,
        "next": at(tp_rank, dp_rank, (pp_rank + 1) % pp),
        "prev": at(tp_rank, dp_rank, (pp_rank - 1) % pp),
    }


def describe(groups, rank):
    """Everything a ParallelGroups says about this rank, and the sum of the global ranks over each
    of its groups (None for a group this rank is not in)."""
    sums = {}
    for name in GROUPS:
        group = getattr(groups, f"{name}_group")
        if group is not None:
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)
            sums[name] = t.item()
        else:
            sums[name] = None
    return {
        "rank": groups.rank,
        "sizes": (groups.tp_size, groups.pp_size, groups.dp_size),
        "coords": (groups.tp_rank, groups.dp_rank, groups.pp_rank),
        "ranks": {name: getattr(groups, f"{name}_ranks") for name in GROUPS},
        "sums": sums,
        "first": groups.is_first_stage,
        "last": groups.is_last_stage,
        "next": groups.next_stage_rank,
        "prev": groups.prev_stage_rank,
    }


def all_layouts(rank, world_size, layouts):
    return {layout: describe(ParallelGroups(*layout), rank) for layout in layouts}


@pytest.fixture(scope="module")
def world_8():
    """One 8-rank run that builds every layout in turn: [rank] -> {(tp, pp): describe(...)}."""
    return run_on_ranks(all_layouts, WORLD, LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_coordinates_and_group_ranks(world_8, layout):
    for rank, seen in enumerate(world_8):
        want = expected(rank, WORLD, *layout)
        assert seen[layout]["rank"] == rank
        assert seen[layout]["sizes"] == want["sizes"]
        assert seen[layout]["coords"] == want["coords"]
        assert seen[layout]["ranks"] == {name: want[name] for name in GROUPS}, f"rank {rank}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_group_all_reduces_over_exactly_its_ranks(world_8, layout):
    for rank, seen in enumerate(world_8):
        want = expected(rank, WORLD, *layout)
        for name in GROUPS:
            # Middle pipeline stages belong to no embedding group.
            member = name != "embedding" or rank in want["embedding"]
            assert seen[layout]["sums"][name] == (sum(want[name]) if member else None), (
                f"rank {rank} {name}"
            )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_stages_and_neighbours(world_8, layout):
    for rank, seen in enumerate(world_8):
        want = expected(rank, WORLD, *layout)
        assert {k: seen[layout][k] for k in ("first", "last", "next", "prev")} == {
            k: want[k] for k in ("first", "last", "next", "prev")
        }, f"rank {rank}"


def test_pipeline_neighbours_wrap_around_at_tp_2_pp_4(world_8):
    """Spelled out once: rank 1 (tp 1, dp 0) is stage 0 of the pipeline 1 -> 3 -> 5 -> 7."""
    seen = world_8[1][(1, 4)]
    assert seen["ranks"]["pp"] == (1, 3, 5, 7) and seen["ranks"]["embedding"] == (1, 7)
    assert (seen["first"], seen["last"], seen["next"], seen["prev"]) == (True, False, 3, 7)
    middle = world_8[3][(1, 4)]
    assert (middle["first"], middle["last"], middle["sums"]["embedding"]) == (False, False, None)


@pytest.mark.parametrize("world, tp, pp", [(16, 2, 2), (64, 4, 4), (64, 8, 2), (24, 2, 3)])
def test_grid_of_larger_worlds_without_processes(world, tp, pp):
    sizes = ParallelSizes.resolve(world, tp, pp)
    dims = {
        "tp": ("tp",),
        "dp": ("dp",),
        "pp": ("pp",),
        "model_parallel": ("tp", "pp"),
        "amax_reduction": ("tp", "dp"),
    }
    for rank in range(world):
        want = expected(rank, world, tp, pp)
        coords = sizes.coordinates(rank)
        assert (coords["tp"], coords["dp"], coords["pp"]) == want["coords"]
        for name, along in dims.items():
            assert want[name] in sizes.groups_along(*along)
    for along in dims.values():  # each layout's groups partition the world
        assert sorted(r for ranks in sizes.groups_along(*along) for r in ranks) == list(
            range(world)
        )


@pytest.mark.parametrize(
    "world, tp, pp, dp, message",
    [
        (
            8,
            3,
            1,
            None,
            "tensor-model-parallel size 3 x pipeline-model-parallel size 1 = 3 "
            "does not divide the world size 8",
        ),
        (
            8,
            2,
            3,
            None,
            "tensor-model-parallel size 2 x pipeline-model-parallel size 3 = 6 "
            "does not divide the world size 8",
        ),
        (
            8,
            2,
            2,
            4,
            "tensor-model-parallel size 2 x pipeline-model-parallel size 2 x data-parallel size 4 = 16 "
            "is not the world size 8",
        ),
        (
            8,
            0,
            1,
            None,
            "tensor-model-parallel size must be a positive integer, got 0 (world size 8)",
        ),
        (
            8,
            1,
            -2,
            None,
            "pipeline-model-parallel size must be a positive integer, got -2 (world size 8)",
        ),
        (
            8,
            2,
            2.0,
            None,
            "pipeline-model-parallel size must be a positive integer, got 2.0 (world size 8)",
        ),
        (8, 2, 2, 0, "data-parallel size must be a positive integer, got 0 (world size 8)"),
        (0, 1, 1, None, "world size must be a positive integer, got 0"),
    ],
)
def test_bad_sizes_say_which(world, tp, pp, dp, message):
    with pytest.raises(ValueError) as error:
        ParallelSizes.resolve(world, tp, pp, dp)
    assert str(error.value) == message


def test_sizes_derive_or_check_data_parallel():
    assert ParallelSizes.resolve(8, 2, 2) == ParallelSizes(world_size=8, tp=2, pp=2, dp=2)
    assert ParallelSizes.resolve(8, 2, 1, 4) == ParallelSizes(world_size=8, tp=2, pp=1, dp=4)


def refuse(*args, **kwargs):
    raise AssertionError("no process group may be created or joined before the sizes are checked")


def test_bad_sizes_fail_before_any_group_is_created(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "new_group", refuse)
    with pytest.raises(ValueError, match="= 3 does not divide the world size 8"):
        ParallelGroups(3, 1)


def test_from_torchrun_checks_sizes_before_the_rendezvous(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", refuse)
    for name, value in dict(
        RANK="0", WORLD_SIZE="8", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"
    ).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        ValueError,
        match="tensor-model-parallel size 2 x pipeline-model-parallel size 3 = 6 "
        "does not divide the world size 8",
    ):
        ParallelGroups.from_torchrun(2, 3)


def test_no_process_group_and_no_torchrun_environment(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(
        RuntimeError,
        match="not initialised and the torchrun environment lacks RANK, WORLD_SIZE, "
        "LOCAL_RANK, MASTER_ADDR, MASTER_PORT",
    ):
        ParallelGroups.from_torchrun(2, 2)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        ParallelGroups(2, 2)


def from_torchrun_environment(rank, world_size, port):
    """Drop the helper's process group and start again the way torchrun would on a CPU machine
    (GPUs hidden, before CUDA is first touched in this process: on a GPU machine from_torchrun
    would rightly take NCCL and GPU LOCAL_RANK)."""
    dist.destroy_process_group()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    groups = ParallelGroups.from_torchrun(tensor_parallel_size=2, pipeline_parallel_size=2)
    return dist.get_backend(), describe(groups, rank)


def test_from_torchrun_environment_initialises_gloo_on_cpu():
    # As under torchrun, the launcher hosts the rendezvous store (TORCHELASTIC_USE_AGENT_STORE):
    # holding the port from the start, so no other process can take it before rank 0 binds it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = run_on_ranks(from_torchrun_environment, 4, store.port)
    for rank, (backend, seen) in enumerate(results):
        want = expected(rank, 4, 2, 2)
        assert backend == "gloo"
        assert seen["coords"] == want["coords"]
        assert seen["ranks"] == {name: want[name] for name in GROUPS}
        assert seen["sums"] == {name: sum(want[name]) for name in GROUPS}
