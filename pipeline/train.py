"""Pretraining under DeepSpeed ZeRO: `train(cfg)` runs on every rank and returns a summary dict.

    torchrun --nproc_per_node 2 -m pipeline.train configs/tiny.yaml train.max_steps=100
    python -m pipeline.train configs/tiny.yaml            # one process

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
  optimizer update, counted) or training stops with an error (train.nan_policy).
- the learning rate is a pure function of the step (warmup + cosine), so it needs no scheduler state.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fpa_model.model import GPT
from pipeline import checkpoint as ckpt_lib
from pipeline import distributed as dist_utils
from pipeline.config import ConfigError, Derived, RunConfig, TrainConfig, derive, load_config, to_yaml
from pipeline.logging import make_logger

EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: "try again later"; launch scripts requeue on it
REQUEUE_ENV = "FPA_REQUEUE_CMD"  # an argv with {job_id}; default "scontrol requeue {job_id}"


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite losses under nan_policy=stop, too many skipped steps)."""


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is written; exits the process with EXIT_PREEMPTED."""

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.step = step
        self.checkpoint = checkpoint


# ----------------------------------------------------------------------------------------------------
# Schedule, DeepSpeed config, FLOPs


def lr_at(step: int, tc: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine to lr * min_lr_ratio."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    span = max(1, tc.max_steps - tc.warmup_steps)
    progress = min(1.0, (step - tc.warmup_steps) / span)
    min_lr = tc.lr * tc.min_lr_ratio
    return min_lr + (tc.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def deepspeed_config(cfg: RunConfig, d: Derived, load_universal: bool = False) -> dict[str, Any]:
    tc = cfg.train
    ds: dict[str, Any] = {
        # DeepSpeed sees every rank as data parallel: under sequence parallelism its "batch" counts each
        # sequence once per rank of its group (the loss's grad_scale undoes the extra averaging).
        "train_batch_size": d.global_batch * d.sequence_parallel,
        "train_micro_batch_size_per_gpu": d.micro_batch,
        "gradient_accumulation_steps": d.grad_accum,
        "gradient_clipping": tc.grad_clip,
        "optimizer": {
            "type": "AdamW",
            # torch_adam: the plain torch AdamW, so nothing JIT-compiles (FusedAdam / CPUAdam would).
            "params": {
                "lr": tc.lr,
                "betas": list(tc.betas),
                "eps": tc.adam_eps,
                "weight_decay": tc.weight_decay,
                "torch_adam": True,
            },
        },
        "zero_optimization": {"stage": tc.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "checkpoint": {"load_universal": load_universal},
    }
    if d.precision == "bf16":  # resolved by pipeline.config (never with ZeRO-0: TrainConfig refuses it)
        ds["bf16"] = {"enabled": True}
        # bf16 gradient accumulation drifts; accumulate in fp32 (ENVIRONMENT.md).
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    return ds


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (embeddings included, as in FoX); none on norms, biases, gains."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024) -> float:
    """Achieved FLOP/s of a square matmul on this device: the MFU denominator when none is configured."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    reps, t0 = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - t0 < 0.2:
        a @ b
        reps += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


def memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ----------------------------------------------------------------------------------------------------
# Data


LoaderFactory = Callable[[RunConfig, str, int, int], Any]


def default_loader(cfg: RunConfig, split: str, dp_rank: int, dp_world: int) -> Any:
    from data_prep.loader import ShardLoader

    return ShardLoader(
        cfg.data_dir,
        split,
        micro_batch=cfg.train.micro_batch,
        dp_rank=dp_rank,
        dp_world=dp_world,
        seed=cfg.data.seed,
        shuffle_block=cfg.data.shuffle_block,
        num_workers=1 if split == "train" else 0,  # one read-ahead thread; order does not depend on it
    )


