"""Sweeps: a grid of config overrides run as one Slurm job array (or locally), then collected into a table.

A sweep file (configs/sweeps/*.yaml):

    name: kind                      # the W&B group and the folder <runs_dir>/sweeps/<name>/
    configs: [../tiny.yaml]         # base config files, relative to the sweep file
    overrides:                      # fixed for every run (dotted key: value)
      train.max_steps: 300
      data.out_dir: runs/data/tiny  # one prepared copy of the data shared by all runs
    grid:                           # the cross product of these values
      model.attention.kind: [fpa, fox, softmax]
      seed: [1, 2]
    max_parallel: 0                 # array elements running at once (0: no limit)
    local_nproc: 1                  # training processes per run with --local

Each grid point is a run named <sweep>.<key>-<value>.<key>-<value> (keys by their last component),
with its own run dir and logging.group = <sweep>. On Slurm, one prepare job per distinct data dir runs
first (or, with data.prepare_parts > 1, a plan job, a job array of parts and a merge job), then a
training job array whose element i trains run i (its overrides are line i of
<runs_dir>/sweeps/<name>/slurm/runs.tsv), and an eval job array whose element i starts once training
element i succeeded (aftercorr). `collect_sweep` reads every run's eval/report.json into
result.md, result.csv, result.png and result-grouped.png (launch/sweep_plots.py) in the same folder.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import json
import math
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from data_prep.config import data_config_dict
from launch.slurm import (
    LaunchError,
    fill,
    prepare_jobs,
    q,
    record_submission,
    render_job,
    submit_jobs,
    template,
    world_size,
)
from pipeline.config import ConfigError, RunConfig, derive, load_config
from pipeline.rundir import stage_commit

SWEEP_KEYS = {"name", "description", "configs", "overrides", "grid", "max_parallel", "local_nproc"}
Runner = Callable[[list[str]], int]  # argv for `python -m launch.cli` -> exit status


@dataclass(frozen=True)
class SweepRun:
    index: int  # position in the grid = the job array index
    name: str
    values: dict[str, Any]  # this run's grid values, by dotted key
    overrides: list[str]  # everything after the config files: fixed + grid + name + logging.group
    config: RunConfig = field(repr=False)  # the resolved config (loaded once)

    @property
    def run_dir(self) -> Path:
        return self.config.run_dir

    @property
    def data_dir(self) -> Path:
        return self.config.data_dir

    @property
    def group(self) -> str | None:  # the W&B group: the sweep's name
        return self.config.logging.group


@dataclass(frozen=True)
class Sweep:
    name: str
    path: Path
    configs: list[str]  # absolute paths
    overrides: list[str]  # the fixed ones
    grid: dict[str, list[Any]]
    max_parallel: int
    local_nproc: int
    out_dir: Path  # <runs_dir>/sweeps/<name>
    runs: list[SweepRun]


# -- reading -----------------------------------------------------------------------------------------


def format_value(value: Any) -> str:
    """A YAML value as override text that OmegaConf reads back as the same value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        try:
            same = yaml.safe_load(value) == value
        except yaml.YAMLError:
            same = False
        return value if same and value.strip() == value else json.dumps(value)
    return json.dumps(value)  # lists and mappings: JSON is YAML flow style


def _label(value: Any) -> str:
    text = value if isinstance(value, str) else format_value(value)
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_") or "_"


