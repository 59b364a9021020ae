"""The Triton FPA kernel against the naive oracle: outputs and every gradient (q, k, v, phi).

On a machine without CUDA these run under the Triton interpreter with CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before the kernels are defined); shapes stay tiny so the default run takes seconds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fpa_model.ops.fpa import triton_kernel as tk
from fpa_model.ops.fpa.naive import fpa_attention_naive
from fpa_model.ops.fpa.triton_kernel import MAX_HEAD_DIM, fpa_attention_triton

pytestmark = pytest.mark.triton  # the whole file reruns on Triton 3.6 (make test-triton36)
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


def make_field(u: torch.Tensor, field: str) -> torch.Tensor:
    """phi from raw per-token values u, the way the model builds it (cumsum happens outside the op)."""
    if field == "walk":
        return torch.cumsum(u, dim=-1)
    if field == "gate":
        return torch.cumsum(F.logsigmoid(u), dim=-1)
    if field == "direct":
        return u
    raise ValueError(field)


def make_inputs(b, h, t, d, *, dtype=torch.float32, field="walk", seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    # Increments around the FoX-like init (slightly negative) with enough spread to make real dips.
    u = (
        torch.randn(b, h, t, generator=g) * 0.7 - 0.1
        if field != "gate"
        else torch.randn(b, h, t, generator=g) + 2
    )
    do = torch.randn(b, h, t, d, generator=g)
    q, k, v, do = (x.to(device=device, dtype=dtype) for x in (q, k, v, do))
    return q, k, v, u.to(device), do


def run_with_grads(fn, q, k, v, u, do, field, **kw):
    """Output and grads w.r.t. q, k, v and the raw field values u (so autograd does the cumsum)."""
    q, k, v, u = (x.detach().clone().requires_grad_(True) for x in (q, k, v, u))
    phi = make_field(u, field)
    o = fn(q, k, v, phi, **kw)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad, u.grad


def reference(q, k, v, u, do, field, kind, scale=None):
    """The naive oracle in fp32 on the same (possibly bf16-rounded) inputs."""
    q32, k32, v32, do32 = (x.float() for x in (q, k, v, do))
    return run_with_grads(fpa_attention_naive, q32, k32, v32, u, do32, field, kind=kind, scale=scale)


def assert_all_close(got, ref, dtype, names=("out", "dq", "dk", "dv", "du")):
    atol, rtol = TOL[dtype]
    for name, a, b in zip(names, got, ref):
        if b is None:
            assert a is None or torch.count_nonzero(a) == 0, f"{name}: expected no gradient"
            continue
        assert a is not None, f"{name}: gradient missing"
        a = a.float()
        # Scale-aware tolerance: field gradients sum over many pairs and grow with T.
        scale = b.abs().max().item() + 1e-6
        err = (a - b).abs().max().item()
        assert err <= atol * max(scale, 1.0) + rtol * scale, (
            f"{name}: max err {err:.3g} (ref max {scale:.3g})"
        )


# (B, H, T, D, block): T not a multiple of the block, several heads, B > 1, D padded to a power of 2.
SHAPES = {
    "B1H1T16D16-blk16": (1, 1, 16, 16, 16),
    "B2H2T50D32-blk16": (2, 2, 50, 32, 16),
    "B1H2T97D16-blk16": (1, 2, 97, 16, 16),
    "B1H1T45D24-blk32": (1, 1, 45, 24, 32),
    "B1H1T70D16-autotune": (1, 1, 70, 16, None),
    "B1H1T1D8-blk16": (1, 1, 1, 8, 16),  # one token; D below the 16 tl.dot needs
    "B1H1T20D128-blk16": (1, 1, 20, 128, 16),  # the largest head dim
}
# Every kind and field mode on the multi-block, multi-batch shape; the two main kinds on every shape.
FP32_CASES = [
    (kind, field, "B2H2T50D32-blk16")
    for kind, field in [
        ("fpa", "walk"),
        ("fpa", "gate"),
        ("fpa", "direct"),
        ("fox", "gate"),
        ("softmax", "walk"),
    ]
]
FP32_CASES += [
    (kind, field, shape)
    for shape in SHAPES
    if shape != "B2H2T50D32-blk16"
    for kind, field in [("fpa", "walk"), ("fox", "gate")]
]
FP32_CASES.append(("softmax", "walk", "B1H2T97D16-blk16"))


@pytest.mark.parametrize("kind,field,shape", FP32_CASES, ids=[f"{k}-{f}-{s}" for k, f, s in FP32_CASES])
def test_matches_naive_fp32(kind, field, shape):
    b, h, t, d, block = SHAPES[shape]
    q, k, v, u, do = make_inputs(b, h, t, d, field=field, seed=t + d)
    got = run_with_grads(fpa_attention_triton, q, k, v, u, do, field, kind=kind, block_size=block)
    assert_all_close(got, reference(q, k, v, u, do, field, kind), torch.float32)


@pytest.mark.parametrize("kind,field", [("fpa", "walk"), ("fox", "gate"), ("softmax", "walk")])
def test_matches_naive_bf16(kind, field):
    q, k, v, u, do = make_inputs(1, 2, 40, 32, dtype=torch.bfloat16, field=field, seed=3)
    got = run_with_grads(fpa_attention_triton, q, k, v, u, do, field, kind=kind, block_size=16)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16
    assert_all_close(got, reference(q, k, v, u, do, field, kind), torch.bfloat16)


def test_custom_scale_and_strided_inputs():
    """q, k, v as (B, T, H, D).transpose(1, 2) views (the model's layout) and an explicit scale."""
    b, h, t, d = 1, 2, 37, 16
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(b, t, h, d, generator=g).to(DEVICE).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    u = torch.randn(b, h, t, generator=g).to(DEVICE) * 0.7
    do = torch.randn(b, h, t, d, generator=g).to(DEVICE)
    got = run_with_grads(fpa_attention_triton, q, k, v, u, do, "walk", kind="fpa", scale=0.3, block_size=16)
    assert_all_close(got, reference(q, k, v, u, do, "walk", "fpa", scale=0.3), torch.float32)


def test_fpa_with_gate_field_equals_fox():
    """phi = cumsum(logsigmoid) is non-increasing, so the range-min sits at i and FPA is exactly FoX."""
    q, k, v, u, do = make_inputs(1, 2, 50, 16, field="gate", seed=11)
    fpa = run_with_grads(fpa_attention_triton, q, k, v, u, do, "gate", kind="fpa", block_size=16)
    fox = run_with_grads(fpa_attention_triton, q, k, v, u, do, "gate", kind="fox", block_size=16)
    for name, a, b in zip(("out", "dq", "dk", "dv", "du"), fpa, fox):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # ...and a walk field that rises somewhere is not FoX.
    q, k, v, u, do = make_inputs(1, 2, 50, 16, field="walk", seed=11)
    fpa_o = fpa_attention_triton(q, k, v, make_field(u, "walk"), kind="fpa", block_size=16)
    fox_o = fpa_attention_triton(q, k, v, make_field(u, "walk"), kind="fox", block_size=16)
    assert (fpa_o - fox_o).abs().max() > 1e-2


def _lowest_argmin_bias(phi: torch.Tensor) -> torch.Tensor:
    """b_ij = phi[argmin over [j, i]] - phi_j, ties to the lowest index, built by gather (differentiable)."""
    bsz, h, t = phi.shape
    p = phi.detach()
    arg = torch.zeros(bsz, h, t, t, dtype=torch.long, device=phi.device)
    for i in range(t):
        cur_v = p[..., i].clone()
        cur_a = torch.full_like(cur_v, i, dtype=torch.long)
        arg[..., i, i] = cur_a
        for j in range(i - 1, -1, -1):
            take = p[..., j] <= cur_v  # going left, an equal value moves the argmin to the lower index
            cur_v = torch.where(take, p[..., j], cur_v)
            cur_a = torch.where(take, torch.full_like(cur_a, j), cur_a)
            arg[..., i, j] = cur_a
    rmin = phi.gather(-1, arg.view(bsz, h, t * t)).view(bsz, h, t, t)
    causal = torch.ones(t, t, dtype=torch.bool, device=phi.device).tril()
    return (rmin - phi[..., None, :]).masked_fill(~causal, float("-inf"))


def test_tie_rule_routes_to_lowest_index():
    """A field with many equal values (also across block boundaries): the field gradient goes to the
    lowest index among equal minima: diagonal tile, prefix-min, suffix-min and the between-blocks M."""
    b, h, t, d = 1, 2, 60, 16
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(b, h, t, d, generator=g).to(DEVICE) for _ in range(4))
    # Values in {1, 2, 3}: blocks 1..3 (block 16) share the minimum 1, so M ties with P and the block
    # minima tie with each other; block 0 stays >= 2 so M (not S) wins for it and its ties with P matter.
    phi = torch.randint(1, 4, (b, h, t), generator=g).float()
    phi[..., :16] = torch.randint(2, 4, (b, h, 16), generator=g).float()
    phi = phi.to(DEVICE)
    got = run_with_grads(fpa_attention_triton, q, k, v, phi, do, "direct", kind="fpa", block_size=16)

    def ref_fn(q, k, v, phi):
        logits = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(d) + _lowest_argmin_bias(phi)
        return torch.einsum("bhij,bhjd->bhid", torch.softmax(logits, -1), v)

    ref = run_with_grads(ref_fn, q, k, v, phi, do, "direct")
    assert_all_close(got, ref, torch.float32)
    # The oracle's cummin-based gradient may route ties elsewhere; the values must agree regardless.
    torch.testing.assert_close(got[0], fpa_attention_naive(q, k, v, phi, kind="fpa"), atol=2e-5, rtol=2e-5)


