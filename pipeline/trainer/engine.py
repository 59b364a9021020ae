"""The model under DeepSpeed: its config (batch sizes, AdamW, ZeRO stage, precision) and the engine."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.config import Derived, RunConfig


def deepspeed_config(cfg: RunConfig, d: Derived, load_universal: bool = False) -> dict[str, Any]:
    tc = cfg.train
    ds: dict[str, Any] = {
        # DeepSpeed sees every rank as data parallel: under sequence parallelism its "batch" counts each
        # sequence once per rank of its group (the loss's grad_scale undoes the extra averaging).
        "train_batch_size": d.global_batch * d.sequence_parallel,
        "train_micro_batch_size_per_gpu": d.micro_batch,
        "gradient_accumulation_steps": d.grad_accum,
        "gradient_clipping": tc.grad_clip,
        "optimizer": {
            "type": "AdamW",
            # torch_adam: the plain torch AdamW, so nothing JIT-compiles (FusedAdam / CPUAdam would).
            "params": {
                "lr": tc.lr,
                "betas": list(tc.betas),
                "eps": tc.adam_eps,
                "weight_decay": tc.weight_decay,
                "torch_adam": True,
            },
        },
        "zero_optimization": {"stage": tc.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "checkpoint": {"load_universal": load_universal},
    }
    if d.precision == "bf16" and tc.zero_stage >= 1:  # resolved by pipeline.config
        # DeepSpeed's bf16 mode needs ZeRO >= 1 to keep fp32 master weights; ZeRO-0 bf16 is torch autocast
        # over the fp32 engine instead (pipeline.trainer.step.autocast), so nothing is set here for it.
        ds["bf16"] = {"enabled": True}
        # bf16 gradient accumulation drifts over many micro batches: accumulate in fp32.
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    return ds


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (embeddings included, as in FoX); none on norms, biases, gains."""
    from fpa_model.attention import RMSNorm

    # Norm gains by module, not by shape: per-head gains (H, Dh) are matrices but still gains.
    gains = {id(p) for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()}
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in gains else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_engine(
    cfg: RunConfig, d: Derived, model: torch.nn.Module, load_universal: bool
) -> tuple[Any, torch.device]:
    """DeepSpeed engine around model (AdamW, the ZeRO stage, precision); returns it and its device."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, cfg.train.weight_decay),
        config=deepspeed_config(cfg, d, load_universal=load_universal),
    )
    device = engine.device if isinstance(engine.device, torch.device) else torch.device(engine.device)
    return engine, device
