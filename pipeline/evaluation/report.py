"""The evaluation report of one run (<run_dir>/eval/report.json + report.md) and a side-by-side comparison
of several runs (sweeps over attention kinds).

report.json keys (schema_version 1; sweeps collect these through read_report below, so they stay stable;
a missing figure is null, never absent):

    schema_version                        1
    run                                   run name
    kind, field                           model.attention.kind / field (field null for softmax)
    seq_len                               training length in tokens
    n_params                              unique parameters
    checkpoint                            the weights evaluated
    passkey_mix                           fraction of training documents that were passkey documents
                                          (data.passkey_mix; null if unknown)
    passkey_training                      the train.passkey phase: {"steps", "batch", "weight", "digits"}
                                          (null: none)
    final_val_loss                        training's last validation loss; the eval loss at 1x if training
                                          recorded none
    final_val_loss_source                 "train" | "eval" | null
    passkey_accuracy                      exact-match accuracy over the whole grid, full KV cache
    passkey_accuracy_per_length           {"<tokens>": accuracy}, full cache
    passkey_accuracy_compressed           the same with FPA/FoX eviction (null: softmax or eviction off)
    passkey_accuracy_compressed_per_length
    cache_fraction                        kept keys / tokens seen with eviction, mean over the grid's cells
                                          (1.0 for softmax: nothing is evicted)
    cache_fraction_per_length             {"<tokens>": fraction}
    cache_fraction_per_layer              [fraction per layer]
    passkey_grid                          {"lengths": [...], "depths": [...], "full": [[acc per depth] per
                                          length], "compressed": same or null}
    perplexity                            {"<tokens>": perplexity}
    perplexity_compressed                 {"<tokens>": perplexity reading through the evicting cache} or null
    ppl_cache_fraction                    {"<tokens>": cache fraction kept in those windows} or null
    bits_per_byte                         {"<tokens>": bits per byte}
    ppl_by_position                       {"<tokens>": {"bucket_start": [...], "loss": [...]}} (loss in nats)
    heldout                               every held-out split (data.validation, data.extra_validation):
                                          {"<split>": {"<tokens>": {"loss", "loss_se", "perplexity",
                                          "bits_per_byte", "windows"}}}; loss_se: standard error over the
                                          windows (reports written before it: read as null)
    harness                               lm-evaluation-harness (eval.harness): {"tasks": {task: {metric:
                                          value}}, "num_fewshot", "limit", "lm_eval_version"}; null when
                                          no task was asked for (reports written before it: read as null)
    data_sources                          a mixture's train sources (data.mixture): {"<name>": {"weight",
                                          "documents", "tokens", "sequences"}}; null for one source
    long_context                          the long-context task grids (eval.long_context): {"<task id>":
                                          {"task", "size", "taught", "trials", "digits", "accuracy",
                                          "accuracy_per_length", "accuracy_compressed",
                                          "accuracy_compressed_per_length", "cache_fraction", "grid":
                                          {"lengths", "depths", "full", "compressed"}}}; taught: the
                                          training phase used this task (train.passkey.task); null when no
                                          task ran (reports written before it: read as null)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipeline.atomic import atomic_write_text

SCHEMA_VERSION = 1

REPORT_KEYS = (
    "schema_version",
    "run",
    "kind",
    "field",
    "seq_len",
    "n_params",
    "checkpoint",
    "passkey_mix",
    "passkey_training",
    "final_val_loss",
    "final_val_loss_source",
    "passkey_accuracy",
    "passkey_accuracy_per_length",
    "passkey_accuracy_compressed",
    "passkey_accuracy_compressed_per_length",
    "cache_fraction",
    "cache_fraction_per_length",
    "cache_fraction_per_layer",
    "passkey_grid",
    "perplexity",
    "perplexity_compressed",
    "ppl_cache_fraction",
    "bits_per_byte",
    "ppl_by_position",
    "heldout",
    "harness",
    "data_sources",
    "long_context",
)
# Keys added to schema 1 later: a report written before them still loads, with the key read as null.
LATER_KEYS = ("heldout", "harness", "data_sources", "long_context")


def build_report(
    *,
    run: str,
    kind: str,
    field: str | None,
    seq_len: int,
    n_params: int,
    checkpoint: str,
    train_val_loss: float | None,
    passkey: dict[str, Any] | None,
    ppl: dict[str, Any] | None,
    passkey_mix: float | None = None,
    passkey_training: dict[str, Any] | None = None,
    harness: dict[str, Any] | None = None,
    heldout: dict[str, dict[str, Any]] | None = None,
    data_sources: dict[str, dict[str, Any]] | None = None,
    long_context: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The report dict (REPORT_KEYS, in that order) from the passkey and perplexity results.

    ppl: the perplexity result of the "validation" split; heldout: every held-out split's result by name
    (validation included), summarized per length."""
    full = (passkey or {}).get("modes", {}).get("full")
    comp = (passkey or {}).get("modes", {}).get("compressed")
    lengths_ok = {k: v for k, v in (ppl or {}).get("lengths", {}).items() if v.get("windows")}

    val_loss, source = None, None
    if train_val_loss is not None and math.isfinite(train_val_loss):
        val_loss, source = float(train_val_loss), "train"
    elif ppl and str(seq_len) in lengths_ok:
        val_loss, source = lengths_ok[str(seq_len)]["loss"], "eval"

    if comp is not None:
        frac, frac_len, frac_layer = (
            comp["cache_fraction"],
            comp["cache_fraction_per_length"],
            comp["cache_fraction_per_layer"],
        )
    elif full is not None and kind == "softmax":
        frac, frac_len, frac_layer = 1.0, dict.fromkeys(full["accuracy_per_length"], 1.0), None
    else:
        frac, frac_len, frac_layer = None, None, None

    report = {
        "schema_version": SCHEMA_VERSION,
        "run": run,
        "kind": kind,
        "field": field if kind != "softmax" else None,
        "seq_len": seq_len,
        "n_params": n_params,
        "checkpoint": checkpoint,
        "passkey_mix": passkey_mix,
        "passkey_training": passkey_training,
        "final_val_loss": val_loss,
        "final_val_loss_source": source,
        "passkey_accuracy": full["accuracy"] if full else None,
        "passkey_accuracy_per_length": full["accuracy_per_length"] if full else None,
        "passkey_accuracy_compressed": comp["accuracy"] if comp else None,
        "passkey_accuracy_compressed_per_length": comp["accuracy_per_length"] if comp else None,
        "cache_fraction": frac,
        "cache_fraction_per_length": frac_len,
        "cache_fraction_per_layer": frac_layer,
        "passkey_grid": {
            "lengths": passkey["lengths"],
            "depths": passkey["depths"],
            "full": full["grid"] if full else None,
            "compressed": comp["grid"] if comp else None,
        }
        if passkey
        else None,
        "perplexity": {k: v["perplexity"] for k, v in lengths_ok.items()} or None,
        "perplexity_compressed": {
            k: v["perplexity_compressed"] for k, v in lengths_ok.items() if "perplexity_compressed" in v
        }
        or None,
        "ppl_cache_fraction": {k: v["cache_fraction"] for k, v in lengths_ok.items() if "cache_fraction" in v}
        or None,
        "bits_per_byte": {k: v["bits_per_byte"] for k, v in lengths_ok.items()} or None,
        "ppl_by_position": {
            k: {"bucket_start": v["bucket_start"], "loss": v["loss_by_bucket"]} for k, v in lengths_ok.items()
        }
        or None,
        "heldout": {
            split: {
                k: {key: v.get(key) for key in ("loss", "loss_se", "perplexity", "bits_per_byte", "windows")}
                for k, v in res.get("lengths", {}).items()
                if v.get("windows")
            }
            for split, res in (heldout or {}).items()
        }
        or None,
        "harness": harness or None,
        "data_sources": data_sources or None,
        "long_context": long_context or None,  # pipeline.evaluation.long_context.report_section
    }
    assert tuple(report) == REPORT_KEYS
    return report


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _passkey_training_line(t: dict[str, Any]) -> str:
    task = t.get("task")  # absent: the passkey (reports before train.passkey.task, and its default)
    if task:
        return (
            f"- long-context training: the last {t['steps']} steps added {t['batch']} {task} prompts "
            f"({t['digits']}-digit values, loss on the answer only, weight {t['weight']:g}) to every micro "
            "batch (train.passkey.task), so that task's grid tests a skill the model was taught"
        )
    return (
        f"- passkey training: the last {t['steps']} steps added {t['batch']} passkey prompts "
        f"({t['digits']}-digit keys, loss on the answer only, weight {t['weight']:g}) to every micro "
        "batch (train.passkey), so the grid tests a skill the model was taught"
    )


