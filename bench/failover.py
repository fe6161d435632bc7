"""Failover bench: kill -9 of a broker of a 3-broker cluster under produce load.

Three brokers on this machine (file:// object store + SQLite metadata, each its own process
and WAL) with the DEFAULT lease settings (``--cluster-lease-ms`` 6000, margin 1000) and the
default upload settings (records stay in the WAL until a 64 MiB / 60 s upload). Two
confluent-kafka idempotent acks=all producers (linger 5 ms) each send a paced stream of
512-byte records round-robin over 9 partitions (3 per broker). After a warm-up broker 1 (not
the controller) is killed with SIGKILL. Printed per run and as ranges over the runs:

- **produce back**: from the kill until every partition the victim led has acknowledged a
  record at or past the start offset of its new leader epoch (``cluster_leader_epochs``), i.e.
  accepts produces on another broker (goal: under 10 s);
- **WAL readable**: from the kill until a consumer (assigned at kill time to the victim's
  partitions at the last offset the victim acknowledged) has read that last acknowledged
  record of every one of them - those records were only in the victim's WAL;
- **p99 on the survivors**: produce latency (send -> delivery callback) of records on
  partitions of the surviving brokers, sent in the 5 s before the kill vs sent between the
  kill and "produce back";
- the taker's ``takeover finished`` line (records recovered from the dead WAL, took_ms).

The time includes the client's side (librdkafka's metadata refresh and retry backoff), as a
user would see it. Run: ``python -m bench.failover [--runs 3] [--rate 1500]`` (about 40 s a
run on the shared 2-core machine); ``make bench-failover``.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import re
import shutil
import signal
import sqlite3
import tempfile
import threading
import time

from bench.common import BrokerProc, pct, wait_until

TOPIC = "bench-failover"
PARTITIONS = 9
VALUE = b"x" * 512
VICTIM = 1


class PacedProducer:
    """An idempotent acks=all producer sending ``rate`` records/s round-robin; every ack is
    (monotonic send time, latency s, partition, offset)."""

    def __init__(self, bootstrap: str, rate: int, start: int) -> None:
        from confluent_kafka import Producer  # noqa: PLC0415
        self.acks: list[tuple[float, float, int, int]] = []
        self.errors: list[str] = []
        self._p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                            "acks": "all", "linger.ms": 5, "message.timeout.ms": 120000,
                            "log_level": 2})   # the dead broker's refused connects: quiet
        self._rate = rate
        self._i = start
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _cb(self, err, msg) -> None:
        now = time.monotonic()
        if err is not None:
            self.errors.append(str(err))
        else:
            lat = msg.latency() or 0.0
            self.acks.append((now - lat, lat, msg.partition(), msg.offset()))

    def _run(self) -> None:
        tick = 0.01
        per_tick = max(1, int(self._rate * tick))
        nxt = time.monotonic()
        while not self._stop.is_set():
            for _ in range(per_tick):
                try:
                    self._p.produce(TOPIC, VALUE, partition=self._i % PARTITIONS,
                                    on_delivery=self._cb)
                except BufferError:
                    break
                self._i += 1
            self._p.poll(0)
            nxt += tick
            d = nxt - time.monotonic()
            if d > 0:
                self._p.poll(d)
            else:
                nxt = time.monotonic()
        self._p.flush(120)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(150)


class Cluster:
    """Brokers 0..2 sharing a file:// object store and a SQLite metadata database."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="s3kbench-failover-")
        self.db = os.path.join(self.dir, "meta.db")
        self.brokers: list[BrokerProc] = []

    def add(self) -> BrokerProc:
        n = len(self.brokers)
        b = BrokerProc(["--node-id", str(n), "--object-store", f"file://{self.dir}/objects",
                        "--metadata", f"sqlite:///{self.db}", "--log-level", "INFO"],
                       data_dir=os.path.join(self.dir, f"b{n}"))
        os.makedirs(b.data_dir, exist_ok=True)
        b.log_path = os.path.join(b.data_dir, "broker.log")
        self.brokers.append(b.start())
        return b

    def epoch_start(self, partition: int, epoch: int) -> int | None:
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5) as c:
            row = c.execute("SELECT e.start_offset FROM cluster_leader_epochs e JOIN "
                            "kafka_topics t ON t.topic_id = e.topic_id WHERE t.name = ? AND "
                            "e.partition_index = ? AND e.leader_epoch = ?",
                            (TOPIC, partition, epoch)).fetchone()
        return None if row is None else int(row[0])

    def close(self, keep: bool = False, copy_to: str | None = None) -> None:
        """Stop the brokers; their directory (logs) is kept when ``keep`` (a failed run);
        ``copy_to``: copy the brokers' logs there."""
        for b in self.brokers:
            if b.proc is not None and b.proc.poll() is None:
                b.proc.kill()
                b.proc.wait()
        if copy_to:
            os.makedirs(copy_to, exist_ok=True)
            for i, b in enumerate(self.brokers):
                shutil.copy(b.log_path, os.path.join(copy_to, f"b{i}.log"))
        if keep:
            print(f"run failed: brokers' logs kept in {self.dir}/b*/broker.log", flush=True)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def leaders(admin) -> dict[int, tuple[int, int]]:
    d = admin.describe_topics([TOPIC])[0]
    return {p["partition_index"]: (p["leader_id"], p["leader_epoch"]) for p in d["partitions"]}


