"""Pretraining under DeepSpeed ZeRO: `train(cfg)` runs on every rank and returns a summary dict.

    torchrun --nproc_per_node 2 -m pipeline.train configs/tiny.yaml train.max_steps=100
    python -m pipeline.train configs/tiny.yaml            # one process

This file is the orchestration: build the parts, resume, loop over steps, save, exit. The parts are
pipeline.trainer's modules (its docstring lists them); the checkpoints on disk are pipeline.checkpoint.

What it guarantees:
- exact resume: model, optimizer, step, tokens, per-rank RNG and the loader cursor come back from the
  latest complete checkpoint (train.checkpoint.resume: auto), so a killed run continues on the same
  loss curve; on a different number of ranks the checkpoint is converted to DeepSpeed's universal format.
- preemption: SIGTERM / SIGUSR1 -> checkpoint at the next step boundary -> exit code 75 (EX_TEMPFAIL);
  under Slurm rank 0 runs `scontrol requeue $SLURM_JOB_ID` first (override: FPA_REQUEUE_CMD).
  torchrun dies of SIGUSR1 by default: either signal the workers directly with torchrun ignoring USR1
  (Slurm --signal=USR1@N without B: reaches every process), or start it with
  `--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout <save time>` to forward it.
  SIGINT (Ctrl-C) saves and exits 75 the same way but is not requeued; a second Ctrl-C aborts at once.
- one trainer per run dir: rank 0 holds an exclusive lock on <run_dir>/train.lock (pipeline.rundir).
- non-finite losses are never silent: every rank agrees before backward, then the step is skipped (no
  optimizer update, counted) or training stops with an error (train.nan_policy); loss spikes likewise
  (train.spike_guard).
- the learning rate is a pure function of the step, so it needs no scheduler state.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fpa_model.model import GPT
from pipeline import distributed as dist_utils
from pipeline.config import ConfigError, RunConfig, derive, load_config
from pipeline.errors import TrainingError
from pipeline.logging import make_logger
from pipeline.trainer.batches import LoaderFactory, PasskeyBatches, StepBatches, default_loader
from pipeline.trainer.engine import build_engine, deepspeed_config, param_groups
from pipeline.trainer.guards import StepPolicy
from pipeline.trainer.metrics import Metrics, measure_peak_flops
from pipeline.trainer.preemption import EXIT_PREEMPTED, REQUEUE_ENV, Preempted, StopFlag, requeue_slurm_job
from pipeline.trainer.profiling import StepProfiler
from pipeline.trainer.schedule import lr_at
from pipeline.trainer.step import SeqParallel, StepSetup, document_eod, train_step
from pipeline.trainer.train_state import Checkpointer, TrainState
from pipeline.trainer.validation import evaluate

# Imported from here by callers and tests.
__all__ = [
    "EXIT_PREEMPTED",
    "REQUEUE_ENV",
    "Preempted",
    "TrainingError",
    "deepspeed_config",
    "exclusive_run_dir",
    "main",
    "measure_peak_flops",
    "param_groups",
    "requeue_slurm_job",
    "train",
]


def _resolve_vocab(cfg: RunConfig) -> None:
    """model.vocab_size from the prepared data's index when it is null; seq_len checked against it."""
    try:
        from data_prep.index import load_index

        index = load_index(cfg.data_dir)
    except Exception as e:
        if cfg.model.vocab_size is None:
            raise ConfigError(
                f"model.vocab_size is null and the data index in {cfg.data_dir} cannot be read: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None
        return
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = int(index.vocab_size)
    elif cfg.model.vocab_size != index.vocab_size:  # a larger one trains, then eval refuses it
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} but the tokenizer of {cfg.data_dir} has "
            f"{index.vocab_size} tokens: set model.vocab_size={index.vocab_size} (or null: from the data)"
        )
    if index.seq_len != cfg.data.seq_len:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} but the data in {cfg.data_dir} holds sequences of "
            f"{index.seq_len}: re-prepare the data or set data.seq_len={index.seq_len}"
        )


