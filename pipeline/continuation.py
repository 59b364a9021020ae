"""A finished or stopped run trained again with a changed config: continue its checkpoints, or start over.

The checkpoints hold what was trained so far. A key that only shapes the steps still to come (how many,
the learning-rate schedule, clipping, validation, the step policies, the passkey phase) leaves them
valid: `resume=auto` continues from the latest one. A key that says what was trained (the model, the
data and tokenizer, the sequence length, the seeds, the global batch, the optimizer's betas, eps and
weight decay, the ZeRO stage, the precision) makes them another run's: they are archived and training
starts over, and the log says which keys changed and how to continue the old run instead.

The learning rate is a pure function of (step, config) (pipeline.trainer.schedule): a continued run
follows the new config's schedule from its checkpoint's step on, recomputed for the new total (a cosine
stretched to a larger max_steps resumes at a higher lr than it ended on; the log gives both). Steps
already trained are what they were. The passkey phase (the last train.passkey.steps of max_steps) is
placed the same way.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError, TrainConfig
from pipeline.trainer.schedule import lr_at

# Dotted keys of pipeline.stages.train_inputs (a trailing ".": every key below) whose change continues.
FUTURE_KEYS = (
    "train.max_steps",
    "train.lr",
    "train.min_lr_ratio",
    "train.warmup_steps",
    "train.schedule",
    "train.decay_fraction",
    "train.decay_shape",
    "train.grad_clip",
    "train.nan_policy",
    "train.max_skipped_steps",
    "train.spike_guard.",
    "train.peak_flops_per_rank",
    "train.val_every",
    "train.val_batches",
    "train.passkey.",
    "model.attention.impl",  # the same math on another path
    "model.attention.block_size",  # the chunked path's tile size
)
SCHEDULE_KEYS = (
    "max_steps",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "schedule",
    "decay_fraction",
    "decay_shape",
)
_UNSET = "(unset)"
# Inputs that are not config keys: what they stand for, for the log line.
_DESCRIBED = {
    "index": "the prepared data (data_dir/index.json: tokenizer or shards)",
    "global_batch": "the global batch (train.micro_batch x train.grad_accum x data-parallel ranks)",
}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (old, new) for every training input that differs."""
    a, b = _flatten(old), _flatten(new)
    return {
        k: (a.get(k, _UNSET), b.get(k, _UNSET)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)
    }


def is_future_key(key: str) -> bool:
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in FUTURE_KEYS)


@dataclass(frozen=True)
class Decision:
    """What a changed training config does to the run's checkpoints."""

    continues: bool  # True: resume=auto continues from the latest checkpoint; False: archive, start over
    changed: dict[str, tuple[Any, Any]]
    restart_keys: tuple[str, ...]  # the changed keys that make the checkpoints another run's


def decide(old: dict[str, Any], new: dict[str, Any]) -> Decision:
    """old, new: the train inputs (pipeline.stages.train_inputs) of the previous and this invocation."""
    changed = changed_keys(old, new) if old else {"(an older manifest without inputs)": (None, None)}
    restart = tuple(k for k in changed if not is_future_key(k))
    return Decision(not restart, changed, restart)


def _value(v: Any) -> str:
    """A value as an override writes it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list | tuple):
        return "[" + ",".join(_value(x) for x in v) + "]"
    return str(v)


def describe(changed: dict[str, tuple[Any, Any]], keys: tuple[str, ...] | None = None) -> str:
    """'model.n_layer 1 -> 2, train.lr 0.001 -> 0.002' for keys (default: all changed ones)."""
    parts = []
    for k in changed if keys is None else keys:
        old, new = changed[k]
        parts.append(f"{_DESCRIBED[k]} changed" if k in _DESCRIBED else f"{k} {_value(old)} -> {_value(new)}")
    return ", ".join(parts)


def command_with(overrides: str) -> str:
    """The command this process was started with, with these overrides in place of its own for the same
    keys, when it is the fpa CLI; else the overrides to add."""
    argv, extra = sys.argv, shlex.split(overrides)
    if argv and Path(argv[0]).name in ("fpa", "cli.py") and len(argv) > 1:
        keys = {o.split("=", 1)[0] + "=" for o in extra}
        kept = [a for a in argv[1:] if not any(a.startswith(k) for k in keys)]
        return shlex.join(["fpa", *kept, *extra])
    return f"the same command with {overrides}"


def continue_instead(decision: Decision, archived: Path) -> str:
    """How to go on training the archived run instead of starting over."""
    back = [f"{k}={_value(decision.changed[k][0])}" for k in decision.restart_keys if k not in _DESCRIBED]
    resume = f"train.checkpoint.resume={archived / 'checkpoints'}"
    extra = [_DESCRIBED[k].split(" (")[0] for k in decision.restart_keys if k in _DESCRIBED]
    tail = f" (with {' and '.join(extra)} it was trained on)" if extra else ""
    return f"to continue the previous run instead: {command_with(' '.join([*back, resume]))}{tail}"


def check_steps(step: int, tc: TrainConfig, checkpoints: list[tuple[int, Path]]) -> None:
    """A continued run whose latest checkpoint is past the new train.max_steps would stop at once with a
    longer-trained model than asked for: refuse, naming the command that trains the shorter run."""
    if step <= tc.max_steps:
        return
    earlier = [d for s, d in checkpoints if s <= tc.max_steps]
    fix = f"train.checkpoint.resume={earlier[-1]}" if earlier else "train.checkpoint.resume=none"
    what = f"continue from {earlier[-1].name}" if earlier else "start over (the checkpoints are archived)"
    raise ConfigError(
        f"train.max_steps={tc.max_steps} but the latest checkpoint is at step {step}: to {what}, run "
        f"{command_with(fix)}; or raise train.max_steps to {step} or more to keep it"
    )


def lr_note(old_train: dict[str, Any], tc: TrainConfig, step: int) -> str:
    """What the recomputed schedule changes at the resume point (empty when nothing)."""
    old = dataclasses.replace(tc, **{k: old_train[k] for k in SCHEDULE_KEYS if k in old_train})
    before, after = lr_at(step, old), lr_at(step, tc)
    if before == after:
        return ""
    return (
        f"; the lr schedule is recomputed for the new config: the next step ({step + 1}) trains at lr "
        f"{after:.6g}, where the old schedule had {before:.6g}"
    )
