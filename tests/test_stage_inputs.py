"""Each stage command checks that its inputs are the ones the previous stage recorded (pipeline.upstream):
another run's export under this run's name, another run's data, a swapped tokenizer.json alone, another
run's checkpoint exported over this run's export: each refused with one line naming the file and the
command that redoes the stage, nothing written; an export named on purpose is evaluated and the report
says whose weights they were. Runs `fpa` processes on real prepared shards and tiny trained models."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_train_support import REPO

from pipeline.config import load_config
from pipeline.upstream import UpstreamError, check_data, check_export

EVAL = [
    "eval.passkey.enabled=false",
    "eval.ppl_length_multipliers=[1]",
    "eval.ppl_bucket=32",
    "eval.ppl_sequences=2",
    "eval.device=cpu",
]


def fpa(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def one_error(r: subprocess.CompletedProcess) -> str:
    """The single `fpa: error:` line of a refused command (and it exited non-zero)."""
    assert r.returncode != 0, r.stdout + r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("fpa: error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """runs/a (d_model 32) and runs/b (d_model 48), trained 2 steps on the same corpus and content config,
    and runs/c: data only, prepared with vocab 400 (a and b: 300). Returns the config file."""
    import random

    tmp = tmp_path_factory.mktemp("inputs")
    rng = random.Random(0)
    words = [f"w{i}" for i in range(40)]
    with open(tmp / "c.jsonl", "w") as f:
        for _ in range(120):
            start = rng.randrange(len(words))
            text = " ".join(words[(start + i) % len(words)] for i in range(rng.randint(20, 60)))
            f.write(json.dumps({"text": text}) + "\n")
    cfg = tmp / "run.yaml"
    cfg.write_text(
        f"""
name: a
runs_dir: {tmp / "runs"}
model: {{n_layer: 1, n_head: 2, d_model: 32, max_seq_len: 64}}
data:
  train: {{type: jsonl, paths: ["{tmp / "c.jsonl"}"]}}
  val_fraction: 0.1
  tokenizer: {{vocab_size: 300}}
  sequences_per_member: 8
  sequences_per_shard: 32
  seq_len: 32
train: {{micro_batch: 4, max_steps: 2, warmup_steps: 1, log_every: 1, val_every: 2, val_batches: 1,
         checkpoint: {{every: 2}}}}
logging: {{wandb_mode: disabled, progress: false}}
"""
    )
    for extra in (["name=a"], ["name=b", "model.d_model=48"]):
        r = fpa("run", str(cfg), *extra, "--stages", "prepare,train")
        assert r.returncode == 0, r.stderr[-3000:]
    r = fpa("prepare", str(cfg), "name=c", "data.tokenizer.vocab_size=400")
    assert r.returncode == 0, r.stderr[-3000:]
    return cfg


def swap_two_tokens(path: Path) -> None:
    """Another tokenizer of the same size: two tokens' ids exchanged (the shards' ids now mean other text)."""
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tok))


def copy_runs(cfg: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of the fixture's runs dir (each test spoils its own): (runs dir, the runs_dir=...)."""
    dst = tmp_path / "runs"
    shutil.copytree(load_config([cfg]).runs_dir, dst)
    return dst, f"runs_dir={dst}"


def test_eval_refuses_another_runs_export_then_evaluates_it_on_purpose(runs: Path, tmp_path: Path) -> None:
    root, where = copy_runs(runs, tmp_path)
    shutil.rmtree(root / "a" / "export")
    shutil.copytree(root / "b" / "export", root / "a" / "export")  # whole: its own checksums.json agrees
    line = one_error(fpa("eval", str(runs), where, *EVAL))
    assert str(root / "a" / "export" / "model.safetensors") in line
    assert "trained by run 'b', not 'a'" in line and "fpa export" in line and "--checkpoint" in line
    assert not (root / "a" / "eval").exists()  # nothing written
    line = one_error(fpa("generate", str(runs), "w1 w2", where, "--max-new-tokens", "2"))
    assert "trained by run 'b', not 'a'" in line
    # Named on purpose: evaluated, and the report says whose weights they were.
    r = fpa("eval", str(runs), where, *EVAL, "--checkpoint", str(root / "b" / "export"))
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((root / "a" / "eval" / "report.json").read_text())
    assert rep["weights_of"]["run"] == "b" and rep["weights_of"]["explicit"] is True
    assert rep["weights_of"]["this_run"] is False
    from data_prep.index import sha256_file

    assert rep["weights_of"]["sha256"] == sha256_file(root / "b" / "export" / "model.safetensors")
    assert "run 'b''s export, not 'a''s, named on purpose" in (root / "a" / "eval" / "report.md").read_text()


