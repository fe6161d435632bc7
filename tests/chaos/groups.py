"""Consumers in groups for the chaos workload, what they saw and committed, and the checks.

Group members (confluent-kafka and kafka-python) subscribe to the topic, record every record
they receive with the assignment *session* it arrived in (a session is one stretch of owning
one partition, from an assignment to the next revocation), and commit synchronously every
``COMMIT_EVERY`` records, on revocation and when stopping. A monitor polls the committed
offsets of every group. After the run, against the final full read of the log:

- no consumer skips: inside a session each record is the next one the log holds after the
  previous; a session starts at the group's committed offset (the next record the log holds
  from there) or earlier only when a commit's outcome was unknown;
- no consumer goes backwards: offsets rise inside a session;
- what a consumer read at an offset is what the log holds there (and where it was acked);
- committed offsets never go backwards (each successful commit, and the monitor's view);
- every error a consumer saw is retriable.
"""
from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .errors import Errors, code_retriable
from .threads import WorkerThread

COMMIT_EVERY = 200

@dataclass
class ConsumeLog:
    """Everything the group members saw and committed (thread-safe)."""

    # (group, member, session, partition, offset, value)
    reads: list[tuple[str, str, int, int, int, bytes]] = field(default_factory=list)
    # (group, member, session, partition, time the session began)
    sessions: list[tuple[str, str, int, int, float]] = field(default_factory=list)
    # (group, partition, offset, time returned, ok): ok False = outcome unknown
    commits: list[tuple[str, int, int, float, bool]] = field(default_factory=list)
    # (group, partition, committed offset, time observed) from the monitor
    observed: list[tuple[str, int, int, float]] = field(default_factory=list)
    errors: Errors = field(default_factory=Errors)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _session: int = 0

    def new_session(self, group: str, member: str, partition: int) -> int:
        with self.lock:
            self._session += 1
            self.sessions.append((group, member, self._session, partition, time.monotonic()))
            return self._session


class _Member(WorkerThread):
    commit_on_revoke = True

    def __init__(self, name: str, bootstrap: str, topic: str, group: str, log: ConsumeLog,
                 stop: threading.Event) -> None:
        super().__init__(f"member-{name}")
        self.mname, self.bootstrap, self.topic, self.group = name, bootstrap, topic, group
        self.log, self.stop_ev = log, stop
        self.sess: dict[int, int] = {}         # partition -> session id
        self.pos: dict[int, int] = {}          # partition -> next offset to commit
        self.read = 0

    def _assigned(self, partitions: list[int]) -> None:
        for p in partitions:
            self.sess[p] = self.log.new_session(self.group, self.mname, p)
            self.pos.pop(p, None)

    def _revoked(self, partitions: list[int]) -> None:
        if self.commit_on_revoke:
            self._commit(partitions)
        for p in partitions:
            self.sess.pop(p, None)
            self.pos.pop(p, None)

    def _got(self, p: int, o: int, v: bytes) -> None:
        s = self.sess.get(p)
        if s is None:                          # a record of a partition not (yet) ours
            s = self.sess[p] = self.log.new_session(self.group, self.mname, p)
        with self.log.lock:
            self.log.reads.append((self.group, self.mname, s, p, o, v))
        self.pos[p] = o + 1
        self.read += 1

    def _consume(self, c: Any, poll: Callable[[], Iterable[tuple[int, int, bytes]]]) -> None:
        """Record each (partition, offset, value) ``poll()`` returns until stopped, committing
        every ``COMMIT_EVERY`` records and once at the end; then close the consumer ``c``."""
        since = 0
        try:
            while not self.stop_ev.is_set():
                for p, o, v in poll():
                    self._got(p, o, v)
                    since += 1
                if since >= COMMIT_EVERY:
                    self._commit()
                    since = 0
            self._commit()
        finally:
            c.close()

    def _commit(self, partitions: list[int] | None = None) -> None:
        """Commit the next offsets of ``partitions`` (default: all read) synchronously."""
        offs = {p: o for p, o in self.pos.items() if partitions is None or p in partitions}
        if offs:
            self._commit_offsets(offs)

    def _commit_offsets(self, offs: dict[int, int]) -> None:
        raise NotImplementedError

    def _record(self, offs: dict[int, int], ok: bool) -> None:
        """Log a commit of ``offs`` (ok False: its outcome is unknown)."""
        now = time.monotonic()
        with self.log.lock:
            for p, o in offs.items():
                self.log.commits.append((self.group, p, o, now, ok))


