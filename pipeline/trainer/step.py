"""One optimizer step: for each micro batch forward, loss, (agreement across ranks), backward; then the
optimizer step, or the step dropped when its loss is not finite or is a spike (pipeline.trainer.guards).

Under DeepSpeed every micro batch goes through engine.backward and engine.step; engine.step() only
updates at the accumulation boundary (the last micro batch), before that it advances a counter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline import distributed as dist_utils
from pipeline.config import RunConfig
from pipeline.trainer.batches import Batch, MicroBatch, batch_to_xy
from pipeline.trainer.deepspeed_internals import poisoned, skipped_steps
from pipeline.trainer.guards import StepPolicy, drop_step
from pipeline.trainer.loss import IGNORE_INDEX, lm_loss
from pipeline.trainer.preemption import StopFlag
from pipeline.trainer.train_state import TrainState


@dataclass(frozen=True)
class SeqParallel:
    """parallel.sequence > 1: the ranks of one group share every sequence, each holding a chunk of it."""

    group: Any
    rank: int
    degree: int
    layout: str


@dataclass(frozen=True)
class StepSetup:
    """What every step needs to know and that does not change during a run."""

    device: torch.device
    sp: SeqParallel | None
    world_size: int
    grad_accum: int
    zero_stage: int
    precision: str
    passkey_weight: float
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens (0: the plain loss over all logits)
    eod_id: int | None = None  # model.attention.document_mask: segment ids from this token (document_eod)

    @property
    def manual_norm(self) -> bool:
        """ZeRO-0 (fp32, or bf16 autocast over fp32 weights) clips without recording the norm: the step
        takes it pre-clip itself."""
        return self.zero_stage == 0


def autocast(device: torch.device, precision: str, zero_stage: int) -> contextlib.AbstractContextManager[Any]:
    """The forward's context: bf16 autocast where bf16 runs at ZeRO-0, else nothing.

    DeepSpeed's bf16 mode (ZeRO 1-3) keeps the module in bf16 with fp32 master weights in the optimizer; at
    ZeRO-0 it would sum gradients in bf16, so there the module, its gradients and the optimizer stay fp32
    and torch autocast runs the matmuls in bf16 (the loss is fp32 either way, pipeline.trainer.loss).
    """
    on = precision == "bf16" and zero_stage == 0
    return torch.autocast(device.type, dtype=torch.bfloat16) if on else contextlib.nullcontext()


@dataclass
class StepResult:
    loss: float | None  # mean language-model loss of the step (None: the step was dropped)
    passkey_loss: float | None  # mean passkey loss (None: outside the passkey phase, or dropped)
    grad_norm: float  # NaN when dropped
    stop_requested: bool  # a preemption signal reached some rank during the step
    wait: float  # seconds spent waiting for the loader


def micro_loss(
    engine: Any,
    batch: Batch,
    device: torch.device,
    sp: SeqParallel | None,
    chunk_tokens: int = 0,
    targeted_only: bool = False,
    eod_id: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Mean next-token loss of one micro batch and the number of tokens it covers.

    Under sequence parallelism the loss is the mean over the whole sequences (the same value on every rank
    of the group); grad_scale=degree undoes DeepSpeed averaging gradients over the dp x sp ranks.
    targeted_only: the LM head runs only where a target is not ignored (passkey rows: a few answer tokens
    per prompt), the same loss without vocab-wide logits for every prompt token.
    eod_id: the end-of-document token of a model with model.attention.document_mask; the model is then
    given each window's segment ids (data_prep.loader.document_segments).
    """
    docs = {}
    if eod_id is not None:  # from the whole windows (under sp every rank holds all of them)
        from data_prep.loader import document_segments

        full = batch[0] if isinstance(batch, tuple) else batch[:, :-1]
        docs = {"segment_ids": document_segments(full.long(), eod_id).to(device)}
    if sp is None:
        x, y = batch_to_xy(batch, device)
    else:
        from fpa_model.sequence_parallel import shard_batch, shard_sequence

        if isinstance(batch, tuple):  # (inputs, targets), e.g. passkey rows with ignored targets
            x, y = (shard_sequence(t.long(), sp.rank, sp.degree, dim=1, layout=sp.layout) for t in batch)
        else:
            x, y = shard_batch(batch.long(), sp.rank, sp.degree, layout=sp.layout)
        x, y = x.to(device), y.to(device)
    group, scale, n = (None, 1.0, y.numel()) if sp is None else (sp.group, sp.degree, y.numel() * sp.degree)
    keep = (y != IGNORE_INDEX) if targeted_only else None
    if keep is not None:
        y = y[keep][None]  # (1, N): the model returns the kept positions only, in the same order
    if chunk_tokens:  # the loss applies the LM head itself, chunk by chunk
        hidden = engine(x, head=False, keep=keep, **docs)
        hidden = hidden[None] if keep is not None else hidden
        head = engine.module.lm_head.weight
        return lm_loss(hidden, y, head=head, chunk_tokens=chunk_tokens, group=group, grad_scale=scale), n
    logits = engine(x, keep=keep, **docs)
    return lm_loss(logits[None] if keep is not None else logits, y, group=group, grad_scale=scale), n


