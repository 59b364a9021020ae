"""Attention kernel benchmark on one CUDA GPU: FPA (Triton) against FoX and flash softmax attention.

Contenders, all causal, bf16 by default, at a constant token count per step (B * T = --tokens):
    fpa-triton   fpa_attention_triton(kind="fpa")      range-min field bias (this project)
    fox-triton   the same kernel with kind="fox"       FoX bias phi_i - phi_j: the cost of the range-min
    fox-fla      flash-linear-attention's parallel_forgetting_attn, when `fla` is importable
    sdpa-flash   torch scaled_dot_product_attention on the FLASH_ATTENTION backend (no bias at all)

Before timing, the Triton kernel is checked against the chunked PyTorch path and the naive oracle at a
small size (outputs and every gradient, fp32 and bf16); a mismatch stops the run with exit status 1.
Times are medians of triton.testing.do_bench; TFLOP/s count the causal half of the attention matmuls
(forward 2 * B * H * T^2 * D, forward + backward 3.5x that). Without a CUDA device the script prints
"no CUDA device: skipping" and exits 0.

A second table times the sequence-parallel ring's per-rank compute (ring_attention at world 1:
two zigzag chunks of T/2, i.e. two diagonal pairs and one cross pair, forward + backward) on its Triton
blocks against its chunked PyTorch blocks (what the ring runs on CPU), at --ring-lengths.

Usage: python bench/kernel.py [--lengths 2048,4096,8192,16384,32768] [--tokens 32768] [--heads 12]
                              [--head-dims 64,128] [--dtype bf16] [--json out.json] [--skip-check]
                              [--ring-lengths 8192]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,4096,8192,16384,32768", help="sequence lengths T")
    ap.add_argument(
        "--tokens", type=int, default=32768, help="B * T per measurement (B = max(1, tokens // T))"
    )
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    ap.add_argument("--skip-check", action="store_true", help="skip the correctness check")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument(
        "--ring-lengths", default="8192", help="T for the ring's Triton vs chunked blocks ('' skips them)"
    )
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------------------------------
# correctness first
# ----------------------------------------------------------------------------------------------------


def _grads(fn: Callable[..., torch.Tensor], q, k, v, u, do, field: str, **kw) -> list[torch.Tensor]:
    q, k, v, u = (x.detach().clone().requires_grad_(True) for x in (q, k, v, u))
    phi = torch.cumsum(torch.nn.functional.logsigmoid(u) if field == "gate" else u, dim=-1)
    o = fn(q, k, v, phi, **kw)
    o.backward(do)
    du = u.grad.float() if u.grad is not None else torch.zeros_like(u)  # softmax ignores the field
    return [o.detach().float(), q.grad.float(), k.grad.float(), v.grad.float(), du]


def check_correctness(device: torch.device) -> list[str]:
    """Triton vs chunked (if present) vs naive at a small size; returns the failures (empty: all good)."""
    from fpa_model.ops.fpa.naive import fpa_attention_naive
    from fpa_model.ops.fpa.triton_kernel import fpa_attention_triton

    try:
        from fpa_model.ops.fpa.chunked import chunked_fpa_attention
    except ImportError:
        chunked_fpa_attention = None

    failures = []
    g = torch.Generator(device="cpu").manual_seed(0)
    b, h, t, d = 2, 3, 300, 64  # T not a multiple of any tile
    base = [torch.randn(b, h, t, d, generator=g) for _ in range(4)]
    u = (torch.randn(b, h, t, generator=g) * 0.7 - 0.1).to(device)
    tol = {torch.float32: 2e-4, torch.bfloat16: 4e-2}
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, do = (x.to(device=device, dtype=dtype) for x in base)
        for kind, field in (("fpa", "walk"), ("fpa", "gate"), ("fox", "gate"), ("softmax", "walk")):
            ref = _grads(
                fpa_attention_naive, q.float(), k.float(), v.float(), u, do.float(), field, kind=kind
            )
            # fp32: IEEE dots, so the check holds the kernel to fp32 accuracy (its GPU default is TF32,
            # which bench/gpu_kernel_check.py checks against its own tolerance).
            triton_fn = fpa_attention_triton
            if dtype == torch.float32:
                triton_fn = functools.partial(fpa_attention_triton, fp32_precision="ieee")
            contenders = {"triton": (triton_fn, (q, k, v, do))}
            if chunked_fpa_attention is not None:
                contenders["chunked"] = (chunked_fpa_attention, (q.float(), k.float(), v.float(), do.float()))
            for name, (fn, (qq, kk, vv, dd)) in contenders.items():
                got = _grads(fn, qq, kk, vv, u, dd, field, kind=kind)
                errs = []
                for label, a, r in zip(("out", "dq", "dk", "dv", "du"), got, ref):
                    rel = ((a - r).abs().max() / r.abs().max().clamp_min(1e-6)).item()
                    errs.append(f"{label} {rel:.1e}")
                    if not math.isfinite(rel) or rel > tol[dtype if name == "triton" else torch.float32]:
                        failures.append(f"{name} {kind}/{field} {dtype}: {label} relative error {rel:.2e}")
                print(f"  check {name:8s} {kind:7s} {field:5s} {str(dtype):15s} " + "  ".join(errs))
    return failures


# ----------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    q: torch.Tensor  # (B, H, T, D)
    k: torch.Tensor
    v: torch.Tensor
    phi: torch.Tensor  # (B, H, T): cumsum of the log forget gate, so FPA and FoX see the same field
    do: torch.Tensor
    bthd: tuple[torch.Tensor, ...]  # fla's layout: q, k, v (B, T, H, D), log gate (B, T, H), do

    def leaves(self, name: str) -> tuple[torch.Tensor, ...]:
        return self.bthd[:4] if name == "fox-fla" else (self.q, self.k, self.v, self.phi)

    def grad_out(self, name: str) -> torch.Tensor:
        return self.bthd[4] if name == "fox-fla" else self.do


def _contenders(dtype: torch.dtype) -> dict[str, Callable[[Inputs], torch.Tensor]]:
    """name -> forward(inputs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fpa_model.ops.fpa.triton_kernel import fpa_attention_triton

    out: dict[str, Callable[[Inputs], torch.Tensor]] = {
        "fpa-triton": lambda x: fpa_attention_triton(x.q, x.k, x.v, x.phi, kind="fpa"),
        "fox-triton": lambda x: fpa_attention_triton(x.q, x.k, x.v, x.phi, kind="fox"),
    }
    try:
        from fla.ops.forgetting_attn import parallel_forgetting_attn

        # fla takes (B, T, H, D) and the per-token log forget gate (B, T, H); it does the cumsum itself.
        out["fox-fla"] = lambda x: parallel_forgetting_attn(*x.bthd[:4])
    except Exception as e:  # not installed, or built against another triton
        print(f"  fla (flash-linear-attention) is not usable ({type(e).__name__}): fox-fla skipped")

    def sdpa(x: Inputs) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(x.q, x.k, x.v, is_causal=True)

    if dtype != torch.float32:  # the flash backend has no fp32 kernel
        out["sdpa-flash"] = sdpa
    return out


def _median_ms(fn: Callable[[], Any], warmup: int, rep: int, grad_to_none=None) -> float:
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")
    return float(ms)


def bench_one(t: int, d: int, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    dtype = DTYPES[args.dtype]
    b, h = max(1, args.tokens // t), args.heads
    g = torch.Generator(device=device).manual_seed(t + d)
    q, k, v, do = (torch.randn(b, h, t, d, device=device, dtype=dtype, generator=g) for _ in range(4))
    gate_log = torch.nn.functional.logsigmoid(torch.randn(b, h, t, device=device, generator=g) + 3.0)
    # fla's layout copies are made once here so no transpose is timed.
    bthd = tuple(x.transpose(1, 2).contiguous() for x in (q, k, v, gate_log, do))
    x = Inputs(q, k, v, torch.cumsum(gate_log, dim=-1), do, bthd)
    flops_fwd = 2.0 * b * h * t * t * d  # 4 * B H T^2 D / 2: causal half of QK^T and PV
    rows = []
    for name, fwd in _contenders(dtype).items():
        leaves = x.leaves(name)
        row: dict[str, Any] = {"T": t, "D": d, "B": b, "H": h, "dtype": args.dtype, "method": name}
        try:
            with torch.no_grad():
                row["fwd_ms"] = _median_ms(lambda fwd=fwd: fwd(x), args.warmup, args.rep)
            for leaf in leaves:
                leaf.requires_grad_(True)
            grad_out = x.grad_out(name)
            row["fwdbwd_ms"] = _median_ms(
                lambda fwd=fwd, grad_out=grad_out: fwd(x).backward(grad_out),
                args.warmup,
                args.rep,
                grad_to_none=list(leaves),
            )
            row["fwd_tflops"] = flops_fwd / row["fwd_ms"] / 1e9
            row["fwdbwd_tflops"] = 3.5 * flops_fwd / row["fwdbwd_ms"] / 1e9
        except torch.cuda.OutOfMemoryError:
            row["error"] = "out of memory"
        except Exception as e:  # a contender that cannot run this shape is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        finally:
            for leaf in leaves:
                leaf.requires_grad_(False)
                leaf.grad = None
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def bench_ring(t: int, d: int, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """The ring's compute for one rank holding two zigzag chunks (world 1: no communication), fpa with a
    walk field, on impl="triton" and impl="chunked" blocks."""
    from fpa_model.sequence_parallel import ring_attention

    dtype = DTYPES[args.dtype]
    b, h = max(1, args.tokens // t), args.heads
    g = torch.Generator(device=device).manual_seed(t + d + 1)
    q, k, v, do = (torch.randn(b, h, t, d, device=device, dtype=dtype, generator=g) for _ in range(4))
    u = torch.randn(b, h, t, device=device, generator=g) * 0.7 - 0.1  # walk increments
    flops_fwd = 2.0 * b * h * t * t * d
    rows = []
    for impl in ("triton", "chunked"):
        row: dict[str, Any] = {"T": t, "D": d, "B": b, "H": h, "dtype": args.dtype, "method": f"ring-{impl}"}

        def fwd(impl: str = impl) -> torch.Tensor:
            return ring_attention(q, k, v, u, kind="fpa", field="walk", impl=impl)

        try:
            with torch.no_grad():
                row["fwd_ms"] = _median_ms(fwd, args.warmup, args.rep)
            for leaf in (q, k, v, u):
                leaf.requires_grad_(True)
            row["fwdbwd_ms"] = _median_ms(
                lambda fwd=fwd: fwd().backward(do), args.warmup, args.rep, grad_to_none=[q, k, v, u]
            )
            row["fwd_tflops"] = flops_fwd / row["fwd_ms"] / 1e9
            row["fwdbwd_tflops"] = 3.5 * flops_fwd / row["fwdbwd_ms"] / 1e9
        except torch.cuda.OutOfMemoryError:
            row["error"] = "out of memory"
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        finally:
            for leaf in (q, k, v, u):
                leaf.requires_grad_(False)
                leaf.grad = None
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def print_ring_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'T':>6} {'D':>4} {'B':>3} {'ring blocks':<13} {'fwd ms':>9} {'fwd+bwd ms':>11} {'TFLOP/s':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['T']:>6} {r['D']:>4} {r['B']:>3} {r['method']:<13} {r['error']}")
        else:
            print(
                f"{r['T']:>6} {r['D']:>4} {r['B']:>3} {r['method']:<13} {r['fwd_ms']:>9.3f} "
                f"{r['fwdbwd_ms']:>11.3f} {r['fwdbwd_tflops']:>8.1f}"
            )


def _ratio(fpa: dict[str, Any], r: dict[str, Any], key: str) -> str:
    return f"{fpa[key] / r[key]:.2f}x" if key in fpa and r.get(key) else "-"


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per (T, D, method) with the fpa-triton time divided by each contender's (x slower)."""
    head = (
        f"{'T':>6} {'D':>4} {'B':>3} {'method':<11} {'fwd ms':>9} {'TFLOP/s':>8} {'fwd+bwd ms':>11} "
        f"{'TFLOP/s':>8} {'fpa/this fwd':>13} {'fpa/this f+b':>13}"
    )
    print(head)
    print("-" * len(head))
    by_shape: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_shape.setdefault((r["T"], r["D"]), {})[r["method"]] = r
    for (t, d), methods in sorted(by_shape.items()):
        fpa = methods.get("fpa-triton", {})
        for name, r in methods.items():
            if "error" in r:
                print(f"{t:>6} {d:>4} {r['B']:>3} {name:<11} {r['error']}")
                continue

            print(
                f"{t:>6} {d:>4} {r['B']:>3} {name:<11} {r['fwd_ms']:>9.3f} {r['fwd_tflops']:>8.1f} "
                f"{r['fwdbwd_ms']:>11.3f} {r['fwdbwd_tflops']:>8.1f} {_ratio(fpa, r, 'fwd_ms'):>13} "
                f"{_ratio(fpa, r, 'fwdbwd_ms'):>13}"
            )
    # One summary line per contender: median over shapes of the fpa-triton / contender time ratio.
    for name in sorted({r["method"] for r in rows} - {"fpa-triton"}):
        rs = []
        for methods in by_shape.values():
            f, c = methods.get("fpa-triton", {}), methods.get(name, {})
            if "fwdbwd_ms" in f and "fwdbwd_ms" in c:
                rs.append(f["fwdbwd_ms"] / c["fwdbwd_ms"])
        if rs:
            print(
                f"median fwd+bwd time ratio fpa-triton / {name}: {statistics.median(rs):.2f}x "
                f"over {len(rs)} shapes"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: skipping")
        return 0
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}")
    if not args.skip_check:
        print("correctness check (relative max error vs naive):")
        failures = check_correctness(device)
        if failures:
            print("CORRECTNESS FAILURES:\n  " + "\n  ".join(failures))
            return 1
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for t in (int(x) for x in args.lengths.split(",")):
            rows += bench_one(t, d, args, device)
            print(f"  done T={t} D={d}", flush=True)
    print_table(rows)
    ring_rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for t in (int(x) for x in args.ring_lengths.split(",") if x):
            ring_rows += bench_ring(t, d, args, device)
    if ring_rows:
        print_ring_table(ring_rows)
    rows += ring_rows
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
