"""lm-evaluation-harness from `fpa eval` (eval.harness), offline: two local tasks (task YAMLs over a jsonl
of KJV verses written here) run on the exported model; their scores equal ones computed by hand from the
project model's logits, and they reach report.json, report.md, the W&B summary and `fpa sweep --collect`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from hf_support import export_random_model, prepare_tiny_data, run_cfg  # noqa: E402

# (context, choices, index of the KJV word): the verse's next word and two other words from the verse.
VERSES = [
    ("In the beginning God created the heaven and the", ["earth", "light", "waters"], 0),
    ("And God said, Let there be light: and there was", ["light", "darkness", "evening"], 0),
    ("And the evening and the morning were the first", ["day", "night", "firmament"], 0),
    ("And God called the light Day, and the darkness he called", ["Night", "Heaven", "Earth"], 0),
    ("And the earth was without form, and", ["void", "light", "seas"], 0),
    ("And God saw the light, that it was", ["good", "evening", "heaven"], 0),
    (
        "And God called the dry land Earth; and the gathering together of the waters called he",
        ["Seas", "Day", "Night"],
        0,
    ),
    ("And God made two great lights; the greater light to rule the", ["day", "seas", "grass"], 0),
]


def _write_tasks(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "kjv.jsonl"
    data.write_text(
        "".join(
            json.dumps({"context": c, "choices": ch, "label": y, "next": " " + ch[y]}) + "\n"
            for c, ch, y in VERSES
        )
    )
    common = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{context}}}}"
"""
    (folder / "kjv_choice.yaml").write_text(
        "task: kjv_choice\n"
        + common
        + """output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
"""
    )
    # loglikelihood requests take the target as is (no target_delimiter): the field holds " <word>".
    (folder / "kjv_next_word.yaml").write_text(
        "task: kjv_next_word\n"
        + common
        + """output_type: loglikelihood
doc_to_target: next
metric_list:
  - metric: perplexity
  - metric: acc
"""
    )
    return folder


def _by_hand(model: torch.nn.Module, tokenizer, eod_id: int) -> dict[str, float]:  # noqa: ANN001
    """lm-eval's numbers from the logits: log P(" " + word | context) summed over the word's tokens."""

    def loglik(context: str, word: str) -> tuple[float, bool]:
        ctx = tokenizer.encode(context).ids
        whole = tokenizer.encode(context + " " + word).ids
        cont = whole[len(ctx) :]
        assert whole[: len(ctx)] == ctx
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([whole]))[0, :-1].double(), -1)
        picked = logp[len(ctx) - 1 :, :].gather(1, torch.tensor(cont)[:, None])
        greedy = bool((logp[len(ctx) - 1 :].argmax(-1) == torch.tensor(cont)).all())
        return float(picked.sum()), greedy

    correct, lls, greedy = 0, [], 0
    for context, choices, label in VERSES:
        scores = [loglik(context, w)[0] for w in choices]
        correct += int(max(range(len(choices)), key=scores.__getitem__) == label)
        ll, g = loglik(context, choices[label])
        lls.append(ll)
        greedy += g
    return {
        "choice_acc": correct / len(VERSES),
        "next_word_perplexity": math.exp(-sum(lls) / len(lls)),
        "next_word_acc": greedy / len(VERSES),
    }


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny_data(tmp_path_factory.mktemp("harnessdata") / "data")


