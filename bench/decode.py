"""CPU benchmark of token-by-token decoding with FPA's evicting KV cache against the full cache.

A trained run's export (--export RUN/export) is given a prompt of --multiple x its training length
(default 8x) of real text (the last verses of the packaged KJV under the run's tokenizer), prefilled in
chunks of 128 (fpa_model.cache.prefill), then --new greedy tokens (decode_step). The full cache and the
evicting one (the sound bound with the run's eval.cache.margin, horizon = the prompt plus the new
tokens) alternate over --repeats runs after a warm-up; medians. Side by side in one run:

    decode tokens/s of each and their ratio; the time inside the layers' caches (attention over the
    cached keys, append, eviction) per token and its ratio; the fraction of the cache kept after the
    prompt and at the end (mean over layers, heads); the slots held at the end; how many greedy tokens
    agree (the eviction bound keeps each attention output within 2 exp(-margin) max|v| of the full one,
    so the argmax may differ only where two logits are that close)

Usage: python bench/decode.py --export runs/<run>/export [--multiple 8] [--new 64] [--repeats 5]
                              [--quick] [--no-result]

Writes docs/results/decode/result.{json,md} (or --result-dir) with the commit, machine, command and load
average; --quick and --no-result write none.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from bench.tile_skipping import text_tokens
from fpa_model.cache import EvictionPolicy, LayerCache, decode_step, prefill


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", type=Path, required=True, help="a trained run's export dir")
    ap.add_argument("--multiple", type=int, default=8, help="prompt length / the training length")
    ap.add_argument("--new", type=int, default=64, help="tokens decoded after the prompt")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per cache")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2x, 8 tokens, 1 repeat, no result")
    ap.add_argument("--result-dir", type=Path, default=None, help="default docs/results/decode")
    ap.add_argument("--no-result", action="store_true", help="write no result file")
    return ap.parse_args(argv)


class CacheClock:
    """Seconds spent inside LayerCache.attend (attention over the cache, append, eviction)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._orig = LayerCache.attend

    def __enter__(self) -> CacheClock:
        clock, orig = self, self._orig

        def timed(lc, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(lc, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t0

        LayerCache.attend = timed
        return self

    def __exit__(self, *exc) -> None:
        LayerCache.attend = self._orig


def decode(model, prompt: torch.Tensor, new: int, policy: EvictionPolicy) -> dict:
    """Prefill, then `new` greedy tokens; the decode phase timed (wall and inside the caches)."""
    logits, cache = prefill(model, prompt, policy=policy, chunk_size=128)
    kept_prompt = cache.fraction_kept()["overall"]
    tokens = []
    with CacheClock() as clock:
        t0 = time.perf_counter()
        for _ in range(new):
            nxt = logits.argmax(-1)
            tokens.append(int(nxt[0]))
            logits = decode_step(model, cache, nxt)
        wall = time.perf_counter() - t0
    return {
        "seconds": wall,
        "cache_seconds": clock.seconds,
        "tokens": tokens,
        "kept_prompt": kept_prompt,
        "kept_end": cache.fraction_kept()["overall"],
        "slots_end": cache.capacity(),
        # per layer, per head (batch row 0): the share of the tokens seen that is still cached
        "kept_per_head": [[round(float(n) / lc.seen, 3) for n in lc.valid[0].sum(-1)] for lc in cache.layers],
    }


def result_markdown(r: dict, args: argparse.Namespace, prov: dict) -> str:
    from bench.results import provenance_md

    full, ev = r["medians"]["full cache"], r["medians"]["evicting"]
    lines = [
        "# Decoding with the evicting KV cache against the full cache",
        "",
        provenance_md(prov),
        "",
        f"Export `{args.export}` ({r['kind']}, {r['layers']} layers, {r['heads']} heads of {r['head_dim']}, "
        f"trained on {r['train_len']} tokens): a prompt of {r['prompt']} tokens ({args.multiple}x) of the "
        f"last KJV verses, prefilled in chunks of 128, then {args.new} greedy tokens; the two caches "
        f"alternate over {args.repeats} runs after a warm-up, medians; fp32, B=1, "
        f"{r['threads']} thread(s). Eviction: the sound bound, margin {r['margin']:g}, horizon "
        f"{r['prompt'] + args.new} tokens.",
        "",
        "| cache | decode tokens/s | in the caches, ms / token | kept after the prompt | kept at the end "
        "| slots per layer at the end |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("full cache", "evicting"):
        m = r["medians"][name]
        lines.append(
            f"| {name} | {m['tokens_per_s']:.1f} | {m['cache_ms_per_token']:.3f} | "
            f"{100 * m['kept_prompt']:.0f}% | {100 * m['kept_end']:.0f}% | {m['slots_end']} |"
        )
    lines += [
        "",
        f"Evicting / full: **{ev['tokens_per_s'] / full['tokens_per_s']:.2f}x** the decode tokens/s "
        f"(paired per run: median {r['paired_speed']:.2f}x), "
        f"{ev['cache_ms_per_token'] / full['cache_ms_per_token']:.2f}x the time in the caches per "
        f"token; greedy tokens agreeing: {r['agree']} of {args.new}.",
        "",
        "Kept per head at the end (layer by layer): "
        + "; ".join(
            f"L{i}: " + ", ".join(f"{100 * x:.0f}%" for x in heads)
            for i, heads in enumerate(ev["kept_per_head"])
        )
        + ". The slots of a layer are its fullest head's (heads are padded to it), and a decode step "
        "costs the slots.",
        "",
        f"Regenerate: `{prov['command']}`",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.multiple, args.new, args.repeats, args.no_result = 2, 8, 1, True
    from bench.results import finish_provenance, provenance, write_result
    from pipeline.config import load_config
    from pipeline.export import CONFIG, load_exported

    prov = provenance(None if argv is None else ["bench/decode.py", *argv])
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    model = load_exported(args.export).eval()
    attn = model.blocks[0].attn
    if attn.spec.name == "softmax":
        raise SystemExit(f"{args.export}: softmax attention never evicts; pick an fpa or fox run")
    if getattr(attn.cfg, "document_mask", False):
        raise SystemExit(f"{args.export}: a document-masked model; this bench feeds one document")
    run_cfg = load_config([str(args.export / CONFIG)])  # the run's resolved config, as exported
    train_len, margin = int(run_cfg.data.seq_len), float(run_cfg.eval.cache.margin)
    prompt = text_tokens(args.export, args.multiple * train_len)
    pol = {
        "full cache": EvictionPolicy(enabled=False),
        "evicting": EvictionPolicy(enabled=True, margin=margin, max_tokens=prompt.shape[1] + args.new),
    }
    print(
        f"decode: {args.export}, prompt {prompt.shape[1]} tokens ({args.multiple}x {train_len}), "
        f"{args.new} new, threads={torch.get_num_threads()}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {name: [] for name in pol}
    for p in pol.values():  # warm-up
        decode(model, prompt, min(args.new, 4), p)
    for rep in range(args.repeats):
        order = list(pol) if rep % 2 == 0 else list(pol)[::-1]
        for name in order:
            runs[name].append(decode(model, prompt, args.new, pol[name]))
    medians = {}
    for name, rs in runs.items():
        medians[name] = {
            "tokens_per_s": statistics.median(args.new / r["seconds"] for r in rs),
            "cache_ms_per_token": statistics.median(1e3 * r["cache_seconds"] / args.new for r in rs),
            "kept_prompt": rs[0]["kept_prompt"],
            "kept_end": rs[0]["kept_end"],
            "slots_end": rs[0]["slots_end"],
            "kept_per_head": rs[0]["kept_per_head"],
        }
        m = medians[name]
        print(
            f"{name:>10}: {m['tokens_per_s']:7.1f} tokens/s, {m['cache_ms_per_token']:.3f} ms/token in the "
            f"caches, kept {100 * m['kept_prompt']:.0f}% after the prompt, {100 * m['kept_end']:.0f}% at "
            f"the end, slots {m['slots_end']}",
            flush=True,
        )
    paired = statistics.median(
        f["seconds"] / e["seconds"] for f, e in zip(runs["full cache"], runs["evicting"])
    )
    agree = sum(a == b for a, b in zip(runs["full cache"][0]["tokens"], runs["evicting"][0]["tokens"]))
    speed = medians["evicting"]["tokens_per_s"] / medians["full cache"]["tokens_per_s"]
    print(
        f"evicting / full: {speed:.2f}x "
        f"tokens/s (paired {paired:.2f}x); greedy tokens agreeing {agree}/{args.new}"
    )
    r = {
        "kind": attn.spec.name,
        "layers": len(model.blocks),
        "heads": attn.n_head,
        "head_dim": attn.head_dim,
        "train_len": train_len,
        "prompt": int(prompt.shape[1]),
        "margin": margin,
        "threads": torch.get_num_threads(),
        "medians": medians,
        "paired_speed": paired,
        "agree": agree,
        "runs": {n: [{k: v for k, v in x.items() if k != "tokens"} for x in rs] for n, rs in runs.items()},
    }
    if not args.no_result:
        finish_provenance(prov)
        meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        out = write_result(
            "decode", {"args": meta, **r, "provenance": prov}, result_markdown(r, args, prov), args.result_dir
        )
        print(f"wrote {out}/result.json and result.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
