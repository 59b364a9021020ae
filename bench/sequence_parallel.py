"""Sequence-parallel FPA on CPU: per-rank time and memory of a 2-rank ring vs one process, growing T.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sequence_parallel.py            # T = 1024 .. 8192
    OMP_NUM_THREADS=1 .venv/bin/python bench/sequence_parallel.py --quick    # T = 512, 1024: a smoke run
    OMP_NUM_THREADS=1 .venv/bin/python bench/sequence_parallel.py --traffic  # the ring's messages

Every measurement runs in fresh processes (gloo, one thread each): the single-process baseline is the
chunked path (fpa_model.ops.fpa.chunked_fpa_attention) on the whole sequence, the ring is
ring_attention over 2 ranks in the zigzag and the contiguous layout, and ulysses_attention
(all-to-all over heads, the chunked path on the whole sequence for half of the heads). Time: forward +
backward, median over repeats of the slowest rank (a step waits for it), as wall time and as CPU time of
the process (time.process_time: less sensitive to other load on a shared machine). Memory: peak RSS
(VmHWM, reset through /proc/self/clear_refs after a warm-up step and malloc_trim) minus the RSS at that
point, i.e. the extra memory a forward + backward needs on top of its inputs, per process. With 2 ranks
on a 2-core machine the ideal time ratio is 0.5 and the ideal memory ratio about 0.5 (each rank holds
half of the sequence and of the workspace). Timings are only meaningful on an otherwise idle machine.

--traffic counts instead of timing: the key-chunk messages (K|V with phi, and the gradient shares going
back) that the ring's ranks send in one forward + backward, summed over the ranks (ring_traffic), at
W = 2 and 4, both layouts, on the tile-skipping benchmark's fields with skipping off and on, against
forwarding every chunk round the whole ring (3 passes x W(W-1) x chunks per rank). Counts do not depend
on the machine's load.

Writes docs/results/sequence_parallel/result.{json,md} (or --result-dir) with the commit, machine, command
and the load average at the start and end (--traffic: docs/results/ring_traffic/); --quick and
--no-result write none.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fpa_model.config import ATTENTION_KINDS
from fpa_model.ops.fpa.chunked import chunked_fpa_attention
from fpa_model.ops.fpa.skipping import skip_counts
from fpa_model.sequence_parallel import (
    num_chunks,
    ring_attention,
    ring_traffic,
    shard_sequence,
    ulysses_attention,
)


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> bool:
    """Release freed heap to the OS and reset the peak RSS (Linux clear_refs 5); False if not possible."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _inputs(args: argparse.Namespace, seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, seq, args.dim)
    t = {n: torch.randn(shape, generator=g) for n in ("q", "k", "v", "dout")}
    t["u"] = torch.randn(args.batch, args.heads, seq, generator=g) * 0.3 - 0.05  # walk increments
    return t


