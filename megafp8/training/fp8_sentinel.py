"""The bf16 sentinel: FP8 checked against bf16 on the same held-out micro-batches every
`--fp8-check-interval` iterations, with a fall back to bf16 when FP8 strays.

At a check the trainer evaluates the same held-out micro-batches from the current weights with
FP8 on and off. If FP8's loss exceeds bf16's by more than `--fp8-check-tolerance` (relative), or
is not finite, the run trains in bf16 for `--fp8-fallback-iters` iterations, then returns to FP8
with every scale re-seeded (histories cleared: the first casts fit their scales to the tensors).
A check that fails within one interval of such a return counts against FP8 again; after
`--fp8-max-fallbacks` fallbacks in a row the run stays in bf16 and says so. Every check and
switch is a record in metrics.jsonl; the state is in the checkpoints, so a resumed run switches
where the straight one would. This class decides; the trainer measures, agrees the numbers over
all ranks (one broadcast from the last stage, so every rank decides alike) and switches.
"""

from __future__ import annotations

import math


class Fp8Sentinel:
    def __init__(self, interval: int, tolerance: float, fallback_iters: int, max_fallbacks: int):
        self.interval, self.tolerance = interval, tolerance
        self.fallback_iters, self.max_fallbacks = fallback_iters, max_fallbacks
        self.fallback_until: int | None = None  # FP8 comes back at this iteration
        self.returned_at: int | None = None  # the last return to FP8
        self.fallbacks_in_a_row = 0
        self.disabled = False  # FP8 failed max_fallbacks times in a row: bf16 for good

    def fp8_on(self, iteration: int) -> bool:
        """Whether iteration `iteration` (0-based, the one about to run) trains in FP8."""
        return not self.disabled and (
            self.fallback_until is None or iteration >= self.fallback_until
        )

    def returns_at(self, iteration: int) -> bool:
        """Whether FP8 comes back at this iteration (the caller re-seeds the scales first)."""
        if self.disabled or self.fallback_until != iteration:
            return False
        self.fallback_until, self.returned_at = None, iteration
        return True

    def due(self, iterations_done: int) -> bool:
        """Whether to check after `iterations_done` iterations: at the interval, while in FP8 (not
        in a fallback, even one whose return is the next iteration: its scales are not re-seeded yet)."""
        return (
            bool(self.interval)
            and iterations_done % self.interval == 0
            and not self.disabled
            and self.fallback_until is None
        )

    def judge(self, iterations_done: int, fp8_loss: float, bf16_loss: float) -> dict:
        """Decide from one check's losses; the record for metrics.jsonl, its "fp8_check" says
        what happened: "ok", "fallback" (bf16 from the next iteration on) or "disabled"."""
        gap = (fp8_loss - bf16_loss) / abs(bf16_loss) if bf16_loss else math.inf
        failed = not math.isfinite(fp8_loss) or (math.isfinite(bf16_loss) and gap > self.tolerance)
        record = {"fp8_check_loss": fp8_loss, "bf16_check_loss": bf16_loss, "fp8_check_gap": gap}
        if not failed:
            if self.returned_at is None or iterations_done - self.returned_at > self.interval:
                self.fallbacks_in_a_row = 0  # FP8 held for a whole interval since it came back
            return {**record, "fp8_check": "ok"}
        self.fallbacks_in_a_row += 1
        if self.fallbacks_in_a_row >= self.max_fallbacks:
            self.disabled = True
            return {**record, "fp8_check": "disabled"}
        self.fallback_until = iterations_done + self.fallback_iters
        return {**record, "fp8_check": "fallback", "fp8_fallback_until": self.fallback_until}

    def state_dict(self) -> dict:
        return {
            "fallback_until": self.fallback_until,
            "returned_at": self.returned_at,
            "fallbacks_in_a_row": self.fallbacks_in_a_row,
            "disabled": self.disabled,
        }

    def load_state_dict(self, state: dict) -> None:
        self.fallback_until, self.returned_at = state["fallback_until"], state["returned_at"]
        self.fallbacks_in_a_row, self.disabled = state["fallbacks_in_a_row"], state["disabled"]
