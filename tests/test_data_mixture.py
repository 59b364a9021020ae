"""Weighted source mixtures (data.mixture): per-source shards and counts, draws by weight, world-size
independent order, exact resume, bad weights and empty sources."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.config import DataConfig, MixtureSourceConfig, SourceConfig, TokenizerConfig
from data_prep.errors import DataError
from data_prep.index import load_index
from data_prep.loader import ShardLoader, apportion
from data_prep.prepare import prepare_data
from data_prep.shards import read_shard

WEIGHTS = {"big": 1.0, "small": 3.0}  # "small" is 1/4 of the sequences but 3/4 of the draws: repeated


def write_jsonl(path: Path, n: int, prefix: str, seed: int) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = [f"{prefix}{rng.randint(0, 30)}" for _ in range(rng.randint(5, 30))]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return path


def mixture_cfg(root: Path, weights: dict[str, float] = WEIGHTS, **kw) -> DataConfig:
    sizes = {"big": 60, "small": 20}
    mixture = {
        name: MixtureSourceConfig(
            type="jsonl", paths=[str(write_jsonl(root / f"{name}.jsonl", sizes[name], name[0], 1))], weight=w
        )
        for name, w in weights.items()
    }
    base = {
        "mixture": mixture,
        "val_fraction": 0.1,
        "tokenizer": TokenizerConfig(vocab_size=320),
        "seq_len": 8,
        "sequences_per_member": 4,
        "sequences_per_shard": 16,
    }
    return DataConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def mix(tmp_path_factory: pytest.TempPathFactory) -> tuple[DataConfig, Path, dict]:
    root = tmp_path_factory.mktemp("mix")
    cfg = mixture_cfg(root)
    summary = prepare_data(cfg, root / "data", progress=False)
    return cfg, root / "data", summary


def source_rows(data_dir: Path) -> dict[str, np.ndarray]:
    index = load_index(data_dir)
    shards = index.shards("train")
    out, first = {}, 0
    for m in index.mixture["train"]:
        part = shards[first : first + m["shards"]]
        out[m["name"]] = np.concatenate(
            [read_shard(data_dir, s, seq_len=index.seq_len, dtype=index.dtype) for s in part]
        )
        first += m["shards"]
    return out


def test_each_source_is_its_own_shards_with_counts_in_the_index(mix, tmp_path: Path) -> None:
    cfg, data_dir, summary = mix
    index = load_index(data_dir)
    names = [m["name"] for m in index.mixture["train"]]
    assert names == ["big", "small"]
    files = [s.file for s in index.shards("train")]
    assert all(f.startswith(("train/big-", "train/small-")) for f in files)
    rows = source_rows(data_dir)
    for m in index.mixture["train"]:
        assert m["weight"] == WEIGHTS[m["name"]] and m["sequences"] == len(rows[m["name"]]) > 0
        assert summary["splits"]["train"]["sources"][m["name"]]["tokens"] == m["tokens"]
    assert index.stats["train"]["tokens"] == sum(m["tokens"] for m in index.mixture["train"])
    # Reference: one source prepared alone with the mixture's tokenizer gives the same rows.
    alone = DataConfig(
        train=SourceConfig(type="jsonl", paths=cfg.mixture["small"].paths),
        val_fraction=0.1,
        tokenizer=TokenizerConfig(path=str(data_dir / "tokenizer.json")),
        seq_len=8,
        sequences_per_member=4,
        sequences_per_shard=16,
    )
    prepare_data(alone, tmp_path / "alone", progress=False)
    index1 = load_index(tmp_path / "alone")
    ref = np.concatenate(
        [read_shard(tmp_path / "alone", s, seq_len=8, dtype=index1.dtype) for s in index1.shards("train")]
    )
    np.testing.assert_array_equal(rows["small"], ref)
    # validation: the last 10% of each source's documents
    assert index.stats["validation"]["documents"] == round(60 * 0.1) + round(20 * 0.1)


def test_draws_follow_the_weights(mix) -> None:
    _, data_dir, _ = mix
    rows = source_rows(data_dir)
    n = {k: len(v) for k, v in rows.items()}
    loader = ShardLoader(data_dir, "train", micro_batch=1, seed=5)
    total = sum(n.values())
    expected = apportion(total, [WEIGHTS["big"], WEIGHTS["small"]])
    n_big_shards = load_index(data_dir).mixture["train"][0]["shards"]  # "big" comes first: sorted names
    for epoch in range(3):
        order = loader.epoch_order(epoch)
        assert len(order) == total
        is_small = order[:, 0] >= n_big_shards
        counts = [int((~is_small).sum()), int(is_small.sum())]
        assert counts == loader.epoch_counts(epoch) == expected
        # exact share: within one sequence of weight / sum(weights) of the epoch
        assert abs(counts[1] - total * 3 / 4) <= 1
        small = [tuple(p) for p in order[is_small].tolist()]
        big = [tuple(p) for p in order[~is_small].tolist()]
        assert len(set(big)) == len(big)  # below its share: a subset, each at most once
        # above its share: every sequence in each full pass, no repeat within a pass
        first_pass = small[: n["small"]]
        assert len(set(first_pass)) == n["small"]
        assert small[n["small"] : 2 * n["small"]] != first_pass  # the repeat comes in a new order
        # interleaved, not one source after the other
        assert 0.5 < is_small[: total // 2].mean() / 0.75 < 1.5
    assert loader.epoch_order(0).tolist() != loader.epoch_order(1).tolist()


def test_mixture_stream_independent_of_world_size_and_workers(mix) -> None:
    _, data_dir, _ = mix
    index = load_index(data_dir)
    stored = [read_shard(data_dir, s, seq_len=8, dtype=index.dtype) for s in index.shards("train")]
    ref = ShardLoader(data_dir, "train", micro_batch=1, shuffle_block=40)
    order = np.concatenate([ref.epoch_order(0), ref.epoch_order(1)])
    stream = np.stack([stored[s][r] for s, r in order])
    for world in (1, 2, 3, 4):
        for workers in (0, 2):
            micro = 2
            g = micro * world
            steps = ref.sequences // g + 3  # into the second epoch
            loaders = [
                ShardLoader(
                    data_dir,
                    "train",
                    micro_batch=micro,
                    dp_rank=r,
                    dp_world=world,
                    num_workers=workers,
                    shuffle_block=40,
                    cache_bytes=0 if workers else 2 << 30,
                )
                for r in range(world)
            ]
            its = [iter(ld) for ld in loaders]
            got = torch.cat([torch.cat([next(it) for it in its]) for _ in range(steps)]).numpy()
            per_epoch = ref.sequences // g * g
            expect = np.concatenate([stream[:per_epoch], stream[ref.sequences : ref.sequences + 3 * g]])
            np.testing.assert_array_equal(got, expect, err_msg=f"world={world} workers={workers}")
            for ld in loaders:
                ld.close()


@pytest.mark.parametrize("k", [7, 45], ids=["mid-epoch", "next-epoch"])
def test_mixture_resume_is_exact(mix, k: int) -> None:
    _, data_dir, _ = mix
    micro, world, total = 2, 3, 60
    kw = {"micro_batch": micro, "dp_world": world, "shuffle_block": 40}
    full = [ShardLoader(data_dir, "train", dp_rank=r, **kw) for r in range(world)]
    its = [iter(ld) for ld in full]
    ref = [torch.cat([next(it) for it in its]) for _ in range(total)]
    loaders = [ShardLoader(data_dir, "train", dp_rank=r, **kw) for r in range(world)]
    its = [iter(ld) for ld in loaders]
    for _ in range(k):
        for it in its:
            next(it)
    state = json.loads(json.dumps(loaders[0].state_dict()))
    del loaders, its  # "killed"
    resumed = [ShardLoader(data_dir, "train", dp_rank=r, **kw) for r in range(world)]
    for ld in resumed:
        ld.load_state_dict(state)
    rits = [iter(ld) for ld in resumed]
    for s in range(k, total):
        torch.testing.assert_close(torch.cat([next(it) for it in rits]), ref[s], rtol=0, atol=0)


def test_other_weights_are_another_stream(mix, tmp_path: Path) -> None:
    _, data_dir, _ = mix
    state = ShardLoader(data_dir, "train", micro_batch=2).state_dict()
    other = tmp_path / "data"
    prepare_data(mixture_cfg(tmp_path, {"big": 1.0, "small": 1.0}), other, progress=False)
    assert load_index(other).fingerprint("train") != load_index(data_dir).fingerprint("train")
    with pytest.raises(DataError, match="fingerprint"):
        ShardLoader(other, "train", micro_batch=2).load_state_dict(state)


def test_a_zero_weight_source_is_prepared_but_never_drawn(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    prepare_data(mixture_cfg(tmp_path, {"big": 0.0, "small": 1.0}), data_dir, progress=False)
    loader = ShardLoader(data_dir, "train", micro_batch=1)
    assert loader.epoch_counts(0) == [0, loader.sequences]


def test_bad_weights_are_one_line_naming_the_source() -> None:
    src = {"type": "packaged", "name": "kjv"}
    with pytest.raises(ValueError, match=r"data\.mixture\.web\.weight must be a finite number >= 0, got -1"):
        DataConfig(mixture={"web": MixtureSourceConfig(**src, weight=-1.0)})
    with pytest.raises(ValueError, match=r"every weight is 0 \(a, b\)"):
        DataConfig(
            mixture={"a": MixtureSourceConfig(**src, weight=0.0), "b": MixtureSourceConfig(**src, weight=0.0)}
        )
    with pytest.raises(ValueError, match="passkey_mix works with a single"):
        DataConfig(mixture={"a": MixtureSourceConfig(**src)}, passkey_mix=0.1)


def test_a_source_without_text_is_named_and_the_previous_data_kept(mix, tmp_path: Path) -> None:
    cfg, data_dir, _ = mix
    out = tmp_path / "data"
    prepare_data(mixture_cfg(tmp_path), out, progress=False)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": "  "}\n')
    bad = mixture_cfg(tmp_path)
    bad.mixture["small"].paths = [str(empty)]
    with pytest.raises(DataError, match=r"^data\.mixture\.small \(jsonl source .*\): no text"):
        prepare_data(bad, out, progress=False)
    bad.val_fraction = 0.0  # not counted first: found while writing
    with pytest.raises(DataError, match=r"^data\.mixture\.small \(jsonl source .*\): no text"):
        prepare_data(bad, out, progress=False)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_packaged_mixture_preset(tmp_path: Path) -> None:
    """configs/data/mixture.yaml over the tiny run: kjv and wiki_summaries by weight, held-out splits
    disjoint from the training documents (here capped to a few documents each)."""
    from data_prep.sources import iter_documents
    from pipeline.config import load_config

    root = Path(__file__).resolve().parents[1]
    caps = [
        "data.mixture.kjv.max_docs=30",
        "data.mixture.wiki.max_docs=200",
        "data.validation.max_docs=5",
        "data.extra_validation.wiki.max_docs=50",
        "data.tokenizer.vocab_size=400",
        "data.seq_len=32",
    ]
    cfg = load_config([str(root / "configs/tiny.yaml"), str(root / "configs/data/mixture.yaml")], caps)
    assert {k: v.weight for k, v in cfg.data.mixture.items()} == {"kjv": 3.0, "wiki": 1.0}
    prepare_data(cfg.data, tmp_path / "data", progress=False)
    index = load_index(tmp_path / "data")
    assert [(m["name"], m["documents"]) for m in index.mixture["train"]] == [("kjv", 30), ("wiki", 200)]
    loader = ShardLoader(tmp_path / "data", "train", micro_batch=1)
    assert loader.epoch_counts(0) == apportion(loader.sequences, [3.0, 1.0])
    wiki_train = set(iter_documents(cfg.data.mixture["wiki"], max_doc_chars=cfg.data.max_doc_chars))
    wiki_heldout = set(
        iter_documents(cfg.data.extra_validation["wiki"], max_doc_chars=cfg.data.max_doc_chars)
    )
    assert len(wiki_heldout) == 50 and not wiki_train & wiki_heldout


def test_single_source_hashes_as_before_mixtures() -> None:
    """The keys added with mixtures stay out of the content config at their defaults: data prepared
    before them keeps its content key and is reused, not prepared again."""
    from data_prep.config import data_config_dict
    from data_prep.prepare import content_config

    d = data_config_dict(DataConfig(validation=SourceConfig()))
    assert not {"mixture", "prepare_processes", "prepare_parts"} & set(d)
    assert "skip_docs" not in d["train"] and "skip_docs" not in d["validation"]
    assert "train" in content_config(DataConfig())
    mixed = DataConfig(mixture={"a": MixtureSourceConfig(skip_docs=3)})
    assert "train" not in data_config_dict(mixed)  # ignored with a mixture: changing it changes nothing
    assert data_config_dict(mixed)["mixture"]["a"]["skip_docs"] == 3


def test_report_names_the_mixture_sources_and_their_tokens(mix) -> None:
    """index.json's per-source counts reach the eval report (data_sources, one markdown line)."""
    from data_prep.prepare import source_summary
    from pipeline.evaluation.report import REPORT_KEYS, build_report, report_markdown

    _, data_dir, _ = mix
    sources = source_summary(load_index(data_dir).mixture["train"])
    common = {
        "run": "r",
        "kind": "fpa",
        "field": "walk",
        "seq_len": 8,
        "n_params": 1,
        "checkpoint": "x",
        "train_val_loss": 1.0,
    }
    rep = build_report(**common, passkey=None, ppl=None, data_sources=sources)
    assert tuple(rep) == REPORT_KEYS
    assert rep["data_sources"]["small"] == {
        k: sources["small"][k] for k in ("weight", "documents", "tokens", "sequences")
    }
    line = f"small weight 3, {sources['small']['tokens']:,} tokens"
    assert line in report_markdown(rep)
    single = build_report(**common, passkey=None, ppl=None)
    assert single["data_sources"] is None and "a mixture" not in report_markdown(single)
