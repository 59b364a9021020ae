"""Long-context tasks beyond one passkey, each a seeded generator of prompts with one exact answer, any
length and any needle depth. Built on the passkey protocol (data_prep/passkey.py): the same filler,
token-level assembly, tokenization with leading spaces and answer-only training rows.

Tasks (a spec is the name, or name-N for the size N; the id always carries the size):

    passkey         the single passkey of data_prep.passkey, unchanged (the same prompts, bit for bit)
    multikey-K      K needles with different keys ("The pass key of QWKX is 42. ..."); the question asks
                    for one of them. Default K = 4
    multivalue-N    one key with N values ("One of the pass keys is 42. ..."); all are asked for, in the
                    order they appear. Default N = 4
    overwrite-N     the key is assigned, then reassigned N-1 times ("The pass key is now 17. ..."); the
                    answer is the latest value. Default N = 3
    vartrack-N      a chain of N variables (VAR QWKX = 42. VAR ZPLM = QWKX. ...); the question asks which
                    variables hold the value, in chain order. Default N = 4

`depth` places the needle the answer hinges on (multikey: the asked key; multivalue and vartrack: the
first value / assignment; overwrite: the latest assignment): round(depth x filler budget) filler tokens
come before it. The other needles sit at seeded random filler offsets: anywhere (multikey), after it
(multivalue, vartrack: the chain reads forward) or before it (overwrite: the stale values come first).

Scoring is exact: the first n integers (the first n words for vartrack) of the greedy continuation must be
the n answer items, in order (n = 1 except multivalue and vartrack).
"""

from __future__ import annotations

import difflib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from data_prep import passkey
from data_prep.errors import DataError
from data_prep.passkey import IGNORE_INDEX, TokenizerLike, decode, encode, random_key

# name -> (default size, smallest size)
TASKS: dict[str, tuple[int, int]] = {
    "passkey": (1, 1),
    "multikey": (4, 1),
    "multivalue": (4, 1),
    "overwrite": (3, 2),  # at least one reassignment, or it is the passkey
    "vartrack": (4, 1),
}

MK_NEEDLE = "The pass key of {name} is {key}. Remember it. {key} is the pass key of {name}."
MK_QUESTION = "What is the pass key of {name}? The pass key of {name} is"
MV_NEEDLE = "One of the pass keys is {key}. Remember it."
MV_QUESTION = "What are all the pass keys? The pass keys are"
OW_UPDATE = "The pass key is now {key}. Forget the old one. {key} is the pass key now."
OW_QUESTION = "What is the pass key now? The pass key is"
VT_ASSIGN = "VAR {name} = {value}."
VT_QUESTION = "Which variables are assigned the value {key}? They are"
NAME_LETTERS = 4  # variable and key names: 4 random capitals (never "VAR", which has 3)

_WORD = re.compile(r"[A-Za-z]+")
_INT = re.compile(r"\d+")
T = TypeVar("T")


class TaskError(DataError, ValueError):
    """A task that cannot be generated as asked (too short a prompt, an unusable tokenizer), one line."""


@dataclass(frozen=True)
class TaskSpec:
    name: str  # a key of TASKS
    size: int  # keys (multikey), values (multivalue), assignments (overwrite), variables (vartrack)

    @property
    def id(self) -> str:
        """The task's name in reports, file names and columns: passkey, multikey-4, ..."""
        return self.name if self.name == "passkey" else f"{self.name}-{self.size}"


def parse_task(spec: str, key: str = "eval.long_context.tasks") -> TaskSpec:
    """A TaskSpec from "name" or "name-N"; ValueError naming `key` (with suggestions) otherwise."""
    name, sep, size_text = str(spec).strip().partition("-")
    if name not in TASKS:
        close = difflib.get_close_matches(name, list(TASKS), n=2)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        raise ValueError(f"{key} has an unknown task {spec!r}{hint}; tasks are {', '.join(TASKS)}")
    default, smallest = TASKS[name]
    if not sep:
        return TaskSpec(name, default)
    if not size_text.isdigit():
        raise ValueError(f"{key} has task {spec!r}: write {name} or {name}-N with N a whole number")
    size = int(size_text)
    if name == "passkey" and size != 1:
        raise ValueError(f"{key} has task {spec!r}, but the passkey has one needle (use multikey-{size})")
    if size < smallest:
        raise ValueError(f"{key} has task {spec!r}, which needs N >= {smallest}")
    return TaskSpec(name, size)


