"""Process-group set-up for every way a training job starts.

Launchers and what they set:
- torchrun / the `deepspeed` launcher: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
- srun (one task per rank): SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_JOB_NODELIST, SLURM_JOB_ID;
  we derive the torch variables from them (master = first node of the allocation).
- a bare `python`: nothing; we run as a single process on a free local port.

NCCL on CUDA, gloo on CPU. On CPU, DeepSpeed would JIT-compile its shared-memory all-reduce op with g++
(about 35 s) although training never uses it; we skip that build.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import socket
import subprocess
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    launcher: str  # torchrun | slurm | single

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_slurm_host(nodelist: str) -> str:
    """The first hostname of a Slurm nodelist ("node[01-04],gpu7" -> "node01")."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    # Fallback parser for the common "prefix[a-b,c]" form when scontrol is not on PATH.
    head = nodelist.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        first = rest.rstrip("]").split(",")[0].split("-")[0]
        return prefix + first
    return head


def setup_env() -> str:
    """Fill RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the launcher; return its name."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        env.setdefault("LOCAL_RANK", env.get("LOCAL_RANK", "0"))
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29500")
        return "torchrun"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        env.setdefault("MASTER_ADDR", _first_slurm_host(nodelist))
        # A port every task computes alike from the job id, so no exchange is needed.
        job = env.get("SLURM_JOB_ID", "0")
        env.setdefault("MASTER_PORT", str(20000 + zlib.crc32(job.encode()) % 20000))
        return "slurm"
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(_free_port()))
    return "single"


def skip_cpu_shm_build() -> None:
    """Stop DeepSpeed from compiling its CPU shm all-reduce op (inference-only) at init."""
    # The module object must come from importlib: `import deepspeed.comm.torch` binds a different name.
    mod = importlib.import_module("deepspeed.comm.torch")
    mod.build_shm_op = lambda: None


# Seconds a collective may wait for a peer before it raises (the process-group timeout). A lost node
# leaves its peers blocked in a collective; this bounds how long they wait when no connection reset
# tells them sooner. Slurm jobs may set it through slurm.env.
TIMEOUT_ENV = "FPA_COLLECTIVE_TIMEOUT"


def collective_timeout(default_s: float) -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return default_s
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds; got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be > 0; got {raw!r}")
    return value


def default_group_timeout(timeout: datetime.timedelta) -> None:
    """Make `timeout` the timeout of every process group created from now on, not only the world group's.
    `torch.distributed.new_group` without a timeout (DeepSpeed's data-parallel clone of the world group,
    which every ZeRO collective uses; the sequence-parallel groups) takes torch's library default (30 min
    gloo, 10 min NCCL), not the one init_process_group got; the one knob is distributed_c10d's module
    default, read at each new_group call. Raises if a torch upgrade removed it
    (tests/test_collective_timeout.py checks it too)."""
    import torch.distributed.distributed_c10d as c10d

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if not hasattr(c10d, name):
            raise RuntimeError(
                f"torch {torch.__version__} has no torch.distributed.distributed_c10d.{name}: "
                f"{TIMEOUT_ENV} would not reach the process groups made by new_group"
            )
        setattr(c10d, name, timeout)


def init_distributed(backend: str = "auto", timeout_s: float = 1800.0) -> DistInfo:
    """Initialize torch.distributed through DeepSpeed for the current launcher; idempotent. The
    collective timeout is timeout_s unless FPA_COLLECTIVE_TIMEOUT says otherwise."""
    import deepspeed

    timeout_s = collective_timeout(timeout_s)
    launcher = setup_env()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        skip_cpu_shm_build()
    if not torch.distributed.is_initialized():
        default_group_timeout(datetime.timedelta(seconds=timeout_s))
        deepspeed.init_distributed(
            dist_backend=backend,
            auto_mpi_discovery=False,
            verbose=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return DistInfo(rank, local_rank, world, device, backend, launcher)


def rank_layout() -> dict[str, object]:
    """Which host each rank runs on and where the ranks met (collective: call on every rank).
    {"world_size", "hosts": [host of rank 0, 1, ...], "master": "addr:port", "run_id"}."""
    host = socket.gethostname()
    hosts = [host]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        hosts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(hosts, host)
    return {
        "world_size": len(hosts),
        "hosts": hosts,
        "master": f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}",
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID"),
    }


def describe_layout(layout: dict[str, object]) -> str:
    """One log line: "4 ranks: 0-1 on node1, 2-3 on node2; master node1:29500"."""
    hosts: list[str] = list(layout["hosts"])  # type: ignore[arg-type]
    runs: list[str] = []
    start = 0
    for i in range(1, len(hosts) + 1):
        if i == len(hosts) or hosts[i] != hosts[start]:
            ranks = str(start) if i - 1 == start else f"{start}-{i - 1}"
            runs.append(f"{ranks} on {hosts[start]}")
            start = i
    return f"{len(hosts)} ranks: {', '.join(runs)}; master {layout['master']}"


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank src's Python object on every rank (a no-op without a process group)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_max(value: float) -> float:
    """The max of a float over ranks (any rank stopping must stop them all)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return value
    nccl = torch.distributed.get_backend() == "nccl"
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if nccl else "cpu")
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def destroy() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def process_group_ends() -> Iterator[None]:
    """Ends the process group when the block ends, before the interpreter does: a gloo group still alive
    at exit can abort a rank that finished ("terminate called without an active exception", SIGABRT), and
    the job is then marked failed. A clean end (no exception, or SystemExit: a deliberate exit such as a
    preemption, which every rank reaches together) always ends it. After an error the group ends only
    where that is local (gloo): NCCL's destroy flushes pending collectives and would wait on a peer that
    is gone or stuck, instead of letting this rank exit and its launcher stop the others."""
    try:
        yield
    except SystemExit:
        destroy()
        raise
    except BaseException:
        if torch.distributed.is_initialized() and torch.distributed.get_backend() != "nccl":
            destroy()
        raise
    destroy()


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
