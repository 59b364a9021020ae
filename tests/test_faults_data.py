"""Faults around data and stages (issue #14): prepare deletes nothing it did not write; a stage is done only
while its outputs exist; a shared data dir is never reused across content configs; data paths never run
commands; bad token ids, a model vocabulary that does not match and validation problems surface early."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_data_prepare import WORDS, small_cfg, tree_digest, write_corpus

from data_prep.config import SourceConfig
from data_prep.errors import DataError
from data_prep.index import load_index
from data_prep.loader import ShardLoader
from data_prep.prepare import prepare_data
from data_prep.shards import SplitWriter, read_shard
from launch.cli import main
from pipeline.config import ConfigError, load_config
from pipeline.rundir import RunDir, hash_outputs
from pipeline.stages import _skip, export_dir, run_prepare

REPO = Path(__file__).resolve().parent.parent


def run_cfg(tmp_path: Path, corpus: Path, name: str = "r", *overrides: str):
    """A run config around small_cfg's data settings (a jsonl corpus, vocabulary 300, seq_len 16)."""
    return load_config(
        [],
        [
            f"runs_dir={tmp_path / 'runs'}",
            f"name={name}",
            "data.train.type=jsonl",
            f"data.train.paths=[{corpus}]",
            "data.val_fraction=0.1",
            "data.tokenizer.vocab_size=300",
            "data.seq_len=16",
            "data.sequences_per_member=4",
            "data.sequences_per_shard=16",
            "logging.progress=false",
            *overrides,
        ],
    )


# ----------------------------------------------------------------------------------------------------
# 1. prepare deletes nothing it did not write