def check_digits(tokenizer: TokenizerLike) -> None:
    """Every digit must be one token that decodes back to itself: the answers are copied digit by digit
    and the generation budget counts at most one token per character."""
    bad = []
    for d in "0123456789":
        ids = encode(tokenizer, d)
        if len(ids) != 1 or decode(tokenizer, ids) != d:
            bad.append(d)
    if bad:
        raise TaskError(
            f"the tokenizer cannot encode the digits {', '.join(bad)} as single tokens that decode back: "
            "long-context answers cannot be generated or scored with it"
        )


@dataclass(frozen=True)
class Instance:
    """What a prompt says before it is laid out: the values, the names, the answer."""

    spec: TaskSpec
    values: tuple[int, ...]  # multikey: one per key; multivalue/overwrite: in prompt order; else (value,)
    names: tuple[str, ...] = ()  # multikey: the keys; vartrack: the variables in chain order
    target: int = 0  # multikey: the index of the asked key

    @property
    def answer(self) -> tuple[int | str, ...]:
        """The items the continuation must start with, in order."""
        name = self.spec.name
        if name == "multikey":
            return (self.values[self.target],)
        if name == "overwrite":
            return (self.values[-1],)
        if name == "vartrack":
            return self.names
        return self.values  # passkey: (key,); multivalue: every value

    @property
    def answer_text(self) -> str:
        """The continuation a correct model produces after the question."""
        if self.spec.name == "passkey":
            return passkey.answer_text(self.values[0])
        return " " + ", ".join(str(a) for a in self.answer) + "."


def answer_budget(spec: TaskSpec, digits: int) -> int:
    """Tokens to generate: the answer's characters (enough even if every character is its own token);
    for the passkey the same digits + 2 as the passkey grid."""
    item = NAME_LETTERS if spec.name == "vartrack" else digits
    n = spec.size if spec.name in ("multivalue", "vartrack") else 1
    return n * item + 2 * n  # " a, b, c.": a space or ", " before each item, the final "."


def _distinct(n: int, draw: Callable[[], T], what: str) -> list[T]:
    out: list[T] = []
    for _ in range(100 * n + 100):  # a bounded number of draws: an impossible request fails, never hangs
        v = draw()
        if v not in out:
            out.append(v)
            if len(out) == n:
                return out
    raise TaskError(f"cannot draw {n} distinct {what}")


def random_name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(NAME_LETTERS))


def draw_instance(spec: TaskSpec, rng: random.Random, digits: int) -> Instance:
    """The values (and names) of one prompt, from rng. The passkey draws its key as the passkey grid does."""
    if digits < 1:
        raise TaskError(f"long-context keys need digits >= 1; got {digits}")
    if spec.name == "passkey":
        return Instance(spec, (random_key(rng, digits),))
    n = spec.size
    if n > 9 * 10 ** (digits - 1):
        raise TaskError(f"task {spec.id} needs {n} distinct {digits}-digit values; there are fewer")
    values = tuple(_distinct(n if spec.name != "vartrack" else 1, lambda: random_key(rng, digits), "values"))
    if spec.name == "multikey":
        names = tuple(_distinct(n, lambda: random_name(rng), "key names"))
        return Instance(spec, values, names, target=rng.randrange(n))
    if spec.name == "vartrack":
        return Instance(spec, values, tuple(_distinct(n, lambda: random_name(rng), "variable names")))
    return Instance(spec, values)


