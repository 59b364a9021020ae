"""Slurm launching without a cluster: the #SBATCH lines, the srun/torchrun command the scripts really run
(executed under bash with stub srun/scontrol/python that record their argv), quoting of hostile names,
submission chains, sweep expansion, local sweeps and the collected comparison table."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from launch import slurm as sl
from launch.sweep import collect_sweep, format_value, load_sweep, run_sweep
from pipeline.config import ConfigError, load_config
from pipeline.evaluation.report import ppl_curve

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
# A run name is one path component (no '/'), so its commands reach the test's dir through `cd` (HOME).
HOSTILE = "a b$(cd;touch PWNED)`cd;touch PWNED2`;x%j'\"q"

# A stand-in for python: writes its argv (and whether USR1 is ignored in it) as one JSON line.
PY_STUB = """#!/bin/bash
usr1=$(awk '/^SigIgn:/ {{print $2}}' /proc/$$/status)
{py} -c 'import json,sys; print(json.dumps({{"argv": sys.argv[2:], "sigign": sys.argv[1]}}))' "$usr1" "$@" \\
    >> {log}
"""
# srun: record the options, then run the command after them (one "task").
SRUN_STUB = """#!/bin/bash
while [[ "$1" == --* ]]; do echo "$1" >> {log}; shift; done
exec "$@"
"""
# A long node list: a script that pipes it into `head` under pipefail dies of SIGPIPE here.
SCONTROL_STUB = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] && {{ for i in $(seq 1 20000); do echo "node$i"; done; exit 0; }}
echo "scontrol $*" >> {log}
"""


