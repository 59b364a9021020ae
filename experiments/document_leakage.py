"""How much attention leaks into earlier documents of a packed window, by distance from the boundary, in
models trained without the document mask; and whether FPA (or FoX) learned to erase at the eod token.

    python experiments/document_leakage.py runs/kind.kind-*  [--splits validation wiki]
        [--windows 184] [--out docs/results/document_leakage]

For every unmasked run (config.yaml and export/), the first `--windows` windows of each split (the
training length, in stored order: the packing training saw) go through the exported model layer by
layer; each layer's attention probabilities are rebuilt from its q, k and bias (fpa_bias_naive, the
oracle) and checked against the model's own attention op. For a query i in the window's document d >= 1
(documents before it lie in the same window), the leak is the probability mass on keys before d's
start, binned by i's distance from that start (0 = the first token after the eod). The `uniform` column
is what attention spread evenly over the causal keys would leak at the same queries.

The eod erasure (fpa and fox): the boundary bias, at each distance i - j = 1..16 the mean b_ij over pairs
that cross the boundary minus the mean over pairs inside one document, averaged over the distances, on
queries and keys that are not eod tokens (a head may keep the eod itself alive as a sink). Negative:
the field dips at the boundary and erases the earlier document (exp of it is the factor on those keys'
weights); 0 for a field that decays at a constant rate. The eod increment: (mean u at eod tokens - mean
u elsewhere) / std of u elsewhere, per head.
Seeds of a kind give mean +- std; the plot is the leak by distance, one colour per kind.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_prep.loader import document_segments
from experiments.trained_run import load_trained_run
from fpa_model.model import GPT
from fpa_model.ops.fpa.naive import fpa_bias_naive
from fpa_model.ops.fpa.segments import document_positions
from pipeline.evaluation.perplexity import validation_stream
from pipeline.provenance import finish_provenance, markdown_table, provenance, provenance_md, write_result

BINS = [(0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 127), (128, 255)]
NEAR = 16  # pairs up to this distance measure the boundary bias
KIND_ORDER = ("fpa", "fox", "softmax")


def bin_label(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


@torch.no_grad()
def layer_probabilities(model: GPT, idx: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per layer: attention probabilities P (B,H,T,T), bias b (None for softmax) and increments u (B,H,T),
    from a forward pass that runs the model's blocks; P . v is checked against the model's attention op."""
    x = model.embed(idx)
    out = []
    for block in model.blocks:
        attn = block.attn
        h = block.norm1(x)
        q, k, v, u = attn.project(h)
        phi = attn.field_from_increments(u)
        logits = torch.einsum("bhid,bhjd->bhij", q.float(), k.float()) / math.sqrt(q.shape[-1])
        t = idx.shape[1]
        if phi is None:
            bias = torch.zeros(t, t).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        else:
            bias = fpa_bias_naive(phi, attn.spec)
        p = torch.softmax(logits + bias, dim=-1)
        o = attn.attend(q, k, v, phi)
        mine = torch.einsum("bhij,bhjd->bhid", p, v.float())
        err = float((mine - o.float()).abs().max() / o.float().abs().max().clamp_min(1e-12))
        if err > 1e-3:
            raise RuntimeError(f"rebuilt attention differs from the model's op by {err:.1e} (relative)")
        out.append({"p": p, "bias": None if phi is None else bias, "u": u})
        x = x + attn.output(o.to(h.dtype), h)
        x = x + block.mlp(block.norm2(x))
    return out


