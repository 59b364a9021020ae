"""DeepSpeed checkpoints that resume exactly, on any number of ranks, and survive a kill mid-save.

Layout under <run_dir>/checkpoints/:

    global_step<N>/                 DeepSpeed's files (model + optimizer states, per ZeRO rank)
        rank_state_<r>.pt           per-rank RNG states (python, numpy, torch) and loader cursor
        checksums.json              sha256 and size of every file above, written before COMPLETE
        COMPLETE                    JSON {step, world_size, lineage, ...}: written last, after every rank
    global_step<N>_universal/       made on demand when resuming on a different number of ranks
    latest                          the tag of the newest complete checkpoint (replaced atomically)

client_state (in DeepSpeed's model-states file) holds step, tokens seen, the W&B run id, the resolved
config YAML, the world size, rank 0's loader cursor and "universal_checkpoint_info" (required by
ds_to_universal). A directory without COMPLETE is a save that was interrupted: it is never resumed from
and is removed by the next save.

What a checkpoint survives:
- no code from files: every .pt is read with torch.load(weights_only=True) and an allowlist of the plain
  classes DeepSpeed stores (`safe_load`, and `weights_only_loads` around DeepSpeed's own loaders); a file
  holding a pickled callable is refused (UnsafeCheckpointError) naming it, before anything runs.
- corruption: `verify` checks the checksums and that every file unpickles; a resume falls back to the
  newest checkpoint that passes, naming what was wrong with the others; a save refuses non-finite weights.
- lineages: every checkpoint records the lineage (one continuous training history) it belongs to. A resume
  that starts a new history (resume=none, an older step, another run's checkpoint) first moves the
  checkpoints it would collide with, and the export, to <run_dir>/archive/<time>-<why>/; pruning only
  deletes older checkpoints of the current lineage, never the one just written.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pickle
import random
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_prep.index import sha256_cached, sha256_file
from pipeline import distributed as dist_utils
from pipeline.atomic import atomic_write_text

COMPLETE = "COMPLETE"
LATEST = "latest"
CHECKSUMS = "checksums.json"
ARCHIVE = "archive"
_TAG_RE = re.compile(r"^global_step(\d+)$")
_torch_load = torch.load  # the real one: weights_only_loads() swaps torch.load for a while
log = logging.getLogger("fpa")


class CheckpointError(Exception):
    """A checkpoint that cannot be used, reported as one line."""


class UnsafeCheckpointError(CheckpointError):
    """A file that would run code when unpickled: always refused, never skipped over quietly."""


def _say(msg: str) -> None:
    """What happened to checkpoints: into the stage log (logs/train.log) under `fpa`, else to stdout."""
    if logging.getLogger().handlers:
        log.warning(msg)
    else:
        print(f"[train] {msg}", flush=True)


def tag_for(step: int) -> str:
    return f"global_step{step}"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------------------------------
# Loading without running code


@functools.cache
def _safe_globals() -> tuple[Any, ...]:
    """The classes a checkpoint may hold besides tensors and containers: plain data, no side effects.

    Found with torch.serialization.get_unsafe_globals_in_checkpoint on real saves of ZeRO 0-3, bf16 and
    universal checkpoints: DeepSpeed's optimizer states pickle a loss scaler, the ZeRO stage enum and
    fragment addresses; rank_state holds numpy's RNG state (an ndarray).
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    return (
        multiarray._reconstruct,
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),  # MT19937's key array: numpy.dtypes.UInt32DType
        LossScaler,
        DynamicLossScaler,
        ZeroStageEnum,
        fragment_address,
    )


def _load_error(path: Any, e: Exception) -> CheckpointError:
    text = str(e)
    m = re.search(r"GLOBAL (\S+)", text)
    if m:  # the file names a callable or class outside the allowlist: unpickling it could run code
        return UnsafeCheckpointError(
            f"{path} holds a pickled {m.group(1).rstrip('.')}, not plain checkpoint data: refusing to "
            f"load it (files are read with weights_only=True)"
        )
    detail = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), type(e).__name__)
    if "Check the documentation" in detail:  # torch's trailer: take the line before it
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        detail = lines[-2] if len(lines) > 1 else detail
    return CheckpointError(f"{path} is unreadable ({detail[:200]})")


