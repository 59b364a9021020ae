"""Slurm launching: sbatch scripts for the prepare, train and eval stages of a run, chained by dependencies.

    fpa launch slurm CONFIG... [key=value ...] [--dry-run]

writes <run_dir>/slurm/{prepare,train,eval}.sbatch and submits them as three jobs: train starts after
prepare succeeded, eval after train succeeded. With data.prepare_parts = N > 1, prepare is three jobs
instead: prepare-plan (tokenizer, document counts), prepare-part (a job array of N one-node tasks, each
tokenizing its slice of every source, after the plan) and prepare-merge (after every part ended,
whatever their exit: it names a part that failed or is missing), which writes the data and index.json;
train starts after the merge succeeded. The data is byte-identical to a one-job prepare. The train job
runs srun + torchrun (c10d rendezvous, no ssh), is requeueable, gets USR1 `slurm.signal_seconds`
before its time limit (the trainer then saves a checkpoint and requeues itself), and always passes
train.checkpoint.resume=auto so a requeued job continues where it stopped. Logs:
<run_dir>/slurm/<stage>-<job id>.{out,err}, appended across requeues.

Every value that reaches the shell (paths, names, overrides) is quoted with shlex.quote; the scripts are
templates under launch/templates/ filled by plain substitution.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pipeline.config import ConfigError, RunConfig, derive, load_config
from pipeline.stages import STAGES

TEMPLATES = Path(__file__).resolve().parent / "templates"
REPO_ROOT = Path(__file__).resolve().parents[1]


class LaunchError(ConfigError):
    """A launch problem (bad value for the scheduler, sbatch missing or refusing); reported as one line."""


# -- small helpers -----------------------------------------------------------------------------------


def q(value: object) -> str:
    """Shell-quote one value (sbatch parses the same quoting in #SBATCH lines)."""
    return shlex.quote(str(value))


def _one_line(value: str, what: str) -> str:
    # sbatch reads its options line by line and a newline inside a comment would end it: refuse.
    if "\n" in value or "\r" in value or "\0" in value:
        raise LaunchError(f"{what} contains a line break or NUL: {value!r}")
    return value


def _job_name(cfg: RunConfig, stage: str) -> str:
    # Job names only label squeue lines: keep them to safe characters instead of quoting them.
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"fpa-{stage}-{cfg.name}")[:120]


def _log_pattern(log_dir: Path, stem: str) -> str:
    # sbatch expands %j etc. in --output/--error; a literal % in the user's path must be doubled.
    return str(log_dir).replace("%", "%%") + "/" + stem


def template(name: str) -> str:
    return (TEMPLATES / name).read_text()


def fill(text: str, values: dict[str, str]) -> str:
    """Replace {{KEY}} placeholders; every placeholder must be known and used."""
    for key, val in values.items():
        text = text.replace("{{" + key + "}}", val)
    left = re.findall(r"{{([A-Z_]+)}}", text)
    if left:
        raise LaunchError(f"template placeholder(s) without a value: {', '.join(sorted(set(left)))}")
    return text


def workers_per_task(cfg: RunConfig) -> int:
    """Training processes each torchrun agent starts: one per GPU, else slurm.nproc_per_node."""
    return cfg.slurm.gpus_per_node or cfg.slurm.nproc_per_node


def world_size(cfg: RunConfig) -> int:
    s = cfg.slurm
    return s.nodes * s.tasks_per_node * workers_per_task(cfg)


# -- rendering ---------------------------------------------------------------------------------------


