"""Training under DeepSpeed: ZeRO stages, 1 vs 2 ranks, exact resume (kill, preemption, other world size),
NaN policy, export round trip, W&B offline records.

Every run is a fresh process (python for 1 rank, torchrun for 2) with the in-memory loader of
test_train_support. The reference run (ZeRO-0, 1 rank, micro 2 x accum 2 = global batch 4, 12 steps) is
made once per module and the other runs are compared with it step by step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train_support import REPO, popen_training, read_metrics, run_training, summary_of, write_config

BASE = ["train.micro_batch=2", "train.grad_accum=2", "train.max_steps=12", "train.val_every=6"]
TOL = 2e-5  # fp32: ranks / stages / resume agree to about 1e-6 here


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_metrics(run_dir).items() if "loss" in r}


def assert_same_curve(a: dict[int, float], b: dict[int, float], steps=None, tol=TOL) -> None:
    steps = sorted(a) if steps is None else steps
    for s in steps:
        assert abs(a[s] - b[s]) <= tol * max(1.0, abs(a[s])), f"step {s}: {a[s]} vs {b[s]}"


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("cfg"))


@pytest.fixture(scope="module")
def reference(cfg_path, tmp_path_factory) -> tuple[Path, dict]:
    runs = tmp_path_factory.mktemp("ref")
    proc = run_training(cfg_path, [*BASE, f"runs_dir={runs}"])
    return runs / "t", summary_of(proc)


@pytest.fixture(scope="module")
def two_rank(cfg_path, tmp_path_factory) -> tuple[Path, dict]:
    """2 ranks, ZeRO-2, micro 2 x accum 1: the same global batch as the reference; all 12 steps. Steps 6-7
    are traced on rank 0 (train.profile): the curve still equals the reference's, untraced."""
    runs = tmp_path_factory.mktemp("two")
    over = [*BASE, "train.grad_accum=1", "train.zero_stage=2", "train.checkpoint.keep_last=3"]
    over += ["train.profile.start=6", "train.profile.steps=2"]
    proc = run_training(cfg_path, [*over, f"runs_dir={runs}"], nproc=2)
    return runs / "t", summary_of(proc)


def test_reference_run_learns_and_checkpoints(reference):
    run_dir, summary = reference
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, 13))
    assert curve[12] < curve[1] - 0.3, curve  # the synthetic sequences are easy: the loss must fall
    assert summary["steps"] == 12 and summary["tokens"] == 12 * 4 * 32
    assert summary["val_loss"] is not None and summary["val_loss"] < curve[1]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["global_step12", "global_step8"]  # keep_last: 2
    assert (run_dir / "checkpoints" / "latest").read_text() == "global_step12"
    meta = json.loads((run_dir / "checkpoints" / "global_step12" / "COMPLETE").read_text())
    assert meta["step"] == 12 and meta["world_size"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_match_reference(stage, cfg_path, reference, tmp_path):
    run_training(cfg_path, [*BASE, f"train.zero_stage={stage}", f"runs_dir={tmp_path}"])
    got = losses(tmp_path / "t")
    assert got[12] < got[1] - 0.3
    assert_same_curve(losses(reference[0]), got)
    # The ZeRO-partitioned checkpoint consolidates to the reference's weights.
    assert_same_weights(tmp_path / "t", reference[0], 12, tmp_path / "export")


def assert_same_weights(
    run_a: Path, run_b: Path, step: int, tmp: Path, tol: float = 1e-5, step_b: int | None = None
) -> None:
    from pipeline.config import load_config
    from pipeline.export import export, load_exported

    cfg = load_config([])
    step_b = step if step_b is None else step_b
    ma = load_exported(export(cfg, run_a / "checkpoints" / f"global_step{step}", tmp / "a"))
    mb = load_exported(export(cfg, run_b / "checkpoints" / f"global_step{step_b}", tmp / "b"))
    for (k, a), (_, b) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=tol, rtol=tol * 10, msg=k)


