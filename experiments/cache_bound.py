"""How much of the KV cache each eviction threshold keeps, and what retrieval it leaves: the sound bound
(with the expected length as horizon, as `fpa eval` uses it, and without a horizon) beside fixed
thresholds, on the passkey grid of a trained run.

    python experiments/cache_bound.py --run runs/tiny          # after `make demo`
    python experiments/cache_bound.py --run runs/tiny --deltas 2 4 6 8 --trials 10

Writes docs/results/cache_bound/result.{json,md} (or --out) with the commit, machine and command.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from experiments.trained_run import load_trained_run, passkey_by_length
from fpa_model.cache import EvictionPolicy
from pipeline.provenance import provenance, provenance_md, write_result


def policies(margin: float, norm_slack: float, deltas: list[float]) -> list[tuple[str, dict[str, Any]]]:
    """(label, EvictionPolicy keywords without max_tokens; "horizon" says whether to pass the length)."""
    out: list[tuple[str, dict[str, Any]]] = [
        ("full cache", {"enabled": False, "horizon": False}),
        (f"sound, horizon = length (margin {margin:g})", {"enabled": True, "horizon": True}),
        (f"sound, no horizon (margin {margin:g})", {"enabled": True, "horizon": False}),
    ]
    out += [
        (f"fixed delta = {d:g} (no guarantee)", {"enabled": True, "delta": d, "horizon": False})
        for d in deltas
    ]
    for _, kw in out:
        kw.setdefault("delta", None)
        kw.update(margin=margin, norm_slack=norm_slack)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=Path("runs/tiny"), help="a trained run directory")
    ap.add_argument("--deltas", type=float, nargs="*", default=[0.5, 2.0, 4.0, 8.0])
    ap.add_argument("--trials", type=int, default=None, help="prompts per cell (default: the run's eval)")
    ap.add_argument("--margin", type=float, default=None, help="default: the run's eval.cache.margin")
    ap.add_argument("--out", type=Path, default=None, help="default: docs/results/cache_bound")
    args = ap.parse_args(argv)

    tr = load_trained_run(args.run)
    model, index, cc = tr.model, tr.index, tr.cfg.eval.cache
    pk, lengths, depths = tr.cfg.eval.passkey, tr.lengths, tr.depths
    if model.cfg.attention.kind == "softmax":
        ap.error("softmax attention never evicts: pick an fpa or fox run")
    margin = cc.margin if args.margin is None else args.margin
    trials = args.trials or pk.trials
    torch.manual_seed(0)

    rows = []
    for label, kw in policies(margin, cc.norm_slack, args.deltas):
        horizon = kw.pop("horizon")
        t0 = time.time()
        per_length = passkey_by_length(
            tr,
            trials=trials,
            policy_for=lambda n, kw=kw, h=horizon: EvictionPolicy(**kw, max_tokens=n if h else None),
        )
        rows.append({"policy": label, **kw, "horizon": horizon, "per_length": per_length})
        print(
            f"{label:45s} "
            + "  ".join(f"{L}: {v['accuracy']:.2f} / {v['kept']:.0%}" for L, v in per_length.items())
            + f"  ({time.time() - t0:.0f} s)",
            flush=True,
        )

    prov = provenance(None if argv is None else ["experiments/cache_bound.py", *argv])
    data = {
        "run": str(args.run),
        # The commit the model was trained at (its train manifest); provenance has the bench's own.
        "model_commit": tr.commit,
        "kind": model.cfg.attention.kind,
        "seq_len": index.seq_len,
        "lengths": lengths,
        "depths": depths,
        "trials_per_cell": trials,
        "digits": pk.digits,
        "margin": margin,
        "norm_slack": cc.norm_slack,
        "prefill_chunk": cc.prefill_chunk,
        "rows": rows,
        "provenance": prov,
    }
    head = "| eviction threshold | " + " | ".join(f"{L} ({L // index.seq_len}x)" for L in lengths) + " |"
    lines = [
        "# KV-cache eviction: passkey accuracy / cache kept, by threshold",
        "",
        provenance_md(prov),
        "",
        f"Run `{args.run}` ({model.cfg.attention.kind}, trained at {(data['model_commit'] or '?')[:10]}), "
        f"{trials} prompts x {len(depths)} depths per length, "
        f"{pk.digits}-digit keys, prefill chunks of {cc.prefill_chunk}. Each cell: accuracy / fraction of "
        "the cache kept at the end of the prompt (mean over heads, layers and prompts).",
        "",
        head,
        "|---" * (len(lengths) + 1) + "|",
    ]
    last = str(lengths[-1])
    lines_layers = [
        "",
        f"Kept per layer at {last} tokens: "
        + "; ".join(
            f"{r['policy'].split(' (')[0]}: "
            + ", ".join(f"{f:.0%}" for f in r["per_length"][last]["kept_per_layer"])
            for r in rows
        ),
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | "
            + " | ".join(f"{v['accuracy']:.2f} / {v['kept']:.0%}" for v in r["per_length"].values())
            + " |"
        )
    out = write_result("cache_bound", data, "\n".join(lines + lines_layers), args.out)
    print(f"wrote {out}/result.json and result.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
