"""Evaluation: bits per byte and loss by position against hand computations, passkey grid aggregation,
and the whole `evaluate` -> report.json / report.md / compare_reports path on tiny random models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from data_prep import passkey as protocol
from data_prep.config import DataConfig, SourceConfig, TokenizerConfig
from pipeline.config import RunConfig, load_config, to_yaml

SEQ_LEN = 128


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from data_prep.prepare import prepare_data

    out = tmp_path_factory.mktemp("evaldata") / "data"
    cfg = DataConfig(
        train=SourceConfig(type="packaged", name="kjv", max_docs=60),
        val_fraction=0.25,
        extra_validation={"ood": SourceConfig(type="packaged", name="wiki_summaries", max_docs=60)},
        tokenizer=TokenizerConfig(vocab_size=512),
        seq_len=SEQ_LEN,
        sequences_per_member=16,
        sequences_per_shard=64,  # several validation shards: the stream must cross shard borders
        num_workers=1,
    )
    prepare_data(cfg, out, progress=False)
    return out


def _run_cfg(tmp: Path, data_dir: Path, name: str, kind: str, overrides: list[str] = ()) -> RunConfig:
    return load_config(
        [],
        [
            f"name={name}",
            f"runs_dir={tmp}",
            f"data.out_dir={data_dir}",
            f"data.seq_len={SEQ_LEN}",
            "model.vocab_size=512",
            "model.n_layer=2",
            "model.n_head=2",
            "model.d_model=32",
            f"model.attention.kind={kind}",
            "model.attention.impl=naive",
            "eval.passkey.length_multipliers=[1,2]",
            "eval.passkey.depths=[0.0,1.0]",
            "eval.passkey.trials=2",
            "eval.ppl_length_multipliers=[1,2]",
            "eval.ppl_bucket=32",
            "eval.ppl_sequences=2",
            "eval.cache.prefill_chunk=64",
            "logging.wandb_mode=disabled",
            *overrides,
        ],
    )


def _export_random_model(cfg: RunConfig, seed: int = 0) -> Path:
    """A randomly initialised GPT written exactly as pipeline.export writes one."""
    from fpa_model.model import GPT
    from pipeline.export import CONFIG, WEIGHTS

    torch.manual_seed(seed)
    model = GPT(cfg.model)
    with torch.no_grad():  # a field with structure, so eviction has something to do
        for blk in model.blocks:
            if blk.attn.field_proj is not None:
                blk.attn.field_proj.weight.normal_(0, 0.3)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.model.tie_embeddings:
        sd.pop("lm_head.weight")
    out = cfg.run_dir / "export"
    out.mkdir(parents=True)
    save_file(sd, str(out / WEIGHTS))
    (out / CONFIG).write_text(to_yaml(cfg))
    return out


# ----------------------------------------------------------------------------------------------------


def test_token_byte_lengths_count_utf8_bytes(data_dir: Path) -> None:
    from data_prep.tokenizer import load_tokenizer
    from pipeline.evaluation.perplexity import token_byte_lengths

    tok = load_tokenizer(data_dir)
    nbytes = token_byte_lengths(tok)
    text = "And God said, Let there be light: and there was light. Café naïve — ünïcode ✓ 12345."
    ids = tok.encode(text).ids
    assert int(nbytes[ids].sum()) == len(text.encode("utf-8"))
    assert nbytes[tok.token_to_id("<|endoftext|>")] == 0


def test_validation_stream_is_the_rows_in_order(data_dir: Path) -> None:
    from data_prep.index import load_index
    from data_prep.shards import read_shard
    from pipeline.evaluation.perplexity import validation_stream

    index = load_index(data_dir)
    shards = index.shards("validation")
    assert len(shards) >= 2
    rows = np.concatenate([read_shard(data_dir, s, seq_len=SEQ_LEN, dtype=index.dtype) for s in shards[:2]])
    n = shards[0].tokens + 10  # crosses into the second shard
    assert np.array_equal(validation_stream(data_dir, n), rows.reshape(-1)[:n])


def test_perplexity_matches_hand_computation(tmp_path: Path, data_dir: Path) -> None:
    from data_prep.tokenizer import load_tokenizer
    from fpa_model.model import GPT
    from pipeline.evaluation.perplexity import run_perplexity, token_byte_lengths, validation_stream

    cfg = _run_cfg(tmp_path, data_dir, "ppl", "fpa")
    torch.manual_seed(1)
    model = GPT(cfg.model).eval()
    tok = load_tokenizer(data_dir)
    res = run_perplexity(
        model,
        tok,
        data_dir=data_dir,
        seq_len=SEQ_LEN,
        multipliers=[1, 2],
        bucket=32,
        sequences=2,
        out_dir=tmp_path,
    )
    stream = torch.from_numpy(validation_stream(data_dir, 2 * (2 * SEQ_LEN + 1)))
    win = stream.view(2, 2 * SEQ_LEN + 1)
    with torch.no_grad():
        loss = F.cross_entropy(model(win[:, :-1]).transpose(1, 2), win[:, 1:], reduction="none")
    r = res["lengths"][str(2 * SEQ_LEN)]
    assert r["windows"] == 2
    assert r["loss"] == pytest.approx(float(loss.mean()), rel=1e-5)
    assert r["bucket_start"] == list(range(0, 2 * SEQ_LEN, 32))
    assert r["loss_by_bucket"][1] == pytest.approx(float(loss[:, 32:64].mean()), rel=1e-5)
    # Standard errors over the 2 windows: of bucket 1's mean, and of the whole loss.
    per_window = loss[:, 32:64].mean(1)
    assert r["loss_by_bucket_se"][1] == pytest.approx(
        float(per_window.std(correction=1)) / math.sqrt(2), rel=1e-4
    )
    assert r["loss_se"] == pytest.approx(float(loss.mean(1).std(correction=1)) / math.sqrt(2), rel=1e-4)
    assert res["split"] == "validation"
    assert r["loss_beyond_train_len"] == pytest.approx(float(loss[:, SEQ_LEN:].mean()), rel=1e-5)
    nbytes = int(token_byte_lengths(tok)[win[:, 1:].numpy()].sum())
    assert r["bits_per_byte"] == pytest.approx(float(loss.sum()) / math.log(2) / nbytes, rel=1e-5)
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"]), rel=1e-6)
    assert json.loads((tmp_path / "perplexity.json").read_text()) == res
    assert (tmp_path / "perplexity.png").stat().st_size > 1000


def test_perplexity_through_the_evicting_cache(tmp_path: Path, data_dir: Path) -> None:
    """Chunked reading through the cache reproduces the plain loss when nothing can be evicted, and with
    eviction it keeps a fraction of the keys at a small loss change."""
    from data_prep.tokenizer import load_tokenizer
    from fpa_model.cache import EvictionPolicy
    from fpa_model.model import GPT
    from pipeline.evaluation.perplexity import run_perplexity

    cfg = _run_cfg(tmp_path, data_dir, "pplc", "fpa")
    torch.manual_seed(2)
    model = GPT(cfg.model).eval()
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.field_proj.weight.normal_(0, 0.3)
    tok = load_tokenizer(data_dir)
    kw = {
        "data_dir": data_dir,
        "seq_len": SEQ_LEN,
        "multipliers": [2],
        "bucket": 32,
        "sequences": 1,
        "prefill_chunk": 48,
    }
    never = run_perplexity(
        model, tok, out_dir=tmp_path / "a", evict=EvictionPolicy(enabled=True, delta=1e9), **kw
    )["lengths"][str(2 * SEQ_LEN)]
    assert never["cache_fraction"] == 1.0
    assert never["loss_compressed"] == pytest.approx(never["loss"], rel=1e-5)
    assert never["loss_by_bucket_compressed"] == pytest.approx(never["loss_by_bucket"], rel=1e-5)
    ev = run_perplexity(model, tok, out_dir=tmp_path / "b", evict=EvictionPolicy(enabled=True), **kw)
    r = ev["lengths"][str(2 * SEQ_LEN)]
    assert 0.0 < r["cache_fraction"] < 1.0
    assert r["loss_compressed"] == pytest.approx(r["loss"], abs=0.05)
    off = run_perplexity(model, tok, out_dir=tmp_path / "c", evict=EvictionPolicy(enabled=False), **kw)
    assert "loss_compressed" not in off["lengths"][str(2 * SEQ_LEN)]


def test_passkey_grid_scores_and_aggregates(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in decoder that answers right only when the needle is at depth 0: the grid must say so."""
    from data_prep.tokenizer import load_tokenizer
    from fpa_model.cache import KVCache, LayerCache
    from fpa_model.model import GPT
    from pipeline.evaluation import passkey as pk_eval

    tok = load_tokenizer(data_dir)
    cfg = _run_cfg(tmp_path, data_dir, "grid", "fpa")
    model = GPT(cfg.model).eval()
    seen_prompts: list[list[int]] = []

    def fake_generate(model, idx, max_new, *, policy, chunk_size, eod_id=None):  # noqa: ANN001
        outs = []
        for row in idx.tolist():
            seen_prompts.append(row)
            text = tok.decode(row)
            key = protocol.parse_answer(text)
            early = text.find("The pass key") < len(text) // 4
            ans = protocol.answer_text(key) if early else " 0."
            outs.append((protocol.encode(tok, ans) + [0] * max_new)[:max_new])
        cache = KVCache([LayerCache("fpa") for _ in range(2)])
        for lc in cache.layers:  # report a fixed fraction to check it is carried through
            lc.seen, lc.valid = 4, torch.tensor([[[True, False, False, False]]])
        return torch.tensor(outs), cache

    monkeypatch.setattr(pk_eval, "generate", fake_generate)
    logged = []

    class Logger:
        def log_table(self, name, columns, rows):  # noqa: ANN001
            logged.append((name, columns, rows))

    res = pk_eval.run_passkey(
        model,
        tok,
        seq_len=SEQ_LEN,
        pk=cfg.eval.passkey,
        cache_cfg=cfg.eval.cache,
        out_dir=tmp_path,
        prefix_ids=[0],
        logger=Logger(),
    )
    assert set(res["modes"]) == {"full", "compressed"}
    budget = pk_eval.answer_budget(cfg.eval.passkey.digits)
    assert {len(p) for p in seen_prompts} == {SEQ_LEN - budget, 2 * SEQ_LEN - budget}
    for mode in ("full", "compressed"):
        m = res["modes"][mode]
        assert m["grid"] == [[1.0, 0.0], [1.0, 0.0]]  # [length][depth]
        assert m["accuracy"] == 0.5
        assert m["accuracy_per_length"] == {str(SEQ_LEN): 0.5, str(2 * SEQ_LEN): 0.5}
        assert m["cache_fraction"] == pytest.approx(0.25)
        assert m["cache_fraction_per_layer"] == pytest.approx([0.25, 0.25])
    # Both modes use the same keys per cell.
    kf = [c["keys"] for c in res["modes"]["full"]["cells"]]
    assert kf == [c["keys"] for c in res["modes"]["compressed"]["cells"]]
    assert logged and logged[0][0] == "eval/passkey" and len(logged[0][2]) == 8
    assert (tmp_path / "passkey.png").stat().st_size > 1000