@pytest.mark.distributed
def test_two_ranks_match_one_rank(reference, two_rank):
    got = losses(two_rank[0])
    assert sorted(got) == list(range(1, 13))
    assert_same_curve(losses(reference[0]), got)
    meta = json.loads((two_rank[0] / "checkpoints" / "global_step8" / "COMPLETE").read_text())
    assert meta["world_size"] == 2
    assert two_rank[1]["val_loss"] == pytest.approx(reference[1]["val_loss"], rel=1e-4)


def test_profile_window_writes_a_trace_and_the_memory_on_rank_0_only(two_rank):
    """train.profile.start=6, steps=2 (two_rank): a Chrome trace holding exactly steps 6 and 7 as ranges
    with the ops inside them, and the per-op CPU memory; rank 1 (not in train.profile.ranks) writes none."""
    prof = two_rank[0] / "profile"
    assert sorted(p.name for p in prof.iterdir()) == ["rank0"]
    assert sorted(p.name for p in (prof / "rank0").iterdir()) == ["memory-6-7.json", "trace-6-7.json"]
    events = json.loads((prof / "rank0" / "trace-6-7.json").read_text())["traceEvents"]
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("train step"))
    assert steps == ["train step 6", "train step 7"]
    names = {e.get("name") for e in events}
    assert {"aten::mm", "aten::add_"} & names, sorted(n for n in names if n)[:20]
    step6 = next(e for e in events if e.get("name") == "train step 6")
    inside = [
        e for e in events if e.get("ph") == "X" and step6["ts"] <= e["ts"] <= step6["ts"] + step6["dur"]
    ]
    assert len(inside) > 50  # the step's ops sit inside its range
    memory = json.loads((prof / "rank0" / "memory-6-7.json").read_text())
    assert memory["steps"] == [6, 7] and memory["device"] == "cpu"
    assert memory["ops"][0]["self_cpu_memory_bytes"] != 0 and len(memory["ops"]) > 5


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_sequence_parallel_two_ranks_match_one_rank(mode, cfg_path, reference, tmp_path):
    """parallel.sequence=2: both ranks share every sequence (zigzag chunks), the same global batch as the
    reference; the loss curve and the validation loss equal the 1-rank run's."""
    over = [*BASE, "parallel.sequence=2", f"parallel.sequence_mode={mode}", f"runs_dir={tmp_path}"]
    proc = run_training(cfg_path, over, nproc=2)
    assert_same_curve(losses(reference[0]), losses(tmp_path / "t"), tol=5e-5)
    assert summary_of(proc)["val_loss"] == pytest.approx(reference[1]["val_loss"], rel=1e-4)
    assert summary_of(proc)["tokens"] == 12 * 4 * 32  # tokens are counted once per sequence group


@pytest.mark.distributed
def test_resume_two_ranks_on_one_rank(cfg_path, reference, two_rank, tmp_path):
    """A ZeRO-2 checkpoint of 2 ranks, resumed on 1 rank (universal checkpoint), continues the curve."""
    src = two_rank[0]
    run_dir = tmp_path / "t"
    run_dir.mkdir()
    shutil.copytree(src / "checkpoints" / "global_step8", run_dir / "checkpoints" / "global_step8")
    shutil.copy(src / "metrics.jsonl", run_dir / "metrics.jsonl")
    # The copied `latest` is absent: resume: auto must still find the newest complete checkpoint.
    proc = run_training(cfg_path, [*BASE, "train.zero_stage=2", f"runs_dir={tmp_path}"])
    assert "resumed from" in proc.stdout and "at step 8" in proc.stdout
    assert_same_curve(losses(reference[0]), losses(run_dir), steps=[9, 10, 11, 12])
    assert summary_of(proc)["tokens"] == 12 * 4 * 32


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    f = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        if f.is_file() and any(json.loads(x).get("step", 0) >= step for x in f.read_text().splitlines()):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_same_curve(cfg_path, reference, tmp_path):
    # ZeRO-3 here: its resume (partitioned params + optimizer) is covered nowhere else.
    over = [*BASE, "train.zero_stage=3", "train.checkpoint.every=3", f"runs_dir={tmp_path}"]
    proc = popen_training(cfg_path, over, {"FPA_TEST_LOADER_DELAY": "0.15"})
    try:
        _wait_for_step(tmp_path / "t", 7, proc)
    finally:
        proc.kill()  # SIGKILL: no handler runs, no checkpoint is written on the way out
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / "t" / "checkpoints" / "latest").read_text() == "global_step6"
    proc2 = run_training(cfg_path, over)
    assert "at step 6" in proc2.stdout
    assert_same_curve(losses(reference[0]), losses(tmp_path / "t"))
    assert summary_of(proc2)["steps"] == 12


