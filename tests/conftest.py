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

# The modules that take longest on one worker (seconds, `pytest --junitxml` on 2 cores), longest first.
# `make test` hands modules to the xdist workers in collection order (--dist loadfile
# --no-loadscope-reorder): starting the long ones first keeps the run from ending with one worker on a
# long module while the other idles. Order only; every module runs either way.
LONGEST_FIRST = (
    "test_slurm_multinode.py",  # 334 s
    "test_train.py",  # 182
    "test_slurm.py",  # 165
    "test_fpa_triton.py",  # 156
    "test_faults_checkpoint.py",  # 146
    "test_sequence_parallel.py",  # 90
    "test_train_features.py",  # 81
    "test_train_extend.py",  # 43
    "test_stage_inputs.py",  # 39
    "test_triton_blocks.py",  # 33
    "test_docs_data.py",  # 32
    "test_launch.py",  # 27
    "test_gpu_check.py",  # 25
    "test_compile.py",  # 24
    "test_train_passkey.py",  # 22
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
