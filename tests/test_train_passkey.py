"""The passkey phase (train.passkey): answer-only passkey rows added to the last steps of training.

Training runs use the in-memory loader of test_train_support for the language-model steps and a small
prepared data directory for the tokenizer the passkey prompts are built with.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from test_train_support import run_training, summary_of, write_config

from data_prep import passkey

BASE = [
    "model.vocab_size=null",  # from the prepared index (the in-memory loader's ids fit below it)
    "train.max_steps=8",
    "train.passkey.steps=4",
    "train.passkey.batch=3",
    "train.passkey.weight=0.5",
    "train.passkey.digits=2",
    "train.passkey.min_len=40",
    "train.passkey.max_len=64",
    "train.checkpoint.every=2",
    "train.checkpoint.keep_last=4",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Prepared shards + tokenizer, trained on text that includes the passkey sentences (compact prompts)."""
    from data_prep.config import DataConfig, SourceConfig, TokenizerConfig
    from data_prep.prepare import prepare_data

    tmp = tmp_path_factory.mktemp("pkdata")
    rng = random.Random(0)
    docs = passkey.passkey_documents(80, seed=1, max_fillers=3)
    docs += [" ".join(f"w{rng.randrange(40)}" for _ in range(rng.randint(20, 60))) for _ in range(80)]
    with open(tmp / "c.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    dcfg = DataConfig(
        train=SourceConfig(type="jsonl", paths=[str(tmp / "c.jsonl")]),
        val_fraction=0.1,
        tokenizer=TokenizerConfig(vocab_size=400),
        seq_len=32,
        sequences_per_member=8,
        sequences_per_shard=32,
    )
    prepare_data(dcfg, tmp / "data", progress=False)
    return tmp / "data"


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("cfg"))


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def phase_losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    """step -> (language-model loss, passkey loss) of the phase steps."""
    return {r["step"]: (r["loss"], r["passkey_loss"]) for r in records(run_dir) if "passkey_loss" in r}


def loader_state(run_dir: Path, step: int) -> dict:
    client = torch.load(
        run_dir / "checkpoints" / f"global_step{step}" / "mp_rank_00_model_states.pt", weights_only=False
    )
    return client["loader_state"]


@pytest.fixture(scope="module")
def reference(cfg_path, data_dir, tmp_path_factory) -> tuple[Path, dict]:
    runs = tmp_path_factory.mktemp("pkref")
    proc = run_training(cfg_path, [*BASE, f"data.out_dir={data_dir}", f"runs_dir={runs}"])
    return runs / "t", summary_of(proc)


def test_phase_is_the_last_steps_on_top_of_the_language_model(reference):
    run_dir, summary = reference
    recs = [r for r in records(run_dir) if "loss" in r]
    assert [r["step"] for r in recs] == list(range(1, 9))  # the LM loss is there at every step
    assert [r["step"] for r in recs if "passkey_loss" in r] == [5, 6, 7, 8]
    # Answer-only loss over 4 supervised tokens (space, 2 digits, '.'): finite and positive.
    assert all(0.0 < r["passkey_loss"] < 30.0 for r in recs if "passkey_loss" in r)
    assert summary["passkey_loss"] == pytest.approx(recs[-1]["passkey_loss"])
    assert summary["final_loss"] == pytest.approx(recs[-1]["loss"])
    # The loader keeps going through the phase; only language-model tokens are counted.
    assert loader_state(run_dir, 8) != loader_state(run_dir, 6) != loader_state(run_dir, 4)
    assert summary["tokens"] == 8 * 4 * 32


def test_phase_rows_are_answer_only_and_deterministic(cfg_path, data_dir):
    from pipeline.config import derive, load_config
    from pipeline.trainer.batches import PasskeyBatches as _PasskeyBatches

    over = [*BASE, f"data.out_dir={data_dir}", "parallel.sequence=2"]
    cfg = load_config([cfg_path], over)
    d = derive(cfg, world_size=2)
    a, b = _PasskeyBatches(cfg, d, dp_rank=0), _PasskeyBatches(cfg, d, dp_rank=1)
    x, y = a.batch(5, 0)
    assert x.shape == y.shape and x.shape[0] == 3 and x.shape[1] % 16 == 0 and 40 <= x.shape[1] <= 64
    assert torch.equal(x, a.batch(5, 0)[0]) and torch.equal(y, a.batch(5, 0)[1])  # resume: same rows
    assert not torch.equal(x, b.batch(5, 0)[0])  # other data-parallel ranks: other keys
    assert b.batch(5, 0)[0].shape == x.shape  # one length per step on every rank
    kept = (y != passkey.IGNORE_INDEX).sum(1)
    assert torch.all(kept == 4)  # space, 2 digits, '.'


