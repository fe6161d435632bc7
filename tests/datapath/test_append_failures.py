"""Appends that fail after validation leave no trace (issue 21), over a Stream whose room and
durability the test controls: back-pressure that times out, a predecessor that fails while a
successor waits, a retried duplicate whose original fails, storage errors, shutdown, a WAL
write that fails after the offsets were taken, and a restart whose replay cannot read yet."""
from __future__ import annotations

import asyncio

import pytest

from broker.partition import Partition
from protocol import ErrorCode
from storage.memory import MemoryStream, MemoryStreamStore
from storage.stream import Batch, RetriableStorageError, StorageError

from .batches import make_batch
from .test_partition import TOPIC_ID, open_partition, read_all

RETRIABLE = {ErrorCode.NOT_ENOUGH_REPLICAS, ErrorCode.REQUEST_TIMED_OUT,
             ErrorCode.KAFKA_STORAGE_ERROR}


class GatedStream(MemoryStream):
    """A MemoryStream with engine-like back-pressure: without ``room`` an append waits (the
    end offset unchanged) up to ``timeout`` and then raises RetriableStorageError; with
    ``hold_durability`` a taken append waits for ``durable`` (which the test may fail)."""

    def __init__(self, stream_id: int = 1, timeout: float = 0.3) -> None:
        super().__init__(stream_id)
        self.room = asyncio.Event()
        self.room.set()
        self.timeout = timeout
        self.error: Exception | None = None        # raised before the offsets are taken
        self.hold_durability = False
        self.durable: list[asyncio.Future[None]] = []
        self.read_error: Exception | None = None

    async def append(self, payload, base_offset, count, check=None):
        if self.error is not None:
            raise self.error
        if not self.room.is_set():
            try:
                await asyncio.wait_for(self.room.wait(), self.timeout)
            except asyncio.TimeoutError:
                raise RetriableStorageError("storage is full of unuploaded data; retry") from None
            if self.error is not None:
                raise self.error
            if base_offset != self._end:
                raise RetriableStorageError("stream moved on while waiting for room; retry")
        await super().append(payload, base_offset, count, check)
        if self.hold_durability:
            fut = asyncio.get_running_loop().create_future()
            self.durable.append(fut)
            await fut

    async def read(self, start_offset, max_bytes):
        if self.read_error is not None:
            raise self.read_error
        return await super().read(start_offset, max_bytes)


def idem(value: bytes, seq: int, pid: int = 7, epoch: int = 0) -> bytes:
    return make_batch([value], producer_id=pid, epoch=epoch, base_sequence=seq)


async def values(p: Partition) -> list[tuple[int, bytes]]:
    return [(o, v) for o, _, v in await read_all(p)]


async def test_successor_of_a_failed_waiting_batch_is_refused(tmp_path):
    """Issue 21, scenario 1: seq 0 waits on back-pressure, seq 1 is pipelined behind it, seq 0
    fails, room appears: seq 1 must not be appended (a retriable error), and the retries of
    seq 0 and seq 1 then land in order."""
    stream = GatedStream()
    p, *_ = await open_partition(tmp_path, stream=stream)
    stream.room.clear()
    a = asyncio.ensure_future(p.append(idem(b"A", 0)))
    await asyncio.sleep(0.1)
    b = asyncio.ensure_future(p.append(idem(b"B", 1)))
    ra = await a
    assert ra.error == ErrorCode.NOT_ENOUGH_REPLICAS
    stream.room.set()
    rb = await b
    assert rb.error in RETRIABLE, rb
    assert rb.error != ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER
    assert await values(p) == []
    # a batch arriving after the failure is held back too, until seq 0 is retried
    rb = await p.append(idem(b"B", 1))
    assert rb.error == ErrorCode.NOT_ENOUGH_REPLICAS
    ra = await p.append(idem(b"A", 0))
    rb = await p.append(idem(b"B", 1))
    assert (ra.error, ra.base_offset, rb.error, rb.base_offset) == (0, 0, 0, 1)
    assert await values(p) == [(0, b"A"), (1, b"B")]


