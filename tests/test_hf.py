"""`fpa export --format hf`: the directory loads offline with transformers' Auto classes
(trust_remote_code), its logits are the project's model's on the same tokens for every attention kind, its
tokenizer encodes as the run's with the end-of-document token as eos, and generate() through the project's
KV cache gives the project's own greedy tokens, with and without FPA/FoX eviction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hf_support import export_random_model, prepare_tiny_data, run_cfg  # noqa: E402

KINDS = ("fpa", "fox", "softmax")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny_data(tmp_path_factory.mktemp("hfdata") / "data")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, tuple]:
    """Per kind: (cfg, plain export dir, hf export dir), made once through the CLI."""
    from launch.cli import main

    tmp = tmp_path_factory.mktemp("hfruns")
    out = {}
    for kind in KINDS:
        cfg = run_cfg(tmp, data_dir, f"hf-{kind}", kind)
        plain = export_random_model(cfg, seed=KINDS.index(kind))
        yaml = tmp / f"{kind}.yaml"
        from pipeline.config import to_yaml

        yaml.write_text(to_yaml(cfg))
        assert main(["export", str(yaml), "--format", "hf", "--checkpoint", str(plain)]) == 0
        out[kind] = (cfg, plain, cfg.run_dir / "export-hf")
    return out


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _load(hf_dir: Path):  # noqa: ANN202
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).eval()
    return model, AutoTokenizer.from_pretrained(hf_dir)


@pytest.mark.parametrize("kind", KINDS)
def test_hf_export_loads_offline_with_the_projects_logits(kind: str, exported: dict, data_dir: Path) -> None:
    from data_prep.index import load_index
    from data_prep.tokenizer import load_tokenizer
    from pipeline.export import load_exported

    cfg, plain, hf_dir = exported[kind]
    names = {p.name for p in hf_dir.iterdir()}
    assert {"config.json", "model.safetensors", "configuration_fpa.py", "modeling_fpa.py"} <= names
    assert "tokenizer.json" in names
    # The shipped modeling file wraps the installed package's GPT: no attention code of its own.
    code = (hf_dir / "modeling_fpa.py").read_text()
    assert "from fpa_model.model import GPT" in code and "def fpa_attention" not in code

    model, tok = _load(hf_dir)
    assert type(model).__name__ == "FPAForCausalLM" and model.config.fpa_model["attention"]["kind"] == kind
    index = load_index(data_dir)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == index.eod_id
    text = "And God said, Let there be light: and there was light."
    ids = load_tokenizer(data_dir).encode(text).ids
    assert tok(text)["input_ids"] == ids  # no BOS, the same tokens as training
    assert tok.decode(ids) == text

    ref = load_exported(plain)
    x = torch.tensor([[index.eod_id, *ids], [index.eod_id, *ids[::-1]]])
    with torch.no_grad():
        got = model(x).logits
        want = ref(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # Tied embeddings stay one tensor after loading.
    assert model.model.lm_head.weight.data_ptr() == model.model.embed.weight.data_ptr()


@pytest.mark.parametrize(
    ("kind", "evict"), [("fpa", False), ("fpa", True), ("fox", True), ("softmax", False)]
)
def test_hf_generate_equals_project_cache(kind: str, evict: bool, exported: dict) -> None:
    from fpa_model.cache import EvictionPolicy, generate
    from pipeline.export import load_exported

    cfg, plain, hf_dir = exported[kind]
    model, _ = _load(hf_dir)
    model.config.evict = evict
    model.config.prefill_chunk = cfg.eval.cache.prefill_chunk if evict else None
    ref = load_exported(plain)
    torch.manual_seed(1)
    x = torch.randint(1, cfg.model.vocab_size, (2, 21))
    n = 24
    out = model.generate(
        x, max_new_tokens=n, do_sample=False, eos_token_id=None, return_dict_in_generate=True
    )
    policy = EvictionPolicy(enabled=evict, delta=cfg.eval.cache.delta, margin=cfg.eval.cache.margin)
    want, cache = generate(ref, x, n, policy=policy, chunk_size=model.config.prefill_chunk)
    assert out.sequences[:, : x.shape[1]].tolist() == x.tolist()
    assert out.sequences[:, x.shape[1] :].tolist() == want.tolist()
    assert len(set(want[0].tolist())) > 2  # not one token repeated: the comparison has content
    hf_cache = out.cache if hasattr(out, "cache") else out.past_key_values
    assert hf_cache.fraction_kept() == cache.fraction_kept()
    if evict:
        assert hf_cache.fraction_kept()["overall"] < 1.0  # keys were actually dropped
    # A cache the caller makes (own eviction policy) is used as is.
    mine = model.new_cache(EvictionPolicy(enabled=False))
    out2 = model.generate(x[:1], max_new_tokens=4, do_sample=False, eos_token_id=None, cache=mine)
    assert mine.seen == x.shape[1] + 3 and out2.shape[1] == x.shape[1] + 4


def test_hf_sampling_and_padding_error(exported: dict) -> None:
    cfg, _, hf_dir = exported["fpa"]
    model, tok = _load(hf_dir)
    x = torch.tensor([tok("In the beginning")["input_ids"]])
    a = model.generate(x, max_new_tokens=6, do_sample=True, top_k=5, eos_token_id=None)
    assert a.shape == (1, x.shape[1] + 6)
    with pytest.raises(ValueError, match="padding"):
        model(x, attention_mask=torch.tensor([[0] + [1] * (x.shape[1] - 1)]))


def test_export_hf_from_nothing_is_one_line_error(
    tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from launch.cli import main
    from pipeline.config import to_yaml

    cfg = run_cfg(tmp_path, data_dir, "none", "fpa")
    yaml = tmp_path / "c.yaml"
    yaml.write_text(to_yaml(cfg))
    assert main(["export", str(yaml), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fpa: error:") and "\n" not in err


def test_export_hf_from_a_deepspeed_checkpoint(tmp_path: Path, data_dir: Path, exported: dict) -> None:
    """A ZeRO-0 checkpoint dir (DeepSpeed's module state file) goes through `export` first, then to hf."""
    from pipeline.config import to_yaml
    from pipeline.export import export_hf, load_exported

    cfg, plain, _ = exported["fox"]
    ref = load_exported(plain)
    ckpt = tmp_path / "checkpoints" / "global_step3"
    ckpt.mkdir(parents=True)
    state = {"module": ref.state_dict(), "config_yaml": to_yaml(cfg), "step": 3}
    torch.save(state, ckpt / "mp_rank_00_model_states.pt")
    out = export_hf(cfg, ckpt, tmp_path / "new" / "hf")
    model, _ = _load(out)
    x = torch.randint(0, cfg.model.vocab_size, (1, 17))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref(x), rtol=0, atol=1e-6)
    assert not [p for p in (tmp_path / "new").iterdir() if p.name != "hf"]  # the temporary export is gone