def sbatch_lines(
    cfg: RunConfig,
    stage: str,
    log_dir: Path,
    *,
    log_stem: str | None = None,
    array: str | None = None,
    job: str | None = None,
) -> list[str]:
    """The #SBATCH header of a stage's job (job: its name in place of the stage's, e.g. prepare-part).
    prepare and eval are one process on one node (one GPU if the run uses GPUs; prepare steps and parts
    too); train gets the full allocation, --requeue and the USR1 warning signal."""
    s = cfg.slurm
    train = stage == "train"
    opts: list[tuple[str, object]] = [("job-name", _job_name(cfg, job or stage))]
    if train:
        opts += [("nodes", s.nodes), ("ntasks-per-node", s.tasks_per_node)]
    else:
        opts += [("nodes", 1), ("ntasks", 1)]
    opts.append(("cpus-per-task", s.cpus_per_task))
    if s.gpus_per_node:
        opts.append(("gpus-per-node", s.gpus_per_node if train else 1))
    if s.mem:
        opts.append(("mem", s.mem))
    opts.append(("time", {"prepare": s.prepare_time, "eval": s.eval_time}.get(stage, s.time)))
    for key in ("partition", "account", "qos"):
        if getattr(s, key):
            opts.append((key, getattr(s, key)))
    if array:
        opts.append(("array", array))
    stem = log_stem or f"{stage}-%j"
    opts += [
        ("output", _log_pattern(log_dir, f"{stem}.out")),
        ("error", _log_pattern(log_dir, f"{stem}.err")),
        ("open-mode", "append"),  # a requeued job adds to its log instead of truncating it
        ("chdir", Path.cwd()),  # relative paths in the config mean what they meant at submission
    ]
    lines = [f"#SBATCH --{k}={q(_one_line(str(v), f'slurm option --{k}'))}" for k, v in opts]
    if train:
        lines += ["#SBATCH --requeue", f"#SBATCH --signal=USR1@{s.signal_seconds}"]
    lines += [f"#SBATCH {_one_line(o, 'slurm.extra_sbatch')}" for o in s.extra_sbatch]
    return lines


def preamble(cfg: RunConfig, config_paths: Sequence[str | Path], omp_threads: int) -> str:
    """Environment (site setup, PYTHONPATH, threads, slurm.env, Triton cache) and $PY, CONFIGS."""
    s = cfg.slurm
    exports = [f"export {k}={q(_one_line(v, f'slurm.env.{k}'))}" for k, v in sorted(s.env.items())]
    return fill(
        template("preamble.sh"),
        {
            "ENV_SETUP": s.env_setup.strip() or "# (none)",  # the user's own shell lines, verbatim
            "REPO_ROOT": q(REPO_ROOT),
            "OMP_THREADS": str(max(1, omp_threads)),
            "ENV_EXPORTS": "\n".join(exports) or "# (none)",
            "LOCAL_TMP": q(s.local_tmp),
            "PYTHON": q(s.python or sys.executable),
            "CONFIGS": " ".join(q(Path(p).resolve()) for p in config_paths),
        },
    ).rstrip("\n")


def stage_command(cfg: RunConfig, stage: str, prepare_step: str | None = None) -> str:
    """The lines that run a stage (using $PY, CONFIGS and OVERRIDES). Training: one torchrun agent per
    Slurm task, meeting at a c10d rendezvous on the first node. prepare_step: one step of a prepare in
    parts (plan | part | merge), the part's index coming from SLURM_ARRAY_TASK_ID."""
    if stage == "prepare":
        n = cfg.data.prepare_parts
        label = {
            None: "",
            "plan": f" plan ({n} parts)",
            "part": f" part ${{SLURM_ARRAY_TASK_ID}} of {n}",
            "merge": f" merge ({n} parts)",
        }[prepare_step]
        args = f" --step {prepare_step}" if prepare_step else ""
        return fill(template("prepare.sh"), {"STEP_LABEL": label, "STEP_ARGS": args}).rstrip("\n")
    if stage != "train":
        return template(f"{stage}.sh").rstrip("\n")
    s = cfg.slurm
    # A requeued job keeps its id: shift the derived port per restart, so the new rendezvous never races
    # the previous attempt's store for a port that is still being released.
    derived = "$((20000 + (SLURM_JOB_ID + 997 * ${SLURM_RESTART_COUNT:-0}) % 20000))"
    port = str(s.rdzv_port) if s.rdzv_port else derived
    return fill(
        template("torchrun.sh"),
        {
            "RDZV_PORT": port,
            "RDZV_FIXED": " --fixed" if s.rdzv_port else "",
            "NPROC": str(workers_per_task(cfg)),
            "TASKS_PER_NODE": str(s.tasks_per_node),
            "CPUS_PER_TASK": str(s.cpus_per_task),
            "RDZV_TIMEOUT": str(s.rdzv_timeout),
        },
    ).rstrip("\n")


