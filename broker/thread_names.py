"""Operating-system names for the broker's threads.

Python before 3.14 names only its own Thread objects: the kernel sees every thread of a broker
as ``python`` (or the console script's name), so ``top -H``, ``ps -L``, ``perf`` and
``/proc/PID/task/*/comm`` cannot tell the event loop from the object writers (``s3kafka-io``),
the WAL's IO threads or the cold readers. ``install()`` makes every thread started afterwards
take its Python name (shortened to the kernel's 15 bytes) when it starts; ``bench.rawload``
splits the broker's CPU per thread pool by these names. Python 3.14 sets them itself.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
import threading
from typing import Any

PR_SET_NAME = 15                 # prctl(2)
NAME_BYTES = 15                  # a thread name's bytes, without the terminating NUL
MAIN_POOL = "event-loop"         # the main thread: the event loop serves every request
_INDEX = re.compile(r"([_-]\d+)$")  # the pool index ThreadPoolExecutor and the WAL append
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_installed = False


def os_name(name: str) -> bytes:
    """The kernel name for a Python thread name: ``s3kafka-`` shortened to ``s3k-`` and, when
    still too long, the stem cut so that a pool index (``_3``, ``-12``) survives:
    ``s3kafka-producer-snapshots_0`` -> ``s3k-producer_0``."""
    short = name.replace("s3kafka-", "s3k-", 1)
    raw = short.encode("utf-8", "replace")
    if len(raw) <= NAME_BYTES:
        return raw
    m = _INDEX.search(short)
    suffix = m.group(1).encode() if m else b""
    stem = raw[:len(raw) - len(suffix)][:NAME_BYTES - len(suffix)]
    return stem.decode("utf-8", "ignore").rstrip("-_").encode() + suffix


@functools.cache
def _prctl() -> Any | None:
    """libc's prctl, or None off Linux (or without a libc ctypes can load); looked up once."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def name_current_thread(name: str) -> bool:
    """Give the calling thread the kernel name for ``name``; False where that is impossible."""
    prctl = _prctl()
    if prctl is None:
        return False
    return prctl(PR_SET_NAME, ctypes.c_char_p(os_name(name)), 0, 0, 0) == 0


def install() -> bool:
    """From now on every thread started in this process names itself after its Python name as
    it starts (idempotent). False where nothing was installed: Python 3.14+ (it does this
    itself), not Linux, or a threading module without the hook used here."""
    global _installed
    if _installed:
        return True
    prctl = _prctl()
    original = getattr(threading.Thread, "_bootstrap_inner", None)
    if sys.version_info >= (3, 14) or prctl is None or original is None:
        return False

    def _bootstrap_inner(self: threading.Thread) -> None:
        try:
            name_current_thread(self.name)
        except Exception:  # noqa: BLE001 - a name is never worth a thread
            pass
        original(self)

    threading.Thread._bootstrap_inner = _bootstrap_inner  # type: ignore[attr-defined]
    _installed = True
    return True


def pool_of(comm: str) -> str:
    """A thread's pool from its kernel name: the name without its index (``s3k-io_3`` ->
    ``s3k-io``, ``iou-wrk-4343`` -> ``iou-wrk``)."""
    return _INDEX.sub("", comm) or comm


def stat_cpu_split(path: str) -> tuple[float, float] | None:
    """(user, kernel) CPU seconds from a /proc ``stat`` file (a process's or a thread's); None
    when it cannot be read (it exited). With os.read, no file object: a metrics scrape reads
    ~40 of these on the event loop (0.5 ms for 41 threads; 1.2 ms with open() and the names
    read each time). bench.common splits the broker's CPU with it too."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            fields = os.read(fd, 4096).rpartition(b")")[2].split()
        finally:
            os.close(fd)
        return int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK
    except (OSError, ValueError, IndexError):
        return None


def tasks_cpu(pid: int | None = None) -> dict[int, float]:
    """CPU seconds (user + system) of every thread of process ``pid`` (default: this one) from
    /proc, by thread id. Empty off Linux or once the process is gone; a thread that exits
    while it is read is left out."""
    pid = os.getpid() if pid is None else pid
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    out: dict[int, float] = {}
    for name in tids:
        split = stat_cpu_split(f"/proc/{pid}/task/{name}/stat")
        if split is not None:
            out[int(name)] = split[0] + split[1]
    return out


def threads_cpu(pid: int | None = None, pools: dict[int, str] | None = None
                ) -> dict[int, tuple[str, float]]:
    """(pool, CPU seconds: user + system) of every thread of process ``pid`` (default: this
    one), by thread id (``tasks_cpu``); the main thread's pool is MAIN_POOL. ``pools``: the
    pools of threads already seen, by id (a thread names itself once, as it starts), filled
    in here; without it every thread's name is read."""
    pid = os.getpid() if pid is None else pid
    cpus = tasks_cpu(pid)
    pools = {} if pools is None else pools
    try:
        with open(f"/proc/{pid}/comm") as f:
            unnamed = f.read().strip()      # what a thread is called until it names itself
    except OSError:
        return {}
    out: dict[int, tuple[str, float]] = {}
    for tid, cpu in cpus.items():
        pool = pools.get(tid)
        if pool is None:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            pool = MAIN_POOL if tid == pid else pool_of(comm)
            if tid == pid or comm != unnamed:
                pools[tid] = pool          # (a thread read before it named itself: again)
        out[tid] = (pool, cpu)
    return out


def cpu_by_pool(pid: int | None = None) -> dict[str, float]:
    """CPU seconds of process ``pid`` (default: this one) by thread pool (``threads_cpu``)."""
    out: dict[str, float] = {}
    for pool, cpu in threads_cpu(pid).values():
        out[pool] = out.get(pool, 0.0) + cpu
    return out


class PoolCPU:
    """This process's CPU seconds by thread pool as a counter that never goes back: a thread
    that exited keeps counting with the CPU it had at the last reading (a plain sum would drop
    it, and a Prometheus rate() would read that as a reset). Read from one thread at a time
    (the metrics scrape, on the event loop)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[str, float]] = {}
        self._pools: dict[int, str] = {}       # thread id -> pool, read once per thread
        self._retired: dict[str, float] = {}

    def read(self) -> dict[str, float]:
        now = threads_cpu(pools=self._pools)
        for tid, (pool, cpu) in self._seen.items():
            if tid not in now:
                self._retired[pool] = self._retired.get(pool, 0.0) + cpu
                self._pools.pop(tid, None)    # a thread id the kernel may hand out again
        self._seen = now
        out = dict(self._retired)
        for pool, cpu in now.values():
            out[pool] = out.get(pool, 0.0) + cpu
        return out
