"""Tile skipping (fpa_model/ops/fpa/skipping.py) in the chunked path: the bound is sound, the chunked path
skips exactly the tiles a by-hand evaluation of the bound names, its output and gradients are those of
attention with exactly those tiles masked, and they stay within the stated epsilon of the unskipped op."""

from __future__ import annotations

import math

import pytest
import torch

from fpa_model.config import AttentionConfig
from fpa_model.ops.fpa import fpa_attention
from fpa_model.ops.fpa.chunked import chunked_fpa_attention
from fpa_model.ops.fpa.library import attention as library_attention
from fpa_model.ops.fpa.skipping import check_skip_epsilon, skip_counts

F64 = torch.float64


def _bias64(phi, kind):
    """(B, H, T, T) bias in phi's own precision (naive.py's oracle works in float32): fpa's
    min_{j <= t <= i} phi_t - phi_j, fox's phi_i - phi_j; entries j > i are left 0 (masked later)."""
    t = phi.shape[-1]
    if kind == "fox":
        return phi[..., :, None] - phi[..., None, :]
    rows = []
    for i in range(t):
        r = torch.cummin(phi[..., : i + 1].flip(-1), dim=-1).values.flip(-1)  # min over [j, i]
        rows.append(torch.cat([r, torch.zeros_like(phi[..., i + 1 :])], dim=-1))
    return torch.stack(rows, dim=-2) - phi[..., None, :]


def _logits(q, k, phi, kind, scale):
    """Full (B, H, Tq, Tk) logits with the causal (queries = last Tq keys) -inf mask."""
    s = scale * q @ k.transpose(-1, -2)
    if kind != "softmax":
        s = s + _bias64(phi, kind)[..., k.shape[-2] - q.shape[-2] :, :]
    tq, tk = q.shape[-2], k.shape[-2]
    future = torch.arange(tk)[None, :] > torch.arange(tk - tq, tk)[:, None]
    return s.masked_fill(future, -math.inf)


