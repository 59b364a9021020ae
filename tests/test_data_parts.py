"""Prepare in parts (data.prepare_parts; a Slurm job array): plan, parts, merge give the same bytes as a
one-job prepare whatever the number of parts; a missing, failed or foreign part is a one-line error
naming it and nothing prepared before is lost; the Slurm chain plan -> part array -> merge -> train."""

from __future__ import annotations

import dataclasses
import json
import shutil
import stat
from pathlib import Path

import pytest

from data_prep.config import DataConfig, MixtureSourceConfig, SourceConfig, TokenizerConfig
from data_prep.errors import DataError
from data_prep.prepare import parts_dir, prepare_data, prepare_part, prepare_plan
from launch import slurm as sl
from pipeline.config import load_config
from pipeline.stages import run_prepare

ROOT = Path(__file__).resolve().parents[1]


def write_jsonl(path: Path, n: int, seed: int) -> Path:
    import random

    rng = random.Random(seed)
    words = ["in", "the", "beginning", "was", "word", "and", "light", "dark", "over", "deep", "waters"]
    with open(path, "w") as f:
        for _ in range(n):
            f.write(
                json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 50)))}) + "\n"
            )
    return path


def digest(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def in_parts(cfg: DataConfig, out: Path, n: int, order: list[int] | None = None) -> dict:
    c = dataclasses.replace(cfg, prepare_parts=n)
    prepare_plan(c, out, progress=False)
    for i in order if order is not None else range(n):
        prepare_part(c, out, i)
    return prepare_data(c, out, progress=False, merge=True)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("parts")
    write_jsonl(root / "a.jsonl", 70, 1)
    write_jsonl(root / "b.jsonl", 25, 2)
    return root


def base(corpora: Path, **kw) -> DataConfig:
    d = {
        "train": SourceConfig(type="jsonl", paths=[str(corpora / "a.jsonl")]),
        "val_fraction": 0.1,
        "tokenizer": TokenizerConfig(vocab_size=300),
        "seq_len": 16,
        "sequences_per_member": 4,
        "sequences_per_shard": 16,
        "tokenize_batch_docs": 7,
    }
    return DataConfig(**{**d, **kw})


CONFIGS = {
    "single": {},
    "passkey-extra": {
        "passkey_mix": 0.2,
        "extra_validation": {"b": SourceConfig(type="jsonl", paths=["{b}"])},
    },
    "mixture": {"mixture": {"a": "{a}", "b": "{b}"}},
}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_same_bytes_whatever_the_number_of_parts(corpora: Path, tmp_path: Path, kind: str) -> None:
    """Plan + N parts (run in any order) + merge == a one-job prepare, byte for byte (shards, tokenizer,
    index, marker), for N = 1, 2, 3 and 8 (more parts than some streams have documents per part)."""
    kw = dict(CONFIGS[kind])
    if "extra_validation" in kw:
        kw["extra_validation"] = {"b": SourceConfig(type="jsonl", paths=[str(corpora / "b.jsonl")])}
    if "mixture" in kw:
        kw["mixture"] = {
            n: MixtureSourceConfig(type="jsonl", paths=[str(corpora / f"{n}.jsonl")], weight=w)
            for n, w in (("a", 1.0), ("b", 2.0))
        }
    cfg = base(corpora, **kw)
    prepare_data(cfg, tmp_path / "one", progress=False)
    ref = digest(tmp_path / "one")
    for n in (1, 2, 3, 8):
        out = tmp_path / f"n{n}"
        summary = in_parts(cfg, out, n, order=list(reversed(range(n))))
        assert summary["parts"] == n
        assert digest(out) == ref, f"{n} parts"
        assert not parts_dir(out).exists()  # the parts are removed once merged


def test_a_missing_failed_or_foreign_part_names_it_and_keeps_the_data(corpora: Path, tmp_path: Path) -> None:
    cfg = dataclasses.replace(base(corpora), prepare_parts=3)
    out = tmp_path / "data"
    prepare_data(cfg, out, progress=False)  # data prepared before: must survive every failed merge
    before = digest(out)
    prepare_plan(cfg, out, progress=False)
    prepare_part(cfg, out, 0)
    prepare_part(cfg, out, 2)
    with pytest.raises(
        DataError, match=r"^prepare part 1 of 3 is missing or did not finish .*rerun array task 1"
    ):
        prepare_data(cfg, out, progress=False, merge=True)
    # a part that failed midway leaves no done.json (and no half-written folder)
    parts = parts_dir(out)
    assert sorted(p.name for p in parts.iterdir()) == [
        "part-00000",
        "part-00002",
        "plan.json",
        "tokenizer.json",
    ]
    # launching again keeps the plan and the finished parts: only the missing one runs
    plan_bytes = (parts / "plan.json").read_bytes()
    prepare_plan(cfg, out, progress=False)
    assert (parts / "plan.json").read_bytes() == plan_bytes
    assert prepare_part(cfg, out, 0).get("kept") is True
    assert prepare_part(cfg, out, 1).get("kept") is None
    done = parts / "part-00002" / "done.json"
    rec = json.loads(done.read_text())
    done.write_text(json.dumps({**rec, "tokenizer_sha256": "f00d" * 16}))
    with pytest.raises(DataError, match=r"^prepare part 2 of 3 \(.*\) was tokenized with another tokenizer"):
        prepare_data(cfg, out, progress=False, merge=True)
    done.write_text(json.dumps(rec))
    tokens = parts / "part-00000" / "stream-000.u32"
    tokens.write_bytes(tokens.read_bytes()[:-4])
    with pytest.raises(DataError, match=r"^prepare part 0 \(.*\) is truncated: rerun array task 0"):
        prepare_data(cfg, out, progress=False, merge=True)
    assert digest(out) == before
    prepare_part(cfg, out, 0)  # rerun: replaces the part whole
    prepare_data(cfg, out, progress=False, merge=True)
    assert digest(out) == before  # same content: same bytes


def test_parts_of_another_plan_or_config_are_refused(corpora: Path, tmp_path: Path) -> None:
    cfg = dataclasses.replace(base(corpora), prepare_parts=2)
    out = tmp_path / "data"
    with pytest.raises(DataError, match=r"no prepare plan at .*plan\.json: run the plan step first"):
        prepare_part(cfg, out, 0)
    prepare_plan(cfg, out, progress=False)
    with pytest.raises(DataError, match="prepare part 2 is outside 0..1"):
        prepare_part(cfg, out, 2)
    other = dataclasses.replace(cfg, seq_len=32)
    with pytest.raises(DataError, match="was made for another content config"):
        prepare_part(other, out, 0)
    with pytest.raises(DataError, match="another data.prepare_parts"):
        prepare_part(dataclasses.replace(cfg, prepare_parts=3), out, 0)
    # a foreign directory is refused at the plan, before any part runs
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(DataError, match="refusing to replace"):
        prepare_plan(cfg, foreign, progress=False)


def test_cli_steps_write_the_prepare_manifest(tmp_path: Path) -> None:
    """The merge step records the prepare stage like a one-job prepare: `fpa run` then skips it, and the
    steps themselves do nothing once it is done."""
    over = [
        f"runs_dir={tmp_path}",
        "name=p",
        "data.prepare_parts=2",
        "data.train.max_docs=40",
        "data.extra_validation={}",
        "data.validation.max_docs=5",
        "data.tokenizer.vocab_size=512",
    ]
    cfg = load_config([str(ROOT / "configs" / "tiny.yaml")], over)
    run_prepare(cfg, step="plan")
    for i in range(2):
        run_prepare(cfg, step="part", part=i)
    result = run_prepare(cfg, step="merge")
    manifest = json.loads((tmp_path / "p" / "manifests" / "prepare.json").read_text())
    assert manifest["status"] == "done" and result["parts"] == 2
    assert run_prepare(cfg) == manifest["result"]  # skipped: done with these inputs
    assert run_prepare(cfg, step="plan") == manifest["result"]
    assert not parts_dir(cfg.data_dir).exists()


SBATCH_STUB = """#!/bin/bash
n=$(( $(wc -l < {log} 2>/dev/null || echo 0) + 101 ))
echo "$*" >> {log}
echo "$n"
"""


def _stub_sbatch(tmp_path: Path, monkeypatch) -> Path:
    """An sbatch on PATH that records its arguments and answers job ids 101, 102, ...; the record file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(SBATCH_STUB.format(log=calls))
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return calls


def test_launch_slurm_runs_prepare_as_an_array_then_merge_then_train(tmp_path: Path, monkeypatch) -> None:
    calls = _stub_sbatch(tmp_path, monkeypatch)
    over = [f"runs_dir={tmp_path}", "name=r", "data.prepare_parts=4"]
    ids = sl.launch_slurm([str(ROOT / "configs" / "tiny.yaml")], over, dry_run=False)
    out = tmp_path / "r" / "slurm"
    assert ids == ["101", "102", "103", "104", "105"]
    assert calls.read_text().splitlines() == [
        f"--parsable {out}/prepare-plan.sbatch",
        f"--parsable --dependency=afterok:101 {out}/prepare-part.sbatch",
        f"--parsable --dependency=afterany:102 {out}/prepare-merge.sbatch",  # runs to name a failed part
        f"--parsable --dependency=afterok:103 {out}/train.sbatch",
        f"--parsable --dependency=afterok:104 {out}/eval.sbatch",
    ]
    part = (out / "prepare-part.sbatch").read_text()
    assert "#SBATCH --array=0-3" in part and "prepare-part-%A_%a.out" in part
    assert '"$PY" -m launch.cli prepare --step part "${CONFIGS[@]}" "${OVERRIDES[@]}"' in part
    assert "--step merge" in (out / "prepare-merge.sbatch").read_text()
    record = json.loads((out / "jobs.jsonl").read_text())
    assert list(record["jobs"]) == ["prepare-plan", "prepare-part", "prepare-merge", "train", "eval"]
    shutil.rmtree(tmp_path / "r")


def test_sweep_prepares_shared_data_in_parts_before_its_training_array(tmp_path: Path, monkeypatch) -> None:
    from launch.sweep import run_sweep

    calls = _stub_sbatch(tmp_path, monkeypatch)
    sweep = tmp_path / "s.yaml"
    sweep.write_text(
        f"""
name: s
configs: [{ROOT / "configs" / "tiny.yaml"}]
overrides:
  runs_dir: {tmp_path / "runs"}
  data.out_dir: {tmp_path / "runs" / "data"}
  data.prepare_parts: 2
grid:
  model.attention.kind: [fpa, softmax]
"""
    )
    ids = run_sweep(sweep, mode="slurm")
    out = tmp_path / "runs" / "sweeps" / "s" / "slurm"
    assert ids == ["101", "102", "103", "104", "105"]
    assert calls.read_text().splitlines() == [
        f"--parsable {out}/prepare-0-plan.sbatch",
        f"--parsable --dependency=afterok:101 {out}/prepare-0-part.sbatch",
        f"--parsable --dependency=afterany:102 {out}/prepare-0-merge.sbatch",
        f"--parsable --dependency=afterok:103 {out}/train-array.sbatch",  # after the merge
        f"--parsable --dependency=aftercorr:104 {out}/eval-array.sbatch",
    ]
    assert "#SBATCH --array=0-1" in (out / "prepare-0-part.sbatch").read_text()
