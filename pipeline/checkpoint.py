"""DeepSpeed checkpoints that resume exactly, on any number of ranks, and survive a kill mid-save.

Layout under <run_dir>/checkpoints/:

    global_step<N>/                 DeepSpeed's files (model + optimizer states, per ZeRO rank)
        rank_state_<r>.pt           per-rank RNG states (python, numpy, torch) and loader cursor
        COMPLETE                    JSON {step, world_size, ...}: written last, after every rank finished
    global_step<N>_universal/       made on demand when resuming on a different number of ranks
    latest                          the tag of the newest complete checkpoint (replaced atomically)

client_state (in DeepSpeed's model-states file) holds step, tokens seen, the W&B run id, the resolved
config YAML, the world size, rank 0's loader cursor and "universal_checkpoint_info" (required by
ds_to_universal). A directory without COMPLETE is a save that was interrupted: it is never resumed from
and is removed by the next save.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline import distributed as dist_utils
from pipeline.atomic import atomic_write_text

COMPLETE = "COMPLETE"
LATEST = "latest"
_TAG_RE = re.compile(r"^global_step(\d+)$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used, reported as one line."""


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


def read_meta(ckpt_dir: Path) -> dict[str, Any] | None:
    """The COMPLETE marker of a checkpoint dir, or None when the save never finished."""
    marker = ckpt_dir / COMPLETE
    if not marker.is_file():
        return None
    try:
        return json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None


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


def save(
    engine: Any,
    root: Path,
    step: int,
    client_state: dict[str, Any],
    rank_state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Collective: every rank calls it. Returns the checkpoint dir once it is complete on disk."""
    tag = tag_for(step)
    ckpt = root / tag
    rank = dist_utils.rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if ckpt.exists():  # a leftover (incomplete, or a rerun of the same step): replace it whole
            shutil.rmtree(ckpt)
    dist_utils.barrier()
    state = dict(client_state)
    state.setdefault("universal_checkpoint_info", {})
    engine.save_checkpoint(str(root), tag=tag, client_state=state, save_latest=False)
    torch.save(rank_state, ckpt / f"rank_state_{rank}.pt")
    dist_utils.barrier()  # every rank's files are written before the marker says so
    if rank == 0:
        meta = {"step": step, "world_size": dist_utils.world_size(), "tag": tag}
        meta.update({k: client_state[k] for k in ("tokens_seen", "wandb_run_id") if k in client_state})
        atomic_write_text(ckpt / COMPLETE, json.dumps(meta))
        atomic_write_text(root / LATEST, tag)
        _prune(root, keep_last, current=step)
    dist_utils.barrier()
    return ckpt


def _prune(root: Path, keep_last: int, current: int) -> None:
    done = complete_checkpoints(root)
    keep = {d for _, d in done[-keep_last:]} if keep_last > 0 else {d for _, d in done}
    for d in root.iterdir():
        m = _TAG_RE.match(d.name.removesuffix("_universal"))
        if not m or not d.is_dir():
            continue
        base = root / tag_for(int(m.group(1)))
        incomplete_old = read_meta(base) is None and int(m.group(1)) < current
        if base not in keep or incomplete_old:
            shutil.rmtree(d, ignore_errors=True)


def universal_dir(ckpt: Path) -> Path:
    return ckpt.with_name(ckpt.name + "_universal")


def convert_to_universal(ckpt: Path, out: Path) -> Path:
    """Run DeepSpeed's ds_to_universal on ckpt into out (not collective); returns out."""
    if out.exists():
        shutil.rmtree(out)
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(ckpt),
        "--output_folder",
        str(out),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        raise CheckpointError(f"converting {ckpt} to a universal checkpoint failed: {tail[0]}")
    return out


def ensure_universal(ckpt: Path) -> Path:
    """Collective: rank 0 converts ckpt to a universal checkpoint (once); returns its dir."""
    out = universal_dir(ckpt)
    if dist_utils.rank() == 0 and not (out / COMPLETE).is_file():
        convert_to_universal(ckpt, out)
        atomic_write_text(out / COMPLETE, (ckpt / COMPLETE).read_text())
    dist_utils.barrier()
    return out


def load(engine: Any, ckpt: Path, universal: bool) -> dict[str, Any]:
    """Collective: load model + optimizer states; return the client state."""
    src = universal_dir(ckpt) if universal else ckpt
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
    return torch.load(f, map_location="cpu", weights_only=False)
