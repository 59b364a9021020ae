"""The Triton ring blocks (triton_kernel.fpa_cross_* / fpa_diag_*) against the chunked PyTorch blocks.

Same inputs into both; out, lse and every gradient (dq, dk, dv, dphi_q, dphi_k, dm / dphi) compared.
Lengths are not multiples of the 16-row tile, query and key chunks differ in length, M is +inf (adjacent
chunks) or finite, and integer-valued fields make ties everywhere (S vs the row term, M vs P, inside
the scans), so the gradient routing must follow chunked._route_cross's rule exactly. On a machine
without CUDA these run under the Triton interpreter (tests/conftest.py); shapes stay tiny.
"""

from __future__ import annotations

import math

import pytest
import torch

from fpa_model.ops.fpa import chunked
from fpa_model.ops.fpa import triton_kernel as tk

pytestmark = pytest.mark.triton  # the whole file reruns on Triton 3.6 (make test-triton36)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 16
KINDS = ("fpa", "fox", "softmax")


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(DEVICE)


def _field(g: torch.Generator, shape: tuple[int, ...], ties: bool) -> torch.Tensor:
    """A walk-like field, or one on three integer levels (equal minima everywhere)."""
    if ties:
        return torch.randint(0, 3, shape, generator=g).float().to(DEVICE)
    return (torch.randn(*shape, generator=g) * 0.7 - 0.1).cumsum(-1).to(DEVICE)


def _m_between(
    g: torch.Generator, m: str, phi_q: torch.Tensor, phi_k: torch.Tensor, ties: bool
) -> torch.Tensor:
    b, h = phi_q.shape[:2]
    if m == "inf":
        return torch.full((b, h), math.inf, device=DEVICE)
    if ties:  # on the field's levels (0, 1 tie with P and S) and between them
        vals = torch.tensor([0.0, 1.0, 0.5, -0.5, math.inf])
        mb = vals[torch.randint(0, len(vals), (b, h), generator=g)]
        mb[0, 0] = -0.5  # below every level: this head routes gradient to M whatever else was drawn
        return mb.to(DEVICE)
    # Below every S_j and inside the query field's range: M wins for the first rows, P or S later.
    return torch.minimum(phi_q[..., 2], phi_k.amin(-1)) - 0.05


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float = 2e-5) -> None:
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert got.dtype == ref.dtype, f"{name}: dtype {got.dtype} != {ref.dtype}"
    scale = max(ref.abs().max().item(), 1.0)
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= tol * scale, f"{name}: max error {err:.3g} (reference max {scale:.3g})"


CROSS_CASES = [(kind, m, ties) for kind in KINDS for m in ("inf", "finite") for ties in (False, True)]


@pytest.mark.parametrize(
    "kind,m,ties",
    CROSS_CASES,
    ids=[f"{k}-M{m}-{'ties' if t else 'walk'}" for k, m, t in CROSS_CASES],
)
def test_cross_block_matches_chunked(kind: str, m: str, ties: bool) -> None:
    b, h, lq, lk, d = 2, 2, 24, 37, 16  # Lq != Lk, neither a multiple of the tile
    g = torch.Generator().manual_seed(1000 + CROSS_CASES.index((kind, m, ties)))  # not hash(): salted
    q, k, v = _randn(g, b, h, lq, d), _randn(g, b, h, lk, d), _randn(g, b, h, lk, d)
    phi_q, phi_k = _field(g, (b, h, lq), ties), _field(g, (b, h, lk), ties)
    mb = _m_between(g, m, phi_q, phi_k, ties)
    out, lse = tk.fpa_cross_forward(q, k, v, phi_q, phi_k, mb, kind=kind, block_size=BLOCK)
    ref_out, ref_lse = chunked.fpa_cross_forward(q, k, v, phi_q, phi_k, mb, kind=kind)
    assert_close("out", out, ref_out)
    assert_close("lse", lse, ref_lse)

    # In the ring the backward sees the lse and delta of the full rows (other chunks included): here a
    # larger lse and an arbitrary delta, the same for both.
    dout = _randn(g, b, h, lq, d)
    full_lse = ref_lse + torch.rand(b, h, lq, generator=g).to(DEVICE)
    delta = _randn(g, b, h, lq)
    args = (dout, q, k, v, phi_q, phi_k, mb, full_lse)
    got = tk.fpa_cross_backward(*args, delta=delta, kind=kind, block_size=BLOCK)
    ref = chunked.fpa_cross_backward(*args, delta=delta, kind=kind)
    for name in chunked.CrossGrads._fields:
        assert_close(name, getattr(got, name), getattr(ref, name))
    if kind == "fpa" and m == "finite":
        assert ref.dm.abs().max() > 1e-3, "the test should route some gradient to M"
    # out instead of delta: delta = rowsum(dout * out).
    got_o = tk.fpa_cross_backward(*args, out=ref_out, kind=kind, block_size=BLOCK)
    ref_o = chunked.fpa_cross_backward(*args, out=ref_out, kind=kind)
    assert_close("dq (out given)", got_o.dq, ref_o.dq)
    assert_close("dphi_k (out given)", got_o.dphi_k, ref_o.dphi_k)


