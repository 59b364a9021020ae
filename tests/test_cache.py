"""KV-cache decoding against the full forward pass, and FPA eviction against its bound."""

from __future__ import annotations

import math

import pytest
import torch

from fpa_model.cache import (
    COMPACT_AT,
    EvictionPolicy,
    KVCache,
    LayerCache,
    decode_step,
    generate,
    key_budget_log,
    prefill,
)
from fpa_model.ops.fpa.naive import fpa_attention_naive, fpa_bias_naive


def _field(kind: str, b: int, h: int, t: int, gen: torch.Generator) -> torch.Tensor | None:
    if kind == "softmax":
        return None
    if kind == "fox":
        return torch.cumsum(torch.nn.functional.logsigmoid(torch.randn(b, h, t, generator=gen) + 1.0), -1)
    # fpa: a signed walk with drift, so dips erase keys and valleys keep old ones alive
    return torch.cumsum(torch.randn(b, h, t, generator=gen) * 1.5 - 0.05, -1)


def _qkv(b: int, h: int, t: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(b, h, t, d, generator=gen) for _ in range(3))


@pytest.mark.parametrize("kind", ["fpa", "fox", "softmax"])
@pytest.mark.parametrize("chunks", [[40], [1] * 40, [16, 1, 1, 7, 15]], ids=["full", "tokens", "mixed"])
def test_layer_cache_exact_without_eviction(kind: str, chunks: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    b, h, t, d = 2, 3, sum(chunks), 8
    q, k, v = _qkv(b, h, t, d, gen)
    phi = _field(kind, b, h, t, gen)
    ref = fpa_attention_naive(q, k, v, phi, kind=kind)
    lc = LayerCache(kind)
    outs, s = [], 0
    for c in chunks:
        sl = slice(s, s + c)
        outs.append(lc.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], None if phi is None else phi[..., sl]))
        s += c
    torch.testing.assert_close(torch.cat(outs, dim=2), ref, atol=1e-5, rtol=1e-5)
    assert lc.fraction_kept() == 1.0 and lc.capacity == t


@pytest.mark.parametrize("kind", ["fpa", "fox"])
@pytest.mark.parametrize("margin", [1.0, 3.0])
def test_eviction_within_bound(kind: str, margin: float) -> None:
    """Evicted keys carry < exp(-margin) of the full model's softmax mass at every later query, and the
    outputs move by at most 2 * that mass * max|v|."""
    gen = torch.Generator().manual_seed(1)
    b, h, t, d = 2, 2, 160, 8
    q, k, v = _qkv(b, h, t, d, gen)
    q, k = 0.5 * q, 0.5 * k  # moderate logits, so the field decides (as in a trained model)
    phi = _field(kind, b, h, t, gen)
    assert phi is not None
    lc = LayerCache(
        kind, EvictionPolicy(enabled=True, margin=margin, norm_slack=1.0, max_tokens=t, record=True)
    )
    # Prefill the first 32 tokens in one chunk so the norm estimates see many tokens, then decode.
    outs = [lc.attend(q[:, :, :32], k[:, :, :32], v[:, :, :32], phi[..., :32])]
    for i in range(32, t):
        sl = slice(i, i + 1)
        outs.append(lc.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], phi[..., sl]))
    out = torch.cat(outs, dim=2)
    assert lc.fraction_kept() < 0.7, "the test field should make eviction bite"
    assert lc.capacity < t

    # Softmax weights of the full computation, and the mask of keys evicted before each query.
    scale = 1.0 / math.sqrt(d)
    w = torch.softmax(scale * q @ k.transpose(-1, -2) + fpa_bias_naive(phi, kind), dim=-1)
    evicted_before = torch.zeros(b, h, t, t, dtype=torch.bool)  # [.., i, j]: j gone when i is computed
    for ev in lc.log:
        evicted_before[ev.batch, ev.head, ev.seen :, ev.pos] = True
    lost = (w * evicted_before).sum(-1)
    assert float(lost.max()) < math.exp(-margin)
    err = (out - fpa_attention_naive(q, k, v, phi, kind=kind)).abs().amax(-1)
    vmax = v.abs().amax()
    assert bool((err <= 2 * lost * vmax + 1e-5).all())


