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
import re
import sys
import threading
from typing import Any

PR_SET_NAME = 15                 # prctl(2)
NAME_BYTES = 15                  # a thread name's bytes, without the terminating NUL
_INDEX = re.compile(r"([_-]\d+)$")  # the pool index ThreadPoolExecutor and the WAL append
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


def _prctl() -> Any | None:
    """libc's prctl, or None off Linux (or without a libc ctypes can load)."""
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
            prctl(PR_SET_NAME, ctypes.c_char_p(os_name(self.name)), 0, 0, 0)
        except Exception:  # noqa: BLE001 - a name is never worth a thread
            pass
        original(self)

    threading.Thread._bootstrap_inner = _bootstrap_inner  # type: ignore[attr-defined]
    _installed = True
    return True
