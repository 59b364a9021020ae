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
  node is back).
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
    _free_port_pair,
    assert_completed,
    job_records,
    wait_done,
    wait_until,
)

from launch import slurm as sl
from pipeline.config import load_config

pytestmark = [pytest.mark.slurm, pytest.mark.multinode]

ROOT = Path(__file__).resolve().parents[1]
NODES = ["fpanode1", "fpanode2"]
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
        assert "UnavailableNodes:fpanode2" in rec["Reason"], rec  # says which node it waits for
        time.sleep(3)
        assert job_records(job)[0]["JobState"] == "PENDING"  # waits; it does not start on one node
    finally:
        subprocess.run(["scontrol", "update", "NodeName=fpanode2", "State=RESUME"], check=True)
    assert_completed(wait_done(job, 180, [logs]), [logs])
    del env, state
