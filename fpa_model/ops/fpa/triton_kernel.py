"""Triton kernels for the FPA attention family (fpa | fox | softmax): causal, flash-style, O(T) memory.

Math (shared/design/FPA.md): logit_ij = scale * q_i . k_j + b_ij with
    fpa:     b_ij = min_{j <= t <= i} phi_t - phi_j
    fox:     b_ij = phi_i - phi_j
    softmax: b_ij = 0

Tiling. Queries and keys share one block size BLOCK (a power of 2), so query block qb and key block qb
cover the same positions. For a key block kb < qb the range-min splits into three parts,
    min(P_i, S_j, M) with P_i = prefix-min of the query block up to i, S_j = suffix-min of the key block
    from j, M = min of the blocks strictly between,
and M is one running scalar while the key blocks are visited from the diagonal downwards. On the
diagonal tile the range-min is built level by level: a pair (i, j), j < i, whose local indices have
their highest differing bit at h is split at the start c of i's aligned 2^h segment, so min[j, i] = min(suffix-min of j's
2^h segment from j, prefix-min of i's 2^h segment up to i). That is log2(BLOCK) tile passes instead of
BLOCK, and each pass knows which position holds the minimum.

Backward. d b_ij / d phi_t = [t = argmin over [j, i]] - [t = j], ties to the LOWEST index (the rule the
chunked path shares). ds_ij is routed to the argmin: prefix-min (per query, in the dq kernel), suffix-min
(per key, in the dk/dv kernel), the between-blocks minimum M (one scalar per tile, flushed with an atomic
add only when the running argmin moves) and the diagonal tile (dq kernel). The -[t = j] term is the
column sum of ds (dk/dv kernel). Each kernel owns the positions it stores, so everything except the
M route is deterministic (on GPU the M-route atomics may change the last bits of d phi from run to
run). Nothing of size T x T is stored; the forward keeps only the log-sum-exp.

Ring blocks. The sequence-parallel ring (fpa_model/context_parallel.py) calls fpa_cross_forward /
fpa_cross_backward / fpa_diag_forward / fpa_diag_backward, with the signatures and return types of the
chunked path's blocks (natural-log lse in and out). The diagonal block is the causal op above on one chunk
(its backward fed with the merged rows' lse and delta). The cross block (a query chunk against a strictly
earlier key chunk, every pair visible, Lq != Lk allowed) has its own three kernels; P, S, their argmins
and min(P, M) come from the chunked path's scans on the host, and the host routes the kernels' per-row /
per-column ds sums to argP, argS and M with the same tie rule, so the cross block needs no atomics.

All math runs in fp32. On GPU, bf16/fp16 inputs feed tl.dot in their own dtype (fp32 accumulate) and fp32
inputs use IEEE fp32 dots (no TF32); under the CPU interpreter everything is cast to fp32 right after the load (bf16 math there is wrong).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fpa_model.ops.fpa.chunked import CrossGrads, DiagGrads, cross_field, resolve_delta, route_cross_sums
from fpa_model.ops.fpa.naive import KINDS

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_KIND_ID = {"fpa": 0, "fox": 1, "softmax": 2}
MAX_HEAD_DIM = 128
_LOG2E = tl.constexpr(1.4426950408889634)


# ----------------------------------------------------------------------------------------------------
# helpers (device)
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _argmin_combine(v1, i1, v2, i2):
    # Lexicographic (value, index) min: commutative, so forward and reverse scans both pick the
    # lowest index among equal minima.
    take1 = (v1 < v2) | ((v1 == v2) & (i1 < i2))
    return tl.where(take1, v1, v2), tl.where(take1, i1, i2)


@triton.jit
def _seg_minscan(phi, idx, SEG: tl.constexpr, BLOCK: tl.constexpr):
    """Prefix and suffix (min, argmin) of phi inside aligned segments of SEG elements."""
    v2 = tl.reshape(phi, (BLOCK // SEG, SEG))
    i2 = tl.reshape(idx, (BLOCK // SEG, SEG))
    pv, pi = tl.associative_scan((v2, i2), 1, _argmin_combine)
    sv, si = tl.associative_scan((v2, i2), 1, _argmin_combine, reverse=True)
    return (
        tl.reshape(pv, (BLOCK,)),
        tl.reshape(pi, (BLOCK,)),
        tl.reshape(sv, (BLOCK,)),
        tl.reshape(si, (BLOCK,)),
    )


@triton.jit
def _diag_range_min(phi, BLOCK: tl.constexpr, LOG_B: tl.constexpr):
    """(BLOCK, BLOCK) tile of min_{j <= t <= i} phi_t for a diagonal tile (rows i, columns j, j <= i)."""
    li = tl.arange(0, BLOCK)
    rmin = tl.zeros((BLOCK, BLOCK), tl.float32) + phi[None, :]  # i == j: the key itself
    for h in tl.static_range(LOG_B):
        if h == 0:
            pv = phi
            sv = phi
        else:
            pv, _pi, sv, _si = _seg_minscan(phi, li, 1 << h, BLOCK)
        # Ascending h overwrites, so each pair ends at its highest differing bit.
        split = (li[:, None] >> h) != (li[None, :] >> h)
        rmin = tl.where(split, tl.minimum(pv[:, None], sv[None, :]), rmin)
    return rmin


@triton.jit
def _route(vals, targets, BLOCK: tl.constexpr):
    """out[t] = sum_i vals[i] * [targets[i] == t] for local targets in [0, BLOCK)."""
    t = tl.arange(0, BLOCK)
    return tl.sum(tl.where(targets[:, None] == t[None, :], vals[:, None], 0.0), 0)


@triton.jit
def _diag_dphi(phi, ds, BLOCK: tl.constexpr, LOG_B: tl.constexpr):
    """Field gradient of a diagonal tile, argmin part only: sum_ij ds_ij [t = argmin over [j, i]]."""
    li = tl.arange(0, BLOCK)
    eye = li[:, None] == li[None, :]
    dloc = tl.sum(tl.where(eye, ds, 0.0), 1)  # b_ii: the minimum over [i, i] sits at i
    for h in tl.static_range(LOG_B):
        if h == 0:
            pv = phi
            pi = li
            sv = phi
            si = li
        else:
            pv, pi, sv, si = _seg_minscan(phi, li, 1 << h, BLOCK)
        level = ((li[:, None] >> h) != (li[None, :] >> h)) & (
            (li[:, None] >> (h + 1)) == (li[None, :] >> (h + 1))
        )
        s_wins = sv[None, :] <= pv[:, None]  # tie: the key side holds the lower index
        dloc += _route(tl.sum(tl.where(level & s_wins, ds, 0.0), 0), si, BLOCK)
        dloc += _route(tl.sum(tl.where(level & (~s_wins), ds, 0.0), 1), pi, BLOCK)
    return dloc


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _fwd_kernel(
    Q, K, V, PHI, O, LSE,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    H, T, D, qk_scale,
    KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, LOG_B: tl.constexpr,
    LOWP: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    m0 = pid_m * BLOCK
    li = tl.arange(0, BLOCK)
    offs_m = m0 + li
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < T
    d_ok = offs_d < D
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    PHI += pid_bh * T

    q = tl.load(
        Q + offs_m[:, None] * stride_qt + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0
    )
    if not LOWP:
        q = q.to(tl.float32)
    phi_q = tl.load(PHI + offs_m, mask=m_ok, other=0.0)

    m_i = tl.full((BLOCK,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK,), tl.float32)
    acc = tl.zeros((BLOCK, HEAD_DIM), tl.float32)

    # Diagonal tile first: every valid row gets a finite running max before the off-diagonal tiles.
    kv_mask = m_ok[:, None] & d_ok[None, :]
    k = tl.load(K + offs_m[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + offs_m[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
    if not LOWP:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if KIND == 0:
        s += (_diag_range_min(phi_q, BLOCK, LOG_B) - phi_q[None, :]) * _LOG2E
    elif KIND == 1:
        s += (phi_q[:, None] - phi_q[None, :]) * _LOG2E
    causal = (offs_m[None, :] <= offs_m[:, None]) & m_ok[None, :]
    s = tl.where(causal, s, float("-inf"))
    m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, DOT_PREC)

    if KIND == 0:
        p_min = tl.associative_scan(phi_q, 0, _min_combine)
    run_min = tl.min(tl.full((BLOCK,), float("inf"), tl.float32), 0)  # M over the blocks in between
    for it in range(0, pid_m):
        offs_n = m0 - (it + 1) * BLOCK + li  # full blocks: they lie below a query block
        k = tl.load(K + offs_n[:, None] * stride_kt + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_vt + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        if not LOWP:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        if KIND == 0:
            phi_k = tl.load(PHI + offs_n)
            s_min = tl.associative_scan(phi_k, 0, _min_combine, reverse=True)
            row_min = tl.minimum(p_min, run_min)
            s += (tl.minimum(row_min[:, None], s_min[None, :]) - phi_k[None, :]) * _LOG2E
            run_min = tl.minimum(run_min, tl.min(phi_k, 0))
        elif KIND == 1:
            phi_k = tl.load(PHI + offs_n)
            s += (phi_q[:, None] - phi_k[None, :]) * _LOG2E
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, DOT_PREC)

    acc = acc / l_i[:, None]
    O += b * stride_ob + h * stride_oh
    tl.store(
        O + offs_m[:, None] * stride_ot + offs_d[None, :],
        acc.to(O.dtype.element_ty),
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
    Q, K, V, PHI, DO, LSE, DELTA, DQ, DPHI_Q, DPHI_M,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dqb, stride_dqh, stride_dqt,
    H, T, D, qk_scale, sm_scale,
    KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, LOG_B: tl.constexpr,
    LOWP: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """dq and the query-side field gradient: prefix-min route, diagonal tiles, M route (atomics)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    m0 = pid_m * BLOCK
    li = tl.arange(0, BLOCK)
    offs_m = m0 + li
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < T
    d_ok = offs_d < D
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    PHI += pid_bh * T

    row_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_mask, other=0.0)
    do = tl.load(DO + offs_m[:, None] * stride_dot + offs_d[None, :], mask=row_mask, other=0.0)
    if not LOWP:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    # lse = +inf on rows past T makes their probabilities exactly 0 (so ds is 0 there).
    lse = tl.load(LSE + pid_bh * T + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + pid_bh * T + offs_m, mask=m_ok, other=0.0)
    phi_q = tl.load(PHI + offs_m, mask=m_ok, other=0.0)

    dq = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    dphi = tl.zeros((BLOCK,), tl.float32)

    if KIND == 0:
        p_min, p_arg = tl.associative_scan((phi_q, li), 0, _argmin_combine)
    row_route = tl.zeros((BLOCK,), tl.float32)  # ds mass owed to the prefix-min argmin of each row
    run_min = tl.min(tl.full((BLOCK,), float("inf"), tl.float32), 0)
    run_arg = tl.sum(tl.zeros((BLOCK,), tl.int32), 0)
    acc_m = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)  # ds mass owed to the current argmin of M
    for it in range(0, pid_m):
        offs_n = m0 - (it + 1) * BLOCK + li
        k = tl.load(K + offs_n[:, None] * stride_kt + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_vt + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        if not LOWP:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        if KIND == 0:
            phi_k = tl.load(PHI + offs_n)
            s_min = tl.associative_scan(phi_k, 0, _min_combine, reverse=True)
            row_min = tl.minimum(p_min, run_min)
            s += (tl.minimum(row_min[:, None], s_min[None, :]) - phi_k[None, :]) * _LOG2E
        elif KIND == 1:
            phi_k = tl.load(PHI + offs_n)
            s += (phi_q[:, None] - phi_k[None, :]) * _LOG2E
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
        if KIND == 0:
            # Winner order on ties (lowest index): S (key block) < M (between) < P (query block).
            not_s = tl.sum(tl.where(s_min[None, :] <= row_min[:, None], 0.0, ds), 1)
            m_wins = run_min <= p_min
            row_route += tl.where(m_wins, 0.0, not_s)
            acc_m += tl.sum(tl.where(m_wins, not_s, 0.0), 0)
            # Fold this key block into M; when its argmin moves, flush what the old one is owed.
            blk_min, blk_arg = tl.reduce((phi_k, offs_n), 0, _argmin_combine)
            moved = blk_min <= run_min
            tl.atomic_add(DPHI_M + pid_bh * T + run_arg, acc_m, mask=moved & (acc_m != 0.0))
            acc_m = tl.where(moved, 0.0, acc_m)
            run_min = tl.where(moved, blk_min, run_min)
            run_arg = tl.where(moved, blk_arg, run_arg)
        elif KIND == 1:
            dphi += tl.sum(ds, 1)

    if KIND == 0:
        tl.atomic_add(DPHI_M + pid_bh * T + run_arg, acc_m, mask=acc_m != 0.0)
        dphi += _route(row_route, p_arg, BLOCK)

    # Diagonal tile last: its level-by-level routing then does not share registers with the loop state.
    k = tl.load(K + offs_m[:, None] * stride_kt + offs_d[None, :], mask=row_mask, other=0.0)
    v = tl.load(V + offs_m[:, None] * stride_vt + offs_d[None, :], mask=row_mask, other=0.0)
    if not LOWP:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if KIND == 0:
        s += (_diag_range_min(phi_q, BLOCK, LOG_B) - phi_q[None, :]) * _LOG2E
    elif KIND == 1:
        s += (phi_q[:, None] - phi_q[None, :]) * _LOG2E
    causal = (offs_m[None, :] <= offs_m[:, None]) & m_ok[None, :]
    s = tl.where(causal, s, float("-inf"))
    p = tl.exp2(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
    if KIND == 0:
        dphi += _diag_dphi(phi_q, ds, BLOCK, LOG_B)
    elif KIND == 1:
        dphi += tl.sum(ds, 1)

    DQ += b * stride_dqb + h * stride_dqh
    tl.store(
        DQ + offs_m[:, None] * stride_dqt + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=row_mask,
    )
    if KIND != 2:
        tl.store(DPHI_Q + pid_bh * T + offs_m, dphi, mask=m_ok)


@triton.jit
def _bwd_dkv_kernel(
    Q, K, V, PHI, DO, LSE, DELTA, DK, DV, DPHI_K,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dkb, stride_dkh, stride_dkt,
    stride_dvb, stride_dvh, stride_dvt,
    H, T, D, qk_scale, sm_scale,
    KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, LOG_B: tl.constexpr,
    LOWP: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """dk, dv and the key-side field gradient: suffix-min route minus the column sum of ds."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    n0 = pid_n * BLOCK
    li = tl.arange(0, BLOCK)
    offs_n = n0 + li
    offs_d = tl.arange(0, HEAD_DIM)
    n_ok = offs_n < T
    d_ok = offs_d < D
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    PHI += pid_bh * T
    LSE += pid_bh * T
    DELTA += pid_bh * T

    col_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + offs_n[:, None] * stride_kt + offs_d[None, :], mask=col_mask, other=0.0)
    v = tl.load(V + offs_n[:, None] * stride_vt + offs_d[None, :], mask=col_mask, other=0.0)
    if not LOWP:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    phi_k = tl.load(PHI + offs_n, mask=n_ok, other=0.0)

    dk = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    col_sum = tl.zeros((BLOCK,), tl.float32)

    # diagonal tile: the queries at the same positions
    q = tl.load(Q + offs_n[:, None] * stride_qt + offs_d[None, :], mask=col_mask, other=0.0)
    do = tl.load(DO + offs_n[:, None] * stride_dot + offs_d[None, :], mask=col_mask, other=0.0)
    if not LOWP:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + offs_n, mask=n_ok, other=float("inf"))
    delta = tl.load(DELTA + offs_n, mask=n_ok, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if KIND == 0:
        s += (_diag_range_min(phi_k, BLOCK, LOG_B) - phi_k[None, :]) * _LOG2E
    elif KIND == 1:
        s += (phi_k[:, None] - phi_k[None, :]) * _LOG2E
    causal = (offs_n[None, :] <= offs_n[:, None]) & n_ok[None, :]
    s = tl.where(causal, s, float("-inf"))
    p = tl.exp2(s - lse[:, None])
    dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PREC)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PREC)
    col_sum += tl.sum(ds, 0)

    if KIND == 0:
        s_min, s_arg = tl.associative_scan((phi_k, li), 0, _argmin_combine, reverse=True)
    col_route = tl.zeros((BLOCK,), tl.float32)  # ds mass owed to the suffix-min argmin of each key
    run_min = tl.min(tl.full((BLOCK,), float("inf"), tl.float32), 0)
    n_blocks = tl.cdiv(T, BLOCK)
    for qb in range(pid_n + 1, n_blocks):
        offs_m = qb * BLOCK + li
        m_ok = offs_m < T
        row_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_mask, other=0.0)
        do = tl.load(DO + offs_m[:, None] * stride_dot + offs_d[None, :], mask=row_mask, other=0.0)
        if not LOWP:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(LSE + offs_m, mask=m_ok, other=float("inf"))
        delta = tl.load(DELTA + offs_m, mask=m_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        if KIND == 0:
            phi_q = tl.load(PHI + offs_m, mask=m_ok, other=0.0)
            p_min = tl.associative_scan(phi_q, 0, _min_combine)
            row_min = tl.minimum(p_min, run_min)
            s += (tl.minimum(row_min[:, None], s_min[None, :]) - phi_k[None, :]) * _LOG2E
            # The padded tail of the last block never sits between two blocks, so its fill is harmless.
            run_min = tl.minimum(run_min, tl.min(phi_q, 0))
        elif KIND == 1:
            phi_q = tl.load(PHI + offs_m, mask=m_ok, other=0.0)
            s += (phi_q[:, None] - phi_k[None, :]) * _LOG2E
        p = tl.exp2(s - lse[:, None])
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PREC)
        if KIND != 2:
            col_sum += tl.sum(ds, 0)
        if KIND == 0:
            col_route += tl.sum(tl.where(s_min[None, :] <= row_min[:, None], ds, 0.0), 0)

    DK += b * stride_dkb + h * stride_dkh
    DV += b * stride_dvb + h * stride_dvh
    tl.store(
        DK + offs_n[:, None] * stride_dkt + offs_d[None, :],
        (dk * sm_scale).to(DK.dtype.element_ty),
        mask=col_mask,
    )
    tl.store(DV + offs_n[:, None] * stride_dvt + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=col_mask)
    if KIND == 0:
        tl.store(DPHI_K + pid_bh * T + offs_n, _route(col_route, s_arg, BLOCK) - col_sum, mask=n_ok)
    elif KIND == 1:
        tl.store(DPHI_K + pid_bh * T + offs_n, -col_sum, mask=n_ok)


# ----------------------------------------------------------------------------------------------------
# cross blocks (sequence-parallel ring): a query chunk against a strictly earlier key chunk
# ----------------------------------------------------------------------------------------------------
# Every pair is visible, so there is no causal mask and no diagonal tile; query and key chunks may have
# different lengths (LQ, LK), masked at the ends. The field terms come from the host, per query row
# ROW_i (fpa: min(P_i, M); fox: phi_i) and per key column SMIN_j (fpa: S_j) and PHI_K_j, so the kernels
# need no scans. The backward kernels emit ds sums split by which term won (the tie rule of
# chunked._route_cross: S wins ties against the row term); the host routes them to argP / argS / M with
# chunked.route_cross_sums, the chunked path's own routing. Each program stores only its own rows or columns: no atomics, deterministic.


@triton.jit
def _load_rows(ptr, offs, stride, offs_d, ok, d_ok, LOWP: tl.constexpr):
    """A (rows, HEAD_DIM) tile of q / k / v / do, zero outside; fp32 unless the dots run in low precision."""
    x = tl.load(ptr + offs[:, None] * stride + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    if not LOWP:
        x = x.to(tl.float32)
    return x


@triton.jit
def _cross_logits(q, k, row_q, s_min, phi_k, n_ok, qk_scale, KIND: tl.constexpr, DOT_PREC: tl.constexpr):
    """Base-2 logits of a cross tile; padded key columns get -inf."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if KIND == 0:
        s += (tl.minimum(row_q[:, None], s_min[None, :]) - phi_k[None, :]) * _LOG2E
    elif KIND == 1:
        s += (row_q[:, None] - phi_k[None, :]) * _LOG2E
    return tl.where(n_ok[None, :], s, float("-inf"))


@triton.jit
def _cross_ds(s, v, do, lse, delta, DOT_PREC: tl.constexpr):
    """(p, ds) of a tile given the full rows' base-2 lse and delta: ds = p * (do . v - delta)."""
    p = tl.exp2(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    return p, p * (dp - delta[:, None])


@triton.jit
def _cross_fwd_kernel(
    Q, K, V, ROW, SMIN, PHI_K, O, LSE,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    H, LQ, LK, D, qk_scale,
    KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    LOWP: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    li = tl.arange(0, BLOCK)
    offs_m = pid_m * BLOCK + li
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < LQ
    d_ok = offs_d < D
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    SMIN += pid_bh * LK
    PHI_K += pid_bh * LK

    q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, stride_qt, offs_d, m_ok, d_ok, LOWP)
    row_q = tl.load(ROW + pid_bh * LQ + offs_m, mask=m_ok, other=0.0)
    m_i = tl.full((BLOCK,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK,), tl.float32)
    acc = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    for n0 in range(0, LK, BLOCK):  # every key block holds at least one real column: m_i turns finite
        offs_n = n0 + li
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
    H, LQ, LK, D, qk_scale, sm_scale,
    KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    LOWP: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """dq and DROW_i = sum_j ds_ij over the keys where the row term wins (fpa) or over all keys (fox)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    li = tl.arange(0, BLOCK)
    offs_m = pid_m * BLOCK + li
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
    dq = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    drow = tl.zeros((BLOCK,), tl.float32)
    for n0 in range(0, LK, BLOCK):
        offs_n = n0 + li
        n_ok = offs_n < LK
        k = _load_rows(K, offs_n, stride_kt, offs_d, n_ok, d_ok, LOWP)
        v = _load_rows(V, offs_n, stride_vt, offs_d, n_ok, d_ok, LOWP)
        s_min = tl.load(SMIN + offs_n, mask=n_ok, other=0.0)
        phi_k = tl.load(PHI_K + offs_n, mask=n_ok, other=0.0)
        s = _cross_logits(q, k, row_q, s_min, phi_k, n_ok, qk_scale, KIND, DOT_PREC)
        _p, ds = _cross_ds(s, v, do, lse, delta, DOT_PREC)
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
    H, LQ, LK, D, qk_scale, sm_scale,
    KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    LOWP: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """dk, dv, DCOL_ALL_j = sum_i ds_ij and (fpa) DCOL_S_j = the part of it where S_j wins."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    li = tl.arange(0, BLOCK)
    offs_n = pid_n * BLOCK + li
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
    dk = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    col_all = tl.zeros((BLOCK,), tl.float32)
    col_s = tl.zeros((BLOCK,), tl.float32)
    for m0 in range(0, LQ, BLOCK):
        offs_m = m0 + li
        m_ok = offs_m < LQ
        q = _load_rows(Q, offs_m, stride_qt, offs_d, m_ok, d_ok, LOWP)
        do = _load_rows(DO, offs_m, stride_dot, offs_d, m_ok, d_ok, LOWP)
        row_q = tl.load(ROW + offs_m, mask=m_ok, other=0.0)
        lse = tl.load(LSE + offs_m, mask=m_ok, other=float("inf"))
        delta = tl.load(DELTA + offs_m, mask=m_ok, other=0.0)
        s = _cross_logits(q, k, row_q, s_min, phi_k, n_ok, qk_scale, KIND, DOT_PREC)
        p, ds = _cross_ds(s, v, do, lse, delta, DOT_PREC)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PREC)
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PREC)
        if KIND != 2:
            col_all += tl.sum(ds, 0)
        if KIND == 0:
            col_s += tl.sum(tl.where(s_min[None, :] <= row_q[:, None], ds, 0.0), 0)

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
# autotuning
# ----------------------------------------------------------------------------------------------------


def _cfg(block: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK": block, "LOG_B": block.bit_length() - 1}, num_warps=warps, num_stages=stages
    )


def _no_levels(configs: list[triton.Config]) -> list[triton.Config]:
    """The same tiles for kernels without a diagonal tile (no LOG_B parameter)."""
    return [
        triton.Config({"BLOCK": c.kwargs["BLOCK"]}, num_warps=c.num_warps, num_stages=c.num_stages)
        for c in configs
    ]


if _INTERPRET:
    # Multi-config autotune fails under the interpreter; one config, and bigger blocks run faster there.
    _FWD_CONFIGS = [_cfg(32, 4, 1)]
    _BWD_CONFIGS = [_cfg(32, 4, 1)]
else:
    # Hopper / Ampere. Kept short: with the diagonal-tile levels unrolled, one fpa backward config takes
    # 5-15 s to compile for sm_90, and every config is compiled on the first call (then cached on disk).
    # Spills measured by compiling for sm_90 with the bundled ptxas (head dim 64, no GPU at hand):
    # fwd 32/4 warps and 64/8 none, 64/4 40 B, 128/8 104 B; dq 32/4 8 B, 64/8 168 B, 64/4 304 B;
    # dkv 32/4 none, 64/8 96 B, 64/4 232 B; 128-row backward tiles spill kilobytes, so they are left out.
    _FWD_CONFIGS = [_cfg(32, 4, 3), _cfg(64, 4, 3), _cfg(64, 8, 3), _cfg(128, 8, 3)]
    _BWD_CONFIGS = [_cfg(32, 4, 2), _cfg(32, 4, 3), _cfg(64, 8, 2), _cfg(64, 8, 3)]

_TUNE_KEY = ["T", "HEAD_DIM", "KIND", "LOWP"]
_fwd_tuned = triton.autotune(configs=_FWD_CONFIGS, key=_TUNE_KEY)(_fwd_kernel)
# Autotune reruns the kernel: the atomically accumulated M-route buffer must start from zero each time.
_bwd_dq_tuned = triton.autotune(configs=_BWD_CONFIGS, key=_TUNE_KEY, reset_to_zero=["DPHI_M"])(_bwd_dq_kernel)
_bwd_dkv_tuned = triton.autotune(configs=_BWD_CONFIGS, key=_TUNE_KEY)(_bwd_dkv_kernel)
# Cross blocks: the causal kernels' tile list (not timed: no GPU at hand). Stack (spill) bytes of their
# sm_90 cubins (cuobjdump -res-usage, bf16, head dim 64 / 128): fwd 128/8 warps 24 / 104 B, dkv 64/8
# 88 / 736 B, every other listed config 0; 128-row backward tiles (not listed) spill 288-2464 B.
_CROSS_KEY = ["LQ", "LK", "HEAD_DIM", "KIND", "LOWP"]
_cross_fwd_tuned = triton.autotune(configs=_no_levels(_FWD_CONFIGS), key=_CROSS_KEY)(_cross_fwd_kernel)
_cross_dq_tuned = triton.autotune(configs=_no_levels(_BWD_CONFIGS), key=_CROSS_KEY)(_cross_bwd_dq_kernel)
_cross_dkv_tuned = triton.autotune(configs=_no_levels(_BWD_CONFIGS), key=_CROSS_KEY)(_cross_bwd_dkv_kernel)


# ----------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------

_LN2 = math.log(2.0)


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _Launch:
    """Per-call constants shared by the kernels of one op."""

    def __init__(self, q: torch.Tensor, kind: str, scale: float, block_size: int | None):
        self.B, self.H, self.T, self.D = q.shape
        self.kind_id = _KIND_ID[kind]
        self.scale = scale
        self.block_size = block_size
        self.head_dim = max(16, triton.next_power_of_2(self.D))  # tl.dot needs >= 16
        # Low-precision tensor-core dots on GPU; the interpreter (and fp32 inputs) compute in fp32.
        self.lowp = q.dtype in (torch.bfloat16, torch.float16) and not _INTERPRET
        self.meta = {
            "KIND": self.kind_id,
            "HEAD_DIM": self.head_dim,
            "LOWP": self.lowp,
            "DOT_PREC": "tf32" if self.lowp else "ieee",
        }

    def run(self, tuned, raw, *args, length: int | None = None) -> None:
        """Launch one program per BLOCK of `length` rows (default T) and per batch and head."""
        n = self.T if length is None else length
        if self.block_size is None:
            grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]), self.B * self.H)  # noqa: E731
            tuned[grid](*args, **self.meta)
        else:
            grid = (triton.cdiv(n, self.block_size), self.B * self.H)
            levels = {"LOG_B": self.block_size.bit_length() - 1} if "LOG_B" in raw.arg_names else {}
            raw[grid](*args, BLOCK=self.block_size, **levels, num_warps=4, num_stages=2, **self.meta)


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
    o = torch.empty((B, H, T, D), dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    lc.run(
        _fwd_tuned, _fwd_kernel,
        q, k, v, phi32, o, lse,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        H, T, D, lc.scale * _LOG2E.value,
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
    dq = torch.empty((B, H, T, D), dtype=grad_dtype or q.dtype, device=q.device)
    dk = torch.empty((B, H, T, D), dtype=grad_dtype or k.dtype, device=q.device)
    dv = torch.empty((B, H, T, D), dtype=grad_dtype or v.dtype, device=q.device)
    # dphi_q / dphi_k: every position is stored by the program that owns it; dphi_m takes atomic adds.
    dphi_q = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    dphi_k = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    dphi_m = torch.zeros((B, H, T), dtype=torch.float32, device=q.device)
    common = (H, T, D, lc.scale * _LOG2E.value, lc.scale)
    lc.run(
        _bwd_dq_tuned, _bwd_dq_kernel,
        q, k, v, phi32, do, lse, delta, dq, dphi_q, dphi_m,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
        *common,
    )  # fmt: skip
    lc.run(
        _bwd_dkv_tuned, _bwd_dkv_kernel,
        q, k, v, phi32, do, lse, delta, dk, dv, dphi_k,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
        *common,
    )  # fmt: skip
    if lc.kind_id == _KIND_ID["softmax"]:
        return dq, dk, dv, None
    dphi = dphi_q + dphi_k
    if lc.kind_id == _KIND_ID["fpa"]:
        dphi += dphi_m
    return dq, dk, dv, dphi


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


def _check_block_size(block_size: int | None) -> None:
    if block_size is not None and (block_size < 16 or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of 2 >= 16, got {block_size}")


def fpa_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None = None,
    *,
    kind: str = "fpa",
    scale: float | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Causal FPA / FoX / softmax attention with the Triton kernels (differentiable in q, k, v and phi).

    q, k, v: (B, H, T, D), same dtype (fp32, bf16 or fp16), D <= 128; phi: (B, H, T), the field at every
    position (None only for kind="softmax"). Queries and keys cover the same T positions. block_size
    (a power of 2 >= 16) pins the tile size instead of autotuning; tests use it to get several blocks.
    Runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before this module loaded.
    """
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
    _check_block_size(block_size)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    lc = _Launch(q, kind, scale, block_size)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    return _FPATritonFunction.apply(q, k, v, phi, lc)


# ----------------------------------------------------------------------------------------------------
# Block functions for the sequence-parallel ring: the signatures and return types of chunked.py's
# fpa_cross_forward / fpa_diag_forward / fpa_cross_backward / fpa_diag_backward (see its docstring),
# plus an optional block_size (a power of 2 >= 16; None autotunes). Natural-log lse in and out.
# Any leading dims "..." (flattened to (N, 1) unless they are (B, H), so the ring's chunk views of
# (B, H, T, D) tensors go in without a copy); q, k, v one dtype of fp32/bf16/fp16, k and v the same shape,
# D <= 128. Outputs and gradients are float32, like the chunked blocks for these dtypes.
# ----------------------------------------------------------------------------------------------------


def _as4d(x: torch.Tensor) -> torch.Tensor:
    """(..., L, D) -> (B, H, L, D) with a unit last stride: (B, H) kept when there are two leading dims."""
    x = _last_dim_contiguous(x)
    return x if x.dim() == 4 else x.reshape(-1, 1, *x.shape[-2:])


def _check_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str, block_size: int | None
) -> None:
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
    _check_block_size(block_size)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a query chunk against a strictly earlier key chunk (chunked.fpa_cross_forward)."""
    _check_block(q, k, v, kind, block_size)
    lead, lq, lk, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    q4, k4, v4 = _as4d(q), _as4d(k), _as4d(v)
    fld = _cross_field(kind, phi_q, phi_k, m_between, lead, lq, lk, q.device)
    lc = _Launch(q4, kind, _scale_of(q, scale), block_size)
    B, H = q4.shape[:2]
    o = torch.empty((B, H, lq, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, H, lq), dtype=torch.float32, device=q.device)
    lc.run(
        _cross_fwd_tuned, _cross_fwd_kernel,
        q4, k4, v4, fld.row, fld.s_min, fld.phi_k, o, lse,
        *_strides(q4), *_strides(k4), *_strides(v4), *_strides(o),
        H, lq, lk, d, lc.scale * _LOG2E.value,
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
) -> CrossGrads:
    """Gradients of a cross block given the full rows' lse and out (or delta) (chunked.fpa_cross_backward).

    The kernels return ds sums per query row (where the row term min(P, M) wins) and per key column
    (all, and where S wins); chunked.route_cross_sums routes them to argP, argS and M (S wins ties
    against the row term, M wins ties against P), as it does for the chunked blocks."""
    _check_block(q, k, v, kind, block_size)
    lead, lq, lk, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    q4, k4, v4, do4 = _as4d(q), _as4d(k), _as4d(v), _as4d(dout)
    B, H = q4.shape[:2]
    n = B * H
    fld = _cross_field(kind, phi_q, phi_k, m_between, lead, lq, lk, q.device)
    lc = _Launch(q4, kind, _scale_of(q, scale), block_size)
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
    common = (H, lq, lk, d, lc.scale * _LOG2E.value, lc.scale)
    operands = (q4, k4, v4, fld.row, fld.s_min, fld.phi_k, do4, lse2, dlt)
    in_strides = (*_strides(q4), *_strides(k4), *_strides(v4), *_strides(do4))
    lc.run(
        _cross_dq_tuned, _cross_bwd_dq_kernel,
        *operands, dq, drow, *in_strides, *_strides(dq), *common,
        length=lq,
    )  # fmt: skip
    lc.run(
        _cross_dkv_tuned, _cross_bwd_dkv_kernel,
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


def _diag_inputs(q, k, v, phi, kind, block_size):
    _check_block(q, k, v, kind, block_size)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a chunk against itself, causal, Lq == Lk (chunked.fpa_diag_forward): the causal op."""
    q4, k4, v4, phi32 = _diag_inputs(q, k, v, phi, kind, block_size)
    lc = _Launch(q4, kind, _scale_of(q, scale), block_size)
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
) -> DiagGrads:
    """Gradients of a causal diagonal block given the full rows' lse and out (or delta): the causal op's
    backward kernels fed with them (chunked.fpa_diag_backward)."""
    q4, k4, v4, phi32 = _diag_inputs(q, k, v, phi, kind, block_size)
    B, H, L = q4.shape[:3]
    lc = _Launch(q4, kind, _scale_of(q, scale), block_size)
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
    "MAX_HEAD_DIM",
    "fpa_attention_triton",
    "fpa_cross_backward",
    "fpa_cross_forward",
    "fpa_diag_backward",
    "fpa_diag_forward",
]
