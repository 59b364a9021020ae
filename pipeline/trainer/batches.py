"""The data a training step consumes: per micro step, a language-model batch and, in the passkey phase,
a batch of passkey rows.

    source = StepBatches(loader, passkey=PasskeyBatches(...) or None, passkey_start=max_steps - steps)
    for micro in source.step(step, grad_accum): micro.lm, micro.passkey (None outside the phase)

A loader batch is a (B, T+1) tensor of token rows (data_prep.loader.ShardLoader); a passkey batch is an
(inputs, targets) pair whose targets ignore everything but the answer.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.config import ConfigError, Derived, RunConfig
from pipeline.errors import TrainingError

LoaderFactory = Callable[[RunConfig, str, int, int], Any]


def default_loader(cfg: RunConfig, split: str, dp_rank: int, dp_world: int) -> Any:
    from data_prep.loader import ShardLoader

    return ShardLoader(
        cfg.data_dir,
        split,
        micro_batch=cfg.train.micro_batch,
        dp_rank=dp_rank,
        dp_world=dp_world,
        seed=cfg.data.seed,
        shuffle_block=cfg.data.shuffle_block,
        num_workers=1 if split == "train" else 0,  # one read-ahead thread; order does not depend on it
    )


Batch = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def batch_to_xy(batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets: from (B, T+1) token rows, or an (inputs, targets) pair as given."""
    if isinstance(batch, tuple):
        x, y = batch
    else:
        x, y = batch[:, :-1], batch[:, 1:]
    return x.to(device=device, dtype=torch.long), y.to(device=device, dtype=torch.long)


class Batches:
    """next() over a loader, starting a new pass when one ends (the loader decides the epoch order)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.it: Iterator[Any] = iter(loader)

    def next(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            try:
                return next(self.it)
            except StopIteration:
                raise TrainingError("the training loader yields no batches") from None


class PasskeyBatches:
    """The rows the train.passkey phase adds to each micro step: whole passkey prompts, loss on the answer.

    A batch is a pure function of (seed, step, data-parallel rank, micro step), so a resumed run draws the
    same ones and the ranks of a sequence-parallel group (one dp rank) hold the same sequences. The prompt
    length is drawn per step (the same on every rank, so DeepSpeed sees one shape per step), up to a bound
    that ramps from min_len to max_len over the phase's first train.passkey.ramp_steps steps.
    """

    def __init__(self, cfg: RunConfig, d: Derived, dp_rank: int, start: int = 0) -> None:
        from data_prep.index import load_index
        from data_prep.long_context import check_task_rows, parse_task
        from data_prep.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(cfg.data_dir)
        self.prefix = [load_index(cfg.data_dir).eod_id]  # as in the training stream and the eval prompts
        self.lo, self.hi, self.multiple = d.passkey_lengths
        self.n, self.digits = cfg.train.passkey.batch or d.micro_batch, cfg.train.passkey.digits
        self.seed, self.dp_rank = cfg.seed, dp_rank
        self.start, self.ramp = start, cfg.train.passkey.ramp_steps  # start: the phase's first step
        self.task = parse_task(cfg.train.passkey.task, "train.passkey.task")
        if self.task.name != "passkey":  # the passkey's rows stay data_prep.passkey.answer_rows
            check_task_rows(
                self.tokenizer,
                self.task,
                self.lo,
                self.digits,
                self.prefix,
                max_len=self.hi,
                multiple=self.multiple,
            )
        else:
            self._check_fits()

    def _check_fits(self) -> None:
        """The shortest prompt must hold the needle, question and answer in this tokenizer's tokens: a
        tokenizer trained on another language or on code takes more of them than on English text."""
        from data_prep.passkey import NEEDLE, QUESTION, answer_text, encode

        need = 0
        for key in (10 ** (self.digits - 1), 10**self.digits - 1):
            parts = (" " + NEEDLE.format(key=key), " " + QUESTION, answer_text(key))
            need = max(need, len(self.prefix) - 1 + sum(len(encode(self.tokenizer, t)) for t in parts))
        shortest = -(-self.lo // self.multiple) * self.multiple
        if shortest < need:
            fix = -(-need // self.multiple) * self.multiple
            raise ConfigError(
                f"train.passkey.min_len={self.lo} is too short for this tokenizer: a passkey prompt's "
                f"needle, question and answer take {need} of its tokens; set train.passkey.min_len={fix} "
                f"(or more), "
                f"or train.passkey.steps=0 to train without the passkey phase"
            )

    def max_length(self, step: int) -> int:
        """The longest prompt length allowed at optimizer step `step` (the ramp; then max_len)."""
        if self.ramp <= 0 or step - self.start >= self.ramp:
            return self.hi
        frac = max(0, step - self.start + 1) / self.ramp
        return max(self.lo, int(self.lo + frac * (self.hi - self.lo)))

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        from data_prep.long_context import answer_rows  # the passkey task: data_prep.passkey's rows

        m, hi = self.multiple, self.max_length(step)
        # The smallest multiple of m >= lo always fits: derive() checks one exists in [min_len, max_len].
        top = max(hi // m, -(-self.lo // m))
        length = m * random.Random(f"passkey:{self.seed}:{step}").randint(-(-self.lo // m), top)
        rng = random.Random(f"passkey:{self.seed}:{step}:{self.dp_rank}:{micro}")
        x, y = answer_rows(
            self.tokenizer, self.task, self.n, length, digits=self.digits, rng=rng, prefix_ids=self.prefix
        )
        return torch.tensor(x), torch.tensor(y)


@dataclass
class MicroBatch:
    lm: Batch  # language-model rows from the loader
    passkey: Batch | None  # passkey rows (the passkey phase), else None
    wait: float  # seconds spent waiting for the loader


class StepBatches:
    """The micro batches of each optimizer step: the loader's, plus passkey rows in steps
    [passkey_start, max_steps) when a passkey source is given."""

    def __init__(self, loader: Any, passkey: PasskeyBatches | None = None, passkey_start: int = 0) -> None:
        self.loader = loader
        self.lm = Batches(loader)
        self.passkey, self.passkey_start = passkey, passkey_start

    def in_passkey_phase(self, step: int) -> bool:
        return self.passkey is not None and step >= self.passkey_start

    def step(self, step: int, grad_accum: int) -> Iterator[MicroBatch]:
        """Lazily: a micro batch is read when the step asks for it (data wait is measured per batch)."""
        for micro in range(grad_accum):
            t = time.perf_counter()
            lm = self.lm.next()
            wait = time.perf_counter() - t
            pk = self.passkey.batch(step, micro) if self.passkey and step >= self.passkey_start else None
            yield MicroBatch(lm, pk, wait)

    def state_dict(self) -> Any:
        return self.loader.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        if hasattr(self.loader, "close"):  # read-ahead threads of ShardLoader
            self.loader.close()
