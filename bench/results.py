"""Result files under docs/results/<name>/: the figures a command measured plus where they came from.

Every result carries its provenance (the commit and whether the tree was dirty, the machine, the command,
the date, the load average at its start and end), so a figure copied into the README can be traced to the
code and machine that produced it, and to how busy that machine was.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.provenance import cpu_model, finish_provenance, markdown_table, provenance, provenance_md

__all__ = [
    "RESULTS_DIR",
    "cpu_model",
    "finish_provenance",
    "markdown_table",
    "provenance",
    "provenance_md",
    "write_result",
]

RESULTS_DIR = Path(__file__).resolve().parents[1] / "docs" / "results"


def write_result(name: str, data: dict[str, Any], markdown: str, out_dir: Path | None = None) -> Path:
    """Write <out_dir or docs/results/name>/result.json (data + provenance) and result.md; return the dir."""
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    (out / "result.md").write_text(markdown.rstrip() + "\n")
    return out