@pytest.mark.parametrize("kind", ["fpa", "fox"])
def test_eviction_never_drops_a_key_above_threshold(kind: str) -> None:
    gen = torch.Generator().manual_seed(2)
    b, h, t, d = 1, 4, 120, 4
    q, k, v = _qkv(b, h, t, d, gen)
    phi = _field(kind, b, h, t, gen)
    assert phi is not None
    lc = LayerCache(kind, EvictionPolicy(enabled=True, delta=3.0, record=True, every=1))
    for i in range(t):
        sl = slice(i, i + 1)
        lc.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], phi[..., sl])
        # Every key still cached is at or above the threshold, every evicted one was below it at the
        # moment it went (the bias computed from scratch by the naive oracle), and stays below later.
        bias_now = fpa_bias_naive(phi[..., : i + 1], kind)[..., -1, :]  # (B,H,i+1) for query i
        for hh in range(h):
            kept = lc.kept_positions(0, hh)
            assert bool((bias_now[0, hh, kept] >= -3.0).all())
            gone = sorted(set(range(i + 1)) - set(kept))
            assert bool((bias_now[0, hh, gone] < -3.0).all())
    n_ev = sum(len(ev.pos) for ev in lc.log)
    assert n_ev > 0
    assert n_ev + lc.kept() == h * t

    # Rounds every 16 decode tokens (the default): evictions only then, and the same keys by the end of
    # a round as a cache that evicts at every token (the rounds judge with the same fixed delta).
    every16 = LayerCache(kind, EvictionPolicy(enabled=True, delta=3.0, record=True))
    for i in range(t):
        sl = slice(i, i + 1)
        every16.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], phi[..., sl])
    assert {ev.seen % 16 for ev in every16.log} == {0} and every16.log
    if t % 16 == 0:
        assert all(every16.kept_positions(0, hh) == lc.kept_positions(0, hh) for hh in range(h))
    with pytest.raises(ValueError, match="every must be an integer >= 1; got 0"):
        EvictionPolicy(every=0)
    with pytest.raises(ValueError, match="horizon max_tokens must be >= 1; got 0"):
        EvictionPolicy(enabled=True, max_tokens=0)  # at construction, not at the first eviction round


def test_fpa_keeps_old_valley_key_that_fox_would_drop() -> None:
    """A key in a valley (phi_j below every later phi) keeps bias 0 under fpa, however old."""
    t = 50
    phi = torch.cat([torch.tensor([0.0, -10.0]), torch.linspace(-5.0, 5.0, t - 2)])[None, None]
    q = torch.zeros(1, 1, t, 2)
    kv = torch.randn(1, 1, t, 2)
    lc = LayerCache("fpa", EvictionPolicy(enabled=True, delta=2.0))
    for i in range(t):
        lc.attend(q[:, :, i : i + 1], kv[:, :, i : i + 1], kv[:, :, i : i + 1], phi[..., i : i + 1])
    kept = lc.kept_positions()
    assert 1 in kept  # the valley key
    assert 0 not in kept  # erased by the dip right after it
    assert kept[-1] == t - 1


# ----------------------------------------------------------------------------------------------------
# Model level


def _model(kind: str, field: str = "walk", **attn: object):
    from fpa_model.config import AttentionConfig, ModelConfig
    from fpa_model.model import GPT

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=97,
        n_layer=2,
        n_head=2,
        d_model=32,
        max_seq_len=64,
        attention=AttentionConfig(kind=kind, field=field, impl="naive", **attn),
    )
    model = GPT(cfg).eval()
    # Give the field real structure (the default init is a constant-decay FoX head).
    with torch.no_grad():
        for blk in model.blocks:
            if blk.attn.field_proj is not None:
                blk.attn.field_proj.weight.normal_(0, 0.5)
    return model


def _prefill_then_decode(
    model, idx: torch.Tensor, prefill_len: int, chunk_size: int, end: int
) -> tuple[torch.Tensor, KVCache]:
    """(logits of idx[:, :end], the cache): the first prefill_len tokens prefilled in chunks, then one
    decode step each."""
    logits, cache = prefill(model, idx[:, :prefill_len], chunk_size=chunk_size, all_logits=True)
    steps = [decode_step(model, cache, idx[:, i]) for i in range(prefill_len, end)]
    return torch.cat([logits, torch.stack(steps, 1)], dim=1), cache


