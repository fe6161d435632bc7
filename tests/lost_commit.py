"""Inject a lost COMMIT answer into the metadata store: the transaction commits, then the
call raises as if the connection broke at COMMIT (a PostgreSQL cut or restart at that
moment). Used by the engine's and the takeover's "commit answer lost" tests."""
from __future__ import annotations

import sqlite3
from typing import Any, Callable


def fail_after_commit(meta: Any, method: str, then: Callable[[], None] = lambda: None,
                      once: bool = False) -> list[int]:
    """Each ``meta.<method>`` transaction (only the first with ``once``) commits, calls
    ``then`` and raises. Returns a list that gets one entry per injected failure."""
    fired: list[int] = []
    backend = meta.db._b
    real_commit, real_method = backend.commit, getattr(meta, method)
    armed = [False]

    def commit() -> None:
        real_commit()
        if armed[0]:
            armed[0] = False
            fired.append(1)
            then()
            raise sqlite3.OperationalError("disk I/O error (injected after COMMIT)")

    def wrapped(*a: Any, **kw: Any) -> Any:
        armed[0] = not (once and fired)
        try:
            return real_method(*a, **kw)
        finally:
            armed[0] = False
    backend.commit = commit
    setattr(meta, method, wrapped)
    return fired