@pytest.fixture(scope="module")
def exported_kv_shift(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> tuple:
    """An fpa model with model.attention.kv_shift=true and random shift gates, and log-n scaling from 16
    tokens (the prompts and generations below pass it): (cfg, plain, hf dir)."""
    from safetensors.torch import load_file, save_file

    from launch.cli import main
    from pipeline.config import to_yaml
    from pipeline.export import WEIGHTS

    tmp = tmp_path_factory.mktemp("hfshift")
    over = ["model.attention.kv_shift=true", "model.attention.rope=true"]
    over.append("model.attention.log_scale_length=16")
    # and the rest of the FoX-Pro block: per-head qk-norm gains, the output norm and gate
    over += [
        "model.attention.qk_norm=true",
        "model.attention.output_norm=true",
        "model.attention.output_gate=true",
    ]
    cfg = run_cfg(tmp, data_dir, "hf-kvshift", "fpa", over)
    plain = export_random_model(cfg, seed=3)
    sd = load_file(str(plain / WEIGHTS))
    g = torch.Generator().manual_seed(4)
    for name in [n for n in sd if ".shift_proj." in n]:  # gates away from the 50/50 init
        sd[name] = torch.randn(sd[name].shape, generator=g)
    for name in [n for n in sd if n.endswith("norm.weight") and ".attn." in n]:  # gains per head
        assert sd[name].shape == (cfg.model.n_head, cfg.model.head_dim)
        sd[name] = torch.rand(sd[name].shape, generator=g) + 0.5
    assert len([n for n in sd if ".shift_proj." in n]) == 2 * cfg.model.n_layer
    save_file(sd, str(plain / WEIGHTS))
    yaml = tmp / "kvshift.yaml"
    yaml.write_text(to_yaml(cfg))
    assert main(["export", str(yaml), "--format", "hf", "--checkpoint", str(plain)]) == 0
    return cfg, plain, cfg.run_dir / "export-hf"


@pytest.mark.parametrize("evict", [False, True], ids=["full", "evict"])
def test_hf_kv_shift_logits_and_generate_equal_the_project(evict: bool, exported_kv_shift: tuple) -> None:
    """config.json carries kv_shift and log_scale_length; the logits and greedy generate() (the cache
    carries each layer's last raw k, v) equal the project's model and its own KV-cache decoder."""
    from fpa_model.cache import EvictionPolicy, generate
    from pipeline.export import load_exported

    cfg, plain, hf_dir = exported_kv_shift
    model, _ = _load(hf_dir)
    assert model.config.fpa_model["attention"]["kv_shift"] is True
    assert model.config.fpa_model["attention"]["output_norm"] is True
    assert model.config.fpa_model["attention"]["qk_norm_gains"] == "per_head"
    assert model.config.fpa_model["attention"]["log_scale_length"] == 16
    assert model.model.blocks[0].attn.shift_proj is not None
    ref = load_exported(plain)
    assert ref.blocks[1].attn.shift_proj.weight.abs().sum() > 0
    x = torch.randint(1, cfg.model.vocab_size, (2, 21), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref(x), rtol=0, atol=1e-6)
    model.config.evict = evict
    model.config.prefill_chunk = cfg.eval.cache.prefill_chunk if evict else None
    n = 20
    out = model.generate(
        x,
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_logits=True,
    )
    policy = EvictionPolicy(enabled=evict, delta=cfg.eval.cache.delta, margin=cfg.eval.cache.margin)
    want, cache = generate(ref, x, n, policy=policy, chunk_size=model.config.prefill_chunk)
    assert out.sequences[:, x.shape[1] :].tolist() == want.tolist()
    assert len(set(want[0].tolist())) > 2  # not one token repeated: the comparison has content
    if evict:
        assert cache.fraction_kept()["overall"] < 1.0  # keys were dropped; the carry is unaffected
    else:  # every step's logits are the full forward pass's over the generated sequence
        with torch.no_grad():
            full = ref(out.sequences[:, :-1])[:, x.shape[1] - 1 :]
        # fp32 decode against the forward, to 2e-5 of the logits' scale (std ~1, max ~6 here): the output
        # norm rescales each head's output to unit RMS, so reassociation differences of ~1e-7 in a small
        # attention output come out larger (4.8e-5 measured); a wrong cache is off by O(1)
        scale = full.abs().max().item()
        torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-4, atol=2e-5 * scale)