@pytest.mark.parametrize(
    "kind,field,extra",
    [
        ("fpa", "walk", {}),
        ("fpa", "direct", {}),
        ("fpa", "gate", {"qk_norm": True, "output_gate": True}),
        ("fox", "walk", {}),
        ("softmax", "walk", {}),
        ("fpa", "walk", {"qk_norm": True, "log_scale_length": 16}),
    ],
    ids=["fpa-walk", "fpa-direct", "fpa-gate-pro", "fox", "softmax-rope", "fpa-log-scale"],
)
def test_model_decode_matches_full_forward(kind: str, field: str, extra: dict) -> None:
    model = _model(kind, field, **extra)
    idx = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    ref = model(idx)
    got, cache = _prefill_then_decode(model, idx, prefill_len=25, chunk_size=8, end=40)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert cache.seen == 40
    assert cache.fraction_kept()["overall"] == 1.0


def test_generate_greedy_matches_argmax_of_full_forward() -> None:
    model = _model("fpa")
    idx = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    new, cache = generate(model, idx, 6)
    seq = idx
    for _ in range(6):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(new, seq[:, 12:])
    assert cache.seen == 12 + 5  # the last generated token is not fed back


def test_model_eviction_reports_fraction_and_shrinks() -> None:
    model = _model("fpa")
    with torch.no_grad():  # a strongly falling field: old keys go quickly
        for blk in model.blocks:
            blk.attn.field_proj.bias.fill_(-3.0)
    idx = torch.randint(0, 97, (1, 60), generator=torch.Generator().manual_seed(5))
    _, cache = prefill(model, idx, policy=EvictionPolicy(enabled=True), chunk_size=4)
    frac = cache.fraction_kept()
    assert len(frac["per_layer"]) == 2
    assert 0 < frac["overall"] < 0.7
    assert max(cache.capacity()) < 60
    softmax = _model("softmax")
    _, c2 = prefill(softmax, idx, policy=EvictionPolicy(enabled=True), chunk_size=4)
    assert c2.fraction_kept()["overall"] == 1.0
    assert isinstance(c2, KVCache)


def test_generate_stops_at_eos_and_pads_finished_rows() -> None:
    model = _model("fox")
    idx = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(6))
    free, _ = generate(model, idx, 8)
    eos = int(free[0, 2])  # row 0 emits this token at step 2 (or earlier)
    new, _ = generate(model, idx, 8, eos_id=eos)
    for r in range(2):
        toks, ref = new[r].tolist(), free[r].tolist()
        if eos in toks:  # greedy up to the first eos, then eos only
            cut = toks.index(eos) + 1
            assert toks[:cut] == ref[:cut]
            assert set(toks[cut:]) <= {eos}
        else:
            assert toks == ref[: len(toks)]
    assert eos in new[0].tolist()
    # Generation ends once every row is done: no longer than the row that finishes last.
    if eos in free[1].tolist():
        assert new.shape[1] == max(free[r].tolist().index(eos) for r in range(2)) + 1


