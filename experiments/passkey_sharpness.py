"""Is a run's passkey failure at long lengths attention dilution? The same trained weights evaluated with
every attention logit multiplied by s (the qk-norm gains scaled by sqrt(s)): if retrieval at 8x recovers
at a modest s, the heads found the needle but were not sharp enough to single it out among 8x more keys.

    python experiments/passkey_sharpness.py runs/demo.seed-0 runs/kind.kind-fpa.seed-0 --scales 1 1.25 1.5 2
    python experiments/passkey_sharpness.py runs/kind.* --scales 1        # log-n scaling off vs on, any kind

Each scale is measured with log-n scaling (model.attention.log_scale_length) off and on from the training
length (`--log-n both`, the default), or as the run was trained (`--log-n as-trained`). Full cache, the
run's own passkey grid (its eval keys). A scale other than 1 needs a run trained with qk-norm (the logit
scale is then the gains' product; without qk-norm the query and key norms are free and have no such cap).
Writes docs/results/passkey_sharpness/result.{json,md} (or --out) with the commit, machine and command.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from experiments.trained_run import TrainedRun, load_trained_run, passkey_by_length
from fpa_model.cache import EvictionPolicy
from pipeline.provenance import (
    finish_provenance,
    markdown_table,
    provenance,
    provenance_md,
    write_result,
)


def logit_scale(tr: TrainedRun) -> float | None:
    """The trained logit scale under qk-norm as a multiple of 1/sqrt(Dh): the mean over layers and heads of
    mean(q gains) x mean(k gains) (1 for a model whose gains never moved from their init of 1); None
    without qk-norm."""
    if tr.model.blocks[0].attn.q_norm is None:
        return None
    vals = [
        float(b.attn.q_norm.weight.detach().abs().mean()) * float(b.attn.k_norm.weight.detach().abs().mean())
        for b in tr.model.blocks
    ]
    return sum(vals) / len(vals)


@torch.no_grad()
def probe(tr: TrainedRun, scales: list[float], trials: int, log_n: list[int | None]) -> list[dict[str, Any]]:
    """Per scale s and log-n setting: the passkey accuracy per length with every logit x s and
    model.attention.log_scale_length set to the given value (None: off) in every layer. The model is left
    as it was found."""
    blocks = [b.attn for b in tr.model.blocks]
    norms = [n for a in blocks for n in (a.q_norm, a.k_norm) if n is not None]
    if any(s != 1.0 for s in scales) and not norms:
        raise SystemExit(f"{tr.path}: trained without qk-norm; only --scales 1 applies (no gains to scale)")
    saved = [n.weight.detach().clone() for n in norms]
    cfgs = [a.cfg for a in blocks]
    rows = []
    try:
        for length in log_n:
            for a, c in zip(blocks, cfgs):
                a.cfg = dataclasses.replace(c, log_scale_length=length)
            for s in scales:
                for n, w in zip(norms, saved):
                    n.weight.copy_(w * s**0.5)
                acc = passkey_by_length(tr, trials=trials, policy_for=lambda _: EvictionPolicy(enabled=False))
                rows.append(
                    {"scale": s, "log_n": length, "accuracy": {k: v["accuracy"] for k, v in acc.items()}}
                )
    finally:
        for n, w in zip(norms, saved):
            n.weight.copy_(w)
        for a, c in zip(blocks, cfgs):
            a.cfg = c
    return rows


def markdown(results: list[dict[str, Any]], prov: dict[str, Any]) -> str:
    lengths = results[0]["lengths"]
    head = ["run", "kind", "seed", "qk_norm_scale", "trained gains", "log-n", "logits x"]
    head += [f"acc. {n}" for n in lengths]
    lines = [
        "# Passkey accuracy with sharpened attention (same weights, every logit x s)",
        "",
        provenance_md(prov),
        "",
        "Full cache, the run's own eval keys and depths. 'qk_norm_scale': the logit scale the run was "
        "trained from (its config); 'trained gains': the learned gains' product at the end of training "
        "(mean over layers); 'log-n': log-n scaling at evaluation (model.attention.log_scale_length: off, "
        "or from the training length); 'logits x': the factor applied at evaluation only (1, with the "
        "run's own log-n setting: the run as trained and evaluated).",
        "",
    ]
    rows = []
    for r in results:
        for row in r["rows"]:
            gains = "-" if r["trained_scale"] is None else f"{r['trained_scale']:.2f}"
            cells = [r["run"], r["kind"], r["seed"], f"{r['qk_norm_scale']:g}", gains]
            cells += ["off" if row["log_n"] is None else f"from {row['log_n']}", f"{row['scale']:g}"]
            rows.append(cells + [f"{row['accuracy'][str(n)]:.2f}" for n in lengths])
    return "\n".join([*lines, markdown_table(head, rows)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="trained run directories")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 1.25, 1.5, 2.0])
    ap.add_argument(
        "--log-n",
        choices=["as-trained", "both"],
        default="both",
        help="both: every scale with log-n scaling off and from the training length (data.seq_len)",
    )
    ap.add_argument("--trials", type=int, default=None, help="keys per cell (default: the run's eval)")
    ap.add_argument("--out", type=Path, default=None, help="default: docs/results/passkey_sharpness")
    args = ap.parse_args(argv)
    if any(s <= 0 for s in args.scales):
        ap.error("--scales must be > 0")
    prov = provenance(None if argv is None else ["experiments/passkey_sharpness.py", *argv])
    torch.manual_seed(0)
    results = []
    for run in args.runs:
        tr = load_trained_run(run)
        trained = tr.model.cfg.attention.log_scale_length
        log_n = [trained] if args.log_n == "as-trained" else [None, tr.index.seq_len]
        rows = probe(tr, args.scales, args.trials or tr.cfg.eval.passkey.trials, log_n)
        results.append(
            {
                "run": run.name,
                "kind": tr.model.cfg.attention.kind,
                "log_scale_length": trained,
                "seed": tr.cfg.seed,
                "model_commit": tr.commit,
                "qk_norm_scale": tr.cfg.model.attention.qk_norm_scale,
                "trained_scale": logit_scale(tr),
                "lengths": tr.lengths,
                "rows": rows,
            }
        )
        for row in rows:
            print(run.name, row["log_n"], row["scale"], row["accuracy"], flush=True)
    finish_provenance(prov)
    md = markdown(results, prov)
    out = write_result("passkey_sharpness", {"provenance": prov, "runs": results}, md, args.out)
    print(md)
    print(f"wrote {out}/result.json and result.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