def test_prepare_refuses_a_corpus_folder_and_keeps_every_file(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus"
    rng = random.Random(0)
    for split, n in (("train", 6), ("validation", 2)):
        (corpus / split).mkdir(parents=True)
        for i in range(n):
            (corpus / split / f"{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(200)))
    before = tree_digest(corpus)
    cfg = small_cfg(
        corpus,
        train=SourceConfig(type="text", paths=[str(corpus / "train" / "*.txt")]),
        validation=SourceConfig(type="text", paths=[str(corpus / "validation" / "*.txt")]),
    )
    with pytest.raises(DataError, match=rf"refusing to replace {re.escape(str(corpus))}: .*not written by"):
        prepare_data(cfg, corpus, progress=False)
    assert tree_digest(corpus) == before
    # the same through `fpa prepare`: one line, non-zero, nothing removed
    rc = main(
        [
            "prepare",
            f"runs_dir={tmp_path / 'runs'}",
            "name=r",
            f"data.out_dir={corpus}",
            "data.train.type=text",
            f"data.train.paths=[{corpus}/train/*.txt]",
            "data.tokenizer.vocab_size=300",
            "data.seq_len=16",
            "logging.progress=false",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith(f"fpa: error: refusing to replace {corpus}")
    assert tree_digest(corpus) == before


def test_prepare_replaces_its_own_output_but_not_a_file_added_to_it(tmp_path: Path) -> None:
    cfg = small_cfg(write_corpus(tmp_path / "c.jsonl", 40))
    out = tmp_path / "d"
    prepare_data(cfg, out, progress=False)
    ref = tree_digest(out)
    prepare_data(cfg, out, progress=False)  # its own output (the marker says so): replaced, same bytes
    assert tree_digest(out) == ref
    (out / "train" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match=r"refusing to replace .*/d: it holds files fpa prepare did not"):
        prepare_data(cfg, out, progress=False)
    assert tree_digest(out) == {**ref, "train/notes.txt": tree_digest(out)["train/notes.txt"]}
    assert (out / "train" / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------------------------------
# 2. a stage is done only while its outputs exist and match its manifest


@pytest.mark.parametrize("out_dir", [None, "shared/d"])  # the run's own data dir, a shared relative one
def test_prepare_is_redone_when_its_data_was_purged_or_changed(tmp_path: Path, out_dir, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    over = [f"data.out_dir={out_dir}"] if out_dir else []
    cfg = run_cfg(tmp_path, write_corpus(tmp_path / "c.jsonl", 40), "r", *over)
    run_prepare(cfg)
    ref = tree_digest(cfg.data_dir)
    started = RunDir(cfg).read_manifest("prepare").started
    run_prepare(cfg)  # intact: skipped
    assert RunDir(cfg).read_manifest("prepare").started == started
    shutil.rmtree(cfg.data_dir)  # a scratch purge: today "skipping", then train says "run fpa prepare"
    run_prepare(cfg)
    assert tree_digest(cfg.data_dir) == ref
    (cfg.data_dir / "train" / "train-00001.tar").unlink()  # one shard lost
    run_prepare(cfg)
    assert tree_digest(cfg.data_dir) == ref
    index = cfg.data_dir / "index.json"
    index.write_text(index.read_text().replace('"seq_len": 16', '"seq_len": 16 '))  # not what was recorded
    run_prepare(cfg)
    assert tree_digest(cfg.data_dir) == ref


def test_train_and_eval_are_done_only_while_their_outputs_exist(tmp_path: Path) -> None:
    cfg = load_config([], [f"runs_dir={tmp_path}", "name=r"])
    run = RunDir(cfg)
    for stage, out in (
        ("train", export_dir(cfg) / "model.safetensors"),
        ("eval", cfg.run_dir / "eval" / "report.json"),
    ):
        with run.stage(stage, {"a": 1}):  # a manifest that records no output is not done
            pass
        assert not _skip(run, stage, {"a": 1}, force=False)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("x")
        with run.stage(stage, {"a": 1}) as m:
            m.outputs = hash_outputs(run, [out])
        assert _skip(run, stage, {"a": 1}, force=False)
        out.write_text("y")  # replaced since
        assert not _skip(run, stage, {"a": 1}, force=False)
        out.unlink()
        assert not _skip(run, stage, {"a": 1}, force=False)


# ----------------------------------------------------------------------------------------------------
# 3. a shared data.out_dir holds one content config


def test_shared_data_dir_is_reused_by_the_same_content_config_only(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", 40)
    shared = tmp_path / "shared"
    run_prepare(run_cfg(tmp_path, corpus, "a", f"data.out_dir={shared}"))
    ref, inode = tree_digest(shared), (shared / "index.json").stat().st_ino
    # same content config (the loader seed does not change a byte): shared as it is, not rewritten
    result = run_prepare(run_cfg(tmp_path, corpus, "b", f"data.out_dir={shared}", "data.seed=5"))
    assert result["reused"] is True and result["sequences"] == load_index(shared).sequences("train") + (
        load_index(shared).sequences("validation")
    )
    assert (shared / "index.json").stat().st_ino == inode and tree_digest(shared) == ref
    other = run_cfg(tmp_path, corpus, "c", f"data.out_dir={shared}", "data.tokenizer.vocab_size=280")
    with pytest.raises(
        DataError, match=r"data\.out_dir .*shared holds data prepared with another content config "
    ) as e:
        run_prepare(other)
    assert "tokenizer.vocab_size" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DataError, match="another content config"):
        run_prepare(other, force=True)  # --force redoes this run's stage, never another run's data
    assert tree_digest(shared) == ref


# ----------------------------------------------------------------------------------------------------
# 4. data paths stay inert; token ids and the model vocabulary match the tokenizer


@pytest.mark.parametrize("command", ["eval", "train", "prepare"])
def test_a_data_dir_that_is_a_command_or_url_is_refused(tmp_path: Path, command: str, capsys) -> None:
    marker = tmp_path / "ran"
    for value in (f"pipe:touch {marker} ; cat {{path}}", "file:///srv/data", "https://host/data"):
        with pytest.raises(ConfigError, match=r"^data\.out_dir must be a local directory"):
            load_config([], [f"data.out_dir={value}"])
    rc = main([command, f"runs_dir={tmp_path}", f"data.out_dir=pipe:touch {marker} ; cat {{path}}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("fpa: error: data.out_dir must be a local")
    assert not marker.exists()


def test_a_token_id_beyond_the_vocabulary_names_the_shard(tmp_path: Path) -> None:
    from pipeline.evaluation.perplexity import validation_stream

    cfg = small_cfg(write_corpus(tmp_path / "c.jsonl", 120))
    data = tmp_path / "d"
    prepare_data(cfg, data, progress=False)
    index = load_index(data)
    shard = index.shards("validation")[0]
    rows = read_shard(data, shard, seq_len=index.seq_len, dtype=index.dtype)
    rows[0, 3] = index.vocab_size  # no embedding row for it: an IndexError deep in the model today
    w = SplitWriter(
        tmp_path / "w",
        "validation",
        seq_len=16,
        dtype=index.dtype,
        sequences_per_member=4,
        sequences_per_shard=16,
    )
    w.add_tokens(rows.reshape(-1))
    (new,) = w.close()
    shutil.copy(tmp_path / "w" / new.file, data / shard.file)
    raw = json.loads((data / "index.json").read_text())
    raw["splits"]["validation"][0].update(sha256=new.sha256, bytes=new.bytes)  # the shard is hash-valid
    (data / "index.json").write_text(json.dumps(raw))
    msg = rf"shard .*validation-00000\.tar: token id {index.vocab_size} is outside the vocabulary"
    with pytest.raises(DataError, match=msg):
        list(ShardLoader(data, "validation", micro_batch=1).iter_once())
    with pytest.raises(DataError, match=msg):
        validation_stream(data, 10**6)


def test_a_model_vocabulary_above_the_tokenizers_is_refused(tmp_path: Path) -> None:
    from pipeline.train import _resolve_vocab

    data = tmp_path / "d"
    prepare_data(small_cfg(write_corpus(tmp_path / "c.jsonl", 40)), data, progress=False)
    v = load_index(data).vocab_size
    cfg = load_config([], [f"data.out_dir={data}", "data.seq_len=16", f"model.vocab_size={v + 64}"])
    with pytest.raises(ConfigError, match=rf"model\.vocab_size={v + 64} .*tokenizer .* has {v} tokens"):
        _resolve_vocab(cfg)
    cfg.model.vocab_size = v
    _resolve_vocab(cfg)  # equal: fine


# ----------------------------------------------------------------------------------------------------
# 5. validation problems stop a run before its first step


def test_validation_problems_are_found_before_training_starts(tmp_path: Path) -> None:
    data = tmp_path / "d"
    prepare_data(small_cfg(write_corpus(tmp_path / "c.jsonl", 40), val_fraction=0.0), data, progress=False)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"name: r\nruns_dir: {tmp_path / 'runs'}\n"
        "model: {n_layer: 1, n_head: 2, d_model: 32, max_seq_len: 32}\n"
        f"data: {{out_dir: {data}, seq_len: 16, train: {{type: jsonl, paths: [{tmp_path / 'c.jsonl'}]}},\n"
        "  val_fraction: 0.0, tokenizer: {vocab_size: 300},\n"
        "  sequences_per_member: 4, sequences_per_shard: 16}\n"
        "train: {micro_batch: 2, max_steps: 4, warmup_steps: 1, val_every: 2, checkpoint: {every: 2}}\n"
        "logging: {wandb_mode: disabled, progress: false}\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", str(cfg)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("fpa: error: validation check before training: ") and "no 'validation' split" in last
    )
    run_dir = tmp_path / "runs" / "r"
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    # a split too small for one global batch is caught the same way
    from data_prep.loader import check_split

    with pytest.raises(DataError, match=r"^train check before training: .*fewer than one global batch"):
        check_split(lambda: ShardLoader(data, "train", micro_batch=10**6), "train")
