"""The chunked FPA path against the naive oracle: outputs and every gradient, ring blocks, dispatcher.

Each case compares fpa_model.ops.fpa.chunked (O(T) memory, hand-written backward) with
fpa_model.ops.fpa.naive (T x T, autograd) on the same inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fpa_model.ops.fpa.chunked as chunked_mod
from fpa_model.ops.fpa import IMPLS, fpa_attention
from fpa_model.ops.fpa.chunked import (
    attention_delta,
    block_min,
    chunked_fpa_attention,
    fpa_cross_backward,
    fpa_cross_forward,
    fpa_diag_backward,
    fpa_diag_forward,
    merge_lse,
    prefix_min,
    suffix_min,
)
from fpa_model.ops.fpa.naive import fpa_attention_naive, fpa_bias_naive

KINDS = ("fpa", "fox", "softmax")


def _inputs(b, h, tq, tk, d, *, dtype=torch.float32, seed=0, dv=None, field="walk"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g)
    k = torch.randn(b, h, tk, d, generator=g)
    v = torch.randn(b, h, tk, dv or d, generator=g)
    u = torch.randn(b, h, tk, generator=g)
    phi = u.cumsum(-1) if field == "walk" else F.logsigmoid(u + 2.0).cumsum(-1)
    dout = torch.randn(b, h, tq, dv or d, generator=g)
    return [t.to(dtype) for t in (q, k, v, phi, dout)]


def _fwd_bwd(fn, q, k, v, phi, dout):
    """Output and (dq, dk, dv, dphi) of fn; an unused phi counts as a zero gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, phi)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return [out.detach()] + [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def _assert_all_close(got, want, atol, rtol, names=("out", "dq", "dk", "dv", "dphi")):
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(
            a.float(), b.float(), atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}"
        )


# (B, H, Tq, Tk, D, block): ragged T, decode (Tq < Tk), one query, block 1, blocks larger than T,
# square blocks that take the two-level diagonal (block a multiple of 16 and > 16).
SHAPES = [
    (1, 1, 1, 1, 4, 16),
    (2, 3, 37, 37, 8, 16),
    (1, 2, 20, 20, 4, 1),
    (1, 2, 9, 9, 1, 4),
    (2, 2, 100, 100, 16, 32),
    (1, 2, 130, 130, 8, 64),
    (1, 2, 5, 70, 8, 16),
    (1, 1, 1, 33, 8, 8),
    (2, 1, 40, 97, 8, 32),
    (1, 1, 12, 12, 8, 128),
]


def _shape_id(s):
    b, h, tq, tk, d, bs = s
    return f"B{b}-H{h}-Tq{tq}-Tk{tk}-D{d}-bs{bs}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_chunked_matches_naive_fp32(kind, shape):
    b, h, tq, tk, d, bs = shape
    q, k, v, phi, dout = _inputs(b, h, tq, tk, d, seed=tk + bs)
    got = _fwd_bwd(lambda *x: chunked_fpa_attention(*x, kind=kind, block_size=bs), q, k, v, phi, dout)
    want = _fwd_bwd(lambda *x: fpa_attention_naive(*x, kind=kind), q, k, v, phi, dout)
    _assert_all_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["fpa", "fox"])
