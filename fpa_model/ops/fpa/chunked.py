"""Chunked (flash-style, O(T) memory) FPA attention in PyTorch with a hand-written backward.

This is the CPU path of the model and the reference the Triton kernel and the sequence-parallel (ring)
attention are built against. Math: shared/design/FPA.md ("Definition", "Tiled computation").

Kinds: "fpa"  b_ij = min_{j <= t <= i} phi_t - phi_j
       "fox"  b_ij = phi_i - phi_j
       "softmax" b_ij = 0
logit_ij = scale * q_i . k_j + b_ij, causal (key j <= query i), out_i = softmax_j(logit_ij) . v_j.

Memory. Only O(T) state is saved for the backward (q, k, v, phi as given, out, lse). The T x T score
matrix never exists: work is done on tiles of `block_size` queries x `block_size` keys. To cut Python
overhead, the tiles on one block diagonal (query block qb, key block qb - d for a fixed d) are processed
together, a bounded number at a time (at most `_TILE_ROWS` query rows per step), so the workspace is
B x H x _TILE_ROWS x block_size whatever T is.

Tie rule (shared with triton_kernel.py). Where several positions hold the minimum of phi over a range,
the argmin is the LOWEST (earliest) index among them. In the tiled form min(S_j, M, P_i) the three ranges
are ordered key block < between blocks < query block, so ties go S first, then M, then P. The value of
b is the same either way; the rule only decides which phi_t receives the gradient
d b_ij / d phi_t = [t = argmin_{[j, i]} phi] - [t = j].
(naive.py's autograd through torch.cummin follows the same rule on CPU, which the tests check.)

Building blocks (public; the ring attention reuses them). All accept any leading dims "..." (e.g.
(B, H) or (B, H, n_tiles)), take q, k, v, phi in any float dtype, compute in float32 and return float32.
`scale` defaults to 1/sqrt(D).

fpa_cross_forward(q, k, v, phi_q, phi_k, m_between, *, kind, scale) -> (out, lse)
    A query chunk against a key chunk that lies strictly EARLIER in the sequence (no causal mask).
    q (..., Lq, D), k (..., Lk, D), v (..., Lk, Dv), phi_q (..., Lq) the field at the query chunk's
    positions, phi_k (..., Lk) at the key chunk's positions, m_between (...) the min of phi over every
    position strictly between the two chunks (+inf when they are adjacent; ignored unless kind="fpa").
    fpa: b_ij = min(P_i, S_j, M) - phi_k_j with P = prefix_min(phi_q), S = suffix_min(phi_k).
    out (..., Lq, Dv), lse (..., Lq) = logsumexp_j logit_ij.
fpa_diag_forward(q, k, v, phi, *, kind, scale) -> (out, lse)
    A chunk against itself, causal. k, v, phi cover Lk positions; q (..., Lq, D) with Lq <= Lk are the
    LAST Lq of them (Lq == Lk in training). The range min is computed directly (O(L^2) per chunk).
fpa_cross_backward(dout, q, k, v, phi_q, phi_k, m_between, lse, *, out=None, delta=None, kind, scale)
    -> CrossGrads(dq, dk, dv, dphi_q, dphi_k, dm)
fpa_diag_backward(dout, q, k, v, phi, lse, *, out=None, delta=None, kind, scale)
    -> DiagGrads(dq, dk, dv, dphi)
    Flash-attention-2 style: `lse` (and `out` or `delta`) must be those of the FULL attention row (after
    merging every chunk), not of this chunk alone; delta = rowsum(dout * out) (see attention_delta).
    The field gradients are already routed inside the chunks: dphi_q to argP(i), dphi_k to argS(j) and
    to the -phi_j term. dm (...) is the gradient that reaches m_between; the caller adds it to phi at
    the argmin of M (its lowest index, see block_min). dphi for the diagonal covers its Lk positions.
merge_lse(out_a, lse_a, out_b, lse_b) -> (out, lse)
    Combines two partial attentions over disjoint key sets; an empty part has lse = -inf.
prefix_min / suffix_min / block_min: running minima of phi with their lowest-index argmins.

The autograd entry point is `chunked_fpa_attention(q, k, v, phi, *, kind, scale, block_size)` with
q (B, H, Tq, D), k (B, H, Tk, D), v (B, H, Tk, Dv), phi (B, H, Tk); queries are the last Tq positions.
Its output has q's dtype; gradients have their inputs' dtypes. It is not twice differentiable.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from fpa_model.ops.fpa.naive import KINDS

# Upper bound on query rows handled in one batched tile step: keeps the workspace (B*H*rows*block
# floats per temporary) in cache and independent of T.
_TILE_ROWS = 256

_INF = float("inf")


class CrossGrads(NamedTuple):
    dq: torch.Tensor  # (..., Lq, D)
    dk: torch.Tensor  # (..., Lk, D)
    dv: torch.Tensor  # (..., Lk, Dv)
    dphi_q: torch.Tensor  # (..., Lq), routed to argP within the query chunk
    dphi_k: torch.Tensor  # (..., Lk), routed to argS within the key chunk, minus the -phi_j term
    dm: torch.Tensor  # (...), gradient of m_between (zero unless kind="fpa")


class DiagGrads(NamedTuple):
    dq: torch.Tensor  # (..., Lq, D)
    dk: torch.Tensor  # (..., Lk, D)
    dv: torch.Tensor  # (..., Lk, Dv)
    dphi: torch.Tensor  # (..., Lk)


# ----------------------------------------------------------------------------------------------------
# Running minima with the lowest-index tie rule
# ----------------------------------------------------------------------------------------------------


def prefix_min(phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """P_t = min(phi_0..phi_t) over the last dim and its lowest argmin (int64, local index)."""
    vals = torch.cummin(phi, dim=-1).values
    idx = torch.arange(phi.shape[-1], device=phi.device)
    prev = torch.cat([torch.full_like(vals[..., :1], _INF), vals[..., :-1]], dim=-1)
    # A new minimum is set at t only when phi_t is strictly below all before it, so equal values keep the
    # earlier index. (torch.cummin's own index keeps the latest on CPU; we do not rely on it.)
    setter = torch.where(phi < prev, idx, torch.zeros_like(idx))
    return vals, torch.cummax(setter, dim=-1).values


def suffix_min(phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = min(phi_t..phi_end) over the last dim and its lowest argmin (int64, local index)."""
    n = phi.shape[-1]
    vals = torch.cummin(phi.flip(-1), dim=-1).values.flip(-1)
    idx = torch.arange(n, device=phi.device)
    # t is a "record" when phi_t is the min of [t, end]; the lowest argmin of [j, end] is the first
    # record at or after j (a reverse running min of record indices; no reliance on cummin's ties).
    rec = torch.where(phi == vals, idx, torch.full_like(idx, n))
    return vals, torch.cummin(rec.flip(-1), dim=-1).values.flip(-1)


