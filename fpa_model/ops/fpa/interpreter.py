"""A log-step scan for Triton's CPU interpreter (TRITON_INTERPRET=1), installed by triton_kernel.

The interpreter runs `tl.associative_scan` with a user combine function one element at a time: every
element is wrapped in an interpreter tensor and the combine function is called on it, so a 1024-long
segmented scan makes 1024 interpreted calls. The field-level and routing kernels run several per
program, and this dominated the CPU tests of the kernels (90 of 157 s in one test). Here the same combine
function is applied to whole shifted arrays (Hillis-Steele: step d combines element i - d into element i,
d = 1, 2, 4, ...), about log2(n) interpreted calls. `associative_scan` requires an associative combine
function, so the result is the same scan: exact for min / max / flag combines; sums are reassociated into
a tree, as the compiled scan on a GPU reassociates them too. Only the interpreter's fallback for user
combine functions is replaced (its cumsum / cumprod fast paths stay), and nothing changes when the
kernels are compiled.
"""

from __future__ import annotations

import numpy as np


def _log_step_scan(self, inputs: list) -> list:
    """ScanOps.generic_scan's contract: inputs are interpreter tensors of one shape, scanned along
    self.axis in the forward direction (apply_impl flips for reverse scans); returns one tensor each."""
    import triton.language as tl

    axis = self.axis
    data = [np.array(x.handle.data, copy=True) for x in inputs]
    n = data[0].shape[axis]

    def part(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
        index = [slice(None)] * a.ndim
        index[axis] = slice(lo, hi)
        return a[tuple(index)]

    # Interpreter blocks must keep power-of-2 shapes, so each step combines whole arrays: the left operand
    # is the data shifted by `step` along the axis (its first `step` entries are filler), and only the
    # entries from `step` on take the result.
    step = 1
    while step < n:
        shifted = [a.copy() for a in data]
        for s, a in zip(shifted, data, strict=True):
            part(s, step, n)[...] = part(a, 0, n - step)
        left = tuple(self.to_tensor(a, x.dtype) for a, x in zip(shifted, inputs, strict=True))
        right = tuple(self.to_tensor(a, x.dtype) for a, x in zip(data, inputs, strict=True))
        out = self.combine_fn.fn(*left, *right)
        out = out if isinstance(out, tuple) else (out,)
        new = [a.copy() for a in data]
        for a, r in zip(new, out, strict=True):
            r = np.broadcast_to(r.handle.data if isinstance(r, tl.core.tensor) else r, a.shape)
            part(a, step, n)[...] = part(r, step, n)
        data = new
        step *= 2
    return [self.to_tensor(a, x.dtype) for a, x in zip(data, inputs, strict=True)]


def install_log_step_scan() -> None:
    """Replace the interpreter's element-by-element fallback scan (idempotent; a Triton without it is
    left alone, so an interpreter rewrite upstream only costs speed)."""
    try:
        from triton.runtime.interpreter import ScanOps
    except ImportError:
        return
    if hasattr(ScanOps, "generic_scan") and hasattr(ScanOps, "to_tensor"):
        ScanOps.generic_scan = _log_step_scan