def safe_load(path: str | Path, *, mmap: bool = False) -> Any:
    """torch.load(path, weights_only=True) with the allowlist, on the CPU.

    Raises UnsafeCheckpointError for a file that would run code, CheckpointError for one that does not
    load (truncated, garbage). mmap=True reads the pickle but leaves tensor data on disk (a cheap check).
    """
    try:
        with torch.serialization.safe_globals(list(_safe_globals())):
            try:
                return _torch_load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as e:
                if not (mmap and "mmap can only be used" in str(e)):
                    raise
                return _torch_load(path, map_location="cpu", weights_only=True)  # an old (legacy) format
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        raise _load_error(path, e) from None


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Within: every torch.load in this process reads with weights_only=True and the allowlist.

    DeepSpeed's loaders (engine.load_checkpoint, zero_to_fp32, ds_to_universal) call
    torch.load(weights_only=False) themselves; they reach torch.load through the module attribute, so
    swapping it for the duration covers them all. Not thread-safe: meant for the loading phase.
    """
    real = torch.load

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        kwargs.pop("pickle_module", None)
        try:
            with torch.serialization.safe_globals(list(_safe_globals())):
                return _torch_load(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            raise _load_error(f, e) from None

    torch.load = load  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.load = real  # type: ignore[assignment]


# ----------------------------------------------------------------------------------------------------
# Checksums and verification


def _payload_files(d: Path) -> list[Path]:
    """Every file a checkpoint's state is in: all but the markers and temp files of atomic writes."""
    skip = {COMPLETE, CHECKSUMS}
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name not in skip and p.name[0] != ".")


def write_checksums(d: Path, names: list[str] | None = None) -> None:
    """d/checksums.json: sha256 and size of the named files (default: every payload file under d)."""
    files = [d / n for n in names] if names is not None else _payload_files(d)
    record = {str(f.relative_to(d)): {"sha256": sha256_file(f), "bytes": f.stat().st_size} for f in files}
    atomic_write_text(d / CHECKSUMS, json.dumps({"files": record}, indent=1, sort_keys=True))


