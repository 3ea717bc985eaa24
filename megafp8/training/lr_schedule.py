"""Learning-rate schedules by iteration, as Megatron-LM's `--lr-decay-style`.

Linear warmup from 0 to `lr` over `warmup_iters`, then towards `min_lr` by the decay style
until `decay_iters`, and `min_lr` after. `wsd` (warmup-stable-decay) holds `lr` until the last
`wsd_decay_iters` of the decay and decays only there; its `exponential` style is geometric
towards `min_lr` (towards lr / 1000 when min_lr is 0).
"""

from __future__ import annotations

import dataclasses
import math

DECAY_STYLES = ("constant", "linear", "cosine", "wsd")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int = 0
    decay_style: str = "cosine"
    wsd_decay_iters: int = 0
    wsd_decay_style: str = "linear"

    def __post_init__(self):
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style {self.decay_style!r}: one of {DECAY_STYLES}")
        if self.wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(
                f"--lr-wsd-decay-style {self.wsd_decay_style!r}: one of {WSD_DECAY_STYLES}"
            )
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr {self.min_lr} must lie in [0, --lr {self.lr}]")
        if self.decay_style != "constant" and self.decay_iters < self.warmup_iters:
            raise ValueError(
                f"--lr-decay-iters {self.decay_iters} is shorter than the warmup "
                f"({self.warmup_iters} iterations)"
            )
        if (
            self.decay_style == "wsd"
            and not 0 < self.wsd_decay_iters <= self.decay_iters - self.warmup_iters
        ):
            raise ValueError(
                f"--lr-wsd-decay-iters {self.wsd_decay_iters} must be positive and fit "
                f"after the warmup within --lr-decay-iters {self.decay_iters}"
            )

    def __call__(self, iteration: int) -> float:
        """The learning rate of step `iteration` (0-based: the first step is 0)."""
        if self.warmup_iters and iteration < self.warmup_iters:
            return self.lr * (iteration + 1) / self.warmup_iters
        if self.decay_style == "constant":
            return self.lr
        if iteration >= self.decay_iters:
            return self.min_lr
        if self.decay_style == "wsd":
            stable_end = self.decay_iters - self.wsd_decay_iters
            if iteration < stable_end:
                return self.lr
            progress, style = (iteration - stable_end) / self.wsd_decay_iters, self.wsd_decay_style
        else:
            progress = (iteration - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
            style = self.decay_style
        if style == "linear":
            factor = 1.0 - progress
        elif style == "cosine":
            factor = 0.5 * (math.cos(math.pi * progress) + 1.0)
        elif style == "exponential":  # geometric, towards min_lr (or lr / 1000 when that is 0)
            floor = max(self.min_lr, self.lr * 1e-3)
            return self.lr * (floor / self.lr) ** progress
        else:  # minus_sqrt
            factor = 1.0 - math.sqrt(progress)
        return self.min_lr + (self.lr - self.min_lr) * factor