def _exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def stubs(tmp_path: Path) -> dict[str, Path]:
    """bin/ with srun, scontrol and a python stub; logs of what they were called with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    logs = {f"{name}_log": tmp_path / f"{name}.log" for name in ("py", "srun", "scontrol")}
    _exe(bin_dir / "srun", SRUN_STUB.format(log=logs["srun_log"]))
    _exe(bin_dir / "scontrol", SCONTROL_STUB.format(log=logs["scontrol_log"]))
    py = _exe(bin_dir / "py-stub", PY_STUB.format(py=sys.executable, log=logs["py_log"]))
    return {"bin": bin_dir, "py": py, **logs}


def run_script(script: str, stubs: dict[str, Path], tmp: Path, **env: str) -> list[dict]:
    """Run a rendered script under bash with the stubs first on PATH; return the python calls."""
    path = tmp / "job.sh"
    path.write_text(script)
    full = {
        "PATH": f"{stubs['bin']}:/usr/bin:/bin",
        "HOME": str(tmp),
        "USER": "tester",
        "SLURM_JOB_ID": "7",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        **env,
    }
    proc = subprocess.run(["bash", str(path)], env=full, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    if not stubs["py_log"].exists():
        return []
    return [json.loads(line) for line in stubs["py_log"].read_text().splitlines()]


def sbatch_options(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")]


def _usr1_ignored(sigign_hex: str) -> bool:
    return bool(int(sigign_hex, 16) >> (signal.SIGUSR1 - 1) & 1)


# -- rendering ---------------------------------------------------------------------------------------


def test_train_script_sbatch_lines_and_torchrun(tmp_path: Path) -> None:
    over = [
        f"runs_dir={tmp_path}",
        "name=big",
        "slurm.partition=gpu",
        "slurm.account=proj",
        "slurm.qos=high",
        "slurm.nodes=2",
        "slurm.gpus_per_node=4",
        "slurm.cpus_per_task=32",
        "slurm.mem=200G",
        "slurm.time=12:00:00",
        "slurm.signal_seconds=300",
        "slurm.extra_sbatch=[--exclusive]",
        "slurm.env.NCCL_SOCKET_IFNAME=ib0",
    ]
    cfg = load_config([TINY], over)
    script = sl.render_sbatch(cfg, [TINY], over, "train")
    log = tmp_path / "big" / "slurm"
    assert sbatch_options(script) == [
        "--job-name=fpa-train-big",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=32",
        "--gpus-per-node=4",
        "--mem=200G",
        "--time=12:00:00",
        "--partition=gpu",
        "--account=proj",
        "--qos=high",
        f"--output={log}/train-%j.out",
        f"--error={log}/train-%j.err",
        "--open-mode=append",
        f"--chdir={Path.cwd()}",
        "--requeue",
        "--signal=USR1@300",
        "--exclusive",
    ]
    assert "export OMP_NUM_THREADS=8\n" in script  # 32 CPUs over 4 workers
    assert (
        "export NCCL_SOCKET_IFNAME=ib0\n" in script and "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in script
    )
    assert 'export TRITON_CACHE_DIR=/tmp/"${USER:-$(id -un)}"/triton-"${SLURM_JOB_ID}"' in script
    assert "--nproc-per-node=4" in script and "--rdzv-backend=c10d" in script
    commands = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    for launcher in ("ssh", "pdsh", "deepspeed"):
        assert not any(re.search(rf"\b{launcher}\b", line) for line in commands), launcher
    assert f"PY={sys.executable}" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_prepare_and_eval_are_single_process_jobs(tmp_path: Path) -> None:
    over = [f"runs_dir={tmp_path}", "slurm.gpus_per_node=8", "slurm.eval_time=00:30:00"]
    cfg = load_config([TINY], over)
    prep = sbatch_options(sl.render_sbatch(cfg, [TINY], over, "prepare"))
    ev = sbatch_options(sl.render_sbatch(cfg, [TINY], over, "eval"))
    for opts in (prep, ev):
        assert "--nodes=1" in opts and "--ntasks=1" in opts
        assert "--requeue" not in opts and not any(o.startswith("--signal") for o in opts)
    assert "--gpus-per-node=1" in ev and "--time=00:30:00" in ev
    assert "--time=01:00:00" in prep
    with pytest.raises(sl.LaunchError, match="unknown stage 'export'"):
        sl.render_sbatch(cfg, [TINY], over, "export")


@pytest.mark.parametrize("stage", ["prepare", "train", "eval"])
def test_hostile_names_reach_python_verbatim_and_run_nothing(stage: str, stubs, tmp_path: Path) -> None:
    pwn = tmp_path / "PWNED"
    runs = tmp_path / "runs with space $(touch {pwn})"
    name = HOSTILE  # run_script sets HOME to tmp_path
    over = [
        f"name={name}",
        f"runs_dir={runs}".replace("{pwn}", str(pwn)),
        f"slurm.python={stubs['py']}",
        "slurm.tasks_per_node=2",
        "slurm.nproc_per_node=1",
        f"slurm.local_tmp={tmp_path}/local tmp",
    ]
    cfg = load_config([TINY], over)
    script = sl.render_sbatch(cfg, [TINY], over, stage)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    calls = run_script(script, stubs, tmp_path)
    assert not list(tmp_path.glob("PWNED*")), "a command in a name was executed"
    assert len(calls) == 1
    argv = calls[0]["argv"]
    if stage == "train":
        assert argv[:9] == [
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=node1:20007",  # first node of the list; port 20000 + job id
            "--rdzv-id=7",
            "--rdzv-conf=join_timeout=900",
            "--max-restarts=0",
        ]
        assert argv[9:] == ["-m", "launch.cli", "train", TINY, *over, "train.checkpoint.resume=auto"]
        # torchrun must survive Slurm's USR1: it starts with the signal ignored.
        assert _usr1_ignored(calls[0]["sigign"])
        srun_options = stubs["srun_log"].read_text().split()
        assert "--ntasks-per-node=2" in srun_options and "--cpus-per-task=2" in srun_options
        assert (tmp_path / "local tmp" / "tester" / "triton-7").is_dir()
    else:
        assert argv == ["-m", "launch.cli", stage, TINY, *over]
    # #SBATCH lines: sbatch reads shell quoting; % doubled so %j in a name is not expanded.
    out = next(o for o in sbatch_options(script) if o.startswith("--output="))
    assert "%%j" in out and out.endswith(f"/slurm/{stage}-%j.out'")


def test_line_breaks_in_values_are_refused(tmp_path: Path) -> None:
    cfg = load_config([TINY], [f"runs_dir={tmp_path}", "name=x"])
    cfg.name = "two\nlines"
    with pytest.raises(sl.LaunchError, match="line break"):
        sl.render_sbatch(cfg, [TINY], [], "train")


def test_bad_slurm_values_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="slurm.tasks_per_node must be 1 with GPUs"):
        load_config([TINY], ["slurm.gpus_per_node=4", "slurm.tasks_per_node=2"])
    with pytest.raises(ConfigError, match="slurm.extra_sbatch entries"):
        load_config([TINY], ["slurm.extra_sbatch=[exclusive]"])
    with pytest.raises(ConfigError, match="slurm.nodes must be >= 1"):
        load_config([TINY], ["slurm.nodes=0"])
    # The parallel layout is checked at render time, before anything is queued.
    cfg = load_config([TINY], ["parallel.sequence=3", "slurm.nproc_per_node=2"])
    with pytest.raises(ConfigError, match="not divisible by parallel.sequence=3"):
        sl.render_sbatch(cfg, [TINY], [], "train")


# -- submitting --------------------------------------------------------------------------------------

SBATCH_STUB = """#!/bin/bash
echo "$*" >> {log}
n=$(wc -l < {log})
[[ $n -ge {fail_at} ]] && {{ echo "sbatch: error: Batch job submission failed: Invalid qos" >&2; exit 1; }}
echo "$((100 + n));cluster"
"""


def _sbatch_stubs(tmp_path: Path, fail_at: int) -> tuple[Path, Path, Path]:
    bin_dir = tmp_path / "sbin"
    bin_dir.mkdir()
    calls, cancels = tmp_path / "sbatch.log", tmp_path / "scancel.log"
    _exe(bin_dir / "sbatch", SBATCH_STUB.format(log=calls, fail_at=fail_at))
    _exe(bin_dir / "scancel", f'#!/bin/bash\necho "$*" >> {cancels}\n')
    return bin_dir, calls, cancels


def test_launch_slurm_chains_the_stages(tmp_path: Path, monkeypatch) -> None:
    bin_dir, calls, cancels = _sbatch_stubs(tmp_path, fail_at=99)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    ids = sl.launch_slurm([TINY], [f"runs_dir={tmp_path}", "name=r"], dry_run=False)
    out = tmp_path / "r" / "slurm"
    assert ids == ["101", "102", "103"]
    assert calls.read_text().splitlines() == [
        f"--parsable {out}/prepare.sbatch",
        f"--parsable --dependency=afterok:101 {out}/train.sbatch",
        f"--parsable --dependency=afterok:102 {out}/eval.sbatch",
    ]
    assert not cancels.exists()
    record = json.loads((out / "jobs.jsonl").read_text())
    assert record["jobs"] == {"prepare": "101", "train": "102", "eval": "103"}


def test_failed_submission_cancels_the_jobs_already_queued(tmp_path: Path, monkeypatch) -> None:
    bin_dir, calls, cancels = _sbatch_stubs(tmp_path, fail_at=3)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    with pytest.raises(sl.LaunchError, match="sbatch refused .*eval.sbatch: .*Invalid qos"):
        sl.launch_slurm([TINY], [f"runs_dir={tmp_path}", "name=r"], dry_run=False)
    assert cancels.read_text().split() == ["101", "102"]


def test_dry_run_prints_and_needs_no_sbatch(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    over = [f"runs_dir={tmp_path}", "name=r"]
    assert sl.launch_slurm([TINY], over, dry_run=True) == []
    printed = capsys.readouterr().out
    for stage in sl.STAGES:
        script = tmp_path / "r" / "slurm" / f"{stage}.sbatch"
        assert script.read_text() in printed
    with pytest.raises(sl.LaunchError, match="sbatch not found on PATH"):
        sl.launch_slurm([TINY], over, dry_run=False)


# -- sweeps ------------------------------------------------------------------------------------------


def write_sweep(tmp_path: Path, body: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(body.format(tiny=TINY, runs=tmp_path / "runs"))
    return path


SWEEP = """
name: abl
configs: [{tiny}]
overrides:
  runs_dir: {runs}
  data.out_dir: {runs}/data
  train.max_steps: 7
  eval.passkey.depths: [0.0, 0.5]
  logging.tags: ["a: b", "x"]
