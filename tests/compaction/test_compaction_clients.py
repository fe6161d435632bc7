"""Compacted topics end to end: librdkafka (confluent-kafka) produces many updates per key and
tombstones; the broker's log cleaner compacts the uploaded objects; librdkafka and Java
kafka-clients consumers then read exactly the latest value of every live key, at the offsets
it was produced at, and the objects shrink. A consumer reading while the cleaner rewrites
never sees a key go backwards."""
from __future__ import annotations

import pathlib
import threading
import time


from clients.e2e_helpers import JavaCli, compile_java, unique

BROKER_ARGS = ["--upload-interval-s", "0.3", "--log-cleaner-backoff-ms", "300",
               "--cleanup-interval-s", "0.5"]
KEYS = 40
ROUNDS = 25


def objects(data_dir: pathlib.Path) -> tuple[int, int]:
    """(count, bytes) of the broker's file:// object store."""
    files = [f for f in (data_dir / "objects").rglob("*") if f.is_file()]
    return len(files), sum(f.stat().st_size for f in files)


def admin(bootstrap: str):
    from confluent_kafka.admin import AdminClient
    return AdminClient({"bootstrap.servers": bootstrap})


def create(bootstrap: str, topic: str, configs: dict[str, str]) -> None:
    from confluent_kafka.admin import NewTopic
    a = admin(bootstrap)            # referenced until the futures complete
    for f in a.create_topics([NewTopic(topic, 1, 1, config=configs)]).values():
        f.result(30)


def set_configs(bootstrap: str, topic: str, configs: dict[str, str]) -> None:
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource
    res = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[
        ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
        for k, v in configs.items()])
    a = admin(bootstrap)
    for f in a.incremental_alter_configs([res]).values():
        f.result(30)


def produce(bootstrap: str, topic: str, items: list[tuple[bytes, bytes | None]]) -> list[int]:
    """Idempotent librdkafka producer; returns the offset of every item."""
    from confluent_kafka import Producer
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                  "linger.ms": 2, "compression.type": "lz4"})
    offsets: list[int] = [-1] * len(items)

    def done(i: int):
        def cb(err, msg) -> None:
            assert err is None, err
            offsets[i] = msg.offset()
        return cb

    for i, (k, v) in enumerate(items):
        p.produce(topic, key=k, value=v, partition=0, on_delivery=done(i))
        if i % 50 == 49:
            p.poll(0)
    assert p.flush(30) == 0
    assert -1 not in offsets
    return offsets