async def test_duplicate_of_a_failed_batch_is_not_answered_with_other_offsets(tmp_path):
    """Issue 21, scenario 2: seq 0 waits; the same batch arrives again (a retry on a second
    connection); seq 0 fails; a plain producer writes C. The retry is appended itself (or
    refused): never answered with the offset where C lives."""
    stream = GatedStream()
    p, *_ = await open_partition(tmp_path, stream=stream)
    stream.room.clear()
    first = asyncio.ensure_future(p.append(idem(b"A2", 0, pid=9)))
    await asyncio.sleep(0.05)
    retry = asyncio.ensure_future(p.append(idem(b"A2", 0, pid=9)))
    r1 = await first
    assert r1.error == ErrorCode.NOT_ENOUGH_REPLICAS
    stream.room.set()
    rc = await p.append(make_batch([b"C"]))
    r2 = await retry
    assert rc.error == 0
    log = dict(await values(p))
    assert log[rc.base_offset] == b"C"
    if r2.error == 0:
        assert log[r2.base_offset] == b"A2"
    else:
        assert r2.error in RETRIABLE
    assert list(log.values()).count(b"A2") == (1 if r2.error == 0 else 0)


async def test_duplicate_waits_for_its_own_original(tmp_path):
    """A retry of a batch still in flight is answered with that batch's offsets once it is
    durable, and with an error when it fails, whatever else becomes durable meanwhile."""
    stream = GatedStream()
    p, *_ = await open_partition(tmp_path, stream=stream)
    stream.hold_durability = True
    first = asyncio.ensure_future(p.append(idem(b"X", 0)))
    await asyncio.sleep(0)
    dup = asyncio.ensure_future(p.append(idem(b"X", 0)))
    await asyncio.sleep(0.05)
    assert not dup.done()
    stream.durable[0].set_result(None)
    r1, r2 = await first, await dup
    assert (r1.error, r1.base_offset, r2.error, r2.base_offset) == (0, 0, 0, 0)


async def test_failed_taken_append_fails_its_successors(tmp_path):
    """A WAL write that fails after the stream took the offsets: neither it nor anything
    behind it is acknowledged (the successor's own write may succeed), and the partition
    refuses produces until restart instead of guessing what survived."""
    stream = GatedStream()
    p, *_ = await open_partition(tmp_path, stream=stream)
    stream.hold_durability = True
    a = asyncio.ensure_future(p.append(idem(b"A", 0)))
    await asyncio.sleep(0)
    b = asyncio.ensure_future(p.append(idem(b"B", 1)))
    c = asyncio.ensure_future(p.append(make_batch([b"C"])))
    dup = asyncio.ensure_future(p.append(idem(b"A", 0)))
    await asyncio.sleep(0.01)
    assert len(stream.durable) == 3
    stream.durable[1].set_result(None)
    stream.durable[2].set_result(None)
    stream.durable[0].set_exception(OSError("disk gone"))
    for fut in (a, b, c, dup):
        r = await fut
        assert r.error == ErrorCode.KAFKA_STORAGE_ERROR, r
    stream.hold_durability = False
    r = await p.append(make_batch([b"D"]))
    assert r.error == ErrorCode.KAFKA_STORAGE_ERROR


async def test_storage_error_and_full_wal_leave_no_trace(tmp_path):
    """A non-retriable storage error (stream deleted) and a full WAL (back-pressure timeout)
    before the offsets are taken: nothing appended, the window untouched, the retry works."""
    stream = GatedStream()
    p, *_ = await open_partition(tmp_path, stream=stream)
    assert (await p.append(idem(b"A", 0))).error == 0
    stream.error = StorageError("stream 1 is deleted")
    r = await p.append(idem(b"B", 1))
    assert r.error == ErrorCode.KAFKA_STORAGE_ERROR
    stream.error = None
    stream.room.clear()
    r = await p.append(idem(b"B", 1))
    assert r.error == ErrorCode.NOT_ENOUGH_REPLICAS
    assert (await p.append(idem(b"C", 2))).error == ErrorCode.NOT_ENOUGH_REPLICAS
    stream.room.set()
    r = await p.append(idem(b"B", 1))
    assert (r.error, r.base_offset) == (0, 1)
    assert (await p.append(idem(b"C", 2))).base_offset == 2
    assert await values(p) == [(0, b"A"), (1, b"B"), (2, b"C")]


