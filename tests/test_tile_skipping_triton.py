"""Tile skipping in the Triton kernels (under TRITON_INTERPRET=1 on CPU): one keep map per call, decided on
SKIP_CELL x SKIP_CELL cells exactly as the chunked path decides at that block size, shared by the forward,
dq and dk/dv kernels. Checked: the map is the bound of skipping.py evaluated by hand; outputs and gradients
are attention with exactly the skipped cells masked, and within epsilon of the unskipped kernels; the
kernels skip the same pairs whatever tiles each runs (their tile counters equal a count made by hand); a
cell just above the threshold is kept; softmax and skipping off are the kernels as they were."""

from __future__ import annotations

import math

import pytest
import torch
from test_tile_skipping import _fields, _grads, _hand_skips, _inputs, _masked_attention, _sawtooth_walk

from fpa_model.ops.fpa import fpa_attention
from fpa_model.ops.fpa import triton_kernel as tk
from fpa_model.ops.fpa.chunked import chunked_fpa_attention, tile_keep_map
from fpa_model.ops.fpa.kinds import resolve_kind
from fpa_model.ops.fpa.library import attention as library_attention
from fpa_model.ops.fpa.skipping import skip_counts

pytestmark = pytest.mark.triton

CELL = tk.SKIP_CELL
EPS = 1e-3


def _pair_skips(keep: torch.Tensor, b: int, h: int, t: int) -> torch.Tensor:
    """(B, H, T, T) bool: the pairs of the cells the map skips (keep (B*H, n, n), 0 = skipped)."""
    cells = torch.arange(t) // CELL
    return (keep == 0)[:, cells][:, :, cells].view(b, h, t, t)


def _triton(q, k, v, phi, kind, **kw):
    return lambda q_, k_, v_, p_: tk.fpa_attention_triton(q_, k_, v_, p_, kind=kind, skip_epsilon=EPS, **kw)


@pytest.mark.parametrize(
    ("kind", "field", "t", "docs"),
    [("fpa", "sawtooth", 384, False), ("fpa", "random", 300, True), ("fox", "sawtooth", 300, True),
     ("fox", "random", 384, False)],
)  # fmt: skip
def test_triton_skips_the_chunked_paths_cells_and_equals_attention_with_them_masked(kind, field, t, docs):
    q, k, v, gen = _inputs(3 + t, b=1, h=2, t=t, d=16)
    phi = _fields(kind, 1, 2, t, gen)[field]
    seg = torch.tensor([[0] * 100 + [1] * (t - 140) + [2] * 40]) if docs else None
    x32 = [x.float() for x in (q, k, v, phi)]
    with skip_counts() as counts:
        out, grads = _grads(_triton(*x32, kind, block_size=64, segment_ids=seg), x32)
    # The same cells as the chunked path at block size SKIP_CELL (decided there in float64).
    with skip_counts() as chunked_counts:
        chunked_fpa_attention(q, k, v, phi, kind=kind, block_size=CELL, segment_ids=seg, skip_epsilon=EPS)
    assert (counts.kept, counts.skipped) == (chunked_counts.kept, chunked_counts.skipped)
    if field == "sawtooth":  # built so that the cells a dip separates from their queries go
        assert counts.skipped >= counts.total / 3 > 0
    keep = tile_keep_map(*x32[:2], x32[3], resolve_kind(kind), q.shape[-1] ** -0.5, CELL, EPS, seg)
    assert int((keep == 0).sum()) == counts.skipped
    skip = _pair_skips(keep, 1, 2, t)
    ref_out, ref_grads = _grads(
        lambda *a: _masked_attention(*a, kind, q.shape[-1] ** -0.5, skip, seg), (q, k, v, phi)
    )
    torch.testing.assert_close(out, ref_out.float(), rtol=1e-4, atol=2e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r.float(), rtol=1e-3, atol=1e-4)  # a skipped cell has no gradient
    full = tk.fpa_attention_triton(*x32, kind=kind, block_size=64, segment_ids=seg)
    assert (out - full).abs().max() <= 2 * EPS * v.abs().max() + 1e-5
    if counts.skipped == 0:
        assert torch.equal(out, full)


