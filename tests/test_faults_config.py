"""Bad config values, hostile names and commands (issue 14, point 6), and train.precision=auto (issue 13,
point 3).

- every bad value is a one-line ConfigError at config load that names the key and where it was set,
  before anything is written;
- a run name is one path component: nothing lands outside runs_dir;
- no config value reaches a shell: the requeue command is an argv, and a SLURM_JOB_ID that is not a job
  id is never substituted into it;
- train.precision=auto is fp32 on CPU and bf16 on CUDA where the ZeRO stage allows it, resolved at load
  so that config.yaml, the train fingerprint and the engine config all hold the precision that ran.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from launch.cli import main
from pipeline.config import ConfigError, RunConfig, derive, from_yaml_text, load_config, to_yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _error(overrides: list[str], paths: list[str | Path] = ()) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(paths, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# -- bad values --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override",
    [
        "train.min_lr_ratio=-3",  # trained with a negative lr and exited 0
        "train.min_lr_ratio=1.5",
        "train.lr=-1e-3",
        "train.lr=0",
        "train.lr=nan",
        "train.adam_eps=-1e-8",
        "train.weight_decay=-0.1",
        "train.grad_clip=-1",
        "train.betas=[2,3]",
        "train.betas=[0.9]",
        "train.warmup_steps=-1",
        "train.log_every=0",  # step % 0 mid-run
        "train.val_every=-5",
        "train.val_batches=0",
        "train.max_skipped_steps=-1",
        "train.peak_flops_per_rank=-1",
        "train.checkpoint.every=-10",
        "train.checkpoint.keep_last=-1",
        "model.n_head=0",  # ZeroDivisionError traceback
        "model.n_head=3",  # does not divide d_model=128
        "model.d_model=0",
        "model.n_layer=0",
    ],
)
def test_bad_value_is_one_line_naming_key_and_origin(override: str) -> None:
    key = override.split("=")[0]
    msg = _error([override])
    assert msg.startswith(key), msg
    assert f"(set in override '{override}')" in msg


def test_bad_value_in_a_file_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  min_lr_ratio: -3\n")
    msg = _error([], [p])
    assert msg.startswith("train.min_lr_ratio must be in [0, 1]") and f"(set in {p})" in msg


def test_cli_bad_value_exits_2_with_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    runs = tmp_path / "runs"
    assert main(["train", TINY, "train.min_lr_ratio=-3", f"runs_dir={runs}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fpa: error: train.min_lr_ratio must be") and "\n" not in err
    assert not runs.exists()


def test_missing_marker_must_be_filled_by_a_later_layer(tmp_path: Path) -> None:
    """'???' merged onto a default kept the default (training silently used lr 2e-3)."""
    p = tmp_path / "a.yaml"
    p.write_text("train:\n  lr: ???\n")
    msg = _error([], [p])
    assert f"missing required value 'train.lr' in {p}" in msg
    assert load_config([p], ["train.lr=0.01"]).train.lr == 0.01  # a later override gives it
    later = tmp_path / "b.yaml"
    later.write_text("train:\n  lr: 0.02\n")
    assert load_config([p, later]).train.lr == 0.02
    assert "missing required value 'train.lr'" in _error(["train.lr=???"])


@pytest.mark.parametrize("base", ["5", "[5]", "{a: b.yaml}", "[null]", "['']"])
def test_base_must_name_files(tmp_path: Path, base: str) -> None:
    p = tmp_path / "a.yaml"
    p.write_text(f"base: {base}\n")
    assert f"'base' in {p} must be a file name or a list of file names" in _error([], [p])


# -- paths and shell ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../x", "../../etc", "/tmp/abs", ".", "..", "a/b", "a\\b", "tab\there"])
def test_run_name_must_be_one_path_component(name: str) -> None:
    msg = _error([f"name={name}"])
    assert msg.startswith("name must be one path component") and repr(name) in msg
    assert "(set in override" in msg


def test_run_name_escape_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    runs = tmp_path / "runs"
    for name in ("../escaped", str(tmp_path / "abs"), "."):
        assert main(["train", TINY, f"name={name}", f"runs_dir={runs}"]) == 2
        assert "name must be one path component" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["tiny", "kind.kind-fox.field-walk", "a b$(x)`y`;'%j\"", "-dash", "ünï"])
def test_run_names_that_are_one_component_stay_under_runs_dir(tmp_path: Path, name: str) -> None:
    cfg = load_config([], [f"name={name}", f"runs_dir={tmp_path}"])
    assert cfg.run_dir.parent == tmp_path and cfg.run_dir.name == name


@pytest.fixture
def slurm_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Run in tmp_path as if under Slurm: a command that escaped into a shell would create files here."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    return tmp_path


def test_requeue_command_is_an_argv_never_a_shell_line(slurm_job: Path, monkeypatch) -> None:
    from pipeline.train import REQUEUE_ENV, requeue_slurm_job

    monkeypatch.setenv(REQUEUE_ENV, "echo {job_id} $(touch PWNED) `touch PWNED2`; touch PWNED3 | tee PWNED4")
    words = ["$(touch", "PWNED)", "`touch", "PWNED2`;", "touch", "PWNED3", "|", "tee", "PWNED4"]
    assert requeue_slurm_job() == ["echo", "77", *words]
    assert list(slurm_job.iterdir()) == []  # echo printed the words; nothing was executed


@pytest.mark.parametrize("job_id", ["1;touch PWNED", "$(touch PWNED)", "1 2", "../1", "12a"])
def test_requeue_refuses_a_job_id_that_is_not_one(slurm_job: Path, monkeypatch, capsys, job_id: str) -> None:
    from pipeline.train import REQUEUE_ENV, requeue_slurm_job

    monkeypatch.setenv("SLURM_JOB_ID", job_id)
    monkeypatch.setenv(REQUEUE_ENV, "touch requeued-{job_id}")
    assert requeue_slurm_job() is None
    assert list(slurm_job.iterdir()) == []
    assert "not a job id" in capsys.readouterr().err


def test_requeue_substitutes_array_job_ids(slurm_job: Path, monkeypatch) -> None:
    from pipeline.train import REQUEUE_ENV, requeue_slurm_job

    monkeypatch.setenv("SLURM_JOB_ID", "123_4")
    monkeypatch.setenv(REQUEUE_ENV, "touch requeued-{job_id}")
    assert requeue_slurm_job() == ["touch", "requeued-123_4"]
    assert [p.name for p in slurm_job.iterdir()] == ["requeued-123_4"]


def test_slurm_env_requeue_command_must_split_into_arguments(tmp_path: Path) -> None:
    p = tmp_path / "cluster.yaml"
    p.write_text('slurm:\n  env:\n    FPA_REQUEUE_CMD: "scontrol requeue \'{job_id}"\n')
    msg = _error([], [p])
    assert msg.startswith("slurm.env.FPA_REQUEUE_CMD cannot be split into arguments") and str(p) in msg
    p.write_text("slurm:\n  env:\n    FPA_REQUEUE_CMD: '  '\n")
    assert _error([], [p]).startswith("slurm.env.FPA_REQUEUE_CMD is empty")


# -- train.precision ---------------------------------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["cpu", "fake-cuda"])
def cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: request.param)
    return request.param


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_precision_auto_resolves_at_load(cuda: bool, zero_stage: int, caplog) -> None:
    """auto is bf16 on CUDA at every ZeRO stage (ZeRO-0 by autocast over fp32 weights), fp32 on the CPU."""
    with caplog.at_level(logging.WARNING, logger="fpa"):
        cfg = load_config([TINY], [f"train.zero_stage={zero_stage}"])
    want = "bf16" if cuda else "fp32"
    assert cfg.train.precision == want and derive(cfg).precision == want
    assert not [r for r in caplog.records if "precision" in r.getMessage()]  # nothing to warn about


@pytest.mark.parametrize(
    "precision, zero_stage", [("fp32", 0), ("fp32", 1), ("bf16", 0), ("bf16", 1), ("bf16", 3)]
)
def test_explicit_precision_is_kept(cuda: bool, precision: str, zero_stage: int) -> None:
    over = [f"train.precision={precision}", f"train.zero_stage={zero_stage}"]
    cfg = load_config([], over)
    assert cfg.train.precision == precision and derive(cfg).precision == precision


def test_110m_preset_trains_in_bf16_on_a_gpu(cuda: bool) -> None:
    """The 110m preset with the default ZeRO stage (0): bf16 on a GPU, fp32 on the CPU."""
    cfg = load_config([TINY, ROOT / "configs" / "model" / "110m.yaml"])
    assert cfg.train.zero_stage == 0 and cfg.model.d_model == 768
    assert cfg.train.precision == ("bf16" if cuda else "fp32")


def test_bf16_at_zero0_is_autocast_over_an_fp32_engine(cuda: bool) -> None:
    """DeepSpeed's bf16 mode only from ZeRO-1 on; at ZeRO-0 the engine stays fp32 and the forward runs
    under torch autocast (bf16), so weights, gradients and the optimizer are fp32."""
    from pipeline.trainer.engine import deepspeed_config
    from pipeline.trainer.step import autocast

    for stage in (0, 1):
        cfg = load_config([], ["train.precision=bf16", f"train.zero_stage={stage}", "model.vocab_size=64"])
        ds = deepspeed_config(cfg, derive(cfg))
        assert ("bf16" in ds) == (stage >= 1)
        with autocast(torch.device("cpu"), cfg.train.precision, stage):
            y = torch.nn.functional.linear(torch.ones(2, 4), torch.ones(3, 4))
        assert y.dtype == (torch.bfloat16 if stage == 0 else torch.float32)
    with autocast(torch.device("cpu"), "fp32", 0):
        assert torch.nn.functional.linear(torch.ones(2, 4), torch.ones(3, 4)).dtype == torch.float32


def test_resolved_precision_is_what_the_run_records_and_the_engine_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pipeline.rundir import RunDir
    from pipeline.stages import train_inputs
    from pipeline.train import deepspeed_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config([TINY], ["train.zero_stage=1", f"runs_dir={tmp_path}"])
    RunDir(cfg).init()
    saved = (cfg.run_dir / "config.yaml").read_text()
    assert "precision: bf16" in saved and "precision: auto" not in saved
    assert from_yaml_text(saved).train.precision == "bf16"  # a checkpoint's config reloads as it ran
    assert train_inputs(cfg, 1)["train"]["precision"] == "bf16"  # the manifest fingerprint
    assert deepspeed_config(cfg, derive(cfg))["bf16"] == {"enabled": True}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = load_config([TINY], ["train.zero_stage=1"])
    assert "precision: fp32" in to_yaml(cpu) and "bf16" not in deepspeed_config(cpu, derive(cpu))


def test_config_built_in_code_resolves_through_derive(cuda: bool) -> None:
    cfg = RunConfig()
    cfg.train.zero_stage = 1
    assert cfg.train.precision == "auto"  # not loaded: derive is where the engine reads it
    assert derive(cfg).precision == ("bf16" if cuda else "fp32")
