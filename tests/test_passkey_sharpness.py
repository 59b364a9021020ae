"""bench/passkey_sharpness.py: every logit x s through the qk-norm gains, the gains restored afterwards, the
trained scale read from the gains, models without qk-norm refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import passkey_sharpness as ps  # noqa: E402
from bench.trained_run import TrainedRun  # noqa: E402
from fpa_model.model import GPT  # noqa: E402
from pipeline.config import load_config  # noqa: E402


def _run(qk_norm: bool = True, scale: float = 1.0) -> TrainedRun:
    over = ["model.vocab_size=64", "model.n_layer=2", "model.n_head=2", "model.d_model=16"]
    over += [f"model.attention.qk_norm={str(qk_norm).lower()}"]
    if qk_norm:
        over.append(f"model.attention.qk_norm_scale={scale}")
    cfg = load_config([], over)
    torch.manual_seed(0)
    return TrainedRun(Path("runs/x.s0"), cfg, GPT(cfg.model).eval(), None, None, [128, 256], [0.0], None)


def _logits(tr: TrainedRun, x: torch.Tensor) -> torch.Tensor:
    q, k, _, _ = tr.model.blocks[0].attn.project(x)
    return q @ k.transpose(-1, -2)


def test_probe_scales_every_logit_then_restores_the_gains(monkeypatch: pytest.MonkeyPatch) -> None:
    tr = _run()
    x = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(1))
    base = _logits(tr, x)
    before = [p.detach().clone() for p in tr.model.parameters()]
    seen = []

    def fake_grid(run: TrainedRun, *, trials: int, policy_for) -> dict:
        assert run is tr and trials == 3 and not policy_for(128).enabled
        ratio = float((_logits(run, x) / base).mean())
        seen.append(ratio)
        return {str(n): {"accuracy": min(1.0, ratio / 2)} for n in run.lengths}

    monkeypatch.setattr(ps, "passkey_by_length", fake_grid)
    rows = ps.probe(tr, [1.0, 1.5, 4.0], trials=3)
    assert seen == pytest.approx([1.0, 1.5, 4.0], rel=1e-5)
    assert [r["accuracy"]["256"] for r in rows] == pytest.approx([0.5, 0.75, 1.0])
    for p, b in zip(tr.model.parameters(), before):
        assert torch.equal(p, b)  # the probe leaves the model as it found it


def test_trained_scale_is_the_gains_product_and_plain_models_are_refused() -> None:
    assert ps.logit_scale(_run()) == pytest.approx(1.0)
    assert ps.logit_scale(_run(scale=2.5)) == pytest.approx(2.5)
    with pytest.raises(SystemExit, match="without qk-norm"):
        ps.probe(_run(qk_norm=False), [1.0], trials=1)


def test_markdown_row() -> None:
    res = [
        {
            "run": "x.s0",
            "seed": 0,
            "qk_norm_scale": 2.0,
            "trained_scale": 2.1234,
            "lengths": [128, 256],
            "rows": [{"scale": 1.5, "accuracy": {"128": 1.0, "256": 0.84}}],
        }
    ]
    md = ps.markdown(res, ps.provenance())
    assert "| x.s0 | 0 | 2 | 2.12 | 1.5 | 1.00 | 0.84 |" in md
