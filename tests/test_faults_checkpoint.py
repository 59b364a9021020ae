"""Checkpoints under faults and files from others (issue 14): nothing executed, nothing lost.

- no code from files: a .pt holding a pickled callable (its __reduce__ runs os.system, which would
  create a marker file) is refused with one line naming it wherever a checkpoint is read: `fpa train`
  with resume=<dir> and with resume=auto, `fpa export --checkpoint`, and DeepSpeed's own loaders;
- resume choices never destroy checkpoints: resume=none and resuming an older step archive what they
  would collide with; pruning keeps other lineages and the checkpoint just written; after a rollback and
  a kill, auto-resume continues the new lineage;
- integrity: checksums at save, a resume falls back past a truncated / flipped / garbage checkpoint naming
  the file, a save refuses non-finite weights, a corrupted export is an error instead of NaN perplexity;
- one trainer per run dir (lock naming the holder), SIGINT saves like SIGTERM, `fpa train --force` on a
  finished run keeps its final loss.

Training runs are fresh processes with the in-memory loader of test_train_support (about 4 s each); run
as a script this file is that runner plus an optional weight-poisoning hook (FPA_TEST_POISON_SAVE).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_support import (
    REPO,
    popen_training,
    prepare_word_corpus,
    read_metrics,
    run_training,
    summary_of,
    write_config,
)

from pipeline import checkpoint as ck

POISON_ENV = "FPA_TEST_POISON_SAVE"
TINY = ["train.max_steps=8", "train.checkpoint.every=4", "train.checkpoint.keep_last=2"]


class Evil:
    """Unpickling this runs `touch <marker>`: what a hostile checkpoint file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def plant(path: Path, marker: Path) -> None:
    """Put a pickled callable into a checkpoint file, keeping its real content (and its checksum entry
    consistent, as someone handing over a checkpoint would): only the unpickling check can catch it."""
    state = ck.safe_load(path) if path.is_file() else {}
    state["evil"] = Evil(marker)
    torch.save(state, path)
    ck.write_checksums(path.parent)


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_metrics(run_dir).items() if "loss" in r}


def tree_hashes(d: Path) -> dict[str, str]:
    from data_prep.index import sha256_file

    return {str(p.relative_to(d)): sha256_file(p) for p in sorted(d.rglob("*")) if p.is_file()}


def archived(run_dir: Path, tag: str) -> list[Path]:
    return sorted((run_dir / "archive").glob(f"*/checkpoints/{tag}"))


def runner(cfg: Path, overrides: list[str], env: dict[str, str] | None = None, **kw: Any):
    """run_training through this file (the poisoning hook) instead of test_train_support's."""
    if not env or POISON_ENV not in env:
        return run_training(cfg, overrides, env=env, **kw)
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}
    full.pop("FPA_QUIET_WANDB", None)
    return subprocess.run(
        [sys.executable, __file__, str(cfg), *overrides],
        cwd=REPO,
        env=full,
        capture_output=True,
        text=True,
        timeout=240,
    )


def wait_for(cond, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"condition not reached in {timeout} s")


def logged_step(run_dir: Path, step: int) -> bool:
    f = run_dir / "metrics.jsonl"
    return f.is_file() and any(json.loads(x).get("step", 0) >= step for x in f.read_text().splitlines())


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("cfg"))


@pytest.fixture(scope="module")
def base(cfg_path, tmp_path_factory) -> tuple[Path, dict]:
    """8 steps, checkpoints at 4 and 8: the run every test below copies and damages."""
    runs = tmp_path_factory.mktemp("base")
    proc = run_training(cfg_path, [*TINY, f"runs_dir={runs}"])
    return runs / "t", summary_of(proc)


def copy_run(base_dir: Path, tmp: Path) -> Path:
    shutil.copytree(base_dir, tmp / "t")
    return tmp / "t"


# ----------------------------------------------------------------------------------------------------
# No code from files


