"""Waiting for an event with a timeout, without losing a cancellation.

Python 3.11's ``asyncio.wait_for(event.wait(), t)`` returns normally when the task is
cancelled in the same loop turn as the event is set: it sees the inner wait done and returns
its result, and the cancellation is gone. A background loop of the form ``while True: await
wait_for(wake.wait(), poll)`` then survives its ``cancel()``, and whoever awaits it after the
cancel - a broker's shutdown - waits forever (3.12 rewrote ``wait_for`` on ``asyncio.timeout``).
``asyncio.timeout`` converts only its own expiry into ``TimeoutError``: an outside cancel
always propagates - but it cancels ``asyncio.current_task()`` at its expiry, which is the
*caller's* task in a coroutine's first step run by ``broker.eager.start_now``: a produce for
several partitions whose append waited for room there had its handler task cancelled at the
back-pressure deadline, and that cancel reached another partition's append after its offsets
were taken, which took that partition offline ("append cancelled"; chaos run under CPU load,
session 22). ``asyncio.wait`` on the event's own waiter binds to no task: an outside cancel
still propagates, and the expiry cancels nothing. Every wait in a cancellable loop goes
through here.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Iterable


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Until ``event`` is set or ``timeout`` seconds passed; whether it is set. A cancel of
    the calling task always raises ``CancelledError``."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((waiter,), timeout=max(timeout, 0.0))
    finally:
        if not waiter.done():
            waiter.cancel()
    return event.is_set()


async def end_tasks(tasks: Iterable[asyncio.Future], timeout_s: float, log: logging.Logger,
                    what: str) -> None:
    """Await ``tasks`` (already cancelled, or finishing on their own) for at most
    ``timeout_s``: a stop is bounded even if one of them swallows its cancel. A task left
    behind is logged with its stack, so the next such bug names itself."""
    tasks = list(tasks)         # walked twice below
    pending = {t for t in tasks if not t.done()}
    t0 = time.monotonic()
    if pending:
        _, pending = await asyncio.wait(pending, timeout=timeout_s)
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()       # retrieved: a stop does not report it again at exit
    for t in pending:
        name = t.get_name() if isinstance(t, asyncio.Task) else repr(t)
        stack = "".join(f"\n  {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}"
                        for f in (t.get_stack() if isinstance(t, asyncio.Task) else []))
        log.error("%s: task %s did not end %.1f s after its cancel; left behind%s", what, name,
                  time.monotonic() - t0, stack)