class ConfluentMember(_Member):
    """librdkafka consumer, manual synchronous commits."""

    def _run(self) -> None:
        from confluent_kafka import Consumer, KafkaException, TopicPartition  # noqa: PLC0415
        self._tp = TopicPartition
        self._kexc = KafkaException
        errs = self.log.errors

        def on_error(err: Any) -> None:
            errs.add(f"consumer:{err.name()}", code_retriable(err.code()) and not err.fatal(),
                     str(err))
        c = self.c = Consumer({
            "bootstrap.servers": self.bootstrap, "group.id": self.group,
            "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "session.timeout.ms": 10000, "heartbeat.interval.ms": 1000,
            "topic.metadata.refresh.interval.ms": 2000, "reconnect.backoff.max.ms": 500,
            "error_cb": on_error, "log_level": 2})
        c.subscribe([self.topic],
                    on_assign=lambda _c, tps: self._assigned([tp.partition for tp in tps]),
                    on_revoke=lambda _c, tps: self._revoked([tp.partition for tp in tps]))

        def poll() -> Iterator[tuple[int, int, bytes]]:
            for m in c.consume(500, timeout=0.2):
                if m.error():
                    e = m.error()
                    errs.add(f"consumer:{e.name()}", code_retriable(e.code()), str(e))
                    continue
                yield m.partition(), m.offset(), m.value()
        self._consume(c, poll)

    def _commit_offsets(self, offs: dict[int, int]) -> None:
        tps = [self._tp(self.topic, p, o) for p, o in offs.items()]
        try:
            res = self.c.commit(offsets=tps, asynchronous=False)
        except self._kexc as e:
            err = e.args[0]
            self.log.errors.add(f"commit:{err.name()}", code_retriable(err.code()), str(err))
            self._record(offs, ok=False)
            return
        now = time.monotonic()
        with self.log.lock:
            for tp in res or ():
                ok = tp.error is None
                if not ok:
                    self.log.errors.add(f"commit:{tp.error.name()}",
                                        code_retriable(tp.error.code()), str(tp.error))
                self.log.commits.append((self.group, tp.partition, tp.offset, now, ok))


class KafkaPythonMember(_Member):
    """kafka-python consumer, manual synchronous commits (none on revocation: kafka-python 3
    runs rebalance listeners on its IO thread, where a blocking commit is refused)."""

    commit_on_revoke = False

    def _run(self) -> None:
        from kafka import KafkaConsumer, TopicPartition  # noqa: PLC0415
        from kafka.consumer.subscription_state import ConsumerRebalanceListener  # noqa: PLC0415
        from kafka.structs import OffsetAndMetadata  # noqa: PLC0415
        self._tp, self._om = TopicPartition, OffsetAndMetadata
        member = self

        class Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked: Any) -> None:
                member._revoked([tp.partition for tp in revoked])

            def on_partitions_assigned(self, assigned: Any) -> None:
                member._assigned([tp.partition for tp in assigned])
        c = self.c = KafkaConsumer(
            bootstrap_servers=self.bootstrap, group_id=self.group, enable_auto_commit=False,
            auto_offset_reset="earliest", session_timeout_ms=10000, heartbeat_interval_ms=1000,
            metadata_max_age_ms=2000, reconnect_backoff_max_ms=500, request_timeout_ms=20000)
        c.subscribe([self.topic], listener=Listener())

        def poll() -> Iterator[tuple[int, int, bytes]]:
            try:
                # a poll long enough for a JoinGroup + SyncGroup round: kafka-python 3.0.12
                # can hang for good when poll() returns before the SyncGroup answer of a
                # metadata-triggered rebalance (docs/groups.md)
                batches = c.poll(timeout_ms=1000, max_records=500)
            except Exception as e:  # noqa: BLE001 - counted, then poll again
                self.log.errors.add(f"consumer:{type(e).__name__}",
                                    bool(getattr(e, "retriable", False)), repr(e))
                time.sleep(0.2)
                return
            for tp, msgs in batches.items():
                for m in msgs:
                    yield tp.partition, m.offset, m.value
        self._consume(c, poll)

    def _commit_offsets(self, offs: dict[int, int]) -> None:
        ok = True
        try:
            self.c.commit({self._tp(self.topic, p): self._om(o, "", -1) for p, o in offs.items()})
        except Exception as e:  # noqa: BLE001 - counted; the outcome is unknown
            retriable = bool(getattr(e, "retriable", False)) or type(e).__name__ in (
                "CommitFailedError", "RebalanceInProgressError", "IllegalGenerationError",
                "UnknownMemberIdError")
            self.log.errors.add(f"commit:{type(e).__name__}", retriable, repr(e))
            ok = False
        self._record(offs, ok)


