"""Sequence-parallel FPA (what some codebases call context parallelism): a ring of K/V/phi over ranks
and a cross-rank scan of the field.

The W ranks of a sequence-parallel group share one sequence of length T. The sequence is cut into chunks
of equal length and every rank holds some of them, concatenated in ascending order along the time axis:

- layout "zigzag" (default): 2W chunks; rank r holds chunks r and 2W-1-r (T % 2W == 0). Causal attention
  then costs every rank the same: at each ring step a rank computes exactly two full chunk pairs (plus the
  two diagonal tiles at step 0), where the contiguous layout leaves rank 0 idle and rank W-1 doing W pairs.
- layout "contiguous": W chunks; rank r holds chunk r (T % W == 0).

`shard_sequence` / `unshard_sequence` / `shard_batch` / `local_positions` convert between the full
sequence and a rank's part. Everything below follows docs/design.md ("Sequence parallel ring",
"Tiled computation"):

Field. Each rank passes the field increments u of its tokens (field "walk" or "gate": for gate the caller
already applied logsigmoid, so both are a plain cumulative sum here) or the field values themselves
(field "direct"). One all-gather of a few scalars per (chunk, batch, head) gives every rank the increment
totals (-> exclusive scan -> each chunk's global offset of phi), the chunk minima and their argmin
positions (-> M, the min over every chunk strictly between a key chunk and a query chunk).

Forward. The pairing of a ring: at step s each rank sends to rank + s and receives from rank - s
(batch_isend_irecv, the next step's messages in flight while the current one is computed), each key chunk
straight from its owner and only to a rank with a query chunk that uses it (later in the sequence and,
with tile skipping, not skipped for every (b, h): _decide, _Plan). A query chunk a against an earlier key
chunk b uses b_ij = min(P_i, S_j, M(b+1..a-1)) - phi_j (fpa), phi_i - phi_j (fox) or 0 (softmax),
computed by a cross-chunk block; same-chunk pairs use a diagonal block; the partial (out, lse) are merged
by log-sum-exp. Nothing here is a second attention implementation: the per-pair math is one of two sets
of block functions with the same signatures (argument `impl`): the Triton kernels of
fpa_model.ops.fpa.triton_kernel for CUDA tensors ("auto"), the PyTorch blocks of
fpa_model.ops.fpa.chunked everywhere else. The ring only picks the pairs and their M, merges the results
and routes the gradients.

Backward. The same chunks come again; each receiver's shares of their dK, dV, dphi_K go back to the
owner, which adds them in step order. The gradient that reaches M (one scalar per pair, batch and head)
is added to a (chunks, B, H) buffer at the chunk holding M's argmin; one all-reduce of that buffer
(packed with the per-chunk totals of dphi, which the reverse scan of walk/gate fields needs) returns it
to the rank that owns the argmin token. du = reverse cumsum of dphi inside the chunk + the sum of dphi
over all later chunks.

Tiles. With the chunked blocks a chunk pair is processed `block_size` query rows at a time (the workspace
is block_size x chunk per batch and head, never chunk x chunk): rows [s, e) of a query chunk see P
restarted at s, so the min of phi over the rows before s is folded into that tile's M and its gradient
routed to that prefix argmin. The Triton blocks tile on chip with O(chunk) memory, so they take whole
chunks (s = 0: M is the between-chunks minimum itself).

Ties follow the chunked path's rule (lowest index wins): chunk minima use the first argmin inside a chunk,
M's argmin is the lowest chunk among equal minima, and M beats the query prefix it is folded with.

Works with any torch.distributed backend that has all_gather, all_reduce and batch_isend_irecv (gloo on
CPU, NCCL on GPU). The group's ranks must all pass tensors of the same shape.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fpa_model.config import ATTENTION_IMPLS, FIELD_MODES, SP_LAYOUTS, SP_MODES
from fpa_model.ops.fpa import chunked, fpa_attention, skipping
from fpa_model.ops.fpa.kinds import AttentionKind, resolve_kind

LAYOUTS = SP_LAYOUTS
FIELDS = FIELD_MODES

# ----------------------------------------------------------------------------------------------------
# Layout: which chunks of the sequence a rank holds


def num_chunks(world: int, layout: str = "zigzag") -> int:
    """How many equal chunks the sequence is cut into for a group of `world` ranks."""
    _check_layout(layout)
    return 2 * world if layout == "zigzag" else world


def chunk_ids(rank: int, world: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The chunk indices rank `rank` holds, ascending (= their order in the rank's local tensors)."""
    _check_layout(layout)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a sequence-parallel group of size {world}")
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def check_divisible(seq_len: int, world: int, layout: str = "zigzag") -> int:
    """The chunk length for seq_len split over `world` ranks; a clear error if it does not split evenly."""
    n = num_chunks(world, layout)
    if seq_len % n:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {n} (= the {layout} layout's chunk count for "
            f"{world} sequence-parallel ranks); pick data.seq_len as a multiple of {n}"
        )
    return seq_len // n


def shard_sequence(x: Tensor, rank: int, world: int, *, dim: int = 1, layout: str = "zigzag") -> Tensor:
    """This rank's part of the full sequence x along `dim` (its chunks concatenated in ascending order)."""
    dim = dim % x.dim()
    c = check_divisible(x.shape[dim], world, layout)
    parts = [x.narrow(dim, i * c, c) for i in chunk_ids(rank, world, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard_sequence(parts: Sequence[Tensor], *, dim: int = 1, layout: str = "zigzag") -> Tensor:
    """Inverse of shard_sequence: the full sequence from every rank's part (parts[r] from rank r)."""
    world = len(parts)
    n = num_chunks(world, layout)
    per_rank = n // world
    chunks: list[Tensor | None] = [None] * n
    for r, p in enumerate(parts):
        d = dim % p.dim()
        if p.shape[d] % per_rank:
            raise ValueError(
                f"part {r} has length {p.shape[d]} along dim {dim}, not a multiple of {per_rank}"
            )
        for i, piece in zip(chunk_ids(r, world, layout), p.chunk(per_rank, dim=d)):
            chunks[i] = piece
    return torch.cat([c for c in chunks if c is not None], dim=dim)


def local_positions(seq_len: int, rank: int, world: int, layout: str = "zigzag") -> Tensor:
    """Absolute positions (int64, length seq_len / world) of this rank's tokens, e.g. for RoPE."""
    c = check_divisible(seq_len, world, layout)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, world, layout)])