@pytest.mark.slow
def test_sigusr1_saves_requeues_and_resumes_same_wandb_run(cfg_path, reference, tmp_path):
    from wandb_log import find_wandb_files, read_finished_wandb_file

    marker = tmp_path / "requeued.txt"
    over = [*BASE, "train.checkpoint.every=100", "logging.wandb_mode=offline", f"runs_dir={tmp_path}"]
    env = {
        "FPA_TEST_LOADER_DELAY": "0.15",
        "SLURM_JOB_ID": "4242",
        "FPA_REQUEUE_CMD": f"sh -c 'echo $1 >> {marker}' sh {{job_id}}",  # an argv: no shell unless named
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
    }
    proc = popen_training(cfg_path, over, env)
    _wait_for_step(tmp_path / "t", 3, proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert marker.read_text().split() == ["4242"]
    latest = (tmp_path / "t" / "checkpoints" / "latest").read_text()
    stopped_at = int(latest.removeprefix("global_step"))
    assert 3 <= stopped_at < 12
    first_id = json.loads((tmp_path / "t" / "checkpoints" / latest / "COMPLETE").read_text())["wandb_run_id"]
    assert first_id

    proc2 = run_training(cfg_path, over)
    assert summary_of(proc2)["wandb_run_id"] == first_id  # the same W&B run continues
    assert_same_curve(losses(reference[0]), losses(tmp_path / "t"))

    files = find_wandb_files(tmp_path / "t", first_id)
    assert len(files) == 2
    logged = {}
    for f in files:
        rec = read_finished_wandb_file(f)
        assert rec["run_id"] == first_id
        for row in rec["history"]:
            if "train/loss" in row:
                logged[row["_step"]] = row
    assert sorted(logged) == [2, 4, 6, 8, 10, 12]
    ref = losses(reference[0])
    # log_every=2: each logged loss is the mean over its window of 2 steps (windows restart on resume).
    assert stopped_at < 10
    for s in (2, 12):
        assert logged[s]["train/loss"] == pytest.approx((ref[s - 1] + ref[s]) / 2, rel=1e-4)
    assert logged[12]["train/tokens"] == 12 * 4 * 32
    cfg_logged = read_finished_wandb_file(files[0])["config"]
    assert cfg_logged["model"]["d_model"] == 32 and "git_sha" in cfg_logged


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])  # 1 and 3 pass too; left out for time
def test_nan_skip_leaves_weights_untouched(stage, cfg_path, tmp_path):
    """ZeRO-0 (discarded by hand) and ZeRO-2 (DeepSpeed's own non-finite-norm skip), accum 2: the last
    micro batch of step index 3 has a non-finite loss (the first one was
    already backpropagated). The step is skipped: the weights equal those after 3 steps, and no gradient
    of the dropped step leaks into the next one (the run continues exactly as a resume from just after)."""
    over = [
        "train.micro_batch=2",
        "train.grad_accum=2",
        f"train.zero_stage={stage}",
        "train.warmup_steps=100",
    ]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    run_training(cfg_path, [*over, "train.max_steps=3", f"runs_dir={a}"])
    proc = run_training(
        cfg_path, [*over, "train.max_steps=6", f"runs_dir={b}"], env={"FPA_TEST_NAN_STEP": "3"}
    )
    assert summary_of(proc)["skipped_steps"] == 1
    assert "non-finite loss, step skipped" in proc.stdout
    recs = read_metrics(b / "t")
    assert recs[3].get("skipped") is True and "loss" in recs[2] and "loss" in recs[5]
    assert_same_weights(a / "t", b / "t", 3, tmp_path / "export", tol=0.0, step_b=4)

    (c / "t" / "checkpoints").mkdir(parents=True)
    shutil.copytree(b / "t" / "checkpoints" / "global_step4", c / "t" / "checkpoints" / "global_step4")
    run_training(cfg_path, [*over, "train.max_steps=6", f"runs_dir={c}"])
    assert_same_curve(losses(b / "t"), losses(c / "t"), steps=[5, 6], tol=1e-6)