def _grid_lines(
    title: str, lengths: list[int], depths: list[float], grid: list[list[float]], per_len: dict, seq_len: int
) -> list[str]:
    """A length x depth accuracy table with a mean column."""
    lines = [title, ""]
    lines.append("| length | " + " | ".join(f"{d:.0%}" for d in depths) + " | mean |")
    lines.append("|---" * (len(depths) + 2) + "|")
    for L, row in zip(lengths, grid):
        cells = " | ".join(f"{a:.2f}" for a in row)
        lines.append(f"| {L} ({L / seq_len:g}x) | {cells} | {per_len[str(L)]:.2f} |")
    return [*lines, ""]


def _long_context_markdown(lc: dict[str, Any] | None, seq_len: int) -> list[str]:
    """One section per long-context task: whether it was taught, then its grids per cache mode."""
    lines: list[str] = []
    for tid, t in (lc or {}).items():
        taught = "taught in training" if t.get("taught") else "not taught in training"
        lines += [
            f"## Long-context task {tid} ({taught})",
            "",
            f"Accuracy: full cache {_pct(t['accuracy'])}, compressed {_pct(t['accuracy_compressed'])} "
            f"with {_pct(t['cache_fraction'])} of the cache kept; {t['trials']} prompts per cell, "
            f"{t['digits']}-digit values; heatmaps: `long_context-{tid}.png`.",
            "",
        ]
        g = t["grid"]
        for mode, per_len in (
            ("full", "accuracy_per_length"),
            ("compressed", "accuracy_compressed_per_length"),
        ):
            if g[mode]:
                title = f"### {tid}, {mode} cache (rows: length, columns: needle depth)"
                lines += _grid_lines(title, g["lengths"], g["depths"], g[mode], t[per_len], seq_len)
    return lines


