"""Two Slurm nodes on one machine: `local_cluster.sh up --nodes 2` makes each node a network namespace
(own address on a private bridge, own host name, own slurmd), with slurmctld and a private munged on the
host side. The namespaces share the file system: the run directory is the same path on both nodes, as
on a cluster with a shared /home, and only rank 0 writes the manifest, metrics and checkpoint markers.

- the cluster's hosts, and `down` removing exactly the namespaces, links and daemons it made;
- `fpa launch slurm` end to end on 2 nodes: prepare as a 2-task job array (one task per node), training
  with 2 nodes x 2 workers under ZeRO-2 and with sequence parallelism over all 4 ranks (gloo), eval; the
  loss curve equals a one-process run with the same global batch; node names, ranks and the rendezvous
  in the logs and the manifest;
- faults: a node lost mid-training (the surviving node's workers end within a stated time), the job
  relaunched resumes from the last complete checkpoint with the same losses bit for bit; a node down at
  submission (the job pends with a reason, then runs once the node is back); the rendezvous port taken.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_slurm import (
    CLUSTER,
    FAST_YAML,
    TERMINAL,
    _free_port_pair,
    assert_completed,
    job_records,
    tails,
    wait_done,
    wait_until,
)

from launch import slurm as sl
from pipeline.config import load_config

pytestmark = [pytest.mark.slurm, pytest.mark.multinode]

ROOT = Path(__file__).resolve().parents[1]
# Holds a port on the first node, as a stray server would.
SQUAT = (
    "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen(); "
    "print('ok', flush=True); time.sleep(300)"
)
NODES = ["fpanode1", "fpanode2"]
# A lost node: the surviving workers see the connection reset (or, at worst, FPA_COLLECTIVE_TIMEOUT)
# and the job must be over within this many seconds of the loss.
LOST_NODE_DEADLINE = 90
TOL = 2e-5  # fp32: one process vs 4 ranks at the same global batch (tests/test_train.py)


def _cluster_cmd(cmd: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), cmd, *args], env=env, capture_output=True, text=True)


def _up(state: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "FPA_SLURM_PORT": str(_free_port_pair()),
        "FPA_SLURM_CPUS": "2",  # 2 CPUs per node: a 2-CPU prepare part fills a node, so parts spread
        "FPA_SLURM_NODE_TIMEOUT": "15",
    }
    up = _cluster_cmd("up", "--nodes", "2", str(state), env=env)
    if up.returncode == 3:
        _cluster_cmd("down", str(state), env=env)
        pytest.skip(f"Slurm or iproute2 cannot be installed here: {up.stderr.strip().splitlines()[-1]}")
    if up.returncode != 0:
        logs = "".join(p.read_text()[-1500:] for p in sorted((state / "log").glob("slurm*.log")))
        _cluster_cmd("down", str(state), env=env)
        pytest.fail(f"two-node cluster did not come up:\n{up.stderr}\n{logs}")
    return env


@pytest.fixture(scope="module")
def cluster2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A running two-node cluster; SLURM_CONF points at it while this module runs."""
    if os.geteuid() != 0:
        pytest.skip("the two-node cluster needs root (network namespaces, SlurmUser=root)")
    state = tmp_path_factory.mktemp("slurm2")
    env = _up(state)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state / "etc" / "slurm.conf")
    try:
        yield {"dir": state, "env": env}
    finally:
        _cluster_cmd("down", str(state), env=env)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


@pytest.fixture(scope="module")
def fast_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cfg2") / "fast.yaml"
    path.write_text(FAST_YAML)
    return path


def two_node_overrides(runs: Path, name: str, *extra: str) -> list[str]:
    return [
        f"runs_dir={runs}",
        f"name={name}",
        "slurm.nodes=2",
        "slurm.tasks_per_node=1",
        "slurm.nproc_per_node=2",
        "slurm.cpus_per_task=2",
        "train.zero_stage=2",
        *extra,
    ]


