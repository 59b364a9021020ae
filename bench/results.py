"""Result files under docs/results/<name>/: the figures a command measured plus where they came from.

Every result carries its provenance (the commit and whether the tree was dirty, the machine, the command,
the date), so a figure copied into the README can be traced to the code and machine that produced it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from pipeline.rundir import git_info

RESULTS_DIR = Path(__file__).resolve().parents[1] / "docs" / "results"


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """Commit, machine and command of the measurement being made now."""
    git = git_info()
    return {
        "commit": git.get("sha"),
        "dirty": git.get("dirty"),
        "command": shlex.join(["python", *(sys.argv if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }


def provenance_md(prov: dict[str, Any]) -> str:
    """Two lines for the top of a result's markdown: the command, and the commit and machine."""
    m = prov["machine"]
    commit = (prov["commit"] or "unknown")[:10] + (" (dirty tree)" if prov.get("dirty") else "")
    return (
        f"Command: `{prov['command']}`  \n"
        f"Commit {commit}, {prov['date']}; {m['cpu']}, {m['cores']} cores, torch {m['torch']} "
        f"({m['torch_threads']} threads)."
    )


def write_result(name: str, data: dict[str, Any], markdown: str, out_dir: Path | None = None) -> Path:
    """Write <out_dir or docs/results/name>/result.json (data + provenance) and result.md; return the dir."""
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    (out / "result.md").write_text(markdown.rstrip() + "\n")
    return out