def report_markdown(report: dict[str, Any]) -> str:
    """One run's report as markdown: headline table, passkey grids, perplexity by length."""
    r = report
    lines = [
        f"# Evaluation: {r['run']}",
        "",
        f"- attention: **{r['kind']}**" + (f" (field `{r['field']}`)" if r["field"] else ""),
        f"- parameters: {r['n_params']:,}; training length {r['seq_len']} tokens",
        f"- weights: `{r['checkpoint']}`",
        *(
            [
                f"- training data: {_pct(r['passkey_mix'])} of the documents were passkey-retrieval "
                "documents (data.passkey_mix), so the passkey grid tests a format the model was shown"
            ]
            if r.get("passkey_mix")
            else []
        ),
        *([_passkey_training_line(r["passkey_training"])] if r.get("passkey_training") else []),
        *(
            [
                "- training data, a mixture (data.mixture): "
                + ", ".join(
                    f"{name} weight {s['weight']:g}, {s['tokens']:,} tokens"
                    for name, s in r["data_sources"].items()
                )
            ]
            if r.get("data_sources")
            else []
        ),
        f"- final validation loss: {_f(r['final_val_loss'], 4)} ({r['final_val_loss_source'] or 'n/a'})",
        f"- passkey accuracy: full cache {_pct(r['passkey_accuracy'])}, "
        f"compressed {_pct(r['passkey_accuracy_compressed'])} "
        f"with {_pct(r['cache_fraction'])} of the cache kept",
        "",
    ]
    grid = r["passkey_grid"]
    if grid:
        for mode in ("full", "compressed"):
            if not grid[mode]:
                continue
            per_len = r[
                "passkey_accuracy_per_length" if mode == "full" else "passkey_accuracy_compressed_per_length"
            ]
            title = f"## Passkey accuracy, {mode} cache (rows: length, columns: needle depth)"
            lines += _grid_lines(title, grid["lengths"], grid["depths"], grid[mode], per_len, r["seq_len"])
        if r["cache_fraction_per_length"] and grid["compressed"]:
            lines += [
                "Cache kept by length: "
                + ", ".join(f"{k}: {_pct(v)}" for k, v in r["cache_fraction_per_length"].items())
            ]
            if r["cache_fraction_per_layer"]:
                lines += ["Cache kept by layer: " + ", ".join(_pct(v) for v in r["cache_fraction_per_layer"])]
            lines.append("")
    if r["perplexity"]:
        comp = r["perplexity_compressed"] or {}
        frac = r["ppl_cache_fraction"] or {}
        lines += [
            "## Validation perplexity by length",
            "",
            "| length | loss | perplexity | bits/byte | perplexity, evicting cache | cache kept |",
            "|---|---|---|---|---|---|",
        ]
        for k in r["perplexity"]:
            mean_loss = math.log(r["perplexity"][k])
            lines.append(
                f"| {k} | {mean_loss:.4f} | {r['perplexity'][k]:.2f} | {r['bits_per_byte'][k]:.4f} "
                f"| {_f(comp.get(k), 2)} | {_pct(frac.get(k))} |"
            )
        lines += ["", "Loss by position: `perplexity.png`; passkey heatmaps: `passkey.png`.", ""]
    lines += _heldout_markdown(r.get("heldout"))
    lines += _harness_markdown(r.get("harness"))
    lines += _long_context_markdown(r.get("long_context"), r["seq_len"])
    return "\n".join(lines)


