"""The training state that goes into a checkpoint and comes back on resume, and when to save it.

The low-level part (verified save/load, checksums, lineages, universal conversion) is pipeline.checkpoint;
here is what the trainer puts into DeepSpeed's client state and the per-rank state file:

    client state (rank 0's, one per checkpoint): step, tokens seen, skipped-step counters, the loss-spike
        window, last losses, W&B run id, resolved config YAML, world size, rank 0's loader cursor, lineage
    rank state (one per rank): RNG states (python, numpy, torch) and this rank's loader cursor

A resume on the same number of ranks restores every rank's RNG and loader cursor; on another number the
loader cursor is rank 0's (global) and the RNG streams restart per rank from (seed, step, rank).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline import checkpoint as ckpt_lib
from pipeline import distributed as dist_utils
from pipeline.config import RunConfig, to_yaml


@dataclass
class TrainState:
    """Where training is: everything the loop carries from step to step besides model and optimizer."""

    step: int = 0
    tokens_seen: int = 0
    skipped: int = 0  # steps dropped for a non-finite loss (or DeepSpeed's overflow check)
    spikes: int = 0  # steps dropped by the loss-spike guard
    spike_window: list[float] = field(default_factory=list)  # recent accepted step losses (spike guard)
    last_loss: float = float("nan")
    val_loss: float | None = None
    last_pk_loss: float | None = None
    run_id: str | None = None  # the W&B run


class Checkpointer:
    """Decides the resume point (before the engine exists), restores and saves the TrainState, and when."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.root = cfg.run_dir / "checkpoints"
        # The plan verifies the checkpoint (checksums, no code) and moves aside what a new history would
        # collide with.
        self.plan = ckpt_lib.choose_resume(cfg.train.checkpoint.resume, self.root)
        self.meta = ckpt_lib.read_meta(self.plan.checkpoint) if self.plan.checkpoint else None
        # A different world size needs DeepSpeed's universal format, decided before the engine exists.
        self.universal = bool(
            self.meta and self.meta["world_size"] != world_size and cfg.train.zero_stage > 0
        )
        if self.plan.checkpoint is not None and self.universal:
            ckpt_lib.ensure_universal(self.plan.checkpoint)
        self.last_saved: Path | None = None
        self.last_saved_step = -1

    @property
    def resume_dir(self) -> Path | None:
        return self.plan.checkpoint

    def restore(self, engine: Any, state: TrainState) -> Any:
        """Collective: load model + optimizer into engine and the TrainState; returns the loader state to
        continue from (None: from the start). Sets this rank's RNG streams."""
        resume_dir = self.plan.checkpoint
        if resume_dir is None:
            return None
        client = ckpt_lib.load(engine, resume_dir, self.universal)
        state.step = int(client["step"])
        # A run resumed at its end trains no step: its summary keeps the losses it ended with.
        state.last_loss = float("nan") if client.get("last_loss") is None else float(client["last_loss"])
        state.val_loss, state.last_pk_loss = client.get("val_loss"), client.get("passkey_loss")
        state.tokens_seen = int(client.get("tokens_seen", 0))
        state.skipped = int(client.get("skipped_steps", 0))
        state.spikes = int(client.get("spike_skipped_steps", 0))
        state.spike_window = [float(x) for x in client.get("spike_window", [])]
        state.run_id = client.get("wandb_run_id")
        same_world = self.meta is not None and self.meta["world_size"] == self.world_size
        rank_state = ckpt_lib.load_rank_state(resume_dir, self.rank) if same_world else None
        if rank_state is not None:
            ckpt_lib.set_rng_state(rank_state["rng"])
            loader_state = rank_state.get("loader")
        else:
            # New world size: the loader cursor is global (rank 0's); RNG streams restart per rank.
            loader_state = client.get("loader_state")
            seed = self.cfg.seed + 7919 * state.step + self.rank
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)
        self.last_saved_step = state.step
        if self.rank == 0:
            print(
                f"[train] resumed from {resume_dir} at step {state.step} ({state.tokens_seen:,} tokens)",
                flush=True,
            )
        return loader_state

    def due(self, step: int) -> bool:
        """The cadence: every train.checkpoint.every steps and at the end."""
        every = self.cfg.train.checkpoint.every
        return bool(every and step % every == 0) or step == self.cfg.train.max_steps

    def saved(self, step: int) -> bool:
        return self.last_saved_step == step

    def save(self, engine: Any, state: TrainState, loader_state: Any, run_id: str | None) -> Path:
        """Collective: checkpoint at state.step. run_id: rank 0's W&B run id (other ranks get it)."""
        client = {
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            "skipped_steps": state.skipped,
            "spike_skipped_steps": state.spikes,
            "spike_window": list(state.spike_window),
            "wandb_run_id": dist_utils.broadcast_object(run_id),
            "config_yaml": to_yaml(self.cfg),
            "world_size": self.world_size,
            "loader_state": loader_state,
            "universal_checkpoint_info": {},
            "last_loss": state.last_loss if math.isfinite(state.last_loss) else None,
            "val_loss": state.val_loss,
            "passkey_loss": state.last_pk_loss,
            "lineage": self.plan.lineage,
        }
        rank_state = {"rng": ckpt_lib.rng_state(), "loader": loader_state}
        self.last_saved = ckpt_lib.save(
            engine,
            self.root,
            state.step,
            client,
            rank_state,
            self.cfg.train.checkpoint.keep_last,
            lineage=self.plan.lineage,
        )
        self.last_saved_step = state.step
        return self.last_saved

    def latest(self) -> Path | None:
        """The checkpoint this run ends on: the one it saved, else the newest complete one."""
        return self.last_saved or ckpt_lib.find_latest(self.root)