def losses(run_dir: Path) -> dict[int, list[float]]:
    """step -> every loss metrics.jsonl holds for it (a resumed run writes its replayed steps again)."""
    out: dict[int, list[float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out.setdefault(rec["step"], []).append(rec["loss"])
    return out


def last_curve(run_dir: Path) -> dict[int, float]:
    return {s: v[-1] for s, v in losses(run_dir).items()}


def node_state(name: str) -> str:
    out = subprocess.run(["sinfo", "-h", "-N", "-n", name, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def submit_train(cfg_yaml: Path, over: list[str]) -> tuple[str, Path]:
    cfg = load_config([str(cfg_yaml)], over)
    out = cfg.run_dir.resolve() / "slurm"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "train.sbatch"
    path.write_text(sl.render_sbatch(cfg, [str(cfg_yaml)], over, "train"))
    return sl.sbatch_submit(path), out


# -- the cluster itself ------------------------------------------------------------------------------


def test_two_node_cluster_has_its_hosts_and_down_removes_exactly_what_it_made(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    state = tmp_path / "c"
    env = _up(state)
    try:
        conf = {**env, "SLURM_CONF": str(state / "etc" / "slurm.conf")}
        nodes = [line.split() for line in (state / "nodes").read_text().splitlines()]
        assert [n[0] for n in nodes] == NODES
        proc = subprocess.run(
            ["srun", "-N2", "-n2", "-l", "bash", "-c", "echo $(hostname) $(getent hosts fpanode2)"],
            env=conf,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        lines = sorted(proc.stdout.split("\n")[:2])
        addr2 = nodes[1][2]
        assert lines == [f"0: fpanode1 {addr2} fpanode2", f"1: fpanode2 {addr2} fpanode2"], proc.stdout
        namespaces = [n[1] for n in nodes]
        assert set(namespaces) <= set(
            subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        )
        pids = {p.name: int(p.read_text()) for p in (state / "pids").glob("*.pid")}
        assert set(pids) == {"munged.pid", "slurmctld.pid", "slurmd-fpanode1.pid", "slurmd-fpanode2.pid"}
        made = (state / "created").read_text().split()
    finally:
        down = _cluster_cmd("down", str(state), env=env)
    assert down.returncode == 0, down.stderr
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    for kind, what in zip(made[::2], made[1::2]):
        if kind == "netns":
            assert what not in listed
        elif kind == "link":
            assert f" {what}:" not in links and f" {what}@" not in links
        else:
            assert not Path(what).exists()
    for name, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists(), f"{name} {pid} still runs"


# -- a two-node run end to end -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def chain(cluster2: dict, fast_yaml: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """prepare (2-part array) -> train (2 nodes x 2 workers, ZeRO-2) -> eval, through launch_slurm."""
    runs = tmp_path_factory.mktemp("runs2")
    over = two_node_overrides(runs, "two", "data.prepare_parts=2", "train.micro_batch=2")
    ids = sl.launch_slurm([str(fast_yaml)], over, dry_run=False)
    logs = [runs / "two" / "slurm"]
    records = {i: wait_done(i, 240, logs) for i in ids}
    assert_completed([r for recs in records.values() for r in recs], logs)
    return {"ids": ids, "runs": runs, "run_dir": runs / "two", "records": records, "over": over}


def one_process_curve(fast_yaml: Path, data_dir: Path, runs: Path, name: str, *extra: str) -> dict:
    """The same run as one local process (no Slurm), global batch micro 2 x accum 4 = 8."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "launch.cli", "train", str(fast_yaml), f"runs_dir={runs}", f"name={name}"]
    cmd += [f"data.out_dir={data_dir}", "train.micro_batch=2", "train.grad_accum=4", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return last_curve(runs / name)


@pytest.mark.slow
def test_two_node_chain_prepares_on_both_nodes_trains_zero2_and_evaluates(
    chain: dict, fast_yaml: Path
) -> None:
    prepare_plan, part, merge, train, evaluate = chain["ids"]
    run_dir: Path = chain["run_dir"]
    slurm_dir = run_dir / "slurm"
    # The array's two parts ran one on each node (each part asks for a whole 2-CPU node).
    part_hosts = sorted(
        re.search(
            r"prepare part \d of 2 on (\S+)", (slurm_dir / f"prepare-part-{part}_{i}.out").read_text()
        ).group(1)
        for i in (0, 1)
    )
    assert part_hosts == NODES
    out = (slurm_dir / f"train-{train}.out").read_text()
    assert "train: 2 agents x 2 workers, rendezvous fpanode1:" in out, out
    assert "[train] 4 ranks: 0-1 on fpanode1, 2-3 on fpanode2; master fpanode1:" in out, out
    manifest = json.loads((run_dir / "manifests" / "train.json").read_text())
    layout = manifest["result"]["distributed"]
    assert layout["hosts"] == ["fpanode1", "fpanode1", "fpanode2", "fpanode2"]
    assert layout["world_size"] == 4 and layout["run_id"] == train
    assert manifest["status"] == "done" and manifest["result"]["steps"] == 6
    meta = json.loads((run_dir / "checkpoints" / "global_step6" / "COMPLETE").read_text())
    assert meta["world_size"] == 4
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["run"] == "two" and isinstance(report["final_val_loss"], float)

    # Only rank 0 writes what rank 0 owns: one record per step, one manifest, no per-rank copies.
    assert all(len(v) == 1 for v in losses(run_dir).values()), losses(run_dir)
    assert sorted(p.name for p in (run_dir / "manifests").iterdir()) == [
        "eval.json",
        "prepare.json",
        "train.json",
    ]

    # The same global batch in one process: the same curve.
    cfg = load_config([str(fast_yaml)], chain["over"])
    one = one_process_curve(fast_yaml, cfg.data_dir, chain["runs"], "one", "train.zero_stage=2")
    two = last_curve(run_dir)
    assert sorted(two) == sorted(one) == list(range(1, 7))
    for s in one:
        assert abs(one[s] - two[s]) <= TOL * max(1.0, abs(one[s])), (s, one[s], two[s])
    chain["one"] = one


@pytest.mark.slow
def test_sequence_parallel_across_the_two_nodes_matches_one_process(chain: dict, fast_yaml: Path) -> None:
    """parallel.sequence=4: every sequence is split over the 4 ranks of both nodes (ring, gloo); micro 2
    x accum 4 keeps the global batch at 8 and the curve equals the one-process run's."""
    cfg = load_config([str(fast_yaml)], chain["over"])
    over = two_node_overrides(
        chain["runs"],
        "sp",
        f"data.out_dir={cfg.data_dir}",
        "parallel.sequence=4",
        "train.micro_batch=2",
        "train.grad_accum=4",
    )
    job, logs = submit_train(fast_yaml, over)
    assert_completed(wait_done(job, 240, [logs]), [logs])
    assert "[train] 4 ranks: 0-1 on fpanode1, 2-3 on fpanode2" in (logs / f"train-{job}.out").read_text()
    one = chain.get("one") or one_process_curve(fast_yaml, cfg.data_dir, chain["runs"], "one-sp")
    got = last_curve(chain["runs"] / "sp")
    assert sorted(got) == sorted(one)
    for s in one:
        assert abs(one[s] - got[s]) <= 5e-5 * max(1.0, abs(one[s])), (s, one[s], got[s])


# -- faults ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_node_lost_mid_training_ends_the_job_then_a_relaunch_resumes_the_same_curve(
    cluster2: dict, chain: dict, fast_yaml: Path
) -> None:
    env, state = cluster2["env"], cluster2["dir"]
    cfg = load_config([str(fast_yaml)], chain["over"])
    over = two_node_overrides(
        chain["runs"],
        "lost",
        f"data.out_dir={cfg.data_dir}",
        "train.max_steps=300",
        "train.checkpoint.every=20",
        "train.checkpoint.keep_last=2",
        "slurm.env.FPA_COLLECTIVE_TIMEOUT=60",
        "slurm.env.PYTHONUNBUFFERED=1",
    )
    job, logs = submit_train(fast_yaml, over)
    run_dir = chain["runs"] / "lost"
    ckpts = run_dir / "checkpoints"
    wait_until("a checkpoint", lambda: (ckpts / "latest").is_file(), 180, [logs], job)
    wait_until("steps past it", lambda: max(losses(run_dir), default=0) >= 30, 60, [logs], job)
    lost_at = time.monotonic()
    kill = _cluster_cmd("kill-node", "fpanode2", str(state), env=env)
    assert kill.returncode == 0, kill.stderr

    def ended():
        recs = job_records(job)
        return recs if recs and recs[0].get("JobState") in TERMINAL | {"PENDING"} else None

    recs = wait_until("the job to end after the node loss", ended, LOST_NODE_DEADLINE, [logs])
    took = time.monotonic() - lost_at
    assert recs[0]["JobState"] != "COMPLETED", recs
    assert took < LOST_NODE_DEADLINE
    # Bring the node back; Slurm either requeued the job (NODE_FAIL on a --requeue job) or it failed and
    # we relaunch the same script: train.checkpoint.resume=auto continues from the last checkpoint.
    up = _cluster_cmd("start-node", "fpanode2", str(state), env=env)
    assert up.returncode == 0, up.stderr
    wait_until(
        "fpanode2 back", lambda: node_state("fpanode2").startswith(("idle", "mix", "alloc")), 60, [logs]
    )
    wait_until(
        "the first attempt to end", lambda: (job_records(job) or [{}])[0].get("JobState") != "COMPLETING", 60
    )
    state_now = (job_records(job) or [{}])[0].get("JobState")
    if state_now == "PENDING":
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
        final = job
    else:
        final = sl.sbatch_submit(logs / "train.sbatch")
    assert_completed(wait_done(final, 240, [logs]), [logs])
    out = "".join(p.read_text() for p in sorted(logs.glob("train-*.out")))
    m = re.search(r"resumed from \S+global_step(\d+) at step (\d+)", out)
    assert m, tails([logs])
    resumed_at = int(m.group(2))
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, 301))
    replayed = [s for s, v in curve.items() if len(v) > 1]
    assert replayed and min(replayed) == resumed_at + 1, (resumed_at, replayed[:5])
    for s in replayed:  # steps computed before the loss and again after the resume: bit for bit
        assert len(set(curve[s])) == 1, (s, curve[s])
    meta = json.loads((ckpts / "global_step300" / "COMPLETE").read_text())
    assert meta["world_size"] == 4
    print(f"node lost: job ended {took:.1f} s after the loss; resumed at step {resumed_at}")


@pytest.mark.slow
def test_node_down_at_submission_pends_with_a_reason_then_runs(
    cluster2: dict, chain: dict, fast_yaml: Path
) -> None:
    env, state = cluster2["env"], cluster2["dir"]
    subprocess.run(["scontrol", "update", "NodeName=fpanode2", "State=DOWN", "Reason=fpa-test"], check=True)
    try:
        cfg = load_config([str(fast_yaml)], chain["over"])
        over = two_node_overrides(
            chain["runs"], "downsub", f"data.out_dir={cfg.data_dir}", "train.max_steps=2"
        )
        job, logs = submit_train(fast_yaml, over)
        rec = wait_until(
            "the job to pend with a reason",
            lambda: next(
                (
                    r
                    for r in job_records(job)
                    if r.get("JobState") == "PENDING" and r.get("Reason") not in ("None", None)
                ),
                None,
            ),
            30,
            [logs],
        )
        assert rec["Reason"] in (
            "Resources",
            "ReqNodeNotAvail",
            "Nodes_required_for_job_are_DOWN,_DRAINED_or_reserved_for_jobs_in_higher_priority_partitions",
        ), rec
        time.sleep(3)
        assert job_records(job)[0]["JobState"] == "PENDING"  # waits; it does not start on one node
    finally:
        subprocess.run(["scontrol", "update", "NodeName=fpanode2", "State=RESUME"], check=True)
    assert_completed(wait_done(job, 180, [logs]), [logs])
    del env, state


@pytest.mark.slow
def test_rendezvous_port_taken_fails_with_a_clear_reason(
    cluster2: dict, chain: dict, fast_yaml: Path
) -> None:
    """Something else listens on slurm.rdzv_port on the first node: the job fails, saying so, in time."""
    state = cluster2["dir"]
    ns1 = (state / "nodes").read_text().split("\n")[0].split()[1]
    port = _free_port_pair()
    squatter = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            ns1,
            sys.executable,
            "-c",
            SQUAT.format(port=port),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert squatter.stdout.readline().strip() == "ok"
        cfg = load_config([str(fast_yaml)], chain["over"])
        over = two_node_overrides(
            chain["runs"],
            "port",
            f"data.out_dir={cfg.data_dir}",
            "train.max_steps=2",
            f"slurm.rdzv_port={port}",
            "slurm.rdzv_timeout=30",
        )
        start = time.monotonic()
        job, logs = submit_train(fast_yaml, over)
        recs = wait_done(job, 150, [logs])
        took = time.monotonic() - start
    finally:
        squatter.kill()
        squatter.wait()
    assert recs[0]["JobState"] == "FAILED", recs
    err = "".join(p.read_text() for p in logs.glob("train-*.err")) + "".join(
        p.read_text() for p in logs.glob("train-*.out")
    )
    assert re.search(r"address already in use|EADDRINUSE|port .* in use", err, re.I), err[-3000:]
    assert took < 150
    print(f"rendezvous port taken: job failed after {took:.1f} s")
