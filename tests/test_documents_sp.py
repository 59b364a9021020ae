"""model.attention.document_mask under sequence parallelism: W = 2 and 3 spawned gloo ranks (ring in both
layouts, Ulysses) against one process running the naive oracle with the whole sequence's segment ids, on
documents that span 2 and 3 ranks; and a masked GPT step under sp against the same step on one rank (RoPE
at the document positions of each rank's tokens)."""

from __future__ import annotations

import datetime
import json
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fpa_model.ops.fpa.naive import fpa_attention_naive
from fpa_model.sequence_parallel import ring_attention, shard_sequence, ulysses_attention

SEQ = 36  # zigzag chunks of 9 (W=2) and 6 (W=3); contiguous 18 and 12
# Row 0: a document over positions 5..30 spans 3 contiguous ranks at W=3 (and both at W=2); row 1: a
# one-token document and a long tail document; length-1 documents in both.
LENGTHS = [[1, 4, 26, 1, 4], [13, 1, 1, 21]]
CASES = [(m, lay, kind) for m in ("ring", "ulysses") for lay in ("zigzag", "contiguous") for kind in
         ("fpa", "fox", "softmax")]  # fmt: skip
TOL = 1e-4


def _segments() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in LENGTHS])


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {n: torch.randn(2, 6, SEQ, 8, generator=g, dtype=torch.float64) for n in ("q", "k", "v", "dout")}
    t["u"] = torch.randn(2, 6, SEQ, generator=g, dtype=torch.float64)
    return t


def _reference(t, kind, seg):
    leaves = {n: t[n].clone().requires_grad_() for n in ("q", "k", "v", "u")}
    phi = None if kind == "softmax" else leaves["u"].cumsum(-1)
    out = fpa_attention_naive(leaves["q"], leaves["k"], leaves["v"], phi, kind=kind, segment_ids=seg)
    out.backward(t["dout"])
    return {"out": out.detach()} | {"d" + n: x.grad for n, x in leaves.items() if x.grad is not None}


def _case(rank, world, mode, layout, kind, seed):
    t, seg = _inputs(seed), _segments()
    ref = _reference(t, kind, seg)
    loc = {n: shard_sequence(t[n].float(), rank, world, dim=2, layout=layout) for n in t}
    leaves = {n: loc[n].clone().requires_grad_() for n in ("q", "k", "v", "u")}
    attend = ring_attention if mode == "ring" else ulysses_attention
    u = None if kind == "softmax" else leaves["u"]
    out = attend(leaves["q"], leaves["k"], leaves["v"], u, kind=kind, field="walk", block_size=4,
                 layout=layout, impl="chunked", segment_ids=seg)  # fmt: skip
    out.backward(loc["dout"])
    got = {"out": out.detach()} | {"d" + n: x.grad for n, x in leaves.items() if x.grad is not None}
    errs = {}
    for name, r in ref.items():
        if got.get(name) is None:
            errs[name] = float("inf")
            continue
        r_loc = shard_sequence(r, rank, world, dim=2, layout=layout)
        errs[name] = float((got[name].double() - r_loc).abs().max() / r.abs().max())
        errs[name + "_finite"] = 0.0 if bool(torch.isfinite(got[name]).all()) else float("inf")
    return errs


def _gpt(rank, world):
    """A masked GPT step under sp (each layout and mode) vs one rank: loss and every gradient."""
    from data_prep.loader import document_segments
    from fpa_model.config import AttentionConfig, ModelConfig
    from fpa_model.model import GPT
    from fpa_model.sequence_parallel import SequenceParallel
    from pipeline.trainer.loss import lm_loss

    out = {}
    tokens = torch.randint(1, 61, (2, SEQ + 1), generator=torch.Generator().manual_seed(2))
    tokens[0, [0, 4, 30, 31]] = 0
    tokens[1, [12, 13, 14]] = 0  # end-of-document id 0: documents across the rank borders
    x, y = tokens[:, :-1], tokens[:, 1:]
    seg = document_segments(x, 0)
    # fpa with kv_shift: a chunk's first token takes the previous rank's last raw k, v unless a document
    # starts there (row 0's position 5 and row 1's 13-15 sit on or near rank borders).
    for kind, shift in (("fpa", False), ("softmax", False), ("fpa", True)):
        for mode, layout in (("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "zigzag")):
            # log_scale_length 8: the log-n factor at document positions >= 8 (each rank's own tokens)
            att = AttentionConfig(kind=kind, block_size=4, field_weight_std=0.5, impl="chunked",
                                  document_mask=True, log_scale_length=8, kv_shift=shift)  # fmt: skip
            cfg = ModelConfig(vocab_size=61, n_layer=2, n_head=6, d_model=48, max_seq_len=64, attention=att)
            torch.manual_seed(0)
            ref_model = GPT(cfg)
            ref = F.cross_entropy(ref_model(x, segment_ids=seg).flatten(0, 1), y.flatten())
            ref.backward()
            torch.manual_seed(0)
            model = GPT(cfg)
            model.set_sequence_parallel(SequenceParallel(dist.group.WORLD, layout=layout, mode=mode))
            xl, yl = (shard_sequence(z, rank, world, dim=1, layout=layout) for z in (x, y))
            loss = lm_loss(model(xl, segment_ids=seg), yl, group=dist.group.WORLD, grad_scale=world)
            loss.backward()
            errs = {"loss": abs(loss.item() - ref.item())}
            for (n, p), (_, r) in zip(model.named_parameters(), ref_model.named_parameters()):
                g = p.grad.clone()
                dist.all_reduce(g)
                errs[n] = float((g / world - r.grad).abs().max() / r.grad.abs().max().clamp_min(1e-12))
            out[f"{kind}{'-shift' if shift else ''}-{mode}-{layout}"] = errs
    return out


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    res = {}
    for i, case in enumerate(CASES):
        try:
            res["-".join(case)] = _case(rank, world, *case, seed=10 + i)
        except Exception:
            res["-".join(case)] = {"error": traceback.format_exc(limit=5)}
    try:
        res["gpt"] = _gpt(rank, world)
    except Exception:
        res["gpt"] = {"error": traceback.format_exc(limit=6)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


_CACHE: dict[int, list[dict]] = {}


def _spawn(world, tmp_root):
    if world not in _CACHE:
        import torch.multiprocessing as mp

        d = tmp_root / f"w{world}"
        d.mkdir(parents=True, exist_ok=True)
        os.environ["OMP_NUM_THREADS"] = "1"
        mp.spawn(_worker, args=(world, str(d / "rdzv"), str(d)), nprocs=world, join=True)
        _CACHE[world] = [json.loads((d / f"rank{r}.json").read_text()) for r in range(world)]
    return _CACHE[world]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("docsp")


def _check(errs: dict, what: str, tol: float) -> None:
    assert "error" not in errs, f"{what}: {errs.get('error')}"
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"{what}: {bad}"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_document_mask_sequence_parallel_matches_oracle(world, case, tmp_root):
    for rank, res in enumerate(_spawn(world, tmp_root)):
        _check(res["-".join(case)], f"W{world} rank {rank}", TOL)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_masked_gpt_sequence_parallel_step_matches_one_rank(world, tmp_root):
    for rank, res in enumerate(_spawn(world, tmp_root)):
        assert "error" not in res["gpt"], res["gpt"]["error"]
        for name, errs in res["gpt"].items():
            _check(errs, f"W{world} rank {rank} {name}", 2e-4)