def render_job(
    cfg: RunConfig,
    config_paths: Sequence[str | Path],
    stage: str,
    select: str,
    *,
    log_dir: Path,
    log_stem: str | None = None,
    array: str | None = None,
    origin: str,
    prepare_step: str | None = None,
) -> str:
    """A whole sbatch script: header, preamble, `select` (the lines that set OVERRIDES), the stage."""
    if stage not in STAGES:
        raise LaunchError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
    if stage == "train":
        derive(cfg, world_size(cfg))  # parallel layout errors at submit time, not after queueing
    threads = cfg.slurm.cpus_per_task // (workers_per_task(cfg) if stage == "train" else 1)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    return fill(
        template("job.sbatch"),
        {
            "SBATCH": "\n".join(
                sbatch_lines(
                    cfg,
                    stage,
                    log_dir,
                    log_stem=log_stem,
                    array=array,
                    job=f"prepare-{prepare_step}" if prepare_step else None,
                )
            ),
            "ORIGIN": "".join(c if c.isprintable() else "?" for c in f"{origin}, rendered {stamp}"),
            "PREAMBLE": preamble(cfg, config_paths, threads),
            "SELECT": select.rstrip("\n"),
            "COMMAND": stage_command(cfg, stage, prepare_step),
        },
    )


def render_sbatch(
    cfg: RunConfig,
    config_paths: list[str],
    overrides: list[str],
    stage: str,
    *,
    log_dir: Path | None = None,
    prepare_step: str | None = None,
) -> str:
    """The sbatch script of one stage (prepare | train | eval) of the run `cfg` (loaded from
    config_paths + overrides, which the job passes to `python -m launch.cli <stage>` again), or of one
    step of a prepare in parts (prepare_step; "part" is a job array of data.prepare_parts tasks).
    Logs go to log_dir (default <run_dir>/slurm), which must exist before submission."""
    name = f"prepare-{prepare_step}" if prepare_step else stage
    return render_job(
        cfg,
        config_paths,
        stage,
        "OVERRIDES=(" + " ".join(q(o) for o in overrides) + ")",
        log_dir=(log_dir or cfg.run_dir / "slurm").resolve(),
        log_stem=f"{name}-%A_%a" if prepare_step == "part" else None if name == stage else f"{name}-%j",
        array=f"0-{cfg.data.prepare_parts - 1}" if prepare_step == "part" else None,
        origin=f"{name} job of run {cfg.name!r}",
        prepare_step=prepare_step,
    )


# A prepare in parts: (step, the steps it waits on, dependency kind). The merge waits for every part to
# end whatever its exit (afterany), so that it runs and names a part that failed, instead of pending
# forever on a dependency that can never be met.
PREPARE_PARTS_CHAIN = (("plan", [], "afterok"), ("part", [0], "afterok"), ("merge", [1], "afterany"))


def prepare_jobs(
    cfg: RunConfig, config_paths: Sequence[str | Path], overrides: list[str], log_dir: Path, stem: str
) -> list[tuple[str, str, list[int], str]]:
    """The prepare job(s) of a run: (file stem, sbatch script, positions among these jobs it waits on,
    dependency kind). One job, or plan -> part array -> merge when data.prepare_parts > 1; the last job
    is the one that leaves the data complete."""
    if cfg.data.prepare_parts <= 1:
        return [
            (stem, render_sbatch(cfg, config_paths, overrides, "prepare", log_dir=log_dir), [], "afterok")
        ]
    return [
        (
            f"{stem}-{step}",
            render_sbatch(cfg, config_paths, overrides, "prepare", log_dir=log_dir, prepare_step=step),
            after,
            kind,
        )
        for step, after, kind in PREPARE_PARTS_CHAIN
    ]


