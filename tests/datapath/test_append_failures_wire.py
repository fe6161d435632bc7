"""Issue 21's three scenarios over real sockets against a broker whose object store is cut
through a proxy (so its small LogCache fills and appends wait on back-pressure, or its replay
after a restart cannot read). Answers are checked field by field with the raw WireClient."""
from __future__ import annotations

import time
import uuid

import pytest
from kafka.protocol.producer import ProduceResponse

from chaos.faults import proxy_for, s3_bucket_url
from tests.conftest import free_port

from .batches import make_batch, read_records
from .wire import WireClient, metric

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

E_NONE, E_NOT_ENOUGH_REPLICAS = 0, 19
RETRIABLE = {7, 19, 56}
BACKPRESSURE_S = 4.0


@pytest.fixture
def cut_store(broker_factory, s3_endpoint):
    """(broker, proxy): a 1 MiB LogCache, 4 s back-pressure, the store behind ``proxy``;
    the broker's /metrics at ``broker.metrics_url``."""
    proxy = proxy_for(s3_endpoint)
    url = s3_bucket_url(s3_endpoint.url, proxy.url, f"wire21-{uuid.uuid4().hex[:12]}")
    mport = free_port()
    bp = broker_factory(["--object-store", url, "--log-cache-bytes", str(1 << 20),
                         "--upload-interval-s", "0.3", "--upload-threshold-bytes",
                         str(64 << 10), "--backpressure-timeout-s", str(BACKPRESSURE_S),
                         "--metrics-listen", f"127.0.0.1:{mport}"])
    bp.metrics_url = f"http://127.0.0.1:{mport}/metrics"
    try:
        yield bp, proxy
    finally:
        proxy.close()


def _fill(bp, proxy) -> None:
    """Cut the store and fill the LogCache until appends are back-pressured."""
    proxy.cut()
    with WireClient(bp.host, bp.port) as c:
        c.create_topic("filler")
        for _ in range(40):
            if c.produce("filler", make_batch([b"f" * (200 << 10)])).error_code != 0:
                return
    raise AssertionError("the LogCache never filled")


def _wal_trimmed(bp, timeout: float = 60.0) -> None:
    """Wait until everything appended is uploaded and the WAL trimmed past it (its used bytes
    0): a fixed 2 s wait (uploads every 0.3 s) could end before the upload on a loaded
    machine, and the restart then replayed the batches from the WAL."""
    deadline = time.monotonic() + timeout
    while metric(bp.metrics_url, "s3kafka_wal_used_bytes", None) != 0:
        assert time.monotonic() < deadline, "the WAL was not trimmed: nothing uploaded?"
        time.sleep(0.1)


def _log(c: WireClient, topic: str) -> list[tuple[int, bytes]]:
    part = c.fetch(topic, 0)
    assert part.error_code == 0
    return [(o, v) for o, _, v in read_records(part.records)]


def _idem(value: bytes, pid: int, epoch: int, seq: int) -> bytes:
    return make_batch([value], producer_id=pid, epoch=epoch, base_sequence=seq)


def _big(tag: bytes) -> bytes:
    """Larger than the filler batch that no longer fit: sure to wait for room."""
    return tag + b"." * (300 << 10)


def _read(c: WireClient, corr: int):
    return c.recv(ProduceResponse, 9, corr).responses[0].partition_responses[0]


