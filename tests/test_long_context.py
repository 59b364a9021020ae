"""Long-context task generators (data_prep/long_context.py): exact answers read back from the prompt text,
needle placement in tokens, determinism by seed, the passkey task bit-identical to data_prep.passkey, and
one-line errors for bad input."""

from __future__ import annotations

import random
import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data_prep import long_context as lc
from data_prep import passkey

SPECS = ["multikey-2", "multikey-4", "multikey-8", "multivalue-3", "overwrite-2", "overwrite-4", "vartrack-3"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """A small byte-level BPE trained on the tasks' own sentences plus some other text."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    text = [
        passkey.FILLER,
        passkey.NEEDLE.format(key=12345),
        passkey.QUESTION,
        lc.MK_NEEDLE.format(name="QWKX", key=42),
        lc.OW_UPDATE.format(key=17),
        lc.VT_ASSIGN.format(name="ABCD", value=42),
        "In the beginning God created the heaven.",
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    t.train_from_iterator(text * 20, trainer)
    return t


def _answer_from_text(spec: lc.TaskSpec, text: str) -> tuple[int | str, ...]:
    """The answer worked out from the prompt's text alone, independently of the generator's bookkeeping."""
    if spec.name == "multikey":
        asked = re.search(r"What is the pass key of ([A-Z]+)\?", text).group(1)
        return (int(re.search(rf"The pass key of {asked} is (\d+)\.", text).group(1)),)
    if spec.name == "multivalue":
        return tuple(int(v) for v in re.findall(r"One of the pass keys is (\d+)\.", text))
    if spec.name == "overwrite":
        return (int(re.findall(r"The pass key is (?:now )?(\d+)\.", text)[-1]),)
    assert spec.name == "vartrack"
    value = re.search(r"assigned the value (\d+)\?", text).group(1)
    assign = dict(re.findall(r"VAR ([A-Z]+) = (\w+)\.", text))
    held, changed = {v for v, x in assign.items() if x == value}, True
    while changed:  # follow the chain: a variable assigned from one that holds the value holds it too
        new = {v for v, x in assign.items() if x in held}
        changed, held = not new <= held, held | new
    order = [v for v in re.findall(r"VAR ([A-Z]+) =", text) if v in held]
    return tuple(order)


@pytest.mark.parametrize("spec_text", SPECS)
@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("length", [300, 701])
def test_prompt_length_depth_and_exact_answer(
    tok: Tokenizer, spec_text: str, depth: float, length: int
) -> None:
    spec = lc.parse_task(spec_text)
    eod = tok.token_to_id("<|endoftext|>")
    p = lc.task_prompt(tok, spec, length, depth, random.Random(7), digits=2, prefix_ids=[eod])
    assert len(p.ids) == length and p.ids[0] == eod
    text = tok.decode(p.ids)
    assert p.answer == _answer_from_text(spec, text)
    assert len(p.needle_starts) == spec.size and list(p.needle_starts) == sorted(p.needle_starts)
    # The target needle sits after exactly round(depth x budget) filler tokens (budget: all the filler).
    texts, target, question = lc._texts(p.instance)
    needles = [passkey.encode(tok, " " + t) for t in texts]
    assert p.ids[p.needle_start : p.needle_end] == needles[target]
    budget = length - 1 - sum(map(len, needles)) - len(passkey.encode(tok, " " + question))
    # Which needle starts where: each start holds the tokens of exactly one needle.
    at = {s: [j for j, n in enumerate(needles) if p.ids[s : s + len(n)] == n] for s in p.needle_starts}
    assert all(len(js) >= 1 for js in at.values())
    needle_tokens_before = sum(len(needles[at[s][0]]) for s in p.needle_starts if s < p.needle_start)
    assert p.needle_start - 1 - needle_tokens_before == round(depth * budget)
    assert text.rstrip().endswith(question)
    # Overwrite: the answer is the last assignment, and every earlier one holds another value.
    if spec.name == "overwrite":
        values = [int(v) for v in re.findall(r"The pass key is (?:now )?(\d+)\.", text)]
        assert len(values) == spec.size and len(set(values)) == spec.size and p.answer == (values[-1],)
        assert p.needle_start == max(p.needle_starts)  # the latest assignment is the last needle


def test_determinism_by_seed(tok: Tokenizer) -> None:
    for spec_text in SPECS:
        spec = lc.parse_task(spec_text)
        a = lc.task_prompt(tok, spec, 400, 0.5, random.Random(3), digits=2)
        b = lc.task_prompt(tok, spec, 400, 0.5, random.Random(3), digits=2)
        c = lc.task_prompt(tok, spec, 400, 0.5, random.Random(4), digits=2)
        assert a == b and a.ids != c.ids, spec_text


def test_passkey_task_is_the_passkey_protocol(tok: Tokenizer) -> None:
    spec = lc.parse_task("passkey")
    eod = tok.token_to_id("<|endoftext|>")
    rng_a, rng_b = random.Random(11), random.Random(11)
    for length, depth in ((90, 0.0), (200, 0.37), (513, 1.0)):
        p = lc.task_prompt(tok, spec, length, depth, rng_a, digits=5, prefix_ids=[eod])
        q = passkey.build_prompt(tok, length, depth, passkey.random_key(rng_b, 5), prefix_ids=[eod])
        assert (p.ids, p.answer, p.needle_start, p.needle_end) == (
            q.ids,
            (q.key,),
            q.needle_start,
            q.needle_end,
        )
        assert lc.is_correct(p, f" {q.key}.") and not lc.is_correct(p, f" {q.key}0")
    rows = lc.answer_rows(tok, spec, 4, 120, digits=3, rng=random.Random(5), prefix_ids=[eod])
    assert rows == passkey.answer_rows(tok, 4, 120, digits=3, rng=random.Random(5), prefix_ids=[eod])
    assert lc.answer_budget(spec, 5) == 7  # the passkey grid's digits + 2


def test_answer_budget_covers_the_answer_text(tok: Tokenizer) -> None:
    for spec_text in SPECS:
        spec = lc.parse_task(spec_text)
        inst = lc.draw_instance(spec, random.Random(1), 3)
        assert len(inst.answer_text) == lc.answer_budget(spec, 3), spec_text
        assert len(passkey.encode(tok, inst.answer_text)) <= lc.answer_budget(spec, 3)


def test_scoring_is_exact(tok: Tokenizer) -> None:
    mv = lc.task_prompt(tok, lc.parse_task("multivalue-3"), 300, 0.5, random.Random(2), digits=2)
    a, b, c = mv.answer
    assert lc.is_correct(mv, f" {a}, {b}, {c}.") and lc.is_correct(mv, f" {a} {b} {c} and more 7")
    assert not lc.is_correct(mv, f" {b}, {a}, {c}.") and not lc.is_correct(mv, f" {a}, {b}.")
    vt = lc.task_prompt(tok, lc.parse_task("vartrack-3"), 300, 0.5, random.Random(2), digits=2)
    x, y, z = vt.answer
    assert lc.is_correct(vt, f" {x}, {y}, {z}.") and not lc.is_correct(vt, f" {x}, {z}, {y}.")
    assert not lc.is_correct(vt, f" VAR {x}, {y}, {z}.")
    ow = lc.task_prompt(tok, lc.parse_task("overwrite-3"), 300, 0.5, random.Random(2), digits=2)
    stale = ow.instance.values[0]
    assert lc.is_correct(ow, f" {ow.answer[0]}.") and not lc.is_correct(ow, f" {stale}.")


@pytest.mark.parametrize("spec_text", ["multikey-3", "multivalue-2", "overwrite-3", "vartrack-2"])
def test_answer_rows_supervise_exactly_the_answer(tok: Tokenizer, spec_text: str) -> None:
    spec = lc.parse_task(spec_text)
    eod = tok.token_to_id("<|endoftext|>")
    xs, ys = lc.answer_rows(tok, spec, 5, 240, digits=2, rng=random.Random(9), prefix_ids=[eod])
    assert (xs, ys) == lc.answer_rows(tok, spec, 5, 240, digits=2, rng=random.Random(9), prefix_ids=[eod])
    for x, y in zip(xs, ys):
        assert len(x) == len(y) == 240 and x[0] == eod
        kept = [i for i, t in enumerate(y) if t != passkey.IGNORE_INDEX]
        assert kept == list(range(kept[0], 240))
        prompt_text = tok.decode(x[: kept[0] + 1])
        answer = _answer_from_text(spec, prompt_text)
        assert lc.parse_items(spec, tok.decode(y[kept[0] :]), len(answer)) == answer


def test_bad_input_is_one_line(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"unknown task 'multkey' \(did you mean 'multikey'\?\)") as e:
        lc.parse_task("multkey")
    assert "\n" not in str(e.value) and "tasks are passkey, multikey" in str(e.value)
    with pytest.raises(ValueError, match="needs N >= 2"):
        lc.parse_task("overwrite-1")
    with pytest.raises(ValueError, match="one needle"):
        lc.parse_task("passkey-3")
    with pytest.raises(ValueError, match="whole number"):
        lc.parse_task("multikey-x")
    with pytest.raises(lc.TaskError, match=r"multikey-8: a prompt of 120 tokens cannot hold its 8 needles"):
        lc.task_prompt(tok, lc.parse_task("multikey-8"), 120, 0.5, random.Random(0), digits=2)
    for depth in (-0.1, 1.5):
        with pytest.raises(lc.TaskError, match=r"depth must be in \[0, 1\]"):
            lc.task_prompt(tok, lc.parse_task("overwrite"), 300, depth, random.Random(0), digits=2)
    with pytest.raises(lc.TaskError, match="distinct 1-digit values"):
        lc.draw_instance(lc.parse_task("multivalue-10"), random.Random(0), 1)
    lc.check_digits(tok)  # byte-level BPE: every digit is a token
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "1": 1, "2": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(lc.TaskError, match=r"cannot encode the digits 0, 3, 4") as e:
        lc.check_digits(words)
    assert "\n" not in str(e.value)
