"""Result files under docs/results/<name>/: the figures a command measured plus where they came from.

Every result carries its provenance (the commit and whether the tree was dirty, the machine, the command,
the date, the load average at its start and end), so a figure copied into the README can be traced to the
code and machine that produced it, and to how busy that machine was.
"""

from __future__ import annotations

from pipeline.provenance import (
    RESULTS_DIR,
    cpu_model,
    finish_provenance,
    markdown_table,
    provenance,
    provenance_md,
    write_result,
)

__all__ = [
    "RESULTS_DIR",
    "cpu_model",
    "finish_provenance",
    "markdown_table",
    "provenance",
    "provenance_md",
    "write_result",
]
