"""Evaluation of a trained run: passkey retrieval to 8x the training length with and without KV-cache
eviction, validation loss by position beyond the training length, bits per byte, and the run's report.

    evaluate(cfg, checkpoint=None) -> summary dict

writes <run_dir>/eval/{passkey.json, passkey.png, perplexity.json, perplexity.png, report.json,
report.md}; with eval.harness.tasks, lm-evaluation-harness scores too (pipeline/evaluation/harness.py); with
eval.long_context.tasks, a grid per long-context task (pipeline/evaluation/long_context.py). The
weights come from `checkpoint` (an export directory holding model.safetensors), else cfg.eval.checkpoint,
else <run_dir>/export.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from data_prep.index import load_index
from data_prep.prepare import source_summary
from data_prep.tokenizer import load_tokenizer
from fpa_model.cache import EvictionPolicy
from pipeline.config import ConfigError, RunConfig
from pipeline.evaluation.long_context import (
    report_section,
    run_long_context,
    taught_task,
    write_harness_tasks,
)
from pipeline.evaluation.passkey import run_passkey
from pipeline.evaluation.perplexity import run_perplexity
from pipeline.evaluation.report import REPORT_KEYS, build_report, compare_reports, load_report, write_report
from pipeline.export import load_exported
from pipeline.logging import make_logger
from pipeline.rundir import RunDir
from pipeline.upstream import weights_of

log = logging.getLogger("fpa")

__all__ = ["REPORT_KEYS", "EvalError", "compare_reports", "evaluate", "load_report", "resolve_weights"]


class EvalError(ConfigError):
    """An evaluation input problem (missing weights, mismatched data); the CLI reports it as one line."""


def resolve_weights(cfg: RunConfig, checkpoint: Path | None = None) -> Path:
    """The export directory to evaluate: the argument, cfg.eval.checkpoint, or <run_dir>/export."""
    path = Path(checkpoint) if checkpoint else Path(cfg.eval.checkpoint) if cfg.eval.checkpoint else None
    path = path or cfg.run_dir / "export"
    if path.is_file() and path.suffix == ".safetensors":
        path = path.parent
    if not (path / "model.safetensors").is_file():
        raise EvalError(
            f"no exported weights at {path / 'model.safetensors'} (eval.checkpoint or --checkpoint must name "
            f"an export directory; `fpa export` makes one from a training checkpoint)"
        )
    return path


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EvalError(f"eval.device={name!r} but CUDA is not available")
    return dev


def _train_result(cfg: RunConfig) -> dict[str, Any]:
    """The training stage's result from its manifest ({} when there is none or it is unreadable)."""
    manifest = RunDir(cfg).read_manifest("train")  # warns and returns None on an unreadable manifest
    result = getattr(manifest, "result", None)
    return result if isinstance(result, dict) else {}


def _float_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def evaluate(cfg: RunConfig, *, checkpoint: Path | None = None, logger: Any = None) -> dict[str, Any]:
    """Run the passkey grid and the perplexity sweep on the exported weights, write the report.

    logger: a pipeline.logging.RunLogger; the passkey grid goes to it as a table (W&B) and the headline
    figures as a summary. None: a rank-0 logger per cfg.logging that continues the training's W&B run
    (its id is in the training manifest), closed at the end. Returns the headline figures (the report
    minus the grids and curves).
    """
    train_result = _train_result(cfg)
    own_logger = logger is None
    if own_logger:
        logger = make_logger(cfg, 0, train_result.get("wandb_run_id"))
    try:
        return _evaluate(cfg, checkpoint, logger, train_result)
    finally:
        if own_logger:
            logger.finish()


def passkey_digits_mismatch(cfg: RunConfig) -> str | None:
    """A warning when the grid asks for keys of another length than the passkey phase trained on."""
    pk, grid = cfg.train.passkey, cfg.eval.passkey
    if not pk.steps or not grid.enabled or pk.digits == grid.digits:
        return None
    return (
        f"eval.passkey.digits={grid.digits} but the model was trained on {pk.digits}-digit keys "
        f"(train.passkey.digits): the grid measures retrieval of keys it was not taught"
    )


def _passkey_training(cfg: RunConfig) -> dict[str, Any] | None:
    pk = cfg.train.passkey
    if not pk.steps:
        return None
    batch = pk.batch or cfg.train.micro_batch
    out = {"steps": pk.steps, "batch": batch, "weight": pk.weight, "digits": pk.digits}
    if pk.task != "passkey":  # a passkey phase's report keeps the keys it always had
        out["task"] = taught_task(pk.task)
    return out


