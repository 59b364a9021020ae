"""Sequence-parallel FPA: W spawned gloo ranks vs one process running the naive oracle.

Spawning ranks is the slow part (each imports torch), so one spawn per world size runs every case and
writes per-case errors to JSON; the parametrized tests below only read those numbers. The ring runs on
the chunked blocks on CPU; the impl="triton" cases run its Triton blocks under the interpreter
(tests/conftest.py sets TRITON_INTERPRET=1, which the spawned ranks inherit).
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fpa_model.sequence_parallel as cp
from fpa_model.ops.fpa.naive import fpa_attention_naive
from fpa_model.sequence_parallel import (
    chunk_ids,
    local_positions,
    ring_attention,
    shard_batch,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)
from pipeline.trainer.sequence_parallel import make_groups

TOL = 1e-4  # fp32 ranks vs a float64 oracle, errors relative to the largest reference entry
SEQ = 48  # divisible by 2W for W = 2, 4 (zigzag) and gives chunks of 6 or 12 tokens
BLOCK = 5  # smaller than a chunk and not dividing it: exercises the chunked path's ragged tiles
FIELD_CASES = [("fpa", f) for f in ("walk", "gate", "direct")] + [
    ("fox", f) for f in ("walk", "gate", "direct")
]
ALL_KINDS = [*FIELD_CASES, ("softmax", "walk")]
# The ring on its Triton blocks (interpreter: few cases, one batch, two heads, 16-row tiles; chunks of 20
# (zigzag) and 40 (contiguous) tokens at W=2: several tiles per chunk, the last one ragged).
TRITON_SEQ = 80
TRITON_BH = (1, 2)
TRITON_BLOCK = 16
TRITON_CASES = [
    ("zigzag", "fpa", "walk"),
    ("zigzag", "fpa", "direct"),
    ("zigzag", "fpa", "ties"),
    ("zigzag", "fox", "gate"),
    ("zigzag", "softmax", "walk"),
    ("contiguous", "fpa", "walk"),
]
CASES = (
    [("ring", layout, kind, field) for layout in ("zigzag", "contiguous") for kind, field in ALL_KINDS]
    + [("ulysses", "zigzag", kind, field) for kind, field in ALL_KINDS]
    + [("ulysses", "contiguous", "fpa", "walk")]
    + [("ring", layout, "fpa", "ties") for layout in ("zigzag", "contiguous")]
)


def _case_id(world: int, mode: str, layout: str, kind: str, field: str) -> str:
    return f"W{world}-{mode}-{layout}-{kind}-{field if kind != 'softmax' else 'nofield'}"


def _make_inputs(
    kind: str, field: str, seed: int, seq: int = SEQ, b: int = 2, h: int = 4
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = 8  # 4 heads by default: Ulysses splits heads over up to 4 ranks
    t = {
        name: torch.randn(b, h, seq, d, generator=g, dtype=torch.float64) for name in ("q", "k", "v", "dout")
    }
    # walk: a signed random walk whose dips land on every rank (M and its argmin cross rank borders);
    # gate: pre-activations of the log forget gate; direct: the field itself.
    t["pre"] = torch.randn(b, h, seq, generator=g, dtype=torch.float64) * (2.0 if field == "direct" else 1.0)
    if field == "ties":  # a direct field on 3 levels: equal minima everywhere test the lowest-index rule
        t["pre"] = torch.randint(0, 3, (b, h, seq), generator=g).double()
    return t


def _field_of(pre: torch.Tensor, field: str) -> torch.Tensor:
    return F.logsigmoid(pre) if field == "gate" else pre


def _reference(t: dict[str, torch.Tensor], kind: str, field: str) -> dict[str, torch.Tensor]:
    leaves = {n: t[n].clone().requires_grad_() for n in ("q", "k", "v", "pre")}
    u = _field_of(leaves["pre"], field)
    phi = u.cumsum(-1) if field in ("walk", "gate") else u  # direct and ties: u is the field
    out = fpa_attention_naive(
        leaves["q"], leaves["k"], leaves["v"], None if kind == "softmax" else phi, kind=kind
    )
    out.backward(t["dout"])
    res = {"out": out.detach()}
    for n, leaf in leaves.items():
        if leaf.grad is not None:
            res["d" + n] = leaf.grad
    return res


def _run_case(
    rank: int,
    world: int,
    mode: str,
    layout: str,
    kind: str,
    field: str,
    seed: int,
    group: object = None,
    impl: str = "auto",
    seq: int = SEQ,
    bh: tuple[int, int] = (2, 4),
) -> dict[str, float]:
    t = _make_inputs(kind, field, seed, seq, *bh)
    ref = _reference(t, kind, field)
    loc = {
        n: shard_sequence(t[n].float(), rank, world, dim=2, layout=layout)
        for n in ("q", "k", "v", "pre", "dout")
    }
    leaves = {n: loc[n].clone().requires_grad_() for n in ("q", "k", "v", "pre")}
    u = None if kind == "softmax" else _field_of(leaves["pre"], field)
    attention = ring_attention if mode == "ring" else ulysses_attention
    out = attention(
        leaves["q"], leaves["k"], leaves["v"], u, kind=kind, field="direct" if field == "ties" else field,
        group=group, block_size=BLOCK,
        layout=layout, impl=impl,
    )  # fmt: skip
    out.backward(loc["dout"])
    got = {"out": out.detach()} | {"d" + n: leaf.grad for n, leaf in leaves.items() if leaf.grad is not None}
    errs: dict[str, float] = {}
    for name, r in ref.items():
        if name not in got or got[name] is None:
            errs[name] = float("inf")  # a gradient the oracle has but the ring lost
            continue
        r_loc = shard_sequence(r, rank, world, dim=2, layout=layout)
        errs[name] = float((got[name].double() - r_loc).abs().max() / r.abs().max().clamp_min(1e-12))
    return errs


def _check_groups(rank: int, world: int) -> dict[str, object]:
    """make_groups(2) on this world: the members each rank sees (to compare with the rank arithmetic),
    and a ring over each sp subgroup (group ranks != global ranks), both dp groups at once."""
    dp_group, sp_group, dp_rank, dp_world, sp_rank = make_groups(2)
    ring = _run_case(sp_rank, 2, "ring", "zigzag", "fpa", "walk", seed=11 + dp_rank, group=sp_group)
    ranks = torch.tensor([rank])
    sp_members = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(sp_group))]
    dist.all_gather(sp_members, ranks, group=sp_group)
    dp_members = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(dp_group))]
    dist.all_gather(dp_members, ranks, group=dp_group)
    return {
        "sp": [int(x) for x in sp_members],
        "dp": [int(x) for x in dp_members],
        "ids": [dp_rank, dp_world, sp_rank],
        "ring": ring,
    }


def _sp_loss_check(rank: int, world: int) -> dict[str, float]:
    """sequence_parallel_cross_entropy on sharded logits vs the full-batch loss and its gradient."""
    from pipeline.trainer.sequence_parallel import sequence_parallel_cross_entropy

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 16, 7, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 7, (2, 16), generator=g)
    targets[0, 3] = targets[1, 12] = -100  # ignored tokens on different ranks
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref.backward()
    mine = shard_sequence(logits, rank, world, dim=1).requires_grad_()
    loss = sequence_parallel_cross_entropy(
        mine, shard_sequence(targets, rank, world, dim=1), dist.group.WORLD
    )
    loss.backward()
    grad_err = (mine.grad - shard_sequence(full.grad, rank, world, dim=1)).abs().max()
    return {"loss": abs(loss.item() - ref.item()), "grad": float(grad_err)}


GPT_CASES = [
    ("fpa", "walk", "ring", "auto"),
    ("fox", "gate", "ring", "auto"),
    ("softmax", "walk", "ring", "auto"),
    ("fpa", "walk", "ulysses", "auto"),
    ("fpa", "walk", "ring", "triton"),  # the layer's impl reaches the ring: its Triton blocks
]


def _gpt_sp_step(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Tiny GPT: loss and every parameter gradient of a sequence-parallel step vs the 1-rank step."""
    from fpa_model.config import AttentionConfig, ModelConfig
    from fpa_model.model import GPT
    from fpa_model.sequence_parallel import SequenceParallel

    out: dict[str, dict[str, float]] = {}
    block_impls: list[str] = []
    block_fns = cp._block_fns

    def spy(impl: str) -> object:
        block_impls.append(impl)
        return block_fns(impl)

    cp._block_fns = spy
    for kind, field, mode, impl in GPT_CASES:
        block_impls.clear()
        # field_weight_std > 0: a data-dependent field, so dips (and M across ranks) really occur.
        att = AttentionConfig(kind=kind, field=field, block_size=4, field_weight_std=0.5, impl=impl)
        cfg = ModelConfig(vocab_size=61, n_layer=2, n_head=2, d_model=32, max_seq_len=64, attention=att)
        torch.manual_seed(0)
        sp_model = GPT(cfg)
        tokens = torch.randint(0, 61, (2, 33), generator=torch.Generator().manual_seed(1))
        sp = SequenceParallel(dist.group.WORLD, mode=mode)
        errs = _sp_step_errors(sp_model, sp, tokens, rank, world, n_layer=cfg.n_layer)
        if mode == "ring":  # 0 when every ring call ran on the blocks the layer's impl asks for
            want = "triton" if impl == "triton" else "chunked"
            errs["ring_blocks"] = 0.0 if block_impls and set(block_impls) == {want} else math.inf
        out[f"{kind}-{field}-{mode}-{impl}"] = errs
    cp._block_fns = block_fns
    return out


