"""The Triton FPA kernel against its oracles on a GPU: outputs and every gradient, fp32 and bf16, long T.

    python bench/gpu_kernel_check.py [--json out.json]      (bench/gpu_check.sh runs it as kernel_check)

Cases (B=1, H=4 by default; q, k, v, dout ~ N(0, 1); fpa: a walk field phi = cumsum(0.7 z - 0.1), whose
range grows to ~|1600| at 16k; fox: a gate field phi = cumsum(logsigmoid(z + 3)); phi stays fp32):
  - fpa, autotuned (the full GPU lists of triton_kernel.GPU_TILES_BY_DIM), every --dtypes x --head-dims x
    --lengths; fp32 means the default TF32 dots, fp32-ieee forces IEEE fp32 dots (--ieee-lengths);
  - fox and softmax, autotuned, bf16, at --other-lengths;
  - every entry of each kernel's autotune list pinned (tiles=...), the three kernels on DIFFERENT entries
    (entry i, i+1, i+2 of the fwd, dq and dk/dv lists), fpa, at --tiles-length, every dtype and head dim;
  - tile skipping (skip_epsilon=--skip-epsilon), fpa and fox, bf16, the first head dim, at --skip-lengths:
    the reference is the chunked path skipping at block size SKIP_CELL (the same decisions); the row also
    has the fraction of cross cells skipped and the warm fwd + bwd time against the unskipped kernels.
The reference is fpa_model.ops.fpa's naive op (T <= --naive-max) or its chunked path (longer T), run in
float64 on the same device from the very inputs the kernel saw (bf16 values upcast). Errors are
max |kernel - reference| / max |reference| per tensor (out, dq, dk, dv, dphi), against tolerances per dtype.
The wall time of each call is recorded; the first call per (dtype, kind, head dim) includes the Triton
compile and the autotuning ("first_call_s").

Exit status: 0 when every case is within tolerance, 1 otherwise. Without a CUDA device it prints
"no CUDA device: skipping" and exits 0, unless --device cpu with TRITON_INTERPRET=1 (the plumbing test).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp32-ieee": torch.float32}
# max |error| / max |reference|: output, gradients (bf16 rounds P and dS to 8 bits; TF32 dots keep 10).
TOLERANCES = {
    "bf16": {"out": 3e-2, "grad": 6e-2},
    "fp32": {"out": 1e-2, "grad": 2e-2},
    "fp32-ieee": {"out": 2e-4, "grad": 1e-3},
}
NAMES = ("out", "dq", "dk", "dv", "dphi")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _strs(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=_ints, default=_ints("1024,4096,16384"), help="T for fpa, autotuned")
    ap.add_argument("--head-dims", type=_ints, default=_ints("64,128"))
    ap.add_argument("--dtypes", type=_strs, default=_strs("bf16,fp32"), help="of bf16, fp32, fp32-ieee")
    ap.add_argument("--ieee-lengths", type=_ints, default=_ints("1024"), help="T for fp32 with IEEE dots")
    ap.add_argument("--other-kinds", type=_strs, default=_strs("fox,softmax"))
    ap.add_argument("--other-lengths", type=_ints, default=_ints("1024"), help="T for --other-kinds (bf16)")
    ap.add_argument("--tiles-length", type=int, default=1024, help="T of the pinned-tile cases (0: none)")
    ap.add_argument("--naive-max", type=int, default=2048, help="longest T checked against the naive op")
    ap.add_argument("--skip-lengths", type=_ints, default=_ints("4096"), help="T of the tile-skipping cases")
    ap.add_argument("--skip-epsilon", type=float, default=1e-3, help="skip_epsilon of those cases")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (plumbing only)")
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    args = ap.parse_args(argv)
    bad = set(args.dtypes) - set(DTYPES)
    if bad:
        ap.error(f"unknown dtypes {sorted(bad)}; choose from {sorted(DTYPES)}")
    return args


@dataclass
class Case:
    kind: str
    dtype: str
    d: int
    t: int
    tiles: dict[str, tuple[int, int, int, int]] | None = None  # None: autotuned
    skip_epsilon: float | None = None  # tile skipping (None: off)

    @property
    def label(self) -> str:
        if self.tiles is None:
            pinned = ""
        else:
            pinned = " tiles " + ",".join(f"{k}={m}x{n}w{w}s{st}" for k, (m, n, w, st) in self.tiles.items())
        skip = "" if self.skip_epsilon is None else f" skip_epsilon={self.skip_epsilon:g}"
        return f"{self.kind:7s} {self.dtype:9s} D={self.d:<3d} T={self.t:<6d}{pinned}{skip}"


def pinned_tile_sets(d: int) -> list[dict[str, tuple[int, int, int, int]]]:
    """Tile sets that use every entry of the fwd, dq and dk/dv lists of head dim d's bucket at least once,
    each kernel on a different entry (i, i+1, i+2) wherever the lists allow."""
    from fpa_model.ops.fpa.triton_kernel import GPU_TILES_BY_DIM

    bucket = 64 if d <= 64 else 128
    lists = {name: GPU_TILES_BY_DIM[name][bucket] for name in ("fwd", "dq", "dkv")}
    n = max(len(v) for v in lists.values())
    return [
        {name: tuple(tiles[(i + off) % len(tiles)]) for off, (name, tiles) in enumerate(lists.items())}
        for i in range(n)
    ]


def build_cases(args: argparse.Namespace) -> list[Case]:
    cases = []
    for dtype in args.dtypes:
        lengths = args.ieee_lengths if dtype == "fp32-ieee" else args.lengths
        cases += [Case("fpa", dtype, d, t) for d in args.head_dims for t in lengths]
    cases += [
        Case(k, "bf16", d, t) for k in args.other_kinds for d in args.head_dims for t in args.other_lengths
    ]
    if args.tiles_length:
        for dtype in args.dtypes:
            for d in args.head_dims:
                cases += [Case("fpa", dtype, d, args.tiles_length, ts) for ts in pinned_tile_sets(d)]
    for t in args.skip_lengths:
        cases += [
            Case(k, "bf16", args.head_dims[0], t, skip_epsilon=args.skip_epsilon) for k in ("fpa", "fox")
        ]
    return cases


def make_inputs(case: Case, args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(1000 * case.d + case.t + len(case.kind))
    b, h, t, d = args.batch, args.heads, case.t, case.d
    q, k, v, do = (torch.randn(b, h, t, d, generator=g).to(device, DTYPES[case.dtype]) for _ in range(4))
    z = torch.randn(b, h, t, generator=g)
    inc = F.logsigmoid(z + 3.0) if case.kind == "fox" else 0.7 * z - 0.1
    phi = torch.cumsum(inc, dim=-1).to(device)  # fp32
    return [q, k, v, phi, do]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(fn, q, k, v, phi, do, device: torch.device, **kw) -> tuple[list[torch.Tensor], float]:
    """Output and the gradients of q, k, v, phi (zeros where none flows), and the call's wall time."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, phi)]
    _sync(device)
    t0 = time.perf_counter()
    o = fn(*leaves, **kw)
    o.backward(do)
    _sync(device)
    seconds = time.perf_counter() - t0
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
    return [o.detach(), *grads], seconds


