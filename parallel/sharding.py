"""How a tensor-parallel parameter's local tensor sits in the full one, for checkpoints that
load under any tensor-parallel size.

`param.partition = Partition(dim, stack)`: the full tensor, viewed as `stack` equal matrices
side by side along `dim` (SwiGLU's gate and up), has each matrix split into tp equal slices
along `dim`, and this rank holds its slice of each. Parameters without `partition` are
replicated over the tensor-parallel group. `unpadded_rows` on a vocabulary-parallel weight is
the real vocabulary size: the rows past it are padding, dropped from checkpoints.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Partition:
    dim: int
    stack: int = 1

    def stacked_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` with the stacked matrices as a new leading dim; the split dim moves to dim + 1."""
        if self.stack == 1:
            return tensor
        shape = list(tensor.shape)
        shape[self.dim] //= self.stack
        return (
            tensor.reshape(shape[: self.dim] + [self.stack] + shape[self.dim :])
            if self.dim == 0
            else tensor.unflatten(self.dim, (self.stack, shape[self.dim]))
        )


def mark_partitioned(param, dim: int, stack: int = 1):
    param.partition = Partition(dim, stack)
    return param
