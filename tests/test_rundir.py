"""Run directories: resolved config and git SHA saved, manifests with status and timings, skip or redo."""

import json
from pathlib import Path

import pytest

from pipeline.config import from_yaml_text, load_config
from pipeline.rundir import RunDir, hash_outputs, sha256_json
from pipeline.stages import _skip, eval_inputs, prepare_inputs, train_inputs


def _cfg(tmp_path: Path, *overrides: str):
    return load_config([], [f"runs_dir={tmp_path}", "name=r", *overrides])


def test_stage_writes_config_git_manifest_and_log(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    run = RunDir(cfg)
    with run.stage("prepare", {"a": 1}) as m:
        m.result = {"tokens": 5}
    assert from_yaml_text((tmp_path / "r/config.yaml").read_text()) == cfg
    assert json.loads((tmp_path / "r/git.json").read_text())["sha"]
    man = json.loads((tmp_path / "r/manifests/prepare.json").read_text())
    assert man["status"] == "done" and man["fingerprint"] == sha256_json({"a": 1})
    assert man["result"] == {"tokens": 5} and man["seconds"] >= 0
    assert (tmp_path / "r/logs/prepare.log").exists()


def test_failed_stage_is_recorded_and_not_skipped(tmp_path: Path) -> None:
    run = RunDir(_cfg(tmp_path))
    with pytest.raises(RuntimeError), run.stage("train", {"a": 1}):
        raise RuntimeError("boom")
    m = run.read_manifest("train")
    assert m.status == "failed" and "boom" in m.error
    assert not _skip(run, "train", {"a": 1}, force=False)


def test_skip_only_when_done_with_same_fingerprint(tmp_path: Path) -> None:
    run = RunDir(_cfg(tmp_path))
    report = tmp_path / "r/eval/report.json"  # eval is done only while its report stands
    report.parent.mkdir(parents=True)
    report.write_text("{}")
    with run.stage("eval", {"x": 1}) as m:
        m.outputs = hash_outputs(run, [report])
    assert _skip(run, "eval", {"x": 1}, force=False)
    assert not _skip(run, "eval", {"x": 1}, force=True)
    assert not _skip(run, "eval", {"x": 2}, force=False)


def test_changed_config_is_kept_in_history(tmp_path: Path) -> None:
    RunDir(_cfg(tmp_path, "train.lr=0.1")).init()
    RunDir(_cfg(tmp_path, "train.lr=0.2")).init()
    hist = list((tmp_path / "r/config_history").glob("*.yaml"))
    assert len(hist) == 1 and "lr: 0.1" in hist[0].read_text()


def test_resolved_vocab_size_is_not_a_config_change(tmp_path: Path) -> None:
    RunDir(_cfg(tmp_path)).init()
    RunDir(_cfg(tmp_path, "model.vocab_size=4096")).init()  # what training writes back
    RunDir(_cfg(tmp_path)).init()
    assert not (tmp_path / "r/config_history").exists()


def test_fingerprints_follow_what_each_stage_reads(tmp_path: Path) -> None:
    base = _cfg(tmp_path)
    # prepare depends on the data section, not on training or logging
    assert prepare_inputs(base) == prepare_inputs(
        _cfg(tmp_path, "train.lr=0.5", "logging.wandb_mode=disabled")
    )
    assert prepare_inputs(base) != prepare_inputs(_cfg(tmp_path, "data.seq_len=64"))
    # train depends on model/train/world size but not on checkpoint cadence or logging
    assert train_inputs(base, 1) == train_inputs(_cfg(tmp_path, "train.checkpoint.every=7"), 1)
    assert train_inputs(base, 1) != train_inputs(_cfg(tmp_path, "model.attention.kind=fox"), 1)
    assert train_inputs(base, 1) != train_inputs(base, 2)  # global batch doubles
    # ... while the same global batch on twice the ranks is the same run (resume on another world size)
    assert train_inputs(base, 1) == train_inputs(_cfg(tmp_path, "train.micro_batch=4"), 2)
    assert eval_inputs(base, None) != eval_inputs(_cfg(tmp_path, "eval.passkey.trials=1"), None)


def test_eval_fingerprint_follows_the_exported_model_config(tmp_path: Path) -> None:
    """The same weights under another model config (here log-n scaling, which changes nothing in training)
    evaluate differently: the eval fingerprint reads the export's config.yaml, not only its weights."""
    from pipeline.config import to_yaml

    base = _cfg(tmp_path)
    export = tmp_path / "exp"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"same weights")
    assert eval_inputs(base, export)["model"] == "missing"
    (export / "config.yaml").write_text(to_yaml(base))
    plain = eval_inputs(base, export)
    assert "log_scale_length" not in plain["model"]["attention"]  # a later key at its default
    (export / "config.yaml").write_text(to_yaml(_cfg(tmp_path, "model.attention.log_scale_length=256")))
    scaled = eval_inputs(base, export)
    assert scaled["weights"] == plain["weights"] and scaled != plain
    assert scaled["model"]["attention"]["log_scale_length"] == 256
    (export / "config.yaml").write_text("model: [not, a, mapping")
    assert eval_inputs(base, export)["model"].startswith("unreadable ")


def test_keys_added_later_leave_an_older_runs_fingerprint_alone(tmp_path):
    """kv_shift, qk_norm_scale, log_scale_length and passkey.ramp_steps at their defaults are not in the
    train fingerprint (a run trained before they existed is still done); set, they are (it trains again)."""
    base = train_inputs(_cfg(tmp_path), 1)
    assert "kv_shift" not in base["model"]["attention"]
    assert "qk_norm_scale" not in base["model"]["attention"]
    assert "log_scale_length" not in base["model"]["attention"]
    assert "ramp_steps" not in base["train"]["passkey"]
    assert base == train_inputs(_cfg(tmp_path, "model.attention.kv_shift=false"), 1)
    assert base != train_inputs(_cfg(tmp_path, "model.attention.kv_shift=true"), 1)
    assert base != train_inputs(_cfg(tmp_path, "train.passkey.ramp_steps=10"), 1)
    assert base != train_inputs(_cfg(tmp_path, "model.attention.log_scale_length=128"), 1)
    normed = train_inputs(_cfg(tmp_path, "model.attention.qk_norm=true"), 1)
    assert normed != train_inputs(
        _cfg(tmp_path, "model.attention.qk_norm=true", "model.attention.qk_norm_scale=2"), 1
    )