DIAG_CASES = [(kind, length, ties) for kind in KINDS for length in (37, 16) for ties in (False, True)]
DIAG_CASES = [c for c in DIAG_CASES if c[1] == 37 or c[0] == "fpa"]  # one-tile chunks: fpa suffices


@pytest.mark.parametrize(
    "kind,length,ties",
    DIAG_CASES,
    ids=[f"{k}-L{n}-{'ties' if t else 'walk'}" for k, n, t in DIAG_CASES],
)
def test_diag_block_matches_chunked(kind: str, length: int, ties: bool) -> None:
    b, h, d = 2, 2, 24  # D padded to 32 inside the kernel
    g = torch.Generator().manual_seed(length + 7 * ties + len(kind))
    q, k, v = (_randn(g, b, h, length, d) for _ in range(3))
    phi = _field(g, (b, h, length), ties)
    out, lse = tk.fpa_diag_forward(q, k, v, phi, kind=kind, block_size=BLOCK)
    ref_out, ref_lse = chunked.fpa_diag_forward(q, k, v, phi, kind=kind)
    assert_close("out", out, ref_out)
    assert_close("lse", lse, ref_lse)
    dout = _randn(g, b, h, length, d)
    full_lse = ref_lse + torch.rand(b, h, length, generator=g).to(DEVICE)
    delta = _randn(g, b, h, length)
    args = (dout, q, k, v, phi, full_lse)
    got = tk.fpa_diag_backward(*args, delta=delta, kind=kind, block_size=BLOCK)
    ref = chunked.fpa_diag_backward(*args, delta=delta, kind=kind)
    for name in chunked.DiagGrads._fields:
        assert_close(name, getattr(got, name), getattr(ref, name))


def test_blocks_on_strided_views_and_other_leading_dims() -> None:
    """The ring's inputs: chunk views of (B, T, H, D).transpose(1, 2) tensors, and 3-D (N, L, D) blocks."""
    g = torch.Generator().manual_seed(3)
    full = [_randn(g, 1, 40, 2, 16).transpose(1, 2) for _ in range(4)]  # (1, 2, 40, 16), strided
    q, do = full[0][..., 20:, :], full[3][..., 20:, :]
    k, v = full[1][..., :20, :], full[2][..., :20, :]
    phi = _field(g, (1, 2, 40), False)
    mb = torch.tensor([[0.2, math.inf]], device=DEVICE)
    args = (q, k, v, phi[..., 20:], phi[..., :20], mb)
    out, lse = tk.fpa_cross_forward(*args, kind="fpa", scale=0.3, block_size=BLOCK)
    ref_out, ref_lse = chunked.fpa_cross_forward(*args, kind="fpa", scale=0.3)
    assert_close("out", out, ref_out)
    got = tk.fpa_cross_backward(do, *args, ref_lse, out=ref_out, kind="fpa", scale=0.3, block_size=BLOCK)
    ref = chunked.fpa_cross_backward(do, *args, ref_lse, out=ref_out, kind="fpa", scale=0.3)
    for name in chunked.CrossGrads._fields:
        assert_close(name, getattr(got, name), getattr(ref, name))
    # Autotuned tiles (no block_size): the path the ring takes on a GPU.
    out_auto, lse_auto = tk.fpa_cross_forward(*args, kind="fpa", scale=0.3)
    assert_close("out (autotuned)", out_auto, ref_out)
    got_auto = tk.fpa_cross_backward(do, *args, ref_lse, out=ref_out, kind="fpa", scale=0.3)
    assert_close("dphi_q (autotuned)", got_auto.dphi_q, ref.dphi_q)
    # Three-dim (N, L, D) diagonal block.
    q3, k3, v3 = (x[0, :, :20].contiguous() for x in full[:3])
    out3, lse3 = tk.fpa_diag_forward(q3, k3, v3, phi[0, :, :20], kind="fox", block_size=BLOCK)
    ref3, rlse3 = chunked.fpa_diag_forward(q3, k3, v3, phi[0, :, :20], kind="fox")
    assert_close("out 3-d", out3, ref3)
    assert_close("lse 3-d", lse3, rlse3)