def start_members(bootstrap: str, topic: str, log: ConsumeLog, stop: threading.Event,
                  confluent: int = 2, kafka_python: int = 1) -> list[_Member]:
    """``confluent`` members in group chaos-ck, ``kafka_python`` in group chaos-kp."""
    ms: list[_Member] = [ConfluentMember(f"ck{i}", bootstrap, topic, "chaos-ck", log, stop)
                         for i in range(confluent)]
    ms += [KafkaPythonMember(f"kp{i}", bootstrap, topic, "chaos-kp", log, stop)
           for i in range(kafka_python)]
    for m in ms:
        m.start()
    return ms


class CommitMonitor(threading.Thread):
    """Polls every group's committed offsets (kafka-python admin) until stopped."""

    def __init__(self, bootstrap: str, groups: list[str], log: ConsumeLog,
                 stop: threading.Event, interval: float = 1.0) -> None:
        super().__init__(name="commit-monitor", daemon=True)
        self.bootstrap, self.groups, self.log = bootstrap, groups, log
        self.stop_ev, self.interval = stop, interval
        self.polls = self.failures = 0

    def run(self) -> None:
        from kafka.admin import KafkaAdminClient  # noqa: PLC0415
        admin = None
        while not self.stop_ev.wait(self.interval):
            try:
                if admin is None:
                    admin = KafkaAdminClient(bootstrap_servers=self.bootstrap,
                                             request_timeout_ms=5000)
                for g in self.groups:
                    got = admin.list_group_offsets(g)[g]
                    now = time.monotonic()
                    with self.log.lock:
                        for tp, om in got.items():
                            off = om["offset"] if isinstance(om, dict) else om.offset
                            if off >= 0:
                                self.log.observed.append((g, tp.partition, off, now))
                self.polls += 1
            except Exception:  # noqa: BLE001 - coordinator moving or cut off: ask again
                self.failures += 1
                if admin is not None:
                    try:
                        admin.close()
                    except Exception:  # noqa: BLE001
                        pass
                admin = None
        if admin is not None:
            admin.close()


def committed_ends(log: ConsumeLog) -> dict[str, dict[int, int]]:
    """The last successful commit per group and partition."""
    out: dict[str, dict[int, int]] = defaultdict(dict)
    with log.lock:
        for g, p, o, _t, ok in log.commits:
            if ok:
                out[g][p] = o
    return out


@dataclass
class GroupReport:
    reads: int
    sessions: int
    commits: int
    commits_unknown: int
    observed: int
    skipped: list[str]
    backwards: list[str]
    wrong_value: list[str]
    commit_backwards: list[str]
    not_retriable: list[str]
    error_kinds: Counter

    @property
    def anomalies(self) -> int:
        return (len(self.skipped) + len(self.backwards) + len(self.wrong_value)
                + len(self.commit_backwards) + len(self.not_retriable))

    def summary(self) -> str:
        kinds = ", ".join(f"{k}={n}" for k, n in self.error_kinds.most_common(12))
        return (f"groups: reads={self.reads} sessions={self.sessions} commits={self.commits} "
                f"commits_unknown={self.commits_unknown} monitor_samples={self.observed} | "
                f"anomalies: skipped={len(self.skipped)} backwards={len(self.backwards)} "
                f"wrong_value={len(self.wrong_value)} "
                f"commit_backwards={len(self.commit_backwards)} "
                f"not_retriable={len(self.not_retriable)}\nconsumer errors: {kinds or 'none'}")

    def examples(self) -> str:
        return "\n".join(f"{name}: {xs[:5]}" for name, xs in (
            ("skipped", self.skipped), ("backwards", self.backwards),
            ("wrong_value", self.wrong_value), ("commit_backwards", self.commit_backwards),
            ("not_retriable", self.not_retriable)) if xs)


