"""Tile skipping: cross tiles whose logits are provably negligible are never computed (sticky erasure).

The bound (kinds with a field; softmax has no field to erase with and skips nothing). For a query tile I
against an earlier key tile J, with P_i the prefix minimum of phi inside I, S_j the suffix minimum inside
J, M the minimum of phi over the blocks strictly between, and q already multiplied by the logit scale:

    fpa: logit_ij = q_i.k_j + min(P_i, M, S_j) - phi_j
                 <= |q_i| max_J|k| + min(P_i - min_J phi, max_{j in J}(min(M, S_j) - phi_j))
    fox: logit_ij = q_i.k_j + phi_i - phi_j  <=  |q_i| max_J|k| + phi_i - min_J phi

(Cauchy-Schwarz for the dot product; min(a, c_j) - phi_j <= min(a - min phi, c_j - phi_j) for the bias.)
The reference of row i is its diagonal logit r_i = q_i.k_i (b_ii = 0), which every row has, so the
row's full log-sum-exp is >= r_i whatever else it attends to (documents included). The tile is skipped
when, for every real query row i of I, bound_i < r_i - tau with tau = log(Tk / epsilon): each skipped
key then has softmax weight < e^-tau = epsilon / Tk in its row, and a row has fewer than Tk keys, so

    GUARANTEE: the softmax mass a row loses to skipped tiles is < epsilon (up to float32 rounding of the
    logits), hence each output row moves by < 2 * epsilon * max|v| (out = (1 - m) out_kept + m out_skip).

The reference is the diagonal logit, not a running maximum, so the decision does not depend on the
order or the size of the tiles visited before: the forward and the backward (which recompute it from the
same q, k, phi with the same arithmetic) skip the same tiles, and a skipped tile contributes no
gradient. The decision is per (query tile, key tile, batch*head) at the path's own tile size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fpa_model.config import check_skip_epsilon  # the one check, shared with the config


def skip_tau(n_keys: int, epsilon: float) -> float:
    """The logit margin below the diagonal logit past which a key's weight is < epsilon / n_keys."""
    return math.log(max(n_keys, 1) / epsilon)


@dataclass
class SkipCounts:
    """Cross tiles (query tile x key tile x batch*head) the forward passes computed and skipped."""

    kept: int = 0
    skipped: int = 0

    @property
    def total(self) -> int:
        return self.kept + self.skipped

    @property
    def fraction_skipped(self) -> float:
        return self.skipped / self.total if self.total else 0.0


_ACTIVE: list[SkipCounts] = []


@contextlib.contextmanager
def skip_counts() -> Iterator[SkipCounts]:
    """Counts the cross tiles of every skipping forward inside the block (diagonal tiles are never
    skipped and not counted; backward passes are not counted, they skip the same tiles)."""
    counts = SkipCounts()
    _ACTIVE.append(counts)
    try:
        yield counts
    finally:
        _ACTIVE.remove(counts)


def record(kept: int, skipped: int) -> None:
    for c in _ACTIVE:
        c.kept += kept
        c.skipped += skipped


def record_decisions(keep: torch.Tensor, visible: torch.Tensor | None = None) -> None:
    """Count one batch of decisions: keep (bool) the tiles computed among the visible ones (visible None:
    every tile of keep is visible). Nothing happens, and no device syncs, unless skip_counts() is open."""
    if not _ACTIVE:
        return
    n_vis = keep.numel() if visible is None else int(visible.sum())
    n_keep = int(keep.sum())
    record(n_keep, n_vis - n_keep)


class TileBound:
    """The per-block parts of the bound for one call, in the chunked path's block-major layout.

    qs (nq, BH, bs, D) queries times the scale, k (n_blk, BH, bs, D), phi (n_blk, BH, bs); query block i is
    key block qb0 + i. Rows that are padding (front rows of the first query block, back rows of the last)
    never hold a tile back. keep(...) answers for the tiles of one block diagonal."""

    def __init__(self, qs, k, phi, *, range_min: bool, qb0: int, front: int, back: int, tk: int, eps: float):
        self.range_min = range_min
        self.qn = qs.norm(dim=-1)  # (nq, BH, bs)
        ref = (qs * k[qb0:]).sum(dim=-1)  # the diagonal logit q_i.k_i
        # Padding rows: +inf reference, so bound - ref is -inf there.
        if front:
            ref[0, :, :front] = math.inf
        if back:
            ref[-1, :, ref.shape[-1] - back :] = math.inf
        self.neg_ref = -ref
        self.kmax = k.norm(dim=-1).amax(dim=-1)  # (n_blk, BH)
        self.phi = phi
        self.phi_min = phi.amin(dim=-1)  # (n_blk, BH)
        self.phi_q = phi[qb0:]
        self.tau = skip_tau(tk, eps)

    def keep(self, qb: torch.Tensor, kb: torch.Tensor, p_min=None, s_min=None, m_run=None) -> torch.Tensor:
        """(len(qb), BH) bool: tiles (query block index qb, key block kb) that the bound cannot rule out.

        fpa needs p_min (len, BH, bs) of the query blocks, s_min (len, BH, bs) of the key blocks and
        m_run (len, BH), the minimum strictly between them (+inf when adjacent)."""
        reach = key_reach(s_min, m_run, self.phi[kb]) if self.range_min else None
        q_bias = p_min if self.range_min else self.phi_q[qb]
        kmax, phi_min = self.kmax[kb], self.phi_min[kb]
        return bound_keep(self.qn[qb], self.neg_ref[qb], q_bias, kmax, phi_min, reach, self.tau)


def key_reach(s_min: torch.Tensor, m_run: torch.Tensor, phi_k: torch.Tensor) -> torch.Tensor:
    """fpa's key side of the bias bound, max over j in J of (min(M, S_j) - phi_j): (..., bs) -> (...).

    It needs only the key tile and M, so the owner of a key tile can compute it for every M that a query
    tile will pair it with (the ring does, before any keys travel)."""
    return torch.minimum(s_min, m_run.unsqueeze(-1)).sub_(phi_k).amax(dim=-1)


def bound_keep(
    qn: torch.Tensor,
    neg_ref: torch.Tensor,
    q_bias: torch.Tensor,
    kmax: torch.Tensor,
    phi_min: torch.Tensor,
    reach: torch.Tensor | None,
    tau: float,
) -> torch.Tensor:
    """The rule on the bound's parts: (...) bool, True where the tile cannot be ruled out.

    Per query row (..., bs): qn = |q_i| (q times the scale), neg_ref = -q_i.k_i, q_bias = P_i (fpa) or
    phi_i (fox). Per key tile (...): kmax = max_J |k|, phi_min = min_J phi and, fpa only, reach =
    key_reach(...) (None for fox)."""
    lead = qn * kmax.unsqueeze(-1) + neg_ref
    bias = q_bias - phi_min.unsqueeze(-1)
    if reach is not None:
        bias = torch.minimum(bias, reach.unsqueeze(-1))
    return ~((lead + bias).amax(dim=-1) < -tau)  # NaN keeps its tile (and propagates)


__all__ = [
    "SkipCounts",
    "TileBound",
    "bound_keep",
    "check_skip_epsilon",
    "key_reach",
    "record",
    "record_decisions",
    "skip_counts",
    "skip_tau",
]
