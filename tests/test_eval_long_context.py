"""The long-context grids of `fpa eval` (eval.long_context): scores against an oracle decoder, the passkey
task equal to the passkey grid, report.json / report.md / W&B / `fpa sweep --collect`, defaults that leave
today's eval as it was, and one-line config errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_support import SEQ_LEN, export_random_model, prepare_tiny_data, run_cfg
from test_long_context import _answer_from_text

from data_prep import long_context as lc
from data_prep import passkey as protocol

# The tiny tokenizer spends many tokens on a needle: prompts of 4x and 8x the 64-token training length.
GRID = [
    "model.max_seq_len=512",
    "eval.passkey.length_multipliers=[4,8]",
    "eval.passkey.depths=[0.0,1.0]",
    "eval.passkey.trials=2",
]
GRID += ["eval.passkey.digits=2", "eval.ppl_length_multipliers=[1]", "eval.ppl_sequences=1"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny_data(tmp_path_factory.mktemp("lcdata") / "data")


class Logger:
    def __init__(self) -> None:
        self.tables: dict[str, list] = {}
        self.values: dict[str, float] = {}

    def log_table(self, name: str, columns: list[str], rows: list) -> None:
        self.tables[name] = rows

    def summary(self, d: dict) -> None:
        self.values.update(d)

    def finish(self) -> None:
        pass


def test_grid_scores_exact_answers_from_an_oracle(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in decoder that reads the answer off the prompt text, only for the shorter length: every
    task's grid must be 1 there and 0 at the longer one, in both cache modes."""
    from data_prep.tokenizer import load_tokenizer
    from fpa_model.cache import KVCache, LayerCache
    from fpa_model.model import GPT
    from pipeline.evaluation import long_context as lc_eval
    from pipeline.evaluation import passkey as pk_eval

    tok = load_tokenizer(data_dir)
    specs = ["multikey-2", "multivalue-2", "overwrite-3", "vartrack-2"]
    cfg = run_cfg(
        tmp_path, data_dir, "oracle", "fpa", [*GRID, f"eval.long_context.tasks=[{','.join(specs)}]"]
    )
    model = GPT(cfg.model).eval()
    short = 4 * SEQ_LEN
    seen: dict[str, set[int]] = {}

    def oracle(model, idx, max_new, *, policy, chunk_size, eod_id=None):  # noqa: ANN001
        outs = []
        for row in idx.tolist():
            text = tok.decode(row)
            spec = next(lc.parse_task(s) for s in specs if _matches(s, text))
            seen.setdefault(spec.id, set()).add(len(row))
            right = len(row) + lc.answer_budget(spec, 2) == short
            ans = " " + ", ".join(map(str, _answer_from_text(spec, text))) + "." if right else " 0."
            outs.append((protocol.encode(tok, ans) + [0] * max_new)[:max_new])
        cache = KVCache([LayerCache("fpa") for _ in range(2)])
        for layer in cache.layers:
            layer.seen, layer.valid = 4, torch.tensor([[[True, True, False, False]]])
        return torch.tensor(outs), cache

    monkeypatch.setattr(pk_eval, "generate", oracle)
    logger = Logger()
    res = lc_eval.run_long_context(
        model,
        tok,
        seq_len=SEQ_LEN,
        lc=cfg.eval.long_context,
        pk=cfg.eval.passkey,
        cache_cfg=cfg.eval.cache,
        out_dir=tmp_path,
        prefix_ids=[0],
        taught="overwrite-3",
        logger=logger,
    )
    assert list(res["tasks"]) == specs
    for tid, t in res["tasks"].items():
        # Prompt plus answer budget is the cell's length: both lengths were asked for.
        assert {n + lc.answer_budget(lc.parse_task(tid), 2) for n in seen[tid]} == {short, 2 * short}
        for mode in ("full", "compressed"):
            m = t["modes"][mode]
            assert m["grid"] == [[1.0, 1.0], [0.0, 0.0]], (tid, mode)
            assert m["accuracy_per_length"] == {str(short): 1.0, str(2 * short): 0.0}
            assert m["cache_fraction"] == pytest.approx(0.5)
        full, comp = t["modes"]["full"]["cells"], t["modes"]["compressed"]["cells"]
        assert [c["expected"] for c in full] == [c["expected"] for c in comp]  # the same prompts
        assert t["taught"] == (tid == "overwrite-3")
        assert len(logger.tables[f"eval/long_context/{tid}"]) == 8
        assert (tmp_path / f"long_context-{tid}.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "long_context.json").read_text())
    assert saved["tasks"]["vartrack-2"]["modes"]["full"]["grid"] == [[1.0, 1.0], [0.0, 0.0]]


def _as_task_cell(cell: dict) -> dict:
    """A passkey grid cell as the long-context grid writes it: "expected" answer items for "keys"."""
    out = {k: v for k, v in cell.items() if k != "keys"}
    out["expected"] = [[k] for k in cell["keys"]]
    return out


def _matches(spec: str, text: str) -> bool:
    return {
        "multikey-2": "pass key of" in text,
        "multivalue-2": "One of the pass keys" in text,
        "overwrite-3": "pass key is now" in text,
        "vartrack-2": "VAR " in text,
    }[spec]


def test_evaluate_runs_the_tasks_into_report_wandb_and_sweep(tmp_path: Path, data_dir: Path) -> None:
    from launch.sweep import collect_sweep, load_sweep
    from pipeline.evaluation import evaluate, load_report
    from pipeline.evaluation.report import REPORT_KEYS, long_context_metrics

    tasks = "eval.long_context.tasks=[passkey,multikey-2,overwrite-2]"
    cfg = run_cfg(tmp_path, data_dir, "lc-run", "fpa", [*GRID, tasks])
    export_random_model(cfg, seed=2)
    logger = Logger()
    headline = evaluate(cfg, logger=logger)
    out = cfg.run_dir / "eval"
    full = json.loads((out / "long_context.json").read_text())
    pk = json.loads((out / "passkey.json").read_text())
    # The passkey task is the passkey grid: the same prompts (keys), answers and cells, bit for bit.
    assert full["tasks"]["passkey"]["modes"] == {
        mode: {**m, "cells": [_as_task_cell(c) for c in m["cells"]]} for mode, m in pk["modes"].items()
    }
    rep = load_report(cfg.run_dir)
    assert tuple(rep) == REPORT_KEYS and set(rep["long_context"]) == {"passkey", "multikey-2", "overwrite-2"}
    for tid, t in rep["long_context"].items():
        cells = full["tasks"][tid]["modes"]["full"]["cells"]
        rescored = sum(
            lc.parse_items(lc.parse_task(tid), a, len(e)) == tuple(e)
            for c in cells
            for a, e in zip(c["answers"], c["expected"])
        )
        assert t["accuracy"] == rescored / sum(c["trials"] for c in cells)
        assert t["taught"] is False and t["grid"]["lengths"] == [4 * SEQ_LEN, 8 * SEQ_LEN]
        assert t["accuracy_compressed"] is not None and 0 < t["cache_fraction"] <= 1
        assert logger.values[f"eval/long_context/{tid}/accuracy"] == t["accuracy"]
    assert rep["long_context"]["passkey"]["accuracy"] == rep["passkey_accuracy"]
    assert headline["long_context"] == {k: t["accuracy"] for k, t in rep["long_context"].items()}
    md = (out / "report.md").read_text()
    assert "## Long-context task overwrite-2 (not taught in training)" in md
    assert "### multikey-2, compressed cache (rows: length, columns: needle depth)" in md
    cols = long_context_metrics(rep)
    assert cols["lc:multikey-2"] == rep["long_context"]["multikey-2"]["accuracy"]
    assert (
        cols["lc:overwrite-2/longest"]
        == rep["long_context"]["overwrite-2"]["accuracy_per_length"][str(4 * SEQ_LEN)]
    )

    # fpa sweep --collect: a column per task (full, compressed, longest); a run without tasks: empty.
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    sweep = tmp_path / "s.yaml"
    sweep.write_text(
        f"name: lc\nconfigs: [{tiny}]\noverrides:\n  runs_dir: {tmp_path / 'runs'}\n"
        "grid:\n  model.attention.kind: [fpa, softmax]\n"
    )
    runs = load_sweep(sweep).runs
    for run, section in zip(runs, (rep["long_context"], None)):
        (run.run_dir / "eval").mkdir(parents=True)
        (run.run_dir / "eval" / "report.json").write_text(json.dumps({**rep, "long_context": section}))
    got = collect_sweep(sweep)
    header, first, second = (got / "result.csv").read_text().splitlines()
    names = header.split(",")
    i = names.index("lc:overwrite-2")
    assert names[i : i + 3] == ["lc:overwrite-2", "lc:overwrite-2/compressed", "lc:overwrite-2/longest"]
    assert float(first.split(",")[i]) == rep["long_context"]["overwrite-2"]["accuracy"]
    assert second.split(",")[i] == ""


def test_defaults_leave_the_eval_as_it_was(tmp_path: Path, data_dir: Path) -> None:
    from pipeline.config import load_config
    from pipeline.evaluation import evaluate, load_report
    from pipeline.evaluation.report import LATER_KEYS, REPORT_KEYS, check_report
    from pipeline.stages import eval_inputs

    assert load_config([]).eval.long_context.tasks == []
    cfg = run_cfg(tmp_path, data_dir, "plain", "fox", GRID)
    export_random_model(cfg)
    # The eval fingerprint of a config without the tasks is what it was before they existed.
    assert "long_context" not in eval_inputs(cfg, None)["eval"]
    with_tasks = run_cfg(tmp_path, data_dir, "plain", "fox", [*GRID, "eval.long_context.tasks=[overwrite]"])
    assert eval_inputs(with_tasks, None)["eval"]["long_context"]["tasks"] == ["overwrite"]
    headline = evaluate(cfg, logger=Logger())
    assert "long_context" not in headline
    assert not (cfg.run_dir / "eval" / "long_context.json").exists()
    assert load_report(cfg.run_dir)["long_context"] is None
    assert "Long-context" not in (cfg.run_dir / "eval" / "report.md").read_text()
    # A report written before the key still loads, with it read as null.
    old = {
        "schema_version": 1,
        **{k: None for k in REPORT_KEYS if k not in LATER_KEYS and k != "schema_version"},
    }
    assert check_report(old, tmp_path / "r.json")["long_context"] is None


def test_bad_tasks_are_one_line_errors(tmp_path: Path, data_dir: Path) -> None:
    from pipeline.config import ConfigError, load_config
    from pipeline.evaluation import evaluate

    cases = {
        "eval.long_context.tasks=[multkey]": r"unknown task 'multkey' \(did you mean 'multikey'\?\).*"
        r"\(set in override",
        "eval.long_context.tasks=[overwrite,overwrite-3]": "names a task twice",
        "eval.long_context.depths=[0.5,1.5]": r"eval.long_context.depths must lie in \[0, 1\]",
        "eval.long_context.tasks=[vartrack-0]": "needs N >= 1",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message) as e:
            load_config([], [override])
        assert "\n" not in str(e.value)
    # More needles than the prompt can hold: named with the task, before any cell runs.
    cfg = run_cfg(tmp_path, data_dir, "big", "fpa", [*GRID, "eval.long_context.tasks=[multikey-16]"])
    export_random_model(cfg)
    with pytest.raises(lc.TaskError, match=r"multikey-16: a prompt of \d+ tokens cannot hold its 16 needles"):
        evaluate(cfg, logger=Logger())


def test_report_says_which_task_was_taught(tmp_path: Path, data_dir: Path) -> None:
    from pipeline.evaluation import evaluate, load_report

    over = [*GRID, "eval.passkey.enabled=false", "eval.cache.evict=false", "eval.passkey.trials=1"]
    over += ["eval.long_context.tasks=[overwrite-2,multikey-2]", "eval.long_context.depths=[0.5]"]
    over += ["train.passkey.steps=3", "train.passkey.task=overwrite-2", "train.passkey.digits=2"]
    cfg = run_cfg(tmp_path, data_dir, "taught", "softmax", over)
    export_random_model(cfg)
    evaluate(cfg, logger=Logger())
    rep = load_report(cfg.run_dir)
    assert rep["passkey_training"]["task"] == "overwrite-2"
    assert {k: t["taught"] for k, t in rep["long_context"].items()} == {
        "overwrite-2": True,
        "multikey-2": False,
    }
    assert rep["long_context"]["overwrite-2"]["accuracy_compressed"] is None  # softmax never evicts
    md = (cfg.run_dir / "eval" / "report.md").read_text()
    assert "- long-context training: the last 3 steps added 8 overwrite-2 prompts" in md
    assert "## Long-context task overwrite-2 (taught in training)" in md
    assert "## Long-context task multikey-2 (not taught in training)" in md
    # The passkey phase's report line and keys are what they were.
    pk = run_cfg(tmp_path, data_dir, "pk", "softmax", [*over[:-2], "train.passkey.steps=3"])
    from pipeline.evaluation import _passkey_training

    assert _passkey_training(pk) == {"steps": 3, "batch": 8, "weight": 1.0, "digits": 5}