def checksum_problem(d: Path) -> str | None:
    """What differs from d/checksums.json (a missing, truncated or changed file), or None.

    A directory without checksums.json (saved by older code) has nothing to compare: None.
    """
    f = d / CHECKSUMS
    if not f.is_file():
        return None
    try:
        record = json.loads(f.read_text())["files"]
        items = [(name, int(v["bytes"]), str(v["sha256"])) for name, v in record.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{f} is unreadable"
    for name, size, digest in items:
        p = d / name
        if Path(name).is_absolute() or ".." in Path(name).parts:  # a file from elsewhere: never read it
            return f"{d / CHECKSUMS} names {name}, outside the checkpoint"
        if not p.is_file():
            return f"{p} is missing"
        actual = p.stat().st_size
        if actual < size:
            return f"{p} is truncated ({actual} of {size} bytes)"
        if actual != size:
            return f"{p} has {actual} bytes, {size} were saved"
        if sha256_cached(p) != digest:  # an eval's input check hashed the same export already
            return f"{p} is corrupted (its sha256 differs from the one recorded at save)"
    return None


def _rank_state_problem(f: Path, state: Any) -> str | None:
    rng = state.get("rng") if isinstance(state, dict) else None
    if not isinstance(rng, dict) or not {"python", "numpy", "torch"} <= set(rng):
        return f"{f} is not a rank state (expected a dict with rng states)"
    return None


def verify_files(d: Path) -> str | None:
    """Every .pt under d unpickles as plain data and every file matches checksums.json.

    Returns what is wrong (None: nothing found). Raises UnsafeCheckpointError at once for a file that
    would run code: that is never a damaged checkpoint to skip, it is a file from someone else.
    """
    problems: list[str | None] = []
    for f in sorted(d.rglob("*.pt")):  # every file, before anything else: refuse code whatever is damaged
        rank_state = f.name.startswith("rank_state_")
        try:
            obj = safe_load(f, mmap=not rank_state)  # tensor data stays on disk: the checksums cover it
        except UnsafeCheckpointError:
            raise
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if rank_state:
            problems.append(_rank_state_problem(f, obj))
    return checksum_problem(d) or next((p for p in problems if p), None)


def verify(ckpt: Path) -> str | None:
    """What makes ckpt unusable for a resume (None: it is complete and intact)."""
    if read_meta(ckpt) is None:
        return f"{ckpt} is incomplete (no {COMPLETE} marker)"
    if not any(ckpt.glob("*model_states.pt")):
        return f"{ckpt} holds no DeepSpeed model states (*model_states.pt)"
    return verify_files(ckpt)


# ----------------------------------------------------------------------------------------------------
# Finding checkpoints


def read_meta(ckpt_dir: Path) -> dict[str, Any] | None:
    """The COMPLETE marker of a checkpoint dir, or None when the save never finished."""
    marker = ckpt_dir / COMPLETE
    if not marker.is_file():
        return None
    try:
        meta = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def lineage_of(ckpt_dir: Path) -> str:
    """The lineage a checkpoint belongs to ("" for checkpoints saved before lineages were recorded)."""
    return str((read_meta(ckpt_dir) or {}).get("lineage") or "")


def new_lineage() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint under root, oldest first."""
    out = []
    if root.is_dir():
        for d in root.iterdir():
            m = _TAG_RE.match(d.name)
            if m and d.is_dir() and read_meta(d) is not None:
                out.append((int(m.group(1)), d))
    return sorted(out)


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint: the `latest` file if it names one, else the highest complete step."""
    latest = root / LATEST
    if latest.is_file():
        cand = root / latest.read_text().strip()
        if read_meta(cand) is not None:
            done = complete_checkpoints(root)
            # `latest` is written last, so a newer complete dir can only exist if that write was cut off.
            if not done or done[-1][1] == cand:
                return cand
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


def resolve_resume(resume: str, root: Path) -> Path | None:
    """Map checkpoint.resume (auto | none | <path>) to a complete checkpoint dir, or None (fresh start)."""
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest(root)
    path = Path(resume)
    if path.is_dir() and read_meta(path) is None and find_latest(path) is not None:
        path = find_latest(path)  # a checkpoints/ root was given
    if not path.is_dir():
        raise CheckpointError(f"train.checkpoint.resume: no such checkpoint directory {path}")
    if read_meta(path) is None:
        raise CheckpointError(f"train.checkpoint.resume: {path} is incomplete (no {COMPLETE} marker)")
    return path


def _newest_good(root: Path) -> Path | None:
    """The newest complete checkpoint under root that passes `verify`, saying why the newer ones fail."""
    latest = find_latest(root)
    if latest is None:
        return None
    order = [latest] + [d for _, d in reversed(complete_checkpoints(root)) if d != latest]
    bad = []
    for cand in order:
        problem = verify(cand)
        if problem is None:
            return cand
        bad.append(problem)
        _say(f"cannot resume from {cand.name}: {problem}; trying the one before it")
    raise CheckpointError(
        f"no usable checkpoint in {root} ({'; '.join(bad)}); train.checkpoint.resume=none starts over "
        f"(it moves them to {root.parent / ARCHIVE})"
    )


@dataclass(frozen=True)
class ResumePlan:
    """Where training starts: the checkpoint (None: from scratch) and the lineage its saves belong to."""

    checkpoint: Path | None
    lineage: str
    archived: Path | None = None


def plan_resume(resume: str, root: Path) -> ResumePlan:
    """Not collective (rank 0): the verified checkpoint to resume from, and a clear field for the saves.

    resume=auto takes the newest intact checkpoint (falling back past damaged ones); a path takes that
    checkpoint, or the newest intact one of a checkpoints/ root. A resume that is not the continuation
    of the newest checkpoint here (none, an older step, another run's checkpoint) starts a new lineage
    and first moves what it would otherwise overwrite or be confused with (every later checkpoint, or
    all of them, and the export) to the run's archive/.
    """
    if resume == "none":
        ckpt = None
    elif resume == "auto":
        ckpt = _newest_good(root)
    else:
        path = Path(resume)
        if path.is_dir() and read_meta(path) is None and find_latest(path) is not None:
            ckpt = _newest_good(path)  # a checkpoints/ root
        else:
            ckpt = resolve_resume(resume, root)
            assert ckpt is not None
            problem = verify(ckpt)
            if problem:
                raise CheckpointError(f"train.checkpoint.resume={resume}: {problem}")
    here = complete_checkpoints(root)
    if ckpt is not None and ckpt.parent.resolve() == root.resolve():
        step = int(_TAG_RE.match(ckpt.name).group(1))  # type: ignore[union-attr]
        later = [d for s, d in here if s > step]
        if not later:  # the newest checkpoint here: its history continues
            return ResumePlan(ckpt, lineage_of(ckpt))
        why = f"resume-step{step}"
    else:
        later = [d for _, d in here]
        why = "fresh-start" if ckpt is None else "resume-other-run"
    lineage = new_lineage()
    export = root.parent / "export"
    moving = later + ([export] if export.exists() else [])
    if not moving:
        return ResumePlan(ckpt, lineage)
    dest = archive(root.parent, moving, why, {"resume": resume, "from": str(ckpt), "new_lineage": lineage})
    metrics = root.parent / "metrics.jsonl"
    if metrics.is_file():  # the old curve goes along; a rollback shares its steps up to the resume point
        (shutil.copy2 if why.startswith("resume-step") else shutil.move)(metrics, dest / metrics.name)
    if (root / LATEST).is_file() and not (root / (root / LATEST).read_text().strip()).is_dir():
        (root / LATEST).unlink()  # it named a moved checkpoint; the next save writes it again
    _say(
        f"train.checkpoint.resume={resume} starts a new history: moved "
        f"{', '.join(p.name for p in moving)} to {dest} "
        f"(to go back: train.checkpoint.resume={dest / 'checkpoints'})"
    )
    return ResumePlan(ckpt, lineage, dest)


def choose_resume(resume: str, root: Path) -> ResumePlan:
    """Collective: rank 0 plans (verifies, archives), every rank gets the plan or the same error."""
    plan, err = None, None
    if dist_utils.rank() == 0:
        try:
            plan = plan_resume(resume, root)
        except CheckpointError as e:
            err = (type(e).__name__, str(e))
    plan, err = dist_utils.broadcast_object((plan, err))  # type: ignore[misc]
    if err is not None:
        raise (UnsafeCheckpointError if err[0] == "UnsafeCheckpointError" else CheckpointError)(err[1])
    assert plan is not None
    return plan


def archive(run_dir: Path, paths: list[Path], why: str, note: dict[str, Any]) -> Path:
    """Move paths (under run_dir) to run_dir/archive/<time>-<why>/, keeping their relative layout, with a
    note of what and why. A checkpoint takes its _universal twin along. Nothing is deleted."""
    base = run_dir / ARCHIVE / f"{time.strftime('%Y%m%d-%H%M%S')}-{why}"
    dest, n = base, 1
    while dest.exists():
        n += 1
        dest = base.with_name(f"{base.name}-{n}")
    dest.mkdir(parents=True)
    moved = []
    for p in paths:
        for q in (p, universal_dir(p)) if _TAG_RE.match(p.name) else (p,):
            if not q.exists():
                continue
            target = dest / q.resolve().relative_to(run_dir.resolve())
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(q), target)
            moved.append({"path": str(target.relative_to(dest)), "lineage": lineage_of(target)})
    info = {**note, "why": why, "moved": moved, "time": time.time(), "host": socket.gethostname()}
    atomic_write_text(dest / "ARCHIVED.json", json.dumps(info, indent=2, default=str) + "\n")
    return dest


