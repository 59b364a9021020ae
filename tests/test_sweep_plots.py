"""`fpa sweep --collect`'s grouped figure (launch/sweep_plots.py): one line per swept value, the mean over
seeds with a +-1 std band, for the training loss, the loss by position and the accuracy by length of the
passkey and every long-context task."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from launch import sweep_plots


def test_mean_band_over_common_points() -> None:
    xs, mean, std = sweep_plots.mean_band([{1.0: 2.0, 2.0: 4.0, 3.0: 9.0}, {1.0: 4.0, 2.0: 8.0}])
    assert xs == [1.0, 2.0] and mean == [3.0, 6.0]
    assert std == pytest.approx([statistics.stdev([2, 4]), statistics.stdev([4, 8])])
    assert sweep_plots.mean_band([{5.0: 1.0}]) == ([5.0], [1.0], [0.0])
    assert sweep_plots.mean_band([]) == ([], [], [])


def test_collect_writes_the_grouped_figure_from_reports_and_metrics(tmp_path: Path) -> None:
    from launch.sweep import collect_sweep, load_sweep
    from pipeline.evaluation.report import REPORT_KEYS

    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    sweep = tmp_path / "s.yaml"
    sweep.write_text(
        f"name: g\nconfigs: [{tiny}]\noverrides:\n  runs_dir: {tmp_path / 'runs'}\n"
        "grid:\n  model.attention.kind: [fpa, softmax]\n  seed: [1, 2]\n"
    )
    runs = load_sweep(sweep).runs
    for i, run in enumerate(runs):
        rep = dict.fromkeys(REPORT_KEYS)
        rep.update(
            schema_version=1, run=run.name, kind=run.values["model.attention.kind"], seq_len=64, n_params=10
        )
        rep["passkey_accuracy_per_length"] = {"64": 1.0, "128": 0.5 + 0.1 * i}
        rep["ppl_by_position"] = {"128": {"bucket_start": [0, 64], "loss": [5.0 + i, 4.0]}}
        rep["long_context"] = {"overwrite-3": {"accuracy_per_length": {"64": 0.25 * i, "128": 0.0}}}
        (run.run_dir / "eval").mkdir(parents=True)
        (run.run_dir / "eval" / "report.json").write_text(json.dumps(rep))
        lines = [json.dumps({"step": s, "loss": 10.0 - s + i}) for s in (1, 2, 3)] + ["not json"]
        (run.run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    # What the figure draws for one run.
    series = sweep_plots.run_series(
        runs[1].run_dir, json.loads((runs[1].run_dir / "eval/report.json").read_text())
    )
    assert series["train loss"] == {1.0: 10.0, 2.0: 9.0, 3.0: 8.0}
    assert series["loss by position"] == {0.0: 6.0, 64.0: 4.0}
    assert series["accuracy: passkey"] == {1.0: 1.0, 2.0: pytest.approx(0.6)}
    assert series["accuracy: overwrite-3"] == {1.0: 0.25, 2.0: 0.0}
    out = collect_sweep(sweep)
    png = (out / "result-grouped.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    names = sweep_plots.plot_grouped(
        tmp_path / "p.png",
        "g",
        [("kind=fpa", series), ("kind=softmax", sweep_plots.run_series(runs[2].run_dir, None))],
    )
    assert names == ["train loss", "loss by position", "accuracy: passkey", "accuracy: overwrite-3"]
    assert sweep_plots.plot_grouped(tmp_path / "none.png", "g", [("a", {})]) == []
    assert not (tmp_path / "none.png").exists()
    # The same accuracy panels as tables in result.md: runs 0, 1 are kind=fpa, runs 2, 3 kind=softmax.
    md = (out / "result.md").read_text()
    section = md.split("## Accuracy by length, mean ± std over seeds\n", 1)[1].split("## ", 1)[0]
    assert "| kind=fpa | 1 ± 0 (n=2) | 0.55 ± 0.071 (n=2) |" in section  # passkey 2x: 0.5, 0.6
    assert "| kind=softmax | 1 ± 0 (n=2) | 0.75 ± 0.071 (n=2) |" in section  # 0.7, 0.8
    assert "| kind=fpa | 0.125 ± 0.18 (n=2) | 0 ± 0 (n=2) |" in section  # overwrite-3 1x: 0, 0.25
    assert "| kind=softmax | 0.625 ± 0.18 (n=2) | 0 ± 0 (n=2) |" in section  # 0.5, 0.75
    assert section.index("passkey, full cache") < section.index("overwrite-3, full cache")


def test_accuracy_tables_missing_lengths_and_single_runs() -> None:
    runs = [
        ("a", {"accuracy: multikey-4": {1.0: 0.5, 2.0: 0.25}, "train loss": {1.0: 3.0}}),
        ("b", {"accuracy: multikey-4": {1.0: 1.0}}),
        ("c", {"train loss": {1.0: 2.0}}),  # no accuracy: no row
    ]
    md = sweep_plots.accuracy_tables(runs)
    assert "| a | 0.5 (n=1) | 0.25 (n=1) |" in md and "| b | 1 (n=1) | - |" in md
    assert "| c |" not in md and "train loss" not in md
    assert sweep_plots.accuracy_tables([("a", {"train loss": {1.0: 2.0}})]) == ""
