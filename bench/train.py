"""Training throughput of the tiny model for fpa, fox and softmax side by side (one process, no DeepSpeed).

    OMP_NUM_THREADS=1 .venv/bin/python bench/train.py [--steps 10] [--impl chunked] [--out bench.json]

Each kind trains the same shapes with the same attention implementation (default: the chunked PyTorch
path, what `auto` picks on CPU): forward, backward and an AdamW step per iteration, timed after warm-up;
the median step time gives tokens/s. Rows are interleaved (fpa, fox, softmax, fpa, ...) so a load change
on a shared machine hits every kind alike. MFU = (6 N + attention) FLOPs/token x tokens/s over the
measured fp32 matmul peak of this process. "softmax-sdpa" is a reference line: softmax through
torch's fused scaled_dot_product_attention instead of the shared chunked path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fpa_model.config import AttentionConfig, ModelConfig  # noqa: E402
from fpa_model.model import GPT  # noqa: E402
from pipeline.train import measure_peak_flops  # noqa: E402


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
            block.attn.attend = lambda q, k, v, phi: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default="fpa,fox,softmax,softmax-sdpa")
    p.add_argument("--impl", default="chunked", choices=["naive", "chunked", "triton", "auto"])
    p.add_argument("--block-size", type=int, default=AttentionConfig().block_size)
    p.add_argument("--steps", type=int, default=10, help="timed steps per kind")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args()

    kinds = args.kinds.split(",")
    device = torch.device("cuda" if torch.cuda.is_available() and args.impl in ("triton", "auto") else "cpu")
    models, opts = {}, {}
    for kind in kinds:
        models[kind] = build(kind, args).to(device)
        opts[kind] = torch.optim.AdamW(models[kind].parameters(), lr=1e-3, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=gen).to(device)
    x, y = idx[:, :-1], idx[:, 1:]

    def step(kind: str) -> float:
        model, opt = models[kind], opts[kind]
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
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

    peak = measure_peak_flops(device)
    tokens = args.batch * args.seq_len
    rows = {}
    for kind in kinds:
        med = statistics.median(times[kind])
        tps = tokens / med
        mfu = models[kind].flops_per_token(args.seq_len) * tps / peak
        rows[kind] = {"median_step_s": med, "tokens_per_s": tps, "mfu": mfu, "steps": times[kind]}
    base = rows.get("softmax")
    print(
        f"tiny model: {args.n_layer} layers, d={args.d_model}, {args.n_head} heads, vocab {args.vocab}, "
        f"batch {args.batch} x {args.seq_len}, impl {args.impl}, {device}, "
        f"torch threads {torch.get_num_threads()}; peak {peak / 1e9:.1f} GFLOP/s; "
        f"median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(f"{'kind':>13} {'step s':>8} {'tokens/s':>10} {'MFU':>7} {'x softmax':>10}")
    for kind, r in rows.items():
        ratio = r["median_step_s"] / base["median_step_s"] if base else float("nan")
        r["time_ratio_vs_softmax"] = ratio
        print(f"{kind:>13} {r['median_step_s']:8.4f} {r['tokens_per_s']:10.0f} {r['mfu']:7.2%} {ratio:10.2f}")
    if "fpa" in rows and base:
        ratio = rows["fpa"]["time_ratio_vs_softmax"]
        verdict = "meets" if ratio <= 1.3 else "MISSES"
        print(f"fpa / softmax step time: {ratio:.2f}x ({verdict} the 1.3x target)")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
