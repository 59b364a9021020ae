"""FPA_COLLECTIVE_TIMEOUT bounds how long a rank waits for a peer that stopped answering, in the world
group and in the groups made later by new_group (DeepSpeed's data-parallel clone of the world group, which
every ZeRO collective uses): two gloo ranks through pipeline.distributed.init_distributed, rank 1 stops
taking part, rank 0's collectives must raise within the timeout. The same on two Slurm nodes with a
stopped worker: tests/test_slurm_multinode.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.distributed import collective_timeout

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import torch, torch.distributed as dist
    from pipeline.distributed import init_distributed
    info = init_distributed()
    clone = dist.new_group(ranks=list(range(info.world_size)))  # as DeepSpeed's _clone_world_group
    if info.rank == 1:
        time.sleep(120)  # a rank that stopped answering
    out = {}
    for name, group in (("new_group", clone), ("world", None)):
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=group)
            out[name] = ["completed", time.monotonic() - t0]
        except Exception as exc:
            out[name] = [type(exc).__name__ + ": " + str(exc)[:200], time.monotonic() - t0]
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # a clean shutdown would wait for the silent rank
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.distributed
def test_a_silent_rank_raises_within_the_timeout_in_the_world_and_in_new_groups() -> None:
    port = _free_port()
    base = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    base.update(MASTER_PORT=str(port), FPA_COLLECTIVE_TIMEOUT="3", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        out, err = procs[0].communicate(timeout=45)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    assert line, err[-3000:]
    got = json.loads(line[len("RESULT ") :])
    for name in ("new_group", "world"):
        what, seconds = got[name]
        assert what != "completed" and "imed out" in what, got  # gloo: "Timed out waiting 3000ms ..."
        assert 2.5 <= seconds < 3 + 10, got  # the timeout, not torch's 30-minute default


def test_the_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FPA_COLLECTIVE_TIMEOUT", raising=False)
    assert collective_timeout(1800.0) == 1800.0
    monkeypatch.setenv("FPA_COLLECTIVE_TIMEOUT", "7.5")
    assert collective_timeout(1800.0) == 7.5
    for bad, msg in (("soon", "must be a number of seconds; got 'soon'"), ("0", "must be > 0; got '0'")):
        monkeypatch.setenv("FPA_COLLECTIVE_TIMEOUT", bad)
        with pytest.raises(ValueError, match=msg):
            collective_timeout(1800.0)
