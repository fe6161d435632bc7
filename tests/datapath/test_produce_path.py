"""The produce hot path over a real socket: pipelined requests answered in order, large frames
received straight into their own buffer (also when they arrive in pieces), offsets written
into the owned request frame, CRC checks still applied on that path."""
from __future__ import annotations

import socket
import time
import uuid

import pytest

from kafka.protocol.producer import ProduceRequest, ProduceResponse

from .batches import make_batch, read_records
from .wire import WireClient

pytestmark = pytest.mark.e2e

E_NONE, E_CORRUPT, E_UNKNOWN = 0, 2, 3


def _topic() -> str:
    return "pp-" + uuid.uuid4().hex[:10]


def _frame(topic: str, records: bytes, corr: int, version: int = 9, partition: int = 0,
           acks: int = -1) -> bytes:
    TD = ProduceRequest.TopicProduceData
    req = ProduceRequest(transactional_id=None, acks=acks, timeout_ms=30000,
                         topic_data=[TD(name=topic, partition_data=[
                             TD.PartitionProduceData(index=partition, records=records)])])
    req.with_header(correlation_id=corr, client_id="produce-path-tests")
    return bytes(req.encode(version=version, header=True, framed=True))


def _read_response(c: WireClient, version: int = 9) -> tuple[int, object]:
    resp = ProduceResponse.decode(c.recv_frame(), version=version, header=True)
    return resp.header.correlation_id, resp.responses[0].partition_responses[0]


def _corrupt(batch: bytes) -> bytes:
    raw = bytearray(batch)
    raw[-3] ^= 0x5A  # inside the records: only the CRC-32C can tell
    return bytes(raw)


@pytest.fixture
def client(module_broker):
    with WireClient(module_broker.host, module_broker.port) as c:
        yield c


def test_pipelined_mixed_requests_answered_in_order(client):
    """Kafka clients keep up to 5 requests in flight; here 40 (small, large, corrupt, unknown
    partition) are sent before reading anything: every answer comes back in request order."""
    t = _topic()
    client.create_topic(t)
    plan = []  # (correlation id, expected error, values)
    out = bytearray()
    for i in range(40):
        corr = 1000 + i
        if i % 10 == 3:  # large: a frame received into its own buffer
            values = [bytes([i]) * 100_000, bytes([i + 1]) * 150_000]
        else:
            values = [f"m{i}-{k}".encode() for k in range(3)]
        batch = make_batch(values)
        if i % 10 == 7:
            out += _frame(t, _corrupt(batch), corr)
            plan.append((corr, E_CORRUPT, None))
        elif i % 13 == 5:
            out += _frame(t, batch, corr, partition=9)
            plan.append((corr, E_UNKNOWN, None))
        else:
            out += _frame(t, batch, corr)
            plan.append((corr, E_NONE, values))
    client.sock.sendall(out)
    expected_offset = 0
    stored = []
    for corr, err, values in plan:
        got_corr, part = _read_response(client)
        assert got_corr == corr
        assert part.error_code == err
        if err == E_NONE:
            assert part.base_offset == expected_offset
            expected_offset += len(values)
            stored.extend(values)
        else:
            assert part.base_offset == -1
    fetched = []
    offset = 0
    while offset < expected_offset:
        recs = read_records(client.fetch(t, offset, partition_max_bytes=50 << 20).records)
        assert recs
        fetched.extend(recs)
        offset = recs[-1][0] + 1
    assert [o for o, _, _ in fetched] == list(range(expected_offset))
    assert [v for _, _, v in fetched] == stored


def test_large_frame_arriving_in_pieces(module_broker):
    """A 1 MiB request whose bytes trickle in (length prefix split too) lands intact; the
    request after it on the same connection is framed correctly."""
    t = _topic()
    values = [bytes(range(256)) * 1000 + bytes([k]) for k in range(4)]
    big = _frame(t, make_batch(values), 7)
    small = _frame(t, make_batch([b"after"]), 8)
    with WireClient(module_broker.host, module_broker.port) as c:
        c.create_topic(t)
        c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cuts = [2, 3, 100, 70_000, 300_000, len(big) - 1]
        prev = 0
        for cut in cuts:
            c.sock.sendall(big[prev:cut])
            time.sleep(0.02)  # pacing only, so the broker sees partial frames
            prev = cut
        c.sock.sendall(big[prev:] + small)
        corr, part = _read_response(c)
        assert (corr, part.error_code, part.base_offset) == (7, E_NONE, 0)
        corr, part = _read_response(c)
        assert (corr, part.error_code, part.base_offset) == (8, E_NONE, 4)
        recs = read_records(c.fetch(t, 0).records)
        assert [v for _, _, v in recs] == values + [b"after"]


