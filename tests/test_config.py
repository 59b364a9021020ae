"""Config merging, every error message, derived values, and every YAML shipped under configs/."""

import logging
from pathlib import Path

import pytest

from pipeline.config import ConfigError, RunConfig, derive, from_yaml_text, load_config, to_yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "sweeps" not in p.parts)


# The own-corpus presets need the corpus they are for.
FILL = {
    "data/text.yaml": ["data.train.paths=[corpus.txt]"],
    "data/jsonl.yaml": ["data.train.paths=[corpus.jsonl]"],
    "data/hf.yaml": ["data.train.name=json", "data.train.paths=[corpus.jsonl]"],
}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config([path], FILL.get(str(path.relative_to(ROOT / "configs")), []))
    assert isinstance(cfg, RunConfig)
    assert from_yaml_text(to_yaml(cfg)) == cfg  # the saved resolved YAML rebuilds the same config


def test_merge_order_files_then_overrides(tmp_path: Path) -> None:
    a = tmp_path / "a.yaml"
    a.write_text("train:\n  lr: 1.0e-3\n  max_steps: 7\nmodel:\n  n_layer: 3\n")
    b = tmp_path / "b.yaml"
    b.write_text("base: [a.yaml]\ntrain:\n  lr: 5.0e-4\n")
    cfg = load_config([b], ["model.attention.kind=fox", "train.max_steps=9"])
    assert cfg.train.lr == 5e-4  # b over its base a
    assert cfg.train.max_steps == 9  # override over files
    assert cfg.model.n_layer == 3
    assert cfg.model.attention.kind == "fox"
    assert cfg.train.grad_accum == 1  # untouched defaults survive


def test_tiny_preset_values() -> None:
    cfg = load_config([ROOT / "configs/tiny.yaml"])
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.name) == (2, 128, "tiny")
    assert cfg.data.train.name == "kjv"


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "train.lrr=1",
            "unknown config key 'train.lrr' in override 'train.lrr=1' (did you mean 'train.lr'?)",
        ),
        ("trian.lr=1", "unknown config key 'trian' in override 'trian.lr=1' (did you mean 'train'?)"),
        ("train.lr=abc", "bad value for 'train.lr' in override 'train.lr=abc'"),
        ("train.max_steps=1.5", "bad value for 'train.max_steps'"),
        (
            "model.attention.kind=foo",
            "model.attention.kind must be one of fpa, fox, softmax; got 'foo' "
            "(set in override 'model.attention.kind=foo')",
        ),
        ("train.zero_stage=4", "train.zero_stage must be 0, 1, 2 or 3; got 4"),
        ("model.n_head=3", "model.n_head (3) must divide model.d_model (128)"),
        ("train.lr", "override 'train.lr' is not of the form key=value"),
    ],
)
def test_override_errors_name_the_key(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config([], [override])
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_key_in_file_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  attention:\n    feild: walk\n")
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'model.attention.feild' in .*bad.yaml "
        r"\(did you mean 'model.attention.field'\?\)",
    ):
        load_config([p])


def test_wrong_type_in_file_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  micro_batch: many\n")
    with pytest.raises(ConfigError, match=r"bad value for 'train.micro_batch' in .*bad.yaml"):
        load_config([p])


