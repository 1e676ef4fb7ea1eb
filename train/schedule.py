"""Linear warmup then cosine decay to lr * min_lr_ratio, as a multiplier for LambdaLR."""

from __future__ import annotations

import math


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """LR multiplier at optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class TimeBudgetedSchedule:
    """warmup_cosine whose progress is the further of steps done and wall time used, for runs with a
    time budget (train.max_minutes): the LR anneals fully by the deadline however fast the machine is,
    instead of being cut off at a high LR. Without a budget it is exactly warmup_cosine.

    Wall time makes a budgeted run's LR curve (and so its weights) depend on the machine's speed; a run
    without a budget stays bit-reproducible, resume included.
    """

    def __init__(self, total_steps: int, warmup_steps: int, min_ratio: float, budget_s: float = 0.0):
        self.configure(total_steps, warmup_steps, min_ratio, budget_s)
        self._t0: float | None = None

    def configure(self, total_steps: int, warmup_steps: int, min_ratio: float, budget_s: float = 0.0) -> None:
        self.total, self.warmup, self.min_ratio, self.budget_s = total_steps, warmup_steps, min_ratio, budget_s

    def start(self, now: float) -> None:
        self._t0 = now

    def __call__(self, step: int, now: float | None = None) -> float:
        effective = float(step)
        if self.budget_s > 0 and self._t0 is not None:
            import time

            elapsed = (time.perf_counter() if now is None else now) - self._t0
            effective = max(effective, elapsed / self.budget_s * self.total)
        return warmup_cosine(min(int(effective), self.total), self.total, self.warmup, self.min_ratio)
