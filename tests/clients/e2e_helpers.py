"""Helpers for the end-to-end client tests: the Java CLI, topic set-up, group-of-three checks
and the resume-after-restart check every client runs."""
from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from bench.common import tied_popen
from java_build import compile_once


REPO = pathlib.Path(__file__).resolve().parents[2]
JAVA_CACHE = REPO / "tests" / ".cache" / "java"

JAVA_SRC = REPO / "tests" / "java" / "KafkaCli.java"
CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
ACKS = ("0", "1", "all")
# broker settings for client tests: quick group rebalances
CLIENT_BROKER_ARGS = ["--group-min-session-timeout-ms", "1000",
                      "--group-initial-rebalance-delay-ms", "0"]


def unique(prefix: str) -> str:
    """A topic/group name no other test in a shared broker uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def create_topic(bootstrap: str, name: str, partitions: int = 1) -> None:
    """Create a topic through kafka-python's admin client (a neutral third client)."""
    from kafka.admin import KafkaAdminClient, NewTopic
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=15000)
    try:
        admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        admin.close()


def produce_values(bootstrap: str, topic: str, values: list[str], partition: int | None = None
                   ) -> None:
    """Produce values with acks=all through kafka-python, round-robin over partitions."""
    from kafka import KafkaProducer
    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    try:
        futs = [p.send(topic, value=v.encode(), key=v.encode(), partition=partition)
                for v in values]
        p.flush(30)
        for f in futs:
            f.get(30)
    finally:
        p.close(10)


# -- Java ---------------------------------------------------------------------------------------
@dataclass
class JavaCli:
    """Runs tests/java/KafkaCli.java (compiled against one kafka-clients version)."""
    version: str
    classpath: str

    def args(self, command: str, **opts: object) -> list[str]:
        args = ["java", "-Xshare:auto", "-XX:TieredStopAtLevel=1", "-cp", self.classpath,
                "KafkaCli", command]
        for k, v in opts.items():
            args += ["--" + k.replace("_", "-"), str(v)]
        return args

    def __call__(self, command: str, timeout: float = 120, **opts: object) -> dict:
        """Run one command to completion and return its JSON result."""
        proc = subprocess.run(self.args(command, **opts), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        return self._result(command, proc.returncode, proc.stdout, proc.stderr)

    def start(self, command: str, **opts: object) -> subprocess.Popen:
        """Start a command in the background; pass the Popen to finish()."""
        return tied_popen(self.args(command, **opts), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)

    def finish(self, proc: subprocess.Popen, timeout: float = 120) -> dict:
        out, err = proc.communicate(timeout=timeout)
        return self._result(str(proc.args[6:7]), proc.returncode, out, err)

    def _result(self, command: str, code: int, out: str, err: str) -> dict:
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if code != 0 or not lines:
            raise AssertionError(f"java {self.version} {command} failed ({code}):\n"
                                 f"{out[-3000:]}\n{err[-5000:]}")
        return json.loads(lines[-1])


def compile_java(version: str, classpath: str) -> str:
    """javac KafkaCli.java against one kafka-clients version, once per source content.

    The output directory is named after the source hash and filled atomically (compile to a
    temporary directory, then rename), so concurrent pytest runs never see half a build.
    """
    digest = hashlib.sha1(JAVA_SRC.read_bytes()).hexdigest()[:12]
    return compile_once(JAVA_SRC, classpath, JAVA_CACHE / f"classes-{version}-{digest}",
                        f"KafkaCli for kafka-clients {version}")


# -- group of three -----------------------------------------------------------------------------
class Member(Protocol):
    """One group member driven from its own thread (client objects are not shared)."""
    def poll_once(self) -> list[str]: ...          # values received
    def assignment(self) -> set[int]: ...          # partitions currently owned
    def close(self) -> None: ...                   # commit and leave the group
    # optional: ``drain() -> list[str]``, values the member delivered while closing (a
    # consumer process may print records after its last poll; their offsets are committed
    # on close, so nobody else will receive them)


@dataclass
class GroupRun:
    phase1: list[set[int]] = field(default_factory=list)
    phase2: list[set[int]] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)


def _split(assigned: list[set[int]], members: list[int], partitions: int) -> list[set[int]] | None:
    snap = [set(assigned[m]) for m in members]
    union = set().union(*snap)
    if all(snap) and len(union) == partitions and sum(map(len, snap)) == partitions:
        return snap
    return None