def _short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Grid keys by their last component, or the full dotted key (dots -> _) where two would clash."""
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (leaf if leaves.count(leaf) == 1 else k.replace(".", "_")) for k, leaf in zip(keys, leaves)}


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file; every run's config is loaded once, so bad keys fail here."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping at the top level")
    unknown = sorted(set(raw) - SWEEP_KEYS)
    if unknown:
        allowed = ", ".join(sorted(SWEEP_KEYS))
        raise ConfigError(f"unknown key '{unknown[0]}' in sweep file {path} (keys: {allowed})")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ConfigError(f"'name' in {path} must be letters, digits, '.', '_' or '-'; got {name!r}")
    configs = raw.get("configs") or []
    configs = [configs] if isinstance(configs, str) else configs
    if not isinstance(configs, list) or not all(isinstance(c, str) for c in configs):
        raise ConfigError(f"'configs' in {path} must be a list of config file paths")
    configs = [str((path.parent / c).resolve()) for c in configs]
    fixed = raw.get("overrides") or {}
    if not isinstance(fixed, dict):
        raise ConfigError(f"'overrides' in {path} must be a mapping of dotted key: value")
    grid = raw.get("grid") or {}
    if not isinstance(grid, dict) or not grid:
        raise ConfigError(f"'grid' in {path} must be a non-empty mapping of dotted key: [values]")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"grid key '{key}' in {path} must have a non-empty list of values")
        if key in ("name", "logging.group") or key in fixed:
            raise ConfigError(f"grid key '{key}' in {path} is also fixed (or set by the sweep itself)")
    if any(str(k).startswith("slurm.") for k in grid):
        raise ConfigError(f"the grid in {path} may not vary slurm.* keys (one job array, one allocation)")
    max_parallel, local_nproc = raw.get("max_parallel", 0), raw.get("local_nproc", 1)
    if not isinstance(max_parallel, int) or max_parallel < 0:
        raise ConfigError(f"'max_parallel' in {path} must be an integer >= 0; got {max_parallel!r}")
    if not isinstance(local_nproc, int) or local_nproc < 1:
        raise ConfigError(f"'local_nproc' in {path} must be an integer >= 1; got {local_nproc!r}")

    fixed_ov = [f"{k}={format_value(v)}" for k, v in fixed.items()]
    try:
        base = load_config(configs, fixed_ov)
    except ConfigError as e:
        raise ConfigError(f"sweep {path}: {e}") from None
    keys = list(grid)
    short = _short_keys(keys)
    runs: list[SweepRun] = []
    seen: dict[str, dict[str, Any]] = {}
    shared: dict[Path, tuple[str, dict[str, Any]]] = {}
    for index, combo in enumerate(itertools.product(*(grid[k] for k in keys))):
        values = dict(zip(keys, combo))
        run_name = ".".join([name] + [f"{short[k]}-{_label(v)}" for k, v in values.items()])
        if run_name in seen:
            raise ConfigError(f"grid points {seen[run_name]} and {values} in {path} get the same run name")
        seen[run_name] = values
        overrides = [*fixed_ov, *(f"{k}={format_value(v)}" for k, v in values.items())]
        overrides += [f"name={run_name}", f"logging.group={name}"]
        try:
            cfg = load_config(configs, overrides)
        except ConfigError as e:
            raise ConfigError(f"sweep {path}, run {run_name}: {e}") from None
        runs.append(SweepRun(index, run_name, values, overrides, cfg))
        _check_shared_data(path, run_name, cfg, shared)
    return Sweep(
        name=name,
        path=path,
        configs=configs,
        overrides=fixed_ov,
        grid=grid,
        max_parallel=max_parallel,
        local_nproc=local_nproc,
        out_dir=Path(base.runs_dir) / "sweeps" / name,
        runs=runs,
    )


def _check_shared_data(
    path: Path, run_name: str, cfg: RunConfig, shared: dict[Path, tuple[str, dict[str, Any]]]
) -> None:
    """Runs that share a data dir must want the same shards: one prepare job makes them for all."""
    # The keys that do not change the shards, as in pipeline.stages.prepare_inputs (which also hashes
    # the source files: too slow to repeat for every grid point).
    data = {
        k: v for k, v in data_config_dict(cfg.data).items() if k not in ("num_workers", "out_dir", "seed")
    }
    first = shared.setdefault(cfg.data_dir.resolve(), (run_name, data))
    if first[1] != data:
        diff = sorted(k for k in data if data[k] != first[1].get(k))
        raise ConfigError(
            f"sweep {path}: runs {first[0]} and {run_name} share the data dir {cfg.data_dir} but differ in "
            f"data.{diff[0]}; drop the fixed data.out_dir or make it depend on that value"
        )


# -- running -----------------------------------------------------------------------------------------


def _data_groups(sweep: Sweep) -> list[SweepRun]:
    """The first run of each distinct data dir: whose prepare stage makes the data the others share."""
    firsts: dict[Path, SweepRun] = {}
    for run in sweep.runs:
        firsts.setdefault(run.data_dir.resolve(), run)
    return list(firsts.values())


def render_array(sweep: Sweep, run_list: Path, stage: str) -> str:
    """A job-array script over the sweep's runs: element i runs `stage` (train or eval) for run i,
    taking its overrides from line i of run_list."""
    cfgs = [r.config for r in sweep.runs]
    if stage == "train":
        for cfg in cfgs[1:]:
            derive(cfg, world_size(cfg))  # element 0 is checked by render_job
    n = len(sweep.runs)
    array = f"0-{n - 1}" + (f"%{sweep.max_parallel}" if sweep.max_parallel else "")
    select = fill(template("array_select.sh"), {"RUN_LIST": q(run_list.resolve()), "SWEEP": sweep.name})
    return render_job(
        dataclasses.replace(cfgs[0], name=sweep.name),  # job names belong to the sweep, not to run 0
        sweep.configs,
        stage,
        select,
        log_dir=sweep.out_dir.resolve() / "slurm",
        log_stem=f"{stage}-%A_%a",
        array=array,
        origin=f"{stage} job array of sweep {sweep.path}",
    )


def write_run_list(sweep: Sweep, path: Path) -> None:
    """Line i: run i's overrides, tab-separated (read by the array script with `read -a`)."""
    lines = []
    for run in sweep.runs:
        for ov in run.overrides:
            if any(c in ov for c in "\t\n\r\0"):
                raise LaunchError(f"override {ov!r} of run {run.name} holds a tab or line break")
        lines.append("\t".join(run.overrides))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _cli_runner(argv: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", "launch.cli", *argv]).returncode


def run_sweep(
    path: str | Path,
    *,
    mode: str = "slurm",
    dry_run: bool = False,
    runner: Runner | None = None,
) -> list[str]:
    """Run a sweep. mode "slurm": submit one prepare job per distinct data dir (plan, parts and merge
    with data.prepare_parts > 1), ONE training job array after them and one eval array (element i
    after training element i); returns the job ids: prepare jobs, then the training array, then the
    eval array. mode "local": prepare once per data dir, then train + eval each run in turn through
    `runner` (default: `python -m launch.cli ...` in a subprocess); returns the names of the runs that
    finished. dry_run prints and submits/runs nothing."""
    if mode not in ("slurm", "local"):
        raise ConfigError(f"sweep mode must be 'slurm' or 'local'; got {mode!r}")
    sweep = load_sweep(path)
    if mode == "local":
        return _run_local(sweep, dry_run=dry_run, runner=runner or _cli_runner)
    out = sweep.out_dir.resolve() / "slurm"
    out.mkdir(parents=True, exist_ok=True)
    run_list = out / "runs.tsv"
    write_run_list(sweep, run_list)
    # One prepare per distinct data dir: one job, or plan -> part array -> merge (data.prepare_parts).
    scripts: list[Path] = []
    prepare_deps: list[tuple[list[int], str]] = []
    ready: list[int] = []  # the job of each data dir that leaves its data complete
    for i, run in enumerate(_data_groups(sweep)):
        first = len(scripts)
        for stem, text, after, kind in prepare_jobs(
            run.config, sweep.configs, run.overrides, out, f"prepare-{i}"
        ):
            script = out / f"{stem}.sbatch"
            script.write_text(text)
            scripts.append(script)
            prepare_deps.append(([first + a for a in after], kind))
        ready.append(len(scripts) - 1)
    arrays = {stage: out / f"{stage}-array.sbatch" for stage in ("train", "eval")}
    for stage, script in arrays.items():
        script.write_text(render_array(sweep, run_list, stage))
    if dry_run:
        for script in [run_list, *scripts, *arrays.values()]:
            print(f"# ===== {script} =====")
            print(script.read_text())
        return []
    # Prepare jobs, then the training array after all of them; eval element i starts as soon as
    # training element i succeeded (aftercorr), on a one-process allocation.
    n = len(scripts)
    jobs = [(script, after, kind) for script, (after, kind) in zip(scripts, prepare_deps)]
    jobs += [(arrays["train"], ready, "afterok"), (arrays["eval"], [n], "aftercorr")]
    ids = submit_jobs(jobs)
    entry = {"time": time.time(), "prepare": ids[:-2], "train_array": ids[-2], "eval_array": ids[-1]}
    record_submission(out / "jobs.jsonl", {**entry, "runs": [r.name for r in sweep.runs]})
    print(
        f"submitted sweep {sweep.name} ({len(sweep.runs)} runs): prepare {', '.join(ids[:-2])}, "
        f"train array {ids[-2]}, eval array {ids[-1]}; logs {out}/<stage>-<array id>_<index>.out"
    )
    return ids


def _run_local(sweep: Sweep, *, dry_run: bool, runner: Runner) -> list[str]:
    prepares = [
        (f"prepare data for {run.name}", ["run", "--stages", "prepare", *sweep.configs, *run.overrides])
        for run in _data_groups(sweep)
    ]
    nproc = ["--nproc", str(sweep.local_nproc)]
    runs = [
        (run.name, ["run", "--stages", "train,eval", *nproc, *sweep.configs, *run.overrides])
        for run in sweep.runs
    ]
    if dry_run:
        for what, argv in prepares + runs:
            print(f"# {what}\n{' '.join(q(a) for a in [sys.executable, '-m', 'launch.cli', *argv])}")
        return []
    for what, argv in prepares:
        print(f"fpa sweep {sweep.name}: {what}", file=sys.stderr)
        rc = runner(argv)
        if rc != 0:  # without data every run would fail the same way
            raise LaunchError(f"sweep {sweep.name}: '{what}' failed with status {rc}")
    done: list[str] = []
    failed: list[str] = []
    for name, argv in runs:
        print(f"fpa sweep {sweep.name}: {name}", file=sys.stderr)
        (done if runner(argv) == 0 else failed).append(name)
    if failed:
        raise LaunchError(f"sweep {sweep.name}: {len(failed)} run(s) failed: {', '.join(failed)}")
    return done


# -- collecting --------------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def collect_sweep(path: str | Path, out: str | Path | None = None) -> Path:
    """Gather every run's <run_dir>/eval/report.json into result.md, result.csv, result.png and
    result.json (the table with the collect command, commit and machine, and the commit each run was
    trained at) under `out`, default <runs_dir>/sweeps/<name>/ (missing values show as "-"); return it."""
    # Here, not at the top: the evaluation package imports torch, which launching does not otherwise need.
    from launch.sweep_plots import accuracy_tables, plot_grouped, run_series
    from pipeline.evaluation.report import (
        METRICS,
        check_report,
        compare_reports,
        harness_metrics,
        heldout_metrics,
        long_context_metrics,
        ppl_curve,
        read_report,
        report_metrics,
    )
    from pipeline.provenance import markdown_table, provenance, provenance_md

    argv = ["sweep", str(path), "--collect", *([] if out is None else ["--out", str(out)])]
    sweep = load_sweep(path)
    keys = list(sweep.grid)
    short = _short_keys(keys)
    table: list[dict[str, Any]] = []
    curves: dict[str, tuple[list[float], list[float]]] = {}
    reports: list[dict[str, Any] | None] = []
    complete: list[Path] = []  # runs whose report passes the strict schema check, for the detail tables
    # Extra columns found in the reports: eval loss per held-out split, lm-eval scores (eval.harness),
    # long-context task accuracies (eval.long_context).
    harness_cols: list[str] = []
    for run in sweep.runs:
        report_path = run.run_dir / "eval" / "report.json"
        status, report = read_report(report_path)
        reports.append(report)
        harness = {**heldout_metrics(report), **harness_metrics(report), **long_context_metrics(report)}
        harness_cols += [c for c in harness if c not in harness_cols]
        grid_values = {short[k]: run.values[k] for k in keys}
        table.append({"run": run.name, **grid_values, **report_metrics(report), **harness, "status": status})
        curve = ppl_curve(report.get("ppl_by_position")) if report else None
        if curve:
            curves[run.name] = curve
        try:
            check_report(report, report_path)
            complete.append(run.run_dir)
        except ValueError:
            pass
    for row in table:  # a run without a task's score: empty there
        for c in harness_cols:
            row.setdefault(c, None)
    out_dir = Path(out) if out is not None else sweep.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    columns = ["run", *(short[k] for k in keys), *METRICS, *harness_cols, "status"]
    prov = provenance(argv, program="fpa")
    trained_at = {run.name: stage_commit(run.run_dir, "train") for run in sweep.runs}
    evaluated_at = {run.name: stage_commit(run.run_dir, "eval") for run in sweep.runs}

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in table:
        writer.writerow(["" if row[c] is None else row[c] for c in columns])
    (out_dir / "result.csv").write_text(buf.getvalue())

    found = sum(r["status"] == "ok" for r in table)
    commits = sorted({c[:10] for c in trained_at.values() if c})
    evaluated = sorted({c[:10] for c in evaluated_at.values() if c})
    text = [
        f"# Sweep {sweep.name}\n",
        "## Runs\n",
        provenance_md(prov) + "\n",
        f"{len(table)} runs, {found} with an eval report ({sweep.path}); trained at commit "
        f"{', '.join(commits) or 'unknown'}, evaluated at {', '.join(evaluated) or 'unknown'}.\n",
    ]
    numeric = {*METRICS, *harness_cols}
    cells = [[_fmt(r[c]) if c in numeric else str(r[c]) for c in columns] for r in table]
    text.append(markdown_table(columns, cells) + "\n")
    summary = _group_summary(table, [short[k] for k in keys], (*METRICS, *harness_cols))
    if summary:
        text += ["## Mean ± std over seeds\n", summary]
    # Grouped by the swept axis (the grid values but the seed): mean +- 1 std over seeds per group.
    by = [k for k in keys if k != "seed"]
    grouped = [
        (
            ", ".join(f"{short[k]}={format_value(run.values[k])}" for k in by) or sweep.name,
            run_series(run.run_dir, rep),
        )
        for run, rep in zip(sweep.runs, reports)
    ]
    by_length = accuracy_tables(grouped)
    if by_length:
        text += ["## Accuracy by length, mean ± std over seeds\n", by_length]
    if complete:
        text += ["## Details (runs with a complete report)\n", compare_reports(complete)]
    (out_dir / "result.md").write_text("\n".join(text))
    record = {
        "sweep": sweep.name,
        "provenance": prov,
        "trained_at": trained_at,
        "evaluated_at": evaluated_at,
        "columns": columns,
        "runs": table,
    }
    (out_dir / "result.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    _plot(out_dir / "result.png", sweep.name, table, curves)
    plot_grouped(out_dir / "result-grouped.png", sweep.name, grouped)
    return out_dir


def _group_summary(table: list[dict[str, Any]], grid_cols: list[str], metrics: Sequence[str]) -> str:
    """Metrics averaged over the seed axis (if the grid has one), grouped by the other grid values."""
    from pipeline.provenance import markdown_table  # here: it imports torch, as collect_sweep notes

    if "seed" not in grid_cols:
        return ""
    by = [c for c in grid_cols if c != "seed"]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in table:
        groups.setdefault(tuple(row[c] for c in by), []).append(row)
    rows = []
    for key, members in groups.items():
        cells = [str(v) for v in key]
        for metric in metrics:
            vals = [m[metric] for m in members if m[metric] is not None]
            if not vals:
                cells.append("-")
            elif len(vals) == 1:
                cells.append(f"{vals[0]:.4g} (n=1)")
            else:
                cells.append(f"{statistics.mean(vals):.4g} ± {statistics.stdev(vals):.2g} (n={len(vals)})")
        rows.append(cells)
    return markdown_table([*by, *metrics], rows) + "\n"


def _plot(path: Path, title: str, table: list[dict[str, Any]], curves: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["run"].split(".", 1)[-1] for r in table]
    losses = [r["final_val_loss"] if r["final_val_loss"] is not None else math.nan for r in table]
    # Points, not bars from zero: the differences that matter are small next to the loss itself.
    ax_loss.plot(range(len(table)), losses, "o", color="tab:blue")
    ax_loss.set_xticks(range(len(table)), names, rotation=45, ha="right", fontsize=8)
    ax_loss.set_ylabel("final validation loss")
    ax_loss.grid(axis="y", alpha=0.3)
    ax_loss.ticklabel_format(axis="y", useOffset=False)
    ax_loss.margins(x=0.1)
    ax_loss.set_title(f"{title}: final validation loss (missing runs left empty)")
    for name, (pos, ppl) in curves.items():
        ax_ppl.plot(pos, ppl, marker="o", ms=3, label=name.split(".", 1)[-1])
    ax_ppl.set_xlabel("position (bucket start), longest evaluated length")
    ax_ppl.set_ylabel("perplexity")
    ax_ppl.grid(alpha=0.3)
    ax_ppl.set_title("perplexity by position" if curves else "perplexity by position (no reports)")
    if curves:
        ax_ppl.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