def test_train_refuses_another_runs_data_and_a_swapped_tokenizer(runs: Path, tmp_path: Path) -> None:
    root, where = copy_runs(runs, tmp_path)
    before = sorted(p.name for p in (root / "a" / "checkpoints").iterdir())
    manifest = (root / "a" / "manifests" / "train.json").read_text()
    shutil.rmtree(root / "a" / "data")
    shutil.copytree(root / "c" / "data", root / "a" / "data")  # vocab 400 where a's config says 300
    line = one_error(fpa("train", str(runs), where, "train.max_steps=4"))
    assert str(root / "a" / "data" / "index.json") in line and "`fpa prepare` recorded" in line
    assert f"fpa prepare {root / 'a' / 'config.yaml'} --force" in line
    # Without a's prepare manifest (data prepared elsewhere): the content config itself disagrees.
    (root / "a" / "manifests" / "prepare.json").unlink()
    line = one_error(fpa("train", str(runs), where, "train.max_steps=4"))
    assert "another content config" in line and "data.tokenizer.vocab_size: 400 there, 300 here" in line
    assert sorted(p.name for p in (root / "a" / "checkpoints").iterdir()) == before  # nothing trained
    assert (root / "a" / "manifests" / "train.json").read_text() == manifest

    # The tokenizer alone swapped (b's data is a's content config, so only the file differs).
    root, where = copy_runs(runs, tmp_path / "tok")
    swap_two_tokens(root / "b" / "data" / "tokenizer.json")
    line = one_error(fpa("train", str(runs), where, "name=b", "model.d_model=48", "train.max_steps=4"))
    assert str(root / "b" / "data" / "tokenizer.json") in line and "`fpa prepare` recorded" in line
    line = one_error(fpa("eval", str(runs), where, "name=b", "model.d_model=48", *EVAL))
    assert "tokenizer.json" in line
    (root / "b" / "manifests" / "prepare.json").unlink()
    line = one_error(fpa("eval", str(runs), where, "name=b", "model.d_model=48", *EVAL))
    assert "is not the tokenizer index.json records" in line
    hf = tmp_path / "hf"
    line = one_error(
        fpa("export", str(runs), where, "name=b", "model.d_model=48", "--format", "hf", "--out", str(hf))
    )
    assert "is not the tokenizer index.json records" in line and not hf.exists()
    assert not (root / "b" / "eval").exists()


def test_export_refuses_another_runs_checkpoint_over_this_runs_export(runs: Path, tmp_path: Path) -> None:
    root, where = copy_runs(runs, tmp_path)
    ckpt_b = next(
        p for p in (root / "b" / "checkpoints").iterdir() if p.is_dir() and (p / "COMPLETE").is_file()
    )
    weights = (root / "a" / "export" / "model.safetensors").read_bytes()
    line = one_error(fpa("export", str(runs), where, "--checkpoint", str(ckpt_b)))
    assert str(ckpt_b) in line and "not one of this run's checkpoints" in line and "--out" in line
    assert (root / "a" / "export" / "model.safetensors").read_bytes() == weights
    r = fpa("export", str(runs), where, "--checkpoint", str(ckpt_b), "--out", str(tmp_path / "b-export"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "b-export" / "model.safetensors").is_file()


def test_check_export_accepts_a_reexport_of_this_runs_checkpoint_not_other_weights(
    runs: Path, tmp_path: Path
) -> None:
    root, where = copy_runs(runs, tmp_path)
    cfg = load_config([runs], [where])
    export = root / "a" / "export"
    check_data(cfg)
    check_export(cfg, export, explicit=False)  # as training recorded it
    sd = load_file(str(export / "model.safetensors"))
    meta = {"step": "2", "source": str(next((root / "a" / "checkpoints").glob("*/COMPLETE")).parent)}
    changed = {k: v + 1e-3 if v.is_floating_point() else v for k, v in sd.items()}
    save_file(changed, str(export / "model.safetensors"), metadata=meta)
    check_export(cfg, export, explicit=False)  # another export of this run's own checkpoint: its weights
    save_file(changed, str(export / "model.safetensors"), metadata={"step": "2", "source": "/elsewhere/ckpt"})
    with pytest.raises(UpstreamError, match="is not the file `fpa train` recorded for this run"):
        check_export(cfg, export, explicit=False)
    check_export(cfg, export, explicit=True)  # named on purpose: not checked
    assert torch.equal(load_file(str(export / "model.safetensors"))["embed.weight"], changed["embed.weight"])
