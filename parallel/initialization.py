"""Weights that are the same whatever the tensor-parallel size: initialise the full (master)
weight from the global seed on the device the weight will live on, then keep this rank's slice.

Every rank draws the same full tensor (same seed, same layer order), so a tp = 4 run starts
from exactly the weights of a tp = 1 run on the same kind of device, and the two can be
compared step by step. (CPU and CUDA generators draw different numbers from one seed.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

InitMethod = Callable[[torch.Tensor], None]


def normal_init(std: float = 0.02) -> InitMethod:
    """Megatron's default: N(0, std²)."""
    return lambda tensor: torch.nn.init.normal_(tensor, mean=0.0, std=std)


def master_slice(
    full_shape,
    partition_dim: int,
    rank: int,
    world_size: int,
    init_method: InitMethod,
    dtype: torch.dtype,
    device,
) -> torch.Tensor:
    """Initialise a `full_shape` fp32 master on `device` and return slice `rank` of `world_size`
    along `partition_dim`, in `dtype`. The layers have checked that the dimension splits evenly."""
    master = torch.empty(full_shape, dtype=torch.float32, device=device)
    init_method(master)
    return (
        master.chunk(world_size, dim=partition_dim)[rank]
        .to(device=device, dtype=dtype)
        .contiguous()
    )
