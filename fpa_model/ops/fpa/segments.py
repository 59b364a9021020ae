"""Document segments of packed sequences: the one check of the `segment_ids` argument every path takes.

segment_ids (B, Tk), an integer tensor: the document index of each key position inside its window,
non-decreasing along T in each row (data_prep.loader.document_segments derives it from the
end-of-document tokens). Query i sees key j only when both lie in the same document, so the windows'
documents attend as if each stood alone.
"""

from __future__ import annotations

import torch


def check_segment_ids(segment_ids: torch.Tensor, k: torch.Tensor, tk: int | None = None) -> torch.Tensor:
    """segment_ids as int64 after a one-line error for a wrong dtype, shape or order (k: (B, H, Tk, D);
    tk: the length they must cover when it is not k's, e.g. the whole sequence under sequence parallelism)."""
    if not isinstance(segment_ids, torch.Tensor):
        raise ValueError(f"segment_ids must be a (B, Tk) integer tensor; got {type(segment_ids).__name__}")
    if segment_ids.is_floating_point() or segment_ids.is_complex() or segment_ids.dtype == torch.bool:
        raise ValueError(f"segment_ids must be an integer tensor; got dtype {segment_ids.dtype}")
    want = (k.shape[0], k.shape[-2] if tk is None else tk)
    if tuple(segment_ids.shape) != want:
        raise ValueError(f"segment_ids must be (B, Tk) = {want}; got {tuple(segment_ids.shape)}")
    if segment_ids.device != k.device:
        raise ValueError(f"segment_ids are on {segment_ids.device}, the keys on {k.device}")
    seg = segment_ids.long()
    if seg.shape[-1] > 1 and bool((seg[:, 1:] < seg[:, :-1]).any()):
        raise ValueError(
            "segment_ids must be non-decreasing along T in each row (a document index per position)"
        )
    return seg


def document_starts(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True where a document starts (the window's first position included), i.e. where the
    token before lies in another document or outside the window (the key/value shift then mixes in zeros)."""
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return starts


def document_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int64 position of every token inside its document (0 at each document start): the RoPE
    positions of a packed window whose documents stand alone."""
    t = segment_ids.shape[-1]
    idx = torch.arange(t, device=segment_ids.device).expand_as(segment_ids)
    starts = document_starts(segment_ids)
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=-1).values  # start of own document
    return idx - first


__all__ = ["check_segment_ids", "document_positions", "document_starts"]
