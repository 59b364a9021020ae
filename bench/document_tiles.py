"""Tiles the Triton FPA kernels visit on packed documents, with the document mask and without it.

    python bench/document_tiles.py                       # T=1024 / mean 128 and T=4096 / mean 512
    python bench/document_tiles.py --configs 2048:256 --seed 1 --out /tmp/doc_tiles

Each configuration packs documents of exponentially distributed lengths (mean as given, at least 1 token)
into windows of T positions (--windows of them, batch rows, counts summed); the first document is cut by the
window start (a random offset into it) and the last by the window end, as data_prep's windows cut them.
The forward and the backward run once with the kernels' tile counter on (tile_counter=, the COUNT switch),
on each kernel's first GPU tile of the head-dim-64 lists, with segment ids and without; the counts are
checked against the host mirror of the loop bounds (triton_kernel.visited_tiles). Without CUDA the kernels
run under the Triton interpreter (the counts do not depend on the machine; the head dim is 16 to keep that
fast, the kind softmax: the loop bounds are the same for every kind). Also printed: the visible pairs'
share of the causal pairs, the lower bound of the fraction at tile size 1. Writes
docs/results/document_tiles/result.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from bench.documents import packed_segments  # noqa: E402
from bench.results import (  # noqa: E402
    finish_provenance,
    markdown_table,
    provenance,
    provenance_md,
    write_result,
)
from fpa_model.ops.fpa import triton_kernel as tk  # noqa: E402

KERNELS = tuple(tk.COUNTER_SLOTS)  # fwd, dq, dkv


def count(t: int, tiles: dict, seg: torch.Tensor | None, device: str) -> list[int]:
    """The tile counter (fwd, dq, dkv) of one forward + backward at H = 1 on the windows seg (B, T), or on one
    unmasked window (seg None)."""
    g = torch.Generator().manual_seed(0)
    b = 1 if seg is None else seg.shape[0]
    q, k, v = (torch.randn(b, 1, t, 16, generator=g).to(device).requires_grad_() for _ in range(3))
    counter = torch.zeros(3, dtype=torch.int32, device=device)
    ids = None if seg is None else seg.to(device)
    out = tk.fpa_attention_triton(
        q, k, v, None, kind="softmax", tiles=tiles, segment_ids=ids, tile_counter=counter
    )
    out.sum().backward()
    return counter.tolist()


def measure(t: int, mean: float, seed: int, windows: int, device: str) -> dict:
    """Counts summed over `windows` packed windows (seeds seed, seed + 1, ...); unmasked: windows x one."""
    packed = [packed_segments(t, mean, seed + w) for w in range(windows)]
    seg = torch.stack([s for s, _ in packed])
    tiles = {name: tk.GPU_TILES_BY_DIM[name][64][0] for name in KERNELS}
    plain, masked = count(t, tiles, None, device), count(t, tiles, seg, device)
    plain = [n * windows for n in plain]
    for name, slot in tk.COUNTER_SLOTS.items():
        want = (
            windows * tk.visited_tiles(name, tiles[name], t),
            sum(tk.visited_tiles(name, tiles[name], t, row) for row in seg),
        )
        if (plain[slot], masked[slot]) != want:
            raise SystemExit(f"{name}: counted {plain[slot]}, {masked[slot]} tiles, the mirror says {want}")
    visible = sum(n * (n + 1) // 2 for _, lengths in packed for n in lengths)
    return {
        "T": t,
        "mean_length": mean,
        "windows": windows,
        "documents": sum(len(lengths) for _, lengths in packed),
        "visible_pair_fraction": round(visible / (windows * t * (t + 1) // 2), 4),
        "kernels": {
            name: {
                "tile": f"{tiles[name].block_m}x{tiles[name].block_n}",
                "unmasked": plain[slot],
                "masked": masked[slot],
                "ratio": round(masked[slot] / plain[slot], 4),
            }
            for name, slot in tk.COUNTER_SLOTS.items()
        },
    }


def result_markdown(rows: list[dict], prov: dict) -> str:
    table = [
        [r["T"], r["mean_length"], r["windows"], r["documents"], name, k["tile"], k["unmasked"], k["masked"],
         f"{k['ratio']:.3f}", f"{r['visible_pair_fraction']:.3f}"]
        for r in rows
        for name, k in r["kernels"].items()
    ]  # fmt: skip
    header = ["T", "mean doc", "windows", "docs", "kernel", "tile (M x N)", "tiles unmasked",
              "tiles masked", "ratio", "visible pairs"]  # fmt: skip
    return "\n".join(
        [
            "# Tiles the Triton kernels visit on packed documents",
            "",
            provenance_md(prov),
            "",
            "Windows of T positions packed with documents of exponential lengths "
            "(`bench/document_tiles.py`): (query tile, key tile) pairs each kernel visits, summed over the "
            "windows (one head each), with segment ids and without, on each kernel's first GPU tile of the "
            "head-dim-64 lists, counted by the kernels' tile counter and equal to the host mirror of their "
            "loop bounds. *Visible pairs*: the share of causal pairs inside one document (the bound at tile "
            "size 1).",
            "",
            markdown_table(header, table),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="1024:128,4096:512", help="T:mean document length, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--windows", type=int, default=4, help="packed windows per configuration (batch rows)")
    ap.add_argument("--out", type=Path, default=None, help="default: docs/results/document_tiles")
    args = ap.parse_args(argv)
    prov = provenance(None if argv is None else ["bench/document_tiles.py", *argv])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for spec in args.configs.split(","):
        t, mean = spec.split(":")
        row = measure(int(t), float(mean), args.seed, args.windows, device)
        rows.append(row)
        for name, k in row["kernels"].items():
            print(
                f"T={row['T']} mean {row['mean_length']:g} "
                f"({row['windows']} windows, {row['documents']} docs) "
                f"{name:4s} {k['tile']:>7s}: "
                f"{k['unmasked']} -> {k['masked']} tiles, ratio {k['ratio']:.3f} "
                f"(visible pairs {row['visible_pair_fraction']:.3f})",
                flush=True,
            )
    finish_provenance(prov)
    data = {"device": device, "interpreter": os.environ.get("TRITON_INTERPRET") == "1", "seed": args.seed}
    out = write_result(
        "document_tiles", {**data, "rows": rows, "provenance": prov}, result_markdown(rows, prov), args.out
    )
    print(f"wrote {out}/result.json and result.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
