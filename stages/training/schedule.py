"""The learning-rate schedule every model trains with: a linear warm-up, then a cosine to zero,
which train's --time and --patience and qat's --tuning-time plan again (stages/training/plans.py).
"""
from __future__ import annotations

import math

# The warm-up: a tenth of the planned steps, at most two epochs (it had been one). Depthwise
# stacks, a BatchNorm after every convolution, are the ones that come apart early at a high
# peak: efficientnet_b0 at 0.05 sat at 12% after two epochs of a 20-epoch plan (2026-12-02).
WARMUP_EPOCHS = 2


class CosineSchedule:
    """Linear warm-up, then cosine decay to zero at ``total_steps``: LambdaLR's factor. An
    object rather than a closure, so that a time budget can re-plan it after an epoch (train
    --time, a plateau) and LambdaLR's state_dict saves it for a resume."""

    def __init__(self, total_steps: int, warmup_steps: int) -> None:
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        self.from_step, self.from_factor = warmup_steps, 1.0  # where the cosine starts

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        done = (step - self.from_step) / max(1, self.total_steps - self.from_step)
        return self.from_factor * 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))

    def replan(self, step: int, total_steps: int) -> None:
        """End at ``total_steps``; past the warm-up, a cosine from the factor ``step`` has
        reached, so that a longer plan never raises the rate and a shorter one never drops it
        at a step. A warm-up still under way shrinks to a tenth of the new plan: --time first
        plans 200 epochs, whose two epochs of warm-up had filled a plan cut to two (ending at
        the peak rate) and half of a plan cut to one; where the shorter warm-up has passed
        already, the cosine goes on from the rate reached."""
        if step <= self.warmup_steps:
            warmup = min(self.warmup_steps, max(total_steps // 10, 1))
            if step >= warmup:
                self.from_factor, self.from_step = self(step), step
            else:
                self.from_factor, self.from_step = 1.0, warmup
            self.warmup_steps = warmup
        else:
            self.from_factor, self.from_step = self(step), step
        self.total_steps = total_steps
