"""One causal self-attention layer of the FPA family (fpa | fox | softmax).

The forward pass is split into public steps so that the KV-cache decoder and the synthetic experiments
can reuse them piece by piece:

    q, k, v, u = attn.project(x, pos_offset)        # projections, kv shift, qk-norm, RoPE, field increments
    phi = attn.field_from_increments(u, phi_prev)   # the scalar field phi per head (None for softmax)
    o = fpa_attention(q, k, v, phi, kind=...)       # the attention op (naive / chunked / triton)
    y = attn.output(o, x)                           # output norm and gate (optional), merge, out proj

Field parametrizations (docs/design.md, "The first-passage bias"): `walk` u = w_h.x + c_h and
phi = cumsum(u); `gate` u = logsigmoid(w_h.x + c_h) and phi = cumsum(u) (kind "fox" always uses this
one); `direct` u is the field value itself. The field is always computed in fp32: a long cumulative
sum in bf16 loses the small increments that decide which keys survive.

Key/value shift (`kv_shift`, FoX "Pro"): k'_t = g_k k_t + (1 - g_k) k_{t-1}, v'_t likewise, with per-head
gates (g_k, g_v) = sigmoid(W x_t + b) and k_{-1} = v_{-1} = 0. It mixes the *raw* projections, before
qk-norm and RoPE, so RoPE still rotates k'_t by its own position t and a decoder only has to carry the
previous token's raw k, v (`project_with_carry`; a sequence-parallel rank gets them for its chunks'
first tokens from the ranks that hold the tokens before them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fpa_model.config import AttentionConfig
from fpa_model.ops.fpa import fpa_attention
from fpa_model.ops.fpa.kinds import AttentionKind, resolve_kind
from fpa_model.ops.fpa.segments import check_segment_ids, document_positions, document_starts
from fpa_model.sequence_parallel import (
    SequenceParallel,
    chunk_predecessors,
    sequence_parallel_attention,
    shard_sequence,
    sp_rank_world,
)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in fp32 and cast back.

    heads=None: one gain vector (dim). heads=H: gains (H, dim) for inputs (B, H, T, dim), one vector per
    head (FoX-Pro's per-head qk-norm and output norm)."""

    def __init__(self, dim: int, eps: float = 1e-6, heads: int | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) if heads is None else torch.ones(heads, dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        if w.dim() == 2:  # (H, dim) against (B, H, T, dim)
            w = w[:, None, :]
        return (y * w).to(x.dtype)


def log_length_factor(
    start: int, length: int, train_length: int, device: torch.device | None = None
) -> Tensor:
    """max(1, ln(i + 1) / ln(train_length)) for the positions i in [start, start + length), fp32 (T,): the
    query multiplier of model.attention.log_scale_length."""
    pos = torch.arange(start, start + length, device=device, dtype=torch.float64)
    return (torch.log1p(pos) / math.log(train_length)).clamp(min=1.0).float()


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos, sin tables (T, head_dim/2) in fp32 for the given integer positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (first half, second half) of the last dim of x (B,H,T,D) by the given angles."""
    d2 = x.shape[-1] // 2
    x1, x2 = x[..., :d2].float(), x[..., d2:].float()
    y = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return y.to(x.dtype)


def gate_bias_for_increment(c: float) -> float:
    """The pre-activation b with logsigmoid(b) = c (< 0), so a gate field starts with increment c."""
    if c >= 0:
        raise ValueError(f"model.attention.field_bias_init values must be < 0 for a gate field; got {c}")
    return -math.log(math.expm1(-c))


class Attention(nn.Module):
    """Causal multi-head self-attention with a first-passage (fpa), forget-gate (fox) or no (softmax) bias.

    Args:
        d_model: model width.
        n_head: number of heads (d_model must be divisible by it).
        cfg: the attention section of the model config.
        max_seq_len: length the RoPE table is precomputed for (longer sequences extend it on the fly).
        sequence_parallel: attend across the ranks of a sequence-parallel group (forward then takes and
            returns this rank's part of the sequence); None: the whole sequence is here. GPT passes it on
            with GPT.set_sequence_parallel.
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        cfg: AttentionConfig,
        max_seq_len: int,
        sequence_parallel: SequenceParallel | None = None,
    ) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        if d_model % n_head:
            raise ValueError(f"model.d_model ({d_model}) must be divisible by model.n_head ({n_head})")
        self.d_model = d_model
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.cfg = cfg
        self.kind = cfg.kind  # resolved into self.spec (the flags every path reads)
        # FoX is exactly the gate parametrization with the phi_i - phi_j bias (its fixed field).
        self.field_mode: str | None = (self.spec.fixed_field or cfg.field) if self.spec.has_field else None
        self.use_rope = cfg.use_rope
        if self.use_rope and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim; got {self.head_dim}")

        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        # Per-head field projection: row h is w_h, bias entry h is c_h.
        self.field_proj = nn.Linear(d_model, n_head, bias=True) if self.field_mode is not None else None
        self.gate_proj = nn.Linear(d_model, d_model, bias=False) if cfg.output_gate else None
        # Key/value shift gates: outputs [0, H) gate the keys, [H, 2H) the values (one gate per head). Made
        # on the meta device (reset_parameters zero-fills them): no random draws, so with a given seed every
        # other weight starts as it does without the shift.
        self.shift_proj = None
        if cfg.kv_shift:
            shift = nn.Linear(d_model, 2 * n_head, bias=True, device="meta")
            self.shift_proj = shift.to_empty(device=self.qkv.weight.device)
        qk_heads = n_head if cfg.qk_norm_gains == "per_head" else None
        self.q_norm = RMSNorm(self.head_dim, heads=qk_heads) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, heads=qk_heads) if cfg.qk_norm else None
        self.out_norm = RMSNorm(self.head_dim, heads=n_head) if cfg.output_norm else None

        if self.use_rope:
            cos, sin = rope_cos_sin(torch.arange(max_seq_len), self.head_dim, cfg.rope_theta)
            # Not persistent: derived from the config, so checkpoints stay independent of max_seq_len.
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @property
    def kind(self) -> str:
        """The attention kind's name (fpa | fox | softmax); self.spec holds its resolved flags."""
        return self.spec.name

    @kind.setter
    def kind(self, kind: str | AttentionKind) -> None:
        self.spec = resolve_kind(kind)

    # ------------------------------------------------------------------------------------------------
    # Init

    def field_bias_values(self) -> Tensor:
        """The per-head initial increments, spread linearly between the two field_bias_init values."""
        lo, hi = (list(self.cfg.field_bias_init) + list(self.cfg.field_bias_init))[:2]
        if self.n_head == 1:
            return torch.tensor([0.5 * (lo + hi)])
        return torch.linspace(lo, hi, self.n_head)

    @torch.no_grad()
    def reset_parameters(self, init_std: float = 0.02, out_std: float | None = None) -> None:
        """FoX-recipe init: normal(init_std) projections, out projection normal(out_std)."""
        nn.init.normal_(self.qkv.weight, std=init_std)
        nn.init.normal_(self.out_proj.weight, std=init_std if out_std is None else out_std)
        if self.gate_proj is not None:
            nn.init.normal_(self.gate_proj.weight, std=init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:  # q.k then starts at qk_norm_scale times the plain 1/sqrt(Dh) logit
                norm.weight.fill_(self.cfg.qk_norm_scale**0.5)
        if self.out_norm is not None:
            self.out_norm.weight.fill_(1.0)
        if self.shift_proj is not None:  # gates of exactly 1/2 at init: an even mix with the previous token
            self.shift_proj.weight.zero_()
            self.shift_proj.bias.zero_()
        if self.field_proj is not None:
            # Field weights start at field_weight_std (default 0): every increment then equals c_h, the
            # field falls monotonically and an fpa head starts as exactly a FoX head with constant decay.
            std = self.cfg.field_weight_std
            if std > 0:
                nn.init.normal_(self.field_proj.weight, std=std)
            else:
                self.field_proj.weight.zero_()
            c = self.field_bias_values()
            if self.field_mode == "gate":
                c = torch.tensor([gate_bias_for_increment(float(v)) for v in c])
            self.field_proj.bias.copy_(c)

    # ------------------------------------------------------------------------------------------------
    # Public steps (the KV-cache decoder calls these directly)

    def _rope_tables(self, start: int, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        end = start + length
        if end > self.rope_cos.shape[0]:  # beyond the precomputed table (length extrapolation)
            return rope_cos_sin(torch.arange(start, end, device=device), self.head_dim, self.cfg.rope_theta)
        return self.rope_cos[start:end], self.rope_sin[start:end]

    def project(
        self, x: Tensor, pos_offset: int = 0, kv_prev: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Project x (B,T,d_model) to q, k, v (B,H,T,Dh) and field increments u (B,H,T) (None for softmax).

        pos_offset is the absolute position of x[:, 0] (used by RoPE when decoding). u is in fp32; its
        meaning depends on the field mode: a signed step (walk), a log forget gate (gate), or the field
        value itself (direct). kv_prev: with kv_shift, the raw (k, v) (B,H,Dh) of the token before x[:, 0]
        (None: the sequence starts at x[:, 0]); project_with_carry also returns the ones for the next call.
        """
        return self.project_with_carry(x, pos_offset, kv_prev)[0]

    def project_with_carry(
        self,
        x: Tensor,
        pos_offset: int = 0,
        kv_prev: tuple[Tensor, Tensor] | None = None,
        positions: Tensor | None = None,
    ) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor] | None]:
        """(project's q, k, v, u), carry: with kv_shift, carry is the raw (k, v) (B,H,Dh) of x[:, -1], the
        kv_prev of the next chunk (the KV-cache decoder keeps it per layer); None without kv_shift.
        positions (B, T): packed documents' positions inside their documents (document_mask): RoPE and
        the log-n factor use them, and a token at position 0 starts a document (its shift mixes in zeros)."""
        q, k, v = self.raw_qkv(x)
        carry = None
        if self.shift_proj is not None:
            # Shift the raw projections, before qk-norm and RoPE (as FoX-Pro does): RoPE then rotates k'_t
            # by its own position t, and a decoder carries only the last token's raw k, v.
            carry = (k[:, :, -1], v[:, :, -1])
            first = None if kv_prev is None else [kv_prev]
            k, v = self.shift_kv(x, k, v, first, None if positions is None else positions == 0)
        return self._finish_projection(x, q, k, v, pos_offset, positions), carry

    def raw_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The plain projections q, k, v (B,H,T,Dh) of x (B,T,d_model): no shift, qk-norm or RoPE."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    def shift_kv(
        self,
        x: Tensor,
        k: Tensor,
        v: Tensor,
        first: list[tuple[Tensor, Tensor] | None] | None = None,
        starts: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The key/value shift of raw k, v (B,H,T,Dh): g * k_t + (1 - g) * k_{t-1}, gates from x (B,T,d).

        The time axis holds len(first) equal chunks (default one); first[i] is the raw (k, v) (B,H,Dh) of
        the token before chunk i, None where chunk i starts the sequence (zeros, k_{-1} = v_{-1} = 0).
        A sequence-parallel rank's chunks are not adjacent in the sequence, hence one entry per chunk.
        starts (B, T) bool (document_mask): tokens that start a document, whose k_{t-1} = v_{t-1} = 0 as at
        the sequence start, so no document's keys mix in the one before it.
        """
        assert self.shift_proj is not None
        h = self.n_head
        first = first or [None]
        c = k.shape[2] // len(first)
        prev_k, prev_v = [], []
        for i, fp in enumerate(first):
            kc, vc = k[:, :, i * c : (i + 1) * c], v[:, :, i * c : (i + 1) * c]
            k0, v0 = (kc.new_zeros(kc[:, :, 0].shape), vc.new_zeros(vc[:, :, 0].shape)) if fp is None else fp
            prev_k.append(torch.cat([k0[:, :, None].to(kc.dtype), kc[:, :, :-1]], dim=2))
            prev_v.append(torch.cat([v0[:, :, None].to(vc.dtype), vc[:, :, :-1]], dim=2))
        k_prev, v_prev = torch.cat(prev_k, dim=2), torch.cat(prev_v, dim=2)
        if starts is not None:
            keep = (~starts)[:, None, :, None]
            k_prev, v_prev = k_prev * keep.to(k_prev.dtype), v_prev * keep.to(v_prev.dtype)
        g = torch.sigmoid(self.shift_proj(x)).transpose(1, 2)[..., None]  # (B, 2H, T, 1)
        gk, gv = g[:, :h], g[:, h:]
        return gk * k + (1 - gk) * k_prev, gv * v + (1 - gv) * v_prev

    def _finish_projection(
        self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos_offset: int, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """qk-norm, RoPE from pos_offset (or at the given (B, T) positions) and the field increments u of x
        (see project)."""
        t = x.shape[1]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            if positions is None:
                cos, sin = self._rope_tables(pos_offset, t, x.device)
            else:  # per row (documents restart at 0): (B, 1, T, Dh/2) tables broadcast over the heads
                top = int(positions.max()) + 1
                cos, sin = self._rope_tables(0, top, x.device)
                cos, sin = cos[positions][:, None], sin[positions][:, None]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        length = self.cfg.log_scale_length
        if length is not None and positions is not None:
            # Documents: a query sees the keys of its own document only, so the factor follows its position
            # inside the document (the same on one rank, under sequence parallelism and in the cache).
            if int(positions.max()) + 1 > length:
                f = (torch.log1p(positions.double()) / math.log(length)).clamp(min=1.0).float()
                q = q * f[:, None, :, None].to(q.dtype)
        elif length is not None and pos_offset + t > length:  # inside the training length: untouched
            q = q * log_length_factor(pos_offset, t, length, q.device).to(q.dtype)[:, None]
        u = None
        if self.field_proj is not None:
            # In fp32 whatever the model's dtype: a bf16 increment (8 mantissa bits) would put a relative
            # error of 4e-3 into every step of the field's cumsum. d_model x H weights: cheap.
            w, c = self.field_proj.weight, self.field_proj.bias
            pre = F.linear(x.float(), w.float(), c.float()).transpose(1, 2)  # (B,H,T)
            u = F.logsigmoid(pre) if self.field_mode == "gate" else pre
        return q, k, v, u

    def field_from_increments(self, u: Tensor | None, phi_prev: Tensor | None = None) -> Tensor | None:
        """The field phi (B,H,T) in fp32 from increments u (B,H,T).

        walk/gate: phi_t = phi_prev + sum_{l<=t} u_l, where phi_prev (B,H) is the field at the token before
        u[..., 0] (decode; None means the sequence starts here). direct: phi = u (phi_prev is ignored).
        softmax: None.
        """
        if u is None or self.field_mode is None:
            return None
        if self.field_mode == "direct":
            return u.float()
        phi = torch.cumsum(u.float(), dim=-1)
        if phi_prev is not None:
            phi = phi + phi_prev.float()[..., None]
        return phi

    def output(self, o: Tensor, x: Tensor) -> Tensor:
        """The optional per-head output norm of o (B,H,T,Dh), merge heads, the optional sigmoid output
        gate from x, project out."""
        b, _, t, _ = o.shape
        if self.out_norm is not None:
            o = self.out_norm(o)
        y = o.transpose(1, 2).reshape(b, t, self.d_model)
        if self.gate_proj is not None:
            y = y * torch.sigmoid(self.gate_proj(x))
        return self.out_proj(y)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, phi: Tensor | None, segment_ids: Tensor | None = None
    ) -> Tensor:
        """The attention op with this layer's kind / impl / block size (q may be shorter than k)."""
        return fpa_attention(
            q, k, v, phi, kind=self.spec, impl=self.cfg.impl, block_size=self.cfg.block_size,
            segment_ids=segment_ids, skip_epsilon=self.cfg.skip_epsilon,
        )  # fmt: skip

    def forward(self, x: Tensor, segment_ids: Tensor | None = None) -> Tensor:
        """Full-sequence causal attention: x (B,T,d_model) -> (B,T,d_model).

        segment_ids (B, T): the document of each position (model.attention.document_mask): each query
        attends only inside its document and RoPE positions restart at each document start.
        Under sequence parallelism x (B, T/W, d_model) is this rank's part of the sequence and so is the
        result; the attention op then runs across the group, and segment_ids are the whole sequence's
        (B, T), the same on every rank.
        """
        if self.sequence_parallel is not None:
            return self._forward_sequence_parallel(x, self.sequence_parallel, segment_ids)
        if segment_ids is None:
            q, k, v, u = self.project(x)
        else:
            q, k, v = self.raw_qkv(x)
            segment_ids = check_segment_ids(segment_ids, k)  # before the positions are read off them
            if self.shift_proj is not None:
                k, v = self.shift_kv(x, k, v, None, document_starts(segment_ids))
            q, k, v, u = self._finish_projection(x, q, k, v, 0, document_positions(segment_ids))
        phi = self.field_from_increments(u)
        return self.output(self.attend(q, k, v, phi, segment_ids), x)

    def _forward_sequence_parallel(
        self, x: Tensor, sp: SequenceParallel, segment_ids: Tensor | None = None
    ) -> Tensor:
        # Projections, qk-norm and the field increments are per token; RoPE needs each chunk's absolute
        # offset (a zigzag rank holds two chunks far apart). The field's cumsum happens across ranks. The
        # kv shift needs, for each chunk's first token, the raw k, v of the token before it, which another
        # rank (or this rank's other chunk) holds: one all-gather of every chunk's last raw k, v.
        ids = sp.local_chunks()
        if x.shape[1] % len(ids):
            raise ValueError(
                f"local sequence length {x.shape[1]} is not divisible by {len(ids)} ({sp.layout} layout)"
            )
        c = x.shape[1] // len(ids)
        q, k, v = self.raw_qkv(x)
        starts = pos = None
        if segment_ids is not None:
            rank, world = sp_rank_world(sp)
            want = (x.shape[0], x.shape[1] * world)
            if tuple(segment_ids.shape) != want:
                raise ValueError(
                    f"sequence-parallel segment_ids must be the whole sequence's (B, T) = {want}, the same "
                    f"on every rank; got {tuple(segment_ids.shape)}"
                )
            segment_ids = check_segment_ids(segment_ids, k, tk=want[1])
            # This rank's tokens' positions inside their documents (RoPE, log-n) and document starts (shift).
            pos = shard_sequence(document_positions(segment_ids), rank, world, dim=1, layout=sp.layout)
            starts = shard_sequence(document_starts(segment_ids), rank, world, dim=1, layout=sp.layout)
        if self.shift_proj is not None:
            tails = torch.stack(
                [torch.cat([k[:, :, e - 1], v[:, :, e - 1]], -1) for e in range(c, k.shape[2] + 1, c)]
            )
            # (n_local, B, H, 2 Dh), zeros before the sequence start. Every chunk uses its entry, chunk 0's
            # zeros too: each rank's backward must then run the gather's collective (same graph everywhere).
            prev = chunk_predecessors(tails, sp)
            d = self.head_dim
            first: list[tuple[Tensor, Tensor] | None] = [(p[..., :d], p[..., d:]) for p in prev.unbind(0)]
            k, v = self.shift_kv(x, k, v, first, starts)
        if pos is not None:  # documents: RoPE at the document positions of this rank's tokens
            q, k, v, u = self._finish_projection(x, q, k, v, 0, pos)
            o = sequence_parallel_attention(
                q, k, v, u, sp, kind=self.spec, field=self.field_mode or "walk",
                block_size=self.cfg.block_size, impl=self.cfg.impl, segment_ids=segment_ids,
                skip_epsilon=self.cfg.skip_epsilon,
            )  # fmt: skip
            return self.output(o, x)
        # RoPE and the log-n factor need each chunk's absolute positions.
        if (self.use_rope or self.cfg.log_scale_length is not None) and len(ids) > 1:
            parts = [
                self._finish_projection(xc, qc, kc, vc, i * c)
                for i, xc, qc, kc, vc in zip(ids, x.split(c, 1), q.split(c, 2), k.split(c, 2), v.split(c, 2))
            ]
            q, k, v = (torch.cat([p[j] for p in parts], dim=2) for j in range(3))
            u = None if parts[0][3] is None else torch.cat([p[3] for p in parts], dim=-1)
        else:
            q, k, v, u = self._finish_projection(x, q, k, v, ids[0] * c)
        o = sequence_parallel_attention(
            q, k, v, u, sp, kind=self.spec, field=self.field_mode or "walk", block_size=self.cfg.block_size,
            impl=self.cfg.impl, skip_epsilon=self.cfg.skip_epsilon,
        )  # fmt: skip
        return self.output(o, x)

    def extra_repr(self) -> str:
        return (
            f"kind={self.kind}, field={self.field_mode}, heads={self.n_head}, head_dim={self.head_dim}, "
            f"rope={self.use_rope}, qk_norm={self.cfg.qk_norm and self.cfg.qk_norm_gains}, "
            f"output_norm={self.cfg.output_norm}, output_gate={self.cfg.output_gate}, "
            f"kv_shift={self.cfg.kv_shift}"
        )