def test_hf_config_from_before_per_head_gains_builds_shared_gains(exported_kv_shift: tuple) -> None:
    """An export with qk-norm made before qk_norm_gains existed (no key in config.json) had shared gains."""
    from pipeline.hf.configuration_fpa import FPAConfig
    from pipeline.hf.modeling_fpa import FPAForCausalLM

    cfg, _, hf_dir = exported_kv_shift
    config = FPAConfig.from_pretrained(hf_dir)
    config.fpa_model["attention"].pop("qk_norm_gains")
    model = FPAForCausalLM(config)
    assert model.model.cfg.attention.qk_norm_gains == "shared"
    assert model.model.blocks[0].attn.q_norm.weight.shape == (cfg.model.head_dim,)


def test_hf_config_without_kv_shift_loads_as_before(exported: dict) -> None:
    """An export made before the key existed (no kv_shift in config.json) builds the model without it."""
    from pipeline.hf.configuration_fpa import FPAConfig
    from pipeline.hf.modeling_fpa import FPAForCausalLM

    _, _, hf_dir = exported["fpa"]
    config = FPAConfig.from_pretrained(hf_dir)
    config.fpa_model["attention"].pop("kv_shift", None)
    model = FPAForCausalLM(config)
    assert model.model.cfg.attention.kv_shift is False
    assert not any("shift" in n for n in model.state_dict())


