"""A handler that raises is answered with the request's error response (broker/failures.py),
as Kafka's getErrorResponse does: every advertised API and version has one that encodes and
decodes, naming the request's items; outages get the retriable code of the API."""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import psycopg
import pytest

from broker.failures import error_response, failure_answer, is_store_outage, outage_code
from broker.metrics import RequestStats, timed
from protocol import SUPPORTED_APIS, ErrorCode as E, encode_response, parse_response, \
    request_class
from protocol.examples import sample_message
from protocol.frames import RequestHeader
from storage import sqldb



@pytest.mark.parametrize("api_key", sorted(SUPPORTED_APIS))
def test_every_api_version_has_an_error_answer_that_round_trips(api_key: int) -> None:
    lo, hi = SUPPORTED_APIS[api_key]
    for v in range(lo, hi + 1):
        req = sample_message(request_class(api_key), v)
        resp = error_response(api_key, v, req, E.UNKNOWN_SERVER_ERROR, "boom")
        assert resp is not None, (api_key, v)
        h = RequestHeader(api_key=api_key, api_version=v, correlation_id=41, client_id="t")
        corr, back = parse_response(api_key, v, encode_response(h, resp)[4:])
        assert corr == 41
        assert str(int(E.UNKNOWN_SERVER_ERROR)) in repr(back)


def test_error_answers_name_the_requests_items() -> None:
    commit = sample_message(request_class(8), 8)
    resp = error_response(8, 8, commit, E.COORDINATOR_NOT_AVAILABLE)
    (t,) = resp.topics
    assert t.name == commit.topics[0].name
    assert [(p.partition_index, p.error_code) for p in t.partitions] == \
        [(commit.topics[0].partitions[0].partition_index, E.COORDINATOR_NOT_AVAILABLE)]
    delete = sample_message(request_class(20), 3)            # topic names as plain strings
    (r,) = error_response(20, 3, delete, E.REQUEST_TIMED_OUT).responses
    assert (r.name, r.error_code) == (delete.topic_names[0], E.REQUEST_TIMED_OUT)
    fetch_offsets = sample_message(request_class(9), 8)      # a failed group lists no topics
    (g,) = error_response(9, 8, fetch_offsets, E.COORDINATOR_NOT_AVAILABLE).groups
    assert (g.group_id, g.error_code, g.topics) == \
        (fetch_offsets.groups[0].group_id, E.COORDINATOR_NOT_AVAILABLE, [])


def test_outage_codes_are_kafkas_retriable_ones() -> None:
    assert outage_code(8) == outage_code(11) == outage_code(14) == E.COORDINATOR_NOT_AVAILABLE
    assert outage_code(22, SimpleNamespace(transactional_id="t")) == E.COORDINATOR_NOT_AVAILABLE
    assert outage_code(22, SimpleNamespace(transactional_id=None)) == \
        E.COORDINATOR_LOAD_IN_PROGRESS
    assert outage_code(19) == outage_code(20) == outage_code(44) == E.REQUEST_TIMED_OUT
    assert is_store_outage(sqldb.MetadataUnreachable("down"))
    assert is_store_outage(psycopg.OperationalError("server closed the connection"))
    wrapped = RuntimeError("while committing")
    wrapped.__cause__ = sqldb.MetadataUnreachable("down")
    assert is_store_outage(wrapped)
    assert not is_store_outage(KeyError("bug"))


def _ctx(api_key: int, version: int) -> SimpleNamespace:
    header = RequestHeader(api_key=api_key, api_version=version, correlation_id=1)
    return SimpleNamespace(header=header, conn=SimpleNamespace(peer="127.0.0.1:1"))


async def test_a_raising_handler_is_answered_not_closed(caplog) -> None:
    """timed() (the per-request wrapper) turns a handler's exception into its answer: a bug is
    UNKNOWN_SERVER_ERROR logged at ERROR; an outage is the API's retriable code, logged once
    per episode (storage.sqldb), and nothing at ERROR."""
    req = sample_message(request_class(8), 8)

    async def buggy(ctx, request):
        raise KeyError("a bug")

    async def store_down(ctx, request):
        raise sqldb.MetadataUnreachable("cannot reach PostgreSQL metadata at x:1")

    stats = RequestStats()
    caplog.set_level(logging.DEBUG)
    resp = await timed(buggy, _ctx(8, 8), req, stats, time.perf_counter())
    assert resp.topics[0].partitions[0].error_code == E.UNKNOWN_SERVER_ERROR
    assert any(r.levelno == logging.ERROR and "UNKNOWN_SERVER_ERROR" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    sqldb.outage.clear()
    try:
        for _ in range(5):
            resp = await timed(store_down, _ctx(8, 8), req, stats, time.perf_counter())
            assert resp.topics[0].partitions[0].error_code == E.COORDINATOR_NOT_AVAILABLE
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "state=started" in warnings[0].getMessage(), warnings
    finally:
        sqldb.outage.clear()
    assert any("state=ended" in r.getMessage() and r.levelno == logging.INFO
               for r in caplog.records)
    assert failure_answer(_ctx(8, 8), req, KeyError("x")) is not None
    # acks=0 produce expects no answer: the connection is closed instead, as Kafka does
    produce = sample_message(request_class(0), 9)
    produce.acks = 0
    assert failure_answer(_ctx(0, 9), produce, KeyError("x")) is None
    produce.acks = -1
    assert failure_answer(_ctx(0, 9), produce, KeyError("x")) is not None