def check_groups(log: ConsumeLog, records: list[tuple[int, int, bytes]],
                 acked: dict[bytes, tuple[int, int]]) -> GroupReport:
    """Check what the members saw and committed against the final read of the log."""
    value_at = {(p, o): v for p, o, v in records}
    offsets: dict[int, list[int]] = defaultdict(list)
    for p, o, _ in records:
        offsets[p].append(o)
    for p in offsets:
        offsets[p].sort()

    def next_after(p: int, o: int) -> int | None:
        """The first offset the log holds at or after ``o``."""
        xs = offsets.get(p, [])
        i = bisect.bisect_left(xs, o)
        return xs[i] if i < len(xs) else None

    with log.lock:
        reads, sessions = list(log.reads), list(log.sessions)
        commits, observed = list(log.commits), list(log.observed)
    skipped, backwards, wrong = [], [], []
    by_sess: dict[int, list[tuple[int, int, bytes, str, str]]] = defaultdict(list)
    for g, m, s, p, o, v in reads:
        by_sess[s].append((p, o, v, g, m))
        if value_at.get((p, o)) != v:
            wrong.append(f"{g}/{m} read {v[:24]!r} at p{p}@{o}, the log holds "
                         f"{(value_at.get((p, o)) or b'')[:24]!r}")
        elif v in acked and acked[v] != (p, o) and acked[v][1] is not None and acked[v][1] >= 0:
            # (an ack without an offset is reported once, by the log check)
            wrong.append(f"{g}/{m} read {v[:24]!r} at p{p}@{o}, acked at {acked[v]}")
    start_of = {s: (g, p, t) for g, _m, s, p, t in sessions}
    ok_commits: dict[tuple[str, int], list[tuple[float, int]]] = defaultdict(list)
    any_commits: dict[tuple[str, int], list[tuple[float, int]]] = defaultdict(list)
    for g, p, o, t, ok in commits:
        any_commits[(g, p)].append((t, o))
        if ok:
            ok_commits[(g, p)].append((t, o))
    for s, rs in by_sess.items():
        for (p1, o1, *_), (p2, o2, _v, g, m) in zip(rs, rs[1:]):
            if o2 <= o1:
                backwards.append(f"{g}/{m} session {s} p{p2}: {o1} then {o2}")
            elif next_after(p2, o1 + 1) != o2:
                skipped.append(f"{g}/{m} session {s} p{p2}: {o1} then {o2}, log has "
                               f"{next_after(p2, o1 + 1)}")
        g, p, t0 = start_of.get(s, (rs[0][3], rs[0][0], 0.0))
        first = rs[0][1]
        known = [o for t, o in ok_commits.get((g, p), []) if t <= t0]
        maybe = [o for t, o in any_commits.get((g, p), []) if t <= t0 + 30]
        base = max(known) if known else 0
        expect = next_after(p, base)
        hi = next_after(p, max(maybe + [base]))
        if expect is not None and first < expect and not known:
            continue                            # no commit yet: reading from the start
        if expect is not None and first < base:
            backwards.append(f"{rs[0][3]}/{rs[0][4]} session {s} p{p} began at {first} "
                             f"below the committed {base}")
        elif expect is not None and hi is not None and first > hi:
            skipped.append(f"{rs[0][3]}/{rs[0][4]} session {s} p{p} began at {first}, "
                           f"committed {base} (log next {expect})")
    commit_back = []
    for (g, p), xs in ok_commits.items():
        xs.sort()
        for (t1, o1), (t2, o2) in zip(xs, xs[1:]):
            if o2 < o1:
                commit_back.append(f"{g} p{p}: commit {o1} then {o2}")
    seen: dict[tuple[str, int], int] = {}
    for g, p, o, t in sorted(observed, key=lambda x: x[3]):
        if o < seen.get((g, p), -1):
            commit_back.append(f"{g} p{p}: monitor saw {seen[(g, p)]} then {o}")
        seen[(g, p)] = max(o, seen.get((g, p), -1))
    return GroupReport(
        reads=len(reads), sessions=len(sessions), commits=sum(1 for c in commits if c[4]),
        commits_unknown=sum(1 for c in commits if not c[4]), observed=len(observed),
        skipped=skipped, backwards=backwards, wrong_value=wrong, commit_backwards=commit_back,
        not_retriable=list(log.errors.fatal), error_kinds=Counter(log.errors.kinds))
