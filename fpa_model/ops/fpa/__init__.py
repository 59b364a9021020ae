"""The FPA attention family (fpa | fox | softmax): naive reference, chunked PyTorch path, Triton kernel.

`fpa_attention` is the one entry point the model calls; `impl` picks the implementation
("auto": Triton on CUDA tensors, the chunked PyTorch path elsewhere).
"""

from __future__ import annotations

import torch

from fpa_model.ops.fpa.naive import KINDS, fpa_attention_naive, fpa_bias_naive


def fpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: torch.Tensor | None = None,
    *,
    kind: str = "fpa",
    scale: float | None = None,
    impl: str = "auto",
    block_size: int = 64,
) -> torch.Tensor:
    """Causal attention of q (B,H,Tq,D) over k, v (B,H,Tk,D) with the field phi (B,H,Tk)."""
    if impl == "naive" or impl == "auto":  # chunked and triton paths land in their own modules
        return fpa_attention_naive(q, k, v, phi, kind=kind, scale=scale)
    raise ValueError(f"unknown attention impl {impl!r}")


__all__ = ["KINDS", "fpa_attention", "fpa_attention_naive", "fpa_bias_naive"]
