"""Incremental decoding with a KV cache for every attention kind, and FPA's sticky key eviction.

Per layer the cache holds K, V (B,H,C,Dh) and, for fpa/fox, the field value phi_j of every cached key
and its running minimum r_j = min_{j <= t <= now} phi_t. The bias of key j for a query at i >= now is

    fpa: b_ij = min(r_j, min_{now < t <= i} phi_t) - phi_j  <=  r_j - phi_j
    fox: b_ij = phi_i - phi_j                               <=  phi_now - phi_j   (phi never rises)

so once r_j - phi_j < -delta_j, key j stays below -delta_j for every future query and can be dropped for
good (docs/design.md, "KV cache eviction"). Dropped keys are masked at once and removed from the tensors
once the largest kept count of a row falls to 3/4 of the slots (each head keeps its own set; heads are
padded to the largest kept count and the padding is masked), so memory shrinks and a decode step's cost
follows the keys kept: the tensors are views of buffers with room to spare, so appending a token writes
its slot instead of copying the cache, and a compaction's copy is paid once per quarter of the slots.

The threshold, per key. Relative to the query's own (diagonal) key, which is never evicted and has
b_ii = 0, key j weighs w_ij = exp(scale q_i.(k_j - k_i) + b_ij) <= exp(scale Q (|k_j| + K) + b_ij), where
Q and K bound the norms of every future query and key. Each key position p gets a share c(p) of a mass
budget with sum_p c(p) <= 1 over all positions, p = 0, 1, 2, ... without end, and key j is evicted when

    r_j - phi_j < -delta_j,   delta_j = scale Q (|k_j| + K) + margin - log c(p_j).

Then w_ij < exp(-margin) c(p_j) for every later query i, so all keys ever evicted together weigh less
than exp(-margin) times the query's own key: they carry less than exp(-margin) of the softmax mass of any
later query, however long the sequence grows, and each attention output moves by less than
2 exp(-margin) max|v| (per layer, given that layer's inputs). The budget (`key_budget_log`):

    max_tokens = N:    c(p) = 1 / (2N) for p < N, and half a convergent tail, c(p) ~ 1/(p ln^2 p), beyond;
    max_tokens = None: c(p) = 1 / (G0 (p+2) ln^2(p+2)) for every p (G0 bounds the series' sum).

So -log c(p) is log 2N inside the expected length (log 2 more than a bound that is only valid up to N) and
about log p + 2 log log p past it: keys evicted early can no longer add up to more than the budget as the
sequence grows (a threshold using the tokens seen so far, log(seen), sums to ~ln(T / t0) budgets).

Q and K. With qk_norm they are hard ceilings, sqrt(Dh) * max|RMSNorm weight| (`KVCache.for_model` passes
them in) and the guarantee holds outright. With model.attention.log_scale_length as well, queries past the
training length grow by the log-n factor: Q is the ceiling times the factor at max_tokens (the guarantee
then holds for queries up to the expected length), and without max_tokens Q is estimated as below.
Without qk_norm future norms are unknown: Q and K are the largest norms seen so far in that layer and
head times `norm_slack` (default 1.25), and the guarantee holds for every continuation whose query and
key norms stay within that (eviction starts after the first prefill chunk, so the estimate comes from at
least that many tokens). A fixed `delta` overrides the bound and guarantees nothing.

Softmax never evicts. With eviction off, decoding reproduces the full forward pass to fp32 tolerance.

Key/value shift (model.attention.kv_shift): each layer's cache also carries the raw (pre-shift, pre-RoPE)
k, v of the newest token (`LayerCache.kv_prev`), which the next token's shift mixes in. It is the previous
*token*, not a cached key, so eviction never touches it; the cached keys are the shifted ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fpa_model.attention import log_length_factor
from fpa_model.ops.fpa.kinds import AttentionKind, resolve_kind
from fpa_model.ops.fpa.naive import fpa_bias_naive

DEFAULT_PREFILL_CHUNK = 128  # prompt tokens per step when evicting (evictions happen between steps)
COMPACT_AT = 0.75  # compact once the most keys kept in a row are at most this share of the slots
_SLOTS = ("k", "v", "kn", "phi", "r", "pos", "valid", "seg")  # per-slot tensors, slot dim 2

# An upper bound on sum_{n>=2} 1 / (n ln^2 n): the n = 2 term plus the integral of 1 / (x ln^2 x) from 2.
_TAIL_SUM_BOUND = 1.0 / (2.0 * math.log(2.0) ** 2) + 1.0 / math.log(2.0)
_ROUND_UP = 1e-5  # the fp32 rounding of -log c(p) must not raise c(p)


def key_budget_log(pos: Tensor, horizon: int | None) -> Tensor:
    """-log c(p) for key positions p (any shape): the share c(p) of the exp(-margin) mass budget that an
    evicted key at position p may take, with sum over p = 0, 1, 2, ... of c(p) <= 1.

    g(p) = 1 / ((p+2) ln^2(p+2)) is decreasing, so sum_{p>=M} g(p) <= integral from M+1 of 1/(x ln^2 x)
    = 1 / ln(M+1). horizon N: c(p) = 1/(2N) for p < N (half the budget), c(p) = g(p) ln(N+1) / 2 beyond
    (the other half at most). horizon None: c(p) = g(p) / _TAIL_SUM_BOUND.
    """
    x = pos.double() + 2.0
    tail = torch.log(x) + 2.0 * torch.log(torch.log(x))
    if horizon is None:
        return (tail + math.log(_TAIL_SUM_BOUND) + _ROUND_UP).float()
    if horizon < 1:
        raise ValueError(f"the eviction horizon max_tokens must be >= 1; got {horizon}")
    tail = tail + math.log(2.0) - math.log(math.log(horizon + 1.0))
    head = torch.full_like(tail, math.log(2.0 * horizon))
    return (torch.where(pos < horizon, head, tail) + _ROUND_UP).float()


@dataclass
class EvictionPolicy:
    """When to drop keys (see the module docstring for the bound)."""

    enabled: bool = False
    delta: float | None = None  # fixed threshold; None: the sound bound
    margin: float = 2.0  # exp(-margin) bounds the total softmax mass of all evicted keys
    norm_slack: float = 1.25  # future |q|, |k| assumed <= norm_slack * the largest seen so far
    # Expected total length N: half the budget spread evenly over positions < N (cheapest up to N), half
    # over a convergent tail beyond it. None: the tail alone. Sound at every length either way.
    max_tokens: int | None = None
    record: bool = False  # keep a log of evictions (tests and analysis)
    # Decode tokens between eviction rounds (a prefill chunk of several tokens always ends with one).
    # Evicting later is always sound, each round judging with the bounds of its time; the kept fraction
    # lags by at most this many tokens, and a round's fixed cost is paid once per `every` tokens.
    every: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"EvictionPolicy.every must be an integer >= 1; got {self.every!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"the eviction horizon max_tokens must be >= 1; got {self.max_tokens}")


@dataclass
class Eviction:
    """One eviction event: at `seen` tokens, key positions `pos` were dropped from (batch, head)."""

    seen: int
    batch: Tensor  # (n,) int64
    head: Tensor  # (n,)
    pos: Tensor  # (n,) absolute key positions
    bias: Tensor  # (n,) r_j - phi_j at eviction time
    delta: Tensor  # (n,) the threshold used for each key


class LayerCache:
    """The cache of one attention layer. Raw-tensor interface: `attend(q, k, v, phi)` for new tokens.

    q, k, v: (B,H,T,Dh) for T new tokens at positions seen..seen+T-1; phi: (B,H,T) their field values
    (None for softmax). Returns the attention output (B,H,T,Dh) in fp32 over all cached keys plus the new
    ones, then appends the new keys and applies the eviction policy.
    """

    def __init__(
        self,
        kind: str | AttentionKind,
        policy: EvictionPolicy | None = None,
        scale: float | None = None,
        *,
        q_bound: float | None = None,
        k_bound: float | None = None,
    ) -> None:
        self.spec = resolve_kind(kind)
        self.kind = self.spec.name
        self.policy = policy or EvictionPolicy()
        self.scale = scale
        # Hard ceilings on every query / key norm (qk_norm); None: estimated from the norms seen.
        self.q_bound, self.k_bound = q_bound, k_bound
        self.seen = 0
        self.k: Tensor | None = None  # (B,H,C,Dh)
        self.v: Tensor | None = None
        self.phi: Tensor | None = None  # (B,H,C) fp32, field value at each cached key
        self.r: Tensor | None = None  # (B,H,C) fp32, running min of phi from the key to now
        self.kn: Tensor | None = None  # (B,H,C) fp32 norm of each cached key (the eviction threshold's)
        self.pos: Tensor | None = None  # (B,H,C) int64 absolute positions
        self.valid: Tensor | None = None  # (B,H,C) bool; False: padding, or evicted and not yet compacted
        self.phi_last: Tensor | None = None  # (B,H) field at the newest token (walk/gate accumulate it)
        # kv_shift: the raw (k, v) (B,H,Dh) of the newest token, before the shift (set by the model decoder).
        self.kv_prev: tuple[Tensor, Tensor] | None = None
        self.q_max: Tensor | None = None  # (B,H) largest query norm seen
        self.k_max: Tensor | None = None  # (B,H) largest key norm seen
        self.log: list[Eviction] = []
        # model.attention.document_mask: (B,H,C) int64 document of each cached key (None: one sequence).
        self.seg: Tensor | None = None
        self._buffers: dict[str, Tensor] = {}  # the storage the tensors above are leading views of

    # ------------------------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Slots per (batch, head): kept keys, padding and keys evicted since the last compaction (at most
        a third more than the most kept in a row). The buffers behind them hold up to twice as many."""
        return 0 if self.k is None else self.k.shape[2]

    def kept(self) -> int:
        """Cached keys summed over batch and heads."""
        return 0 if self.valid is None else int(self.valid.sum())

    def fraction_kept(self) -> float:
        """Kept keys / tokens seen, averaged over batch and heads (1.0 before any token)."""
        if self.valid is None or self.seen == 0:
            return 1.0
        b, h = self.valid.shape[:2]
        return self.kept() / (b * h * self.seen)

    def threshold(self) -> Tensor:
        """delta_j of every cached key, (B,H,C) fp32 (see the module docstring)."""
        assert self.q_max is not None and self.k_max is not None
        assert self.k is not None and self.pos is not None
        p = self.policy
        if p.delta is not None:
            return torch.full(self.pos.shape, float(p.delta), device=self.k.device)
        s = p.norm_slack
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(self.k.shape[-1])
        q = torch.full_like(self.q_max, self.q_bound) if self.q_bound is not None else s * self.q_max
        k = torch.full_like(self.k_max, self.k_bound) if self.k_bound is not None else s * self.k_max
        assert self.kn is not None  # cached keys are known: their own norm, no slack
        norms = scale * q[..., None] * (self.kn + k[..., None])
        # -log c(p) from the cached positions at each round (every `every` tokens), not stored per token:
        # a decode step then pays nothing for it, and a round's cost is O(slots) either way.
        return norms + p.margin + key_budget_log(self.pos, p.max_tokens)

    # ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, phi: Tensor | None, segment_ids: Tensor | None = None
    ) -> Tensor:
        """segment_ids (B, T): the documents of the new tokens (model.attention.document_mask); a query
        then sees only the cached and new keys of its own document."""
        b, h, t, d = q.shape
        if (phi is None) == self.spec.has_field:
            raise ValueError(
                f"attention kind {self.kind!r} {'needs' if phi is None else 'takes no'} field phi"
            )
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(d)
        qf, kf, vf = q.float(), k.float(), v.float()
        phi_f = phi.float() if phi is not None else None

        # Bias of the new keys among themselves (causal, -inf above the diagonal).
        field = phi_f if phi_f is not None else q.new_zeros(b, h, t, dtype=torch.float32)
        b_new = fpa_bias_naive(field, self.spec, segment_ids=segment_ids)
        logits_new = scale * torch.einsum("bhid,bhjd->bhij", qf, kf) + b_new

        if self.k is not None:
            assert self.v is not None and self.valid is not None
            logits_old = scale * torch.einsum("bhid,bhjd->bhij", qf, self.k.float())
            if phi_f is not None:
                assert self.phi is not None and self.r is not None
                if self.spec.range_min:
                    prefix_min = torch.cummin(phi_f, dim=-1).values  # min over [now+1, i]
                    b_old = (
                        torch.minimum(self.r[..., None, :], prefix_min[..., :, None]) - self.phi[..., None, :]
                    )
                else:  # fox
                    b_old = phi_f[..., :, None] - self.phi[..., None, :]
                logits_old = logits_old + b_old
            visible = self.valid[..., None, :]
            if segment_ids is not None:
                assert self.seg is not None
                visible = visible & (self.seg[..., None, :] == segment_ids[:, None, :, None])
            logits_old = logits_old.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(torch.cat([logits_old, logits_new], dim=-1), dim=-1)
            c = logits_old.shape[-1]  # two products, not a copy of the cached values
            out = probs[..., :c] @ self.v.float() + probs[..., c:] @ vf
        else:
            out = torch.softmax(logits_new, dim=-1) @ vf
        self.append(q, k, v, phi_f, segment_ids)
        return out

    @torch.no_grad()
    def append(
        self, q: Tensor, k: Tensor, v: Tensor, phi: Tensor | None, segment_ids: Tensor | None = None
    ) -> None:
        """Add new tokens whose attention output was computed elsewhere (the model's own op, for a first
        chunk), then apply the eviction policy. With segment_ids (B, T), keys of documents that have
        ended (earlier than the newest token's) are dropped: no later query can see them."""
        self._append(q, k, v, None if phi is None else phi.float())
        if segment_ids is not None:
            self._extend("seg", segment_ids.long()[:, None, :].expand(*k.shape[:3]))
            assert self.valid is not None and self.seg is not None
            done = self.valid & (self.seg < segment_ids[:, -1, None, None])
            if bool(done.any()):
                self._drop(done)
        if (
            self.policy.enabled
            and self.spec.has_field
            and (k.shape[2] > 1 or self.seen % self.policy.every == 0)
        ):
            self._evict()

    def _extend(self, name: str, new: Tensor) -> None:
        """Append `new` along the slot dim (2) of the cached tensor `name`, in place when its buffer has
        room; a full (or replaced) buffer is reallocated at twice the slots, so appends are amortized
        O(new) where torch.cat would copy the whole cache every token."""
        cur: Tensor | None = getattr(self, name)
        n, t = (0 if cur is None else cur.shape[2]), new.shape[2]
        buf = self._buffers.get(name)
        fits = (
            cur is not None
            and buf is not None
            and buf.shape[2] >= n + t
            and cur.data_ptr() == buf.data_ptr()
            and cur.stride() == buf.stride()
        )
        if not fits:
            shape = (*new.shape[:2], max(2 * n, n + t, 16), *new.shape[3:])
            buf = new.new_empty(shape)
            if cur is not None:
                buf[:, :, :n] = cur
            self._buffers[name] = buf
        assert buf is not None
        buf[:, :, n : n + t] = new
        setattr(self, name, buf[:, :, : n + t])

    def _append(self, q: Tensor, k: Tensor, v: Tensor, phi: Tensor | None) -> None:
        b, h, t, _ = k.shape
        q_norm = q.float().norm(dim=-1).amax(-1)
        k_norms = k.float().norm(dim=-1)
        k_norm = k_norms.amax(-1)
        self.q_max = q_norm if self.q_max is None else torch.maximum(self.q_max, q_norm)
        self.k_max = k_norm if self.k_max is None else torch.maximum(self.k_max, k_norm)
        if phi is not None:
            if self.r is not None:  # the running min of every cached key takes in the new tokens
                torch.minimum(self.r, phi.amin(-1, keepdim=True), out=self.r)
            # r for a new key: min of phi from the key to the newest token (suffix min in the chunk).
            self._extend("r", torch.flip(torch.cummin(torch.flip(phi, [-1]), dim=-1).values, [-1]))
            self._extend("phi", phi)
            self.phi_last = phi[..., -1].clone()
        self._extend("k", k)
        self._extend("v", v)
        self._extend("kn", k_norms)
        pos = torch.arange(self.seen, self.seen + t, device=k.device).expand(b, h, t)
        self._extend("pos", pos)
        self._extend("valid", torch.ones(b, h, t, dtype=torch.bool, device=k.device))
        self.seen += t

    def _evict(self) -> None:
        assert self.phi is not None and self.r is not None and self.valid is not None
        assert self.k is not None and self.v is not None and self.pos is not None
        if self.spec.range_min:
            bias = self.r - self.phi
        else:  # fox: phi is a cumulative sum of log forget gates, so phi_now is the running min
            assert self.phi_last is not None
            bias = self.phi_last[..., None] - self.phi
        delta = self.threshold()
        drop = self.valid & (bias < -delta)
        if not bool(drop.any()):
            return
        if self.policy.record:
            bi, hi, ci = drop.nonzero(as_tuple=True)
            self.log.append(
                Eviction(self.seen, bi, hi, self.pos[bi, hi, ci], bias[bi, hi, ci], delta[bi, hi, ci])
            )
        self._drop(drop)

    def _drop(self, drop: Tensor) -> None:
        """Evict the slots flagged in drop (B,H,C): masked at once (no later query sees them), removed
        from the tensors once the most kept in a row is at most COMPACT_AT of the slots."""
        assert self.valid is not None
        self.valid &= ~drop  # in place: the view of its buffer stays one
        if int(self.valid.sum(-1).max()) <= COMPACT_AT * self.capacity:
            self._compact()

    def _compact(self) -> None:
        """Remove the invalid slots and shrink the slots to the most kept per row."""
        assert self.valid is not None and self.k is not None
        keep = self.valid
        new_cap = int(keep.sum(-1).max())
        # Kept slots first, in their original order (a stable sort of the drop flags), then cut.
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :new_cap]
        idx_d = order[..., None].expand(*order.shape, self.k.shape[-1])
        for name in _SLOTS:
            cur = getattr(self, name)
            if cur is None:
                continue
            kept = torch.gather(cur, 2, idx_d if cur.dim() == 4 else order)
            # Into a buffer with room for as many again, so the next appends do not move it at once.
            buf = kept.new_empty((*kept.shape[:2], max(2 * new_cap, 16), *kept.shape[3:]))
            buf[:, :, :new_cap] = kept
            self._buffers[name] = buf
            setattr(self, name, buf[:, :, :new_cap])

    def kept_positions(self, batch: int = 0, head: int = 0) -> list[int]:
        """Absolute positions of the keys still cached for one (batch, head)."""
        if self.pos is None or self.valid is None:
            return []
        return self.pos[batch, head][self.valid[batch, head]].tolist()