# ----------------------------------------------------------------------------------------------------


def test_evaluate_writes_report_and_compares_runs(tmp_path: Path, data_dir: Path) -> None:
    from pipeline.evaluation import REPORT_KEYS, compare_reports, evaluate, load_report
    from pipeline.rundir import Manifest, RunDir

    dirs = []
    for name, kind in (("fpa-run", "fpa"), ("softmax-run", "softmax")):
        cfg = _run_cfg(tmp_path, data_dir, name, kind)
        _export_random_model(cfg)
        if kind == "fpa":  # a finished training stage: its last validation loss is the report's
            RunDir(cfg).write_manifest(
                Manifest(stage="train", status="done", fingerprint="x", result={"val_loss": 3.21})
            )
        headline = evaluate(cfg)
        assert headline["kind"] == kind
        ev = cfg.run_dir / "eval"
        for f in (
            "passkey.json",
            "passkey.png",
            "perplexity.json",
            "perplexity.png",
            "report.json",
            "report.md",
        ):
            assert (ev / f).is_file(), f
        rep = load_report(cfg.run_dir)
        assert tuple(rep) == REPORT_KEYS
        assert rep["run"] == name and rep["seq_len"] == SEQ_LEN
        ppl = json.loads((ev / "perplexity.json").read_text())
        if kind == "fpa":
            assert (rep["final_val_loss"], rep["final_val_loss_source"]) == (3.21, "train")
        else:  # no training manifest: the eval loss at 1x
            assert rep["final_val_loss_source"] == "eval"
            assert rep["final_val_loss"] == pytest.approx(ppl["lengths"][str(SEQ_LEN)]["loss"])
        assert set(rep["passkey_accuracy_per_length"]) == {str(SEQ_LEN), str(2 * SEQ_LEN)}
        assert set(rep["ppl_by_position"]) == {str(SEQ_LEN), str(2 * SEQ_LEN)}
        assert 0.0 <= rep["passkey_accuracy"] <= 1.0
        # Every held-out split: the in-domain one and the extra "ood" one, each from its own file.
        ood = json.loads((ev / "perplexity-ood.json").read_text())
        assert ood["split"] == "ood" and (ev / "perplexity-ood.png").is_file()
        assert set(rep["heldout"]) == {"validation", "ood"}
        for split, res in (("validation", ppl), ("ood", ood)):
            for k, v in rep["heldout"][split].items():
                assert v["loss"] == pytest.approx(res["lengths"][k]["loss"])
                assert v["loss_se"] == pytest.approx(res["lengths"][k]["loss_se"])
        assert (
            rep["heldout"]["ood"][str(SEQ_LEN)]["loss"] != rep["heldout"]["validation"][str(SEQ_LEN)]["loss"]
        )
        md = (ev / "report.md").read_text()
        assert f"# Evaluation: {name}" in md and "Passkey accuracy, full cache" in md
        assert "| ood | 128 | 2 |" in md and "| validation | 128 | 2 |" in md
        dirs.append(cfg.run_dir)
        if kind == "fpa":
            assert rep["field"] == "walk"
            assert 0.0 < rep["cache_fraction"] < 1.0  # the random field evicts some keys
            assert len(rep["cache_fraction_per_layer"]) == 2
            assert rep["passkey_accuracy_compressed"] is not None
            assert set(rep["perplexity_compressed"]) == set(rep["perplexity"])
            assert all(0.0 < f <= 1.0 for f in rep["ppl_cache_fraction"].values())
        else:
            assert rep["field"] is None
            assert rep["cache_fraction"] == 1.0
            assert rep["passkey_accuracy_compressed"] is None
            assert rep["perplexity_compressed"] is None
    table = compare_reports(dirs)
    assert "| fpa-run | fpa | walk |" in table
    assert "| softmax-run | softmax | - |" in table
    assert str(2 * SEQ_LEN) in table


