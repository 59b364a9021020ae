import os

# The Triton kernels run under the interpreter on CPU; it must be on before any @triton.jit is defined.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# Runs started by tests (in this process or its children) log to W&B without console capture, system-stats
# thread or git probing (pipeline.logging.QUIET_WANDB_ENV), which keeps them fast and their output clean.
os.environ.setdefault("FPA_QUIET_WANDB", "1")
