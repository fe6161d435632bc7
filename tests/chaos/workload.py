"""A queue workload for chaos tests and its checker (reusable for single-broker and cluster
fault schedules).

Several idempotent, acks=all producers of two client libraries (confluent-kafka and
kafka-python) write unique values ``<writer>|<n>|`` to every partition of one topic, each
value once, and record what every send was answered with: acknowledged at (partition,
offset), or failed. After the faults, one full read of every partition checks that

- no acknowledged value is lost,
- no value is stored at two offsets,
- each acknowledged value sits at the offset its acknowledgement named,
- each writer's values are in send order within a partition,

and reports the op counts (acked, failed, unresolved, failed-but-stored) and the anomalies.
Everything is bounded: writers stop on an event or a count, reads on a deadline.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import Errors, code_retriable
from .threads import WorkerThread

PAD = b"." * 500
# librdkafka's idempotence and batch debug lines ("eos,msg") go here when it has a handler
# (the cluster harness writes them to rdkafka.log): the evidence for a client-side fatal error
RDKAFKA_LOG = logging.getLogger("chaos.rdkafka")


class RdkafkaDebugLog:
    """Between ``start()`` and ``stop()`` the confluent-kafka writers log librdkafka's
    idempotence and message debug lines (``RDKAFKA_LOG``) to ``path`` (None: nowhere): the
    client's side of an anomaly. ``stop()`` is safe when ``start()`` never ran, so a
    harness calls it in the ``finally`` of the ``try`` that starts it."""

    def __init__(self, path: "os.PathLike[str] | str | None") -> None:
        self.path = path
        self._handler: logging.Handler | None = None
        self._saved = RDKAFKA_LOG.propagate, RDKAFKA_LOG.level

    def start(self) -> None:
        if self.path is None or self._handler is not None:
            return
        self._handler = logging.FileHandler(self.path)
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(message)s"))
        self._saved = RDKAFKA_LOG.propagate, RDKAFKA_LOG.level
        RDKAFKA_LOG.propagate = False
        RDKAFKA_LOG.setLevel(logging.DEBUG)
        RDKAFKA_LOG.addHandler(self._handler)

    def stop(self) -> None:
        handler, self._handler = self._handler, None
        if handler is None:
            return
        RDKAFKA_LOG.removeHandler(handler)
        RDKAFKA_LOG.propagate, level = self._saved
        RDKAFKA_LOG.setLevel(level)
        handler.close()


def value_of(writer: str, n: int) -> bytes:
    return f"{writer}|{n:09d}|".encode() + PAD


def parse(value: bytes) -> tuple[str, int] | None:
    parts = value.split(b"|", 2)
    if len(parts) < 3:
        return None
    try:
        return parts[0].decode(), int(parts[1])
    except ValueError:
        return None


@dataclass
class Ledger:
    """What every writer sent and how each send was answered (thread-safe)."""

    sent: dict[bytes, int] = field(default_factory=dict)             # value -> partition
    acked: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # value -> (p, offset)
    failed: dict[bytes, str] = field(default_factory=dict)           # value -> error
    acked_at: dict[bytes, float] = field(default_factory=dict)       # value -> monotonic time
    fatal: int = 0                                                   # producers recreated
    errors: Errors = field(default_factory=Errors)                   # by kind, retriable?
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, value: bytes, partition: int) -> None:
        with self.lock:
            self.sent[value] = partition

    def ack(self, value: bytes, partition: int, offset: int) -> None:
        with self.lock:
            self.acked[value] = (partition, offset)
            self.acked_at[value] = time.monotonic()
            self.failed.pop(value, None)

    def fail(self, value: bytes, error: str, kind: str = "", retriable: bool = True) -> None:
        self.errors.add(f"produce:{kind or 'error'}", retriable, error)
        with self.lock:
            if value not in self.acked:
                self.failed[value] = error


class _Writer(WorkerThread):
    def __init__(self, name: str, bootstrap: str, topic: str, partitions: int, ledger: Ledger,
                 stop: threading.Event, max_values: int, rate: float) -> None:
        super().__init__(f"writer-{name}")
        self.wname, self.bootstrap, self.topic = name, bootstrap, topic
        self.partitions, self.ledger, self.stop_ev = partitions, ledger, stop
        self.max_values, self.interval = max_values, 1.0 / rate
        self._next_t = 0.0

    def _value(self, n: int) -> tuple[int, bytes]:
        """The partition and value of this writer's n-th send (round robin)."""
        return n % self.partitions, value_of(self.wname, n)

    def _pace(self, wait: Callable[[float], Any]) -> None:
        """After a value is sent: ``wait`` out the time to the next send at the writer's rate, or
        start the schedule again from now when behind it."""
        self._next_t += self.interval
        delay = self._next_t - time.monotonic()
        if delay > 0:
            wait(delay)
        else:
            self._next_t = time.monotonic()