def test_missing_weights_and_reports_are_clear_errors(tmp_path: Path, data_dir: Path) -> None:
    from pipeline.evaluation import EvalError, load_report, resolve_weights

    cfg = _run_cfg(tmp_path, data_dir, "nothing", "fpa")
    with pytest.raises(EvalError, match="no exported weights at .*model.safetensors"):
        resolve_weights(cfg)
    with pytest.raises(ValueError, match="no evaluation report at"):
        load_report(cfg.run_dir)
    bad = cfg.run_dir / "eval"
    bad.mkdir(parents=True)
    (bad / "report.json").write_text('{"schema_version": 1, "run": "x"}')
    with pytest.raises(ValueError, match="missing keys"):
        load_report(cfg.run_dir)


def test_report_without_passkey_and_with_a_skipped_length() -> None:
    from pipeline.evaluation.report import REPORT_KEYS, build_report, report_markdown

    ppl = {
        "seq_len": 64,
        "bucket": 32,
        "lengths": {
            "64": {
                "multiplier": 1.0,
                "windows": 2,
                "loss": 2.0,
                "perplexity": math.exp(2.0),
                "bits_per_byte": 1.5,
                "bucket_start": [0, 32],
                "loss_by_bucket": [2.2, 1.8],
            },
            "512": {"multiplier": 8.0, "windows": 0, "skipped": "too few validation tokens"},
        },
    }
    rep = build_report(
        run="r",
        kind="fox",
        field="gate",
        seq_len=64,
        n_params=10,
        checkpoint="x",
        train_val_loss=float("nan"),  # a diverged run's NaN is not a loss to report
        passkey=None,
        ppl=ppl,
    )
    assert tuple(rep) == REPORT_KEYS
    assert (rep["final_val_loss"], rep["final_val_loss_source"]) == (2.0, "eval")
    assert rep["passkey_accuracy"] is None and rep["passkey_grid"] is None and rep["cache_fraction"] is None
    assert rep["perplexity"] == {"64": pytest.approx(math.exp(2.0))}
    assert rep["perplexity_compressed"] is None
    assert rep["ppl_by_position"] == {"64": {"bucket_start": [0, 32], "loss": [2.2, 1.8]}}
    md = report_markdown(rep)
    assert "| 64 | 2.0000 | 7.39 | 1.5000 | - | - |" in md
    assert "Passkey accuracy" not in md
    assert "passkey-retrieval documents" not in md  # no mix recorded: no claim about the training data
    rep["passkey_mix"] = 0.25
    assert "- training data: 25% of the documents were passkey-retrieval documents" in report_markdown(rep)
    assert "passkey training" not in report_markdown(rep)
    rep["passkey_training"] = {"steps": 600, "batch": 32, "weight": 1.0, "digits": 2}
    assert (
        "- passkey training: the last 600 steps added 32 passkey prompts (2-digit keys, loss on the answer "
        "only, weight 1) to every micro batch (train.passkey)"
    ) in report_markdown(rep)


