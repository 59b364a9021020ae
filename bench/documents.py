"""CPU attention on packed documents: the chunked path with segment ids against itself unmasked and SDPA.

    python bench/documents.py                     # T=8192, mean document 512, H=2, D=64, block 256
    python bench/documents.py --quick             # T=2048, 2 repeats, no result file
    python bench/documents.py --block-size 128 --out /tmp/docs

One window of T positions packed with documents of exponentially distributed lengths (mean --mean-length,
at least 1 token, fixed --seed; the first document cut by the window start, the last by its end:
document_tiles' windows). Contenders, forward + backward, fp32, B=1, one thread:
    <kind>-masked     chunked_fpa_attention(kind, segment_ids=...) for kind fpa, fox, softmax
    <kind>-unmasked   the same call without segment_ids (plain causal attention over the whole window)
    sdpa-mask         scaled_dot_product_attention with the equivalent (T, T) boolean mask: causal and
                      block-diagonal over the documents (softmax, no field)
    sdpa-causal       scaled_dot_product_attention(is_causal=True), the unmasked reference
flex_attention (torch.nn.attention.flex_attention, with a block mask of the documents) is tried once on a
small case; torch 2.13 has no flex_attention backward on CPU, and the output says so when that is why it
is left out. Timing: bench/attention.py's time_cases (median wall and process CPU time over --repeats
interleaved rounds after a warm-up). Before timing, the masked chunked softmax is checked against sdpa-mask
(outputs and gradients) at T=512, which also checks the mask. Targets (fpa): masked <= 0.3x unmasked and
<= 1.3x sdpa-mask. Writes docs/results/documents/result.{json,md} (or --out); --quick writes none.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

from bench.attention import time_cases  # noqa: E402
from fpa_model.ops.fpa.chunked import chunked_fpa_attention  # noqa: E402

KINDS = ("fpa", "fox", "softmax")
TARGET_VS_UNMASKED = 0.3
TARGET_VS_SDPA = 1.3


def packed_segments(t: int, mean: float, seed: int) -> tuple[torch.Tensor, list[int]]:
    """(T,) document ids of one packed window and the documents' lengths inside it."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < t:
        lengths.append(max(1, round(float(torch.empty(1).exponential_(1 / mean, generator=g)))))
    lengths[0] -= int(torch.randint(0, lengths[0], (1,), generator=g))  # the window starts inside it
    lengths[-1] -= sum(lengths) - t  # ... and ends inside the last one
    lengths = [n for n in lengths if n > 0]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)), lengths


def document_mask(seg: torch.Tensor) -> torch.Tensor:
    """(T, T) bool, True where query i may see key j: j <= i and both in one document (seg (T,))."""
    pos = torch.arange(seg.shape[0])
    return (pos[:, None] >= pos[None, :]) & (seg[:, None] == seg[None, :])


def visible_pair_fraction(lengths: list[int], t: int) -> float:
    """The share of the causal pairs that lie inside one document."""
    return sum(n * (n + 1) // 2 for n in lengths) / (t * (t + 1) // 2)


def make_case(
    name: str, seg: torch.Tensor, h: int, d: int, bs: int, seed: int = 0
) -> Callable[[], torch.Tensor]:
    """A closure running forward + backward of one contender on fresh-gradient inputs (returns the output)."""
    t = seg.shape[0]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, t, d, generator=g).requires_grad_() for _ in range(3))
    u = torch.randn(1, h, t, generator=g)
    kind, _, variant = name.partition("-")
    if kind == "fpa":
        phi = (0.3 * u).cumsum(-1).requires_grad_()
    elif kind == "fox":
        phi = F.logsigmoid(u + 3.0).cumsum(-1).requires_grad_()
    else:
        phi = None
    dout = torch.randn(1, h, t, d, generator=g)
    mask = document_mask(seg) if name == "sdpa-mask" else None
    ids = seg[None] if variant == "masked" else None

    def run() -> torch.Tensor:
        for x in (q, k, v, phi):
            if x is not None:
                x.grad = None
        if name == "sdpa-mask":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif name == "sdpa-causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = chunked_fpa_attention(q, k, v, phi, kind=kind, block_size=bs, segment_ids=ids)
        out.backward(dout)
        return out

    run.leaves = (q, k, v)  # type: ignore[attr-defined]
    return run


