"""CPU benchmark of tile skipping (model.attention.skip_epsilon) in the chunked path.

For each T and field, side by side in one run (interleaved, after a warm-up, medians; fp32, B=1, one
thread unless OMP_NUM_THREADS says otherwise): forward + backward of chunked FPA (or FoX) with every tile,
the same with skipping on, and torch SDPA (causal softmax, no bias). Also the fraction of cross tiles
skipped (skipping.skip_counts over one forward) and the largest output difference against every tile,
beside the guarantee 2 * epsilon * max|v|.

Fields (phi, per head):
    fpa-walk      phi = cumsum(0.3 u), u ~ N(0, 1): a random walk, the sticky dips of chance alone
    fpa-sawtooth  phi = cumsum of increments that dip by 30 every 64 tokens: most old keys erased
    fox-gate      phi = cumsum(logsigmoid(u + 3)): FoX's decay at its usual init

Usage: python bench/tile_skipping.py [--lengths 2048,8192] [--heads 8] [--head-dim 64] [--block-size 128]
                                     [--epsilon 1e-3] [--repeats 5] [--quick] [--no-result]

Writes docs/results/tile_skipping/result.{json,md} (or --result-dir) with the commit, machine, command
and load average; --quick and --no-result write none.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

from bench.attention import time_cases
from fpa_model.ops.fpa.chunked import chunked_fpa_attention
from fpa_model.ops.fpa.skipping import skip_counts

FIELDS = ("fpa-walk", "fpa-sawtooth", "fox-gate")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,8192", help="sequence lengths T")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=128, help="tile size of the chunked path")
    ap.add_argument("--epsilon", type=float, default=1e-3, help="skip_epsilon")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per contender; 3 above T=4096")
    ap.add_argument("--quick", action="store_true", help="smoke run: T=512, 2 heads, 2 repeats, no result")
    ap.add_argument("--result-dir", type=Path, default=None, help="default docs/results/tile_skipping")
    ap.add_argument("--no-result", action="store_true", help="write no result file")
    return ap.parse_args(argv)


def field_of(name: str, h: int, t: int, g: torch.Generator) -> torch.Tensor:
    u = torch.randn(1, h, t, generator=g)
    if name == "fpa-walk":
        return (0.3 * u).cumsum(-1)
    if name == "fpa-sawtooth":
        dips = torch.where(torch.arange(t) % 64 == 0, -30.0, 0.0)
        return (0.1 * u + dips).cumsum(-1)
    return F.logsigmoid(u + 3.0).cumsum(-1)


def inputs(field: str, t: int, h: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, t, d, generator=g) for _ in range(3))
    return q, k, v, field_of(field, h, t, g), torch.randn(1, h, t, d, generator=g)


def make_run(q, k, v, phi, dout, kind: str | None, bs: int, eps: float | None):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, phi)]

    def run() -> None:
        for x in leaves:
            x.grad = None
        if kind is None:
            out = F.scaled_dot_product_attention(*leaves[:3], is_causal=True)
        else:
            out = chunked_fpa_attention(*leaves, kind=kind, block_size=bs, skip_epsilon=eps)
        out.backward(dout)

    return run


def measure(field: str, t: int, h: int, d: int, bs: int, eps: float, repeats: int) -> dict:
    kind = field.split("-")[0]
    q, k, v, phi, dout = inputs(field, t, h, d)
    with torch.no_grad():
        full = chunked_fpa_attention(q, k, v, phi, kind=kind, block_size=bs)
        with skip_counts() as counts:
            skipped = chunked_fpa_attention(q, k, v, phi, kind=kind, block_size=bs, skip_epsilon=eps)
    cases = {
        "every tile": make_run(q, k, v, phi, dout, kind, bs, None),
        "skipping": make_run(q, k, v, phi, dout, kind, bs, eps),
        "sdpa": make_run(q, k, v, phi, dout, None, bs, None),
    }
    times = time_cases(cases, repeats)
    return {
        "field": field,
        "T": t,
        "tiles": counts.total,
        "skipped": counts.skipped,
        "fraction_skipped": counts.fraction_skipped,
        "max_out_diff": float((skipped - full).abs().max()),
        "guarantee": 2 * eps * float(v.abs().max()),
        "ms": {n: r["wall_ms"] for n, r in times.items()},
        "cpu_ms": {n: r["cpu_ms"] for n, r in times.items()},
        "repeats": repeats,
    }


def result_markdown(rows: list[dict], args: argparse.Namespace, prov: dict) -> str:
    from bench.results import markdown_table, provenance_md

    table = []
    for r in rows:
        ms = r["ms"]
        table.append(
            [
                r["T"],
                r["field"],
                f"{100 * r['fraction_skipped']:.1f}% of {r['tiles']:,}",
                f"{ms['skipping'] / ms['every tile']:.2f}x",
                f"{ms['skipping'] / ms['sdpa']:.2f}x",
                f"{ms['every tile'] / ms['sdpa']:.2f}x",
                f"{ms['skipping']:.0f} / {ms['every tile']:.0f} / {ms['sdpa']:.0f}",
                f"{r['max_out_diff']:.1e} (< {r['guarantee']:.1e})",
            ]
        )
    header = [
        "T",
        "field",
        "cross tiles skipped",
        "skipping / every tile",
        "skipping / SDPA",
        "every tile / SDPA",
        "wall ms skipping / every tile / SDPA",
        "max output change (guarantee)",
    ]
    return "\n".join(
        [
            "# Tile skipping in the chunked path: forward + backward against every tile and SDPA",
            "",
            provenance_md(prov),
            "",
            f"fp32, B=1, H={args.heads}, D={args.head_dim}, chunked block {args.block_size}, skip_epsilon "
            f"{args.epsilon:g}, threads: {prov['machine']['torch_threads']}; wall time: median of "
            f"{args.repeats} runs per contender (3 above T=4096), interleaved after a warm-up.",
            "",
            markdown_table(header, table),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.lengths, args.heads, args.repeats, args.no_result = "512", 2, 2, True
    from bench.results import finish_provenance, provenance, write_result

    prov = provenance(None if argv is None else ["bench/tile_skipping.py", *argv])
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    lengths = [int(x) for x in args.lengths.split(",")]
    print(
        f"tile skipping, fwd+bwd, fp32, B=1, H={args.heads}, D={args.head_dim}, block {args.block_size}, "
        f"epsilon {args.epsilon:g}, threads={torch.get_num_threads()}"
    )
    rows = []
    for t in lengths:
        reps = args.repeats if t <= 4096 else min(args.repeats, 3)
        for field in FIELDS:
            r = measure(field, t, args.heads, args.head_dim, args.block_size, args.epsilon, reps)
            rows.append(r)
            ms = r["ms"]
            print(
                f"T={t:>6} {field:>13}: skipped {100 * r['fraction_skipped']:5.1f}%  skipping / every tile "
                f"{ms['skipping'] / ms['every tile']:.2f}x, / SDPA {ms['skipping'] / ms['sdpa']:.2f}x "
                f"(every tile / SDPA {ms['every tile'] / ms['sdpa']:.2f}x); "
                f"max change {r['max_out_diff']:.1e} < {r['guarantee']:.1e}",
                flush=True,
            )
    if not args.no_result:
        finish_provenance(prov)
        data = {"args": vars(args) | {"result_dir": None}, "rows": rows, "provenance": prov}
        out = write_result("tile_skipping", data, result_markdown(rows, args, prov), args.result_dir)
        print(f"wrote {out}/result.json and result.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
