"""Passkey-recipe trials: how fast, and how well, trained runs learned passkey retrieval, read from the runs.

    python experiments/passkey_trials.py runs/kind.kind-fpa.seed-0 runs/trial.* [--out DIR]

For each run directory (a full `fpa run`, or a training stopped early): the recipe it was trained with (the
config keys that decide passkey learning, read from its config.yaml), the seed, the commit it was trained
at, the last step it reached, the first step at which the passkey loss (metrics.jsonl, mean over 10 steps)
fell below 0.1, and, when the run was evaluated, its passkey accuracy per length (full cache). Nothing is
re-run: the table is what the runs recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.provenance import (
    finish_provenance,
    markdown_table,
    provenance,
    provenance_md,
    write_result,
)
from pipeline.rundir import stage_commit

SOLVED, WINDOW = 0.1, 10
RECIPE = {  # column: dotted config key
    "kv_shift": "model.attention.kv_shift",
    "qk_norm": "model.attention.qk_norm",
    "qk scale": "model.attention.qk_norm_scale",
    "log-n from": "model.attention.log_scale_length",
    "steps": "train.max_steps",
    "lr": "train.lr",
    "digits": "train.passkey.digits",
    "prompts": "train.passkey.max_len",
    "ramp": "train.passkey.ramp_steps",
    "tile": "model.attention.block_size",  # the chunked path's tile: changes float rounding only
}


def _get(cfg: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def solved_step(losses: list[tuple[int, float]]) -> int | None:
    """The first step at which the mean passkey loss over the last WINDOW logged steps is below SOLVED."""
    for i in range(WINDOW - 1, len(losses)):
        window = [v for _, v in losses[i - WINDOW + 1 : i + 1]]
        if sum(window) / WINDOW < SOLVED:
            return losses[i][0]
    return None


def read_run(run: Path) -> dict[str, Any]:
    import yaml  # PyYAML: a dependency of omegaconf

    if not (run / "config.yaml").is_file() or not (run / "metrics.jsonl").is_file():
        raise SystemExit(f"{run}: not a run directory (config.yaml and metrics.jsonl are needed)")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [(r["step"], r["passkey_loss"]) for r in records if "passkey_loss" in r]
    row: dict[str, Any] = {"run": run.name, "seed": cfg.get("seed")}
    row.update({col: _get(cfg, key) for col, key in RECIPE.items()})
    if row["prompts"] is None:
        row["prompts"] = _get(cfg, "data.seq_len")
    row["prompts"] = f"{_get(cfg, 'train.passkey.min_len')}-{row['prompts']}"
    row["commit"] = (stage_commit(run, "train") or "?")[:10]
    row["last_step"] = max((r["step"] for r in records if "step" in r), default=0)
    row["solved_at"] = solved_step(losses)
    report = run / "eval" / "report.json"
    row["ramp"] = row["ramp"] or 0  # a config from before the key: no ramp
    row["qk scale"] = row["qk scale"] or 1.0  # before the key: the plain 1/sqrt(Dh)
    row["log-n from"] = row["log-n from"] or "-"  # off (or before the key)
    acc = json.loads(report.read_text()).get("passkey_accuracy_per_length") if report.is_file() else None
    row["accuracy"] = acc
    return row


def markdown(rows: list[dict[str, Any]], prov: dict[str, Any]) -> str:
    lengths = sorted({int(k) for r in rows if r["accuracy"] for k in r["accuracy"]})
    head = ["run", "seed", *RECIPE, "trained at", "last step", f"passkey loss < {SOLVED} at"]
    head += [f"acc. {n}" for n in lengths]
    lines = [
        "# Passkey-recipe trials",
        "",
        provenance_md(prov),
        "",
        "Read from the runs' own files (config.yaml, metrics.jsonl, eval/report.json). "
        f"'passkey loss < {SOLVED} at': the first step at which the mean passkey loss over {WINDOW} steps "
        f"fell below {SOLVED} ('-': not by its last step); accuracy: exact match of the key (of 'digits' "
        "digits), full cache, 25 prompts per length ('-': the run was stopped before its eval).",
        "",
    ]
    table = []
    for r in rows:
        acc = r["accuracy"] or {}
        cells = [r["run"], r["seed"], *(r[c] for c in RECIPE), r["commit"], r["last_step"]]
        cells += [r["solved_at"] if r["solved_at"] is not None else "-"]
        table.append(cells + [f"{acc[str(n)]:.2f}" if str(n) in acc else "-" for n in lengths])
    return "\n".join([*lines, markdown_table(head, table)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="default docs/results/passkey_trials")
    args = ap.parse_args()
    prov = provenance()
    rows = [read_run(run) for run in args.runs]
    finish_provenance(prov)
    md = markdown(rows, prov)
    out = write_result("passkey_trials", {"provenance": prov, "rows": rows}, md, args.out)
    print(md)
    print(f"wrote {out}/result.json and result.md", file=sys.stderr)


if __name__ == "__main__":
    main()