def run_group_of_three(make_member: Callable[[int], Member], partitions: int,
                       expected: set[str], timeout: float = 90) -> GroupRun:
    """Three members join; wait for a 3-way split; member 2 leaves; the two others must take
    over every partition and together receive every expected value."""
    run = GroupRun()
    assigned: list[set[int]] = [set(), set(), set()]
    stop = [threading.Event() for _ in range(3)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def loop(i: int) -> None:
        try:
            m = make_member(i)
            try:
                while not stop[i].is_set():
                    vals = m.poll_once()
                    a = m.assignment()
                    with lock:
                        run.seen.update(vals)
                        assigned[i] = set(a)
            finally:
                m.close()
                late = m.drain() if hasattr(m, "drain") else []
                with lock:
                    run.seen.update(late)
                    assigned[i] = set()
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout

    def wait_for(cond: Callable[[], object], what: str) -> object:
        while time.monotonic() < deadline:
            if errors:
                raise errors[0]
            with lock:
                r = cond()
            if r:
                return r
            time.sleep(0.05)
        with lock:
            raise AssertionError(f"timed out waiting for {what}: assigned={assigned} "
                                 f"seen={len(run.seen)}/{len(expected)}")

    try:
        run.phase1 = wait_for(lambda: _split(assigned, [0, 1, 2], partitions), "3-way split")
        stop[2].set()
        threads[2].join(60)
        run.phase2 = wait_for(lambda: _split(assigned, [0, 1], partitions), "2-way split")
        wait_for(lambda: expected <= run.seen, "all records")
        # leave one at a time, each after a stable assignment: a commit racing a rebalance
        # may be skipped by the client (nothing assigned at that instant)
        stop[0].set()
        threads[0].join(60)
        wait_for(lambda: _split(assigned, [1], partitions), "last member owning everything")
    finally:
        for s in stop:
            s.set()
        for t in threads:
            t.join(60)
    if errors:
        raise errors[0]
    return run


def pending_values(bootstrap: str, group: str, topic: str, partitions: int) -> list[str]:
    """Values of the records at or after the group's committed offsets (from the beginning of
    partitions without a commit): exactly what the group must receive when it resumes.

    Comparing against this, instead of assuming a client committed everything it consumed,
    keeps the resume check exact: client libraries may skip a commit that races a rebalance.
    """
    from kafka import KafkaConsumer, TopicPartition
    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                      auto_offset_reset="earliest")
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        start = {tp: c.committed(tp) or 0 for tp in tps}
        end = c.end_offsets(tps)
        c.assign(tps)
        for tp in tps:
            c.seek(tp, start[tp])
        want = sum(max(0, end[tp] - start[tp]) for tp in tps)
        out = [r.value.decode() for r in kp_poll_records(c, want, poll_ms=300)]
        assert len(out) == want, f"read {len(out)} of {want} pending records"
        return out
    finally:
        c.close()


def kp_poll_records(c: Any, count: int, timeout: float = 30, poll_ms: int = 500) -> list:
    """Records a kafka-python consumer returns until it has ``count`` or ``timeout`` s pass."""
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=poll_ms).values():
            out.extend(recs)
    return out


def resume_after_restart(broker: Any, group: str, topic: str, consume: Callable[[int], list[str]],
                         partitions: int = 6, produced: int = 60, more: int = 12) -> None:
    """Committed offsets survive a broker restart: after it, the group must receive exactly the
    records at or after its commits plus ``more`` new ones. ``consume(count)`` joins the group
    again (with the client under test) and returns the values it received."""
    pending = pending_values(broker.bootstrap, group, topic, partitions)
    assert len(pending) < produced, "the group committed nothing"
    broker.restart()
    new = [f"b-{i}" for i in range(more)]
    produce_values(broker.bootstrap, topic, new)
    expected = sorted(pending + new)
    assert sorted(consume(len(expected))) == expected


def poll_member(member: Member, count: int, timeout: float = 30) -> list[str]:
    """Values one member receives until ``count`` arrived (one poll more: anything beyond would
    be a duplicate); then it commits and leaves."""
    got: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            got += member.poll_once()
        got += member.poll_once()
    finally:
        member.close()
    return got


def group_of_three_then_resume(broker: Any, topic: str, member: Callable[[str], Member]) -> None:
    """The group scenario every client library runs against a 6-partition topic: three
    ``member(group)`` split it, one leaves, two take over, then the group resumes from its
    committed offsets after a broker restart."""
    group = unique("g")
    values = [f"a-{i}" for i in range(60)]
    produce_values(broker.bootstrap, topic, values)
    run = run_group_of_three(lambda i: member(group), 6, set(values))
    assert len(run.phase1) == 3 and len(run.phase2) == 2
    resume_after_restart(broker, group, topic, lambda count: poll_member(member(group), count))