wait = functools.partial(wait_until, timeout=60.0)


def read_last(bootstrap: str, last: dict[int, int], t0: float, out: dict) -> None:
    """Consumer thread: time (since t0) at which the record at ``last[p]`` was read, for every
    partition (polling from the kill on; fetches fail until the partitions reopen)."""
    from confluent_kafka import Consumer, TopicPartition  # noqa: PLC0415
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-failover-reader",
                  "enable.auto.commit": False, "topic.metadata.refresh.interval.ms": 1000,
                  "log_level": 2})
    c.assign([TopicPartition(TOPIC, p, off) for p, off in last.items()])
    todo = set(last)
    end = time.monotonic() + 60
    while todo and time.monotonic() < end:
        m = c.poll(0.1)
        if m is None or m.error():
            continue
        if m.partition() in todo and m.offset() >= last[m.partition()]:
            todo.discard(m.partition())
    out["wal_readable_s"] = None if todo else time.monotonic() - t0
    c.close()


def one_run(rate: int, warmup: float, keep_logs: str | None = None) -> dict:
    from kafka.admin import KafkaAdminClient, NewTopic  # noqa: PLC0415
    cl = Cluster()
    producers: list[PacedProducer] = []
    res: dict = {}
    try:
        for _ in range(3):
            cl.add()
        boot = ",".join(b.bootstrap for b in cl.brokers)
        admin = KafkaAdminClient(bootstrap_servers=boot)
        wait(lambda: len(admin.describe_cluster()["brokers"]) == 3, what="3 brokers")
        admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])
        wait(lambda: (len(ls := leaders(admin)) == PARTITIONS
                      and {le[0] for le in ls.values()} == {0, 1, 2}), what="leaders")
        before = leaders(admin)
        admin.close()
        producers = [PacedProducer(boot, rate, k) for k in range(2)]
        time.sleep(warmup)
        victim_parts = sorted(p for p, (lead, _) in before.items() if lead == VICTIM)
        acks = [a for pr in producers for a in list(pr.acks)]
        last = {p: max(off for _, _, q, off in acks if q == p) for p in victim_parts}
        cl.brokers[VICTIM].proc.send_signal(signal.SIGKILL)
        t_kill, wall_kill = time.monotonic(), time.time()
        survivors = ",".join(b.bootstrap for i, b in enumerate(cl.brokers) if i != VICTIM)
        reader: dict = {}
        rt = threading.Thread(target=read_last, args=(survivors, last, t_kill, reader),
                              daemon=True)
        rt.start()
        admin = KafkaAdminClient(bootstrap_servers=survivors)
        after = wait(lambda: (ls := leaders(admin)) and all(
            ls[p][0] not in (VICTIM, -1) and ls[p][1] > before[p][1] for p in victim_parts)
            and ls, what="new leaders")
        starts = {p: wait(lambda p=p: cl.epoch_start(p, after[p][1]), what="epoch start")
                  for p in victim_parts}
        admin.close()

        def back() -> float | None:
            first = {}
            for pr in producers:
                for sent, lat, p, off in list(pr.acks):
                    if p in starts and off >= starts[p]:
                        t = sent + lat
                        first[p] = min(first.get(p, t), t)
            return max(first.values()) if len(first) == len(starts) else None
        t_back = wait(back, what="victim's partitions accept produces")
        rt.join(70)
        time.sleep(1.0)
        for pr in producers:
            pr.stop()
        acks = [a for pr in producers for a in pr.acks]
        surv = [(s, lat) for s, lat, p, _ in acks if p not in victim_parts]
        pre = [lat for s, lat in surv if t_kill - 5 <= s < t_kill]
        during = [lat for s, lat in surv if t_kill <= s < t_back]
        logs = "\n".join(b.log_text() for b in cl.brokers)
        m = re.search(rf"takeover finished node_id={VICTIM} records=(\d+) committed=(\d+) "
                      r".*?took_ms=(\d+)", logs)
        f = re.search(rf"broker fenced node_id={VICTIM} .*", logs)
        res_phases = timeline(logs, wall_kill, wall_kill + (t_back - t_kill), after,
                              victim_parts)
        res = {"back_s": t_back - t_kill, "wal_readable_s": reader.get("wal_readable_s"),
               "p99_before_ms": pct(pre, 0.99) * 1000, "p99_during_ms": pct(during, 0.99) * 1000,
               "p50_before_ms": pct(pre, 0.5) * 1000, "p50_during_ms": pct(during, 0.5) * 1000,
               "samples": (len(pre), len(during)),
               "takeover_records": int(m.group(1)) if m else None,
               "takeover_committed": int(m.group(2)) if m else None,
               "takeover_ms": int(m.group(3)) if m else None,
               "fenced": f.group(0) if f else None,
               "errors": sum(len(pr.errors) for pr in producers),
               "victim_partitions": victim_parts, "phases": res_phases}
        producers = []
    finally:
        for pr in producers:
            pr.stop()
        cl.close(keep=not res, copy_to=keep_logs)
    return res


