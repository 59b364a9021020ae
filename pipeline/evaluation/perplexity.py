"""Loss by position at and beyond the training length, and bits per byte, on the validation split.

Windows longer than training are made by joining consecutive validation sequences end to end: the
prepared shards store the token stream cut into consecutive rows of seq_len + 1 tokens, so reading the rows
in order gives back the contiguous stream. Each length L gets up to eval.ppl_sequences disjoint windows of
L + 1 tokens (inputs and shifted targets).

Bits per byte divides the summed loss (in bits) by the UTF-8 bytes the target tokens decode to, so runs
with different tokenizers compare. Special tokens (the end-of-document separator) count zero bytes.

With eviction on (fpa/fox), every window is also read through the evicting KV cache in prefill chunks,
giving the loss by position with the compressed cache and the fraction kept: the price of compression.

A model.attention.document_mask model reads each window as it was trained: segment ids from the
end-of-document tokens (eod_id), so a query attends only inside its document (the cache: a new document
after each eod). The loss by position is still by position in the window.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fpa_model.cache import EvictionPolicy, prefill
from pipeline.atomic import atomic_write_text

log = logging.getLogger("fpa")


def validation_stream(data_dir: Path | str, max_tokens: int, split: str = "validation") -> np.ndarray:
    """The first max_tokens tokens (or all there are) of a split's token stream, in stored order."""
    from data_prep.index import load_index
    from data_prep.shards import read_shard

    index = load_index(data_dir)
    parts: list[np.ndarray] = []
    n = 0
    for shard in index.shards(split):
        rows = read_shard(
            data_dir, shard, seq_len=index.seq_len, dtype=index.dtype, vocab_size=index.vocab_size
        )
        flat = rows.reshape(-1)
        parts.append(flat)
        n += flat.size
        if n >= max_tokens:
            break
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return stream[:max_tokens].astype(np.int64)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def token_byte_lengths(tokenizer: Any) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens).

    Byte-level BPE vocab entries are strings over GPT-2's byte alphabet, one character per byte; any
    other tokenizer falls back to decoding each id alone.
    """
    vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=True)
    special = {int(i) for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    out = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
    alphabet = set(_bytes_to_unicode().values())
    for tok, i in vocab.items():
        if i in special:
            continue
        if all(ch in alphabet for ch in tok):
            out[i] = len(tok)
        else:
            out[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return out


def document_eod(model: torch.nn.Module, eod_id: int | None, what: str) -> int | None:
    """eod_id for a model with model.attention.document_mask (a one-line error naming `what` when it is
    missing: the eval would otherwise attend across documents), None for any other model."""
    attn = getattr(getattr(model, "cfg", None), "attention", None)
    if not getattr(attn, "document_mask", False):
        return None
    if eod_id is None:
        raise ValueError(
            f"{what}: the model has model.attention.document_mask=true and needs eod_id (the data index's "
            "end-of-document id) to derive its segment ids"
        )
    return int(eod_id)


@torch.no_grad()
def window_losses(
    model: torch.nn.Module, windows: torch.Tensor, batch: int = 1, eod_id: int | None = None
) -> torch.Tensor:
    """Per-position next-token loss (nats, fp32) of windows (N, L+1) -> (N, L). eod_id: the
    end-of-document token, required by (and only read for) a document_mask model."""
    from data_prep.loader import document_segments

    eod = document_eod(model, eod_id, "window_losses")
    out = []
    for s in range(0, windows.shape[0], batch):
        w = windows[s : s + batch]
        x = w[:, :-1]
        logits = model(x) if eod is None else model(x, segment_ids=document_segments(x, eod))
        out.append(F.cross_entropy(logits.float().transpose(1, 2), w[:, 1:], reduction="none").cpu())
    return torch.cat(out)


@torch.no_grad()
def compressed_window_losses(
    model: torch.nn.Module,
    windows: torch.Tensor,
    policy: EvictionPolicy,
    chunk_size: int,
    eod_id: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Per-position loss (N, L) when the windows are read through the evicting KV cache in chunks (every
    chunk sees only the keys kept so far), and the fraction of the cache kept at the end (mean). eod_id:
    as in window_losses."""
    eod = document_eod(model, eod_id, "compressed_window_losses")
    out, fracs = [], []
    for w in windows:
        logits, cache = prefill(
            model, w[None, :-1], policy=policy, chunk_size=chunk_size, all_logits=True, eod_id=eod
        )
        out.append(F.cross_entropy(logits[0].float(), w[1:], reduction="none").cpu())
        fracs.append(float(cache.fraction_kept()["overall"]))
    return torch.stack(out), sum(fracs) / len(fracs)


