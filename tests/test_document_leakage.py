"""experiments/document_leakage.py against two oracles: a model whose queries are zero attends uniformly,
so its leak equals the uniform column; an FPA field with a constant step and one dip at the eod token has
a boundary bias of exactly that dip."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from experiments.document_leakage import BINS, layer_probabilities, window_stats
from fpa_model.config import AttentionConfig, ModelConfig
from fpa_model.model import GPT

EOD, V, D = 0, 23, 16


def _model(kind: str, n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    att = AttentionConfig(kind=kind, impl="chunked", block_size=8, field_weight_std=0.3)
    return GPT(ModelConfig(vocab_size=V, n_layer=n_layer, n_head=2, d_model=D, attention=att)).eval()


def _windows(n: int = 6, t: int = 48, spaced: bool = False) -> torch.Tensor:
    x = torch.randint(1, V, (n, t), generator=torch.Generator().manual_seed(3))
    for r in range(n):
        # ragged documents, a one-token one among them; spaced: eods 20 apart (a pair at distance <= 16
        # then crosses at most one)
        x[r, [10 + r, 30 + r] if spaced else [5 + r, 20 + 2 * r, 21 + 2 * r]] = EOD
    return x


def test_probabilities_are_the_models_attention():
    model = _model("fpa")
    layers = layer_probabilities(model, _windows())
    assert len(layers) == 2
    for layer in layers:
        p = layer["p"]
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]), atol=1e-5, rtol=0)
        assert float(p.triu(1).abs().max()) == 0.0  # causal


@pytest.mark.parametrize("kind", ["softmax", "fpa"])
def test_zero_queries_leak_as_much_as_uniform_attention(kind):
    """q = 0 makes every logit 0: softmax attention is uniform over the causal keys, so the leak equals the
    uniform column; an fpa field erases keys, so it leaks less."""
    model = _model(kind)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[:D].zero_()
    res = window_stats(model, _windows(), EOD, batch=4)
    counted = [i for i, c in enumerate(res["queries"]) if c > 0]
    assert len(counted) >= 5
    for layer in res["leak"]:
        got, want = np.asarray(layer)[counted], np.asarray(res["uniform"])[counted]
        if kind == "softmax":
            np.testing.assert_allclose(got, want, rtol=1e-5)
        else:
            assert (got < want - 1e-3).any() and (got <= want + 1e-6).all()
    assert "boundary_bias" not in res or kind == "fpa"


def test_a_dip_at_the_eod_is_the_boundary_bias():
    """u = -0.1 on every token and -5.1 on the eod: a pair across the boundary at distance d has
    b = (d - 1)(-0.1) - 5.1, inside one document d(-0.1): the boundary bias is -5 in every head."""
    model = _model("fpa", n_layer=1)
    attn = model.blocks[0].attn
    with torch.no_grad():
        model.embed.weight[:, 0] = 0.0
        model.embed.weight[EOD] = 0.0
        model.embed.weight[EOD, 0] = 1.0  # RMSNorm makes it sqrt(D) e_0
        attn.field_proj.weight.zero_()
        attn.field_proj.weight[:, 0] = -5.0 / math.sqrt(D)
        attn.field_proj.bias.fill_(-0.1)
    res = window_stats(model, _windows(spaced=True), EOD, batch=4)
    np.testing.assert_allclose(np.asarray(res["boundary_bias"]), -5.0, atol=1e-4)
    assert np.all(np.asarray(res["eod_increment_z"]) < -1e3)  # every eod step is the dip
    assert len(res["leak"][0]) == len(BINS)