def test_missing_file_and_missing_base(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config([tmp_path / "nope.yaml"])
    p = tmp_path / "a.yaml"
    p.write_text("base: [gone.yaml]\n")
    with pytest.raises(ConfigError, match="config file not found: .*gone.yaml"):
        load_config([p])


def test_base_cycle_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("base: [b.yaml]\n")
    (tmp_path / "b.yaml").write_text("base: [a.yaml]\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_config([tmp_path / "a.yaml"])


def test_missing_required_value(tmp_path: Path) -> None:
    # An interpolation to a key that does not exist is an error naming the key ('???' in a file, which
    # OmegaConf's merge would let keep the default, is one too: tests/test_faults_config.py).
    p = tmp_path / "a.yaml"
    p.write_text("name: ${train.nope}\n")
    with pytest.raises(ConfigError, match=r"cannot resolve 'name' \(set in .*a.yaml\)"):
        load_config([p])


def test_yaml_syntax_error(tmp_path: Path) -> None:
    p = tmp_path / "a.yaml"
    p.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse .*a.yaml"):
        load_config([p])


def test_derived_values() -> None:
    cfg = load_config(
        [], ["train.micro_batch=4", "train.grad_accum=3", "data.seq_len=128", "parallel.sequence=2"]
    )
    d = derive(cfg, world_size=8)
    assert (d.data_parallel, d.global_batch, d.tokens_per_step) == (4, 4 * 3 * 4, 4 * 3 * 4 * 128)
    with pytest.raises(ConfigError, match="world size 6 is not divisible by parallel.sequence=4"):
        derive(load_config([], ["parallel.sequence=4"]), world_size=6)
    with pytest.raises(ConfigError, match="data.seq_len=130 is not divisible by parallel.sequence=4"):
        derive(load_config([], ["parallel.sequence=4", "data.seq_len=130"]), world_size=4)


def test_qk_norm_scale_default_override_and_errors() -> None:
    """model.attention.qk_norm_scale: 1 by default, set by override with qk_norm, an error naming the key
    when it is not positive or when qk_norm is off (it would do nothing)."""
    assert load_config([]).model.attention.qk_norm_scale == 1.0
    cfg = load_config([ROOT / "configs/tiny.yaml"], ["model.attention.qk_norm_scale=2.5"])
    assert cfg.model.attention.qk_norm_scale == 2.5
    assert from_yaml_text(to_yaml(cfg)).model.attention.qk_norm_scale == 2.5
    with pytest.raises(ConfigError, match="qk_norm_scale must be > 0"):
        load_config([ROOT / "configs/tiny.yaml"], ["model.attention.qk_norm_scale=0"])
    with pytest.raises(ConfigError, match="qk_norm_scale=2.0 needs model.attention.qk_norm=true"):
        load_config([], ["model.attention.qk_norm=false", "model.attention.qk_norm_scale=2"])


def test_log_scale_length_off_by_default_and_the_demo_ties_it_to_the_training_length() -> None:
    """Off (null) by default; configs/tiny.yaml sets ${data.seq_len}, so it follows a changed seq_len, and
    config.yaml records the resolved number."""
    assert load_config([]).model.attention.log_scale_length is None
    assert load_config([ROOT / "configs/tiny.yaml"]).model.attention.log_scale_length == 256
    cfg = load_config([ROOT / "configs/tiny.yaml"], ["data.seq_len=128"])
    assert cfg.model.attention.log_scale_length == 128
    assert "    log_scale_length: 128\n" in to_yaml(cfg)
    with pytest.raises(ConfigError, match="log_scale_length must be >= 2"):
        load_config([], ["model.attention.log_scale_length=0"])


def test_kv_shift_key_default_override_and_old_yaml(tmp_path: Path) -> None:
    """model.attention.kv_shift: false by default (a saved config from before the key loads with it off),
    true by override, kept through the saved YAML."""
    assert load_config([]).model.attention.kv_shift is False
    cfg = load_config([ROOT / "configs/tiny.yaml"], ["model.attention.kv_shift=true"])
    assert cfg.model.attention.kv_shift is True
    assert from_yaml_text(to_yaml(cfg)).model.attention.kv_shift is True
    old = to_yaml(load_config([])).replace("    kv_shift: false\n", "")
    assert "kv_shift" not in old
    assert from_yaml_text(old).model.attention.kv_shift is False
    with pytest.raises(ConfigError, match="kv_shift"):
        load_config([], ["model.attention.kv_shift=maybe"])


# -- a source's type replaces the source (your own corpus over configs/tiny.yaml) --------------------

TINY_PATH = ROOT / "configs" / "tiny.yaml"


def test_own_corpus_the_three_obvious_ways_give_one_config(tmp_path: Path, caplog) -> None:
    """Overrides, a mapping override and a YAML with base: all replace the KJV train source, drop its
    book list and its packaged validation split (saying so): the held-out split is the user's."""
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"base: [{TINY_PATH}]\ndata:\n  train: {{type: text, paths: [my.txt]}}\n")
    with caplog.at_level(logging.INFO, logger="fpa"):
        got = [
            load_config([TINY_PATH], ["data.train.type=text", "data.train.paths=[my.txt]"]),
            load_config([TINY_PATH], ["data.train.paths=[my.txt]", "data.train.type=text"]),
            load_config([TINY_PATH], ["data.train={type: text, paths: [my.txt]}"]),
            load_config([mine]),
        ]
    for cfg in got:
        assert cfg.data == got[0].data
    train = got[0].data.train
    assert (train.type, train.paths, train.exclude_books, train.books) == ("text", ["my.txt"], [], None)
    assert got[0].data.validation is None and list(got[0].data.extra_validation) == ["wiki"]
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data.validation:")]
    assert len(notes) == 4 and "configs/data/kjv.yaml" in notes[0] and "data.val_fraction" in notes[0]


def test_own_validation_source_is_kept_and_other_types_keep_theirs(tmp_path: Path) -> None:
    cfg = load_config(
        [TINY_PATH],
        ["data.train={type: text, paths: [a.txt]}", "data.validation={type: text, paths: [b.txt]}"],
    )
    assert cfg.data.validation is not None and cfg.data.validation.paths == ["b.txt"]
    # text -> jsonl keeps paths (both read them); jsonl -> packaged drops them
    cfg = load_config([], ["data.train={type: text, paths: [a.txt]}", "data.train.type=jsonl"])
    assert cfg.data.train.paths == ["a.txt"]
    cfg = load_config(
        [], ["data.train={type: jsonl, paths: [a.jsonl], text_field: body}", "data.train.type=packaged"]
    )
    assert (cfg.data.train.paths, cfg.data.train.text_field, cfg.data.train.name) == ([], "text", "kjv")


def test_a_key_the_type_does_not_read_names_key_origin_and_fix(tmp_path: Path) -> None:
    def error(paths: list, overrides: list[str]) -> str:
        with pytest.raises(ConfigError) as e:
            load_config(paths, overrides)
        return str(e.value)

    msg = error([TINY_PATH], ["data.train.name=wiki_summaries"])
    assert msg == (
        "data.train.exclude_books selects books of the packaged corpus 'kjv' only, and this source is "
        f"'wiki_summaries' (set in {ROOT / 'configs/data/kjv.yaml'}): "
        "clear it with data.train.exclude_books=[]"
    )
    assert load_config([TINY_PATH], ["data.train.name=wiki_summaries", "data.train.exclude_books=null"])
    msg = error([TINY_PATH], ["data.train={type: text, paths: [a.txt], exclude_books: [Ruth]}"])
    assert msg.startswith("data.train.exclude_books is read by sources of type packaged only")
    assert msg.endswith(
        "(set in override 'data.train={type: text, paths: [a.txt], exclude_books: [Ruth]}'): "
        "clear it with data.train.exclude_books=[]"
    )
    msg = error(
        [TINY_PATH], ["data.train.type=text", "data.train.paths=[a.txt]", "data.train.text_field=body"]
    )
    assert "data.train.text_field is read by sources of type jsonl / parquet / hf only" in msg
    assert msg.endswith(
        "(set in override 'data.train.text_field=body'): clear it with data.train.text_field=text"
    )
    msg = error([TINY_PATH], ["data.train.type=text"])
    assert msg.startswith("data.train.paths is empty: a source of type text reads files")
    assert msg.endswith("(its type set in override 'data.train.type=text')")
    # packaged -> hf: the corpus name is no datasets builder
    msg = error([TINY_PATH], ["data.train.type=hf", "data.train.paths=[a.jsonl]"])
    assert msg.startswith("data.train.name is required for a source of type hf")
    cfg = load_config(
        [TINY_PATH], ["data.train.type=hf", "data.train.paths=[a.jsonl]", "data.train.name=json"]
    )
    assert cfg.data.train.name == "json"


def test_an_empty_mapping_empties_extra_splits_and_mixtures() -> None:
    assert load_config([TINY_PATH], ["data.extra_validation={}"]).data.extra_validation == {}
    mixture = ROOT / "configs" / "data" / "mixture.yaml"
    assert load_config([TINY_PATH, mixture]).data.mixture
    assert load_config([TINY_PATH, mixture], ["data.mixture={}"]).data.mixture == {}


@pytest.mark.parametrize("preset", ["text", "jsonl"])
def test_own_corpus_presets_after_tiny(preset: str) -> None:
    ext = "txt" if preset == "text" else "jsonl"
    cfg = load_config([TINY_PATH, ROOT / f"configs/data/{preset}.yaml"], [f"data.train.paths=[c/*.{ext}]"])
    assert cfg.name == f"my-{preset}" and cfg.data.train.type == preset and cfg.data.train.exclude_books == []
    assert cfg.data.validation is None and cfg.data.extra_validation == {}
    with pytest.raises(ConfigError, match=rf"data.train.paths is empty.*configs/data/{preset}.yaml"):
        load_config([TINY_PATH, ROOT / f"configs/data/{preset}.yaml"])