async def test_shutdown_while_waiting_leaves_no_trace(tmp_path):
    """Closing the partition (broker stopping, topic deleted) while appends wait: every one
    answered with an error, nothing in the log or the producer state."""
    stream = GatedStream(timeout=5)
    p, *_ = await open_partition(tmp_path, stream=stream)
    stream.room.clear()
    a = asyncio.ensure_future(p.append(idem(b"A", 0)))
    await asyncio.sleep(0.01)
    b = asyncio.ensure_future(p.append(idem(b"B", 1)))
    await asyncio.sleep(0.01)
    stream.error = RetriableStorageError("engine closing")
    await p.close()
    stream.room.set()
    ra, rb = await a, await b
    assert ra.error != 0 and rb.error != 0
    assert await values(p) == [] and p.producers.entries == {}


async def _reopened_while_unreadable(tmp_path) -> tuple[Partition, GatedStream]:
    """Three idempotent batches (v0-v2, sequences 0-2), then the partition reopened over the
    same stream without its snapshot while the stream cannot be read (the object store
    down): the producer state must come from the log, whose replay waits."""
    stream = GatedStream()
    p, *_ = await open_partition(tmp_path, stream=stream)
    for i in range(3):
        assert (await p.append(idem(f"v{i}".encode(), i))).error == 0
    stream.read_error = StorageError("object store unreachable")
    return await Partition.open(None, "t", TOPIC_ID, 0, stream, {}), stream


async def test_restart_waits_for_producer_state_before_idempotent_appends(tmp_path):
    """Issue 21, scenario 3: the log tail cannot be read at open (object store down). The
    partition answers idempotent produces with a retriable error (plain ones are appended)
    until the replay completes; then a retry of a replayed batch is a duplicate with its
    original offset, and the next sequence follows."""
    p2, stream = await _reopened_while_unreadable(tmp_path)
    r = await p2.append(idem(b"v2", 2))
    assert r.error == ErrorCode.NOT_ENOUGH_REPLICAS
    r = await p2.append(make_batch([b"plain"]))
    assert (r.error, r.base_offset) == (0, 3)
    stream.read_error = None
    for _ in range(100):
        if p2._producers_ready:
            break
        await asyncio.sleep(0.05)
    r = await p2.append(idem(b"v2", 2))
    assert (r.error, r.base_offset) == (0, 2)          # duplicate of the replayed batch
    r = await p2.append(idem(b"v3", 3))
    assert (r.error, r.base_offset) == (0, 4)
    assert [v for _, v in await values(p2)] == [b"v0", b"v1", b"v2", b"plain", b"v3"]
    # the index kept the plain append taken during the replay
    assert p2.log_index.end_offset == 5
    await p2.close()


async def test_a_batch_refused_during_replay_holds_back_its_successor(tmp_path):
    """Back-pressure suite (acknowledged without an offset): after a kill -9 the retry of a
    stored batch (v2) was refused while the replay ran; its successor (v3, pipelined behind
    it) arrived once the replay had ended and was appended after the replayed v2. librdkafka
    then acknowledged v2 implicitly, without an offset. v3 must get a retriable error until
    v2's retry is answered as a duplicate with its original offset; then v3 follows."""
    p2, stream = await _reopened_while_unreadable(tmp_path)
    ra = await p2.append(idem(b"v2", 2))
    assert ra.error == ErrorCode.NOT_ENOUGH_REPLICAS
    stream.read_error = None
    await asyncio.wait_for(p2._replay_task, 10)
    rb = await p2.append(idem(b"v3", 3))
    assert rb.error == ErrorCode.NOT_ENOUGH_REPLICAS, rb
    ra = await p2.append(idem(b"v2", 2))
    assert (ra.error, ra.base_offset) == (0, 2)        # duplicate of the replayed batch
    rb = await p2.append(idem(b"v3", 3))
    assert (rb.error, rb.base_offset) == (0, 3), rb    # the mark went with the duplicate
    assert [v for _, v in await values(p2)] == [b"v0", b"v1", b"v2", b"v3"]
    await p2.close()


