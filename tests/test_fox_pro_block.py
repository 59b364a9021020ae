"""The FoX-Pro block's parts as options: model.attention.output_norm (a per-head RMSNorm of the attention
output before the output gate and the out projection) and model.attention.qk_norm_gains (per-head gains,
the default, or shared across heads as this project's runs before the key). Checked against the formula
written out here, in the decode cache, in the weight-decay groups, and for configs saved before the keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fpa_model.attention import Attention
from fpa_model.cache import decode_step, prefill
from fpa_model.config import AttentionConfig, ModelConfig
from fpa_model.model import GPT
from fpa_model.ops.fpa.naive import fpa_attention_naive

ROOT = Path(__file__).resolve().parents[1]
B, T, D, H = 2, 13, 32, 4
DH = D // H


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dim with gains w broadcast from the right: the definition, in float64."""
    return x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w


def _random_gains(attn: Attention, gen: torch.Generator) -> None:
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm, attn.out_norm):
            if norm is not None:
                norm.weight.copy_(torch.rand(norm.weight.shape, generator=gen) * 1.5 + 0.25)
        if attn.field_proj is not None:
            attn.field_proj.weight.normal_(0, 0.3, generator=gen)


@pytest.mark.parametrize("kind", ["fpa", "fox", "softmax"])
@pytest.mark.parametrize("gains", ["per_head", "shared"])
def test_block_equals_the_formula(kind: str, gains: str) -> None:
    """out = W_o ( sigmoid(W_g x) * concat_h RMSNorm_h(attn_h(RMSNorm_h(q_h), RMSNorm_h(k_h), v_h)) )."""
    cfg = AttentionConfig(kind=kind, qk_norm=True, qk_norm_gains=gains, output_norm=True, output_gate=True)
    torch.manual_seed(0)
    attn = Attention(D, H, cfg, max_seq_len=64)
    gen = torch.Generator().manual_seed(1)
    _random_gains(attn, gen)
    want_shape = (H, DH) if gains == "per_head" else (DH,)
    assert attn.q_norm.weight.shape == want_shape and attn.out_norm.weight.shape == (H, DH)
    x = torch.randn(B, T, D, generator=gen)

    attn = attn.double()
    xd = x.double()
    q, k, v = attn.qkv(xd).view(B, T, 3, H, DH).permute(2, 0, 3, 1, 4).unbind(0)
    wq, wk = attn.q_norm.weight.detach(), attn.k_norm.weight.detach()
    if gains == "per_head":
        wq, wk = wq[:, None, :], wk[:, None, :]  # (H, 1, Dh) against (B, H, T, Dh)
    q, k = _rms(q, wq), _rms(k, wk)
    if attn.use_rope:
        from fpa_model.attention import apply_rope

        cos, sin = attn._rope_tables(0, T, xd.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    phi = None
    if attn.field_proj is not None:
        u = torch.nn.functional.linear(xd, attn.field_proj.weight, attn.field_proj.bias).transpose(1, 2)
        if attn.field_mode == "gate":
            u = torch.nn.functional.logsigmoid(u)
        phi = torch.cumsum(u, -1)
    o = fpa_attention_naive(q, k, v, phi, kind=kind)
    o = _rms(o, attn.out_norm.weight.detach()[:, None, :])
    y = o.transpose(1, 2).reshape(B, T, D) * torch.sigmoid(attn.gate_proj(xd))
    ref = attn.out_proj(y)
    torch.testing.assert_close(attn(xd), ref, rtol=1e-5, atol=1e-6)  # the norms run in fp32
    # The output norm is there: without it the layer gives something else.
    attn.out_norm = None
    assert (attn(xd) - ref).abs().max() > 1e-3


def test_shared_gains_equal_per_head_gains_with_equal_rows() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, T, D, generator=gen)
    layers = []
    for gains in ("shared", "per_head"):
        torch.manual_seed(0)
        layers.append(Attention(D, H, AttentionConfig(qk_norm=True, qk_norm_gains=gains), max_seq_len=64))
    shared, per_head = layers
    _random_gains(shared, gen)
    with torch.no_grad():
        per_head.field_proj.weight.copy_(shared.field_proj.weight)
        per_head.q_norm.weight.copy_(shared.q_norm.weight.expand(H, DH))
        per_head.k_norm.weight.copy_(shared.k_norm.weight.expand(H, DH))
    torch.testing.assert_close(per_head(x), shared(x), rtol=0, atol=1e-6)
    with torch.no_grad():  # one head's gains changed: only per-head gains can do that
        per_head.q_norm.weight[2].mul_(3.0)
    assert (per_head(x) - shared(x)).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["fpa", "softmax"])
