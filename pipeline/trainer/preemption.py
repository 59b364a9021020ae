"""Preemption: SIGTERM / SIGUSR1 / SIGINT -> checkpoint at the next step boundary -> exit 75 (EX_TEMPFAIL).

Under Slurm rank 0 runs `scontrol requeue $SLURM_JOB_ID` first (override: FPA_REQUEUE_CMD). SIGINT (Ctrl-C)
saves and exits 75 the same way but is not requeued; a second Ctrl-C aborts at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: "try again later"; launch scripts requeue on it
REQUEUE_ENV = "FPA_REQUEUE_CMD"  # an argv with {job_id}; default "scontrol requeue {job_id}"


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is written; exits the process with EXIT_PREEMPTED."""

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.step = step
        self.checkpoint = checkpoint


class StopFlag:
    """SIGTERM / SIGUSR1 / SIGINT set a flag; the loop checks it (across ranks) at step boundaries."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    @property
    def requeue(self) -> bool:
        """Whether the stop asks for a requeue: not for Ctrl-C, a person stopping the run."""
        return self.signum != signal.SIGINT

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