async def test_a_batch_refused_during_replay_holds_back_a_stored_successor(tmp_path):
    """Like the test above, but the successor was stored too (both in flight at a kill -9 or
    a fence, both retried to the taker): v1's retry was refused while the replay ran, v2's
    retry, arriving once it had ended, is a duplicate of a replayed batch. Answered with its
    offset ahead of v1, librdkafka acknowledges v1 implicitly, without an offset (the
    "implicitly acked by subsequent batch success" of the cluster chaos suite). A duplicate
    behind a failed mark waits for the marked batch's retry like any successor."""
    p2, stream = await _reopened_while_unreadable(tmp_path)
    ra = await p2.append(idem(b"v1", 1))
    assert ra.error == ErrorCode.NOT_ENOUGH_REPLICAS
    stream.read_error = None
    await asyncio.wait_for(p2._replay_task, 10)
    rb = await p2.append(idem(b"v2", 2))
    assert rb.error == ErrorCode.NOT_ENOUGH_REPLICAS, rb
    ra = await p2.append(idem(b"v1", 1))
    rb = await p2.append(idem(b"v2", 2))
    assert (ra.error, ra.base_offset, rb.error, rb.base_offset) == (0, 1, 0, 2), (ra, rb)
    assert [v for _, v in await values(p2)] == [b"v0", b"v1", b"v2"]
    await p2.close()


@pytest.mark.parametrize("refusal", ["held back by the mark", "failed itself"])
async def test_a_batch_refused_behind_a_failed_mark_is_waited_for_after_its_retry(
        tmp_path, refusal):
    """Cluster chaos suite (run 7 of session 21, a passing run): during an object store cut
    seq 1 failed (no room: a mark at 1); seq 2 was refused too, either by that mark or by a
    failure of its own (an admission wait timing out), leaving no mark of its own since the
    one at 1 held it back; room came back and seq 1's retry was appended, which took the
    mark away, so seq 3 (pipelined behind seq 2) was checked against seq 1 and answered
    OUT_OF_ORDER_SEQUENCE (librdkafka: a fatal-path epoch bump re-sending 'possibly
    persisted' records). A stored successor (a duplicate) would have been answered instead,
    and librdkafka would have acknowledged seq 2 implicitly, without an offset. Seq 3 must
    wait for seq 2's retry."""
    stream = GatedStream(timeout=0.05)
    p, *_ = await open_partition(tmp_path, stream=stream)
    assert (await p.append(idem(b"A", 0))).error == 0
    stream.room.clear()
    assert (await p.append(idem(b"B", 1))).error == ErrorCode.NOT_ENOUGH_REPLICAS
    if refusal == "failed itself":
        p.refused(idem(b"C", 2))
    else:
        assert (await p.append(idem(b"C", 2))).error == ErrorCode.NOT_ENOUGH_REPLICAS
    stream.room.set()
    rb = await p.append(idem(b"B", 1))
    assert (rb.error, rb.base_offset) == (0, 1), rb
    rd = await p.append(idem(b"D", 3))
    assert rd.error == ErrorCode.NOT_ENOUGH_REPLICAS, rd
    rc = await p.append(idem(b"C", 2))
    rd = await p.append(idem(b"D", 3))
    assert (rc.error, rc.base_offset, rd.error, rd.base_offset) == (0, 2, 0, 3), (rc, rd)
    assert await values(p) == [(0, b"A"), (1, b"B"), (2, b"C"), (3, b"D")]


