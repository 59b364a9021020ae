"""Peak memory of one training step (forward + backward) with the plain and the chunked cross-entropy.

    .venv/bin/python bench/loss_memory.py                      # vocab 32768, seq 2048, CPU, chunk 1024
    .venv/bin/python bench/loss_memory.py --device cuda --batch 8

Each variant runs in a fresh process (peak RSS cannot be reset within one): it builds a small GPT, makes
the batch, runs one step to warm up and records the resident memory, then runs the measured step. On the
CPU the figure is the rise of peak RSS (ru_maxrss) over that baseline, on CUDA torch's peak allocated
memory over the allocated baseline. The plain loss holds the (batch x seq x vocab) fp32 logits with their
log-softmax and gradient; the chunked one (train.loss_chunk_tokens) at most chunk x vocab of them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _rss_mib() -> float:
    """The resident memory now (ru_maxrss is the peak so far)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One variant in this process: the step's peak memory above the state before it, in MiB."""
    import torch

    from fpa_model.config import AttentionConfig, ModelConfig
    from fpa_model.model import GPT
    from pipeline.trainer.loss import lm_loss

    torch.manual_seed(0)
    device = torch.device(args.device)
    att = AttentionConfig(kind="fpa", impl="auto", block_size=128)
    cfg = ModelConfig(
        vocab_size=args.vocab,
        n_layer=args.layers,
        n_head=args.d_model // 64,
        d_model=args.d_model,
        max_seq_len=args.seq,
        attention=att,
    )
    model = GPT(cfg).to(device)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    x, y = idx[:, :-1], idx[:, 1:]
    chunk = args.chunk if args.variant == "chunked" else 0

    def step() -> float:
        if chunk:
            loss = lm_loss(model(x, head=False), y, head=model.lm_head.weight, chunk_tokens=chunk)
        else:
            loss = lm_loss(model(x), y)
        loss.backward()
        return float(loss)

    step()  # warm-up: gradients exist from here on, as in training
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        loss = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        base = _rss_mib()
        loss = step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return {
        "variant": args.variant,
        "loss": loss,
        "baseline_mib": base,
        "peak_mib": peak,
        "step_mib": peak - base,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chunk", type=int, default=1024, help="train.loss_chunk_tokens of the chunked variant")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--variant", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:  # a child: one measurement as a JSON line
        print(json.dumps(measure(args)), flush=True)
        return 0
    rows = {}
    for variant in ("plain", "chunked"):
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--variant", variant],
            capture_output=True,
            text=True,
            check=True,
        )
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    plain, chunked = rows["plain"], rows["chunked"]
    print(
        f"vocab {args.vocab}, seq {args.seq}, batch {args.batch}, d_model {args.d_model}, "
        f"{args.layers} layers, {args.device}; chunk {args.chunk} tokens"
    )
    for r in (plain, chunked):
        print(
            f"  {r['variant']:8s} loss {r['loss']:.6f}  step peak {r['step_mib']:8.1f} MiB "
            f"(process peak {r['peak_mib']:.1f} MiB)"
        )
    print(f"  step peak ratio plain / chunked: {plain['step_mib'] / max(chunked['step_mib'], 1e-9):.2f}x")
    print(f"  process peak ratio plain / chunked: {plain['peak_mib'] / chunked['peak_mib']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
