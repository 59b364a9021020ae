"""Where a measured figure came from: the commit (and whether the tree was dirty), the machine, the command
and the date. Result files under docs/results/ and a sweep's collected table carry it."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from pipeline.rundir import git_info


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(argv: list[str] | None = None, program: str = "python") -> dict[str, Any]:
    """Commit, machine and command of the measurement being made now (argv: sys.argv when None)."""
    git = git_info()
    return {
        "commit": git.get("sha"),
        "dirty": git.get("dirty"),
        "command": shlex.join([program, *(sys.argv if argv is None else argv)]),
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