def test_weights_only_loads_guards_deepspeeds_own_loaders(tmp_path):
    """DeepSpeed's loaders call torch.load(weights_only=False); inside weights_only_loads() they refuse
    the file, naming it, and nothing runs. The control shows the planted file is live."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    marker = tmp_path / "marker"
    f = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "evil": Evil(marker)}, f)
    torch.load(f, weights_only=False)  # control: a plain load runs the payload
    assert marker.exists()
    marker.unlink()

    with ck.weights_only_loads(), pytest.raises(ck.UnsafeCheckpointError) as e:
        TorchCheckpointEngine().load(str(f), map_location="cpu")
    assert str(f) in str(e.value) and "posix.system" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ck.UnsafeCheckpointError, match="mp_rank_00_model_states.pt"):
        ck.safe_load(f)
    assert not marker.exists()
    assert torch.load is ck._torch_load  # restored on the way out


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory) -> tuple[Path, Path]:
    """`fpa train` (the CLI, real prepared shards, export at the end): (config file, run dir)."""
    tmp = tmp_path_factory.mktemp("cli")
    prepare_word_corpus(tmp)
    cfg = tmp / "run.yaml"
    cfg.write_text(
        f"""
name: cli
runs_dir: {tmp / "runs"}
model: {{n_layer: 1, n_head: 2, d_model: 32, max_seq_len: 64}}
data:
  train: {{type: jsonl, paths: ["{tmp / "c.jsonl"}"]}}
  val_fraction: 0.1
  tokenizer: {{vocab_size: 300}}
  sequences_per_member: 8
  sequences_per_shard: 32
  out_dir: {tmp / "data"}
  seq_len: 32
train: {{micro_batch: 4, max_steps: 6, lr: 1.0e-2, warmup_steps: 2, log_every: 3, val_every: 3,
         val_batches: 2, checkpoint: {{every: 3}}}}
