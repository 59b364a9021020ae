"""Rank-0 run logging behind one interface: console (tqdm), Weights & Biases, and a no-op for other ranks.

    logger = make_logger(cfg, rank, run_id)   # run_id: persisted in checkpoints so a resumed job
    logger.log({"train/loss": 2.3}, step)     # continues the same W&B run
    logger.log_table("passkey", ["len", "acc"], rows)
    logger.summary({"final/loss": 2.1})
    logger.finish()

W&B runs offline by default (no network, `wandb sync` later); `logging.wandb_mode: online` uploads live.
"""

from __future__ import annotations

import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig, to_yaml
from pipeline.rundir import git_info

# Set to 1, this turns logging.quiet_wandb on for every run of the process and its children, whatever the
# configs say (the test suite sets it in tests/conftest.py: W&B then starts fast and quiet).
QUIET_WANDB_ENV = "FPA_QUIET_WANDB"


class RunLogger:
    """The interface every rank holds; the base class is the no-op used on ranks other than 0."""

    run_id: str | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record scalar metrics at an optimizer step."""

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        """Record a small table (eval grids, per-layer figures)."""

    def summary(self, values: dict[str, Any]) -> None:
        """Record final values of the run."""

    def progress(self, step: int, total: int) -> None:
        """Advance the console progress bar to `step` of `total`."""

    def finish(self) -> None:
        """Flush and close; safe to call twice."""


NullLogger = RunLogger


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5) or not math.isfinite(v):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


class ConsoleLogger(RunLogger):
    """Metrics as one line per log call, a tqdm bar over the steps, tables as aligned text."""

    def __init__(self, progress: bool = True, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.use_bar = progress
        self._bar: Any = None

    def _write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def progress(self, step: int, total: int) -> None:
        if not self.use_bar:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=step, unit="step", file=sys.stderr, dynamic_ncols=True)
        self._bar.update(step - self._bar.n)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        body = " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
        self._write(f"step {step}: {body}")

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        cells = [[str(c) for c in columns]] + [[_fmt(v) for v in r] for r in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
        lines = [f"== {name} =="]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
        self._write("\n".join(lines))

    def summary(self, values: dict[str, Any]) -> None:
        self._write("summary: " + " ".join(f"{k}={_fmt(v)}" for k, v in values.items()))

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class MultiLogger(RunLogger):
    """Fan out to several loggers (console + W&B)."""

    def __init__(self, *loggers: RunLogger) -> None:
        self.loggers = list(loggers)
        self.run_id = next((lg.run_id for lg in self.loggers if lg.run_id), None)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for lg in self.loggers:
            lg.log(metrics, step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        for lg in self.loggers:
            lg.log_table(name, columns, rows)

    def summary(self, values: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.summary(values)

    def progress(self, step: int, total: int) -> None:
        for lg in self.loggers:
            lg.progress(step, total)

    def finish(self) -> None:
        for lg in self.loggers:
            lg.finish()


def git_sha() -> str | None:
    """The code's HEAD commit ("-dirty" with local changes), or None outside a git checkout."""
    info = git_info()
    if info["sha"] == "unknown":
        return None
    return info["sha"] + ("-dirty" if info["dirty"] else "")


def new_run_id() -> str:
    """A fresh W&B-style run id (8 lowercase alphanumerics)."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbLogger(RunLogger):
    """A W&B run in <run_dir>/wandb, resumed by id (resume="allow") so a requeued job continues it."""

    def __init__(self, cfg: RunConfig, run_id: str, run_dir: Path, *, test_mode: bool = False) -> None:
        import wandb
        from omegaconf import OmegaConf

        run_dir.mkdir(parents=True, exist_ok=True)
        settings: dict[str, Any] = {}
        if test_mode:  # no console capture, no system-stats thread, no git probing: fast and quiet
            settings = {"console": "off", "x_disable_stats": True, "disable_git": True}
        config = OmegaConf.to_container(OmegaConf.create(to_yaml(cfg)), resolve=True)
        assert isinstance(config, dict)
        config["git_sha"] = git_sha()
        _avoid_same_second_dir(run_dir / "wandb", run_id)
        self._wandb = wandb
        self.run = wandb.init(
            project=cfg.logging.project,
            entity=cfg.logging.entity,
            group=cfg.logging.group,
            tags=list(cfg.logging.tags) or None,
            name=cfg.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=cfg.logging.wandb_mode,
            config=config,
            settings=wandb.Settings(**settings),
        )
        self.run_id = self.run.id

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({name: self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])})

    def summary(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            self.run.summary[k] = v

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _avoid_same_second_dir(wandb_dir: Path, run_id: str) -> None:
    """W&B names a segment's folder <mode>-run-<YYYYmmdd_HHMMSS>-<id>; a resume of the same id within the
    same second reuses the folder and the new segment's .wandb file replaces the old one (data loss).
    Wait for the next second when that would happen (restarts in tests and quick retries)."""
    import datetime

    if not wandb_dir.is_dir():
        return
    stamps = {d.name.split("-")[2] for d in wandb_dir.glob(f"*-run-*-{run_id}") if d.name.count("-") >= 3}
    for _ in range(3):
        if datetime.datetime.now().strftime("%Y%m%d_%H%M%S") not in stamps:
            return
        time.sleep(1.0 - (time.time() % 1.0) + 0.01)


def make_logger(cfg: RunConfig, rank: int, run_id: str | None) -> RunLogger:
    """Console (+ W&B unless disabled) on rank 0, a no-op elsewhere.

    run_id: the W&B id from the checkpoint being resumed (None: a new run). The logger's `run_id` is the
    id to persist in the next checkpoint.
    """
    if rank != 0:
        return RunLogger()
    console = ConsoleLogger(progress=cfg.logging.progress)
    if cfg.logging.wandb_mode == "disabled":
        console.run_id = run_id
        return console
    quiet = cfg.logging.quiet_wandb or os.environ.get(QUIET_WANDB_ENV, "") not in ("", "0")
    wb = WandbLogger(cfg, run_id or new_run_id(), cfg.run_dir, test_mode=quiet)
    return MultiLogger(console, wb)
