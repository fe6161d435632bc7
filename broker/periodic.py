"""One background task that runs a step every few seconds until stopped.

The log cleaner, retention and the transaction coordinator each had the same block (create a
named task, sleep, run a pass, log and survive a failed pass, cancel and await on stop); this is
that block once. A failed pass is logged and the next one runs on time: a background duty must
never die of one bad partition or one unreachable database call.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from .failures import log_failure


class Periodic:
    """Run ``step`` every ``interval_s`` seconds (the first run after one interval, or at once
    with ``immediate``)."""

    def __init__(self, name: str, interval_s: float | Callable[[], float],
                 step: Callable[[], Awaitable[object]], logger: logging.Logger,
                 immediate: bool = False) -> None:
        self.name = name
        self._immediate = immediate
        self._interval = interval_s
        self._step = step
        self._log = logger
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def _run(self) -> None:
        wait = not self._immediate
        while True:
            if wait:
                interval = self._interval() if callable(self._interval) else self._interval
                await asyncio.sleep(interval)
            wait = True
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep the duty alive; the next pass retries
                # a metadata outage is the store's one-line episode, not a traceback per pass
                log_failure(self._log, exc, "%s: pass failed", self.name)

    async def stop(self) -> None:
        """Cancel the task and wait until it has ended (idempotent)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
            pass