def _ts(line: str) -> float:
    m = re.search(r"ts=(\S+)", line)
    return datetime.datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()


def timeline(logs: str, wall_kill: float, wall_back: float, after: dict,
             victim_parts: list[int]) -> dict[str, float]:
    """Seconds from the kill to each step, from the brokers' logs: the victim's last lease
    renewal is not logged, so ``fenced`` includes lease + margin; then the taker starts,
    finishes the takeover, reassigns, the new leaders open the partitions, clients ack."""
    out: dict[str, float] = {}
    pats = {"fenced": rf"broker fenced node_id={VICTIM} ",
            "takeover_started": rf"takeover started node_id={VICTIM} ",
            "takeover_finished": rf"takeover finished node_id={VICTIM} ",
            "reassigned": rf"partitions reassigned node_id={VICTIM} "}
    lines = logs.splitlines()
    for k, pat in pats.items():
        hit = [ln for ln in lines if re.search(pat, ln) and "ts=" in ln]
        if hit:
            out[k] = min(_ts(ln) for ln in hit) - wall_kill
    opened = [ln for ln in lines if "partition opened" in ln and "ts=" in ln and any(
        f"topic={TOPIC} partition={p} leader_epoch={after[p][1]} " in ln for p in victim_parts)]
    if opened:
        out["all_opened"] = max(_ts(ln) for ln in opened) - wall_kill
    out["produce_back"] = wall_back - wall_kill
    return out


def _rng(xs: list) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{min(xs):.2f}-{max(xs):.2f}" if len(xs) > 1 else f"{xs[0]:.2f}"


def report(runs: list[dict], rate: int) -> str:
    lines = [f"## Failover: kill -9 of 1 of 3 brokers, default lease (6 s + 1 s margin), "
             f"2 idempotent acks=all producers x {rate} records/s of 512 B over "
             f"{PARTITIONS} partitions", "",
             "| run | produce back s | WAL readable s | survivors p99 before / during ms | "
             "p50 before / during ms | takeover records / took ms | producer errors |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(runs, 1):
        wr = r["wal_readable_s"]
        lines.append(f"| {i} | {r['back_s']:.2f} | {'-' if wr is None else f'{wr:.2f}'} | "
                     f"{r['p99_before_ms']:.1f} / {r['p99_during_ms']:.1f} | "
                     f"{r['p50_before_ms']:.1f} / {r['p50_during_ms']:.1f} | "
                     f"{r['takeover_records']} / {r['takeover_ms']} | {r['errors']} |")
    steps = ("fenced", "takeover_started", "takeover_finished", "reassigned", "all_opened",
             "produce_back")
    lines += ["", "timeline from the kill (s): " + " -> ".join(steps)]
    for i, r in enumerate(runs, 1):
        ph = r.get("phases") or {}
        lines.append(f"- run {i}: " + " -> ".join(
            f"{ph[k]:.2f}" if k in ph else "-" for k in steps))
    lines += ["", f"ranges over {len(runs)} runs: produce back {_rng([r['back_s'] for r in runs])} s "
              f"(goal < 10 s), WAL readable {_rng([r['wal_readable_s'] for r in runs])} s, "
              f"survivors' p99 before {_rng([r['p99_before_ms'] for r in runs])} ms, during "
              f"{_rng([r['p99_during_ms'] for r in runs])} ms",
              f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rate", type=int, default=1500, help="records/s per producer")
    ap.add_argument("--warmup", type=float, default=8.0, help="seconds of load before the kill")
    ap.add_argument("--keep-logs", metavar="DIR", help="copy the brokers' logs here (run<i>/)")
    a = ap.parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    t0 = time.monotonic()
    runs = []
    for i in range(a.runs):
        r = one_run(a.rate, a.warmup,
                    a.keep_logs and os.path.join(a.keep_logs, f"run{i + 1}"))
        print(f"run {i + 1}: back {r['back_s']:.2f} s, WAL readable {r['wal_readable_s']}, "
              f"p99 {r['p99_before_ms']:.1f} -> {r['p99_during_ms']:.1f} ms, {r['fenced']}, "
              f"timeline {r.get('phases')}", flush=True)
        runs.append(r)
    print(report(runs, a.rate))
    print(f"took {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