class ConfluentWriter(_Writer):
    """librdkafka: enable.idempotence, acks=all; a fatal idempotence error recreates the
    producer (and is counted: with a correct broker there are none)."""

    def _producer(self) -> Any:
        from confluent_kafka import Producer
        errs = self.ledger.errors

        def on_error(err: Any) -> None:
            errs.add(f"producer:{err.name()}", code_retriable(err.code()) and not err.fatal(),
                     str(err))
        conf = {"bootstrap.servers": self.bootstrap, "enable.idempotence": True,
                "error_cb": on_error, "acks": "all", "linger.ms": 5,
                "message.timeout.ms": 120000,
                "retry.backoff.ms": 100, "reconnect.backoff.max.ms": 500,
                "topic.metadata.refresh.interval.ms": 2000, "log_level": 2}
        if RDKAFKA_LOG.handlers:
            conf.update({"debug": "eos,msg", "logger": RDKAFKA_LOG})
        return Producer(conf)

    def _run(self) -> None:
        from confluent_kafka import KafkaError, KafkaException
        p = self._producer()
        led = self.ledger

        def cb(err: Any, msg: Any) -> None:
            if err is None:
                led.ack(msg.value(), msg.partition(), msg.offset())
            else:
                led.fail(msg.value(), str(err), err.name(),
                         code_retriable(err.code()) and not err.fatal())
        n = 0
        self._next_t = time.monotonic()
        while not self.stop_ev.is_set() and n < self.max_values:
            part, v = self._value(n)
            try:
                p.produce(self.topic, v, partition=part, on_delivery=cb)
            except BufferError:
                p.poll(0.05)
                continue
            except KafkaException as e:
                err = e.args[0] if e.args else None
                if err is not None and (err.fatal() or err.code() == KafkaError._FATAL):
                    led.fatal += 1
                    p.flush(5)
                    p = self._producer()
                    continue
                raise
            led.send(v, part)
            n += 1
            p.poll(0)
            self._pace(p.poll)
        self._flush(p)

    def _flush(self, p: Any) -> None:
        deadline = time.monotonic() + 150
        while len(p) and time.monotonic() < deadline:
            p.poll(0.2)


class KafkaPythonWriter(_Writer):
    """kafka-python: enable_idempotence, acks=all."""

    def _run(self) -> None:
        from kafka import KafkaProducer
        p = KafkaProducer(bootstrap_servers=self.bootstrap, enable_idempotence=True, acks="all",
                          linger_ms=5, retries=2**31 - 1, delivery_timeout_ms=120000,
                          request_timeout_ms=20000, retry_backoff_ms=100,
                          reconnect_backoff_max_ms=500, metadata_max_age_ms=2000,
                          max_in_flight_requests_per_connection=5)
        led = self.ledger
        n = 0
        self._next_t = time.monotonic()
        while not self.stop_ev.is_set() and n < self.max_values:
            part, v = self._value(n)
            try:
                fut = p.send(self.topic, v, partition=part)
            except Exception as e:  # noqa: BLE001 - buffer full / metadata: try again
                time.sleep(0.05)
                if "Fatal" in type(e).__name__:
                    led.fatal += 1
                continue
            led.send(v, part)
            fut.add_callback(lambda md, v=v: led.ack(v, md.partition, md.offset))
            fut.add_errback(lambda e, v=v: led.fail(v, repr(e), type(e).__name__,
                                                    bool(getattr(e, "retriable", False))))
            n += 1
            self._pace(time.sleep)
        try:
            p.flush(150)
        finally:
            p.close(5)


def start_writers(bootstrap: str, topic: str, partitions: int, ledger: Ledger,
                  stop: threading.Event, confluent: int = 3, kafka_python: int = 2,
                  max_values: int = 10**6, rate: float = 300.0) -> list[_Writer]:
    """Start the writers (``rate`` values/s each, ``max_values`` at most)."""
    ws: list[_Writer] = []
    for i in range(confluent):
        ws.append(ConfluentWriter(f"ck{i}", bootstrap, topic, partitions, ledger, stop,
                                  max_values, rate))
    for i in range(kafka_python):
        ws.append(KafkaPythonWriter(f"kp{i}", bootstrap, topic, partitions, ledger, stop,
                                    max_values, rate))
    for w in ws:
        w.start()
    return ws