grid:
  model.attention.kind: [fpa, softmax]
  seed: [1, 2]
max_parallel: 1
"""


def test_sweep_runs_name_overrides_and_dirs(tmp_path: Path) -> None:
    runs = load_sweep(write_sweep(tmp_path, SWEEP)).runs
    assert [r.name for r in runs] == [
        "abl.kind-fpa.seed-1",
        "abl.kind-fpa.seed-2",
        "abl.kind-softmax.seed-1",
        "abl.kind-softmax.seed-2",
    ]
    r = runs[2]
    assert r.index == 2 and r.values == {"model.attention.kind": "softmax", "seed": 1}
    assert r.run_dir == tmp_path / "runs" / "abl.kind-softmax.seed-1"
    assert r.data_dir == tmp_path / "runs" / "data"
    cfg = load_config([TINY], r.overrides)  # the overrides alone rebuild the run's config
    assert (cfg.model.attention.kind, cfg.seed, cfg.logging.group) == ("softmax", 1, "abl")
    assert cfg.train.max_steps == 7 and cfg.eval.passkey.depths == [0.0, 0.5]
    assert cfg.logging.tags == ["a: b", "x"]


@pytest.mark.parametrize(
    "value", ["a: b", "1", "true", "null", " x", "[1]", "plain", 3, 2.5, True, None, [1, "a"]]
)
def test_format_value_round_trips_through_overrides(value) -> None:
    from omegaconf import OmegaConf

    assert OmegaConf.from_dotlist([f"k={format_value(value)}"]).k == value


@pytest.mark.parametrize(
    "body, message",
    [
        ("name: a\nconfigs: [{tiny}]\ngrid: {{seed: [1]}}\nbogus: 1\n", "unknown key 'bogus' in sweep file"),
        ("name: a\nconfigs: [{tiny}]\ngrid: {{}}\n", "'grid' in .* must be a non-empty mapping"),
        ("name: a\nconfigs: [{tiny}]\ngrid: {{seed: []}}\n", "grid key 'seed' .* non-empty list"),
        ("name: a\nconfigs: [{tiny}]\ngrid: {{slurm.nodes: [1, 2]}}\n", "may not vary slurm"),
        ("name: a b\nconfigs: [{tiny}]\ngrid: {{seed: [1]}}\n", "'name' in .* must be letters"),
        (
            "name: a\nconfigs: [{tiny}]\ngrid: {{model.attention.kind: [fpa, rnn]}}\n",
            "run a.kind-rnn: .*kind",
        ),
        ("name: a\nconfigs: [{tiny}]\ngrid: {{train.lrr: [1]}}\n", "unknown config key 'train.lrr'"),
        ("name: a\nconfigs: [{tiny}]\ngrid: {{logging.tags: [[x y], [x_y]]}}\n", "get the same run name"),
        ("name: a\nconfigs: [missing.yaml]\ngrid: {{seed: [1]}}\n", "config file not found"),
    ],
)
def test_bad_sweep_files_are_one_line_errors(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_sweep(write_sweep(tmp_path, body))


def test_local_sweep_prepares_once_then_trains_and_evaluates_each(tmp_path: Path) -> None:
    sweep = write_sweep(tmp_path, SWEEP)
    calls: list[list[str]] = []

    def runner(argv: list[str]) -> int:
        calls.append(argv)
        return 1 if "seed=2" in argv and "model.attention.kind=softmax" in argv else 0

    with pytest.raises(ConfigError, match="1 run.* failed: abl.kind-softmax.seed-2"):
        run_sweep(sweep, mode="local", runner=runner)
    runs = load_sweep(sweep).runs
    assert calls[0] == ["run", "--stages", "prepare", TINY, *runs[0].overrides]  # one shared data dir
    assert calls[1:] == [["run", "--stages", "train,eval", "--nproc", "1", TINY, *r.overrides] for r in runs]
    calls.clear()
    assert run_sweep(sweep, mode="local", runner=lambda argv: calls.append(argv) or 0) == [
        r.name for r in runs
    ]


def test_slurm_sweep_arrays_select_their_runs_overrides(tmp_path: Path, stubs, capsys) -> None:
    # The compute-node python comes from the fixed overrides, like any slurm.* setting.
    body = SWEEP.replace("  train.max_steps: 7", f"  train.max_steps: 7\n  slurm.python: {stubs['py']}")
    sweep = write_sweep(tmp_path, body)
    assert run_sweep(sweep, mode="slurm", dry_run=True) == []
    runs = load_sweep(sweep).runs
    out = tmp_path / "runs" / "sweeps" / "abl" / "slurm"
    assert (out / "runs.tsv").read_text().splitlines() == ["\t".join(r.overrides) for r in runs]
    names = sorted(p.name for p in out.glob("*.sbatch"))
    assert names == ["eval-array.sbatch", "prepare-0.sbatch", "train-array.sbatch"]
    printed = capsys.readouterr().out
    train_script, eval_script = ((out / f"{s}-array.sbatch").read_text() for s in ("train", "eval"))
    assert train_script in printed and eval_script in printed
    opts = sbatch_options(train_script)
    assert "--array=0-3%1" in opts and "--requeue" in opts and "--job-name=fpa-train-abl" in opts
    assert f"--output={out}/train-%A_%a.out" in opts
    opts = sbatch_options(eval_script)
    assert "--array=0-3%1" in opts and "--ntasks=1" in opts and "--requeue" not in opts

    (train,) = run_script(train_script, stubs, tmp_path, SLURM_ARRAY_TASK_ID="2")
    tail = ["-m", "launch.cli", "train", TINY, *runs[2].overrides, "train.checkpoint.resume=auto"]
    assert train["argv"][-len(tail) :] == tail
    stubs["py_log"].unlink()
    (ev,) = run_script(eval_script, stubs, tmp_path, SLURM_ARRAY_TASK_ID="3")
    assert ev["argv"] == ["-m", "launch.cli", "eval", TINY, *runs[3].overrides]


def test_slurm_sweep_submits_prepare_then_train_array_then_eval_array(tmp_path: Path, monkeypatch) -> None:
    bin_dir, calls, cancels = _sbatch_stubs(tmp_path, fail_at=99)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    # Two data dirs (one per sequence length): two prepare jobs, both awaited by training.
    body = SWEEP.replace("  seed: [1, 2]", "  data.seq_len: [64, 128]").replace(
        "{runs}/data", "{runs}/d${{data.seq_len}}"
    )
    sweep = write_sweep(tmp_path, body)
    assert len({r.data_dir for r in load_sweep(sweep).runs}) == 2
    assert run_sweep(sweep, mode="slurm") == ["101", "102", "103", "104"]
    out = tmp_path / "runs" / "sweeps" / "abl" / "slurm"
    assert calls.read_text().splitlines() == [
        f"--parsable {out}/prepare-0.sbatch",
        f"--parsable {out}/prepare-1.sbatch",
        f"--parsable --dependency=afterok:101:102 {out}/train-array.sbatch",
        f"--parsable --dependency=aftercorr:103 {out}/eval-array.sbatch",
    ]
    record = json.loads((out / "jobs.jsonl").read_text())
    assert record["prepare"] == ["101", "102"] and record["eval_array"] == "104"
    assert not cancels.exists()


def test_runs_sharing_a_data_dir_must_share_the_data_settings(tmp_path: Path) -> None:
    sweep = write_sweep(tmp_path, SWEEP.replace("  seed: [1, 2]", "  data.seq_len: [64, 128]"))
    with pytest.raises(ConfigError, match=r"share the data dir .* differ in data.seq_len"):
        load_sweep(sweep)


# -- collecting --------------------------------------------------------------------------------------


def _report(kind: str, loss: float | None, passkey: float, cache: float) -> dict:
    from pipeline.evaluation.report import REPORT_KEYS

    report = dict.fromkeys(REPORT_KEYS)
    report.update(
        schema_version=1,
        run=kind,
        kind=kind,
        seq_len=256,
        n_params=1000,
        checkpoint="x",
        final_val_loss=loss,
        passkey_accuracy=passkey,
        passkey_accuracy_compressed=passkey / 2,
        cache_fraction=cache,
        perplexity={"256": 20.0, "512": 30.0},
        ppl_by_position={
            "256": {"bucket_start": [0, 128], "loss": [3.0, 2.0]},
            "512": {"bucket_start": [0, 256], "loss": [math.log(40.0), math.log(25.0)]},
        },
    )
    return report


def test_collect_sweep_table_csv_plot_and_seed_means(tmp_path: Path) -> None:
    sweep = write_sweep(tmp_path, SWEEP)
    runs = load_sweep(sweep).runs
    figures = [("fpa", 2.0, 1.0, 0.25), ("fpa", 4.0, 0.5, 0.75), ("softmax", 3.0, 0.0, 1.0)]
    for run, fig in zip(runs, figures):
        (run.run_dir / "eval").mkdir(parents=True)
        (run.run_dir / "eval" / "report.json").write_text(json.dumps(_report(*fig)))
    (runs[3].run_dir / "eval").mkdir(parents=True)
    (runs[3].run_dir / "eval" / "report.json").write_text("{not json")
    out = collect_sweep(sweep)
    assert out == tmp_path / "runs" / "sweeps" / "abl"

    rows = (out / "result.csv").read_text().splitlines()
    assert rows[0] == (
        "run,kind,seed,final_val_loss,ppl_train_len,ppl_longest,passkey_accuracy,"
        "passkey_accuracy_compressed,passkey_longest,cache_fraction,status"
    )
    assert rows[1] == "abl.kind-fpa.seed-1,fpa,1,2.0,20.0,30.0,1.0,0.5,,0.25,ok"  # no per-length accuracy
    assert rows[4] == "abl.kind-softmax.seed-2,softmax,2,,,,,,,,unreadable"

    md = (out / "result.md").read_text()
    assert "| abl.kind-softmax.seed-2 | softmax | 2 | - | - | - | - | - | - | - | unreadable |" in md
    # Seeds averaged: fpa loss (2 + 4) / 2 = 3 ± sqrt(2); softmax has one readable seed.
    assert "| fpa | 3 ± 1.4 (n=2) |" in md and "| softmax | 3 (n=1) |" in md
    assert "## Details" in md and "Passkey accuracy by length" not in md  # no per-length data given

    png = (out / "result.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_collect_has_a_loss_column_per_heldout_split(tmp_path: Path) -> None:
    sweep = write_sweep(tmp_path, SWEEP)
    runs = load_sweep(sweep).runs
    for run, (ind, ood) in zip(runs, [(2.0, 5.0), (4.0, 6.0)]):
        rep = _report("fpa", ind, 1.0, 0.5)
        rep["heldout"] = {
            "validation": {"256": {"loss": ind, "loss_se": 0.1, "windows": 8}},
            "wiki": {"256": {"loss": ood, "loss_se": 0.2, "windows": 8}, "512": {"loss": 9.0, "windows": 8}},
        }
        (run.run_dir / "eval").mkdir(parents=True)
        (run.run_dir / "eval" / "report.json").write_text(json.dumps(rep))
    out = collect_sweep(sweep)
    rows = (out / "result.csv").read_text().splitlines()
    assert rows[0].endswith("cache_fraction,loss:validation,loss:wiki,status")
    assert rows[1].endswith(",2.0,5.0,ok") and rows[2].endswith(",4.0,6.0,ok")  # the training length's loss
    assert rows[3].endswith(",,,missing")
    md = (out / "result.md").read_text()
    assert "| fpa | 3 ± 1.4 (n=2) |" in md and "5.5 ± 0.71 (n=2)" in md  # seed means of both splits


def test_collect_says_where_its_figures_came_from(tmp_path: Path) -> None:
    """result.md/json name the collect command, its commit and machine, and the commit each run was
    trained at; --out writes them elsewhere (docs/results/<name>/ for the README)."""
    sweep = write_sweep(tmp_path, SWEEP)
    runs = load_sweep(sweep).runs
    for i, run in enumerate(runs[:2]):
        (run.run_dir / "eval").mkdir(parents=True)
        (run.run_dir / "eval" / "report.json").write_text(json.dumps(_report("fpa", 2.0 + i, 1.0, 0.5)))
        (run.run_dir / "git.json").write_text(json.dumps({"sha": "ab" * 20, "dirty": False}))
    # Run 0 was trained at one commit and re-evaluated at another (git.json holds the last invocation's):
    # its stage manifests say which; run 1 has no manifests, so git.json stands in.
    (runs[0].run_dir / "manifests").mkdir()
    for stage, sha in (("train", "cd"), ("eval", "ef")):
        manifest = {"stage": stage, "status": "done", "git": {"sha": sha * 20, "dirty": False}}
        (runs[0].run_dir / "manifests" / f"{stage}.json").write_text(json.dumps(manifest))
    out = collect_sweep(sweep, out=tmp_path / "docs" / "abl")
    assert out == tmp_path / "docs" / "abl" and not (tmp_path / "runs" / "sweeps" / "abl").exists()
    record = json.loads((out / "result.json").read_text())
    prov = record["provenance"]
    assert prov["command"] == f"fpa sweep {sweep} --collect --out {tmp_path / 'docs' / 'abl'}"
    assert len(prov["commit"]) == 40 and prov["machine"]["cores"] >= 1
    assert record["trained_at"][runs[0].name] == "cd" * 20
    assert record["evaluated_at"][runs[0].name] == "ef" * 20
    assert record["trained_at"][runs[1].name] == "ab" * 20 and record["trained_at"][runs[2].name] is None
    assert [r["final_val_loss"] for r in record["runs"][:2]] == [2.0, 3.0]
    md = (out / "result.md").read_text()
    assert prov["command"] in md and prov["commit"][:10] in md
    assert "trained at commit ababababab, cdcdcdcdcd, evaluated at ababababab, efefefefef." in md


def test_ppl_curve_takes_the_longest_length_in_perplexity() -> None:
    pos, ppl = ppl_curve(_report("fpa", 1.0, 1.0, 1.0)["ppl_by_position"])
    assert pos == [0.0, 256.0] and ppl == pytest.approx([40.0, 25.0])
    assert ppl_curve(None) is None and ppl_curve({"x": 1}) is None
    assert ppl_curve({"64": {"bucket_start": [0, 1], "loss": [None, "a"]}}) is None


def test_collect_with_no_reports_still_writes_everything(tmp_path: Path) -> None:
    out = collect_sweep(write_sweep(tmp_path, SWEEP))
    md = (out / "result.md").read_text()
    assert "4 runs, 0 with an eval report" in md and md.count("| missing |") == 4
    assert "## Details" not in md
    assert (out / "result.png").stat().st_size > 0
    assert re.search(r"abl.kind-fpa.seed-1,fpa,1,,,,,,,,missing", (out / "result.csv").read_text())
    assert os.access(out / "result.csv", os.R_OK)


@pytest.mark.parametrize("name", ["kind", "field"])
def test_shipped_sweeps_expand_and_render(name: str, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # their runs_dir is relative: keep the checkout clean
    path = ROOT / "configs" / "sweeps" / f"{name}.yaml"
    runs = load_sweep(path).runs
    assert len(runs) == 9 and len({r.name for r in runs}) == 9  # 3 kinds or fields x 3 seeds
    assert len({r.data_dir for r in runs}) == 1  # one prepared dataset for the whole comparison
    assert {r.group for r in runs} == {name}
    run_sweep(path, mode="slurm", dry_run=True)
    out = tmp_path / "runs" / "sweeps" / name / "slurm"
    for script in out.glob("*.sbatch"):
        subprocess.run(["bash", "-n", str(script)], check=True)
    assert "--array=0-8" in (out / "train-array.sbatch").read_text()
    capsys.readouterr()


def test_collect_reports_the_passkey_accuracy_at_the_longest_length(tmp_path: Path) -> None:
    """passkey_longest: the full-cache accuracy at the longest length evaluated (8x by default), per run and
    as a mean over seeds, beside the grid mean passkey_accuracy."""
    sweep = write_sweep(tmp_path, SWEEP)
    runs = load_sweep(sweep).runs
    for run, at_8x in zip(runs, [0.32, 1.0]):
        rep = _report("fpa", 2.0, 0.9, 0.5)
        rep["passkey_accuracy_per_length"] = {"256": 1.0, "2048": at_8x, "512": 0.5}
        (run.run_dir / "eval").mkdir(parents=True)
        (run.run_dir / "eval" / "report.json").write_text(json.dumps(rep))
    out = collect_sweep(sweep)
    rows = (out / "result.csv").read_text().splitlines()
    col = rows[0].split(",").index("passkey_longest")
    assert [r.split(",")[col] for r in rows[1:3]] == ["0.32", "1.0"]
    assert "0.66 ± 0.48 (n=2)" in (out / "result.md").read_text()