def _mismatched(i: int) -> dict:
    lists = {n: tk.GPU_TILES[n] for n in ("cross_fwd", "cross_dq", "cross_dkv")}
    pick = {n: tiles[(i + j) % len(tiles)] for j, (n, tiles) in enumerate(lists.items())}
    return {**pick, "fwd": (16, 64), "dq": (64, 16), "dkv": (32, 16)}


MISMATCHED = [_mismatched(i) for i in range(2)]


@pytest.mark.parametrize("tiles", MISMATCHED, ids=["gpu0", "gpu1"])
def test_blocks_on_mismatched_tiles_match_chunked(tiles: dict) -> None:
    """Each ring kernel pinned to a different entry of its GPU list (as independent autotuners may pick):
    cross and diagonal blocks still equal the chunked blocks, field gradients and dm included."""
    g = torch.Generator().manual_seed(21)
    b, h, lq, lk, d = 1, 2, 150, 170, 16
    q, k, v, do = (
        _randn(g, b, h, lq, d),
        _randn(g, b, h, lk, d),
        _randn(g, b, h, lk, d),
        _randn(g, b, h, lq, d),
    )
    phi_q, phi_k = _field(g, (b, h, lq), True), _field(g, (b, h, lk), True)
    mb = _m_between(g, "finite", phi_q, phi_k, True)
    args = (q, k, v, phi_q, phi_k, mb)
    out, lse = tk.fpa_cross_forward(*args, kind="fpa", tiles=tiles)
    ref_out, ref_lse = chunked.fpa_cross_forward(*args, kind="fpa")
    assert_close("cross out", out, ref_out)
    got = tk.fpa_cross_backward(do, *args, ref_lse, out=ref_out, kind="fpa", tiles=tiles)
    ref = chunked.fpa_cross_backward(do, *args, ref_lse, out=ref_out, kind="fpa")
    for name in chunked.CrossGrads._fields:
        assert_close("cross " + name, getattr(got, name), getattr(ref, name))
    out, lse = tk.fpa_diag_forward(q, q, do, phi_q, kind="fpa", tiles=tiles)
    ref_out, ref_lse = chunked.fpa_diag_forward(q, q, do, phi_q, kind="fpa")
    assert_close("diag out", out, ref_out)
    got = tk.fpa_diag_backward(do, q, q, do, phi_q, ref_lse, out=ref_out, kind="fpa", tiles=tiles)
    ref = chunked.fpa_diag_backward(do, q, q, do, phi_q, ref_lse, out=ref_out, kind="fpa")
    for name in chunked.DiagGrads._fields:
        assert_close("diag " + name, getattr(got, name), getattr(ref, name))


