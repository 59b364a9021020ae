"""Shared pieces of the training tests: an in-memory loader, a tiny run config, and a runner.

Run as a script (under torchrun or python) it trains with the in-memory loader:
    torchrun --nproc_per_node 2 tests/test_train_support.py CONFIG.yaml key=value ...
The unit tests at the bottom check the schedule and the loader stand-in themselves.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
VOCAB = 64
DELAY = float(os.environ.get("FPA_TEST_LOADER_DELAY", "0"))


class MemoryLoader:
    """Deterministic learnable sequences; global order depends on (seed, epoch) only.

    Rank r of W reads, for every micro batch, rows [cursor + r*B, cursor + (r+1)*B) of the epoch's
    permutation; the cursor is global, so the state is the same on every rank and survives a change of
    world size. Sequence i: x_t = (a_i + b_i * t) mod VOCAB, easy to learn, so the loss falls quickly.
    """

    def __init__(self, split: str, seq_len: int, micro_batch: int, dp_rank: int, dp_world: int, seed: int):
        self.split, self.seq_len, self.mb = split, seq_len, micro_batch
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        n = 512 if split == "train" else 64
        rng = np.random.default_rng(1000 + (split == "validation"))
        a = rng.integers(0, VOCAB, n)
        b = rng.integers(1, 8, n)
        t = np.arange(seq_len + 1)
        self.rows = torch.as_tensor((a[:, None] + b[:, None] * t[None, :]) % VOCAB, dtype=torch.int64)
        self.epoch, self.cursor = 0, 0

    def _order(self) -> np.ndarray:
        if self.split != "train":
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))

    def __iter__(self):
        order = self._order()
        step = self.mb * self.dp_world
        while self.cursor + step <= len(order):
            lo = self.cursor + self.dp_rank * self.mb
            self.cursor += step
            if DELAY:  # tests that signal or kill a run mid-way slow it down to hit a known window
                time.sleep(DELAY)
            yield self.rows[order[lo : lo + self.mb]]
        if self.split == "train":
            self.epoch, self.cursor = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def memory_loader(cfg: Any, split: str, dp_rank: int, dp_world: int) -> MemoryLoader:
    return MemoryLoader(split, cfg.data.seq_len, cfg.train.micro_batch, dp_rank, dp_world, cfg.data.seed)


TINY_YAML = f"""
name: t
model:
  vocab_size: {VOCAB}
  n_layer: 2
  n_head: 2
  d_model: 32
  max_seq_len: 64
  attention:
    impl: naive
data:
  seq_len: 32
train:
  micro_batch: 4
  grad_accum: 1
  max_steps: 8
  lr: 1.0e-2
  warmup_steps: 2
  log_every: 2
  val_every: 0
  val_batches: 2
  checkpoint:
    every: 4
    keep_last: 2
logging:
  wandb_mode: disabled
  progress: false
  quiet_wandb: true
