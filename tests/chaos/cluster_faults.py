"""A 3-broker cluster to break: real broker processes, each with its WAL in a file, one moto
S3 server and one private PostgreSQL server, every broker reaching both through its own TCP
proxy (tests/tcp_proxy.py), a short lease (2 s) so failover is quick.

Faults (each bounded in time, all on 127.0.0.1):
- ``kill``: kill -9 of one broker, then start it again (it waits until its WAL was taken over);
- ``pause``: SIGSTOP of one broker until the controller fenced it (at least lease + margin +
  2 s, at most PAUSE_MAX_S: a pause never fenced is an anomaly), then SIGCONT (it finds itself
  fenced and exits 4; the supervisor starts it again);
- ``store_cut``: the object store cut for every broker, then restored;
- ``pg_cut``: PostgreSQL cut for every broker (longer than the lease), then restored;
- ``pg_restart``: PostgreSQL restarted (immediate stop: a crash, then recovery);
- ``wal_full``: the object store cut for the broker with the tiny WAL until its WAL is full
  (producers back-pressured), then restored.

A supervisor thread restarts any broker that exits on its own (as systemd or Kubernetes
would), counting exits by code; an exit other than 4 (fenced) is reported.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import boto3

from cluster.kit import ClusterFactory, leaders, wait_for
from pgserver import PostgresServer
from tcp_proxy import TcpProxy

LEASE_MS = 2000
MARGIN_MS = 500
PAUSE_MAX_S = 30.0                  # a SIGSTOP lasts until fenced, at most this long
TINY_WAL = 1 << 20                  # the WAL of the last broker: fills within seconds
FAULTS = ("kill", "pause", "store_cut", "pg_cut", "pg_restart", "wal_full")


class ChaosPostgres(PostgresServer):
    """The test PostgreSQL with synchronous commits (an immediate restart must not lose a
    commit the broker was told about) that can be restarted in place."""

    def start(self) -> "ChaosPostgres":
        self._run(os.path.join(self.bindir, "initdb"), "-D", self.data, "-U", self.USER,
                  "--auth=trust", "-E", "UTF8", "--no-sync", "--locale=C")
        opts = (f"-p {self.port} -k {self.dir} -c listen_addresses={self.host} -c fsync=off"
                " -c synchronous_commit=on -c max_connections=200 -c shared_buffers=32MB")
        self._run(os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-o", opts, "-w",
                  "-t", "60", "-l", os.path.join(self.dir, "server.log"), "start")
        return self

    def activity(self) -> list[str]:
        """What every PostgreSQL session is doing and waiting for (to chase a stuck call)."""
        import psycopg  # noqa: PLC0415
        try:
            with psycopg.connect(host=self.host, port=self.port, user=self.USER,
                                 dbname="postgres", connect_timeout=5) as c:
                rows = c.execute(
                    "SELECT pid, application_name, client_port, state, wait_event_type, "
                    "wait_event, now() - xact_start, now() - state_change, "
                    "pg_blocking_pids(pid), left(query, 160) FROM pg_stat_activity "
                    "WHERE datname IS NOT NULL AND pid <> pg_backend_pid() "
                    "ORDER BY xact_start NULLS LAST").fetchall()
        except Exception as e:  # noqa: BLE001 - diagnostics only
            return [f"pg_stat_activity unavailable: {e!r}"]
        return [" | ".join(str(x) for x in r) for r in rows]

    def restart(self) -> None:
        """Immediate stop (no checkpoint: crash recovery at start), then start again."""
        self._run(os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-m", "immediate",
                  "-w", "-t", "60", "-l", os.path.join(self.dir, "server.log"), "restart")


@dataclass
class Node:
    id: int
    broker: Any                 # conftest.BrokerProcess
    s3: TcpProxy
    pg: TcpProxy
    lock: threading.Lock = field(default_factory=threading.Lock)   # held by a fault


class ChaosCluster:
    """``n`` brokers on one S3 bucket and one PostgreSQL database, each through its proxies."""

    def __init__(self, broker_factory: Any, s3_endpoint: Any, n: int = 3,
                 wal_capacity: int = 64 << 20, tiny_wal_node: int | None = -1,
                 log: Any = print) -> None:
        self.log = log
        self.pg = ChaosPostgres().start()
        self.nodes: list[Node] = []
        self.exits: Counter = Counter()            # exit code -> count (supervised)
        self.unexpected_exits: list[str] = []
        self.start_failures = 0
        self.faults: Counter = Counter()
        self.fault_log: list[str] = []
        self.unfenced_pauses: list[str] = []       # SIGSTOPs no controller fenced in time
        self._stop = threading.Event()
        self.t0 = time.monotonic()                 # fault times are logged relative to it
        self.topic = "queue"                       # the workload's topic (wal_full moves one)
        try:
            self.db_url = self.pg.new_database("chaos")
            db = self.db_url.rsplit("/", 1)[1]
            bucket = f"chaos-{os.getpid()}-{time.time_ns()}"
            boto3.client("s3", endpoint_url=s3_endpoint.url, region_name="us-east-1",
                         aws_access_key_id="testing",
                         aws_secret_access_key="testing").create_bucket(Bucket=bucket)
            s3_host, s3_port = s3_endpoint.host, s3_endpoint.port
            s3p = [TcpProxy(s3_host, s3_port) for _ in range(n)]
            pgp = [TcpProxy(self.pg.host, self.pg.port) for _ in range(n)]
            self.tiny = (n - 1) if tiny_wal_node == -1 else tiny_wal_node

            def per_node(i: int) -> list[str]:
                store = (f"s3://{bucket}/kafka?endpoint_url={s3p[i].url}&region=us-east-1"
                         "&access_key_id=testing&secret_access_key=testing"
                         "&connect_timeout=1&read_timeout=2&max_attempts=1")
                meta = f"postgresql://{PostgresServer.USER}@127.0.0.1:{pgp[i].port}/{db}"
                cap = TINY_WAL if i == self.tiny else wal_capacity
                return ["--object-store", store, "--metadata", meta, "--wal-capacity", str(cap)]
            shared = ["--cluster-lease-ms", str(LEASE_MS),
                      "--cluster-takeover-margin-ms", str(MARGIN_MS),
                      "--upload-interval-s", "1", "--upload-threshold-bytes", str(256 << 10),
                      "--log-cache-bytes", str(16 << 20), "--backpressure-timeout-s", "2",
                      "--cleanup-interval-s", "2",
                      # Kafka's default (tests default to 0): kafka-python 3.0.12 joins before
                      # it has the topic's metadata and can hang in the rebalance that follows
                      # (docs/groups.md); with the delay its first assignment has the topic
                      "--group-initial-rebalance-delay-ms", "3000"]
            brokers = ClusterFactory(broker_factory, shared)(n, per_node=per_node)
            self.nodes = [Node(i, b, s3p[i], pgp[i]) for i, b in enumerate(brokers)]
        except BaseException:
            self.close()
            raise
        self._sup = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._sup.start()

    @property
    def bootstrap(self) -> str:
        return ",".join(nd.broker.bootstrap for nd in self.nodes)

    # -- supervision --------------------------------------------------------------------------
    def _supervise(self) -> None:
        while not self._stop.wait(0.2):
            for nd in self.nodes:
                if not nd.lock.acquire(blocking=False):
                    continue                           # a fault owns it right now
                try:
                    proc = nd.broker.proc
                    if proc is not None and proc.poll() is not None and not self._stop.is_set():
                        code = proc.returncode
                        self.exits[code] += 1
                        self.log(f"chaos: broker {nd.id} exited with {code} at "
                                 f"{time.monotonic() - self.t0:.1f}s; restarting")
                        if code != 4:
                            self.unexpected_exits.append(
                                f"broker {nd.id} exited with {code}:\n{nd.broker.log_tail(15)}")
                        self._start(nd)
                finally:
                    nd.lock.release()

    def _start(self, nd: Node, timeout: float = 150.0) -> None:
        """Start a stopped broker, retrying while it cannot (PostgreSQL away, still fenced)."""
        deadline = time.monotonic() + timeout
        while not self._stop.is_set():
            try:
                nd.broker.start()
                return
            except (RuntimeError, AssertionError) as e:
                self.start_failures += 1
                if time.monotonic() > deadline:
                    self.unexpected_exits.append(f"broker {nd.id} did not restart: {e}")
                    return
                self.log(f"chaos: broker {nd.id} start failed, retrying: "
                         f"{str(e).splitlines()[0]}")
                time.sleep(1.0)

    def all_running(self, timeout: float = 120.0) -> bool:
        """Until every broker process runs (the supervisor restarts the ones that exited)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(nd.broker.running and not nd.lock.locked() for nd in self.nodes):
                return True
            time.sleep(0.2)
        return False

    # -- faults ---------------------------------------------------------------------------------
    def inject(self, fault: str, victim: int) -> str:
        """Apply one fault (blocking until it is lifted); returns what was done."""
        t0 = time.monotonic()
        nd = self.nodes[victim]
        if fault == "kill":
            with nd.lock:
                nd.broker.kill()
                time.sleep(1.0)
                self._start(nd)
            what = f"kill -9 broker {victim}, restarted"
        elif fault == "pause":
            # SIGSTOP until the controller fenced it (its node epoch bumped), at least lease +
            # margin + 2 s: on a loaded machine the watchers' own slow rounds count as blind
            # time (broker/cluster/lease.py), so a fixed pause may end before anyone fenced it
            # and the fault would test nothing
            epoch0 = self._node_epoch(victim)
            min_s = (LEASE_MS + MARGIN_MS) / 1000 + 2.0
            with nd.lock:
                nd.broker.proc.send_signal(signal.SIGSTOP)
                t_stop = time.monotonic()
                time.sleep(min_s)
                fenced = False
                while time.monotonic() - t_stop < PAUSE_MAX_S:
                    epoch = self._node_epoch(victim)
                    if epoch is not None and epoch0 is not None and epoch > epoch0:
                        fenced = True
                        break
                    time.sleep(0.25)
                pause_s = time.monotonic() - t_stop
                if not fenced:
                    self.unfenced_pauses.append(f"broker {victim} paused {pause_s:.1f}s at "
                                                f"{t_stop - self.t0:.1f}s was not fenced")
                nd.broker.proc.send_signal(signal.SIGCONT)
                try:
                    code: Any = nd.broker.proc.wait(15)     # fenced: exits 4
                except subprocess.TimeoutExpired:
                    code = "still running"
                if code == 4:
                    self.exits[4] += 1
                    self._start(nd)
                elif code != "still running":
                    self.unexpected_exits.append(f"broker {victim} exited with {code} after "
                                                 f"SIGCONT:\n{nd.broker.log_tail(15)}")
                    self._start(nd)
            what = (f"SIGSTOP broker {victim} {pause_s:.1f}s "
                    f"({'fenced' if fenced else 'NOT fenced'}), SIGCONT: {code}")
        elif fault == "store_cut":
            for n in self.nodes:
                n.s3.cut()
            time.sleep(5.0)
            for n in self.nodes:
                n.s3.restore()
            what = "object store cut 5s for all"
        elif fault == "pg_cut":
            cut_s = LEASE_MS / 1000 * 1.5
            for n in self.nodes:
                n.pg.cut()
            time.sleep(cut_s)
            for n in self.nodes:
                n.pg.restore()
            what = f"PostgreSQL cut {cut_s:.1f}s for all"
        elif fault == "pg_restart":
            self.pg.restart()
            what = "PostgreSQL restarted (immediate)"
        elif fault == "wal_full":
            tn = self.nodes[self.tiny]
            self.all_running()      # it may have just been fenced (PostgreSQL cut): restarting
            try:
                moved = self._lead_one(self.tiny)
            except AssertionError as e:       # the cluster would not move a partition there
                what = f"@{t0 - self.t0:.1f}s wal_full NOT injected (not counted): {e}"
                self.fault_log.append(what)
                return what

            def full_now() -> bool:   # a wal_full episode began (this start) and has not ended
                t = tn.broker.log_text()
                t = t[t.rfind("===== start"):]
                return (t.count("episode=wal_full state=started")
                        > t.count("episode=wal_full state=ended"))
            tn.s3.cut()
            deadline = time.monotonic() + 20
            full = False
            while time.monotonic() < deadline:
                if full_now():
                    full = True
                    break
                time.sleep(0.25)
            time.sleep(2.0 if full else 0)
            tn.s3.restore()
            what = (f"object store cut for broker {self.tiny} (WAL {TINY_WAL >> 20} MiB"
                    f"{', a partition moved to it first' if moved else ''}): "
                    f"{'WAL full' if full else 'WAL NOT full within 20 s'}")
        else:
            raise ValueError(fault)
        self.faults[fault] += 1
        what = f"@{t0 - self.t0:.1f}s {what} ({time.monotonic() - t0:.1f}s)"
        self.fault_log.append(what)
        return what

    def _node_epoch(self, node: int) -> int | None:
        """The node's epoch in the cluster registry, read directly (not through the proxies);
        None when PostgreSQL does not answer."""
        import psycopg  # noqa: PLC0415
        try:
            with psycopg.connect(self.db_url, connect_timeout=3) as c:
                row = c.execute("SELECT node_epoch FROM cluster_brokers WHERE node_id = %s",
                                (node,)).fetchone()
        except Exception:  # noqa: BLE001 - PostgreSQL restarting: ask again
            return None
        return None if row is None else int(row[0])

    def _lead_one(self, node: int) -> bool:
        """Make ``node`` lead a partition of ``self.topic`` (a move) if it leads none, so
        that producers write to its WAL; True if a move was made."""
        from kafka import TopicPartition  # noqa: PLC0415
        from kafka.admin import KafkaAdminClient  # noqa: PLC0415
        deadline = time.monotonic() + 60
        while True:         # a broker may restart meanwhile (fenced): ask again, bounded
            admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=10000)
            try:
                ls = leaders(admin, self.topic)
                if any(lead == node for lead, _ in ls.values()):
                    return False
                p = min(ls)
                admin.alter_partition_reassignments({TopicPartition(self.topic, p): [node]})
                wait_for(lambda: leaders(admin, self.topic)[p][0] == node, timeout=20,
                         what=f"partition {p} moving to broker {node}")
                return True
            except Exception:  # noqa: BLE001 - retried until the deadline, then raised
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
            finally:
                admin.close()

    def close(self) -> None:
        self._stop.set()
        for nd in self.nodes:
            try:
                nd.broker.proc.send_signal(signal.SIGCONT)
            except Exception:  # noqa: BLE001 - not running
                pass
            nd.broker.kill()
            nd.s3.close()
            nd.pg.close()
        self.pg.stop()


def short_schedule(seed: int = 17, rounds: int = 2) -> list[tuple[str, int]]:
    """Every fault ``rounds`` times in a shuffled order, victims rotating."""
    rnd = random.Random(seed)
    faults = [f for _ in range(rounds) for f in FAULTS]
    rnd.shuffle(faults)
    return [(f, i % 3) for i, f in enumerate(faults)]


def timed_schedule(seconds: float, seed: int) -> list[tuple[str, int]]:
    """Random faults for about ``seconds`` (each fault with its recovery takes ~10 s)."""
    rnd = random.Random(seed)
    return [(rnd.choice(FAULTS), rnd.randrange(3)) for _ in range(int(seconds / 10))]
