"""Free TCP ports that no other live test or bench process has been handed.

A port from ``bind(("127.0.0.1", 0))`` is free only at that moment. A broker that a test killed
and is about to restart on the same port leaves it free in between, and the kernel may hand it
to another pytest-xdist worker's ``free_port()`` or ``bind(0)`` listener: the restart's
ApiVersions probe was then answered by the other worker's broker (CI, session 38:
tests/cluster/test_zombie.py read an empty log of a broker that had not started yet). So every
port handed out here is recorded, with the pid it went to, in one file under the temp directory
(``flock``-ed while read and rewritten); a port recorded for a live pid is not handed out again.
Entries of dead pids are dropped as the file is rewritten.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile

# one per user: a file another user created is not writable here (processes of one user share it)
REGISTRY = os.path.join(tempfile.gettempdir(), f"s3kafka-test-ports-{os.getuid()}")
_TRIES = 200


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(port: int, registry: str = REGISTRY) -> bool:
    """Record ``port`` as this process's; False when a live process (this one included)
    already holds it."""
    fd = os.open(registry, os.O_RDWR | os.O_CREAT, 0o600)
    with open(fd, "r+", encoding="ascii") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        held: list[tuple[int, int]] = []
        alive: dict[int, bool] = {}
        for line in f:
            parts = line.split()
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                continue
            pid, p = int(parts[0]), int(parts[1])
            if pid not in alive:
                alive[pid] = _alive(pid)
            if alive[pid]:
                held.append((pid, p))
        if any(p == port for _, p in held):
            return False
        held.append((os.getpid(), port))
        f.seek(0)
        f.truncate()
        f.write("".join(f"{pid} {p}\n" for pid, p in held))
    return True


def listener(backlog: int = 128, reuse_addr: bool = False,
             registry: str = REGISTRY) -> socket.socket:
    """A socket listening on 127.0.0.1 at a port claimed for this process."""
    for _ in range(_TRIES):
        s = socket.socket()
        try:
            if reuse_addr:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", 0))
            if claim(s.getsockname()[1], registry):
                s.listen(backlog)
                return s
        except BaseException:
            s.close()
            raise
        s.close()
    raise OSError(f"no unclaimed free port on 127.0.0.1 in {_TRIES} tries ({registry})")


def _bound_port() -> int:
    """The port the kernel picks for bind(("127.0.0.1", 0)), free at that moment."""
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port(registry: str = REGISTRY) -> int:
    """A TCP port free on 127.0.0.1 now and claimed for this process (a broker binds it after;
    a restart of that broker finds it free again)."""
    for _ in range(_TRIES):
        port = _bound_port()
        if claim(port, registry):
            return port
    raise OSError(f"no unclaimed free port on 127.0.0.1 in {_TRIES} tries ({registry})")


def listening_pid_owns(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on TCP ``port`` (IPv4 or IPv6; Linux
    /proc): an answer on the port is then its own, not another process's that took the port
    while it was free (a restart's readiness probe)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    # local address "ADDR:PORT" in hex, state 0A = LISTEN, inode column 9
                    if len(cols) > 9 and cols[3] == "0A" and \
                            int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{cols[9]}]")
        except FileNotFoundError:
            continue
    if not inodes:
        return False
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(os.path.join(fd_dir, name)) in inodes:
                return True
        except OSError:
            continue
    return False