def _sp_step_errors(
    sp_model: Any, sp: Any, tokens: torch.Tensor, rank: int, world: int, n_layer: int
) -> dict:
    """One LM step of sp_model across the group vs a 1-rank copy of it: relative error of the loss and of
    every parameter gradient (the ranks' shares summed)."""
    from pipeline.trainer.sequence_parallel import sequence_parallel_cross_entropy

    ref_model = copy.deepcopy(sp_model)
    ref_loss = F.cross_entropy(ref_model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
    ref_loss.backward()
    assert sp_model.set_sequence_parallel(sp) == n_layer
    x, y = shard_batch(tokens, rank, world, layout=sp.layout)
    loss = sequence_parallel_cross_entropy(sp_model(x), y, dist.group.WORLD)
    loss.backward()
    errs = {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())}
    ref_params = dict(ref_model.named_parameters())
    for name, p in sp_model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # the group's per-rank shares sum to the full gradient
        r = ref_params[name].grad
        errs[name] = float((g.double() - r).abs().max() / r.abs().max().clamp_min(1e-12))
    return errs


# The key/value shift across ranks: each chunk's first token mixes in the raw k, v of the token before it,
# held by another rank (or, zigzag, by this rank's other chunk). Both layouts, both modes.
KV_SHIFT_CASES = [
    ("zigzag", "ring", {"rope": True, "qk_norm": True}),
    # FoX-Pro's per-head qk-norm gains and output norm (Ulysses: heads are split over the ranks)
    ("contiguous", "ring", {"qk_norm": True, "output_norm": True, "output_gate": True}),
    ("zigzag", "ulysses", {"qk_norm": True, "output_norm": True}),
    ("contiguous", "ulysses", {"rope": True}),
    # log-n scaling: each zigzag chunk's queries need their own absolute positions (without RoPE too)
    ("zigzag", "ring", {"qk_norm": True, "log_scale_length": 8}),
]


