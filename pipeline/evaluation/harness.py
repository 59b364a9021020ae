"""lm-evaluation-harness on the exported model, for `fpa eval` (the `eval.harness` config section).

The model goes to lm-eval as the transformers model that `fpa export --format hf` ships
(pipeline.hf.modeling_fpa.FPAForCausalLM around the same weights, built in memory) with the run's tokenizer
as a fast tokenizer, through lm-eval's Python API (`lm_eval.simple_evaluate` with an HFLM wrapping the
model object). Standard tasks download their data sets from the hub; `eval.harness.include_path` names a
folder of task YAMLs for local tasks (e.g. `dataset_path: json` over a local file), which run offline.

Scores come back as {task: {metric: value}} (lm-eval's "acc,none" keys become "acc"; standard errors are
kept as "<metric>_stderr").
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pipeline.config import ConfigError, HarnessConfig

log = logging.getLogger("fpa")


class HarnessError(ConfigError):
    """lm-eval missing or a task it cannot run, reported as one line."""


def _metric_name(key: str) -> str:
    # lm-eval keys are "<metric>,<filter>"; the default filter "none" is dropped.
    metric, _, filt = key.partition(",")
    return metric if filt in ("", "none") else f"{metric}[{filt}]"


def scores_from_results(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of the numeric entries in lm-eval's results["results"]."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results.get("results", {}).items():
        vals = {
            _metric_name(k): float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k != "samples"
        }
        if vals:
            out[task] = vals
    return out


def _task_manager(task_manager: Any, hcfg: HarnessConfig) -> Any:
    """lm-eval's TaskManager: the include_path tasks alone when they are all that is asked for (indexing
    lm-eval's own thousands of task YAMLs takes seconds), else those and lm-eval's."""
    if hcfg.include_path:
        local = task_manager(include_path=hcfg.include_path, include_defaults=False)
        if all(local.match_tasks([t]) for t in hcfg.tasks):
            return local
        return task_manager(include_path=hcfg.include_path)
    return task_manager()


def run_harness(
    model: torch.nn.Module,
    tokenizer: Any,
    eod_id: int,
    hcfg: HarnessConfig,
    *,
    device: torch.device | str = "cpu",
    seed: int = 1234,
) -> dict[str, Any]:
    """Run hcfg.tasks on a GPT (fpa_model.model.GPT) with a `tokenizers.Tokenizer`.

    Returns {"tasks": {task: {metric: value}}, "num_fewshot", "limit", "lm_eval_version"}.
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise HarnessError(
            f"eval.harness needs lm-eval and transformers (pip install -e '.[hf]'): {e}"
        ) from None
    from pipeline.export import hf_model, hf_tokenizer

    hf = hf_model(model, eos_id=eod_id).to(device)
    tok = hf_tokenizer(tokenizer, eod_id, model.cfg.max_seq_len)
    lm = HFLM(pretrained=hf, tokenizer=tok, batch_size=hcfg.batch_size, max_length=model.cfg.max_seq_len)
    manager = _task_manager(TaskManager, hcfg)
    unknown = [t for t in hcfg.tasks if not manager.match_tasks([t])]
    if unknown:
        where = f" or in {hcfg.include_path}" if hcfg.include_path else ""
        raise HarnessError(f"eval.harness.tasks: lm-eval knows no task {unknown}{where}")
    limit = hcfg.limit
    if limit is not None and limit >= 1:
        limit = int(limit)  # a count of documents (lm-eval reads a float < 1 as a fraction)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(hcfg.tasks),
        num_fewshot=hcfg.num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=False,
        bootstrap_iters=0,  # no stderr bootstrap: seconds of CPU for a figure the report does not show
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    if results is None:  # lm-eval returns None on non-zero ranks
        return {}
    return {
        "tasks": scores_from_results(results),
        "num_fewshot": hcfg.num_fewshot,
        "limit": limit,
        "lm_eval_version": getattr(lm_eval, "__version__", None),
    }