def test_nan_stop_policy_fails_with_a_clear_error(cfg_path, tmp_path):
    proc = run_training(
        cfg_path,
        ["train.max_steps=4", "train.nan_policy=stop", f"runs_dir={tmp_path}"],
        env={"FPA_TEST_NAN_STEP": "2"},
        check=False,
    )
    assert proc.returncode != 0
    assert "non-finite loss at step 2 (train.nan_policy=stop)" in proc.stderr


def test_export_round_trip_matches_checkpoint_logits(reference, tmp_path):
    from fpa_model.model import GPT
    from pipeline.config import from_yaml_text
    from pipeline.export import export, load_exported

    ckpt = reference[0] / "checkpoints" / "global_step12"
    state = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    cfg = from_yaml_text(state["config_yaml"])
    out = export(cfg, ckpt, tmp_path / "export")
    assert (out / "model.safetensors").is_file() and (out / "config.yaml").is_file()
    exported = load_exported(out)
    direct = GPT(cfg.model)
    direct.load_state_dict(state["module"])
    idx = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(idx), direct.eval()(idx))
    assert exported.lm_head.weight.data_ptr() == exported.embed.weight.data_ptr()  # still tied


@pytest.mark.distributed
def test_export_consolidates_zero2_two_rank_checkpoint(reference, two_rank, tmp_path):
    """ZeRO-2 shards of 2 ranks -> one fp32 model equal to the 1-rank run's weights at the same step."""
    assert_same_weights(two_rank[0], reference[0], 8, tmp_path)


@pytest.mark.slow
def test_bf16_zero1_tracks_fp32(cfg_path, reference, tmp_path):
    """bf16 weights/activations with fp32 gradient accumulation stay close to the fp32 curve."""
    run_training(cfg_path, [*BASE, "train.precision=bf16", "train.zero_stage=1", f"runs_dir={tmp_path}"])
    got, ref = losses(tmp_path / "t"), losses(reference[0])
    assert got[12] < got[1] - 0.3
    assert_same_curve(ref, got, tol=0.03)
    # Export takes the fp32 master weights (via a universal conversion for DeepSpeed's bf16 optimizer):
    # full fp32 mantissas, which round to exactly the bf16 module weights the engine trained with.
    from pipeline.config import load_config
    from pipeline.export import export, load_exported

    ckpt = tmp_path / "t" / "checkpoints" / "global_step12"
    model = load_exported(export(load_config([]), ckpt, tmp_path / "export"))
    bf16 = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    for k, w in model.state_dict().items():
        assert w.dtype == torch.float32 and bf16[k].dtype == torch.bfloat16
        assert torch.equal(w.bfloat16(), bf16[k]), k
    assert any((w != w.bfloat16().float()).any() for w in model.state_dict().values())
    assert not list(ckpt.parent.glob(".export-universal-*"))  # the temporary conversion is removed