async def test_a_batch_refused_before_append_holds_back_its_successor(tmp_path):
    """Issue 17 (chaos suite): a produce refused at the door (this broker's lease lapsed for
    a few ms) appends nothing; the producer's next pipelined batch, arriving once the lease
    is renewed, must get a retriable error, not OUT_OF_ORDER_SEQUENCE (librdkafka bumps the
    epoch on that and re-sends records that may have been stored: duplicates). The retry of
    the refused batch and then its successor land in order."""
    p, *_ = await open_partition(tmp_path)
    assert (await p.append(idem(b"A", 0))).error == 0
    p.refused(idem(b"B", 1))
    rc = await p.append(idem(b"C", 2))
    assert rc.error == ErrorCode.NOT_ENOUGH_REPLICAS, rc
    rb = await p.append(idem(b"B", 1))
    rc = await p.append(idem(b"C", 2))
    assert (rb.error, rb.base_offset, rc.error, rc.base_offset) == (0, 1, 0, 2)
    assert await values(p) == [(0, b"A"), (1, b"B"), (2, b"C")]


async def test_a_refused_retry_of_a_stored_batch_holds_back_its_stored_successor(tmp_path):
    """Back-pressure suite (CI, session 22: four values acknowledged without an offset): seq 1
    and seq 2 were stored, both answers lost (kill -9 or a reset connection), both retried. The
    retry of seq 1 was refused before its duplicate check (here at the door; at the
    replay's or the admission's refusal in the chaos run) and, being a duplicate, left no
    failed mark; the retry of seq 2 was then answered with its offset, and librdkafka
    acknowledged seq 1 implicitly, without one. A refused duplicate holds back its
    successors like any refused batch, until its own retry is answered."""
    p, *_ = await open_partition(tmp_path)
    for i, v in enumerate((b"A", b"B", b"C")):
        assert (await p.append(idem(v, i))).error == 0
    p.refused(idem(b"B", 1))
    rc = await p.append(idem(b"C", 2))
    assert rc.error == ErrorCode.NOT_ENOUGH_REPLICAS, rc
    rb = await p.append(idem(b"B", 1))
    rc = await p.append(idem(b"C", 2))
    assert (rb.error, rb.base_offset, rc.error, rc.base_offset) == (0, 1, 0, 2), (rb, rc)
    rd = await p.append(idem(b"D", 3))
    assert (rd.error, rd.base_offset) == (0, 3), rd
    assert await values(p) == [(0, b"A"), (1, b"B"), (2, b"C"), (3, b"D")]


async def test_a_refused_duplicate_below_a_failed_mark_keeps_that_mark(tmp_path):
    """Seq 2 failed (a mark at 2), then the retry of the stored seq 1 was refused too: the
    mark moves down to 1 and still remembers 2, so seq 3 waits for both retries in turn."""
    stream = GatedStream(timeout=0.05)
    p, *_ = await open_partition(tmp_path, stream=stream)
    for i, v in enumerate((b"A", b"B")):
        assert (await p.append(idem(v, i))).error == 0
    stream.room.clear()
    assert (await p.append(idem(b"C", 2))).error == ErrorCode.NOT_ENOUGH_REPLICAS
    p.refused(idem(b"B", 1))
    stream.room.set()
    assert (await p.append(idem(b"D", 3))).error == ErrorCode.NOT_ENOUGH_REPLICAS
    rb = await p.append(idem(b"B", 1))
    assert (rb.error, rb.base_offset) == (0, 1), rb
    assert (await p.append(idem(b"D", 3))).error == ErrorCode.NOT_ENOUGH_REPLICAS
    rc = await p.append(idem(b"C", 2))
    rd = await p.append(idem(b"D", 3))
    assert (rc.error, rc.base_offset, rd.error, rd.base_offset) == (0, 2, 0, 3), (rc, rd)
    assert await values(p) == [(0, b"A"), (1, b"B"), (2, b"C"), (3, b"D")]


async def test_a_retried_stored_batch_is_answered_without_waiting_for_admission(tmp_path):
    """A retry of a stored batch needs no room: it is answered with its offset at once, not
    queued behind another producer's append that waits for room (where it would time out,
    be refused, and hold back its own stored successors)."""
    stream = GatedStream(timeout=30)
    p, *_ = await open_partition(tmp_path, stream=stream)
    p._admission_timeout_s = 0.05
    for i, v in enumerate((b"A", b"B")):
        assert (await p.append(idem(v, i))).error == 0
    stream.room.clear()
    other = asyncio.ensure_future(p.append(idem(b"X", 0, pid=8)))
    await asyncio.sleep(0.05)
    assert p._admission.held and not other.done()
    rb = await p.append(idem(b"B", 1))
    assert (rb.error, rb.base_offset) == (0, 1), rb
    stream.room.set()
    rx = await other
    assert (rx.error, rx.base_offset) == (0, 2), rx
    assert await values(p) == [(0, b"A"), (1, b"B"), (2, b"X")]