def run_perplexity(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    data_dir: Path | str,
    seq_len: int,
    multipliers: list[float],
    bucket: int,
    sequences: int,
    out_dir: Path,
    device: torch.device | None = None,
    evict: EvictionPolicy | None = None,
    prefill_chunk: int = 128,
    split: str = "validation",
    eod_id: int | None = None,
) -> dict[str, Any]:
    """Loss by position bucket (with its standard error over windows), perplexity and bits per byte per
    length on one held-out split; writes perplexity.json/.png (split "validation") or
    perplexity-<split>.json/.png.

    evict: also read every window through the evicting KV cache (chunks of prefill_chunk tokens) and
    record its loss by position and the cache fraction kept: what compression costs in loss. Ignored
    for softmax models, which never evict. eod_id: the end-of-document token, required by a
    model.attention.document_mask model (each window's documents as in training).
    """
    eod = document_eod(model, eod_id, "run_perplexity")
    kinds = {block.attn.kind for block in model.blocks}
    if evict is not None and (not evict.enabled or kinds == {"softmax"}):
        evict = None
    device = device or next(model.parameters()).device
    lengths = [max(2, round(m * seq_len)) for m in multipliers]
    need = sequences * (max(lengths) + 1)
    stream = validation_stream(data_dir, need, split)
    nbytes = token_byte_lengths(tokenizer)
    result: dict[str, Any] = {"split": split, "seq_len": seq_len, "bucket": bucket, "lengths": {}}
    for m, L in zip(multipliers, lengths):
        n = min(sequences, stream.size // (L + 1))
        key = str(L)
        if n == 0:
            log.warning(
                "perplexity: %s split has %d tokens, too few for one window of %d", split, stream.size, L
            )
            result["lengths"][key] = {
                "multiplier": float(m),
                "windows": 0,
                "skipped": f"too few {split} tokens",
            }
            continue
        windows = torch.from_numpy(stream[: n * (L + 1)].reshape(n, L + 1)).to(device)
        losses = window_losses(model, windows, eod_id=eod)  # (n, L)
        per_pos = losses.mean(0)
        starts = list(range(0, L, bucket))
        by_bucket = [float(per_pos[s : s + bucket].mean()) for s in starts]
        # Standard error of each bucket's mean over the windows (the windows are disjoint text).
        window_buckets = torch.stack([losses[:, s : s + bucket].mean(1) for s in starts], dim=1)  # (n, nb)
        se = (
            window_buckets.std(0, correction=1) / math.sqrt(n)
            if n > 1
            else torch.full((len(starts),), math.nan)
        )
        loss_se = float(losses.mean(1).std(correction=1)) / math.sqrt(n) if n > 1 else math.nan
        target_bytes = int(nbytes[np.clip(windows[:, 1:].cpu().numpy(), 0, nbytes.size - 1)].sum())
        total_nats = float(losses.sum())
        mean = float(losses.mean())
        result["lengths"][key] = {
            "multiplier": float(m),
            "windows": n,
            "loss": mean,
            "perplexity": math.exp(min(mean, 50.0)),
            "bits_per_byte": total_nats / math.log(2) / max(target_bytes, 1),
            "bytes": target_bytes,
            "bucket_start": starts,
            "loss_by_bucket": by_bucket,
            "loss_by_bucket_se": [float(x) for x in se],
            "loss_se": loss_se,
            # Loss inside the training length vs beyond it: the length-extrapolation gap in one number.
            "loss_within_train_len": float(per_pos[:seq_len].mean()),
            "loss_beyond_train_len": float(per_pos[seq_len:].mean()) if seq_len < L else None,
        }
        if evict is not None:
            policy = dataclasses.replace(evict, max_tokens=L)
            closs, frac = compressed_window_losses(model, windows, policy, prefill_chunk, eod)
            cpos = closs.mean(0)
            result["lengths"][key].update(
                {
                    "loss_compressed": float(closs.mean()),
                    "perplexity_compressed": math.exp(min(float(closs.mean()), 50.0)),
                    "loss_by_bucket_compressed": [float(cpos[s : s + bucket].mean()) for s in starts],
                    "cache_fraction": frac,
                }
            )
        log.info(
            "perplexity %s length %d (%gx): loss %.4f +- %.4f, %d windows", split, L, m, mean, loss_se, n
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = perplexity_stem(split)
    atomic_write_text(out_dir / f"{stem}.json", json.dumps(result, indent=1) + "\n")
    plot_perplexity(result, out_dir / f"{stem}.png")
    return result


def perplexity_stem(split: str) -> str:
    """File name stem of a split's perplexity outputs under the eval dir."""
    return "perplexity" if split == "validation" else f"perplexity-{split}"


def plot_perplexity(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, r in result["lengths"].items():
        if not r.get("windows"):
            continue
        centers = [s + result["bucket"] / 2 for s in r["bucket_start"]]
        (line,) = ax.plot(
            centers, r["loss_by_bucket"], marker=".", label=f"{key} tokens ({r['multiplier']:g}x)"
        )
        se = r.get("loss_by_bucket_se")
        if se and all(math.isfinite(x) for x in se):  # +- 1 standard error over the windows
            lo = [m - e for m, e in zip(r["loss_by_bucket"], se)]
            hi = [m + e for m, e in zip(r["loss_by_bucket"], se)]
            ax.fill_between(centers, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        if "loss_by_bucket_compressed" in r:
            ax.plot(
                centers,
                r["loss_by_bucket_compressed"],
                linestyle=":",
                color=line.get_color(),
                label=f"{key}, evicting cache ({r['cache_fraction']:.0%} kept)",
            )
    ax.axvline(result["seq_len"], color="gray", linestyle="--", linewidth=1, label="training length")
    ax.set_xlabel("position")
    ax.set_ylabel("loss (nats)")
    ax.set_title(f"{result.get('split', 'validation')} loss by position (band: +- 1 s.e. over windows)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