def shard_batch(tokens: Tensor, rank: int, world: int, *, layout: str = "zigzag") -> tuple[Tensor, Tensor]:
    """(inputs, targets), each (B, T/world), of this rank from a batch of token windows (B, T+1)."""
    if tokens.dim() != 2:
        raise ValueError(
            f"shard_batch expects a (batch, seq_len + 1) token tensor; got shape {tuple(tokens.shape)}"
        )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    return (
        shard_sequence(inputs, rank, world, dim=1, layout=layout),
        shard_sequence(targets, rank, world, dim=1, layout=layout),
    )


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence-parallel layout {layout!r}; expected one of {LAYOUTS}")


# ----------------------------------------------------------------------------------------------------
# Ring communication


@dataclass
class RingTraffic:
    """What this rank sent to its peers in the ring's passes: key chunks (K|V, with phi) and their
    gradient shares, one message each, and their bytes."""

    chunks: int = 0
    bytes: int = 0


_TRAFFIC: list[RingTraffic] = []


@contextlib.contextmanager
def ring_traffic() -> Iterator[RingTraffic]:
    """Counts the chunk messages this rank sends in the ring's passes (forward and backward) in the block."""
    counts = RingTraffic()
    _TRAFFIC.append(counts)
    try:
        yield counts
    finally:
        _TRAFFIC.remove(counts)


class _Exchange:
    """Point-to-point messages of one pass. At step s every rank sends its own chunks to the rank s places
    after it and receives from the rank s places before it (backward gradients go the other way): the
    pairing of a ring, but each message goes straight from the owner of the chunks to a rank that uses
    them, so a chunk nobody there needs (causally later, or skipped) is not sent at all."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def _global(self, group_rank: int) -> int:
        group_rank %= self.world
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def start(
        self, to: int, send: Sequence[Tensor], frm: int, recv_like: Sequence[Tensor], tag: int, chunks: int
    ) -> tuple[list[Tensor], list[Any]]:
        """Post sends of `send` (the tensors of `chunks` chunks) to group rank `to` and receives of tensors
        shaped as `recv_like` from `frm`.

        Both sides post the same step's messages in the same order; distinct tags keep the passes that are
        in flight together (K/V and gradient shares) apart."""
        send = [t.contiguous() for t in send]  # p2p needs dense buffers (q/k/v are permuted views)
        recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in recv_like]
        ops = [dist.P2POp(dist.isend, t, self._global(to), self.group, tag) for t in send]
        ops += [dist.P2POp(dist.irecv, r, self._global(frm), self.group, tag) for r in recv]
        for c in _TRAFFIC:
            c.chunks += chunks
            c.bytes += sum(t.numel() * t.element_size() for t in send)
        return recv, (dist.batch_isend_irecv(ops) if ops else [])

    @staticmethod
    def wait(works: list[Any]) -> None:
        for w in works:
            w.wait()


# Which block functions compute the chunk pairs: "chunked" (fpa_model.ops.fpa.chunked, PyTorch, any device,
# row-tiled) or "triton" (fpa_model.ops.fpa.triton_kernel, whole chunks). "auto" picks Triton for CUDA
# tensors it supports, "naive" (the layer's impl for tests) means chunked: the ring has no naive form.
RING_IMPLS = ATTENTION_IMPLS
_BLOCK_FNS = ("fpa_cross_forward", "fpa_cross_backward", "fpa_diag_forward", "fpa_diag_backward")
_TRITON_BLOCK: int | None = None  # the Triton blocks' tile (None: autotuned); tests pin small tiles


def _triton_blocks_unusable(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why the Triton blocks cannot run these tensors here, or None if they can."""
    try:  # imported here: triton is slow to import and may be missing or broken
        from fpa_model.ops.fpa import triton_kernel as tk
    except Exception as e:  # no triton, or a broken install
        return f"{type(e).__name__}: {e}"
    if not q.is_cuda and not tk._INTERPRET:
        return "they need CUDA tensors (or TRITON_INTERPRET=1 set before the kernels are imported)"
    if q.shape[-1] > tk.MAX_HEAD_DIM or v.shape[-1] != q.shape[-1]:
        return f"head dims q {q.shape[-1]}, v {v.shape[-1]}: they need equal head dims <= {tk.MAX_HEAD_DIM}"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: they take one of fp32, bf16, fp16"
    return None


def _resolve_impl(impl: str, q: Tensor, k: Tensor, v: Tensor) -> str:
    """Which blocks run this call, "chunked" or "triton"; a clear error where a forced "triton" cannot."""
    if impl not in RING_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {RING_IMPLS}")
    if impl in ("naive", "chunked"):
        return "chunked"
    if impl == "auto":
        return "triton" if q.is_cuda and _triton_blocks_unusable(q, k, v) is None else "chunked"
    why = _triton_blocks_unusable(q, k, v)
    if why is not None:
        raise RuntimeError(
            f"sequence-parallel impl 'triton' is unavailable here ({why}); use impl='chunked' or 'auto'"
        )
    return "triton"


def _block_fns(impl: str) -> Any:
    """The four block functions of `impl` (same signatures; the Triton ones get the ring's tile size)."""
    if impl == "chunked":
        return chunked
    from fpa_model.ops.fpa import triton_kernel as tk  # here: triton is slow to import

    return SimpleNamespace(**{n: partial(getattr(tk, n), block_size=_TRITON_BLOCK) for n in _BLOCK_FNS})


def _group_info(group: Any) -> tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1  # a single process without torch.distributed
    return dist.get_rank(group), dist.get_world_size(group)


# ----------------------------------------------------------------------------------------------------
# The field across ranks


def _all_gather_chunks(x: Tensor, group: Any, world: int, layout: str) -> Tensor:
    """Gather (n_local, ...) per-chunk tensors from every rank into (n_chunks, ...) in chunk order."""
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    out = x.new_empty((num_chunks(world, layout), *x.shape[1:]))
    for r, p in enumerate(parts):
        out[list(chunk_ids(r, world, layout))] = p
    return out


def _between_min(minima: Tensor, b: int, a: int) -> tuple[Tensor, Tensor | None]:
    """M = min of the chunk minima strictly between chunks b < a, and the chunk holding it (per B, H)."""
    if a - b <= 1:
        return torch.full_like(minima[0], math.inf), None
    vals, idx = minima[b + 1 : a].min(dim=0)  # first index among ties -> the lowest chunk wins
    return vals, idx + (b + 1)


