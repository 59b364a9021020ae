"""Triton kernels for the FPA attention family (fpa | fox | softmax): causal, flash-style, O(T) memory.

Math (docs/design.md, "The first-passage bias"; this file's design: "The Triton kernel"):
logit_ij = scale * q_i . k_j + b_ij with
    fpa:     b_ij = min_{j <= t <= i} phi_t - phi_j
    fox:     b_ij = phi_i - phi_j
    softmax: b_ij = 0

Levels: the tiling-independent decomposition of the range-min. For a pair j < i let h be the highest bit
in which i and j differ and c = i with its bits below h cleared (the start of i's aligned 2^h segment). Then
[j, i] = [j, c) + [c, i], so
    min_{j <= t <= i} phi_t = min(SUF[h, j], PRE[h, i])
with PRE[h, t] the prefix-min of phi inside t's aligned 2^h segment and SUF[h, t] the suffix-min. The host
computes PRE and SUF for every level once per call (O(T log T) elements, `field_levels`). Ties go to the
lowest index, i.e. to the SUF side (j's half) when the two are equal.

Tiles. Query tiles of BLOCK_M rows and key tiles of BLOCK_N columns are independent powers of 2 (16..128).
Let LG = log2(max(BLOCK_M, BLOCK_N)). A key tile outside the query tile's aligned 2^LG block ("far") has one
level for all its pairs, h = highbit(m0 ^ n0), so its bias is one min of two loaded vectors; the tiles inside
that block ("near", at most 2^LG / BLOCK_N of them) take the level of each pair, LG masked passes.

Backward routing. d b_ij / d phi_t = [t = argmin over [j, i]] - [t = j]. The argmin is the lowest-index
argmin of SUF[h, j] when that side wins, else of PRE[h, i]; which side wins depends on (i, j) and phi
only, never on a tile size. So the dq kernel (which owns rows) writes ROWR[h, i] = sum of ds_ij over the
pairs of level h that PRE wins, the dk/dv kernel (which owns columns) writes COLR[h, j] for the pairs SUF
wins and DCOL[j] = sum_{i > j} ds_ij, and the host sends ROWR[h, i] to argPRE[h, i] and COLR[h, j] to
argSUF[h, j] (`route_levels`: runs of equal argmin are contiguous, so these are segmented sums). Every
buffer element has one writer: no atomics, the same field gradient whatever tiles the autotuner picks
for each kernel, and the same bits from run to run.

Ring blocks. The sequence-parallel ring (fpa_model/sequence_parallel.py) calls fpa_cross_forward /
fpa_cross_backward / fpa_diag_forward / fpa_diag_backward, with the signatures and return types of the
chunked path's blocks (natural-log lse in and out). The diagonal block is the causal op above on one chunk
(its backward fed with the merged rows' lse and delta). The cross block (a query chunk against a strictly
earlier key chunk, every pair visible, Lq != Lk allowed) has its own three kernels; P, S, their argmins
and min(P, M) come from the chunked path's scans on the host, and the host routes the kernels' per-row /
per-column ds sums to argP, argS and M with the same tie rule, so the cross block needs no atomics either.

Precision. All softmax and field math runs in fp32 and the field stays fp32. bf16/fp16 inputs feed tl.dot
in their own dtype (fp32 accumulate); fp32 inputs use TF32 tensor-core dots on GPU unless
fp32_precision="ieee" is asked for. Under the CPU interpreter everything is cast to fp32 right after the
load (bf16 math there is wrong) and dots are plain fp32.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fpa_model.ops.fpa.chunked import (
    CrossGrads,
    DiagGrads,
    cross_field,
    resolve_delta,
    route_cross_sums,
    tile_keep_map,
)
from fpa_model.ops.fpa.interpreter import install_log_step_scan
from fpa_model.ops.fpa.kinds import resolve_kind
from fpa_model.ops.fpa.naive import KINDS
from fpa_model.ops.fpa.segments import check_segment_ids
from fpa_model.ops.fpa.skipping import check_skip_epsilon

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if _INTERPRET:  # the interpreter's own scan runs element by element (fpa_model/ops/fpa/interpreter.py)
    install_log_step_scan()
_KIND_ID = {"fpa": 0, "fox": 1, "softmax": 2}
MAX_HEAD_DIM = 128
MIN_TILE, MAX_TILE = 16, 128
# Tile skipping decides per cell of SKIP_CELL x SKIP_CELL positions (the chunked path's decisions at that
# block size, chunked.tile_keep_map): every kernel tile, and every near region (2^LG), lies in one cell.
SKIP_CELL = MAX_TILE
_CELL_LG = SKIP_CELL.bit_length() - 1
_LOG2E = tl.constexpr(1.4426950408889634)


# ----------------------------------------------------------------------------------------------------
# helpers (device)
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _highbit(x):
    """floor(log2(x)) of a positive int32 scalar: the level of a far tile, x = m0 ^ n0."""
    h = (x >> 1) != 0
    h = h.to(tl.int32)
    for b in tl.static_range(2, 31):
        h += ((x >> b) != 0).to(tl.int32)
    return h


@triton.jit
def _near_field(
    PRE, SUF, T, offs_q, offs_k, q_ok, k_ok, phi_k,
    BQ: tl.constexpr, BK: tl.constexpr, LG: tl.constexpr, KEYS_ON_ROWS: tl.constexpr,
):  # fmt: skip
    """Pairs of one aligned 2^LG block, each at its own level: (range-min tile, routed-level tile).

    A pair's level is the highest bit of i ^ j: the float exponent of that integer (exact below 2^24;
    i == j gives a negative level: range-min phi_j, bias 0, no routing). The routed level is the pair's
    level where this kernel's side wins (PRE with queries on rows, SUF with keys on rows; equal values go
    to SUF, the lower indices), else -1. Tiles are (BQ, BK), or (BK, BQ) when KEYS_ON_ROWS."""
    if KEYS_ON_ROWS:
        x = offs_q[None, :] ^ offs_k[:, None]
        rmin = tl.zeros((BK, BQ), tl.float32) + phi_k[:, None]
    else:
        x = offs_q[:, None] ^ offs_k[None, :]
        rmin = tl.zeros((BQ, BK), tl.float32) + phi_k[None, :]
    lvl = (x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    mine = lvl < -1  # all False
    for h in range(LG):  # a loop, not unrolled: unrolled, the hoisted loads pushed tiles into spills
        pre = tl.load(PRE + h * T + offs_q, mask=q_ok, other=0.0)
        suf = tl.load(SUF + h * T + offs_k, mask=k_ok, other=0.0)
        if KEYS_ON_ROWS:
            pb = pre[None, :]
            sb = suf[:, None]
        else:
            pb = pre[:, None]
            sb = suf[None, :]
        at = lvl == h
        rmin = tl.where(at, tl.minimum(pb, sb), rmin)
        if KEYS_ON_ROWS:  # noqa: SIM108 (a constexpr branch)
            mine = tl.where(at, sb <= pb, mine)
        else:
            mine = tl.where(at, pb < sb, mine)
    return rmin, tl.where(mine, lvl, -1)


@triton.jit
def _level_sums(acc, ds, lvl, AXIS: tl.constexpr, LG: tl.constexpr, LGP: tl.constexpr):
    """acc[h, :] += sum of ds over AXIS where the routed level is h, for h < LG (acc is (LGP, n))."""
    ids = tl.arange(0, LGP)
    for h in range(LG):
        part = tl.sum(tl.where(lvl == h, ds, 0.0), AXIS)
        acc += tl.where(ids[:, None] == h, part[None, :], 0.0)
    return acc


@triton.jit
def _load_rows(ptr, offs, stride, offs_d, ok, d_ok, LOWP: tl.constexpr):
    """A (rows, HEAD_DIM) tile of q / k / v / do, zero outside; fp32 unless the dots run in low precision."""
    x = tl.load(ptr + offs[:, None] * stride + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    if not LOWP:
        x = x.to(tl.float32)
    return x


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr, SEGMENTED: tl.constexpr = False):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row whose document starts in a later tile has no visible key yet: keep exp2 finite (alpha, p = 0).
    if SEGMENTED:  # noqa: SIM108 (a constexpr branch)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _near_logits(
    q, k, PHI, PRE, SUF, T, phi_q, offs_m, m_ok, offs_n, n_ok, qk_scale,
    KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LG: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Base-2 logits of a near tile, queries on rows, causal and length masks applied; and (fpa) each
    pair's level where PRE wins, else -1 (the dq kernel's routing)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    lvl = tl.full((BLOCK_M, BLOCK_N), -1, tl.int32)
    if KIND == 0:
        phi_k = tl.load(PHI + offs_n, mask=n_ok, other=0.0)
        rmin, lvl = _near_field(PRE, SUF, T, offs_m, offs_n, m_ok, n_ok, phi_k, BLOCK_M, BLOCK_N, LG, False)
        s += (rmin - phi_k[None, :]) * _LOG2E
    elif KIND == 1:
        phi_k = tl.load(PHI + offs_n, mask=n_ok, other=0.0)
        s += (phi_q[:, None] - phi_k[None, :]) * _LOG2E
    return tl.where((offs_n[None, :] <= offs_m[:, None]) & n_ok[None, :], s, float("-inf")), lvl


@triton.jit
def _kept(KEEP, offset, SKIPPING: tl.constexpr):
    """Whether a far tile is computed: its cell's entry KEEP[offset] of the tile-skipping map, or always
    without the switch (no load is compiled then)."""
    if SKIPPING:
        return tl.load(KEEP + offset) != 0
    return True


@triton.jit
def _doc_mask(s, seg_rows, seg_cols):
    """Pairs in different documents get -inf (rows and columns of the tile, either way round)."""
    return tl.where(seg_rows[:, None] == seg_cols[None, :], s, float("-inf"))


@triton.jit
def _far_logits(
    q, k, PHI, PRE, SUF, T, phi_q, offs_m, m_ok, offs_n, lev, qk_scale,
    KIND: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Base-2 logits of a far tile (a whole key tile below the query tile's block, all pairs at level
    `lev`), queries on rows; and (fpa) that level's PRE of the rows and SUF of the columns."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    phi_k = tl.load(PHI + offs_n)
    pre = phi_q
    suf = phi_k
    if KIND == 0:
        pre = tl.load(PRE + lev * T + offs_m, mask=m_ok, other=0.0)
        suf = tl.load(SUF + lev * T + offs_n)
        s += (tl.minimum(pre[:, None], suf[None, :]) - phi_k[None, :]) * _LOG2E
    elif KIND == 1:
        s += (phi_q[:, None] - phi_k[None, :]) * _LOG2E
    return s, pre, suf


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_kernel(
    Q, K, V, PHI, PRE, SUF, O, LSE, SEG, DOC_START, CNT, KEEP,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    H, T, D, NLEV, T_BUCKET, NC, qk_scale,
    KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LG: tl.constexpr, LGP: tl.constexpr, LOWP: tl.constexpr, DOT_PREC: tl.constexpr,
    SEGMENTED: tl.constexpr, COUNT: tl.constexpr, SKIPPING: tl.constexpr, CELL_LG: tl.constexpr,
):  # fmt: skip
    """Output and base-2 lse of a query tile. SEGMENTED: SEG (B, T) document ids, DOC_START (B, T) the first
    position of each position's document; key tiles wholly before the first row's document are not
    visited. COUNT: CNT[0] += the key tiles visited (a debugging aid). SKIPPING: KEEP (B*H, NC, NC) uint8,
    0 for the cells whose tiles are skipped (tile skipping; only far tiles can lie in such a cell)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    ln = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < T
    d_ok = offs_d < D
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    PHI += pid_bh * T
    PRE += pid_bh * NLEV * T
    SUF += pid_bh * NLEV * T

    q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, stride_qt, offs_d, m_ok, d_ok, LOWP)
    phi_q = tl.load(PHI + offs_m, mask=m_ok, other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)

    # Near tiles first: the first one holds key d0 <= every row, so each row's running max turns finite.
    d0 = (m0 >> LG) << LG
    if SEGMENTED:
        SEG += b * T
        # Rows past T take the last row's document: they see key T - 1 and stay finite (never stored).
        seg_q = tl.load(SEG + tl.minimum(offs_m, T - 1))
        # Every row's document starts at or after the first row's: earlier key tiles are all masked.
        n_lo = (tl.load(DOC_START + b * T + m0) // BLOCK_N) * BLOCK_N
        near_lo = tl.maximum(d0, n_lo)
    else:
        n_lo = 0
        near_lo = d0
    for n0 in range(near_lo, tl.minimum(m0 + BLOCK_M, T), BLOCK_N):
        offs_n = n0 + ln
        n_ok = offs_n < T
        k = _load_rows(K, offs_n, stride_kt, offs_d, n_ok, d_ok, LOWP)
        v = _load_rows(V, offs_n, stride_vt, offs_d, n_ok, d_ok, LOWP)
        s, _lv = _near_logits(
            q, k, PHI, PRE, SUF, T, phi_q, offs_m, m_ok, offs_n, n_ok, qk_scale,
            KIND, BLOCK_M, BLOCK_N, LG, DOT_PREC,
        )  # fmt: skip
        if SEGMENTED:
            s = _doc_mask(s, seg_q, tl.load(SEG + offs_n, mask=n_ok, other=-1))
        if COUNT:
            tl.atomic_add(CNT, 1)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, DOT_PREC, SEGMENTED)

    # Far tiles: whole key tiles below the block, one level each (the levels do not depend on where the
    # loop starts, so skipping the tiles of earlier documents changes no visited tile's bias).
    if SKIPPING:
        KEEP += pid_bh * NC * NC + (m0 >> CELL_LG) * NC
    for n0 in range(n_lo, d0, BLOCK_N):
        if _kept(KEEP, n0 >> CELL_LG, SKIPPING):
            offs_n = n0 + ln
            all_n = offs_n >= 0
            k = _load_rows(K, offs_n, stride_kt, offs_d, all_n, d_ok, LOWP)
            v = _load_rows(V, offs_n, stride_vt, offs_d, all_n, d_ok, LOWP)
            lev = _highbit(m0 ^ n0)
            s, _pre, _suf = _far_logits(
                q, k, PHI, PRE, SUF, T, phi_q, offs_m, m_ok, offs_n, lev, qk_scale, KIND, DOT_PREC
            )
            if SEGMENTED:
                s = _doc_mask(s, seg_q, tl.load(SEG + offs_n))
            if COUNT:
                tl.atomic_add(CNT, 1)
            m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, DOT_PREC, SEGMENTED)

    O += b * stride_ob + h * stride_oh
    tl.store(
        O + offs_m[:, None] * stride_ot + offs_d[None, :],
        (acc / l_i[:, None]).to(O.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )
    tl.store(LSE + pid_bh * T + offs_m, m_i + tl.log2(l_i), mask=m_ok)  # base-2 log-sum-exp


# ----------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _bwd_delta_kernel(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_ot,
    stride_dob, stride_doh, stride_dot,
    H, T, D,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """delta_i = do_i . o_i in fp32 (= rowsum(P * dP)), without fp32 copies of o and do."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_m < T)[:, None] & (offs_d < D)[None, :]
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :], mask=mask)
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :], mask=mask
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh * T + offs_m, delta, mask=offs_m < T)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, PHI, PRE, SUF, DO, LSE, DELTA, DQ, DROW, ROWR, SEG, DOC_START, CNT, KEEP,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dqb, stride_dqh, stride_dqt,
    H, T, D, NLEV, T_BUCKET, NC, qk_scale, sm_scale,
    KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LG: tl.constexpr, LGP: tl.constexpr, LOWP: tl.constexpr, DOT_PREC: tl.constexpr,
    SEGMENTED: tl.constexpr, COUNT: tl.constexpr, SKIPPING: tl.constexpr, CELL_LG: tl.constexpr,
):  # fmt: skip
    """dq and the row side of the field gradient: fpa ROWR[h, i] (pairs PRE wins), fox DROW_i = sum_{j<i} ds.
    SEGMENTED / COUNT / SKIPPING as in the forward (the same key tiles are not visited or skipped; CNT[0]
    counts the visited ones)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    ln = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < T
    d_ok = offs_d < D
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    PHI += pid_bh * T
    PRE += pid_bh * NLEV * T
    SUF += pid_bh * NLEV * T
    ROWR += pid_bh * NLEV * T

    q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, stride_qt, offs_d, m_ok, d_ok, LOWP)
    do = _load_rows(DO + b * stride_dob + h * stride_doh, offs_m, stride_dot, offs_d, m_ok, d_ok, LOWP)
    # lse = +inf on rows past T makes their probabilities exactly 0 (so ds is 0 there).
    lse = tl.load(LSE + pid_bh * T + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + pid_bh * T + offs_m, mask=m_ok, other=0.0)
    phi_q = tl.load(PHI + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    drow = tl.zeros((BLOCK_M,), tl.float32)

    d0 = (m0 >> LG) << LG
    if SEGMENTED:
        SEG += b * T
        seg_q = tl.load(SEG + tl.minimum(offs_m, T - 1))  # rows past T: lse = +inf, p = 0 whatever this is
        n_lo = (tl.load(DOC_START + b * T + m0) // BLOCK_N) * BLOCK_N
        near_lo = tl.maximum(d0, n_lo)
    else:
        n_lo = 0
        near_lo = d0
    near = tl.zeros((LGP, BLOCK_M), tl.float32)  # fpa: ROWR of the levels below LG
    for n0 in range(near_lo, tl.minimum(m0 + BLOCK_M, T), BLOCK_N):
        offs_n = n0 + ln
        n_ok = offs_n < T
        k = _load_rows(K, offs_n, stride_kt, offs_d, n_ok, d_ok, LOWP)
        v = _load_rows(V, offs_n, stride_vt, offs_d, n_ok, d_ok, LOWP)
        s, lvl = _near_logits(
            q, k, PHI, PRE, SUF, T, phi_q, offs_m, m_ok, offs_n, n_ok, qk_scale,
            KIND, BLOCK_M, BLOCK_N, LG, DOT_PREC,
        )  # fmt: skip
        if SEGMENTED:
            s = _doc_mask(s, seg_q, tl.load(SEG + offs_n, mask=n_ok, other=-1))
        if COUNT:
            tl.atomic_add(CNT, 1)
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
        if KIND == 0:
            near = _level_sums(near, ds, lvl, 1, LG, LGP)
        elif KIND == 1:
            drow += tl.sum(tl.where(offs_n[None, :] < offs_m[:, None], ds, 0.0), 1)
    if KIND == 0:
        ids = tl.arange(0, LGP)
        tl.store(ROWR + ids[:, None] * T + offs_m[None, :], near, mask=(ids < LG)[:, None] & m_ok[None, :])

    # Far tiles, ascending: the level never rises, so each level's row sums are complete when it changes
    # (starting past the skipped tiles only leaves their levels' sums at zero, as nothing reaches them).
    cur = tl.full((BLOCK_M,), -1, tl.int32)  # the level being summed (a vector: scalar masks don't broadcast)
    racc = tl.zeros((BLOCK_M,), tl.float32)
    if SKIPPING:
        KEEP += pid_bh * NC * NC + (m0 >> CELL_LG) * NC
    for n0 in range(n_lo, d0, BLOCK_N):
        lev = _highbit(m0 ^ n0)
        if KIND == 0:  # level bookkeeping on every tile, skipped or not
            tl.store(ROWR + tl.maximum(cur, 0) * T + offs_m, racc, mask=m_ok & (cur != lev) & (cur >= 0))
            racc = tl.where(cur != lev, 0.0, racc)
            cur = tl.zeros_like(cur) + lev
        if _kept(KEEP, n0 >> CELL_LG, SKIPPING):
            offs_n = n0 + ln
            all_n = offs_n >= 0
            k = _load_rows(K, offs_n, stride_kt, offs_d, all_n, d_ok, LOWP)
            v = _load_rows(V, offs_n, stride_vt, offs_d, all_n, d_ok, LOWP)
            s, pre, suf = _far_logits(
                q, k, PHI, PRE, SUF, T, phi_q, offs_m, m_ok, offs_n, lev, qk_scale, KIND, DOT_PREC
            )
            if SEGMENTED:
                s = _doc_mask(s, seg_q, tl.load(SEG + offs_n))
            if COUNT:
                tl.atomic_add(CNT, 1)
            p = tl.exp2(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
            if KIND == 0:
                racc += tl.sum(tl.where(pre[:, None] < suf[None, :], ds, 0.0), 1)
            elif KIND == 1:
                drow += tl.sum(ds, 1)
    if KIND == 0:
        tl.store(ROWR + tl.maximum(cur, 0) * T + offs_m, racc, mask=m_ok & (cur >= 0))

    DQ += b * stride_dqb + h * stride_dqh
    tl.store(
        DQ + offs_m[:, None] * stride_dqt + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )
    if KIND == 1:
        tl.store(DROW + pid_bh * T + offs_m, drow, mask=m_ok)


@triton.jit
def _bwd_dkv_kernel(
    Q, K, V, PHI, PRE, SUF, DO, LSE, DELTA, DK, DV, DCOL, COLR, SEG, DOC_END, CNT, KEEP,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dkb, stride_dkh, stride_dkt,
    stride_dvb, stride_dvh, stride_dvt,
    H, T, D, NLEV, T_BUCKET, NC, qk_scale, sm_scale,
    KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LG: tl.constexpr, LGP: tl.constexpr, LOWP: tl.constexpr, DOT_PREC: tl.constexpr,
    SEGMENTED: tl.constexpr, COUNT: tl.constexpr, SKIPPING: tl.constexpr, CELL_LG: tl.constexpr,
):  # fmt: skip
    """dk, dv and the column side of the field gradient, computed as K.Q^T tiles (keys on rows, so P and dS
    feed the dv and dk dots untransposed): DCOL_j = sum_{i > j} ds_ij, fpa COLR[h, j] (pairs SUF wins).
    SEGMENTED: SEG (B, T) document ids, DOC_END (B, T) one past each position's document; query tiles
    wholly after the last key's document are not visited. COUNT: CNT[0] += the query tiles visited.
    SKIPPING: KEEP as in the forward (the same cells skipped)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    lm = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    n_ok = offs_n < T
    d_ok = offs_d < D
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_dob + h * stride_doh
    PHI += pid_bh * T
    LSE += pid_bh * T
    DELTA += pid_bh * T
    PRE += pid_bh * NLEV * T
    SUF += pid_bh * NLEV * T
    COLR += pid_bh * NLEV * T

    k = _load_rows(K + b * stride_kb + h * stride_kh, offs_n, stride_kt, offs_d, n_ok, d_ok, LOWP)
    v = _load_rows(V + b * stride_vb + h * stride_vh, offs_n, stride_vt, offs_d, n_ok, d_ok, LOWP)
    phi_k = tl.load(PHI + offs_n, mask=n_ok, other=0.0)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    col = tl.zeros((BLOCK_N,), tl.float32)

    d0 = (n0 >> LG) << LG
    near = tl.zeros((LGP, BLOCK_N), tl.float32)  # fpa: COLR of the levels below LG
    first = d0 + ((n0 - d0) // BLOCK_M) * BLOCK_M  # the first query tile that reaches key n0
    # Large K / V tiles (64 x 128 and up): no loop-invariant code motion out of the query loops. Hoisted,
    # the shared-memory operand addresses of the dots (on Hopper the wgmma descriptors of K, V, Q and dO,
    # several per 16-wide step of the head dim) stay live in about 40 registers across the loops, which
    # spilled the 64-key tiles at head dim 128; recomputed per query tile they cost a few integer adds.
    # Smaller tiles keep the hoisting (without it ptxas spilled 16 x 64 at head dim 64 on sm_80).
    no_licm: tl.constexpr = HEAD_DIM * BLOCK_N >= 128 * 64
    if SEGMENTED:
        SEG += b * T
        seg_k = tl.load(SEG + tl.minimum(offs_n, T - 1))  # keys past T: masked by causality anyway
        # Every key's document ends at or before the last key's: later query tiles are all masked.
        m_hi = tl.minimum(T, tl.load(DOC_END + b * T + tl.minimum(n0 + BLOCK_N, T) - 1))
        near_hi = tl.minimum(d0 + (1 << LG), m_hi)
    else:
        m_hi = T
        near_hi = tl.minimum(d0 + (1 << LG), T)
    for m0 in tl.range(first, near_hi, BLOCK_M, disable_licm=no_licm):
        offs_m = m0 + lm
        m_ok = offs_m < T
        q = _load_rows(Q, offs_m, stride_qt, offs_d, m_ok, d_ok, LOWP)
        do = _load_rows(DO, offs_m, stride_dot, offs_d, m_ok, d_ok, LOWP)
        lse = tl.load(LSE + offs_m, mask=m_ok, other=float("inf"))
        delta = tl.load(DELTA + offs_m, mask=m_ok, other=0.0)
        st = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale
        if KIND == 0:
            rmin, lvl = _near_field(
                PRE, SUF, T, offs_m, offs_n, m_ok, n_ok, phi_k, BLOCK_M, BLOCK_N, LG, True
            )
            st += (rmin - phi_k[:, None]) * _LOG2E
        elif KIND == 1:
            phi_q = tl.load(PHI + offs_m, mask=m_ok, other=0.0)
            st += (phi_q[None, :] - phi_k[:, None]) * _LOG2E
        st = tl.where(offs_n[:, None] <= offs_m[None, :], st, float("-inf"))
        if SEGMENTED:
            st = _doc_mask(st, seg_k, tl.load(SEG + offs_m, mask=m_ok, other=-1))
        if COUNT:
            tl.atomic_add(CNT, 1)
        pt = tl.exp2(st - lse[None, :])
        dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PREC)
        dst = pt * (tl.dot(v, tl.trans(do), input_precision=DOT_PREC) - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PREC)
        if KIND != 2:
            col += tl.sum(tl.where(offs_n[:, None] < offs_m[None, :], dst, 0.0), 1)
        if KIND == 0:
            near = _level_sums(near, dst, lvl, 1, LG, LGP)
    if KIND == 0:
        ids = tl.arange(0, LGP)
        tl.store(COLR + ids[:, None] * T + offs_n[None, :], near, mask=(ids < LG)[:, None] & n_ok[None, :])

    # Far query tiles, ascending: the level never falls, so each level's column sums are complete when it
    # changes (stopping before the tiles of later documents leaves their levels' sums at zero).
    cur = tl.full((BLOCK_N,), -1, tl.int32)  # the level being summed (a vector: scalar masks don't broadcast)
    cacc = tl.zeros((BLOCK_N,), tl.float32)
    if SKIPPING:
        KEEP += pid_bh * NC * NC + (n0 >> CELL_LG)
    for m0 in tl.range(d0 + (1 << LG), m_hi, BLOCK_M, disable_licm=no_licm):
        if KIND == 0:  # level bookkeeping on every tile, skipped or not
            lev = _highbit(m0 ^ n0)
            tl.store(COLR + tl.maximum(cur, 0) * T + offs_n, cacc, mask=n_ok & (cur != lev) & (cur >= 0))
            cacc = tl.where(cur != lev, 0.0, cacc)
            cur = tl.zeros_like(cur) + lev
        if _kept(KEEP, (m0 >> CELL_LG) * NC, SKIPPING):
            offs_m = m0 + lm
            m_ok = offs_m < T
            q = _load_rows(Q, offs_m, stride_qt, offs_d, m_ok, d_ok, LOWP)
            do = _load_rows(DO, offs_m, stride_dot, offs_d, m_ok, d_ok, LOWP)
            lse = tl.load(LSE + offs_m, mask=m_ok, other=float("inf"))
            delta = tl.load(DELTA + offs_m, mask=m_ok, other=0.0)
            st = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale
            if KIND == 0:
                pre = tl.load(PRE + lev * T + offs_m, mask=m_ok, other=0.0)
                suf = tl.load(SUF + lev * T + offs_n, mask=n_ok, other=0.0)
                st += (tl.minimum(suf[:, None], pre[None, :]) - phi_k[:, None]) * _LOG2E
            elif KIND == 1:
                phi_q = tl.load(PHI + offs_m, mask=m_ok, other=0.0)
                st += (phi_q[None, :] - phi_k[:, None]) * _LOG2E
            if SEGMENTED:
                st = _doc_mask(st, seg_k, tl.load(SEG + offs_m, mask=m_ok, other=-1))
            if COUNT:
                tl.atomic_add(CNT, 1)
            pt = tl.exp2(st - lse[None, :])
            dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PREC)
            dst = pt * (tl.dot(v, tl.trans(do), input_precision=DOT_PREC) - delta[None, :])
            dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PREC)
            if KIND != 2:
                col += tl.sum(dst, 1)
            if KIND == 0:
                cacc += tl.sum(tl.where(suf[:, None] <= pre[None, :], dst, 0.0), 1)
    if KIND == 0:
        tl.store(COLR + tl.maximum(cur, 0) * T + offs_n, cacc, mask=n_ok & (cur >= 0))

    DK += b * stride_dkb + h * stride_dkh
    DV += b * stride_dvb + h * stride_dvh
    tl.store(
        DK + offs_n[:, None] * stride_dkt + offs_d[None, :],
        (dk * sm_scale).to(DK.dtype.element_ty),
        mask=n_ok[:, None] & d_ok[None, :],
    )
    tl.store(
        DV + offs_n[:, None] * stride_dvt + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=n_ok[:, None] & d_ok[None, :],
    )
    if KIND != 2:
        tl.store(DCOL + pid_bh * T + offs_n, col, mask=n_ok)


# ----------------------------------------------------------------------------------------------------
# field levels and routing: one program per (batch x head, level), chunked segmented scans
# ----------------------------------------------------------------------------------------------------
# A chunk is scanned in one direction by loading it in that order (t ascending, or t descending for
# suffixes), so every scan is a forward scan whose flag marks the element that starts a new segment.


@triton.jit
def _seg_min(a, fa, b, fb):
    return tl.where(fb != 0, b, tl.minimum(a, b)), fa | fb


@triton.jit
def _seg_sum(a, fa, b, fb):
    return tl.where(fb != 0, b, a + b), fa | fb


@triton.jit
def _last(x, BLOCK: tl.constexpr):
    """The last element of a (BLOCK,) vector in scan order, as a scalar."""
    return tl.max(tl.where(tl.arange(0, BLOCK) == BLOCK - 1, x, float("-inf")), 0)


@triton.jit
def _levels_kernel(PHI, PRE, SUF, T, NLEV, BLOCK: tl.constexpr):
    """PRE[h, t] = min of phi from the start of t's aligned 2^h segment to t; SUF[h, t] = from t to its end."""
    bh = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    low = (1 << h) - 1  # t & low == 0: a segment starts at t; == low: one ends at t
    PHI += bh * T
    PRE += (bh * NLEV + h) * T
    SUF += (bh * NLEV + h) * T
    ids = tl.arange(0, BLOCK)
    carry = tl.max(tl.full((BLOCK,), float("inf"), tl.float32), 0)
    for c0 in range(0, T, BLOCK):  # prefixes: t ascending
        t = c0 + ids
        x = tl.load(PHI + t, mask=t < T, other=float("inf"))
        v, f = tl.associative_scan((x, ((t & low) == 0).to(tl.int32)), 0, _seg_min)
        v = tl.where(f != 0, v, tl.minimum(v, carry))
        tl.store(PRE + t, v, mask=t < T)
        carry = _last(v, BLOCK)
    carry = tl.max(tl.full((BLOCK,), float("inf"), tl.float32), 0)
    for c0 in range(0, T, BLOCK):  # suffixes: t descending (padding past T is +inf: it changes no min)
        t = T - 1 - c0 - ids
        x = tl.load(PHI + t, mask=t >= 0, other=float("inf"))
        v, f = tl.associative_scan((x, ((t & low) == low).to(tl.int32)), 0, _seg_min)
        v = tl.where(f != 0, v, tl.minimum(v, carry))
        tl.store(SUF + t, v, mask=t >= 0)
        carry = _last(v, BLOCK)


@triton.jit
def _route_kernel(PHI, PRE, SUF, ROWR, COLR, OUT_ROW, OUT_COL, T, NLEV, BLOCK: tl.constexpr):
    """OUT_ROW[h, t] = ROWR[h] summed over the rows whose lowest PRE argmin is t (the run from a head t, where
    the prefix-min strictly falls or a segment starts, to the next head); OUT_COL[h, t] = COLR[h] summed over
    the columns whose lowest SUF argmin is t (the run after the previous tail up to a tail t, SUF == phi).
    Two outputs: the two passes visit t in opposite orders, so neither reads what the other wrote."""
    bh = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    low = (1 << h) - 1
    base = (bh * NLEV + h) * T
    PHI += bh * T
    PRE += base
    SUF += base
    ROWR += base
    COLR += base
    OUT_ROW += base
    OUT_COL += base
    ids = tl.arange(0, BLOCK)
    # Rows, t descending: the run of head t is t .. next head - 1, so t+1 being a head starts a new sum.
    carry = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)
    for c0 in range(0, T, BLOCK):
        t = T - 1 - c0 - ids
        ok = t >= 0
        pre = tl.load(PRE + t, mask=ok, other=float("inf"))
        head = ((t & low) == 0) | (pre < tl.load(PRE + t - 1, mask=t >= 1, other=float("inf")))
        nxt = t + 1
        nxt_pre = tl.load(PRE + nxt, mask=(nxt < T) & ok, other=float("inf"))
        nxt_head = (nxt >= T) | ((nxt & low) == 0) | (nxt_pre < pre)
        r = tl.load(ROWR + t, mask=ok, other=0.0)
        acc, f = tl.associative_scan((r, nxt_head.to(tl.int32)), 0, _seg_sum)
        acc = tl.where(f != 0, acc, acc + carry)
        tl.store(OUT_ROW + t, tl.where(head, acc, 0.0), mask=ok)
        carry = _last(acc, BLOCK)
    # Columns, t ascending: the run of tail t is previous tail + 1 .. t, so t-1 being a tail starts one.
    carry = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)
    for c0 in range(0, T, BLOCK):
        t = c0 + ids
        ok = t < T
        tail = tl.load(SUF + t, mask=ok, other=0.0) == tl.load(PHI + t, mask=ok, other=1.0)
        prv = t - 1
        prv_tail = (prv < 0) | (
            tl.load(SUF + prv, mask=(prv >= 0) & ok, other=0.0)
            == tl.load(PHI + prv, mask=(prv >= 0) & ok, other=1.0)
        )
        c = tl.load(COLR + t, mask=ok, other=0.0)
        acc, f = tl.associative_scan((c, prv_tail.to(tl.int32)), 0, _seg_sum)
        acc = tl.where(f != 0, acc, acc + carry)
        tl.store(OUT_COL + t, tl.where(tail, acc, 0.0), mask=ok)
        carry = _last(acc, BLOCK)


# ----------------------------------------------------------------------------------------------------
# cross blocks (sequence-parallel ring): a query chunk against a strictly earlier key chunk
# ----------------------------------------------------------------------------------------------------
# Every pair is visible, so there is no causal mask and no near tile; query and key chunks may have
# different lengths (LQ, LK), masked at the ends. The field terms come from the host, per query row
# ROW_i (fpa: min(P_i, M); fox: phi_i) and per key column SMIN_j (fpa: S_j) and PHI_K_j, so the kernels
# need no scans. The backward kernels emit ds sums split by which term won (the tie rule of
# chunked._route_cross: S wins ties against the row term): per row and per column, whatever the tiles.
# The host routes them to argP / argS / M with chunked.route_cross_sums, the chunked path's own routing.


@triton.jit
def _cross_logits(q, k, row_q, s_min, phi_k, n_ok, qk_scale, KIND: tl.constexpr, DOT_PREC: tl.constexpr):
    """Base-2 logits of a cross tile (queries on rows); padded key columns get -inf."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if KIND == 0:
        s += (tl.minimum(row_q[:, None], s_min[None, :]) - phi_k[None, :]) * _LOG2E
    elif KIND == 1:
        s += (row_q[:, None] - phi_k[None, :]) * _LOG2E
    return tl.where(n_ok[None, :], s, float("-inf"))


@triton.jit
def _cross_fwd_kernel(
    Q, K, V, ROW, SMIN, PHI_K, O, LSE,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    H, LQ, LK, D, LQ_BUCKET, LK_BUCKET, qk_scale,
    KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LOWP: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ln = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < LQ
    d_ok = offs_d < D
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    SMIN += pid_bh * LK
    PHI_K += pid_bh * LK

    q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, stride_qt, offs_d, m_ok, d_ok, LOWP)
    row_q = tl.load(ROW + pid_bh * LQ + offs_m, mask=m_ok, other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for n0 in range(0, LK, BLOCK_N):  # every key tile holds at least one real column: m_i turns finite
        offs_n = n0 + ln
        n_ok = offs_n < LK
        k = _load_rows(K, offs_n, stride_kt, offs_d, n_ok, d_ok, LOWP)
        v = _load_rows(V, offs_n, stride_vt, offs_d, n_ok, d_ok, LOWP)
        s_min = tl.load(SMIN + offs_n, mask=n_ok, other=0.0)
        phi_k = tl.load(PHI_K + offs_n, mask=n_ok, other=0.0)
        s = _cross_logits(q, k, row_q, s_min, phi_k, n_ok, qk_scale, KIND, DOT_PREC)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, DOT_PREC)

    O += b * stride_ob + h * stride_oh
    tl.store(
        O + offs_m[:, None] * stride_ot + offs_d[None, :],
        (acc / l_i[:, None]).to(O.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )
    tl.store(LSE + pid_bh * LQ + offs_m, m_i + tl.log2(l_i), mask=m_ok)  # base-2 log-sum-exp


@triton.jit
def _cross_bwd_dq_kernel(
    Q, K, V, ROW, SMIN, PHI_K, DO, LSE, DELTA, DQ, DROW,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dqb, stride_dqh, stride_dqt,
    H, LQ, LK, D, LQ_BUCKET, LK_BUCKET, qk_scale, sm_scale,
    KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LOWP: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """dq and DROW_i = sum_j ds_ij over the keys where the row term wins (fpa) or over all keys (fox)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ln = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < LQ
    d_ok = offs_d < D
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    SMIN += pid_bh * LK
    PHI_K += pid_bh * LK

    q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, stride_qt, offs_d, m_ok, d_ok, LOWP)
    do = _load_rows(DO + b * stride_dob + h * stride_doh, offs_m, stride_dot, offs_d, m_ok, d_ok, LOWP)
    row_q = tl.load(ROW + pid_bh * LQ + offs_m, mask=m_ok, other=0.0)
    # lse = +inf on rows past LQ makes their probabilities exactly 0 (so ds is 0 there).
    lse = tl.load(LSE + pid_bh * LQ + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + pid_bh * LQ + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    drow = tl.zeros((BLOCK_M,), tl.float32)
    for n0 in range(0, LK, BLOCK_N):
        offs_n = n0 + ln
        n_ok = offs_n < LK
        k = _load_rows(K, offs_n, stride_kt, offs_d, n_ok, d_ok, LOWP)
        v = _load_rows(V, offs_n, stride_vt, offs_d, n_ok, d_ok, LOWP)
        s_min = tl.load(SMIN + offs_n, mask=n_ok, other=0.0)
        phi_k = tl.load(PHI_K + offs_n, mask=n_ok, other=0.0)
        s = _cross_logits(q, k, row_q, s_min, phi_k, n_ok, qk_scale, KIND, DOT_PREC)
        p = tl.exp2(s - lse[:, None])
        ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT_PREC) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
        if KIND == 0:
            drow += tl.sum(tl.where(s_min[None, :] <= row_q[:, None], 0.0, ds), 1)  # S wins ties
        elif KIND == 1:
            drow += tl.sum(ds, 1)

    DQ += b * stride_dqb + h * stride_dqh
    tl.store(
        DQ + offs_m[:, None] * stride_dqt + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )
    if KIND != 2:
        tl.store(DROW + pid_bh * LQ + offs_m, drow, mask=m_ok)