@pytest.fixture(scope="module")
def exported_docs(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, tuple]:
    """Per kind (fpa, with the key/value shift; softmax, with RoPE): a model.attention.document_mask model,
    (cfg, plain, hf dir)."""
    from launch.cli import main
    from pipeline.config import to_yaml

    tmp = tmp_path_factory.mktemp("hfdocs")
    out = {}
    for kind in ("fpa", "softmax"):
        extra = ["model.attention.kv_shift=true"] if kind == "fpa" else []
        cfg = run_cfg(tmp, data_dir, f"hf-docs-{kind}", kind, ["model.attention.document_mask=true", *extra])
        plain = export_random_model(cfg, seed=7)
        yaml = tmp / f"docs-{kind}.yaml"
        yaml.write_text(to_yaml(cfg))
        assert main(["export", str(yaml), "--format", "hf", "--checkpoint", str(plain)]) == 0
        out[kind] = (cfg, plain, cfg.run_dir / "export-hf")
    return out


def _docs(cfg, eod: int, lengths: list[int], seed: int) -> list[list[int]]:  # noqa: ANN001
    """Random documents without the end-of-document token (as a flattening collator packs them)."""
    g = torch.Generator().manual_seed(seed)
    ids = [t for t in range(cfg.model.vocab_size) if t != eod]
    return [[ids[i] for i in torch.randint(0, len(ids), (n,), generator=g).tolist()] for n in lengths]


@pytest.mark.parametrize("kind", ["fpa", "softmax"])
def test_hf_document_mask_packed_by_position_ids(kind: str, exported_docs: dict, data_dir: Path) -> None:
    """The exported masked model on a batch packed by transformers' DataCollatorWithFlattening (position
    ids restart at 0 per document) equals the project's model with the matching segment ids, and each
    document run alone; without position_ids it cuts at the end-of-document token, as in training."""
    from transformers import DataCollatorWithFlattening

    from data_prep.index import load_index
    from data_prep.loader import document_segments
    from pipeline.export import load_exported

    cfg, plain, hf_dir = exported_docs[kind]
    model, _ = _load(hf_dir)
    eod = load_index(data_dir).eod_id
    assert model.config.document_eod_id == eod
    ref = load_exported(plain)
    lengths = [9, 1, 1, 17, 5]
    docs = _docs(cfg, eod, lengths, seed=8)
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d} for d in docs])
    x, pos = batch["input_ids"], batch["position_ids"]
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    with torch.no_grad():
        got = model(input_ids=x, position_ids=pos).logits
        torch.testing.assert_close(got, ref(x, segment_ids=seg), rtol=0, atol=1e-6)
        start = 0
        for d in docs:
            alone = ref(torch.tensor([d]), segment_ids=torch.zeros(1, len(d), dtype=torch.long))
            torch.testing.assert_close(got[:, start : start + len(d)], alone, rtol=1e-4, atol=1e-4)
            start += len(d)
        # No position_ids, no end-of-document token: one document (the logits then differ: a real check).
        whole = model(input_ids=x).logits
        torch.testing.assert_close(whole, ref(x, segment_ids=torch.zeros_like(x)), rtol=0, atol=1e-6)
        assert not torch.allclose(whole, got, atol=1e-3)
        # No position_ids, documents ended by the end-of-document token: cut after each, as in training.
        y = torch.tensor([sum((d + [eod] for d in docs), [])])
        torch.testing.assert_close(
            model(input_ids=y).logits, ref(y, segment_ids=document_segments(y, eod)), rtol=0, atol=1e-6
        )