@pytest.mark.parametrize("bs", [8, 16], ids=lambda b: f"bs{b}")
def test_two_level_diagonal_small_subblocks(kind, bs, monkeypatch):
    """Sub-blocks of 4 inside the diagonal tiles: exercises every branch (S/M/P winners) of _DiagField."""
    monkeypatch.setattr(chunked_mod, "_SUB", 4)
    q, k, v, phi, dout = _inputs(2, 2, 45, 45, 8, seed=bs)
    got = _fwd_bwd(lambda *x: chunked_fpa_attention(*x, kind=kind, block_size=bs), q, k, v, phi, dout)
    want = _fwd_bwd(lambda *x: fpa_attention_naive(*x, kind=kind), q, k, v, phi, dout)
    _assert_all_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_chunked_matches_naive_half(kind, dtype):
    q, k, v, phi, dout = _inputs(2, 2, 50, 50, 16, dtype=dtype, seed=3)
    got = _fwd_bwd(lambda *x: chunked_fpa_attention(*x, kind=kind, block_size=32), q, k, v, phi, dout)
    want = _fwd_bwd(lambda *x: fpa_attention_naive(*x, kind=kind), q, k, v, phi, dout)
    assert got[0].dtype == dtype and got[4].dtype == dtype
    # Both accumulate in fp32 from the same half inputs; they differ by a few half-precision roundings.
    _assert_all_close(got, want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_value_dim_differs_from_key_dim(kind):
    q, k, v, phi, dout = _inputs(1, 2, 30, 30, 8, dv=5, seed=1)
    got = _fwd_bwd(lambda *x: chunked_fpa_attention(*x, kind=kind, block_size=8), q, k, v, phi, dout)
    want = _fwd_bwd(lambda *x: fpa_attention_naive(*x, kind=kind), q, k, v, phi, dout)
    _assert_all_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "bs,sub", [(1, 16), (4, 16), (32, 16), (16, 4)], ids=["bs1", "bs4", "bs32", "bs16-sub4"]
)
def test_ties_follow_lowest_index_rule(bs, sub, monkeypatch):
    """Integer fields have many equal minima; the chunked routing must pick the same (lowest) argmin as
    the oracle, across tiles (S vs M vs P) and inside them (sub4: inside two-level diagonal tiles)."""
    monkeypatch.setattr(chunked_mod, "_SUB", sub)
    q, k, v, _, dout = _inputs(2, 2, 64, 64, 8, seed=5)
    phi = torch.randint(-2, 3, (2, 2, 64), generator=torch.Generator().manual_seed(5)).float()
    got = _fwd_bwd(lambda *x: chunked_fpa_attention(*x, kind="fpa", block_size=bs), q, k, v, phi, dout)
    want = _fwd_bwd(lambda *x: fpa_attention_naive(*x, kind="fpa"), q, k, v, phi, dout)
    _assert_all_close(got, want, atol=2e-5, rtol=1e-5)


def test_minima_helpers_lowest_index():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (50, 13), generator=g).float()
    pv, pa = prefix_min(x)
    sv, sa = suffix_min(x)
    bv, ba = block_min(x)
    for r in range(x.shape[0]):
        row = x[r].tolist()
        for t in range(len(row)):
            head, tail = row[: t + 1], row[t:]
            assert pv[r, t] == min(head) and pa[r, t] == head.index(min(head))
            assert sv[r, t] == min(tail) and sa[r, t] == t + tail.index(min(tail))
        assert bv[r] == min(row) and ba[r] == row.index(min(row))


