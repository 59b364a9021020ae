"""Passkey retrieval grid: lengths (multiples of the training length) x needle depths, with the full KV
cache and with FPA/FoX eviction, scored by exact match of the generated integer.

Outputs under the eval dir: passkey.json (the grid and every answer) and passkey.png (a heatmap per cache
mode, accuracy in each cell, cache fraction kept in the titles).

A model.attention.document_mask model decodes each prompt as one document: the prompt follows the
end-of-document prefix and holds no other end-of-document token (checked), so the cache (eod_id) starts
the document right after the prefix, as passkey documents start in the training stream.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from data_prep import passkey as protocol
from fpa_model.cache import EvictionPolicy, generate
from pipeline.atomic import atomic_write_text
from pipeline.config import CacheConfig, PasskeyConfig

log = logging.getLogger("fpa")

MODES = ("full", "compressed")  # full KV cache | FPA/FoX eviction on


def passkey_lengths(seq_len: int, multipliers: list[float]) -> list[int]:
    """Total token lengths (prompt plus answer) of the grid rows."""
    return [max(1, round(m * seq_len)) for m in multipliers]


def answer_budget(digits: int) -> int:
    """Tokens generated per prompt: enough for the key even if every digit is its own token, plus one."""
    return digits + 2


def _cell_keys(seed: int, length: int, depth: float, trials: int, digits: int) -> list[int]:
    # Keys depend on the cell only, so every run (and both cache modes) sees the same prompts.
    rng = random.Random(f"{seed}:{length}:{depth:.6f}")
    return [protocol.random_key(rng, digits) for _ in range(trials)]


@torch.no_grad()
def decode_answers(
    model: torch.nn.Module,
    tokenizer: protocol.TokenizerLike,
    prompts: list[list[int]],
    budget: int,
    *,
    policy: EvictionPolicy,
    chunk_size: int | None,
    device: torch.device,
    eod_id: int | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """Greedy continuations (`budget` tokens) of equal-length prompts decoded as one batch, and what the
    cache kept: every grid cell (the passkey's and the long-context tasks') runs through here. eod_id:
    the end-of-document token of a model with model.attention.document_mask (the cache's documents)."""
    idx = torch.tensor(prompts, dtype=torch.long, device=device)
    new, cache = generate(model, idx, budget, policy=policy, chunk_size=chunk_size, eod_id=eod_id)
    answers = [protocol.decode(tokenizer, row) for row in new.tolist()]
    frac = cache.fraction_kept()
    return answers, {
        "cache_fraction": float(frac["overall"]),
        "cache_fraction_per_layer": [float(f) for f in frac["per_layer"]],
        "cache_capacity": cache.capacity(),
    }


def run_cell(
    model: torch.nn.Module,
    tokenizer: protocol.TokenizerLike,
    *,
    length: int,
    depth: float,
    keys: list[int],
    digits: int,
    policy: EvictionPolicy,
    chunk_size: int | None,
    prefix_ids: list[int],
    device: torch.device,
    eod_id: int | None = None,
) -> dict[str, Any]:
    """One (length, depth, mode) cell: the prompts of all keys decoded as one batch. eod_id: the
    end-of-document token, required by a model.attention.document_mask model."""
    from pipeline.evaluation.perplexity import document_eod

    eod = document_eod(model, eod_id, "passkey")
    budget = answer_budget(digits)
    prompts = [
        protocol.build_prompt(tokenizer, length - budget, depth, k, prefix_ids=prefix_ids) for k in keys
    ]
    if eod is not None and any(eod in p.ids[len(prefix_ids) :] for p in prompts):
        raise ValueError(f"a passkey prompt holds the end-of-document token {eod}: it must be one document")
    answers, kept = decode_answers(
        model,
        tokenizer,
        [p.ids for p in prompts],
        budget,
        policy=policy,
        chunk_size=chunk_size,
        device=device,
        eod_id=eod,
    )
    correct = [protocol.is_correct(a, k) for a, k in zip(answers, keys)]
    return {
        "length": length,
        "depth": depth,
        "needle_depth_tokens": [p.needle_start for p in prompts],
        "keys": keys,
        "answers": answers,
        "correct": sum(correct),
        "trials": len(keys),
        "accuracy": sum(correct) / len(keys),
        **kept,
    }


def _summarize(cells: list[dict[str, Any]], lengths: list[int], depths: list[float]) -> dict[str, Any]:
    by = {(c["length"], c["depth"]): c for c in cells}
    grid = [[by[(L, d)]["accuracy"] for d in depths] for L in lengths]
    frac_grid = [[by[(L, d)]["cache_fraction"] for d in depths] for L in lengths]
    n_layers = len(cells[0]["cache_fraction_per_layer"]) if cells else 0
    return {
        "accuracy": sum(c["correct"] for c in cells) / max(sum(c["trials"] for c in cells), 1),
        "accuracy_per_length": {
            str(L): sum(by[(L, d)]["correct"] for d in depths) / sum(by[(L, d)]["trials"] for d in depths)
            for L in lengths
        },
        "grid": grid,  # [length][depth]
        "cache_fraction": sum(c["cache_fraction"] for c in cells) / max(len(cells), 1),
        "cache_fraction_per_length": {
            str(L): sum(by[(L, d)]["cache_fraction"] for d in depths) / len(depths) for L in lengths
        },
        "cache_fraction_per_layer": [
            sum(c["cache_fraction_per_layer"][i] for c in cells) / len(cells) for i in range(n_layers)
        ],
        "cache_fraction_grid": frac_grid,
    }


CellFn = Callable[[int, float, EvictionPolicy, int | None], dict[str, Any]]


def grid_modes(model: torch.nn.Module, cache_cfg: CacheConfig) -> list[str]:
    """full, and compressed where the model can evict (fpa/fox) and eval.cache.evict asks for it."""
    kinds = {block.attn.kind for block in model.blocks}
    return ["full", "compressed"] if cache_cfg.evict and kinds != {"softmax"} else ["full"]


def run_grid(
    cell: CellFn,
    lengths: list[int],
    depths: list[float],
    modes: list[str],
    cache_cfg: CacheConfig,
    *,
    seq_len: int,
    name: str,
) -> tuple[dict[str, Any], list[list[Any]]]:
    """Every (mode, length, depth) cell through cell(length, depth, policy, prefill chunk): ({mode: summary
    with the cells}, W&B table rows). The eviction policy is built here, once per length, for every task."""
    out: dict[str, Any] = {}
    rows: list[list[Any]] = []
    for mode in modes:
        cells = []
        for L in lengths:
            policy = EvictionPolicy(
                enabled=mode == "compressed",
                delta=cache_cfg.delta,
                margin=cache_cfg.margin,
                norm_slack=cache_cfg.norm_slack,
                max_tokens=L,
            )
            for d in depths:
                # Full cache: the whole prompt in one pass of the model's op; compressed: chunks, evicting
                # between them.
                c = cell(L, d, policy, cache_cfg.prefill_chunk if mode == "compressed" else None)
                c["mode"] = mode
                cells.append(c)
                rows.append([mode, L, L / seq_len, d, c["accuracy"], c["cache_fraction"], c["trials"]])
            at_len = [c for c in cells if c["length"] == L]
            log.info(
                "%s %s length %d: accuracy %.3f",
                name,
                mode,
                L,
                sum(c["correct"] for c in at_len) / sum(c["trials"] for c in at_len),
            )
        out[mode] = {**_summarize(cells, lengths, depths), "cells": cells}
    return out, rows


def run_passkey(
    model: torch.nn.Module,
    tokenizer: protocol.TokenizerLike,
    *,
    seq_len: int,
    pk: PasskeyConfig,
    cache_cfg: CacheConfig,
    out_dir: Path,
    prefix_ids: list[int] | None = None,
    logger: Any = None,
    device: torch.device | None = None,
    eod_id: int | None = None,
) -> dict[str, Any]:
    """The whole grid, both cache modes (compressed only for fpa/fox with eviction enabled). eod_id: the
    end-of-document token, required by a model.attention.document_mask model (run_cell).

    Writes passkey.json and passkey.png into out_dir, logs a W&B table through `logger.log_table` when a
    logger is given, and returns the JSON content.
    """
    device = device or next(model.parameters()).device
    lengths = passkey_lengths(seq_len, list(pk.length_multipliers))
    depths = [float(d) for d in pk.depths]
    modes = grid_modes(model, cache_cfg)
    result: dict[str, Any] = {
        "seq_len": seq_len,
        "multipliers": [float(m) for m in pk.length_multipliers],
        "lengths": lengths,
        "depths": depths,
        "trials": pk.trials,
        "digits": pk.digits,
        "modes": {},
        "cache": {
            "delta": cache_cfg.delta,
            "margin": cache_cfg.margin,
            "norm_slack": cache_cfg.norm_slack,
            "prefill_chunk": cache_cfg.prefill_chunk,
        },
    }
    t0 = time.time()

    def cell(length: int, depth: float, policy: EvictionPolicy, chunk_size: int | None) -> dict[str, Any]:
        keys = _cell_keys(pk.seed, length, depth, pk.trials, pk.digits)
        return run_cell(
            model,
            tokenizer,
            length=length,
            depth=depth,
            keys=keys,
            digits=pk.digits,
            policy=policy,
            chunk_size=chunk_size,
            prefix_ids=list(prefix_ids or []),
            device=device,
            eod_id=eod_id,
        )

    result["modes"], rows = run_grid(cell, lengths, depths, modes, cache_cfg, seq_len=seq_len, name="passkey")
    result["seconds"] = round(time.time() - t0, 2)

    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "passkey.json", result)
    plot_passkey(result, out_dir / "passkey.png")
    if logger is not None:
        logger.log_table(
            "eval/passkey",
            ["mode", "length", "multiplier", "depth", "accuracy", "cache_fraction", "trials"],
            rows,
        )
    return result


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


def plot_passkey(result: dict[str, Any], path: Path, title: str | None = None) -> None:
    """Heatmaps (length x depth) of accuracy, one per cache mode (title: a figure title above them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    lengths, depths = result["lengths"], result["depths"]
    fig, axes = plt.subplots(
        1,
        len(modes),
        figsize=(2.0 + 1.0 * len(depths) * len(modes), 1.6 + 0.45 * len(lengths)),
        squeeze=False,
        layout="constrained",
    )
    for ax, mode in zip(axes[0], modes):
        m = result["modes"][mode]
        im = ax.imshow(m["grid"], vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="lower")
        for i in range(len(lengths)):
            for j in range(len(depths)):
                ax.text(j, i, f"{m['grid'][i][j]:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_yticks(range(len(lengths)), [f"{L} ({L / result['seq_len']:g}x)" for L in lengths])
        ax.set_xlabel("needle depth")
        if ax is axes[0][0]:
            ax.set_ylabel("length (tokens)")
        title = f"{mode}: acc {m['accuracy']:.2f}"
        if mode == "compressed":
            title += f", cache kept {m['cache_fraction']:.0%}"
        ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)