@dataclass(frozen=True)
class TaskPrompt:
    ids: list[int]  # the prompt, exactly `length` tokens
    instance: Instance
    depth: float  # requested depth of the target needle in [0, 1]
    needle_start: int  # token offset of the target needle's first token
    needle_end: int  # one past its last token
    needle_starts: tuple[int, ...]  # token offsets of every needle, in prompt order

    @property
    def answer(self) -> tuple[int | str, ...]:
        return self.instance.answer


def _texts(inst: Instance) -> tuple[list[str], int, str]:
    """(needle texts in their chain order, index of the target needle, question)."""
    name, v = inst.spec.name, inst.values
    if name == "multikey":
        needles = [MK_NEEDLE.format(name=k, key=x) for k, x in zip(inst.names, v)]
        return needles, inst.target, MK_QUESTION.format(name=inst.names[inst.target])
    if name == "multivalue":
        return [MV_NEEDLE.format(key=x) for x in v], 0, MV_QUESTION
    if name == "overwrite":
        needles = [passkey.NEEDLE.format(key=v[0])] + [OW_UPDATE.format(key=x) for x in v[1:]]
        return needles, len(v) - 1, OW_QUESTION
    assert name == "vartrack"
    chain = [str(v[0]), *inst.names[:-1]]  # the first variable takes the value, each next the previous one
    return (
        [VT_ASSIGN.format(name=n, value=x) for n, x in zip(inst.names, chain)],
        0,
        VT_QUESTION.format(key=v[0]),
    )


def _offsets(name: str, n: int, target: int, at: int, budget: int, rng: random.Random) -> list[int]:
    """Filler tokens before each needle (chain order): the target at `at`, the others drawn from rng."""
    if name == "multikey":
        return [at if i == target else rng.randint(0, budget) for i in range(n)]
    if name == "overwrite":  # stale values before the latest one
        return [*sorted(rng.randint(0, at) for _ in range(n - 1)), at]
    return [at, *sorted(rng.randint(at, budget) for _ in range(n - 1))]  # the chain reads forward


def build_task_prompt(
    tokenizer: TokenizerLike,
    inst: Instance,
    length: int,
    depth: float,
    rng: random.Random,
    *,
    prefix_ids: Sequence[int] = (),
) -> TaskPrompt:
    """The prompt of `inst`, exactly `length` tokens, the target needle at `depth`; the other needles'
    offsets come from rng (the passkey draws nothing: it is data_prep.passkey.build_prompt)."""
    if not 0.0 <= depth <= 1.0:
        raise TaskError(f"long-context needle depth must be in [0, 1]; got {depth}")
    spec = inst.spec
    if spec.name == "passkey":
        p = passkey.build_prompt(tokenizer, length, depth, inst.values[0], prefix_ids=prefix_ids)
        return TaskPrompt(p.ids, inst, depth, p.needle_start, p.needle_end, (p.needle_start,))
    texts, target, question_text = _texts(inst)
    needles = [encode(tokenizer, " " + t) for t in texts]
    question = encode(tokenizer, " " + question_text)
    prefix = [int(i) for i in prefix_ids]
    fixed = len(prefix) + sum(map(len, needles)) + len(question)
    budget = length - fixed
    if budget < 0:
        raise TaskError(
            f"task {spec.id}: a prompt of {length} tokens cannot hold its {len(needles)} needles: prefix, "
            f"needles and question alone take {fixed} tokens"
        )
    offsets = _offsets(spec.name, len(needles), target, round(depth * budget), budget, rng)
    # Prompt order: by filler offset; among equal offsets the chain order (multikey: the asked key first).
    rank = {target: -1} if spec.name == "multikey" else {}
    order = sorted(range(len(needles)), key=lambda i: (offsets[i], rank.get(i, i)))
    ids, pos, starts = list(prefix), 0, {}
    for i in order:
        ids += passkey._filler_stream(tokenizer, offsets[i] - pos) if offsets[i] > pos else []
        pos = offsets[i]
        starts[i] = len(ids)
        ids += needles[i]
    ids += passkey._filler_stream(tokenizer, budget - pos) if budget > pos else []
    ids += question
    assert len(ids) == length
    start = starts[target]
    return TaskPrompt(ids, inst, depth, start, start + len(needles[target]), tuple(starts[i] for i in order))