@pytest.mark.parametrize("kind,field", [("fpa", "walk"), ("fpa", "gate"), ("fox", "gate")])
def test_gradients_through_cumsum_of_increments(kind, field):
    """The model builds phi = cumsum(u) (walk) or cumsum(logsigmoid(u)) (gate); autograd does the cumsum."""
    q, k, v, _, dout = _inputs(1, 2, 70, 70, 8, seed=7)
    u = torch.randn(1, 2, 70, generator=torch.Generator().manual_seed(8))

    def run(impl):
        uu = u.clone().requires_grad_()
        inc = uu if field == "walk" else F.logsigmoid(uu + 1.0)
        out = fpa_attention(q, k, v, inc.cumsum(-1), kind=kind, impl=impl, block_size=16)
        (du,) = torch.autograd.grad(out, uu, dout)
        return out.detach(), du

    (o1, du1), (o2, du2) = run("chunked"), run("naive")
    torch.testing.assert_close(o1, o2, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(du1, du2, atol=5e-5, rtol=1e-5)


def test_fpa_with_gate_field_equals_fox():
    """A non-increasing field puts every range min at the query: fpa == fox (docs/design.md)."""
    q, k, v, phi, dout = _inputs(2, 2, 75, 75, 8, seed=11, field="gate")
    assert bool((phi[..., 1:] < phi[..., :-1]).all()), "the test field must be strictly decreasing"
    assert torch.equal(fpa_bias_naive(phi, "fpa"), fpa_bias_naive(phi, "fox"))
    fpa = _fwd_bwd(lambda *x: chunked_fpa_attention(*x, kind="fpa", block_size=16), q, k, v, phi, dout)
    fox = _fwd_bwd(lambda *x: chunked_fpa_attention(*x, kind="fox", block_size=16), q, k, v, phi, dout)
    # Same math, different summation order (fox adds phi_i inside the matmul): equal to fp32 rounding.
    _assert_all_close(fpa, fox, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "tq,tk,bs,sub",
    [(7, 7, 3, 16), (3, 10, 4, 16), (19, 19, 8, 4)],
    ids=["T7-bs3", "decode-Tq3-Tk10", "T19-2level"],
)
def test_gradcheck_float64(kind, tq, tk, bs, sub, monkeypatch):
    monkeypatch.setattr(chunked_mod, "_SUB", sub)
    g = torch.Generator().manual_seed(tq * tk)
    q = torch.randn(1, 2, tq, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, tk, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, tk, 2, generator=g, dtype=torch.float64, requires_grad=True)
    # Random (tie-free) field: the range min is locally linear, so finite differences are valid.
    phi = torch.randn(1, 2, tk, generator=g, dtype=torch.float64).cumsum(-1).requires_grad_()

    def fn(q, k, v, phi):
        return chunked_fpa_attention(q, k, v, phi, kind=kind, block_size=bs)

    assert torch.autograd.gradcheck(fn, (q, k, v, phi), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_huge_logits_take_the_exact_path(monkeypatch):
    """Cross logits far above the diagonal's (exp would overflow in the fast path) fall back to exact
    per-tile max-shifts; the result still matches the oracle."""
    calls = []
    exact = chunked_mod._forward_exact
    monkeypatch.setattr(chunked_mod, "_forward_exact", lambda *a: calls.append(1) or exact(*a))
    q, k, v, phi, dout = _inputs(1, 2, 48, 48, 8, seed=2)
    phi = torch.zeros_like(phi)  # a flat field: no bias that could erase the early keys
    k = k.clone()
    k[..., :16, :] = q[..., 40:41, :] * 100.0  # early keys align with a late query: logits ~ +hundreds
    got = _fwd_bwd(lambda *x: chunked_fpa_attention(*x, kind="fpa", block_size=16), q, k, v, phi, dout)
    want = _fwd_bwd(lambda *x: fpa_attention_naive(*x, kind="fpa"), q, k, v, phi, dout)
    assert calls, "the fast path should have overflowed and fallen back"
    assert all(torch.isfinite(t).all() for t in got)
    _assert_all_close(got, want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------
# The ring building blocks: a sequence cut into chunks, reassembled from diag / cross blocks + merge.
# ---------------------------------------------------------------------------------------------------


def _ring_reference(q, k, v, phi, dout, kind, cuts):
    """Output and gradients assembled only from the public blocks, as a ring would."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    bounds = list(zip([0, *cuts], [*cuts, q.shape[-2]]))
    chunks = [(slice(a, b)) for a, b in bounds]
    outs, lses = [], []
    for ia, qa in enumerate(chunks):
        o, l = fpa_diag_forward(
            q[..., qa, :], k[..., qa, :], v[..., qa, :], phi[..., qa], kind=kind, scale=scale
        )
        for ib in range(ia):
            kb = chunks[ib]
            between = phi[..., kb.stop : qa.start]
            m = between.amin(-1) if between.shape[-1] else torch.full(phi.shape[:-1], math.inf)
            o2, l2 = fpa_cross_forward(
                q[..., qa, :],
                k[..., kb, :],
                v[..., kb, :],
                phi[..., qa],
                phi[..., kb],
                m,
                kind=kind,
                scale=scale,
            )
            o, l = merge_lse(o, l, o2, l2)
        outs.append(o)
        lses.append(l)
    out = torch.cat(outs, -2)
    dq, dk, dv, dphi = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v, phi))
    for ia, qa in enumerate(chunks):
        args = {"out": outs[ia], "kind": kind, "scale": scale}
        g = fpa_diag_backward(
            dout[..., qa, :], q[..., qa, :], k[..., qa, :], v[..., qa, :], phi[..., qa], lses[ia], **args
        )
        dq[..., qa, :] += g.dq
        dk[..., qa, :] += g.dk
        dv[..., qa, :] += g.dv
        dphi[..., qa] += g.dphi
        delta = attention_delta(dout[..., qa, :], outs[ia])
        for ib in range(ia):
            kb = chunks[ib]
            between = phi[..., kb.stop : qa.start]
            if between.shape[-1]:
                m, m_arg = block_min(between)
                m_arg = m_arg + kb.stop
            else:
                m, m_arg = torch.full(phi.shape[:-1], math.inf), torch.zeros(phi.shape[:-1], dtype=torch.long)
            g = fpa_cross_backward(
                dout[..., qa, :], q[..., qa, :], k[..., kb, :], v[..., kb, :], phi[..., qa], phi[..., kb], m,
                lses[ia], delta=delta, kind=kind, scale=scale,
            )  # fmt: skip
            dq[..., qa, :] += g.dq
            dk[..., kb, :] += g.dk
            dv[..., kb, :] += g.dv
            dphi[..., qa] += g.dphi_q
            dphi[..., kb] += g.dphi_k
            dphi.scatter_add_(-1, m_arg.unsqueeze(-1), g.dm.unsqueeze(-1))  # dM lands on M's argmin
    return [out, dq, dk, dv, dphi]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cuts", [[10], [7, 19, 30], [1, 2, 3]], ids=["2chunks", "4chunks", "tiny-chunks"])
def test_ring_blocks_reassemble_the_oracle(kind, cuts):
    q, k, v, phi, dout = _inputs(2, 2, 41, 41, 8, seed=len(cuts))
    got = _ring_reference(q, k, v, phi, dout, kind, cuts)
    want = _fwd_bwd(lambda *x: fpa_attention_naive(*x, kind=kind), q, k, v, phi, dout)
    _assert_all_close(got, want, atol=2e-5, rtol=1e-5)


def test_diag_block_with_fewer_queries_and_extra_leading_dims():
    """fpa_diag_forward: queries are the last Lq of the Lk positions; any leading dims."""
    q, k, v, phi, _ = _inputs(2, 3, 6, 20, 4, seed=9)
    o, l = fpa_diag_forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), phi.unsqueeze(0), kind="fpa")
    want = fpa_attention_naive(q, k, v, phi, kind="fpa")
    assert o.shape == (1, 2, 3, 6, 4) and l.shape == (1, 2, 3, 6)
    torch.testing.assert_close(o[0], want, atol=1e-5, rtol=1e-5)
    logits = torch.einsum("bhid,bhjd->bhij", q, k) / 2.0 + fpa_bias_naive(phi, "fpa", 6)
    torch.testing.assert_close(l[0], torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)


def test_merge_lse_handles_empty_parts():
    o = torch.randn(3, 4)
    l = torch.tensor([0.5, -1.0, 2.0])
    empty_o, empty_l = torch.zeros(3, 4), torch.full((3,), -math.inf)
    mo, ml = merge_lse(o, l, empty_o, empty_l)
    torch.testing.assert_close(mo, o)
    torch.testing.assert_close(ml, l)
    mo, ml = merge_lse(empty_o, empty_l, empty_o, empty_l)
    assert torch.equal(mo, empty_o) and bool(torch.isneginf(ml).all())


# ---------------------------------------------------------------------------------------------------
# Dispatcher and input errors
# ---------------------------------------------------------------------------------------------------


def test_dispatcher_impls_agree_on_cpu():
    q, k, v, phi, _ = _inputs(1, 2, 33, 33, 8, seed=4)
    naive = fpa_attention(q, k, v, phi, kind="fpa", impl="naive")
    chunk = fpa_attention(q, k, v, phi, kind="fpa", impl="chunked", block_size=8)
    auto = fpa_attention(q, k, v, phi, kind="fpa", impl="auto", block_size=8)
    assert torch.equal(auto, chunk), "auto must pick the chunked path for CPU tensors"
    torch.testing.assert_close(chunk, naive, atol=1e-5, rtol=1e-5)
    # softmax without a field, as the model calls it
    torch.testing.assert_close(
        fpa_attention(q, k, v, None, kind="softmax", impl="chunked"),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
        atol=1e-5,
        rtol=1e-5,
    )
    assert set(IMPLS) == {"auto", "naive", "chunked", "triton"}


def test_dispatcher_triton_unavailable_is_a_clear_error(monkeypatch):
    import fpa_model.ops.fpa as ops

    def broken():
        raise ImportError("no triton here")

    monkeypatch.setattr(ops, "_load_triton", broken)
    q, k, v, phi, _ = _inputs(1, 1, 4, 4, 4)
    with pytest.raises(RuntimeError, match="triton.*unavailable"):
        fpa_attention(q, k, v, phi, impl="triton")
    assert torch.equal(fpa_attention(q, k, v, phi, impl="auto"), fpa_attention(q, k, v, phi, impl="chunked"))


@pytest.mark.parametrize(
    "case,tq,d",
    [("decode", 3, 16), ("head-dim", 12, 160), ("served", 12, 16)],
)
def test_auto_falls_back_where_the_kernel_cannot_serve(case, tq, d, monkeypatch):
    """impl=auto on a (simulated) CUDA machine: shapes the Triton kernel cannot serve (Tq != Tk, head dim
    > 128) take the chunked path with one warning per reason instead of raising; served shapes take Triton."""
    import warnings

    import fpa_model.ops.fpa as ops

    monkeypatch.setattr(ops, "_triton_usable", lambda q: True)
    monkeypatch.setattr(ops, "_WARNED", set())
    calls = []
    real = ops._load_triton()
    monkeypatch.setattr(ops, "_load_triton", lambda: lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, phi, _ = _inputs(1, 2, tq, 12, d, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fpa_attention(q, k, v, phi, kind="fpa", impl="auto")
        fpa_attention(q, k, v, phi, kind="fpa", impl="auto")  # the same reason warns once
    ref = fpa_attention(q, k, v, phi, kind="fpa", impl="naive")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    msgs = [str(w.message) for w in caught if "impl='auto'" in str(w.message)]
    if case == "served":
        assert calls and not msgs
    else:
        assert not calls and len(msgs) == 1, msgs
        assert ("Tq == Tk" if case == "decode" else "head dim 160") in msgs[0]


@pytest.mark.parametrize(
    "change,match",
    [
        ({"kind": "nope"}, "unknown attention kind"),
        ({"impl": "nope"}, "unknown attention impl"),
        ({"phi": torch.zeros(1, 1, 5)}, "phi must be"),
        ({"phi": None}, "needs a field phi"),
        ({"q": torch.zeros(1, 1, 9, 4)}, "more queries"),
        ({"v": torch.zeros(1, 1, 7, 4)}, "shape mismatch"),
        ({"block_size": 0}, "block_size"),
    ],
    ids=["kind", "impl", "phi-shape", "phi-missing", "tq>tk", "v-len", "block"],
)
def test_bad_inputs_raise_one_line_errors(change, match):
    args = {"q": torch.zeros(1, 1, 8, 4), "k": torch.zeros(1, 1, 8, 4), "v": torch.zeros(1, 1, 8, 4)}
    args["phi"] = torch.zeros(1, 1, 8)
    kw = {"kind": "fpa", "impl": "chunked", "block_size": 4}
    for key, val in change.items():
        (args if key in args else kw)[key] = val
    with pytest.raises(ValueError, match=match):
        fpa_attention(args["q"], args["k"], args["v"], args["phi"], **kw)


@pytest.mark.parametrize("kind", ["fpa", "fox"])
def test_strong_decay_flushes_tiny_weights_without_changing_results(kind):
    """Fields that decay by ~3 nats per token push most logits below exp's normal range; the chunked path
    flushes those weights to 0 (to avoid slow denormals), which the oracle's result cannot tell apart."""
    q, k, v, _, dout = _inputs(1, 2, 160, 160, 8, seed=12)
    u = torch.randn(1, 2, 160, generator=torch.Generator().manual_seed(13))
    phi = F.logsigmoid(u - 3.0).cumsum(-1)
    got = _fwd_bwd(lambda *x: chunked_fpa_attention(*x, kind=kind, block_size=32), q, k, v, phi, dout)
    want = _fwd_bwd(lambda *x: fpa_attention_naive(*x, kind=kind), q, k, v, phi, dout)
    _assert_all_close(got, want, atol=2e-5, rtol=1e-5)


def test_ties_without_relying_on_cummin_index_order(monkeypatch):
    """Devices whose torch.cummin reports another index among equal values take the exact record path."""
    monkeypatch.setattr(chunked_mod, "_CUMMIN_KEEPS_LAST", {"cpu": False})
    q, k, v, _, dout = _inputs(1, 2, 40, 40, 8, seed=6)
    phi = torch.randint(-2, 3, (1, 2, 40), generator=torch.Generator().manual_seed(6)).float()
    for bs in (8, 32):
        got = _fwd_bwd(
            lambda *x, bs=bs: chunked_fpa_attention(*x, kind="fpa", block_size=bs), q, k, v, phi, dout
        )
        want = _fwd_bwd(lambda *x: fpa_attention_naive(*x, kind="fpa"), q, k, v, phi, dout)
        _assert_all_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_chunked_on_cuda_matches_naive(kind, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tol = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    for tq, tk, bs in ((300, 300, 64), (7, 300, 64), (130, 130, 128)):
        q, k, v, phi, dout = (t.cuda() for t in _inputs(2, 3, tq, tk, 32, dtype=dtype, seed=tq))
        got = _fwd_bwd(
            lambda *x, bs=bs: chunked_fpa_attention(*x, kind=kind, block_size=bs), q, k, v, phi, dout
        )
        want = _fwd_bwd(lambda *x: fpa_attention_naive(*x, kind=kind), q, k, v, phi, dout)
        _assert_all_close(got, want, **tol)


@pytest.mark.slow
def test_bf16_long_sequence_with_large_field_keeps_precision():
    """bf16 q, k, v at T = 8192 with a field of magnitude up to 1e4 (kept in fp32): output and every
    gradient track a float64 run on the same values to bf16 accuracy. b_ij = min - phi_j cancels two
    numbers near 1e4; a field held in bf16 anywhere (steps of 64 there) would be off by whole logits."""
    b, h, t, d = 1, 1, 8192, 32
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, t, d, generator=g).bfloat16() for _ in range(4))
    u = torch.randn(b, h, t, generator=g) * 0.7 - 0.001  # a walk with dips of a few units ...
    u[..., 0] -= 1e4  # ... around -1e4: fp32 keeps steps of 1e-3 there, bf16 steps of 64
    phi = u.cumsum(-1)
    assert phi.abs().min() > 9e3

    def run(dtype, field_dtype):
        return _fwd_bwd(
            lambda q, k, v, p: fpa_attention(q, k, v, p, kind="fpa", impl="chunked", block_size=256),
            *(x.to(dtype) for x in (q, k, v)),
            phi.to(field_dtype),
            dout.to(dtype),
        )

    got = run(torch.bfloat16, torch.float32)
    ref = run(torch.float64, torch.float64)
    for name, a, r in zip(("out", "dq", "dk", "dv", "dphi"), got, ref):
        err = (a.double() - r).abs().max().item() / r.abs().max().item()
        assert err < 3e-2, f"{name}: relative error {err:.3g}"
    # The same field rounded to bf16 loses it: the check above can fail.
    bad = run(torch.bfloat16, torch.bfloat16)[0]
    assert (bad.double() - ref[0]).abs().max().item() > 0.1


def test_attention_kinds_resolve_once_to_their_flags():
    """The kind spec every path reads: flags per kind, kernel ids as the Triton kernels number them."""
    from fpa_model.config import ATTENTION_KINDS
    from fpa_model.ops.fpa.kinds import SPECS, resolve_kind

    flags = {n: (s.has_field, s.range_min, s.query_term, s.fixed_field) for n, s in SPECS.items()}
    assert flags == {
        "fpa": (True, True, False, None),
        "fox": (True, False, True, "gate"),
        "softmax": (False, False, False, None),
    }
    assert tuple(SPECS) == ATTENTION_KINDS
    assert all(resolve_kind(n) is resolve_kind(s) is s for n, s in SPECS.items())
    with pytest.raises(ValueError, match="unknown attention kind 'nope'"):
        resolve_kind("nope")
    tk = pytest.importorskip("fpa_model.ops.fpa.triton_kernel")
    assert {n: s.kernel_id for n, s in SPECS.items()} == tk._KIND_ID