def window_stats(model: GPT, windows: torch.Tensor, eod: int, batch: int = 16) -> dict[str, Any]:
    """Sums for one run over windows (N, T): leak mass and uniform leak per (layer, bin), and per (layer,
    head) the boundary-bias and eod-increment sums (see the module docstring)."""
    n_layer, n_head = len(model.blocks), model.blocks[0].attn.n_head
    nb = len(BINS)
    leak = np.zeros((n_layer, nb))
    uniform = np.zeros(nb)
    count = np.zeros(nb)
    # Per distance d = i - j in 1..NEAR: sum of b and pairs, across the boundary and inside one document.
    cross = np.zeros((n_layer, n_head, NEAR, 2))
    inside = np.zeros((n_layer, n_head, NEAR, 2))
    u_eod = [[[] for _ in range(n_head)] for _ in range(n_layer)]
    u_rest = [[[] for _ in range(n_head)] for _ in range(n_layer)]
    for s in range(0, windows.shape[0], batch):
        idx = windows[s : s + batch]
        seg = document_segments(idx, eod)
        t = idx.shape[1]
        pos = torch.arange(t).expand_as(idx)
        start = pos - document_positions(seg)  # each query's document start
        later = seg > 0  # queries with an earlier document inside the window
        dist = pos - start
        key = torch.arange(t)
        before = key[None, None, :] < start[:, :, None]  # (B, Tq, Tk): keys of earlier documents
        gap = pos[:, :, None] - key[None, None, :]
        same = seg[:, :, None] == seg[:, None, :]
        content = idx != eod  # the boundary bias is read between non-eod tokens (an eod may be a sink)
        for li, layer in enumerate(layer_probabilities(model, idx)):
            mass = (layer["p"] * before[:, None]).sum(-1).mean(1)  # (B, T): mean over heads
            for bi, (lo, hi) in enumerate(BINS):
                sel = later & (dist >= lo) & (dist <= hi)
                leak[li, bi] += float(mass[sel].sum())
                if li == 0:
                    count[bi] += float(sel.sum())
                    uniform[bi] += float((start[sel].float() / (pos[sel].float() + 1)).sum())
            if layer["bias"] is not None:
                b = layer["bias"]
                for d in range(1, NEAR + 1):
                    at = (gap == d) & content[:, :, None] & content[:, None, :]
                    for m, acc in ((at & ~same, cross), (at & same, inside)):
                        mm = m[:, None].expand_as(b)
                        acc[li, :, d - 1, 0] += torch.where(mm, b, 0.0).sum((0, 2, 3)).double().numpy()
                        acc[li, :, d - 1, 1] += mm.sum((0, 2, 3)).double().numpy()
                is_eod = idx == eod
                for hd in range(n_head):
                    uh = layer["u"][:, hd].float()
                    u_eod[li][hd].append(uh[is_eod].numpy())
                    u_rest[li][hd].append(uh[~is_eod].numpy())
    res: dict[str, Any] = {
        "queries": count.tolist(),
        "leak": (leak / np.maximum(count, 1)).tolist(),  # (layer, bin)
        "uniform": (uniform / np.maximum(count, 1)).tolist(),
    }
    both = (cross[0, 0, :, 1] > 0) & (inside[0, 0, :, 1] > 0)  # distances with pairs of both sorts
    if both.any():
        diff = cross[..., 0] / np.maximum(cross[..., 1], 1) - inside[..., 0] / np.maximum(inside[..., 1], 1)
        res["boundary_bias"] = diff[..., both].mean(-1).tolist()  # (layer, head): mean over distances
        z = np.zeros((n_layer, n_head))
        for li in range(n_layer):
            for hd in range(n_head):
                e, r = np.concatenate(u_eod[li][hd]), np.concatenate(u_rest[li][hd])
                z[li, hd] = (e.mean() - r.mean()) / max(r.std(), 1e-12) if e.size else float("nan")
        res["eod_increment_z"] = z.tolist()
    return res


def mean_std(values: list[float]) -> str:
    a = np.asarray(values, dtype=float)
    return f"{a.mean():.3f} ± {a.std(ddof=1) if a.size > 1 else 0.0:.3f}"


