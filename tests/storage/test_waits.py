"""storage/waits.py: a cancel that arrives in the loop turn its event is set must still end the
task (Python 3.11's ``asyncio.wait_for`` returned normally then: the cluster room's watch loop
survived its cancel and a PostgreSQL broker never finished its SIGTERM shutdown), and a stop
bounded by ``end_tasks`` names a task that will not end."""
from __future__ import annotations

import asyncio
import logging

from storage.engine import open_engine
from storage.waits import end_tasks, wait_event

from storage_helpers import small_config


async def _ends_when_cancelled_as_set(event: asyncio.Event, task: asyncio.Task) -> None:
    """Set ``event`` and cancel ``task`` in one loop turn: the task must end cancelled."""
    await asyncio.sleep(0.05)            # the loop is inside its wait
    event.set()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    assert done, "the loop swallowed its cancel and kept going"
    assert task.cancelled()


async def test_a_cancel_in_the_turn_the_event_is_set_ends_the_loop() -> None:
    ev = asyncio.Event()
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while True:
            await wait_event(ev, 0.2)
            ev.clear()
            rounds += 1

    t = asyncio.create_task(loop())
    await _ends_when_cancelled_as_set(ev, t)
    assert rounds == 0


async def test_wait_event_answers_whether_it_was_set() -> None:
    ev = asyncio.Event()
    assert await wait_event(ev, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, ev.set)
    assert await wait_event(ev, 5) is True
    assert await wait_event(ev, 0) is True          # already set: no wait


async def test_end_tasks_leaves_a_task_that_will_not_end_and_names_it(caplog) -> None:
    caplog.set_level(logging.ERROR)
    stop = asyncio.Event()

    async def stubborn() -> None:
        while not stop.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass                        # a bug: swallows every cancel

    async def fails() -> None:
        raise RuntimeError("boom")

    t, f = asyncio.create_task(stubborn(), name="stubborn"), asyncio.create_task(fails())
    await asyncio.sleep(0.02)
    t.cancel()
    await end_tasks([t, f], 0.2, logging.getLogger("test"), "test stop")
    assert not t.done()
    assert "test stop: task stubborn did not end" in caplog.text
    assert "stubborn" in caplog.text.split("left behind", 1)[1]      # its stack
    stop.set()
    await t


async def test_the_upload_loop_ends_when_cancelled_as_it_is_woken(tmp_path) -> None:
    eng = open_engine(small_config(tmp_path))
    await eng.start()
    try:
        uploader = next(t for t in eng._tasks if t.get_name() == "s3kafka-uploader")
        await _ends_when_cancelled_as_set(eng._upload_wakeup, uploader)
    finally:
        await asyncio.wait_for(eng.close(), 30)


async def test_a_wait_started_eagerly_cancels_nothing_of_its_caller_at_its_expiry() -> None:
    """A coroutine whose first step runs in the caller's task (``start_now``, the produce path
    for several partitions) and waits there with a timeout: the expiry ends that wait only.
    With ``asyncio.timeout`` it cancelled the caller's task, and through it the append the
    caller was awaiting (a partition went offline: 'append cancelled')."""
    from broker.eager import start_now

    ev = asyncio.Event()
    job = start_now(wait_event(ev, 0.05))
    other = asyncio.ensure_future(asyncio.sleep(0.3, "other done"))
    assert await other == "other done"       # the caller was not cancelled meanwhile
    assert await job is False
