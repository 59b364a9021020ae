"""Document masking on packed sequences (segment_ids): the oracle against each document run alone, the
chunked path against the oracle (outputs and every gradient), the dispatcher's errors.

A window's documents must attend exactly as if each stood alone: no key of another document is seen, and
for fpa the range minimum runs over the document's own part of [j, i].
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fpa_model.ops.fpa import fpa_attention
from fpa_model.ops.fpa.chunked import chunked_fpa_attention
from fpa_model.ops.fpa.naive import fpa_attention_naive

KINDS = ("fpa", "fox", "softmax")


def segments_of(lengths: list[int]) -> torch.Tensor:
    """(T,) document ids for documents of these lengths, in order."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _inputs(b, h, t, d, *, seed=0, kind="fpa"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    u = torch.randn(b, h, t, generator=g)
    u = F.logsigmoid(u + 1.0) if kind == "fox" else u  # fox: a gate field
    dout = torch.randn(b, h, t, d, generator=g)
    return q, k, v, u, dout


def _run(fn, q, k, v, u, dout, kind):
    """Output and the gradients of q, k, v and the increments u (phi = cumsum(u), the model's field)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, u)]
    phi = leaves[3].cumsum(-1) if kind != "softmax" else None
    out = fn(*leaves[:3], phi)
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return [out.detach()] + [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


NAMES = ("out", "dq", "dk", "dv", "du")


def _close(got, want, atol=2e-5, rtol=2e-5):
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


# Ragged documents (length-1 ones too), boundaries inside tiles and on tile edges (blocks of 8 and 16),
# one document, only end-of-document tokens (each its own length-1 document).
LAYOUTS = {
    "ragged": [5, 1, 9, 1, 1, 14, 3, 6],
    "tile-edges": [16, 8, 8, 32],
    "one-doc": [40],
    "all-eod": [1] * 24,
    "long-short": [33, 1, 2, 12],
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_oracle_equals_each_document_alone(kind, layout):
    """The masked oracle on a packed row equals the oracle on each document alone: outputs and every
    gradient, the field's increments included (phi is one cumsum over the whole window, so a document
    alone sees phi shifted by a constant, which the bias does not feel)."""
    lengths = LAYOUTS[layout]
    t = sum(lengths)
    seg = segments_of(lengths)[None].expand(2, t)
    q, k, v, u, dout = _inputs(2, 2, t, 8, seed=1, kind=kind)
    packed = _run(
        lambda q, k, v, p: fpa_attention_naive(q, k, v, p, kind=kind, segment_ids=seg), q, k, v, u, dout, kind
    )
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        alone = _run(
            lambda q, k, v, p: fpa_attention_naive(q, k, v, p, kind=kind),
            q[..., sl, :], k[..., sl, :], v[..., sl, :], u[..., sl], dout[..., sl, :], kind,
        )  # fmt: skip
        # du also collects d phi of the later documents, which sums to 0 over each document (a bias only
        # depends on differences of phi): so du of a document alone is du inside the packed row too.
        got = [x[..., sl, :] for x in packed[:4]] + [packed[4][..., sl]]
        _close(got, alone)
        start += n


def _ragged(b, t, seed):
    """(B, T) ids of ragged documents (length-1 ones included), different per row."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        lengths, n = [], 0
        while n < t:
            x = int(torch.randint(1, 3, (1,), generator=g)) if torch.rand(1, generator=g) < 0.3 else 0
            x = x or int(torch.randint(1, 40, (1,), generator=g))
            lengths.append(min(x, t - n))
            n += lengths[-1]
        rows.append(segments_of(lengths))
    return torch.stack(rows)


CHUNKED_CASES = {
    # name: (segment ids (B, T), block sizes)
    "ragged": (lambda: _ragged(2, 96, 3), (8, 16, 32)),
    "tile-edges": (lambda: segments_of([16, 8, 8, 32, 16])[None].expand(2, -1), (8, 16)),
    "inside-tiles": (lambda: segments_of([5, 1, 9, 1, 1, 14, 3, 6, 24])[None].expand(2, -1), (8, 16)),
    "one-doc": (lambda: torch.zeros(2, 64, dtype=torch.long), (8, 32)),
    "all-eod": (lambda: torch.arange(48)[None].expand(2, -1), (8, 16)),
    "uneven-tail": (lambda: _ragged(2, 83, 5), (16,)),  # T not a multiple of the block
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(CHUNKED_CASES))
def test_chunked_with_documents_matches_the_oracle(kind, case):
    """Outputs and the gradients of q, k, v and the field's increments, for several tile sizes."""
    make, blocks = CHUNKED_CASES[case]
    seg = make()
    t = seg.shape[1]
    q, k, v, u, dout = _inputs(2, 2, t, 8, seed=7, kind=kind)
    want = _run(
        lambda q, k, v, p: fpa_attention_naive(q, k, v, p, kind=kind, segment_ids=seg), q, k, v, u, dout, kind
    )
    for bs in blocks:

        def fn(q, k, v, p, bs=bs):
            return chunked_fpa_attention(q, k, v, p, kind=kind, block_size=bs, segment_ids=seg)

        got = _run(fn, q, k, v, u, dout, kind)
        _close(got, want, atol=3e-5, rtol=3e-5)


def test_chunked_documents_decode_shape_and_huge_logits():
    """Queries the last Tq of the keys (decode shape), and logits big enough to take the exact path."""
    seg = _ragged(1, 70, 11)
    q, k, v, u, dout = _inputs(1, 2, 70, 8, seed=2)
    phi = u.cumsum(-1)
    for scale in (None, 40.0):  # 40: cross logits far above the diagonal's lse (exp overflow -> exact)
        want = fpa_attention_naive(q[..., 50:, :], k, v, phi, kind="fpa", scale=scale, segment_ids=seg)
        got = chunked_fpa_attention(
            q[..., 50:, :], k, v, phi, kind="fpa", scale=scale, block_size=8, segment_ids=seg
        )
        torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)