@contextlib.contextmanager
def exclusive_run_dir(run_dir: Path, is_main: bool) -> Iterator[None]:
    """Rank 0 holds the run dir's lock for the whole run; every rank fails at once if another has it."""
    from pipeline.rundir import RunDirBusy, run_lock

    with contextlib.ExitStack() as stack:
        err = None
        if is_main:
            try:
                stack.enter_context(run_lock(run_dir))
            except RunDirBusy as e:
                err = str(e)
        err = dist_utils.broadcast_object(err)
        if err:
            raise TrainingError(err)
        yield


def train(cfg: RunConfig, make_loader: LoaderFactory | None = None) -> dict[str, Any]:
    """Train on every rank; return {final_loss, val_loss, steps, tokens, checkpoint, ...} (same on all ranks).

    make_loader(cfg, split, dp_rank, dp_world) builds a loader (default: data_prep.loader.ShardLoader)
    with state_dict()/load_state_dict() for exact resume.
    """
    info = dist_utils.init_distributed(cfg.parallel.backend)
    with exclusive_run_dir(cfg.run_dir, info.is_main):
        return _train(cfg, make_loader or default_loader)


def _train(cfg: RunConfig, make_loader: LoaderFactory) -> dict[str, Any]:
    info = dist_utils.init_distributed(cfg.parallel.backend)
    tc, d = cfg.train, derive(cfg, info.world_size)
    dp_rank, dp_world, sp = info.rank, d.data_parallel, None
    if d.sequence_parallel > 1:
        from pipeline.trainer.sequence_parallel import make_groups

        _, sp_group, dp_rank, dp_world, sp_rank = make_groups(d.sequence_parallel)
        sp = SeqParallel(sp_group, sp_rank, d.sequence_parallel, cfg.parallel.sequence_layout)
    _resolve_vocab(cfg)
    if tc.val_every:  # a bad validation split fails now, not at the first validation pass
        from data_prep.loader import check_split

        hint = " (or train.val_every=0 to train without validation)"
        check_split(lambda: make_loader(cfg, "validation", dp_rank, dp_world), "validation", hint)
    if info.is_main:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(cfg, info.rank, info.world_size)  # the resume point, before the engine exists

    # Same seed on every rank: identical initial weights before DeepSpeed partitions them.
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model, activation_checkpointing=tc.activation_checkpointing)
    if tc.compile:
        model.compile_blocks()
    if sp is not None:
        from fpa_model.sequence_parallel import SequenceParallel

        model.set_sequence_parallel(SequenceParallel(sp.group, sp.layout, cfg.parallel.sequence_mode))
    n_params = model.num_parameters()
    flops_per_token = model.flops_per_token(cfg.data.seq_len)
    if info.is_main:
        print(
            f"[train] model: {n_params:,} parameters ({model.num_parameters(non_embedding=True):,} "
            f"non-embedding), attention {cfg.model.attention.kind}/{cfg.model.attention.field}; "
            f"world {info.world_size}, global batch {d.global_batch} x {d.seq_len} tokens, "
            f"ZeRO {tc.zero_stage}, {d.precision}",
            flush=True,
        )
    engine, device = build_engine(cfg, d, model, ckpt.universal)

    state = TrainState()
    loader_state = ckpt.restore(engine, state)  # also this rank's RNG streams
    state.run_id = dist_utils.broadcast_object(state.run_id)
    logger = make_logger(cfg, info.rank, state.run_id)
    loader = make_loader(cfg, "train", dp_rank, dp_world)
    if loader_state is not None:
        loader.load_state_dict(loader_state)
    pk_start = max(0, tc.max_steps - tc.passkey.steps)  # the passkey phase: the last steps
    batches = StepBatches(
        loader,
        passkey=PasskeyBatches(cfg, d, dp_rank, start=pk_start) if tc.passkey.steps else None,
        passkey_start=pk_start,
    )
    peak = tc.peak_flops_per_rank or measure_peak_flops(
        device, torch.bfloat16 if d.precision == "bf16" and device.type == "cuda" else torch.float32
    )
    metrics = Metrics(
        logger,
        cfg.run_dir / "metrics.jsonl",
        info.is_main,
        device,
        flops_per_token,
        peak * info.world_size,
        tc.log_every,
        tc.max_steps,
    )
    policy = StepPolicy(tc, metrics)
    setup = StepSetup(
        device=device,
        sp=sp,
        world_size=info.world_size,
        grad_accum=d.grad_accum,
        zero_stage=tc.zero_stage,
        precision=d.precision,
        passkey_weight=tc.passkey.weight,
        loss_chunk_tokens=tc.loss_chunk_tokens,
        eod_id=document_eod(cfg),
    )
    stop = StopFlag()
    stop.install()
    profiler = StepProfiler(tc.profile, cfg.run_dir, info.rank, device)

    def save() -> Path:
        return ckpt.save(engine, state, batches.state_dict(), logger.run_id if info.is_main else state.run_id)

    try:
        while state.step < tc.max_steps:
            t_step = time.perf_counter()
            lr = lr_at(state.step, tc)
            micro_batches = batches.step(state.step, d.grad_accum)
            profiler.before(state.step + 1)
            result = train_step(engine, state, lr, micro_batches, setup, policy, stop)
            state.step += 1
            profiler.after(state.step)
            state.tokens_seen += d.tokens_per_step  # language-model tokens (passkey rows are extra)
            if result.loss is not None:
                state.last_loss = result.loss
            if result.passkey_loss is not None:
                state.last_pk_loss = result.passkey_loss
            metrics.step(
                state.step,
                loss=result.loss,
                passkey_loss=result.passkey_loss,
                lr=lr,
                grad_norm=result.grad_norm,
                tokens=state.tokens_seen,
                tokens_per_step=d.tokens_per_step,
                seconds=time.perf_counter() - t_step,
                wait=result.wait,
            )
            if metrics.log_due(state.step):
                counters = policy.counters(state)
                metrics.log(
                    state.step, lr=lr, grad_norm=result.grad_norm, tokens=state.tokens_seen, counters=counters
                )
            if tc.val_every and (state.step % tc.val_every == 0 or state.step == tc.max_steps):
                state.val_loss = evaluate(engine, cfg, make_loader, dp_rank, dp_world, device, sp)
                val_ppl = math.exp(min(state.val_loss, 50.0))
                logger.log({"val/loss": state.val_loss, "val/ppl": val_ppl}, state.step)
                metrics.write({"step": state.step, "val_loss": state.val_loss})
            if ckpt.due(state.step):
                save()
            if result.stop_requested:
                if not ckpt.saved(state.step):
                    save()
                logger.summary({"preempted_at_step": state.step})
                logger.finish()
                if info.is_main:
                    print(f"[train] preempted: checkpoint {ckpt.last_saved} written, exiting", flush=True)
                    if stop.requeue:
                        requeue_slurm_job()
                dist_utils.barrier()
                raise Preempted(state.step, ckpt.last_saved)
        if not ckpt.saved(state.step):  # resumed at max_steps with nothing new: make sure one exists
            save()
        latest = ckpt.latest()
        summary = {
            "final_loss": state.last_loss if math.isfinite(state.last_loss) else None,
            "val_loss": state.val_loss,
            "passkey_loss": state.last_pk_loss,
            "steps": state.step,
            "tokens": state.tokens_seen,
            "skipped_steps": state.skipped,
            "parameters": n_params,
            "checkpoint": str(latest) if latest else None,
            "wandb_run_id": logger.run_id if info.is_main else None,
        }
        if policy.spikes.enabled:
            summary["spike_skipped_steps"] = state.spikes
        logger.summary({k: v for k, v in summary.items() if v is not None and k != "checkpoint"})
        return summary
    finally:
        profiler.close()
        stop.restore()
        logger.finish()
        batches.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.train CONFIG... [key=value ...]` (also accepts --local_rank from `deepspeed`)."""
    args = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")]
    paths = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    try:
        cfg = load_config(paths, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with dist_utils.process_group_ends():
        summary = train(cfg)
        if dist_utils.rank() == 0:
            print("[train] summary " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
