"""Training a run again with a changed config (pipeline.continuation): keys that shape only the steps to
come (max_steps, the lr schedule, validation, ...) continue from the latest checkpoint under resume=auto,
exactly; keys the checkpoints depend on (the model, ...) archive them and start over, and the log says
which keys changed and the command that continues the old run instead; a max_steps below the latest
checkpoint is refused with the command that trains the shorter run.

The runs are `fpa train` processes on real prepared shards (about 5 s each).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_support import REPO, prepare_word_corpus, read_metrics

from pipeline.config import load_config
from pipeline.continuation import decide
from pipeline.stages import train_inputs
from pipeline.trainer.schedule import lr_at

TOL = 2e-5  # fp32 resume is exact to about 1e-6


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


def suggested(stderr: str, after: str) -> list[str]:
    """The fpa command a log line suggests after `after`, as arguments for `fpa(...)`."""
    line = next(ln for ln in stderr.splitlines() if after in ln)
    cmd = shlex.split(line.split(after, 1)[1].split(";")[0].strip())
    assert cmd[0] == "fpa", line
    return cmd[1:]


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_metrics(run_dir).items() if "loss" in r}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """A finished 6-step run (checkpoints at 3 and 6, constant lr after a 2-step warmup): (config, run)."""
    tmp = tmp_path_factory.mktemp("extend")
    prepare_word_corpus(tmp)
    cfg = tmp / "run.yaml"
    cfg.write_text(
        f"""
name: ext
runs_dir: {tmp / "runs"}
model: {{n_layer: 1, n_head: 2, d_model: 32, max_seq_len: 64}}
data:
  train: {{type: jsonl, paths: ["{tmp / "c.jsonl"}"]}}
  val_fraction: 0.1
  tokenizer: {{vocab_size: 300}}
  sequences_per_member: 8
  sequences_per_shard: 32
  out_dir: {tmp / "data"}
  seq_len: 32
train: {{micro_batch: 4, max_steps: 6, lr: 1.0e-2, min_lr_ratio: 1.0, warmup_steps: 2, log_every: 1,
         val_every: 3, val_batches: 2, checkpoint: {{every: 3, keep_last: 0}}}}
