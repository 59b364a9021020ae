"""Sampling with the project's KV cache (fpa_model.cache.sample_next / generate) and `fpa generate`: greedy
results unchanged, the seed reproduces a sample, the text is streamed as produced, the cache fraction is
printed with --evict, and bad input is a one-line error with a non-zero exit."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from hf_support import export_random_model, prepare_tiny_data, run_cfg


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny_data(tmp_path_factory.mktemp("gendata") / "data")


def _tiny_model(kind: str = "fpa") -> torch.nn.Module:
    from fpa_model.config import AttentionConfig, ModelConfig
    from fpa_model.model import GPT

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, n_layer=2, n_head=2, d_model=32, init_std=0.3)
    cfg.attention = AttentionConfig(kind=kind, field_weight_std=0.3)
    return GPT(cfg).eval()


def test_sample_next_greedy_top_k_and_seed() -> None:
    from fpa_model.cache import sample_next

    logits = torch.randn(3, 50)
    assert torch.equal(sample_next(logits), logits.argmax(-1))
    assert torch.equal(sample_next(logits, 1.0, top_k=1, generator=torch.Generator()), logits.argmax(-1))
    a = sample_next(logits[:1].expand(200, 50), 1.0, top_k=3, generator=torch.Generator().manual_seed(5))
    b = sample_next(logits[:1].expand(200, 50), 1.0, top_k=3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    top3 = logits[:1].expand(200, 50).topk(3, dim=-1).indices
    assert bool((top3 == a[:, None]).any(-1).all())  # only the 3 most likely tokens are drawn
    assert len(set(a.tolist())) > 1
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, -1.0)
    with pytest.raises(ValueError, match="top_k"):
        sample_next(logits, 1.0, top_k=0)


def test_generate_greedy_unchanged_and_sampling_reproducible() -> None:
    from fpa_model.cache import decode_step, generate, prefill

    model = _tiny_model()
    x = torch.randint(0, 40, (2, 9))
    # Greedy is still prefill + argmax decode steps.
    logits, cache = prefill(model, x)
    want = []
    for _ in range(6):
        want.append(logits.argmax(-1))
        logits = decode_step(model, cache, want[-1])
    got, _ = generate(model, x, 6)
    assert got.tolist() == torch.stack(want, 1).tolist()

    seen = []
    s1, _ = generate(
        model,
        x,
        12,
        temperature=1.0,
        top_k=10,
        generator=torch.Generator().manual_seed(3),
        on_token=seen.append,
    )
    s2, _ = generate(model, x, 12, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(3))
    s3, _ = generate(model, x, 12, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(4))
    assert torch.equal(s1, s2) and not torch.equal(s1, s3)
    assert torch.equal(torch.stack(seen, 1), s1)  # on_token saw every step's tokens, in order


@pytest.fixture
def run(tmp_path: Path, data_dir: Path) -> tuple:
    from pipeline.config import to_yaml

    cfg = run_cfg(tmp_path, data_dir, "gen", "fpa")
    export_random_model(cfg)
    yaml = tmp_path / "gen.yaml"
    yaml.write_text(to_yaml(cfg))
    return cfg, yaml


def test_fpa_generate_streams_and_seed_reproduces(run: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    from launch.cli import main
    from pipeline.generate import generate_text

    cfg, yaml = run
    args = ["generate", str(yaml), "In the beginning", "--max-new-tokens", "20", "--temperature", "0.9"]
    assert main([*args, "--top-k", "30", "--seed", "7"]) == 0
    first = capsys.readouterr()
    assert main([*args, "--top-k", "30", "--seed", "7"]) == 0
    second = capsys.readouterr()
    assert first.out == second.out and first.out.strip()
    assert main([*args, "--top-k", "30", "--seed", "8"]) == 0
    assert capsys.readouterr().out != first.out

    # Streaming: the pieces written while decoding add up to the final text, in more than one write.
    class Recorder(io.StringIO):
        writes: list[str] = []

        def write(self, s: str) -> int:
            self.writes.append(s)
            return super().write(s)

    rec = Recorder()
    res = generate_text(
        cfg, "In the beginning", max_new_tokens=20, temperature=0.9, top_k=30, seed=7, out=rec
    )
    assert rec.getvalue() == first.out == res["text"] + "\n"
    assert len([w for w in rec.writes if w]) > 2

    # --evict: the fraction of the cache kept, on stderr after the text.
    assert main(["generate", str(yaml), "And God said", "--max-new-tokens", "30", "--evict"]) == 0
    err = capsys.readouterr().err
    assert "cache kept:" in err and "per layer" in err
    greedy = generate_text(cfg, "And God said", max_new_tokens=30, evict=True, out=io.StringIO())
    assert 0.0 < greedy["cache_fraction"] < 1.0


def test_fpa_generate_bad_input_is_one_line(
    run: tuple, tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from launch.cli import main
    from pipeline.config import to_yaml

    cfg, yaml = run
    empty = run_cfg(tmp_path, data_dir, "no-weights", "fpa")
    no_weights = tmp_path / "none.yaml"
    no_weights.write_text(to_yaml(empty))
    cases = [
        ([str(no_weights), "hello"], "no exported weights"),
        ([str(yaml), "hello", "--checkpoint", str(tmp_path / "nowhere")], "no exported weights"),
        ([str(yaml), "   "], "the prompt is empty"),
        ([str(yaml), "light " * 300], "exceeds model.max_seq_len=256"),
        ([str(yaml), "hello", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        ([str(yaml), "hello", "--temperature", "-1"], "--temperature must be >= 0"),
    ]
    for argv, message in cases:
        assert main(["generate", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("fpa: error:") and message in err and "\n" not in err, err