def test_successor_of_a_failed_waiting_batch_is_not_appended(cut_store):
    """Scenario 1: seq 0 waits on back-pressure, seq 1 is pipelined on the same connection,
    seq 0 fails, room appears. seq 1 must not be acknowledged ahead of seq 0 (it was, with
    error 0, and the retry of seq 0 got OUT_OF_ORDER_SEQUENCE_NUMBER)."""
    bp, proxy = cut_store
    with WireClient(bp.host, bp.port) as c:
        c.create_topic("s1")
        pid, epoch = c.init_producer_id()
        _fill(bp, proxy)
        corr_a = c.send(c.produce_request("s1", {0: _idem(_big(b"A"), pid, epoch, 0)}), 9)
        time.sleep(BACKPRESSURE_S - 0.5)
        corr_b = c.send(c.produce_request("s1", {0: _idem(_big(b"B"), pid, epoch, 1)}), 9)
        ra = _read(c, corr_a)
        assert ra.error_code == E_NOT_ENOUGH_REPLICAS
        proxy.restore()
        rb = _read(c, corr_b)
        assert rb.error_code in RETRIABLE, rb
        ra = c.produce("s1", _idem(_big(b"A"), pid, epoch, 0))
        rb = c.produce("s1", _idem(_big(b"B"), pid, epoch, 1))
        assert (ra.error_code, rb.error_code) == (0, 0), (ra, rb)
        assert rb.base_offset == ra.base_offset + 1
        assert _log(c, "s1") == [(ra.base_offset, _big(b"A")), (rb.base_offset, _big(b"B"))]


def test_retry_on_another_connection_never_gets_another_batchs_offset(cut_store):
    """Scenario 2: seq 0 waits; the same request is sent again on a second connection; the
    first fails; a plain producer writes C. The retry is either appended itself or refused,
    never answered with the offset where C lives."""
    bp, proxy = cut_store
    with WireClient(bp.host, bp.port) as c1, WireClient(bp.host, bp.port) as c2, \
            WireClient(bp.host, bp.port) as c3:
        c1.create_topic("s2")
        pid, epoch = c1.init_producer_id()
        _fill(bp, proxy)
        a2 = _big(b"A2")
        corr1 = c1.send(c1.produce_request("s2", {0: _idem(a2, pid, epoch, 0)}), 9)
        time.sleep(0.5)
        corr2 = c2.send(c2.produce_request("s2", {0: _idem(a2, pid, epoch, 0)}), 9)
        r1 = _read(c1, corr1)
        assert r1.error_code == E_NOT_ENOUGH_REPLICAS
        proxy.restore()
        rc = c3.produce("s2", make_batch([b"C"]))
        r2 = _read(c2, corr2)
        assert rc.error_code == 0
        log = dict(_log(c3, "s2"))
        assert log[rc.base_offset] == b"C"
        if r2.error_code == 0:
            assert log[r2.base_offset] == a2, (r2, log[r2.base_offset][:10])
        else:
            assert r2.error_code in RETRIABLE
        assert list(log.values()).count(a2) == (1 if r2.error_code == 0 else 0)


def test_restart_with_store_down_refuses_idempotent_produce_until_state_is_complete(cut_store):
    """Scenario 3: batches uploaded (the WAL trimmed), kill -9 before any producer snapshot,
    restart with the store cut. A retry of an acknowledged batch must not be appended again
    (it was: the replay stopped and the producer looked new); it is refused retriably until
    the store is back, then answered with its original offset."""
    bp, proxy = cut_store
    with WireClient(bp.host, bp.port) as c:
        c.create_topic("s3")
        pid, epoch = c.init_producer_id()
        acked = [c.produce("s3", _idem(f"v{i}".encode(), pid, epoch, i)) for i in range(3)]
        assert [r.error_code for r in acked] == [0, 0, 0]
    _wal_trimmed(bp)
    bp.kill()
    proxy.cut()
    t0 = time.monotonic()
    bp.start()
    listen_s = time.monotonic() - t0
    with WireClient(bp.host, bp.port) as c:
        r = c.produce("s3", _idem(b"v2", pid, epoch, 2))
        assert r.error_code in RETRIABLE, r
        proxy.restore()
        deadline = time.monotonic() + 30
        while r.error_code != 0 and time.monotonic() < deadline:
            time.sleep(0.3)
            r = c.produce("s3", _idem(b"v2", pid, epoch, 2))
        assert (r.error_code, r.base_offset) == (0, acked[2].base_offset)
        r = c.produce("s3", _idem(b"v3", pid, epoch, 3))
        assert r.error_code == 0
        assert [v for _, v in _log(c, "s3")] == [b"v0", b"v1", b"v2", b"v3"]
    # the broker's own start (not its interpreter's start-up and imports) within 10 s
    assert listen_s - bp.interpreter_seconds() < 10, (listen_s, bp.interpreter_seconds())