def test_prefill_input_errors() -> None:
    model = _model("fpa")
    with pytest.raises(ValueError, match="shape"):
        prefill(model, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        prefill(model, torch.zeros(1, 4, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="needs field phi"):
        LayerCache("fpa").attend(*(torch.zeros(1, 1, 2, 4),) * 3, None)


def test_qk_norm_gives_hard_norm_bounds() -> None:
    model = _model("fpa", qk_norm=True)
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.q_norm.weight.uniform_(0.5, 2.0)
            blk.attn.k_norm.weight.uniform_(0.5, 1.5)
    idx = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(7))
    _, cache = prefill(model, idx, policy=EvictionPolicy(enabled=True), chunk_size=10)
    for blk, lc in zip(model.blocks, cache.layers):
        d = blk.attn.head_dim
        assert lc.q_bound == pytest.approx(math.sqrt(d) * float(blk.attn.q_norm.weight.detach().abs().max()))
        assert float(lc.q_max.max()) <= lc.q_bound * (1 + 1e-5)
        assert float(lc.k_max.max()) <= lc.k_bound * (1 + 1e-5)
        scale = 1 / math.sqrt(d)
        k_j = lc.k.float().norm(dim=-1)
        assert float(k_j.max()) <= lc.k_bound * (1 + 1e-5)
        expect = scale * lc.q_bound * (k_j + lc.k_bound) + key_budget_log(lc.pos, None) + 2.0
        torch.testing.assert_close(lc.threshold(), expect)
    plain = _model("fpa")
    _, c2 = prefill(plain, idx, policy=EvictionPolicy(enabled=True), chunk_size=10)
    assert all(lc.q_bound is None for lc in c2.layers)


def test_log_scale_length_grows_the_query_ceiling_to_the_horizon() -> None:
    """With log-n scaling, queries at position i carry the factor ln(i + 1) / ln(L): the hard ceiling on
    |q| is the qk-norm one times the factor at the expected length; without one there is no ceiling."""
    model = _model("fpa", qk_norm=True, log_scale_length=8)
    plain = KVCache.for_model(_model("fpa", qk_norm=True), EvictionPolicy(enabled=True, max_tokens=64))
    grown = KVCache.for_model(model, EvictionPolicy(enabled=True, max_tokens=64))
    for a, b in zip(plain.layers, grown.layers):
        assert b.q_bound == pytest.approx(a.q_bound * math.log(64) / math.log(8))
        assert b.k_bound == a.k_bound
    assert all(lc.q_bound is None for lc in KVCache.for_model(model, EvictionPolicy(enabled=True)).layers)
    # The ceiling holds for every query the prompt makes.
    idx = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(7))
    _, cache = prefill(model, idx, policy=EvictionPolicy(enabled=True, max_tokens=64), chunk_size=16)
    assert all(float(lc.q_max.max()) <= lc.q_bound * (1 + 1e-5) for lc in cache.layers)


@pytest.mark.parametrize("horizon", [None, 1, 7, 128, 4096])
def test_key_budget_sums_to_at_most_one(horizon: int | None) -> None:
    """The shares c(p) = exp(-key_budget_log(p)) of the eviction budget, summed over every position there
    will ever be, stay <= 1: the first 2M positions exactly, the rest by the integral bound."""
    n = 2_000_000
    c = torch.exp(-key_budget_log(torch.arange(n), horizon).double())
    assert bool((c[1:] <= c[:-1] * (1 + 1e-6)).all()) or horizon is not None  # decreasing past the head
    # sum_{p >= n} g(p) <= 1 / ln(n + 1), g(p) = 1 / ((p+2) ln^2(p+2)); c(p) = g(p) * factor beyond n.
    factor = float(c[-1]) * (n + 1) * math.log(n + 1) ** 2
    total = float(c.sum()) + factor / math.log(n + 1)
    assert total <= 1.0
    if horizon is not None:
        # Half the budget spread evenly inside the horizon: cheaper thresholds there than past it.
        assert float(c[:horizon].sum()) == pytest.approx(0.5, rel=1e-4)
        assert float(c[horizon - 1]) > float(c[horizon])


@pytest.mark.parametrize("max_tokens", [None, 40])
@pytest.mark.parametrize("margin", [1.0, 2.0])
def test_early_evictions_cannot_add_up(max_tokens: int | None, margin: float) -> None:
    """An adversarial field: each episode puts a key at a fresh level, then dips just past that key's
    threshold and never lower again, so every evicted key keeps its weight just under the threshold for
    all later queries. The weights of all evicted keys at the last query, relative to its own key, must
    stay below exp(-margin) (a threshold from the tokens seen so far, log(seen) + margin, sums to about
    exp(-margin) ln(T / t0) / 2 here, twice the budget). q = k = 0, so the field alone decides."""
    d, episodes = 4, 150
    lc = LayerCache("fpa", EvictionPolicy(enabled=True, margin=margin, max_tokens=max_tokens, record=True))
    zeros = torch.zeros(1, 1, 1, d)
    phis: list[float] = [0.0] * 8
    lc.attend(*(torch.zeros(1, 1, 8, d),) * 3, torch.zeros(1, 1, 8))

    def add(value: float) -> None:
        phis.append(value)
        lc.attend(zeros, zeros, zeros, torch.full((1, 1, 1), value))

    level, dips = 0.0, []
    for _ in range(episodes):
        add(level)
        thr = float(lc.threshold()[0, 0, -1])  # the newest key's delta
        dips.append(level - thr - 0.2)
        add(dips[-1])
        level += 20.0
    add(level)  # the last query, above every dip
    assert all(a < b for a, b in zip(dips, dips[1:])), "dips must rise, or old keys would sink further"
    evicted = torch.cat([ev.pos for ev in lc.log])
    assert len(evicted) >= episodes - 5, "the field should evict (nearly) every episode key"
    phi = torch.tensor(phis, dtype=torch.float64)
    last = len(phis) - 1
    bias = torch.stack([phi[j:].min() - phi[j] for j in evicted.tolist()])
    weight = float(torch.exp(bias).sum())  # relative to the last query's own key (logit 0, bias 0)
    assert weight < math.exp(-margin), (weight, math.exp(-margin))
    assert last not in evicted.tolist()