def summarize(runs: list[dict[str, Any]], split: str) -> tuple[list[str], dict[str, Any]]:
    """Markdown lines and the per-kind summary of one split."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_kind.setdefault(r["kind"], []).append(r)
    kinds = [k for k in KIND_ORDER if k in by_kind] + sorted(set(by_kind) - set(KIND_ORDER))
    labels = [bin_label(*b) for b in BINS]
    first = runs[0]["splits"][split]
    keep = [i for i, c in enumerate(first["queries"]) if c > 0]
    summary: dict[str, Any] = {}
    rows = []
    for kind in kinds:
        per_seed = [np.mean(r["splits"][split]["leak"], axis=0) for r in by_kind[kind]]  # mean over layers
        arr = np.stack(per_seed)
        overall = [
            float(np.dot(s, first["queries"]) / max(sum(first["queries"]), 1)) for s in per_seed
        ]  # weighted by queries per bin
        summary[kind] = {
            "seeds": [r["seed"] for r in by_kind[kind]],
            "leak_by_distance_mean": arr.mean(0).tolist(),
            "leak_by_distance_std": (arr.std(0, ddof=1) if len(arr) > 1 else np.zeros(arr.shape[1])).tolist(),
            "leak_overall": overall,
        }
        rows.append([kind, len(per_seed)] + [mean_std(arr[:, i]) for i in keep] + [mean_std(overall)])
    uni = first["uniform"]
    rows.append(
        ["uniform attention", "-"]
        + [f"{uni[i]:.3f}" for i in keep]
        + [f"{float(np.dot(uni, first['queries']) / max(sum(first['queries']), 1)):.3f}"]
    )
    lines = [
        f"### {split}: attention mass on earlier documents, by distance from the document start",
        "",
        "Queries per distance bin: "
        + ", ".join(f"{labels[i]}: {int(first['queries'][i])}" for i in keep)
        + " "
        "(queries with an earlier document in their window). Mean over layers and heads; mean ± std over "
        "seeds.",
        "",
        markdown_table(["kind", "seeds"] + [labels[i] for i in keep] + ["all"], rows),
        "",
    ]
    field_rows = []
    for kind in kinds:
        runs_k = [r["splits"][split] for r in by_kind[kind] if "boundary_bias" in r["splits"][split]]
        if not runs_k:
            continue
        bb = np.stack([np.asarray(r["boundary_bias"]) for r in runs_k])  # (seed, layer, head)
        zz = np.stack([np.asarray(r["eod_increment_z"]) for r in runs_k])
        summary[kind]["boundary_bias_mean_head"] = bb.mean((1, 2)).tolist()
        summary[kind]["boundary_bias_strongest_head"] = bb.min((1, 2)).tolist()
        summary[kind]["eod_increment_z_mean_head"] = zz.mean((1, 2)).tolist()
        summary[kind]["eod_increment_z_lowest_head"] = zz.min((1, 2)).tolist()
        summary[kind]["heads_erasing"] = [int((b < -1.0).sum()) for b in bb]  # boundary bias below -1
        field_rows.append([
            kind,
            mean_std(bb.mean((1, 2))),
            mean_std(bb.min((1, 2))),
            f"{np.mean(summary[kind]['heads_erasing']):.1f} of {bb.shape[1] * bb.shape[2]}",
            mean_std(zz.mean((1, 2))),
            mean_std(zz.min((1, 2))),
        ])  # fmt: skip
    if field_rows:
        lines += [
            f"### {split}: erasure at the end-of-document token",
            "",
            "Boundary bias: at each distance 1..16, mean b_ij over pairs across the boundary minus the "
            "mean over pairs inside one document, averaged over the distances (queries and keys other "
            "than eod tokens); the eod increment z: (mean u at eod - mean u elsewhere) / std. Heads "
            "erasing: boundary bias below -1 (the earlier document's keys weighted by under e^-1).",
            "",
            markdown_table(
                [
                    "kind",
                    "boundary bias (mean head)",
                    "strongest head",
                    "heads erasing",
                    "eod z (mean head)",
                    "eod z (lowest head)",
                ],
                field_rows,
            ),  # fmt: skip
            "",
        ]
    return lines, summary


def plot(summaries: dict[str, dict[str, Any]], runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(summaries)
    fig, axes = plt.subplots(1, len(splits), figsize=(5.2 * len(splits), 3.8), squeeze=False)
    colours = {"fpa": "tab:blue", "fox": "tab:orange", "softmax": "tab:green"}
    for ax, split in zip(axes[0], splits):
        first = runs[0]["splits"][split]
        keep = [i for i, c in enumerate(first["queries"]) if c > 0]
        xs = [0.5 * (BINS[i][0] + BINS[i][1]) + 1 for i in keep]  # +1: distance 0 on a log axis
        for kind, s in summaries[split].items():
            m, sd = np.asarray(s["leak_by_distance_mean"])[keep], np.asarray(s["leak_by_distance_std"])[keep]
            ax.plot(xs, m, "o-", color=colours.get(kind), label=f"{kind} ({len(s['seeds'])} seeds)")
            ax.fill_between(xs, m - sd, m + sd, color=colours.get(kind), alpha=0.2)
        ax.plot(xs, np.asarray(first["uniform"])[keep], "k--", label="uniform attention")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("distance from the document start + 1 (tokens)")
        ax.set_ylabel("attention mass on earlier documents")
        ax.set_title(split)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="trained runs without the document mask")
    ap.add_argument("--splits", nargs="+", default=["validation", "wiki"])
    ap.add_argument("--windows", type=int, default=184, help="windows per split (validation holds 184)")
    ap.add_argument("--out", type=Path, default=None, help="default: docs/results/document_leakage")
    args = ap.parse_args(argv)
    prov = provenance(None if argv is None else ["experiments/document_leakage.py", *argv])
    torch.manual_seed(0)

    runs = []
    for path in args.runs:
        tr = load_trained_run(path)
        if tr.model.cfg.attention.document_mask:
            ap.error(f"{path} was trained with the document mask: it attends inside its documents only")
        eod, seq = tr.index.eod_id, tr.index.seq_len
        entry: dict[str, Any] = {
            "run": str(path), "kind": tr.model.cfg.attention.kind, "seed": tr.cfg.seed,
            "model_commit": tr.commit, "splits": {},
        }  # fmt: skip
        for split in args.splits:
            stream = validation_stream(tr.cfg.data_dir, args.windows * seq, split)
            n = stream.size // seq
            if n == 0:
                ap.error(f"{path}: split {split!r} holds no window of {seq} tokens")
            windows = torch.from_numpy(stream[: n * seq].reshape(n, seq))
            entry["splits"][split] = {"windows": n, **window_stats(tr.model, windows, eod)}
        runs.append(entry)
        overall = {s: np.mean(entry["splits"][s]["leak"]) for s in args.splits}
        print(f"{path}: {entry['kind']} seed {entry['seed']}: " + ", ".join(
            f"{s} mean leak by bin {v:.3f}" for s, v in overall.items()), flush=True)  # fmt: skip

    finish_provenance(prov)
    lines = [
        "# Attention leakage between packed documents (models trained without the document mask)",
        "",
        provenance_md(prov),
        "",
        "Runs: " + ", ".join(f"`{r['run']}`" for r in runs) + " (trained at "
        f"{', '.join(sorted({(r['model_commit'] or '?')[:10] for r in runs}))}). The first {args.windows} "
        f"windows of {seq} tokens of each split, as packed for training.",
        "",
    ]
    summaries = {}
    for split in args.splits:
        md, summaries[split] = summarize(runs, split)
        lines += md
    data = {
        "bins": [list(b) for b in BINS], "near": NEAR, "windows": args.windows, "splits": args.splits,
        "summary": summaries, "runs": runs, "provenance": prov,
    }  # fmt: skip
    out = write_result("document_leakage", data, "\n".join(lines), args.out)
    plot(summaries, runs, out / "leakage.png")
    lines.append("![leakage by distance](leakage.png)")
    write_result("document_leakage", data, "\n".join(lines), out)
    print(f"wrote {out}/result.json, result.md and leakage.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
