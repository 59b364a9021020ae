"""Long-context task grids (eval.long_context): for each task of data_prep/long_context.py (multikey-K,
multivalue-N, overwrite-N, vartrack-N, passkey), accuracy by length (multiples of the training length) x
needle depth, with the full KV cache and with FPA/FoX eviction. The cells run through the passkey grid's
machinery (pipeline/evaluation/passkey.py: run_grid, decode_answers, the same eviction policy), so the
passkey task here gives the passkey grid's prompts and answers exactly.

Outputs under the eval dir: long_context.json ({"tasks": {task id: grid}}, every prompt's expected and
generated answer) and long_context-<task id>.png (heatmaps per cache mode).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from data_prep import long_context as tasks
from data_prep.passkey import TokenizerLike
from fpa_model.cache import EvictionPolicy
from pipeline.atomic import atomic_write_text
from pipeline.config import CacheConfig, LongContextConfig, PasskeyConfig
from pipeline.evaluation.passkey import decode_answers, grid_modes, passkey_lengths, plot_passkey, run_grid


def resolved(lc: LongContextConfig, pk: PasskeyConfig) -> dict[str, Any]:
    """The grid settings: eval.long_context's, falling back to eval.passkey's where they are null."""
    return {
        "length_multipliers": [float(m) for m in lc.length_multipliers or pk.length_multipliers],
        "depths": [float(d) for d in lc.depths or pk.depths],
        "trials": lc.trials or pk.trials,
        "digits": lc.digits or pk.digits,
        "seed": lc.seed,
    }


def cell_rng(seed: int, spec: tasks.TaskSpec, length: int, depth: float) -> random.Random:
    # Prompts depend on the cell only (both cache modes and every run see the same ones); the passkey's
    # string is the passkey grid's, so its keys are the same.
    if spec.name == "passkey":
        return random.Random(f"{seed}:{length}:{depth:.6f}")
    return random.Random(f"{seed}:{spec.id}:{length}:{depth:.6f}")


def run_task_cell(
    model: torch.nn.Module,
    tokenizer: TokenizerLike,
    spec: tasks.TaskSpec,
    *,
    length: int,
    depth: float,
    trials: int,
    digits: int,
    seed: int,
    policy: EvictionPolicy,
    chunk_size: int | None,
    prefix_ids: list[int],
    device: torch.device,
    eod_id: int | None = None,
) -> dict[str, Any]:
    """One (task, length, depth, mode) cell: `trials` prompts of `length` tokens with their answers.
    eod_id: the end-of-document token, required by a model.attention.document_mask model (each prompt
    is one document after the prefix)."""
    from pipeline.evaluation.perplexity import document_eod

    eod = document_eod(model, eod_id, "long-context")
    budget = tasks.answer_budget(spec, digits)
    rng = cell_rng(seed, spec, length, depth)
    prompts = [
        tasks.task_prompt(tokenizer, spec, length - budget, depth, rng, digits=digits, prefix_ids=prefix_ids)
        for _ in range(trials)
    ]
    if eod is not None and any(eod in p.ids[len(prefix_ids) :] for p in prompts):
        raise ValueError(f"a {spec.id} prompt holds the end-of-document token {eod}: it must be one document")
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
    correct = [tasks.is_correct(p, a) for p, a in zip(prompts, answers)]
    return {
        "length": length,
        "depth": depth,
        "needle_depth_tokens": [p.needle_start for p in prompts],
        "expected": [list(p.answer) for p in prompts],
        "answers": answers,
        "correct": sum(correct),
        "trials": trials,
        "accuracy": sum(correct) / trials,
        **kept,
    }


def taught_task(train_task: str | None) -> str | None:
    """The id of the task the training phase taught (train.passkey with steps), else None."""
    return tasks.parse_task(train_task, "train.passkey.task").id if train_task else None


def run_long_context(
    model: torch.nn.Module,
    tokenizer: TokenizerLike,
    *,
    seq_len: int,
    lc: LongContextConfig,
    pk: PasskeyConfig,
    cache_cfg: CacheConfig,
    out_dir: Path,
    prefix_ids: list[int] | None = None,
    taught: str | None = None,
    logger: Any = None,
    device: torch.device | None = None,
    eod_id: int | None = None,
) -> dict[str, Any]:
    """Every task's grid. taught: the task id the training phase taught (None: none). Writes
    long_context.json and a heatmap per task, logs a W&B table per task, returns the JSON content."""
    device = device or next(model.parameters()).device
    tasks.check_digits(tokenizer)
    s = resolved(lc, pk)
    lengths = passkey_lengths(seq_len, s["length_multipliers"])
    modes = grid_modes(model, cache_cfg)
    result: dict[str, Any] = {
        "seq_len": seq_len,
        "multipliers": s["length_multipliers"],
        "lengths": lengths,
        "depths": s["depths"],
        "trials": s["trials"],
        "digits": s["digits"],
        "seed": s["seed"],
        "taught": taught,
        "cache": {
            "delta": cache_cfg.delta,
            "margin": cache_cfg.margin,
            "norm_slack": cache_cfg.norm_slack,
            "prefill_chunk": cache_cfg.prefill_chunk,
        },
        "tasks": {},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    for text in lc.tasks:
        spec = tasks.parse_task(text)
        t0 = time.time()

        def cell(
            length: int, depth: float, policy: EvictionPolicy, chunk: int | None, spec: tasks.TaskSpec = spec
        ) -> dict[str, Any]:
            return run_task_cell(
                model,
                tokenizer,
                spec,
                length=length,
                depth=depth,
                trials=s["trials"],
                digits=s["digits"],
                seed=s["seed"],
                policy=policy,
                chunk_size=chunk,
                prefix_ids=list(prefix_ids or []),
                device=device,
                eod_id=eod_id,
            )

        by_mode, rows = run_grid(cell, lengths, s["depths"], modes, cache_cfg, seq_len=seq_len, name=spec.id)
        task = {"task": spec.name, "size": spec.size, "taught": spec.id == taught, "modes": by_mode}
        task["seconds"] = round(time.time() - t0, 2)
        result["tasks"][spec.id] = task
        plot_passkey(
            {**result, "modes": by_mode},
            out_dir / f"long_context-{spec.id}.png",
            title=f"{spec.id} ({'taught' if task['taught'] else 'not taught'})",
        )
        if logger is not None:
            logger.log_table(
                f"eval/long_context/{spec.id}",
                ["mode", "length", "multiplier", "depth", "accuracy", "cache_fraction", "trials"],
                rows,
            )
    atomic_write_text(out_dir / "long_context.json", json.dumps(result, indent=1) + "\n")
    return result


def report_section(result: dict[str, Any] | None) -> dict[str, Any] | None:
    """report.json's "long_context": {task id: {"task", "size", "taught", "trials", "digits", "accuracy",
    "accuracy_per_length", "accuracy_compressed", "accuracy_compressed_per_length", "cache_fraction",
    "grid": {"lengths", "depths", "full", "compressed"}}}; None when no task ran."""
    if not result or not result.get("tasks"):
        return None
    out: dict[str, Any] = {}
    for tid, t in result["tasks"].items():
        full, comp = t["modes"].get("full"), t["modes"].get("compressed")
        out[tid] = {
            "task": t["task"],
            "size": t["size"],
            "taught": t["taught"],
            "trials": result["trials"],
            "digits": result["digits"],
            "accuracy": full["accuracy"] if full else None,
            "accuracy_per_length": full["accuracy_per_length"] if full else None,
            "accuracy_compressed": comp["accuracy"] if comp else None,
            "accuracy_compressed_per_length": comp["accuracy_per_length"] if comp else None,
            "cache_fraction": comp["cache_fraction"] if comp else None,
            "grid": {
                "lengths": result["lengths"],
                "depths": result["depths"],
                "full": full["grid"] if full else None,
                "compressed": comp["grid"] if comp else None,
            },
        }
    return out


# -- lm-evaluation-harness ------------------------------------------------------------------------------
# The same prompts as lm-eval tasks over local files: one jsonl of documents and one task YAML per task,
# and utils.py, whose process_results scores with data_prep.long_context (the same exact match).

HARNESS_UTILS = '''"""Scoring of the fpa long-context tasks (written by fpa eval): exact match."""

from data_prep.long_context import parse_items, parse_task


def process_results(doc, results):
    expected = tuple(doc["expected"])
    return {"acc": float(parse_items(parse_task(doc["task"]), results[0], len(expected)) == expected)}
'''


def harness_task_name(task_id: str) -> str:
    """The lm-eval task name of a long-context task: fpa_multikey_4, fpa_passkey, ..."""
    return "fpa_" + task_id.replace("-", "_")


def harness_documents(
    tokenizer: TokenizerLike,
    spec: tasks.TaskSpec,
    settings: dict[str, Any],
    lengths: list[int],
    prefix_ids: list[int],
) -> list[dict[str, Any]]:
    """The grid's prompts (every length, depth and trial, in cell order) as text documents. The text
    encodes back to exactly the grid's token ids (checked), end-of-document token included."""
    digits, budget = settings["digits"], tasks.answer_budget(spec, settings["digits"])
    docs = []
    for L in lengths:
        for d in settings["depths"]:
            rng = cell_rng(settings["seed"], spec, L, d)
            for trial in range(settings["trials"]):
                p = tasks.task_prompt(
                    tokenizer, spec, L - budget, d, rng, digits=digits, prefix_ids=prefix_ids
                )
                text = tokenizer.decode(p.ids, skip_special_tokens=False)  # type: ignore[call-arg]
                if tasks.encode(tokenizer, text) != p.ids:
                    raise tasks.TaskError(
                        f"task {spec.id}: the prompt at length {L}, depth {d}, trial {trial} does not encode "
                        "back to the same tokens as text, so lm-eval would read another prompt"
                    )
                docs.append(
                    {
                        "task": spec.id,
                        "length": L,
                        "depth": d,
                        "prompt": text,
                        "expected": list(p.answer),
                        "answer": p.instance.answer_text,
                    }
                )
    return docs


