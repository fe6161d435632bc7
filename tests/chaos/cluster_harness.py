"""Runs the queue workload on a ChaosCluster while faults are injected, then checks.

Writers: idempotent acks=all producers of confluent-kafka, kafka-python and Java kafka-clients
(when Java and the jars are there; every ack's partition and offset in a Ledger). Readers: two groups (confluent-kafka, kafka-python) whose
members commit synchronously, and a monitor of the committed offsets. After the schedule:
every broker running again, writers drained, one full read of the log, the groups given time
to read to the end; then the ledger and the groups are checked (workload.check, groups.check).
"""
from __future__ import annotations

import logging
import pathlib
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kafka.admin import KafkaAdminClient, NewTopic

from cluster.kit import leaders, wait_leaders, wait_live

from .cluster_faults import FAULTS, ChaosCluster
from .groups import CommitMonitor, ConsumeLog, GroupReport, check_groups, start_members
from .java_writer import java_classpath, start_java_writers
from .workload import Ledger, Report, check, RdkafkaDebugLog, read_all, start_writers

TOPIC = "queue"
PARTITIONS = 6
GAP_S = 2.0                  # writers work this long between two faults
DRAIN_S = 130.0              # writers must have every send answered within this after the
                             # faults (their delivery timeout is 120 s)


@dataclass
class ClusterOutcome:
    report: Report | None = None
    groups: GroupReport | None = None
    faults: list[str] = field(default_factory=list)
    fault_counts: dict[str, int] = field(default_factory=dict)
    exits: dict[Any, int] = field(default_factory=dict)
    unexpected_exits: list[str] = field(default_factory=list)
    unfenced_pauses: list[str] = field(default_factory=list)
    start_failures: int = 0
    writer_errors: list[str] = field(default_factory=list)
    member_errors: list[str] = field(default_factory=list)
    lagging: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    not_running: bool = False
    seconds: float = 0.0
    writers: list[str] = field(default_factory=list)

    @property
    def anomalies(self) -> list[str]:
        """Every finding that fails the run (empty: clean)."""
        out = []
        r, g = self.report, self.groups
        if r is not None and r.anomalies:
            out.append(f"log: lost={len(r.lost)} duplicated={len(r.duplicated)} "
                       f"wrong_offset={len(r.wrong_offset)} out_of_order={len(r.out_of_order)}"
                       f" acked_without_offset={len(r.no_offset)}"
                       f"; e.g. lost={r.lost[:3]} dup={r.duplicated[:3]} "
                       f"wrong={r.wrong_offset[:3]} order={r.out_of_order[:3]}")
        if r is not None and r.fatal:
            out.append(f"{r.fatal} producers hit a fatal error and were recreated")
        if r is not None and self.produce_fatal:
            out.append(f"non-retriable produce errors: {self.produce_fatal[:5]}")
        if g is not None and g.anomalies:
            out.append("groups: " + g.examples().replace("\n", "; "))
        if self.unexpected_exits:
            out.append("brokers exited unexpectedly: " + " | ".join(self.unexpected_exits[:3]))
        if self.writer_errors or self.member_errors:
            out.append(f"client threads failed: {self.writer_errors + self.member_errors}")
        if self.lagging:
            out.append(f"groups did not reach the end within the bound: {self.lagging}")
        if self.unfenced_pauses:
            out.append("paused brokers never fenced: " + "; ".join(self.unfenced_pauses))
        if self.not_running:
            out.append("not every broker was running again after the schedule")
        if self.read_error:
            out.append(f"the full read did not finish: {self.read_error}")
        return out

    produce_fatal: list[str] = field(default_factory=list)
    read_error: str = ""

    def summary(self) -> str:
        lines = [f"chaos (3 brokers): {len(self.faults)} faults in {self.seconds:.0f}s: "
                 + ", ".join(f"{k}={v}" for k, v in sorted(self.fault_counts.items())),
                 f"broker exits (supervised restarts): {dict(self.exits)}, "
                 f"failed start attempts: {self.start_failures}",
                 f"writers: {', '.join(self.writers)}"]
        if self.report is not None:
            lines.append(self.report.summary())
        if self.groups is not None:
            lines.append(self.groups.summary())
        lines += [f"  fault: {f}" for f in self.faults]
        return "\n".join(lines)