class _ReadsNothingAtFirst:
    """A stream whose first reads return no batches (objects not visible yet)."""

    def __init__(self, stream, empty_reads: int) -> None:
        self._s, self.empty = stream, empty_reads

    def __getattr__(self, name):
        return getattr(self._s, name)

    async def read(self, start_offset, max_bytes):
        if self.empty > 0:
            self.empty -= 1
            return []
        return await self._s.read(start_offset, max_bytes)


async def test_replay_that_reads_nothing_retries_until_the_tail_is_read(tmp_path):
    """Issue 17 (chaos suite): a partition reopened on a stream whose objects were not
    readable yet ended its producer-state replay at the first empty read and declared the
    state complete: the producers' next batches were refused out of order (fatal in
    librdkafka) and a retried batch was not recognised. The replay reads again instead."""
    store = MemoryStreamStore()
    stream = await store.create_stream()
    p, *_ = await open_partition(tmp_path / "a", store=store, stream=stream)
    for i in range(3):
        assert (await p.append(idem(b"v%d" % i, i))).error == 0
    q, *_ = await open_partition(tmp_path / "b", store=store,
                                 stream=_ReadsNothingAtFirst(stream, 2))
    await asyncio.wait_for(q._replay_task or asyncio.sleep(0), 10)
    dup = await q.append(idem(b"v2", 2))      # a retry of the last batch: its offset
    assert (dup.error, dup.base_offset) == (0, 2)
    nxt = await q.append(idem(b"v3", 3))
    assert (nxt.error, nxt.base_offset) == (0, 3)
    assert await values(q) == [(0, b"v0"), (1, b"v1"), (2, b"v2"), (3, b"v3")]


class DirectStream(GatedStream):
    """GatedStream with the engine's task-less ``append_now``: the payload is taken at once
    and ``then(error)`` runs when the test resolves that append's durability future."""

    def __init__(self) -> None:
        super().__init__()
        self.direct: list[asyncio.Future[None]] = []

    def append_now(self, payload, base_offset, count, then) -> bool:
        self._batches.append(Batch(base_offset, count, bytes(payload)))
        self._bases.append(base_offset)
        self._end = base_offset + count
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: then(f.exception()))
        self.direct.append(fut)
        return True


async def test_task_less_appends_behind_a_waiting_one_settle_with_it(tmp_path):
    """Two pipelined task-less appends (Partition.append_now) durable before the task-path
    append ahead of them: both are answered in the step that settles it, in order, not one
    loop iteration per link of the chain; and a failure of the first fails them all."""
    stream = DirectStream()
    p, *_ = await open_partition(tmp_path, stream=stream)
    stream.hold_durability = True
    a = asyncio.ensure_future(p.append(make_batch([b"A"])))
    await asyncio.sleep(0)
    answered: list[tuple[str, int, int]] = []
    for name in ("B", "C"):
        assert p.append_now(bytearray(make_batch([name.encode()])), 9,
                            lambda r, n=name: answered.append((n, r.error, r.base_offset)))
    for fut in stream.direct:          # B and C durable first: they wait for A
        fut.set_result(None)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert answered == []
    stream.durable[0].set_result(None)
    ra = await a
    assert (ra.error, ra.base_offset) == (0, 0)
    assert answered == [("B", 0, 1), ("C", 0, 2)]
    assert await values(p) == [(0, b"A"), (1, b"B"), (2, b"C")]

    # the same chain behind an append whose WAL write fails: all three fail, none is answered
    # with an offset, and the partition refuses appends until restart
    d = asyncio.ensure_future(p.append(make_batch([b"D"])))
    await asyncio.sleep(0)
    answered.clear()
    stream.direct.clear()
    for name in ("E", "F"):
        assert p.append_now(bytearray(make_batch([name.encode()])), 9,
                            lambda r, n=name: answered.append((n, r.error, r.base_offset)))
    for fut in stream.direct:
        fut.set_result(None)
    stream.durable[1].set_exception(OSError("disk gone"))
    rd = await d
    assert rd.error == ErrorCode.KAFKA_STORAGE_ERROR
    assert [(n, e) for n, e, _ in answered] == [("E", ErrorCode.KAFKA_STORAGE_ERROR),
                                               ("F", ErrorCode.KAFKA_STORAGE_ERROR)]
    assert not p.append_now(bytearray(make_batch([b"G"])), 9, answered.append)


