"""The rendezvous port check the Slurm train script runs on the head node (launch/rendezvous_port.py):
a taken derived port moves to the next free one, a taken fixed port fails naming its holder. The
two-node job with the port taken is in tests/test_slurm_multinode.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.rendezvous_port import choose_port, port_holder, port_is_free

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def listener() -> Iterator[int]:
    """A stranger listening on a port of the derived range (20000-39999)."""
    for port in range(31000, 32000, 7):
        sock = socket.socket()
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            sock.close()
            continue
        sock.listen(1)
        try:
            yield port
        finally:
            sock.close()
        return
    pytest.skip("no free port to occupy")


def test_a_free_port_stays_and_a_listened_port_is_taken(listener: int) -> None:
    assert not port_is_free(listener)
    free = next(p for p in range(listener + 1, listener + 50) if port_is_free(p))
    assert choose_port(free, fixed=False, host="h") == free
    assert choose_port(free, fixed=True, host="h") == free
    assert port_holder(listener).startswith(f"pid {os.getpid()} (")
    assert port_holder(free) == ""


def test_a_taken_derived_port_moves_to_the_next_free_one(
    listener: int, capsys: pytest.CaptureFixture
) -> None:
    got = choose_port(listener, fixed=False, host="node7")
    assert got == next(p for p in range(listener + 1, listener + 50) if port_is_free(p))
    assert f"rendezvous port {listener} on node7 is in use by pid {os.getpid()}" in capsys.readouterr().err


def test_the_derived_range_wraps_at_its_end() -> None:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", 39999))
        except OSError:
            pytest.skip("port 39999 is in use here")
        sock.listen(1)
        got = choose_port(39999, fixed=False, host="h")
    assert 20000 <= got < 20050


def test_a_taken_fixed_port_fails_naming_port_holder_and_the_key(listener: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "launch.rendezvous_port", str(listener), "--fixed"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    err = proc.stderr.strip()
    assert err.startswith(
        f"fpa: error: rendezvous port {listener} on {socket.gethostname()} is in use by pid {os.getpid()} "
    )
    assert "slurm.rdzv_port fixes it" in err and len(err.splitlines()) == 1
    free = subprocess.run(
        [sys.executable, "-m", "launch.rendezvous_port", str(listener + 1)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert free.returncode == 0 and int(free.stdout) >= listener + 1
