"""Slurm launching on a REAL single-node Slurm cluster (launch/slurm/local_cluster.sh; needs root and the
Debian packages munge, slurmctld, slurmd, slurm-client, installed by the script when missing).

- the time-limit warning (--signal=USR1@N) reaches the training workers while torchrun survives it, the
  job requeues itself and reruns with SLURM_RESTART_COUNT=1; logs land under a hostile run dir
  (spaces, $(...), %) and nothing in a name is executed (a probe stands in for the trainer here);
- `launch_slurm` submits prepare -> train -> eval with afterok; the real trainer runs as 2 torchrun
  agents meeting at a c10d rendezvous, gets USR1 mid-run, checkpoints, requeues itself and resumes from
  that checkpoint; eval runs only after the requeued train job succeeded;
- a 2-element sweep runs as one job array on a shared prepared dataset and `collect_sweep` tabulates it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch import slurm as sl
from launch.sweep import collect_sweep, load_sweep, run_sweep
from pipeline.config import load_config

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "launch" / "slurm" / "local_cluster.sh"
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "BOOT_FAIL",
    "DEADLINE",
}

# A run small enough for seconds on 2 cores: 60 KJV verses, 512-token BPE, a 2-layer d=32 model.
FAST_YAML = """
name: fast
model: {n_layer: 2, n_head: 2, d_model: 32, attention: {impl: naive}}
data:
  train: {type: packaged, name: kjv, max_docs: 60}
  validation: null
  val_fraction: 0.25
  tokenizer: {vocab_size: 512}
  seq_len: 64
  sequences_per_member: 16
  sequences_per_shard: 64
  num_workers: 1
train:
  micro_batch: 2
  max_steps: 6
  warmup_steps: 1
  log_every: 1
  val_every: 1000
  val_batches: 2
  checkpoint: {every: 2, keep_last: 2}
eval:
  passkey: {length_multipliers: [1], depths: [0.5], trials: 1}
  ppl_length_multipliers: [1, 2]
  ppl_bucket: 32
  ppl_sequences: 2
logging: {wandb_mode: disabled, progress: false}
slurm: {cpus_per_task: 1, rdzv_timeout: 120}
"""


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port > 60000:
            continue
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A running single-node cluster; SLURM_CONF points at it for the whole session."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (SlurmUser=root, munged as user munge)")
    state = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "FPA_SLURM_PORT": str(_free_port_pair()), "FPA_SLURM_CPUS": "8"}
    up = subprocess.run(["bash", str(CLUSTER), "up", str(state)], env=env, capture_output=True, text=True)
    if up.returncode == 3:
        pytest.skip(f"Slurm packages cannot be installed here: {up.stderr.strip().splitlines()[-1]}")
    if up.returncode != 0:
        logs = "".join(p.read_text()[-1500:] for p in sorted((state / "log").glob("slurm*.log")))
        pytest.fail(f"local Slurm cluster did not come up:\n{up.stderr}\n{logs}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state / "etc" / "slurm.conf")
    try:
        yield state
    finally:
        subprocess.run(["bash", str(CLUSTER), "down", str(state)], env=env, capture_output=True)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


# -- helpers -----------------------------------------------------------------------------------------


def job_records(job_id: str) -> list[dict[str, str]]:
    """`scontrol show job` as dicts (one per array element), [] once the job is gone."""
    proc = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    out = []
    for line in proc.stdout.splitlines():
        out.append(dict(re.findall(r"(\w+)=(\S*)", line)))
    return out


def wait_until(
    what: str, predicate, timeout: float, logs: list[Path] = (), job: str | None = None, poll: float = 0.25
):
    """Poll `predicate` until it is true; fail with the job logs on timeout or if `job` ends first."""
    deadline = time.monotonic() + timeout
    problem = f"timed out after {timeout:.0f} s"
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if job is not None and any(r.get("JobState") in TERMINAL for r in job_records(job)):
            problem = f"job {job} ended ({job_records(job)[0].get('JobState')})"
            break
        time.sleep(poll)
    queue = subprocess.run(["squeue"], capture_output=True, text=True).stdout
    pytest.fail(f"{problem} waiting for {what}\n{queue}\n{tails(logs)}")


def tails(logs: list[Path]) -> str:
    """The ends of the given log files, and of the .out/.err files in the given directories."""
    files: list[Path] = []
    for p in logs:
        files += sorted(p.glob("*.out")) + sorted(p.glob("*.err")) if p.is_dir() else [p]
    return "\n".join(f"--- {p}:\n{p.read_text()[-3000:]}" for p in files if p.is_file())


def wait_done(job_id: str, timeout: float, logs: list[Path] = ()) -> list[dict[str, str]]:
    def done():
        recs = job_records(job_id)
        # A job whose dependency failed would pend forever: report it as it is.
        if any(r.get("Reason") == "DependencyNeverSatisfied" for r in recs):
            return recs
        return recs if recs and all(r.get("JobState") in TERMINAL for r in recs) else None

    return wait_until(f"job {job_id} to finish", done, timeout, logs)


def requeued(job_id: str, restarts: int) -> bool:
    rec = (job_records(job_id) or [{}])[0]
    return rec.get("JobState") == "PENDING" and rec.get("Restarts") == str(restarts)


def start_now(job_id: str) -> None:
    """Slurm holds a requeued job for about two minutes (BeginTime); let it start again at once."""
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)


def nodes_idle() -> bool:
    """Every node of the cluster idle: nothing allocated and nothing completing."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True).stdout.split()
    return bool(out) and all(state == "idle" for state in out)


