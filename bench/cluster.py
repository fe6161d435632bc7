"""Cluster bench: partition moves, a joining broker, and 1/2/3-broker produce throughput.

One cluster on this machine (each broker its own process and WAL) grows from 1 to 3 brokers
under one confluent-kafka idempotent acks=all producer (512-byte records round-robin over 6
partitions, flat out), on two storage setups: ``files`` (file:// object store + SQLite
metadata) and ``s3pg`` (a moto S3 server + a private PostgreSQL server from Debian's package,
as a cluster of several hosts would use; tests/pgserver.py starts it):

- throughput with 1, 2 and 3 brokers (acknowledged records/s and MB/s over a window, after
  the cluster has balanced); the producer load is the same, spread over all partitions;
- join: from spawning a broker process to the first acknowledged produce on a partition it
  received (the first ack at an offset >= the start offset of its new leader epoch);
- moves: AlterPartitionReassignments on a 3-broker cluster under load, from the request to the
  first acknowledged produce on the new leader (same rule), several moves, p50 and max.

Run: ``python -m bench.cluster [--backend files|s3pg|both] [--runs N]`` (about 1-2 minutes
per run and setup); with several runs the figures are printed per run and as ranges.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import functools
import os
import re
import shutil
import sqlite3
import subprocess
import tempfile
import threading
import time

from bench.common import BrokerProc, pct, start_moto_s3, wait_until

TOPIC = "bench-cluster"
PARTITIONS = 6
VALUE = b"x" * 512


class Load:
    """One confluent-kafka idempotent acks=all producer, flat out, round-robin partitions;
    every ack is recorded as (monotonic time, partition, offset)."""

    def __init__(self, bootstrap: str) -> None:
        from confluent_kafka import Producer  # noqa: PLC0415
        self.acks: list[tuple[float, int, int]] = []
        self.errors = 0
        self._p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                            "acks": "all", "linger.ms": 5, "batch.size": 256 << 10,
                            "queue.buffering.max.messages": 20000,
                            "message.timeout.ms": 60000,
                            "topic.metadata.refresh.interval.ms": 1000})
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _cb(self, err, msg) -> None:
        if err is not None:
            self.errors += 1
        else:
            self.acks.append((time.monotonic(), msg.partition(), msg.offset()))

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                self._p.produce(TOPIC, VALUE, partition=i % PARTITIONS, on_delivery=self._cb)
                i += 1
            except BufferError:
                self._p.poll(0.01)
            if i % 100 == 0:
                self._p.poll(0)
        self._p.flush(60)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(90)

    def first_ack(self, partition: int, min_offset: int, after: float, timeout: float = 30
                  ) -> float | None:
        """Monotonic time of the first ack on ``partition`` at offset >= ``min_offset``."""
        end = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < end:
            acks = self.acks
            for t, p, off in acks[seen:]:
                if p == partition and off >= min_offset and t >= after:
                    return t
            seen = max(0, len(acks) - 1)
            time.sleep(0.01)
        return None


class Backend:
    """Where the cluster keeps its data: ``files`` (file:// + SQLite in the cluster's dir) or
    ``s3pg`` (a moto S3 server and a PostgreSQL server, started here, stopped by close())."""

    def __init__(self, kind: str, dir: str) -> None:
        self.kind = kind
        self._moto: subprocess.Popen | None = None
        self._pg = None
        if kind == "files":
            self.db = os.path.join(dir, "meta.db")
            self.store, self.meta = f"file://{dir}/objects", f"sqlite:///{self.db}"
            return
        try:
            from tests.pgserver import PostgresServer  # noqa: PLC0415
            self._pg = PostgresServer().start()
            self.meta = self._pg.new_database("bench")
            self._moto, self.store = start_moto_s3("cluster")
        except BaseException:
            self.close()
            raise

    def query_one(self, sql: str, args: tuple) -> tuple | None:
        if self.kind == "files":
            with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5) as c:
                return c.execute(sql, args).fetchone()
        import psycopg  # noqa: PLC0415
        with psycopg.connect(self.meta) as c:
            return c.execute(sql.replace("?", "%s"), args).fetchone()

    def close(self) -> None:
        if self._moto is not None:
            self._moto.terminate()
            self._moto.wait(10)
            self._moto = None
        if self._pg is not None:
            self._pg.stop()
            self._pg = None


class Cluster:
    """Brokers 0..n-1 sharing one object store and one metadata database."""

    def __init__(self, backend: str = "files") -> None:
        self.dir = tempfile.mkdtemp(prefix="s3kbench-cluster-")
        self.backend = Backend(backend, self.dir)
        self.brokers: list[BrokerProc] = []

    def add(self) -> BrokerProc:
        n = len(self.brokers)
        b = BrokerProc(["--node-id", str(n), "--object-store", self.backend.store,
                        "--metadata", self.backend.meta, "--upload-interval-s", "2",
                        "--log-level", "INFO",      # the cluster's move lines (quiet idle)
                        # moto can take > 15 s to answer on a loaded box: start anyway
                        *(["--allow-degraded-start"] if self.backend.kind == "s3pg" else [])],
                       data_dir=os.path.join(self.dir, f"b{n}"))
        os.makedirs(b.data_dir, exist_ok=True)
        b.log_path = os.path.join(b.data_dir, "broker.log")
        self.brokers.append(b)       # stopped by close() even if it never comes up
        b.start()
        return b

    def epoch_start(self, partition: int, epoch: int) -> int | None:
        """Where ``epoch`` of the topic's ``partition`` began (cluster_leader_epochs)."""
        row = self.backend.query_one(
            "SELECT e.start_offset FROM cluster_leader_epochs e JOIN kafka_topics t ON "
            "t.topic_id = e.topic_id WHERE t.name = ? AND e.partition_index = ? AND "
            "e.leader_epoch = ?", (TOPIC, partition, epoch))
        return None if row is None else int(row[0])

    def opened_at(self, node: int, partition: int, epoch: int) -> float | None:
        """Wall time the new leader logged ``partition opened`` for ``epoch``."""
        pat = re.compile(rf"ts=(\S+) .*partition opened topic={TOPIC} partition={partition} "
                         rf"leader_epoch={epoch} ")
        for m in pat.finditer(self.brokers[node].log_text()):
            return datetime.datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
        return None

    def phases(self, partition: int, epoch: int, wall0: float, acked: float | None
               ) -> dict[str, float] | None:
        """One move's timeline from the brokers' logs (seconds): ``notice`` request -> the old
        leader starts releasing, ``release`` its release (close, upload, snapshot, hand-over),
        ``reopen`` hand-over -> the new leader opened it, ``client`` opened -> first ack."""
        text = "\n".join(b.log_text() for b in self.brokers)
        moved = re.search(rf"ts=(\S+) .*partition moved topic={TOPIC} partition={partition} "
                          rf"from=\d+ to=\d+ leader_epoch={epoch} .*release_ms=(\d+)", text)
        opened = re.search(rf"ts=(\S+) .*partition opened topic={TOPIC} partition={partition} "
                           rf"leader_epoch={epoch} ", text)
        if moved is None or opened is None:
            return None
        ts = lambda s: datetime.datetime.fromisoformat(  # noqa: E731
            s.replace("Z", "+00:00")).timestamp()
        t_moved, rel = ts(moved.group(1)), int(moved.group(2)) / 1000
        t_open = ts(opened.group(1))
        return {"notice": t_moved - rel - wall0, "release": rel, "reopen": t_open - t_moved,
                "client": (acked - t_open) if acked is not None else float("nan")}

    def close(self, keep: str | None = None) -> None:
        for b in self.brokers:
            b.stop()
        self.backend.close()
        if keep:                       # the brokers' logs, for a look at slow moves
            os.makedirs(keep, exist_ok=True)
            for b in self.brokers:
                shutil.copy(b.log_path, os.path.join(
                    keep, f"{self.backend.kind}-{os.path.basename(b.data_dir)}.log"))
        shutil.rmtree(self.dir, ignore_errors=True)


def leaders(admin) -> dict[int, tuple[int, int]]:
    d = admin.describe_topics([TOPIC])[0]
    return {p["partition_index"]: (p["leader_id"], p["leader_epoch"]) for p in d["partitions"]}


wait = functools.partial(wait_until, timeout=30.0)


def throughput(load: Load, seconds: float) -> tuple[float, float]:
    n0, t0 = len(load.acks), time.monotonic()
    time.sleep(seconds)
    n = len(load.acks) - n0
    dt = time.monotonic() - t0
    return n / dt, n * len(VALUE) / dt / 1e6


def run(window: float = 8.0, moves: int = 6, backend: str = "files",
        keep: str | None = None) -> dict:
    from kafka import TopicPartition  # noqa: PLC0415
    from kafka.admin import KafkaAdminClient, NewTopic  # noqa: PLC0415

    cl = Cluster(backend)
    out: dict = {"backend": backend, "throughput": {}, "join_s": [], "move_s": [], "open_s": [],
                 "phases": []}
    load = None
    try:
        cl.add()
        admin = KafkaAdminClient(bootstrap_servers=cl.brokers[0].bootstrap)
        admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])
        wait(lambda: len(leaders(admin)) == PARTITIONS and all(le[0] == 0 for le in leaders(admin).values()))
        load = Load(cl.brokers[0].bootstrap)
        wait(lambda: len(load.acks) > 1000)
        out["throughput"][1] = throughput(load, window)
        for n in (2, 3):
            before = leaders(admin)
            t_spawn = time.monotonic()
            b = cl.add()
            nid = n - 1
            got = wait(lambda: {p: le for p, le in leaders(admin).items() if le[0] == nid})
            p, (_, epoch) = sorted(got.items())[0]
            start = wait(lambda: cl.epoch_start(p, epoch) is not None and cl.epoch_start(p, epoch))
            start = cl.epoch_start(p, epoch)
            t = load.first_ack(p, start, t_spawn)
            out["join_s"].append(None if t is None else t - t_spawn)
            wait(lambda: all(le[0] == before[q][0] or le[0] == nid
                             for q, le in leaders(admin).items()))
            time.sleep(1.0)       # the moves of the join settle
            out["throughput"][n] = throughput(load, window)
            del b
        for k in range(moves):
            cur = leaders(admin)
            p = k % PARTITIONS
            old, epoch = cur[p]
            target = (old + 1) % 3
            t0, wall0 = time.monotonic(), time.time()
            admin.alter_partition_reassignments({TopicPartition(TOPIC, p): [target]})
            wait(lambda: leaders(admin)[p] == (target, epoch + 1))
            start = wait(lambda: cl.epoch_start(p, epoch + 1) is not None) and \
                cl.epoch_start(p, epoch + 1)
            t = load.first_ack(p, start, t0)
            out["move_s"].append(None if t is None else t - t0)
            opened = cl.opened_at(target, p, epoch + 1)
            out["open_s"].append(None if opened is None else opened - wall0)
            out["phases"].append(cl.phases(p, epoch + 1, wall0,
                                           None if t is None else wall0 + (t - t0)))
        load.stop()
        out["errors"] = load.errors
        load = None
        admin.close()
    finally:
        if load is not None:
            load.stop()
        cl.close(keep)
    return out