def test_corrupt_large_batch_rejected_and_connection_kept(client):
    t = _topic()
    client.create_topic(t)
    bad = _corrupt(make_batch([b"z" * 400_000]))
    client.sock.sendall(_frame(t, bad, 1))
    assert _read_response(client)[1].error_code == E_CORRUPT
    good = make_batch([b"g" * 400_000])
    client.sock.sendall(_frame(t, good, 2))
    corr, part = _read_response(client)
    assert (corr, part.error_code, part.base_offset) == (2, E_NONE, 0)
    assert client.fetch(t, 0).high_watermark == 1


@pytest.mark.parametrize("acks", [0, 1])
def test_large_acks0_and_acks1_pipelined(client, acks):
    """acks=0 requests get no answer but keep their place: the next acked answer still
    matches its own correlation id."""
    t = _topic()
    client.create_topic(t)
    batch = make_batch([b"q" * 200_000])
    client.sock.sendall(_frame(t, batch, 1, acks=acks) + _frame(t, batch, 2, acks=-1))
    if acks:
        corr, part = _read_response(client)
        assert (corr, part.base_offset) == (1, 0)
    corr, part = _read_response(client)
    assert (corr, part.error_code, part.base_offset) == (2, E_NONE, 1)


def test_reused_frame_buffers_never_mix_payloads(client):
    """Large frames come from a pool of reused buffers: 30 pipelined ~300 KB requests of
    varying size and distinct content are stored exactly as sent."""
    t = _topic()
    client.create_topic(t)
    sent = []
    out = bytearray()
    for i in range(30):
        values = [bytes([i % 251]) * (250_000 + 7919 * (i % 5)), f"tail-{i}".encode()]
        sent.extend(values)
        out += _frame(t, make_batch(values), 500 + i)
    client.sock.sendall(out)
    for i in range(30):
        corr, part = _read_response(client)
        assert (corr, part.error_code, part.base_offset) == (500 + i, E_NONE, 2 * i)
    fetched = []
    offset = 0
    while offset < len(sent):
        recs = read_records(client.fetch(t, offset, partition_max_bytes=50 << 20).records)
        fetched.extend(v for _, _, v in recs)
        offset = recs[-1][0] + 1
    assert fetched == sent


def test_reading_paused_at_max_inflight_with_large_frames(broker_factory):
    """With --max-inflight-requests 2 reading pauses while two requests are unanswered, also
    in the middle of large frames received in place: 12 pipelined 200 KB requests still all
    land, in order."""
    b = broker_factory(["--wal-capacity", str(256 << 20), "--max-inflight-requests", "2"])
    t = _topic()
    with WireClient(b.host, b.port) as c:
        c.create_topic(t)
        values = [bytes([i]) * 200_000 for i in range(12)]
        c.sock.sendall(b"".join(_frame(t, make_batch([v]), 40 + i) for i, v in enumerate(values)))
        for i in range(12):
            corr, part = _read_response(c)
            assert (corr, part.error_code, part.base_offset) == (40 + i, E_NONE, i)
        got = []
        while len(got) < 12:
            got.extend(v for _, _, v in read_records(c.fetch(t, len(got)).records))
        assert got == values