@dataclass
class KVCache:
    """The caches of all layers of a GPT plus the number of tokens consumed."""

    layers: list[LayerCache]
    seen: int = 0
    # model.attention.document_mask: the end-of-document id; a token after it starts a new document (its
    # queries see none of the earlier keys, its RoPE position restarts at 0), row by row.
    eod_id: int | None = None
    docs: Tensor | None = None  # (B,) end-of-document tokens seen per row: the next token's document
    doc_start: Tensor | None = None  # (B,) stream index where each row's current document began

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, policy: EvictionPolicy | None = None, eod_id: int | None = None
    ) -> KVCache:
        """eod_id: the end-of-document token, required by (and only taken for) a model with
        model.attention.document_mask."""
        policy = policy or EvictionPolicy()
        attn_cfg = getattr(getattr(model, "cfg", None), "attention", None)
        masked = bool(getattr(attn_cfg, "document_mask", False))
        if masked and eod_id is None:
            raise ValueError(
                "model.attention.document_mask=true: the KV-cache decoder needs the end-of-document id "
                "(eod_id=..., the data index's eod_id) to start a new document after it"
            )
        layers = []
        for block in model.blocks:
            attn = block.attn
            bounds = {}
            if getattr(attn, "q_norm", None) is not None and getattr(attn, "k_norm", None) is not None:
                # RMSNorm output: |y| = sqrt(D) * |w * x/|x||, at most sqrt(D) max|w| (RoPE keeps norms).
                root_d = math.sqrt(attn.head_dim)
                bounds = {
                    "q_bound": root_d * float(attn.q_norm.weight.detach().abs().max()),
                    "k_bound": root_d * float(attn.k_norm.weight.detach().abs().max()),
                }
                growth = attn.cfg.log_scale_length
                if growth is not None:
                    # Queries grow by the log-n factor with their position: a ceiling up to the expected
                    # length; without one, no ceiling (the norm_slack estimate, as without qk_norm).
                    n = policy.max_tokens
                    bounds["q_bound"] = (
                        bounds["q_bound"] * float(log_length_factor(n - 1, 1, growth)[0]) if n else None
                    )
            layers.append(LayerCache(attn.spec, policy, **bounds))
        return cls(layers, eod_id=int(eod_id) if masked and eod_id is not None else None)

    def documents(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """(segment ids, document positions), each (B,T), of new tokens idx (B,T) following the tokens
        seen (document_mask); advances the per-row document state."""
        assert self.eod_id is not None
        b, t = idx.shape
        if self.docs is None or self.doc_start is None:
            self.docs = idx.new_zeros(b, dtype=torch.long)
            self.doc_start = idx.new_zeros(b, dtype=torch.long)
        if self.docs.shape[0] != b:
            raise ValueError(f"the cache holds {self.docs.shape[0]} rows; got tokens of {b}")
        ends = (idx == self.eod_id).long()
        seg = self.docs[:, None] + ends.cumsum(1) - ends
        p = torch.arange(self.seen, self.seen + t, device=idx.device).expand(b, t)
        starts = torch.cat([self.docs[:, None], seg[:, :-1]], dim=1) != seg  # first token after an eod
        first = torch.where(starts, p, self.doc_start[:, None]).cummax(dim=1).values
        self.docs = seg[:, -1] + ends[:, -1]
        self.doc_start = torch.where(ends[:, -1].bool(), self.seen + t, first[:, -1])
        return seg, p - first

    def fraction_kept(self) -> dict[str, float | list[float]]:
        """{"per_layer": [kept/seen per layer], "overall": kept/seen over all layers and heads}."""
        per_layer = [lc.fraction_kept() for lc in self.layers]
        return {"per_layer": per_layer, "overall": sum(per_layer) / max(len(per_layer), 1)}

    def capacity(self) -> list[int]:
        """Slots allocated per (batch, head) in each layer."""
        return [lc.capacity for lc in self.layers]


# ----------------------------------------------------------------------------------------------------
# Model-level decoding


@torch.no_grad()
def _forward_chunk(model: torch.nn.Module, cache: KVCache, idx: Tensor) -> Tensor:
    """Run new tokens idx (B,T) through the model against the cache; return their logits (B,T,V)."""
    x = model.embed(idx)
    seg = positions = None
    if cache.eod_id is not None:
        seg, positions = cache.documents(idx)
    for block, lc in zip(model.blocks, cache.layers):
        attn = block.attn
        h = block.norm1(x)
        # document_mask: RoPE at the positions inside each row's document, and no shift across its start.
        (q, k, v, u), lc.kv_prev = attn.project_with_carry(h, cache.seen, lc.kv_prev, positions)
        phi = attn.field_from_increments(u, lc.phi_last)
        if lc.seen == 0:
            # Nothing cached yet: the model's own op (chunked / Triton, O(T) memory) gives the exact output.
            o = attn.attend(q, k, v, phi, seg)
            lc.append(q, k, v, phi, seg)
        else:
            o = lc.attend(q, k, v, phi, seg)
        x = x + attn.output(o.to(h.dtype), h)
        x = x + block.mlp(block.norm2(x))
    cache.seen += idx.shape[1]
    return model.lm_head(model.norm_f(x))


@torch.no_grad()
def prefill(
    model: torch.nn.Module,
    idx: Tensor,
    cache: KVCache | None = None,
    *,
    policy: EvictionPolicy | None = None,
    chunk_size: int | None = None,
    all_logits: bool = False,
    eod_id: int | None = None,
) -> tuple[Tensor, KVCache]:
    """Feed a prompt idx (B,T) in chunks of chunk_size; evictions happen between chunks, so later chunks
    (and the first generated token) already see the compressed cache.

    chunk_size None: the whole prompt at once when nothing is evicted (one pass of the model's op), else
    DEFAULT_PREFILL_CHUNK. Returns (logits, cache): logits (B,T,V) if all_logits else the last position's
    (B,V). eod_id: the end-of-document token of a model with model.attention.document_mask (a new cache
    only; a given cache keeps its own).
    """
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError(f"prefill needs token ids of shape (B, T>0); got {tuple(idx.shape)}")
    cache = cache if cache is not None else KVCache.for_model(model, policy, eod_id)
    if chunk_size is None:
        evicting = any(lc.policy.enabled and lc.spec.has_field for lc in cache.layers)
        chunk_size = DEFAULT_PREFILL_CHUNK if evicting else idx.shape[1]
    if chunk_size < 1:
        raise ValueError(f"prefill chunk_size must be >= 1; got {chunk_size}")
    outs = []
    for start in range(0, idx.shape[1], chunk_size):
        logits = _forward_chunk(model, cache, idx[:, start : start + chunk_size])
        outs.append(logits if all_logits else logits[:, -1:])
    logits = torch.cat(outs, dim=1) if all_logits else outs[-1][:, -1]
    return logits, cache


@torch.no_grad()
def decode_step(model: torch.nn.Module, cache: KVCache, token: Tensor) -> Tensor:
    """One new token per sequence, token (B,) or (B,1) -> next-token logits (B,V)."""
    token = token.reshape(-1, 1)
    return _forward_chunk(model, cache, token)[:, -1]


def sample_next(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next tokens (B,) from logits (B,V): argmax when temperature is 0, else a draw from
    softmax(logits / temperature) over the top_k most likely tokens (all when None), using generator
    (the same seed gives the same draws)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0; got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1; got {top_k}")
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits.float() / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    # Drawn on the generator's device (CPU by default), so a seed gives the same tokens on any device.
    dev = generator.device if generator is not None else probs.device
    return torch.multinomial(probs.to(dev), 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    idx: Tensor,
    max_new_tokens: int,
    *,
    policy: EvictionPolicy | None = None,
    chunk_size: int | None = None,
    eos_id: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    on_token: Callable[[Tensor], None] | None = None,
    eod_id: int | None = None,
) -> tuple[Tensor, KVCache]:
    """Decoding: prompt idx (B,T) -> (new tokens (B, <= max_new_tokens), cache). Greedy by default;
    temperature > 0 samples (sample_next: top_k, generator). on_token(tokens (B,)) is called as each step's
    tokens are chosen (streaming).

    Stops early once every sequence has produced eos_id (later positions of finished rows repeat it).
    eod_id: the end-of-document token of a model with model.attention.document_mask (prefill); a prompt
    holding it starts a new document after it.
    """
    logits, cache = prefill(model, idx, policy=policy, chunk_size=chunk_size, eod_id=eod_id)
    out: list[Tensor] = []
    done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    for step in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, generator)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        out.append(nxt)
        if on_token is not None:
            on_token(nxt)
        if step + 1 == max_new_tokens or (eos_id is not None and bool(done.all())):
            break
        logits = decode_step(model, cache, nxt)
    new = torch.stack(out, dim=1) if out else idx.new_zeros(idx.shape[0], 0)
    return new, cache
