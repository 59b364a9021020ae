"""Choose the c10d rendezvous port on the head node, before the torchrun agents start.

torchrun's head agent hosts the rendezvous store on the port; if something else already listens there,
the agent silently falls back to being a client of that stranger and every agent hangs until the
rendezvous times out. The batch script (which Slurm runs on the first node of the allocation) calls

    python -m launch.rendezvous_port PORT [--fixed]

and hands the printed port to every agent. A derived port (the default) that is taken moves to the next
free one, said on stderr; a port the user fixed (`slurm.rdzv_port`, e.g. for a firewall) is not moved:
the job fails at once with the port and its holder in the message.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from pathlib import Path

TRIES = 50  # derived ports probed before giving up


def port_is_free(port: int) -> bool:
    """True if a listening socket can be bound to `port` on every address, as torchrun's TCPStore does
    (SO_REUSEADDR, so a previous attempt's TIME_WAIT connections do not count as taken)."""
    families = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")] if socket.has_ipv6 else []
    families = families or [(socket.AF_INET, "0.0.0.0")]
    for family, addr in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 in this kernel/namespace: try IPv4
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # covers IPv4 too
            try:
                sock.bind((addr, port))
                sock.listen(1)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return False
                if family == socket.AF_INET6 and exc.errno == errno.EADDRNOTAVAIL:
                    continue  # IPv6 disabled on the interfaces
                raise
            return True
    return True


def port_holder(port: int) -> str:
    """'pid N (cmd)' of a process listening on `port`, from /proc; '' when it cannot be seen."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])  # state 0A: LISTEN
    if not inodes:
        return ""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
                    return f"pid {proc.name} ({' '.join(cmd.split())[:120]})"  # one line
        except OSError:
            continue
    return ""


def choose_port(port: int, *, fixed: bool, host: str, tries: int = TRIES) -> int:
    """The first free port from `port` on (wrapping within 20000-39999, the derived range), or `port`
    itself when fixed. Raises RuntimeError naming the port and its holder when none is usable."""
    if not 0 < port < 65536:
        raise RuntimeError(f"rendezvous port {port} is not a TCP port")
    if port_is_free(port):
        return port
    holder = port_holder(port)
    taken = f"rendezvous port {port} on {host} is in use" + (f" by {holder}" if holder else "")
    if fixed:
        raise RuntimeError(
            f"{taken}; slurm.rdzv_port fixes it: free the port, set another, or set 0 to derive one"
        )
    candidate = port
    for _ in range(tries):
        candidate = 20000 + (candidate + 1 - 20000) % 20000 if 20000 <= port < 40000 else candidate + 1
        if candidate < 65536 and port_is_free(candidate):
            print(f"fpa: {taken}; the rendezvous moves to {candidate}", file=sys.stderr)
            return candidate
    raise RuntimeError(f"{taken}, and so are the next {tries} ports")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--fixed", action="store_true", help="the user set this port: never move it")
    args = parser.parse_args(argv)
    try:
        port = choose_port(args.port, fixed=args.fixed, host=socket.gethostname())
    except RuntimeError as exc:
        print(f"fpa: error: {exc}", file=sys.stderr)
        return 1
    print(port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