# ----------------------------------------------------------------------------------------------------
# The autograd Function


# Row tiles hold at least this many scores per batch and head (fewer, larger calls on short chunks).
_TILE_SCORES = 1 << 17


def _row_tiles(n: int, rows: int) -> list[tuple[int, int]]:
    """Query row ranges of a chunk of n: `rows` (block_size) each, more while a tile stays small."""
    rows = max(rows, min(n, _TILE_SCORES // max(n, 1)))
    return [(s, min(s + rows, n)) for s in range(0, n, rows)]


def _tiles(impl: str, n: int, rows: int) -> list[tuple[int, int]]:
    """Row tiles for the chunked blocks; the Triton kernels tile on chip with O(n) memory: whole chunks
    (s == 0, so a pair's M is never folded with a query prefix and a diagonal pair is one causal block)."""
    return [(0, n)] if impl == "triton" else _row_tiles(n, rows)


class _Field:
    """The field of this rank's chunks in global values, and the chunk minima of the whole sequence."""

    def __init__(self, u: Tensor, field: str, ids: tuple[int, ...], group: Any, world: int, layout: str):
        n_local = len(ids)
        uc = u.detach().float().unflatten(-1, (n_local, -1))  # (B,H,n,c)
        cumulative = field in ("walk", "gate")
        cs = uc.cumsum(-1) if cumulative else uc
        mn, am = chunked.block_min(cs)  # lowest argmin among ties
        tot = cs[..., -1] if cumulative else torch.zeros_like(mn)
        stats = torch.stack([tot, mn, am.to(mn.dtype)], dim=-1).permute(2, 0, 1, 3)  # (n,B,H,3)
        g = _all_gather_chunks(stats, group, world, layout)  # (N,B,H,3): the one collective of the forward
        offsets = torch.cumsum(g[..., 0], dim=0) - g[..., 0]  # exclusive scan of the increment totals
        self.minima = g[..., 1] + offsets  # (N,B,H) chunk minima in global field values
        self.argmin = g[..., 2].round().long()  # (N,B,H) their position inside the chunk
        self.phi = (cs + offsets[list(ids)].permute(1, 2, 0)[..., None]).flatten(-2)  # (B,H,T_local)


def _query_prefix(phi_q: Tensor | None, kind: AttentionKind) -> tuple[Tensor | None, Tensor | None]:
    """Prefix minima of a query chunk's field (fpa only): folded into M for row tiles after the first."""
    if not kind.range_min or phi_q is None:
        return None, None
    return chunked.prefix_min(phi_q)


def _tile_m(
    kind: AttentionKind, m: Tensor | None, pmin: Tensor | None, s: int
) -> tuple[Tensor | None, Tensor | None]:
    """M for query rows [s, e): min(M, min phi_q[:s]); and where M itself wins (it is earlier: ties)."""
    if not kind.range_min or s == 0:
        return m, None
    pref = pmin[..., s - 1]
    m_wins = m <= pref
    return torch.where(m_wins, m, pref), m_wins


def _key_summaries(
    k: Tensor, fld: _Field, ids: tuple[int, ...], kind: AttentionKind, group: Any, world: int, layout: str
) -> Tensor:
    """(N, 2 + N, B, H) float32 ((N, 2, B, H) for fox), for every chunk b of the sequence: max |k| and min
    phi over b and, fpa only, skipping.key_reach of b for each query chunk a (M strictly between them;
    read only for a > b). The key side of the bound, computed by b's owner and all-gathered, so that every
    rank decides its chunk pairs before any keys travel (and does not fetch the keys it skips)."""
    n_chunks = num_chunks(world, layout)
    c = k.shape[-2] // len(ids)
    rows = []
    for ib, b in enumerate(ids):
        kb = k[..., ib * c : (ib + 1) * c, :].detach().float()
        pb = fld.phi[..., ib * c : (ib + 1) * c]
        parts = [kb.norm(dim=-1).amax(dim=-1), pb.amin(dim=-1)]
        if kind.range_min:
            s_min = chunked.suffix_min(pb)[0]
            between = (_between_min(fld.minima, b, a)[0] for a in range(n_chunks))
            parts += [skipping.key_reach(s_min, m, pb) for m in between]
        rows.append(torch.stack(parts))
    return _all_gather_chunks(torch.stack(rows), group, world, layout)


@dataclass
class _Decisions:
    """Which chunk pairs this rank computes: `skipped` (query chunk index ia, key chunk b) pairs left out for
    every (b, h), `partial` masks of the kept (b, h) of the others that skipping thinned, and `need` (N, N)
    bool over the whole sequence, need[a, b]: query chunk a uses some keys of chunk b (same on every rank)."""

    skipped: set[tuple[int, int]]
    partial: dict[tuple[int, int], Tensor]
    need: Tensor


def _causal_need(n_chunks: int) -> Tensor:
    return torch.ones(n_chunks, n_chunks, dtype=torch.bool).tril(-1)


def _decide(
    q: Tensor, k: Tensor, fld: _Field | None, ids: tuple[int, ...], kind: AttentionKind, scale: float,
    eps: float | None, group: Any, world: int, layout: str,
) -> _Decisions:  # fmt: skip
    """The ring's tile skipping: one decision per (query chunk a, earlier key chunk b, b, h), the chunked
    path's at a block size of one chunk over the whole sequence of T tokens (skipping.TileBound: each
    skipped key weighs < eps / T in its row). No skipping: every causal pair is needed."""
    n_chunks = num_chunks(world, layout)
    if eps is None or fld is None:
        return _Decisions(set(), {}, _causal_need(n_chunks))
    summary = _key_summaries(k, fld, ids, kind, group, world, layout)
    tau = skipping.skip_tau(q.shape[-2] * world, eps)
    c = q.shape[-2] // len(ids)
    keeps: dict[tuple[int, int], Tensor] = {}
    for ia, a in enumerate(ids):
        sl = slice(ia * c, (ia + 1) * c)
        qa = q[..., sl, :].detach().float() * scale
        qn, neg_ref = qa.norm(dim=-1), -(qa * k[..., sl, :].detach().float()).sum(dim=-1)
        pa = fld.phi[..., sl]
        q_bias = chunked.prefix_min(pa)[0] if kind.range_min else pa
        for b in range(a):
            kmax, phi_min, reach = summary[b, 0], summary[b, 1], summary[b, 2 + a] if kind.range_min else None
            keeps[(ia, b)] = skipping.bound_keep(qn, neg_ref, q_bias, kmax, phi_min, reach, tau)
    skipped: set[tuple[int, int]] = set()
    partial: dict[tuple[int, int], Tensor] = {}
    mine = torch.zeros(len(ids), n_chunks, dtype=torch.int32, device=q.device)
    if keeps:
        stacked = torch.stack(list(keeps.values()))  # (pairs, B, H)
        skipping.record_decisions(stacked)
        flat = stacked.flatten(1)
        anys, alls = flat.any(dim=1).tolist(), flat.all(dim=1).tolist()  # one device sync for all pairs
        for (pair, keep), kept_any, kept_all in zip(keeps.items(), anys, alls):
            if not kept_any:
                skipped.add(pair)
                continue
            mine[pair[0], pair[1]] = 1
            if not kept_all:
                partial[pair] = keep
    need = _all_gather_chunks(mine, group, world, layout).bool().cpu()
    return _Decisions(skipped, partial, need)


class _Plan:
    """Per step s of a pass, the indices (in the sender's chunk order) of the chunks this rank receives
    from rank - s (`recv`) and sends to rank + s (`send`): those a query chunk there needs."""

    def __init__(self, need: Tensor, rank: int, world: int, layout: str) -> None:
        ids = chunk_ids(rank, world, layout)

        def needed(users: tuple[int, ...], b: int) -> bool:
            return any(bool(need[a, b]) for a in users)

        self.recv = [
            [ib for ib, b in enumerate(chunk_ids((rank - s) % world, world, layout)) if needed(ids, b)]
            for s in range(world)
        ]
        self.send = [
            [ib for ib, b in enumerate(ids) if needed(chunk_ids((rank + s) % world, world, layout), b)]
            for s in range(world)
        ]


def _post_keys(
    ex: _Exchange | None, plan: _Plan, step: int, kv: list[Tensor], phi: list[Tensor] | None
) -> tuple[list[Tensor], list[Any]] | None:
    """Step `step`'s K|V (and phi) messages: this rank's chunks that rank + step needs, out; the chunks of
    rank - step that this rank needs, in (K|V of each, then phi of each)."""
    if ex is None or step >= ex.world:
        return None
    out, n_in = plan.send[step], len(plan.recv[step])
    send = [kv[i] for i in out] + ([phi[i] for i in out] if phi is not None else [])
    like = [kv[0]] * n_in + ([phi[0]] * n_in if phi is not None else [])
    return ex.start(ex.rank + step, send, ex.rank - step, like, tag=step, chunks=len(out))


def _arrived(
    got: list[Tensor], ibs: Sequence[int], n: int, dk: int, has_field: bool
) -> tuple[list[Tensor | None], list[Tensor | None], list[Tensor | None]]:
    """K, V, phi per chunk index of the sender (None: not sent, this rank does not need it), dense (the
    blocks would copy a strided view on every tile). got: K|V of each chunk in ibs, then phi of each."""
    kk: list[Tensor | None] = [None] * n
    vv: list[Tensor | None] = [None] * n
    pk: list[Tensor | None] = [None] * n
    for j, ib in enumerate(ibs):
        kk[ib], vv[ib] = got[j][..., :dk].contiguous(), got[j][..., dk:].contiguous()
        if has_field:
            pk[ib] = got[len(ibs) + j].contiguous()
    return kk, vv, pk


def _key_steps(
    ex: _Exchange | None, plan: _Plan, world: int, kv: list[Tensor], phi: list[Tensor] | None, dk: int
) -> Iterator[tuple[int, list[Tensor | None], list[Tensor | None], list[Tensor | None]]]:
    """(step, K, V, phi per chunk index of rank - step) for step 0 .. world-1 of a pass: this rank's own
    chunks first, then what the plan brings, the next step's messages in flight during each step."""
    n = len(kv)
    pending = _post_keys(ex, plan, 1, kv, phi)  # in flight while the own chunks are computed
    yield 0, *_arrived(kv + (phi or []), range(n), n, dk, phi is not None)
    for step in range(1, world):
        nxt = _post_keys(ex, plan, step + 1, kv, phi)
        _Exchange.wait(pending[1])
        yield step, *_arrived(pending[0], plan.recv[step], n, dk, phi is not None)
        pending = nxt


def _keep_only(x: Tensor | None, keep: Tensor) -> Tensor | None:
    """x (B, H, ...) with the (b, h) that keep (B, H) rules out zeroed."""
    return None if x is None else x * keep.view(*keep.shape, *[1] * (x.dim() - 2))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        u: Tensor | None,
        kind: AttentionKind,
        field: str,
        layout: str,
        group: Any,
        scale: float,
        rows: int,
        impl: str,
        eps: float | None = None,
    ) -> Tensor:
        # The block functions get the kind's name: the Triton blocks take it in that form.
        ops, blk = chunked, _block_fns(impl)
        rank, world = _group_info(group)
        ids = chunk_ids(rank, world, layout)
        n_local = len(ids)
        c = q.shape[-2] // n_local
        fld = _Field(u, field, ids, group, world, layout) if kind.has_field else None
        phi = fld.phi if fld is not None else None

        qs = q.split(c, dim=-2)
        phis_q = phi.split(c, dim=-1) if phi is not None else [None] * n_local
        pmins = [_query_prefix(p, kind)[0] for p in phis_q]
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        outs, lses = out.split(c, dim=-2), lse.split(c, dim=-1)  # views, filled in place
        no_m = torch.full(q.shape[:2], math.inf, device=q.device) if kind.range_min else None  # adjacent

        dk = k.shape[-1]
        # Tile skipping: one decision per (query chunk, key chunk, b, h), made before any keys travel and
        # replayed by the backward; a pair skipped for every (b, h) is neither fetched nor computed, a
        # partly skipped one is masked (`partial`: its mask of the kept (b, h)).
        dec = _decide(q, k, fld, ids, kind, scale, eps if kind.has_field else None, group, world, layout)
        plan = _Plan(dec.need, rank, world, layout)
        ex = _Exchange(group) if world > 1 else None
        # K and V of a chunk travel as one tensor (one message), phi beside it in float32.
        kv_own = list(torch.cat([k, v], dim=-1).split(c, dim=-2))
        phi_own = list(phi.split(c, dim=-1)) if phi is not None else None
        for step, kk, vv, pk in _key_steps(ex, plan, world, kv_own, phi_own, dk):
            src = (rank - step) % world
            for ia, a in enumerate(ids):
                for ib, b in enumerate(chunk_ids(src, world, layout)):
                    if b > a or (ia, b) in dec.skipped:
                        continue
                    m = _between_min(fld.minima, b, a)[0] if kind.range_min else None
                    keep = dec.partial.get((ia, b))
                    for s, e in _tiles(impl, c, rows):
                        qt = qs[ia][..., s:e, :]
                        if b == a:
                            # Rows [s, e) of a chunk against itself: a causal tile over [s, e) plus a
                            # cross tile against the adjacent keys [0, s) (M = +inf), which is much
                            # cheaper than the diagonal block's direct range min over all of [0, e).
                            pd = phis_q[ia][..., s:e] if phi is not None else None
                            o, lt = blk.fpa_diag_forward(
                                qt, kk[ib][..., s:e, :], vv[ib][..., s:e, :], pd, kind=kind.name, scale=scale
                            )
                            if s > 0:
                                p0 = pk[ib][..., :s] if phi is not None else None
                                o2, l2 = blk.fpa_cross_forward(
                                    qt,
                                    kk[ib][..., :s, :],
                                    vv[ib][..., :s, :],
                                    pd,
                                    p0,
                                    no_m,
                                    kind=kind.name,
                                    scale=scale,
                                )
                                o, lt = ops.merge_lse(o, lt, o2, l2)
                        else:
                            mt = _tile_m(kind, m, pmins[ia], s)[0]
                            pq = phis_q[ia][..., s:e] if phi is not None else None
                            o, lt = blk.fpa_cross_forward(
                                qt, kk[ib], vv[ib], pq, pk[ib], mt, kind=kind.name, scale=scale
                            )
                            if keep is not None:  # the skipped (b, h) of this pair weigh nothing
                                lt = lt.masked_fill(~keep[..., None], -math.inf)
                        o_m, l_m = ops.merge_lse(outs[ia][..., s:e, :], lses[ia][..., s:e], o, lt)
                        outs[ia][..., s:e, :] = o_m
                        lses[ia][..., s:e] = l_m

        out_t = out.to(q.dtype)
        minima = fld.minima if fld is not None else None
        argmin = fld.argmin if fld is not None else None
        ctx.save_for_backward(q, k, v, phi, out_t, lse, minima, argmin)
        ctx.meta = (kind, field, layout, group, scale, rows, impl, u is not None)
        ctx.dec, ctx.plan = dec, plan
        return out_t

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, phi, out, lse, minima, argmin = ctx.saved_tensors
        kind, field, layout, group, scale, rows, impl, has_u = ctx.meta
        dec, plan = ctx.dec, ctx.plan
        ops, blk = chunked, _block_fns(impl)
        rank, world = _group_info(group)
        ids = chunk_ids(rank, world, layout)
        n_local = len(ids)
        c = q.shape[-2] // n_local
        has_field = phi is not None

        delta = ops.attention_delta(dout, out)  # (B,H,T_local), full rows: computed once
        qs, douts, lses, deltas = q.split(c, -2), dout.split(c, -2), lse.split(c, -1), delta.split(c, -1)
        phis_q = phi.split(c, dim=-1) if has_field else [None] * n_local
        prefix = [_query_prefix(p, kind) for p in phis_q]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dqs = dq.split(c, -2)
        dphi_q = torch.zeros_like(phi) if has_field else None
        dphis_q = dphi_q.split(c, -1) if has_field else None
        dm_buf = torch.zeros_like(minima) if kind.range_min else None  # (N,B,H): dM per chunk holding M
        no_m = torch.full(q.shape[:2], math.inf, device=q.device) if kind.range_min else None

        ex = _Exchange(group) if world > 1 else None
        dk, dv = k.shape[-1], v.shape[-1]
        kv_own = list(torch.cat([k, v], dim=-1).split(c, dim=-2))
        phi_own = list(phi.split(c, dim=-1)) if has_field else None
        # dK | dV | dphi_K: this rank's own keys accumulate in `acc`. At step s the keys that came from
        # rank - s get a fresh float32 share each, sent back to their owner after the step's compute; the
        # owner adds the shares that come back to it in step order (deterministic).
        acc = k.new_zeros((*k.shape[:-1], dk + dv + int(has_field)), dtype=torch.float32)
        acc_own = list(acc.split(c, dim=-2))
        shares_in = None

        def add_shares(posted: tuple[int, tuple[list[Tensor], list[Any]]] | None) -> None:
            if posted is None:
                return
            step, (got, works) = posted
            _Exchange.wait(works)
            for ib, g in zip(plan.send[step], got):
                acc_own[ib] += g

        for step, kk, vv, pk in _key_steps(ex, plan, world, kv_own, phi_own, dk):
            src = (rank - step) % world
            shares: list[Tensor | None] = acc_own
            if step > 0:
                shares = [None] * n_local
                for ib in plan.recv[step]:
                    shares[ib] = acc.new_zeros(acc_own[ib].shape)
            # Views into the shares: the in-place adds below write through.
            gk = [None if t is None else t[..., :dk] for t in shares]
            gv = [None if t is None else t[..., dk : dk + dv] for t in shares]
            gp = [None if t is None else t[..., -1] for t in shares] if has_field else None
            for ia, a in enumerate(ids):
                pmin, parg = prefix[ia]
                for ib, b in enumerate(chunk_ids(src, world, layout)):
                    if b > a or (ia, b) in dec.skipped:  # the forward's decisions
                        continue
                    m, m_at = _between_min(minima, b, a) if kind.range_min else (None, None)
                    keep = dec.partial.get((ia, b))
                    for s, e in _tiles(impl, c, rows):
                        args = (douts[ia][..., s:e, :], qs[ia][..., s:e, :])
                        tile = {"lse": lses[ia][..., s:e], "delta": deltas[ia][..., s:e]}
                        if b == a:  # the same split as the forward: causal [s, e) + cross [0, s)
                            pd = phis_q[ia][..., s:e] if has_field else None
                            kd, vd = kk[ib][..., s:e, :], vv[ib][..., s:e, :]
                            g = blk.fpa_diag_backward(*args, kd, vd, pd, **tile, kind=kind.name, scale=scale)
                            dqs[ia][..., s:e, :] += g.dq
                            gk[ib][..., s:e, :] += g.dk
                            gv[ib][..., s:e, :] += g.dv
                            if has_field:
                                dphis_q[ia][..., s:e] += g.dphi
                            if s == 0:
                                continue
                            p0 = pk[ib][..., :s] if has_field else None
                            k0, v0 = kk[ib][..., :s, :], vv[ib][..., :s, :]
                            g2 = blk.fpa_cross_backward(
                                *args, k0, v0, pd, p0, no_m, **tile, kind=kind.name, scale=scale
                            )
                            dqs[ia][..., s:e, :] += g2.dq
                            gk[ib][..., :s, :] += g2.dk
                            gv[ib][..., :s, :] += g2.dv
                            if has_field:
                                dphis_q[ia][..., s:e] += g2.dphi_q
                                dphis_q[ia][..., :s] += g2.dphi_k
                            continue
                        mt, m_wins = _tile_m(kind, m, pmin, s)
                        pq = phis_q[ia][..., s:e] if has_field else None
                        g = blk.fpa_cross_backward(
                            *args, kk[ib], vv[ib], pq, pk[ib], mt, **tile, kind=kind.name, scale=scale
                        )
                        if keep is not None:  # skipped (b, h): no gradient, as they had no weight
                            g = chunked.CrossGrads(*(_keep_only(x, keep) for x in g))
                        dqs[ia][..., s:e, :] += g.dq
                        gk[ib].add_(g.dk)
                        gv[ib].add_(g.dv)
                        if not has_field:
                            continue
                        dphis_q[ia][..., s:e] += g.dphi_q
                        gp[ib].add_(g.dphi_k)
                        if not kind.range_min:
                            continue
                        # The tile's M is min(M between chunks, phi_q before row s): route dM to its argmin.
                        dm_between = g.dm if m_wins is None else g.dm * m_wins
                        if m_at is not None:
                            dm_buf.scatter_add_(0, m_at[None], dm_between[None])
                        if m_wins is not None:
                            dm_pref = g.dm.masked_fill(m_wins, 0.0)
                            dphis_q[ia].scatter_add_(-1, parg[..., s - 1 : s], dm_pref[..., None])
            if step > 0:
                # The shares of rank - s's keys go back to it; rank + s's shares of ours come in.
                back = [shares[ib] for ib in plan.recv[step]]
                like = [acc_own[ib] for ib in plan.send[step]]
                posted = ex.start(rank - step, back, rank + step, like, tag=world + step, chunks=len(back))
                add_shares(shares_in)
                shares_in = (step, posted)
        add_shares(shares_in)

        dk_t, dv_t = acc[..., :dk].to(k.dtype), acc[..., dk : dk + dv].to(v.dtype)
        du = None
        if has_field and has_u:
            du = _field_backward(
                acc[..., -1] + dphi_q, dm_buf, argmin, kind, field, ids, group, world, layout
            )
        return dq.to(q.dtype), dk_t, dv_t, du, None, None, None, None, None, None, None, None


def _field_backward(
    dphi: Tensor,
    dm_buf: Tensor | None,
    argmin: Tensor,
    kind: AttentionKind,
    field: str,
    ids: tuple[int, ...],
    group: Any,
    world: int,
    layout: str,
) -> Tensor:
    """du from dphi of this rank's chunks, dM of every chunk pair (routed here) and the scan's reverse."""
    n_local = len(ids)
    dphi_c = dphi.unflatten(-1, (n_local, -1))  # (B,H,n,c)
    cumulative = field in ("walk", "gate")
    if not kind.range_min and not cumulative:
        return dphi
    # One all-reduce returns the M gradients to the owners of the argmin tokens and shares the chunk
    # totals of dphi that the reverse scan of walk/gate fields needs.
    buf = dphi.new_zeros((num_chunks(world, layout), *dphi.shape[:2], 2))
    if dm_buf is not None:
        buf[..., 0] = dm_buf
    buf[list(ids), ..., 1] = dphi_c.sum(-1).permute(2, 0, 1)
    if world > 1:
        dist.all_reduce(buf, group=group)
    if dm_buf is not None:
        own = buf[list(ids), ..., 0].permute(1, 2, 0)  # (B,H,n)
        at = argmin[list(ids)].permute(1, 2, 0)  # (B,H,n) position inside the chunk
        dphi_c = dphi_c.scatter_add(-1, at[..., None], own[..., None])
    if cumulative:
        totals = buf[..., 0] + buf[..., 1]  # (N,B,H) dphi per chunk after the routing
        later = totals.flip(0).cumsum(0).flip(0) - totals  # sum over the strictly later chunks
        dphi_c = dphi_c.flip(-1).cumsum(-1).flip(-1) + later[list(ids)].permute(1, 2, 0)[..., None]
    return dphi_c.flatten(-2)


def _validate(
    q: Tensor, k: Tensor, v: Tensor, u_or_phi: Tensor | None, kind: AttentionKind, field: str, layout: str
) -> Tensor | None:
    """Argument checks shared by the ring and Ulysses; returns the field (None for softmax)."""
    if field not in FIELDS:
        raise ValueError(f"unknown field mode {field!r}; expected one of {FIELDS}")
    _check_layout(layout)
    if q.dim() != 4 or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"q, k, v must be (B, H, T_local, D) with equal shapes; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if kind.has_field:
        if u_or_phi is None:
            raise ValueError(f"kind {kind.name!r} needs the field (increments or values), got None")
        if u_or_phi.shape != q.shape[:-1]:
            raise ValueError(
                f"u_or_phi must be (B, H, T_local) = {tuple(q.shape[:-1])}; got {tuple(u_or_phi.shape)}"
            )
    else:
        u_or_phi = None
    return u_or_phi


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    u_or_phi: Tensor | None,
    *,
    kind: str | AttentionKind = "fpa",
    field: str = "walk",
    group: Any = None,
    scale: float | None = None,
    block_size: int = 64,
    layout: str = "zigzag",
    impl: str = "auto",
    segment_ids: Tensor | None = None,
    skip_epsilon: float | None = None,
) -> Tensor:
    """Causal FPA / FoX / softmax attention of a sequence split over the ranks of `group`.

    Each rank passes its part of the sequence (see the module docstring for the layouts):
    q, k, v (B, H, T/W, D) and u_or_phi (B, H, T/W): the field increments for field "walk" / "gate"
    (gate: the logsigmoid values, as Attention.project returns them) or the field values for "direct";
    None (or ignored) for kind "softmax". Returns this rank's output (B, H, T/W, D) in q's dtype, equal
    to the single-process attention over the whole sequence. Differentiable w.r.t. q, k, v and u_or_phi.
    group None: the default world group (or a single process without torch.distributed).
    block_size: query rows per tile of the chunked blocks (workspace B x H x block_size x T/(2W) floats
    per temporary); the Triton blocks take whole chunks and tile on chip.
    impl: which blocks compute the chunk pairs. "auto": the Triton kernels (fpa_model.ops.fpa.triton_kernel)
    for CUDA tensors they support (fp32/bf16/fp16, equal head dims <= 128), the chunked PyTorch blocks
    otherwise; "chunked" (or "naive") / "triton" force one ("triton" on CPU only under TRITON_INTERPRET=1,
    else a RuntimeError). T must be divisible by 2W (zigzag) or W (contiguous); every rank must pass the
    same shapes (and impl).
    segment_ids (B, T), the whole sequence's document ids (the same on every rank, data_prep.loader.
    document_segments of the full windows): pairs in different documents are masked. The keys are then
    all-gathered (_gathered_documents) instead of passed round the ring.
    skip_epsilon: tile skipping (fpa_model/ops/fpa/skipping.py; kinds with a field): a (query chunk, key
    chunk, b, h) whose logits the bound rules out is left out (each row loses < skip_epsilon of its mass),
    decided as the chunked path decides at a block size of one chunk; a chunk pair left out for every
    (b, h) is neither sent nor computed (ring_traffic() counts the messages). With segment_ids, the
    gathered keys go to fpa_attention with skip_epsilon (its own blocks decide).
    """
    kind = resolve_kind(kind)
    u_or_phi = _validate(q, k, v, u_or_phi, kind, field, layout)
    eps = skipping.check_skip_epsilon(skip_epsilon)
    if segment_ids is not None:
        return _gathered_documents(q, k, v, u_or_phi, kind, field, group, scale, block_size, layout, impl,
                                   segment_ids, eps)  # fmt: skip
    _, world = _group_info(group)
    n_local = num_chunks(world, layout) // world
    if q.shape[-2] % n_local:
        raise ValueError(
            f"local sequence length {q.shape[-2]} must be divisible by {n_local} ({layout} layout: each rank "
            f"holds {n_local} chunks); shard with fpa_model.sequence_parallel.shard_sequence"
        )
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}")
    # Resolved before any communication: a forced impl that cannot run fails on every rank alike.
    impl = _resolve_impl(impl, q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, u_or_phi, kind, field, layout, group, scale, block_size, impl, eps)


