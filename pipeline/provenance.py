"""Where a measured figure came from: the commit (and whether the tree was dirty), the machine, the command,
the date and the machine's load around the measurement. Result files under docs/results/ and a sweep's
collected table carry it.

    prov = provenance()          # at the start of a measurement: load average now
    ...                          # measure
    finish_provenance(prov)      # at its end: load average then (shown in provenance_md's header line)

The load average matters on a shared machine: a benchmark that ran beside other jobs says so.
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

from pipeline.atomic import atomic_write_text
from pipeline.rundir import git_info

# The repository this package was installed from (editable): result files live under its docs/results.
ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "docs" / "results"


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages of the machine (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def provenance(argv: list[str] | None = None, program: str = "python") -> dict[str, Any]:
    """Commit, machine and command of the measurement being made now (argv: sys.argv when None)."""
    git = git_info()
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).is_absolute() and Path(argv[0]).is_relative_to(ROOT):
        argv[0] = str(Path(argv[0]).relative_to(ROOT))  # `python -m experiments.x` gives an absolute path
    return {
        "commit": git.get("sha"),
        "dirty": git.get("dirty"),
        "command": shlex.join([program, *argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "load_average": {"start": load_average(), "end": None},
    }


def finish_provenance(prov: dict[str, Any]) -> dict[str, Any]:
    """Record the load average at the end of the measurement that `prov` (from provenance()) started."""
    prov.setdefault("load_average", {"start": None})["end"] = load_average()
    return prov


def _load_md(prov: dict[str, Any]) -> str:
    """'; load average 2.10 at start, 2.40 at end (1 min)' once the end is recorded, else ''."""
    load = prov.get("load_average") or {}
    start, end = load.get("start"), load.get("end")
    if not start or not end:
        return ""
    return f"; load average {start[0]:.2f} at start, {end[0]:.2f} at end (1 min)"


def markdown_table(header: list[Any], rows: list[list[Any]]) -> str:
    """A markdown table (no trailing newline) of the result files and sweep tables; cells go through str()
    and a "|" inside one is escaped."""
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def provenance_md(prov: dict[str, Any]) -> str:
    """Two lines for the top of a result's markdown: the command, and the commit and machine (and the load
    average at the start and end of the measurement, once finish_provenance recorded the end)."""
    m = prov["machine"]
    commit = (prov["commit"] or "unknown")[:10] + (" (dirty tree)" if prov.get("dirty") else "")
    return (
        f"Command: `{prov['command']}`  \n"
        f"Commit {commit}, {prov['date']}; {m['cpu']}, {m['cores']} cores, torch {m['torch']} "
        f"({m['torch_threads']} threads){_load_md(prov)}."
    )


def write_result(name: str, data: dict[str, Any], markdown: str, out_dir: Path | None = None) -> Path:
    """Write <out_dir or docs/results/name>/result.json (data + provenance) and result.md; return the dir."""
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR / name
    atomic_write_text(out / "result.json", json.dumps(data, indent=2, sort_keys=False) + "\n")
    atomic_write_text(out / "result.md", markdown.rstrip() + "\n")
    return out
