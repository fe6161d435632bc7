"""Runs a fault schedule against one broker while the queue workload writes, then checks.

A schedule is a list of steps: ``("run", seconds)`` lets the writers work, ``"cut"`` /
``"blackhole"`` / ``"restore"`` change the object store proxy, ``"kill"`` is kill -9 and
``"restart"`` starts the broker again on the same port and data (whatever the store's state),
timing how long until it answers ApiVersions, takes a plain produce and takes an idempotent
produce (``Restart`` rows). Everything runs on 127.0.0.1 with bounded waits.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from datapath.batches import make_batch
from datapath.wire import WireClient

from .faults import broker_args, proxy_for, s3_bucket_url
from .workload import Ledger, Report, check, RdkafkaDebugLog, read_all, start_writers

PROBE_TIMEOUT_S = 20.0        # plain produce after a restart
IDEMPOTENT_PROBE_S = 10.0     # idempotent produce: refused (retriably) while the producer
                              # state needs objects the store cannot serve yet


@dataclass
class Restart:
    store: str            # the object store's state during the restart
    listen_s: float       # kill -> ApiVersions answered
    produce_s: float      # kill -> a plain produce acknowledged
    idempotent_s: float   # kill -> an idempotent produce acknowledged (-1: not within 10 s)
    interpreter_s: float = 0.0   # of listen_s: interpreter start-up and imports (load-bound)

    def __str__(self) -> str:
        idem = (f"{self.idempotent_s:.1f}s" if self.idempotent_s >= 0 else
                "refused (retriable) while the store is away: replay needs objects")
        return (f"restart(store {self.store}): listen {self.listen_s:.1f}s (interpreter "
                f"{self.interpreter_s:.1f}s), produce {self.produce_s:.1f}s, idempotent "
                f"produce {idem}")


@dataclass
class Outcome:
    report: Report
    restarts: list[Restart] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    writer_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rdkafka_log: str = ""   # the confluent-kafka writers' librdkafka debug lines

    def summary(self) -> str:
        lines = [self.report.summary(), f"schedule: {' '.join(self.steps)} ({self.seconds:.0f}s)"]
        lines += [str(r) for r in self.restarts]
        lines += [f"writer error: {e}" for e in self.writer_errors]
        if self.report is not None and self.report.no_offset:
            lines += [f"librdkafka: {ln}" for ln in implicit_acks(self.rdkafka_log)]
        return "\n".join(lines)


def implicit_acks(path: str, limit: int = 10) -> list[str]:
    """librdkafka's 'implicitly acked by subsequent batch success' lines (the values it
    acknowledged without an offset: an earlier answer was an error for a batch that was
    stored), so a failing CI run names them even when its logs are gone."""
    try:
        with open(path, errors="replace") as f:
            return [ln.strip()[:300] for ln in f if "implicitly acked" in ln][:limit]
    except OSError:
        return []


def short_schedule() -> list[Any]:
    """About 50 s of faults: kill -9 and restart with the store up (the run's baseline), a cut
    long enough to back-pressure, kill -9 and restart while cut, kill -9 and restart while
    black-holed, each followed by recovery."""
    return [("run", 3), "kill", "restart", ("run", 2), "cut", ("run", 6), "restore", ("run", 3),
            "cut", ("run", 3), "kill",
            "restart", ("run", 4), "restore", ("run", 3), "blackhole", ("run", 3), "kill",
            "restart", ("run", 4), "restore", ("run", 4)]


def long_schedule(rounds: int, seed: int) -> list[Any]:
    """``rounds`` random rounds of the same faults (cut/blackhole of 2-15 s, kill -9 and
    restart in any store state)."""
    rnd = random.Random(seed)
    steps: list[Any] = [("run", 3)]
    for _ in range(rounds):
        fault = rnd.choice(["cut", "blackhole"])
        steps += [fault, ("run", rnd.uniform(2, 15))]
        if rnd.random() < 0.6:
            steps += ["kill", ("run", rnd.uniform(0, 2)), "restart", ("run", rnd.uniform(1, 6))]
        steps += ["restore", ("run", rnd.uniform(2, 8))]
        if rnd.random() < 0.3:
            steps += ["kill", "restart", ("run", 3)]
    return steps


def _probe(host: str, port: int, topic: str, since: float, idempotent: bool) -> float:
    """Seconds from ``since`` until one produce to partition 0 is acknowledged (-1: never)."""
    deadline = since + (IDEMPOTENT_PROBE_S if idempotent else PROBE_TIMEOUT_S)
    pid = epoch = -1
    while time.monotonic() < deadline:
        try:
            with WireClient(host, port, timeout=10) as c:
                if idempotent and pid < 0:
                    pid, epoch = c.init_producer_id()
                batch = make_batch([b"probe"], producer_id=pid, epoch=epoch,
                                   base_sequence=0 if idempotent else -1)
                while time.monotonic() < deadline:
                    r = c.produce(topic, batch, partition=0)
                    if r.error_code == 0:
                        return time.monotonic() - since
                    time.sleep(0.1)
        except (OSError, AssertionError, ValueError):
            time.sleep(0.1)
    return -1.0


def run_schedule(broker_factory: Any, s3_endpoint: Any, steps: list[Any], *,
                 partitions: int = 3, confluent: int = 3, kafka_python: int = 2,
                 rate: float = 400.0, wal_capacity: int = 64 << 20,
                 log_cache: int = 4 << 20, log: Any = print) -> Outcome:
    """Start a broker behind a store proxy, write, apply ``steps``, stop, read, check."""
    proxy = proxy_for(s3_endpoint)
    url = s3_bucket_url(s3_endpoint.url, proxy.url, f"chaos-{time.time_ns()}")
    bp = broker_factory(broker_args(url, wal_capacity=wal_capacity, log_cache=log_cache))
    topic = "chaos"
    with WireClient(bp.host, bp.port) as c:
        c.create_topic(topic, partitions)
    ledger = Ledger()
    stop = threading.Event()
    out_log = bp.log_path.with_name("rdkafka.log")
    rd_log = RdkafkaDebugLog(out_log)
    out = Outcome(report=None, rdkafka_log=str(out_log))  # type: ignore[arg-type]
    killed_at = 0.0
    try:
        rd_log.start()
        writers = start_writers(bp.bootstrap, topic, partitions, ledger, stop,
                                confluent=confluent, kafka_python=kafka_python, rate=rate)
        t_start = time.monotonic()
        for step in steps:
            name = step[0] if isinstance(step, tuple) else step
            if name == "run":
                time.sleep(step[1])
                out.steps.append(f"run{step[1]:.0f}")
                continue
            out.steps.append(name)
            if name == "cut":
                proxy.cut()
            elif name == "blackhole":
                proxy.blackhole()
            elif name == "restore":
                proxy.restore()
            elif name == "kill":
                bp.kill()
                killed_at = time.monotonic()
            elif name == "restart":
                t0 = killed_at or time.monotonic()
                bp.start()
                listen = time.monotonic() - t0
                produce = _probe(bp.host, bp.port, topic, t0, idempotent=False)
                idem = _probe(bp.host, bp.port, topic, t0, idempotent=True)
                interp = bp.interpreter_seconds() if hasattr(bp, "interpreter_seconds") else 0.0
                r = Restart(proxy.state, listen, produce, idem, interp)
                out.restarts.append(r)
                log(f"chaos: {r}")
            log(f"chaos: {name} at {time.monotonic() - t_start:.1f}s, acked so far "
                f"{len(ledger.acked)}")
        proxy.restore()
        stop.set()
        for w in writers:
            w.join(180)
        out.writer_errors = [f"{w.name}: {w.error!r}" for w in writers if w.error is not None]
        out.writer_errors += [f"{w.name}: still running" for w in writers if w.is_alive()]
        records = read_all(bp.bootstrap, topic, partitions, timeout=120)
        out.report = check(ledger, records)
        out.seconds = time.monotonic() - t_start
        return out
    finally:
        stop.set()
        proxy.close()
        rd_log.stop()