def run_cluster_chaos(broker_factory: Any, s3_endpoint: Any, schedule: list[tuple[str, int]]
                      | None = None, duration_s: float = 0.0, seed: int = 17,
                      rate: float = 150.0, log: Any = print, details: pathlib.Path | None = None,
                      java: bool = True) -> ClusterOutcome:
    """Apply ``schedule`` ([(fault, victim)]), or random faults for ``duration_s``; with
    anomalies, their details go to the file ``details`` (a path)."""
    out = ClusterOutcome()
    client_log = logging.getLogger("kafka")   # kafka-python: thousands of reconnect lines
    handler = logging.FileHandler(details.with_name("kafka-python.log")) if details else None
    client_log.propagate, saved = False, (client_log.propagate, client_log.level)
    client_log.setLevel(logging.WARNING)
    if handler:
        handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(message)s"))
        client_log.addHandler(handler)
    rd_log = RdkafkaDebugLog(details.with_name("rdkafka.log") if details else None)
    cl = ChaosCluster(broker_factory, s3_endpoint, log=log)
    cl.topic = TOPIC
    stop_w, stop_r = threading.Event(), threading.Event()
    writers: list = []
    members: list = []
    monitor = None
    t_start = time.monotonic()
    try:
        rd_log.start()
        admin = KafkaAdminClient(bootstrap_servers=cl.bootstrap)
        wait_live(admin, 3)
        admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])
        wait_leaders(admin, TOPIC, PARTITIONS)
        admin.close()
        ledger, clog = Ledger(), ConsumeLog()
        writers = start_writers(cl.bootstrap, TOPIC, PARTITIONS, ledger, stop_w,
                                confluent=2, kafka_python=2, rate=rate)
        java_cp = java_classpath() if java else None
        if java_cp:
            writers += start_java_writers(java_cp, cl.bootstrap, TOPIC, PARTITIONS, ledger,
                                          stop_w, count=1, rate=rate)
        out.writers = [w.name for w in writers]
        members = start_members(cl.bootstrap, TOPIC, clog, stop_r, confluent=2, kafka_python=1)
        monitor = CommitMonitor(cl.bootstrap, ["chaos-ck", "chaos-kp"], clog, stop_r)
        monitor.start()
        time.sleep(GAP_S * 2)
        rnd = random.Random(seed)
        steps = list(schedule or [])
        deadline = t_start + duration_s
        i = 0
        while steps or (duration_s and time.monotonic() < deadline):
            fault, victim = steps.pop(0) if steps else (rnd.choice(FAULTS), rnd.randrange(3))
            if not cl.all_running():
                out.not_running = True
                break
            what = cl.inject(fault, victim)
            i += 1
            log(f"chaos: fault {i}: {what}; acked so far "
                f"{len(ledger.acked)}, read {sum(m.read for m in members)}")
            time.sleep(GAP_S)
        out.not_running = out.not_running or not cl.all_running()
        time.sleep(GAP_S)
        stop_w.set()
        drain_until = time.monotonic() + DRAIN_S
        for w in writers:
            w.join(max(0.1, drain_until - time.monotonic()))
        out.writer_errors = [f"{w.name}: {w.error!r}" for w in writers if w.error is not None]
        out.writer_errors += [f"{w.name}: still running" for w in writers if w.is_alive()]
        try:
            records = read_all(cl.bootstrap, TOPIC, PARTITIONS, timeout=120)
        except AssertionError as e:            # a partition unreadable for two minutes
            out.read_error = str(e)
            _collect(out, cl, t_start)
            if details is not None:
                _write_details(details, out, ledger, clog, [], cl.t0, cl.pg.activity())
            raise AssertionError(f"{e}\n{out.summary()}\n(details: {details})") from None
        ends: dict[int, int] = {}
        for p, o, _ in records:
            ends[p] = max(ends.get(p, 0), o + 1)
        out.lagging = _wait_groups(clog, ends, timeout=90)
        stop_r.set()
        for m in members:
            m.join(60)
        monitor.join(30)
        out.member_errors = [f"{m.name}: {m.error!r}" for m in members if m.error is not None]
        out.member_errors += [f"{m.name}: still running" for m in members if m.is_alive()]
        out.report = check(ledger, records)
        out.produce_fatal = list(ledger.errors.fatal)
        out.groups = check_groups(clog, records, dict(ledger.acked))
        out.groups.error_kinds.update(ledger.errors.kinds)
        _collect(out, cl, t_start)
        if details is not None and out.anomalies:
            _write_details(details, out, ledger, clog, records, cl.t0, cl.pg.activity(),
                           _batches_of(cl, out.report, records) + _groups_of(cl))
        return out
    finally:
        stop_w.set()
        stop_r.set()
        _collect(out, cl, t_start)
        cl.close()
        client_log.propagate = saved[0]
        client_log.setLevel(saved[1])
        if handler:
            client_log.removeHandler(handler)
            handler.close()
        rd_log.stop()


