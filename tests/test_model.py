"""The Attention layer and the GPT model: shapes, parameter count, FoX equivalences, decode pieces, init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fpa_model.attention import Attention, apply_rope, gate_bias_for_increment, rope_cos_sin
from fpa_model.config import AttentionConfig, ModelConfig
from fpa_model.model import GPT
from pipeline.trainer.loss import lm_loss

D, H = 32, 4


def _x(b=2, t=12, seed=0):
    return torch.randn(b, t, D, generator=torch.Generator().manual_seed(seed))


def _attn(seed=0, **kw) -> Attention:
    torch.manual_seed(seed)
    kw.setdefault("impl", "naive")
    return Attention(D, H, AttentionConfig(**kw), max_seq_len=64)


def test_qk_norm_scale_multiplies_every_logit_at_init() -> None:
    """qk_norm_scale=s starts the q and k gains at sqrt(s): the same raw weights give s times every q.k."""
    x = _x()
    plain, scaled = _attn(qk_norm=True), _attn(qk_norm=True, qk_norm_scale=2.5)
    for norm in (scaled.q_norm, scaled.k_norm):
        assert norm is not None
        torch.testing.assert_close(norm.weight.detach(), torch.full((H, D // H), 2.5**0.5))
    q1, k1, _, _ = plain.project(x)
    q2, k2, _, _ = scaled.project(x)
    torch.testing.assert_close(
        q2 @ k2.transpose(-1, -2), 2.5 * (q1 @ k1.transpose(-1, -2)), rtol=1e-5, atol=1e-5
    )


def test_log_scale_length_scales_queries_past_the_training_length_only() -> None:
    """Queries at positions i >= L are multiplied by ln(i + 1) / ln(L), earlier ones are untouched (bit for
    bit, so training on L tokens is unchanged); keys, values and the field never change."""
    from fpa_model.attention import log_length_factor

    f = log_length_factor(0, 40, 16)
    expect = torch.tensor([max(1.0, math.log(i + 1) / math.log(16)) for i in range(40)])
    torch.testing.assert_close(f, expect)
    assert torch.all(f[:16] == 1.0) and f[15] == 1.0 and f[16] > 1.0
    x = _x(t=40)
    plain, scaled = _attn(qk_norm=True), _attn(qk_norm=True, log_scale_length=16)
    q1, k1, v1, u1 = plain.project(x)
    q2, k2, v2, u2 = scaled.project(x)
    torch.testing.assert_close(q2, q1 * f[:, None])
    assert torch.equal(k1, k2) and torch.equal(v1, v2) and torch.equal(u1, u2)
    assert torch.equal(plain(x[:, :16]), scaled(x[:, :16]))  # inside the training length: the same op
    q3, *_ = scaled.project(x[:, 30:], pos_offset=30)  # decode offsets: the factor of the absolute position
    torch.testing.assert_close(q3, q1[:, :, 30:] * f[30:, None])
    with pytest.raises(ValueError, match="log_scale_length must be >= 2"):
        AttentionConfig(log_scale_length=1)


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


# ----------------------------------------------------------------------------------------------------
# Key/value shift (model.attention.kv_shift)


def _shift_attn(seed=0, **kw) -> Attention:
    attn = _attn(seed, kv_shift=True, field_weight_std=0.3, **kw)
    with torch.no_grad():  # gates away from the 50/50 init, different per head, token and k / v
        attn.shift_proj.weight.normal_(0, 0.5)
        attn.shift_proj.bias.uniform_(-2.0, 2.0)
    return attn


def _shift_reference(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """The layer from the formula, token by token: raw projections, k'_t = g_k k_t + (1 - g_k) k_{t-1}
    (v likewise, k_{-1} = v_{-1} = 0), then qk-norm and RoPE at position t, the naive op, the output."""
    from fpa_model.ops.fpa.naive import fpa_attention_naive

    b, t, _ = x.shape
    q, k, v = F.linear(x, attn.qkv.weight).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
    g = torch.sigmoid(F.linear(x, attn.shift_proj.weight, attn.shift_proj.bias))  # (B, T, 2H)
    ks, vs = [], []
    for s in range(t):
        gk, gv = g[:, s, :H, None], g[:, s, H:, None]
        kp, vp = (k[:, :, s - 1], v[:, :, s - 1]) if s else (torch.zeros_like(k[:, :, 0]),) * 2
        ks.append(gk * k[:, :, s] + (1 - gk) * kp)
        vs.append(gv * v[:, :, s] + (1 - gv) * vp)
    k, v = torch.stack(ks, 2), torch.stack(vs, 2)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if attn.use_rope:
        cos, sin = rope_cos_sin(torch.arange(t), D // H)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    phi = None
    if attn.field_proj is not None:
        pre = F.linear(x, attn.field_proj.weight, attn.field_proj.bias).transpose(1, 2)
        u = F.logsigmoid(pre) if attn.field_mode == "gate" else pre
        phi = u if attn.field_mode == "direct" else u.cumsum(-1)
    return attn.output(fpa_attention_naive(q, k, v, phi, kind=attn.kind), x)


SHIFT_CASES = [
    ("fpa", "walk", {"rope": True, "qk_norm": True, "output_gate": True}),
    ("fpa", "direct", {}),
    ("fox", "gate", {}),
    ("softmax", "walk", {}),
]


SHIFT_IMPL_CASES = [(impl, *case) for impl in ("naive", "chunked") for case in SHIFT_CASES] + [
    pytest.param("triton", *SHIFT_CASES[0], marks=pytest.mark.triton)  # one: the interpreter is slow
]
SHIFT_IMPL_IDS = [f"{i}-{k}-{f}" for i in ("naive", "chunked") for k, f, _ in SHIFT_CASES] + [
    "triton-fpa-walk"
]


@pytest.mark.parametrize("impl,kind,field,extra", SHIFT_IMPL_CASES, ids=SHIFT_IMPL_IDS)
def test_kv_shift_forward_and_grads_match_formula(impl, kind, field, extra):
    """The layer with kv_shift = the formula on the raw projections (before qk-norm / RoPE), output and
    every gradient, on each attention impl (the shift lives in the projection; the ops are unchanged)."""
    attn = _shift_attn(kind=kind, field=field, impl=impl, block_size=4, **extra)
    x = _x(t=11).requires_grad_()
    got = attn(x)
    got.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in attn.named_parameters()} | {"x": x.grad.clone()}
    attn.zero_grad()
    x.grad = None
    ref = _shift_reference(attn, x)
    ref.square().sum().backward()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    for n, p in [*attn.named_parameters(), ("x", x)]:
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-3, msg=n)
    assert grads["shift_proj.weight"].abs().sum() > 0 and grads["shift_proj.bias"].abs().sum() > 0
    # The shift is real: the same weights without it give another output.
    plain = _attn(kind=kind, field=field, impl="naive", **extra)
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if not k.startswith("shift_proj")})
    assert (plain(x) - got).abs().max() > 1e-3


def test_kv_shift_init_is_an_even_mix_and_off_adds_nothing():
    """Zero-init gates: k'_t = (k_t + k_{t-1}) / 2 at start. Off (the default): no parameters, so configs
    and checkpoints without the key load unchanged."""
    assert AttentionConfig().kv_shift is False
    attn = _attn(kv_shift=True, rope=True)
    assert not attn.shift_proj.weight.any() and not attn.shift_proj.bias.any()
    x = _x(t=6)
    q, k, v = attn.raw_qkv(x)
    _, k2, v2 = attn.raw_qkv(x)
    ks, vs = attn.shift_kv(x, k, v)
    torch.testing.assert_close(ks[:, :, 1:], (k2[:, :, 1:] + k2[:, :, :-1]) / 2)
    torch.testing.assert_close(vs[:, :, 0], v2[:, :, 0] / 2)  # v_{-1} = 0
    torch.testing.assert_close(attn(x), _shift_reference(attn, x), atol=1e-5, rtol=1e-4)

    off, on = GPT(tiny_cfg()), GPT(tiny_cfg(kv_shift=True))
    assert not any("shift" in name for name in off.state_dict())
    extra = set(on.state_dict()) - set(off.state_dict())
    assert extra == {f"blocks.{i}.attn.shift_proj.{p}" for i in range(2) for p in ("weight", "bias")}
    assert on.num_parameters() - off.num_parameters() == 2 * (2 * H * D + 2 * H)
    old = {k: v for k, v in on.state_dict().items() if "shift" not in k}  # a checkpoint from before
    GPT(tiny_cfg()).load_state_dict(old, strict=True)


@pytest.mark.parametrize("chunks", [[1] * 9, [4, 1, 3, 1]], ids=["tokens", "mixed"])
def test_kv_shift_decode_with_carry_matches_forward(chunks):
    """project_with_carry(kv_prev) chunk by chunk == forward: the carry is the last raw k, v."""
    attn = _shift_attn(kind="fpa", field="walk", rope=True, qk_norm=True)
    x = _x(b=1, t=sum(chunks))
    full = attn(x)
    ks, vs, phis, outs, phi_prev, carry, t = [], [], [], [], None, None, 0
    for n in chunks:
        xc = x[:, t : t + n]
        (q, k, v, u), carry_next = attn.project_with_carry(xc, pos_offset=t, kv_prev=carry)
        raw_k, raw_v = attn.raw_qkv(xc)[1:]
        assert torch.equal(carry_next[0], raw_k[:, :, -1]) and torch.equal(carry_next[1], raw_v[:, :, -1])
        carry, t = carry_next, t + n
        phi = attn.field_from_increments(u, phi_prev)
        phi_prev = phi[..., -1]
        ks.append(k), vs.append(v), phis.append(phi)
        o = attn.attend(q, torch.cat(ks, 2), torch.cat(vs, 2), torch.cat(phis, -1))
        outs.append(attn.output(o, xc))
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-4)
    assert attn.project_with_carry(x)[1] is not None and _attn().project_with_carry(x)[1] is None