logging: {{wandb_mode: disabled, progress: false}}
"""
    )
    r = fpa("train", str(cfg))
    assert r.returncode == 0, r.stderr[-3000:]
    return cfg, tmp / "runs" / "cli"


def fpa(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("FPA_QUIET_WANDB", None)
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


def assert_one_line_refusal(r: subprocess.CompletedProcess, names: Path, marker: Path) -> None:
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("fpa: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert str(names) in errors[0] and "pickled posix.system" in errors[0], errors[0]
    assert not marker.exists()


@pytest.mark.parametrize(
    "where, victim",
    [
        ("explicit", "mp_rank_00_model_states.pt"),  # DeepSpeed's file, via resume=<dir>
        ("auto", "rank_state_0.pt"),  # ours, in the latest checkpoint, via resume=auto
    ],
)
def test_train_refuses_pickled_code(cli_run, tmp_path, where, victim):
    cfg, run_dir = cli_run
    runs = tmp_path / "runs"
    shutil.copytree(run_dir, runs / "cli")
    ckpt = runs / "cli" / "checkpoints" / "global_step6"
    marker = tmp_path / "marker"
    plant(ckpt / victim, marker)
    before = tree_hashes(runs / "cli" / "checkpoints")
    resume = f"train.checkpoint.resume={ckpt}" if where == "explicit" else "train.checkpoint.resume=auto"
    r = fpa("train", str(cfg), f"runs_dir={runs}", "--force", resume)
    assert_one_line_refusal(r, ckpt / victim, marker)
    assert "resumed from" not in r.stdout  # no quiet fallback to the older checkpoint either
    assert tree_hashes(runs / "cli" / "checkpoints") == before  # nothing moved, pruned or written


def test_export_refuses_pickled_code(cli_run, tmp_path):
    cfg, run_dir = cli_run
    ckpt = tmp_path / "global_step6"
    shutil.copytree(run_dir / "checkpoints" / "global_step6", ckpt)
    marker = tmp_path / "marker"
    plant(ckpt / "mp_rank_00_model_states.pt", marker)
    r = fpa("export", str(cfg), "--checkpoint", str(ckpt), "--out", str(tmp_path / "out"))
    assert_one_line_refusal(r, ckpt / "mp_rank_00_model_states.pt", marker)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------
# Integrity


def test_force_on_finished_run_keeps_its_final_loss(cli_run, tmp_path):
    """`fpa train --force` on a finished run resumes at max_steps and trains nothing: its manifest keeps
    the final and validation losses it had (it used to write final_loss NaN)."""
    cfg, run_dir = cli_run
    runs = tmp_path / "runs"
    shutil.copytree(run_dir, runs / "cli")
    manifest = runs / "cli" / "manifests" / "train.json"
    first = json.loads(manifest.read_text())["result"]
    r = fpa("train", str(cfg), f"runs_dir={runs}", "--force")
    assert r.returncode == 0, r.stderr[-3000:]
    again = json.loads(manifest.read_text())
    assert again["status"] == "done" and again["result"]["steps"] == 6
    assert again["result"]["final_loss"] == first["final_loss"] and first["final_loss"] > 0
    assert again["result"]["val_loss"] == first["val_loss"] and first["val_loss"] > 0


def flip(f: Path, n: int = 64) -> None:
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    f.write_bytes(bytes(data))


def damage(ckpt: Path, how: str) -> tuple[Path, str]:
    """Damage ckpt; return the file and the words the fallback message must use for it."""
    model, rank = ckpt / "mp_rank_00_model_states.pt", ckpt / "rank_state_0.pt"
    if how == "truncated":
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
        return model, "is truncated"
    if how == "flipped":
        flip(model)
        return model, "is corrupted"
    if how == "garbage_rank_state":
        rank.write_bytes(random.Random(0).randbytes(rank.stat().st_size))
        return rank, "is corrupted"
    # A checkpoint from before checksums.json: a valid pickle that is not a rank state is still caught.
    (ckpt / ck.CHECKSUMS).unlink()
    torch.save({"not": "a rank state"}, rank)
    return rank, "is not a rank state"


@pytest.mark.parametrize("how", ["truncated", "flipped", "garbage_rank_state", "wrong_rank_state_no_sums"])
def test_resume_falls_back_past_a_damaged_checkpoint(cfg_path, base, tmp_path, how):
    run_dir = copy_run(base[0], tmp_path)
    victim, words = damage(run_dir / "checkpoints" / "global_step8", how)
    damaged = tree_hashes(run_dir / "checkpoints" / "global_step8")
    proc = run_training(cfg_path, [*TINY, f"runs_dir={tmp_path}"])
    assert f"cannot resume from global_step8: {victim} {words}" in proc.stdout, proc.stdout[-2000:]
    assert "at step 4" in proc.stdout
    ref = losses(base[0])
    got = losses(run_dir)
    assert all(abs(got[s] - ref[s]) <= 2e-5 * abs(ref[s]) for s in range(5, 9)), (got, ref)  # exact resume
    assert ck.verify(run_dir / "checkpoints" / "global_step8") is None  # the new one is intact
    (moved,) = archived(run_dir, "global_step8")  # the damaged one is kept aside, as it was
    assert tree_hashes(moved) == damaged


def test_save_refuses_non_finite_weights(cfg_path, tmp_path):
    """The weights turn NaN before the save at step 8: no global_step8, `latest` and global_step4 stay."""
    proc = runner(cfg_path, [*TINY, f"runs_dir={tmp_path}"], env={POISON_ENV: "8"}, check=False)
    assert proc.returncode != 0
    assert "refusing to save global_step8: the weights are not finite (embed.weight)" in proc.stderr
    root = tmp_path / "t" / "checkpoints"
    assert not (root / "global_step8").exists()
    assert (root / "latest").read_text() == "global_step4"
    assert ck.verify(root / "global_step4") is None


def test_corrupted_export_is_an_error_not_nan(cli_run, tmp_path):
    from pipeline.export import ExportError, load_exported

    cfg, run_dir = cli_run
    export = tmp_path / "export"
    shutil.copytree(run_dir / "export", export)
    load_exported(export)  # intact: loads
    flip(export / "model.safetensors")
    with pytest.raises(ExportError, match=r"model\.safetensors is corrupted"):
        load_exported(export)
    r = fpa("eval", str(cfg), "--checkpoint", str(export), f"runs_dir={tmp_path / 'runs'}")
    assert r.returncode == 2 and "model.safetensors is corrupted" in r.stderr, r.stderr[-2000:]
    # Without checksums.json (an older export) NaN weights (all-ones bytes) are still refused.
    (export / ck.CHECKSUMS).unlink()
    data = bytearray((export / "model.safetensors").read_bytes())
    data[-4096:-4032] = b"\xff" * 64
    (export / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ExportError, match="holds non-finite weights"):
        load_exported(export)


# ----------------------------------------------------------------------------------------------------
# Resume choices never destroy checkpoints


def test_resume_none_on_a_used_run_dir_archives_and_starts_over(cfg_path, base, tmp_path):
    run_dir = copy_run(base[0], tmp_path)
    (run_dir / "export").mkdir()
    (run_dir / "export" / "model.safetensors").write_bytes(b"old weights")
    old = {t: tree_hashes(run_dir / "checkpoints" / t) for t in ("global_step4", "global_step8")}
    old_lineage = ck.lineage_of(run_dir / "checkpoints" / "global_step8")
    proc = run_training(cfg_path, [*TINY, "train.checkpoint.resume=none", f"runs_dir={tmp_path}"])
    assert "starts a new history: moved global_step4, global_step8, export to" in proc.stdout
    (dest,) = (run_dir / "archive").iterdir()
    assert str(dest) in proc.stdout
    for tag, hashes in old.items():
        assert tree_hashes(dest / "checkpoints" / tag) == hashes
    assert (dest / "export" / "model.safetensors").read_bytes() == b"old weights"
    # A fresh run of the same config: the same curve, its own lineage, both checkpoints kept.
    assert losses(run_dir) == losses(base[0])
    assert summary_of(proc)["steps"] == 8
    for tag in ("global_step4", "global_step8"):
        assert ck.verify(run_dir / "checkpoints" / tag) is None
        assert ck.lineage_of(run_dir / "checkpoints" / tag) not in ("", old_lineage)


def test_rollback_kill_and_auto_resume_stay_on_the_new_lineage(cfg_path, tmp_path):
    """Run A (12 steps, checkpoints 8/10/12); roll back to A's step 8 with another lr (lineage B, keeping
    one checkpoint), kill B after its step-10 save, resume=auto: B continues from its own step 10 and
    ends on the curve of an uninterrupted B. A's 10 and 12 are archived byte for byte; A's 8, the
    branch point, is another lineage and survives B's keep_last=1."""
    a_over = ["train.max_steps=12", "train.checkpoint.every=2", "train.checkpoint.keep_last=3"]
    b_over = [*a_over[:2], "train.checkpoint.keep_last=1", "train.lr=5.0e-3"]
    run_training(cfg_path, [*a_over, f"runs_dir={tmp_path / 'a'}"])
    a_dir = tmp_path / "a" / "t"
    a_root = a_dir / "checkpoints"
    a_hashes = {t: tree_hashes(a_root / t) for t in ("global_step8", "global_step10", "global_step12")}
    a_lineage = ck.lineage_of(a_root / "global_step8")
    ref_dir = copy_run(a_dir, tmp_path / "ref")  # B without the kill
    run_training(
        cfg_path,
        [
            *b_over,
            f"train.checkpoint.resume={ref_dir / 'checkpoints' / 'global_step8'}",
            f"runs_dir={tmp_path / 'ref'}",
        ],
    )

    proc = popen_training(
        cfg_path,
        [*b_over, f"train.checkpoint.resume={a_root / 'global_step8'}", f"runs_dir={tmp_path / 'a'}"],
        {"FPA_TEST_LOADER_DELAY": "0.15"},
    )
    try:
        b10 = a_root / "global_step10"
        wait_for(lambda: ck.lineage_of(b10) not in ("", a_lineage), proc)
    finally:
        proc.kill()
        proc.wait()
    b_lineage = ck.lineage_of(b10)
    assert (a_root / "latest").read_text() == "global_step10"
    proc2 = run_training(cfg_path, [*b_over, f"runs_dir={tmp_path / 'a'}"])  # resume=auto
    assert f"resumed from {b10} at step 10" in proc2.stdout, proc2.stdout[-2000:]

    ref, got = losses(ref_dir), losses(a_dir)
    assert all(abs(got[s] - ref[s]) <= 2e-5 * abs(ref[s]) for s in range(9, 13)), (got, ref)
    for tag in ("global_step10", "global_step12"):
        (moved,) = archived(a_dir, tag)
        assert tree_hashes(moved) == a_hashes[tag] and ck.lineage_of(moved) == a_lineage
    assert sorted(p.name for p in a_root.iterdir() if p.is_dir()) == ["global_step12", "global_step8"]
    assert tree_hashes(a_root / "global_step8") == a_hashes["global_step8"]
    assert ck.lineage_of(a_root / "global_step12") == b_lineage


