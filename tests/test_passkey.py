"""The passkey protocol: prompt length and needle depth in tokens, scoring, training documents."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data_prep import passkey
from data_prep.passkey import FILLER, NEEDLE, QUESTION


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """A small byte-level BPE trained on the protocol's own sentences plus some other text."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    text = [
        FILLER,
        NEEDLE.format(key=12345),
        QUESTION,
        "In the beginning God created the heaven.",
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    t.train_from_iterator(text * 20, trainer)
    return t


@pytest.mark.parametrize("length", [64, 200, 513])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_prompt_length_and_depth(tok: Tokenizer, length: int, depth: float) -> None:
    eod = tok.token_to_id("<|endoftext|>")
    p = passkey.build_prompt(tok, length, depth, 48213, prefix_ids=[eod])
    assert len(p.ids) == length
    assert p.ids[0] == eod
    needle = passkey.encode(tok, " " + NEEDLE.format(key=48213))
    assert p.ids[p.needle_start : p.needle_end] == needle
    question = passkey.encode(tok, " " + QUESTION)
    assert p.ids[-len(question) :] == question
    # The needle starts at round(depth * free) after the prefix, where free is the filler budget.
    free = length - 1 - len(needle) - len(question)
    assert p.needle_start == 1 + round(depth * free)
    # Depth in the whole prompt differs from the filler depth by at most the prefix and question share.
    assert abs(p.actual_depth - depth) <= (1 + len(question) + 1) / (length - len(needle))
    text = tok.decode(p.ids)
    assert NEEDLE.format(key=48213) in text
    assert text.rstrip().endswith(QUESTION)


def test_whole_filler_prompt_is_canonical_tokenization(tok: Tokenizer) -> None:
    # When the filler budget is whole sentences, the token-level assembly equals encoding the text.
    unit = passkey.encode(tok, " " + FILLER)
    needle = passkey.encode(tok, " " + NEEDLE.format(key=777))
    question = passkey.encode(tok, " " + QUESTION)
    length = 4 * len(unit) + len(needle) + len(question)
    p = passkey.build_prompt(tok, length, 0.5, 777)
    text = " " + " ".join([FILLER] * 2 + [NEEDLE.format(key=777)] + [FILLER] * 2 + [QUESTION])
    assert p.ids == passkey.encode(tok, text)


def test_prompt_too_short_is_a_clear_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="too short"):
        passkey.build_prompt(tok, 10, 0.5, 12345)
    with pytest.raises(ValueError, match="depth"):
        passkey.build_prompt(tok, 100, 1.5, 12345)


def test_scoring() -> None:
    assert passkey.parse_answer(" 48213. Remember") == 48213
    assert passkey.is_correct(" 48213.", 48213)
    assert not passkey.is_correct(" 4821.", 48213)
    assert not passkey.is_correct(" 482130", 48213)  # exact match, not prefix
    assert not passkey.is_correct(" the grass", 48213)
    assert passkey.parse_answer("no digits") is None


def test_random_key_digits() -> None:
    rng = random.Random(0)
    keys = [passkey.random_key(rng, 5) for _ in range(200)]
    assert all(10_000 <= k <= 99_999 for k in keys)
    assert len(set(keys)) > 150
    with pytest.raises(ValueError, match="digits"):
        passkey.random_key(rng, 0)


def test_passkey_documents_deterministic_and_well_formed() -> None:
    docs = passkey.passkey_documents(50, seed=3, min_fillers=2, max_fillers=6)
    assert docs == passkey.passkey_documents(50, seed=3, min_fillers=2, max_fillers=6)
    assert docs != passkey.passkey_documents(50, seed=4, min_fillers=2, max_fillers=6)
    for d in docs:
        key = passkey.parse_answer(d)
        assert key is not None and 10_000 <= key <= 99_999
        assert NEEDLE.format(key=key) in d
        assert d.endswith(QUESTION + passkey.answer_text(key))
        assert 2 <= d.count(FILLER) <= 6
    # The needle is spread over positions, not always at the same depth.
    firsts = {d.startswith("The pass key") for d in docs}
    assert firsts == {True, False}


@pytest.mark.parametrize("length", [80, 137])
def test_answer_rows_supervise_exactly_the_answer(tok: Tokenizer, length: int) -> None:
    eod = tok.token_to_id("<|endoftext|>")
    rng = random.Random(5)
    xs, ys = passkey.answer_rows(tok, 6, length, digits=3, rng=rng, prefix_ids=[eod])
    assert len(xs) == len(ys) == 6
    for x, y in zip(xs, ys):
        assert len(x) == len(y) == length and x[0] == eod
        kept = [i for i, t in enumerate(y) if t != passkey.IGNORE_INDEX]
        assert kept == list(range(kept[0], length))  # one contiguous run at the end: the answer
        assert y[kept[0] :] == x[kept[0] + 1 :] + [y[-1]]  # next-token targets of the same row
        text = passkey.decode(tok, x[: kept[0] + 1])
        assert text.rstrip().endswith(QUESTION)  # the answer starts right after the question
        key = passkey.parse_answer(passkey.decode(tok, y[kept[0] :]))
        assert key is not None and 100 <= key <= 999
        assert NEEDLE.format(key=key) in text  # the supervised key is the one hidden in the prompt
    # Deterministic in the rng; different rows get different keys.
    again = passkey.answer_rows(tok, 6, length, digits=3, rng=random.Random(5), prefix_ids=[eod])
    assert again == (xs, ys)
    assert len({tuple(y) for y in ys}) > 1
