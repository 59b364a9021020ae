"""How long `make demo` takes a new user, and what it gives them: clone this repository's HEAD into a
scratch directory, run the README's first command there (venv, install, prepare, train, eval), time it, and
read the demo's own report.

    python bench/demo_time.py                    # make demo, DEMO_THREADS as the Makefile sets it
    python bench/demo_time.py --threads 1

The clone is of the committed HEAD (uncommitted changes are not in it). pip's download cache is used as
found, so a machine that never installed the dependencies also spends their download time. Writes
docs/results/demo_time/result.{json,md} (or --out) with the commit, machine and command.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

from bench.results import finish_provenance, provenance, provenance_md, write_result  # noqa: E402

REPORT = Path("runs/tiny/eval/report.json")  # where the demo's eval writes (configs/tiny.yaml: name tiny)


def run_demo(clone: Path, command: list[str], threads: int | None) -> tuple[float, int, str]:
    """(seconds, exit status, the last 3000 characters of its output) of `command` run in `clone`."""
    env = dict(os.environ)
    if threads is not None:
        env["DEMO_THREADS"] = str(threads)
    t0 = time.perf_counter()
    proc = subprocess.run(command, cwd=clone, env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, proc.returncode, (proc.stdout + proc.stderr)[-3000:]


def read_report(clone: Path) -> dict[str, Any]:
    """The demo's figures from its eval report."""
    report = json.loads((clone / REPORT).read_text())
    return {
        "passkey_accuracy_per_length": report.get("passkey_accuracy_per_length"),
        "passkey_accuracy_compressed_per_length": report.get("passkey_accuracy_compressed_per_length"),
        "cache_fraction_per_length": report.get("cache_fraction_per_length"),
        "final_val_loss": report.get("final_val_loss"),
    }


def markdown(data: dict[str, Any], prov: dict[str, Any]) -> str:
    r = data["report"]
    lengths = list(r["passkey_accuracy_per_length"] or {})
    compressed = r["passkey_accuracy_compressed_per_length"] or {}
    kept = r["cache_fraction_per_length"] or {}

    def row(label: str, values: dict[str, float], fmt: str) -> str:
        cells = [format(values[n], fmt) if n in values else "-" for n in lengths]
        return f"| {label} | " + " | ".join(cells) + " |"

    lines = [
        "# `make demo` on a fresh clone",
        "",
        provenance_md(prov),
        "",
        f"`{data['demo_command']}` in a fresh clone of commit {data['clone_commit'][:10]} "
        f"(DEMO_THREADS={data['threads'] if data['threads'] is not None else 'the Makefile default'}), venv "
        f"and install included: **{data['seconds']:.0f} s**. Its report: validation loss "
        f"{r['final_val_loss']:.4f}; passkey accuracy with the full and the evicting cache, and the cache "
        "kept, by length:",
        "",
        "| length | " + " | ".join(lengths) + " |",
        "|---" * (len(lengths) + 1) + "|",
        row("full cache", r["passkey_accuracy_per_length"], ".2f"),
        row("evicting cache", compressed, ".2f"),
        row("cache kept", kept, ".0%"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="DEMO_THREADS (default: the Makefile's)")
    ap.add_argument("--command", default="make demo", help="what to run in the clone (default: make demo)")
    ap.add_argument("--repo", type=Path, default=ROOT, help="the repository to clone (default: this one)")
    ap.add_argument("--out", type=Path, default=None, help="default: docs/results/demo_time")
    args = ap.parse_args(argv)
    prov = provenance(None if argv is None else ["bench/demo_time.py", *argv])
    with tempfile.TemporaryDirectory(prefix="fpa-demo-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "--quiet", str(args.repo), str(clone)], check=True)
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True, check=True
        ).stdout.strip()
        seconds, status, tail = run_demo(clone, shlex.split(args.command), args.threads)
        if status != 0 or not (clone / REPORT).is_file():
            print(tail, file=sys.stderr)
            raise SystemExit(f"`{args.command}` failed (exit {status}) or wrote no {REPORT}: see above")
        report = read_report(clone)
    finish_provenance(prov)
    data = {
        "demo_command": args.command,
        "clone_commit": sha,
        "threads": args.threads,
        "seconds": round(seconds, 1),
        "report": report,
        "provenance": prov,
    }
    md = markdown(data, prov)
    out = write_result("demo_time", data, md, args.out)
    print(md)
    print(f"wrote {out}/result.json and result.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
