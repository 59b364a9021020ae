"""Chunked (flash-style, O(T) memory) FPA attention in PyTorch with a hand-written backward.

This is the CPU path of the model and the reference the Triton kernel and the sequence-parallel (ring)
attention are built against. Math: docs/design.md ("The first-passage bias", "Tiled computation").

Kinds: "fpa"  b_ij = min_{j <= t <= i} phi_t - phi_j
       "fox"  b_ij = phi_i - phi_j
       "softmax" b_ij = 0
logit_ij = scale * q_i . k_j + b_ij, causal (key j <= query i), out_i = softmax_j(logit_ij) . v_j.

Memory. Only O(T) state is saved for the backward (q, k, v, phi as given, out, lse). The T x T score
matrix never exists: work is done on tiles of `block_size` queries x `block_size` keys. To cut Python
overhead, the tiles on one block diagonal (query block qb, key block qb - d for a fixed d) are processed
together as one batched matmul, a bounded number at a time (at most _TILE_ELEMS scores per step), so
the workspace is at most min(T * block, _TILE_ELEMS) scores per batch*head whatever T is.

Speed (CPU). The per-row and per-column parts of the bias (-phi_j, fox's +phi_i, -lse_i, -delta_i) ride
in extra columns of the matmul operands, fpa's min(P_i, M, S_j) is written into the score buffer and the
matmul accumulates onto it, so a cross tile costs two elementwise passes beyond plain flash attention.
Diagonal tiles use the same prefix/suffix/between decomposition at sub-block (_SUB) granularity and a
direct range min only inside sub-blocks. The forward accumulates cross tiles relative to the diagonal
tile's lse (no per-tile rescaling); if a logit exceeds it by ~88 (float32 exp overflow) it detects the
non-finite sum and recomputes with exact per-tile max-shifts and log-sum-exp merges.

Tie rule (shared with triton_kernel.py). Where several positions hold the minimum of phi over a range,
the argmin is the LOWEST (earliest) index among them. In the tiled form min(S_j, M, P_i) the three ranges
are ordered key block < between blocks < query block, so ties go S first, then M, then P. The value of
b is the same either way; the rule only decides which phi_t receives the gradient
d b_ij / d phi_t = [t = argmin_{[j, i]} phi] - [t = j].
(naive.py's autograd through torch.cummin follows the same rule on CPU, which the tests check.)

Building blocks (public; the ring attention reuses them). All accept any leading dims "..." (e.g.
(B, H) or (B, H, n_tiles)), take q, k, v, phi in any float dtype, compute in float32 (float64 stays
float64) and return that dtype. Argmin indices are int64, local to their chunk.
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
    LAST Lq of them (Lq == Lk in training). Square chunks whose length is a multiple of _SUB use the
    two-level decomposition; others compute the range min directly (O(Lq * Lk) cummin).
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

from fpa_model.ops.fpa import skipping
from fpa_model.ops.fpa.kinds import AttentionKind, resolve_kind
from fpa_model.ops.fpa.segments import check_segment_ids

# Upper bound on score elements (B*H x tiles x block x block) per batched tile step: keeps each
# temporary in cache and the workspace independent of T.
_TILE_ELEMS = 1 << 19

_INF = float("inf")

# Shifted logits are floored here before exp. Below about -87 float32 exp returns denormals, and
# weights that small also make denormal products in the backward (ds = p * (dp - delta)); denormal
# operands make exp and matmul 20-60x slower on x86, and FoX's long-range decay and FPA's erasure put many
# logits there. A floored weight is e^-64 ~ 1.6e-28 relative to the row's reference (its diagonal or
# final lse) instead of smaller: far below float32 resolution. Masked (future) entries stay exactly 0.
_EXP_FLOOR = -64.0


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


_CUMMIN_KEEPS_LAST: dict[str, bool] = {}


def _cummin_keeps_last(device: torch.device) -> bool:
    """Whether torch.cummin reports the LAST index among equal values on this device type (CPU does).
    Checked once per device type: the fast diagonal argmin relies on it, else a slower exact path runs."""
    key = device.type
    if key not in _CUMMIN_KEEPS_LAST:
        idx = torch.cummin(torch.zeros(3, device=device), dim=0).indices
        _CUMMIN_KEEPS_LAST[key] = idx.tolist() == [0, 1, 2]
    return _CUMMIN_KEEPS_LAST[key]


def _causal_masks(lq: int, lk: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masks for queries = the last lq of lk positions: (finite BIG above the diagonal else 0, -inf above
    the diagonal else 0, 0 above the diagonal else 1). Float masks applied by add/mul are far cheaper
    than masked_fill."""
    kpos = torch.arange(lk, device=like.device)
    future = kpos[None, :] > kpos[lk - lq :, None]
    big = torch.zeros(lq, lk, dtype=like.dtype, device=like.device)
    big.masked_fill_(future, torch.finfo(like.dtype).max / 4)
    neg = torch.zeros(lq, lk, dtype=like.dtype, device=like.device).masked_fill_(future, -_INF)
    return big, neg, (~future).to(like.dtype)