def document_eod(cfg: RunConfig) -> int | None:
    """The end-of-document id segment ids are derived from under model.attention.document_mask, else None."""
    if not cfg.model.attention.document_mask:
        return None
    from data_prep.index import load_index

    return int(load_index(cfg.data_dir).eod_id)


def all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if dist_utils.world_size() == 1:
        return t
    t = t.to(device)
    torch.distributed.all_reduce(t)
    return t.cpu()


def train_step(
    engine: Any,
    state: TrainState,
    lr: float,
    micro_batches: Iterable[MicroBatch],
    setup: StepSetup,
    policy: StepPolicy,
    stop: StopFlag,
) -> StepResult:
    """Optimizer step number state.step (0-based) at learning rate lr; the model is updated unless the
    step is dropped. Does not advance state.step; updates its skipped-step counters and spike window."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    ga, world = setup.grad_accum, setup.world_size
    bad, spike_loss, lm_sum, pk_sum, stop_req, wait, in_phase = False, None, 0.0, 0.0, 0.0, 0.0, False
    for i, micro in enumerate(micro_batches):
        wait += micro.wait
        with autocast(setup.device, setup.precision, setup.zero_stage):
            loss, _ = micro_loss(
                engine, micro.lm, setup.device, setup.sp, setup.loss_chunk_tokens, eod_id=setup.eod_id
            )
        lm_value, pk_value = loss.item(), 0.0
        if micro.passkey is not None:  # the passkey phase adds answer-only rows
            in_phase = True
            with autocast(setup.device, setup.precision, setup.zero_stage):
                pk_loss, _ = micro_loss(
                    engine,
                    micro.passkey,
                    setup.device,
                    setup.sp,
                    setup.loss_chunk_tokens,
                    targeted_only=True,
                    eod_id=setup.eod_id,
                )
            pk_value = pk_loss.item()
            loss = loss + setup.passkey_weight * pk_loss
        # One collective per micro step: [finite LM loss sum, non-finite count, stop request, passkey sum].
        finite = bool(torch.isfinite(loss.detach()).item())
        flags = torch.tensor(
            [
                lm_value if finite else 0.0,
                0.0 if finite else 1.0,
                float(stop.signum is not None),
                pk_value if finite else 0.0,
            ],
            dtype=torch.float64,
        )
        flags = all_reduce_sum(flags, setup.device)
        stop_req = max(stop_req, float(flags[2]))
        if flags[1] > 0:
            bad = True  # every rank knows, whichever rank saw it
        else:
            lm_sum += float(flags[0]) / world  # sp ranks of a group hold one value
            pk_sum += float(flags[3]) / world
        last = i == ga - 1
        if last and not bad and policy.spikes.is_spike(state, lm_sum / ga):
            bad, spike_loss = True, lm_sum / ga
            # ZeRO 1-3 drop a step through DeepSpeed's non-finite-norm check: make its gradients NaN.
            loss = poisoned(loss)
        # ZeRO-0 keeps NaN out of the gradients (the step is discarded by hand); ZeRO 1-3 let it through
        # so DeepSpeed's own non-finite-norm skip drops the step and resets its buffers.
        if not bad or setup.zero_stage > 0:
            engine.backward(loss)
        if not last:
            engine.step()  # not a boundary: DeepSpeed only advances its micro-step counter

    if bad:
        policy.bad_step(state, lr, spike_loss)  # counts, records; raises under a stop policy
        drop_step(engine, state.step, setup.zero_stage, setup.precision)
        policy.check_limit(state)
        return StepResult(None, None, float("nan"), stop_req > 0, wait)

    own_norm = _grad_norm(engine) if setup.manual_norm else None
    before = skipped_steps(engine)
    engine.step()
    if skipped_steps(engine) > before:  # DeepSpeed's own overflow check (inf/NaN grad norm)
        state.skipped += 1
    grad_norm = own_norm if setup.manual_norm else engine.get_global_grad_norm()
    loss_mean = lm_sum / ga
    policy.spikes.accept(state, loss_mean)
    return StepResult(
        loss=loss_mean,
        passkey_loss=pk_sum / ga if in_phase else None,
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        stop_requested=stop_req > 0,
        wait=wait,
    )


def _grad_norm(engine: Any) -> float:
    """The global gradient norm before clipping, from the module's .grad (ZeRO-0)."""
    grads = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0
