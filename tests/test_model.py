"""The Attention layer and the GPT model: shapes, parameter count, FoX equivalences, decode pieces, init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fpa_model.attention import Attention, apply_rope, gate_bias_for_increment, rope_cos_sin
from fpa_model.config import AttentionConfig, ModelConfig
from fpa_model.model import GPT
from pipeline.loss import lm_loss

D, H = 32, 4


def _x(b=2, t=12, seed=0):
    return torch.randn(b, t, D, generator=torch.Generator().manual_seed(seed))


def _attn(seed=0, **kw) -> Attention:
    torch.manual_seed(seed)
    kw.setdefault("impl", "naive")
    return Attention(D, H, AttentionConfig(**kw), max_seq_len=64)


def tiny_cfg(**attn) -> ModelConfig:
    attn.setdefault("impl", "naive")
    return ModelConfig(vocab_size=50, n_layer=2, n_head=H, d_model=D, attention=AttentionConfig(**attn))


# ----------------------------------------------------------------------------------------------------
# Attention


@pytest.mark.parametrize(
    "kind,field", [("fpa", "walk"), ("fpa", "gate"), ("fpa", "direct"), ("fox", "walk"), ("softmax", "walk")]
)
def test_attention_shapes_and_gradients(kind, field):
    attn = _attn(kind=kind, field=field, qk_norm=True, output_gate=True, field_weight_std=0.02)
    x = _x().requires_grad_()
    q, k, v, u = attn.project(x)
    assert q.shape == k.shape == v.shape == (2, H, 12, D // H)
    assert (u is None) == (kind == "softmax")
    if u is not None:
        assert u.shape == (2, H, 12) and u.dtype == torch.float32
    y = attn(x)
    assert y.shape == x.shape
    y.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in attn.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if name != "field_proj.bias" or kind != "softmax":
            assert p.grad.abs().sum() > 0, f"{name} gets no gradient"


def test_fpa_gate_field_equals_fox():
    """docs/design.md, "The first-passage bias": with the gate parametrization the field never rises, so
    FPA is exactly FoX."""
    fpa = _attn(kind="fpa", field="gate", field_weight_std=0.1)
    fox = _attn(kind="fox", field="walk", field_weight_std=0.1)  # fox always uses the gate field
    fox.load_state_dict(fpa.state_dict())
    x = _x()
    torch.testing.assert_close(fpa(x), fox(x), atol=1e-6, rtol=1e-5)
    _, _, _, u = fpa.project(x)
    assert (u <= 0).all()


def test_walk_with_rising_field_differs_from_fox():
    """With signed increments the range-min bias is not FoX's: the two kinds must give different outputs."""
    from fpa_model.ops.fpa import fpa_attention

    fpa = _attn(kind="fpa", field="walk", field_weight_std=0.3)
    x = _x()
    q, k, v, u = fpa.project(x)
    assert (u > 0).any() and (u < 0).any()
    phi = fpa.field_from_increments(u)
    o_fpa = fpa.attend(q, k, v, phi)
    o_fox = fpa_attention(q, k, v, phi, kind="fox", impl="naive")  # same field, bias phi_i - phi_j
    assert (o_fpa - o_fox).abs().max() > 1e-3


def test_fresh_fpa_head_is_a_fox_head():
    """field_weight_std=0: every increment is c_h < 0, phi falls monotonically, and fpa == fox at init."""
    fpa = _attn(kind="fpa", field="walk")
    fox = _attn(kind="fox")
    sd = {k: v for k, v in fpa.state_dict().items() if not k.startswith("field_proj")}
    fox.load_state_dict(sd, strict=False)
    x = _x()
    _, _, _, u_fpa = fpa.project(x)
    _, _, _, u_fox = fox.project(x)
    expected = torch.linspace(-0.2, -0.02, H)
    torch.testing.assert_close(u_fpa[0, :, 0], expected)
    torch.testing.assert_close(u_fox[0, :, 0], expected, atol=1e-6, rtol=1e-5)  # via the gate bias
    torch.testing.assert_close(fpa(x), fox(x), atol=1e-6, rtol=1e-5)


def test_gate_bias_inverts_logsigmoid():
    for c in (-0.5, -0.2, -0.02, -1e-3):
        assert F.logsigmoid(torch.tensor(gate_bias_for_increment(c))).item() == pytest.approx(c, rel=1e-5)
    with pytest.raises(ValueError, match="field_bias_init"):
        gate_bias_for_increment(0.1)


@pytest.mark.parametrize("field", ["walk", "gate", "direct"])
def test_field_from_increments_continues_across_chunks(field):
    """Decode: phi of a suffix computed from phi_prev equals the full-sequence field."""
    attn = _attn(kind="fpa", field=field, field_weight_std=0.2)
    x = _x(t=10)
    _, _, _, u = attn.project(x)
    full = attn.field_from_increments(u)
    head = attn.field_from_increments(u[..., :6])
    tail = attn.field_from_increments(u[..., 6:], phi_prev=head[..., -1])
    torch.testing.assert_close(torch.cat([head, tail], -1), full)
    if field == "direct":
        torch.testing.assert_close(full, u)


