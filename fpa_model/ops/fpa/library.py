"""The attention op as torch.library custom ops, so that torch.compile (train.compile) keeps it whole.

Traced by dynamo, the chunked path's data-dependent branches and the Triton launches would break the
compiled graph into pieces around every attention call. Registered as `fpa::attention` (forward: out and
the row log-sum-exp) and `fpa::attention_backward`, with fake (meta) implementations that give the output
shapes from the input shapes, the op is one opaque node: the norms, rotary, gates and MLP around it compile
into the block's graph. Eager calls never come here (fpa_model.ops.fpa.fpa_attention dispatches to this
module only while compiling), so eager results stay bit for bit what they were.

    out = attention(q, k, v, phi, kind="fpa", scale=None, block_size=64, segment_ids=None, impl="chunked")
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fpa_model.ops.fpa.chunked import chunked_backward, chunked_forward, lse_dtype, lse_shape
from fpa_model.ops.fpa.kinds import resolve_kind
from fpa_model.ops.fpa.segments import check_segment_ids

LIBRARY_IMPLS = ("chunked", "triton")


def _scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


@torch.library.custom_op("fpa::attention", mutates_args=())
def attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    phi: Tensor | None,
    segment_ids: Tensor | None,
    kind: str,
    scale: float,
    block_size: int,
    impl: str,
    skip_epsilon: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse): the chunked path's (lse block-major) or the Triton kernel's (lse (B, H, T))."""
    if impl == "chunked":
        seg = None if segment_ids is None else check_segment_ids(segment_ids, k)
        out, lse = chunked_forward(q, k, v, phi, resolve_kind(kind), scale, block_size, seg, skip_epsilon)
    else:
        from fpa_model.ops.fpa.triton_kernel import triton_forward

        out, lse = triton_forward(q, k, v, phi, kind, scale, segment_ids, skip_epsilon)
    return out.contiguous(), lse.contiguous()  # the layouts the fake promises


@attention_fwd.register_fake
def _(q, k, v, phi, segment_ids, kind, scale, block_size, impl, skip_epsilon=None):  # noqa: ANN001, ANN202
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if impl == "chunked":
        return out, q.new_empty(lse_shape(q, k, block_size), dtype=lse_dtype(q))
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fpa::attention_backward", mutates_args=())
def attention_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    phi: Tensor | None,
    segment_ids: Tensor | None,
    out: Tensor,
    lse: Tensor,
    kind: str,
    scale: float,
    block_size: int,
    impl: str,
    skip_epsilon: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dphi); dphi is an empty tensor when there is no field (custom ops return tensors)."""
    if impl == "chunked":
        seg = None if segment_ids is None else check_segment_ids(segment_ids, k)
        args = (dout, q, k, v, phi, out, lse, resolve_kind(kind), scale, block_size, seg, skip_epsilon)
        dq, dk, dv, dphi = chunked_backward(*args)
    else:
        from fpa_model.ops.fpa.triton_kernel import triton_backward

        args = (dout, q, k, v, phi, out, lse, kind, scale, segment_ids, skip_epsilon)
        dq, dk, dv, dphi = triton_backward(*args)
    dphi = q.new_empty(0) if dphi is None else dphi
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dphi.contiguous()


@attention_bwd.register_fake
def _(dout, q, k, v, phi, segment_ids, out, lse, kind, scale, block_size, impl, skip_epsilon=None):  # noqa: ANN001, ANN202
    dphi = q.new_empty(0) if phi is None else phi.new_empty(phi.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dphi


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, phi, segment_ids, kind, scale, block_size, impl, skip_epsilon = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, phi, segment_ids, out, lse)
    ctx.args = (kind, scale, block_size, impl, skip_epsilon)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: Tensor, _dlse: Tensor | None):  # noqa: ANN001, ANN202
    q, k, v, phi, segment_ids, out, lse = ctx.saved_tensors
    dq, dk, dv, dphi = attention_bwd(dout.contiguous(), q, k, v, phi, segment_ids, out, lse, *ctx.args)
    return dq, dk, dv, None if phi is None else dphi, None, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    phi: Tensor | None = None,
    *,
    kind: str = "fpa",
    scale: float | None = None,
    block_size: int = 64,
    segment_ids: Tensor | None = None,
    impl: str = "chunked",
    skip_epsilon: float | None = None,
) -> Tensor:
    """The attention output through the custom op (same contract as fpa_attention with impl chunked or
    triton); checks its inputs as those paths do before the op runs."""
    if impl not in LIBRARY_IMPLS:
        raise ValueError(f"the compiled attention op serves impl {' or '.join(LIBRARY_IMPLS)}; got {impl!r}")
    spec = resolve_kind(kind)
    if impl == "chunked":
        from fpa_model.ops.fpa.chunked import _validate

        _validate(q, k, v, phi, spec, block_size)
    args = (q, k, v, phi, segment_ids, spec.name, _scale(q, scale), int(block_size), impl)
    return attention_fwd(*args, skip_epsilon)[0]