# -- submitting --------------------------------------------------------------------------------------


def sbatch_submit(script: Path, dependency: Sequence[str] = (), kind: str = "afterok") -> str:
    """Submit a script with sbatch, to start after the `dependency` jobs (afterok: all succeeded;
    aftercorr: the array element of the same index succeeded); return the job id."""
    exe = shutil.which("sbatch")
    if exe is None:
        raise LaunchError("sbatch not found on PATH: run this on a Slurm login node (or use --dry-run)")
    cmd = [exe, "--parsable"]
    if dependency:
        cmd.append(f"--dependency={kind}:" + ":".join(dependency))
    cmd.append(str(script))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        msg = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise LaunchError(f"sbatch refused {script}: {msg}")
    return proc.stdout.strip().split(";")[0]  # --parsable prints "id" or "id;cluster"


def scancel(job_ids: Sequence[str]) -> None:
    if job_ids and shutil.which("scancel"):
        subprocess.run(["scancel", *job_ids], capture_output=True)


def submit_jobs(jobs: Sequence[tuple[Path, Sequence[int], str]]) -> list[str]:
    """Submit (script, positions of earlier jobs it waits on, dependency kind) in order; return the ids.
    If one submission fails, the jobs already queued are cancelled: they would otherwise wait forever on
    a dependency that never comes, or run for nothing."""
    ids: list[str] = []
    try:
        for script, after, kind in jobs:
            ids.append(sbatch_submit(script, [ids[i] for i in after], kind))
    except LaunchError:
        scancel(ids)
        raise
    return ids


def record_submission(path: Path, entry: dict[str, object]) -> None:
    """Append one line to a JSON-lines log of submissions (which job ids belong to which launch)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def launch_slurm(config_paths: list[str], overrides: list[str], *, dry_run: bool) -> list[str]:
    """Render the prepare, train and eval scripts into <run_dir>/slurm/ and submit them chained with
    afterok dependencies; return the job ids. With dry_run, print the scripts and submit nothing."""
    cfg = load_config(config_paths, overrides)
    if cfg.train.checkpoint.resume != "auto":
        print(
            f"fpa: note: train.checkpoint.resume={cfg.train.checkpoint.resume!r} is replaced by 'auto' "
            "in the Slurm train job so that a requeued job resumes",
            file=sys.stderr,
        )
    out = cfg.run_dir.resolve() / "slurm"
    out.mkdir(parents=True, exist_ok=True)
    # (name, script, positions it waits on, kind): the prepare job(s), then train, then eval
    jobs = [
        (name, text, list(after), kind)
        for name, text, after, kind in prepare_jobs(cfg, config_paths, overrides, out, "prepare")
    ]
    for stage in STAGES[1:]:
        jobs.append((stage, render_sbatch(cfg, config_paths, overrides, stage), [len(jobs) - 1], "afterok"))
    scripts: list[Path] = []
    for name, text, _, _ in jobs:
        path = out / f"{name}.sbatch"
        path.write_text(text)
        scripts.append(path)
        if dry_run:
            print(f"# ===== {path} =====")
            print(path.read_text())
    if dry_run:
        return []
    ids = submit_jobs([(script, after, kind) for script, (_, _, after, kind) in zip(scripts, jobs)])
    names = [name for name, _, _, _ in jobs]
    entry = {"time": time.time(), "jobs": dict(zip(names, ids))}
    record_submission(out / "jobs.jsonl", {**entry, "configs": config_paths, "overrides": overrides})
    for name, job in zip(names, ids):
        log = f"{name}-{job}_<task>.out" if name.endswith("-part") else f"{name}-{job}.out"
        print(f"submitted {name}: job {job} (log {out}/{log})")
    return ids
