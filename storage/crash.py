"""Test hook: die at a named point to prove crash safety.

Set ``S3KAFKA_CRASH_POINT`` to ``before_commit`` (objects uploaded, metadata not committed),
``after_commit`` (committed, WAL not yet trimmed), ``during_compaction`` (compacted objects
uploaded, not committed) or ``during_rewrite`` (a stream's rewritten objects uploaded, not
committed) and the process exits with ``os._exit(137)`` - like kill -9, nothing is
flushed - the first time (or the Nth time, ``S3KAFKA_CRASH_AFTER=N``) it gets there. Never set
it in production.

``S3KAFKA_PAUSE_POINT=name`` with ``S3KAFKA_PAUSE_S=seconds`` instead sleeps there (every time),
so that a test can kill the process from outside (kill -9) while it is at that point.
"""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)
_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Exit abruptly if the crash-point environment variable names this point."""
    if os.environ.get("S3KAFKA_PAUSE_POINT") == name:
        log.warning("pause point %s reached: sleeping", name)
        time.sleep(float(os.environ.get("S3KAFKA_PAUSE_S", "5")))
    if os.environ.get("S3KAFKA_CRASH_POINT") != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(os.environ.get("S3KAFKA_CRASH_AFTER", "1")):
        log.error("crash point %s reached: exiting 137", name)
        os._exit(137)