def test_passkey_digits_mismatch_is_named() -> None:
    from pipeline.evaluation import passkey_digits_mismatch

    taught = ["train.passkey.steps=10", "train.passkey.digits=2"]
    assert passkey_digits_mismatch(load_config([], [*taught, "eval.passkey.digits=2"])) is None
    assert passkey_digits_mismatch(load_config([], ["eval.passkey.digits=3"])) is None  # no phase: no claim
    msg = passkey_digits_mismatch(load_config([], [*taught, "eval.passkey.digits=5"]))
    assert msg is not None and "eval.passkey.digits=5" in msg and "2-digit keys" in msg


# ----------------------------------------------------------------------------------------------------
# model.attention.document_mask: every eval reads the windows and prompts with segment ids


def _masked_model(tmp: Path, data_dir: Path, name: str) -> tuple[RunConfig, torch.nn.Module]:
    from fpa_model.model import GPT

    cfg = _run_cfg(tmp, data_dir, name, "fpa", ["model.attention.document_mask=true"])
    torch.manual_seed(3)
    model = GPT(cfg.model).eval()
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.field_proj.weight.normal_(0, 0.3)
    return cfg, model


def test_perplexity_of_a_masked_model_uses_segment_ids(tmp_path: Path, data_dir: Path) -> None:
    """run_perplexity of a document_mask model equals the loss computed directly with the windows' segment
    ids (which differs from the unmasked loss: the windows hold several documents), through the plain
    forward and through the cache; without eod_id it is a one-line error, not an unmasked run."""
    from data_prep.index import load_index
    from data_prep.loader import document_segments
    from data_prep.tokenizer import load_tokenizer
    from fpa_model.cache import EvictionPolicy
    from pipeline.evaluation.perplexity import run_perplexity, validation_stream

    cfg, model = _masked_model(tmp_path, data_dir, "pplmask")
    tok, eod = load_tokenizer(data_dir), load_index(data_dir).eod_id
    # The "ood" split (short wiki summaries): its windows hold several documents.
    kw = {"data_dir": data_dir, "seq_len": SEQ_LEN, "multipliers": [2], "bucket": 32, "sequences": 2,
          "split": "ood"}  # fmt: skip
    res = run_perplexity(
        model, tok, out_dir=tmp_path, eod_id=eod, prefill_chunk=48,
        evict=EvictionPolicy(enabled=True, delta=1e9), **kw,
    )["lengths"][str(2 * SEQ_LEN)]  # fmt: skip
    win = torch.from_numpy(validation_stream(data_dir, 2 * (2 * SEQ_LEN + 1), "ood")).view(2, -1)
    x = win[:, :-1]
    seg = document_segments(x, eod)
    assert int(seg[:, -1].max()) >= 1  # a window holds more than one document
    with torch.no_grad():
        loss = F.cross_entropy(model(x, segment_ids=seg).transpose(1, 2), win[:, 1:], reduction="none")
        model.cfg.attention.document_mask = False  # the same weights reading the windows as one sequence
        unmasked = F.cross_entropy(model(x).transpose(1, 2), win[:, 1:], reduction="none")
        model.cfg.attention.document_mask = True
    assert res["loss"] == pytest.approx(float(loss.mean()), rel=1e-5)
    assert res["loss_by_bucket"][3] == pytest.approx(float(loss[:, 96:128].mean()), rel=1e-5)
    assert float((unmasked - loss).abs().max()) > 1e-2  # the mask changes the loss after an eod
    # Nothing evicted (delta 1e9): the cache in chunks of 48 gives the masked loss too.
    assert res["loss_compressed"] == pytest.approx(res["loss"], rel=1e-5)
    with pytest.raises(ValueError, match="run_perplexity: the model has model.attention.document_mask"):
        run_perplexity(model, tok, out_dir=tmp_path / "no", **kw)