def release_requeued(job_id: str, restarts: int, timeout: float, logs: list[Path] = ()) -> None:
    """Start a requeued job at once, but only after its first attempt has left the node: the job can
    read PENDING while slurmd is still ending that attempt, and restarting the same job id then races the
    cleanup, which can SIGTERM the new attempt's step (Slurm 22.05, seen under load). Slurm's own
    ~2 min hold on a requeued job is what avoids that race outside tests."""
    wait_until(f"job {job_id} to be requeued", lambda: requeued(job_id, restarts), timeout, logs)
    wait_until(f"job {job_id}'s first attempt to leave the node", nodes_idle, timeout, logs)
    start_now(job_id)


def assert_completed(records: list[dict[str, str]], logs: list[Path]) -> None:
    bad = [(r["JobId"], r["JobState"], r.get("Reason")) for r in records if r.get("JobState") != "COMPLETED"]
    if bad:
        pytest.fail(f"jobs not COMPLETED: {bad}\n{tails(logs)}")


@pytest.fixture(scope="module")
def fast_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "fast.yaml"
    path.write_text(FAST_YAML)
    return path


# -- the time-limit signal path, with a probe in place of the trainer -------------------------------

PROBE = r"""
import os, signal, subprocess, sys, time
out, rank = sys.argv[1], os.environ["RANK"]
attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
parent = os.getppid()
def mark(what):
    with open(os.path.join(out, f"{what}.r{rank}.a{attempt}"), "w") as f:
        f.write(os.environ.get("WORLD_SIZE", "?"))
def on_usr1(sig, frame):
    mark("usr1")
    time.sleep(0.5)
    try:  # torchrun (our parent) must have survived the same signal
        os.kill(parent, 0)
        mark("parent_alive")
    except OSError:
        pass
    if rank == "0":  # what the trainer does after its checkpoint
        time.sleep(1.0)
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
    time.sleep(30)
signal.signal(signal.SIGUSR1, on_usr1)
mark("start")
if attempt != "0":
    sys.exit(0)
time.sleep(120)
sys.exit(3)  # the signal never came
"""


