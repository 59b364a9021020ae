"""Training throughput of the tiny model for fpa, fox and softmax side by side (one process, no DeepSpeed).

    OMP_NUM_THREADS=1 .venv/bin/python bench/train.py [--steps 10] [--impl chunked] [--out bench.json]
    OMP_NUM_THREADS=1 .venv/bin/python bench/train.py --compile    # each kind eager and compiled, as ratios
    python bench/train.py --preset 110m --dtype bf16 --impl auto --seq-len 2048 --batch 16 --peak-tflops auto
                                   (the GPU acceptance run's loop: bench/gpu_check.sh)

Each kind trains the same shapes with the same attention implementation (default: the chunked PyTorch
path, what `auto` picks on CPU): forward, backward and an AdamW step per iteration, timed after warm-up;
the median step time gives tokens/s. Rows are interleaved (fpa, fox, softmax, fpa, ...) so a load change
on a shared machine hits every kind alike. MFU = (6 N + attention) FLOPs/token x tokens/s over the
measured fp32 matmul peak of this process. "softmax-sdpa" is a reference line: softmax through
torch's fused scaled_dot_product_attention instead of the shared chunked path.
--preset 110m takes the model of configs/model/110m.yaml (d=768, 12 layers, 12 heads, 32k vocab);
--dtype bf16 runs forward and loss under bf16 autocast (fp32 weights and optimizer); --peak-tflops sets the
MFU denominator: "measured" (a matmul in --dtype on this device), "auto" (the datasheet's dense peak of a
known GPU: H100 SXM / H200 989 TFLOP/s bf16, else measured) or a number.

--compile adds each kind with its blocks compiled (train.compile: torch.compile, inductor; the attention
op a custom op), timed interleaved with the eager model after the warm-up that compiles it; the table
gains compiled / eager. Writes docs/results/train_step/result.{json,md} (the tiny preset on CPU; other
presets and devices: train_step_<preset>_<device>; --compile: train_step_compile...; or --result-dir)
with the commit, machine, command and load average;
--no-result writes none.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fpa_model.config import ATTENTION_IMPLS, AttentionConfig, ModelConfig
from fpa_model.model import GPT
from pipeline.trainer.loss import lm_loss
from pipeline.trainer.metrics import measure_peak_flops

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Datasheet dense peaks, TFLOP/s, by a substring of torch.cuda.get_device_name (first match wins).
DATASHEET_TFLOPS = {
    "bf16": [("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0)],
    "fp32": [("H100 PCIe", 51.0), ("H100", 67.0), ("H200", 67.0), ("A100", 19.5)],
}


def apply_preset(args: argparse.Namespace) -> None:
    """--preset 110m: the model sizes of configs/model/110m.yaml (and its tokenizer's vocab)."""
    if args.preset == "tiny":
        return
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "model" / f"{args.preset}.yaml").read_text())
    args.n_layer, args.n_head, args.d_model = (cfg["model"][k] for k in ("n_layer", "n_head", "d_model"))
    args.vocab = cfg.get("data", {}).get("tokenizer", {}).get("vocab_size", args.vocab)


def peak_flops(spec: str, device: torch.device, dtype: str) -> tuple[float, str]:
    """The MFU denominator in FLOP/s and where it came from."""
    if spec not in ("auto", "measured"):
        return float(spec) * 1e12, "given"
    if spec == "auto" and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in DATASHEET_TFLOPS[dtype]:
            if key in name:
                return tflops * 1e12, f"datasheet ({name}, dense {dtype})"
    n = 4096 if device.type == "cuda" else 1024
    return measure_peak_flops(device, DTYPES[dtype], n=n), f"measured ({dtype} {n}^3 matmul)"


