"""The one place that relies on DeepSpeed beyond its public API (pyproject pins deepspeed==0.19.8).

A training step that must not update the model (a non-finite loss, a loss spike: pipeline.trainer.guards) is
dropped at the accumulation boundary, and DeepSpeed has no public call for that:

- ZeRO-0: `engine.step()` at the boundary would apply the gradients. `discard_step` shadows the engine's
  private `_take_model_step` for that one call with a step that zeroes the gradients and advances the
  counters `_take_model_step` advances (skipped_steps, global_steps, global_samples, _step_applied), so
  accumulation and the lr schedule stay aligned.
- ZeRO 1-3: DeepSpeed's optimizer wrappers skip a step whose gradient norm is not finite, clean their
  partitioned / accumulated buffers and count it in `engine.skipped_steps`. `poisoned` turns a loss
  into one whose backward makes every gradient NaN, so that check drops the step.

`check_deepspeed()` lists what of this the installed DeepSpeed no longer provides;
tests/test_deepspeed_internals.py runs it and drives both paths on a tiny engine, so an upgrade that
moves any of it fails there by name instead of silently training on a dropped step.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

# What DeepSpeedEngine._take_model_step updates, which discard_step must update the same way.
TAKE_MODEL_STEP_UPDATES = (
    "self.skipped_steps",
    "self.global_steps",
    "self.global_samples",
    "self._step_applied",
)


def check_deepspeed() -> list[str]:
    """What this module relies on that the installed DeepSpeed lacks (empty: all present)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    problems = []
    for name in ("step", "_take_model_step", "train_batch_size", "get_global_grad_norm"):
        if not callable(getattr(DeepSpeedEngine, name, None)):
            problems.append(f"DeepSpeedEngine.{name} is gone")
    if problems:
        return problems
    if "self._take_model_step(" not in inspect.getsource(DeepSpeedEngine.step):
        problems.append(
            "DeepSpeedEngine.step no longer calls self._take_model_step (discard_step shadows it)"
        )
    take = inspect.getsource(DeepSpeedEngine._take_model_step)
    problems += [
        f"DeepSpeedEngine._take_model_step no longer updates {attr} (discard_step mirrors it)"
        for attr in TAKE_MODEL_STEP_UPDATES
        if attr not in take
    ]
    return problems


def discard_step(engine: Any) -> None:
    """ZeRO-0: run engine.step() at the accumulation boundary but drop the gradients instead of updating.

    Step counters advance, so accumulation stays aligned; weights and optimizer state do not change.
    """

    def discard(lr_kwargs: Any = None) -> None:
        engine.optimizer.zero_grad(set_to_none=True)  # the plain torch optimizer: p.grad is all there is
        engine.skipped_steps += 1
        engine.global_steps += 1
        engine.global_samples += engine.train_batch_size()
        engine._step_applied = False

    engine._take_model_step = discard  # instance attribute shadows the method for this one call
    try:
        engine.step()
    finally:
        del engine._take_model_step


def poisoned(loss: torch.Tensor) -> torch.Tensor:
    """ZeRO 1-3: the loss times NaN, whose backward makes every gradient NaN, so DeepSpeed's own
    non-finite-norm check drops the step at the boundary and resets its gradient buffers."""
    return loss * float("nan")


def skipped_steps(engine: Any) -> int:
    """The engine's count of steps it dropped (its own overflow checks and discard_step)."""
    return int(engine.skipped_steps)
