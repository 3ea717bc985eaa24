"""The 3D-parallel rank grid and its process groups, in Megatron's rank order.

Tensor parallel varies fastest, then data, then pipeline:

    global_rank = tp_rank + dp_rank * tp + pp_rank * tp * dp

so a tensor-parallel group is `tp` consecutive ranks (inside one node, on its fast links, when
tp is at most the GPUs per node), and pipeline stages, whose traffic is the lightest, span nodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megafp8.messages import check_integer

# Grid dimensions, fastest-varying first. This is the only place the order is written down:
# a context-parallel dimension would slot in between "tp" and "dp" here.
GRID_ORDER = ("tp", "dp", "pp")

# What `init_process_group`'s env:// rendezvous reads, plus the GPU index torchrun gives each process.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

_NAMES = {"tp": "tensor-model-parallel", "pp": "pipeline-model-parallel", "dp": "data-parallel"}


@dataclass(frozen=True)
class ParallelSizes:
    """The grid's sizes, checked against the world size; pure, no process group needed.

    ParallelSizes.resolve(8, tp=2, pp=2)   # ParallelSizes(world_size=8, tp=2, pp=2, dp=2)
    ParallelSizes.resolve(8, tp=3)         # ValueError: ... = 3 does not divide the world size 8
    """

    world_size: int
    tp: int
    pp: int
    dp: int

    @classmethod
    def resolve(
        cls, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None
    ) -> ParallelSizes:
        """Derive dp as world_size // (tp * pp), or check the given one; ValueError saying which size is wrong."""
        check_integer("world size", world_size)
        given = {"tp": tp, "pp": pp} if dp is None else {"tp": tp, "pp": pp, "dp": dp}
        for dim, size in given.items():
            check_integer(f"{_NAMES[dim]} size", size, note=f" (world size {world_size})")
        model = f"{_NAMES['tp']} size {tp} x {_NAMES['pp']} size {pp}"
        if world_size % (tp * pp):
            raise ValueError(f"{model} = {tp * pp} does not divide the world size {world_size}")
        if dp is not None and dp * tp * pp != world_size:
            raise ValueError(
                f"{model} x {_NAMES['dp']} size {dp} = {tp * pp * dp} is not the world size {world_size}"
            )
        return cls(world_size, tp, pp, world_size // (tp * pp))

    def coordinates(self, rank: int) -> dict:
        """{"tp": tp_rank, "dp": dp_rank, "pp": pp_rank} of a global rank."""
        coords = {}
        for dim in GRID_ORDER:
            rank, coords[dim] = divmod(rank, getattr(self, dim))
        return coords

    def groups_along(self, *dims: str) -> list:
        """Every group of global ranks that differ only along `dims`, each sorted, in order of their first rank."""
        groups = {}
        for rank in range(self.world_size):
            coords = self.coordinates(rank)
            groups.setdefault(tuple(coords[d] for d in GRID_ORDER if d not in dims), []).append(
                rank
            )
        return [tuple(ranks) for ranks in groups.values()]


class ParallelGroups:
    """This rank's place in the tp x dp x pp grid and its process groups.

    Built from an initialised default process group (`ParallelGroups(...)`), or from torchrun's
    environment (`ParallelGroups.from_torchrun(...)`, which initialises torch.distributed first
    if needed: NCCL when CUDA is available, else gloo). Every rank must build it, with the same
    sizes, at the same point; several objects may coexist.

        groups = ParallelGroups.from_torchrun(tensor_parallel_size=2, pipeline_parallel_size=4)
        fc1 = ColumnParallelLinear(1024, 4096, tp_group=groups.tp_group)
        with fp8_autocast(recipe=recipe, amax_reduction_group=groups.amax_reduction_group):
            ...
        if not groups.is_last_stage:
            dist.send(activations, groups.next_stage_rank)

    Attributes:
        sizes: the `ParallelSizes`; also as world_size, tp_size, pp_size, dp_size.
        rank, tp_rank, dp_rank, pp_rank: global rank and coordinates.
        tp_group, pp_group, dp_group: this rank's group along one dimension.
        model_parallel_group: tp x pp, every rank with this dp_rank (one full model replica).
        embedding_group: the first and last stage of this rank's pipeline (just the one stage
            when pp == 1), for tied input/output embeddings; None on the stages in between.
        amax_reduction_group: tp x dp, every rank of this pipeline stage (shards and replicas of
            the same layers), for FP8 amax reductions.
        tp_ranks, pp_ranks, dp_ranks, model_parallel_ranks, embedding_ranks,
        amax_reduction_ranks: the global ranks (sorted tuples) of each group above; on the
            middle stages embedding_ranks still names their pipeline's first and last stage.
        is_first_stage, is_last_stage: pipeline-stage position.
        next_stage_rank, prev_stage_rank: global ranks of the neighbouring stages; they wrap
            around (the last stage's next is the first) as the interleaved schedule needs.
    """

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int | None = None,
        *,
        backend: str | None = None,
    ):
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call dist.init_process_group first, "
                "or use ParallelGroups.from_torchrun under torchrun"
            )
        # Checked before any group is created, so bad sizes fail here with a message that says
        # which, not as a hang or an obscure error inside new_group.
        self.sizes = sizes = ParallelSizes.resolve(
            dist.get_world_size(), tensor_parallel_size, pipeline_parallel_size, data_parallel_size
        )
        self.world_size, self.tp_size, self.pp_size, self.dp_size = (
            sizes.world_size,
            sizes.tp,
            sizes.pp,
            sizes.dp,
        )
        self.rank = dist.get_rank()
        coords = sizes.coordinates(self.rank)
        self.tp_rank, self.dp_rank, self.pp_rank = coords["tp"], coords["dp"], coords["pp"]

        pipelines = sizes.groups_along("pp")
        self.tp_ranks, self.tp_group = self._new_groups(sizes.groups_along("tp"), backend)
        self.dp_ranks, self.dp_group = self._new_groups(sizes.groups_along("dp"), backend)
        self.pp_ranks, self.pp_group = self._new_groups(pipelines, backend)
        self.model_parallel_ranks, self.model_parallel_group = self._new_groups(
            sizes.groups_along("tp", "pp"), backend
        )
        ends = [(ranks[0], ranks[-1]) if sizes.pp > 1 else ranks for ranks in pipelines]
        self.embedding_ranks = ends[pipelines.index(self.pp_ranks)]
        _, self.embedding_group = self._new_groups(ends, backend)
        self.amax_reduction_ranks, self.amax_reduction_group = self._new_groups(
            sizes.groups_along("tp", "dp"), backend
        )

        self.is_first_stage = self.pp_rank == 0
        self.is_last_stage = self.pp_rank == sizes.pp - 1
        self.next_stage_rank = self.pp_ranks[(self.pp_rank + 1) % sizes.pp]
        self.prev_stage_rank = self.pp_ranks[(self.pp_rank - 1) % sizes.pp]

    @classmethod
    def from_torchrun(
        cls,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int | None = None,
        *,
        backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> ParallelGroups:
        """Initialise torch.distributed from torchrun's environment unless it already is, then build the
        groups. `timeout`: how long a collective waits for the other ranks before the run fails
        (torch's default when None)."""
        if not dist.is_initialized():
            missing = [name for name in TORCHRUN_ENV if name not in os.environ]
            if missing:
                raise RuntimeError(
                    f"torch.distributed is not initialised and the torchrun environment lacks "
                    f"{', '.join(missing)}: launch with torchrun, or call dist.init_process_group first"
                )
            # Fail on bad sizes now, not after the rendezvous has waited for every rank.
            ParallelSizes.resolve(
                int(os.environ["WORLD_SIZE"]),
                tensor_parallel_size,
                pipeline_parallel_size,
                data_parallel_size,
            )
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before NCCL binds to a GPU
            dist.init_process_group(
                backend or ("nccl" if torch.cuda.is_available() else "gloo"),
                **({"timeout": timeout} if timeout is not None else {}),
            )
        return cls(
            tensor_parallel_size, pipeline_parallel_size, data_parallel_size, backend=backend
        )

    def _new_groups(self, rank_lists: list, backend: str | None) -> tuple:
        """Create every group of `rank_lists`; return (ranks, group) of the one holding this rank, or (None, None)."""
        own = None, None
        for ranks in rank_lists:
            # new_group is collective over the whole world: every rank creates every group, in order.
            group = dist.new_group(list(ranks), backend=backend)
            if self.rank in ranks:
                own = ranks, group
        return own

    def __repr__(self) -> str:
        return (
            f"ParallelGroups(rank={self.rank}, tp={self.tp_rank}/{self.tp_size}, "
            f"dp={self.dp_rank}/{self.dp_size}, pp={self.pp_rank}/{self.pp_size})"
        )