def test_the_map_is_the_bound_evaluated_by_hand():
    q, k, v, gen = _inputs(21, b=1, h=2, t=2 * CELL + 40, d=8)
    phi = _sawtooth_walk(1, 2, q.shape[-2], gen, depth=4.0, period=50)
    scale = q.shape[-1] ** -0.5
    hand, n_hand = _hand_skips(q, k, phi, "fpa", scale, CELL, EPS)
    keep = tile_keep_map(q.float(), k.float(), phi.float(), resolve_kind("fpa"), scale, CELL, EPS)
    assert 0 < n_hand < 3 * 2  # some of the 3 cross cells of each head go, not all
    assert torch.equal(_pair_skips(keep, 1, 2, q.shape[-2]), hand)


def _skipped_tiles(name: str, tile: tuple[int, int], t: int, keep: torch.Tensor) -> int:
    """Tiles kernel `name` would visit that lie in skipped cells, from its loops: fwd and dq walk the far key
    tiles below each query tile's aligned 2^LG block, dk/dv the far query tiles above each key tile's."""
    bm, bn = tile
    lg = max(bm, bn).bit_length() - 1
    n = 0
    if name in ("fwd", "dq"):
        for m0 in range(0, t, bm):
            for n0 in range(0, (m0 >> lg) << lg, bn):
                n += int((keep[:, m0 // CELL, n0 // CELL] == 0).sum())
    else:
        for n0 in range(0, t, bn):
            for m0 in range(((n0 >> lg) << lg) + (1 << lg), t, bm):
                n += int((keep[:, m0 // CELL, n0 // CELL] == 0).sum())
    return n


TILE_SETS = [
    {"fwd": (32, 64), "dq": (64, 32), "dkv": (32, 128)},
    {"fwd": (128, 64), "dq": (128, 128), "dkv": (128, 32)},
]


def test_the_kernels_skip_the_same_pairs_whatever_tiles_they_run():
    kind, t = "fpa", 3 * CELL + 32
    q, k, v, gen = _inputs(5, b=1, h=2, t=t, d=16)
    phi = _fields(kind, 1, 2, t, gen)["sawtooth"]
    x32 = [x.float() for x in (q, k, v, phi)]
    keep = tile_keep_map(*x32[:2], x32[3], resolve_kind(kind), q.shape[-1] ** -0.5, CELL, EPS)
    assert 0 < int((keep == 0).sum()) < 2 * 6  # some cross cells go, some stay
    results = []
    for tiles in TILE_SETS:
        counter = torch.zeros(3, dtype=torch.int32)
        fn = _triton(*x32, kind, tiles=tiles, tile_counter=counter)
        results.append(_grads(fn, x32))
        for name, slot in tk.COUNTER_SLOTS.items():
            expected = tk.visited_tiles(name, tiles[name], t) * 2 - _skipped_tiles(name, tiles[name], t, keep)
            assert int(counter[slot]) == expected, (name, tiles[name])
    (out0, g0), rest = results[0], results[1:]
    for out, grads in rest:
        torch.testing.assert_close(out, out0, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads, g0):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["fpa", "fox"])
def test_a_cell_just_above_the_threshold_is_kept_and_just_below_skipped(kind):
    """q = 0 makes every logit its bias: a dip of depth tau -+ 1e-3 at the start of cell 1 erases the keys
    of cell 0 for every query of cell 1 by that depth, just short of or just past the threshold."""
    t = 2 * CELL
    tau = math.log(t / EPS)
    q = torch.zeros(1, 1, t, 16)
    k = torch.randn(1, 1, t, 16, generator=torch.Generator().manual_seed(3))
    v = torch.randn(1, 1, t, 16, generator=torch.Generator().manual_seed(4))
    for depth, skipped in ((tau - 1e-3, 0), (tau + 1e-3, 1)):
        phi = torch.zeros(1, 1, t)
        if kind == "fpa":
            phi[..., CELL] = -depth
        else:
            phi[..., CELL:] = -depth
        counter = torch.zeros(3, dtype=torch.int32)
        with skip_counts() as counts:
            tk.fpa_attention_triton(
                q, k, v, phi, kind=kind, block_size=64, tile_counter=counter, skip_epsilon=EPS
            )
        assert (counts.skipped, counts.total) == (skipped, 1)
        # fwd: query tiles 2, 3 each visit the 2 far key tiles of cell 0 unless it is skipped
        assert int(counter[0]) == tk.visited_tiles("fwd", (64, 64), t) - 4 * skipped
    # Skipped at depth tau + 1e-3, every key of cell 0 still weighs e^-depth ~ eps / T in the rows of cell 1:
    # a mass of about eps / 2 per row, well above float32 rounding. The kernels' output and gradients are
    # those of attention without these pairs, and measurably not those of the unskipped kernels.
    x = (q, k, v, phi)
    run = _triton(*x, kind, block_size=64)
    out, grads = _grads(run, x)
    full, full_grads = _grads(lambda *a: tk.fpa_attention_triton(*a, kind=kind, block_size=64), x)
    skip = torch.zeros(1, 1, t, t, dtype=torch.bool)
    skip[..., CELL:, :CELL] = True
    ref, ref_grads = _grads(lambda *a: _masked_attention(*a, kind, 0.25, skip), [a.double() for a in x])
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-6)
    assert (out - full).abs().max() > 50 * 1e-6
    for name, g, r, f in zip("qkvp", grads, ref_grads, full_grads):
        torch.testing.assert_close(g, r.float(), rtol=1e-5, atol=1e-6)
        if name in "vp":  # dk is 0 with q = 0
            assert (g - f).abs().max() > 50 * 1e-6, name


def test_skipping_off_and_softmax_are_the_kernels_as_they_were():
    q, k, v, gen = _inputs(8, b=1, h=2, t=2 * CELL + 16, d=16)
    phi = _sawtooth_walk(1, 2, q.shape[-2], gen).float()
    q, k, v = q.float(), k.float(), v.float()
    base = tk.fpa_attention_triton(q, k, v, None, kind="softmax", block_size=64)
    with skip_counts() as counts:
        soft = tk.fpa_attention_triton(q, k, v, None, kind="softmax", block_size=64, skip_epsilon=0.1)
    assert torch.equal(soft, base) and counts.total == 0  # no field: nothing decided or skipped
    off = tk.fpa_attention_triton(q, k, v, phi, block_size=64)
    assert torch.equal(tk.fpa_attention_triton(q, k, v, phi, block_size=64, skip_epsilon=None), off)
    with pytest.raises(ValueError, match="skip_epsilon"):
        tk.fpa_attention_triton(q, k, v, phi, block_size=64, skip_epsilon=-1.0)


def test_dispatch_and_the_compiled_op_skip_as_the_kernel():
    """fpa_attention(impl="triton") (the kernel entry point, autotuned tiles) and the torch.library op (its
    backward makes the map again from the same inputs) skip the same cells, with the same results."""
    q, k, v, gen = _inputs(13, b=1, h=1, t=2 * CELL + 32, d=16)
    phi = _sawtooth_walk(1, 1, q.shape[-2], gen)
    x32 = [x.float() for x in (q, k, v, phi)]
    with skip_counts() as counts:
        direct, g_direct = _grads(lambda *a: fpa_attention(*a, impl="triton", skip_epsilon=EPS), x32)
    assert counts.skipped > 0
    with skip_counts() as op_counts:
        via_op, g_op = _grads(lambda *a: library_attention(*a, impl="triton", skip_epsilon=EPS), x32)
    assert op_counts.skipped == counts.skipped
    assert torch.equal(via_op, direct)
    for a, b in zip(g_op, g_direct):
        assert torch.equal(a, b)
