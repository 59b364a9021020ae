"""The passkey retrieval protocol (Mohtashami & Jaggi 2023, Landmark Attention), shared by evaluation and
by the training data mix.

A prompt is the filler sentence repeated, with the needle "The pass key is K. Remember it. K is the pass
key." inserted at a chosen depth, and the question "What is the pass key? The pass key is" at the end.
The model must continue with K; scoring is exact match of the first integer it generates.

Prompts are assembled at the token level so that a prompt has exactly the requested token length and the
needle sits at an exact token offset. Every piece is encoded with a leading space: a byte-level BPE splits
words before merging, so the concatenation is the same token sequence the tokenizer gives the whole text.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"

_INT = re.compile(r"\d+")


class TokenizerLike(Protocol):
    """What the protocol needs from a tokenizer: a `tokenizers.Tokenizer` or any encode/decode pair."""

    def encode(self, text: str) -> Any: ...

    def decode(self, ids: list[int]) -> str: ...


def encode(tokenizer: TokenizerLike, text: str) -> list[int]:
    """Token ids of text without special tokens (a `tokenizers.Encoding` or a plain list both work)."""
    try:
        out = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # encoders without that keyword
        out = tokenizer.encode(text)
    ids = getattr(out, "ids", out)
    return [int(i) for i in ids]


def decode(tokenizer: TokenizerLike, ids: Sequence[int]) -> str:
    return tokenizer.decode([int(i) for i in ids])


def random_key(rng: random.Random, digits: int = 5) -> int:
    """A passkey with exactly `digits` digits (no leading zero, so the integer round-trips)."""
    if digits < 1:
        raise ValueError(f"eval.passkey.digits must be >= 1; got {digits}")
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


@dataclass(frozen=True)
class PasskeyPrompt:
    ids: list[int]  # the prompt, exactly `length` tokens
    key: int  # the answer
    depth: float  # requested needle depth in [0, 1]
    needle_start: int  # token offset of the needle's first token
    needle_end: int  # one past its last token

    @property
    def actual_depth(self) -> float:
        """Where the needle really sits: its start over the positions it could have started at."""
        span = len(self.ids) - (self.needle_end - self.needle_start)
        return self.needle_start / span if span > 0 else 0.0


def _filler_stream(tokenizer: TokenizerLike, n: int) -> list[int]:
    """The first n tokens of " FILLER FILLER ..." (repeated at the token level)."""
    unit = encode(tokenizer, " " + FILLER)
    if not unit:
        raise ValueError("the tokenizer encodes the passkey filler to no tokens")
    reps = n // len(unit) + 1
    return (unit * reps)[:n]


def build_prompt(
    tokenizer: TokenizerLike,
    length: int,
    depth: float,
    key: int,
    *,
    prefix_ids: Sequence[int] = (),
) -> PasskeyPrompt:
    """A passkey prompt of exactly `length` tokens with the needle at `depth` (0: first, 1: last before
    the question). `prefix_ids` (e.g. the end-of-document token the training data starts documents
    with) come first and count towards the length."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth must be in [0, 1]; got {depth}")
    needle = encode(tokenizer, " " + NEEDLE.format(key=key))
    question = encode(tokenizer, " " + QUESTION)
    prefix = [int(i) for i in prefix_ids]
    budget = length - len(prefix) - len(needle) - len(question)
    if budget < 0:
        raise ValueError(
            f"passkey prompt length {length} is too short: prefix, needle and question alone take "
            f"{length - budget} tokens"
        )
    n_before = round(depth * budget)
    before = _filler_stream(tokenizer, n_before)
    after = _filler_stream(tokenizer, budget - n_before)
    ids = prefix + before + needle + after + question
    start = len(prefix) + n_before
    return PasskeyPrompt(ids=ids, key=key, depth=depth, needle_start=start, needle_end=start + len(needle))


def parse_answer(text: str) -> int | None:
    """The first integer in a generated continuation, or None if there is none."""
    m = _INT.search(text)
    return int(m.group()) if m else None


def is_correct(text: str, key: int) -> bool:
    """Exact match of the first generated integer with the key."""
    return parse_answer(text) == key


def answer_text(key: int) -> str:
    """The continuation a correct model produces after the question."""
    return f" {key}."


def passkey_documents(
    n: int,
    seed: int,
    *,
    digits: int = 5,
    min_fillers: int = 1,
    max_fillers: int = 30,
) -> list[str]:
    """n whole passkey documents (prompt plus answer) for the training mix, deterministic in seed.

    Each document holds between min_fillers and max_fillers filler sentences (uniformly; a filler is
    about 25 tokens with a typical BPE) with the needle at a uniform random position among them, then
    the question and the answer. Keep max_fillers small enough that documents fit data.seq_len so the
    model sees the needle and the question in the same training sequence.
    """
    if n < 0:
        raise ValueError(f"passkey_documents needs n >= 0; got {n}")
    if not 0 <= min_fillers <= max_fillers:
        raise ValueError(
            f"passkey_documents needs 0 <= min_fillers <= max_fillers; got {min_fillers}, {max_fillers}"
        )
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        key = random_key(rng, digits)
        total = rng.randint(min_fillers, max_fillers)
        before = rng.randint(0, total)
        parts = [FILLER] * before + [NEEDLE.format(key=key)] + [FILLER] * (total - before)
        docs.append(" ".join(parts) + " " + QUESTION + answer_text(key))
    return docs


IGNORE_INDEX = -100  # targets the loss skips (torch's cross_entropy default)


def answer_rows(
    tokenizer: TokenizerLike,
    n: int,
    length: int,
    *,
    digits: int,
    rng: random.Random,
    prefix_ids: Sequence[int] = (),
) -> tuple[list[list[int]], list[list[int]]]:
    """n passkey training rows for answer-only supervision: (inputs, targets), each n rows of `length`.

    A row is a prompt (random key, needle at a uniform random depth) followed by the answer " K." and
    shifted by one token for next-token prediction. Targets are IGNORE_INDEX except at the answer tokens,
    so the loss rewards exactly the retrieval that the evaluation grid scores.
    """
    inputs: list[list[int]] = []
    targets: list[list[int]] = []
    for _ in range(n):
        key = random_key(rng, digits)
        answer = encode(tokenizer, answer_text(key))
        prompt = build_prompt(tokenizer, length + 1 - len(answer), rng.random(), key, prefix_ids=prefix_ids)
        row = prompt.ids + answer
        p = len(prompt.ids)
        inputs.append(row[:-1])
        targets.append([IGNORE_INDEX] * (p - 1) + row[p:])
    return inputs, targets