def test_incremental_decode_with_public_steps_matches_forward():
    """project(pos_offset) + field_from_increments(phi_prev) + attend + output == forward, token by token."""
    attn = _attn(kind="fpa", field="walk", field_weight_std=0.2, rope=True, qk_norm=True, output_gate=True)
    x = _x(b=1, t=9)
    full = attn(x)
    ks, vs, phis, outs, phi_prev = [], [], [], [], None
    for t in range(9):
        q, k, v, u = attn.project(x[:, t : t + 1], pos_offset=t)
        phi = attn.field_from_increments(u, phi_prev)
        phi_prev = phi[..., -1]
        ks.append(k), vs.append(v), phis.append(phi)
        o = attn.attend(q, torch.cat(ks, 2), torch.cat(vs, 2), torch.cat(phis, -1))
        outs.append(attn.output(o, x[:, t : t + 1]))
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-4)


def test_rope_rotation_is_relative():
    """RoPE: q_i . k_j depends on i - j only, and the table extends past max_seq_len."""
    qv, kv = torch.randn(8), torch.randn(8)
    dots = []
    for off in (0, 5, 200):
        cos, sin = rope_cos_sin(torch.tensor([off + 3, off]), 8)
        q = apply_rope(qv.view(1, 1, 1, 8).expand(1, 1, 2, 8), cos, sin)
        k = apply_rope(kv.view(1, 1, 1, 8).expand(1, 1, 2, 8), cos, sin)
        dots.append(float(q[0, 0, 0] @ k[0, 0, 1]))
    assert dots[0] == pytest.approx(dots[1], abs=1e-4) and dots[0] == pytest.approx(dots[2], abs=1e-4)
    attn = _attn(kind="softmax")
    assert attn.use_rope
    cos, _ = attn._rope_tables(60, 10, torch.device("cpu"))  # crosses max_seq_len=64
    torch.testing.assert_close(cos, rope_cos_sin(torch.arange(60, 70), D // H)[0])


def test_attention_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        Attention(30, 4, AttentionConfig(), 16)


# ----------------------------------------------------------------------------------------------------
# GPT


def test_gpt_shapes_and_parameter_count():
    cfg = tiny_cfg()
    model = GPT(cfg)
    idx = torch.randint(0, 50, (3, 16))
    assert model(idx).shape == (3, 16, 50)
    d, f, L, V = D, cfg.ffn_hidden, cfg.n_layer, 50
    per_layer = 4 * d * d + (d * H + H) + 3 * d * f + 2 * d  # qkv+out, field proj, SwiGLU, two norms
    assert model.num_parameters() == V * d + L * per_layer + d  # tied head counted once
    assert model.num_parameters(non_embedding=True) == L * per_layer + d
    untied = GPT(ModelConfig(**{**cfg.__dict__, "tie_embeddings": False}))
    assert untied.num_parameters() == model.num_parameters() + V * d


def test_gpt_110m_preset_size():
    from pipeline.config import load_config

    cfg = load_config(["configs/model/110m.yaml"], ["model.vocab_size=32768"]).model
    with torch.device("meta"):
        n = GPT(cfg).num_parameters()
    assert 100e6 < n < 140e6, n


def test_gpt_is_causal():
    model = GPT(tiny_cfg()).eval()
    idx = torch.randint(0, 50, (1, 16))
    idx2 = idx.clone()
    idx2[0, 10:] = (idx2[0, 10:] + 1) % 50
    with torch.no_grad():
        a, b = model(idx), model(idx2)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-4


def test_gpt_init_follows_fox_recipe():
    cfg = ModelConfig(
        vocab_size=512, n_layer=4, n_head=4, d_model=256, attention=AttentionConfig(impl="naive")
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    std = cfg.init_std
    assert model.embed.weight.std().item() == pytest.approx(std, rel=0.05)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(std, rel=0.05)
    out_std = std / math.sqrt(2 * cfg.n_layer)
    assert model.blocks[0].attn.out_proj.weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert model.blocks[0].mlp.down.weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert model.lm_head.weight is model.embed.weight


def test_gpt_chunked_matches_naive():
    """The chunked attention path (the default on CPU) gives the naive model's logits and gradients."""
    torch.manual_seed(0)
    naive = GPT(tiny_cfg(impl="naive", field_weight_std=0.1, block_size=4))
    chunked = GPT(tiny_cfg(impl="chunked", field_weight_std=0.1, block_size=4))
    chunked.load_state_dict(naive.state_dict())
    idx = torch.randint(0, 50, (2, 13))
    la, lb = naive(idx), chunked(idx)
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-4)
    la.square().mean().backward()
    lb.square().mean().backward()
    for (n, pa), (_, pb) in zip(naive.named_parameters(), chunked.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-5, rtol=1e-3, msg=n)


def test_gpt_requires_vocab_size():
    with pytest.raises(ValueError, match="vocab_size"):
        GPT(ModelConfig())


def test_gpt_loss_and_flops():
    model = GPT(tiny_cfg())
    idx = torch.randint(0, 50, (2, 8))
    loss = lm_loss(model(idx), torch.roll(idx, -1, dims=1))
    assert loss.item() == pytest.approx(math.log(50), rel=0.1)  # near-uniform predictions at init
    n = model.num_parameters(non_embedding=True) + 50 * D
    assert model.flops_per_token(8) == 6 * n + 6 * 2 * 8 * D
