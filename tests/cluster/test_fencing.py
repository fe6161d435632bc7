"""Fencing: a broker acknowledges only while its own lease is valid (monotonic clock), and a
takeover whose taker is killed half-way is finished by another broker.

Real broker processes, real clients (confluent-kafka idempotent acks=all producers), a short
lease (2 s) and margin (0.5 s). Every acknowledged record must be read back exactly once at
its acknowledged offset.
"""
from __future__ import annotations

import re
import signal
import sqlite3
import time
import types

import pytest

from broker.cluster.lease import LeaseWatch, OwnLease
from .kit import FAILOVER_FLAGS, ask, leaders, wait_for
from .timed_load import PARTITIONS, TimedLoad, check_read_back, create_topic

LEASE_S = 2.0                   # FAILOVER_FLAGS: lease 2 s, margin 0.5 s
FLAGS = (*FAILOVER_FLAGS, "--upload-interval-s", "30")


# ---- the clocks themselves (no processes) ----------------------------------------------------
@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """broker.cluster.lease's monotonic clock, moved only by the test (``clock[0] += s``):
    these leases and limits are 50-200 ms, and on a loaded machine a real sleep oversleeps
    them and a test thread descheduled between two lines outlives them."""
    now = [1000.0]
    monkeypatch.setattr("broker.cluster.lease.time",
                        types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_own_lease_runs_from_the_send_of_the_last_successful_renewal(clock):
    lease = OwnLease(200)
    assert lease.valid()                        # not a member yet: nothing to fence
    sent = clock[0]
    lease.renewed(sent - 0.15)                  # a renewal that took 150 ms to succeed
    clock[0] += 0.001
    assert lease.valid() and lease.remaining_ms() <= 50
    clock[0] += 0.06
    assert not lease.valid()                    # 200 ms after the send, not after the answer
    lease.withhold(3)
    lease.renewed(sent - 1.0)                   # an older renewal never extends it
    assert not lease.valid()
    lease.renewed(clock[0])
    assert lease.valid() and lease.withheld == 0


class _Row:
    def __init__(self, node_id: int, instance: str, lease_until_ms: int) -> None:
        self.node_id, self.instance, self.lease_until_ms = node_id, instance, lease_until_ms


def test_lease_watch_counts_on_its_own_clock_not_the_rows_wall_time(clock):
    w = LeaseWatch()
    now = 1_800_000_000_000
    # node 1's wall clock is an hour ahead, node 2's an hour behind: neither matters
    w.observe([_Row(1, "a", now + 3_600_000), _Row(2, "b", now - 3_600_000)], now)
    assert w.alive(1, 100) and not w.alive(2, 100)    # first sight: the wall time is a hint
    assert not w.expired(1, 100, 50) and not w.expired(2, 100, 50)
    clock[0] += 0.2
    w.observe([_Row(1, "a", now + 3_600_000), _Row(2, "b", now - 3_600_000)], now)
    assert not w.alive(1, 100) and w.expired(1, 100, 50) and w.expired(2, 100, 50)
    w.observe([_Row(1, "a", now + 3_600_001), _Row(2, "c", now - 3_600_000)], now)
    assert w.alive(1, 100) and w.alive(2, 100)        # renewed / re-registered: seen change
    assert not w.expired(1, 100, 50) and not w.expired(2, 100, 50)


def test_lease_watch_does_not_count_time_it_could_not_see(clock):
    """A watcher cut off from the database (no read for longer than blind_ms, or its own
    renewals failing) does not count that time as anyone's silence: after an outage everyone
    shared, nobody looks expired at once; one that stays silent afterwards is, later. (On a
    fake monotonic clock: real sleeps of 80 ms overslept the 100 ms blind limit under load.)"""

    def sleep(s: float) -> None:
        clock[0] += s
    now = 1_800_000_000_000
    w = LeaseWatch(blind_ms=100)
    rows = [_Row(1, "a", now + 1), _Row(2, "b", now + 1)]
    w.observe(rows, now)
    sleep(0.15)
    w.observe([_Row(1, "a", now + 2), _Row(2, "b", now + 1)], now)   # a gap: blind 150 ms
    assert not w.expired(1, 100, 50) and not w.expired(2, 100, 50)
    sleep(0.08)
    w.observe([_Row(1, "a", now + 3), _Row(2, "b", now + 1)], now)
    sleep(0.08)
    w.observe([_Row(1, "a", now + 4), _Row(2, "b", now + 1)], now)
    assert not w.expired(1, 100, 50) and w.expired(2, 100, 50)        # 160 ms seen silent
    # reads worked but our own renewals failed for 300 ms: that time is not silence either
    w2 = LeaseWatch(blind_ms=10_000)
    w2.observe([_Row(3, "c", now + 1)], now)
    t_ok = clock[0]
    for _ in range(6):
        sleep(0.05)
        w2.observe([_Row(3, "c", now + 1)], now)
    w2.blind_since(t_ok)
    w2.observe([_Row(3, "c", now + 1)], now)
    assert not w2.expired(3, 100, 50) and w2.alive(3, 100)


def test_late_watch_rounds_with_renewals_going_through_are_not_blindness(clock):
    """A watch round that runs late (a loaded machine) while this broker's own renewals keep
    reaching the database is not blindness: a silent broker still expires on schedule (the
    chaos suite at load 15-20: 1.6-2.1 s between rounds with a 1 s blind limit, and the paused
    broker was never fenced). Without renewals in the gap, it is blindness as before."""
    now = 1_800_000_000_000
    w = LeaseWatch(blind_ms=100)
    w.observe([_Row(1, "a", now + 1), _Row(2, "b", now + 1)], now)
    for _ in range(5):                   # 50 ms renewals of our own, the rounds 250 ms apart
        clock[0] += 0.05
        w.renewal(clock[0] - 0.01, clock[0])
    w.observe([_Row(1, "a", now + 2), _Row(2, "b", now + 1)], now)
    assert w.blind_gaps == 0
    assert not w.expired(1, 100, 50) and w.expired(2, 100, 50)        # 250 ms seen silent
    # the same late round with a hole in our renewals: blind, nobody's silence counts
    w2 = LeaseWatch(blind_ms=100)
    w2.observe([_Row(1, "a", now + 1), _Row(2, "b", now + 1)], now)
    clock[0] += 0.05
    w2.renewal(clock[0] - 0.01, clock[0])
    clock[0] += 0.2                      # 200 ms with no renewal going through
    w2.observe([_Row(1, "a", now + 2), _Row(2, "b", now + 1)], now)
    assert w2.blind_gaps == 1 and not w2.expired(2, 100, 50)


# ---- a broker cut off from its metadata database -----------------------------------------------
class _Blocker:
    """Holds a write lock on the metadata database so that lease renewals cannot commit
    (SQLite: an exclusive transaction; PostgreSQL: an EXCLUSIVE lock on cluster_brokers,
    reads go on)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = None

    def block(self) -> None:
        if self.url.startswith("sqlite"):
            path = self.url.split("sqlite:///", 1)[1]
            self.conn = sqlite3.connect(path, timeout=30, isolation_level=None)
            # SQLite can answer "database is locked" at once, without its busy timeout (WAL
            # mode, a broker's write or checkpoint in progress): try again until it is ours
            deadline = time.monotonic() + 30
            while True:
                try:
                    self.conn.execute("BEGIN EXCLUSIVE")
                    break
                except sqlite3.OperationalError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
        else:
            import psycopg  # noqa: PLC0415
            self.conn = psycopg.connect(self.url)
            self.conn.execute("LOCK TABLE cluster_brokers IN EXCLUSIVE MODE")

    def release(self) -> None:
        if self.conn is not None:
            if not self.url.startswith("sqlite"):
                self.conn.rollback()
            elif self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            self.conn.close()
            self.conn = None


@pytest.mark.slow
def test_broker_cut_off_from_metadata_stops_acknowledging_within_its_lease(broker_factory,
                                                                         metadata_url):
    """With its lease renewals blocked the broker stops acknowledging within the lease (an
    idempotent producer keeps retrying NOT_LEADER_OR_FOLLOWER), and acknowledges again once
    a renewal succeeds; nothing acknowledged is lost."""
    b = broker_factory(["--metadata", metadata_url, *FLAGS])
    create_topic(b.bootstrap, "cut")
    load = TimedLoad(b.bootstrap, "cut")
    blocker = _Blocker(metadata_url)
    try:
        wait_for(lambda: len(load.acked) > 300, what="acks before the cut")
        blocker.block()
        t_block = time.monotonic()
        hold = LEASE_S + 3.0
        time.sleep(hold)
        sent_during = load.sent
        late = [t - t_block for *_, t in list(load.acked) if t > t_block + LEASE_S + 1.0]
        blocker.release()
        t_release = time.monotonic()
        last = max((t for *_, t in load.acked if t < t_release), default=t_block)
        print(f"\nmetadata blocked for {hold:.1f} s: last ack {last - t_block:.2f} s after "
              f"the block (lease {LEASE_S} s)")
        # the lease ran from the last renewal's send (before the block): no ack arrives more
        # than the lease (+1 s for the client's delivery callback) after the block
        assert not late, f"acknowledged {late[:5]} s after the block, lease {LEASE_S} s"
        assert sent_during > 0
        n = len(load.acked)
        wait_for(lambda: len(load.acked) > n + 300, what="acks after the renewal")
    finally:
        blocker.release()
        load.stop()
    text = b.log_text()
    assert "lease lapsed" in text and "lease renewed: acknowledging produces again" in text
    assert not load.errors, load.errors[:5]
    print(f"acknowledged {check_read_back(b.bootstrap, 'cut', load.acked)} records, "
          f"all read back once")


@pytest.mark.slow
def test_appends_in_flight_when_the_lease_lapses_are_acknowledged_once_renewed(broker_factory,
                                                                             metadata_url):
    """SIGSTOP past the lease but not past lease + margin (nobody fences it): the appends that
    were in flight complete after SIGCONT while the lease is lapsed. They are in the WAL and
    no taker can have missed them, so once the next renewal succeeds they are acknowledged
    with their offsets; answering them NOT_LEADER_OR_FOLLOWER made librdkafka acknowledge
    them without an offset when the producer's next batch succeeded (chaos suite: acks
    without an offset). Requests that arrive while it is lapsed are still refused."""
    if not metadata_url.startswith("sqlite"):
        pytest.skip("the lease gate is the same on PostgreSQL; SQLite keeps this lean")
    _three_lapses_none_withheld(broker_factory, metadata_url, "gap")


@pytest.mark.slow
def test_appends_in_flight_wait_for_a_renewal_later_than_a_lease(broker_factory, metadata_url):
    """As above, but the renewal after SIGCONT is held back by a database lock for longer than
    a lease (a PostgreSQL cut of 3 s in the chaos suite): the appends that were in flight
    still wait for it and are acknowledged with their offsets, none withheld. Withheld
    (NOT_LEADER_OR_FOLLOWER) while the producer's next pipelined batch succeeded after the
    renewal, librdkafka acknowledged them without an offset (chaos suite, session 19)."""
    if not metadata_url.startswith("sqlite"):
        pytest.skip("the lease gate is the same on PostgreSQL; SQLite keeps this lean")
    _three_lapses_none_withheld(broker_factory, metadata_url, "late",
                                _Blocker(metadata_url))


def _three_lapses_none_withheld(broker_factory, metadata_url: str, topic: str,
                                blocker: "_Blocker | None" = None) -> None:
    """One broker (2 s lease, nobody to fence it) under load is paused past its lease three
    times; with ``blocker``, the renewal after each SIGCONT also waits a lease for a database
    lock. Every lapse is logged, no answer is withheld, nothing acknowledged is lost."""
    b = broker_factory(["--metadata", metadata_url, "--cluster-lease-ms", "2000",
                        "--cluster-takeover-margin-ms", "60000", "--upload-interval-s", "30"])
    create_topic(b.bootstrap, topic)
    load = TimedLoad(b.bootstrap, topic)
    try:
        for _ in range(3):
            n = len(load.acked)
            wait_for(lambda: len(load.acked) > n + 300, what="acks")
            b.proc.send_signal(signal.SIGSTOP)
            time.sleep(LEASE_S + 0.6)
            if blocker is not None:
                blocker.block()          # the renewal after SIGCONT waits for this lock
            b.proc.send_signal(signal.SIGCONT)
            if blocker is not None:
                time.sleep(LEASE_S + 0.8)
                blocker.release()
    finally:
        if blocker is not None:
            blocker.release()
        load.stop()
    text = b.log_text()
    withheld = [int(n) for n in re.findall(r"answers withheld=(\d+)", text)]
    assert "lease lapsed" in text and withheld, text[-3000:]
    assert not any(withheld), f"answers withheld after renewals: {withheld}"
    assert not load.errors, load.errors[:5]
    print(f"acknowledged {check_read_back(b.bootstrap, topic, load.acked)} records at their "
          f"offsets, all read back once; lapses: {len(withheld)}")


# ---- a taker killed in the middle of a takeover ------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("how", ["takeover_after_commit", "kill-9-during-takeover"])
def test_taker_killed_mid_takeover_third_broker_takes_over_both(broker_factory, cluster_factory,
                                                                metadata_url, how):
    """Broker 1 is killed; its taker, broker 2, dies half-way (a crash point right after it
    committed broker 1's records, or kill -9 while it waits before the commit); broker 0 takes
    over both WALs. Every acknowledged record is read back exactly once."""
    if not metadata_url.startswith("sqlite"):
        pytest.skip("the takeover path is the same on PostgreSQL; SQLite keeps this lean")
    brokers = cluster_factory(2, extra=FLAGS)
    env = {"S3KAFKA_CRASH_POINT": how} if how.startswith("takeover_") else \
        {"S3KAFKA_PAUSE_POINT": "takeover_before_commit", "S3KAFKA_PAUSE_S": "30"}
    brokers.append(broker_factory(["--node-id", "2", "--rack", "r2", *cluster_factory.shared,
                                   *FLAGS], env=env))
    boot = ",".join(b.bootstrap for b in brokers)
    before = create_topic(boot, "tk", live=3, settle=True)
    assert {lead for lead, _ in before.values()} == {0, 1, 2}, before
    load = TimedLoad(boot, "tk")
    try:
        load.wait_every_partition()
        time.sleep(1.0)
        brokers[1].kill()
        t_kill = time.monotonic()
        if how.startswith("takeover_"):
            assert brokers[2].proc.wait(40) == 137        # died at the crash point
        else:
            # it fenced broker 1's WAL and recovered its records, and sits before the commit
            wait_for(lambda: "pause point takeover_before_commit" in brokers[2].log_text(),
                     timeout=40, what="broker 2 in the middle of taking over broker 1")
            brokers[2].kill()
        t_second = time.monotonic()
        text2 = brokers[2].log_text()
        assert "takeover started node_id=1" in text2
        assert "takeover finished node_id=1" not in text2

        def all_back() -> bool:
            return {p for p, *_, t in list(load.acked) if t > t_second + 0.05} \
                >= set(range(PARTITIONS))
        wait_for(all_back, timeout=60, what="every partition accepts produces on broker 0")
        print(f"\n{how}: every partition accepts produces on broker 0 "
              f"{time.monotonic() - t_kill:.1f} s after the first kill")
        n = len(load.acked)
        wait_for(lambda: len(load.acked) > n + 200, what="more acks")
    finally:
        load.stop()
    text0 = brokers[0].log_text()
    for dead in (1, 2):
        assert re.search(rf"takeover finished node_id={dead} ", text0), text0[-3000:]
        assert re.search(rf"partitions reassigned node_id={dead} ", text0), text0[-3000:]
    assert not load.errors, load.errors[:5]
    m = re.search(r"takeover finished node_id=1 records=(\d+) committed=(\d+) skipped=(\d+)",
                  text0)
    print(f"broker 0: {m.group(0) if m else '?'}")
    if how == "takeover_after_commit":      # broker 2 had committed them all: nothing twice
        assert m and int(m.group(2)) == 0 and int(m.group(3)) == int(m.group(1)), m.group(0)
    after = ask(brokers[0].bootstrap, lambda a: leaders(a, "tk"))
    assert {lead for lead, _ in after.values()} == {0}, after
    print(f"acknowledged {check_read_back(brokers[0].bootstrap, 'tk', load.acked)} records, "
          f"all read back once")
