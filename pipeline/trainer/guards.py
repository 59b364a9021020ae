"""Steps that must not update the model: a non-finite loss (train.nan_policy) or a loss spike
(train.spike_guard). Either is skipped (no optimizer update, counted, recorded in metrics.jsonl) or stops
training with a TrainingError.

Every rank agrees on the verdict before backward (the step's losses are all-reduced first), so all ranks
drop the same step. How a step is dropped depends on the ZeRO stage: see drop_step.
"""

from __future__ import annotations

import statistics
from typing import Any

from pipeline.config import TrainConfig
from pipeline.errors import TrainingError
from pipeline.trainer.deepspeed_internals import discard_step, skipped_steps
from pipeline.trainer.metrics import Metrics
from pipeline.trainer.train_state import TrainState


def drop_step(engine: Any, step: int, zero_stage: int, precision: str) -> None:
    """The accumulation boundary of a step whose gradients must not be applied.

    ZeRO-0 never backpropagated the bad loss and discards the gradients by hand; ZeRO 1-3 backpropagated a
    non-finite loss, so DeepSpeed's own non-finite-norm check drops the step and resets its buffers
    (pipeline.trainer.deepspeed_internals).
    """
    if zero_stage == 0:
        discard_step(engine)
        return
    before = skipped_steps(engine)
    engine.step()
    if skipped_steps(engine) == before:
        raise TrainingError(
            f"step {step}: DeepSpeed applied an update with non-finite gradients "
            f"(ZeRO {zero_stage}, {precision}); stopping rather than training on NaN"
        )


class SpikeGuard:
    """train.spike_guard: a step loss above factor x the median of the last `window` accepted step losses
    is a spike. The window lives in TrainState (checkpointed), so a resumed run judges as an uninterrupted
    one would."""

    def __init__(self, tc: TrainConfig) -> None:
        self.factor, self.window = tc.spike_guard.factor, tc.spike_guard.window

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def limit(self, state: TrainState) -> float | None:
        """The loss above which a step is a spike (None: no verdict yet, or the guard is off)."""
        if not self.enabled or len(state.spike_window) < self.window:
            return None
        return self.factor * statistics.median(state.spike_window)

    def is_spike(self, state: TrainState, loss: float) -> bool:
        limit = self.limit(state)
        return limit is not None and loss > limit

    def accept(self, state: TrainState, loss: float) -> None:
        if self.enabled:
            state.spike_window = [*state.spike_window, loss][-self.window :]


class StepPolicy:
    """What happens to a step that must not update: count it, record it, then skip it or stop."""

    def __init__(self, tc: TrainConfig, metrics: Metrics) -> None:
        self.tc, self.metrics = tc, metrics
        self.spikes = SpikeGuard(tc)

    def counters(self, state: TrainState) -> dict[str, int]:
        """The counts logged every log_every steps."""
        out = {"skipped_steps": state.skipped}
        if self.spikes.enabled:
            out["spike_skipped_steps"] = state.spikes
        return out

    def bad_step(self, state: TrainState, lr: float, spike_loss: float | None) -> None:
        """Before the step is dropped: count and record it; raise under the stop policy.
        spike_loss: the step loss when it is a spike (None: a non-finite loss)."""
        step = state.step
        if spike_loss is None:
            state.skipped += 1
            self.metrics.skipped(step, lr)
            if self.tc.nan_policy == "stop":
                raise TrainingError(
                    f"non-finite loss at step {step} (train.nan_policy=stop); "
                    f"last finite loss was {state.last_loss}"
                )
            print(f"[train] step {step}: non-finite loss, step skipped ({state.skipped} so far)", flush=True)
            return
        g = self.tc.spike_guard
        limit = self.spikes.limit(state)
        what = f"loss {spike_loss:.4g} > {g.factor} x the median of the last {g.window} steps ({limit:.4g})"
        state.spikes += 1
        self.metrics.skipped(step, lr, spike=True)
        if g.action == "stop":
            raise TrainingError(f"loss spike at step {step}: {what} (train.spike_guard.action=stop)")
        print(f"[train] step {step}: loss spike, {what}; step skipped ({state.spikes} so far)", flush=True)

    def check_limit(self, state: TrainState) -> None:
        """After a dropped step: stop once more than train.max_skipped_steps were dropped for a reason."""
        limit = self.tc.max_skipped_steps
        if state.skipped > limit:
            raise TrainingError(
                f"{state.skipped} steps skipped for non-finite loss (train.max_skipped_steps="
                f"{limit}); stopping at step {state.step}"
            )
        if state.spikes > limit:
            raise TrainingError(
                f"{state.spikes} steps skipped as loss spikes (train.max_skipped_steps="
                f"{limit}); stopping at step {state.step}"
            )