async def test_task_path_append_behind_a_pending_task_less_one_waits_for_it(tmp_path):
    """A task-path append (Partition.append) taken behind a task-less one (append_now) whose
    WAL write is not durable yet is answered only once that one is, after it; when that write
    fails, the append behind fails too (KAFKA_STORAGE_ERROR). A task-less append's outcome is
    no asyncio future (``_Outcome``): the task path makes one for it when it has to wait."""
    stream = DirectStream()
    p, *_ = await open_partition(tmp_path, stream=stream)
    answered: list[tuple[str, int, int]] = []
    # already durable before the task-path append is taken: no wait
    assert p.append_now(bytearray(make_batch([b"A"])), 9,
                        lambda r: answered.append(("A", r.error, r.base_offset)))
    stream.direct[0].set_result(None)
    await asyncio.sleep(0)
    assert answered == [("A", 0, 0)]
    rb = await asyncio.wait_for(p.append(make_batch([b"B"])), 5)
    assert (rb.error, rb.base_offset) == (0, 1)

    # still pending: the task-path append waits for it, and is answered after it
    assert p.append_now(bytearray(make_batch([b"C"])), 9,
                        lambda r: answered.append(("C", r.error, r.base_offset)))
    d = asyncio.ensure_future(p.append(make_batch([b"D"])))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not d.done() and answered[1:] == []
    stream.direct[1].set_result(None)
    rd = await asyncio.wait_for(d, 5)
    assert (rd.error, rd.base_offset) == (0, 3)
    assert answered[1:] == [("C", 0, 2)]
    assert await values(p) == [(0, b"A"), (1, b"B"), (2, b"C"), (3, b"D")]

    # its WAL write fails: the append behind it fails too, none is answered with an offset
    assert p.append_now(bytearray(make_batch([b"E"])), 9,
                        lambda r: answered.append(("E", r.error, r.base_offset)))
    f = asyncio.ensure_future(p.append(make_batch([b"F"])))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not f.done()
    stream.direct[2].set_exception(OSError("disk gone"))
    rf = await asyncio.wait_for(f, 5)
    assert rf.error == ErrorCode.KAFKA_STORAGE_ERROR
    assert [(n, e) for n, e, _ in answered[2:]] == [("E", ErrorCode.KAFKA_STORAGE_ERROR)]


async def test_admission_line_hands_over_in_order_times_out_and_survives_cancels():
    """The partition's admission line (_Admission): waiters are handed the lock in arrival
    order; one whose time runs out first gives up (False) and is skipped; one cancelled
    while waiting leaves the line; one cancelled after it was handed the lock passes it on."""
    from broker.partition import _Admission

    a = _Admission()
    assert a.try_take() and not a.try_take()
    first = asyncio.ensure_future(a.take(30))
    late = asyncio.ensure_future(a.take(0.01))
    gone = asyncio.ensure_future(a.take(30))
    last = asyncio.ensure_future(a.take(30))
    await asyncio.sleep(0.05)                 # past late's timer, before any hand-over
    assert late.done() and late.result() is False
    gone.cancel()
    await asyncio.sleep(0)
    assert len(a._waiters) == 2                  # first and last wait; late and gone left
    a.release()
    assert await first is True and a.held
    a.release()                                  # to last (late and gone are skipped) ...
    last.cancel()                                # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await last
    assert not a.held and not a._waiters         # it passed the lock on: nobody left
    assert a.try_take()
