"""Long-context tasks as the training phase's source (train.passkey.task): the same answer-only rows, ramp
and determinism as the passkey phase, a run that trains on them, the passkey's fingerprint kept, the
report saying which task was taught."""

from __future__ import annotations

import random
import re

import pytest
import torch
from test_train_passkey import cfg_path, data_dir, phase_losses  # noqa: F401 (module fixtures)
from test_train_support import run_training

from data_prep import long_context as lc
from data_prep import passkey

OVER = ["train.passkey.task=overwrite-2", "train.passkey.min_len=96", "train.passkey.max_len=128"]
BASE = [
    "model.vocab_size=null",
    "model.max_seq_len=128",
    "train.max_steps=4",
    "train.passkey.steps=2",
    "train.passkey.batch=2",
    "train.passkey.digits=2",
    "train.checkpoint.every=0",
    *OVER,
]


def test_task_rows_are_answer_only_deterministic_and_ramped(cfg_path, data_dir):  # noqa: F811
    from pipeline.config import derive, load_config
    from pipeline.trainer.batches import PasskeyBatches

    cfg = load_config([cfg_path], [*BASE, f"data.out_dir={data_dir}", "train.passkey.ramp_steps=2"])
    rows = PasskeyBatches(cfg, derive(cfg), dp_rank=0, start=2)
    assert rows.max_length(2) == 96 + (128 - 96) // 2 and rows.max_length(3) == 128
    x, y = rows.batch(3, 0)
    assert torch.equal(x, rows.batch(3, 0)[0]) and torch.equal(y, rows.batch(3, 0)[1])
    assert x.shape[0] == 2 and x.shape[1] % 16 == 0 and 96 <= x.shape[1] <= 128
    tok = rows.tokenizer
    spec = lc.parse_task("overwrite-2")
    for xi, yi in zip(x.tolist(), y.tolist()):
        kept = [i for i, t in enumerate(yi) if t != passkey.IGNORE_INDEX]
        assert kept == list(range(kept[0], len(yi)))
        text = tok.decode(xi[: kept[0] + 1])
        latest = [int(v) for v in re.findall(r"The pass key is (?:now )?(\d+)\.", text)][-1]
        assert lc.parse_items(spec, tok.decode(yi[kept[0] :]), 1) == (latest,)  # the latest value is taught
    # The passkey task's rows are the passkey phase's rows, bit for bit.
    pk_cfg = load_config([cfg_path], [*BASE[:-3], f"data.out_dir={data_dir}", "train.passkey.max_len=64"])
    pk_rows = PasskeyBatches(pk_cfg, derive(pk_cfg), dp_rank=0, start=2)
    want = passkey.answer_rows(
        tok,
        2,
        pk_rows.batch(3, 0)[0].shape[1],
        digits=2,
        rng=random.Random(f"passkey:{pk_cfg.seed}:3:0:0"),
        prefix_ids=pk_rows.prefix,
    )
    assert pk_rows.batch(3, 0)[0].tolist() == want[0] and pk_rows.batch(3, 0)[1].tolist() == want[1]


def test_bad_task_config_is_one_line(cfg_path, data_dir):  # noqa: F811
    from pipeline.config import ConfigError, derive, load_config
    from pipeline.trainer.batches import PasskeyBatches

    with pytest.raises(
        ConfigError, match=r"train.passkey.task has an unknown task 'overwrit' \(did you mean"
    ):
        load_config([], ["train.passkey.task=overwrit"])
    short = load_config([cfg_path], [*BASE, f"data.out_dir={data_dir}", "train.passkey.task=multikey-8"])
    with pytest.raises(
        lc.TaskError, match=r"train.passkey.min_len=96: task multikey-8: a prompt of \d+ tokens"
    ) as err:
        PasskeyBatches(short, derive(short), dp_rank=0)
    # The error names the shortest min_len that holds the task (here above max_len=128, so it says to
    # raise that too), and that one starts.
    fix = re.search(
        r"set (train.passkey.min_len=(\d+)) \(or more\) and train.passkey.max_len to at least that "
        r"\(now 128\)",
        str(err.value),
    )
    assert fix and int(fix.group(2)) % 16 == 0, err.value
    n = int(fix.group(2))
    task8 = [*BASE, f"data.out_dir={data_dir}", "train.passkey.task=multikey-8", f"model.max_seq_len={n}"]
    fixed = load_config([cfg_path], [*task8, fix.group(1), f"train.passkey.max_len={n}"])
    PasskeyBatches(fixed, derive(fixed), dp_rank=0)
    tight = load_config([cfg_path], [*task8, f"train.passkey.min_len={n - 16}", f"train.passkey.max_len={n}"])
    with pytest.raises(
        lc.TaskError, match=f"min_len={n - 16}: .*set train.passkey.min_len={n} \\(or more\\)$"
    ):
        PasskeyBatches(tight, derive(tight), dp_rank=0)
    # A task no prompt holds says so (256 needles of 3 digits, min_len 16: none up to 64 x 16 tokens).
    huge = load_config(
        [cfg_path],
        [*task8, "train.passkey.task=multikey-256", "train.passkey.digits=3", "train.passkey.min_len=16"],
    )
    with pytest.raises(lc.TaskError, match=r"no prompt of up to 1024 tokens holds it"):
        PasskeyBatches(huge, derive(huge), dp_rank=0)


def test_fingerprint_of_the_passkey_phase_is_unchanged():
    from pipeline.config import load_config
    from pipeline.stages import train_inputs

    plain = train_inputs(load_config([], ["train.passkey.steps=4"]), 1)
    assert "task" not in plain["train"]["passkey"]
    assert train_inputs(load_config([], ["train.passkey.steps=4", "train.passkey.task=passkey"]), 1) == plain
    other = train_inputs(load_config([], ["train.passkey.steps=4", "train.passkey.task=overwrite"]), 1)
    assert other["train"]["passkey"]["task"] == "overwrite"


def test_a_run_trains_on_the_task(cfg_path, data_dir, tmp_path):  # noqa: F811
    run_training(cfg_path, [*BASE, f"data.out_dir={data_dir}", f"runs_dir={tmp_path}"])
    losses = phase_losses(tmp_path / "t")
    assert set(losses) == {3, 4}
    assert all(0.0 < pk < 30.0 for _, pk in losses.values())
