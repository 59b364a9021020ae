"""`fpa generate CONFIG "prompt"`: text from the run's exported model through the project's KV cache.

Greedy (temperature 0) or sampled (temperature > 0, optional top-k) with a seeded torch.Generator, so the
same seed gives the same text; tokens are printed as they are produced. With --evict the FPA/FoX cache
drops keys by the eviction bound (fpa_model.cache; eval.cache's margin / delta / norm_slack) and the
fraction of the cache kept is printed at the end (to stderr, after the text).

The prompt is encoded as a document of the training stream: after the end-of-document token. Decoding
stops at that token (a document's end) or after --max-new-tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from pipeline.config import ConfigError, RunConfig


class GenerateError(ConfigError):
    """Bad input to `fpa generate` (no weights, empty or too long prompt), reported as one line."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The `generate` subcommand on the CLI's subparsers (launch.cli)."""
    sp = sub.add_parser(
        "generate",
        help="generate text from the exported model with the KV cache (streamed)",
        description="generate text from the exported model with the KV cache (streamed)",
    )
    sp.add_argument("config", metavar="CONFIG", help="the run's YAML config")
    sp.add_argument("prompt", help="the text to continue")
    sp.add_argument("items", nargs="*", metavar="CONFIG|KEY=VALUE", help="more configs and overrides")
    sp.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (64)")
    sp.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    sp.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    sp.add_argument("--seed", type=int, default=None, help="sampling seed (default: the config's seed)")
    sp.add_argument("--evict", action="store_true", help="FPA/FoX KV-cache eviction; prints the cache kept")
    sp.add_argument(
        "--checkpoint", help="an export dir (model.safetensors + config.yaml); default: the run's"
    )
    sp.set_defaults(fn=cmd_generate)
    return sp


def cmd_generate(args: argparse.Namespace) -> int:
    from pipeline.config import load_config

    paths = [args.config, *(a for a in args.items if "=" not in a)]
    cfg = load_config(paths, [a for a in args.items if "=" in a])
    result = generate_text(
        cfg,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        evict=args.evict,
        checkpoint=Path(args.checkpoint) if args.checkpoint else None,
    )
    if result["cache_fraction"] is not None:
        per_layer = ", ".join(f"{100 * f:.0f}%" for f in result["cache_fraction_per_layer"])
        print(
            f"cache kept: {100 * result['cache_fraction']:.1f}% of the keys "
            f"({result['tokens']} tokens; per layer {per_layer})",
            file=sys.stderr,
        )
    return 0


def _check_args(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be >= 1; got {max_new_tokens}")
    if temperature < 0:
        raise GenerateError(f"--temperature must be >= 0; got {temperature}")
    if top_k is not None and top_k < 1:
        raise GenerateError(f"--top-k must be >= 1; got {top_k}")


def generate_text(
    cfg: RunConfig,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    evict: bool = False,
    checkpoint: Path | None = None,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Continue prompt with the run's exported model, streaming the text to out (stdout).

    Returns {"text", "tokens" (prompt + generated), "new_tokens": [ids], "cache_fraction" (None without
    eviction), "cache_fraction_per_layer"}.
    """
    import torch

    from data_prep.index import load_index
    from data_prep.tokenizer import load_tokenizer
    from fpa_model.cache import EvictionPolicy, generate
    from pipeline.evaluation import pick_device, resolve_weights
    from pipeline.export import load_exported
    from pipeline.upstream import check_data, check_export

    out = out if out is not None else sys.stdout
    _check_args(max_new_tokens, temperature, top_k)
    if not prompt.strip():
        raise GenerateError("the prompt is empty")
    weights = resolve_weights(cfg, checkpoint)  # EvalError (one line) when there is no export
    check_data(cfg)
    check_export(cfg, weights, explicit=bool(checkpoint or cfg.eval.checkpoint))
    index = load_index(cfg.data_dir)
    tokenizer = load_tokenizer(cfg.data_dir)
    ids = [index.eod_id, *tokenizer.encode(prompt).ids]
    model = load_exported(weights)
    limit = model.cfg.max_seq_len
    if len(ids) + max_new_tokens > limit:
        raise GenerateError(
            f"the prompt is {len(ids)} tokens; with --max-new-tokens {max_new_tokens} that exceeds "
            f"model.max_seq_len={limit}"
        )
    device = pick_device(cfg.eval.device)
    model = model.to(device)
    c = cfg.eval.cache
    policy = EvictionPolicy(enabled=evict, delta=c.delta, margin=c.margin, norm_slack=c.norm_slack)
    generator = torch.Generator().manual_seed(cfg.seed if seed is None else seed)

    new: list[int] = []
    shown = ""

    def stream(tokens: torch.Tensor) -> None:
        # Decode everything so far and print what is new: a character may span several byte tokens.
        nonlocal shown
        new.append(int(tokens[0]))
        text = tokenizer.decode(new)
        if text.startswith(shown) and not text.endswith("\ufffd"):
            out.write(text[len(shown) :])
            out.flush()
            shown = text

    _, cache = generate(
        model,
        torch.tensor([ids], device=device),
        max_new_tokens,
        policy=policy,
        chunk_size=c.prefill_chunk if evict else None,
        eos_id=index.eod_id,
        eod_id=index.eod_id,  # document_mask models: the prompt is a document after the eod prefix
        temperature=temperature,
        top_k=top_k,
        generator=generator,
        on_token=stream,
    )
    text = tokenizer.decode(new)
    out.write(text[len(shown) :] + "\n")
    out.flush()
    fraction = cache.fraction_kept() if evict else None
    return {
        "text": text,
        "tokens": len(ids) + len(new),
        "new_tokens": new,
        "cache_fraction": fraction["overall"] if fraction else None,
        "cache_fraction_per_layer": fraction["per_layer"] if fraction else None,
    }