def read_all(bootstrap: str, topic: str, isolation: str = "read_committed"
             ) -> list[tuple[int, bytes | None, bytes | None]]:
    """Every record from the beginning to the high watermark (librdkafka)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": unique("g"),
                  "enable.auto.commit": False, "fetch.wait.max.ms": 50,
                  "enable.partition.eof": True, "isolation.level": isolation})
    try:
        c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        out: list[tuple[int, bytes | None, bytes | None]] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None:
                continue
            if m.error() is not None:
                if m.error().code() == KafkaError._PARTITION_EOF:
                    return out          # the fetch position reached the high watermark
                raise AssertionError(m.error())
            out.append((m.offset(), m.key(), m.value()))
        raise AssertionError("did not reach the high watermark")
    finally:
        c.close()


def test_compacted_topic_latest_value_per_key(broker_factory, java_classpath) -> None:
    b = broker_factory(BROKER_ARGS)
    topic = unique("compact")
    create(b.bootstrap, topic, {"cleanup.policy": "delete", "delete.retention.ms": "1500",
                                "min.cleanable.dirty.ratio": "0.01"})
    items = [(b"key-%d" % k, b"value-%d-%d" % (k, r) * 5) for r in range(ROUNDS)
             for k in range(KEYS)]
    items += [(b"key-%d" % k, None) for k in range(0, KEYS, 4)]      # tombstones
    offsets: list[int] = []
    step = len(items) // 5 + 1
    for i in range(0, len(items), step):              # several uploads: several objects
        offsets += produce(b.bootstrap, topic, items[i:i + step])
        time.sleep(0.5)
    latest: dict[bytes, tuple[int, bytes | None]] = {}
    for (k, v), o in zip(items, offsets):
        latest[k] = (o, v)
    expect = sorted((o, k, v) for k, (o, v) in latest.items() if v is not None)
    time.sleep(0.5)                                   # uploaded (--upload-interval-s 0.3)
    n_before, bytes_before = objects(b.data_dir)
    assert n_before >= 3 and bytes_before > 0
    set_configs(b.bootstrap, topic, {"cleanup.policy": "compact"})
    deadline = time.monotonic() + 30
    got = read_all(b.bootstrap, topic)
    while got != expect and time.monotonic() < deadline:
        time.sleep(0.5)            # tombstones go once delete.retention.ms passed
        got = read_all(b.bootstrap, topic)
    assert got == expect
    time.sleep(1.2)                                   # the replaced objects are deleted
    n_after, bytes_after = objects(b.data_dir)
    print(f"objects {n_before} -> {n_after}, bytes {bytes_before} -> {bytes_after}")
    assert n_after < n_before and bytes_after < bytes_before / 5
    assert "log cleaner topic=" + topic in b.log_text()
    # Java kafka-clients read the same records, and their position reaches the end offset
    want = [{"p": 0, "o": o, "k": k.decode(), "v": v.decode()} for o, k, v in expect]
    for version, cp in java_classpath.items():
        res = JavaCli(version, compile_java(version, cp))(
            "consume-assign", bootstrap=b.bootstrap, topic=topic, count=len(expect),
            timeout_ms=20000)
        got_j = [{f: r[f] for f in ("p", "o", "k", "v")} for r in res["records"]]
        assert got_j == want, version
        assert res["position"] == res["end_offset"] == offsets[-1] + 1, version


def test_reader_during_compaction_never_sees_a_key_go_back(broker_factory) -> None:
    b = broker_factory(BROKER_ARGS)
    topic = unique("compact-live")
    create(b.bootstrap, topic, {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.01",
                                "segment.bytes": "1048576"})
    stop = threading.Event()
    errors: list[str] = []
    scans = [0]

    def reader() -> None:
        while not stop.is_set():
            seen: dict[bytes, int] = {}
            last = -1
            for o, k, v in read_all(b.bootstrap, topic):
                rnd = int(v.split(b"-")[1])
                if o <= last or rnd < seen.get(k, -1):
                    errors.append(f"offset {o} key {k!r} round {rnd} after {seen.get(k)}")
                seen[k] = rnd
                last = o
            scans[0] += 1

    produce(b.bootstrap, topic, [(b"k%d" % k, b"v-0-%d" % k) for k in range(KEYS)])
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        for rnd in range(1, 16):
            produce(b.bootstrap, topic, [(b"k%d" % k, b"v-%d-%d" % (rnd, k))
                                         for k in range(KEYS)])
            time.sleep(0.3)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors[:5]
    assert scans[0] >= 3
    passes = b.log_text().count("log cleaner topic=" + topic)
    assert passes >= 2, "the cleaner ran while the reader read"
    final = read_all(b.bootstrap, topic)
    assert {k: v for _, k, v in final} == {b"k%d" % k: b"v-15-%d" % k for k in range(KEYS)}


def test_crash_during_rewrite_then_restarts(broker_factory) -> None:
    """kill -9 between writing the rewritten objects and committing them: the old objects stay
    the truth; after the restart the cleaner finishes the job, and a graceful restart later
    reads the compacted log back (its state from the checkpoint: no second full pass)."""
    b = broker_factory(BROKER_ARGS, env={"S3KAFKA_CRASH_POINT": "during_rewrite"})
    topic = unique("compact-crash")
    create(b.bootstrap, topic, {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.01"})
    items = [(b"k%d" % k, b"v-%d-%d" % (r, k)) for r in range(10) for k in range(KEYS)]
    offsets = produce(b.bootstrap, topic, items)
    expect = sorted({k: (o, k, v) for (k, v), o in zip(items, offsets)}.values())
    assert b.proc is not None
    assert b.proc.wait(30) == 137, "the crash point was reached"
    b.env = None                                      # restart without the crash point
    b.start()
    deadline = time.monotonic() + 30
    while (got := read_all(b.bootstrap, topic)) != expect and time.monotonic() < deadline:
        seen = {k: int(v.split(b"-")[1]) for _, k, v in got}
        assert set(seen) == {k for k, _ in items}     # never a key lost meanwhile
        time.sleep(0.5)
    assert got == expect
    passes = b.log_text().count("log cleaner topic=" + topic)
    b.restart()
    assert read_all(b.bootstrap, topic) == expect
    produce(b.bootstrap, topic, [(b"k0", b"v-10-0")])  # producers go on after the restart
    deadline = time.monotonic() + 20
    while (text := b.log_text()).count("log cleaner topic=" + topic) <= passes \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert text.count("log cleaner topic=" + topic) >= passes + 1
    last_pass = text.split("log cleaner topic=" + topic)[-1].splitlines()[0]
    assert " keys=1 " in last_pass, "the checkpoint survived: only the new record was dirty"
    final = read_all(b.bootstrap, topic)
    assert final[-1][1:] == (b"k0", b"v-10-0") and len(final) == KEYS


def test_aborted_transactions_and_their_markers_cleaned(broker_factory) -> None:
    """A transactional librdkafka producer aborts one transaction and commits the next on a
    compacted topic: the cleaner removes the aborted records (read_uncommitted readers stop
    seeing them; read_committed readers see the same records throughout) and, once
    delete.retention.ms has passed, the ABORT marker whose data is gone."""
    from confluent_kafka import Producer
    b = broker_factory(BROKER_ARGS)
    topic = unique("compact-txn")
    create(b.bootstrap, topic, {"cleanup.policy": "delete", "delete.retention.ms": "1000",
                                "min.cleanable.dirty.ratio": "0.01"})
    p = Producer({"bootstrap.servers": b.bootstrap, "transactional.id": unique("ctid"),
                  "linger.ms": 2})
    p.init_transactions(30)
    p.begin_transaction()
    for k in range(KEYS):
        p.produce(topic, key=b"a%d" % k, value=b"aborted", partition=0)
    assert p.flush(30) == 0
    p.abort_transaction(30)
    p.begin_transaction()
    for k in range(KEYS):
        p.produce(topic, key=b"t%d" % k, value=b"committed", partition=0)
    p.commit_transaction(30)
    offsets: list[int] = []
    items = [(b"k%d" % k, b"v-%d-%d" % (r, k)) for r in range(3) for k in range(KEYS)]
    for r in range(3):                                # a few objects after the transactions
        offsets += produce(b.bootstrap, topic, items[r * KEYS:(r + 1) * KEYS])
        time.sleep(0.4)
    committed = read_all(b.bootstrap, topic)
    uncommitted = read_all(b.bootstrap, topic, "read_uncommitted")
    assert sum(v == b"aborted" for _, _, v in uncommitted) == KEYS
    assert not any(v == b"aborted" for _, _, v in committed)
    set_configs(b.bootstrap, topic, {"cleanup.policy": "compact"})
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        uncommitted = read_all(b.bootstrap, topic, "read_uncommitted")
        if not any(v == b"aborted" for _, _, v in uncommitted) and \
                "markers_dropped=1" in b.log_text():
            break
        time.sleep(0.5)
    assert not any(v == b"aborted" for _, _, v in uncommitted), "aborted records not cleaned"
    assert "markers_dropped=1" in b.log_text(), "the ABORT marker was not removed"
    want = {(k, v) for _, k, v in committed if not k.startswith(b"k")} | \
        {(k, v) for k, v in items[2 * KEYS:]}
    final = read_all(b.bootstrap, topic)
    assert {(k, v) for _, k, v in final} == want
    assert read_all(b.bootstrap, topic, "read_uncommitted") == final