@pytest.mark.parametrize("kind", ["fpa", "fox"])
def test_bf16_blocks_track_chunked(kind: str) -> None:
    """bf16 inputs: float32 outputs and gradients (as the chunked blocks give), close to them."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (_randn(g, 1, 2, 20, 16).bfloat16() for _ in range(3))
    phi = _field(g, (1, 2, 20), True)
    out, lse = tk.fpa_diag_forward(q, k, v, phi, kind=kind, block_size=BLOCK)
    ref_out, ref_lse = chunked.fpa_diag_forward(q, k, v, phi, kind=kind)
    assert_close("out", out, ref_out, tol=2e-2)
    dout = _randn(g, 1, 2, 20, 16).bfloat16()
    mb = torch.zeros(1, 2, device=DEVICE)
    args = (
        dout[..., 10:, :],
        q[..., 10:, :],
        k[..., :10, :],
        v[..., :10, :],
        phi[..., 10:],
        phi[..., :10],
        mb,
    )
    got = tk.fpa_cross_backward(*args, lse[..., 10:], out=out[..., 10:, :], kind=kind, block_size=BLOCK)
    ref = chunked.fpa_cross_backward(*args, ref_lse[..., 10:], out=ref_out[..., 10:, :], kind=kind)
    for name in chunked.CrossGrads._fields:
        assert_close(name, getattr(got, name), getattr(ref, name), tol=3e-2)


@pytest.mark.parametrize(
    "case,match",
    [
        ("diag_lq_lt_lk", "Lq == Lk"),
        ("kind", "unknown attention kind"),
        ("no_m", "needs m_between"),
        ("no_phi", "needs phi_q and phi_k"),
        ("head_dim", "head dim 192"),
        ("dv", "equal leading dims"),
        ("block", "power of 2"),
        ("no_out", "either out or delta"),
    ],
)
def test_block_bad_input_gives_clear_error(case: str, match: str) -> None:
    z = torch.zeros(1, 2, 8, 16, device=DEVICE)
    p = torch.zeros(1, 2, 8, device=DEVICE)
    m = torch.zeros(1, 2, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        if case == "diag_lq_lt_lk":
            tk.fpa_diag_forward(z[..., :4, :], z, z, p, kind="fpa")
        elif case == "kind":
            tk.fpa_cross_forward(z, z, z, p, p, m, kind="linear")
        elif case == "no_m":
            tk.fpa_cross_forward(z, z, z, p, p, None, kind="fpa")
        elif case == "no_phi":
            tk.fpa_cross_forward(z, z, z, None, p, m, kind="fox")
        elif case == "head_dim":
            big = torch.zeros(1, 2, 8, 192, device=DEVICE)
            tk.fpa_diag_forward(big, big, big, p, kind="fpa")
        elif case == "dv":
            tk.fpa_cross_forward(z, z, z[..., :8], p, p, m, kind="fpa")
        elif case == "block":
            tk.fpa_cross_forward(z, z, z, p, p, m, kind="fpa", block_size=24)
        elif case == "no_out":
            tk.fpa_cross_backward(z, z, z, z, p, p, m, p, kind="fpa")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_autotuned_blocks_match_chunked(
    kind: str, d: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ring-sized chunks on the GPU with autotuned tiles: a diagonal block of 1000 and a cross block of
    1000 queries against 700 earlier keys (finite M), the chunked blocks as reference (IEEE fp32 dots)."""
    monkeypatch.setattr(tk, "FP32_PRECISION", "ieee")
    g = torch.Generator().manual_seed(d)
    b, h, lq, lk = 2, 3, 1000, 700
    q, kd, vd, do = (_randn(g, b, h, lq, d).to(dtype) for _ in range(4))
    k, v = _randn(g, b, h, lk, d).to(dtype), _randn(g, b, h, lk, d).to(dtype)
    phi_q, phi_k = _field(g, (b, h, lq), False), _field(g, (b, h, lk), False)
    mb = _m_between(g, "finite", phi_q, phi_k, False)
    tol = 2e-4 if dtype == torch.float32 else 5e-2
    out, lse = tk.fpa_diag_forward(q, kd, vd, phi_q, kind=kind)
    ref_out, ref_lse = chunked.fpa_diag_forward(q, kd, vd, phi_q, kind=kind)
    assert_close("diag out", out, ref_out, tol)
    assert_close("diag lse", lse, ref_lse, tol)
    got = tk.fpa_diag_backward(do, q, kd, vd, phi_q, ref_lse, out=ref_out, kind=kind)
    ref = chunked.fpa_diag_backward(do, q, kd, vd, phi_q, ref_lse, out=ref_out, kind=kind)
    for name in chunked.DiagGrads._fields:
        assert_close("diag " + name, getattr(got, name), getattr(ref, name), tol)
    args = (q, k, v, phi_q, phi_k, mb)
    out, lse = tk.fpa_cross_forward(*args, kind=kind)
    ref_out, ref_lse = chunked.fpa_cross_forward(*args, kind=kind)
    assert_close("cross out", out, ref_out, tol)
    assert_close("cross lse", lse, ref_lse, tol)
    got = tk.fpa_cross_backward(do, *args, ref_lse, out=ref_out, kind=kind)
    ref = chunked.fpa_cross_backward(do, *args, ref_lse, out=ref_out, kind=kind)
    for name in chunked.CrossGrads._fields:
        assert_close("cross " + name, getattr(got, name), getattr(ref, name), tol)