@pytest.fixture(scope="module", autouse=True)
def probe_job(cluster: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Submitted before the other tests of this module and checked by the last one: the time-limit
    signal takes up to ~30 s (slurmctld checks limits periodically), so it waits while they run.
    A thread lets the requeued job start again at once instead of after Slurm's two-minute hold."""
    tmp = tmp_path_factory.mktemp("probe")
    pwn = tmp / "PWNED"
    marks = tmp / "marks"
    marks.mkdir()
    probe = tmp / "probe.py"
    probe.write_text(PROBE)
    over = [
        f"runs_dir={tmp / f'runs 50% $(touch {pwn})'}",
        "name=p b'%j",  # a name is one path component: the command substitution lives in runs_dir
        "slurm.tasks_per_node=2",  # two torchrun agents: a two-"node" c10d rendezvous on one machine
        "slurm.nproc_per_node=1",
        "slurm.cpus_per_task=1",
        "slurm.time=1:00",  # one minute ...
        "slurm.signal_seconds=59",  # ... and USR1 59 s before its end
    ]
    cfg = load_config([], over)
    script = sl.render_sbatch(cfg, [], over, "train")
    assert script.count("-m launch.cli train ") == 1
    path = tmp / "train.sbatch"
    path.write_text(script.replace("-m launch.cli train ", f"{probe} {marks} "))  # same launch, probe
    log_dir = cfg.run_dir / "slurm"
    log_dir.mkdir(parents=True)  # sbatch does not create it (launch_slurm does)
    job = sl.sbatch_submit(path)
    info: dict = {
        "job": job,
        "tmp": tmp,
        "marks": marks,
        "logs": [log_dir / f"train-{job}.{e}" for e in ("out", "err")],
    }

    def release() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if requeued(job, 1):
                start_now(job)
                info["released"] = True
                return
            if any(r.get("JobState") in TERMINAL for r in job_records(job)):
                return
            time.sleep(0.25)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    info["thread"] = thread
    yield info
    thread.join(timeout=1)


# -- the real pipeline -------------------------------------------------------------------------------


@pytest.mark.slow
def test_launch_chain_trains_on_two_agents_requeues_resumes_then_evaluates(
    cluster: Path, fast_yaml: Path, tmp_path: Path
) -> None:
    over = [
        f"runs_dir={tmp_path / 'runs'}",
        "name=chain",
        "slurm.tasks_per_node=2",
        "slurm.nproc_per_node=1",
        # Long enough that the preemption lands mid-run even on a quiet machine (a step takes ~15 ms).
        "train.max_steps=400",
        "train.checkpoint.every=20",
    ]
    ids = sl.launch_slurm([str(fast_yaml)], over, dry_run=False)
    prepare, train, evaluate = ids
    run_dir = tmp_path / "runs" / "chain"
    ckpts = run_dir / "checkpoints"

    # Preempt the trainer once it has a checkpoint: the same delivery as the time-limit warning
    # (slurmctld signals every process of the job's steps; the batch shell is left alone).
    # (any complete checkpoint: keep_last prunes the early ones while we poll)
    wait_until("the first checkpoint", lambda: (ckpts / "latest").is_file(), 120, [run_dir / "slurm"], train)
    subprocess.run(["scancel", "--signal=USR1", train], check=True)
    release_requeued(train, 1, 60, [run_dir / "slurm"])
    records = {r: wait_done(r, 150, [run_dir / "slurm"])[0] for r in ids}
    assert_completed(list(records.values()), [run_dir / "slurm"])

    out = (run_dir / "slurm" / f"train-{train}.out").read_text()
    assert "train: 2 agents x 1 workers" in out and ", restart 0" in out and ", restart 1" in out
    m = re.search(r"\[train\] preempted: checkpoint (\S+) written", out)
    assert m, out
    preempted_at = int(re.search(r"global_step(\d+)", m.group(1)).group(1))
    assert 20 <= preempted_at < 400
    assert f"resumed from {m.group(1)} at step {preempted_at}" in out
    assert (ckpts / "latest").read_text().strip() == "global_step400"
    meta = json.loads((ckpts / "global_step400" / "COMPLETE").read_text())
    assert meta["world_size"] == 2
    manifest = json.loads((run_dir / "manifests" / "train.json").read_text())
    assert manifest["status"] == "done" and manifest["result"]["steps"] == 400

    # afterok held eval back through the requeue: it starts only after the second train attempt ended.
    assert records[evaluate]["StartTime"] >= records[train]["EndTime"]
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["run"] == "chain" and isinstance(report["final_val_loss"], float)
    jobcomp = (cluster / "log" / "jobcomp.txt").read_text()
    assert re.search(rf"JobId={train} .*JobState=PENDING", jobcomp)  # the requeued first attempt


@pytest.mark.slow
def test_sweep_array_on_shared_data_then_collect(cluster: Path, fast_yaml: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "mini.yaml"
    sweep.write_text(
        f"""
name: mini
configs: [{fast_yaml}]
overrides:
  runs_dir: {tmp_path / "runs"}
  data.out_dir: {tmp_path / "runs" / "data"}
  slurm.nproc_per_node: 2   # one torchrun agent with two workers per element
  slurm.cpus_per_task: 2
grid:
  model.attention.kind: [fpa, softmax]
"""
    )
    runs = load_sweep(sweep).runs
    ids = run_sweep(sweep, mode="slurm")
    assert len(ids) == 3  # one prepare job for the shared data dir, a training and an eval array
    logs = [tmp_path / "runs" / "sweeps" / "mini" / "slurm"]
    records = [wait_done(i, 150, logs) for i in ids]
    assert_completed([r for recs in records for r in recs], logs)
    train, evals = records[1], records[2]
    assert sorted(r["ArrayTaskId"] for r in train) == sorted(r["ArrayTaskId"] for r in evals) == ["0", "1"]
    # aftercorr: each eval element started after its own training element ended.
    ends = {r["ArrayTaskId"]: r["EndTime"] for r in train}
    assert all(r["StartTime"] >= ends[r["ArrayTaskId"]] for r in evals)

    for run in runs:
        manifest = json.loads((run.run_dir / "manifests" / "train.json").read_text())
        assert manifest["status"] == "done" and manifest["result"]["steps"] == 6
        meta = json.loads((run.run_dir / "checkpoints" / "global_step6" / "COMPLETE").read_text())
        assert meta["world_size"] == 2
        assert not (run.run_dir / "data").exists()  # the shared copy was used
    out = collect_sweep(sweep)
    rows = (out / "result.csv").read_text().splitlines()
    assert [r.split(",")[:2] for r in rows[1:]] == [[runs[0].name, "fpa"], [runs[1].name, "softmax"]]
    for row in rows[1:]:
        cells = row.split(",")
        assert cells[-1] == "ok" and float(cells[2]) > 0  # final_val_loss
    assert "| mini.kind-fpa |" in (out / "result.md").read_text()
    assert (out / "result.png").stat().st_size > 10_000


def test_cluster_script_status_reports_the_daemons(cluster: Path) -> None:
    proc = subprocess.run(["bash", str(CLUSTER), "status", str(cluster)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"slurmctld: running \(pid \d+\)", proc.stdout)
    assert re.search(r"slurmd: running \(pid \d+\)", proc.stdout)
    assert "idle" in proc.stdout or "mix" in proc.stdout or "alloc" in proc.stdout


@pytest.mark.slow
def test_time_limit_usr1_reaches_workers_requeues_and_reruns(probe_job: dict) -> None:
    job, marks, logs = probe_job["job"], probe_job["marks"], probe_job["logs"]
    wait_until("USR1 in both workers", lambda: len(list(marks.glob("usr1.*"))) == 2, 90, logs, job)
    probe_job["thread"].join(timeout=60)
    assert probe_job.get("released"), f"job {job} was not requeued: {job_records(job)}"
    assert_completed(wait_done(job, 60, logs), logs)

    got = sorted(p.name for p in marks.iterdir())
    assert got == [
        "parent_alive.r0.a0",
        "parent_alive.r1.a0",
        "start.r0.a0",
        "start.r0.a1",
        "start.r1.a0",
        "start.r1.a1",
        "usr1.r0.a0",
        "usr1.r1.a0",
    ]
    assert all((marks / n).read_text() == "2" for n in got)  # WORLD_SIZE 2 from the rendezvous
    out = logs[0].read_text()  # appended across the requeue, at the literal hostile path
    assert ", restart 0" in out and ", restart 1" in out, out
    assert not list(probe_job["tmp"].glob("PWNED*"))


@pytest.mark.slow
def test_prepare_as_a_job_array_then_merge_gives_the_one_job_data(
    cluster: Path, fast_yaml: Path, tmp_path: Path
) -> None:
    """data.prepare_parts=3: plan, a 3-task job array and the merge on the real cluster write the same bytes
    as a one-job prepare (the chain's train/eval jobs are checked with stubs in test_data_parts.py)."""
    from data_prep.prepare import prepare_data

    over = [f"runs_dir={tmp_path / 'runs'}", "name=arr", "data.prepare_parts=3"]
    cfg = load_config([str(fast_yaml)], over)
    out = cfg.run_dir.resolve() / "slurm"
    out.mkdir(parents=True)
    jobs = []
    for stem, text, after, kind in sl.prepare_jobs(cfg, [str(fast_yaml)], over, out, "prepare"):
        (out / f"{stem}.sbatch").write_text(text)
        jobs.append((out / f"{stem}.sbatch", after, kind))
    ids = sl.submit_jobs(jobs)
    records = [wait_done(i, 120, [out]) for i in ids]
    assert_completed([r for recs in records for r in recs], [out])
    assert sorted(r["ArrayTaskId"] for r in records[1]) == ["0", "1", "2"]
    assert "prepare part 2 of 3" in (out / f"prepare-part-{ids[1]}_2.out").read_text()
    prepare_data(cfg.data, tmp_path / "one", progress=False)

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    assert files(cfg.data_dir) == files(tmp_path / "one")
    manifest = json.loads((cfg.run_dir / "manifests" / "prepare.json").read_text())
    assert manifest["status"] == "done" and manifest["result"]["parts"] == 3
