"""Properties of First Passage Attention (docs/design.md) on the oracle and on the chunked path.

The chunked path's bias is read back from its attention weights: with q = 0 the logits are the bias
alone, and with v = identity the output row i is softmax_j(b_ij), so b_ij = log out_ij - log out_ii.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fpa_model.ops.fpa.chunked import chunked_fpa_attention
from fpa_model.ops.fpa.naive import fpa_attention_naive, fpa_bias_naive


def _chunked_bias(phi: torch.Tensor, kind: str = "fpa", block_size: int = 4) -> torch.Tensor:
    """The (B, H, T, T) bias the chunked path applies, read back through its output (lower triangle)."""
    b, h, t = phi.shape
    q = torch.zeros(b, h, t, 1, dtype=torch.float64)
    k = torch.zeros(b, h, t, 1, dtype=torch.float64)
    v = torch.eye(t, dtype=torch.float64).expand(b, h, t, t)
    w = chunked_fpa_attention(q, k, v, phi.double(), kind=kind, block_size=block_size)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    bias = w.log() - w.diagonal(dim1=-2, dim2=-1).log().unsqueeze(-1)
    return bias.masked_fill(~causal, float("-inf"))


def _walk(b, h, t, seed, std=0.5):
    return (torch.randn(b, h, t, generator=torch.Generator().manual_seed(seed)) * std).cumsum(-1)


def test_chunked_bias_readback_matches_the_oracle():
    phi = _walk(2, 2, 29, seed=0)
    for bs in (1, 4, 16):
        torch.testing.assert_close(
            _chunked_bias(phi, block_size=bs).float(), fpa_bias_naive(phi), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("source", ["naive", "chunked"])
def test_sticky_erasure(source):
    """For a fixed key j, b_ij never increases with i: an erased key stays erased even if phi recovers."""
    phi = _walk(2, 3, 40, seed=1)
    bias = fpa_bias_naive(phi) if source == "naive" else _chunked_bias(phi, block_size=8).float()
    lower = torch.ones(40, 40, dtype=torch.bool).tril()
    nxt = bias[..., 1:, :]  # row i + 1
    cur = bias[..., :-1, :]
    valid = lower[:-1, :]  # j <= i
    tol = 0.0 if source == "naive" else 1e-6
    assert bool((nxt[..., valid] <= cur[..., valid] + tol).all())
    assert bool((bias[..., lower] <= tol).all()), "b_ij <= 0"
    # and a recovered field does not bring the key back: b stays at its lowest dip
    torch.testing.assert_close(bias[..., -1, :][..., :1], (phi.min(-1).values - phi[..., 0]).unsqueeze(-1))


@pytest.mark.parametrize("block_size", [1, 2, 4], ids=lambda b: f"bs{b}")
def test_old_key_in_a_valley_survives_younger_ridge_keys_do_not(block_size):
    #        0    1    2    3    4    5 (query)
    phi = torch.tensor([0.0, 3.0, 4.0, 1.0, 2.0, 2.5]).view(1, 1, 6)
    want = torch.tensor([0.0, -2.0, -3.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(fpa_bias_naive(phi)[0, 0, 5], want)
    torch.testing.assert_close(
        _chunked_bias(phi, block_size=block_size)[0, 0, 5].float(), want, atol=1e-6, rtol=0
    )
    # FoX cannot: with any non-increasing field its bias is monotone in age (older <= younger).
    gate = torch.nn.functional.logsigmoid(
        torch.randn(3, 2, 30, generator=torch.Generator().manual_seed(2))
    ).cumsum(-1)
    fox = fpa_bias_naive(gate, "fox")
    lower = torch.ones(30, 30, dtype=torch.bool).tril(-1)  # j + 1 <= i
    assert bool((fox[..., :, :-1][..., lower[:, 1:]] <= fox[..., :, 1:][..., lower[:, 1:]]).all())


def _field_for_subset(alive: set[int], t: int, threshold: float) -> torch.Tensor:
    """A 1-D field rising along the alive set, each non-member above the next member by > threshold."""
    members = sorted(alive)
    phi = torch.zeros(t)
    for rank, j in enumerate(members):
        phi[j] = float(rank)
    for j in range(t):
        if j not in alive:
            nxt = next(m for m in members if m > j)
            phi[j] = phi[nxt] + threshold + 1.0
    return phi


def test_subset_realizability_every_subset():
    """With q.k constant, any subset S containing the query can be made the alive set by a 1-D field."""
    t, threshold = 8, 5.0
    for bits in itertools.product([0, 1], repeat=t - 1):
        alive = {j for j, bit in enumerate(bits) if bit} | {t - 1}
        b = fpa_bias_naive(_field_for_subset(alive, t, threshold).view(1, 1, t))[0, 0, t - 1]
        got = {j for j in range(t) if b[j] > -threshold}
        assert got == alive, (sorted(alive), b.tolist())
        assert all(b[j] == 0 for j in alive)


@pytest.mark.parametrize("block_size", [2, 3, 16], ids=lambda b: f"bs{b}")
def test_subset_realizability_on_the_chunked_path(block_size):
    t, threshold = 13, 5.0
    g = torch.Generator().manual_seed(block_size)
    for _ in range(6):
        alive = {j for j in range(t - 1) if torch.rand((), generator=g) < 0.5} | {t - 1}
        phi = _field_for_subset(alive, t, threshold).view(1, 1, t)
        b = _chunked_bias(phi, block_size=block_size)[0, 0, t - 1]
        assert {j for j in range(t) if b[j] > -threshold} == alive
        # the attention weights (q.k constant): equal on the alive set, < e^-threshold elsewhere
        w = b.exp() / b.exp().sum()
        assert float(w[sorted(alive)].std()) < 1e-9 if len(alive) > 1 else True
        assert all(
            float(w[j]) < float(w[t - 1]) * torch.exp(torch.tensor(-threshold))
            for j in range(t)
            if j not in alive
        )


@pytest.mark.parametrize("kind", ["fpa", "fox", "softmax"])
@pytest.mark.parametrize("block_size", [7, 16], ids=lambda b: f"bs{b}")
def test_future_keys_have_no_influence(kind, block_size):
    """Perturb k, v, phi after position c: outputs up to c are bit-identical and no gradient flows from
    them to the future positions."""
    g = torch.Generator().manual_seed(3)
    b, h, t, d, c = 2, 2, 70, 8, 37
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    phi = torch.randn(b, h, t, generator=g).cumsum(-1)
    k2, v2, phi2 = k.clone(), v.clone(), phi.clone()
    k2[..., c + 1 :, :] = torch.randn(b, h, t - c - 1, d, generator=g) * 3
    v2[..., c + 1 :, :] = torch.randn(b, h, t - c - 1, d, generator=g) * 3
    phi2[..., c + 1 :] = torch.randn(b, h, t - c - 1, generator=g) * 10  # deep dips in the future
    w = torch.randn(b, h, c + 1, d, generator=g)

    def run(k, v, phi):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, phi)]
        out = chunked_fpa_attention(*leaves, kind=kind, block_size=block_size)
        grads = torch.autograd.grad((out[..., : c + 1, :] * w).sum(), leaves, allow_unused=True)
        return out.detach(), [torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads)]

    (o1, g1), (o2, g2) = run(k, v, phi), run(k2, v2, phi2)
    assert torch.equal(o1[..., : c + 1, :], o2[..., : c + 1, :])
    for a, bb in zip(g1, g2):
        assert (
            torch.equal(a[..., : c + 1], bb[..., : c + 1])
            if a.dim() == 3
            else torch.equal(a[..., : c + 1, :], bb[..., : c + 1, :])
        )
    for gr in g1[1:]:
        future = gr[..., c + 1 :] if gr.dim() == 3 else gr[..., c + 1 :, :]
        assert bool((future == 0).all())


class _MaxTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) any aten op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.max_numel = max(self.max_numel, x.numel())
        return out


def _largest_tensor(fn, t: int, kind: str = "fpa") -> int:
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(1, 1, t, 16, generator=g, requires_grad=True) for _ in range(3))
    phi = torch.randn(1, 1, t, generator=g).cumsum(-1).requires_grad_()
    with _MaxTensor() as m:
        out = fn(q, k, v, phi, kind=kind)
        out.backward(torch.ones_like(out))
    return m.max_numel


def test_no_t_by_t_tensor_and_linear_growth():
    """Every tensor the chunked forward + backward creates is O(T) (at most a few T x block); the naive
    oracle, checked the same way, does build T x T tensors (so the check can fail)."""
    bs = 64
    sizes = {}
    for t in (1024, 2048, 4096):
        sizes[t] = _largest_tensor(lambda *a, **kw: chunked_fpa_attention(*a, **kw, block_size=bs), t)
        assert sizes[t] <= 2 * t * bs, (t, sizes[t])
        assert sizes[t] <= t * t // 8
    assert sizes[4096] <= 2.2 * sizes[2048] and sizes[2048] <= 2.2 * sizes[1024], sizes
    assert _largest_tensor(fpa_attention_naive, 1024, kind="softmax") >= 1024 * 1024


def test_naive_matches_itself_through_block_reads():
    """Sanity of the readback helper: the oracle read back the same way gives its own bias."""
    phi = _walk(1, 1, 12, seed=4)
    q = torch.zeros(1, 1, 12, 1, dtype=torch.float64)
    v = torch.eye(12, dtype=torch.float64).view(1, 1, 12, 12)
    w = fpa_attention_naive(q, q, v, phi.double(), kind="fpa").double()
    bias = w.log() - w.diagonal(dim1=-2, dim2=-1).log().unsqueeze(-1)
    lower = torch.ones(12, 12, dtype=torch.bool).tril()
    torch.testing.assert_close(bias[..., lower].float(), fpa_bias_naive(phi)[..., lower], atol=1e-5, rtol=0)