def _collect(out: ClusterOutcome, cl: ChaosCluster, t_start: float) -> None:
    out.faults, out.fault_counts = list(cl.fault_log), dict(cl.faults)
    out.exits, out.unexpected_exits = dict(cl.exits), list(cl.unexpected_exits)
    out.unfenced_pauses = list(cl.unfenced_pauses)
    out.start_failures = cl.start_failures
    out.seconds = time.monotonic() - t_start


def _wait_groups(clog: ConsumeLog, ends: dict[int, int], timeout: float
                 ) -> dict[str, dict[int, tuple[int, int]]]:
    """Until each group read every partition to its end; returns what is still behind
    ({group: {partition: (read up to, end)}})."""
    deadline = time.monotonic() + timeout
    while True:
        top: dict[str, dict[int, int]] = {"chaos-ck": {}, "chaos-kp": {}}
        with clog.lock:
            for g, _m, _s, p, o, _v in clog.reads:
                top.setdefault(g, {})
                top[g][p] = max(top[g].get(p, -1), o + 1)
        behind = {g: {p: (ps.get(p, 0), e) for p, e in ends.items() if ps.get(p, 0) < e}
                  for g, ps in top.items()}
        behind = {g: b for g, b in behind.items() if b}
        if not behind or time.monotonic() > deadline:
            return behind
        time.sleep(0.5)


def _groups_of(cl: ChaosCluster) -> list[str]:
    """What the coordinators say of each group at the end (state, members, assignments):
    tells a group that never got partitions from one that got them and did not fetch."""
    out = ["groups at the end (DescribeGroups):"]
    try:
        admin = KafkaAdminClient(bootstrap_servers=cl.bootstrap, request_timeout_ms=10000)
        try:
            if hasattr(admin, "describe_groups"):          # kafka-python 3: dicts
                for gid, g in admin.describe_groups(["chaos-ck", "chaos-kp"]).items():
                    out.append(f"  {gid} state={g.get('group_state', g.get('state'))} "
                               f"error={g.get('error')} members=" + "; ".join(
                                   f"{m.get('client_id')}: {m.get('member_assignment')}"
                                   for m in g.get("members", [])))
            else:
                for g in admin.describe_consumer_groups(["chaos-ck", "chaos-kp"]):
                    out.append(f"  {g.group} state={g.state} members=" + "; ".join(
                        f"{m.client_id}: {getattr(m.member_assignment, 'assignment', None)}"
                        for m in g.members))
        finally:
            admin.close()
    except Exception as e:  # noqa: BLE001 - diagnostics only
        out.append(f"  unavailable: {e!r}")
    return out


