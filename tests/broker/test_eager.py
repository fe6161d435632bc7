"""start_now: a coroutine's first step runs in the caller's step, the rest as a task."""
from __future__ import annotations

import asyncio

import pytest

from broker.eager import start_now


async def test_first_step_runs_before_start_now_returns():
    steps: list[str] = []
    gate = asyncio.get_running_loop().create_future()

    async def job(name: str) -> str:
        steps.append(f"{name} start")
        await gate
        steps.append(f"{name} end")
        return name

    scheduled = asyncio.ensure_future(job("scheduled"))
    eager = start_now(job("eager"))
    assert steps == ["eager start"]  # ensure_future's first step has not run yet
    await asyncio.sleep(0)
    assert steps == ["eager start", "scheduled start"]
    gate.set_result(None)
    assert await eager == "eager" and await scheduled == "scheduled"
    assert sorted(steps[2:]) == ["eager end", "scheduled end"]  # both awaited the same future


async def test_values_sent_and_results_pass_through():
    async def job() -> int:
        total = 0
        for i in range(3):
            fut = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(fut.set_result, i + 1)
            total += await fut
            await asyncio.sleep(0)  # a bare yield
        return total

    assert await start_now(job()) == 6


async def test_finished_or_failed_in_the_first_step():
    async def quick() -> str:
        return "done"

    async def broken() -> None:
        raise ValueError("bad input")

    fut = start_now(quick())
    assert fut.done() and fut.result() == "done"
    bad = start_now(broken())
    assert bad.done()
    with pytest.raises(ValueError, match="bad input"):
        await bad


async def test_cancelling_the_task_reaches_the_coroutine():
    seen: list[str] = []
    started = asyncio.Event()

    async def job() -> None:
        try:
            started.set()
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("cleanup")

    task = start_now(job())
    assert started.is_set()
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled", "cleanup"]


async def test_an_exception_after_the_first_step_reaches_the_awaiter():
    async def job() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("later")

    with pytest.raises(RuntimeError, match="later"):
        await start_now(job())