def _hand_skips(q, k, phi, kind, scale, bs, eps, segment_ids=None):
    """(B, H, Tq, Tk) bool: the pairs in tiles the bound rules out, from its formula evaluated tile by tile
    (P, S, M by explicit minima over the ranges), and the number of such tiles (over batch*head)."""
    b, h, tq, _ = q.shape
    tk = k.shape[-2]
    off = tk - tq
    tau = math.log(tk / eps)
    qs = q * scale
    ref = (qs * k[..., off:, :]).sum(-1)  # (B, H, Tq) diagonal logits
    skip = torch.zeros(b, h, tq, tk, dtype=torch.bool)
    n_skipped = 0
    n_blk = -(-tk // bs)
    for qb in range(off // bs, n_blk):
        rows = [i for i in range(qb * bs, min((qb + 1) * bs, tk)) if i >= off]
        for kb in range(qb):
            cols = list(range(kb * bs, (kb + 1) * bs))
            for bi in range(b):
                if segment_ids is not None and not any(
                    segment_ids[bi, i] == segment_ids[bi, j] for i in rows for j in cols
                ):
                    continue  # no visible pair: the documents skip it, not the bound
                for hi in range(h):
                    ph = phi[bi, hi]
                    kmax = k[bi, hi, cols].norm(dim=-1).max()
                    phi_min_j = ph[cols].min()
                    m = (
                        ph[(kb + 1) * bs : qb * bs].min()
                        if qb - kb > 1
                        else torch.tensor(math.inf, dtype=F64)
                    )
                    worst = -math.inf
                    for i in rows:
                        qn = qs[bi, hi, i - off].norm()
                        if kind == "fpa":
                            p_i = ph[qb * bs : i + 1].min()
                            c = max(float(min(ph[j : (kb + 1) * bs].min(), m) - ph[j]) for j in cols)
                            bias = min(float(p_i - phi_min_j), c)
                        else:
                            bias = float(ph[i] - phi_min_j)
                        worst = max(worst, float(qn * kmax) + bias - float(ref[bi, hi, i - off]))
                    if worst < -tau:
                        n_skipped += 1
                        for i in rows:
                            skip[bi, hi, i - off, cols] = True
    return skip, n_skipped


def _masked_attention(q, k, v, phi, kind, scale, skip, segment_ids=None):
    """The reference: softmax over the causal, same-document pairs that `skip` does not remove."""
    s = _logits(q, k, phi, kind, scale).masked_fill(skip, -math.inf)
    if segment_ids is not None:
        tq = q.shape[-2]
        same = segment_ids[:, None, -tq:, None] == segment_ids[:, None, None, :]
        s = s.masked_fill(~same, -math.inf)
    return torch.softmax(s, dim=-1) @ v


def _sawtooth_walk(b, h, t, gen, depth=30.0, period=40):
    """A walk field whose increments dip by `depth` every `period` tokens: most old keys erased."""
    pos = torch.arange(t, dtype=F64)
    steps = torch.where(pos % period < 2, -depth, 0.0).expand(b, h, t) + 0.1 * torch.randn(
        b, h, t, generator=gen, dtype=F64
    )
    return steps.cumsum(-1)


def _inputs(seed, b=2, h=2, t=128, d=8, tq=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t if tq is None else tq, d, generator=gen, dtype=F64)
    k = torch.randn(b, h, t, d, generator=gen, dtype=F64)
    v = torch.randn(b, h, t, d, generator=gen, dtype=F64)
    return q, k, v, gen


def _fields(kind, b, h, t, gen):
    if kind == "fpa":
        return {
            "random": 0.3 * torch.randn(b, h, t, generator=gen, dtype=F64).cumsum(-1),
            "sawtooth": _sawtooth_walk(b, h, t, gen),
        }
    # fox: a non-increasing gate field (cumulative log forget gates), weak and strong decay
    weak = -0.01 * torch.rand(b, h, t, generator=gen, dtype=F64).cumsum(-1)
    strong = -2.0 * torch.rand(b, h, t, generator=gen, dtype=F64).cumsum(-1)
    return {"random": weak, "sawtooth": strong}


def _grads(fn, tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    w = torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out)
    return out.detach(), torch.autograd.grad((out * w).sum(), leaves)


@pytest.mark.parametrize("kind", ["fpa", "fox"])
@pytest.mark.parametrize("field", ["random", "sawtooth"])
@pytest.mark.parametrize(
    ("bs", "tq", "docs"), [(16, None, False), (32, None, True), (24, 77, False), (16, 100, True)]
)
def test_chunked_skips_the_hand_counted_tiles_and_equals_attention_with_them_masked(
    kind, field, bs, tq, docs
):
    eps = 1e-4
    q, k, v, gen = _inputs(7 + bs, tq=tq)
    b, h, t = k.shape[:3]
    phi = _fields(kind, b, h, t, gen)[field]
    seg = torch.tensor([[0] * 50 + [1] * 78, [0] * 20 + [1] * 90 + [2] * 18]) if docs else None
    scale = q.shape[-1] ** -0.5
    skip, n_hand = _hand_skips(q, k, phi, kind, scale, bs, eps, seg)
    with skip_counts() as counts:
        out, grads = _grads(
            lambda q_, k_, v_, p_: chunked_fpa_attention(
                q_, k_, v_, p_, kind=kind, block_size=bs, segment_ids=seg, skip_epsilon=eps
            ),
            (q, k, v, phi),
        )
    assert counts.skipped == n_hand
    if field == "sawtooth":  # built so that most cross tiles can go
        assert counts.skipped > 0.3 * counts.total
    ref_out, ref_grads = _grads(lambda *a: _masked_attention(*a, kind, scale, skip, seg), (q, k, v, phi))
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-7, atol=1e-8)  # a skipped tile has no gradient
    # Within the guarantee of the unskipped op: each row loses < eps of its mass.
    full = chunked_fpa_attention(q, k, v, phi, kind=kind, block_size=bs, segment_ids=seg)
    assert (out - full).abs().max() <= 2 * eps * v.abs().max()
    if n_hand == 0:
        # Nothing skipped: the same result up to float64 rounding. Not bit for bit: with documents the
        # skipping path computes the kept tiles in other batch shapes, and BLAS may then sum a dot product
        # in another order (seen at 1 ulp on one CPU, bit-equal on another).
        assert (out - full).abs().max() <= 1e-14 * v.abs().max()


@pytest.mark.parametrize("kind", ["fpa", "fox"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_skipped_tile_is_below_the_threshold_in_the_true_logits(kind, seed):
    """Soundness: in every tile the bound skips, each true logit is below the row's diagonal logit by more
    than tau, so the skipped mass of a row is < Tk * e^-tau = eps."""
    eps = 1e-3
    q, k, _, gen = _inputs(100 + seed, t=96)
    b, h, t = k.shape[:3]
    for phi in _fields(kind, b, h, t, gen).values():
        scale = q.shape[-1] ** -0.5
        skip, _ = _hand_skips(q, k, phi, kind, scale, 16, eps)
        s = _logits(q, k, phi, kind, scale)
        diag = torch.diagonal(s, dim1=-2, dim2=-1).unsqueeze(-1)
        margin = (s - diag).masked_fill(~skip, -math.inf)
        assert bool((margin < -math.log(t / eps)).all())
        mass = torch.softmax(s, dim=-1).masked_fill(~skip, 0.0).sum(-1)
        assert float(mass.max()) < eps


@pytest.mark.parametrize("kind", ["fpa", "fox"])
def test_a_tile_just_above_the_threshold_is_kept_and_just_below_skipped(kind):
    """q = 0 makes every logit its bias; one dip of depth tau +- 1e-3 before key block 0's later queries."""
    t, bs, eps = 64, 16, 1e-3
    tau = math.log(t / eps)
    q = torch.zeros(1, 1, t, 4, dtype=F64)
    k = torch.randn(1, 1, t, 4, dtype=F64, generator=torch.Generator().manual_seed(3))
    v = torch.randn(1, 1, t, 4, dtype=F64, generator=torch.Generator().manual_seed(4))
    for depth, skipped in ((tau - 1e-3, 0), (tau + 1e-3, 3)):
        phi = torch.zeros(1, 1, t, dtype=F64)
        if kind == "fpa":
            phi[..., bs] = -depth  # a dip at the start of block 1: keys of block 0 erased by depth
        else:
            phi[..., bs:] = -depth  # fox: a step down at block 1
        with skip_counts() as counts:
            chunked_fpa_attention(q, k, v, phi, kind=kind, block_size=bs, skip_epsilon=eps)
        assert (counts.skipped, counts.total) == (skipped, 6)
        assert _hand_skips(q, k, phi, kind, 1.0, bs, eps)[1] == skipped


def test_skipping_off_and_softmax_are_bit_for_bit_the_unskipped_op():
    q, k, v, gen = _inputs(5)
    phi = _sawtooth_walk(*k.shape[:3], gen).float()
    q, k, v = q.float(), k.float(), v.float()
    base = chunked_fpa_attention(q, k, v, None, kind="softmax", block_size=16)
    with skip_counts() as counts:
        assert torch.equal(
            chunked_fpa_attention(q, k, v, None, kind="softmax", block_size=16, skip_epsilon=0.1), base
        )
    assert counts.total == 0  # softmax has no field: nothing is decided or skipped
    on = chunked_fpa_attention(q, k, v, phi, block_size=16, skip_epsilon=1e-3)
    off = chunked_fpa_attention(q, k, v, phi, block_size=16)
    assert (on - off).abs().max() <= 2e-3 * v.abs().max()
    assert torch.equal(fpa_attention(q, k, v, phi, impl="chunked", block_size=16), off)


def test_the_compiled_op_skips_as_the_eager_one():
    q, k, v, gen = _inputs(9)
    phi = _sawtooth_walk(*k.shape[:3], gen)
    eager, g_eager = _grads(
        lambda *a: chunked_fpa_attention(*a, block_size=16, skip_epsilon=1e-4), (q, k, v, phi)
    )
    op, g_op = _grads(lambda *a: library_attention(*a, block_size=16, skip_epsilon=1e-4), (q, k, v, phi))
    assert torch.equal(op, eager)
    for a, b in zip(g_op, g_eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [float("nan"), -0.1, 0.0, 1.0, 2, True, "1e-3"])
def test_a_bad_epsilon_is_a_one_line_error(bad):
    with pytest.raises(ValueError, match="skip_epsilon"):
        check_skip_epsilon(bad)
    q, k, v, _ = _inputs(0, t=32)
    with pytest.raises(ValueError, match="skip_epsilon"):
        chunked_fpa_attention(q, k, v, torch.zeros(k.shape[:3], dtype=F64), skip_epsilon=bad)
    with pytest.raises(ValueError, match="model.attention.skip_epsilon"):
        AttentionConfig(skip_epsilon=bad)


def test_skipping_asked_of_the_naive_oracle_is_refused():
    q, k, v, _ = _inputs(0, t=32)
    phi = torch.zeros(k.shape[:3], dtype=F64)
    with pytest.raises(ValueError, match="skip_epsilon.*chunked.*naive"):
        fpa_attention(q, k, v, phi, impl="naive", skip_epsilon=1e-3)
    with pytest.raises(ValueError, match="skip_epsilon is served by impl chunked, triton or auto"):
        AttentionConfig(skip_epsilon=1e-3, impl="naive")
    assert AttentionConfig(skip_epsilon=1e-3, impl="triton").skip_epsilon == 1e-3  # the kernels skip too
    # softmax has no field: a documented no-op on every impl
    assert torch.equal(
        fpa_attention(q, k, v, None, kind="softmax", impl="naive", skip_epsilon=1e-3),
        fpa_attention(q, k, v, None, kind="softmax", impl="naive"),
    )


@pytest.mark.parametrize("min_run", [1, 10**9])
def test_slices_and_gathered_tiles_give_the_same_result(monkeypatch, min_run):
    """Runs of kept tiles go as slices, the rest gathered by index: forcing either way changes nothing
    beyond float rounding (documents on, most tiles skipped, some kept in fragments)."""
    import fpa_model.ops.fpa.chunked as chunked

    q, k, v, gen = _inputs(11)
    phi = _sawtooth_walk(*k.shape[:3], gen, depth=12.0, period=24)
    seg = torch.tensor([[0] * 60 + [1] * 68, [0] * 128])

    def run():
        return _grads(
            lambda *a: chunked_fpa_attention(*a, block_size=8, segment_ids=seg, skip_epsilon=1e-3),
            (q, k, v, phi),
        )

    with skip_counts() as counts:
        out, grads = run()
    assert 0.2 * counts.total < counts.skipped < 0.95 * counts.total
    monkeypatch.setattr(chunked, "_MIN_RUN", min_run)
    out_m, grads_m = run()
    torch.testing.assert_close(out_m, out, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_m, grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_head_keeping_a_stretch_the_others_skip_goes_as_a_strided_view(monkeypatch):
    """Head 0 keeps every tile (a weak field), head 1 skips most (deep dips): the kept tiles alternate
    lanes in the flat (block, head) order, so they come as runs of stride B*H, and the result is the one of
    gathering every tile."""
    import fpa_model.ops.fpa.chunked as chunked

    q, k, v, gen = _inputs(12, b=1, h=2)
    phi = torch.stack([0.01 * torch.randn(128, generator=gen, dtype=F64).cumsum(-1),
                       _sawtooth_walk(1, 1, 128, gen, depth=40.0, period=16)[0, 0]])[None]  # fmt: skip
    steps = []
    real = chunked._skip_steps

    def spy(*a, **kw):
        for st in real(*a, **kw):
            steps.append(st.qt.step if isinstance(st.qt, slice) else "gathered")
            yield st

    monkeypatch.setattr(chunked, "_skip_steps", spy)

    def run():
        return _grads(lambda *a: chunked_fpa_attention(*a, block_size=8, skip_epsilon=1e-3), (q, k, v, phi))

    out, grads = run()
    assert 2 in steps  # strided runs (stride B*H = 2) were taken
    monkeypatch.setattr(chunked, "_MIN_RUN", 10**9)
    out_g, grads_g = run()
    torch.testing.assert_close(out, out_g, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, grads_g):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_model_with_skipping_trains_the_same_loss_and_gradients_within_epsilon():
    """model.attention.skip_epsilon reaches every layer: most tiles go and the loss and its gradients move
    by no more than the guarantee allows."""
    from fpa_model.config import ModelConfig
    from fpa_model.model import GPT

    losses, grads = [], []
    for eps in (None, 1e-3):
        torch.manual_seed(0)
        attn = AttentionConfig(skip_epsilon=eps, block_size=16, field_bias_init=[-3.0, -1.0])
        model = GPT(ModelConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, attention=attn))
        idx = torch.randint(0, 64, (2, 128), generator=torch.Generator().manual_seed(1))
        with skip_counts() as counts:
            logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        if eps is not None:
            assert counts.skipped > 0.5 * counts.total  # strong decay at init: most old tiles go
    assert abs(losses[1] - losses[0]) < 1e-3
    assert float((grads[1] - grads[0]).abs().max()) < 1e-3