def _batches_of(cl: ChaosCluster, report: Report | None,
                records: list[tuple[int, int, bytes]]) -> list[str]:
    """The stored batch headers (producer id, epoch, sequences) around each duplicated value:
    tells a client re-send under a new producer epoch from a broker that missed a duplicate."""
    if report is None or not report.duplicated:
        return []
    from datapath.batches import batch_headers  # noqa: PLC0415
    from datapath.wire import WireClient  # noqa: PLC0415
    where: dict[bytes, list[tuple[int, int]]] = {}
    dup = set(report.duplicated[:5])
    for p, o, v in records:
        if v in dup:
            where.setdefault(v, []).append((p, o))
    out = []
    try:
        admin = KafkaAdminClient(bootstrap_servers=cl.bootstrap, request_timeout_ms=10000)
        try:
            lead = {p: l for p, (l, _e) in leaders(admin, cl.topic).items()}
        finally:
            admin.close()
        for v, locs in where.items():
            for p, o in locs:
                b = cl.nodes[lead[p]].broker
                with WireClient(b.host, b.port, timeout=10) as w:
                    data = w.fetch(cl.topic, o, partition=p, partition_max_bytes=1 << 16)
                hs = batch_headers(data.records or b"")[:1]
                out += [f"  {v[:16]!r} p{p}@{o}: batch base {h.base_offset} count "
                        f"{h.records_count} producer {h.producer_id} epoch {h.producer_epoch} "
                        f"base_sequence {h.base_sequence}" for h in hs]
    except Exception as e:  # noqa: BLE001 - diagnostics only
        out.append(f"  batch headers unavailable: {e!r}")
    return out


def _write_details(path: Any, out: ClusterOutcome, ledger: Ledger, clog: ConsumeLog,
                   records: list[tuple[int, int, bytes]], t0: float,
                   pg_activity: list[str] | None = None,
                   batches: list[str] | None = None) -> None:
    """Everything needed to chase an anomaly: fault times, each lost value's ack (where,
    when, what the log holds there now), every group anomaly, what PostgreSQL sessions
    were doing at the end (a stuck call shows as a lock wait)."""
    at = {(p, o): v for p, o, v in records}
    lines = [out.summary(), "", "ANOMALIES:", *out.anomalies, "",
             "PostgreSQL sessions (pid | app | port | state | wait type | wait | in xact "
             "| since | blocked by | query):", *[f"  {a}" for a in pg_activity or []], "",
             "stored batches of duplicated values, groups:", *(batches or []), "",
             "lost acknowledged values:"]
    for v in (out.report.lost if out.report else [])[:200]:
        p, o = ledger.acked[v]
        t = ledger.acked_at.get(v, t0) - t0
        lines.append(f"  {v[:16]!r} acked p{p}@{o} at {t:.1f}s; log there: "
                     f"{(at.get((p, o)) or b'<none>')[:16]!r}")
    if out.report:
        lines += ["wrong offsets:", *[f"  {x[0][:16]!r} acked {x[1]} found {x[2]}"
                                     for x in out.report.wrong_offset[:200]]]
        lines += ["duplicated:", *[f"  {v[:16]!r}" for v in out.report.duplicated[:200]]]
        lines += ["acknowledged without an offset (where the log holds it, ack time):",
                  *[f"  {v[:16]!r} at {[(p, o) for p, o, x in records if x == v]} acked "
                    f"{ledger.acked_at.get(v, t0) - t0:.1f}s" for v in out.report.no_offset[:50]]]
        lines += ["out of order:", *[f"  {x}" for x in out.report.out_of_order[:200]]]
    if out.groups:
        g = out.groups
        for name, xs in (("skipped", g.skipped), ("backwards", g.backwards),
                         ("wrong_value", g.wrong_value), ("commit_backwards", g.commit_backwards),
                         ("not_retriable", g.not_retriable)):
            lines += [f"{name}:", *[f"  {x}" for x in xs[:200]]]
    with clog.lock:
        commits = sorted(clog.commits, key=lambda c: c[3])
    lines += ["commits (group, partition, offset, t, ok):",
              *[f"  {g} p{p} {o} {t - t0:.1f}s {ok}" for g, p, o, t, ok in commits]]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
