"""The benches' result files: provenance with the load average, and each bench's markdown from its figures
(synthetic figures here: no measurement runs)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import finish_provenance, provenance, provenance_md, write_result  # noqa: E402


def _bench(name: str) -> ModuleType:
    """Import bench/<name>.py without keeping the OMP_NUM_THREADS it may set for its own runs."""
    before = os.environ.get("OMP_NUM_THREADS")
    try:
        return importlib.import_module(f"bench.{name}")
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


def _prov() -> dict:
    return finish_provenance(provenance(["bench/x.py", "--flag"]))


def test_provenance_records_the_load_average_at_start_and_end(tmp_path: Path) -> None:
    prov = provenance(["bench/x.py"])
    assert len(prov["load_average"]["start"]) == 3 and prov["load_average"]["end"] is None
    assert "load average" not in provenance_md(prov)  # no end recorded: no claim about the run's load
    finish_provenance(prov)
    start, end = prov["load_average"]["start"][0], prov["load_average"]["end"][0]
    md = provenance_md(prov)
    assert f"load average {start:.2f} at start, {end:.2f} at end" in md
    assert md.startswith("Command: `python bench/x.py`")
    out = write_result("x", {"provenance": prov}, "# X\n\n" + md, tmp_path / "x")
    assert json.loads((out / "result.json").read_text())["provenance"]["load_average"]["end"] is not None
    # a result written before the load average was recorded still renders
    old = {k: v for k, v in prov.items() if k != "load_average"}
    assert "load average" not in provenance_md(old)


def test_attention_markdown() -> None:
    att = _bench("attention")
    lengths = [512, 2048]
    res = {}
    for t in lengths:
        for name, (ms, mb) in zip(att.CONTENDERS, [(30, 20), (24, 22), (20, 5)]):
            res[(name, t)] = {
                "wall_ms": ms * t / 512,
                "cpu_ms": ms * t / 512,
                "repeats": 5,
                "peak_mb": mb * t / 512,
            }
            res[(name, t)]["ratio_wall"] = res[(name, t)]["ratio_cpu"] = ms / 20
    args = argparse.Namespace(heads=8, head_dim=64, block_size=256, no_memory=False)
    md = att.result_markdown(res, lengths, args, _prov())
    assert "| 2048 | 1.50x | 1.20x | 1.50x | 1.20x | 120 / 96 / 80 | 80 / 88 / 20 |" in md
    assert "- fpa-chunked: T x4 -> memory x4.0; of SDPA's peak: x4.0 at T=512, x4.0 at T=2048" in md
    assert "median over runs per contender (5 each;" in md


def test_train_markdown() -> None:
    train = _bench("train")
    setup = {
        "preset": "tiny", "n_params": 1.5e6, "n_layer": 2, "d_model": 128, "n_head": 4, "vocab": 8192,
        "batch": 8, "seq_len": 256, "dtype": "fp32", "impl": "chunked", "block_size": 128, "device": "cpu",
        "steps": 10, "warmup": 2, "peak_tflops": 0.05, "peak_source": "measured",
    }  # fmt: skip
    rows = {
        k: {"median_step_s": s, "tokens_per_s": 2048 / s, "mfu": 0.3, "time_ratio_vs_softmax": s / 0.4}
        for k, s in (("fpa", 0.42), ("softmax", 0.4))
    }
    md = train.result_markdown(setup, rows, _prov())
    assert "| fpa | 0.4200 | 4,876 | 30.0% | 1.05x |" in md and "median of 10 steps" in md
    rows["fpa compiled"] = {**rows["fpa"], "median_step_s": 0.21, "time_ratio_vs_eager": 0.5}
    md = train.result_markdown({**setup, "compile": True}, rows, _prov())
    assert "| fpa | 0.4200 | 4,876 | 30.0% | 1.05x | - |" in md
    assert "| fpa compiled | 0.2100 | 4,876 | 30.0% | 1.05x | 0.50x |" in md
    setup_line = next(line for line in md.splitlines() if line.startswith("1.5M parameters"))
    assert setup_line.endswith("compiled / eager is the step time ratio.")  # one paragraph, no stray line


def test_train_bench_runs_every_kind_on_toy_sizes(tmp_path: Path, monkeypatch) -> None:
    """bench/train.py itself at toy sizes: every kind (softmax-sdpa's replaced attend included) trains, and
    the figures it writes agree with its own step times."""
    train = _bench("train")
    out = tmp_path / "train.json"
    argv = ["train.py", "--steps", "3", "--warmup", "1", "--batch", "2", "--seq-len", "32", "--vocab", "64"]
    argv += ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--block-size", "16", "--peak-tflops", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out), "--no-result"])
    assert train.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["fpa", "fox", "softmax", "softmax-sdpa"]
    for r in rows.values():
        assert len(r["steps"]) == 3 and r["median_step_s"] == sorted(r["steps"])[1]
        assert abs(r["tokens_per_s"] * r["median_step_s"] - 2 * 32) < 1e-6
    assert rows["softmax"]["time_ratio_vs_softmax"] == 1.0


def test_data_markdown() -> None:
    data = _bench("data")
    out = {
        "prepare": {
            "documents": 1189, "tokens": 2_900_000, "raw_tokens": 1_040_000, "extra_validation": ["wiki"],
            "end_to_end_seconds": 5.0, "tokenizer_train_seconds": 1.0, "raw_encode_batch_tokens_per_s": 1e6,
            "prepare_tokens_per_s": 0.8e6, "prepare_over_raw": 0.8, "prepare_over_raw_paired_median": 0.81,
            "prepare_over_raw_cpu": 0.9, "raw_runs": [1e6] * 3, "prepare_runs": [0.8e6] * 3,
        },
        "loader": {"first_batch_seconds": 0.05, "tokens_per_s": 1e8, "runs": [1e8] * 3},
        "train_step": {"step_seconds": 0.4, "tokens_per_s": 5120.0, "micro_batch": 8, "seq_len": 256},
        "loader_over_train": 1e8 / 5120,
    }  # fmt: skip
    md = data.data_markdown(out, _prov())
    assert "| 0.80 | 1.00 | 0.80 | 0.81 | 0.90 |" in md
    assert "| 100,000,000 | 5,120 | 19,531x |" in md
    assert "extra validation splits wiki" in md
    assert set(data.RESULT_GROUPS["data"]) == {"prepare", "loader"}


def test_data_prepare_markdown() -> None:
    """The processes section at 10x: wall time and memory per process count (no worker at 1 process)."""
    data = _bench("data")
    row = {
        "prepare_seconds": 5.0, "prepare_tokens_per_s": 2e6, "raw_encode_batch_tokens_per_s": 1.6e6,
        "ratio": 1.25, "paired_median_ratio": 1.26, "prepare_runs": [2e6] * 3, "raw_runs": [1.6e6] * 3,
        "rss_before_mb": 231.0, "peak_rss_mb": 392.0, "tree_peak_rss_mb": 392.0, "worker_peak_rss_mb": 0.0,
        "maxrss_mb": 500.0,
    }  # fmt: skip
    rows = [{**row, "processes": 1}, {**row, "processes": 2, "worker_peak_rss_mb": 235.0}]
    p = {"documents": 11395, "tokens": 10_065_069, "scale": 10, "repeats": 3, "corpus_mb": 38.2, "rows": rows}
    out = {"processes": p}
    md = data.result_markdown(out, _prov())
    assert "10x as jsonl (38 MB" in md and "medians of 3" in md
    assert "| 1 | 5.0 | 2.000 | 1.600 | 1.25 | 1.26 | 392 (231) / - / 392 |" in md
    assert "| 2 | 5.0 | 2.000 | 1.600 | 1.25 | 1.26 | 392 (231) / 235 / 392 |" in md


def test_sequence_parallel_markdown() -> None:
    cp = _bench("sequence_parallel")
    rows = [
        {
            "T": 2048, "variant": v, "single_wall_s": 1.0, "single_cpu_s": 1.0, "single_peak_mb": 100.0,
            "ranks_wall_s": r, "ranks_cpu_s": r, "ranks_peak_mb": [60.0, 70.0], "wall_ratio": r,
            "cpu_ratio": r, "memory_ratio": 0.7,
        }
        for v, r in (("zigzag", 0.6), ("contiguous", 0.9))
    ]  # fmt: skip
    setup = {"kind": "fpa", "batch": 1, "heads": 4, "dim": 64, "block": 64, "repeats": 3}
    md = cp.result_markdown(setup, rows, _prov())
    assert "| T | zigzag ring time / mem | contiguous ring time / mem |" in md
    assert "| 2048 | 0.60 / 0.70 | 0.90 / 0.70 |" in md
    ratios, figures = md.split("## Ratios\n")[1].split("## Seconds and MB\n")
    assert "Command: `python bench/x.py --flag`" in ratios and "| 2048 | zigzag |" in figures


def test_tile_skipping_bench_writes_its_figures(tmp_path):
    """bench/tile_skipping.py at toy sizes: every field measured against every tile and SDPA, the sawtooth
    field skips most tiles, and every output change is inside the guarantee."""
    bench = _bench("tile_skipping")
    args = ["--lengths", "512", "--heads", "2", "--head-dim", "16", "--block-size", "32", "--repeats", "1"]
    assert bench.main([*args, "--result-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "result.json").read_text())
    rows = {r["field"]: r for r in data["rows"]}
    assert set(rows) == set(bench.FIELDS)
    assert rows["fpa-sawtooth"]["fraction_skipped"] > 0.9
    for r in rows.values():
        assert r["tiles"] == 2 * 16 * 15 // 2  # batch*head x the cross tiles of 16 blocks
        assert r["max_out_diff"] < r["guarantee"]
        assert set(r["ms"]) == {"every tile", "skipping", "sdpa"}
    md = (tmp_path / "result.md").read_text()
    assert "| 512 | fpa-sawtooth |" in md and data["provenance"]["command"].startswith(
        "python bench/tile_skipping"
    )


def test_tile_skipping_bench_reads_a_trained_runs_fields(tmp_path):
    """--export: every layer's q, k, v, phi captured from the model on real text, timed as the synthetic
    fields are, and the model's loss with skipping off and on (equal within the guarantee's reach)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from data_prep.sources import packaged_path
    from fpa_model.model import GPT
    from pipeline.config import load_config, to_yaml
    from pipeline.export import CONFIG, WEIGHTS

    (tmp_path / "data").mkdir()
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    text = packaged_path("kjv").read_text().splitlines()[-400:]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "data" / "tokenizer.json"))
    cfg = load_config([ROOT / "configs/tiny.yaml"], ["model.vocab_size=200"])
    torch.manual_seed(0)
    sd = {k: v.contiguous() for k, v in GPT(cfg.model).state_dict().items() if k != "lm_head.weight"}
    export = tmp_path / "export"
    export.mkdir()
    save_file(sd, str(export / WEIGHTS))
    (export / CONFIG).write_text(to_yaml(cfg))
    bench = _bench("tile_skipping")
    args = ["--lengths", "256", "--heads", "2", "--head-dim", "16", "--block-size", "32", "--repeats", "1"]
    assert bench.main([*args, "--export", str(export), "--result-dir", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "result.json").read_text())
    trained = [r for r in data["rows"] if r["field"].startswith("trained-L")]
    assert [r["field"] for r in trained] == [f"trained-L{i}" for i in range(cfg.model.n_layer)]
    assert all(r["tiles"] == cfg.model.n_head * 8 * 7 // 2 for r in trained)
    (loss,) = data["losses"]
    assert loss["T"] == 256 and abs(loss["on"] - loss["off"]) < 1e-3
    assert "| 256 | trained-L0 |" in (tmp_path / "out" / "result.md").read_text()


def test_tile_skipping_training_compares_two_runs(tmp_path):
    """experiments/tile_skipping_training.py over two written runs: the loss differences and times come
    from their metrics and manifests, and the runs' order (off, then on) is checked."""
    from experiments.tile_skipping_training import main
    from pipeline.config import load_config, to_yaml

    for name, eps, losses, seconds in (
        ("off", None, [3.0, 2.5, 2.0], 100.0),
        ("on", 1e-3, [3.0, 2.6, 1.9], 90.0),
    ):
        run = tmp_path / name
        (run / "manifests").mkdir(parents=True)
        over = [f"name={name}"] + ([f"model.attention.skip_epsilon={eps}"] if eps else [])
        (run / "config.yaml").write_text(to_yaml(load_config([ROOT / "configs/tiny.yaml"], over)))
        rows = [{"step": i + 1, "loss": x, "passkey_loss": 0.1 * x} for i, x in enumerate(losses)]
        rows.append({"step": 3, "val_loss": losses[-1] + 0.5})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "manifests" / "train.json").write_text(json.dumps({"seconds": seconds, "git": {"sha": "abc"}}))
    assert main([str(tmp_path / "off"), str(tmp_path / "on"), "--result-dir", str(tmp_path / "out")]) == 0
    s = json.loads((tmp_path / "out" / "result.json").read_text())["summary"]
    assert s["steps"] == 3 and abs(s["max_train_loss_diff"] - 0.1) < 1e-9
    assert s["val"] == [{"step": 3, "off": 2.5, "on": 2.4}] and s["seconds"] == {"off": 100.0, "on": 90.0}
    assert "| 3 | 2.5000 | 2.4000 | -0.1000 |" in (tmp_path / "out" / "result.md").read_text()
    import pytest

    with pytest.raises(SystemExit, match="first run must have skipping off"):
        main([str(tmp_path / "on"), str(tmp_path / "off"), "--result-dir", str(tmp_path / "out2")])


