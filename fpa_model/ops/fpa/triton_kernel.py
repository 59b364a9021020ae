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

All math runs in fp32. On GPU, bf16/fp16 inputs feed tl.dot in their own dtype (fp32 accumulate) and fp32
inputs use IEEE fp32 dots (no TF32); under the CPU interpreter everything is cast to fp32 right after the load (bf16 math there is wrong).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

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
# autotuning
# ----------------------------------------------------------------------------------------------------


def _cfg(block: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK": block, "LOG_B": block.bit_length() - 1}, num_warps=warps, num_stages=stages
    )


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


# ----------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _Launch:
    """Per-call constants shared by the three kernels."""

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

    def run(self, tuned, raw, *args) -> None:
        if self.block_size is None:
            grid = lambda meta: (triton.cdiv(self.T, meta["BLOCK"]), self.B * self.H)  # noqa: E731
            tuned[grid](*args, **self.meta)
        else:
            grid = (triton.cdiv(self.T, self.block_size), self.B * self.H)
            log_b = self.block_size.bit_length() - 1
            raw[grid](*args, BLOCK=self.block_size, LOG_B=log_b, num_warps=4, num_stages=2, **self.meta)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phi32: torch.Tensor, lc: _Launch
) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, T, D = q.shape
    o = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    lc.run(
        _fwd_tuned, _fwd_kernel,
        q, k, v, phi32, o, lse,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        H, T, D, lc.scale * _LOG2E.value,
    )  # fmt: skip
    return o, lse


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi32: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    lc: _Launch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    B, H, T, D = q.shape
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    _bwd_delta_kernel[(triton.cdiv(T, 64), B * H)](
        o, do, delta, *_strides(o), *_strides(do), H, T, D, HEAD_DIM=lc.head_dim, BLOCK=64
    )
    dq = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, H, T, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, H, T, D), dtype=v.dtype, device=q.device)
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
        dq, dk, dv, dphi = _backward(q, k, v, phi32, o, lse, _last_dim_contiguous(do), ctx.lc)
        dphi = dphi.to(ctx.phi_dtype) if dphi is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dphi, None


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
    if not q.is_cuda and not _INTERPRET:
        raise RuntimeError(
            "fpa_attention_triton needs CUDA tensors, or TRITON_INTERPRET=1 set before "
            "fpa_model.ops.fpa.triton_kernel is imported (CPU interpreter)"
        )
    if block_size is not None and (block_size < 16 or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of 2 >= 16, got {block_size}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    lc = _Launch(q, kind, scale, block_size)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    return _FPATritonFunction.apply(q, k, v, phi, lc)


__all__ = ["MAX_HEAD_DIM", "fpa_attention_triton"]
