"""The learning rate as a pure function of the step: nothing to checkpoint, the same on every rank.

Two schedules after a linear warmup, both ending at lr * min_lr_ratio:
- cosine: one cosine from the end of warmup to max_steps;
- wsd (warmup-stable-decay): lr held constant, then the last `decay_fraction` of max_steps decays with
  `decay_shape` (linear, cosine, or sqrt: 1 - sqrt(progress)). Up to the decay the lr does not depend on
  max_steps, so a checkpoint of the stable phase can be resumed with a larger train.max_steps: one run
  yields models at several token budgets.
"""

from __future__ import annotations

import math

from pipeline.config import TrainConfig


def warmup_cosine(step: int, *, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from lr to lr * min_ratio at step `total`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    min_lr = lr * min_ratio
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


DECAY_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1.0 - math.sqrt(p),
}


def decay_start(total: int, warmup: int, decay_fraction: float) -> int:
    """First step of the wsd decay: the last round(decay_fraction * total) steps (never inside warmup)."""
    return max(warmup, total - max(1, round(decay_fraction * total)))


def warmup_stable_decay(
    step: int, *, lr: float, warmup: int, total: int, min_ratio: float, decay_fraction: float, shape: str
) -> float:
    """Linear warmup, lr until decay_start, then `shape` from lr down to lr * min_ratio at step `total`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    start = decay_start(total, warmup, decay_fraction)
    if step < start:
        return lr
    progress = min(1.0, (step - start) / max(1, total - start))
    min_lr = lr * min_ratio
    return min_lr + (lr - min_lr) * DECAY_SHAPES[shape](progress)


def lr_at(step: int, tc: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based) under train.schedule."""
    common = {"lr": tc.lr, "warmup": tc.warmup_steps, "total": tc.max_steps, "min_ratio": tc.min_lr_ratio}
    if tc.schedule == "wsd":
        return warmup_stable_decay(step, **common, decay_fraction=tc.decay_fraction, shape=tc.decay_shape)
    return warmup_cosine(step, **common)