def _worker(
    rank: int, world: int, variant: str, seq: int, args: argparse.Namespace, rdzv: str, out: str
) -> None:
    torch.set_num_threads(1)
    layout = "zigzag" if variant == "ulysses" else variant
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=600),
        )  # fmt: skip
    t = _inputs(args, seq)
    if world > 1:
        t = {n: shard_sequence(x, rank, world, dim=2, layout=layout) for n, x in t.items()}
    leaves = {n: t[n].clone().requires_grad_() for n in ("q", "k", "v", "u")}

    def step() -> None:
        for x in leaves.values():
            x.grad = None
        if world > 1:
            attention = ring_attention if variant != "ulysses" else ulysses_attention
            o = attention(
                leaves["q"], leaves["k"], leaves["v"], leaves["u"], kind=args.kind, field="walk",
                block_size=args.block, layout=layout,
            )  # fmt: skip
        else:
            phi = leaves["u"].cumsum(-1)
            o = chunked_fpa_attention(
                leaves["q"], leaves["k"], leaves["v"], phi, kind=args.kind, block_size=args.block
            )
        o.backward(t["dout"])

    times = []
    for i in range(args.repeats + 1):  # the first is a warm-up (library workspaces, lazy inits)
        if i == 1:
            exact = _reset_peak()
            base = _status_mb("VmRSS")
        if world > 1:
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        times.append(dt.tolist())
    # Peak since the reset (VmHWM); without clear_refs the lifetime peak, which includes the warm-up.
    peak = (
        _status_mb("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ) - base
    wall = statistics.median(t[0] for t in times[1:])
    cpu = statistics.median(t[1] for t in times[1:])
    Path(out, f"rank{rank}.txt").write_text(f"{wall} {cpu} {peak}")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def measure(world: int, variant: str, seq: int, args: argparse.Namespace) -> tuple[float, float, list[float]]:
    """(median step wall seconds, median CPU seconds of the busiest rank, per-rank extra peak MB)."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, variant, seq, args, str(Path(d, "rdzv")), d), nprocs=world, join=True)
        rows = [Path(d, f"rank{r}.txt").read_text().split() for r in range(world)]
    return float(rows[0][0]), float(rows[0][1]), [float(r[2]) for r in rows]


TRAFFIC_FIELDS = ("fpa-walk", "fpa-sawtooth", "fox-gate")


def _traffic_worker(
    rank: int, world: int, layout: str, field: str, eps: float | None, args: argparse.Namespace, rdzv: str,
    out: str,
) -> None:  # fmt: skip
    from bench.tile_skipping import inputs

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    q, k, v, phi, dout = inputs(field, args.traffic_seq, args.heads, args.dim, seed=0)
    loc = [shard_sequence(x, rank, world, dim=2, layout=layout) for x in (q, k, v, phi, dout)]
    leaves = [x.clone().requires_grad_() for x in loc[:4]]
    kind = "fox" if field.startswith("fox") else "fpa"
    with ring_traffic() as sent, skip_counts() as tiles:
        o = ring_attention(
            *leaves, kind=kind, field="direct", layout=layout, block_size=args.block, skip_epsilon=eps
        )  # fmt: skip
        o.backward(loc[4])
    n = torch.tensor([sent.chunks, sent.bytes, tiles.kept, tiles.skipped], dtype=torch.float64)
    dist.all_reduce(n)
    if rank == 0:
        Path(out, "traffic.txt").write_text(" ".join(str(int(x)) for x in n.tolist()))
    dist.destroy_process_group()


def measure_traffic(world: int, layout: str, field: str, eps: float | None, args: argparse.Namespace) -> dict:
    """One forward + backward of the ring: chunk messages and bytes sent (all ranks), pairs skipped."""
    with tempfile.TemporaryDirectory() as d:
        a = (world, layout, field, eps, args, str(Path(d, "rdzv")), d)
        mp.spawn(_traffic_worker, args=a, nprocs=world, join=True)
        chunks, nbytes, kept, skipped = map(int, Path(d, "traffic.txt").read_text().split())
    whole = 3 * world * (world - 1) * (num_chunks(world, layout) // world)
    return {
        "world": world, "layout": layout, "field": field, "epsilon": eps, "chunks": chunks,
        "mb": nbytes / 2**20, "whole_ring_chunks": whole, "chunk_ratio": chunks / whole,
        "pairs_kept": kept, "pairs_skipped": skipped,
    }  # fmt: skip


def traffic_markdown(rows: list[dict], args: argparse.Namespace, prov: dict) -> str:
    from bench.results import provenance_md

    lines = [
        "# Sequence-parallel ring: the messages it sends",
        "",
        "## Messages",
        "",
        provenance_md(prov),
        "",
        f"T={args.traffic_seq}, B=1, H={args.heads}, D={args.dim}, fp32, one forward + backward of "
        "ring_attention (field values passed directly), summed over the ranks. A message is one key "
        "chunk's K|V with its phi (forward, and again in the backward) or its gradient share going back "
        "to the owner. Whole ring: every chunk forwarded round the ring in the three passes, "
        "3 W(W-1) x chunks per rank. Skipping: skip_epsilon, the cross chunk pairs (x batch x head) "
        "the ring left out.",
        "",
        "| W | layout | field | skipping | messages | whole ring | ratio | MB sent | pairs skipped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eps = "off" if r["epsilon"] is None else f"eps {r['epsilon']:g}"
        total = r["pairs_kept"] + r["pairs_skipped"]
        skipped = f"{r['pairs_skipped']} / {total}" if r["epsilon"] is not None else "-"
        lines.append(
            f"| {r['world']} | {r['layout']} | {r['field']} | {eps} | {r['chunks']} | "
            f"{r['whole_ring_chunks']} | {r['chunk_ratio']:.2f} | {r['mb']:.1f} | {skipped} |"
        )
    return "\n".join(lines)


def main_traffic(args: argparse.Namespace) -> None:
    from bench.results import finish_provenance, provenance, write_result

    prov = provenance()
    rows = []
    for world in args.worlds:
        for layout in ("zigzag", "contiguous"):
            for field in TRAFFIC_FIELDS:
                for eps in (None, args.epsilon):
                    if eps is None and field != TRAFFIC_FIELDS[0]:
                        continue  # without skipping the messages do not depend on the field
                    r = measure_traffic(world, layout, field, eps, args)
                    rows.append(r)
                    print(
                        f"W={world} {layout:>10} {field:>13} eps={eps} messages {r['chunks']:>4} / "
                        f"{r['whole_ring_chunks']:>4} ({r['chunk_ratio']:.2f}) {r['mb']:8.1f} MB, "
                        f"pairs skipped {r['pairs_skipped']} of {r['pairs_kept'] + r['pairs_skipped']}",
                        flush=True,
                    )
    if not args.no_result:
        finish_provenance(prov)
        setup = {"T": args.traffic_seq, "heads": args.heads, "dim": args.dim, "epsilon": args.epsilon}
        data = {**setup, "rows": rows, "provenance": prov}
        out = write_result("ring_traffic", data, traffic_markdown(rows, args, prov), args.result_dir)
        print(f"wrote {out}/result.json and result.md")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--kind", default="fpa", choices=ATTENTION_KINDS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--variants", nargs="+", default=["zigzag", "contiguous", "ulysses"],
        help="ring layouts (zigzag, contiguous) and/or ulysses (all-to-all over heads, chunked per rank)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="T = 512, 1024 with 2 repeats")
    p.add_argument("--traffic", action="store_true", help="count the ring's messages instead of timing")
    p.add_argument("--traffic-seq", type=int, default=2048, help="T of the --traffic runs")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks of the --traffic runs")
    p.add_argument("--epsilon", type=float, default=1e-3, help="skip_epsilon of the --traffic runs")
    p.add_argument("--result-dir", type=Path, default=None, help="default docs/results/sequence_parallel")
    p.add_argument("--no-result", action="store_true", help="write no result file (--quick implies it)")
    args = p.parse_args()
    if args.quick:
        args.seqs, args.repeats = [512, 1024], 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.traffic:
        return main_traffic(args)
    from bench.results import finish_provenance, provenance, write_result

    prov = provenance()

    print(
        f"kind={args.kind} B={args.batch} H={args.heads} D={args.dim} block={args.block} "
        f"repeats={args.repeats} threads/process=1, fwd+bwd; memory = peak RSS - RSS before the step; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    head = (
        f"{'T':>6} {'variant':>10} {'1p wall':>8} {'2r wall':>8} {'ratio':>6} {'1p cpu':>8} {'2r cpu':>8} "
        f"{'ratio':>6} {'1p MB':>7} {'rank MB':>11} {'ratio':>6}"
    )
    print(head)
    print("-" * len(head))
    rows = []
    for seq in args.seqs:
        t1, c1, (m1,) = measure(1, "contiguous", seq, args)
        for variant in args.variants:
            t2, c2, m2 = measure(2, variant, seq, args)
            rows.append(
                {
                    "T": seq,
                    "variant": variant,
                    "single_wall_s": t1,
                    "single_cpu_s": c1,
                    "single_peak_mb": m1,
                    "ranks_wall_s": t2,
                    "ranks_cpu_s": c2,
                    "ranks_peak_mb": m2,
                    "wall_ratio": t2 / t1,
                    "cpu_ratio": c2 / c1,
                    "memory_ratio": max(m2) / max(m1, 1e-9),
                }
            )
            ranks = "/".join(f"{m:.0f}" for m in m2)
            print(
                f"{seq:>6} {variant:>10} {t1:>8.3f} {t2:>8.3f} {t2 / t1:>6.2f} {c1:>8.3f} {c2:>8.3f} "
                f"{c2 / c1:>6.2f} {m1:>7.0f} {ranks:>11} {max(m2) / max(m1, 1e-9):>6.2f}",
                flush=True,
            )
    if not (args.quick or args.no_result):
        finish_provenance(prov)
        setup = {
            k: getattr(args, k) for k in ("kind", "batch", "heads", "dim", "block", "repeats", "variants")
        }
        data = {**setup, "world": 2, "rows": rows, "provenance": prov}
        out = write_result("sequence_parallel", data, result_markdown(setup, rows, prov), args.result_dir)
        print(f"wrote {out}/result.json and result.md")


VARIANT_NAMES = {"zigzag": "zigzag ring", "contiguous": "contiguous ring", "ulysses": "Ulysses"}


def result_markdown(setup: dict, rows: list[dict], prov: dict) -> str:
    """The result's markdown: per T and variant, 2 ranks over 1 process as ratios (## Ratios, what the README
    copies), then the seconds and MB they come from (## Seconds and MB)."""
    from bench.results import provenance_md

    s = setup
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    seqs = list(dict.fromkeys(r["T"] for r in rows))
    by = {(r["T"], r["variant"]): r for r in rows}
    lines = [
        "# Sequence parallel attention: 2 ranks against one process",
        "",
        "## Ratios",
        "",
        provenance_md(prov),
        "",
        f"{s['kind']}, B={s['batch']}, H={s['heads']}, D={s['dim']}, block {s['block']}, forward + backward; "
        "2 gloo ranks, one thread each, against the chunked path in one process. Each cell: the busiest "
        "rank's CPU time / its peak extra memory, as ratios to the single process (ideal 0.5); median of "
        f"{s['repeats']} steps after a warm-up.",
        "",
        "| T | " + " | ".join(f"{VARIANT_NAMES.get(v, v)} time / mem" for v in variants) + " |",
        "|---|" + "---|" * len(variants),
    ]
    for t in seqs:
        cells = [f"{by[t, v]['cpu_ratio']:.2f} / {by[t, v]['memory_ratio']:.2f}" for v in variants]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Seconds and MB",
        "",
        "The median step (wall and CPU time of the busiest rank) and the peak extra memory per process:",
        "",
        "| T | variant | 1 process wall / CPU s | 2 ranks wall / CPU s | wall ratio | 1 process MB "
        "| rank MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['T']} | {r['variant']} | {r['single_wall_s']:.3f} / {r['single_cpu_s']:.3f} | "
            f"{r['ranks_wall_s']:.3f} / {r['ranks_cpu_s']:.3f} | {r['wall_ratio']:.2f} | "
            f"{r['single_peak_mb']:.0f} | {' / '.join(f'{m:.0f}' for m in r['ranks_peak_mb'])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
