"""The figures of a collected sweep, grouped by the swept axis: one colour per group (the grid values other
than the seed, e.g. one per attention kind), the mean over seeds with a +-1 std band.

    series = run_series(run_dir, report)             # one run's curves
    plot_grouped(path, title, [(group, series), ...])  # result-grouped.png
    accuracy_tables([(group, series), ...])            # the accuracy panels as mean +- std tables

Panels: the training loss by step (each run's metrics.jsonl), the validation loss by position at the
longest length evaluated, and the accuracy by length (x the training length) of the passkey and of each
long-context task.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

Curve = dict[float, float]  # x -> y


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def train_curve(run_dir: Path) -> Curve:
    """step -> language-model loss from <run_dir>/metrics.jsonl (missing or malformed lines skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    out: Curve = {}
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and _finite(rec.get("step")) and _finite(rec.get("loss")):
            out[float(rec["step"])] = float(rec["loss"])  # a resumed run rewrites a step: the last one counts
    return out


def _by_length(x: Any, seq_len: Any) -> Curve:
    """{"<tokens>": accuracy} -> {multiple of the training length: accuracy}."""
    if not isinstance(x, dict) or not _finite(seq_len) or seq_len <= 0:
        return {}
    return {int(k) / seq_len: float(v) for k, v in x.items() if str(k).isdigit() and _finite(v)}


def run_series(run_dir: Path, report: dict[str, Any] | None) -> dict[str, Curve]:
    """One run's curves by panel name: "train loss", "loss by position", "accuracy: <task>"."""
    series: dict[str, Curve] = {"train loss": train_curve(run_dir)}
    if not isinstance(report, dict):
        return series
    by_pos = report.get("ppl_by_position")
    if isinstance(by_pos, dict):
        lengths = [k for k in by_pos if str(k).isdigit() and isinstance(by_pos[k], dict)]
        if lengths:
            v = by_pos[max(lengths, key=int)]
            starts, losses = v.get("bucket_start"), v.get("loss")
            if isinstance(starts, list) and isinstance(losses, list):
                series["loss by position"] = {
                    float(a): float(b) for a, b in zip(starts, losses) if _finite(a) and _finite(b)
                }
    seq_len = report.get("seq_len")
    series["accuracy: passkey"] = _by_length(report.get("passkey_accuracy_per_length"), seq_len)
    lc = report.get("long_context")
    for tid, t in (lc if isinstance(lc, dict) else {}).items():
        if isinstance(t, dict) and tid != "passkey":  # the passkey task is the passkey grid's panel
            series[f"accuracy: {tid}"] = _by_length(t.get("accuracy_per_length"), seq_len)
    return {k: v for k, v in series.items() if v}


def mean_band(curves: list[Curve]) -> tuple[list[float], list[float], list[float]]:
    """(x, mean, std) over the x values every curve has (std 0 for a single curve)."""
    if not curves:
        return [], [], []
    xs = sorted(set.intersection(*(set(c) for c in curves)))
    mean = [statistics.mean(c[x] for c in curves) for x in xs]
    std = [statistics.stdev(c[x] for c in curves) if len(curves) > 1 else 0.0 for x in xs]
    return xs, mean, std


def plot_grouped(path: Path, title: str, runs: list[tuple[str, dict[str, Curve]]]) -> list[str]:
    """One panel per series name found, a line per group (mean over its runs, +-1 std band). Returns the
    panel names (empty: nothing to plot, no file written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ["train loss", "loss by position", "accuracy: passkey"]
    names = sorted({k for _, s in runs for k in s}, key=lambda k: (order.index(k) if k in order else 3, k))
    if not names:
        return []
    groups = list(dict.fromkeys(g for g, _ in runs))
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False, layout="constrained"
    )
    colours = plt.get_cmap("tab10")
    for ax, name in zip(axes.flat, names):
        for gi, group in enumerate(groups):
            curves = [s[name] for g, s in runs if g == group and name in s]
            xs, mean, std = mean_band(curves)
            if not xs:
                continue
            c = colours(gi % 10)
            ax.plot(
                xs,
                mean,
                color=c,
                marker="o" if name.startswith("accuracy") else None,
                ms=3,
                label=f"{group} (n={len(curves)})",
            )
            ax.fill_between(
                xs,
                [m - s for m, s in zip(mean, std)],
                [m + s for m, s in zip(mean, std)],
                color=c,
                alpha=0.2,
                linewidth=0,
            )
        if name.startswith("accuracy"):
            ax.set_xscale("log", base=2)
            ticks = sorted({x for _, s in runs for x in s.get(name, {})})
            ax.set_xticks(ticks, [f"{x:g}x" for x in ticks])
            ax.minorticks_off()
            ax.set_xlabel("length (x training length)")
            ax.set_ylim(-0.05, 1.05)
            ax.set_ylabel("accuracy, full cache")
        elif name == "loss by position":
            ax.set_xlabel("position (bucket start), longest length")
            ax.set_ylabel("validation loss (nats)")
        else:
            ax.set_xlabel("step")
            ax.set_ylabel("training loss")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    fig.suptitle(f"{title}: mean +- 1 std over seeds", fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return names


def accuracy_tables(runs: list[tuple[str, dict[str, Curve]]]) -> str:
    """The accuracy panels of `plot_grouped` as markdown: per task a table, a row per group, a column per
    length (x the training length), "mean ± std (n)" over the group's runs that have that length ("" when
    no run has an accuracy series)."""
    from pipeline.provenance import markdown_table  # here: it imports torch

    names = sorted({k for _, s in runs for k in s if k.startswith("accuracy: ")})
    names.sort(key=lambda k: k != "accuracy: passkey")  # the passkey first, then the tasks by name
    groups = list(dict.fromkeys(g for g, _ in runs))
    out: list[str] = []
    for name in names:
        xs = sorted({x for _, s in runs for x in s.get(name, {})})
        rows = []
        for group in groups:
            curves = [s[name] for g, s in runs if g == group and name in s]
            if not curves:
                continue
            cells = [group]
            for x in xs:
                vals = [c[x] for c in curves if x in c]
                if not vals:
                    cells.append("-")
                elif len(vals) == 1:
                    cells.append(f"{vals[0]:.3g} (n=1)")
                else:
                    mean, std = statistics.mean(vals), statistics.stdev(vals)
                    cells.append(f"{mean:.3g} ± {std:.2g} (n={len(vals)})")
            rows.append(cells)
        task = name.removeprefix("accuracy: ")
        out += [f"{task}, full cache:\n", markdown_table(["group", *(f"{x:g}x" for x in xs)], rows) + "\n"]
    return "\n".join(out)