def test_decode_cache_equals_the_forward(kind: str) -> None:
    att = AttentionConfig(kind=kind, qk_norm=True, output_norm=True, output_gate=True, kv_shift=True)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=53, n_layer=2, n_head=H, d_model=D, max_seq_len=64, attention=att))
    gen = torch.Generator().manual_seed(3)
    for blk in model.blocks:
        _random_gains(blk.attn, gen)
    idx = torch.randint(0, 53, (2, 24), generator=gen)
    with torch.no_grad():
        ref = model(idx)
        logits, cache = prefill(model, idx[:, :15], chunk_size=4)
        torch.testing.assert_close(logits, ref[:, 14], atol=1e-5, rtol=1e-5)
        for t in range(15, 24):
            torch.testing.assert_close(decode_step(model, cache, idx[:, t]), ref[:, t], atol=1e-5, rtol=1e-5)


def test_per_head_gains_get_no_weight_decay() -> None:
    from pipeline.trainer.engine import param_groups

    att = AttentionConfig(qk_norm=True, output_norm=True)
    model = GPT(ModelConfig(vocab_size=53, n_layer=2, n_head=H, d_model=D, attention=att))
    decay, no_decay = (g["params"] for g in param_groups(model, 0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    gains = {n for n in names.values() if n.endswith(("q_norm.weight", "k_norm.weight", "out_norm.weight"))}
    assert len(gains) == 6
    assert gains <= {names[id(p)] for p in no_decay}
    assert not gains & {names[id(p)] for p in decay}
    assert {"blocks.0.attn.qkv.weight", "blocks.1.attn.out_proj.weight"} <= {names[id(p)] for p in decay}


def test_config_defaults_presets_and_configs_saved_before_the_keys() -> None:
    from pipeline.config import ConfigError, from_yaml_text, load_config, to_yaml
    from pipeline.stages import train_inputs

    new = load_config([], ["model.attention.qk_norm=true"])
    assert new.model.attention.qk_norm_gains == "per_head" and new.model.attention.output_norm is False
    tiny = load_config([ROOT / "configs/tiny.yaml"])
    assert tiny.model.attention.qk_norm_gains == "shared"  # the demo's stored results were trained so
    with pytest.raises(ConfigError, match="model.attention.qk_norm_gains must be one of per_head, shared"):
        load_config([], ["model.attention.qk_norm_gains=per-head"])
    # A run or export config saved before the key: qk-norm on, no qk_norm_gains -> shared gains.
    old = to_yaml(tiny).replace("    qk_norm_gains: shared\n", "").replace("    output_norm: false\n", "")
    assert "qk_norm_gains" not in old and "output_norm" not in old
    assert from_yaml_text(old).model.attention.qk_norm_gains == "shared"
    assert from_yaml_text(to_yaml(new)).model.attention.qk_norm_gains == "per_head"
    # Fingerprints: the keys at their old meaning leave the train inputs as they were.
    for cfg in (tiny, load_config([])):
        att = train_inputs(cfg, 1)["model"]["attention"]
        assert "qk_norm_gains" not in att and "output_norm" not in att
    att = train_inputs(new, 1)["model"]["attention"]
    assert att["qk_norm_gains"] == "per_head"
    on = load_config([], ["model.attention.output_norm=true"])
    assert train_inputs(on, 1)["model"]["attention"]["output_norm"] is True


def test_old_export_with_shared_gains_loads_exactly(tmp_path: Path) -> None:
    """An export written before the key (shared (Dh) gains, no qk_norm_gains in its config.yaml) loads
    as shared and gives its logits; the same file read as per-head gains would not fit."""
    from safetensors.torch import save_file

    from pipeline.config import load_config, to_yaml
    from pipeline.export import CONFIG, WEIGHTS, ExportError, load_exported

    cfg = load_config([ROOT / "configs/tiny.yaml"], ["model.vocab_size=61"])
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    gen = torch.Generator().manual_seed(4)
    for blk in model.blocks:
        _random_gains(blk.attn, gen)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.model.tie_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(tmp_path / WEIGHTS))
    (tmp_path / CONFIG).write_text(to_yaml(cfg).replace("    qk_norm_gains: shared\n", ""))
    idx = torch.randint(0, 61, (1, 20), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(load_exported(tmp_path)(idx), model(idx), rtol=0, atol=0)
    per_head = to_yaml(cfg).replace("qk_norm_gains: shared", "qk_norm_gains: per_head")
    (tmp_path / CONFIG).write_text(per_head)
    with pytest.raises(ExportError, match="does not fit"):
        load_exported(tmp_path)