def test_hf_document_mask_generate_and_errors(exported_docs: dict, exported: dict, data_dir: Path) -> None:
    """generate() on a prompt holding the end-of-document token equals the project's cache decoder (a new
    document after it); packed position_ids with a cache, ids that do not count up, and resets given to a
    model without the mask are one-line errors."""
    from data_prep.index import load_index
    from fpa_model.cache import generate
    from pipeline.export import load_exported

    cfg, plain, hf_dir = exported_docs["fpa"]
    model, _ = _load(hf_dir)
    ref = load_exported(plain)
    eod = load_index(data_dir).eod_id
    a, b = _docs(cfg, eod, [11, 8], seed=9)
    x = torch.tensor([a + [eod] + b])
    # eos_token_id=None: transformers would read the eod (= pad) in the prompt as padding; say it is not.
    ones = torch.ones_like(x)
    out = model.generate(
        x, attention_mask=ones, max_new_tokens=10, do_sample=False, eos_token_id=None,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    want, _ = generate(ref, x, 10, eod_id=eod)
    new = out.sequences[:, x.shape[1] :]
    assert new.tolist() == want.tolist()
    # Every step's logits are those of the last document run alone (the first is invisible after the eod).
    alone = torch.cat([torch.tensor([b]), new[:, :-1]], dim=1)
    with torch.no_grad():
        want_logits = ref(alone, segment_ids=torch.zeros_like(alone))[:, len(b) - 1 :]
    torch.testing.assert_close(torch.stack(out.logits, 1), want_logits, rtol=1e-4, atol=1e-4)
    pos = torch.tensor([list(range(11)) + list(range(9))])
    with pytest.raises(ValueError, match="served by the full forward"):
        model(input_ids=x, position_ids=pos, use_cache=True)
    with pytest.raises(ValueError, match="count up by 1"):
        model(input_ids=x, position_ids=pos + (pos > 3).long())
    plain_model, _ = _load(exported["fpa"][2])
    with pytest.raises(ValueError, match="without model.attention.document_mask"):
        plain_model(input_ids=x, position_ids=pos)
    with torch.no_grad():  # position ids without resets change nothing there
        torch.testing.assert_close(
            plain_model(input_ids=x, position_ids=torch.arange(20)[None]).logits,
            plain_model(input_ids=x).logits, rtol=0, atol=0,
        )  # fmt: skip


def test_hf_export_with_tile_skipping_skips_as_the_project_and_stays_within_epsilon(
    tmp_path: Path, data_dir: Path
) -> None:
    """model.attention.skip_epsilon travels into the HF export: the loaded model skips exactly the tiles
    the project's model skips (the same count, the same logits), most of them on these fast-falling
    fields, and its logits stay near the unskipped model's (skipping changes them, a little). Generation
    goes through the KV cache, which has no tiles, so it matches the project's decoder as before."""
    import dataclasses

    from fpa_model.cache import EvictionPolicy, generate
    from fpa_model.model import GPT
    from fpa_model.ops.fpa.skipping import skip_counts
    from launch.cli import main
    from pipeline.config import to_yaml
    from pipeline.export import load_exported

    eps = 1e-3
    over = [f"model.attention.skip_epsilon={eps}", "model.attention.block_size=16"]
    cfg = run_cfg(tmp_path, data_dir, "hf-skip", "fpa", over)
    plain = export_random_model(cfg, seed=5)
    yaml = tmp_path / "skip.yaml"
    yaml.write_text(to_yaml(cfg))
    assert main(["export", str(yaml), "--format", "hf", "--checkpoint", str(plain)]) == 0
    model, _ = _load(cfg.run_dir / "export-hf")
    assert model.config.fpa_model["attention"]["skip_epsilon"] == eps
    ref = load_exported(plain)
    off_cfg = dataclasses.replace(
        cfg.model, attention=dataclasses.replace(cfg.model.attention, skip_epsilon=None)
    )
    unskipped = GPT(off_cfg).eval()
    unskipped.load_state_dict(ref.state_dict())

    x = torch.randint(1, cfg.model.vocab_size, (2, 192), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        with skip_counts() as hf_counts:
            got = model(x).logits
        with skip_counts() as ref_counts:
            want = ref(x)
        with skip_counts() as off_counts:
            full = unskipped(x)
    assert (hf_counts.kept, hf_counts.skipped) == (ref_counts.kept, ref_counts.skipped)
    assert hf_counts.fraction_skipped > 0.5, (hf_counts.kept, hf_counts.skipped)
    assert off_counts.total == 0  # skipping off: the plain op, nothing counted
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    diff = float((got - full).abs().max())
    assert 0 < diff < eps, diff  # 2.6e-5 here: skipping changed the logits, within the guarantee's scale

    prompt = x[:1, :40]
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
    want_tokens, _ = generate(ref, prompt, 8, policy=EvictionPolicy(enabled=False))
    assert out[:, prompt.shape[1] :].tolist() == want_tokens.tolist()
