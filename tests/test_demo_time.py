"""bench/demo_time.py: clones the repository, runs the demo command in the clone, times it, and tabulates the
demo's own report; a failing command or a missing report is an error naming the command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import demo_time as dt  # noqa: E402

FAKE_DEMO = """
import json, os, pathlib, time
time.sleep(0.3)
out = pathlib.Path("runs/tiny/eval")
out.mkdir(parents=True)
threads = os.environ.get("DEMO_THREADS")
report = {
    "final_val_loss": 4.6123,
    "passkey_accuracy_per_length": {"256": 1.0, "2048": 0.96},
    "passkey_accuracy_compressed_per_length": {"256": 1.0, "2048": 0.92},
    "cache_fraction_per_length": {"256": 0.5, "2048": 0.27},
    "threads_seen": threads,
}
(out / "report.json").write_text(json.dumps(report))
"""


def _repo(tmp: Path) -> Path:
    repo = tmp / "repo"
    repo.mkdir()
    (repo / "demo.py").write_text(FAKE_DEMO)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "add", "demo.py"], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "demo"], check=True)
    return repo


def test_a_demo_run_in_a_fresh_clone_is_timed_and_tabulated(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    out = tmp_path / "out"
    argv = ["--repo", str(repo), "--command", f"{sys.executable} demo.py", "--threads", "3"]
    argv += ["--out", str(out)]
    assert dt.main(argv) == 0
    data = json.loads((out / "result.json").read_text())
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert data["clone_commit"] == sha.strip() and data["threads"] == 3 and data["seconds"] >= 0.3
    assert data["report"]["passkey_accuracy_per_length"] == {"256": 1.0, "2048": 0.96}
    md = (out / "result.md").read_text()
    assert "(DEMO_THREADS=3)" in md and "validation loss 4.6123" in md
    assert "| full cache | 1.00 | 0.96 |" in md and "| evicting cache | 1.00 | 0.92 |" in md
    assert "| cache kept | 50% | 27% |" in md
    assert not (repo / "runs").exists()  # the demo ran in the clone, not in the repository


def test_a_failing_demo_is_an_error_naming_the_command(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    with pytest.raises(SystemExit, match="`false` failed \\(exit 1\\)"):
        dt.main(["--repo", str(repo), "--command", "false", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
