"""Run directories and per-stage manifests.

runs/<name>/
  config.yaml            the fully resolved config of the latest invocation (older ones in config_history/)
  git.json               code version: git SHA and whether the tree was dirty
  manifests/<stage>.json status, fingerprint, inputs and outputs with hashes, timings, result summary
  logs/<stage>.log       everything the stage logged

A stage is skipped when its manifest says "done" with the same fingerprint: a hash of the config sections
the stage reads and of its input files. Any change to those redoes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data_prep.index import sha256_file
from pipeline.atomic import atomic_write_text
from pipeline.config import RunConfig, from_yaml_text, to_yaml

STAGES = ("prepare", "train", "eval")
log = logging.getLogger("fpa")


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def git_info() -> dict[str, Any]:
    """The SHA of the checkout this code runs from ("unknown" outside a git checkout)."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                check=True,
                timeout=10,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        return {"sha": "unknown", "dirty": None}
    return {"sha": sha, "dirty": dirty}


@dataclass
class Manifest:
    stage: str
    status: str  # running | done | failed
    fingerprint: str
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, str] = field(
        default_factory=dict
    )  # path (relative to the run dir if inside) -> sha256
    result: dict[str, Any] = field(default_factory=dict)
    git: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0
    finished: float | None = None
    seconds: float | None = None
    error: str | None = None


class RunDir:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.path = cfg.run_dir

    # -- layout ------------------------------------------------------------------------------------
    def manifest_path(self, stage: str) -> Path:
        return self.path / "manifests" / f"{stage}.json"

    def log_path(self, stage: str) -> Path:
        return self.path / "logs" / f"{stage}.log"

    def init(self) -> None:
        """Create the run dir and record the resolved config and code version (keeping older configs)."""
        self.path.mkdir(parents=True, exist_ok=True)
        text = to_yaml(self.cfg)
        cfg_path = self.path / "config.yaml"
        if cfg_path.exists() and cfg_path.read_text() != text and not self._only_vocab_resolved(cfg_path):
            hist = self.path / "config_history"
            hist.mkdir(exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(cfg_path.stat().st_mtime))
            shutil.copy2(cfg_path, hist / f"config-{stamp}.yaml")
        atomic_write_text(cfg_path, text)
        atomic_write_text(self.path / "git.json", json.dumps(git_info(), indent=2) + "\n")

    def _only_vocab_resolved(self, saved: Path) -> bool:
        """True when the saved config differs only by training having filled in model.vocab_size from the
        data (not a change worth keeping in config_history)."""
        try:
            old = from_yaml_text(saved.read_text())
        except Exception:  # an unreadable or older-schema config is kept in history
            return False
        if None not in (old.model.vocab_size, self.cfg.model.vocab_size):
            return False
        vocab = old.model.vocab_size or self.cfg.model.vocab_size
        same = dataclasses.replace(self.cfg, model=dataclasses.replace(self.cfg.model, vocab_size=vocab))
        return dataclasses.replace(old, model=dataclasses.replace(old.model, vocab_size=vocab)) == same

    # -- manifests ---------------------------------------------------------------------------------
    def read_manifest(self, stage: str) -> Manifest | None:
        p = self.manifest_path(stage)
        if not p.exists():
            return None
        try:
            return Manifest(**json.loads(p.read_text()))
        except (json.JSONDecodeError, TypeError):
            log.warning("ignoring unreadable manifest %s", p)
            return None

    def write_manifest(self, m: Manifest) -> None:
        atomic_write_text(self.manifest_path(m.stage), json.dumps(asdict(m), indent=2, default=str) + "\n")

    def is_done(self, stage: str, fingerprint: str) -> bool:
        m = self.read_manifest(stage)
        return m is not None and m.status == "done" and m.fingerprint == fingerprint

    def rel(self, p: Path) -> str:
        try:
            return str(Path(p).resolve().relative_to(self.path.resolve()))
        except ValueError:
            return str(p)

    @contextlib.contextmanager
    def stage(self, stage: str, inputs: dict[str, Any]) -> Iterator[Manifest]:
        """Run a stage body: writes a 'running' manifest, then 'done' (or 'failed' with the error) with
        timings, and tees all logging into logs/<stage>.log. The body fills `outputs` and `result`."""
        self.init()
        m = Manifest(
            stage=stage,
            status="running",
            fingerprint=sha256_json(inputs),
            inputs=inputs,
            git=git_info(),
            started=time.time(),
        )
        self.write_manifest(m)
        self.log_path(stage).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(self.log_path(stage))
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        root.addHandler(handler)
        try:
            yield m
        except BaseException as e:
            m.status, m.error = "failed", f"{type(e).__name__}: {e}"
            raise
        else:
            m.status = "done"
        finally:
            m.finished = time.time()
            m.seconds = round(m.finished - m.started, 3)
            self.write_manifest(m)
            root.removeHandler(handler)
            handler.close()


class RunDirBusy(RuntimeError):
    """Another process holds the run dir's lock (its pid and host are in the message)."""


_held: dict[str, int] = {}  # lock files this process holds -> nesting depth


@contextlib.contextmanager
def run_lock(run_dir: Path, name: str = "train") -> Iterator[None]:
    """Hold an exclusive flock on <run_dir>/<name>.lock while the body runs: a second holder fails at
    once (RunDirBusy) naming the first's pid and host instead of both writing one run dir.

    The kernel drops the lock when its process dies, so a SIGKILLed trainer leaves none behind; the file
    stays, holding the last holder's details. flock is per node on some network file systems: two
    trainers on different nodes may both get it there (one job per run dir is the rule under Slurm).
    Re-entrant within a process (a stage wrapper and train() may both take it): flock is per open file,
    so a second open in the same process would otherwise refuse its own holder.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"{name}.lock"
    key = str(path.resolve())
    if key in _held:
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(path.read_text() or "{}")
            except (OSError, ValueError):
                holder = {}
            who = (
                f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
                f"since {holder.get('since', '?')}"
                if holder
                else "a process that has not written its details yet"
            )
            raise RunDirBusy(
                f"{run_dir} is in use by another {name} ({who}; lock {path}): wait for it to finish or stop "
                f"it, or use another run name"
            ) from None
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        _held[key] = 1
        try:
            yield
        finally:
            del _held[key]
    finally:
        os.close(fd)  # releases the lock


def stage_commit(run_dir: Path, stage: str) -> str | None:
    """The commit a run's `stage` last ran at: its manifest's git sha, else the run's git.json (written by
    every invocation, so only a fallback for runs without a manifest); None when unknown."""
    for path, key in ((run_dir / "manifests" / f"{stage}.json", "git"), (run_dir / "git.json", None)):
        try:
            info = json.loads(path.read_text())
            sha = info[key]["sha"] if key else info["sha"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(sha, str) and sha != "unknown":
            return sha
    return None


def hash_outputs(run: RunDir, paths: list[Path]) -> dict[str, str]:
    return {run.rel(p): sha256_file(p) for p in paths if Path(p).is_file()}
