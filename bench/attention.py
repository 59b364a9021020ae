"""CPU attention benchmark: chunked FPA and chunked FoX (fpa_model.ops.fpa.chunked) against torch SDPA.

Contenders, all causal, fp32, forward + backward, B=1, one thread (OMP_NUM_THREADS=1 unless set):
    fpa-chunked   chunked_fpa_attention(kind="fpa") with a walk field phi = cumsum(u)
    fox-chunked   chunked_fpa_attention(kind="fox") with a gate field phi = cumsum(logsigmoid(u))
    sdpa          torch.nn.functional.scaled_dot_product_attention(is_causal=True) (softmax, no bias)

Time: median over --repeats runs (contenders interleaved, after one warm-up run each) of the wall time
of forward + backward, and of the process CPU time (time.process_time) over the same span; on a shared
machine the CPU time is the steadier figure. Ratios are to SDPA at the same T.

Memory: the peak resident set size increase of a FRESH Python process over one forward + backward,
one process per (contender, T): after the inputs are allocated (and one small warm-up run), the
kernel's peak-RSS mark is reset (echo 5 > /proc/self/clear_refs) and VmHWM - VmRSS is read afterwards
from /proc/self/status (resource.getrusage ru_maxrss if the reset is not allowed). It counts everything
the op allocates, saved activations and workspaces included (tracemalloc does not see torch's
allocations). Linear memory
means the peak grows by about the same factor as T (x4 between the default lengths); T x T scores
would grow x16.

Before timing, the chunked path is checked against the naive oracle (outputs and gradients) at T=96.

Usage: python bench/attention.py [--quick] [--lengths 512,2048,8192] [--heads 8] [--head-dim 64]
                                 [--block-size 256] [--repeats 5] [--json out.json] [--result-dir DIR]

Writes docs/results/attention/result.{json,md} (or --result-dir) with the commit, machine, command and
load average; --quick and --no-result write none.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

from fpa_model.config import ATTENTION_KINDS  # noqa: E402
from fpa_model.ops.fpa.chunked import chunked_fpa_attention  # noqa: E402
from fpa_model.ops.fpa.naive import fpa_attention_naive  # noqa: E402

CONTENDERS = ("fpa-chunked", "fox-chunked", "sdpa")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,2048,8192", help="sequence lengths T")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=256, help="tile size of the chunked path")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per (contender, T); 3 above T=4096")
    ap.add_argument("--quick", action="store_true", help="smoke run: T=256,1024, 2 heads, 2 repeats")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-process peak memory runs")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--result-dir", type=Path, default=None, help="default docs/results/attention")
    ap.add_argument("--no-result", action="store_true", help="write no result file (--quick implies it)")
    ap.add_argument("--memory-child", nargs=5, metavar=("NAME", "T", "H", "D", "BS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.lengths, args.heads, args.repeats = "256,1024", 2, 2
    return args


def make_case(name: str, t: int, h: int, d: int, bs: int, seed: int = 0) -> Callable[[], None]:
    """A closure running forward + backward of one contender on fresh-gradient inputs."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, t, d, generator=g).requires_grad_() for _ in range(3))
    u = torch.randn(1, h, t, generator=g)
    if name == "fpa-chunked":
        phi = (0.3 * u).cumsum(-1).requires_grad_()
    else:
        phi = F.logsigmoid(u + 3.0).cumsum(-1).requires_grad_()
    dout = torch.randn(1, h, t, d, generator=g)

    def run() -> None:
        for x in (q, k, v, phi):
            x.grad = None
        if name == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = chunked_fpa_attention(q, k, v, phi, kind=name.split("-")[0], block_size=bs)
        out.backward(dout)

    return run


