"""Naive T x T reference for the FPA family (the oracle every other implementation is tested against).

Shapes: q (B, H, Tq, D); k, v (B, H, Tk, D); phi (B, H, Tk), the field value at every key position.
Queries are the last Tq positions of the key sequence (Tq == Tk for training, Tq < Tk for decode).

Kinds (docs/design.md, "The first-passage bias"):
- "fpa":     b_ij = min_{j <= t <= i} phi_t - phi_j          (range-min, "first passage")
- "fox":     b_ij = phi_i - phi_j                           (Forgetting Transformer; phi = cumsum log f)
- "softmax": b_ij = 0

Documents (`segment_ids`, (B, Tk) non-decreasing ids): key j is visible to query i only when both lie in
the same document; other pairs get -inf like the future.
"""

from __future__ import annotations

import math

import torch

from fpa_model.config import ATTENTION_KINDS as KINDS  # noqa: F401  (re-exported: the kernels import it)
from fpa_model.ops.fpa.kinds import AttentionKind, resolve_kind
from fpa_model.ops.fpa.segments import check_segment_ids


def fpa_bias_naive(
    phi: torch.Tensor,
    kind: str | AttentionKind = "fpa",
    tq: int | None = None,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The (B, H, Tq, Tk) additive bias b_ij, with -inf above the causal diagonal and, with segment_ids
    (B, Tk), wherever query and key lie in different documents."""
    spec = resolve_kind(kind)
    tk = phi.shape[-1]
    tq = tk if tq is None else tq
    offset = tk - tq
    phi = phi.float()
    qpos = torch.arange(tq, device=phi.device) + offset
    kpos = torch.arange(tk, device=phi.device)
    causal = kpos[None, :] <= qpos[:, None]  # (Tq, Tk)
    if not spec.has_field:
        bias = torch.zeros(*phi.shape[:-1], tq, tk, device=phi.device)
    elif spec.query_term:
        bias = phi[..., offset:, None] - phi[..., None, :]
    else:
        # range_min[i, j] = min_{j <= t <= i} phi_t. Built as a reverse running min over j for each i:
        # for fixed i, min over [j, i] is the suffix-min (from the right, starting at i) of phi[:i+1].
        big = torch.finfo(torch.float32).max
        rows = []
        for i in range(tq):
            p = phi[..., : offset + i + 1]
            suffix_min = torch.flip(torch.cummin(torch.flip(p, [-1]), dim=-1).values, [-1])
            pad = phi.new_full((*phi.shape[:-1], tk - p.shape[-1]), big)
            rows.append(torch.cat([suffix_min, pad], dim=-1))
        range_min = torch.stack(rows, dim=-2)
        bias = range_min - phi[..., None, :]
    visible = causal
    if segment_ids is not None:
        seg = check_segment_ids(segment_ids, phi.unsqueeze(-1))
        # Ids are non-decreasing, so seg_i == seg_j puts all of [j, i] inside one document: the range
        # minimum above is then the document's own, the bias the one it has when the document stands alone.
        visible = causal & (seg[:, None, offset:, None] == seg[:, None, None, :])  # (B, 1, Tq, Tk)
    return bias.masked_fill(~visible, float("-inf"))


def fpa_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None = None,
    *,
    kind: str | AttentionKind = "fpa",
    scale: float | None = None,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax_j(scale * q_i . k_j + b_ij) . v, computed in fp32, returned in q's dtype; segment_ids (B, Tk):
    attend only inside each query's document."""
    spec = resolve_kind(kind)
    tq, d = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if phi is None:
        if spec.has_field:
            raise ValueError(f"kind {spec.name!r} needs a field phi")
        phi = q.new_zeros(*k.shape[:-1])
    logits = scale * torch.einsum("bhid,bhjd->bhij", q.float(), k.float())
    logits = logits + fpa_bias_naive(phi, spec, tq, segment_ids)
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("bhij,bhjd->bhid", p, v.float()).to(q.dtype)