TITLES = {"files": "file:// object store + SQLite metadata",
          "s3pg": "moto S3 object store + PostgreSQL metadata"}


def report(out: dict) -> str:
    lines = [f"## Cluster ({TITLES[out['backend']]}, brokers on one machine)", "",
             "| brokers | acked records/s | MB/s |", "| --- | --- | --- |"]
    for n, (rps, mbs) in sorted(out["throughput"].items()):
        lines.append(f"| {n} | {rps:,.0f} | {mbs:.1f} |")
    moves = [m for m in out["move_s"] if m is not None]
    lines += ["", "| measure | samples | p50 s | max s |", "| --- | --- | --- | --- |",
              f"| reassignment request -> first ack on the new leader | {len(moves)}"
              f"/{len(out['move_s'])} | {pct(moves, 0.5):.2f} | {max(moves, default=float('nan')):.2f} |"]
    opens = [x for x in out["open_s"] if x is not None]
    lines.append(f"| (of which: request -> partition opened on the new leader, broker side) | "
                 f"{len(opens)}/{len(out['open_s'])} | {pct(opens, 0.5):.2f} | "
                 f"{max(opens, default=float('nan')):.2f} |")
    joins = [j for j in out["join_s"] if j is not None]
    lines.append(f"| broker spawn -> first ack on a partition it received | {len(joins)}"
                 f"/{len(out['join_s'])} | {pct(joins, 0.5):.2f} | "
                 f"{max(joins, default=float('nan')):.2f} |")
    ph = [x for x in out.get("phases", []) if x is not None]
    if ph:
        lines.append("| (phases, p50 s: request -> old leader releases / release / hand-over -> "
                     "opened / opened -> first ack) | " + f"{len(ph)} | " + " / ".join(
                         f"{pct([x[k] for x in ph], 0.5):.2f}"
                         for k in ("notice", "release", "reopen", "client")) + " | |")
    fmt = lambda xs: ", ".join("-" if x is None else f"{x:.2f}" for x in xs)  # noqa: E731
    lines += ["", f"moves (s): {fmt(out['move_s'])}; of which broker side (s): "
              f"{fmt(out['open_s'])}; joins (s): {fmt(out['join_s'])}"]
    lines += ["", f"producer errors: {out.get('errors', '?')}; "
              f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
    return "\n".join(lines)


def ranges(outs: list[dict]) -> str:
    """One line per figure: min-max over the runs (move p50 per run, every join)."""
    def rng(xs: list[float], f: str) -> str:
        return "-" if not xs else f"{min(xs):{f}} - {max(xs):{f}}"
    lines = [f"## Ranges over {len(outs)} runs ({TITLES[outs[0]['backend']]})", "",
             "| figure | range |", "| --- | --- |"]
    for n in (1, 2, 3):
        xs = [o["throughput"][n][0] for o in outs if n in o["throughput"]]
        lines.append(f"| acked records/s, {n} broker{'s' if n > 1 else ''} | {rng(xs, ',.0f')} |")
    p50s = [pct(m, 0.5) for o in outs if (m := [x for x in o["move_s"] if x is not None])]
    lines.append(f"| reassignment -> first ack on the new leader, p50 per run (s) | "
                 f"{rng(p50s, '.2f')} |")
    opens = [pct(m, 0.5) for o in outs if (m := [x for x in o["open_s"] if x is not None])]
    lines.append(f"| reassignment -> partition opened on the new leader, p50 per run (s) | "
                 f"{rng(opens, '.2f')} |")
    for k, what in (("notice", "request -> old leader releases"), ("release", "release"),
                    ("reopen", "hand-over -> opened on the new leader"),
                    ("client", "opened -> first ack (client)")):
        xs = [pct(v, 0.5) for o in outs
              if (v := [ph[k] for ph in o.get("phases", []) if ph is not None])]
        lines.append(f"| phase {what}, p50 per run (s) | {rng(xs, '.2f')} |")
    allm = [x for o in outs for x in o["move_s"] if x is not None]
    lines.append(f"| reassignment -> first ack, every move (s) | {rng(allm, '.2f')} |")
    joins = [x for o in outs for x in o["join_s"] if x is not None]
    lines.append(f"| broker spawn -> first ack on a partition it received (s) | "
                 f"{rng(joins, '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--window", type=float, default=8.0, help="throughput window, seconds")
    ap.add_argument("--moves", type=int, default=6)
    ap.add_argument("--backend", choices=("files", "s3pg", "both"), default="both")
    ap.add_argument("--runs", type=int, default=1, help="runs per backend (ranges if > 1)")
    ap.add_argument("--keep-logs", metavar="DIR", help="copy the brokers' logs here")
    a = ap.parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    t0 = time.monotonic()
    for backend in (("files", "s3pg") if a.backend == "both" else (a.backend,)):
        outs = []
        for _ in range(a.runs):
            keep = a.keep_logs and os.path.join(a.keep_logs, f"run{len(outs) + 1}")
            outs.append(run(a.window, a.moves, backend, keep))
            print(report(outs[-1]) + "\n", flush=True)
        if len(outs) > 1:
            print(ranges(outs) + "\n", flush=True)
    print(f"took {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