"""


def write_config(tmp: Path, extra: str = "") -> Path:
    p = tmp / "run.yaml"
    p.write_text(TINY_YAML + extra)
    return p


def run_training(
    config: Path,
    overrides: list[str],
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 240,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Train in fresh processes (torchrun for nproc > 1, plain python for 1), cwd = repo root."""
    script = str(Path(__file__).resolve())
    if nproc > 1:
        with socket.socket() as sock:  # torchrun's static rendezvous does not accept port 0
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(port), script]
    else:
        cmd = [sys.executable, script]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    full_env.pop("FPA_QUIET_WANDB", None)  # W&B as a user runs it, unless the config asks quiet
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(k, None)
    # Own process group: on a timeout the whole group goes (torchrun's workers would outlive it).
    popen = subprocess.Popen(
        [*cmd, str(config), *overrides],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        out, err = popen.communicate()
        raise AssertionError(f"training timed out after {timeout} s:\n{out[-2000:]}\n{err[-3000:]}") from None
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def popen_training(config: Path, overrides: list[str], env: dict[str, str]) -> subprocess.Popen:
    """One training process left running (for signals, kills and a second trainer), cwd = repo root."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}
    full_env.pop("FPA_QUIET_WANDB", None)  # W&B as a user runs it, unless the config asks quiet
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), str(config), *overrides],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def prepare_word_corpus(tmp: Path) -> Path:
    """A small jsonl corpus of word runs prepared into real shards (vocab 300, seq_len 32): the data dir."""
    import random

    from data_prep.config import DataConfig, SourceConfig, TokenizerConfig
    from data_prep.prepare import prepare_data

    rng = random.Random(0)
    words = [f"w{i}" for i in range(40)]
    with open(tmp / "c.jsonl", "w") as f:
        for _ in range(120):
            start = rng.randrange(len(words))
            text = " ".join(words[(start + i) % len(words)] for i in range(rng.randint(20, 60)))
            f.write(json.dumps({"text": text}) + "\n")
    dcfg = DataConfig(
        train=SourceConfig(type="jsonl", paths=[str(tmp / "c.jsonl")]),
        val_fraction=0.1,
        tokenizer=TokenizerConfig(vocab_size=300),
        seq_len=32,
        sequences_per_member=8,
        sequences_per_shard=32,
    )
    prepare_data(dcfg, tmp / "data", progress=False)
    return tmp / "data"


def read_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """step -> the last metrics.jsonl record with a loss for it (a resumed run rewrites its steps)."""
    out: dict[int, dict[str, Any]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec or rec.get("skipped"):
            out[rec["step"]] = rec
    return out


def summary_of(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    for line in proc.stdout.splitlines():
        if line.startswith("[train] summary "):
            return json.loads(line[len("[train] summary ") :])
    raise AssertionError(f"no summary line in output:\n{proc.stdout[-2000:]}")


NAN_STEP_ENV = "FPA_TEST_NAN_STEP"


def poison_step(step: int, grad_accum: int) -> None:
    """Make the loss of step index `step` non-finite on the last rank, in its last micro batch (the earlier
    ones are already backpropagated: the hardest case for dropping a step), by wrapping
    pipeline.trainer.step.micro_loss in this process. Validation (under no_grad) is left alone."""
    import torch.distributed as dist

    import pipeline.trainer.step as tr

    real, calls = tr.micro_loss, [0]

    def micro_loss(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, int]:
        loss, n = real(*args, **kwargs)
        if torch.is_grad_enabled():
            i, calls[0] = calls[0], calls[0] + 1
            last_rank = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
            if last_rank and i == step * grad_accum + grad_accum - 1:
                loss = loss * float("nan")
        return loss, n

    tr.micro_loss = micro_loss


SPIKE_STEP_ENV = "FPA_TEST_SPIKE_STEP"


def spike_step(step: int, grad_accum: int, factor: float = 1000.0) -> None:
    """Multiply the language-model loss of step index `step` by `factor` in its last micro batch (every
    rank), keyed on the trainer's step counter so that a resumed run plants it at the same step."""
    import pipeline.train as tr
    import pipeline.trainer.step as st

    real_step, real_loss, current, calls = tr.train_step, st.micro_loss, [-1], [0]

    def train_step(engine: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
        current[0], calls[0] = state.step, 0
        return real_step(engine, state, *args, **kwargs)

    def micro_loss(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, int]:
        loss, n = real_loss(*args, **kwargs)
        if torch.is_grad_enabled():
            i, calls[0] = calls[0], calls[0] + 1
            if current[0] == step and i == grad_accum - 1:
                loss = loss * factor
        return loss, n

    tr.train_step, st.micro_loss = train_step, micro_loss


def _main() -> int:
    sys.path.insert(0, str(REPO))
    from pipeline import distributed as dist_utils
    from pipeline.config import load_config
    from pipeline.train import train

    args = sys.argv[1:]
    cfg = load_config([a for a in args if "=" not in a], [a for a in args if "=" in a])
    if os.environ.get(NAN_STEP_ENV):
        poison_step(int(os.environ[NAN_STEP_ENV]), cfg.train.grad_accum)
    if os.environ.get(SPIKE_STEP_ENV):
        spike_step(int(os.environ[SPIKE_STEP_ENV]), cfg.train.grad_accum)
    summary = train(cfg, make_loader=memory_loader)
    if dist_utils.rank() == 0:
        print("[train] summary " + json.dumps(summary), flush=True)
    dist_utils.barrier()
    dist_utils.destroy()
    return 0


# ----------------------------------------------------------------------------------------------------
# Unit tests of the pieces above and of the schedule


def test_memory_loader_global_order_is_world_size_independent():
    one = [b for _, b in zip(range(4), MemoryLoader("train", 8, 4, 0, 1, seed=3))]
    r0 = [b for _, b in zip(range(2), MemoryLoader("train", 8, 2, 0, 2, seed=3))]
    r1 = [b for _, b in zip(range(2), MemoryLoader("train", 8, 2, 1, 2, seed=3))]
    flat_one = torch.cat(one[:2])  # 1 rank, two micro batches of 4 = rows 0..7
    flat_two = torch.cat([r0[0], r1[0], r0[1], r1[1]])  # 2 ranks x micro 2, two steps = rows 0..7
    assert torch.equal(flat_one, flat_two)


def test_lr_schedule_warmup_cosine():
    from pipeline.config import TrainConfig
    from pipeline.trainer.schedule import lr_at

    tc = TrainConfig(lr=1.0, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, tc) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, tc) == pytest.approx(1.0)
    assert lr_at(9, tc) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, tc) == pytest.approx(0.1)
    assert lr_at(100, tc) == pytest.approx(0.1)


def test_batch_to_xy_accepts_rows_and_pairs():
    from pipeline.trainer.batches import batch_to_xy

    rows = torch.arange(10).view(2, 5)
    x, y = batch_to_xy(rows, torch.device("cpu"))
    assert torch.equal(x, rows[:, :-1]) and torch.equal(y, rows[:, 1:])
    x2, y2 = batch_to_xy((rows[:, :-1], rows[:, 1:]), torch.device("cpu"))
    assert torch.equal(x2, x) and torch.equal(y2, y)
    x3, _ = batch_to_xy(rows.to(torch.int32), torch.device("cpu"))
    assert x3.dtype == torch.long and torch.equal(x3, x)


if __name__ == "__main__":
    sys.exit(_main())
