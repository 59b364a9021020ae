"""experiments/passkey_trials.py reads a run's own files: the recipe, when the passkey loss fell, its
accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from experiments import passkey_trials as pt


def _run(tmp: Path, losses: list[float], report: dict | None) -> Path:
    run = tmp / "trial.s3"
    run.mkdir()
    cfg = {"seed": 3, "model": {"attention": {"kv_shift": True, "qk_norm": False, "block_size": 64}}}
    cfg["data"] = {"seq_len": 256}
    passkey = {"min_len": 64, "max_len": None, "digits": 5}
    cfg["train"] = {"max_steps": len(losses), "lr": 0.003, "passkey": passkey}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [json.dumps({"step": i + 1, "loss": 5.0, "passkey_loss": v}) for i, v in enumerate(losses)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "git.json").write_text(json.dumps({"sha": "0123456789abcdef", "dirty": False}))
    if report is not None:
        (run / "eval").mkdir()
        (run / "eval" / "report.json").write_text(json.dumps(report))
    return run


def test_solved_step_is_the_first_window_mean_below_the_threshold():
    losses = [(s, 1.0) for s in range(1, 21)] + [(s, 0.05) for s in range(21, 41)]
    # the 10-step mean drops below 0.1 once 10 of the last 10 are 0.05 ... at step 30 (mean 0.05);
    # at step 29 one step of 1.0 is still in the window (mean 0.145)
    assert pt.solved_step(losses) == 30
    assert pt.solved_step([(s, 0.5) for s in range(1, 50)]) is None


def test_a_run_row_and_its_table_line(tmp_path):
    run = _run(
        tmp_path, [1.15] * 30 + [0.01] * 20, {"passkey_accuracy_per_length": {"256": 1.0, "2048": 0.8}}
    )
    row = pt.read_run(run)
    assert row["seed"] == 3 and row["kv_shift"] is True and row["qk_norm"] is False
    assert row["prompts"] == "64-256" and row["ramp"] == 0 and row["commit"] == "0123456789"
    assert row["last_step"] == 50 and row["solved_at"] == 40
    md = pt.markdown([row], pt.provenance())
    cells = "trial.s3 | 3 | True | False | 1.0 | - | 50 | 0.003 | 5 | 64-256 | 0 | 64 | 0123456789 | 50 | 40"
    cells += " | 1.00 | 0.80"
    assert f"| {cells} |" in md


def test_a_stopped_run_has_no_accuracy_and_a_non_run_is_refused(tmp_path):
    (tmp_path / "b").mkdir()
    row = pt.read_run(_run(tmp_path / "b", [1.1] * 5, None))
    assert row["accuracy"] is None and row["solved_at"] is None
    with pytest.raises(SystemExit, match="not a run directory"):
        pt.read_run(tmp_path)
