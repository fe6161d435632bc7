"""Start a coroutine now, in the caller's step, and finish it as a task.

``asyncio.ensure_future`` only schedules a coroutine: its first step runs after everything
already in the loop's ready queue. The produce path needs the opposite. A partition assigns
offsets and checks producer sequences synchronously, before its first await, so running that
step at once keeps appends in request order even when a request for several partitions is
followed, on the same connection, by one whose handler appends inline. (Python 3.12's
``eager_task_factory`` does this for every task; this broker runs on 3.11 as well.)

Unlike 3.12's eager tasks, the first step runs with the *caller's* task as
``asyncio.current_task()``: nothing reachable from it may bind to the current task
(``asyncio.timeout`` cancels it at expiry - the caller, not this coroutine; storage/waits.py).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


_NOT_STARTED: Any = object()


class Drive:
    """Drives a coroutine inside the task that awaits this (no task of its own), as
    ``yield from`` would, and calls ``on_suspend()`` each time the coroutine suspends until
    that returns True.

    - ``first``: the coroutine's first step already ran (start_now) and yielded this value
      (the future it waits for): it is yielded again to the driving task.
    - ``on_suspend``: Partition.append learns this way when the stream has taken its
      offsets (the stream's append suspends first for room, if any, then for durability)
      without a second task."""

    __slots__ = ("_coro", "_first", "_on_suspend")

    def __init__(self, coro: Coroutine[Any, Any, T], on_suspend: Callable[[], bool] | None = None,
                 first: Any = _NOT_STARTED) -> None:
        self._coro = coro
        self._first = first
        self._on_suspend = on_suspend

    def __await__(self) -> Generator[Any, Any, T]:
        coro, cb, value = self._coro, self._on_suspend, self._first
        self._first = None
        if value is _NOT_STARTED:
            try:
                value = coro.send(None)
            except StopIteration as stop:
                return stop.value
        elif asyncio.isfuture(value):
            value._asyncio_future_blocking = True  # as the future left it (see start_now)
        while True:
            if cb is not None and cb():
                cb = None
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - cancellation goes into the coroutine
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _finish(rest: Drive) -> Any:
    return await rest


def start_now(coro: Coroutine[Any, Any, T]) -> "asyncio.Future[T]":
    """Run ``coro`` up to its first suspension before returning; the rest runs as a task.

    A coroutine that finishes (or fails) in its first step gives a completed future."""
    loop = asyncio.get_running_loop()
    try:
        first = coro.send(None)
    except StopIteration as stop:
        done = loop.create_future()
        done.set_result(stop.value)
        return done
    except Exception as exc:  # noqa: BLE001 - delivered to whoever awaits the future
        failed = loop.create_future()
        failed.set_exception(exc)
        return failed
    if asyncio.isfuture(first):
        # a future sets this flag when it yields itself and the task that receives it clears
        # it; until our task does, nobody else could await this future
        first._asyncio_future_blocking = False
    return loop.create_task(_finish(Drive(coro, first=first)))