def _heldout_markdown(h: dict[str, Any] | None) -> list[str]:
    if not h:
        return []
    lines = [
        "## Held-out splits (loss +- standard error over windows)",
        "",
        "| split | length | windows | loss | perplexity | bits/byte |",
        "|---|---|---|---|---|---|",
    ]
    for split, by_len in h.items():
        for k, v in by_len.items():
            se = v.get("loss_se")
            se_txt = f" +- {se:.4f}" if isinstance(se, float) and math.isfinite(se) else ""
            lines.append(
                f"| {split} | {k} | {v['windows']} | {v['loss']:.4f}{se_txt} | {v['perplexity']:.2f} "
                f"| {_f(v.get('bits_per_byte'), 4)} |"
            )
    files = ", ".join(f"`{'perplexity' if s == 'validation' else 'perplexity-' + s}.png`" for s in h)
    return [*lines, "", f"Loss by position per split: {files}.", ""]


def _harness_markdown(h: dict[str, Any] | None) -> list[str]:
    if not h or not h.get("tasks"):
        return []
    shots = "task default" if h.get("num_fewshot") is None else h["num_fewshot"]
    limit = "all" if h.get("limit") is None else h["limit"]
    lines = [
        "## lm-evaluation-harness",
        "",
        f"lm-eval {h.get('lm_eval_version') or '?'}, few-shot: {shots}, documents per task: {limit}",
        "",
        "| task | metric | value |",
        "|---|---|---|",
    ]
    for task, metrics in h["tasks"].items():
        lines += [f"| {task} | {m} | {_f(v, 4)} |" for m, v in metrics.items() if not m.endswith("_stderr")]
    return [*lines, ""]


def write_report(report: dict[str, Any], eval_dir: Path) -> tuple[Path, Path]:
    """report.json and report.md into eval_dir (each written atomically)."""
    eval_dir.mkdir(parents=True, exist_ok=True)
    pj, pm = eval_dir / "report.json", eval_dir / "report.md"
    atomic_write_text(pj, json.dumps(report, indent=1) + "\n")
    atomic_write_text(pm, report_markdown(report))
    return pj, pm


# -- reading ------------------------------------------------------------------------------------------
# One reader for every consumer: load_report (strict: the schema, or a ValueError naming the file) for
# comparisons, read_report + report_metrics (lenient: a status and None for what is missing or malformed)
# for collecting a sweep in which some runs failed.

# The headline figures of a report, by name (a sweep's table columns).
METRICS = (
    "final_val_loss",
    "ppl_train_len",  # validation perplexity at the training length
    "ppl_longest",  # ... at the longest length evaluated
    "passkey_accuracy",  # full KV cache
    "passkey_accuracy_compressed",  # with FPA/FoX eviction
    "passkey_longest",  # full KV cache, at the longest length evaluated (8x the training length by default)
    "cache_fraction",  # kept keys / tokens seen with eviction
)


