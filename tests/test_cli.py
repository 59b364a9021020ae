"""The `fpa` entry point: help, bad input as one-line errors with nothing written, print-config."""

import subprocess
import sys
from pathlib import Path

import pytest

from launch.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ["prepare", "train", "eval", "run", "launch", "sweep", "export", "print-config", "synthetic"]


def fpa(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


def test_help_lists_every_subcommand() -> None:
    text = build_parser().format_help()
    for name in SUBCOMMANDS:
        assert name in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "missing.yaml"], "fpa: error: config file not found: missing.yaml"),
        (["prepare", "{tiny}", "data.seq_lenn=3"], "unknown config key 'data.seq_lenn'"),
        (["train", "{tiny}", "train.max_steps=lots"], "bad value for 'train.max_steps'"),
        (["run", "{tiny}", "model.attention.kind=rnn"], "model.attention.kind must be one of"),
        (["eval", "{tiny}", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    args = [a.replace("{tiny}", str(ROOT / "configs/tiny.yaml")) for a in args]
    r = fpa(*args, f"runs_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.startswith("fpa")]) == 1
    assert not (tmp_path / "runs").exists()


def test_print_config_resolves_overrides(capsys: pytest.CaptureFixture) -> None:
    assert main(["print-config", str(ROOT / "configs/tiny.yaml"), "train.lr=0.5", "--derived"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.5" in out
    assert "global_batch=8" in out  # micro 8 x accum 1 x 1 rank


def test_options_may_follow_overrides(capsys: pytest.CaptureFixture) -> None:
    assert (
        main(
            [
                "print-config",
                str(ROOT / "configs/tiny.yaml"),
                "--derived",
                "train.grad_accum=2",
                "--world-size",
                "2",
            ]
        )
        == 0
    )
    assert "global_batch=32" in capsys.readouterr().out
