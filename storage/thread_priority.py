"""Background threads that yield the CPU and the disk to the hot path.

Cold reads (catch-up consumers) run on their own threads. Two things let them slow the tail
on a small machine (sched_switch traces and per-write WAL timings in bench/HISTORY.md):

- CPU: a thread woken to read a large range (the kernel copies megabytes and faults fresh
  pages in) lands on the waker's core, preempts the event loop and keeps it waiting for up to
  a scheduler slice (1-3 ms, and this kernel does not preempt inside a system call). A high
  nice value plus SCHED_BATCH (never preempts on wake-up) lets the loop run first; unlike
  SCHED_IDLE a nice value still gets its share under full load, so catch-up never stops.
- Disk: with the file:// store on the WAL's disk, cold reads that miss the page cache queue
  in front of the WAL's O_DSYNC writes (WAL write p99 0.6 -> 1.0-1.4 ms while a reader ran).
  The idle I/O class makes the block scheduler (mq-deadline, BFQ) serve them only when no
  other I/O is waiting; mq-deadline still serves an idle request after 10 s, so catch-up
  slows down under a saturated disk instead of starving. Schedulers without priorities
  ("none", typical for NVMe) ignore it.

The frame prefill thread (broker/frames.py: produce frames faulted in ahead of need, woken
per large request) takes SCHED_BATCH alone (``lower_current_thread(0)``): it was the main
thread preempting the event loop and a co-located client under a confluent-kafka producer.

Linux keeps all three per thread, so setting them in a pool's initializer touches only that
pool. Threads inherit them from their creator: never open the WAL (which starts its IO
threads) from such a thread.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import platform
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

IOPRIO_CLASS_BE = 2
IOPRIO_CLASS_IDLE = 3
IOPRIO_CLASS_SHIFT = 13
IOPRIO_WHO_PROCESS = 1                 # "process" means the thread id given
IO_CLASSES = {"be": IOPRIO_CLASS_BE, "idle": IOPRIO_CLASS_IDLE}
# ioprio_set / ioprio_get have no wrapper in Python's os module or in glibc
_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31), "i686": (289, 290)}


def _syscall(index: int, *args: int) -> int:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        raise OSError(f"ioprio syscalls unknown on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    r = libc.syscall(numbers[index], *args)
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return r


def set_io_class(io_class: str, tid: int | None = None) -> None:
    """Put a thread (default: the caller) in the I/O scheduling class ``io_class``."""
    value = IO_CLASSES[io_class] << IOPRIO_CLASS_SHIFT
    _syscall(0, IOPRIO_WHO_PROCESS, tid or threading.get_native_id(), value)


def io_class_of(tid: int | None = None) -> str:
    """The I/O class of a thread: "be", "idle", "rt" or "none" (the default: by nice)."""
    value = _syscall(1, IOPRIO_WHO_PROCESS, tid or threading.get_native_id())
    return {0: "none", 1: "rt", 2: "be", 3: "idle"}.get(value >> IOPRIO_CLASS_SHIFT, "?")


def lower_current_thread(nice: int, io_class: str = "") -> None:
    """Give the calling thread ``nice``, SCHED_BATCH and (if given) the I/O class
    ``io_class``. Best effort: what the system refuses is logged at debug level and the
    thread keeps what it had."""
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (OSError, AttributeError) as e:       # not Linux, or not allowed
        log.debug("could not lower thread priority: %s", e)
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (OSError, AttributeError) as e:
        log.debug("could not set SCHED_BATCH: %s", e)
    if io_class:
        try:
            set_io_class(io_class, tid)
            _current.io_class = io_class
        except (OSError, AttributeError) as e:
            log.debug("could not set I/O class %s: %s", io_class, e)


_current = threading.local()


def in_io_class(io_class: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` on this (pool) thread in ``io_class`` ("" = leave it): the class is
    switched only when it differs from what this thread last set (one syscall), best
    effort like lower_current_thread."""
    if io_class and getattr(_current, "io_class", None) != io_class:
        try:
            set_io_class(io_class)
        except (OSError, AttributeError) as e:
            log.debug("could not set I/O class %s: %s", io_class, e)
        _current.io_class = io_class
    return fn(*args)


def background_executor(threads: int, name: str, nice: int, io_class: str = ""
                        ) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads run at ``nice`` with SCHED_BATCH and in ``io_class``
    (see the module text)."""
    if io_class and io_class not in IO_CLASSES:
        raise ValueError(f"unknown I/O class {io_class!r} (use one of {sorted(IO_CLASSES)})")
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name,
                                                 initializer=lower_current_thread,
                                                 initargs=(nice, io_class))