def test_decode_bench_times_both_caches_on_a_trained_export(tmp_path):
    """bench/decode.py on a toy export: both caches decode the same number of tokens, the evicting one
    keeps less than the full one (which keeps everything), and the markdown carries the figures."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from data_prep.sources import packaged_path
    from fpa_model.model import GPT
    from pipeline.config import load_config, to_yaml
    from pipeline.export import CONFIG, WEIGHTS

    (tmp_path / "data").mkdir()
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    text = packaged_path("kjv").read_text().splitlines()[-400:]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "data" / "tokenizer.json"))
    over = ["model.vocab_size=200", "data.seq_len=64", "model.n_layer=2"]
    cfg = load_config([ROOT / "configs/tiny.yaml"], over)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    with torch.no_grad():  # a falling field, as a trained FPA head's: old keys become evictable
        for blk in model.blocks:
            blk.attn.field_proj.bias.fill_(-3.0)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    export = tmp_path / "export"
    export.mkdir()
    save_file(sd, str(export / WEIGHTS))
    (export / CONFIG).write_text(to_yaml(cfg))
    bench = _bench("decode")
    args = ["--export", str(export), "--multiple", "4", "--new", "6", "--repeats", "2"]
    assert bench.main([*args, "--result-dir", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "result.json").read_text())
    assert data["prompt"] == 256 and data["train_len"] == 64 and data["margin"] == cfg.eval.cache.margin
    full, ev = data["medians"]["full cache"], data["medians"]["evicting"]
    assert full["kept_prompt"] == full["kept_end"] == 1.0
    assert full["slots_end"] == [256 + 6] * 2  # the prompt and every decoded token, fed back
    assert 0 < ev["kept_end"] < 0.7 and max(ev["slots_end"]) < 256
    assert all(len(rs) == 2 for rs in data["runs"].values()) and 0 <= data["agree"] <= 6
    md = (tmp_path / "out" / "result.md").read_text()
    assert f"| full cache | {full['tokens_per_s']:.1f} |" in md and "greedy tokens agreeing" in md