def check_correctness(bs: int) -> None:
    """Chunked vs naive on one small case per kind; exits 1 on a mismatch."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 96, 16, generator=g) for _ in range(3))
    phi = torch.randn(1, 2, 96, generator=g).cumsum(-1)
    dout = torch.randn(1, 2, 96, 16, generator=g)
    for kind in ATTENTION_KINDS:
        res = []
        for fn in (
            lambda *x, kind=kind: chunked_fpa_attention(*x, kind=kind, block_size=min(bs, 32)),
            lambda *x, kind=kind: fpa_attention_naive(*x, kind=kind),
        ):
            leaves = [x.clone().requires_grad_() for x in (q, k, v, phi)]
            out = fn(*leaves)
            grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
            res.append([out] + [torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads)])
        err = max(float((a - b).detach().abs().max()) for a, b in zip(*res))
        if err > 1e-4:
            print(f"correctness check failed: kind={kind} max abs error {err:.2e}", file=sys.stderr)
            sys.exit(1)
    print("correctness: chunked == naive (fpa, fox, softmax; outputs and gradients) at T=96")


def time_cases(cases: dict[str, Callable[[], None]], repeats: int) -> dict[str, dict]:
    """Median wall and process CPU time (ms) of each closure: one warm-up run each, then `repeats` rounds
    running every case once in turn (interleaved, so a load change hits all contenders alike)."""
    for run in cases.values():
        run()  # warm-up
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in cases}
    for _ in range(repeats):
        for name, run in cases.items():
            w0, c0 = time.perf_counter(), time.process_time()
            run()
            samples[name].append((time.perf_counter() - w0, time.process_time() - c0))
    return {
        name: {
            "wall_ms": 1e3 * statistics.median(x[0] for x in s),
            "cpu_ms": 1e3 * statistics.median(x[1] for x in s),
            "repeats": repeats,
        }
        for name, s in samples.items()
    }


def time_all(lengths, h, d, bs, repeats) -> dict:
    results: dict = {}
    for t in lengths:
        cases = {name: make_case(name, t, h, d, bs) for name in CONTENDERS}
        reps = repeats if t <= 4096 else min(repeats, 3)
        for name, r in time_cases(cases, reps).items():
            results[(name, t)] = r
        print(f"  timed T={t} ({reps} repeats)", flush=True)
    return results


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(name: str, t: int, h: int, d: int, bs: int) -> None:
    make_case(name, 128, h, d, bs, seed=1)()  # one-off allocations (BLAS buffers, dispatch) out of the way
    run = make_case(name, t, h, d, bs)
    try:
        # Reset the kernel's peak-RSS mark (VmHWM) to the current RSS: the peak then covers only the op.
        Path("/proc/self/clear_refs").write_text("5")
        base, how = _status_kib("VmRSS"), "VmHWM"
    except OSError:  # no /proc reset: fall back to ru_maxrss, which may include earlier peaks
        base, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"
    run()
    peak = _status_kib("VmHWM") if how == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mb": (peak - base) / 1024.0, "how": how}))  # both in KiB on Linux


def measure_memory(name: str, t: int, h: int, d: int, bs: int) -> float:
    cmd = [sys.executable, __file__, "--memory-child", name, str(t), str(h), str(d), str(bs)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"])


def memory_growth(res: dict, lengths: list[int], name: str) -> list[tuple[float, float]]:
    """(growth of T, growth of the peak memory) between consecutive lengths."""
    return [
        (t1 / t0, res[(name, t1)]["peak_mb"] / max(res[(name, t0)]["peak_mb"], 1e-9))
        for t0, t1 in zip(lengths, lengths[1:])
    ]


def result_markdown(res: dict, lengths: list[int], args: argparse.Namespace, prov: dict) -> str:
    """The result file's markdown: ratios to SDPA (wall and CPU time) and peak memory per T."""
    from bench.results import provenance_md

    mem = not args.no_memory
    reps = {t: res[("sdpa", t)]["repeats"] for t in lengths}
    runs = (
        ", ".join(f"{r} at T={t}" for t, r in reps.items())
        if len(set(reps.values())) > 1
        else f"{reps[lengths[0]]} each"
    )
    lines = [
        "# Attention, forward + backward: chunked FPA and FoX against SDPA",
        "",
        provenance_md(prov),
        "",
        f"fp32, B=1, H={args.heads}, D={args.head_dim}, chunked block {args.block_size}, "
        f"threads: {prov['machine']['torch_threads']}; time: median over runs per contender ({runs}; "
        "interleaved, after a warm-up), as wall time and as process CPU time"
        + ("; peak MB: peak RSS increase of a fresh process over one forward + backward." if mem else "."),
        "",
        "| T | FPA / SDPA wall | FoX / SDPA wall | FPA / SDPA CPU | FoX / SDPA CPU | wall ms FPA / FoX / SDPA"
        + (" | peak MB FPA / FoX / SDPA |" if mem else " |"),
        "|---|---|---|---|---|---|" + ("---|" if mem else ""),
    ]
    for t in lengths:
        f, x, s = (res[(n, t)] for n in CONTENDERS)
        row = (
            f"| {t} | {f['ratio_wall']:.2f}x | {x['ratio_wall']:.2f}x | {f['ratio_cpu']:.2f}x | "
            f"{x['ratio_cpu']:.2f}x | {f['wall_ms']:.0f} / {x['wall_ms']:.0f} / {s['wall_ms']:.0f} |"
        )
        if mem:
            row += f" {f['peak_mb']:.0f} / {x['peak_mb']:.0f} / {s['peak_mb']:.0f} |"
        lines.append(row)
    if mem and len(lengths) > 1:
        lines += ["", "Peak memory growth between consecutive lengths:"]
        for name in CONTENDERS:
            steps = memory_growth(res, lengths, name)
            txt = ", ".join(f"T x{tg:g} -> memory x{mg:.1f}" for tg, mg in steps)
            if name != "sdpa":
                sdpa = [max(res[("sdpa", t)]["peak_mb"], 1e-9) for t in lengths]
                of_sdpa = [res[(name, t)]["peak_mb"] / m for t, m in zip(lengths, sdpa)]
                txt += "; of SDPA's peak: " + ", ".join(
                    f"x{r:.1f} at T={t}" for t, r in zip(lengths, of_sdpa)
                )
            lines.append(f"- {name}: {txt}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        name, t, h, d, bs = args.memory_child
        memory_child(name, int(t), int(h), int(d), int(bs))
        return 0
    from bench.results import finish_provenance, provenance, write_result

    prov = provenance(None if argv is None else ["bench/attention.py", *argv])
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    lengths = [int(x) for x in args.lengths.split(",")]
    h, d, bs = args.heads, args.head_dim, args.block_size
    print(
        f"CPU attention fwd+bwd, fp32, B=1, H={h}, D={d}, chunked block={bs}, "
        f"threads={torch.get_num_threads()}, torch {torch.__version__}"
    )
    check_correctness(bs)
    res = time_all(lengths, h, d, bs, args.repeats)
    if not args.no_memory:
        for t in lengths:
            for name in CONTENDERS:
                res[(name, t)]["peak_mb"] = measure_memory(name, t, h, d, bs)
            print(f"  memory T={t}", flush=True)

    print()
    hdr = f"{'T':>6} {'contender':>12} {'wall ms':>9} {'cpu ms':>9} {'x SDPA wall':>11} {'x SDPA cpu':>10}"
    print(hdr + ("" if args.no_memory else f" {'peak MB':>9}"))
    for t in lengths:
        ref = res[("sdpa", t)]
        for name in CONTENDERS:
            r = res[(name, t)]
            r["ratio_wall"] = r["wall_ms"] / ref["wall_ms"]
            r["ratio_cpu"] = r["cpu_ms"] / ref["cpu_ms"]
            line = f"{t:>6} {name:>12} {r['wall_ms']:>9.1f} {r['cpu_ms']:>9.1f} {r['ratio_wall']:>11.2f}"
            line += f" {r['ratio_cpu']:>10.2f}"
            if not args.no_memory:
                line += f" {r['peak_mb']:>9.1f}"
            print(line)
    if not args.no_memory and len(lengths) > 1:
        print()
        for name in CONTENDERS:
            steps = memory_growth(res, lengths, name)
            # Linear: memory grows by at most ~1.5x the growth of T at each step (quadratic: its square).
            linear = all(mg <= 1.5 * tg for tg, mg in steps)
            txt = ", ".join(f"T x{tg:g} -> mem x{mg:.1f}" for tg, mg in steps)
            print(f"{name:>12}: {txt}: {'linear in T' if linear else 'NOT linear in T'}")
    if args.json:
        rows = [{"contender": n, "T": t, **r} for (n, t), r in res.items()]
        args.json.write_text(json.dumps(rows, indent=2))
    if not (args.quick or args.no_result):
        finish_provenance(prov)
        data = {
            "heads": h,
            "head_dim": d,
            "block_size": bs,
            "lengths": lengths,
            "rows": [{"contender": n, "T": t, **r} for (n, t), r in res.items()],
            "provenance": prov,
        }
        out = write_result("attention", data, result_markdown(res, lengths, args, prov), args.result_dir)
        print(f"wrote {out}/result.json and result.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
