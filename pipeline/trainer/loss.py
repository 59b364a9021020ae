"""The language-model loss: mean next-token cross-entropy in fp32, the one used for training, validation
and anything else that needs an LM loss.

    lm_loss(logits, targets)                                  plain: (B, T, V) logits -> fp32 mean
    lm_loss(hidden, targets, head=W, chunk_tokens=4096)       chunked: the LM head is applied in here
    lm_loss(..., group=sp_group, grad_scale=degree)           sequence parallel: mean over the group

Chunked: the head matmul and the cross-entropy run over `chunk_tokens` tokens at a time, forward and
backward (the backward recomputes each chunk's logits), so at most (chunk_tokens x vocab) fp32 logits exist
at once instead of (batch x seq x vocab) of them plus their fp32 copy and gradient. Targets equal to
IGNORE_INDEX (-100, as torch's) are skipped in both forms.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def lm_loss(
    out: Tensor,
    targets: Tensor,
    *,
    head: Tensor | None = None,
    chunk_tokens: int = 0,
    group: Any = None,
    grad_scale: float = 1.0,
) -> Tensor:
    """Mean token cross-entropy of `out` against targets (B, T).

    out: logits (B, T, V), or the final hidden states (B, T, d) when `head` (the LM head weight, (V, d)) is
    given, which the loss then applies in chunks of chunk_tokens tokens. group: the sequence-parallel group
    (the loss is then the mean over the whole sequences, the same on every rank of it; see
    sequence_parallel_cross_entropy for grad_scale).
    """
    if head is None:
        if group is not None:
            from pipeline.trainer.sequence_parallel import sequence_parallel_cross_entropy

            return sequence_parallel_cross_entropy(out, targets, group, grad_scale=grad_scale)
        return F.cross_entropy(out.float().flatten(0, 1), targets.flatten())
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 with a head; got {chunk_tokens}")
    y = targets.flatten()
    loss_sum = _ChunkedHeadCrossEntropy.apply(out.flatten(0, 1), head, y, chunk_tokens)
    count = (y != IGNORE_INDEX).sum().to(loss_sum.dtype)
    if group is not None:
        loss_sum, count = _sum_over_group(loss_sum, count, group)
    loss = loss_sum / count.clamp_min(1)
    if grad_scale != 1.0:  # same value, gradient scaled (as sequence_parallel_cross_entropy does)
        loss = loss * grad_scale - (loss * (grad_scale - 1.0)).detach()
    return loss


def _sum_over_group(loss_sum: Tensor, count: Tensor, group: Any) -> tuple[Tensor, Tensor]:
    """Group totals; the gradient of the total w.r.t. this rank's sum is 1 (its own share)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return loss_sum, count
    total = loss_sum.detach().clone()
    dist.all_reduce(total, group=group)
    count = count.clone()
    dist.all_reduce(count, group=group)
    # x - x.detach() is exactly 0 with gradient 1: the value is the total itself, the same on every rank.
    return (loss_sum - loss_sum.detach()) + total, count


def _acc_dtype(t: Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs (the loss's precision), fp64 kept (tests compare in it)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i @ head^T, y_i) over tokens, computed chunk by chunk; logits recomputed in backward.

    Logits are made in the hidden states' dtype (like the head's F.linear) and upcast to fp32 per chunk,
    as the plain loss upcasts them all; the sum and the head's gradient accumulate in fp32.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, head: Tensor, y: Tensor, chunk: int) -> Tensor:
        acc = _acc_dtype(hidden)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for i in range(0, hidden.shape[0], chunk):
            logits = (hidden[i : i + chunk] @ head.t()).to(acc)
            total += F.cross_entropy(logits, y[i : i + chunk], ignore_index=IGNORE_INDEX, reduction="sum")
        ctx.save_for_backward(hidden, head, y)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        hidden, head, y = ctx.saved_tensors
        d_hidden = torch.empty_like(hidden)
        acc = _acc_dtype(hidden)
        d_head = torch.zeros(head.shape, dtype=acc, device=head.device)
        for i in range(0, hidden.shape[0], ctx.chunk):
            h, t = hidden[i : i + ctx.chunk], y[i : i + ctx.chunk]
            # d CE_sum / d logits = softmax - onehot(target), zero on ignored rows.
            g = torch.softmax((h @ head.t()).to(acc), dim=-1)
            keep = t != IGNORE_INDEX
            rows = torch.arange(len(t), device=t.device)[keep]
            g[rows, t[keep]] -= 1.0
            g[~keep] = 0.0
            g = g.mul_(grad).to(hidden.dtype)  # in place: one chunk of logits at a time
            d_hidden[i : i + ctx.chunk] = g @ head
            d_head += (g.t() @ h).to(acc)
        return d_hidden, d_head.to(head.dtype), None, None
