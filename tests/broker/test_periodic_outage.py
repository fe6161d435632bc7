"""A periodic duty's pass that meets a metadata outage logs the store's one-line episode, not
a traceback per pass (session 26: a transaction coordinator's pass during a PostgreSQL cut
logged ``pass failed`` with a traceback at ERROR); a bug in a pass still logs its traceback."""
from __future__ import annotations

import asyncio
import logging

import pytest

from broker.periodic import Periodic
from storage import sqldb


async def _two_passes(exc: BaseException, caplog: pytest.LogCaptureFixture) -> list:
    ran = asyncio.Event()
    passes = [0]

    async def step() -> None:
        passes[0] += 1
        if passes[0] >= 2:
            ran.set()
        raise exc

    log = logging.getLogger("test.periodic")
    p = Periodic("duty", 0.001, step, log, immediate=True)
    with caplog.at_level(logging.DEBUG, logger="test.periodic"):
        p.start()
        await asyncio.wait_for(ran.wait(), 10)
        await p.stop()
    return [r for r in caplog.records if r.name == "test.periodic"]


async def test_a_pass_that_meets_a_metadata_outage_logs_no_error(caplog, monkeypatch) -> None:
    noted: list[str] = []
    monkeypatch.setattr(sqldb, "note_unreachable", noted.append)
    records = await _two_passes(sqldb.MetadataUnreachable("cannot reach PostgreSQL"), caplog)
    assert records and all(r.levelno < logging.WARNING and r.exc_info is None
                           for r in records), [(r.levelname, r.getMessage()) for r in records]
    assert noted and "cannot reach PostgreSQL" in noted[0], noted


async def test_a_pass_that_fails_by_a_bug_logs_its_traceback(caplog) -> None:
    records = await _two_passes(ValueError("a bug"), caplog)
    errors = [r for r in records if r.levelno >= logging.ERROR]
    assert errors and errors[0].exc_info is not None, records
    assert "duty: pass failed" in errors[0].getMessage()