def test_harness_local_tasks_match_hand_scores_and_reach_the_report(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from data_prep.index import load_index
    from data_prep.tokenizer import load_tokenizer
    from pipeline.evaluation import evaluate, load_report
    from pipeline.export import load_exported

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = _write_tasks(tmp_path / "tasks")
    cfg = run_cfg(
        tmp_path,
        data_dir,
        "harness-run",
        "fpa",
        [
            "eval.passkey.enabled=false",
            "eval.cache.evict=false",
            "eval.ppl_length_multipliers=[1]",
            "eval.ppl_sequences=1",
            "eval.harness.tasks=[kjv_choice,kjv_next_word]",
            f"eval.harness.include_path={tasks}",
            "eval.harness.batch_size=4",  # right-padded batches: the model's causal logits ignore the pad
        ],
    )
    export = export_random_model(cfg, seed=3)

    class Summary:
        def __init__(self) -> None:
            self.values: dict[str, float] = {}

        def summary(self, d: dict) -> None:  # noqa: D401
            self.values.update(d)

        def log_table(self, *a, **k) -> None:  # noqa: ANN002, ANN003
            pass

    logger = Summary()
    headline = evaluate(cfg, logger=logger)
    index = load_index(data_dir)
    want = _by_hand(load_exported(export), load_tokenizer(data_dir), index.eod_id)

    rep = load_report(cfg.run_dir)
    scores = rep["harness"]["tasks"]
    assert headline["harness"] == rep["harness"]
    assert scores["kjv_choice"]["acc"] == pytest.approx(want["choice_acc"], abs=1e-9)
    assert scores["kjv_next_word"]["perplexity"] == pytest.approx(want["next_word_perplexity"], rel=1e-4)
    assert scores["kjv_next_word"]["acc"] == pytest.approx(want["next_word_acc"], abs=1e-9)
    assert rep["harness"]["lm_eval_version"]
    md = (cfg.run_dir / "eval" / "report.md").read_text()
    assert "## lm-evaluation-harness" in md and "| kjv_next_word | perplexity |" in md
    assert logger.values["eval/harness/kjv_choice/acc"] == scores["kjv_choice"]["acc"]

    # fpa sweep --collect: a column per task and metric.
    from pipeline.evaluation.report import harness_metrics

    cols = harness_metrics(rep)
    assert cols["harness:kjv_next_word/perplexity"] == pytest.approx(want["next_word_perplexity"], rel=1e-4)
    assert not any(k.endswith("_stderr") for k in cols)


def test_harness_unknown_task_and_old_reports(tmp_path: Path, data_dir: Path) -> None:
    from data_prep.index import load_index
    from data_prep.tokenizer import load_tokenizer
    from pipeline.config import HarnessConfig
    from pipeline.evaluation.harness import HarnessError, run_harness
    from pipeline.evaluation.report import LATER_KEYS, check_report
    from pipeline.export import load_exported

    cfg = run_cfg(tmp_path, data_dir, "h", "fox")
    model = load_exported(export_random_model(cfg))
    tasks = _write_tasks(tmp_path / "tasks")
    with pytest.raises(HarnessError, match="no task"):
        run_harness(
            model,
            load_tokenizer(data_dir),
            load_index(data_dir).eod_id,
            HarnessConfig(tasks=["no_such_task"], include_path=str(tasks)),
        )
    with pytest.raises(ValueError, match="batch_size"):
        HarnessConfig(batch_size=0)
    # A report written before the harness key still loads, with harness null.
    old = {"schema_version": 1}
    from pipeline.evaluation.report import REPORT_KEYS

    old.update({k: None for k in REPORT_KEYS if k not in LATER_KEYS and k != "schema_version"})
    assert check_report(old, tmp_path / "r.json")["harness"] is None


def test_sweep_collect_has_a_column_per_harness_score(tmp_path: Path) -> None:
    from launch.sweep import collect_sweep, load_sweep
    from pipeline.evaluation.report import REPORT_KEYS

    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    sweep = tmp_path / "s.yaml"
    sweep.write_text(
        f"name: h\nconfigs: [{tiny}]\noverrides:\n  runs_dir: {tmp_path / 'runs'}\n"
        "grid:\n  model.attention.kind: [fpa, softmax]\n"
    )
    runs = load_sweep(sweep).runs
    for run, harness in zip(runs, ({"tasks": {"kjv": {"acc": 0.625, "acc_stderr": 0.1}}}, None)):
        report = dict.fromkeys(REPORT_KEYS)
        report.update(schema_version=1, run=run.name, kind="fpa", seq_len=64, n_params=10, harness=harness)
        (run.run_dir / "eval").mkdir(parents=True)
        (run.run_dir / "eval" / "report.json").write_text(json.dumps(report))
    out = collect_sweep(sweep)
    header, first, second = (out / "result.csv").read_text().splitlines()
    assert header.split(",")[-2:] == ["harness:kjv/acc", "status"]
    assert first.split(",")[-2:] == ["0.625", "ok"] and second.split(",")[-2:] == ["", "ok"]
    assert "harness:kjv/acc" in (out / "result.md").read_text()
