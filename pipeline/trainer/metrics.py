"""What training records: one metrics.jsonl line per step (rank 0) and, every train.log_every steps, the
means over the steps since the last log line (the window) with throughput, MFU and memory."""

from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


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


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


@dataclass
class Window:
    """Sums over the steps since the last log line."""

    loss: float = 0.0
    n: int = 0
    time: float = 0.0
    wait: float = 0.0
    tokens: int = 0
    pk_loss: float = 0.0
    pk_n: int = 0


class Metrics:
    """Per-step records and the log window. Only rank 0 writes metrics.jsonl; the logger is rank-aware."""

    def __init__(
        self,
        logger: Any,
        path: Path,
        is_main: bool,
        device: torch.device,
        flops_per_token: float,
        peak_flops_total: float,
        log_every: int,
        max_steps: int,
    ) -> None:
        self.logger, self.path, self.is_main, self.device = logger, path, is_main, device
        self.flops_per_token, self.peak_total = flops_per_token, peak_flops_total
        self.log_every, self.max_steps = log_every, max_steps
        self.window = Window()

    def write(self, record: dict[str, Any]) -> None:
        if self.is_main:
            append_jsonl(self.path, record)

    def skipped(self, step: int, lr: float, spike: bool = False) -> None:
        """A step dropped without an update (step: its 0-based index, as the loop counts before it)."""
        self.write({"step": step, "skipped": True, "lr": lr, **({"spike": True} if spike else {})})

    def step(
        self,
        step: int,
        *,
        loss: float | None,
        passkey_loss: float | None,
        lr: float,
        grad_norm: float,
        tokens: int,
        tokens_per_step: int,
        seconds: float,
        wait: float,
    ) -> None:
        """After optimizer step `step` (1-based): its line (when not skipped) and the window's sums."""
        w = self.window
        if loss is not None:
            w.loss += loss
            w.n += 1
            record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens}
            if passkey_loss is not None:
                w.pk_loss += passkey_loss
                w.pk_n += 1
                record["passkey_loss"] = passkey_loss
            self.write(record)
        w.time += seconds
        w.wait += wait
        w.tokens += tokens_per_step
        self.logger.progress(step, self.max_steps)

    def log_due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.max_steps

    def log(self, step: int, *, lr: float, grad_norm: float, tokens: int, counters: dict[str, int]) -> None:
        """The window's means, then a new window. counters: skipped-step counts (train/<name>)."""
        w = self.window
        tps = w.tokens / max(w.time, 1e-9)
        self.logger.log(
            {
                "train/loss": w.loss / max(w.n, 1),
                "train/lr": lr,
                "train/grad_norm": grad_norm,
                "train/tokens": tokens,
                **{f"train/{k}": v for k, v in counters.items()},
                "perf/tokens_per_s": tps,
                "perf/mfu": self.flops_per_token * tps / self.peak_total,
                "perf/step_time_s": w.time / max(w.n, 1),
                "perf/data_wait_frac": w.wait / max(w.time, 1e-9),
                "perf/memory_mb": memory_mb(self.device),
                **({"train/passkey_loss": w.pk_loss / w.pk_n} if w.pk_n else {}),
            },
            step,
        )
        self.window = Window()
