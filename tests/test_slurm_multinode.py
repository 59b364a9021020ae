"""Two Slurm nodes on one machine: `local_cluster.sh up --nodes 2` makes each node a network namespace
(own address on a private bridge, own host name, own slurmd), with slurmctld and a private munged on the
host side. The namespaces share the file system: the run directory is the same path on both nodes, as
on a cluster with a shared /home, and only rank 0 writes the manifest, metrics and checkpoint markers.

- the cluster's hosts, and `down` removing exactly the namespaces, links and daemons it made;
- `fpa launch slurm` end to end on 2 nodes: prepare as a 2-task job array (one task per node), training
  with 2 nodes x 2 workers under ZeRO-2 and with sequence parallelism over all 4 ranks (gloo), eval; the
  loss curve equals a one-process run with the same global batch; node names, ranks and the rendezvous
  in the logs and the manifest;
- faults: a node down at submission (the job pends with a reason naming the node, then runs once the
  node is back); a node lost mid-training (the survivors exit, Slurm requeues the job, it resumes from
  the last complete checkpoint and the loss curve equals the uninterrupted run's bit for bit); a stuck
  rank (the job ends after FPA_COLLECTIVE_TIMEOUT); the rendezvous port taken on the head node (a derived
  port moves to a free one, a fixed slurm.rdzv_port fails the job naming the port's holder).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_slurm import (
    CLUSTER,
    FAST_YAML,
    _free_port_pair,
    assert_completed,
    job_records,
    requeued,
    wait_done,
    wait_until,
)

from launch import slurm as sl
from pipeline.config import load_config

pytestmark = [pytest.mark.slurm, pytest.mark.multinode]

ROOT = Path(__file__).resolve().parents[1]
NODES = ["fpanode1", "fpanode2"]
TOL = 2e-5  # fp32: one process vs 4 ranks at the same global batch (tests/test_train.py)
STEPS = 24  # long enough that a node can be lost between two checkpoints (every 4 steps)


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
    text = FAST_YAML.replace("max_steps: 6", f"max_steps: {STEPS}").replace("every: 2,", "every: 4,")
    assert text.count(f"max_steps: {STEPS}") == 1 and text.count("every: 4,") == 1
    path.write_text(text)
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


def reached_step(run_dir: Path) -> int:
    """The last step metrics.jsonl records so far (a line being written is not counted)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            continue
    return max(steps)


def last_curve(run_dir: Path) -> dict[int, float]:
    return {s: v[-1] for s, v in losses(run_dir).items()}