class FakeEngine:
    """Enough of a DeepSpeed engine for ck.save: a module, and save_checkpoint writing one file."""

    def __init__(self) -> None:
        self.module = torch.nn.Linear(2, 2)

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool) -> None:
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        torch.save(
            {"module": self.module.state_dict(), **client_state},
            Path(save_dir) / tag / "mp_rank_00_model_states.pt",
        )


def test_save_keeps_other_lineages_and_the_checkpoint_just_written(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    eng = FakeEngine()
    rs = {"rng": ck.rng_state()}
    for step in (4, 8):
        ck.save(eng, root, step, {"step": step}, rs, keep_last=2, lineage="A")
    a8 = tree_hashes(root / "global_step8")
    # Lineage B writes the same tag: A's global_step8 is moved aside, not deleted.
    ck.save(eng, root, 8, {"step": 8}, rs, keep_last=1, lineage="B")
    (moved,) = archived(tmp_path / "run", "global_step8")
    assert tree_hashes(moved) == a8 and ck.lineage_of(moved) == "A"
    assert ck.lineage_of(root / "global_step8") == "B" and ck.verify(root / "global_step8") is None
    assert ck.lineage_of(root / "global_step4") == "A"  # keep_last=1 prunes only B's own
    # B saves a step below its newest: keep_last=1 keeps the newest (8), and the one just written too.
    ck.save(eng, root, 6, {"step": 6}, rs, keep_last=1, lineage="B")
    kept = ["global_step4", "global_step6", "global_step8"]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == kept
    # Non-finite weights: refused before anything is written.
    with torch.no_grad():
        eng.module.weight[0, 0] = float("inf")
    with pytest.raises(ck.CheckpointError, match="not finite"):
        ck.save(eng, root, 10, {"step": 10}, rs, keep_last=1, lineage="B")
    assert not (root / "global_step10").exists() and (root / "latest").read_text() == "global_step6"


def test_checksums_name_only_files_inside_the_checkpoint(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"abc")
    ck.write_checksums(tmp_path)
    assert ck.checksum_problem(tmp_path) is None
    (tmp_path / "a.pt").write_bytes(b"abd")
    assert (
        ck.checksum_problem(tmp_path)
        == f"{tmp_path / 'a.pt'} is corrupted (its sha256 differs from the one recorded at save)"
    )
    for name in ("/etc/hostname", "../a.pt"):
        (tmp_path / ck.CHECKSUMS).write_text(json.dumps({"files": {name: {"sha256": "0", "bytes": 1}}}))
        assert (
            ck.checksum_problem(tmp_path) == f"{tmp_path / ck.CHECKSUMS} names {name}, outside the checkpoint"
        )


# ----------------------------------------------------------------------------------------------------
# One trainer per run dir, SIGINT


def test_second_trainer_on_the_same_run_dir_fails_at_once(cfg_path, tmp_path):
    first = popen_training(cfg_path, [*TINY, f"runs_dir={tmp_path}"], {"FPA_TEST_LOADER_DELAY": "1.5"})
    try:
        wait_for(lambda: logged_step(tmp_path / "t", 1), first)
        t0 = time.time()
        second = run_training(cfg_path, [*TINY, f"runs_dir={tmp_path}"], check=False)
        took = time.time() - t0
        assert first.poll() is None  # the check happened while the first one was training
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert second.returncode != 0
    assert f"is in use by another train (pid {first.pid} on host {socket.gethostname()}" in second.stderr
    assert took < 30 and "[train] model:" not in second.stdout  # failed before building anything
    assert first.returncode == 0, err[-2000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))  # one writer


