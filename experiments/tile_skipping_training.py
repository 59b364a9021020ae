"""Two trained runs of one recipe, tile skipping off and on: their loss curves and wall times side by side.

    fpa train configs/tiny.yaml name=ts-base model.attention.block_size=32
    fpa train configs/tiny.yaml name=ts-skip model.attention.block_size=32 model.attention.skip_epsilon=1e-3
    python experiments/tile_skipping_training.py runs/ts-base runs/ts-skip

Reads each run's metrics.jsonl and train manifest (the code wrote both) and writes
docs/results/tile_skipping_training/result.{json,md} (or --result-dir): the validation loss at every
evaluation, the largest and mean train-loss difference over the steps, the final passkey loss, the
train stage's seconds, and the two runs' skip settings as their configs state them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from pipeline.provenance import finish_provenance, markdown_table, provenance, provenance_md, write_result


def read_run(run: Path) -> dict:
    metrics = run / "metrics.jsonl"
    manifest = run / "manifests" / "train.json"
    for f in (metrics, manifest):
        if not f.is_file():
            raise SystemExit(f"{run} is not a finished training run: {f} is missing")
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    man = json.loads(manifest.read_text())
    from pipeline.config import load_config

    cfg = load_config([run / "config.yaml"], [f"runs_dir={run.resolve().parent}", f"name={run.name}"])
    return {
        "run": str(run),
        "skip_epsilon": cfg.model.attention.skip_epsilon,
        "block_size": cfg.model.attention.block_size,
        "loss": {r["step"]: r["loss"] for r in rows if "loss" in r},
        "val": {r["step"]: r["val_loss"] for r in rows if "val_loss" in r},
        "passkey": {r["step"]: r["passkey_loss"] for r in rows if "passkey_loss" in r},
        "seconds": man["seconds"],
        "commit": man.get("git", {}).get("sha"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("off", type=Path, help="the run with skipping off")
    ap.add_argument("on", type=Path, help="the run with skipping on")
    ap.add_argument(
        "--result-dir", type=Path, default=None, help="default docs/results/tile_skipping_training"
    )
    args = ap.parse_args(argv)
    prov = provenance(["experiments/tile_skipping_training.py", *(sys.argv[1:] if argv is None else argv)])
    off, on = read_run(args.off), read_run(args.on)
    if off["skip_epsilon"] is not None or on["skip_epsilon"] is None:
        raise SystemExit(
            "the first run must have skipping off and the second on (model.attention.skip_epsilon)"
        )
    steps = sorted(set(off["loss"]) & set(on["loss"]))
    diffs = [abs(on["loss"][s] - off["loss"][s]) for s in steps]
    val_steps = sorted(set(off["val"]) & set(on["val"]))
    last = steps[-1]
    summary = {
        "steps": len(steps),
        "max_train_loss_diff": max(diffs),
        "mean_train_loss_diff": statistics.mean(diffs),
        "val": [{"step": s, "off": off["val"][s], "on": on["val"][s]} for s in val_steps],
        "passkey_final": {"off": off["passkey"].get(last), "on": on["passkey"].get(last)},
        "seconds": {"off": off["seconds"], "on": on["seconds"]},
    }
    finish_provenance(prov)
    md = "\n".join(
        [
            "# Training with tile skipping off and on: the same recipe, two runs",
            "",
            provenance_md(prov),
            "",
            f"Runs `{off['run']}` (skip_epsilon off) and `{on['run']}` "
            f"(skip_epsilon {on['skip_epsilon']:g}), "
            f"chunked block {on['block_size']}, trained at commits {str(off['commit'])[:10]} / "
            f"{str(on['commit'])[:10]}. Train loss over {len(steps)} steps: largest difference "
            f"{summary['max_train_loss_diff']:.3f}, mean {summary['mean_train_loss_diff']:.4f} (the runs "
            "part by float rounding from the first step with skipped tiles, then by the chaos of training).",
            "",
            markdown_table(
                ["step", "val loss off", "val loss on", "on - off"],
                [
                    [v["step"], f"{v['off']:.4f}", f"{v['on']:.4f}", f"{v['on'] - v['off']:+.4f}"]
                    for v in summary["val"]
                ],
            ),
            "",
            f"Final passkey loss {summary['passkey_final']['off']:.2e} off, "
            f"{summary['passkey_final']['on']:.2e} on; "
            f"train stage {off['seconds']:.0f} s off, {on['seconds']:.0f} s on "
            f"({on['seconds'] / off['seconds']:.2f}x).",
        ]
    )
    out = write_result(
        "tile_skipping_training",
        {"off": off, "on": on, "summary": summary, "provenance": prov},
        md,
        args.result_dir,
    )
    print(md)
    print(f"wrote {out}/result.json and result.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