def test_resume_inside_the_phase_draws_the_same_batches(cfg_path, data_dir, reference, tmp_path):
    src = reference[0]
    run_dir = tmp_path / "t"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / "global_step6", run_dir / "checkpoints" / "global_step6")
    proc = run_training(cfg_path, [*BASE, f"data.out_dir={data_dir}", f"runs_dir={tmp_path}"])
    assert "at step 6" in proc.stdout
    ref, got = phase_losses(src), phase_losses(run_dir)
    for s in (7, 8):
        assert got[s] == pytest.approx(ref[s], rel=1e-5, abs=1e-6), f"step {s}"
    assert got[7] != got[8]


@pytest.mark.distributed
def test_sequence_parallel_phase_matches_one_rank(cfg_path, data_dir, reference, tmp_path):
    """Two ranks sharing every sequence (zigzag): the passkey rows are sharded with their ignored targets
    and the group-wide answer-only loss equals the 1-rank run's."""
    over = [*BASE, "parallel.sequence=2", f"data.out_dir={data_dir}", f"runs_dir={tmp_path}"]
    run_training(cfg_path, over, nproc=2)
    ref, got = phase_losses(reference[0]), phase_losses(tmp_path / "t")
    assert set(got) == {5, 6, 7, 8}
    for s in got:
        assert got[s] == pytest.approx(ref[s], rel=5e-5, abs=1e-6), f"step {s}"


def test_phase_bounds_are_checked_with_the_key_named():
    from pipeline.config import ConfigError, derive, load_config

    cfg = load_config([], ["train.passkey.steps=6", "train.passkey.min_len=70", "train.passkey.max_len=79"])
    with pytest.raises(ConfigError, match=r"train.passkey: no prompt length in \[min_len=70, max_len=79\]"):
        derive(cfg)
    with pytest.raises(ConfigError, match="train.passkey.weight must be > 0"):
        load_config([], ["train.passkey.weight=0"])


def test_ramp_grows_the_longest_prompt_from_min_len_to_max_len(data_dir, tmp_path):
    """train.passkey.ramp_steps: the longest prompt grows linearly over the phase's first steps (the phase
    starts at max_steps - steps), each drawn length stays a multiple in [min_len, bound], then max_len."""
    from pipeline.config import derive, load_config
    from pipeline.trainer.batches import PasskeyBatches

    over = ["train.max_steps=30", "train.passkey.steps=20", "train.passkey.min_len=64"]
    over += ["train.passkey.max_len=160", "train.passkey.ramp_steps=8", "train.passkey.batch=2"]
    cfg = load_config([], [*over, f"data.out_dir={data_dir}", f"runs_dir={tmp_path}"])
    pk = PasskeyBatches(cfg, derive(cfg), 0, start=10)
    bounds = [pk.max_length(s) for s in range(10, 30)]
    assert bounds[0] == 64 + (160 - 64) // 8 and bounds[7:] == [160] * 13
    assert bounds == sorted(bounds)
    for s in range(10, 30):
        x, _ = pk.batch(s, 0)
        assert x.shape[1] <= pk.max_length(s) and x.shape[1] % 16 == 0 and x.shape[1] >= 64, (s, x.shape)
    lengths = {pk.batch(s, 0)[0].shape[1] for s in range(18, 30)}
    assert max(lengths) > 112  # after the ramp, long prompts are drawn again
    no_ramp_cfg = load_config([], [*over[:-2], "train.passkey.batch=2", f"data.out_dir={data_dir}"])
    no_ramp = PasskeyBatches(no_ramp_cfg, derive(cfg), 0, start=10)
    assert no_ramp.max_length(10) == 160