def _range_min_diag(
    phi: torch.Tensor, big: torch.Tensor, with_arg: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """R_ij = min_{j <= t <= i} phi_t for queries i (the last Lq positions, rows) and keys j (columns).

    Entries with j > i hold a huge finite value (the caller adds -inf there). With with_arg, also the
    lowest argmin (int64, local key index)."""
    a = phi.unsqueeze(-2) + big  # row i: phi with every position after i pushed to +BIG
    rev = torch.cummin(a.flip(-1), dim=-1)
    r = rev.values.flip(-1)
    if not with_arg:
        return r, None
    lk = phi.shape[-1]
    if _cummin_keeps_last(phi.device):
        # On the flipped row the last of equal minima is the lowest original index: the tie rule.
        return r, (lk - 1) - rev.indices.flip(-1)
    kpos = torch.arange(lk, device=phi.device)
    rec = torch.where(a == r, kpos, lk)  # records, as in suffix_min
    return r, torch.cummin(rec.flip(-1), dim=-1).values.flip(-1)


# Sub-block size of the two-level diagonal: a diagonal tile of L = n * _SUB positions gets its range
# minima from the same prefix/suffix/between decomposition as the cross tiles, at sub-block granularity;
# only the _SUB x _SUB sub-diagonal pieces use the direct (cummin) range min. This keeps the L x L work
# to a few elementwise passes instead of a cummin, two flips and an L^2 scatter.
_SUB = 16


class _DiagField:
    """fpa bias and gradient routing for square causal tiles of size L (a multiple of _SUB, > _SUB).

    Tile entries are viewed as (N, a, i', b, j'): query sub-block a, key sub-block b. For b < a the bias
    is min(P_i, S_j, M_ab) - phi_j (P, S inside the sub-blocks, M_ab = min of the sub-blocks strictly
    between); for b == a it is the direct range min; b > a is the future (-inf). Ties: S, then M, then P,
    then lowest index inside each: the module's tie rule."""

    def __init__(self, phi: torch.Tensor, with_arg: bool) -> None:
        n, length = phi.shape
        sb = _SUB
        nsb = length // sb
        self.n, self.sb, self.nsb = n, sb, nsb
        ph = phi.view(n, nsb, sb)
        self.p_min, self.arg_p = prefix_min(ph)
        self.s_min, self.arg_s = suffix_min(ph)
        bmin = self.s_min[..., 0]  # (n, nsb)
        # M[a, b] = min over sub-blocks t with b < t < a: a suffix min (over t > b) of z[a, t] = bmin[t]
        # for t < a, +inf otherwise. Its lowest argmin names the sub-block; bargmin the position in it.
        t = torch.arange(nsb, device=phi.device)
        z = bmin.unsqueeze(-2).masked_fill(t[None, :] >= t[:, None], _INF)  # (n, a, t)
        zs, zarg = suffix_min(z)
        m = torch.full_like(zs, _INF)
        m[..., :-1] = zs[..., 1:]
        # Same and future sub-blocks: -inf makes min(P, S, M) -inf (masked) and keeps S from "winning".
        m.masked_fill_(t[None, :] >= t[:, None], -_INF)
        self.m = m  # (n, a, b)
        self.lower = (t[None, :] < t[:, None]).to(phi.dtype)  # b < a
        if with_arg:
            bargmin = self.arg_s[..., 0] + t * sb  # (n, nsb) position inside the tile
            zarg_next = torch.zeros_like(zarg)
            zarg_next[..., :-1] = zarg[..., 1:]
            self.m_arg = torch.gather(bargmin, 1, zarg_next.flatten(1)).view(n, nsb, nsb)
        # Direct range min inside each sub-block (BIG above its diagonal, then -inf there).
        big, neg, _ = _causal_masks(sb, sb, phi)
        r, self.r_arg = _range_min_diag(ph.reshape(n * nsb, sb), big, with_arg)
        self.r = (r + neg).view(n, nsb, sb, sb)
        self.pm = torch.minimum(self.p_min.unsqueeze(-1), self.m.unsqueeze(-2)).unsqueeze(-1)  # (n,a,i',b,1)

    def bias_into(self, buf: torch.Tensor) -> torch.Tensor:
        """Writes the (N, L, L) bias (without -phi_j, which rides in the matmul) into buf."""
        n, nsb, sb = self.n, self.nsb, self.sb
        b5 = buf.view(n, nsb, sb, nsb, sb)
        torch.minimum(self.pm, self.s_min.view(n, 1, 1, nsb, sb), out=b5)
        torch.diagonal(b5, 0, 1, 3).copy_(self.r.permute(0, 2, 3, 1))
        return buf

    def route(self, ds: torch.Tensor, buf_w: torch.Tensor | None = None) -> torch.Tensor:
        """d phi (N, L) of sum_ij ds_ij * b_ij, excluding nothing (the -phi_j term included)."""
        n, nsb, sb = self.n, self.nsb, self.sb
        ds5 = ds.view(n, nsb, sb, nsb, sb)
        dphi = ds.sum(dim=-2).neg_()  # the -phi_j term
        w = _new_buf(buf_w, *ds.shape, ds).view(n, nsb, sb, nsb, sb)
        torch.le(self.s_min.view(n, 1, 1, nsb, sb), self.pm, out=w)  # S wins (only where b < a)
        ds_s = w.mul_(ds5)
        col_s = ds_s.sum(dim=(1, 2))  # (n, b, j')
        rest = (ds5.sum(dim=-1) - ds_s.sum(dim=-1)).mul_(self.lower.unsqueeze(-2))  # (n, a, i', b)
        m_wins = self.m.unsqueeze(-2) <= self.p_min.unsqueeze(-1)  # (n, a, i', b)
        d_m = torch.where(m_wins, rest, 0.0).sum(dim=2)  # (n, a, b)
        d_p = torch.where(m_wins, 0.0, rest).sum(dim=-1)  # (n, a, i')
        out = dphi.view(n, nsb, sb)
        out.scatter_add_(-1, self.arg_s, col_s)
        out.scatter_add_(-1, self.arg_p, d_p)
        dphi.scatter_add_(-1, self.m_arg.flatten(1), d_m.flatten(1))
        # Sub-diagonal pieces: direct argmin routing.
        dd = torch.diagonal(ds5, 0, 1, 3).permute(0, 3, 1, 2).reshape(n * nsb, sb * sb)
        out.view(n * nsb, sb).scatter_add_(-1, self.r_arg.flatten(-2), dd)
        return dphi


def _two_level(phi: torch.Tensor | None, lq: int) -> bool:
    length = phi.shape[-1]
    return lq == length and length % _SUB == 0 and length > _SUB


# ----------------------------------------------------------------------------------------------------
# Tile cores, on 3-D operands (N, L, D) where N is any flattened batch (B*H, or tiles x B*H).
# They see "augmented" operands so the per-row and per-column bias terms ride along in the matmul's
# reduction dimension for free (an elementwise pass over a tile costs 10-30% of a matmul on CPU):
#   qa = [scale*q, c, r_i]  ka = [k, -phi_j, 1]   ->  qa . ka = scale q.k - c*phi_j + r_i
# with c = 1 for fpa/fox (0 for softmax) and r_i = (phi_i for fox) - (a per-row reference: the lse in
# the backward, the diagonal's lse in the forward's fast path).
#   doa = [dO, -delta_i]    va = [v, 1]            ->  doa . va = dO.v - delta_i
# fpa's min(P_i, M, S_j) term is written into the score buffer first and the matmul accumulates onto it
# (baddbmm), so it costs one pass. dq/dk/dv accumulate in place into caller buffers the same way.
# `buf` arguments are optional preallocated (N, Lq, Lk) workspaces (reused to avoid page faults).
# ----------------------------------------------------------------------------------------------------


def _augment_q(qs, kind, phi_q, ref):
    """[qs, c, r] with c, r as above; ref (the per-row reference) may be None."""
    c = qs.new_full(qs.shape[:-1], 0.0 if not kind.has_field else 1.0)
    r = _f32(phi_q).clone() if kind.query_term else qs.new_zeros(qs.shape[:-1])
    if ref is not None:
        r = r - ref
    return torch.cat([qs, c.unsqueeze(-1), r.unsqueeze(-1)], dim=-1)


def _augment_k(k, kind, phi_k):
    neg_phi = -_f32(phi_k) if kind.has_field else k.new_zeros(k.shape[:-1])
    return torch.cat([k, neg_phi.unsqueeze(-1), torch.ones_like(neg_phi).unsqueeze(-1)], dim=-1)


def _augment_tail(x, col):
    return torch.cat([x, col.unsqueeze(-1)], dim=-1)


def _new_buf(buf, n, lq, lk, like):
    return torch.empty(n, lq, lk, dtype=like.dtype, device=like.device) if buf is None else buf


def _cross_scores(qa, ka, row, s_min, buf=None):
    """qa . ka (+ min(row_i, S_j) for fpa) into buf: (N, Lq, Lk)."""
    buf = _new_buf(buf, qa.shape[0], qa.shape[1], ka.shape[1], qa)
    if row is None:
        return torch.bmm(qa, ka.transpose(1, 2), out=buf)
    torch.minimum(row.unsqueeze(-1), s_min.unsqueeze(-2), out=buf)
    return buf.baddbmm_(qa, ka.transpose(1, 2))


def _diag_scores(qa, ka, phi, kind, masks, with_arg, buf=None):
    """Causal scores of diagonal tiles (-inf above the diagonal) and, for fpa, the routing info:
    a _DiagField (square tiles) or the direct lowest-index range argmin (N, Lq, Lk)."""
    big, neg, _ = masks
    buf = _new_buf(buf, qa.shape[0], qa.shape[1], ka.shape[1], qa)
    if not kind.range_min:
        return torch.baddbmm(neg, qa, ka.transpose(1, 2), out=buf), None
    if _two_level(phi, qa.shape[1]):
        field = _DiagField(phi, with_arg)
        return field.bias_into(buf).baddbmm_(qa, ka.transpose(1, 2)), field
    r, arg = _range_min_diag(phi, big, with_arg)
    torch.add(r, neg, out=buf)  # BIG + -inf = -inf above the diagonal
    return buf.baddbmm_(qa, ka.transpose(1, 2)), arg


def _exp_(s: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """In-place exp with the argument floored at _EXP_FLOOR (no denormals); `keep` (0/1, causal tiles)
    then zeroes the masked entries exactly. Flooring beats mapping to -inf: exp(-inf) is ~10x slower."""
    s.clamp_min_(_EXP_FLOOR).exp_()
    return s if keep is None else s.mul_(keep)


def _finish_softmax(
    s: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(s) @ v, logsumexp(s)) over the last dim, exact (max-shifted); s is overwritten."""
    m = s.amax(dim=-1, keepdim=True)
    _exp_(s.sub_(m), keep)
    den = s.sum(dim=-1, keepdim=True)
    out = torch.bmm(s, v).div_(den)
    return out, (m + den.log()).squeeze(-1)


def _accumulate(s: torch.Tensor, v: torch.Tensor, acc: torch.Tensor, den: torch.Tensor) -> None:
    """acc += exp(s) @ v, den += rowsum(exp(s)): s already holds logits minus the row reference."""
    _exp_(s)
    den.add_(s.sum(dim=-1))
    acc.baddbmm_(s, v)


def _bwd_tile(p, qs, k, v, va, do, doa, dq, dk, dv, buf_ds=None, keep=None):
    """Shared flash-attention-2 tile backward: p holds logits - lse; accumulates dq (unscaled), dk, dv.
    `keep`: the 0/1 causal mask of diagonal tiles."""
    _exp_(p, keep)
    dv.baddbmm_(p.transpose(1, 2), do)
    ds = torch.bmm(doa, va.transpose(1, 2), out=_new_buf(buf_ds, *p.shape, p)).mul_(p)  # p (dO.v - delta)
    dq.baddbmm_(ds, k)
    dk.baddbmm_(ds.transpose(1, 2), qs)
    return ds


def _route_cross(ds, row, s_min, arg_s, p_min, arg_p, m_between, buf_w=None):
    """fpa: route ds_ij to the argmin of min(S_j, M, P_i); S wins ties (lowest index), then M, then P.

    Returns (dphi_q (N, Lq), dphi_k (N, Lk), dm (N,))."""
    row_all, col_all = ds.sum(dim=-1), ds.sum(dim=-2)
    w = torch.le(s_min.unsqueeze(-2), row.unsqueeze(-1), out=_new_buf(buf_w, *ds.shape, ds))  # float 0/1
    ds_s = w.mul_(ds)
    col_s = ds_s.sum(dim=-2)
    rest = row_all - ds_s.sum(dim=-1)  # per query: the part that goes to min(P_i, M)
    return route_cross_sums(rest, col_s, col_all, arg_s, p_min, arg_p, m_between)


def route_cross_sums(rest, col_s, col_all, arg_s, p_min, arg_p, m_between):
    """The fpa cross-tile field gradients from ds sums already split by winner: `rest` (N, Lq) per query
    where min(P_i, M) won, `col_s` (N, Lk) per key where S_j won, `col_all` (N, Lk) per key. M wins ties
    against P (it is earlier). Returns (dphi_q (N, Lq), dphi_k (N, Lk), dm (N,)); the Triton blocks'
    kernels return the same sums, so both paths route here."""
    m_wins = m_between.unsqueeze(-1) <= p_min
    dm = torch.where(m_wins, rest, 0.0).sum(dim=-1)
    dphi_q = torch.zeros_like(p_min).scatter_add_(-1, arg_p, torch.where(m_wins, 0.0, rest))
    dphi_k = torch.zeros_like(col_s).scatter_add_(-1, arg_s, col_s).sub_(col_all)
    return dphi_q, dphi_k, dm


def _route_diag(ds, arg, kind, buf_w=None):
    """Field gradient of diagonal tiles: (N, Lk)."""
    if isinstance(arg, _DiagField):
        return arg.route(ds, buf_w)
    dphi = ds.sum(dim=-2).neg_()
    if kind.range_min:
        dphi.scatter_add_(-1, arg.flatten(-2), ds.flatten(-2))
    else:  # fox: + phi_i for the queries (the last Lq positions)
        dphi[..., dphi.shape[-1] - ds.shape[-2] :] += ds.sum(dim=-1)
    return dphi


# ----------------------------------------------------------------------------------------------------
# Public building blocks (any leading dims; flattened to 3-D for the cores)
# ----------------------------------------------------------------------------------------------------


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _f32(x: torch.Tensor) -> torch.Tensor:
    # Half types accumulate in float32; float64 stays float64 so gradcheck sees exact arithmetic.
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _flat(x: torch.Tensor | None, tail: int) -> torch.Tensor | None:
    """Flatten all but the last `tail` dims into one (contiguous)."""
    if x is None:
        return None
    x = x.contiguous()
    return x.reshape(-1, *x.shape[x.dim() - tail :]) if tail else x.reshape(-1)


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


def _need_field(kind, **named):
    if not kind.has_field:
        return
    for name, t in named.items():
        if t is None:
            raise ValueError(f"kind {kind.name!r} needs {name}")


def cross_field(kind: str | AttentionKind, phi_q, phi_k, m_between):
    """fpa's field terms of a cross tile, flattened to (N, L): (row = min(P, M), S, argS, P, argP, M (N,)).
    Shared with the Triton blocks, which feed row and S to their kernels."""
    if not resolve_kind(kind).range_min:
        return (None,) * 6
    if m_between is None:
        raise ValueError("kind 'fpa' needs m_between (+inf for adjacent chunks)")
    p_min, arg_p = prefix_min(_flat(_f32(phi_q), 1))
    s_min, arg_s = suffix_min(_flat(_f32(phi_k), 1))
    lead = phi_q.shape[:-1]
    m = torch.as_tensor(m_between, dtype=p_min.dtype, device=p_min.device).expand(lead).reshape(-1)
    return torch.minimum(p_min, m.unsqueeze(-1)), s_min, arg_s, p_min, arg_p, m


def fpa_cross_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor | None,
    phi_k: torch.Tensor | None,
    m_between: torch.Tensor | None,
    *,
    kind: str | AttentionKind,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a query chunk against a strictly earlier key chunk; see the module docstring."""
    kind = resolve_kind(kind)
    _need_field(kind, phi_q=phi_q, phi_k=phi_k)
    lead = q.shape[:-2]
    qs = _flat(_f32(q), 2) * _scale(q, scale)
    row, s_min, *_ = cross_field(kind, phi_q, phi_k, m_between)
    qa = _augment_q(qs, kind, _flat(phi_q, 1), None)
    ka = _augment_k(_flat(_f32(k), 2), kind, _flat(phi_k, 1))
    out, lse = _finish_softmax(_cross_scores(qa, ka, row, s_min), _flat(_f32(v), 2))
    return out.reshape(*lead, *out.shape[1:]), lse.reshape(*lead, -1)


def fpa_diag_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None,
    *,
    kind: str | AttentionKind,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a chunk against itself, causal; q are the last Lq of the Lk positions."""
    kind = resolve_kind(kind)
    _need_field(kind, phi=phi)
    lead = q.shape[:-2]
    lq, lk = q.shape[-2], k.shape[-2]
    qs = _flat(_f32(q), 2) * _scale(q, scale)
    pf = _flat(_f32(phi), 1) if phi is not None else None
    qa = _augment_q(qs, kind, None if pf is None else pf[:, lk - lq :], None)
    ka = _augment_k(_flat(_f32(k), 2), kind, pf)
    masks = _causal_masks(lq, lk, qs)
    s, _ = _diag_scores(qa, ka, pf, kind, masks, with_arg=False)
    out, lse = _finish_softmax(s, _flat(_f32(v), 2), masks[2])
    return out.reshape(*lead, *out.shape[1:]), lse.reshape(*lead, -1)


def resolve_delta(dout, out, delta):
    """The backward's row term: the given delta, else rowsum(dout * out) (float32, or float64 kept)."""
    if delta is not None:
        return _f32(delta)
    if out is None:
        raise ValueError("the tile backward needs either out or delta (= rowsum(dout * out))")
    return attention_delta(dout, out)


def _bwd_operands(dout, q, k, v, lse, out, delta, sc):
    qs, kf, vf, do = (_flat(_f32(x), 2) for x in (q, k, v, dout))
    qs = qs * sc
    delta = _flat(resolve_delta(dout, out, delta), 1)
    va, doa = _augment_tail(vf, torch.ones_like(vf[..., 0])), _augment_tail(do, -delta)
    zeros = (torch.zeros_like(qs), torch.zeros_like(kf), torch.zeros_like(vf))
    return qs, kf, vf, do, va, doa, _flat(_f32(lse), 1), zeros


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
    kind: str | AttentionKind,
    scale: float | None = None,
) -> CrossGrads:
    """Gradients of a cross tile given the full-row lse and out (or delta); see the module docstring."""
    kind = resolve_kind(kind)
    _need_field(kind, phi_q=phi_q, phi_k=phi_k)
    sc = _scale(q, scale)
    qs, kf, vf, do, va, doa, lse_f, (dq, dk, dv) = _bwd_operands(dout, q, k, v, lse, out, delta, sc)
    row, s_min, arg_s, p_min, arg_p, m = cross_field(kind, phi_q, phi_k, m_between)
    qa = _augment_q(qs, kind, _flat(phi_q, 1), lse_f)
    ka = _augment_k(kf, kind, _flat(phi_k, 1))
    ds = _bwd_tile(_cross_scores(qa, ka, row, s_min), qs, kf, vf, va, do, doa, dq, dk, dv)
    if kind.range_min:
        dphi_q, dphi_k, dm = _route_cross(ds, row, s_min, arg_s, p_min, arg_p, m)
    elif kind.query_term:
        dphi_q, dphi_k, dm = ds.sum(dim=-1), ds.sum(dim=-2).neg_(), qs.new_zeros(qs.shape[0])
    else:
        dphi_q, dphi_k, dm = (
            qs.new_zeros(qs.shape[:-1]),
            kf.new_zeros(kf.shape[:-1]),
            qs.new_zeros(qs.shape[0]),
        )
    lq, lk = q.shape[:-1], k.shape[:-1]
    return CrossGrads(
        dq.mul_(sc).reshape(q.shape),
        dk.reshape(k.shape),
        dv.reshape(v.shape),
        dphi_q.reshape(lq),
        dphi_k.reshape(lk),
        dm.reshape(q.shape[:-2]),
    )


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
    kind: str | AttentionKind,
    scale: float | None = None,
) -> DiagGrads:
    """Gradients of a causal diagonal tile given the full-row lse and out (or delta)."""
    kind = resolve_kind(kind)
    _need_field(kind, phi=phi)
    sc = _scale(q, scale)
    lq, lk = q.shape[-2], k.shape[-2]
    qs, kf, vf, do, va, doa, lse_f, (dq, dk, dv) = _bwd_operands(dout, q, k, v, lse, out, delta, sc)
    pf = _flat(_f32(phi), 1) if phi is not None else None
    qa = _augment_q(qs, kind, None if pf is None else pf[:, lk - lq :], lse_f)
    ka = _augment_k(kf, kind, pf)
    masks = _causal_masks(lq, lk, qs)
    p, arg = _diag_scores(qa, ka, pf, kind, masks, with_arg=True)
    ds = _bwd_tile(p, qs, kf, vf, va, do, doa, dq, dk, dv, keep=masks[2])
    dphi = _route_diag(ds, arg, kind) if kind.has_field else kf.new_zeros(kf.shape[:-1])
    return DiagGrads(
        dq.mul_(sc).reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dphi.reshape(k.shape[:-1])
    )


