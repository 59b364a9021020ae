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
    trained-L<n>  with --export RUN/export: q, k, v, phi of layer n of a trained model, its projections
                  applied to real text (the last verses of the packaged KJV, T tokens of the run's
                  tokenizer); the layer's own kind, and the loss of the whole model on that text with
                  skipping off and on

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
    ap.add_argument("--export", type=Path, default=None, help="a trained run's export dir: its fields too")
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


def text_tokens(export: Path, t: int) -> torch.Tensor:
    """(1, t) token ids: the last verses of the packaged KJV under the run's tokenizer."""
    import json

    from tokenizers import Tokenizer

    from data_prep.sources import packaged_path

    tok = Tokenizer.from_file(str(export.parent / "data" / "tokenizer.json"))
    lines = packaged_path("kjv").read_text().splitlines()
    ids: list[int] = []
    n = 64
    while len(ids) < t and n <= len(lines):
        ids = tok.encode(" ".join(json.loads(x)["text"] for x in lines[-n:])).ids
        n *= 2
    if len(ids) < t:
        raise SystemExit(f"the packaged corpus holds fewer than {t} tokens under {export}'s tokenizer")
    return torch.tensor(ids[-t:])[None]


def trained_fields(export: Path, t: int):
    """The model, its token ids and [(layer name, kind, q, k, v, phi)] captured from one forward."""
    from pipeline.export import load_exported

    model = load_exported(export)
    idx = text_tokens(export, t)
    captured = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        orig = attn.attend

        def grab(q, k, v, phi, segment_ids=None, _orig=orig, _i=i, _attn=attn):
            captured.append(
                (f"trained-L{_i}", _attn.spec.name, q.detach(), k.detach(), v.detach(), phi.detach())
            )
            return _orig(q, k, v, phi, segment_ids)

        attn.attend = grab
    with torch.no_grad():
        model(idx)
    for block in model.blocks:
        del block.attn.attend
    return model, idx, captured


def model_loss(model, idx: torch.Tensor, eps: float | None) -> float:
    for block in model.blocks:
        block.attn.cfg.skip_epsilon = eps
    with torch.no_grad():
        logits = model(idx)
    return float(F.cross_entropy(logits[0, :-1], idx[0, 1:]))


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


def measure(field: str, t: int, h: int, d: int, bs: int, eps: float, repeats: int, given=None) -> dict:
    if given is None:
        kind = field.split("-")[0]
        q, k, v, phi, dout = inputs(field, t, h, d)
    else:  # a trained layer's tensors
        kind, q, k, v, phi = given
        dout = torch.randn(v.shape, generator=torch.Generator().manual_seed(0))
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


def result_markdown(rows: list[dict], losses: list[dict], args: argparse.Namespace, prov: dict) -> str:
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
        + (
            [
                "",
                f"Trained fields: layers of `{args.export}` (B=1, its own heads and head size) on the last "
                "verses of the packaged KJV; the whole model's loss on that text, skipping off / on:",
                "",
                markdown_table(
                    ["T", "loss, every tile", "loss, skipping", "difference"],
                    [
                        [x["T"], f"{x['off']:.6f}", f"{x['on']:.6f}", f"{x['on'] - x['off']:+.1e}"]
                        for x in losses
                    ],
                ),
            ]
            if losses
            else []
        )
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
    rows, losses = [], []
    for t in lengths:
        reps = args.repeats if t <= 4096 else min(args.repeats, 3)
        cases = [(field, None) for field in FIELDS]
        if args.export is not None:
            model, idx, captured = trained_fields(args.export, t)
            cases += [(name, (kind, q, k, v, phi)) for name, kind, q, k, v, phi in captured]
            loss = {"T": t, "off": model_loss(model, idx, None), "on": model_loss(model, idx, args.epsilon)}
            losses.append(loss)
            print(f"T={t:>6} trained model loss on the text: {loss['off']:.6f} off, {loss['on']:.6f} on")
        for field, given in cases:
            r = measure(field, t, args.heads, args.head_dim, args.block_size, args.epsilon, reps, given)
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
        meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        data = {"args": meta, "rows": rows, "losses": losses, "provenance": prov}
        out = write_result("tile_skipping", data, result_markdown(rows, losses, args, prov), args.result_dir)
        print(f"wrote {out}/result.json and result.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