def node_state(name: str) -> str:
    out = subprocess.run(["sinfo", "-h", "-N", "-n", name, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def submit_train(cfg_yaml: Path, over: list[str], *, hold: bool = False) -> tuple[str, Path]:
    cfg = load_config([str(cfg_yaml)], over)
    out = cfg.run_dir.resolve() / "slurm"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "train.sbatch"
    path.write_text(sl.render_sbatch(cfg, [str(cfg_yaml)], over, "train"))
    if not hold:
        return sl.sbatch_submit(path), out
    proc = subprocess.run(["sbatch", "--parsable", "--hold", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0], out


def namespace(state: Path, node: str) -> str:
    return next(f[1] for f in map(str.split, (state / "nodes").read_text().splitlines()) if f[0] == node)


def train_processes(ns: str) -> dict[int, str]:
    """pid -> command line of the training workers in a node's namespace (`launch.cli train` processes
    and their data-loader children; not the torchrun agent that starts them)."""
    out = {}
    for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # exited meanwhile
        if "launch.cli train" in cmd and "torch.distributed.run" not in cmd:
            out[int(pid)] = cmd
    return out


def rank_of(pid: int) -> int | None:
    """The RANK of a training worker started by torchrun (None for a data-loader child)."""
    ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    if b"torch.distributed.run" not in Path(f"/proc/{ppid}/cmdline").read_bytes():
        return None
    env = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
    return int(env[b"RANK"])


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
    assert manifest["status"] == "done" and manifest["result"]["steps"] == STEPS
    meta = json.loads((run_dir / "checkpoints" / f"global_step{STEPS}" / "COMPLETE").read_text())
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
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
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
def test_node_down_at_submission_pends_with_a_reason_then_runs(
    cluster2: dict, chain: dict, fast_yaml: Path
) -> None:
    """fpanode2's slurmd is gone (the node is down, not merely marked: a marked node whose slurmd still
    answers is returned to service by ReturnToService=2) and the node is DOWN before the job is
    submitted: the job pends, naming the node, and runs once the node's slurmd is back."""
    env, state = cluster2["env"], cluster2["dir"]
    killed = _cluster_cmd("kill-node", "fpanode2", str(state), env=env)
    assert killed.returncode == 0, killed.stderr
    try:
        down = ["scontrol", "update", "NodeName=fpanode2", "State=DOWN", "Reason=fpa-test"]
        subprocess.run(down, check=True)  # at once, not after SlurmdTimeout
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
        assert "UnavailableNodes:fpanode2" in rec["Reason"], rec  # says which node it waits for
        time.sleep(3)
        assert job_records(job)[0]["JobState"] == "PENDING"  # waits; it does not start on one node
    finally:
        started = _cluster_cmd("start-node", "fpanode2", str(state), env=env)
    assert started.returncode == 0, started.stderr
    assert_completed(wait_done(job, 180, [logs]), [logs])


@pytest.mark.slow
def test_node_lost_mid_training_is_requeued_and_a_relaunch_resumes_the_same_curve(
    cluster2: dict, chain: dict, fast_yaml: Path
) -> None:
    """SIGKILL to every process of fpanode2 (its slurmd, agent and workers) after the checkpoint of step 8:
    fpanode1's workers exit on the broken connections (they do not hang), Slurm declares the node DOWN
    after SlurmdTimeout and requeues the job; relaunched once the node is back, the run resumes from the
    last complete checkpoint: every replayed step's loss equals the first attempt's and the whole curve
    equals the uninterrupted two-node run's, bit for bit."""
    env, state = cluster2["env"], cluster2["dir"]
    cfg = load_config([str(fast_yaml)], chain["over"])
    over = two_node_overrides(chain["runs"], "lost", f"data.out_dir={cfg.data_dir}", "train.micro_batch=2")
    run_dir = chain["runs"] / "lost"
    job, logs = submit_train(fast_yaml, over)
    marker = run_dir / "checkpoints" / "global_step8" / "COMPLETE"
    wait_until(
        "step 10, after the checkpoint of step 8",
        lambda: marker.exists() and reached_step(run_dir) >= 10,
        180,
        [logs],
        job=job,
        poll=0.02,
    )
    killed = _cluster_cmd("kill-node", "fpanode2", str(state), env=env)
    lost_at = time.monotonic()
    try:
        assert killed.returncode == 0, killed.stderr
        # The survivors do not wait for the lost node: their next collective fails and they exit.
        ns1 = namespace(state, "fpanode1")
        wait_until("fpanode1's workers to exit", lambda: not train_processes(ns1), 60, [logs])
        survivors_s = time.monotonic() - lost_at
        reached = reached_step(run_dir)
        assert reached < STEPS, f"the run finished (step {reached}) before the node was lost"
        wait_until("the job to be requeued", lambda: requeued(job, 1), 120, [logs])
        requeue_s = time.monotonic() - lost_at
        assert node_state("fpanode2") == "down*", node_state("fpanode2")  # *: not responding
        # Relaunched as a new job (the documented `sbatch <run_dir>/slurm/train.sbatch`): restarting
        # the requeued job's own id once the node is back races slurmctld's late cleanup of the first
        # attempt on that node, which can SIGTERM the restarted step there (Slurm 22.05, seen under
        # load) or leave its srun seeing one node.
        subprocess.run(["scancel", job], check=True)
        wait_done(job, 60, [logs])
    finally:
        started = _cluster_cmd("start-node", "fpanode2", str(state), env=env)
    assert started.returncode == 0, started.stderr
    wait_until("fpanode2 to be back", lambda: node_state("fpanode2") == "idle", 90)
    again = sl.sbatch_submit(logs / "train.sbatch")
    assert_completed(wait_done(again, 240, [logs]), [logs])
    print(
        f"node lost at step ~{reached}: survivors gone {survivors_s:.1f} s, requeued {requeue_s:.1f} s after"
    )
    assert survivors_s < 30 and requeue_s < 15 + 45, (survivors_s, requeue_s)  # SlurmdTimeout 15 s

    out = (logs / f"train-{again}.out").read_text()
    resumed = re.search(r"\[train\] resumed from \S+global_step(\d+) at step (\d+)", out)
    assert resumed and resumed.group(1) == resumed.group(2), out
    start = int(resumed.group(1))
    assert 8 <= start <= reached and start % 4 == 0, (start, reached)
    curve = losses(run_dir)
    replayed = sorted(s for s, v in curve.items() if len(v) > 1)
    assert replayed and replayed == list(range(start + 1, reached + 1)), (replayed, start, reached)
    assert all(curve[s][0] == curve[s][1] for s in replayed), {s: curve[s] for s in replayed}
    assert last_curve(run_dir) == last_curve(chain["run_dir"])  # same world size and data order


@pytest.mark.slow
def test_a_stuck_rank_ends_the_job_after_the_collective_timeout(
    cluster2: dict, chain: dict, fast_yaml: Path
) -> None:
    """SIGSTOP to rank 3 on fpanode2 (its node and slurmd stay healthy, no connection breaks): the other
    ranks' next collective times out after FPA_COLLECTIVE_TIMEOUT (5 s here), they raise, torchrun and
    `srun --kill-on-bad-exit` end the step, and the job fails within the timeout plus teardown."""
    state = cluster2["dir"]
    cfg = load_config([str(fast_yaml)], chain["over"])
    over = two_node_overrides(
        chain["runs"],
        "stuck",
        f"data.out_dir={cfg.data_dir}",
        "train.max_steps=1000",
        "train.checkpoint.every=10000",
        "slurm.env.FPA_COLLECTIVE_TIMEOUT=5",
    )
    run_dir = chain["runs"] / "stuck"
    job, logs = submit_train(fast_yaml, over)
    wait_until(
        "step 3",
        lambda: reached_step(run_dir) >= 3,
        180,
        [logs],
        job=job,
        poll=0.05,
    )
    ns2 = namespace(state, "fpanode2")
    stuck = next(pid for pid in train_processes(ns2) if rank_of(pid) == 3)
    os.kill(stuck, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        recs = wait_done(job, 120, [logs])
        ended_s = time.monotonic() - stopped_at
    finally:
        if Path(f"/proc/{stuck}").exists():
            os.kill(stuck, signal.SIGKILL)
    assert recs[0]["JobState"] == "FAILED", recs
    err = (logs / f"train-{job}.err").read_text()
    assert re.search(r"[Tt]imed out|timeout", err), err[-3000:]
    print(f"rank 3 stopped: job ended {ended_s:.1f} s later (collective timeout 5 s)")
    assert 5 <= ended_s < 5 + 60, ended_s
    for node in NODES:  # nothing of the job is left on either node
        wait_until(f"{node} to be clean", lambda n=node: not train_processes(namespace(state, n)), 30)


@pytest.mark.slow
def test_rendezvous_port_taken_on_the_head_node(cluster2: dict, chain: dict, fast_yaml: Path) -> None:
    """A stranger listens on the job's derived port on fpanode1: the batch script moves the rendezvous to
    the next free port and the job completes; with that port fixed (slurm.rdzv_port) the job fails at once
    with the port and the stranger's pid in its error, instead of hanging at the rendezvous."""
    state = cluster2["dir"]
    cfg = load_config([str(fast_yaml)], chain["over"])
    over = two_node_overrides(chain["runs"], "port", f"data.out_dir={cfg.data_dir}", "train.max_steps=2")
    job, logs = submit_train(fast_yaml, over, hold=True)
    port = 20000 + int(job) % 20000  # launch/slurm.py: the derived port of restart 0
    code = (
        "import socket, sys, time\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('0.0.0.0', {port})); s.listen(8); print('listening', flush=True); time.sleep(600)\n"
    )
    stranger = subprocess.Popen(
        ["ip", "netns", "exec", namespace(state, "fpanode1"), sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stranger.stdout.readline().strip() == "listening"
        subprocess.run(["scontrol", "release", job], check=True)
        assert_completed(wait_done(job, 180, [logs]), [logs])
        err = (logs / f"train-{job}.err").read_text()
        moved = re.search(
            rf"fpa: rendezvous port {port} on fpanode1 is in use by pid (\d+) .*"
            r"; the rendezvous moves to (\d+)",
            err,
        )
        assert moved and int(moved.group(1)) == stranger.pid, err[-2000:]
        assert f"rendezvous fpanode1:{moved.group(2)}," in (logs / f"train-{job}.out").read_text()

        fixed = two_node_overrides(
            chain["runs"],
            "portfixed",
            f"data.out_dir={cfg.data_dir}",
            "train.max_steps=2",
            f"slurm.rdzv_port={port}",
        )
        job2, logs2 = submit_train(fast_yaml, fixed)
        t0 = time.monotonic()
        recs = wait_done(job2, 60, [logs2])
        assert recs[0]["JobState"] == "FAILED" and time.monotonic() - t0 < 30, recs
        err2 = (logs2 / f"train-{job2}.err").read_text()
        assert f"fpa: error: rendezvous port {port} on fpanode1 is in use by pid {stranger.pid} (" in err2, (
            err2
        )
        assert not (chain["runs"] / "portfixed" / "metrics.jsonl").exists()  # nothing started
    finally:
        stranger.kill()
        stranger.wait()