# ----------------------------------------------------------------------------------------------------
# Saving


def _nonfinite_params(engine: Any) -> list[str]:
    """Names of this rank's parameters holding NaN/inf (ZeRO-3: the rank's partition)."""
    bad = []
    for name, p in engine.module.named_parameters():
        t = getattr(p, "ds_tensor", None)
        t = p.data if t is None else t
        if t.numel() and not bool(torch.isfinite(t).all()):
            bad.append(name)
    return bad


def save(
    engine: Any,
    root: Path,
    step: int,
    client_state: dict[str, Any],
    rank_state: dict[str, Any],
    keep_last: int,
    lineage: str = "",
) -> Path:
    """Collective: every rank calls it. Returns the checkpoint dir once it is complete on disk.

    Refuses (CheckpointError, nothing written) when any rank's weights are not finite: a NaN model saved
    as COMPLETE would become `latest` and prune the last good checkpoint.
    """
    tag = tag_for(step)
    ckpt = root / tag
    rank = dist_utils.rank()
    bad = _nonfinite_params(engine)
    if dist_utils.all_reduce_max(float(len(bad))) > 0:
        where = ", ".join(bad[:3]) + ("..." if len(bad) > 3 else "") if bad else "on another rank"
        raise CheckpointError(
            f"refusing to save {tag}: the weights are not finite ({where}); the previous checkpoint "
            f"and {root / LATEST} are left as they were"
        )
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if ckpt.exists():
            if read_meta(ckpt) is None:  # a save that was cut off: not a checkpoint
                shutil.rmtree(ckpt)
            else:  # a complete checkpoint with this tag (another history): keep it, out of the way
                dest = archive(root.parent, [ckpt], f"replaced-{tag}", {"lineage": lineage})
                _say(f"{tag} existed already: moved it to {dest}")
    dist_utils.barrier()
    state = dict(client_state)
    state.setdefault("universal_checkpoint_info", {})
    engine.save_checkpoint(str(root), tag=tag, client_state=state, save_latest=False)
    torch.save(rank_state, ckpt / f"rank_state_{rank}.pt")
    dist_utils.barrier()  # every rank's files are written before the marker says so
    if rank == 0:
        write_checksums(ckpt)
        meta = {"step": step, "world_size": dist_utils.world_size(), "tag": tag, "lineage": lineage}
        meta.update({k: client_state[k] for k in ("tokens_seen", "wandb_run_id") if k in client_state})
        atomic_write_text(ckpt / COMPLETE, json.dumps(meta))
        atomic_write_text(root / LATEST, tag)
        _prune(root, keep_last, current=step, lineage=lineage)
    dist_utils.barrier()
    return ckpt


