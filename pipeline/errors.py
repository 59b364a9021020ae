"""The error every part of the trainer raises when training cannot continue."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite losses under nan_policy=stop, too many skipped steps)."""
