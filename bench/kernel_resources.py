"""Registers, spills and shared memory of every Triton FPA kernel config, compiled for Hopper and Ampere
without a GPU (Triton's bundled ptxas, then cuobjdump -res-usage on the cubin).

    python bench/kernel_resources.py           # every GPU_TILES_BY_DIM entry, sm_90 + sm_80, at its head dim
    python bench/kernel_resources.py --quick   # the first entry per kernel, head dim 64 (the test's mode)
    python bench/kernel_resources.py --json docs/results/kernel_resources/triton-3.9.0.json
    .venv-triton36/bin/python bench/kernel_resources.py --json docs/results/kernel_resources/triton-3.6.0.json
    python bench/kernel_resources.py --md docs/kernel_resources.md --from docs/results/kernel_resources/*.json

Compiled with bf16 inputs and kind fpa (the heaviest: the near-tile levels); the ring's cross kernels write
fp32 outputs as the ring does. The causal kernels (fwd, dq, dkv) compile three times: plain, with segment ids
(SEGMENTED, the document mask) and with tile skipping (SKIPPING, the keep map), one row each (`segmented`,
`skipping`; the tile counter COUNT stays off). --quick compiles them plain and with both switches on.
A config with spill bytes > 0 should leave GPU_TILES.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real; nothing is launched
# A fresh cache, so the compile times are real (not cache hits); the caller's TRITON_CACHE_DIR wins.
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="fpa_triton_cache_"))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fpa_model.ops.fpa import triton_kernel as tk

ARCHS = {"sm_90": 90, "sm_80": 80}
LOWP_PTRS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}
CROSS_FP32_OUT = {"O", "DQ", "DK", "DV"}
INT_ARGS = {"H", "T", "D", "NLEV", "T_BUCKET", "NC", "LQ", "LK", "LQ_BUCKET", "LK_BUCKET"}
INT_PTRS = {"SEG", "DOC_START", "DOC_END", "CNT"}  # the document tables and the tile counter
U8_PTRS = {"KEEP"}  # the tile-skipping map
# (segmented, skipping) per causal kernel entry: the full sweep, and --quick (plain, and both switches on).
VARIANTS = ((False, False), (True, False), (False, True))
QUICK_VARIANTS = ((False, False), (True, True))


def _signature(kernel, name: str, consts: dict) -> dict:
    cross = name.startswith("cross")
    sig = {}
    for arg in kernel.arg_names:
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg in LOWP_PTRS and not (cross and arg in CROSS_FP32_OUT):
            sig[arg] = "*bf16"
        elif arg.endswith("scale"):
            sig[arg] = "fp32"
        elif arg in INT_PTRS:
            sig[arg] = "*i32"
        elif arg in U8_PTRS:
            sig[arg] = "*u8"
        elif arg in INT_ARGS or arg.startswith("stride"):
            sig[arg] = "i32"
        else:
            sig[arg] = "*fp32"
    return sig


def _res_usage(cubin: bytes, workdir: Path) -> dict:
    path = workdir / "k.cubin"
    path.write_bytes(cubin)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    text = subprocess.run(
        [str(tool), "-res-usage", str(path)], capture_output=True, text=True, check=True
    ).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
    if m is None:
        raise RuntimeError(f"cannot read cuobjdump output: {text[-500:]}")
    return {"registers": int(m[1]), "stack_bytes": int(m[2]), "static_shared": int(m[3])}


def _compile(fn, name: str, consts: dict, arch: str, num_warps: int, num_stages: int, workdir: Path) -> dict:
    src = ASTSource(
        fn=fn,
        signature=_signature(fn, name, consts),
        constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
    )
    t0 = time.perf_counter()
    kernel = triton.compile(
        src,
        target=GPUTarget("cuda", ARCHS[arch], 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    seconds = time.perf_counter() - t0
    usage = _res_usage(kernel.asm["cubin"], workdir)
    return {
        "kernel": name,
        "arch": arch,
        "num_warps": num_warps,
        "num_stages": num_stages,
        **usage,
        # Stack frames in these kernels are register spills (no local arrays, no recursion).
        "spill_bytes": usage["stack_bytes"],
        "shared_bytes": int(kernel.metadata.shared),
        "compile_s": round(seconds, 2),
    }


def compile_one(
    name: str,
    tile: tk.Tile,
    arch: str,
    head_dim: int,
    workdir: Path,
    segmented: bool = False,
    skipping: bool = False,
) -> dict:
    """One autotune entry of an attention kernel (bf16, kind fpa; segmented: with the document switch,
    skipping: with the tile-skipping switch)."""
    raw = tk._KERNELS[name][0]
    consts = {"KIND": 0, "HEAD_DIM": head_dim, "LOWP": True, "DOT_PREC": "tf32", **tk._meta(tile, raw)}
    if has_segments(name):  # the causal kernels: the tile counter stays off (its default)
        consts.update(SEGMENTED=segmented, COUNT=False, SKIPPING=skipping, CELL_LG=tk._CELL_LG)
    elif segmented or skipping:
        raise ValueError(f"kernel {name!r} takes no segment ids and skips no tiles")
    row = _compile(raw, name, consts, arch, tile.num_warps, tile.num_stages, workdir)
    tile_s = f"{tile.block_m}x{tile.block_n}"
    return {**row, "head_dim": head_dim, "tile": tile_s, "segmented": segmented, "skipping": skipping}


def has_segments(name: str) -> bool:
    """Whether kernel `name` has the SEGMENTED switch (the causal kernels; not the ring's cross kernels)."""
    return "SEGMENTED" in tk._KERNELS[name][0].arg_names


# The field-level scans (one launch each per call, default launch options): name -> kernel.
SCANS = {"levels": tk._levels_kernel, "route": tk._route_kernel}


def compile_scan(name: str, arch: str, workdir: Path) -> dict:
    row = _compile(SCANS[name], name, {"BLOCK": tk.SCAN_BLOCK}, arch, 4, 3, workdir)
    return {**row, "head_dim": "-", "tile": str(tk.SCAN_BLOCK), "segmented": False, "skipping": False}


# Not pipeline.provenance.cpu_model: this script also runs in the Triton-3.6 test venv, which has only
# torch, triton and numpy (pipeline imports omegaconf).
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} threads)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_md(path: Path, runs: list[dict]) -> None:
    """One table over the runs (one per Triton version), each row naming its Triton, commit and command."""
    lines = [
        "# Triton FPA kernels: registers, spills, shared memory per GPU config",
        "",
        "Compiled with Triton's bundled ptxas (no GPU) by `bench/kernel_resources.py`: bf16 inputs, "
        "kind fpa, every entry of `GPU_TILES_BY_DIM` at the head dim whose list holds it "
        "(64: D <= 64, 128: D <= 128); the causal kernels (fwd, dq, dkv) plain, with segment ids "
        "(column seg: the document mask, `SEGMENTED`) and with tile skipping (column skip: the keep map, "
        "`SKIPPING`; runs compiled before it existed have no such rows). "
        "Registers per thread (the limit is 255), spill = local-memory stack bytes per thread, shared = "
        "dynamic shared memory per program.",
        "",
    ]
    for run in runs:
        m = run["meta"]
        n_spill = sum(r["spill_bytes"] > 0 for r in run["rows"])
        n_seg = sum(bool(r.get("segmented")) for r in run["rows"])
        seg_spill = sum(r["spill_bytes"] > 0 for r in run["rows"] if r.get("segmented"))
        n_skip = sum(bool(r.get("skipping")) for r in run["rows"])
        skip_spill = sum(r["spill_bytes"] > 0 for r in run["rows"] if r.get("skipping"))
        lines.append(
            f"- Triton {m['triton']}: `{m['command']}` at commit `{m['commit'][:10]}` on "
            f"{m['machine']['cpu']} (Python {m['machine']['python']}): {len(run['rows'])} configs "
            f"({n_seg} with segment ids, {n_skip} with tile skipping), {n_spill} spill "
            f"({seg_spill} with segment ids, {skip_spill} with tile skipping)"
        )
    lines += [
        "",
        "| triton | kernel | tile (M x N) | warps | stages | arch | head dim | seg | skip | registers "
        "| spill B | shared B |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    yes = lambda flag: "yes" if flag else "-"  # noqa: E731
    for run in runs:
        lines += [
            f"| {run['meta']['triton']} | {r['kernel']} | {r['tile']} | {r['num_warps']} | "
            f"{r['num_stages']} | {r['arch']} | {r['head_dim']} | {yes(r.get('segmented'))} | "
            f"{yes(r.get('skipping'))} | {r['registers']} | {r['spill_bytes']} | {r['shared_bytes']} |"
            for r in run["rows"]
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="first tile per kernel, head dim 64")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    ap.add_argument("--md", type=Path, help="write a markdown table here")
    ap.add_argument(
        "--from", dest="sources", type=Path, nargs="+", help="tabulate these JSON runs, compile nothing"
    )
    args = ap.parse_args(argv)
    if args.sources:
        runs = [json.loads(p.read_text()) for p in args.sources]
        if args.md:
            write_md(args.md, runs)
        return 0
    head_dims = [64] if args.quick else [64, 128]
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"fpa_res_{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in tk.KERNEL_NAMES:
        for d in head_dims:
            tiles = tk.GPU_TILES_BY_DIM[name][d]
            for tile in tiles[:1] if args.quick else tiles:
                variants = QUICK_VARIANTS if args.quick else VARIANTS
                variants = variants if has_segments(name) else VARIANTS[:1]
                for segmented, skipping in variants:
                    for arch in ARCHS:
                        row = compile_one(name, tile, arch, d, workdir, segmented, skipping)
                        rows.append(row)
                        print(
                            f"{name:10s} {row['tile']:>8s} w{tile.num_warps} s{tile.num_stages} {arch} d{d}"
                            f"{' seg' if segmented else ''}{' skip' if skipping else ''}: "
                            f"{row['registers']} regs, "
                            f"spill {row['spill_bytes']} B, smem {row['shared_bytes']} B, "
                            f"{row['compile_s']} s",
                            flush=True,
                        )
    for name in SCANS:
        for arch in ARCHS:
            row = compile_scan(name, arch, workdir)
            rows.append(row)
            print(
                f"{name:10s} {row['tile']:>8s} {arch}: {row['registers']} regs, spill {row['spill_bytes']} B"
            )
    meta = {
        "command": "python bench/kernel_resources.py" + (" --quick" if args.quick else ""),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": {"cpu": _cpu_model(), "python": platform.python_version()},
        "triton": triton.__version__,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    if args.md:
        write_md(args.md, [{"meta": meta, "rows": rows}])
    bad = [r for r in rows if r["spill_bytes"] > 0]
    print(f"{len(rows)} configs compiled, {len(bad)} spill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