def test_run_lock_is_reentrant_in_a_process_and_exclusive_across(tmp_path):
    from pipeline.rundir import run_lock

    code = "import sys; from pathlib import Path; from pipeline.rundir import run_lock\n"
    code += "with run_lock(Path(sys.argv[1])): pass"
    with run_lock(tmp_path), run_lock(tmp_path):  # a stage wrapper, then train() inside it
        other = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=REPO
        )
        assert f"RunDirBusy: {tmp_path} is in use by another train (pid {os.getpid()}" in other.stderr
    with run_lock(tmp_path), run_lock(tmp_path / ".." / tmp_path.name):  # one lock however spelled
        pass
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, cwd=REPO)
    assert other.returncode == 0  # released on the way out


def test_sigint_saves_and_exits_like_sigterm(cfg_path, base, tmp_path):
    marker = tmp_path / "requeued"
    over = [*TINY[:1], "train.checkpoint.every=100", f"runs_dir={tmp_path}"]
    env = {
        "FPA_TEST_LOADER_DELAY": "0.15",
        "SLURM_JOB_ID": "77",
        "FPA_REQUEUE_CMD": f"touch {marker}",
    }
    proc = popen_training(cfg_path, over, env)
    try:
        wait_for(lambda: logged_step(tmp_path / "t", 3), proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, err[-3000:]
    latest = (tmp_path / "t" / "checkpoints" / "latest").read_text()
    assert 3 <= int(latest.removeprefix("global_step")) < 8
    assert ck.verify(tmp_path / "t" / "checkpoints" / latest) is None
    assert not marker.exists()  # Ctrl-C is a person stopping the job: saved, not requeued
    run_training(cfg_path, over)
    ref, got = losses(base[0]), losses(tmp_path / "t")
    assert all(abs(got[s] - ref[s]) <= 2e-5 * abs(ref[s]) for s in range(1, 9)), (got, ref)


# ----------------------------------------------------------------------------------------------------


def _poison_weights_before_save(step: int) -> None:
    """Wrap pipeline.checkpoint.save in this process: the weights hold a NaN when step `step` is saved."""
    real = ck.save

    def save(engine: Any, root: Path, s: int, *args: Any, **kwargs: Any) -> Path:
        if s == step:
            with torch.no_grad():
                engine.module.embed.weight[0, 0] = float("nan")
        return real(engine, root, s, *args, **kwargs)

    ck.save = save


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_train_support

    if os.environ.get(POISON_ENV):
        _poison_weights_before_save(int(os.environ[POISON_ENV]))
    sys.exit(test_train_support._main())