@triton.jit
def _cross_bwd_dkv_kernel(
    Q, K, V, ROW, SMIN, PHI_K, DO, LSE, DELTA, DK, DV, DCOL_S, DCOL_ALL,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dkb, stride_dkh, stride_dkt,
    stride_dvb, stride_dvh, stride_dvt,
    H, LQ, LK, D, LQ_BUCKET, LK_BUCKET, qk_scale, sm_scale,
    KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LOWP: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """dk, dv, DCOL_ALL_j = sum_i ds_ij and (fpa) DCOL_S_j = the part of it where S_j wins; K.Q^T tiles."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    lm = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    n_ok = offs_n < LK
    d_ok = offs_d < D
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_dob + h * stride_doh
    ROW += pid_bh * LQ
    LSE += pid_bh * LQ
    DELTA += pid_bh * LQ

    k = _load_rows(K + b * stride_kb + h * stride_kh, offs_n, stride_kt, offs_d, n_ok, d_ok, LOWP)
    v = _load_rows(V + b * stride_vb + h * stride_vh, offs_n, stride_vt, offs_d, n_ok, d_ok, LOWP)
    s_min = tl.load(SMIN + pid_bh * LK + offs_n, mask=n_ok, other=0.0)
    phi_k = tl.load(PHI_K + pid_bh * LK + offs_n, mask=n_ok, other=0.0)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    col_all = tl.zeros((BLOCK_N,), tl.float32)
    col_s = tl.zeros((BLOCK_N,), tl.float32)
    for m0 in range(0, LQ, BLOCK_M):
        offs_m = m0 + lm
        m_ok = offs_m < LQ
        q = _load_rows(Q, offs_m, stride_qt, offs_d, m_ok, d_ok, LOWP)
        do = _load_rows(DO, offs_m, stride_dot, offs_d, m_ok, d_ok, LOWP)
        row_q = tl.load(ROW + offs_m, mask=m_ok, other=0.0)
        lse = tl.load(LSE + offs_m, mask=m_ok, other=float("inf"))
        delta = tl.load(DELTA + offs_m, mask=m_ok, other=0.0)
        st = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale
        if KIND == 0:
            st += (tl.minimum(s_min[:, None], row_q[None, :]) - phi_k[:, None]) * _LOG2E
        elif KIND == 1:
            st += (row_q[None, :] - phi_k[:, None]) * _LOG2E
        pt = tl.exp2(st - lse[None, :])
        dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PREC)
        dst = pt * (tl.dot(v, tl.trans(do), input_precision=DOT_PREC) - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PREC)
        if KIND != 2:
            col_all += tl.sum(dst, 1)
        if KIND == 0:
            col_s += tl.sum(tl.where(s_min[:, None] <= row_q[None, :], dst, 0.0), 1)

    DK += b * stride_dkb + h * stride_dkh
    DV += b * stride_dvb + h * stride_dvh
    tl.store(
        DK + offs_n[:, None] * stride_dkt + offs_d[None, :],
        (dk * sm_scale).to(DK.dtype.element_ty),
        mask=n_ok[:, None] & d_ok[None, :],
    )
    tl.store(
        DV + offs_n[:, None] * stride_dvt + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=n_ok[:, None] & d_ok[None, :],
    )
    if KIND != 2:
        tl.store(DCOL_ALL + pid_bh * LK + offs_n, col_all, mask=n_ok)
    if KIND == 0:
        tl.store(DCOL_S + pid_bh * LK + offs_n, col_s, mask=n_ok)


# ----------------------------------------------------------------------------------------------------
# tiles and autotuning
# ----------------------------------------------------------------------------------------------------


class Tile(NamedTuple):
    """One launch configuration: query rows, key columns (powers of 2 in [16, 128]), warps, stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


# The GPU autotune lists (Hopper / Ampere), per head-dim bucket (64: D <= 64, 128: D <= 128). 64- and
# 128-row tiles on the side that is the MMA's M (queries in fwd / dq, keys in dk/dv) so Hopper's warpgroup
# MMA applies. docs/kernel_resources.md has the registers, spills and shared memory of every entry compiled
# for sm_90 and sm_80 with Triton 3.9 and 3.6 (bench/kernel_resources.py): no entry spills plain or with
# tile skipping (SKIPPING); with segment ids (SEGMENTED) fwd 128 x 64 spills (16-136 B, most on sm_80
# under Triton 3.6) and a few others 8-24 B. The causal dk/dv kernel spilled with 64 key rows at D = 128
# until its query loops stopped hoisting the K / V operand addresses (disable_licm); 16 x 64 now fits on
# both GPUs under both Tritons and leads its list. dq keeps a 64-row tile at 1 stage.
# The routing does not depend on the tiles, so each kernel may pick any entry of its list.
GPU_TILES_BY_DIM: dict[str, dict[int, list[Tile]]] = {
    "fwd": {64: [Tile(128, 64, 8, 2), Tile(128, 64, 8, 3), Tile(64, 32, 4, 3)], 128: [Tile(128, 32, 8, 2)]},
    "dq": {
        64: [Tile(64, 32, 4, 2), Tile(64, 16, 4, 2), Tile(128, 32, 8, 2)],
        128: [Tile(64, 16, 8, 1), Tile(32, 16, 8, 2)],
    },
    "dkv": {
        64: [Tile(16, 64, 8, 2), Tile(16, 128, 8, 1), Tile(16, 64, 4, 1), Tile(32, 64, 8, 2)],
        128: [Tile(16, 64, 8, 2), Tile(16, 32, 8, 2), Tile(16, 32, 4, 2)],
    },
    "cross_fwd": {
        64: [Tile(128, 64, 8, 2), Tile(128, 64, 8, 3), Tile(64, 32, 4, 3)],
        128: [Tile(64, 32, 4, 3), Tile(64, 64, 8, 2)],
    },
    "cross_dq": {64: [Tile(64, 32, 4, 2), Tile(64, 16, 4, 2)], 128: [Tile(64, 16, 8, 2), Tile(64, 32, 8, 2)]},
    "cross_dkv": {
        64: [Tile(16, 64, 8, 2), Tile(16, 128, 8, 1), Tile(16, 64, 4, 1), Tile(32, 64, 8, 2)],
        128: [Tile(16, 64, 8, 2)],
    },
}
# Every tile a kernel's autotuner may try (the union over head dims).
GPU_TILES: dict[str, list[Tile]] = {
    name: list(dict.fromkeys(t for tiles in by_dim.values() for t in tiles))
    for name, by_dim in GPU_TILES_BY_DIM.items()
}
# Multi-config autotune fails under the interpreter: one config per kernel there.
_INTERPRET_TILES = {name: [Tile(32, 32, 4, 1)] for name in GPU_TILES}
KERNEL_NAMES = tuple(GPU_TILES)


def _levels_below(tile: Tile) -> int:
    return max(tile.block_m, tile.block_n).bit_length() - 1


def _meta(tile: Tile, kernel) -> dict:
    """The constexpr tile parameters of `kernel` for `tile` (near-tile level counts where it has them)."""
    meta = {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n}
    if "LG" in kernel.arg_names:
        lg = _levels_below(tile)
        meta.update(LG=lg, LGP=triton.next_power_of_2(lg))
    return meta


def _dim_bucket(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128


def _tuned(kernel, name: str, key: list[str]):
    tiles = _INTERPRET_TILES[name] if _INTERPRET else GPU_TILES[name]
    configs = [triton.Config(_meta(t, kernel), num_warps=t.num_warps, num_stages=t.num_stages) for t in tiles]
    by_dim = GPU_TILES_BY_DIM[name]

    def prune(configs, named_args, **kwargs):
        """Only the head dim's own list: the other bucket's tiles spill or waste registers here."""
        keep = by_dim[_dim_bucket(kwargs["HEAD_DIM"])]
        chosen = [c for c in configs if Tile(**_tile_of(c)) in keep]
        return chosen or configs

    return triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": prune})(kernel)


def _tile_of(config: triton.Config) -> dict:
    kw = config.kwargs
    return {
        "block_m": kw["BLOCK_M"],
        "block_n": kw["BLOCK_N"],
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }


# Lengths enter the key as powers of 2, so an eval sweep over lengths tunes once per octave. No kernel
# accumulates into its outputs, so the tuner's repeated launches need no reset.
_KEY = ["T_BUCKET", "HEAD_DIM", "KIND", "LOWP", "DOT_PREC", "SEGMENTED", "SKIPPING"]
_CROSS_KEY = ["LQ_BUCKET", "LK_BUCKET", "HEAD_DIM", "KIND", "LOWP", "DOT_PREC"]
# name -> (raw kernel, autotuned kernel, the block that counts the programs)
_KERNELS = {
    "fwd": (_fwd_kernel, _tuned(_fwd_kernel, "fwd", _KEY), "BLOCK_M"),
    "dq": (_bwd_dq_kernel, _tuned(_bwd_dq_kernel, "dq", _KEY), "BLOCK_M"),
    "dkv": (_bwd_dkv_kernel, _tuned(_bwd_dkv_kernel, "dkv", _KEY), "BLOCK_N"),
    "cross_fwd": (_cross_fwd_kernel, _tuned(_cross_fwd_kernel, "cross_fwd", _CROSS_KEY), "BLOCK_M"),
    "cross_dq": (_cross_bwd_dq_kernel, _tuned(_cross_bwd_dq_kernel, "cross_dq", _CROSS_KEY), "BLOCK_M"),
    "cross_dkv": (_cross_bwd_dkv_kernel, _tuned(_cross_bwd_dkv_kernel, "cross_dkv", _CROSS_KEY), "BLOCK_N"),
}


def _check_tile(tile: Tile, where: str) -> None:
    for name, n in (("block_m", tile.block_m), ("block_n", tile.block_n)):
        if not MIN_TILE <= n <= MAX_TILE or n & (n - 1):
            raise ValueError(f"{where}: {name} must be a power of 2 in [{MIN_TILE}, {MAX_TILE}], got {n}")


TileSpec = Tile | tuple[int, ...]


def _resolve_tiles(block_size: int | None, tiles: Mapping[str, TileSpec] | None) -> dict[str, Tile]:
    """Pinned tiles per kernel name: block_size square tiles everywhere, then `tiles` per kernel."""
    out: dict[str, Tile] = {}
    if block_size is not None:
        _check_tile(Tile(block_size, block_size), "block_size")
        out = {name: Tile(block_size, block_size) for name in KERNEL_NAMES}
    for name, spec in (tiles or {}).items():
        if name not in KERNEL_NAMES:
            raise ValueError(f"unknown kernel {name!r} in tiles; expected some of {KERNEL_NAMES}")
        tile = Tile(*spec)
        _check_tile(tile, f"tiles[{name!r}]")
        out[name] = tile
    return out


# ----------------------------------------------------------------------------------------------------
# host side: field levels and routing
# ----------------------------------------------------------------------------------------------------

_LN2 = math.log(2.0)


def n_levels(t: int) -> int:
    """Levels the kernels index: every highest differing bit of two positions < t, and every near-tile level."""
    return max((t - 1).bit_length(), _levels_below(Tile(MAX_TILE, MAX_TILE)))


SCAN_BLOCK = 1024  # positions per chunk of the level and routing scans (tests shrink it to cross chunks)


def _scan_block(t: int) -> int:
    return min(SCAN_BLOCK, max(16, triton.next_power_of_2(t)))


def field_levels(phi: torch.Tensor, nlev: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(PRE, SUF), each (N, nlev, T) float32, from phi (N, T) float32 contiguous: PRE[:, h, t] = min of phi
    from the start of t's aligned 2^h segment to t, SUF[:, h, t] = min of phi from t to the end of that
    segment. One launch, one program per (row, level)."""
    n, t = phi.shape
    pre = phi.new_empty((n, nlev, t))
    suf = phi.new_empty((n, nlev, t))
    _levels_kernel[(n, nlev)](phi, pre, suf, t, nlev, BLOCK=_scan_block(t))
    return pre, suf


def route_levels(
    phi: torch.Tensor, pre: torch.Tensor, suf: torch.Tensor, row_r: torch.Tensor, col_r: torch.Tensor
) -> torch.Tensor:
    """sum over levels h of ROWR[h, i] sent to the lowest argmin of PRE[h, i] and COLR[h, j] to that of
    SUF[h, j], as an (N, T) float32 field gradient.

    In each aligned segment the prefix argmin only moves forward and changes at a strict new minimum (a
    head); the suffix argmin of j is the first t >= j with SUF == phi_t (a tail). So the rows that route
    to a head form the run up to the next head, the columns that route to a tail the run after the
    previous tail: segmented sums in one launch (a program per row and level, no atomics), then a sum over
    the levels."""
    n, nlev, t = pre.shape
    out_row, out_col = torch.empty_like(pre), torch.empty_like(pre)
    _route_kernel[(n, nlev)](phi, pre, suf, row_r, col_r, out_row, out_col, t, nlev, BLOCK=_scan_block(t))
    return out_row.sum(1) + out_col.sum(1)


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


_FP32_PRECISIONS = ("tf32", "ieee")
# fp32 inputs on GPU: TF32 tensor-core dots unless a call (or FPA_FP32_PRECISION=ieee) asks for IEEE fp32.
FP32_PRECISION = os.environ.get("FPA_FP32_PRECISION", "tf32")


class _Docs(NamedTuple):
    """Packed documents of a (B, T) window as the kernels read them, each (B, T) int32 contiguous."""

    seg: torch.Tensor  # the document's index in its row: 0, 0, 1, 1, 1, 2, ...
    start: torch.Tensor  # the first position of the document
    end: torch.Tensor  # one past its last position


def document_layout(segment_ids: torch.Tensor, k: torch.Tensor) -> _Docs:
    """The kernels' tables of segment ids (B, T) for keys k (B, H, T, D), after segments.check_segment_ids
    (integer, (B, T), on k's device, non-decreasing). Ids are renumbered 0, 1, ... per row (only equality
    matters), so any integer range fits int32."""
    ids = check_segment_ids(segment_ids, k)
    b, t = ids.shape
    step = ids.diff(dim=1)
    new_doc = torch.ones((b, t), dtype=torch.bool, device=ids.device)
    new_doc[:, 1:] = step != 0
    last = torch.ones((b, t), dtype=torch.bool, device=ids.device)
    last[:, :-1] = step != 0
    pos = torch.arange(t, dtype=torch.int32, device=ids.device).expand(b, t)
    seg = new_doc.to(torch.int32).cumsum(1, dtype=torch.int32) - 1
    start = torch.where(new_doc, pos, 0).cummax(1).values
    end = torch.where(last, pos + 1, t).flip(1).cummin(1).values.flip(1)
    return _Docs(*(x.to(torch.int32).contiguous() for x in (seg, start, end)))


# Slots of a tile counter: the (query tile, key tile) pairs each kernel visits.
COUNTER_SLOTS = {"fwd": 0, "dq": 1, "dkv": 2}


def visited_tiles(name: str, tile: TileSpec, t: int, segment_ids: torch.Tensor | None = None) -> int:
    """The (query tile, key tile) pairs kernel `name` ("fwd", "dq" or "dkv") visits on one (batch row, head)
    of T positions with `tile` (block_m, block_n, ...), segment_ids (T,) of that row or None: the host mirror
    of the kernels' loop bounds, what their tile counter counts. fwd / dq start each query tile's key loop at
    the key tile holding its first row's document start; dk/dv end each key tile's query loop at its last
    key's document end."""
    tile = Tile(*tile)
    bm, bn = tile.block_m, tile.block_n
    span = 1 << _levels_below(tile)
    if segment_ids is None:
        start, end = [0] * t, [t] * t
    else:
        ids = segment_ids.tolist()
        start = [0] * t
        for i in range(1, t):
            start[i] = start[i - 1] if ids[i] == ids[i - 1] else i
        end = [t] * t
        for i in range(t - 2, -1, -1):
            end[i] = end[i + 1] if ids[i] == ids[i + 1] else i + 1
    count = 0
    if name in ("fwd", "dq"):
        for m0 in range(0, t, bm):
            d0 = m0 // span * span
            n_lo = start[m0] // bn * bn
            count += len(range(max(d0, n_lo), min(m0 + bm, t), bn)) + len(range(n_lo, d0, bn))
    elif name == "dkv":
        for n0 in range(0, t, bn):
            d0 = n0 // span * span
            first = d0 + (n0 - d0) // bm * bm
            m_hi = end[min(n0 + bn, t) - 1]
            count += len(range(first, min(d0 + span, m_hi), bm)) + len(range(d0 + span, m_hi, bm))
    else:
        raise ValueError(f"visited_tiles counts the kernels {tuple(COUNTER_SLOTS)}, not {name!r}")
    return count


class _Launch:
    """Per-call constants shared by the kernels of one op, the pinned tiles (if any), the packed documents
    (None: every causal pair is visible), the debugging tile counter (None: off) and the tile-skipping
    map shared by the forward, dq and dk/dv kernels (chunked.tile_keep_map at SKIP_CELL; None: off)."""

    def __init__(
        self,
        q: torch.Tensor,
        kind: str,
        scale: float,
        tiles: dict[str, Tile],
        fp32_precision: str | None = None,
        docs: _Docs | None = None,
        counter: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ):
        fp32_precision = fp32_precision or FP32_PRECISION
        if fp32_precision not in _FP32_PRECISIONS:
            raise ValueError(f"fp32_precision must be one of {_FP32_PRECISIONS}, got {fp32_precision!r}")
        self.B, self.H, self.T, self.D = q.shape
        self.kind_id = _KIND_ID[kind]
        self.scale = scale
        self.tiles = tiles
        self.head_dim = max(16, triton.next_power_of_2(self.D))  # tl.dot needs >= 16
        # Low-precision tensor-core dots on GPU; the interpreter computes everything in fp32.
        self.lowp = q.dtype in (torch.bfloat16, torch.float16) and not _INTERPRET
        prec = "ieee" if _INTERPRET else ("tf32" if self.lowp else fp32_precision)
        self.meta = {"KIND": self.kind_id, "HEAD_DIM": self.head_dim, "LOWP": self.lowp, "DOT_PREC": prec}
        self.docs = docs
        self.counter = counter
        self.keep = keep
        self.n_cells = triton.cdiv(self.T, SKIP_CELL)

    def switch_args(self, name: str, table: str, dummy: torch.Tensor) -> tuple:
        """(SEG, DOC_START or DOC_END, CNT, KEEP) of kernel `name` and its SEGMENTED / COUNT / SKIPPING
        switches; `dummy` stands in for the unused pointers (never read when the switch is off)."""
        d = self.docs
        cnt = dummy if self.counter is None else self.counter[COUNTER_SLOTS[name] :]
        ptrs = (dummy, dummy) if d is None else (d.seg, getattr(d, table))
        keep = dummy if self.keep is None else self.keep
        switches = {
            "SEGMENTED": d is not None,
            "COUNT": self.counter is not None,
            "SKIPPING": self.keep is not None,
            "CELL_LG": _CELL_LG,
        }
        return (*ptrs, cnt, keep), switches

    def run(self, name: str, *args, length: int, switches: Mapping[str, bool] | None = None) -> None:
        """Launch kernel `name` with one program per tile of `length` rows or columns and per (b, h)."""
        raw, tuned, counted = _KERNELS[name]
        tile = self.tiles.get(name)
        extra = dict(switches or {})
        if tile is None:
            grid = lambda meta: (triton.cdiv(length, meta[counted]), self.B * self.H)  # noqa: E731
            tuned[grid](*args, **self.meta, **extra)
        else:
            meta = _meta(tile, raw)
            grid = (triton.cdiv(length, meta[counted]), self.B * self.H)
            raw[grid](
                *args, **meta, num_warps=tile.num_warps, num_stages=tile.num_stages, **self.meta, **extra
            )


def _bucket(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi32: torch.Tensor,
    lc: _Launch,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in out_dtype (default q's), base-2 lse in float32) of the causal op."""
    B, H, T, D = q.shape
    nlev = n_levels(T)
    pre, suf = field_levels(phi32.view(B * H, T), nlev) if lc.kind_id == 0 else (phi32, phi32)
    o = torch.empty((B, H, T, D), dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    docs, switches = lc.switch_args("fwd", "start", lse)
    lc.run(
        "fwd",
        q, k, v, phi32, pre, suf, o, lse, *docs,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        H, T, D, nlev, _bucket(T), lc.n_cells, lc.scale * _LOG2E.value,
        length=T, switches=switches,
    )  # fmt: skip
    return o, lse


def _delta_of(o: torch.Tensor, do: torch.Tensor, lc: _Launch) -> torch.Tensor:
    """delta = rowsum(do * o) in float32 (B, H, T)."""
    B, H, T, D = o.shape
    delta = torch.empty((B, H, T), dtype=torch.float32, device=o.device)
    _bwd_delta_kernel[(triton.cdiv(T, 64), B * H)](
        o, do, delta, *_strides(o), *_strides(do), H, T, D, HEAD_DIM=lc.head_dim, BLOCK=64
    )
    return delta


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi32: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    lc: _Launch,
    *,
    o: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of the causal op from the base-2 lse and delta = rowsum(do * o) (given, or from o).

    With lse and delta of longer rows (a ring's merged attention) this is the chunk's share of them:
    the flash backward only ever uses p = exp(logit - lse) and delta. Grads in grad_dtype (default:
    the inputs' dtypes); dphi float32, None for softmax."""
    B, H, T, D = q.shape
    if delta is None:
        delta = _delta_of(o, do, lc)
    f32 = {"dtype": torch.float32, "device": q.device}
    dq = torch.empty((B, H, T, D), dtype=grad_dtype or q.dtype, device=q.device)
    dk = torch.empty((B, H, T, D), dtype=grad_dtype or k.dtype, device=q.device)
    dv = torch.empty((B, H, T, D), dtype=grad_dtype or v.dtype, device=q.device)
    is_fpa = lc.kind_id == 0
    nlev = n_levels(T)
    phi_n = phi32.view(B * H, T)
    pre, suf = field_levels(phi_n, nlev) if is_fpa else (phi32, phi32)
    # fpa: level sums, zero where a level has no pairs (only visited levels are stored); fox: row sums.
    row_r = torch.zeros((B * H, nlev, T), **f32) if is_fpa else torch.empty((B, H, T), **f32)
    col_r = torch.zeros((B * H, nlev, T), **f32) if is_fpa else row_r
    dcol = torch.empty((B, H, T), **f32)
    common = (H, T, D, nlev, _bucket(T), lc.n_cells, lc.scale * _LOG2E.value, lc.scale)
    docs, switches = lc.switch_args("dq", "start", dcol)
    lc.run(
        "dq",
        q, k, v, phi32, pre, suf, do, lse, delta, dq, row_r, row_r, *docs,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
        *common,
        length=T, switches=switches,
    )  # fmt: skip
    docs, switches = lc.switch_args("dkv", "end", dcol)
    lc.run(
        "dkv",
        q, k, v, phi32, pre, suf, do, lse, delta, dk, dv, dcol, col_r, *docs,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
        *common,
        length=T, switches=switches,
    )  # fmt: skip
    if lc.kind_id == _KIND_ID["softmax"]:
        return dq, dk, dv, None
    if not is_fpa:  # fox: +phi_i for every pair, -phi_j
        return dq, dk, dv, row_r - dcol
    return dq, dk, dv, route_levels(phi_n, pre, suf, row_r, col_r).view(B, H, T) - dcol


class _FPATritonFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, phi, lc: _Launch):  # type: ignore[override]
        phi32 = phi.detach().float().contiguous()
        o, lse = _forward(q, k, v, phi32, lc)
        ctx.save_for_backward(q, k, v, phi32, o, lse)
        ctx.lc = lc
        ctx.phi_dtype = phi.dtype
        return o

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        q, k, v, phi32, o, lse = ctx.saved_tensors
        dq, dk, dv, dphi = _backward(q, k, v, phi32, lse, _last_dim_contiguous(do), ctx.lc, o=o)
        dphi = dphi.to(ctx.phi_dtype) if dphi is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dphi, None


def _check_runnable(q: torch.Tensor, what: str) -> None:
    if not q.is_cuda and not _INTERPRET:
        raise RuntimeError(
            f"{what} needs CUDA tensors, or TRITON_INTERPRET=1 set before "
            "fpa_model.ops.fpa.triton_kernel is imported (CPU interpreter)"
        )


def _check_counter(counter: torch.Tensor, pinned: Mapping[str, Tile], device: torch.device) -> None:
    if not isinstance(counter, torch.Tensor) or counter.shape != (3,) or counter.dtype != torch.int32:
        raise ValueError("tile_counter must be an int32 tensor of shape (3,) (fwd, dq, dkv)")
    if counter.device != device:
        raise ValueError(f"tile_counter must be on {device} like q, got {counter.device}")
    unpinned = [name for name in COUNTER_SLOTS if name not in pinned]
    if unpinned:
        raise ValueError(f"tile_counter needs pinned tiles (block_size or tiles) for {unpinned}")


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the causal kernel cannot serve these inputs (None when it can): what impl="auto" falls back on."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        return (
            f"needs q, k, v of shape (B, H, T, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[2] != q.shape[2]:
        return f"needs Tq == Tk (training / prefill); got Tq={q.shape[2]}, Tk={k.shape[2]}"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"needs one dtype of fp32/bf16/fp16 for q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}"
    return None


def fpa_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None = None,
    *,
    kind: str = "fpa",
    scale: float | None = None,
    block_size: int | None = None,
    tiles: Mapping[str, TileSpec] | None = None,
    fp32_precision: str | None = None,
    segment_ids: torch.Tensor | None = None,
    tile_counter: torch.Tensor | None = None,
    skip_epsilon: float | None = None,
) -> torch.Tensor:
    """Causal FPA / FoX / softmax attention with the Triton kernels (differentiable in q, k, v and phi).

    q, k, v: (B, H, T, D), same dtype (fp32, bf16 or fp16), D <= 128; phi: (B, H, T), the field at every
    position (None only for kind="softmax"). Queries and keys cover the same T positions.
    segment_ids: (B, T) integer document ids, non-decreasing along T (packed documents): key j is visible
    to query i only when both lie in one document; tiles wholly outside the query's document are never
    visited. The bias of a visible pair is unchanged (its range [j, i] lies inside the document). None:
    every causal pair is visible (the kernels compiled without the document switch).
    tile_counter: a debugging aid, an int32 tensor of 3 zeros on q's device; the forward, dq and dk/dv
    kernels add the (query tile, key tile) pairs they visit to slots 0, 1, 2 (COUNTER_SLOTS). Needs pinned
    tiles (an autotuner's trial launches would count too).
    Tiles are autotuned per kernel from GPU_TILES unless pinned: block_size (a power of 2 in [16, 128])
    pins square tiles on every kernel, tiles={"fwd": (64, 32), "dq": (128, 64, 8, 2), ...} pins Tile
    values per kernel. fp32_precision: "tf32" (tensor cores) or "ieee" for fp32 inputs on GPU; default
    FP32_PRECISION (tf32 unless the environment sets FPA_FP32_PRECISION=ieee).
    skip_epsilon: tile skipping (fpa_model/ops/fpa/skipping.py: each row loses < skip_epsilon of its softmax
    mass). The decisions are made once per call on SKIP_CELL x SKIP_CELL cells, as the chunked path makes
    them at block_size SKIP_CELL, and the three kernels skip every tile of a skipped cell, so they skip the
    same pairs whatever tiles they run; skipped tiles are not counted by tile_counter. fpa and fox (softmax
    has no field: nothing is skipped); None: off, the kernels as compiled without it.
    Runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before this module loaded.
    """
    q, k, v, phi, lc = _prepare(
        q, k, v, phi, kind, scale, block_size, tiles, fp32_precision, segment_ids, tile_counter,
        skip_epsilon, count=True,
    )  # fmt: skip
    return _FPATritonFunction.apply(q, k, v, phi, lc)


def triton_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None,
    kind: str,
    scale: float | None,
    segment_ids: torch.Tensor | None,
    skip_epsilon: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, base-2 lse (B, H, T) float32) of fpa_attention_triton (autotuned tiles) without autograd,
    for the torch.library op (fpa_model.ops.fpa.library)."""
    q, k, v, phi, lc = _prepare(
        q, k, v, phi, kind, scale, None, None, None, segment_ids, None, skip_epsilon, count=True
    )
    return _forward(q, k, v, phi.detach().float().contiguous(), lc)


def triton_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None,
    o: torch.Tensor,
    lse: torch.Tensor,
    kind: str,
    scale: float | None,
    segment_ids: torch.Tensor | None,
    skip_epsilon: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq, dk, dv, dphi in phi's dtype; None for softmax) from triton_forward's out and lse (the same
    skip_epsilon: the skipping map is made again from the same inputs, so the same tiles are skipped)."""
    q, k, v, phi_in, lc = _prepare(
        q, k, v, phi, kind, scale, None, None, None, segment_ids, None, skip_epsilon
    )
    phi32 = phi_in.detach().float().contiguous()
    dq, dk, dv, dphi = _backward(q, k, v, phi32, lse, _last_dim_contiguous(do), lc, o=o)
    if phi is not None and dphi is not None:
        dphi = dphi.to(phi.dtype)
    return dq, dk, dv, None if phi is None else dphi


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None,
    kind: str,
    scale: float | None,
    block_size: int | None,
    tiles: Mapping[str, TileSpec] | None,
    fp32_precision: str | None,
    segment_ids: torch.Tensor | None,
    tile_counter: torch.Tensor | None,
    skip_epsilon: float | None = None,
    count: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, _Launch]:
    """Checked inputs (unit last stride; phi zeros for softmax without one) and the launch settings
    (count: add the skipping map's kept and skipped cross cells to skipping.skip_counts)."""
    if kind not in KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; expected one of {KINDS}")
    if q.dim() != 4:
        raise ValueError(f"q must be (B, H, T, D), got shape {tuple(q.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[:2] != q.shape[:2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in B, H or D")
    if k.shape[2] != q.shape[2]:
        raise ValueError(
            f"the Triton kernel needs Tq == Tk (training / prefill); got Tq={q.shape[2]}, Tk={k.shape[2]}: "
            "use the chunked or naive path for decode"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"q, k, v must share one dtype of fp32/bf16/fp16; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    B, H, T, D = q.shape
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dim {D} > {MAX_HEAD_DIM} is not supported by the Triton kernel")
    if T == 0:
        raise ValueError("empty sequence (T == 0)")
    if phi is None:
        if kind != "softmax":
            raise ValueError(f"kind {kind!r} needs a field phi")
        phi = torch.zeros((B, H, T), dtype=torch.float32, device=q.device)
    if tuple(phi.shape) != (B, H, T):
        raise ValueError(f"phi must be (B, H, T) = {(B, H, T)}, got {tuple(phi.shape)}")
    _check_runnable(q, "fpa_attention_triton")
    pinned = _resolve_tiles(block_size, tiles)
    docs = None if segment_ids is None else document_layout(segment_ids, k)
    if tile_counter is not None:
        _check_counter(tile_counter, pinned, q.device)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    keep = None
    eps = check_skip_epsilon(skip_epsilon)
    spec = resolve_kind(kind)
    if eps is not None and spec.has_field:
        seg = None if segment_ids is None else check_segment_ids(segment_ids, k)
        keep = tile_keep_map(q, k, phi, spec, scale, SKIP_CELL, eps, seg, count=count).contiguous()
    lc = _Launch(q, kind, scale, pinned, fp32_precision, docs, tile_counter, keep)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    return q, k, v, phi, lc


# ----------------------------------------------------------------------------------------------------
# Block functions for the sequence-parallel ring: the signatures and return types of chunked.py's
# fpa_cross_forward / fpa_diag_forward / fpa_cross_backward / fpa_diag_backward (see its docstring),
# plus optional block_size / tiles (as fpa_attention_triton's; None autotunes). Natural-log lse in and out.
# Any leading dims "..." (flattened to (N, 1) unless they are (B, H), so the ring's chunk views of
# (B, H, T, D) tensors go in without a copy); q, k, v one dtype of fp32/bf16/fp16, k and v the same shape,
# D <= 128. Outputs and gradients are float32, like the chunked blocks for these dtypes.
# ----------------------------------------------------------------------------------------------------


def _as4d(x: torch.Tensor) -> torch.Tensor:
    """(..., L, D) -> (B, H, L, D) with a unit last stride: (B, H) kept when there are two leading dims."""
    x = _last_dim_contiguous(x)
    return x if x.dim() == 4 else x.reshape(-1, 1, *x.shape[-2:])


def _check_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; expected one of {KINDS}")
    if q.dim() < 2 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"the Triton blocks need q (..., Lq, D) and k, v (..., Lk, D) with equal leading dims and D; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"q, k, v must share one dtype of fp32/bf16/fp16; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head dim {q.shape[-1]} > {MAX_HEAD_DIM} is not supported by the Triton kernel")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"empty block: Lq={q.shape[-2]}, Lk={k.shape[-2]}")
    _check_runnable(q, "the Triton attention blocks")


def _scale_of(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _vec32(x: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """A per-position float32 vector (..., L) as a dense (n, L) tensor (kernels index it by pid * L)."""
    return x.detach().to(torch.float32).reshape(n, length).contiguous()


class _CrossField(NamedTuple):
    """The host-side field terms of a cross block, each (N, L) float32 (argmins int64, local)."""

    row: torch.Tensor  # per query: fpa min(P_i, M); fox phi_q; softmax 0
    s_min: torch.Tensor  # per key: fpa S_j (else phi_k, unused)
    phi_k: torch.Tensor  # per key: phi_k (softmax 0)
    p_min: torch.Tensor | None = None
    arg_p: torch.Tensor | None = None
    arg_s: torch.Tensor | None = None
    m: torch.Tensor | None = None  # (N,)


def _cross_field(
    kind: str,
    phi_q: torch.Tensor | None,
    phi_k: torch.Tensor | None,
    m_between: torch.Tensor | float | None,
    lead: torch.Size,
    lq: int,
    lk: int,
    device: torch.device,
) -> _CrossField:
    n = math.prod(lead)
    if kind == "softmax":
        zq = torch.zeros((n, lq), dtype=torch.float32, device=device)
        zk = torch.zeros((n, lk), dtype=torch.float32, device=device)
        return _CrossField(zq, zk, zk)
    if phi_q is None or phi_k is None:
        raise ValueError(f"kind {kind!r} needs phi_q and phi_k")
    pq, pk = _vec32(phi_q, n, lq), _vec32(phi_k, n, lk)
    if kind == "fox":
        return _CrossField(pq, pk, pk)
    # The chunked path's terms: the same values and the same lowest-index argmins.
    row, s_min, arg_s, p_min, arg_p, m = cross_field(kind, pq.view(*lead, lq), pk.view(*lead, lk), m_between)
    return _CrossField(row, s_min, pk, p_min, arg_p, arg_s, m)


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
    block_size: int | None = None,
    tiles: Mapping[str, TileSpec] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a query chunk against a strictly earlier key chunk (chunked.fpa_cross_forward)."""
    _check_block(q, k, v, kind)
    lead, lq, lk, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    q4, k4, v4 = _as4d(q), _as4d(k), _as4d(v)
    fld = _cross_field(kind, phi_q, phi_k, m_between, lead, lq, lk, q.device)
    lc = _Launch(q4, kind, _scale_of(q, scale), _resolve_tiles(block_size, tiles))
    B, H = q4.shape[:2]
    o = torch.empty((B, H, lq, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, H, lq), dtype=torch.float32, device=q.device)
    lc.run(
        "cross_fwd",
        q4, k4, v4, fld.row, fld.s_min, fld.phi_k, o, lse,
        *_strides(q4), *_strides(k4), *_strides(v4), *_strides(o),
        H, lq, lk, d, _bucket(lq), _bucket(lk), lc.scale * _LOG2E.value,
        length=lq,
    )  # fmt: skip
    return o.reshape(*lead, lq, d), lse.mul_(_LN2).reshape(*lead, lq)


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
    block_size: int | None = None,
    tiles: Mapping[str, TileSpec] | None = None,
) -> CrossGrads:
    """Gradients of a cross block given the full rows' lse and out (or delta) (chunked.fpa_cross_backward).

    The kernels return ds sums per query row (where the row term min(P, M) wins) and per key column
    (all, and where S wins); chunked.route_cross_sums routes them to argP, argS and M (S wins ties
    against the row term, M wins ties against P), as it does for the chunked blocks."""
    _check_block(q, k, v, kind)
    lead, lq, lk, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    q4, k4, v4, do4 = _as4d(q), _as4d(k), _as4d(v), _as4d(dout)
    B, H = q4.shape[:2]
    n = B * H
    fld = _cross_field(kind, phi_q, phi_k, m_between, lead, lq, lk, q.device)
    lc = _Launch(q4, kind, _scale_of(q, scale), _resolve_tiles(block_size, tiles))
    lse2 = _vec32(lse, n, lq) * _LOG2E.value  # not in place: it may be the caller's tensor
    dlt = _vec32(resolve_delta(dout, out, delta), n, lq)
    f32 = {"dtype": torch.float32, "device": q.device}
    dq, dk, dv = (
        torch.empty((B, H, lq, d), **f32),
        torch.empty((B, H, lk, d), **f32),
        torch.empty((B, H, lk, d), **f32),
    )
    drow = torch.zeros((n, lq), **f32)  # stored only for fpa / fox
    col_all, col_s = torch.zeros((n, lk), **f32), torch.zeros((n, lk), **f32)
    common = (H, lq, lk, d, _bucket(lq), _bucket(lk), lc.scale * _LOG2E.value, lc.scale)
    operands = (q4, k4, v4, fld.row, fld.s_min, fld.phi_k, do4, lse2, dlt)
    in_strides = (*_strides(q4), *_strides(k4), *_strides(v4), *_strides(do4))
    lc.run(
        "cross_dq",
        *operands, dq, drow, *in_strides, *_strides(dq), *common,
        length=lq,
    )  # fmt: skip
    lc.run(
        "cross_dkv",
        *operands, dk, dv, col_s, col_all, *in_strides, *_strides(dk), *_strides(dv), *common,
        length=lk,
    )  # fmt: skip
    if kind == "fpa":
        dphi_q, dphi_k, dm = route_cross_sums(drow, col_s, col_all, fld.arg_s, fld.p_min, fld.arg_p, fld.m)
    else:  # fox: +phi_i, -phi_j; softmax: all zero
        dphi_q, dphi_k, dm = drow, col_all.neg_(), torch.zeros(n, **f32)
    return CrossGrads(
        dq.reshape(*lead, lq, d),
        dk.reshape(*lead, lk, d),
        dv.reshape(*lead, lk, d),
        dphi_q.reshape(*lead, lq),
        dphi_k.reshape(*lead, lk),
        dm.reshape(lead),
    )


def _diag_inputs(q, k, v, phi, kind):
    _check_block(q, k, v, kind)
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"the Triton diagonal block needs Lq == Lk (a whole chunk against itself); got Lq={q.shape[-2]}, "
            f"Lk={k.shape[-2]}"
        )
    if phi is None and kind != "softmax":
        raise ValueError(f"kind {kind!r} needs a field phi")
    q4, k4, v4 = _as4d(q), _as4d(k), _as4d(v)
    B, H, L = q4.shape[:3]
    if phi is None or kind == "softmax":
        phi32 = torch.zeros((B, H, L), dtype=torch.float32, device=q.device)
    else:
        phi32 = _vec32(phi, B * H, L).view(B, H, L)
    return q4, k4, v4, phi32


def fpa_diag_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None,
    *,
    kind: str,
    scale: float | None = None,
    block_size: int | None = None,
    tiles: Mapping[str, TileSpec] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a chunk against itself, causal, Lq == Lk (chunked.fpa_diag_forward): the causal op."""
    q4, k4, v4, phi32 = _diag_inputs(q, k, v, phi, kind)
    lc = _Launch(q4, kind, _scale_of(q, scale), _resolve_tiles(block_size, tiles))
    o, lse2 = _forward(q4, k4, v4, phi32, lc, out_dtype=torch.float32)
    return o.reshape(q.shape), lse2.mul_(_LN2).reshape(q.shape[:-1])


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
    block_size: int | None = None,
    tiles: Mapping[str, TileSpec] | None = None,
) -> DiagGrads:
    """Gradients of a causal diagonal block given the full rows' lse and out (or delta): the causal op's
    backward kernels fed with them (chunked.fpa_diag_backward)."""
    q4, k4, v4, phi32 = _diag_inputs(q, k, v, phi, kind)
    B, H, L = q4.shape[:3]
    lc = _Launch(q4, kind, _scale_of(q, scale), _resolve_tiles(block_size, tiles))
    lse2 = (_vec32(lse, B * H, L) * _LOG2E.value).view(B, H, L)
    dlt = _vec32(resolve_delta(dout, out, delta), B * H, L).view(B, H, L)
    dq, dk, dv, dphi = _backward(
        q4, k4, v4, phi32, lse2, _as4d(dout), lc, delta=dlt, grad_dtype=torch.float32
    )
    if dphi is None:
        dphi = torch.zeros_like(phi32)
    return DiagGrads(
        dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dphi.reshape(k.shape[:-1])
    )


__all__ = [
    "COUNTER_SLOTS",
    "GPU_TILES",
    "GPU_TILES_BY_DIM",
    "KERNEL_NAMES",
    "MAX_HEAD_DIM",
    "Tile",
    "document_layout",
    "fpa_attention_triton",
    "fpa_cross_backward",
    "fpa_cross_forward",
    "fpa_diag_backward",
    "fpa_diag_forward",
    "unsupported_reason",
    "visited_tiles",
]