def build(kind: str, args: argparse.Namespace) -> GPT:
    sdpa = kind == "softmax-sdpa"
    attn = AttentionConfig(kind="softmax" if sdpa else kind, impl=args.impl, block_size=args.block_size)
    cfg = ModelConfig(
        vocab_size=args.vocab,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        max_seq_len=args.seq_len,
        attention=attn,
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    if sdpa:
        for block in model.blocks:
            # segment_ids: the bench trains unpacked rows (no document mask), as the chunked kinds do
            block.attn.attend = lambda q, k, v, phi, segment_ids=None: F.scaled_dot_product_attention(
                q, k, v, is_causal=True
            )
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default="fpa,fox,softmax,softmax-sdpa")
    p.add_argument("--impl", default="chunked", choices=list(ATTENTION_IMPLS))
    p.add_argument("--block-size", type=int, default=AttentionConfig().block_size)
    p.add_argument("--steps", type=int, default=10, help="timed steps per kind")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument(
        "--preset", choices=["tiny", "110m"], default="tiny", help="110m overrides the sizes above"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="bf16: autocast forward + loss")
    p.add_argument("--compile", action="store_true", help="also each kind with its blocks compiled")
    p.add_argument("--peak-tflops", default="measured", help="MFU denominator: measured, auto or a number")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--result-dir", type=Path, default=None, help="default docs/results/train_step")
    p.add_argument("--no-result", action="store_true", help="write no result file")
    args = p.parse_args()
    apply_preset(args)
    from bench.results import finish_provenance, provenance, write_result

    prov = provenance()

    base_kinds = args.kinds.split(",")
    kinds = base_kinds + ([f"{k} compiled" for k in base_kinds] if args.compile else [])
    device = torch.device("cuda" if torch.cuda.is_available() and args.impl in ("triton", "auto") else "cpu")
    models, opts = {}, {}
    for kind in kinds:
        models[kind] = build(kind.removesuffix(" compiled"), args).to(device)
        if kind.endswith(" compiled"):
            models[kind].compile_blocks()
        opts[kind] = torch.optim.AdamW(models[kind].parameters(), lr=1e-3, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=gen).to(device)
    x, y = idx[:, :-1], idx[:, 1:]

    def autocast():
        if args.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=DTYPES[args.dtype])

    def step(kind: str) -> float:
        model, opt = models[kind], opts[kind]
        t0 = time.perf_counter()
        with autocast():
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        for kind in kinds:
            step(kind)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.steps):
        for kind in kinds:  # interleaved: drifting machine load hits every kind alike
            times[kind].append(step(kind))

    peak, peak_source = peak_flops(args.peak_tflops, device, args.dtype)
    tokens = args.batch * args.seq_len
    rows = {}
    for kind in kinds:
        med = statistics.median(times[kind])
        tps = tokens / med
        mfu = models[kind].flops_per_token(args.seq_len) * tps / peak
        rows[kind] = {"median_step_s": med, "tokens_per_s": tps, "mfu": mfu, "steps": times[kind]}
    base = rows.get("softmax")
    n_params = models[kinds[0]].num_parameters()
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{args.preset} model ({n_params / 1e6:.1f}M parameters): {args.n_layer} layers, d={args.d_model}, "
        f"{args.n_head} heads, vocab {args.vocab}, batch {args.batch} x {args.seq_len}, {args.dtype}, "
        f"impl {args.impl}, {dev_name}, torch threads {torch.get_num_threads()}; "
        f"peak {peak / 1e12:.2f} TFLOP/s, {peak_source}; "
        f"median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(f"{'kind':>13} {'step s':>8} {'tokens/s':>10} {'MFU':>7} {'x softmax':>10}")
    for kind, r in rows.items():
        ratio = r["median_step_s"] / base["median_step_s"] if base else float("nan")
        r["time_ratio_vs_softmax"] = ratio
        if kind.endswith(" compiled"):
            r["time_ratio_vs_eager"] = (
                r["median_step_s"] / rows[kind.removesuffix(" compiled")]["median_step_s"]
            )
        extra = f" {r['time_ratio_vs_eager']:8.2f}x eager" if "time_ratio_vs_eager" in r else ""
        print(
            f"{kind:>20} {r['median_step_s']:8.4f} {r['tokens_per_s']:10.0f} {r['mfu']:7.2%} {ratio:10.2f}"
            + extra
        )
    if "fpa" in rows and base:
        ratio = rows["fpa"]["time_ratio_vs_softmax"]
        verdict = "meets" if ratio <= 1.3 else "MISSES"
        print(f"fpa / softmax step time: {ratio:.2f}x ({verdict} the 1.3x target)")
    if args.out:
        meta = {
            "device": dev_name,
            "n_params": n_params,
            "peak_tflops": peak / 1e12,
            "peak_source": peak_source,
            "torch": torch.__version__,
        }
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, **meta, "rows": rows}, indent=1)
        )
    if not args.no_result:
        finish_provenance(prov)
        name = (
            "train_step"
            if (args.preset, device.type) == ("tiny", "cpu")
            else f"train_step_{args.preset}_{device.type}"
        )
        if args.compile:
            name = name.replace("train_step", "train_step_compile", 1)
        setup = {
            "preset": args.preset,
            "n_params": n_params,
            "n_layer": args.n_layer,
            "d_model": args.d_model,
            "n_head": args.n_head,
            "vocab": args.vocab,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "dtype": args.dtype,
            "impl": args.impl,
            "block_size": args.block_size,
            "device": dev_name,
            "steps": args.steps,
            "warmup": args.warmup,
            "peak_tflops": peak / 1e12,
            "peak_source": peak_source,
            "compile": args.compile,
        }
        data = {**setup, "rows": rows, "provenance": prov}
        out = write_result(name, data, result_markdown(setup, rows, prov), args.result_dir)
        print(f"wrote {out}/result.json and result.md")
    return 0


def result_markdown(setup: dict, rows: dict, prov: dict) -> str:
    """The result file's markdown: step time, tokens/s, MFU and the ratio to softmax per kind."""
    from bench.results import provenance_md

    s = setup
    lines = [
        f"# Training step, {s['preset']} model: fpa, fox and softmax side by side",
        "",
        provenance_md(prov),
        "",
        f"{s['n_params'] / 1e6:.1f}M parameters ({s['n_layer']} layers, d={s['d_model']}, "
        f"{s['n_head']} heads, vocab {s['vocab']}), batch {s['batch']} x {s['seq_len']} tokens, "
        f"{s['dtype']}, attention impl "
        f"{s['impl']} (block {s['block_size']}), {s['device']}; forward, backward and AdamW step; median of "
        f"{s['steps']} steps per kind after {s['warmup']} warm-up, kinds interleaved. MFU: against a peak of "
        f"{s['peak_tflops']:.3g} TFLOP/s, {s['peak_source']} in the same process.",
        "",
    ]
    compiled = s.get("compile", False)
    if compiled:
        lines[-2] += (  # the setup paragraph (the last line is the blank after it)
            " Compiled: the blocks under torch.compile (inductor; train.compile), timed after the warm-up"
            " that compiles them, interleaved with the eager models; compiled / eager is the step time ratio."
        )
    lines += [
        "| kind | step s | tokens/s | MFU | step time / softmax |"
        + (" compiled / eager |" if compiled else ""),
        "|---|---|---|---|---|" + ("---|" if compiled else ""),
    ]
    for kind, r in rows.items():
        eager = (
            f" {r['time_ratio_vs_eager']:.2f}x |"
            if "time_ratio_vs_eager" in r
            else (" - |" if compiled else "")
        )
        lines.append(
            f"| {kind} | {r['median_step_s']:.4f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
            f"{r['time_ratio_vs_softmax']:.2f}x |{eager}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