def _parse(path: Path) -> Any:
    """The JSON in path; ValueError (naming the file) when it is missing or not JSON."""
    if not path.is_file():
        raise ValueError(f"no evaluation report at {path} (run `fpa eval` first)")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def check_report(report: Any, path: Path) -> dict[str, Any]:
    """report itself if it follows the schema (this version, every key); ValueError naming path otherwise."""
    version = report.get("schema_version") if isinstance(report, dict) else None
    if version != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version {version!r}, expected {SCHEMA_VERSION}")
    for k in LATER_KEYS:
        report.setdefault(k, None)
    missing = [k for k in REPORT_KEYS if k not in report]
    if missing:
        raise ValueError(f"{path}: missing keys {missing}")
    return report


def load_report(run_dir: Path | str) -> dict[str, Any]:
    """<run_dir>/eval/report.json, checked for the schema; ValueError naming the file otherwise."""
    path = Path(run_dir) / "eval" / "report.json"
    return check_report(_parse(path), path)


def read_report(path: Path) -> tuple[str, dict[str, Any] | None]:
    """(status, report) of a report.json, never an error: ok | missing | unreadable (not a JSON object)."""
    if not path.is_file():
        return "missing", None
    try:
        report = _parse(path)
    except (OSError, ValueError):  # ValueError covers undecodable bytes and bad JSON
        return "unreadable", None
    return ("ok", report) if isinstance(report, dict) else ("unreadable", None)


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        return None
    return float(x)


def _by_length(x: Any) -> dict[int, float]:
    """{"<tokens>": value} -> {tokens: value}, skipping what is not a number."""
    out: dict[int, float] = {}
    if isinstance(x, dict):
        for k, v in x.items():
            if str(k).isdigit() and _number(v) is not None:
                out[int(k)] = float(v)
    return out


def _passkey(x: Any) -> float | None:
    # A number, or an older/other eval's {"accuracy": ...} mapping.
    return _number(x) if not isinstance(x, dict) else _number(x.get("accuracy"))


def report_metrics(report: dict[str, Any] | None) -> dict[str, float | None]:
    """The METRICS of a report (None for the report itself): each a finite number or None."""
    if report is None:
        return dict.fromkeys(METRICS)
    ppl = _by_length(report.get("perplexity"))
    by_len = _by_length(report.get("passkey_accuracy_per_length"))
    seq_len = report.get("seq_len")
    return {
        "final_val_loss": _number(report.get("final_val_loss")),
        "ppl_train_len": ppl.get(seq_len) if isinstance(seq_len, int) else None,
        "ppl_longest": ppl[max(ppl)] if ppl else None,
        "passkey_accuracy": _passkey(report.get("passkey_accuracy", report.get("passkey"))),
        "passkey_accuracy_compressed": _passkey(report.get("passkey_accuracy_compressed")),
        "passkey_longest": by_len[max(by_len)] if by_len else None,
        "cache_fraction": _number(report.get("cache_fraction")),
    }


def heldout_metrics(report: dict[str, Any] | None) -> dict[str, float]:
    """{"loss:<split>": eval loss at the training length} for every held-out split of the report (in-domain
    and out-of-domain side by side); {} for reports without them."""
    heldout = report.get("heldout") if isinstance(report, dict) else None
    seq_len = str(report.get("seq_len")) if isinstance(report, dict) else None
    out: dict[str, float] = {}
    for split, by_len in (heldout if isinstance(heldout, dict) else {}).items():
        v = by_len.get(seq_len) if isinstance(by_len, dict) else None
        if isinstance(v, dict) and _number(v.get("loss")) is not None:
            out[f"loss:{split}"] = float(v["loss"])
    return out


def harness_metrics(report: dict[str, Any] | None) -> dict[str, float]:
    """{"harness:<task>/<metric>": value} of the report's lm-evaluation-harness scores (standard errors
    left out); {} when there are none. A sweep's table gets a column per task and metric found."""
    harness = report.get("harness") if isinstance(report, dict) else None
    tasks = harness.get("tasks") if isinstance(harness, dict) else None
    out: dict[str, float] = {}
    for task, metrics in (tasks if isinstance(tasks, dict) else {}).items():
        for metric, value in (metrics if isinstance(metrics, dict) else {}).items():
            if not str(metric).endswith("_stderr") and _number(value) is not None:
                out[f"harness:{task}/{metric}"] = float(value)
    return out


