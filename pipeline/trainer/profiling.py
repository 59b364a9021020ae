"""train.profile: a window of training steps traced with torch.profiler, on the chosen ranks.

    prof = StepProfiler(cfg.train.profile, cfg.run_dir, rank, device)
    prof.before(step)   # step: the 1-based number of the step about to run
    ... the step ...
    prof.after(step)    # writes the files once the window's last step is done
    prof.close()        # a run that stops inside the window still writes what it traced

Writes under <run_dir>/profile/rank<R>/: trace-<a>-<b>.json (Chrome / Perfetto trace: chrome://tracing or
ui.perfetto.dev; each step is a "train step N" range) and, with memory on, on CUDA
memory-<a>-<b>.pickle (the allocator's snapshot: pytorch.org/memory_viz), on CPU memory-<a>-<b>.json (the
profiler's per-op allocations, largest first). Each file appears whole (written, then renamed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import atomic_write, atomic_write_text


class StepProfiler:
    def __init__(self, cfg: Any, run_dir: Path, rank: int, device: torch.device) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.enabled = bool(cfg.start) and rank in list(cfg.ranks)
        self.first, self.last = cfg.start, cfg.start + cfg.steps - 1
        self.out = Path(run_dir) / "profile" / f"rank{rank}"
        self._prof: torch.profiler.profile | None = None
        self._range: Any = None
        self._traced: list[int] = []
        self.written: list[Path] = []

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def before(self, step: int) -> None:
        if not self.enabled or not self.first <= step <= self.last:
            return
        if self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                if self.cfg.memory:
                    torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._prof = torch.profiler.profile(
                activities=activities, record_shapes=True, profile_memory=self.cfg.memory
            )
            self._prof.__enter__()
        self._range = torch.profiler.record_function(f"train step {step}")
        self._range.__enter__()

    def after(self, step: int) -> None:
        if self._range is None:
            return
        self._range.__exit__(None, None, None)
        self._range = None
        self._traced.append(step)
        if step >= self.last:
            self._finish()

    def close(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None:
            self._finish()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        prof.__exit__(None, None, None)
        a, b = (self._traced[0], self._traced[-1]) if self._traced else (self.first, self.first)
        trace = self.out / f"trace-{a}-{b}.json"
        atomic_write(trace, lambda tmp: prof.export_chrome_trace(str(tmp)))
        self.written.append(trace)
        if self.cfg.memory:
            if self.cuda:
                snap = self.out / f"memory-{a}-{b}.pickle"
                atomic_write(snap, lambda tmp: torch.cuda.memory._dump_snapshot(str(tmp)))
                torch.cuda.memory._record_memory_history(enabled=None)
            else:
                snap = self.out / f"memory-{a}-{b}.json"
                atomic_write_text(snap, json.dumps(_cpu_memory(prof, a, b), indent=1) + "\n")
            self.written.append(snap)
        print(
            f"[train] profile of steps {a}-{b} written: {', '.join(str(p) for p in self.written)}", flush=True
        )


def _cpu_memory(prof: torch.profiler.profile, a: int, b: int) -> dict[str, Any]:
    """The profiler's allocations per op over the window, largest first (bytes; self: the op's own)."""
    rows = [
        {
            "op": e.key,
            "calls": e.count,
            "self_cpu_memory_bytes": int(e.self_cpu_memory_usage),
            "cpu_memory_bytes": int(e.cpu_memory_usage),
        }
        for e in prof.key_averages()
        if e.cpu_memory_usage or e.self_cpu_memory_usage
    ]
    rows.sort(key=lambda r: -abs(r["self_cpu_memory_bytes"]))
    return {"steps": [a, b], "device": "cpu", "ops": rows}