def block_min(phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """min of phi over the last dim and its lowest argmin (local), i.e. suffix_min at position 0."""
    vals, arg = suffix_min(phi)
    return vals[..., 0], arg[..., 0]


def _range_min_diag(
    phi: torch.Tensor, lq: int, with_arg: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """R_ij = min_{j <= t <= i} phi_t for the last lq positions i (as rows), all key positions j.

    Returns (R, lowest argmin or None, future mask). Entries with j > i are +inf (masked by the caller).
    """
    lk = phi.shape[-1]
    off = lk - lq
    kpos = torch.arange(lk, device=phi.device)
    future = kpos[None, :] > (kpos[off:, None])  # (lq, lk)
    a = phi.unsqueeze(-2).masked_fill(future, _INF)  # row i: phi with everything after i removed
    r = torch.cummin(a.flip(-1), dim=-1).values.flip(-1)
    if not with_arg:
        return r, None, future
    rec = torch.where(a == r, kpos, lk)  # same record trick as suffix_min, row by row
    arg = torch.cummin(rec.flip(-1), dim=-1).values.flip(-1)
    return r, arg, future


# ----------------------------------------------------------------------------------------------------
# Tile cores. qs is q already multiplied by scale, everything float32. They return unscaled dq (= ds@k).
# ----------------------------------------------------------------------------------------------------


def _softmax_stats(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(s) @ v, logsumexp(s)) over the last dim, reusing s as the workspace."""
    m = s.amax(dim=-1, keepdim=True)
    s.sub_(m).exp_()
    den = s.sum(dim=-1, keepdim=True)
    out = torch.matmul(s, v).div_(den)
    return out, (m + den.log()).squeeze(-1)


def _cross_logits(
    qs: torch.Tensor,
    k: torch.Tensor,
    kind: str,
    row: torch.Tensor | None,
    s_min: torch.Tensor | None,
    phi_k: torch.Tensor | None,
) -> torch.Tensor:
    """scale*q.k + b for a cross tile. fpa: row = min(P_i, M); fox: row = phi_q_i."""
    s = torch.matmul(qs, k.transpose(-1, -2))
    if kind == "fpa":
        s.add_(torch.minimum(row.unsqueeze(-1), s_min.unsqueeze(-2))).sub_(phi_k.unsqueeze(-2))
    elif kind == "fox":
        s.add_(row.unsqueeze(-1) - phi_k.unsqueeze(-2))
    return s


def _cross_fwd_core(qs, k, v, kind, row, s_min, phi_k):
    return _softmax_stats(_cross_logits(qs, k, kind, row, s_min, phi_k), v)


def _cross_bwd_core(qs, k, v, do, lse, delta, kind, p_min, arg_p, m_between, s_min, arg_s, phi_q, phi_k):
    """Gradients of one batch of cross tiles. Returns (dq_unscaled, dk, dv, dphi_q, dphi_k, dm)."""
    row = None
    if kind == "fpa":
        row = torch.minimum(p_min, m_between.unsqueeze(-1))
    elif kind == "fox":
        row = phi_q
    p = _cross_logits(qs, k, kind, row, s_min, phi_k)
    p.sub_(lse.unsqueeze(-1)).exp_()
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = torch.matmul(do, v.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)
    del p
    dq = torch.matmul(ds, k)
    dk = torch.matmul(ds.transpose(-1, -2), qs)
    dphi_q = dphi_k = dm = None
    if kind == "fpa":
        # Route ds_ij to the argmin of min(S_j, M, P_i): S wins ties (lowest index), then M, then P.
        s_wins = s_min.unsqueeze(-2) <= row.unsqueeze(-1)
        ds_s = ds * s_wins
        col_s = ds_s.sum(dim=-2)
        rest = ds.sum(dim=-1) - ds_s.sum(dim=-1)  # per query: the part that goes to min(P_i, M)
        del ds_s
        m_wins = m_between.unsqueeze(-1) <= p_min
        dm = (rest * m_wins).sum(dim=-1)
        dphi_q = torch.zeros_like(p_min).scatter_add_(-1, arg_p, rest.masked_fill_(m_wins, 0.0))
        dphi_k = torch.zeros_like(s_min).scatter_add_(-1, arg_s, col_s).sub_(ds.sum(dim=-2))
    elif kind == "fox":
        dphi_q = ds.sum(dim=-1)
        dphi_k = ds.sum(dim=-2).neg_()
    return dq, dk, dv, dphi_q, dphi_k, dm


def _diag_logits(qs, k, phi, kind, with_arg):
    lq = qs.shape[-2]
    s = torch.matmul(qs, k.transpose(-1, -2))
    arg = None
    if kind == "fpa":
        r, arg, future = _range_min_diag(phi, lq, with_arg)
        s.add_(r.masked_fill_(future, 0.0)).sub_(phi.unsqueeze(-2))
    else:
        lk = k.shape[-2]
        kpos = torch.arange(lk, device=k.device)
        future = kpos[None, :] > kpos[lk - lq :, None]
        if kind == "fox":
            s.add_(phi[..., lk - lq :].unsqueeze(-1) - phi.unsqueeze(-2))
    return s.masked_fill_(future, -_INF), arg


def _diag_fwd_core(qs, k, v, phi, kind):
    s, _ = _diag_logits(qs, k, phi, kind, with_arg=False)
    return _softmax_stats(s, v)


def _diag_bwd_core(qs, k, v, phi, do, lse, delta, kind):
    """Gradients of a batch of diagonal tiles. Returns (dq_unscaled, dk, dv, dphi or None)."""
    p, arg = _diag_logits(qs, k, phi, kind, with_arg=True)
    p.sub_(lse.unsqueeze(-1)).exp_()
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = torch.matmul(do, v.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)
    del p
    dq = torch.matmul(ds, k)
    dk = torch.matmul(ds.transpose(-1, -2), qs)
    dphi = None
    if kind == "fpa":
        dphi = torch.zeros_like(phi).scatter_add_(-1, arg.flatten(-2), ds.flatten(-2)).sub_(ds.sum(dim=-2))
    elif kind == "fox":
        lq = qs.shape[-2]
        dphi = ds.sum(dim=-2).neg_()
        dphi[..., dphi.shape[-1] - lq :] += ds.sum(dim=-1)
    return dq, dk, dv, dphi


# ----------------------------------------------------------------------------------------------------
# Public building blocks
# ----------------------------------------------------------------------------------------------------


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; expected one of {KINDS}")


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _f32(x: torch.Tensor) -> torch.Tensor:
    # Half types accumulate in float32; float64 stays float64 so gradcheck sees exact arithmetic.
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def attention_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """delta_i = sum_d dout_id * out_id in float32 (the flash-attention-2 backward's row term)."""
    return (_f32(dout) * _f32(out)).sum(dim=-1)


def merge_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial softmax attentions over disjoint key sets by log-sum-exp (float32)."""
    lse = torch.logaddexp(_f32(lse_a), _f32(lse_b))
    # Rows empty in both parts keep lse = -inf and out = 0 instead of NaN.
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = _f32(out_a) * (lse_a - ref).exp().unsqueeze(-1) + _f32(out_b) * (lse_b - ref).exp().unsqueeze(-1)
    return out, lse


def _cross_field(kind, phi_q, phi_k, m_between):
    """Per-kind field inputs of a cross tile: (row term, S, argS, P, argP, M) as float32."""
    if kind == "fpa":
        p_min, arg_p = prefix_min(_f32(phi_q))
        s_min, arg_s = suffix_min(_f32(phi_k))
        m = _f32(m_between).expand(p_min.shape[:-1])
        return torch.minimum(p_min, m.unsqueeze(-1)), s_min, arg_s, p_min, arg_p, m
    if kind == "fox":
        return _f32(phi_q), None, None, None, None, None
    return None, None, None, None, None, None


def fpa_cross_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor | None,
    phi_k: torch.Tensor | None,
    m_between: torch.Tensor | None,
    *,
    kind: str,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a query chunk against a strictly earlier key chunk; see the module docstring."""
    _check_kind(kind)
    qs = _f32(q) * _scale(q, scale)
    row, s_min, _, _, _, _ = _cross_field(kind, phi_q, phi_k, m_between)
    pk = _f32(phi_k) if kind != "softmax" else None
    return _cross_fwd_core(qs, _f32(k), _f32(v), kind, row, s_min, pk)


def fpa_diag_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None,
    *,
    kind: str,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a chunk against itself, causal; q are the last Lq of the Lk positions."""
    _check_kind(kind)
    qs = _f32(q) * _scale(q, scale)
    pk = _f32(phi) if phi is not None else None
    return _diag_fwd_core(qs, _f32(k), _f32(v), pk, kind)


def _delta(dout, out, delta):
    if delta is not None:
        return _f32(delta)
    if out is None:
        raise ValueError("the tile backward needs either out or delta (= rowsum(dout * out))")
    return attention_delta(dout, out)


def fpa_cross_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor | None,
    phi_k: torch.Tensor | None,
    m_between: torch.Tensor | None,
    lse: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    kind: str,
    scale: float | None = None,
) -> CrossGrads:
    """Gradients of a cross tile given the full-row lse and out (or delta); see the module docstring."""
    _check_kind(kind)
    sc = _scale(q, scale)
    qs = _f32(q) * sc
    delta = _delta(dout, out, delta)
    row, s_min, arg_s, p_min, arg_p, m = _cross_field(kind, phi_q, phi_k, m_between)
    pq = _f32(phi_q) if kind == "fox" else None
    pk = _f32(phi_k) if kind != "softmax" else None
    dq, dk, dv, dphi_q, dphi_k, dm = _cross_bwd_core(
        qs, _f32(k), _f32(v), _f32(dout), _f32(lse), delta, kind, p_min, arg_p, m, s_min, arg_s, pq, pk
    )
    lead_q, lead_k = q.shape[:-1], k.shape[:-1]
    if dphi_q is None:
        dphi_q = q.new_zeros(lead_q, dtype=torch.float32)
        dphi_k = k.new_zeros(lead_k, dtype=torch.float32)
    if dm is None:
        dm = q.new_zeros(q.shape[:-2], dtype=torch.float32)
    return CrossGrads(dq.mul_(sc), dk, dv, dphi_q, dphi_k, dm)


def fpa_diag_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None,
    lse: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    kind: str,
    scale: float | None = None,
) -> DiagGrads:
    """Gradients of a causal diagonal tile given the full-row lse and out (or delta)."""
    _check_kind(kind)
    sc = _scale(q, scale)
    qs = _f32(q) * sc
    delta = _delta(dout, out, delta)
    pk = _f32(phi) if phi is not None else None
    dq, dk, dv, dphi = _diag_bwd_core(qs, _f32(k), _f32(v), pk, _f32(dout), _f32(lse), delta, kind)
    if dphi is None:
        dphi = k.new_zeros(k.shape[:-1], dtype=torch.float32)
    return DiagGrads(dq.mul_(sc), dk, dv, dphi)


# ----------------------------------------------------------------------------------------------------
# The full causal op, built from the tile cores
# ----------------------------------------------------------------------------------------------------


class _Plan:
    """Block layout of one call. Keys are padded at the end to n_blk * bs; queries are padded at the
    front with `front` dummy rows (real positions whose outputs are dropped) so query blocks line up with
    key blocks, and at the end like the keys. Query block i is key block qb0 + i."""

    def __init__(self, tq: int, tk: int, bs: int) -> None:
        self.bs = bs
        self.n_blk = -(-tk // bs)
        self.back = self.n_blk * bs - tk
        offset = tk - tq
        self.qb0 = offset // bs
        self.front = offset - self.qb0 * bs
        self.nq = self.n_blk - self.qb0
        self.tq, self.tk = tq, tk
        # Query-block groups per block diagonal d, each at most _TILE_ROWS rows.
        self.group = max(1, _TILE_ROWS // bs)

    def groups(self, d: int):
        """(query-block slice, key-block slice) pairs for block diagonal d >= 1."""
        lo = max(self.qb0, d)
        for g0 in range(lo, self.n_blk, self.group):
            g1 = min(g0 + self.group, self.n_blk)
            yield slice(g0 - self.qb0, g1 - self.qb0), slice(g0 - d, g1 - d)


def _pad_rows(x: torch.Tensor, front: int, back: int) -> torch.Tensor:
    if front == 0 and back == 0:
        return x
    if x.dim() == 3:  # phi (B, H, T)
        return torch.nn.functional.pad(x, (front, back))
    return torch.nn.functional.pad(x, (0, 0, front, back))


class _Field:
    """Per-block minima of the (padded) field, computed once per call: O(T)."""

    def __init__(self, phib: torch.Tensor, plan: _Plan) -> None:
        # phib: (B, H, n_blk, bs)
        self.s_min, self.arg_s = suffix_min(phib)
        self.p_min, self.arg_p = prefix_min(phib[:, :, plan.qb0 :])
        self.bmin = self.s_min[..., 0]
        starts = torch.arange(plan.n_blk, device=phib.device) * plan.bs
        self.bargmin = self.arg_s[..., 0] + starts  # global index of each block's lowest argmin
        # Running min of the blocks strictly between key block qb-d and query block qb (one per query
        # block), updated as d grows; +inf while the blocks are adjacent.
        self.m_run = torch.full_like(self.p_min[..., 0], _INF)
        self.m_arg = torch.zeros_like(self.arg_p[..., 0])

    def advance(self, d: int, plan: _Plan) -> None:
        """Move from diagonal d-1 to d: block qb-d+1 becomes 'between' for every active query block."""
        if d < 2:
            return
        lo = max(plan.qb0, d)
        qi = slice(lo - plan.qb0, plan.n_blk - plan.qb0)
        nb = slice(lo - d + 1, plan.n_blk - d + 1)
        new, new_arg = self.bmin[:, :, nb], self.bargmin[:, :, nb]
        take = new <= self.m_run[:, :, qi]  # the newly added block is earlier: it wins ties
        self.m_run[:, :, qi] = torch.where(take, new, self.m_run[:, :, qi])
        self.m_arg[:, :, qi] = torch.where(take, new_arg, self.m_arg[:, :, qi])


def _prepare(q, k, v, phi, scale, plan: _Plan):
    b, h, _, d = q.shape
    bs = plan.bs
    qs = _pad_rows(_f32(q) * scale, plan.front, plan.back).view(b, h, plan.nq, bs, d)
    kb = _pad_rows(_f32(k), 0, plan.back).view(b, h, plan.n_blk, bs, d)
    vb = _pad_rows(_f32(v), 0, plan.back).view(b, h, plan.n_blk, bs, v.shape[-1])
    phib = None if phi is None else _pad_rows(_f32(phi), 0, plan.back).view(b, h, plan.n_blk, bs)
    return qs, kb, vb, phib


def _forward(q, k, v, phi, kind: str, scale: float, plan: _Plan):
    """Padded (out (B,H,nq,bs,Dv), lse (B,H,nq,bs)) in float32."""
    qs, kb, vb, phib = _prepare(q, k, v, phi, scale, plan)
    qb0 = plan.qb0
    diag_phi = None if phib is None else phib[:, :, qb0:]
    out, lse = _diag_fwd_core(qs, kb[:, :, qb0:], vb[:, :, qb0:], diag_phi, kind)
    field = _Field(phib, plan) if kind == "fpa" else None
    for d in range(1, plan.n_blk):
        if field is not None:
            field.advance(d, plan)
        for qi, ki in plan.groups(d):
            row = s_min = phi_k = None
            if kind == "fpa":
                row = torch.minimum(field.p_min[:, :, qi], field.m_run[:, :, qi, None])
                s_min, phi_k = field.s_min[:, :, ki], phib[:, :, ki]
            elif kind == "fox":
                row, phi_k = phib[:, :, qb0:][:, :, qi], phib[:, :, ki]
            o_t, l_t = _cross_fwd_core(qs[:, :, qi], kb[:, :, ki], vb[:, :, ki], kind, row, s_min, phi_k)
            o_m, l_m = merge_lse(out[:, :, qi], lse[:, :, qi], o_t, l_t)
            out[:, :, qi] = o_m
            lse[:, :, qi] = l_m
    return out, lse


def _backward(dout, q, k, v, phi, out, lse, kind: str, scale: float, plan: _Plan):
    b, h, _, d_qk = q.shape
    bs, qb0 = plan.bs, plan.qb0
    qs, kb, vb, phib = _prepare(q, k, v, phi, scale, plan)
    do = _pad_rows(_f32(dout), plan.front, plan.back).view(b, h, plan.nq, bs, v.shape[-1])
    delta = _pad_rows(attention_delta(dout, out), plan.front, plan.back).view(b, h, plan.nq, bs)
    diag_phi = None if phib is None else phib[:, :, qb0:]
    dq, dk_d, dv_d, dphi_d = _diag_bwd_core(
        qs, kb[:, :, qb0:], vb[:, :, qb0:], diag_phi, do, lse, delta, kind
    )
    dk = torch.zeros_like(kb)
    dv = torch.zeros_like(vb)
    dk[:, :, qb0:] = dk_d
    dv[:, :, qb0:] = dv_d
    dphi = None
    if kind != "softmax":
        dphi = torch.zeros_like(phib)
        dphi[:, :, qb0:] = dphi_d
    field = _Field(phib, plan) if kind == "fpa" else None
    for d in range(1, plan.n_blk):
        if field is not None:
            field.advance(d, plan)
        for qi, ki in plan.groups(d):
            a = dict(p_min=None, arg_p=None, m_between=None, s_min=None, arg_s=None, phi_q=None, phi_k=None)
            if kind == "fpa":
                a.update(
                    p_min=field.p_min[:, :, qi],
                    arg_p=field.arg_p[:, :, qi],
                    m_between=field.m_run[:, :, qi],
                    s_min=field.s_min[:, :, ki],
                    arg_s=field.arg_s[:, :, ki],
                    phi_k=phib[:, :, ki],
                )
            elif kind == "fox":
                a.update(phi_q=phib[:, :, qb0:][:, :, qi], phi_k=phib[:, :, ki])
            g = _cross_bwd_core(
                qs[:, :, qi], kb[:, :, ki], vb[:, :, ki], do[:, :, qi], lse[:, :, qi], delta[:, :, qi], kind,
                a["p_min"], a["arg_p"], a["m_between"], a["s_min"], a["arg_s"], a["phi_q"], a["phi_k"],
            )  # fmt: skip
            dq[:, :, qi] += g[0]
            dk[:, :, ki] += g[1]
            dv[:, :, ki] += g[2]
            if dphi is not None:
                dphi[:, :, qb0:][:, :, qi] += g[3]
                dphi[:, :, ki] += g[4]
            if kind == "fpa":
                # The between-blocks min is one scalar per tile: its gradient lands on its argmin.
                dphi.view(b, h, -1).scatter_add_(-1, field.m_arg[:, :, qi], g[5])
    dq = dq.view(b, h, -1, d_qk)[:, :, plan.front : plan.front + plan.tq].mul_(scale)
    dk = dk.view(b, h, -1, d_qk)[:, :, : plan.tk]
    dv = dv.view(b, h, -1, v.shape[-1])[:, :, : plan.tk]
    if dphi is not None:
        dphi = dphi.view(b, h, -1)[:, :, : plan.tk]
    return dq, dk, dv, dphi


class _ChunkedFPAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, phi, kind, scale, block_size):
        plan = _Plan(q.shape[-2], k.shape[-2], block_size)
        out_p, lse = _forward(q, k, v, phi, kind, scale, plan)
        out = out_p.view(*q.shape[:2], -1, v.shape[-1])[:, :, plan.front : plan.front + plan.tq]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, phi, out, lse)
        ctx.kind, ctx.scale, ctx.plan = kind, scale, plan
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, phi, out, lse = ctx.saved_tensors
        dq, dk, dv, dphi = _backward(dout, q, k, v, phi, out, lse, ctx.kind, ctx.scale, ctx.plan)
        dphi_out = None
        if phi is not None and ctx.needs_input_grad[3]:
            dphi_out = dphi.to(phi.dtype) if dphi is not None else torch.zeros_like(phi)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dphi_out, None, None, None


def _validate(q, k, v, phi, kind, block_size):
    _check_kind(kind)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (B, H, T, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "(need equal B, H; equal D for q, k; equal T for k, v)"
        )
    if q.shape[-2] > k.shape[-2]:
        raise ValueError(
            f"more queries ({q.shape[-2]}) than keys ({k.shape[-2]}): queries are the last Tq keys"
        )
    if q.shape[-2] == 0:
        raise ValueError("empty query sequence")
    if phi is None and kind != "softmax":
        raise ValueError(f"kind {kind!r} needs a field phi")
    if phi is not None and phi.shape != k.shape[:3]:
        raise ValueError(f"phi must be (B, H, Tk) = {tuple(k.shape[:3])}; got {tuple(phi.shape)}")
    if not all(t.is_floating_point() for t in (q, k, v)):
        raise ValueError("q, k, v must be floating point")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}")


def chunked_fpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None = None,
    *,
    kind: str = "fpa",
    scale: float | None = None,
    block_size: int = 64,
) -> torch.Tensor:
    """Causal FPA/FoX/softmax attention with O(T) memory; same contract as fpa_attention_naive."""
    _validate(q, k, v, phi, kind, block_size)
    return _ChunkedFPAFunction.apply(q, k, v, phi, kind, _scale(q, scale), block_size)


__all__ = [
    "CrossGrads",
    "DiagGrads",
    "attention_delta",
    "block_min",
    "chunked_fpa_attention",
    "fpa_cross_backward",
    "fpa_cross_forward",
    "fpa_diag_backward",
    "fpa_diag_forward",
    "merge_lse",
    "prefix_min",
    "suffix_min",
]