def test_bf16_zero0_autocast_tracks_fp32(cfg_path, reference, tmp_path):
    """bf16 at ZeRO-0 (the default stage, what `auto` picks on a GPU): torch autocast over fp32 weights,
    gradients and optimizer (here the CPU's bf16 autocast); its curve stays near the fp32 one."""
    run_training(cfg_path, [*BASE, "train.precision=bf16", f"runs_dir={tmp_path}"])
    got, ref = losses(tmp_path / "t"), losses(reference[0])
    assert got[12] < got[1] - 0.3
    assert_same_curve(ref, got, tol=0.03)
    assert any(abs(got[s] - ref[s]) > 1e-6 for s in ref)  # it did run in bf16, not fp32
    states = torch.load(
        tmp_path / "t" / "checkpoints" / "global_step12" / "mp_rank_00_model_states.pt",
        map_location="cpu",
        weights_only=False,
    )
    assert all(w.dtype == torch.float32 for w in states["module"].values())  # fp32 master weights


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_default_precision_is_bf16_autocast_at_zero0_and_tracks_fp32(cfg_path, tmp_path):
    """On CUDA, train.precision=auto at the default ZeRO-0 trains in bf16 (autocast over fp32 weights)
    and stays near an fp32 run on the same GPU; the 110m model sizes train the same way."""
    auto = run_training(cfg_path, [*BASE, f"runs_dir={tmp_path / 'auto'}"])
    assert "ZeRO 0, bf16" in auto.stdout
    fp32 = run_training(cfg_path, [*BASE, "train.precision=fp32", f"runs_dir={tmp_path / 'fp32'}"])
    assert "ZeRO 0, fp32" in fp32.stdout
    assert_same_curve(losses(tmp_path / "fp32" / "t"), losses(tmp_path / "auto" / "t"), tol=0.03)
    big = [
        "model.n_layer=12",
        "model.n_head=12",
        "model.d_model=768",
        "train.max_steps=4",
        "train.val_every=0",
    ]
    r = run_training(cfg_path, [*BASE[:2], *big, f"runs_dir={tmp_path / 'big'}"])
    assert "ZeRO 0, bf16" in r.stdout and summary_of(r)["final_loss"] > 0


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_forwards_sigusr1_and_both_ranks_checkpoint(cfg_path, reference, tmp_path):
    """Under torchrun --signals-to-handle ...,SIGUSR1 a preemption signal to the agent reaches both ranks,
    which agree on the step, save, requeue once (rank 0) and exit; resume (on 1 rank) continues the curve.
    Without that option torchrun dies of SIGUSR1 (its default action) and the workers save nothing."""
    marker = tmp_path / "requeued.txt"
    over = [*BASE, "train.grad_accum=1", "train.zero_stage=1", "train.checkpoint.every=100"]
    over.append(f"runs_dir={tmp_path}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **{k: v for k, v in os.environ.items() if k != "FPA_QUIET_WANDB"},
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "FPA_TEST_LOADER_DELAY": "0.3",
        "SLURM_JOB_ID": "5151",
        "FPA_REQUEUE_CMD": f"sh -c 'echo $1 >> {marker}' sh {{job_id}}",  # an argv: no shell unless named
    }
    script = str(Path(__file__).with_name("test_train_support.py"))
    torchrun = str(Path(sys.executable).parent / "torchrun")
    proc = subprocess.Popen(
        [
            *(torchrun, "--nproc_per_node", "2", "--master_port", str(port)),
            *("--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout", "120"),
            *(script, str(cfg_path), *over),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a failure can take torchrun's workers down with it
    )
    try:
        _wait_for_step(tmp_path / "t", 2, proc, timeout=180)
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert marker.read_text().split() == ["5151"], err[-3000:]  # rank 0 only, once
    latest = (tmp_path / "t" / "checkpoints" / "latest").read_text()
    meta = json.loads((tmp_path / "t" / "checkpoints" / latest / "COMPLETE").read_text())
    assert meta["world_size"] == 2 and 2 <= meta["step"] < 12
    # Resume on 1 rank with accum 2: the same global batch of 4.
    run_training(cfg_path, [o for o in over if o != "train.grad_accum=1"], nproc=1)
    assert_same_curve(losses(reference[0]), losses(tmp_path / "t"))