def test_softmax_without_field_and_phi_grad_dtype():
    q, k, v, u, do = make_inputs(1, 1, 20, 16, seed=2)
    o = fpa_attention_triton(q, k, v, None, kind="softmax", block_size=16)
    torch.testing.assert_close(o, fpa_attention_naive(q, k, v, None, kind="softmax"), atol=2e-5, rtol=2e-5)
    # A bf16 field gets a bf16 gradient (the kernel computes it in fp32).
    phi = torch.cumsum(u, -1).to(torch.bfloat16).requires_grad_(True)
    fpa_attention_triton(q, k, v, phi, kind="fpa", block_size=16).backward(do)
    assert phi.grad is not None and phi.grad.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "case,match",
    [
        ("kind", "unknown attention kind"),
        ("tq_ne_tk", "Tq == Tk"),
        ("head_dim", "head dim 192"),
        ("phi_shape", "phi must be"),
        ("no_phi", "needs a field phi"),
        ("block", "power of 2"),
        ("dtype", "share one dtype"),
    ],
)
def test_bad_input_gives_clear_error(case, match):
    q = torch.zeros(1, 2, 8, 16, device=DEVICE)
    k = v = q
    phi = torch.zeros(1, 2, 8, device=DEVICE)
    kw: dict = {"kind": "fpa"}
    if case == "kind":
        kw["kind"] = "linear"
    elif case == "tq_ne_tk":
        q = q[:, :, :4]
    elif case == "head_dim":
        q = k = v = torch.zeros(1, 2, 8, 192, device=DEVICE)
    elif case == "phi_shape":
        phi = phi[..., :7]
    elif case == "no_phi":
        phi = None
    elif case == "block":
        kw["block_size"] = 24
    elif case == "dtype":
        k = k.double()
    with pytest.raises(ValueError, match=match):
        fpa_attention_triton(q, k, v, phi, **kw)
    assert MAX_HEAD_DIM == 128