def write_harness_tasks(
    tokenizer: TokenizerLike,
    *,
    seq_len: int,
    lc: LongContextConfig,
    pk: PasskeyConfig,
    eod_token: str,
    prefix_ids: list[int],
    out_dir: Path,
) -> list[str]:
    """A folder of lm-eval tasks, one per eval.long_context task, for `lm_eval --include_path out_dir`;
    returns their names. Generation: greedy, the grid's answer budget, stopped at the end-of-document
    token (the grid decodes the whole budget: an answer after an end-of-document token counts only there)."""
    s = resolved(lc, pk)
    lengths = passkey_lengths(seq_len, s["length_multipliers"])
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for text in lc.tasks:
        spec = tasks.parse_task(text)
        name = harness_task_name(spec.id)
        docs = harness_documents(tokenizer, spec, s, lengths, prefix_ids)
        data = (out_dir / f"{name}.jsonl").resolve()
        atomic_write_text(data, "".join(json.dumps(doc) + "\n" for doc in docs))
        stop = json.dumps(eod_token)
        cells = f"{len(docs)} prompts, {s['trials']} per length x depth cell"
        yaml = f"""# fpa long-context task {spec.id}: {cells}
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: [{stop}]
  max_gen_toks: {tasks.answer_budget(spec, s["digits"])}
  do_sample: false
process_results: !function utils.process_results
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
        atomic_write_text(out_dir / f"{name}.yaml", yaml)
        names.append(name)
    atomic_write_text(out_dir / "utils.py", HARNESS_UTILS)
    return names
