"""The FPA attention family (fpa | fox | softmax): naive reference, chunked PyTorch path, Triton kernel.

`fpa_attention` is the one entry point the model calls; `impl` picks the implementation:
- "naive":   the T x T oracle (naive.py), autograd through plain tensor ops; tests only.
- "chunked": flash-style PyTorch path with O(T) memory and a custom backward (chunked.py).
- "triton":  the fused kernel (triton_kernel.py); errors clearly if Triton cannot run here.
- "auto":    Triton for CUDA tensors when it imports and serves the shape, the chunked path everywhere
             else (with one warning per reason when a CUDA call falls back: Tq != Tk, head dim > 128,
             segment_ids). segment_ids are served by naive and chunked only (impl="triton" refuses them).
"""

from __future__ import annotations

import warnings

import torch

from fpa_model.config import ATTENTION_IMPLS as IMPLS
from fpa_model.ops.fpa.chunked import chunked_fpa_attention
from fpa_model.ops.fpa.kinds import AttentionKind, resolve_kind
from fpa_model.ops.fpa.naive import KINDS, fpa_attention_naive, fpa_bias_naive
from fpa_model.ops.fpa.segments import check_segment_ids
from fpa_model.ops.fpa.skipping import check_skip_epsilon


def _load_triton():
    """The Triton entry point, or an ImportError/RuntimeError saying why it is unavailable."""
    from fpa_model.ops.fpa.triton_kernel import fpa_attention_triton  # lazy: triton is heavy to import

    return fpa_attention_triton


def _triton_usable(q: torch.Tensor) -> bool:
    if not q.is_cuda:
        return False
    try:
        _load_triton()
    except Exception:  # missing module or broken triton install: auto falls back to the chunked path
        return False
    return True


_WARNED: set[str] = set()


def _auto_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """ "triton" where the kernel runs and serves these shapes, else "chunked" (warning once per reason)."""
    if not _triton_usable(q):
        return "chunked"
    from fpa_model.ops.fpa.triton_kernel import unsupported_reason

    reason = unsupported_reason(q, k, v)
    if reason is None:
        return "triton"
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(
            f"fpa_attention(impl='auto'): the Triton kernel {reason}; using the chunked PyTorch path",
            stacklevel=3,
        )
    return "chunked"


def fpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None = None,
    *,
    kind: str | AttentionKind = "fpa",
    scale: float | None = None,
    impl: str = "auto",
    block_size: int = 64,
    segment_ids: torch.Tensor | None = None,
    skip_epsilon: float | None = None,
) -> torch.Tensor:
    """Causal attention of q (B,H,Tq,D) over k, v (B,H,Tk,D) with the field phi (B,H,Tk).

    skip_epsilon: tiles whose softmax mass is provably below skip_epsilon of every row are not computed
    (skipping.py states the bound; fpa and fox; softmax has no field and computes every tile). Served by
    the chunked path (at its block_size) and the Triton kernels (at their SKIP_CELL); None (the default)
    computes every tile.

    segment_ids (B, Tk), non-decreasing integer ids (the document of each position in a packed window):
    a query attends only to keys of its own document. None: the whole window is one sequence.

    Queries are the last Tq key positions. `block_size` is the tile size of the chunked path (the Triton
    kernel picks its own tiles); on CPU, 128-256 runs about 10-15% faster than 64 at T >= 2048.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
    spec = resolve_kind(kind)  # the one resolution of the kind: every path below reads its flags
    skip_epsilon = check_skip_epsilon(skip_epsilon)
    if skip_epsilon is not None and spec.has_field and impl == "naive":
        raise ValueError(
            "skip_epsilon (tile skipping) is served by impl 'chunked', 'triton' or 'auto'; got impl 'naive' "
            "(the naive oracle computes every pair)"
        )
    if torch.compiler.is_compiling() and impl != "naive":
        # Inside torch.compile: the op as one custom-op node (library.py), so the graph does not break
        # around it. auto picks by device alone here (the shape checks of fpa_attention_triton still run).
        from fpa_model.ops.fpa.library import attention

        if impl == "auto":
            impl = "triton" if q.is_cuda else "chunked"
        return attention(
            q,
            k,
            v,
            phi,
            kind=spec.name,
            scale=scale,
            block_size=block_size,
            segment_ids=segment_ids,
            impl=impl,
            skip_epsilon=skip_epsilon,
        )
    if impl == "auto":
        impl = _auto_impl(q, k, v)
    if impl == "naive":
        return fpa_attention_naive(q, k, v, phi, kind=spec, scale=scale, segment_ids=segment_ids)
    if impl == "chunked":
        return chunked_fpa_attention(
            q, k, v, phi, kind=spec, scale=scale, block_size=block_size, segment_ids=segment_ids,
            skip_epsilon=skip_epsilon,
        )  # fmt: skip
    try:
        fn = _load_triton()
    except Exception as e:
        raise RuntimeError(
            f"attention impl 'triton' is unavailable here ({type(e).__name__}: {e}); "
            "use impl='chunked' (or 'auto') on machines without a working Triton"
        ) from e
    if phi is None:
        if spec.has_field:
            raise ValueError(f"kind {spec.name!r} needs a field phi")
        phi = q.new_zeros(k.shape[:-1])
    # The kernel module takes the kind's name; segment_ids only when given, so other calls stay as they were.
    extra = {} if segment_ids is None else {"segment_ids": check_segment_ids(segment_ids, k)}
    if skip_epsilon is not None:
        extra["skip_epsilon"] = skip_epsilon
    return fn(q, k, v, phi, kind=spec.name, scale=scale, **extra)


__all__ = [
    "IMPLS",
    "AttentionKind",
    "KINDS",
    "chunked_fpa_attention",
    "fpa_attention",
    "fpa_attention_naive",
    "fpa_bias_naive",
    "resolve_kind",
]