@pytest.mark.slow
@pytest.mark.parametrize("kind,field", [("fpa", "walk"), ("fpa", "direct")])
def test_matches_naive_longer(kind, field):
    q, k, v, u, do = make_inputs(1, 2, 160, 64, field=field, seed=13)
    got = run_with_grads(fpa_attention_triton, q, k, v, u, do, field, kind=kind, block_size=32)
    assert_all_close(got, reference(q, k, v, u, do, field, kind), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind,field", [("fpa", "walk"), ("fox", "gate"), ("softmax", "walk")])
def test_gpu_autotuned_matches_naive(kind, field, d, dtype):
    q, k, v, u, do = make_inputs(2, 3, 1000, d, dtype=dtype, field=field, seed=d)
    got = run_with_grads(fpa_attention_triton, q, k, v, u, do, field, kind=kind, fp32_precision="ieee")
    assert_all_close(got, reference(q, k, v, u, do, field, kind), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_tf32_default_close_to_naive():
    """fp32 inputs take TF32 tensor-core dots by default: ~1e-3 relative, not the 2e-5 of IEEE fp32."""
    q, k, v, u, do = make_inputs(1, 2, 1000, 64, field="walk", seed=5)
    got = run_with_grads(fpa_attention_triton, q, k, v, u, do, "walk", kind="fpa")
    ref = reference(q, k, v, u, do, "walk", "fpa")
    for name, a, b in zip(("out", "dq", "dk", "dv", "du"), got, ref):
        err = (a - b).abs().max().item() / (b.abs().max().item() + 1e-6)
        assert err < 5e-3, f"{name}: relative error {err:.3g} with TF32 dots"


def _tile_combos() -> list[tuple[str, dict, int]]:
    """Each kernel on a different entry of its GPU autotune list, every entry used at least once, plus
    the split that gave a wrong field gradient before the routing was made tile-independent."""
    fwd, dq, dkv = (tk.GPU_TILES[n] for n in ("fwd", "dq", "dkv"))
    combos = [
        (f"gpu{i}", {"fwd": fwd[i % len(fwd)], "dq": dq[i % len(dq)], "dkv": dkv[(i + 1) % len(dkv)]}, 300)
        for i in range(max(len(fwd), len(dq), len(dkv)))
    ]
    combos.append(("dq16-dkv32", {"fwd": (16, 16), "dq": (16, 16), "dkv": (32, 32)}, 64))
    combos.append(("dq128x16-dkv16x128", {"fwd": (16, 128), "dq": (128, 16), "dkv": (16, 128)}, 200))
    return combos


TILE_COMBOS = _tile_combos()


@pytest.mark.parametrize("name,tiles,t", TILE_COMBOS, ids=[c[0] for c in TILE_COMBOS])
def test_any_tiles_per_kernel_match_naive(name, tiles, t):
    """The autotuner picks each kernel's tiles on its own: whatever it picks, the outputs and every
    gradient (the field's included) equal the oracle. T spans several far tiles of the largest tiles."""
    assert tk.Tile(*tiles["dq"]) != tk.Tile(*tiles["dkv"]), "the point is different tiles per kernel"
    q, k, v, u, do = make_inputs(1, 1, t, 16, field="walk", seed=t)
    got = run_with_grads(fpa_attention_triton, q, k, v, u, do, "walk", kind="fpa", tiles=tiles)
    assert_all_close(got, reference(q, k, v, u, do, "walk", "fpa"), torch.float32)


def test_head_dim_128_tiles_match_naive():
    """Head dim 128 with its own list's first entries, each kernel on a different one (dk/dv on 16 x 64, the
    tile whose query loops stop hoisting addresses at this size): outputs and every gradient equal the
    oracle."""
    tiles = {name: tk.GPU_TILES_BY_DIM[name][128][0] for name in ("fwd", "dq", "dkv")}
    assert tiles["dkv"] == tk.Tile(16, 64, 8, 2) and tiles["dq"] != tiles["dkv"]
    q, k, v, u, do = make_inputs(1, 1, 160, 128, field="walk", seed=3)
    got = run_with_grads(fpa_attention_triton, q, k, v, u, do, "walk", kind="fpa", tiles=tiles)
    assert_all_close(got, reference(q, k, v, u, do, "walk", "fpa"), torch.float32)


def test_any_tiles_with_ties_match_tie_rule():
    """Tie-heavy field on mismatched tiles: the field gradient still follows the lowest-index rule."""
    b, h, t, d = 1, 2, 70, 16
    g = torch.Generator().manual_seed(8)
    q, k, v, do = (torch.randn(b, h, t, d, generator=g).to(DEVICE) for _ in range(4))
    phi = torch.randint(1, 4, (b, h, t), generator=g).float().to(DEVICE)
    tiles = {"fwd": (32, 16), "dq": (16, 64), "dkv": (64, 16)}
    got = run_with_grads(fpa_attention_triton, q, k, v, phi, do, "direct", kind="fpa", tiles=tiles)

    def ref_fn(q, k, v, phi):
        logits = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(d) + _lowest_argmin_bias(phi)
        return torch.einsum("bhij,bhjd->bhid", torch.softmax(logits, -1), v)

    assert_all_close(got, run_with_grads(ref_fn, q, k, v, phi, do, "direct"), torch.float32)


def test_backward_is_deterministic():
    """No atomics: two backward passes give the same bits (the field gradient included)."""
    q, k, v, u, do = make_inputs(1, 2, 90, 16, field="walk", seed=4)
    a = run_with_grads(fpa_attention_triton, q, k, v, u, do, "walk", kind="fpa", tiles={"dq": (16, 32)})
    b = run_with_grads(fpa_attention_triton, q, k, v, u, do, "walk", kind="fpa", tiles={"dq": (16, 32)})
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    "tiles,match",
    [
        ({"dq": (24, 16)}, "power of 2"),
        ({"dq": (256, 16)}, "power of 2"),
        ({"bwd": (16, 16)}, "unknown kernel"),
    ],
)
def test_bad_tiles_give_clear_error(tiles, match):
    q = torch.zeros(1, 1, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        fpa_attention_triton(q, q, q, torch.zeros(1, 1, 8, device=DEVICE), tiles=tiles)


@pytest.mark.slow
def test_kernels_compile_for_hopper_and_ampere(tmp_path):
    """The interpreter does not check what the GPU compiler checks (constexpr shapes, layouts, loop-carried
    types, register spills): compile one GPU tile of every kernel for sm_90 and sm_80 with the bundled
    ptxas (bench/kernel_resources.py, which tabulates every config, in its quick mode), the causal kernels
    plain and with segment ids and tile skipping both on."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "res.json"
    cmd = [sys.executable, "bench/kernel_resources.py", "--quick", "--json", str(out)]
    # The limit only catches a hung compiler: `make test` reruns this at idle CPU priority beside the suite,
    # where a wall-clock limit also counts the time the suite starves it (600 s was once exceeded so).
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=2400)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("no ptxas bundled with this triton")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    kernels = {row["kernel"] for row in rows}
    assert kernels == {*tk.KERNEL_NAMES, "levels", "route"}, kernels
    assert {row["arch"] for row in rows} == {"sm_90", "sm_80"}
    assert {row["kernel"] for row in rows if row["segmented"]} == {"fwd", "dq", "dkv"}
    assert {row["kernel"] for row in rows if row["skipping"]} == {"fwd", "dq", "dkv"}
    for row in rows:  # --quick compiles the head-dim-64 lists' first entries: none may spill unsegmented
        assert 0 < row["registers"] <= 255, row
        # With segment ids the fwd 128 x 64 tile spills a little on sm_80 (docs/kernel_resources.md).
        assert row["segmented"] or row["spill_bytes"] == 0, row


def test_bench_skips_cleanly_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    if HAS_CUDA:
        pytest.skip("has CUDA: the bench would run for real")
    # In process: `make test` reruns this file at idle CPU priority beside the suite, where a subprocess's
    # torch import alone was once starved past a 120 s limit.
    from bench import kernel

    assert kernel.main([]) == 0
    assert "no CUDA device: skipping" in capsys.readouterr().out


def test_tie_rule_matches_chunked_path():
    """The tie rule is shared with chunked.py: same field gradient on a tie-heavy field and other tiles."""
    chunked = pytest.importorskip("fpa_model.ops.fpa.chunked").chunked_fpa_attention
    b, h, t, d = 1, 2, 60, 16
    g = torch.Generator().manual_seed(6)
    q, k, v, do = (torch.randn(b, h, t, d, generator=g).to(DEVICE) for _ in range(4))
    phi = torch.randint(1, 4, (b, h, t), generator=g).float().to(DEVICE)
    got = run_with_grads(fpa_attention_triton, q, k, v, phi, do, "direct", kind="fpa", block_size=16)
    ref = run_with_grads(chunked, q, k, v, phi, do, "direct", kind="fpa", block_size=8)
    assert_all_close(got, ref, torch.float32)


@pytest.mark.slow
def test_bf16_large_field_keeps_precision():
    """bf16 inputs with a field near 1e4 (fp32 inside the kernel): the kernel tracks a float64 oracle on
    the same values; min - phi_j cancels two numbers near 1e4 (a bf16 field: off by whole logits)."""
    b, h, t, d = 1, 1, 512, 16
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(b, h, t, d, generator=g).bfloat16().to(DEVICE) for _ in range(4))
    u = torch.randn(b, h, t, generator=g) * 0.7 - 0.1  # a walk with dips of a few units ...
    u[..., 0] -= 1e4  # ... around -1e4: fp32 keeps steps of 1e-3 there, bf16 steps of 64
    u = u.to(DEVICE)
    got = run_with_grads(fpa_attention_triton, q, k, v, u, do, "walk", kind="fpa", tiles={"dq": (64, 16)})
    ref = run_with_grads(
        fpa_attention_naive, *(x.double() for x in (q, k, v)), u.double(), do.double(), "walk", kind="fpa"
    )
    assert make_field(u, "walk").abs().min() > 9e3
    for name, a, r in zip(("out", "dq", "dk", "dv", "du"), got, ref):
        err = (a.double() - r).abs().max().item() / r.abs().max().item()
        assert err < 3e-2, f"{name}: relative error {err:.3g}"


def _levels_oracle(phi: torch.Tensor, nlev: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PRE / SUF by cummin over each level's aligned segments."""
    n, t = phi.shape
    pre, suf = phi.new_empty((n, nlev, t)), phi.new_empty((n, nlev, t))
    for h in range(nlev):
        seg = min(1 << h, t)
        padded = -(-t // seg) * seg
        x = F.pad(phi, (0, padded - t), value=math.inf).view(n, padded // seg, seg)
        pre[:, h] = x.cummin(-1).values.view(n, padded)[:, :t]
        suf[:, h] = x.flip(-1).cummin(-1).values.flip(-1).view(n, padded)[:, :t]
    return pre, suf


def _route_oracle(phi, pre, suf, row_r, col_r) -> torch.Tensor:
    """Each ROWR[h, i] to the lowest argmin of phi over [segment start, i], each COLR[h, j] to the lowest
    argmin over [j, segment end], by an explicit scatter."""
    n, nlev, t = pre.shape
    out = torch.zeros(n, t, dtype=torch.float64)
    for r in range(n):
        for h in range(nlev):
            seg = 1 << h
            for i in range(t):
                s0, s1 = (i // seg) * seg, min((i // seg + 1) * seg, t)
                window = phi[r, s0 : i + 1]
                out[r, s0 + int(torch.nonzero(window == window.min())[0])] += float(row_r[r, h, i])
                window = phi[r, i:s1]
                out[r, i + int(torch.nonzero(window == window.min())[0])] += float(col_r[r, h, i])
    return out


@triton.jit
def _scan_probe_kernel(
    X, F, MIN_OUT, SUM_OUT, FLAG_OUT, R: tl.constexpr, C: tl.constexpr, AXIS: tl.constexpr
):
    """Both segmented combines of the field kernels over an (R, C) block along AXIS, in both directions."""
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    x, f = tl.load(X + offs), tl.load(F + offs)
    v, g = tl.associative_scan((x, f), AXIS, tk._seg_min)
    tl.store(MIN_OUT + offs, v)
    tl.store(FLAG_OUT + offs, g)
    v, g = tl.associative_scan((x, f), AXIS, tk._seg_sum, reverse=True)
    tl.store(SUM_OUT + offs, v)


def _segmented_scan_oracle(x: np.ndarray, f: np.ndarray, axis: int, op, reverse: bool) -> np.ndarray:
    """Element by element, as the interpreter's own fallback scans: a set flag restarts the segment."""
    x, f = np.moveaxis(x, axis, -1), np.moveaxis(f, axis, -1)
    out = np.empty_like(x)
    order = range(x.shape[-1] - 1, -1, -1) if reverse else range(x.shape[-1])
    for r in range(x.shape[0]):
        acc = None
        for i in order:
            acc = x[r, i] if acc is None or f[r, i] else op(acc, x[r, i])
            out[r, i] = acc
    return np.moveaxis(out, -1, axis)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's scan (fpa_model/ops/fpa/interpreter.py)")
@pytest.mark.parametrize("axis", [0, 1])
def test_interpreter_log_step_scan_equals_sequential_scan(axis):
    """The log-step scan installed for the interpreter gives the element-by-element scan's minima and
    flags exactly, and its sums to float rounding (reassociated), on 2-D blocks along either axis, with
    segments of every length (a flag at the first element, runs crossing the block's middle)."""
    from triton.runtime.interpreter import ScanOps

    from fpa_model.ops.fpa.interpreter import _log_step_scan

    assert ScanOps.generic_scan is _log_step_scan
    g = np.random.default_rng(axis)
    shape = (4, 64)
    x = g.standard_normal(shape).astype(np.float32)
    x[0, :7] = 1.0  # ties
    f = (g.random(shape) < 0.15).astype(np.int32)
    f[1] = 0  # one segment per line
    outs = [torch.empty(shape), torch.empty(shape), torch.empty(shape, dtype=torch.int32)]
    _scan_probe_kernel[(1,)](torch.from_numpy(x), torch.from_numpy(f), *outs, R=4, C=64, AXIS=axis)
    assert np.array_equal(outs[0].numpy(), _segmented_scan_oracle(x, f, axis, np.minimum, False))
    assert np.array_equal(outs[2].numpy(), _segmented_scan_oracle(f, f, axis, np.bitwise_or, False))
    ref_sum = _segmented_scan_oracle(x.astype(np.float64), f, axis, np.add, True)
    np.testing.assert_allclose(outs[1].numpy(), ref_sum, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,block", [(1, 1024), (37, 1024), (1500, 1024), (100, 16)])
def test_field_levels_kernel_matches_cummin(t, block, monkeypatch):
    """Chunks of 16 make every level's segments and runs cross chunk boundaries (the carried minima)."""
    monkeypatch.setattr(tk, "SCAN_BLOCK", block)
    g = torch.Generator().manual_seed(t)
    phi = torch.randint(0, 4, (2, t), generator=g).float()  # ties everywhere
    phi[1] = torch.randn(t, generator=g).cumsum(0)
    nlev = tk.n_levels(t)
    pre, suf = tk.field_levels(phi.to(DEVICE), nlev)
    ref_pre, ref_suf = _levels_oracle(phi, nlev)
    assert torch.equal(pre.cpu(), ref_pre) and torch.equal(suf.cpu(), ref_suf)


@pytest.mark.parametrize("t,block", [(1, 1024), (45, 1024), (100, 16)])
def test_route_levels_kernel_sends_each_sum_to_its_lowest_argmin(t, block, monkeypatch):
    """Each level's row and column sums reach their lowest argmins; chunks of 16 make runs cross chunks."""
    monkeypatch.setattr(tk, "SCAN_BLOCK", block)
    g = torch.Generator().manual_seed(t + 1)
    phi = torch.randint(0, 3, (2, t), generator=g).float()
    phi[1] = torch.randn(t, generator=g).cumsum(0)
    nlev = tk.n_levels(t)
    pre, suf = _levels_oracle(phi, nlev)
    row_r, col_r = torch.randn(2, nlev, t, generator=g), torch.randn(2, nlev, t, generator=g)
    got = tk.route_levels(*(x.to(DEVICE) for x in (phi, pre, suf, row_r, col_r))).cpu()
    torch.testing.assert_close(got.double(), _route_oracle(phi, pre, suf, row_r, col_r), atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Packed documents (segment_ids): masked like the oracle, key / query tiles of other documents skipped
# ----------------------------------------------------------------------------------------------------


def _segments(*rows: list[int]) -> torch.Tensor:
    """(B, T) document ids, one row per list of document lengths (each list summing to T)."""
    rows = [torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in rows]
    return torch.stack(rows).to(DEVICE)


def _doc_run(q, k, v, u, do, field, kind, seg, **kw):
    """(Triton, oracle) outputs and gradients (q, k, v, the field's raw values u) with these documents."""
    got = run_with_grads(fpa_attention_triton, q, k, v, u, do, field, kind=kind, segment_ids=seg, **kw)
    q32, k32, v32, do32 = (x.float() for x in (q, k, v, do))
    ref = run_with_grads(fpa_attention_naive, q32, k32, v32, u, do32, field, kind=kind, segment_ids=seg)
    return got, ref


# Two batch rows of different layouts each (the kernels offset the tables per row). Block 16: boundaries
# inside tiles and length-1 documents; boundaries exactly on tile edges (16, 32, 64), a length-1 document
# opening a tile; one document; only end-of-document tokens (every position its own document).
DOC_LAYOUTS = {
    "ragged": ([5, 1, 9, 1, 1, 14, 3, 6, 1, 7], [1, 1, 20, 2, 11, 1, 12]),
    "tile-edges": ([16, 16, 32, 1, 15], [32, 32, 16]),
    "one-doc": ([50], [1, 49]),
    "all-eod": ([1] * 40, [1] * 40),
}
DOC_KINDS = [("fpa", "walk"), ("fox", "gate"), ("softmax", "walk")]


@pytest.mark.parametrize("kind,field", DOC_KINDS, ids=[k for k, _ in DOC_KINDS])
@pytest.mark.parametrize("layout", list(DOC_LAYOUTS))
def test_documents_match_naive(layout, kind, field):
    """Outputs and every gradient (the field's included) equal the masked oracle, and stay finite: a row
    whose document starts in a later key tile has no visible key in the tiles before it."""
    seg = _segments(*DOC_LAYOUTS[layout])
    b, t = seg.shape
    q, k, v, u, do = make_inputs(b, 2, t, 16, field=field, seed=t)
    got, ref = _doc_run(q, k, v, u, do, field, kind, seg, block_size=16)
    assert all(torch.isfinite(x).all() for x in got if x is not None)
    assert_all_close(got, ref, torch.float32)


def _doc_tile_combos() -> list[tuple[str, dict]]:
    """Each kernel on a different entry of its GPU list (as _tile_combos), and a non-square mix."""
    fwd, dq, dkv = (tk.GPU_TILES[n] for n in ("fwd", "dq", "dkv"))
    combos = [
        (f"gpu{i}", {"fwd": fwd[i % len(fwd)], "dq": dq[i % len(dq)], "dkv": dkv[(i + 1) % len(dkv)]})
        for i in range(max(len(fwd), len(dq), len(dkv)))
    ]
    combos.append(("mixed", {"fwd": (32, 16), "dq": (16, 64), "dkv": (64, 16)}))
    return combos


DOC_TILE_COMBOS = _doc_tile_combos()
# T = 300: documents crossing several far tiles of the largest tiles, boundaries on 64 and 128 edges and
# inside tiles, runs of length-1 documents, a document cut by the window end.
DOC_LONG = ([64, 1, 1, 62, 100, 1, 7, 5, 59], [3, 125, 128, 1, 1, 1, 41])


@pytest.mark.parametrize("name,tiles", DOC_TILE_COMBOS, ids=[c[0] for c in DOC_TILE_COMBOS])
def test_documents_any_tiles_match_naive(name, tiles):
    """Whatever tiles the autotuner picks for each kernel, the masked kernels equal the oracle (fpa)."""
    seg = _segments(*DOC_LONG)
    q, k, v, u, do = make_inputs(2, 1, seg.shape[1], 16, field="walk", seed=5)
    got, ref = _doc_run(q, k, v, u, do, "walk", "fpa", seg, tiles=tiles)
    assert_all_close(got, ref, torch.float32)


@pytest.mark.parametrize("kind,field", DOC_KINDS[1:], ids=[k for k, _ in DOC_KINDS[1:]])
def test_documents_gpu_tiles_other_kinds(kind, field):
    """fox and softmax on the GPU lists' first tiles, and autotuned (the tuner's key holds the switch)."""
    seg = _segments(*DOC_LONG)
    q, k, v, u, do = make_inputs(2, 1, seg.shape[1], 16, field=field, seed=6)
    got, ref = _doc_run(q, k, v, u, do, field, kind, seg, tiles=DOC_TILE_COMBOS[0][1])
    assert_all_close(got, ref, torch.float32)
    seg = _segments(*DOC_LAYOUTS["ragged"])
    q, k, v, u, do = make_inputs(2, 1, seg.shape[1], 16, field=field, seed=7)
    assert_all_close(*_doc_run(q, k, v, u, do, field, kind, seg), torch.float32)


def test_documents_bf16_and_dispatch():
    """bf16 inputs, and fpa_attention(impl="triton", segment_ids=...) (the dispatcher's checked ids)."""
    from fpa_model.ops.fpa import fpa_attention

    seg = _segments(*DOC_LAYOUTS["ragged"])
    q, k, v, u, do = make_inputs(2, 2, seg.shape[1], 32, dtype=torch.bfloat16, seed=8)
    got, ref = _doc_run(q, k, v, u, do, "walk", "fpa", seg, block_size=16)
    assert_all_close(got, ref, torch.bfloat16)
    q, k, v, u, do = make_inputs(2, 2, seg.shape[1], 16, seed=9)
    phi = make_field(u, "walk")
    via = fpa_attention(q, k, v, phi, impl="triton", segment_ids=seg.int())
    want = fpa_attention_naive(q, k, v, phi, segment_ids=seg)
    torch.testing.assert_close(via, want, atol=2e-5, rtol=2e-5)


def _count(seg, t, tiles, kind="fpa", h=2):
    """The tile counter (fwd, dq, dkv) of one forward + backward on B = seg rows (or 1), H = h heads."""
    b = 1 if seg is None else seg.shape[0]
    q, k, v, u, do = make_inputs(b, h, t, 16, seed=t)
    counter = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    run_with_grads(
        fpa_attention_triton, q, k, v, u, do, "walk", kind=kind, segment_ids=seg, tiles=tiles,
        tile_counter=counter,
    )  # fmt: skip
    return counter.tolist()


def test_document_tiles_skipped_hand_count():
    """T = 64, 16 x 16 tiles, documents [0, 20) [20, 32) [32, 64), two heads. Causal: 1 + 2 + 3 + 4 = 10
    tiles per head in each kernel. Masked, fwd / dq visit per query tile (its first row's document start):
    q0: k0; q16 (row 16 in the document from 0): k0, k16; q32 (from 32): k32; q48: k32, k48 = 6. dk/dv per
    key tile (its last key's document end): k0 (ends 20): q0, q16; k16 (ends 32): q16; k32, k48 (end 64):
    q32, q48 and q48 = 6."""
    tiles = dict.fromkeys(tk.COUNTER_SLOTS, (16, 16))
    assert _count(None, 64, tiles) == [20, 20, 20]
    assert _count(_segments([20, 12, 32]), 64, tiles) == [12, 12, 12]


def test_document_tiles_counted_equal_host_mirror():
    """On GPU-list tiles and a non-square mix, every kernel visits strictly fewer tiles with the mask, and
    exactly the count of the host mirror of its loop bounds (tk.visited_tiles), per row and head. (The loop
    bounds do not depend on the kind: softmax, the cheapest under the interpreter.)"""
    kind = "softmax"
    seg = _segments(*DOC_LONG)
    t = seg.shape[1]
    for _, tiles in (DOC_TILE_COMBOS[0], DOC_TILE_COMBOS[-1]):
        plain, masked = _count(None, t, tiles, kind, h=1), _count(seg, t, tiles, kind, h=1)
        for name, slot in tk.COUNTER_SLOTS.items():
            rows = [tk.visited_tiles(name, tiles[name], t, row) for row in seg]
            assert plain[slot] == tk.visited_tiles(name, tiles[name], t)
            assert masked[slot] == sum(rows), (name, tiles[name])
            assert max(rows) < plain[slot], (name, tiles[name], rows, plain[slot])  # plain: one row


@pytest.mark.parametrize(
    "case,match",
    [
        ("float", "integer"),
        ("shape", r"\(B, Tk\)"),
        ("order", "non-decreasing"),
        ("counter_unpinned", "pinned tiles"),
        ("counter_dtype", "int32"),
    ],
)
def test_documents_bad_input(case, match):
    q = torch.zeros(2, 1, 8, 16, device=DEVICE)
    phi = torch.zeros(2, 1, 8, device=DEVICE)
    seg = torch.zeros(2, 8, dtype=torch.long, device=DEVICE)
    kw: dict = {"segment_ids": seg, "block_size": 16}
    if case == "float":
        kw["segment_ids"] = seg.float()
    elif case == "shape":
        kw["segment_ids"] = seg[:, :7]
    elif case == "order":
        kw["segment_ids"] = torch.tensor([[0, 0, 1, 1, 0, 2, 2, 2]] * 2, device=DEVICE)
    elif case == "counter_unpinned":
        kw = {"segment_ids": seg, "tile_counter": torch.zeros(3, dtype=torch.int32, device=DEVICE)}
    elif case == "counter_dtype":
        kw["tile_counter"] = torch.zeros(3, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        fpa_attention_triton(q, q, q, phi, **kw)
