"""The validation loss during training: the same sequences every time, whatever the number of ranks."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.config import RunConfig, resolve_precision
from pipeline.errors import TrainingError
from pipeline.trainer.batches import LoaderFactory
from pipeline.trainer.step import SeqParallel, all_reduce_sum, autocast, document_eod, micro_loss


@torch.no_grad()
def evaluate(
    engine: Any,
    cfg: RunConfig,
    make_loader: LoaderFactory,
    dp_rank: int,
    dp_world: int,
    device: torch.device,
    sp: SeqParallel | None = None,
) -> float:
    """Mean validation loss over train.val_batches global batches (the same sequences every time).

    Each rank takes val_batches * grad_accum micro batches, so the sequences covered (the first
    val_batches * global_batch of the split) do not depend on the number of ranks.
    """
    loader = make_loader(cfg, "validation", dp_rank, dp_world)
    eod_id = document_eod(cfg)
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64)
    try:
        # One pass in stored order where offered (ShardLoader.iter_once); the training state is untouched.
        it = loader.iter_once() if hasattr(loader, "iter_once") else iter(loader)
        for _ in range(cfg.train.val_batches * cfg.train.grad_accum):
            try:
                batch = next(it)
            except StopIteration:
                break
            with autocast(device, resolve_precision(cfg.train), cfg.train.zero_stage):
                loss, n = micro_loss(engine, batch, device, sp, cfg.train.loss_chunk_tokens, eod_id=eod_id)
            total += torch.tensor([loss.item() * n, n], dtype=torch.float64)
    finally:
        engine.train()
        if hasattr(loader, "close"):
            loader.close()
    total = all_reduce_sum(total, device)
    if total[1] == 0:
        raise TrainingError("the validation loader yields no batches")
    return float(total[0] / total[1])