def _evaluate(
    cfg: RunConfig, checkpoint: Path | None, logger: Any, train_result: dict[str, Any]
) -> dict[str, Any]:
    t0 = time.time()
    weights = resolve_weights(cfg, checkpoint)
    device = pick_device(cfg.eval.device)
    model = load_exported(weights).to(device).eval()
    tokenizer = load_tokenizer(cfg.data_dir)
    index = load_index(cfg.data_dir)
    if model.cfg.vocab_size != index.vocab_size:
        raise EvalError(
            f"{weights}: model vocab size {model.cfg.vocab_size} differs from the data's {index.vocab_size} "
            f"({cfg.data_dir}/index.json): the weights were trained on other data"
        )
    seq_len = index.seq_len
    out_dir = cfg.run_dir / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)

    passkey = None
    if (warning := passkey_digits_mismatch(cfg)) is not None:
        log.warning(warning)
    if cfg.eval.passkey.enabled:
        passkey = run_passkey(
            model,
            tokenizer,
            seq_len=seq_len,
            pk=cfg.eval.passkey,
            cache_cfg=cfg.eval.cache,
            out_dir=out_dir,
            prefix_ids=[index.eod_id],  # documents in the training stream start right after an EOD
            logger=logger,
            device=device,
            eod_id=index.eod_id,  # document_mask models: the prompt is one document after the prefix
        )
    long_context = None
    if cfg.eval.long_context.tasks:
        long_context = run_long_context(
            model,
            tokenizer,
            seq_len=seq_len,
            lc=cfg.eval.long_context,
            pk=cfg.eval.passkey,
            cache_cfg=cfg.eval.cache,
            out_dir=out_dir,
            prefix_ids=[index.eod_id],
            taught=taught_task(cfg.train.passkey.task) if cfg.train.passkey.steps else None,
            logger=logger,
            device=device,
            eod_id=index.eod_id,  # document_mask models: each prompt is one document after the prefix
        )
        # The same prompts as lm-eval tasks (eval.harness.include_path may name this folder).
        write_harness_tasks(
            tokenizer,
            seq_len=seq_len,
            lc=cfg.eval.long_context,
            pk=cfg.eval.passkey,
            eod_token=tokenizer.id_to_token(index.eod_id),
            prefix_ids=[index.eod_id],
            out_dir=out_dir / "lm_eval",
        )
    # Every held-out split is read the same way; the evicting cache is measured on "validation" alone.
    ppl_args = {
        "data_dir": cfg.data_dir,
        "seq_len": seq_len,
        "multipliers": list(cfg.eval.ppl_length_multipliers),
        "bucket": cfg.eval.ppl_bucket,
        "sequences": cfg.eval.ppl_sequences,
        "out_dir": out_dir,
        "device": device,
        "eod_id": index.eod_id,  # document_mask models: each window's segment ids
    }
    ppl = run_perplexity(
        model,
        tokenizer,
        **ppl_args,
        evict=EvictionPolicy(
            enabled=cfg.eval.cache.evict,
            delta=cfg.eval.cache.delta,
            margin=cfg.eval.cache.margin,
            norm_slack=cfg.eval.cache.norm_slack,
        ),
        prefill_chunk=cfg.eval.cache.prefill_chunk,
    )
    heldout = {"validation": ppl}
    for split in index.splits:
        if split not in ("train", "validation"):  # data.extra_validation
            heldout[split] = run_perplexity(model, tokenizer, **ppl_args, split=split)
    harness = None
    if cfg.eval.harness.tasks:
        # lm-eval + transformers (the hf extra): imported only when asked
        from pipeline.evaluation.harness import run_harness

        harness = run_harness(model, tokenizer, index.eod_id, cfg.eval.harness, device=device, seed=cfg.seed)
    attn = model.cfg.attention
    report = build_report(
        run=cfg.name,
        kind=attn.kind,
        field=attn.field,
        seq_len=seq_len,
        n_params=model.num_parameters(),
        checkpoint=str(weights),
        train_val_loss=_float_or_none(train_result.get("val_loss")),
        passkey=passkey,
        ppl=ppl,
        passkey_mix=cfg.data.passkey_mix,
        passkey_training=_passkey_training(cfg),
        heldout=heldout,
        harness=harness,
        data_sources=source_summary(index.mixture.get("train", [])),
        long_context=report_section(long_context),
        weights_of=weights_of(cfg, weights, explicit=bool(checkpoint or cfg.eval.checkpoint)),
    )
    write_report(report, out_dir)
    headline = {
        k: report[k]
        for k in (
            "kind",
            "field",
            "final_val_loss",
            "passkey_accuracy",
            "passkey_accuracy_compressed",
            "cache_fraction",
            "perplexity",
            "bits_per_byte",
            "harness",
        )
    }
    if report["long_context"]:  # only when asked for: today's headline stays as it was
        headline["long_context"] = {k: t["accuracy"] for k, t in report["long_context"].items()}
    headline["seconds"] = round(time.time() - t0, 1)
    if logger is not None:
        summary = {
            f"eval/{k}": v for k, v in headline.items() if isinstance(v, int | float) and v is not None
        }
        for name, src in (report["data_sources"] or {}).items():  # per mixture source
            summary[f"data/{name}/tokens"] = src["tokens"]
        for task, metrics in ((harness or {}).get("tasks") or {}).items():
            summary.update({f"eval/harness/{task}/{m}": v for m, v in metrics.items()})
        for task, t in (report["long_context"] or {}).items():
            for m in ("accuracy", "accuracy_compressed", "cache_fraction"):
                if t[m] is not None:
                    summary[f"eval/long_context/{task}/{m}"] = t[m]
        logger.summary(summary)
    log.info("eval report: %s", out_dir / "report.md")
    return headline