def _gpt_kv_shift_step(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Tiny GPT with kv_shift (random gates): loss and every parameter gradient of a sequence-parallel
    step vs the 1-rank step, per KV_SHIFT_CASES."""
    from fpa_model.config import AttentionConfig, ModelConfig
    from fpa_model.model import GPT
    from fpa_model.sequence_parallel import SequenceParallel

    out: dict[str, dict[str, float]] = {}
    for layout, mode, extra in KV_SHIFT_CASES:
        att = AttentionConfig(kind="fpa", block_size=4, field_weight_std=0.5, kv_shift=True, **extra)
        cfg = ModelConfig(vocab_size=61, n_layer=2, n_head=4, d_model=32, max_seq_len=64, attention=att)
        torch.manual_seed(0)
        sp_model = GPT(cfg)
        with torch.no_grad():  # gates away from the 50/50 init, norm gains different per head
            for blk in sp_model.blocks:
                blk.attn.shift_proj.weight.normal_(0, 0.5)
                blk.attn.shift_proj.bias.uniform_(-2.0, 2.0)
                for norm in (blk.attn.q_norm, blk.attn.k_norm, blk.attn.out_norm):
                    if norm is not None:
                        norm.weight.uniform_(0.5, 1.5)
        tokens = torch.randint(0, 61, (2, 33), generator=torch.Generator().manual_seed(2))
        sp = SequenceParallel(dist.group.WORLD, layout=layout, mode=mode)
        out[f"{layout}-{mode}"] = _sp_step_errors(sp_model, sp, tokens, rank, world, n_layer=cfg.n_layer)
    return out


def _triton_ring(rank: int, world: int) -> dict[str, dict[str, float]]:
    """The ring on its Triton blocks (impl="triton", interpreter) vs the oracle, per TRITON_CASES."""
    out: dict[str, dict[str, float]] = {}
    for i, (layout, kind, field) in enumerate(TRITON_CASES):
        cid = "-".join((layout, kind, field))
        try:
            out[cid] = _run_case(
                rank, world, "ring", layout, kind, field, seed=300 + i, impl="triton", seq=TRITON_SEQ,
                bh=TRITON_BH,
            )  # fmt: skip
        except Exception:
            out[cid] = {"error": traceback.format_exc(limit=6)}
    return out


# Tile skipping across ranks: (mode, layout, field). "sawtooth": a walk that dips by 30 every 9 tokens
# (most earlier chunks erased); "strong": a FoX gate field decaying by about 3 a token; "weak": a walk of
# tiny steps (nothing can be skipped); "threshold": q = 0 (every logit is its bias) and a staircase that
# steps down by D at each chunk start, D = tau + 0.5 on heads 0-1 (every cross pair goes, yet the keys of
# the chunk just before still weigh e^-0.5 eps / T each: measurable) and tau - 0.5 on heads 2-3 (adjacent
# pairs kept, the others 2D down go), at epsilon 0.05: adjacent pairs are partly skipped.
SKIP_EPS = 1e-3
THRESHOLD_EPS = 0.05
SKIP_CASES = [
    ("ring", "zigzag", "fpa", "sawtooth"),
    ("ring", "contiguous", "fpa", "sawtooth"),
    ("ring", "zigzag", "fox", "strong"),
    ("ring", "zigzag", "fpa", "weak"),
    ("ring", "zigzag", "fpa", "threshold"),
    ("ulysses", "zigzag", "fpa", "sawtooth"),
]


def _skip_inputs(field: str, seed: int, world: int, layout: str) -> dict[str, torch.Tensor]:
    t = _make_inputs("fpa", "walk", seed)
    g = torch.Generator().manual_seed(seed + 1)
    noise = torch.randn(t["pre"].shape, generator=g, dtype=torch.float64)
    if field == "sawtooth":
        dips = torch.where(torch.arange(SEQ) % 9 == 0, -30.0, 0.0).to(torch.float64)
        t["pre"] = dips + 0.1 * noise  # walk increments
    elif field == "strong":
        t["pre"] = -3.0 + 0.3 * noise  # gate pre-activations: logsigmoid about -3
    elif field == "threshold":
        t["q"].zero_()
        tau = math.log(SEQ / THRESHOLD_EPS)
        depth = torch.tensor([tau + 0.5, tau + 0.5, tau - 0.5, tau - 0.5], dtype=torch.float64)[:, None]
        c = SEQ // cp.num_chunks(world, layout)
        u = torch.zeros(SEQ, dtype=torch.float64)
        u[c::c] = -1.0  # phi = -depth x (chunk index)
        t["pre"] = (u * depth).expand_as(t["pre"]).clone()
    else:
        t["pre"] = 0.01 * noise
    return t


def _chunks_needed(t: dict, kind: str, gate: str, c: int, eps: float, world: int, layout: str) -> int:
    """Chunk messages of one forward pass over all ranks, from the single-process decisions at a block of
    one chunk: key chunk b goes to each other rank with a query chunk a > b that keeps some (b, h) of it."""
    from fpa_model.ops.fpa.chunked import tile_keep_map
    from fpa_model.ops.fpa.kinds import resolve_kind

    phi = _field_of(t["pre"], gate).cumsum(-1)
    scale = 1 / math.sqrt(t["q"].shape[-1])
    keep = tile_keep_map(t["q"], t["k"], phi, resolve_kind(kind), scale, c, eps).bool().any(dim=0)
    owner = {b: r for r in range(world) for b in cp.chunk_ids(r, world, layout)}
    return sum(
        any(keep[a, b] for a in cp.chunk_ids(dst, world, layout) if a > b)
        for b in owner
        for dst in range(world)
        if dst != owner[b]
    )


def _skipping_sp(rank: int, world: int) -> dict[str, dict[str, float]]:
    """skip_epsilon across ranks vs one process: the ring decides per (query chunk, key chunk, b, h) as the
    chunked path does at a block size of one chunk, Ulysses per head as fpa_attention does; outputs and
    every gradient vs that single-process op, the tiles counted over the ranks vs its counts."""
    from fpa_model.ops.fpa.chunked import chunked_fpa_attention
    from fpa_model.ops.fpa.skipping import skip_counts

    out: dict[str, dict[str, float]] = {}
    for i, (mode, layout, kind, field) in enumerate(SKIP_CASES):
        t = _skip_inputs(field, 500 + i, world, layout)
        eps = THRESHOLD_EPS if field == "threshold" else SKIP_EPS
        gate = "gate" if kind == "fox" else "walk"
        c = SEQ // cp.num_chunks(world, layout)
        block = c if mode == "ring" else BLOCK  # the single-process op that decides alike
        leaves = {n: t[n].clone().requires_grad_() for n in ("q", "k", "v", "pre")}
        u = _field_of(leaves["pre"], gate)
        with skip_counts() as ref_counts:
            ref_out = chunked_fpa_attention(
                leaves["q"], leaves["k"], leaves["v"], u.cumsum(-1), kind=kind, block_size=block,
                skip_epsilon=eps,
            )  # fmt: skip
        ref_out.backward(t["dout"])
        ref = {"out": ref_out.detach()} | {"d" + n: x.grad for n, x in leaves.items()}
        full = chunked_fpa_attention(t["q"], t["k"], t["v"], _field_of(t["pre"], gate).cumsum(-1), kind=kind)
        loc = {n: shard_sequence(t[n].float(), rank, world, dim=2, layout=layout) for n in t}
        lv = {n: loc[n].clone().requires_grad_() for n in ("q", "k", "v", "pre")}
        attention = ring_attention if mode == "ring" else ulysses_attention
        with skip_counts() as counts, cp.ring_traffic() as traffic:
            o = attention(
                lv["q"], lv["k"], lv["v"], _field_of(lv["pre"], gate), kind=kind, field=gate,
                block_size=BLOCK, layout=layout, skip_epsilon=eps,
            )  # fmt: skip
            o.backward(loc["dout"])
        got = {"out": o.detach()} | {"d" + n: x.grad for n, x in lv.items()}
        errs = {
            name: float(
                (got[name].double() - shard_sequence(r, rank, world, dim=2, layout=layout)).abs().max()
                / r.abs().max().clamp_min(1e-12)
            )
            for name, r in ref.items()
        }
        n = torch.tensor([counts.kept, counts.skipped, traffic.chunks], dtype=torch.long)
        dist.all_reduce(n)
        off = (o.detach().double() - shard_sequence(full, rank, world, dim=2, layout=layout)).abs().max()
        out["-".join((mode, layout, kind, field))] = {
            **errs, "kept": int(n[0]), "skipped": int(n[1]), "ref_kept": ref_counts.kept,
            "ref_skipped": ref_counts.skipped, "vs_unskipped": float(off / t["v"].abs().max()), "eps": eps,
            "sent": int(n[2]), "ref_sent": _chunks_needed(t, kind, gate, c, eps, world, layout),
        }  # fmt: skip
    # The model's skip_epsilon reaches the ring: its attention layers decide (and count) chunk pairs.
    from fpa_model.config import AttentionConfig, ModelConfig
    from fpa_model.model import GPT
    from fpa_model.sequence_parallel import SequenceParallel

    att = AttentionConfig(kind="fpa", block_size=4, field_weight_std=0.5, skip_epsilon=SKIP_EPS)
    model = GPT(ModelConfig(vocab_size=61, n_layer=2, n_head=2, d_model=32, max_seq_len=64, attention=att))
    model.set_sequence_parallel(SequenceParallel(dist.group.WORLD))
    x, _ = shard_batch(torch.randint(0, 61, (2, 33), generator=torch.Generator().manual_seed(3)), rank, world)
    with skip_counts() as counts:
        model(x)
    out["model"] = {"total": counts.total}
    return out


def _worker(
    rank: int, world: int, init_file: str, out_dir: str, extra: list[str], cases: bool = True
) -> None:
    torch.set_num_threads(1)
    # Tiles of exactly BLOCK query rows (short chunks would otherwise be one tile): exercises the folding
    # of the query prefix into M and the split of diagonal pairs.
    cp._TILE_SCORES = 0
    cp._TRITON_BLOCK = TRITON_BLOCK  # several Triton tiles per chunk (autotune would take one 32 tile)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),  # the Triton 3.6 rerun runs at idle priority
    )  # fmt: skip
    results: dict[str, object] = {}
    for i, case in enumerate(CASES if cases else ()):
        cid = _case_id(world, *case)
        try:
            results[cid] = _run_case(rank, world, *case, seed=100 + i)
        except Exception:  # recorded per case so one failure does not hide the others
            results[cid] = {"error": traceback.format_exc(limit=4)}
    if world == 4 and cases:
        results["groups"] = _check_groups(rank, world)
    for name in extra:
        try:
            results[name] = globals()[name](rank, world)
        except Exception:
            results[name] = {"error": traceback.format_exc(limit=6)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


_CACHE: dict[int, list[dict]] = {}


def _spawn(world: int, tmp_root: Path, extra: tuple[str, ...] = ()) -> list[dict]:
    if world not in _CACHE:
        import torch.multiprocessing as mp

        d = tmp_root / f"w{world}"
        d.mkdir(parents=True, exist_ok=True)
        os.environ["OMP_NUM_THREADS"] = "1"
        args = (world, str(d / "rdzv"), str(d), list(extra), not _PLAN["triton_only"])
        mp.spawn(_worker, args=args, nprocs=world, join=True)
        _CACHE[world] = [json.loads((d / f"rank{r}.json").read_text()) for r in range(world)]
    return _CACHE[world]


# Set by the tmp_root fixture: only `triton` tests of this module were selected (make test-triton36), so
# the spawns compute only what those read.
_PLAN = {"triton_only": False}


def _extras(world: int) -> tuple[str, ...]:
    """The loss, Triton-ring and GPT checks ride on the 2-rank spawn (one spawn, not two)."""
    if _PLAN["triton_only"]:
        return ("_triton_ring", "_gpt_sp_step") if world == 2 else ()
    if world != 2:
        return ("_gpt_kv_shift_step", "_skipping_sp")
    return ("_sp_loss_check", "_triton_ring", "_gpt_sp_step", "_gpt_kv_shift_step", "_skipping_sp")


@pytest.fixture(scope="module")
def tmp_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    mine = [item for item in request.session.items if item.path.name == Path(__file__).name]
    _PLAN["triton_only"] = bool(mine) and all(item.get_closest_marker("triton") for item in mine)
    return tmp_path_factory.mktemp("cp")


def _max_errors(results: list[dict], cid: str) -> dict[str, float]:
    merged: dict[str, float] = {}
    for rank, res in enumerate(results):
        r = res[cid]
        if "error" in r:
            pytest.fail(f"rank {rank} raised in {cid}:\n{r['error']}")
        for k, v in r.items():
            merged[k] = max(merged.get(k, 0.0), v)
    return merged


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("mode", "layout", "kind", "field"), CASES, ids=["-".join(c) for c in CASES])
def test_sequence_parallel_matches_single_process(
    world: int, mode: str, layout: str, kind: str, field: str, tmp_root: Path
) -> None:
    errs = _max_errors(_spawn(world, tmp_root, _extras(world)), _case_id(world, mode, layout, kind, field))
    expected = {"out", "dq", "dk", "dv"} | (set() if kind == "softmax" else {"dpre"})
    assert set(errs) == expected
    bad = {k: v for k, v in errs.items() if not v < TOL}
    assert not bad, f"relative errors over {TOL}: {bad}"


@pytest.mark.triton
@pytest.mark.distributed
@pytest.mark.parametrize(("layout", "kind", "field"), TRITON_CASES, ids=["-".join(c) for c in TRITON_CASES])
def test_ring_on_triton_blocks_matches_single_process(
    layout: str, kind: str, field: str, tmp_root: Path
) -> None:
    """2 gloo ranks, impl="triton" (the interpreter on CPU): outputs and every gradient vs the oracle."""
    for rank, res in enumerate(_spawn(2, tmp_root, _extras(2))):
        r = res["_triton_ring"]["-".join((layout, kind, field))]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        assert set(r) == {"out", "dq", "dk", "dv"} | (set() if kind == "softmax" else {"dpre"})
        bad = {k: v for k, v in r.items() if not v < TOL}
        assert not bad, f"rank {rank}: relative errors over {TOL}: {bad}"


@pytest.mark.triton
@pytest.mark.distributed
@pytest.mark.parametrize(("kind", "field", "mode", "impl"), GPT_CASES, ids=["-".join(c) for c in GPT_CASES])
def test_gpt_sequence_parallel_step_matches_one_rank(
    kind: str, field: str, mode: str, impl: str, tmp_root: Path
) -> None:
    results = _spawn(2, tmp_root, _extras(2))
    for rank, res in enumerate(results):
        r = res["_gpt_sp_step"]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        errs = r[f"{kind}-{field}-{mode}-{impl}"]
        assert len(errs) > 5  # the loss and every parameter
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"rank {rank}: relative errors over {TOL}: {bad}"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    ("layout", "mode"), [c[:2] for c in KV_SHIFT_CASES], ids=[f"{c[0]}-{c[1]}" for c in KV_SHIFT_CASES]
)
def test_gpt_kv_shift_sequence_parallel_matches_one_rank(
    world: int, layout: str, mode: str, tmp_root: Path
) -> None:
    """kv_shift under sequence parallelism: loss and every gradient (the shift gates' too) equal the
    single-rank model's, with the previous token's k, v fetched across rank (and zigzag chunk) borders."""
    for rank, res in enumerate(_spawn(world, tmp_root, _extras(world))):
        r = res["_gpt_kv_shift_step"]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        errs = r[f"{layout}-{mode}"]
        assert {"blocks.0.attn.shift_proj.weight", "blocks.1.attn.shift_proj.bias"} <= set(errs)
        if (layout, mode) in (("contiguous", "ring"), ("zigzag", "ulysses")):
            assert {"blocks.0.attn.out_norm.weight", "blocks.1.attn.q_norm.weight"} <= set(errs)
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"rank {rank}: relative errors over {TOL}: {bad}"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", SKIP_CASES, ids=["-".join(c) for c in SKIP_CASES])
def test_tile_skipping_across_ranks_matches_the_single_process_op(
    world: int, case: tuple, tmp_root: Path
) -> None:
    """skip_epsilon under sequence parallelism: the ring skips the (chunk pair, b, h) the chunked path
    skips at a block size of one chunk (Ulysses: what fpa_attention skips per head), with the same outputs
    and gradients, and stays within the guarantee of the unskipped op (2 eps max|v|)."""
    mode, layout, kind, field = case
    for rank, res in enumerate(_spawn(world, tmp_root, _extras(world))):
        r = res["_skipping_sp"]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        got = r["-".join(case)]
        assert (got["kept"], got["skipped"]) == (got["ref_kept"], got["ref_skipped"]), got
        if field == "weak":
            assert got["skipped"] == 0 and got["vs_unskipped"] < 1e-5, got
        elif field == "threshold":  # heads 2-3 keep the adjacent pairs (N - 1 per batch row), nothing else
            n = cp.num_chunks(world, layout)
            assert got["kept"] == (n - 1) * 2 * 2 and got["skipped"] == n * (n - 1) // 2 * 8 - got["kept"], (
                got
            )
            # measurably not the unskipped op (its float error is about 1e-7), and within the guarantee
            assert 1e-3 < got["vs_unskipped"] <= 2 * got["eps"], got
        else:
            # The dips erase every chunk pair with a chunk between them (adjacent ones keep the keys just
            # before the query chunk): at least (N-1)(N-2)/2 pairs per (b, h) go, N chunks (B=2, H=4).
            n = cp.num_chunks(world, layout)
            assert got["skipped"] >= max(1 if mode == "ulysses" else 0, (n - 1) * (n - 2) // 2 * 8), got
            assert got["vs_unskipped"] <= 2 * got["eps"], got
        bad = {k: v for k, v in got.items() if k in ("out", "dq", "dk", "dv", "dpre") and not v < TOL}
        assert not bad, f"rank {rank}: relative errors over {TOL}: {bad}"
        if mode == "ring":
            # Keys travel only where a query chunk uses them: each pass (forward; backward's keys; the
            # gradient shares going back) sends the chunks the decisions need, not the whole ring.
            w = world
            assert got["sent"] == 3 * got["ref_sent"], got
            if field == "weak":  # nothing skipped: the causal need alone (a ring sends 2W(W-1) / W(W-1))
                assert got["ref_sent"] == (3 * w * (w - 1) // 2 if layout == "zigzag" else w * (w - 1) // 2)
            if field == "threshold":  # only chunk a-1 for query chunk a: 2 (W - 1) messages
                assert got["ref_sent"] == 2 * (w - 1), got
            if field == "sawtooth" and cp.num_chunks(w, layout) > 2:  # non-adjacent pairs go unsent
                assert got["ref_sent"] < (3 * w * (w - 1) // 2 if layout == "zigzag" else w * (w - 1) // 2)
        assert r["model"]["total"] > 0  # the model's layers decided chunk pairs in the ring


@pytest.mark.distributed
def test_sp_cross_entropy_two_ranks_equals_full_batch(tmp_root: Path) -> None:
    for rank, res in enumerate(_spawn(2, tmp_root, _extras(2))):
        r = res["_sp_loss_check"]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        assert r["loss"] < 1e-12 and r["grad"] < 1e-12, r


@pytest.mark.distributed
def test_make_groups_layout(tmp_root: Path) -> None:
    results = _spawn(4, tmp_root)
    for rank, res in enumerate(results):
        g = res["groups"]
        dp_rank, sp_rank = rank // 2, rank % 2
        assert sorted(g["sp"]) == [2 * dp_rank, 2 * dp_rank + 1]  # consecutive ranks share a sequence
        assert sorted(g["dp"]) == [sp_rank, sp_rank + 2]
        assert g["ids"] == [dp_rank, 2, sp_rank]
        bad = {k: v for k, v in g["ring"].items() if not v < TOL}
        assert not bad, f"rank {rank}: ring over its sp subgroup, relative errors over {TOL}: {bad}"


# ----------------------------------------------------------------------------------------------------
# Single-process checks (no spawn)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_roundtrip(world: int, layout: str) -> None:
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    parts = [shard_sequence(x, r, world, dim=1, layout=layout) for r in range(world)]
    assert all(p.shape == (2, 24 // world, 3) for p in parts)
    assert torch.equal(unshard_sequence(parts, dim=1, layout=layout), x)
    pos = [local_positions(24, r, world, layout) for r in range(world)]
    assert torch.equal(torch.cat(pos).sort().values, torch.arange(24))
    for r in range(world):
        assert torch.equal(parts[r][0, :, 0], x[0, pos[r], 0])


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_sends_only_the_key_chunks_a_rank_uses(world: int, layout: str) -> None:
    """Without skipping a rank gets exactly the earlier chunks of the others (none of their later ones):
    3W(W-1)/2 messages a pass for zigzag, W(W-1)/2 for contiguous (forwarding the whole ring: 2W(W-1),
    W(W-1)); each step's sends are the receives of the rank they go to, in the same order."""
    n = cp.num_chunks(world, layout)
    plans = [cp._Plan(cp._causal_need(n), r, world, layout) for r in range(world)]
    sent = sum(len(p.send[s]) for p in plans for s in range(1, world))
    assert sent == (3 * world * (world - 1) // 2 if layout == "zigzag" else world * (world - 1) // 2)
    for r, p in enumerate(plans):
        mine = cp.chunk_ids(r, world, layout)
        for s in range(1, world):
            assert p.send[s] == plans[(r + s) % world].recv[s]
            src = cp.chunk_ids((r - s) % world, world, layout)
            assert [src[i] for i in p.recv[s]] == [b for b in src if b < max(mine)]


def test_zigzag_balances_causal_work() -> None:
    """Every rank computes the same number of query-key chunk pairs (contiguous: rank W-1 does W)."""
    for world in (2, 4, 8):
        work = []
        for r in range(world):
            mine = chunk_ids(r, world, "zigzag")
            work.append(sum(b < a for a in mine for s in range(world) for b in chunk_ids(s, world, "zigzag")))
        assert len(set(work)) == 1, work
    assert chunk_ids(1, 4, "zigzag") == (1, 6)


def test_shard_batch_targets_are_next_tokens() -> None:
    tokens = torch.arange(2 * 17).reshape(2, 17)  # T = 16
    for r in range(2):
        x, y = shard_batch(tokens, r, 2, layout="zigzag")
        assert x.shape == y.shape == (2, 8)
        assert torch.equal(y, x + 1)
        assert torch.equal(x[0], local_positions(16, r, 2, "zigzag"))


def test_not_divisible_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not divisible by 4"):
        shard_sequence(torch.zeros(1, 10), 0, 2, dim=1, layout="zigzag")
    with pytest.raises(ValueError, match="not divisible by 3"):
        shard_sequence(torch.zeros(1, 10), 0, 3, dim=1, layout="contiguous")
    with pytest.raises(ValueError, match="unknown sequence-parallel layout"):
        shard_sequence(torch.zeros(1, 8), 0, 2, dim=1, layout="ring")
    q = torch.zeros(1, 1, 7, 4)
    with pytest.raises(ValueError, match="divisible by 2"):
        ring_attention(q, q, q, torch.zeros(1, 1, 7), kind="fpa", layout="zigzag")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown attention kind"):
        ulysses_attention(*[torch.zeros(1, 1, 8, 4)] * 3, torch.zeros(1, 1, 8), kind="linear")
    q = torch.zeros(1, 1, 8, 4)
    with pytest.raises(ValueError, match="needs the field"):
        ring_attention(q, q, q, None, kind="fpa")
    with pytest.raises(ValueError, match="unknown field mode"):
        ring_attention(q, q, q, torch.zeros(1, 1, 8), kind="fpa", field="sum")
    with pytest.raises(ValueError, match="u_or_phi must be"):
        ring_attention(q, q, q, torch.zeros(1, 1, 4), kind="fox")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize(("kind", "field"), ALL_KINDS)
@pytest.mark.parametrize("tiles", ["whole", "rows"])
def test_single_process_matches_oracle(
    kind: str, field: str, layout: str, tiles: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """world 1 (no torch.distributed): the diagonal and cross blocks of one rank's two zigzag chunks."""
    if tiles == "rows":
        monkeypatch.setattr(cp, "_TILE_SCORES", 0)  # BLOCK-row tiles instead of whole short chunks
    errs = _run_case(0, 1, "ring", layout, kind, field, seed=7)
    bad = {k: v for k, v in errs.items() if not v < TOL}
    assert not bad, f"relative errors over {TOL}: {bad}"


def test_bf16_inputs_keep_dtype_and_track_fp32() -> None:
    """bf16 q/k/v (the training precision): outputs and gradients in bf16, close to the fp32 oracle."""
    t = _make_inputs("fpa", "walk", seed=3, seq=32)
    lo = {n: t[n].to(torch.bfloat16) for n in ("q", "k", "v")}
    leaves = {n: x.clone().requires_grad_() for n, x in lo.items()}
    u = t["pre"].float().requires_grad_()
    out = ring_attention(leaves["q"], leaves["k"], leaves["v"], u, kind="fpa", block_size=8)
    out.backward(t["dout"].to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and leaves["q"].grad.dtype == torch.bfloat16
    ref = _reference(
        {**{n: x.double() for n, x in lo.items()}, "pre": t["pre"], "dout": t["dout"]}, "fpa", "walk"
    )
    got = {"out": out, "dq": leaves["q"].grad, "dk": leaves["k"].grad, "dv": leaves["v"].grad, "dpre": u.grad}
    for name, r in ref.items():
        err = float((got[name].detach().double() - r).abs().max() / r.abs().max())
        assert err < 3e-2, f"{name}: relative error {err:.2e}"


def test_sp_cross_entropy_single_rank_value_and_grad_scale() -> None:
    """One rank: the plain mean cross-entropy (ignored targets excluded); grad_scale scales only gradients."""
    from pipeline.trainer.sequence_parallel import sequence_parallel_cross_entropy

    logits = torch.randn(2, 6, 11, generator=torch.Generator().manual_seed(0), requires_grad=True)
    targets = torch.tensor([[1, 2, 3, -100, 4, 5], [6, 7, 8, 9, 10, -100]])
    loss = sequence_parallel_cross_entropy(logits, targets, None)
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert torch.allclose(loss, ref)
    (g1,) = torch.autograd.grad(loss, logits)
    scaled = sequence_parallel_cross_entropy(logits, targets, None, grad_scale=4.0)
    assert torch.allclose(scaled, ref)
    (g4,) = torch.autograd.grad(scaled, logits)
    assert torch.allclose(g4, 4 * g1)


@pytest.mark.triton
@pytest.mark.parametrize(
    ("layout", "kind", "field"),
    [TRITON_CASES[0], TRITON_CASES[3]],
    ids=["zigzag-fpa-walk", "zigzag-fox-gate"],
)
def test_single_process_triton_blocks_match_oracle(
    layout: str, kind: str, field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """world 1, impl="triton": one rank's diagonal and cross pairs on the Triton blocks (interpreter)."""
    monkeypatch.setattr(cp, "_TRITON_BLOCK", TRITON_BLOCK)
    errs = _run_case(0, 1, "ring", layout, kind, field, seed=9, impl="triton", seq=TRITON_SEQ, bh=TRITON_BH)
    bad = {k: v for k, v in errs.items() if not v < TOL}
    assert not bad, f"relative errors over {TOL}: {bad}"


@pytest.mark.triton
def test_ring_impl_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: chunked blocks on CPU tensors; naive means chunked; triton forced where it cannot run, or an
    unknown impl, is a clear error before any communication."""
    import fpa_model.ops.fpa.triton_kernel as tk

    q = torch.zeros(1, 2, 8, 16)
    assert cp._resolve_impl("auto", q, q, q) == "chunked"
    assert cp._resolve_impl("naive", q, q, q) == "chunked"
    assert cp._resolve_impl("triton", q, q, q) == "triton"  # CPU under the interpreter
    with pytest.raises(RuntimeError, match="equal head dims <= 128"):
        cp._resolve_impl("triton", q, q, torch.zeros(1, 2, 8, 8))
    with pytest.raises(ValueError, match="unknown attention impl"):
        ring_attention(q, q, q, torch.zeros(1, 2, 8), kind="fpa", impl="flash")
    monkeypatch.setattr(tk, "_INTERPRET", False)
    with pytest.raises(RuntimeError, match="impl 'triton' is unavailable here.*CUDA tensors"):
        ring_attention(q, q, q, torch.zeros(1, 2, 8), kind="fpa", impl="triton")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_chunk_predecessors_single_process(layout: str) -> None:
    """One rank: the value before each local chunk is the previous chunk's tail, zeros before chunk 0,
    and the gradient reaches the tail that was used (zigzag: chunk 1 gets chunk 0's)."""
    n = cp.num_chunks(1, layout)
    tails = torch.arange(1.0, n + 1.0)[:, None].expand(n, 3).clone().requires_grad_()
    prev = cp.chunk_predecessors(tails, cp.SequenceParallel(None, layout=layout))
    assert prev[:, 0].tolist() == [0.0, 1.0][:n]
    prev.sum().backward()
    assert tails.grad[:, 0].tolist() == ([1.0, 0.0] if n == 2 else [0.0])
    with pytest.raises(ValueError, match="chunks"):
        cp.chunk_predecessors(torch.zeros(n + 1, 3), cp.SequenceParallel(None, layout=layout))