class _GatherSequence(torch.autograd.Function):
    """(B, H, T/W, ...) sequence shards -> the full (B, H, T, ...) on every rank; the gradient of each
    rank's shard is the sum over the ranks of their gradients at its positions."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, world: int, layout: str, rank: int) -> Tensor:
        ctx.args = (group, world, layout, rank)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return unshard_sequence(parts, dim=2, layout=layout)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None, None]:
        group, world, layout, rank = ctx.args
        g = g.contiguous()
        dist.all_reduce(g, group=group)
        return shard_sequence(g, rank, world, dim=2, layout=layout), None, None, None, None


def _gathered_documents(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    u_or_phi: Tensor | None,
    kind: AttentionKind,
    field: str,
    group: Any,
    scale: float | None,
    block_size: int,
    layout: str,
    impl: str,
    segment_ids: Tensor,
    skip_epsilon: float | None = None,
) -> Tensor:
    """The ring's contract with documents: every rank gathers the whole sequence's k, v and field
    increments (differentiably) and runs fpa_attention (its document tile skipping and masks) for each
    of its query chunks against the keys up to that chunk's end, with the segment ids of those keys.
    Pairs in different documents are masked and the FPA minimum of a visible pair runs inside its own
    document, so this equals the single-process masked attention. Memory: O(T) keys per rank."""
    rank, world = _group_info(group)
    b, t = q.shape[0], q.shape[-2] * world
    if tuple(segment_ids.shape) != (b, t):
        raise ValueError(
            f"sequence-parallel segment_ids must be the whole sequence's (B, T) = {(b, t)} (the same on "
            f"every rank); got {tuple(segment_ids.shape)}"
        )
    parts = [k, v] + ([u_or_phi[..., None]] if u_or_phi is not None else [])
    if world > 1:
        full = [_GatherSequence.apply(p, group, world, layout, rank) for p in parts]
    else:
        full = [unshard_sequence([p], dim=2, layout=layout) for p in parts]
    phi = None
    if u_or_phi is not None:
        u = full[2][..., 0].float()
        phi = u.cumsum(-1) if field in ("walk", "gate") else u
    impl = "chunked" if impl in ("naive", "chunked") or not q.is_cuda else impl
    ids = chunk_ids(rank, world, layout)
    c = q.shape[-2] // len(ids)
    outs = []
    for i, a in enumerate(ids):
        end = (a + 1) * c
        outs.append(
            fpa_attention(
                q[..., i * c : (i + 1) * c, :], full[0][..., :end, :], full[1][..., :end, :],
                None if phi is None else phi[..., :end], kind=kind, scale=scale, impl=impl,
                block_size=block_size, segment_ids=segment_ids[:, :end], skip_epsilon=skip_epsilon,
            )
        )  # fmt: skip
    return torch.cat(outs, dim=-2)


# ----------------------------------------------------------------------------------------------------
# DeepSpeed-Ulysses style alternative: all-to-all from sequence shards to head shards and back


def _seq_to_heads(x: Tensor, group: Any, world: int, layout: str) -> Tensor:
    """(B, H, T/W, ...) sequence shard -> (B, H/W, T, ...) full sequence for this rank's heads."""
    b, h = x.shape[:2]
    send = x.reshape(b, world, h // world, *x.shape[2:]).transpose(0, 1).contiguous()  # (W,B,H/W,Tl,...)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r] = rank r's tokens of my head group
    return unshard_sequence(list(recv.unbind(0)), dim=2, layout=layout)


def _heads_to_seq(y: Tensor, group: Any, world: int, layout: str) -> Tensor:
    """Inverse of _seq_to_heads: (B, H/W, T, ...) -> (B, H, T/W, ...)."""
    send = torch.stack([shard_sequence(y, r, world, dim=2, layout=layout) for r in range(world)])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)  # recv[r] = my tokens of head group r
    return recv.transpose(0, 1).flatten(1, 2)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, world: int, layout: str) -> Tensor:
        ctx.args = (group, world, layout)
        return _seq_to_heads(x, group, world, layout)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        return _heads_to_seq(g.contiguous(), *ctx.args), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: Tensor, group: Any, world: int, layout: str) -> Tensor:
        ctx.args = (group, world, layout)
        return _heads_to_seq(y, group, world, layout)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        return _seq_to_heads(g.contiguous(), *ctx.args), None, None, None


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    u_or_phi: Tensor | None,
    *,
    kind: str | AttentionKind = "fpa",
    field: str = "walk",
    group: Any = None,
    scale: float | None = None,
    block_size: int = 64,
    layout: str = "zigzag",
    impl: str = "auto",
    segment_ids: Tensor | None = None,
    skip_epsilon: float | None = None,
) -> Tensor:
    """Same contract as ring_attention, by all-to-all over heads (DeepSpeed-Ulysses).

    Each rank gathers the whole sequence for H/W of the heads (H must be divisible by W), builds the
    field with a plain cumsum, runs fpa_attention (impl as given) and scatters the output back. Moves
    4 (q, k, v, out) x T/W x H x D per rank and needs O(T) activations per rank for H/W heads; the ring
    moves K/V W-1 times but never holds the full sequence. skip_epsilon goes to fpa_attention, which decides
    per head exactly as on one rank.
    """
    rank, world = _group_info(group)
    if q.shape[1] % world:
        raise ValueError(
            f"ulysses sequence parallelism needs heads ({q.shape[1]}) divisible by the group size {world}"
        )
    kind = resolve_kind(kind)
    if kind.has_field and u_or_phi is None:
        raise ValueError(f"kind {kind.name!r} needs the field (increments or values), got None")
    if world == 1:
        parts = [q, k, v] + ([u_or_phi[..., None]] if kind.has_field else [])
        full = [unshard_sequence([t], dim=2, layout=layout) for t in parts]
    else:
        full = [_SeqToHeads.apply(t, group, world, layout) for t in (q, k, v)]
        if kind.has_field:
            full.append(_SeqToHeads.apply(u_or_phi[..., None], group, world, layout))
    phi = None
    if kind.has_field:
        u = full[3][..., 0].float()
        phi = u.cumsum(-1) if field in ("walk", "gate") else u
    o = fpa_attention(
        full[0], full[1], full[2], phi, kind=kind, scale=scale, impl=impl, block_size=block_size,
        segment_ids=segment_ids, skip_epsilon=skip_epsilon,
    )  # fmt: skip
    if world == 1:
        return shard_sequence(o, 0, 1, dim=2, layout=layout)
    return _HeadsToSeq.apply(o, group, world, layout)