def read_all(bootstrap: str, topic: str, partitions: int, timeout: float = 60.0,
             limit: float = 900.0) -> list[tuple[int, int, bytes]]:
    """(partition, offset, value) of every record up to each partition's high watermark.

    Fails when no record arrived for ``timeout`` s (a partition whose tail cannot be read),
    or after ``limit`` s in all: the 30-minute schedule's log (~1 M values, ~550 MB, read
    cold from the object store while both groups read too) takes longer than any fixed
    ``timeout`` that still catches a stuck tail quickly (session 18's long run: 99.6 % read
    when a 120 s deadline for the whole read ran out, no read failing)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"chaos-check-{time.time_ns()}",
                  "enable.auto.commit": False, "fetch.max.bytes": 8 << 20, "log_level": 2})
    try:
        highs = {}
        t0 = time.monotonic()
        deadline = t0 + timeout
        for p in range(partitions):
            while True:
                try:
                    highs[p] = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                    break
                except Exception:  # noqa: BLE001 - broker still starting
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        out: list[tuple[int, int, bytes]] = []
        pos = {p: 0 for p in range(partitions)}
        done = {p for p in range(partitions) if highs[p] == 0}
        while len(done) < partitions and time.monotonic() < deadline:
            for m in c.consume(1000, timeout=1.0):
                if m.error():
                    continue
                deadline = min(t0 + limit, time.monotonic() + timeout)    # progress
                out.append((m.partition(), m.offset(), m.value()))
                pos[m.partition()] = m.offset() + 1
                if pos[m.partition()] >= highs[m.partition()]:
                    done.add(m.partition())
        if len(done) < partitions:
            raise AssertionError(f"read incomplete after {time.monotonic() - t0:.0f} s "
                                 f"(no progress for {timeout:.0f} s or {limit:.0f} s in all):"
                                 f" {pos} of {highs}")
        return out
    finally:
        c.close()


@dataclass
class Report:
    sent: int
    acked: int
    failed: int
    unresolved: int
    failed_but_stored: int
    stored: int
    fatal: int
    lost: list[bytes]
    duplicated: list[bytes]
    wrong_offset: list[tuple[bytes, tuple[int, int], tuple[int, int]]]
    out_of_order: list[tuple[str, int, int, int]]
    # acknowledged without an offset (librdkafka acks a batch "persisted" when the broker
    # answers its retry with an error instead of the original offset): not checkable
    no_offset: list[bytes] = field(default_factory=list)

    @property
    def anomalies(self) -> int:
        return (len(self.lost) + len(self.duplicated) + len(self.wrong_offset)
                + len(self.out_of_order) + len(self.no_offset))

    def summary(self) -> str:
        return (f"ops: sent={self.sent} acked={self.acked} failed={self.failed} "
                f"unresolved={self.unresolved} failed_but_stored={self.failed_but_stored} "
                f"stored={self.stored} producers_recreated={self.fatal} | anomalies: "
                f"lost={len(self.lost)} duplicated={len(self.duplicated)} "
                f"wrong_offset={len(self.wrong_offset)} out_of_order={len(self.out_of_order)} "
                f"acked_without_offset={len(self.no_offset)}")


def check(ledger: Ledger, records: list[tuple[int, int, bytes]]) -> Report:
    """Compare what was acknowledged with what one full read found."""
    where: dict[bytes, list[tuple[int, int]]] = defaultdict(list)
    for p, o, v in records:
        if v is not None and parse(v) is not None:
            where[v].append((p, o))
    with ledger.lock:
        sent, acked, failed = dict(ledger.sent), dict(ledger.acked), dict(ledger.failed)
    lost = [v for v in acked if v not in where]
    duplicated = [v for v, locs in where.items() if len(locs) > 1]
    no_offset = [v for v, (_p, o) in acked.items() if o is None or o < 0]
    wrong = [(v, at, where[v][0]) for v, at in acked.items()
             if v in where and len(where[v]) == 1 and where[v][0] != at
             and at[1] is not None and at[1] >= 0]
    per: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    for p, o, v in records:
        w = parse(v) if v is not None else None
        if w is not None:
            per[(w[0], p)].append((o, w[1]))
    disorder = []
    for (writer, p), seq in per.items():
        seq.sort()
        for (o1, n1), (o2, n2) in zip(seq, seq[1:]):
            if n2 <= n1:
                disorder.append((writer, p, o2, n2))
    unresolved = len([v for v in sent if v not in acked and v not in failed])
    return Report(sent=len(sent), acked=len(acked), failed=len(failed), unresolved=unresolved,
                  failed_but_stored=len([v for v in failed if v in where]),
                  stored=len(where), fatal=ledger.fatal, lost=lost, duplicated=duplicated,
                  wrong_offset=wrong, out_of_order=disorder, no_offset=no_offset)
