"""pipeline.trainer.deepspeed_internals: what the project relies on inside DeepSpeed is still there, and
still does what the step guards need (a dropped step leaves the weights alone and advances the counters)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.trainer.deepspeed_internals import TAKE_MODEL_STEP_UPDATES, check_deepspeed

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_deepspeed_has_what_the_step_guards_rely_on() -> None:
    assert check_deepspeed() == []


def test_a_deepspeed_that_moved_its_step_machinery_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    def take_model_step(self, lr_kwargs=None):  # an "upgrade" that counts steps elsewhere
        self.optimizer.step()

    monkeypatch.setattr(DeepSpeedEngine, "_take_model_step", take_model_step)
    problems = check_deepspeed()
    assert len(problems) == len(TAKE_MODEL_STEP_UPDATES)
    assert all("_take_model_step no longer updates" in p for p in problems)
    monkeypatch.delattr(DeepSpeedEngine, "_take_model_step")
    assert check_deepspeed() == ["DeepSpeedEngine._take_model_step is gone"]


# One process, world size 1, gloo: a tiny engine per ZeRO stage; a step dropped the project's way.
_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys
    import torch
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no JIT build
    import deepspeed
    from pipeline.trainer.deepspeed_internals import discard_step, poisoned, skipped_steps

    out = {}
    for stage in (0, 1):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        config = {
            "train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        x = torch.randn(2, 4)
        before = [p.detach().clone() for p in engine.module.parameters()]
        counts = (skipped_steps(engine), engine.global_steps, engine.global_samples)
        loss = engine(x).pow(2).mean()
        if stage == 0:
            engine.backward(loss)
            discard_step(engine)
        else:
            engine.backward(poisoned(loss))
            engine.step()
        same = all(torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters()))
        after = (skipped_steps(engine), engine.global_steps, engine.global_samples)
        engine.backward(engine(x).pow(2).mean())  # the next step updates as usual
        engine.step()
        moved = not all(torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters()))
        out[stage] = {"same": same, "before": counts, "after": after, "next_moved": moved,
                      "shadow_left": "_take_model_step" in vars(engine)}
    print("RESULT " + json.dumps(out))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_a_dropped_step_leaves_the_weights_and_advances_the_counters() -> None:
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(line[len("RESULT ") :])
    for stage in ("0", "1"):
        r = out[stage]
        assert r["same"], f"ZeRO {stage}: the dropped step changed the weights"
        skipped, steps, samples = r["before"]
        assert r["after"] == [skipped + 1, steps + 1, samples + 2], f"ZeRO {stage}: {r}"
        assert r["next_moved"] and not r["shadow_left"], f"ZeRO {stage}: {r}"
