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