def test_passkey_of_a_masked_model_decodes_the_prompt_as_one_document(tmp_path: Path, data_dir: Path) -> None:
    """The passkey cell's answers of a document_mask model are the greedy tokens of the masked forward
    (recomputed over the whole sequence at every step) on the prefixed prompt; no eod_id: an error."""
    from data_prep.index import load_index
    from data_prep.loader import document_segments
    from data_prep.tokenizer import load_tokenizer
    from fpa_model.cache import EvictionPolicy
    from pipeline.evaluation import passkey as pk_eval

    cfg, model = _masked_model(tmp_path, data_dir, "pkmask")
    tok, eod = load_tokenizer(data_dir), load_index(data_dir).eod_id
    digits, keys = cfg.eval.passkey.digits, [12345, 67890]
    args = {"length": SEQ_LEN, "depth": 0.5, "keys": keys, "digits": digits, "chunk_size": None,
            "policy": EvictionPolicy(), "prefix_ids": [eod], "device": torch.device("cpu")}  # fmt: skip
    cell = pk_eval.run_cell(model, tok, eod_id=eod, **args)
    budget = pk_eval.answer_budget(digits)
    for key, answer in zip(keys, cell["answers"]):
        x = torch.tensor([protocol.build_prompt(tok, SEQ_LEN - budget, 0.5, key, prefix_ids=[eod]).ids])
        assert int(document_segments(x, eod)[0, -1]) == 1  # the prefix, then the prompt as one document
        with torch.no_grad():
            for _ in range(budget):
                nxt = model(x, segment_ids=document_segments(x, eod))[:, -1].argmax(-1, keepdim=True)
                x = torch.cat([x, nxt], dim=1)
        assert answer == protocol.decode(tok, x[0, -budget:].tolist())
    with pytest.raises(ValueError, match="passkey: the model has model.attention.document_mask"):
        pk_eval.run_cell(model, tok, **args)


def test_evaluate_a_masked_model(tmp_path: Path, data_dir: Path) -> None:
    """`evaluate` end to end on a document_mask export: every stage (passkey, perplexity on each split,
    the evicting cache) gets the index's eod id; the report's 2x loss is the masked one."""
    from pipeline.evaluation import evaluate, load_report

    cfg = _run_cfg(tmp_path, data_dir, "evalmask", "fpa", ["model.attention.document_mask=true"])
    _export_random_model(cfg)
    evaluate(cfg)
    rep = load_report(cfg.run_dir)
    assert set(rep["heldout"]) == {"validation", "ood"} and rep["passkey_accuracy_compressed"] is not None
    ppl = json.loads((cfg.run_dir / "eval" / "perplexity.json").read_text())
    assert rep["heldout"]["validation"][str(SEQ_LEN)]["loss"] == pytest.approx(
        ppl["lengths"][str(SEQ_LEN)]["loss"]
    )