# ----------------------------------------------------------------------------------------------------
# What an attention layer is given to attend across ranks


@dataclass(frozen=True)
class SequenceParallel:
    """The parallel context of an attention layer whose input is one rank's part of the sequence.

    group: the ranks sharing one sequence (a torch.distributed group; None: the default world group);
    layout: how the sequence is cut over them (LAYOUTS); mode: "ring" (ring_attention) or
    "ulysses" (all-to-all over heads, ulysses_attention). Process groups are made by the trainer
    (pipeline.trainer.sequence_parallel.make_groups); the model only receives them here.
    """

    group: Any = None
    layout: str = "zigzag"
    mode: str = "ring"

    def __post_init__(self) -> None:
        _check_layout(self.layout)
        if self.mode not in SP_MODES:
            raise ValueError(f"unknown sequence-parallel mode {self.mode!r}; expected one of {SP_MODES}")

    def local_chunks(self) -> tuple[int, ...]:
        """The chunk indices this rank holds, ascending (its tokens are these chunks, concatenated)."""
        rank, world = _group_info(self.group)
        return chunk_ids(rank, world, self.layout)


class _GatherChunks(torch.autograd.Function):
    """_all_gather_chunks with a gradient: each rank's chunks get the sum of every rank's gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, world: int, layout: str, ids: tuple[int, ...]) -> Tensor:
        ctx.args = (group, world, ids)
        return _all_gather_chunks(x, group, world, layout)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None, None]:
        group, world, ids = ctx.args
        g = g.contiguous()
        if world > 1:
            dist.all_reduce(g, group=group)
        return g[list(ids)], None, None, None, None


def sp_rank_world(sp: SequenceParallel) -> tuple[int, int]:
    """(rank, world) of this process in sp's group."""
    return _group_info(sp.group)