def check_case(case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from fpa_model.ops.fpa import chunked_fpa_attention, fpa_attention_naive
    from fpa_model.ops.fpa.skipping import skip_counts
    from fpa_model.ops.fpa.triton_kernel import SKIP_CELL, fpa_attention_triton

    q, k, v, phi, do = make_inputs(case, args, device)
    kw: dict[str, Any] = {"kind": case.kind}
    if case.dtype.startswith("fp32"):
        kw["fp32_precision"] = "ieee" if case.dtype == "fp32-ieee" else "tf32"
    if case.tiles is not None:
        kw["tiles"] = case.tiles
    skipping: dict[str, Any] = {}
    if case.skip_epsilon is not None:
        with skip_counts() as counts:
            got, seconds = run(
                fpa_attention_triton, q, k, v, phi, do, device, **kw, skip_epsilon=case.skip_epsilon
            )
        warm = full = None  # timed on a GPU only (the interpreter's times say nothing)
        if device.type == "cuda":
            warm = run(fpa_attention_triton, q, k, v, phi, do, device, **kw, skip_epsilon=case.skip_epsilon)[
                1
            ]
            run(fpa_attention_triton, q, k, v, phi, do, device, **kw)  # compiles, tunes the unskipped kernels
            full = run(fpa_attention_triton, q, k, v, phi, do, device, **kw)[1]
        skipping = {
            "skip_epsilon": case.skip_epsilon,
            "cells_skipped": counts.skipped,
            "cells_total": counts.total,
            "fraction_skipped": round(counts.fraction_skipped, 4),
            "warm_seconds": None if warm is None else round(warm, 4),
            "unskipped_warm_seconds": None if full is None else round(full, 4),
            "time_ratio": round(warm / full, 3) if warm is not None and full else None,
        }
        ref_name = f"chunked skipping at block {SKIP_CELL}"
        ref_kw = {"kind": case.kind, "block_size": SKIP_CELL, "skip_epsilon": case.skip_epsilon}
        ref, ref_seconds = run(
            chunked_fpa_attention, *(x.double() for x in (q, k, v, phi, do)), device, **ref_kw
        )
    else:
        got, seconds = run(fpa_attention_triton, q, k, v, phi, do, device, **kw)
        ref_name = "naive" if case.t <= args.naive_max else "chunked"
        ref_fn = fpa_attention_naive if ref_name == "naive" else chunked_fpa_attention
        ref, ref_seconds = run(ref_fn, *(x.double() for x in (q, k, v, phi, do)), device, kind=case.kind)
    errors, scales = {}, {}
    for name, a, r in zip(NAMES, got, ref):
        if name == "dphi" and case.kind == "softmax":
            continue  # no field
        scale = r.abs().max().item()
        err = (a.double() - r).abs().max().item()
        errors[name] = err / scale if scale > 0 else err
        scales[name] = scale
        if not math.isfinite(errors[name]) or not torch.isfinite(a).all():
            errors[name] = math.inf
    tol = TOLERANCES[case.dtype]
    bad = {n: e for n, e in errors.items() if not e <= (tol["out"] if n == "out" else tol["grad"])}
    return {
        "kind": case.kind,
        "dtype": case.dtype,
        "D": case.d,
        "T": case.t,
        "B": args.batch,
        "H": args.heads,
        "tiles": "autotune" if case.tiles is None else {k: list(v) for k, v in case.tiles.items()},
        "reference": ref_name,
        "seconds": round(seconds, 3),
        "reference_seconds": round(ref_seconds, 3),
        "rel_errors": {n: float(f"{e:.3g}") for n, e in errors.items()},
        "reference_max_abs": {n: float(f"{s:.4g}") for n, s in scales.items()},
        "tolerance": tol,
        **skipping,
        "ok": not bad,
    }


def autotune_choices() -> dict[str, dict[str, str]]:
    """The tile each autotuned kernel settled on per key (best effort: reads the autotuners' caches)."""
    try:
        from fpa_model.ops.fpa import triton_kernel as tk

        out = {}
        for name, entry in tk._KERNELS.items():
            cache = getattr(entry[1], "cache", {}) or {}
            if cache:
                out[name] = {str(key): str(cfg) for key, cfg in cache.items()}
        return out
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipping")
        return 0
    import triton

    t_start = time.perf_counter()
    cases = build_cases(args)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"{len(cases)} cases on {name}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows, first_call = [], {}
    for case in cases:
        try:
            row = check_case(case, args, device)
        except Exception as e:
            row = {"kind": case.kind, "dtype": case.dtype, "D": case.d, "T": case.t, "ok": False,
                   "tiles": "autotune" if case.tiles is None else {k: list(v) for k, v in case.tiles.items()},
                   "error": f"{type(e).__name__}: {str(e)[:400]}"}  # fmt: skip
        key = f"{case.dtype}/{case.kind}/D{case.d}"
        if key not in first_call and "seconds" in row:
            first_call[key] = row["seconds"]
            row["first_call"] = True
        rows.append(row)
        errs = "  ".join(f"{n} {e:.1e}" for n, e in row.get("rel_errors", {}).items())
        status = "ok  " if row["ok"] else "FAIL"
        print(
            f"  {status} {case.label}  {row.get('seconds', '-')} s  {errs}{row.get('error', '')}", flush=True
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    worst: dict[str, dict[str, float]] = {}
    for row in rows:
        for n, e in row.get("rel_errors", {}).items():
            w = worst.setdefault(row["dtype"], {})
            w[n] = max(w.get(n, 0.0), e)
    report = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "ok": all(r["ok"] for r in rows),
        "cases": len(rows),
        "failed": [
            f"{r['kind']} {r['dtype']} D={r['D']} T={r['T']} tiles={r['tiles']}" for r in rows if not r["ok"]
        ],
        "worst": worst,
        "first_call_s": first_call,
        "tolerances": TOLERANCES,
        "autotune": autotune_choices(),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "rows": rows,
    }
    print(f"worst relative errors per dtype: {json.dumps(worst)}")
    print(f"first call (compile + autotune) seconds: {json.dumps(first_call)}")
    verdict = "all cases within tolerance" if report["ok"] else "FAILURES"
    print(f"{verdict} ({len(rows)} cases, {report['wall_s']} s)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
