"""Rank-0 run logging behind one interface: console (tqdm), Weights & Biases, and a no-op for other ranks.

    logger = make_logger(cfg, rank, run_id)   # run_id: persisted in checkpoints so a resumed job
    logger.log({"train/loss": 2.3}, step)     # continues the same W&B run
    logger.log_table("passkey", ["len", "acc"], rows)
    logger.summary({"final/loss": 2.1})
    logger.finish()

W&B runs offline by default (no network, `wandb sync` later); `logging.wandb_mode: online` uploads live.
`read_wandb_file` parses an offline run's .wandb file (there is no public offline reader in wandb 0.31).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import struct
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig, to_yaml
from pipeline.rundir import git_info


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
    test_mode = bool(os.environ.get("PYTEST_CURRENT_TEST")) or cfg.logging.quiet_wandb
    wb = WandbLogger(cfg, run_id or new_run_id(), cfg.run_dir, test_mode=test_mode)
    return MultiLogger(console, wb)


# ----------------------------------------------------------------------------------------------------
# Reading an offline run back (tests, post-hoc checks)

_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) records
_FILE_HEADER = 7  # ":W&B" + magic 0xBEE1 + version byte


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log (bad header)")
    out: list[bytes] = []
    pos, partial = _FILE_HEADER, b""
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # a block tail too short for a record header is zero padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        chunk = data[pos : pos + length]
        pos += length
        if kind == 0 and length == 0:
            break
        if kind == 1:  # full
            out.append(chunk)
        elif kind == 2:  # first
            partial = chunk
        elif kind == 3:  # middle
            partial += chunk
        elif kind == 4:  # last
            out.append(partial + chunk)
    return out


def read_wandb_file(path: str | Path) -> dict[str, Any]:
    """Parse a run-<id>.wandb file: {"run_id", "config", "history": [{key: value}], "summary", "finished"}."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(path)
    # finished: the exit record is written (the W&B service may still be flushing just after finish()).
    result: dict[str, Any] = {"run_id": None, "config": {}, "history": [], "summary": {}, "finished": False}

    def key_of(item: Any) -> str:
        return item.key or "/".join(item.nested_key)

    for raw in _records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            result["run_id"] = rec.run.run_id
            for item in rec.run.config.update:
                result["config"][key_of(item)] = json.loads(item.value_json)
        elif kind == "history":
            result["history"].append({key_of(it): json.loads(it.value_json) for it in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                result["summary"][key_of(item)] = json.loads(item.value_json)
        elif kind == "exit":
            result["finished"] = True
    return result


def read_finished_wandb_file(path: str | Path, timeout_s: float = 30.0) -> dict[str, Any]:
    """read_wandb_file once the segment's exit record is on disk (or raise TimeoutError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rec = read_wandb_file(path)
        if rec["finished"]:
            return rec
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} has no exit record after {timeout_s} s")
        time.sleep(0.1)


def find_wandb_files(run_dir: str | Path, run_id: str) -> list[Path]:
    """The .wandb files of one run id under <run_dir>/wandb, oldest first (one per resumed segment)."""
    files = Path(run_dir, "wandb").glob(f"*-{run_id}/run-{run_id}.wandb")
    return sorted(files, key=lambda p: (p.stat().st_mtime, p.name))