def batch_to_xy(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets from a loader batch: (x, y), {"input_ids", "labels"} or (B, T+1) rows."""
    if isinstance(batch, dict):
        if "input_ids" in batch and "labels" in batch:
            x, y = batch["input_ids"], batch["labels"]
        else:
            rows = batch.get("tokens")
            if rows is None:
                raise TypeError(f"a loader batch dict needs input_ids+labels or tokens; got {list(batch)}")
            x, y = rows[:, :-1], rows[:, 1:]
    elif isinstance(batch, tuple | list) and len(batch) == 2:
        x, y = batch
    else:
        rows = torch.as_tensor(np.asarray(batch)) if not isinstance(batch, torch.Tensor) else batch
        x, y = rows[:, :-1], rows[:, 1:]
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    return x.to(device=device, dtype=torch.long), y.to(device=device, dtype=torch.long)


@dataclass(frozen=True)
class _SeqParallel:
    """parallel.sequence > 1: the ranks of one group share every sequence, each holding a chunk of it."""

    group: Any
    rank: int
    degree: int
    layout: str


def micro_loss(
    engine: Any, batch: Any, device: torch.device, sp: _SeqParallel | None
) -> tuple[torch.Tensor, int]:
    """Mean next-token loss of one micro batch and the number of tokens it covers.

    Under sequence parallelism the loss is the mean over the whole sequences (the same value on every rank
    of the group); grad_scale=degree undoes DeepSpeed averaging gradients over the dp x sp ranks.
    """
    if sp is None:
        x, y = batch_to_xy(batch, device)
        logits = engine(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten()), y.numel()
    from fpa_model.context_parallel import shard_batch, shard_sequence
    from pipeline.sequence_parallel import sequence_parallel_cross_entropy

    if isinstance(batch, tuple):  # (inputs, targets), e.g. passkey rows with ignored targets
        x, y = (shard_sequence(t.long(), sp.rank, sp.degree, dim=1, layout=sp.layout) for t in batch)
    else:
        rows = batch if isinstance(batch, torch.Tensor) else torch.as_tensor(np.asarray(batch))
        x, y = shard_batch(rows.long(), sp.rank, sp.degree, layout=sp.layout)
    logits = engine(x.to(device))
    loss = sequence_parallel_cross_entropy(logits, y.to(device), sp.group, grad_scale=sp.degree)
    return loss, y.numel() * sp.degree


def _new_window() -> dict[str, float]:
    """Sums over the steps since the last log line."""
    return {"loss": 0.0, "n": 0, "time": 0.0, "wait": 0.0, "tokens": 0, "pk_loss": 0.0, "pk_n": 0}


def _passkey_metrics(window: dict[str, float]) -> dict[str, float]:
    return {"train/passkey_loss": window["pk_loss"] / window["pk_n"]} if window["pk_n"] else {}


class _PasskeyBatches:
    """The rows the train.passkey phase adds to each micro step: whole passkey prompts, loss on the answer.

    A batch is a pure function of (seed, step, data-parallel rank, micro step), so a resumed run draws the
    same ones and the ranks of a sequence-parallel group (one dp rank) hold the same sequences. The prompt
    length is drawn per step (the same on every rank, so DeepSpeed sees one shape per step).
    """

    def __init__(self, cfg: RunConfig, d: Derived, dp_rank: int) -> None:
        from data_prep.index import load_index
        from data_prep.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(cfg.data_dir)
        self.prefix = [load_index(cfg.data_dir).eod_id]  # as in the training stream and the eval prompts
        self.lo, self.hi, self.multiple = d.passkey_lengths
        self.n, self.digits = cfg.train.passkey.batch or d.micro_batch, cfg.train.passkey.digits
        self.seed, self.dp_rank = cfg.seed, dp_rank

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        from data_prep.passkey import answer_rows

        m = self.multiple
        length = m * random.Random(f"passkey:{self.seed}:{step}").randint(-(-self.lo // m), self.hi // m)
        rng = random.Random(f"passkey:{self.seed}:{step}:{self.dp_rank}:{micro}")
        x, y = answer_rows(
            self.tokenizer, self.n, length, digits=self.digits, rng=rng, prefix_ids=self.prefix
        )
        return torch.tensor(x), torch.tensor(y)


class _Batches:
    """next() over a loader, starting a new pass when one ends (the loader decides the epoch order)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.it: Iterator[Any] = iter(loader)

    def next(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            try:
                return next(self.it)
            except StopIteration:
                raise TrainingError("the training loader yields no batches") from None


# ----------------------------------------------------------------------------------------------------
# Preemption


class _StopFlag:
    """SIGTERM / SIGUSR1 / SIGINT set a flag; the loop checks it (across ranks) at step boundaries."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            # Outside the main thread (an embedding app) signals cannot be caught: no preemption handling.
            with contextlib.suppress(ValueError):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:  # Ctrl-C twice: stop without saving
            signal.default_int_handler(signum, frame)
        self.signum = signum

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def requeue_slurm_job() -> list[str] | None:
    """Under Slurm, ask for this job to be requeued; returns the argv run (None outside Slurm).

    REQUEUE_ENV (settable from a config's slurm.env) is split into arguments like a shell line but never
    run by a shell; {job_id} in an argument becomes the job id, which must look like one (digits)."""
    import re
    import shlex

    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job):
        print(f"[train] not requeued: SLURM_JOB_ID={job!r} is not a job id", file=sys.stderr, flush=True)
        return None
    try:
        cmd = [a.replace("{job_id}", job) for a in shlex.split(os.environ.get(REQUEUE_ENV, ""))]
    except ValueError as e:
        print(f"[train] requeue failed ({REQUEUE_ENV}): {e}", file=sys.stderr, flush=True)
        return None
    cmd = cmd or ["scontrol", "requeue", job]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            print(f"[train] requeue failed ({cmd}): {proc.stderr.strip()}", file=sys.stderr, flush=True)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"[train] requeue failed ({cmd}): {e}", file=sys.stderr, flush=True)
    return cmd


# ----------------------------------------------------------------------------------------------------
# Skipping a step without an update


def _discard_step(engine: Any) -> None:
    """ZeRO-0: run engine.step() at the accumulation boundary but drop the gradients instead of updating.

    (ZeRO 1-3 need no help: DeepSpeed itself drops a step whose gradient norm is not finite, and cleans
    its partitioned / accumulated gradient buffers, so there the non-finite gradients go through.)
    Step counters advance, so accumulation stays aligned; weights and optimizer state do not change.
    """

    def discard(lr_kwargs: Any = None) -> None:
        engine.optimizer.zero_grad(set_to_none=True)  # the plain torch optimizer: p.grad is all there is
        engine.skipped_steps += 1
        engine.global_steps += 1
        engine.global_samples += engine.train_batch_size()
        engine._step_applied = False

    engine._take_model_step = discard  # instance attribute shadows the method for this one call
    try:
        engine.step()
    finally:
        del engine._take_model_step


# ----------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(
    engine: Any,
    cfg: RunConfig,
    make_loader: LoaderFactory,
    dp_rank: int,
    dp_world: int,
    device: torch.device,
    sp: _SeqParallel | None = None,
) -> float:
    """Mean validation loss over train.val_batches global batches (the same sequences every time).

    Each rank takes val_batches * grad_accum micro batches, so the sequences covered (the first
    val_batches * global_batch of the split) do not depend on the number of ranks.
    """
    loader = make_loader(cfg, "validation", dp_rank, dp_world)
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64)
    try:
        # One pass in stored order where offered (ShardLoader.iter_once); the training state is untouched.
        it = loader.iter_once() if hasattr(loader, "iter_once") else iter(loader)
        for _ in range(cfg.train.val_batches * cfg.train.grad_accum):
            try:
                batch = next(it)
            except StopIteration:
                break
            loss, n = micro_loss(engine, batch, device, sp)
            total += torch.tensor([loss.item() * n, n], dtype=torch.float64)
    finally:
        engine.train()
        if hasattr(loader, "close"):
            loader.close()
    total = _all_reduce_sum(total, device)
    if total[1] == 0:
        raise TrainingError("the validation loader yields no batches")
    return float(total[0] / total[1])


def _all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if dist_utils.world_size() == 1:
        return t
    t = t.to(device)
    torch.distributed.all_reduce(t)
    return t.cpu()


# ----------------------------------------------------------------------------------------------------
# The loop


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


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


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
        return _train(cfg, make_loader)


def _train(cfg: RunConfig, make_loader: LoaderFactory | None) -> dict[str, Any]:
    import deepspeed

    make_loader = make_loader or default_loader
    info = dist_utils.init_distributed(cfg.parallel.backend)
    d = derive(cfg, info.world_size)
    dp_rank, dp_world, sp = info.rank, d.data_parallel, None
    if d.sequence_parallel > 1:
        from pipeline.sequence_parallel import make_groups

        _, sp_group, dp_rank, dp_world, sp_rank = make_groups(d.sequence_parallel)
        sp = _SeqParallel(sp_group, sp_rank, d.sequence_parallel, cfg.parallel.sequence_layout)
    _resolve_vocab(cfg)
    if cfg.train.val_every:  # a bad validation split fails now, not at the first validation pass
        from data_prep.loader import check_split

        hint = " (or train.val_every=0 to train without validation)"
        check_split(lambda: make_loader(cfg, "validation", dp_rank, dp_world), "validation", hint)
    tc = cfg.train
    root = cfg.run_dir / "checkpoints"
    run_dir = cfg.run_dir
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)

    # Resume point, decided before the engine exists: a different world size needs load_universal.
    # The plan verifies it (checksums, no code) and moves aside what a new history would collide with.
    plan = ckpt_lib.choose_resume(tc.checkpoint.resume, root)
    resume_dir = plan.checkpoint
    meta = ckpt_lib.read_meta(resume_dir) if resume_dir else None
    universal = bool(meta and meta["world_size"] != info.world_size and tc.zero_stage > 0)
    if resume_dir is not None and universal:
        ckpt_lib.ensure_universal(resume_dir)

    # Same seed on every rank: identical initial weights before DeepSpeed partitions them.
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    if sp is not None:
        from fpa_model.context_parallel import SequenceParallel

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
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, tc.weight_decay),
        config=deepspeed_config(cfg, d, load_universal=universal),
    )
    device = engine.device if isinstance(engine.device, torch.device) else torch.device(engine.device)

    step, tokens_seen, skipped, run_id, loader_state = 0, 0, 0, None, None
    last_loss, val_loss, last_pk_loss = float("nan"), None, None
    if resume_dir is not None:
        client = ckpt_lib.load(engine, resume_dir, universal)
        step = int(client["step"])
        # A run resumed at its end trains no step: its summary keeps the losses it ended with.
        last_loss = float("nan") if client.get("last_loss") is None else float(client["last_loss"])
        val_loss, last_pk_loss = client.get("val_loss"), client.get("passkey_loss")
        tokens_seen = int(client.get("tokens_seen", 0))
        skipped = int(client.get("skipped_steps", 0))
        run_id = client.get("wandb_run_id")
        same_world = meta is not None and meta["world_size"] == info.world_size
        rank_state = ckpt_lib.load_rank_state(resume_dir, info.rank) if same_world else None
        if rank_state is not None:
            ckpt_lib.set_rng_state(rank_state["rng"])
            loader_state = rank_state.get("loader")
        else:
            # New world size: the loader cursor is global (rank 0's); RNG streams restart per rank.
            loader_state = client.get("loader_state")
            random.seed(cfg.seed + 7919 * step + info.rank)
            np.random.seed((cfg.seed + 7919 * step + info.rank) % 2**32)
            torch.manual_seed(cfg.seed + 7919 * step + info.rank)
        if info.is_main:
            print(f"[train] resumed from {resume_dir} at step {step} ({tokens_seen:,} tokens)", flush=True)
    run_id = dist_utils.broadcast_object(run_id)

    logger = make_logger(cfg, info.rank, run_id)
    loader = make_loader(cfg, "train", dp_rank, dp_world)
    if loader_state is not None:
        loader.load_state_dict(loader_state)
    batches = _Batches(loader)
    pk_start = max(0, tc.max_steps - tc.passkey.steps)  # the passkey phase: steps [pk_start, max_steps)
    pk_batches = _PasskeyBatches(cfg, d, dp_rank) if tc.passkey.steps else None
    peak = tc.peak_flops_per_rank or measure_peak_flops(
        device, torch.bfloat16 if d.precision == "bf16" and device.type == "cuda" else torch.float32
    )
    peak_total = peak * info.world_size
    metrics_file = run_dir / "metrics.jsonl"

    manual_norm = tc.zero_stage == 0 and d.precision == "fp32"
    own_norm: float | None = None
    stop = _StopFlag()
    stop.install()
    last_saved: Path | None = None
    last_saved_step = step if resume_dir is not None else -1
    window = _new_window()

    def save_now() -> Path:
        client = {
            "step": step,
            "tokens_seen": tokens_seen,
            "skipped_steps": skipped,
            "wandb_run_id": logger.run_id if info.is_main else run_id,
            "config_yaml": to_yaml(cfg),
            "world_size": info.world_size,
            "loader_state": loader.state_dict(),
            "universal_checkpoint_info": {},
            "last_loss": last_loss if math.isfinite(last_loss) else None,
            "val_loss": val_loss,
            "passkey_loss": last_pk_loss,
            "lineage": plan.lineage,
        }
        rank_state = {"rng": ckpt_lib.rng_state(), "loader": loader.state_dict()}
        client["wandb_run_id"] = dist_utils.broadcast_object(client["wandb_run_id"])
        return ckpt_lib.save(
            engine, root, step, client, rank_state, tc.checkpoint.keep_last, lineage=plan.lineage
        )

    try:
        while step < tc.max_steps:
            t_step = time.perf_counter()
            wait = 0.0
            pk_step = pk_batches is not None and step >= pk_start
            lr = lr_at(step, tc)
            for group in engine.optimizer.param_groups:
                group["lr"] = lr
            bad_step, loss_sum, pk_sum, stop_req = False, 0.0, 0.0, 0.0
            for _micro in range(d.grad_accum):
                t_wait = time.perf_counter()
                batch = batches.next()
                wait += time.perf_counter() - t_wait
                loss, _ = micro_loss(engine, batch, device, sp)
                lm_value, pk_value = loss.item(), 0.0
                if pk_step and pk_batches is not None:  # the passkey phase adds answer-only rows
                    pk_loss, _ = micro_loss(engine, pk_batches.batch(step, _micro), device, sp)
                    pk_value = pk_loss.item()
                    loss = loss + tc.passkey.weight * pk_loss
                # One collective per micro step: [finite LM loss sum, non-finite count, stop request,
                # passkey loss sum].
                finite = bool(torch.isfinite(loss.detach()).item())
                flags = torch.tensor(
                    [
                        lm_value if finite else 0.0,
                        0.0 if finite else 1.0,
                        float(stop.signum is not None),
                        pk_value if finite else 0.0,
                    ],
                    dtype=torch.float64,
                )
                flags = _all_reduce_sum(flags, device)
                stop_req = max(stop_req, float(flags[2]))
                if flags[1] > 0:
                    bad_step = True  # every rank knows, whichever rank saw it
                else:
                    loss_sum += float(flags[0]) / info.world_size  # sp ranks of a group hold one value
                    pk_sum += float(flags[3]) / info.world_size
                # ZeRO-0 keeps NaN out of the gradients (the step is discarded by hand); ZeRO 1-3 let it
                # through so DeepSpeed's own non-finite-norm skip drops the step and resets its buffers.
                if not bad_step or tc.zero_stage > 0:
                    engine.backward(loss)
                if _micro < d.grad_accum - 1:
                    engine.step()  # not a boundary: DeepSpeed only advances its micro-step counter
            if bad_step:
                skipped += 1
                _append_jsonl_rank0(info.is_main, metrics_file, {"step": step, "skipped": True, "lr": lr})
                if tc.nan_policy == "stop":
                    raise TrainingError(
                        f"non-finite loss at step {step} (train.nan_policy=stop); "
                        f"last finite loss was {last_loss}"
                    )
                print(f"[train] step {step}: non-finite loss, step skipped ({skipped} so far)", flush=True)
                if tc.zero_stage == 0:
                    _discard_step(engine)
                else:
                    before = engine.skipped_steps
                    engine.step()
                    if engine.skipped_steps == before:
                        raise TrainingError(
                            f"step {step}: DeepSpeed applied an update with non-finite gradients "
                            f"(ZeRO {tc.zero_stage}, {d.precision}); stopping rather than training on NaN"
                        )
                if skipped > tc.max_skipped_steps:
                    raise TrainingError(
                        f"{skipped} steps skipped for non-finite loss (train.max_skipped_steps="
                        f"{tc.max_skipped_steps}); stopping at step {step}"
                    )
            else:
                if manual_norm:  # ZeRO-0 fp32 clips without recording the norm: take it pre-clip here
                    grads = [
                        p.grad.detach().float().norm()
                        for p in engine.module.parameters()
                        if p.grad is not None
                    ]
                    own_norm = float(torch.stack(grads).norm()) if grads else 0.0
                before = engine.skipped_steps
                engine.step()
                if engine.skipped_steps > before:  # DeepSpeed's own overflow check (inf/NaN grad norm)
                    skipped += 1
            step += 1
            dt = time.perf_counter() - t_step
            grad_norm = own_norm if manual_norm else engine.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None and not bad_step else float("nan")
            tokens_seen += d.tokens_per_step  # language-model tokens (passkey rows are extra)
            if not bad_step:
                last_loss = loss_sum / d.grad_accum
                window["loss"] += last_loss
                window["n"] += 1
                record = {
                    "step": step,
                    "loss": last_loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens": tokens_seen,
                }
                if pk_step:
                    last_pk_loss = pk_sum / d.grad_accum
                    window["pk_loss"] += last_pk_loss
                    window["pk_n"] += 1
                    record["passkey_loss"] = last_pk_loss
                _append_jsonl_rank0(info.is_main, metrics_file, record)
            window["time"] += dt
            window["wait"] += wait
            window["tokens"] += d.tokens_per_step
            logger.progress(step, tc.max_steps)

            if step % tc.log_every == 0 or step == tc.max_steps:
                tps = window["tokens"] / max(window["time"], 1e-9)
                logger.log(
                    {
                        "train/loss": window["loss"] / max(window["n"], 1),
                        "train/lr": lr,
                        "train/grad_norm": grad_norm,
                        "train/tokens": tokens_seen,
                        "train/skipped_steps": skipped,
                        "perf/tokens_per_s": tps,
                        "perf/mfu": flops_per_token * tps / peak_total,
                        "perf/step_time_s": window["time"] / max(window["n"] + 0, 1),
                        "perf/data_wait_frac": window["wait"] / max(window["time"], 1e-9),
                        "perf/memory_mb": memory_mb(device),
                        **_passkey_metrics(window),
                    },
                    step,
                )
                window = _new_window()
            if tc.val_every and (step % tc.val_every == 0 or step == tc.max_steps):
                val_loss = evaluate(engine, cfg, make_loader, dp_rank, dp_world, device, sp)
                logger.log({"val/loss": val_loss, "val/ppl": math.exp(min(val_loss, 50.0))}, step)
                _append_jsonl_rank0(info.is_main, metrics_file, {"step": step, "val_loss": val_loss})
            every = tc.checkpoint.every
            if (every and step % every == 0) or step == tc.max_steps:
                last_saved, last_saved_step = save_now(), step
            if stop_req > 0:
                if last_saved_step != step:
                    last_saved, last_saved_step = save_now(), step
                logger.summary({"preempted_at_step": step})
                logger.finish()
                if info.is_main:
                    print(f"[train] preempted: checkpoint {last_saved} written, exiting", flush=True)
                    if stop.signum != signal.SIGINT:  # Ctrl-C is a person stopping it: no requeue
                        requeue_slurm_job()
                dist_utils.barrier()
                raise Preempted(step, last_saved)
        if last_saved_step != step:  # resumed at max_steps with nothing new: make sure a checkpoint exists
            last_saved, last_saved_step = save_now(), step
        if last_saved is None:
            last_saved = ckpt_lib.find_latest(root)
        summary = {
            "final_loss": last_loss if math.isfinite(last_loss) else None,
            "val_loss": val_loss,
            "passkey_loss": last_pk_loss,
            "steps": step,
            "tokens": tokens_seen,
            "skipped_steps": skipped,
            "parameters": n_params,
            "checkpoint": str(last_saved) if last_saved else None,
            "wandb_run_id": logger.run_id if info.is_main else None,
        }
        logger.summary({k: v for k, v in summary.items() if v is not None and k != "checkpoint"})
        return summary
    finally:
        stop.restore()
        logger.finish()
        if hasattr(loader, "close"):  # read-ahead threads of ShardLoader
            loader.close()


def _append_jsonl_rank0(is_main: bool, path: Path, record: dict[str, Any]) -> None:
    if is_main:
        _append_jsonl(path, record)


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
    summary = train(cfg)
    if dist_utils.rank() == 0:
        print("[train] summary " + json.dumps(summary), flush=True)
    dist_utils.barrier()
    dist_utils.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