def long_context_metrics(report: dict[str, Any] | None) -> dict[str, float]:
    """{"lc:<task>": full-cache accuracy, "lc:<task>/compressed": with eviction, "lc:<task>/longest": full
    cache at the longest length} of the report's long-context tasks; {} when there are none. A sweep's
    table gets these columns for every task found."""
    lc = report.get("long_context") if isinstance(report, dict) else None
    out: dict[str, float] = {}
    for tid, t in (lc if isinstance(lc, dict) else {}).items():
        if not isinstance(t, dict):
            continue
        by_len = _by_length(t.get("accuracy_per_length"))
        for col, v in (
            (f"lc:{tid}", _number(t.get("accuracy"))),
            (f"lc:{tid}/compressed", _number(t.get("accuracy_compressed"))),
            (f"lc:{tid}/longest", by_len[max(by_len)] if by_len else None),
        ):
            if v is not None:
                out[col] = v
    return out


def ppl_curve(x: Any) -> tuple[list[float], list[float]] | None:
    """(bucket start, perplexity) at the longest length in report["ppl_by_position"], which holds
    {"<tokens>": {"bucket_start": [...], "loss": [...]}} with losses in nats."""
    best: tuple[int, list[tuple[float, float]]] | None = None
    for k, v in (x if isinstance(x, dict) else {}).items():
        if not str(k).isdigit() or not isinstance(v, dict):
            continue
        starts, losses = v.get("bucket_start"), v.get("loss")
        if not isinstance(starts, list) or not isinstance(losses, list):
            continue
        pairs = [
            (float(a), math.exp(min(float(b), 50.0)))
            for a, b in zip(starts, losses)
            if _number(a) is not None and _number(b) is not None
        ]
        if pairs and (best is None or int(k) > best[0]):
            best = (int(k), pairs)
    return ([a for a, _ in best[1]], [b for _, b in best[1]]) if best else None


def compare_reports(run_dirs: list[Path | str]) -> str:
    """Several runs side by side as markdown: headline figures, passkey by length, perplexity by length."""
    reports = [load_report(d) for d in run_dirs]
    if not reports:
        return "_no runs_\n"
    lengths = sorted({int(k) for r in reports for k in (r["passkey_accuracy_per_length"] or {})})
    ppl_lengths = sorted({int(k) for r in reports for k in (r["perplexity"] or {})})
    out = [
        "| run | kind | field | params | val loss | passkey | passkey compressed | cache kept |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        out.append(
            f"| {r['run']} | {r['kind']} | {r['field'] or '-'} | {r['n_params']:,} "
            f"| {_f(r['final_val_loss'], 4)} "
            f"| {_pct(r['passkey_accuracy'])} | {_pct(r['passkey_accuracy_compressed'])} "
            f"| {_pct(r['cache_fraction'])} |"
        )
    if lengths:
        out += ["", "Passkey accuracy by length (full cache / compressed):", ""]
        out.append("| run | " + " | ".join(str(L) for L in lengths) + " |")
        out.append("|---" * (len(lengths) + 1) + "|")
        for r in reports:
            full = r["passkey_accuracy_per_length"] or {}
            comp = r["passkey_accuracy_compressed_per_length"] or {}
            cells = [f"{_pct(full.get(str(L)))} / {_pct(comp.get(str(L)))}" for L in lengths]
            out.append(f"| {r['run']} | " + " | ".join(cells) + " |")
    if ppl_lengths:
        out += ["", "Validation perplexity by length:", ""]
        out.append("| run | " + " | ".join(str(L) for L in ppl_lengths) + " |")
        out.append("|---" * (len(ppl_lengths) + 1) + "|")
        for r in reports:
            ppl = r["perplexity"] or {}
            out.append(f"| {r['run']} | " + " | ".join(_f(ppl.get(str(L)), 2) for L in ppl_lengths) + " |")
    return "\n".join(out) + "\n"