def task_prompt(
    tokenizer: TokenizerLike,
    spec: TaskSpec,
    length: int,
    depth: float,
    rng: random.Random,
    *,
    digits: int,
    prefix_ids: Sequence[int] = (),
) -> TaskPrompt:
    """A fresh instance of `spec` from rng, laid out at `length` tokens with the target at `depth`."""
    return build_task_prompt(
        tokenizer, draw_instance(spec, rng, digits), length, depth, rng, prefix_ids=prefix_ids
    )


def parse_items(spec: TaskSpec, text: str, n: int) -> tuple[int | str, ...]:
    """The first n answer items of a continuation: integers, or words for vartrack."""
    if spec.name == "vartrack":
        return tuple(_WORD.findall(text)[:n])
    return tuple(int(m) for m in _INT.findall(text)[:n])


def is_correct(prompt: TaskPrompt, text: str) -> bool:
    """Exact match: the continuation's first items are the answer, in order (passkey: its own scorer)."""
    inst = prompt.instance
    if inst.spec.name == "passkey":
        return passkey.is_correct(text, inst.values[0])
    return parse_items(inst.spec, text, len(inst.answer)) == inst.answer


def answer_rows(
    tokenizer: TokenizerLike,
    spec: TaskSpec,
    n: int,
    length: int,
    *,
    digits: int,
    rng: random.Random,
    prefix_ids: Sequence[int] = (),
) -> tuple[list[list[int]], list[list[int]]]:
    """n training rows of `spec` for answer-only supervision, as data_prep.passkey.answer_rows (which the
    passkey task is): a prompt with the target at a uniform random depth, then the answer, shifted by one;
    targets are IGNORE_INDEX except at the answer tokens."""
    if spec.name == "passkey":
        return passkey.answer_rows(tokenizer, n, length, digits=digits, rng=rng, prefix_ids=prefix_ids)
    inputs: list[list[int]] = []
    targets: list[list[int]] = []
    for _ in range(n):
        inst = draw_instance(spec, rng, digits)
        answer = encode(tokenizer, inst.answer_text)
        prompt = build_task_prompt(
            tokenizer, inst, length + 1 - len(answer), rng.random(), rng, prefix_ids=prefix_ids
        )
        row = prompt.ids + answer
        p = len(prompt.ids)
        inputs.append(row[:-1])
        targets.append([IGNORE_INDEX] * (p - 1) + row[p:])
    return inputs, targets


def check_task_rows(
    tokenizer: TokenizerLike,
    spec: TaskSpec,
    min_len: int,
    digits: int,
    prefix_ids: Sequence[int],
    *,
    max_len: int | None = None,
    multiple: int = 1,
) -> None:
    """Fail at the start of training, not at the phase's first step, when the shortest training prompt
    cannot hold the task (a few draws: names and values change a needle's length by a token or two) or
    the tokenizer cannot spell its answers. The error names the shortest min_len (a multiple of
    `multiple`) that holds the same draws, and whether it needs a larger max_len too."""
    check_digits(tokenizer)

    def fits(length: int) -> TaskError | None:
        try:
            rng = random.Random(0)
            answer_rows(tokenizer, spec, 8, length, digits=digits, rng=rng, prefix_ids=prefix_ids)
        except TaskError as e:
            return e
        return None

    error = fits(min_len)
    if error is None:
        return
    step = max(1, multiple)
    top = 64 * max(min_len, step)
    length = (min_len // step + 1) * step
    while length <= top and fits(length) is not None:
        length += step
    if length > top:
        hint = f"no prompt of up to {top} tokens holds it: use a smaller task size"
    elif max_len is not None and length > max_len:
        hint = (
            f"set train.passkey.min_len={length} (or more) and train.passkey.max_len to at least that "
            f"(now {max_len})"
        )
    else:
        hint = f"set train.passkey.min_len={length} (or more)"
    raise TaskError(f"train.passkey.min_len={min_len}: {error}; {hint}")
