"""The long-context tasks as lm-evaluation-harness tasks over locally generated data (offline): `fpa eval`
writes them to eval/lm_eval/; lm-eval reads the same prompts (the same tokens), generates the same greedy
answers and gives the same accuracy as the project's own grid on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from hf_support import export_random_model, prepare_tiny_data, run_cfg  # noqa: E402

TASKS = ["overwrite-2", "vartrack-2", "passkey"]
OVER = ["model.max_seq_len=512", "eval.passkey.enabled=false", "eval.cache.evict=false"]
OVER += [
    "eval.ppl_length_multipliers=[1]",
    "eval.ppl_sequences=1",
    f"eval.long_context.tasks=[{','.join(TASKS)}]",
]
OVER += ["eval.long_context.length_multipliers=[4,8]", "eval.long_context.depths=[0.0,1.0]"]
OVER += ["eval.long_context.trials=2", "eval.long_context.digits=2"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny_data(tmp_path_factory.mktemp("lcharness") / "data")


def test_lm_eval_scores_the_grid_prompts_as_the_grid_does(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from data_prep import long_context as lc
    from data_prep import passkey
    from data_prep.index import load_index
    from data_prep.tokenizer import load_tokenizer
    from pipeline.evaluation import evaluate, load_report
    from pipeline.evaluation.long_context import cell_rng, harness_task_name
    from pipeline.export import hf_model, hf_tokenizer, load_exported

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    names = [harness_task_name(t) for t in TASKS]
    folder = tmp_path / "harness-run" / "eval" / "lm_eval"  # written by the eval before the harness runs
    harness = [f"eval.harness.tasks=[{','.join(names)}]", f"eval.harness.include_path={folder}"]
    cfg = run_cfg(tmp_path, data_dir, "harness-run", "fpa", [*OVER, *harness])
    export = export_random_model(cfg, seed=4)

    class Quiet:
        def log_table(self, *a, **k) -> None:  # noqa: ANN002, ANN003
            pass

        def summary(self, d: dict) -> None:
            pass

    evaluate(cfg, logger=Quiet())
    rep = load_report(cfg.run_dir)
    grid = json.loads((cfg.run_dir / "eval" / "long_context.json").read_text())
    tok = load_tokenizer(data_dir)
    eod = load_index(data_dir).eod_id
    for tid, name in zip(TASKS, names):
        # The documents are the grid's prompts, token for token, in cell order.
        docs = [json.loads(x) for x in (folder / f"{name}.jsonl").read_text().splitlines()]
        cells = grid["tasks"][tid]["modes"]["full"]["cells"]
        assert [d["expected"] for d in docs] == [e for c in cells for e in c["expected"]]
        spec = lc.parse_task(tid)
        budget = lc.answer_budget(spec, 2)
        want_ids = []
        for c in cells:
            rng = cell_rng(0, spec, c["length"], c["depth"])
            for _ in range(2):
                p = lc.task_prompt(
                    tok, spec, c["length"] - budget, c["depth"], rng, digits=2, prefix_ids=[eod]
                )
                want_ids.append(p.ids)
        assert [passkey.encode(tok, d["prompt"]) for d in docs] == want_ids
        # lm-eval's accuracy (run by fpa eval through eval.harness) is the grid's full-cache accuracy.
        assert rep["harness"]["tasks"][name]["acc"] == pytest.approx(
            rep["long_context"][tid]["accuracy"], abs=1e-12
        )

    # Answer by answer: lm-eval's greedy continuations are the grid's (the same tokens in, the same out).
    model = load_exported(export)
    index = load_index(data_dir)
    lm = HFLM(
        pretrained=hf_model(model, eos_id=index.eod_id),
        tokenizer=hf_tokenizer(tok, index.eod_id, model.cfg.max_seq_len),
        batch_size=1,
        max_length=model.cfg.max_seq_len,
    )
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=names,
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    import torch

    from fpa_model.cache import generate

    for tid, name in zip(TASKS, names):
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        docs = [json.loads(x) for x in (folder / f"{name}.jsonl").read_text().splitlines()]
        cells = grid["tasks"][tid]["modes"]["full"]["cells"]
        grid_answers = [a for c in cells for a in c["answers"]]
        budget = lc.answer_budget(lc.parse_task(tid), 2)
        for doc, sample, grid_answer in zip(docs, samples, grid_answers, strict=True):
            with torch.no_grad():
                new, _ = generate(model, torch.tensor([passkey.encode(tok, doc["prompt"])]), budget)
            toks = new[0].tolist()
            assert passkey.decode(tok, toks) == grid_answer  # the grid's greedy answer, from the document
            # lm-eval stops at the end-of-document token; the grid decodes its whole budget.
            cut = toks[: toks.index(eod)] if eod in toks else toks
            assert sample["resps"][0][0] == passkey.decode(tok, cut), (tid, sample["doc_id"])
            items = lc.parse_items(lc.parse_task(tid), passkey.decode(tok, cut), len(doc["expected"]))
            assert sample["acc"] == float(items == tuple(doc["expected"]))
