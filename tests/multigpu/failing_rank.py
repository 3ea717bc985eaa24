"""`python -m megafp8.train`, but the last rank raises at iteration CHECK_FAIL_AT: the multi-GPU
check's stand-in for an error on one rank (a bad batch, a CUDA error), to see every rank end."""

import os

import torch.distributed as dist

from megafp8.training import trainer

FAIL_AT = int(os.environ["CHECK_FAIL_AT"])
_train_step = trainer.Trainer.train_step


def train_step(self, *args, **kwargs):
    if self.iteration + 1 == FAIL_AT and dist.get_rank() == dist.get_world_size() - 1:
        raise RuntimeError(f"planted error on rank {dist.get_rank()} at iteration {FAIL_AT}")
    return _train_step(self, *args, **kwargs)


if __name__ == "__main__":
    trainer.Trainer.train_step = train_step
    trainer.main()
