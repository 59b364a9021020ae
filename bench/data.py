"""Data pipeline benchmark on the embedded default corpus (configs/tiny.yaml: KJV train, wiki validation).

1. prepare throughput: prepare_data (with the tokenizer already trained, so both sides tokenize the same
   text) in tokens/s, against raw `Tokenizer.encode_batch` on the same documents in the same batches, in
   the same process, alternating runs; medians. Target: ratio >= 0.8. prepare reads and parses its
   sources itself while the raw side gets the documents in memory. Wall-clock ratios swing with other
   load on a shared machine, so the ratio of tokens per CPU-second (all threads) is printed as well.
   The tokenizer training time and a full end-to-end prepare are reported too.
2. loader throughput: ShardLoader over the train split (tokens/s of input positions, micro_batch x
   seq_len per batch) against what one training step of the tiny model consumes, measured here (forward,
   backward, AdamW step at the config's micro batch) unless --assume-train-tps is given. Target: >= 10x.

Usage: OMP_NUM_THREADS=1 python bench/data.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_prep.prepare import prepare_data  # noqa: E402
from data_prep.sources import iter_documents  # noqa: E402
from pipeline.config import load_config  # noqa: E402


def bench_prepare(cfg: Any, work: Path, repeats: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    t = time.perf_counter()
    full = prepare_data(cfg, work / "full", progress=False)
    e2e_seconds = time.perf_counter() - t
    tok_path = work / "full" / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_path))
    cfg.tokenizer.path = str(tok_path)
    docs = list(iter_documents(cfg.train, max_doc_chars=cfg.max_doc_chars))
    docs += list(iter_documents(cfg.validation, max_doc_chars=cfg.max_doc_chars))
    bs = cfg.tokenize_batch_docs
    raw_tps, prep_tps, raw_cpu, prep_cpu = [], [], [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), _cpu()
        n = 0
        for i in range(0, len(docs), bs):
            n += sum(len(e.ids) for e in tok.encode_batch(docs[i : i + bs], add_special_tokens=False))
        raw_tps.append(n / (time.perf_counter() - t))
        raw_cpu.append(n / (_cpu() - c))
        t, c = time.perf_counter(), _cpu()
        s = prepare_data(cfg, work / "again", progress=False)
        prep_tps.append(s["tokens"] / (time.perf_counter() - t))
        prep_cpu.append(s["tokens"] / (_cpu() - c))
    raw, prep = statistics.median(raw_tps), statistics.median(prep_tps)
    return {
        "documents": len(docs),
        "tokens": full["tokens"],
        "end_to_end_seconds": e2e_seconds,
        "tokenizer_train_seconds": full["tokenizer_seconds"],
        "raw_encode_batch_tokens_per_s": raw,
        "prepare_tokens_per_s": prep,
        "prepare_over_raw": prep / raw,
        # per run, the two measured back to back: less exposed to load that drifts over the whole bench
        "prepare_over_raw_paired_median": statistics.median(p / r for p, r in zip(prep_tps, raw_tps)),
        # tokens per CPU-second (all threads): what each side costs, whatever else runs on the machine
        "prepare_over_raw_cpu": statistics.median(prep_cpu) / statistics.median(raw_cpu),
        "raw_runs": raw_tps,
        "prepare_runs": prep_tps,
    }


def _cpu() -> float:
    """CPU seconds of this process, every thread included (tokenizers' Rust pool too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bench_loader(data_dir: Path, micro_batch: int, repeats: int, batches: int) -> dict[str, Any]:
    from data_prep.loader import ShardLoader

    loader = ShardLoader(data_dir, "train", micro_batch=micro_batch)
    it = iter(loader)
    t = time.perf_counter()
    next(it)  # first batch reads and verifies the shards
    first = time.perf_counter() - t
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(batches):
            next(it)
        runs.append(batches * micro_batch * loader.seq_len / (time.perf_counter() - t))
    return {"first_batch_seconds": first, "tokens_per_s": statistics.median(runs), "runs": runs}


def bench_train_step(cfg: Any, vocab_size: int, steps: int) -> dict[str, Any]:
    import torch

    from fpa_model.model import GPT
    from pipeline.loss import lm_loss

    torch.manual_seed(0)
    cfg.model.vocab_size = vocab_size
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b, t = cfg.train.micro_batch, cfg.data.seq_len
    x = torch.randint(0, vocab_size, (b, t + 1))
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return {"step_seconds": step, "tokens_per_s": b * t / step, "micro_batch": b, "seq_len": t}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loader-batches", type=int, default=2000)
    ap.add_argument("--train-steps", type=int, default=5)
    ap.add_argument("--assume-train-tps", type=float, default=None, help="skip the model step measurement")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)

    cfg = load_config([args.config])
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        out["prepare"] = bench_prepare(cfg.data, work, args.repeats)
        p = out["prepare"]
        print(
            f"prepare: {p['tokens']:,} tokens; end to end {p['end_to_end_seconds']:.2f} s "
            f"(tokenizer training {p['tokenizer_train_seconds']:.2f} s)"
        )
        print(
            f"prepare {p['prepare_tokens_per_s'] / 1e6:.3f} M tok/s vs raw encode_batch "
            f"{p['raw_encode_batch_tokens_per_s'] / 1e6:.3f} M tok/s (medians of {args.repeats}): "
            f"ratio {p['prepare_over_raw']:.2f} (target >= 0.8); paired median "
            f"{p['prepare_over_raw_paired_median']:.2f}; per CPU-second {p['prepare_over_raw_cpu']:.2f}"
        )
        out["loader"] = bench_loader(work / "full", cfg.train.micro_batch, args.repeats, args.loader_batches)
        vocab = json.loads((work / "full" / "index.json").read_text())["vocab_size"]
    if args.assume_train_tps:
        out["train_step"] = {"tokens_per_s": args.assume_train_tps, "assumed": True}
    else:
        out["train_step"] = bench_train_step(cfg, vocab, args.train_steps)
    lt, tt = out["loader"]["tokens_per_s"], out["train_step"]["tokens_per_s"]
    out["loader_over_train"] = lt / tt
    how = "assumed" if args.assume_train_tps else f"measured, {out['train_step']['step_seconds']:.3f} s/step"
    print(
        f"loader {lt / 1e6:.2f} M tok/s (first batch {out['loader']['first_batch_seconds'] * 1e3:.0f} ms) vs "
        f"tiny-model training {tt:,.0f} tok/s ({how}): ratio {lt / tt:,.0f}x (target >= 10x)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