# ----------------------------------------------------------------------------------------------------
# The full causal op, built from the tile cores. Internally everything is block-major,
# (n_blocks, B*H, block, D), so a run of consecutive blocks is one contiguous slice whose flattening
# (tiles*B*H, block, D) is a view: the batched matmuls never copy.
# ----------------------------------------------------------------------------------------------------


class _Plan:
    """Block layout of one call. Keys are padded at the end to n_blk * bs; queries are padded at the
    front with `front` dummy rows (real positions whose outputs are dropped) so query blocks line up with
    key blocks, and at the end like the keys. Query block i is key block qb0 + i."""

    def __init__(self, tq: int, tk: int, bs: int, bh: int) -> None:
        self.bs, self.bh = bs, bh
        self.n_blk = -(-tk // bs)
        self.back = self.n_blk * bs - tk
        offset = tk - tq
        self.qb0 = offset // bs
        self.front = offset - self.qb0 * bs
        self.nq = self.n_blk - self.qb0
        self.tq, self.tk = tq, tk
        # Tiles per batched step, so the workspace stays near _TILE_ELEMS floats whatever T is.
        self.group = max(1, min(self.nq, _TILE_ELEMS // (bh * bs * bs)))

    def groups(self, d: int):
        """(query-block slice, key-block slice) pairs for block diagonal d (d = 0: the diagonal)."""
        lo = max(self.qb0, d)
        for g0 in range(lo, self.n_blk, self.group):
            g1 = min(g0 + self.group, self.n_blk)
            yield slice(g0 - self.qb0, g1 - self.qb0), slice(g0 - d, g1 - d)

    def workspace(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(self.group * self.bh, self.bs, self.bs, dtype=like.dtype, device=like.device)


def _to_blocks(x: torch.Tensor, front: int, back: int, bs: int) -> torch.Tensor:
    """(B, H, T, *) -> (n_blocks, B*H, bs, *) after zero padding rows at the front and back."""
    b, h, t = x.shape[:3]
    rest = x.shape[3:]
    if front or back:
        pad = (0, 0) * len(rest) + (front, back)
        x = torch.nn.functional.pad(x, pad)
    x = x.reshape(b * h, (t + front + back) // bs, bs, *rest)
    return x.transpose(0, 1).contiguous()


def _from_blocks(x: torch.Tensor, b: int, h: int, start: int, length: int) -> torch.Tensor:
    """Inverse of _to_blocks: (n, B*H, bs, *) -> (B, H, length, *) from padded row `start`."""
    n, bh, bs = x.shape[:3]
    rest = x.shape[3:]
    y = x.transpose(0, 1).reshape(bh, n * bs, *rest)[:, start : start + length]
    return y.reshape(b, h, length, *rest)


def _f(x: torch.Tensor) -> torch.Tensor:
    """(tiles, B*H, ...) block slice -> (tiles*B*H, ...) view for the 3-D cores."""
    return x.flatten(0, 1)


class _Field:
    """Per-block minima of the (padded, block-major) field, computed once per call: O(T)."""

    def __init__(self, phib: torch.Tensor, plan: _Plan) -> None:
        # phib: (n_blk, BH, bs)
        self.s_min, self.arg_s = suffix_min(phib)
        self.p_min, self.arg_p = prefix_min(phib[plan.qb0 :])
        self.bmin = self.s_min[..., 0]
        starts = torch.arange(plan.n_blk, device=phib.device) * plan.bs
        self.bargmin = self.arg_s[..., 0] + starts[:, None]  # global position of each block's argmin
        # Running min of the blocks strictly between key block qb-d and query block qb (one per query
        # block), updated as d grows; +inf while the blocks are adjacent.
        self.m_run = torch.full_like(self.p_min[..., 0], _INF)
        self.m_arg = torch.zeros_like(self.arg_p[..., 0])

    def advance(self, d: int, plan: _Plan) -> None:
        """Move to diagonal d: block qb-d+1 becomes 'between' for every active query block qb."""
        if d < 2:
            return
        lo = max(plan.qb0, d)
        qi = slice(lo - plan.qb0, plan.nq)
        nb = slice(lo - d + 1, plan.n_blk - d + 1)
        new, new_arg = self.bmin[nb], self.bargmin[nb]
        take = new <= self.m_run[qi]  # the newly added block is earlier: it wins ties
        self.m_run[qi] = torch.where(take, new, self.m_run[qi])
        self.m_arg[qi] = torch.where(take, new_arg, self.m_arg[qi])

    def row(self, qi: slice) -> torch.Tensor:
        return _f(torch.minimum(self.p_min[qi], self.m_run[qi].unsqueeze(-1)))


class _Blocks:
    """The block-major operands of one call. set_ref(ref) (block-major (nq, BH, bs)) makes qa subtract
    ref_i from every logit: the diagonal lse in the forward's fast path, the final lse in the backward."""

    def __init__(self, q, k, v, phi, kind, scale, plan: _Plan, dout=None, delta=None):
        bs, front, back = plan.bs, plan.front, plan.back
        self.kind = kind
        self.qs = _to_blocks(_f32(q) * scale, front, back, bs)
        self.k = _to_blocks(_f32(k), 0, back, bs)
        self.v = _to_blocks(_f32(v), 0, back, bs)
        self.phi = None if phi is None else _to_blocks(_f32(phi).unsqueeze(-1), 0, back, bs).squeeze(-1)
        self.phi_q = None if self.phi is None else self.phi[plan.qb0 :]
        self.qa = _augment_q(self.qs, kind, self.phi_q, None)
        self.ka = _augment_k(self.k, kind, self.phi)
        if dout is not None:
            self.do = _to_blocks(_f32(dout), front, back, bs)
            self.va = _augment_tail(self.v, torch.ones_like(self.v[..., 0]))
            neg_delta = _to_blocks(-delta.unsqueeze(-1), front, back, bs).squeeze(-1)
            self.doa = _augment_tail(self.do, neg_delta)

    def set_ref(self, ref: torch.Tensor) -> None:
        base = self.phi_q if self.kind.query_term else 0.0
        self.qa[..., -1] = base - ref


def _forward(q, k, v, phi, kind: AttentionKind, scale: float, plan: _Plan):
    """Block-major (out (nq, BH, bs, Dv), lse (nq, BH, bs)) in float32."""
    x = _Blocks(q, k, v, phi, kind, scale, plan)
    out, lse, buf = _diag_forward_pass(x, kind, plan, None)
    if plan.n_blk == 1:
        return out, lse
    field = _Field(x.phi, plan) if kind.range_min else None
    # Fast path: every cross tile's logits are taken relative to the diagonal's lse (a lower bound of
    # the row's final lse, so nothing that matters underflows) and summed without per-tile rescaling.
    # Should a cross logit exceed it by ~88 (float32 exp overflow) the sums turn inf, and the call is
    # redone with exact per-tile max-shifts and log-sum-exp merges.
    x.set_ref(lse)
    acc, den = out.clone(), torch.ones_like(lse)
    for d in range(1, plan.n_blk):
        if field is not None:
            field.advance(d, plan)
        for qi, ki in plan.groups(d):
            row = s_min = None
            if field is not None:
                row, s_min = field.row(qi), _f(field.s_min[ki])
            n = (qi.stop - qi.start) * plan.bh
            s = _cross_scores(_f(x.qa[qi]), _f(x.ka[ki]), row, s_min, buf[:n])
            _accumulate(s, _f(x.v[ki]), _f(acc[qi]), _f(den[qi]))
    # |acc| <= den * max|v|, so a finite den and a finite total of acc (one cheap read) suffice.
    if bool(torch.isfinite(den).all()) and bool(torch.isfinite(acc.sum())):
        return acc.div_(den.unsqueeze(-1)), lse.add_(den.log_())
    return _forward_exact(x, out, lse, kind, plan, buf)


def _forward_exact(x: _Blocks, out, lse, kind: AttentionKind, plan: _Plan, buf):
    """Cross tiles with exact per-tile max-shifts, merged by log-sum-exp (fallback for huge logits)."""
    x.set_ref(torch.zeros_like(lse))
    field = _Field(x.phi, plan) if kind.range_min else None
    for d in range(1, plan.n_blk):
        if field is not None:
            field.advance(d, plan)
        for qi, ki in plan.groups(d):
            row = s_min = None
            if field is not None:
                row, s_min = field.row(qi), _f(field.s_min[ki])
            n = (qi.stop - qi.start) * plan.bh
            s = _cross_scores(_f(x.qa[qi]), _f(x.ka[ki]), row, s_min, buf[:n])
            o_t, l_t = _finish_softmax(s, _f(x.v[ki]))
            o_m, l_m = merge_lse(out[qi], lse[qi], o_t.view_as(out[qi]), l_t.view_as(lse[qi]))
            out[qi] = o_m
            lse[qi] = l_m
    return out, lse


def _grads_from_blocks(dq, dk, dv, dphi, dphi_m, bh_shape, plan: _Plan, scale: float):
    """The block-major gradients of a backward as (B, H, T, *) tensors: dq scaled, dphi (None without a
    field) plus the between-blocks part dphi_m ((B*H, n_blk * bs), None unless fpa)."""
    b, h = bh_shape
    dq = _from_blocks(dq, b, h, plan.front, plan.tq).mul_(scale)
    dk = _from_blocks(dk, b, h, 0, plan.tk)
    dv = _from_blocks(dv, b, h, 0, plan.tk)
    if dphi is not None:
        dphi = _from_blocks(dphi.unsqueeze(-1), b, h, 0, plan.tk).squeeze(-1)
        if dphi_m is not None:
            dphi = dphi + dphi_m[:, : plan.tk].reshape(b, h, plan.tk)
    return dq, dk, dv, dphi


def _backward(dout, q, k, v, phi, out, lse, kind: AttentionKind, scale: float, plan: _Plan):
    x = _Blocks(q, k, v, phi, kind, scale, plan, dout=dout, delta=attention_delta(dout, out))
    x.set_ref(lse)
    dq, dk, dv, dphi, (buf_p, buf_ds, buf_w) = _diag_backward_pass(x, kind, plan, None)
    field = _Field(x.phi, plan) if kind.range_min else None
    dphi_m = (
        torch.zeros(plan.bh, plan.n_blk * plan.bs, dtype=x.qs.dtype, device=x.qs.device)
        if field is not None
        else None
    )
    for d in range(1, plan.n_blk):
        if field is not None:
            field.advance(d, plan)
        for qi, ki in plan.groups(d):
            n = (qi.stop - qi.start) * plan.bh
            row = s_min = None
            if field is not None:
                row, s_min = field.row(qi), _f(field.s_min[ki])
            p = _cross_scores(_f(x.qa[qi]), _f(x.ka[ki]), row, s_min, buf_p[:n])
            ds = _bwd_tile(
                p, _f(x.qs[qi]), _f(x.k[ki]), _f(x.v[ki]), _f(x.va[ki]), _f(x.do[qi]), _f(x.doa[qi]),
                _f(dq[qi]), _f(dk[ki]), _f(dv[ki]), buf_ds[:n],
            )  # fmt: skip
            if kind.query_term:
                _f(dphi[plan.qb0 :][qi]).add_(ds.sum(dim=-1))
                _f(dphi[ki]).sub_(ds.sum(dim=-2))
            elif kind.range_min:
                dphi_q, dphi_k, dm = _route_cross(
                    ds, row, s_min, _f(field.arg_s[ki]), _f(field.p_min[qi]), _f(field.arg_p[qi]),
                    _f(field.m_run[qi]), buf_w[:n],
                )  # fmt: skip
                _f(dphi[plan.qb0 :][qi]).add_(dphi_q)
                _f(dphi[ki]).add_(dphi_k)
                # The between-blocks min is one scalar per tile: its gradient lands on its argmin.
                dphi_m.scatter_add_(-1, field.m_arg[qi].transpose(0, 1), dm.view(-1, plan.bh).transpose(0, 1))
    return _grads_from_blocks(dq, dk, dv, dphi, dphi_m, q.shape[:2], plan, scale)


# ----------------------------------------------------------------------------------------------------
# Packed documents (segment_ids). Pairs in different documents are masked; key tiles whose keys all lie in
# earlier documents than every query of the query tile are never visited. Ids are non-decreasing, so for a
# query block the visible key blocks are one run ending at the diagonal: the diagonals are walked outwards
# and the walk stops at the first one where no tile of any batch row is visible. On each diagonal only
# the query blocks with a visible tile are gathered (index tensors instead of slices) and accumulated
# back with index_add_. Tiles whose queries and keys all lie in one document (in every batch row) need no
# mask: each diagonal's tiles are grouped full ones first, then the partial ones, and only the partial
# groups build and apply the document mask (likewise the diagonal groups holding a document boundary).
# The field machinery is the unmasked one: for a visible pair [j, i] lies inside one document, so
# min(S_j, M, P_i) is already the document's own range minimum.
# ----------------------------------------------------------------------------------------------------


def _segment_blocks(seg: torch.Tensor, plan: _Plan, h: int) -> torch.Tensor:
    """(B, Tk) ids -> block-major (n_blk, B*H, bs); the back padding gets an id of its own (last + 1)."""
    if plan.back:
        seg = torch.cat([seg, (seg[:, -1:] + 1).expand(-1, plan.back)], dim=1)
    b = seg.shape[0]
    sb = seg.view(b, plan.n_blk, plan.bs).transpose(0, 1)  # (n_blk, B, bs)
    return sb[:, :, None].expand(-1, -1, h, -1).reshape(plan.n_blk, b * h, plan.bs).contiguous()


def _segment_steps(segb: torch.Tensor, plan: _Plan):
    """(d, [(query-block index, key-block index, partial) per batched step]) for each diagonal d >= 1 that
    has a visible tile; stops at the first diagonal without one. partial: some pair of the step's tiles
    lies in two documents (the mask is needed); the steps of wholly visible tiles come first."""
    first, last = segb[..., 0], segb[..., -1]  # (n_blk, BH)
    for d in range(1, plan.n_blk):
        lo = max(plan.qb0, d)
        qb = torch.arange(lo, plan.n_blk, device=segb.device)
        active = (last[qb - d] >= first[qb]).any(dim=-1)
        if not bool(active.any()):
            return
        qb = qb[active]
        full = (first[qb - d] == last[qb]).all(dim=-1)  # ids non-decreasing: one document throughout
        groups = [
            (g - plan.qb0, g - d, partial)
            for partial, blocks in ((False, qb[full]), (True, qb[~full]))
            for g in blocks.split(plan.group)
        ]
        yield d, groups


def _diag_partial(segb: torch.Tensor) -> torch.Tensor:
    """(n_blk,) bool: the block holds a document boundary in some batch row (its diagonal tile needs the
    document mask)."""
    return (segb[..., 0] != segb[..., -1]).any(dim=-1)


def _same_segment(segq: torch.Tensor, segk: torch.Tensor) -> torch.Tensor:
    """(N, Lq, Lk) bool: query and key in one document, from (tiles, BH, L) id blocks."""
    return _f(segq).unsqueeze(-1) == _f(segk).unsqueeze(-2)


def _finish_softmax_masked(s: torch.Tensor, v: torch.Tensor, keep: torch.Tensor):
    """_finish_softmax over the entries `keep` (bool) allows; a row with none gives out 0, lse -inf."""
    s.masked_fill_(~keep, -_INF)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    _exp_(s.sub_(m), keep.to(s.dtype))
    den = s.sum(dim=-1, keepdim=True)
    out = torch.bmm(s, v).div_(den.clamp_min(torch.finfo(s.dtype).tiny))
    return out, (m + den.log()).squeeze(-1)


def _diag_forward_pass(x: _Blocks, kind: AttentionKind, plan: _Plan, segb: torch.Tensor | None):
    """The diagonal tiles (with documents when segb is given): block-major (out, lse) and the workspace."""
    masks = _causal_masks(plan.bs, plan.bs, x.qs)
    causal = masks[2].bool()
    buf = plan.workspace(x.qs)
    out = torch.empty(*x.qs.shape[:-1], x.v.shape[-1], dtype=x.qs.dtype, device=x.qs.device)
    lse = torch.empty(x.qs.shape[:-1], dtype=x.qs.dtype, device=x.qs.device)
    cut = [False] * plan.n_blk if segb is None else _diag_partial(segb).tolist()
    segq = None if segb is None else segb[plan.qb0 :]
    for qi, ki in plan.groups(0):
        n = (qi.stop - qi.start) * plan.bh
        phi_d = None if x.phi is None else _f(x.phi[ki])
        s, _ = _diag_scores(_f(x.qa[qi]), _f(x.ka[ki]), phi_d, kind, masks, False, buf[:n])
        if any(cut[ki]):
            keep = _same_segment(segq[qi], segb[ki]) & causal  # never empty: a query sees its own key
            s.masked_fill_(~keep, -_INF)
            o, l = _finish_softmax(s, _f(x.v[ki]), keep.to(s.dtype))
        else:
            o, l = _finish_softmax(s, _f(x.v[ki]), masks[2])
        out[qi] = o.view_as(out[qi])
        lse[qi] = l.view_as(lse[qi])
    return out, lse, buf


def _forward_segments(q, k, v, phi, kind: AttentionKind, scale: float, plan: _Plan, segb: torch.Tensor):
    """_forward with documents: block-major (out, lse) in float32."""
    x = _Blocks(q, k, v, phi, kind, scale, plan)
    out, lse, buf = _diag_forward_pass(x, kind, plan, segb)
    segq = segb[plan.qb0 :]
    steps = list(_segment_steps(segb, plan))
    if not steps:
        return out, lse
    bh, bs = plan.bh, plan.bs
    x.set_ref(lse)  # the fast path of _forward: cross logits relative to the diagonal's lse
    acc, den = out.clone(), torch.ones_like(lse)
    field = _Field(x.phi, plan) if kind.range_min else None
    for d, groups in steps:
        if field is not None:
            field.advance(d, plan)
        for qi, ki, partial in groups:
            row = s_min = None
            if field is not None:
                row, s_min = field.row(qi), _f(field.s_min[ki])
            n = len(qi) * bh
            s = _cross_scores(_f(x.qa[qi]), _f(x.ka[ki]), row, s_min, buf[:n])
            _exp_(s)
            if partial:
                s.masked_fill_(~_same_segment(segq[qi], segb[ki]), 0.0)
            den.index_add_(0, qi, s.sum(dim=-1).view(-1, bh, bs))
            acc.index_add_(0, qi, torch.bmm(s, _f(x.v[ki])).view(-1, bh, bs, acc.shape[-1]))
    if bool(torch.isfinite(den).all()) and bool(torch.isfinite(acc.sum())):
        return acc.div_(den.unsqueeze(-1)), lse.add_(den.log_())
    # Exact per-tile max-shifts and log-sum-exp merges (huge logits), as _forward_exact.
    x.set_ref(torch.zeros_like(lse))
    field = _Field(x.phi, plan) if kind.range_min else None
    for d, groups in steps:
        if field is not None:
            field.advance(d, plan)
        for qi, ki, partial in groups:
            row = s_min = None
            if field is not None:
                row, s_min = field.row(qi), _f(field.s_min[ki])
            n = len(qi) * bh
            s = _cross_scores(_f(x.qa[qi]), _f(x.ka[ki]), row, s_min, buf[:n])
            if partial:
                o_t, l_t = _finish_softmax_masked(s, _f(x.v[ki]), _same_segment(segq[qi], segb[ki]))
            else:
                o_t, l_t = _finish_softmax(s, _f(x.v[ki]))
            o_m, l_m = merge_lse(out[qi], lse[qi], o_t.view_as(out[qi]), l_t.view_as(lse[qi]))
            out[qi] = o_m
            lse[qi] = l_m
    return out, lse


def _diag_backward_pass(x: _Blocks, kind: AttentionKind, plan: _Plan, segb: torch.Tensor | None):
    """The diagonal tiles' gradients (block-major dq unscaled, dk, dv, dphi or None) and the three
    workspaces (with documents when segb is given); x has its reference set to the final lse."""
    bh, bs = plan.bh, plan.bs
    masks = _causal_masks(bs, bs, x.qs)
    causal = masks[2].bool()
    buf_p, buf_ds, buf_w = plan.workspace(x.qs), plan.workspace(x.qs), plan.workspace(x.qs)
    dq, dk, dv = torch.zeros_like(x.qs), torch.zeros_like(x.k), torch.zeros_like(x.v)
    dphi = torch.zeros_like(x.phi) if kind.has_field else None
    cut = [False] * plan.n_blk if segb is None else _diag_partial(segb).tolist()
    segq = None if segb is None else segb[plan.qb0 :]
    for qi, ki in plan.groups(0):
        n = (qi.stop - qi.start) * bh
        phi_d = None if x.phi is None else _f(x.phi[ki])
        p, arg = _diag_scores(_f(x.qa[qi]), _f(x.ka[ki]), phi_d, kind, masks, True, buf_p[:n])
        keep = masks[2]
        if any(cut[ki]):
            keep = _same_segment(segq[qi], segb[ki]) & causal
            p.masked_fill_(~keep, -_INF)
            keep = keep.to(p.dtype)
        ds = _bwd_tile(
            p, _f(x.qs[qi]), _f(x.k[ki]), _f(x.v[ki]), _f(x.va[ki]), _f(x.do[qi]), _f(x.doa[qi]),
            _f(dq[qi]), _f(dk[ki]), _f(dv[ki]), buf_ds[:n], keep=keep,
        )  # fmt: skip
        if dphi is not None:
            _f(dphi[ki]).add_(_route_diag(ds, arg, kind, buf_w[:n]))
    return dq, dk, dv, dphi, (buf_p, buf_ds, buf_w)


def _backward_segments(dout, q, k, v, phi, out, lse, kind: AttentionKind, scale, plan: _Plan, segb):
    """_backward with documents (the tiles and masks of _forward_segments)."""
    bh, bs = plan.bh, plan.bs
    x = _Blocks(q, k, v, phi, kind, scale, plan, dout=dout, delta=attention_delta(dout, out))
    x.set_ref(lse)
    segq = segb[plan.qb0 :]
    dq, dk, dv, dphi, (buf_p, buf_ds, buf_w) = _diag_backward_pass(x, kind, plan, segb)
    field = _Field(x.phi, plan) if kind.range_min else None
    dphi_m = x.qs.new_zeros(bh, plan.n_blk * bs) if field is not None else None
    for d, groups in _segment_steps(segb, plan):
        if field is not None:
            field.advance(d, plan)
        for qi, ki, partial in groups:
            n = len(qi) * bh
            row = s_min = None
            if field is not None:
                row, s_min = field.row(qi), _f(field.s_min[ki])
            p = _cross_scores(_f(x.qa[qi]), _f(x.ka[ki]), row, s_min, buf_p[:n])
            keep = None
            if partial:
                keep = _same_segment(segq[qi], segb[ki])
                p.masked_fill_(~keep, -_INF)
                keep = keep.to(p.dtype)
            qs_t, k_t = _f(x.qs[qi]), _f(x.k[ki])
            dq_t, dk_t, dv_t = torch.zeros_like(qs_t), torch.zeros_like(k_t), torch.zeros_like(_f(x.v[ki]))
            ds = _bwd_tile(
                p, qs_t, k_t, _f(x.v[ki]), _f(x.va[ki]), _f(x.do[qi]), _f(x.doa[qi]), dq_t, dk_t, dv_t,
                buf_ds[:n], keep=keep,
            )  # fmt: skip
            dq.index_add_(0, qi, dq_t.view(-1, *dq.shape[1:]))
            dk.index_add_(0, ki, dk_t.view(-1, *dk.shape[1:]))
            dv.index_add_(0, ki, dv_t.view(-1, *dv.shape[1:]))
            if kind.query_term:
                dphi[plan.qb0 :].index_add_(0, qi, ds.sum(dim=-1).view(-1, bh, bs))
                dphi.index_add_(0, ki, ds.sum(dim=-2).neg_().view(-1, bh, bs))
            elif kind.range_min:
                dphi_q, dphi_k, dm = _route_cross(
                    ds, row, s_min, _f(field.arg_s[ki]), _f(field.p_min[qi]), _f(field.arg_p[qi]),
                    _f(field.m_run[qi]), buf_w[:n],
                )  # fmt: skip
                dphi[plan.qb0 :].index_add_(0, qi, dphi_q.view(-1, bh, bs))
                dphi.index_add_(0, ki, dphi_k.view(-1, bh, bs))
                dphi_m.scatter_add_(-1, field.m_arg[qi].transpose(0, 1), dm.view(-1, bh).transpose(0, 1))
    return _grads_from_blocks(dq, dk, dv, dphi, dphi_m, q.shape[:2], plan, scale)


# ----------------------------------------------------------------------------------------------------
# Tile skipping (skip_epsilon; skipping.py has the bound and what it guarantees). Each block diagonal's
# tiles are decided per (query block, key block, batch*head) by skipping.TileBound, documents included,
# and the kept ones are gathered by flat tile index (block * BH + bh) into batched steps and added back
# with index_add_ (a query tile and a key tile appear at most once per diagonal). The backward replays
# the same decisions from the same q, k, phi, so a skipped tile has no gradient.
# ----------------------------------------------------------------------------------------------------


class _Step(NamedTuple):
    qt: torch.Tensor | slice  # flat query tiles (into nq * BH): a run of consecutive tiles is a slice
    kt: torch.Tensor | slice  # flat key tiles (into n_blk * BH)
    partial: bool  # some pair of these tiles lies in two documents: the mask is needed

    @property
    def n(self) -> int:
        return (
            len(range(self.qt.start, self.qt.stop, self.qt.step or 1))
            if isinstance(self.qt, slice)
            else self.qt.numel()
        )


# Kept tiles in runs of at least this many consecutive flat tiles are taken as slices (views, accumulated
# in place, as the unskipped path does); of the rest, runs of as many in one head (flat stride B*H: heads
# that keep a stretch of the diagonal while the others skip it) are strided slices, and what remains is
# gathered by index. Gathering copies q, k, v of each tile, about 30% of its matmuls' time on CPU, so a
# diagonal with nothing skipped costs no more than the unskipped path.
_MIN_RUN = 4


def _add_at(dst: torch.Tensor, idx: torch.Tensor | slice, src: torch.Tensor) -> None:
    if isinstance(idx, slice):
        dst[idx].add_(src)
    else:
        dst.index_add_(0, idx, src)


def _decisions(plan: _Plan, field, bound, segb, count: bool = False):
    """(d, qb, qi, kb, keep, visible) for each block diagonal d = 1, 2, ... in order: query blocks qb (qi into
    the query blocks), key blocks kb = qb - d, keep (len, BH) the visible tiles the bound cannot rule out
    and visible (len, BH) the tiles with a pair in one document (None without documents). `field` is
    advanced to each diagonal as it is reached. Stops at the first diagonal with no visible tile.
    count: add the kept and skipped tiles to skipping.skip_counts."""
    dev = bound.qn.device
    first = last = None
    if segb is not None:
        first, last = segb[..., 0], segb[..., -1]  # (n_blk, BH)
    for d in range(1, plan.n_blk):
        if field is not None:
            field.advance(d, plan)
        qb = torch.arange(max(plan.qb0, d), plan.n_blk, device=dev)
        qi, kb = qb - plan.qb0, qb - d
        visible = None if segb is None else last[kb] >= first[qb]  # (len, BH)
        if visible is not None and not bool(visible.any()):
            return  # documents: the visible key blocks of a query block are a run ending at the diagonal
        if field is not None:
            keep = bound.keep(qi, kb, field.p_min[qi], field.s_min[kb], field.m_run[qi])
        else:
            keep = bound.keep(qi, kb)
        if visible is not None:
            keep &= visible
        if count:
            skipping.record_decisions(keep, visible)
        yield d, qb, qi, kb, keep, visible


def _skip_steps(x: _Blocks, plan: _Plan, field, bound, segb, count: bool = False):
    """The kept cross tiles as _Steps, diagonal by diagonal; `field` is advanced as the steps are taken,
    so consume them in order. count: add the kept and skipped tiles to skipping.skip_counts."""
    bh, dev = plan.bh, x.qs.device
    lanes = torch.arange(bh, device=dev)
    step = plan.group * bh  # tiles per batched step: the workspace holds that many
    first = last = None
    if segb is not None:
        first, last = segb[..., 0], segb[..., -1]  # (n_blk, BH)
    for d, qb, qi, kb, keep, _visible in _decisions(plan, field, bound, segb, count):
        partial = None if segb is None else first[kb] != last[qb]
        shift = (plan.qb0 - d) * bh  # kt = qt + shift on this diagonal
        for flag in (False, True):
            if partial is None:
                if flag:
                    continue
                sel = keep
            else:
                sel = keep & (partial if flag else ~partial)
            rows, lane = sel.nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            qt = qi[rows] * bh + lanes[lane]  # ascending
            cuts = [0, *((qt[1:] - qt[:-1] != 1).nonzero().flatten() + 1).tolist(), qt.numel()]
            starts = qt[cuts[:-1]].tolist()
            loose = []
            for a, b, q0 in zip(cuts[:-1], cuts[1:], starts):
                if b - a < _MIN_RUN:
                    loose.append(qt[a:b])
                    continue
                for c in range(q0, q0 + b - a, step):
                    e = min(c + step, q0 + b - a)
                    yield _Step(slice(c, e), slice(c + shift, e + shift), flag)
            if not loose:
                continue
            # The rest, lane by lane: a head that keeps a run of consecutive query blocks (while the other
            # heads skip them) is a run with stride BH in the flat order, a view as well.
            qt = torch.cat(loose)
            qt = qt[torch.argsort((qt % bh) * (plan.n_blk * bh) + qt, stable=True)]
            cuts = [0, *((qt[1:] - qt[:-1] != bh).nonzero().flatten() + 1).tolist(), qt.numel()]
            starts = qt[cuts[:-1]].tolist()
            gathered = []
            for a, b, q0 in zip(cuts[:-1], cuts[1:], starts):
                if b - a < _MIN_RUN:
                    gathered.append(qt[a:b])
                    continue
                for c in range(a, b, step):
                    e = min(c + step, b)
                    lo, hi = q0 + (c - a) * bh, q0 + (e - 1 - a) * bh + 1
                    yield _Step(slice(lo, hi, bh), slice(lo + shift, hi + shift, bh), flag)
            if gathered:
                qt = torch.cat(gathered)
                for a in range(0, qt.numel(), step):
                    yield _Step(qt[a : a + step], qt[a : a + step] + shift, flag)


def _same_doc(segq_f: torch.Tensor, segk_f: torch.Tensor, st: _Step) -> torch.Tensor:
    """(n, bs, bs) bool: query and key in one document, for the flat tiles of a step."""
    return segq_f[st.qt].unsqueeze(-1) == segk_f[st.kt].unsqueeze(-2)


def _skip_operands(x: _Blocks, field, st: _Step):
    """fpa's row min(P_i, M) and S_j for the tiles of a step (None, None for the other kinds)."""
    if field is None:
        return None, None
    row = torch.minimum(_f(field.p_min)[st.qt], _f(field.m_run)[st.qt].unsqueeze(-1))
    return row, _f(field.s_min)[st.kt]


def _forward_skip(q, k, v, phi, kind: AttentionKind, scale: float, plan: _Plan, segb, eps: float):
    """_forward (segb None) or _forward_segments with the tiles the bound rules out never computed."""
    x = _Blocks(q, k, v, phi, kind, scale, plan)
    out, lse, buf = _diag_forward_pass(x, kind, plan, segb)
    if plan.n_blk == 1:
        return out, lse
    segq_f = None if segb is None else _f(segb[plan.qb0 :])
    segk_f = None if segb is None else _f(segb)
    bound = skipping.TileBound(
        x.qs, x.k, x.phi, range_min=kind.range_min, qb0=plan.qb0, front=plan.front, back=plan.back,
        tk=plan.tk, eps=eps,
    )  # fmt: skip
    qa_f, ka_f, v_f = _f(x.qa), _f(x.ka), _f(x.v)

    # The fast path of _forward: cross logits relative to the diagonal's lse, no per-tile rescaling.
    x.set_ref(lse)
    acc, den = out.clone(), torch.ones_like(lse)
    acc_f, den_f = _f(acc), _f(den)
    field = _Field(x.phi, plan) if kind.range_min else None
    for st in _skip_steps(x, plan, field, bound, segb, count=True):
        row, s_min = _skip_operands(x, field, st)
        s = _cross_scores(qa_f[st.qt], ka_f[st.kt], row, s_min, buf[: st.n])
        if isinstance(st.qt, slice) and not st.partial:
            _accumulate(s, v_f[st.kt], acc_f[st.qt], den_f[st.qt])  # in place, as _forward
            continue
        _exp_(s)
        if st.partial:
            s.masked_fill_(~_same_doc(segq_f, segk_f, st), 0.0)
        _add_at(den_f, st.qt, s.sum(dim=-1))
        _add_at(acc_f, st.qt, torch.bmm(s, v_f[st.kt]))
    if bool(torch.isfinite(den).all()) and bool(torch.isfinite(acc.sum())):
        return acc.div_(den.unsqueeze(-1)), lse.add_(den.log_())
    # Exact per-tile max-shifts and log-sum-exp merges (huge logits), as _forward_exact.
    x.set_ref(torch.zeros_like(lse))
    qa_f = _f(x.qa)
    out_f, lse_f = _f(out), _f(lse)
    field = _Field(x.phi, plan) if kind.range_min else None
    for st in _skip_steps(x, plan, field, bound, segb):
        row, s_min = _skip_operands(x, field, st)
        s = _cross_scores(qa_f[st.qt], ka_f[st.kt], row, s_min, buf[: st.n])
        if st.partial:
            o_t, l_t = _finish_softmax_masked(s, v_f[st.kt], _same_doc(segq_f, segk_f, st))
        else:
            o_t, l_t = _finish_softmax(s, v_f[st.kt])
        o_m, l_m = merge_lse(out_f[st.qt], lse_f[st.qt], o_t, l_t)
        out_f[st.qt] = o_m
        lse_f[st.qt] = l_m
    return out, lse


def _backward_skip(dout, q, k, v, phi, out, lse, kind: AttentionKind, scale, plan: _Plan, segb, eps: float):
    """The backward of _forward_skip: the same tiles, decided again from the same inputs."""
    bh, bs = plan.bh, plan.bs
    x = _Blocks(q, k, v, phi, kind, scale, plan, dout=dout, delta=attention_delta(dout, out))
    x.set_ref(lse)
    dq, dk, dv, dphi, (buf_p, buf_ds, buf_w) = _diag_backward_pass(x, kind, plan, segb)
    field = _Field(x.phi, plan) if kind.range_min else None
    dphi_m = x.qs.new_zeros(bh, plan.n_blk * bs) if field is not None else None
    if plan.n_blk > 1:
        bound = skipping.TileBound(
            x.qs, x.k, x.phi, range_min=kind.range_min, qb0=plan.qb0, front=plan.front, back=plan.back,
            tk=plan.tk, eps=eps,
        )  # fmt: skip
        segq_f = None if segb is None else _f(segb[plan.qb0 :])
        segk_f = None if segb is None else _f(segb)
        qa_f, ka_f, qs_f, k_f, v_f, va_f = _f(x.qa), _f(x.ka), _f(x.qs), _f(x.k), _f(x.v), _f(x.va)
        do_f, doa_f, dq_f, dk_f, dv_f = _f(x.do), _f(x.doa), _f(dq), _f(dk), _f(dv)
        dphi_f = None if dphi is None else _f(dphi)
        dphiq_f = None if dphi is None else _f(dphi[plan.qb0 :])
        for st in _skip_steps(x, plan, field, bound, segb):
            qt, kt, n = st.qt, st.kt, st.n
            row, s_min = _skip_operands(x, field, st)
            p = _cross_scores(qa_f[qt], ka_f[kt], row, s_min, buf_p[:n])
            keep = None
            if st.partial:
                keep = _same_doc(segq_f, segk_f, st)
                p.masked_fill_(~keep, -_INF)
                keep = keep.to(p.dtype)
            qs_t, k_t, v_t = qs_f[qt], k_f[kt], v_f[kt]
            runs = isinstance(qt, slice)  # views: accumulate in place, as _backward
            if runs:
                dq_t, dk_t, dv_t = dq_f[qt], dk_f[kt], dv_f[kt]
            else:
                dq_t, dk_t, dv_t = torch.zeros_like(qs_t), torch.zeros_like(k_t), torch.zeros_like(v_t)
            ds = _bwd_tile(
                p, qs_t, k_t, v_t, va_f[kt], do_f[qt], doa_f[qt], dq_t, dk_t, dv_t, buf_ds[:n], keep=keep
            )
            if not runs:
                dq_f.index_add_(0, qt, dq_t)
                dk_f.index_add_(0, kt, dk_t)
                dv_f.index_add_(0, kt, dv_t)
            if kind.query_term:
                _add_at(dphiq_f, qt, ds.sum(dim=-1))
                _add_at(dphi_f, kt, ds.sum(dim=-2).neg_())
            elif kind.range_min:
                dphi_q, dphi_k, dm = _route_cross(
                    ds, row, s_min, _f(field.arg_s)[kt], _f(field.p_min)[qt], _f(field.arg_p)[qt],
                    _f(field.m_run)[qt], buf_w[:n],
                )  # fmt: skip
                _add_at(dphiq_f, qt, dphi_q)
                _add_at(dphi_f, kt, dphi_k)
                # The between-blocks min of each tile: its gradient lands on its argmin (lane qt % BH).
                qt_i = torch.arange(qt.start, qt.stop, qt.step or 1, device=dm.device) if runs else qt
                dphi_m.view(-1).index_add_(0, (qt_i % bh) * (plan.n_blk * bs) + _f(field.m_arg)[qt], dm)
    return _grads_from_blocks(dq, dk, dv, dphi, dphi_m, q.shape[:2], plan, scale)


def tile_keep_map(
    q: torch.Tensor,
    k: torch.Tensor,
    phi: torch.Tensor,
    kind: AttentionKind,
    scale: float,
    block_size: int,
    skip_epsilon: float,
    segment_ids: torch.Tensor | None = None,
    count: bool = False,
) -> torch.Tensor:
    """(B*H, n, n) uint8, n = ceil(T / block_size): 0 where this path, at this block size, skips the tile
    (query block I, key block J), 1 elsewhere (diagonal, kept, invisible to documents, and I < J). The
    decisions of _forward_skip for a kind with a field and Tq == Tk, as a table for kernels with their
    own tile loops (the Triton kernels: every tile of theirs lies in one block). count: add the visible
    cross tiles kept and skipped to skipping.skip_counts."""
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(f"tile_keep_map needs Tq == Tk; got {q.shape[-2]} and {k.shape[-2]}")
    b, h = q.shape[:2]
    plan = _Plan(q.shape[-2], k.shape[-2], block_size, b * h)
    segb = None if segment_ids is None else _segment_blocks(segment_ids, plan, h)
    back, bs = plan.back, plan.bs
    with torch.no_grad():
        qs = _to_blocks(_f32(q.detach()) * scale, 0, back, bs)
        kb_ = _to_blocks(_f32(k.detach()), 0, back, bs)
        phib = _to_blocks(_f32(phi.detach()).unsqueeze(-1), 0, back, bs).squeeze(-1)
        bound = skipping.TileBound(
            qs, kb_, phib, range_min=kind.range_min, qb0=0, front=0, back=back, tk=plan.tk, eps=skip_epsilon
        )  # fmt: skip
        field = _Field(phib, plan) if kind.range_min else None
        keep_map = torch.ones(plan.bh, plan.n_blk, plan.n_blk, dtype=torch.uint8, device=q.device)
        for _d, qb, _qi, kb, keep, visible in _decisions(plan, field, bound, segb, count):
            kept = keep if visible is None else keep | ~visible
            keep_map[:, qb, kb] = kept.t().to(torch.uint8)
    return keep_map


def _plan_of(q: torch.Tensor, k: torch.Tensor, block_size: int) -> _Plan:
    # A block longer than the sequence would only add padding.
    return _Plan(q.shape[-2], k.shape[-2], min(block_size, k.shape[-2]), q.shape[0] * q.shape[1])


def lse_shape(q: torch.Tensor, k: torch.Tensor, block_size: int) -> tuple[int, int, int]:
    """The shape of chunked_forward's lse (block-major (query blocks, B*H, block)), from the shapes alone."""
    plan = _plan_of(q, k, block_size)
    return (plan.nq, plan.bh, plan.bs)


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    return _f32(q[:0]).dtype


def chunked_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None,
    kind: AttentionKind,
    scale: float,
    block_size: int,
    segment_ids: torch.Tensor | None,
    skip_epsilon: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Tq, Dv) in q's dtype, lse in the block layout of lse_shape): the forward of the chunked
    op without autograd, for its autograd Function and its torch.library op (fpa_model.ops.fpa.library).
    skip_epsilon: skip the tiles the bound of skipping.py rules out (kinds with a field; None: off)."""
    b, h = q.shape[:2]
    plan = _plan_of(q, k, block_size)
    segb = None if segment_ids is None else _segment_blocks(segment_ids, plan, h)
    if skip_epsilon is not None and kind.has_field:
        out_b, lse = _forward_skip(q, k, v, phi, kind, scale, plan, segb, skip_epsilon)
    elif segb is None:
        out_b, lse = _forward(q, k, v, phi, kind, scale, plan)
    else:
        out_b, lse = _forward_segments(q, k, v, phi, kind, scale, plan, segb)
    return _from_blocks(out_b, b, h, plan.front, plan.tq).to(q.dtype), lse


def chunked_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    kind: AttentionKind,
    scale: float,
    block_size: int,
    segment_ids: torch.Tensor | None,
    skip_epsilon: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq, dk, dv in their inputs' dtypes, dphi in phi's dtype, None without a field gradient) from
    chunked_forward's out and lse (skip_epsilon: the same as the forward's)."""
    plan = _plan_of(q, k, block_size)
    args = (dout, q, k, v, phi, out, lse, kind, scale, plan)
    if skip_epsilon is not None and kind.has_field:
        segb = None if segment_ids is None else _segment_blocks(segment_ids, plan, q.shape[1])
        dq, dk, dv, dphi = _backward_skip(*args, segb, skip_epsilon)
    elif segment_ids is None:
        dq, dk, dv, dphi = _backward(*args)
    else:
        dq, dk, dv, dphi = _backward_segments(*args, _segment_blocks(segment_ids, plan, q.shape[1]))
    if phi is not None:
        dphi = dphi.to(phi.dtype) if dphi is not None else torch.zeros_like(phi)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dphi


class _ChunkedFPAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, phi, kind, scale, block_size, segment_ids, skip_epsilon):
        out, lse = chunked_forward(q, k, v, phi, kind, scale, block_size, segment_ids, skip_epsilon)
        ctx.save_for_backward(q, k, v, phi, out, lse, segment_ids)
        ctx.kind, ctx.scale, ctx.block_size, ctx.skip_epsilon = kind, scale, block_size, skip_epsilon
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, phi, out, lse, seg = ctx.saved_tensors
        dq, dk, dv, dphi = chunked_backward(
            dout, q, k, v, phi, out, lse, ctx.kind, ctx.scale, ctx.block_size, seg, ctx.skip_epsilon
        )
        dphi = dphi if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dphi, None, None, None, None, None


def _validate(q, k, v, phi, kind: AttentionKind, block_size):
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
    if phi is None and kind.has_field:
        raise ValueError(f"kind {kind.name!r} needs a field phi")
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
    kind: str | AttentionKind = "fpa",
    scale: float | None = None,
    block_size: int = 64,
    segment_ids: torch.Tensor | None = None,
    skip_epsilon: float | None = None,
) -> torch.Tensor:
    """Causal FPA/FoX/softmax attention with O(T) memory; same contract as fpa_attention_naive (segment_ids
    (B, Tk): attend only inside each query's document; tiles wholly in earlier documents are skipped).
    skip_epsilon: also skip the tiles whose softmax mass is provably < skip_epsilon of each row
    (skipping.py; softmax has no field and skips nothing); None: every tile, bit for bit as before."""
    kind = resolve_kind(kind)
    _validate(q, k, v, phi, kind, block_size)
    eps = skipping.check_skip_epsilon(skip_epsilon)
    seg = None if segment_ids is None else check_segment_ids(segment_ids, k)
    return _ChunkedFPAFunction.apply(q, k, v, phi, kind, _scale(q, scale), block_size, seg, eps)


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
    "tile_keep_map",
]