def test_chunked_skips_tiles_of_earlier_documents(monkeypatch):
    """Key tiles wholly in earlier documents are never computed: with 8 documents of one tile each only
    the diagonal tiles and the tiles a boundary falls into run, far fewer than all of them."""
    import fpa_model.ops.fpa.chunked as ch

    seen = []
    real = ch._cross_scores
    monkeypatch.setattr(
        ch, "_cross_scores", lambda qa, *a, **kw: seen.append(qa.shape[0]) or real(qa, *a, **kw)
    )
    t, bs = 128, 16
    q, k, v, u, dout = _inputs(1, 1, t, 8)
    aligned = segments_of([bs] * (t // bs))[None]
    chunked_fpa_attention(q, k, v, u.cumsum(-1), kind="fpa", block_size=bs, segment_ids=aligned)
    assert seen == []  # every document is one tile: no cross tile is visible
    shifted = segments_of([8] + [bs] * (t // bs - 1) + [8])[None]
    chunked_fpa_attention(q, k, v, u.cumsum(-1), kind="fpa", block_size=bs, segment_ids=shifted)
    assert sum(seen) == t // bs - 1  # only the first off-diagonal: each document spans two tiles


@pytest.mark.parametrize(
    "seg,match",
    [
        (torch.tensor([[0, 0, 1, 1, 0, 2, 2, 2]]), "non-decreasing"),
        (torch.zeros(1, 7, dtype=torch.long), "must be \\(B, Tk\\)"),
        (torch.zeros(1, 8), "integer tensor"),
    ],
    ids=["decreasing", "shape", "float"],
)
@pytest.mark.parametrize("impl", ["naive", "chunked"])
def test_bad_segment_ids_raise_one_line_errors(seg, match, impl):
    q = torch.zeros(1, 1, 8, 4)
    with pytest.raises(ValueError, match=match) as e:
        fpa_attention(q, q, q, torch.zeros(1, 1, 8), kind="fpa", impl=impl, segment_ids=seg)
    assert "\n" not in str(e.value)


def test_dispatch_passes_segment_ids_through():
    seg = _ragged(2, 40, 1)
    q, k, v, u, _ = _inputs(2, 2, 40, 8)
    phi = u.cumsum(-1)
    want = fpa_attention_naive(q, k, v, phi, kind="fpa", segment_ids=seg)
    got = fpa_attention(q, k, v, phi, kind="fpa", impl="auto", block_size=8, segment_ids=seg)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(fpa_attention(q, k, v, phi, kind="fpa", impl="chunked", block_size=8), want)


def test_auto_with_segment_ids_on_cpu_runs_the_masked_chunked_path():
    """impl="auto" with segment_ids off CUDA: the chunked path, equal to the oracle (on CUDA auto picks the
    Triton kernel, which takes the same ids: tests/test_fpa_triton.py)."""
    seg = _ragged(1, 24, 2)
    q, k, v, u, _ = _inputs(1, 2, 24, 8)
    phi = u.cumsum(-1)
    want = fpa_attention_naive(q, k, v, phi, kind="fpa", segment_ids=seg)
    got = fpa_attention(q, k, v, phi, kind="fpa", impl="auto", block_size=8, segment_ids=seg)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale", [None, 40.0], ids=["fast", "exact"])
def test_chunked_documents_mask_only_partial_tiles(monkeypatch, kind, scale):
    """Documents spanning several tiles: the tiles inside one document skip the mask (grouped apart from
    the partial ones, here one tile per step), and outputs and gradients still match the oracle, on the
    fast path (outputs and gradients) and on the exact one (scale 40: huge cross logits; outputs)."""
    import fpa_model.ops.fpa.chunked as ch

    monkeypatch.setattr(ch, "_TILE_ELEMS", 1)  # one tile per batched step
    masked = []
    real = ch._same_segment
    monkeypatch.setattr(
        ch, "_same_segment", lambda a, b: masked.append(a.shape[0] * a.shape[1]) or real(a, b)
    )
    seg = torch.stack([segments_of([37, 50, 3, 38]), segments_of([64, 40, 24])])
    q, k, v, u, dout = _inputs(2, 2, 128, 8, seed=4, kind=kind)
    want = _run(
        lambda q, k, v, p: fpa_attention_naive(q, k, v, p, kind=kind, scale=scale, segment_ids=seg),
        q, k, v, u, dout, kind,
    )  # fmt: skip
    got = _run(
        lambda q, k, v, p: chunked_fpa_attention(
            q, k, v, p, kind=kind, scale=scale, block_size=16, segment_ids=seg
        ),
        q, k, v, u, dout, kind,
    )  # fmt: skip
    if scale is None:
        _close(got, want, atol=3e-5, rtol=3e-5)
    else:  # near one-hot rows amplify rounding in the gradients (so in the unmasked path too): outputs only
        torch.testing.assert_close(got[0], want[0], atol=3e-5, rtol=3e-5)
    plan = ch._Plan(128, 128, 16, 4)
    steps = [g for _, groups in ch._segment_steps(ch._segment_blocks(seg, plan, 2), plan) for g in groups]
    assert {partial for *_, partial in steps} == {False, True}  # both kinds of cross tile
    cut = int(ch._diag_partial(ch._segment_blocks(seg, plan, 2)).sum())
    want_masks = 2 * (cut + sum(partial for *_, partial in steps))  # forward + backward
    assert len(masked) == (want_masks if scale is None else want_masks + sum(p for *_, p in steps))
    assert want_masks < 2 * (plan.n_blk + len(steps))  # fewer than the tiles visited