# ----------------------------------------------------------------------------------------------------
# Key/value shift: each layer's cache carries the newest token's raw k, v


def _shift_model(kind: str, field: str = "walk", **attn: object):
    model = _model(kind, field, kv_shift=True, **attn)
    with torch.no_grad():  # gates away from the 50/50 init, different per head, token and k / v
        for blk in model.blocks:
            blk.attn.shift_proj.weight.normal_(0, 0.5)
            blk.attn.shift_proj.bias.uniform_(-2.0, 2.0)
    return model


SHIFT_CASES = [
    ("fpa", "walk", {"rope": True, "qk_norm": True}),
    ("fpa", "gate", {"output_gate": True}),
    ("fox", "walk", {}),
    ("softmax", "walk", {}),
]


@pytest.mark.parametrize("kind,field,extra", SHIFT_CASES, ids=[f"{k}-{f}" for k, f, _ in SHIFT_CASES])
def test_kv_shift_decode_matches_full_forward(kind: str, field: str, extra: dict) -> None:
    model = _shift_model(kind, field, **extra)
    idx = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(8))
    ref = model(idx)
    got, cache = _prefill_then_decode(model, idx, prefill_len=17, chunk_size=5, end=29)
    torch.testing.assert_close(got, ref[:, :29], atol=1e-5, rtol=1e-5)
    for blk, lc in zip(model.blocks, cache.layers):
        assert lc.kv_prev is not None and lc.kv_prev[0].shape == (2, 2, blk.attn.head_dim)
    torch.testing.assert_close(decode_step(model, cache, idx[:, 29]), ref[:, 29], atol=1e-5, rtol=1e-5)
    # The carry matters: the same step after forgetting the previous token's k, v gives other logits.
    _, cache = prefill(model, idx[:, :29], chunk_size=5)
    for lc in cache.layers:
        lc.kv_prev = None
    assert (decode_step(model, cache, idx[:, 29]) - ref[:, 29]).abs().max() > 1e-3


def test_kv_shift_generate_greedy_matches_argmax_of_full_forward() -> None:
    model = _shift_model("fpa", rope=True)
    with torch.no_grad():  # attention that moves the logits, so greedy tokens depend on the carry
        for blk in model.blocks:
            blk.attn.qkv.weight.mul_(10.0)
            blk.attn.out_proj.weight.mul_(30.0)
    idx = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(9))
    new, _ = generate(model, idx, 8)
    seq = idx
    for _ in range(8):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(new, seq[:, 12:])