def chunk_predecessors(tails: Tensor, sp: SequenceParallel) -> Tensor:
    """For each of this rank's chunks, the value at the token just before the chunk's first token.

    tails (n_local, ...): the value at the last token of each local chunk (ascending chunk order). Returns
    (n_local, ...): the tail of chunk i - 1 for local chunk i, zeros for chunk 0 (the sequence start).
    One all-gather of the tails (the chunk before may sit on another rank, or be this rank's other zigzag
    chunk); differentiable, the gradient returns to the rank that owns the token. Used by the key/value
    shift of an attention layer (fpa_model.attention), which mixes each key with the previous token's.
    """
    rank, world = _group_info(sp.group)
    ids = chunk_ids(rank, world, sp.layout)
    if tails.shape[0] != len(ids):
        raise ValueError(
            f"tails has {tails.shape[0]} chunks; this rank holds {len(ids)} ({sp.layout} layout)"
        )
    every = _GatherChunks.apply(tails, sp.group, world, sp.layout, ids)  # (n_chunks, ...) in chunk order
    before = torch.cat([torch.zeros_like(every[:1]), every[:-1]])
    return before[list(ids)]


def sequence_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    u_or_phi: Tensor | None,
    sp: SequenceParallel,
    *,
    kind: str | AttentionKind = "fpa",
    field: str = "walk",
    block_size: int = 64,
    impl: str = "auto",
    segment_ids: Tensor | None = None,
    skip_epsilon: float | None = None,
) -> Tensor:
    """ring_attention or ulysses_attention over sp's group and layout, as sp.mode says.
    segment_ids: the whole sequence's (B, T) document ids, the same on every rank; skip_epsilon: tile
    skipping (see ring_attention)."""
    attend = ulysses_attention if sp.mode == "ulysses" else ring_attention
    return attend(
        q, k, v, u_or_phi, kind=kind, field=field, group=sp.group, layout=sp.layout, block_size=block_size,
        impl=impl, segment_ids=segment_ids, skip_epsilon=skip_epsilon,
    )  # fmt: skip