def test_client_gone_in_the_middle_of_a_large_frame(client, module_broker):
    """Half a 1 MiB frame, then the client disconnects: the broker drops it and serves others."""
    t = _topic()
    client.create_topic(t)
    frame = _frame(t, make_batch([b"h" * (1 << 20)]), 3)
    with socket.create_connection((module_broker.host, module_broker.port)) as s:
        s.sendall(frame[:len(frame) // 2])
    r = client.produce(t, make_batch([b"still here"]))
    assert (r.error_code, r.base_offset) == (E_NONE, 0)


def test_frames_recycled_from_the_log_cache_never_mix_payloads(broker_factory):
    """With a small LogCache, uploaded entries are evicted after every few requests and their
    request frames go back to the frame pool for the next large requests (issue 20): 60
    pipelined ~300 KB requests of distinct content, while a reader keeps fetching the tail
    (its views pin frames that must not be reused), are all read back exactly as sent."""
    b = broker_factory(["--wal-capacity", str(64 << 20), "--log-cache-bytes", str(4 << 20),
                        "--upload-threshold-bytes", str(1 << 20), "--upload-interval-s", "0.05"])
    t = _topic()
    sent = []
    with WireClient(b.host, b.port) as c, WireClient(b.host, b.port) as reader:
        c.create_topic(t)
        for rnd in range(3):
            out = bytearray()
            for i in range(20):
                n = rnd * 20 + i
                values = [bytes([n % 251]) * (300_000 + 4099 * (n % 7)), f"tail-{n}".encode()]
                sent.extend(values)
                out += _frame(t, make_batch(values), 700 + n)
            c.sock.sendall(out)
            for i in range(20):
                n = rnd * 20 + i
                corr, part = _read_response(c)
                assert (corr, part.error_code, part.base_offset) == (700 + n, E_NONE, 2 * n)
                if i % 5 == 0:
                    reader.fetch(t, 2 * n)
        fetched = []
        while len(fetched) < len(sent):
            recs = read_records(c.fetch(t, len(fetched), partition_max_bytes=8 << 20).records)
            fetched.extend(v for _, _, v in recs)
    assert fetched == sent


def test_frame_pool_takes_back_only_unshared_frames():
    """FramePool.recycle (called for evicted LogCache payloads) reuses a frame only when no
    view of it and no other reference is left."""
    from broker.server import FramePool

    pool = FramePool(arena=False)
    frame = bytearray(200_000)
    payload = memoryview(frame)[100:].cast("B")
    held = payload[10:20]              # a reader's slice still in flight
    pool.recycle([payload])
    assert pool.bytes == 0             # pinned by the reader's view
    assert bytes(payload[:3]) == bytes(3)   # and the view itself is still usable
    del payload, held
    pool.recycle([memoryview(frame)[100:]])
    assert pool.bytes == 0             # `frame` itself is still referenced here
    ident = id(frame)
    box = [memoryview(frame)[100:]]
    del frame
    pool.recycle(box)
    assert pool.bytes == 200_000 and box == []
    again = pool.take(199_000)
    assert id(again) == ident and len(again) == 199_000


def test_frame_pool_grows_a_smaller_pooled_frame_instead_of_faulting_in_a_new_one():
    """A request larger than every pooled frame takes the largest pooled frame of at least
    half its size, grown to it (only the added tail is new memory): the frames an earlier
    mix of smaller requests left (make bench's 100 B row, ~0.95 MB) serve the next, larger
    ones (its 1 KiB row, ~1.05 MB). They used to sit in the pool while every request faulted
    in a new frame (~0.9 GB in that row)."""
    from broker.frames import FramePool, _alloc_frame

    pool = FramePool(max_bytes=8 << 20, arena=False)
    try:
        frames = {n: _alloc_frame(n) for n in (400_000, 600_000, 990_000)}
        for n, frame in frames.items():
            frame[:4] = n.to_bytes(4, "big")
            pool.give(frame)
        ids = {n: id(frame) for n, frame in frames.items()}
        del frames, frame
        assert pool.bytes == 1_990_000
        first = pool.take(1_050_000)                 # the largest below it, grown
        assert (id(first), len(first)) == (ids[990_000], 1_050_000)
        assert bytes(first[:4]) == (990_000).to_bytes(4, "big")   # the same buffer
        second = pool.take(1_050_000)                # 600,000: still at least half of it
        assert (id(second), len(second)) == (ids[600_000], 1_050_000)
        third = pool.take(1_050_000)                 # 400,000 is less than half: a new frame
        assert id(third) != ids[400_000] and len(third) == 1_050_000
        assert pool.bytes == 400_000
        assert pool.take(390_000) is not None and pool.bytes == 0   # fits its allocation
    finally:
        pool.close()


def test_frame_prefill_of_varying_request_sizes_faults_in_about_what_is_taken(monkeypatch):
    """Requests of varying sizes (a linger-5 client: each one another size class) are served
    from frames of recent classes; the thread faults in about what is taken. It used to empty
    its whole ready queue (up to 32 MiB) at each class change and fault it in again."""
    import random
    import time

    from broker import frames as frames_mod
    from broker.frames import FramePool

    populated: list[int] = []
    real = frames_mod.populate

    def populate(buf):
        populated.append(len(buf))
        return real(buf)
    monkeypatch.setattr(frames_mod, "populate", populate)
    pool = FramePool(max_bytes=64 << 20, arena=False)
    rnd = random.Random(5)
    taken = 0
    try:
        for _ in range(300):
            size = rnd.randrange(300 << 10, 1 << 20)
            frame = pool.take(size)
            assert len(frame) == size
            taken += size
            time.sleep(0.002)                 # the thread refills meanwhile
        assert pool.prefilled >= 15           # served from the thread, at least in part
        assert sum(populated) <= 2 * taken + (16 << 20), (sum(populated) >> 20, taken >> 20)
    finally:
        pool.close()


def test_frame_prefill_serves_a_mix_of_request_sizes_without_dropping_frames():
    """A linger-5 producer's requests spread over 0.55-0.93 MB: the thread replaces each frame
    taken by one of its request's class, so nearly every request gets a prefilled frame and
    hardly a frame is thrown away. Frames of the largest recent class only served half of
    these and dropped one frame per miss (bench/HISTORY.md, session 26)."""
    import random
    import time

    from broker import frames as frames_mod
    from broker.frames import FramePool, size_class

    made: list[int] = []
    real = frames_mod.populate

    def populate(buf):
        made.append(len(buf))
        return real(buf)
    pool = FramePool(max_bytes=128 << 20, arena=False)
    rnd = random.Random(7)
    sizes = [560_000, 640_000, 700_000, 760_000, 820_000, 880_000, 930_000]
    top = size_class(max(sizes))                  # the thread stops short of its bound by less
    try:
        frames_mod.populate = populate
        pool.take(sizes[0])
        pre = pool._prefill
        hits = 0
        for i in range(150):
            deadline = time.monotonic() + 10      # the thread fills up to its bound first
            while pre._ready_bytes + top <= pre.ahead and time.monotonic() < deadline:
                time.sleep(0.002)
            before = pool.prefilled
            size = rnd.choice(sizes)
            frame = pool.take(size)
            assert len(frame) == size
            if i >= 50:                           # after the first RECENT requests' mix
                hits += pool.prefilled - before
        assert hits >= 95, hits
        deadline = time.monotonic() + 10          # the thread at its bound again
        while pre._ready_bytes + top <= pre.ahead and time.monotonic() < deadline:
            time.sleep(0.002)
        with pre._lock:
            ready = len(pre._ready)
        dropped = len(made) - pool.prefilled - ready - 1   # (-1: a frame being made)
        assert dropped <= 20, (len(made), pool.prefilled, ready)
    finally:
        frames_mod.populate = real
        pool.close()


def test_frame_pool_prefills_large_frames_off_the_loop():
    """While nothing is recycled (the LogCache filling), frames of PREFILL_FROM bytes and more
    come from the prefill thread, already faulted in: writing one takes no page faults."""
    import resource
    import time

    from broker.frames import PREFILL_FROM, FramePool, size_class

    pool = FramePool(max_bytes=64 << 20, arena=False)
    try:
        size = 1 << 20
        first = pool.take(size)                   # nothing ready yet: allocated here
        assert len(first) == size and pool.prefilled == 0
        deadline = time.monotonic() + 10
        while pool._prefill._ready_bytes < 4 * size and time.monotonic() < deadline:
            time.sleep(0.01)
        frame = pool.take(size - 1000)            # same size class
        assert pool.prefilled == 1 and len(frame) == size - 1000
        # this thread's faults only: the prefill thread goes on faulting in frames ahead
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        frame[::4096] = b"x" * len(range(0, len(frame), 4096))
        assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults < 16
        assert bytes(frame[4096:4097]) == b"x"
        small = pool.take(PREFILL_FROM - 1)       # below the prefill size: plain allocation
        assert pool.prefilled == 1 and len(small) == PREFILL_FROM - 1
        other = pool.take(3 << 20)                # another size class: made from now on
        assert pool.prefilled == 1 and len(other) == 3 << 20
        assert size_class(3 << 20) in pool._prefill._recent
    finally:
        pool.close()
