"""The base of the chaos workload's client threads (writers, group members)."""
from __future__ import annotations

import threading


class WorkerThread(threading.Thread):
    """A daemon thread whose ``_run()`` is the work; what it raises is kept in ``error`` for the
    harness to report."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - reported by the harness
            self.error = e

    def _run(self) -> None:
        raise NotImplementedError
