"""experiments/passkey_sharpness.py: every logit x s through the qk-norm gains, log-n scaling switched off and
on, the model restored afterwards, the trained scale read from the gains, gain scales refused without
qk-norm."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experiments import passkey_sharpness as ps
from experiments.trained_run import TrainedRun
from fpa_model.model import GPT
from pipeline.config import load_config


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


def test_probe_scales_every_logit_and_switches_log_n_then_restores_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tr = _run()
    x = torch.randn(1, 40, 16, generator=torch.Generator().manual_seed(1))
    base = _logits(tr, x)[..., :8, :]  # positions < 8: no log-n factor at any setting below
    far = _logits(tr, x)[..., 30:, :]
    before = [p.detach().clone() for p in tr.model.parameters()]
    cfgs = [b.attn.cfg for b in tr.model.blocks]
    seen = []

    def fake_grid(run: TrainedRun, *, trials: int, policy_for) -> dict:
        assert run is tr and trials == 3 and not policy_for(128).enabled
        logits = _logits(run, x)
        ratio = float((logits[..., :8, :] / base).mean())
        # the log-n factor alone: ln(31..40) / ln 8 = 1.65-1.77 when on
        far_ratio = float((logits[..., 30:, :] / far).mean() / ratio)
        seen.append((round(ratio, 4), far_ratio > 1.5))
        return {str(n): {"accuracy": min(1.0, ratio / 2)} for n in run.lengths}

    monkeypatch.setattr(ps, "passkey_by_length", fake_grid)
    rows = ps.probe(tr, [1.0, 4.0], trials=3, log_n=[None, 8])
    assert seen == [(1.0, False), (4.0, False), (1.0, True), (4.0, True)]
    assert [(r["log_n"], r["scale"], r["accuracy"]["256"]) for r in rows] == [
        (None, 1.0, 0.5),
        (None, 4.0, 1.0),
        (8, 1.0, 0.5),
        (8, 4.0, 1.0),
    ]
    for p, b in zip(tr.model.parameters(), before):
        assert torch.equal(p, b)  # the probe leaves the model as it found it
    assert [b.attn.cfg for b in tr.model.blocks] == cfgs


def test_trained_scale_is_the_gains_product_and_plain_models_are_refused() -> None:
    assert ps.logit_scale(_run()) == pytest.approx(1.0)
    assert ps.logit_scale(_run(scale=2.5)) == pytest.approx(2.5)
    assert ps.logit_scale(_run(qk_norm=False)) is None
    with pytest.raises(SystemExit, match="without qk-norm"):
        ps.probe(_run(qk_norm=False), [1.5], trials=1, log_n=[None])


def test_markdown_row() -> None:
    res = [
        {
            "run": "x.s0",
            "kind": "fpa",
            "seed": 0,
            "qk_norm_scale": 2.0,
            "trained_scale": 2.1234,
            "lengths": [128, 256],
            "rows": [
                {"scale": 1.5, "log_n": None, "accuracy": {"128": 1.0, "256": 0.84}},
                {"scale": 1.0, "log_n": 256, "accuracy": {"128": 1.0, "256": 1.0}},
            ],
        }
    ]
    md = ps.markdown(res, ps.provenance())
    assert "| x.s0 | fpa | 0 | 2 | 2.12 | off | 1.5 | 1.00 | 0.84 |" in md
    assert "| x.s0 | fpa | 0 | 2 | 2.12 | from 256 | 1 | 1.00 | 1.00 |" in md