def _forward_without_evicted(model: torch.nn.Module, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The full forward pass (naive op) in which each query ignores the keys its layer's cache had evicted
    before it (the recorded evictions), with the projections (and kv shift) of the whole sequence."""
    t = idx.shape[1]
    x = model.embed(idx)
    for block, lc in zip(model.blocks, cache.layers):
        attn = block.attn
        h = block.norm1(x)
        q, k, v, u = attn.project(h)
        phi = attn.field_from_increments(u)
        mask = torch.zeros(idx.shape[0], attn.n_head, t, t)
        for ev in lc.log:  # dropped after `seen` tokens: hidden from every query at position >= seen
            for b, hd, p in zip(ev.batch.tolist(), ev.head.tolist(), ev.pos.tolist()):
                mask[b, hd, ev.seen :, p] = float("-inf")
        logits = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
        o = torch.softmax(logits + fpa_bias_naive(phi, attn.kind) + mask, -1) @ v
        x = x + attn.output(o, h)
        x = x + block.mlp(block.norm2(x))
    return model.lm_head(model.norm_f(x))


@pytest.mark.parametrize("kv_shift", [False, True], ids=["plain", "kv_shift"])
def test_eviction_decode_equals_forward_without_the_evicted_keys(kv_shift: bool) -> None:
    """Decoding with eviction = the full forward pass minus exactly the evicted keys. With kv_shift an
    evicted key's token still feeds the next token's shift: the carry is the previous token, not a key."""
    model = _shift_model("fpa") if kv_shift else _model("fpa")
    with torch.no_grad():  # a strongly falling field: old keys go quickly
        for blk in model.blocks:
            blk.attn.field_proj.bias.fill_(-3.0)
    idx = torch.randint(0, 97, (1, 44), generator=torch.Generator().manual_seed(10))
    policy = EvictionPolicy(enabled=True, record=True)
    logits, cache = prefill(model, idx[:, :20], policy=policy, chunk_size=4, all_logits=True)
    steps = [decode_step(model, cache, idx[:, i]) for i in range(20, 44)]
    got = torch.cat([logits, torch.stack(steps, 1)], 1)
    evicted = [int(sum(len(ev.pos) for ev in lc.log)) for lc in cache.layers]
    assert min(evicted) > 20, evicted  # every layer dropped keys, in prefill and in decode
    with torch.no_grad():
        ref = _forward_without_evicted(model, idx, cache)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["fpa", "fox"])
def test_decoding_appends_in_place_and_compacts_lazily(kind: str) -> None:
    """A decode step writes its key into the cache's buffers instead of copying the cache (the storage
    moves only when it grows, by doubling, or when evicted keys are compacted away); an evicted key is
    masked at once, and the slots shrink once the most kept in a row is at most COMPACT_AT of them. The
    outputs equal attention over exactly the keys not yet evicted, computed from scratch."""
    gen = torch.Generator().manual_seed(3)
    b, h, t, d = 1, 2, 240, 8
    q, k, v = _qkv(b, h, t, d, gen)
    phi = _field(kind, b, h, t, gen)
    assert phi is not None
    lc = LayerCache(kind, EvictionPolicy(enabled=True, delta=1.0, record=True))
    lc.attend(q[:, :, :16], k[:, :, :16], v[:, :, :16], phi[..., :16])
    moves, compactions = 0, 0
    for i in range(16, t):
        ptr, cap = lc._buffers["k"].data_ptr(), lc.capacity
        sl = slice(i, i + 1)
        gone = torch.zeros(b, h, i, dtype=torch.bool)  # keys evicted before query i
        for ev in lc.log:
            gone[ev.batch, ev.head, ev.pos] = True
        out = lc.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], phi[..., sl])
        bias = fpa_bias_naive(phi[..., : i + 1], kind)[..., i : i + 1, :]
        logits = (q[:, :, sl] @ k[:, :, : i + 1].transpose(-1, -2)) / math.sqrt(d) + bias
        logits[..., :i] = logits[..., :i].masked_fill(gone[..., None, :], float("-inf"))
        torch.testing.assert_close(out, torch.softmax(logits, -1) @ v[:, :, : i + 1], atol=1e-5, rtol=1e-5)
        moves += lc._buffers["k"].data_ptr() != ptr
        most = int(lc.valid.sum(-1).max())
        if lc.capacity < cap + 1:  # shrank, or did not grow: compacted this step
            compactions += 1
            assert lc.capacity == most
        else:
            assert lc.capacity == cap + 1 and most > COMPACT_AT * cap  # appended in place of a copy
    assert lc.fraction_kept() < 0.5 and compactions >= 2, (lc.fraction_kept(), compactions)
    # Not one per token: each compaction, and each doubling of the slots after it.
    assert moves <= 2 * compactions + math.ceil(math.log2(t)) and moves < (t - 16) / 4, (moves, compactions)
    assert {ev.seen % 16 for ev in lc.log} == {0}  # eviction rounds every 16 decode tokens