def check_against_sdpa(bs: int, mean: float, seed: int) -> float:
    """Max abs difference of the masked chunked softmax and sdpa-mask at T=512 (outputs, dq, dk, dv)."""
    seg, _ = packed_segments(512, mean / 4, seed)
    a, b = make_case("softmax-masked", seg, 2, 16, min(bs, 64)), make_case("sdpa-mask", seg, 2, 16, bs)
    outs = [a(), b()]
    err = float((outs[0] - outs[1]).detach().abs().max())
    for x, y in zip(a.leaves, b.leaves):  # type: ignore[attr-defined]
        err = max(err, float((x.grad - y.grad).abs().max()))
    return err


def try_flex(seg: torch.Tensor) -> str:
    """flex_attention forward + backward with the documents' block mask on a small window: 'ok' or why not."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return f"not available: {e}"
    t = seg.shape[0]

    def doc_causal(b, h, qi, kj):
        return (qi >= kj) & (seg[qi] == seg[kj])

    try:
        block = create_block_mask(doc_causal, 1, 1, t, t, device="cpu")
        q, k, v = (torch.randn(1, 1, t, 16, requires_grad=True) for _ in range(3))
        flex_attention(q, k, v, block_mask=block).sum().backward()
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return "ok"


def contenders(kinds: Sequence[str]) -> list[str]:
    return [f"{k}-{v}" for k in kinds for v in ("masked", "unmasked")] + ["sdpa-mask", "sdpa-causal"]


def ratios(res: dict[str, dict], kinds: Sequence[str], key: str) -> dict[str, dict[str, float]]:
    """Per kind: masked / unmasked and masked / sdpa-mask of the timing `key` (wall_ms or cpu_ms)."""
    return {
        k: {
            "vs_unmasked": res[f"{k}-masked"][key] / res[f"{k}-unmasked"][key],
            "vs_sdpa_mask": res[f"{k}-masked"][key] / res["sdpa-mask"][key],
        }
        for k in kinds
    }


def result_markdown(data: dict, prov: dict) -> str:
    from bench.results import markdown_table, provenance_md

    res, kinds = data["timings"], data["kinds"]
    rw, rc = ratios(res, kinds, "wall_ms"), ratios(res, kinds, "cpu_ms")
    table = [
        [k, f"{rw[k]['vs_unmasked']:.2f}x", f"{rc[k]['vs_unmasked']:.2f}x", f"{rw[k]['vs_sdpa_mask']:.2f}x",
         f"{rc[k]['vs_sdpa_mask']:.2f}x",
         f"{res[f'{k}-masked']['wall_ms']:.0f} / {res[f'{k}-unmasked']['wall_ms']:.0f}"]
        for k in kinds
    ]  # fmt: skip
    header = ["kind", "masked / unmasked wall", "CPU", "masked / SDPA mask wall", "CPU",
              "wall ms masked / unmasked"]  # fmt: skip
    fpa = rw.get("fpa")
    verdict = []
    if fpa is not None:
        for what, got, want in (
            ("masked <= 0.3x unmasked", fpa["vs_unmasked"], TARGET_VS_UNMASKED),
            ("masked <= 1.3x SDPA with the same mask", fpa["vs_sdpa_mask"], TARGET_VS_SDPA),
        ):
            verdict.append(f"- FPA {what}: {got:.2f}x, {'met' if got <= want else '**not met**'}")
    return "\n".join(
        [
            "# Attention on packed documents, forward + backward: the chunked path with segment ids",
            "",
            provenance_md(prov),
            "",
            f"fp32, B=1, H={data['heads']}, D={data['head_dim']}, T={data['T']}, chunked block "
            f"{data['block_size']}, threads: {prov['machine']['torch_threads']}; one window of "
            f"{data['documents']} documents (exponential lengths, mean {data['mean_length']:g}, seed "
            f"{data['seed']}; the longest {max(data['lengths'])}), visible pairs "
            f"{data['visible_pair_fraction']:.3f} of the causal ones, chunked tiles visited "
            f"{data['tile_fraction']:.3f} of the causal ones. Time: median over {data['repeats']} "
            "interleaved runs per contender after a warm-up, wall and process CPU time. *Unmasked*: the same "
            "call without segment ids; *SDPA mask*: scaled_dot_product_attention with the equivalent "
            f"boolean (T, T) mask ({res['sdpa-mask']['wall_ms']:.0f} ms; is_causal without the documents: "
            f"{res['sdpa-causal']['wall_ms']:.0f} ms). flex_attention: {data['flex'].rstrip('.')}.",
            "",
            markdown_table(header, table),
            "",
            *verdict,
        ]
    )


def tile_fraction(seg: torch.Tensor, bs: int) -> float:
    """The share of the causal (query block, key block) tiles the chunked walk visits at block bs."""
    n = -(-seg.shape[0] // bs)
    pad = torch.cat([seg, (seg[-1:] + 1).expand(n * bs - seg.shape[0])]).view(n, bs)
    first, last = pad[:, 0], pad[:, -1]
    visited = sum(int((last[: n - d] >= first[d:]).sum()) for d in range(n))
    return visited / (n * (n + 1) // 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=8192, help="window length T")
    ap.add_argument("--mean-length", type=float, default=512.0, help="mean document length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=256, help="tile size of the chunked path")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kinds", default=",".join(KINDS), help="attention kinds of the chunked contenders")
    ap.add_argument("--quick", action="store_true", help="smoke run: T=2048, 2 repeats, no result file")
    ap.add_argument("--out", type=Path, default=None, help="default docs/results/documents")
    args = ap.parse_args(argv)
    if args.quick:
        args.length, args.repeats = 2048, 2
    from bench.results import finish_provenance, provenance, write_result

    prov = provenance(None if argv is None else ["bench/documents.py", *argv])
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    kinds = args.kinds.split(",")
    t, h, d, bs = args.length, args.heads, args.head_dim, args.block_size
    seg, lengths = packed_segments(t, args.mean_length, args.seed)
    print(
        f"CPU attention fwd+bwd on packed documents, fp32, B=1, H={h}, D={d}, T={t}, {len(lengths)} "
        f"documents (mean {args.mean_length:g}), block={bs}, threads={torch.get_num_threads()}, "
        f"torch {torch.__version__}"
    )
    err = check_against_sdpa(bs, args.mean_length, args.seed)
    if err > 1e-4:
        print(
            f"masked chunked softmax != SDPA with the document mask: max abs error {err:.2e}", file=sys.stderr
        )
        return 1
    print(f"correctness: masked chunked softmax == SDPA with the document mask at T=512 ({err:.1e})")
    flex = try_flex(packed_segments(256, 64, args.seed)[0])
    print(f"flex_attention (CPU, block mask, fwd + bwd): {flex}")
    names = contenders(kinds)
    cases = {name: make_case(name, seg, h, d, bs) for name in names}
    res = time_cases(cases, args.repeats)
    print(f"\n{'contender':>18} {'wall ms':>9} {'cpu ms':>9}")
    for name in names:
        print(f"{name:>18} {res[name]['wall_ms']:>9.1f} {res[name]['cpu_ms']:>9.1f}")
    rw, rc = ratios(res, kinds, "wall_ms"), ratios(res, kinds, "cpu_ms")
    print()
    for k in kinds:
        print(
            f"{k:>8}: masked / unmasked {rw[k]['vs_unmasked']:.2f}x wall, {rc[k]['vs_unmasked']:.2f}x CPU "
            f"(target <= {TARGET_VS_UNMASKED}x); masked / SDPA mask {rw[k]['vs_sdpa_mask']:.2f}x wall, "
            f"{rc[k]['vs_sdpa_mask']:.2f}x CPU (target <= {TARGET_VS_SDPA}x)"
        )
    if args.quick:
        return 0
    finish_provenance(prov)
    data = {
        "T": t,
        "heads": h,
        "head_dim": d,
        "block_size": bs,
        "mean_length": args.mean_length,
        "seed": args.seed,
        "documents": len(lengths),
        "lengths": lengths,
        "visible_pair_fraction": round(visible_pair_fraction(lengths, t), 4),
        "tile_fraction": round(tile_fraction(seg, bs), 4),
        "repeats": args.repeats,
        "kinds": kinds,
        "flex": flex,
        "timings": res,
        "ratios": {"wall": rw, "cpu": rc},
        "targets": {"vs_unmasked": TARGET_VS_UNMASKED, "vs_sdpa_mask": TARGET_VS_SDPA},
        "provenance": prov,
    }
    out = write_result("documents", data, result_markdown(data, prov), args.out)
    print(f"wrote {out}/result.json and result.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