def _prune(root: Path, keep_last: int, current: int, lineage: str | None = None) -> None:
    """Keep the last keep_last complete checkpoints of `lineage` (None: of any) and every checkpoint of
    another lineage; never the one just written (`current`). Drop older interrupted saves and the
    universal twins of checkpoints that are gone."""
    done = complete_checkpoints(root)
    keep = {d for _, d in done}
    ours = [(s, d) for s, d in done if lineage is None or lineage_of(d) == lineage]
    if keep_last > 0:
        keep -= {d for s, d in ours[:-keep_last] if s != current}
    for d in root.iterdir():
        m = _TAG_RE.match(d.name.removesuffix("_universal"))
        if not m or not d.is_dir():
            continue
        base = root / tag_for(int(m.group(1)))
        incomplete_old = read_meta(base) is None and int(m.group(1)) < current
        if base not in keep or incomplete_old:
            shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------
# Universal checkpoints, loading


def universal_dir(ckpt: Path) -> Path:
    return ckpt.with_name(ckpt.name + "_universal")


# ds_to_universal calls torch.load(weights_only=False) itself: run it with torch.load swapped.
_UNIVERSAL_SCRIPT = (
    "import runpy, sys\n"
    "from pipeline.checkpoint import weights_only_loads\n"
    "sys.argv[0] = 'ds_to_universal'\n"
    "with weights_only_loads():\n"
    "    runpy.run_module('deepspeed.checkpoint.ds_to_universal', run_name='__main__', alter_sys=True)\n"
)


def convert_to_universal(ckpt: Path, out: Path) -> Path:
    """Run DeepSpeed's ds_to_universal on ckpt into out (not collective); returns out."""
    if out.exists():
        shutil.rmtree(out)
    cmd = [
        sys.executable,
        "-c",
        _UNIVERSAL_SCRIPT,
        "--input_folder",
        str(ckpt),
        "--output_folder",
        str(out),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        raise CheckpointError(f"converting {ckpt} to a universal checkpoint failed: {tail[0]}")
    return out


def ensure_universal(ckpt: Path) -> Path:
    """Collective: rank 0 converts ckpt to a universal checkpoint (once); returns its dir."""
    out = universal_dir(ckpt)
    if dist_utils.rank() == 0 and not ((out / COMPLETE).is_file() and checksum_problem(out) is None):
        convert_to_universal(ckpt, out)
        write_checksums(out)
        atomic_write_text(out / COMPLETE, (ckpt / COMPLETE).read_text())
    dist_utils.barrier()
    return out


def load(engine: Any, ckpt: Path, universal: bool) -> dict[str, Any]:
    """Collective: load model + optimizer states; return the client state."""
    src = universal_dir(ckpt) if universal else ckpt
    with weights_only_loads():
        path, client = engine.load_checkpoint(
            str(src.parent), tag=src.name, load_optimizer_states=True, load_lr_scheduler_states=False
        )
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load the checkpoint in {src}")
    return client or {}


def load_rank_state(ckpt: Path, rank: int) -> dict[str, Any] | None:
    f = ckpt / f"rank_state_{rank}.pt"
    if not f.is_file():
        return None
    state = safe_load(f)
    problem = _rank_state_problem(f, state)
    if problem:
        raise CheckpointError(problem)
    return state
