"""Sequence parallelism on the training side: the process groups and the loss over a split sequence.

The attention math across ranks (the ring, Ulysses, how a sequence is cut into chunks) lives in
fpa_model.sequence_parallel; a model attends across a group once it is given a
fpa_model.sequence_parallel.SequenceParallel (GPT.set_sequence_parallel). This module holds what only a
trainer needs: carving the world into data-parallel x sequence-parallel groups, and the mean token loss
over the whole sequences of a group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def make_groups(sequence_degree: int) -> tuple[Any, Any, int, int, int]:
    """Split the default world into data-parallel x sequence-parallel groups.

    Ranks of one sequence-parallel group are consecutive (global rank = dp_rank * sp + sp_rank), so on a
    multi-GPU node the ring stays on the node. Every rank must call this (new_group is collective).
    Returns (dp_group, sp_group, dp_rank, dp_world, sp_rank); dp_group holds the ranks with the same
    sp_rank (the ones that average gradients), sp_group the ranks sharing one sequence.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("make_groups needs torch.distributed to be initialized first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if sequence_degree < 1 or world % sequence_degree:
        raise ValueError(
            f"parallel.sequence={sequence_degree} must be >= 1 and divide the world size {world}"
        )
    sp, dp = sequence_degree, world // sequence_degree
    dp_group = sp_group = None
    # Every rank creates every group, in the same order (a collective requirement of new_group).
    for d in range(dp):
        g = dist.new_group([d * sp + s for s in range(sp)])
        if rank // sp == d:
            sp_group = g
    for s in range(sp):
        g = dist.new_group([d * sp + s for d in range(dp)])
        if rank % sp == s:
            dp_group = g
    return dp_group, sp_group, rank // sp, dp, rank % sp


class _SumOverGroup(torch.autograd.Function):
    """Forward: all-reduce sum. Backward: identity, so each rank's gradient is its own share of d(sum)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        y = x.detach().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g, None


def sequence_parallel_cross_entropy(
    logits: Tensor, targets: Tensor, group: Any, *, ignore_index: int = -100, grad_scale: float = 1.0
) -> Tensor:
    """Mean token cross-entropy over the whole sequence-parallel group, from this rank's logits/targets.

    The value is the same on every rank of the group (the single-process loss of the full sequences).
    The backward gives every rank the gradient of that global mean w.r.t. its own logits, so summing
    parameter gradients over the group gives the single-process gradient. An engine that AVERAGES
    gradients over all dp x sp ranks (DeepSpeed with the whole world as its data-parallel group) needs
    grad_scale = sp degree to get the single-process gradient times 1/dp, i.e. the usual dp average.
    """
    lf = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()  # bf16 -> fp32
    loss_sum = F.cross_entropy(
        lf.reshape(-1, lf.shape[-1]),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    count = (targets != ignore_index).sum().to(loss_sum.dtype)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        total_sum, total_count = loss_sum, count
    else:
        total_sum = _SumOverGroup.apply(loss_sum, group)
        total_count = count.clone()
        dist.all_reduce(total_count, group=group)
    loss = total_sum / total_count.clamp_min(1)
    if grad_scale != 1.0:
        # Same value, gradient scaled: keeps logged losses comparable across sp degrees.
        loss = loss * grad_scale - (loss * (grad_scale - 1.0)).detach()
    return loss
