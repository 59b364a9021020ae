"""A trained run loaded for a probe (its exported weights, tokenizer and passkey grid) and the passkey grid
evaluated on it, per length: shared by experiments/cache_bound.py and experiments/passkey_sharpness.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data_prep.index import DataIndex, load_index
from data_prep.tokenizer import load_tokenizer
from fpa_model.cache import EvictionPolicy
from fpa_model.model import GPT
from pipeline.config import RunConfig, load_config
from pipeline.evaluation.passkey import _cell_keys, passkey_lengths, run_cell
from pipeline.export import load_exported
from pipeline.rundir import stage_commit


@dataclass
class TrainedRun:
    path: Path  # as given on the command line
    cfg: RunConfig
    model: GPT
    tokenizer: Any
    index: DataIndex
    lengths: list[int]
    depths: list[float]
    commit: str | None  # the commit the model was trained at (its train manifest)


def load_trained_run(run: Path) -> TrainedRun:
    """The run's config, exported model (eval mode, CPU), tokenizer and passkey lengths/depths."""
    full = run.resolve()
    if not (full / "config.yaml").is_file() or not (full / "export" / "model.safetensors").is_file():
        raise SystemExit(f"{run} is not a trained run (needs config.yaml and export/model.safetensors)")
    cfg = load_config([full / "config.yaml"], [f"runs_dir={full.parent}", f"name={full.name}"])
    index = load_index(cfg.data_dir)
    pk = cfg.eval.passkey
    return TrainedRun(
        path=run,
        cfg=cfg,
        model=load_exported(full / "export").eval(),
        tokenizer=load_tokenizer(cfg.data_dir),
        index=index,
        lengths=passkey_lengths(index.seq_len, list(pk.length_multipliers)),
        depths=[float(d) for d in pk.depths],
        commit=stage_commit(full, "train"),
    )


def passkey_by_length(
    tr: TrainedRun, *, trials: int, policy_for: Callable[[int], EvictionPolicy]
) -> dict[str, dict[str, Any]]:
    """{length: accuracy, kept (cache fraction), kept_per_layer} over the run's depths, `trials` keys each
    (the eval's keys), with policy_for(length) as the cache policy (prefill in eval.cache.prefill_chunk
    chunks when it evicts, one pass otherwise)."""
    pk, cc = tr.cfg.eval.passkey, tr.cfg.eval.cache
    out = {}
    for length in tr.lengths:
        policy = policy_for(length)
        cells = [
            run_cell(
                tr.model,
                tr.tokenizer,
                length=length,
                depth=d,
                keys=_cell_keys(pk.seed, length, d, trials, pk.digits),
                digits=pk.digits,
                policy=policy,
                chunk_size=cc.prefill_chunk if policy.enabled else None,
                prefix_ids=[tr.index.eod_id],
                device=torch.device("cpu"),
                eod_id=tr.index.eod_id,  # document_mask models only
            )
            for d in tr.depths
        ]
        out[str(length)] = {
            "accuracy": sum(c["correct"] for c in cells) / sum(c["trials"] for c in cells),
            "kept": sum(c["cache_fraction"] for c in cells) / len(cells),
            "kept_per_layer": [
                sum(c["cache_fraction_per_layer"][i] for c in cells) / len(cells)
                for i in range(len(cells[0]["cache_fraction_per_layer"]))
            ],
        }
    return out
