"""Is a run's passkey failure at long lengths attention dilution? The same trained weights evaluated with
every attention logit multiplied by s (the qk-norm gains scaled by sqrt(s)): if retrieval at 8x recovers
at a modest s, the heads found the needle but were not sharp enough to single it out among 8x more keys.

    python bench/passkey_sharpness.py runs/demo.seed-0 runs/kind.kind-fpa.seed-0 --scales 1 1.25 1.5 2

Full cache, the run's own passkey grid (its eval keys). Needs runs trained with qk-norm (the logit scale
is then the gains' product; without qk-norm the query and key norms are free and have no such cap).
Writes docs/results/passkey_sharpness/result.{json,md} (or --out) with the commit, machine and command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import finish_provenance, provenance, provenance_md, write_result  # noqa: E402
from bench.trained_run import TrainedRun, load_trained_run, passkey_by_length  # noqa: E402
from fpa_model.cache import EvictionPolicy  # noqa: E402


def logit_scale(tr: TrainedRun) -> float:
    """The trained logit scale under qk-norm as a multiple of 1/sqrt(Dh): the mean over layers and heads of
    mean(q gains) x mean(k gains) (1 for a model whose gains never moved from their init of 1)."""
    vals = [
        float(b.attn.q_norm.weight.detach().abs().mean()) * float(b.attn.k_norm.weight.detach().abs().mean())
        for b in tr.model.blocks
    ]
    return sum(vals) / len(vals)


@torch.no_grad()
def probe(tr: TrainedRun, scales: list[float], trials: int) -> list[dict[str, Any]]:
    """Per scale s: the passkey accuracy per length with every logit x s (gains restored afterwards)."""
    norms = [n for b in tr.model.blocks for n in (b.attn.q_norm, b.attn.k_norm)]
    if any(n is None for n in norms):
        raise SystemExit(f"{tr.path}: trained without qk-norm; this probe scales the qk-norm gains")
    saved = [n.weight.detach().clone() for n in norms]
    rows = []
    try:
        for s in scales:
            for n, w in zip(norms, saved):
                n.weight.copy_(w * s**0.5)
            acc = passkey_by_length(tr, trials=trials, policy_for=lambda _: EvictionPolicy(enabled=False))
            rows.append({"scale": s, "accuracy": {k: v["accuracy"] for k, v in acc.items()}})
    finally:
        for n, w in zip(norms, saved):
            n.weight.copy_(w)
    return rows


def markdown(results: list[dict[str, Any]], prov: dict[str, Any]) -> str:
    lengths = results[0]["lengths"]
    head = ["run", "seed", "qk_norm_scale", "trained gains", "logits x", *(f"acc. {n}" for n in lengths)]
    lines = [
        "# Passkey accuracy with sharpened attention (same weights, every logit x s)",
        "",
        provenance_md(prov),
        "",
        "Full cache, the run's own eval keys and depths. 'qk_norm_scale': the logit scale the run was "
        "trained from (its config); 'trained gains': the learned gains' product at the end of training "
        "(mean over layers); 'logits x': the factor applied at evaluation only (1: the run as trained).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in results:
        for row in r["rows"]:
            cells = [r["run"], r["seed"], f"{r['qk_norm_scale']:g}", f"{r['trained_scale']:.2f}"]
            cells += [f"{row['scale']:g}"] + [f"{row['accuracy'][str(n)]:.2f}" for n in lengths]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="trained run directories (qk-norm models)")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 1.25, 1.5, 2.0])
    ap.add_argument("--trials", type=int, default=None, help="keys per cell (default: the run's eval)")
    ap.add_argument("--out", type=Path, default=None, help="default: docs/results/passkey_sharpness")
    args = ap.parse_args(argv)
    if any(s <= 0 for s in args.scales):
        ap.error("--scales must be > 0")
    prov = provenance(None if argv is None else ["bench/passkey_sharpness.py", *argv])
    torch.manual_seed(0)
    results = []
    for run in args.runs:
        tr = load_trained_run(run)
        rows = probe(tr, args.scales, args.trials or tr.cfg.eval.passkey.trials)
        results.append(
            {
                "run": run.name,
                "seed": tr.cfg.seed,
                "model_commit": tr.commit,
                "qk_norm_scale": tr.cfg.model.attention.qk_norm_scale,
                "trained_scale": logit_scale(tr),
                "lengths": tr.lengths,
                "rows": rows,
            }
        )
        for row in rows:
            print(run.name, row["scale"], row["accuracy"], flush=True)
    finish_provenance(prov)
    md = markdown(results, prov)
    out = write_result("passkey_sharpness", {"provenance": prov, "runs": results}, md, args.out)
    print(md)
    print(f"wrote {out}/result.json and result.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