logging: {{wandb_mode: disabled, progress: false}}
"""
    )
    r = fpa("train", str(cfg))
    assert r.returncode == 0, r.stderr[-3000:]
    return cfg, tmp / "runs" / "ext"


def copy(finished: tuple[Path, Path], tmp: Path) -> tuple[Path, Path, str]:
    cfg, run = finished
    shutil.copytree(run, tmp / "ext")
    return cfg, tmp / "ext", f"runs_dir={tmp}"


def test_which_changed_keys_continue_and_which_start_over() -> None:
    base = ["model.vocab_size=64"]
    ref = train_inputs(load_config([], base), 1)
    cont = [
        "train.max_steps=500",
        "train.lr=1e-4",
        "train.warmup_steps=3",
        "train.schedule=wsd",
        "train.min_lr_ratio=0.5",
        "train.val_every=7",
        "train.grad_clip=0.5",
        "train.passkey.steps=10",
        "train.spike_guard.factor=3",
        "model.attention.impl=naive",
        "train.log_every=3",  # not a training input at all
    ]
    restart = [
        "model.n_layer=3",
        "model.attention.kind=fox",
        "seed=7",
        "data.seq_len=64",
        "data.seed=3",
        "train.betas=[0.9,0.99]",
        "train.weight_decay=0.0",
        "train.zero_stage=1",
        "train.precision=bf16",
        "train.micro_batch=2",  # the global batch
    ]
    for ov in cont:
        d = decide(ref, train_inputs(load_config([], [*base, ov]), 1))
        assert d.continues, ov
    for ov in restart:
        d = decide(ref, train_inputs(load_config([], [*base, ov]), 1))
        assert not d.continues and d.restart_keys, ov
    other_data = {**ref, "index": "0" * 64}
    assert decide(ref, other_data).restart_keys == ("index",)


def test_raising_max_steps_continues_the_run_exactly(finished, tmp_path):
    """6 steps, then max_steps=9: steps 7-9 are trained from the step-6 checkpoint (nothing archived), and
    the curve is the one of an uninterrupted 9-step run."""
    cfg, run, runs = copy(finished, tmp_path)
    r = fpa("train", str(cfg), runs, "train.max_steps=9")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        "train.max_steps 6 -> 9" in r.stderr and "continuing from the latest checkpoint (step 6)" in r.stderr
    )
    assert f"resumed from {run / 'checkpoints' / 'global_step6'} at step 6" in r.stdout
    assert not (run / "archive").exists()
    manifest = json.loads((run / "manifests" / "train.json").read_text())
    assert manifest["status"] == "done" and manifest["result"]["steps"] == 9
    straight = fpa("train", str(cfg), runs, "name=straight", "train.max_steps=9")
    assert straight.returncode == 0, straight.stderr[-3000:]
    got, want = losses(run), losses(tmp_path / "straight")
    assert sorted(got) == list(range(1, 10)) == sorted(want)
    for s in want:
        assert abs(got[s] - want[s]) <= TOL * max(1.0, abs(want[s])), (s, got[s], want[s])


def test_a_new_lr_schedule_continues_and_the_log_says_how_the_lr_moved(finished, tmp_path):
    """The lr is a function of (step, config): the continued steps follow the new schedule, recomputed
    for the new total from the checkpoint's step on, and the log gives the lr there under both."""
    cfg, run, runs = copy(finished, tmp_path)
    r = fpa("train", str(cfg), runs, "train.max_steps=10", "train.min_lr_ratio=0.1")
    assert r.returncode == 0, r.stderr[-3000:]
    new = load_config([cfg], [runs, "train.max_steps=10", "train.min_lr_ratio=0.1"]).train
    assert "train.min_lr_ratio 1.0 -> 0.1" in r.stderr
    assert f"the next step (7) trains at lr {lr_at(6, new):.6g}, where the old schedule had 0.01" in r.stderr
    lrs = {s: rec["lr"] for s, rec in read_metrics(run).items()}
    assert lrs[6] == pytest.approx(0.01)  # trained before: as it was
    for s in range(7, 11):  # metrics step s is optimizer step s - 1
        assert lrs[s] == pytest.approx(lr_at(s - 1, new))
    assert lrs[10] < lrs[7] < 0.01


def test_a_model_change_archives_and_names_the_command_that_continues_instead(finished, tmp_path):
    cfg, run, runs = copy(finished, tmp_path)
    r = fpa("train", str(cfg), runs, "model.n_layer=2")
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stderr.splitlines() if "training config changed" in ln)
    assert "keys the checkpoints depend on (model.n_layer 1 -> 2)" in line
    dest = Path(re.search(r"moved the previous checkpoints to (\S+) ", line).group(1))
    assert (dest / "checkpoints" / "global_step6").is_dir() and "resumed from" not in r.stdout
    cmd = suggested(r.stderr, "to continue the previous run instead: ")
    assert cmd[-2:] == ["model.n_layer=1", f"train.checkpoint.resume={dest / 'checkpoints'}"]
    assert "model.n_layer=2" not in cmd  # replaced, not left beside the old value
    back = fpa(*cmd)  # the suggested command goes on with the old run
    assert back.returncode == 0, back.stderr[-3000:]
    assert f"resumed from {dest / 'checkpoints' / 'global_step6'} at step 6" in back.stdout


def test_max_steps_below_the_latest_checkpoint_is_refused_with_the_command(finished, tmp_path):
    cfg, run, runs = copy(finished, tmp_path)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    r = fpa("train", str(cfg), runs, "train.max_steps=4")
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("fpa: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert errors[0].startswith("fpa: error: train.max_steps=4 but the latest checkpoint is at step 6")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # nothing moved
    cmd = suggested(errors[0], "to continue from global_step3, run ")
    assert cmd[-1] == f"train.checkpoint.resume={run / 'checkpoints' / 'global_step3'}"
    short = fpa(*cmd)
    assert short.returncode == 0, short.stderr[-3000:]
    assert json.loads((run / "manifests" / "train.json").read_text())["result"]["steps"] == 4
