"""Client-level benchmarks through confluent-kafka (librdkafka), run against s3kafka and the mock.

    python -m bench.clients [--seconds 8] [--sizes 100,1024,16384] [--skip-mock]
    python -m bench.clients --latency-only [--rates 1000,30000] [--seconds 5] [--trace]
                                                                             (s3kafka only)

Produce throughput (acks=all) per message size, consume throughput hot (LogCache) and cold
(object store: the broker is restarted, which uploads and empties the LogCache), and produce
latency p50/p99/p999 at fixed rates (a fraction of the measured maximum). The same runs go
against librdkafka's mock cluster and are reported as s3kafka/mock ratios.
"""
from __future__ import annotations

import argparse
import os
import struct
import time
from array import array
from typing import Any

from .common import (BrokerProc, MockCluster, Result, create_topic, host_ticks, pct,
                     steal_share, thread_cpu)
from .device import device_of, disk_counters, disk_writes

PRODUCER_CONF = {"acks": "all", "linger.ms": 5, "batch.size": 1 << 20, "batch.num.messages": 1_000_000,
                 "queue.buffering.max.messages": 2_000_000, "queue.buffering.max.kbytes": 1 << 21,
                 "message.max.bytes": 16 << 20, "enable.idempotence": False, "log_level": 2}


def cpu_shares(before: dict[int, float], after: dict[int, float], wall: float) -> tuple[float, float]:
    """(busiest thread, whole process) CPU between two ``thread_cpu`` snapshots, in CPUs."""
    used = [after[t] - before.get(t, 0.0) for t in after]
    return (max(used, default=0.0) / wall, sum(used) / wall) if wall > 0 else (0.0, 0.0)


def produce_throughput(bootstrap: str, topic: str, size: int, seconds: float,
                       max_msgs: int = 50_000_000, broker_pid: int | None = None) -> dict[str, Any]:
    """Produce `size`-byte messages for `seconds` as fast as the client goes; wait for all acks.

    Throughput = acknowledged messages / (time to last ack). The time series comes from
    librdkafka's statistics (messages handed to the broker), sampled every 0.5 s.
    ``cpu``: this process's busiest thread and its whole CPU, and the broker's (``broker_pid``),
    from 2 s into the sending to its end: a busiest thread near one CPU says the row measured
    the client's own produce loop, not the broker (bench/HISTORY.md, session 48).
    """
    import json

    from confluent_kafka import Producer
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()

    def stats(js: str) -> None:
        samples.append((time.monotonic() - t0, json.loads(js).get("txmsgs", 0)))

    errors = [0]

    def on_err(err: Any) -> None:
        errors[0] += 1

    p = Producer({**PRODUCER_CONF, "bootstrap.servers": bootstrap, "statistics.interval.ms": 500,
                  "stats_cb": stats, "error_cb": on_err})
    p.list_topics(topic, timeout=10)
    value = b"x" * size
    n = 0
    t0 = time.monotonic()
    end = t0 + seconds
    produce = p.produce
    mark: tuple[float, dict[int, float], dict[int, float]] | None = None
    while n < max_msgs:
        if mark is None and time.monotonic() - t0 >= min(2.0, seconds / 4):
            mark = (time.monotonic(), thread_cpu(os.getpid()),
                    thread_cpu(broker_pid) if broker_pid else {})
        i = 0
        try:
            for i in range(1000):
                produce(topic, value, partition=0)
            n += 1000
        except BufferError:   # the queue is full: messages 0..i-1 of this round were queued
            n += i            # (not counting them undercounted a broker slower than the client)
            p.poll(0.005)
            if time.monotonic() >= end:
                break
            continue
        p.poll(0)
        if time.monotonic() >= end:
            break
    cpu = None
    if mark is not None:
        wall = time.monotonic() - mark[0]
        busiest, client = cpu_shares(mark[1], thread_cpu(os.getpid()), wall)
        broker = cpu_shares(mark[2], thread_cpu(broker_pid), wall)[1] if broker_pid else None
        cpu = {"client_busiest": busiest, "client": client, "broker": broker}
    left = p.flush(120)
    elapsed = time.monotonic() - t0
    acked = n - left
    series: list[tuple[float, float]] = []
    prev_t, prev_n = 0.0, 0
    for t, c in samples:
        if t > prev_t:
            series.append((t, (c - prev_n) * size / (t - prev_t) / 1e6))
        prev_t, prev_n = t, c
    return {"msgs": acked, "msgs_s": acked / elapsed, "mb_s": acked * size / elapsed / 1e6,
            "series": series, "cpu": cpu}


def consume_throughput(bootstrap: str, topic: str, expected: int, timeout: float = 120) -> dict[str, Any]:
    """Read up to `expected` messages of partition 0 from its log start (assign, no group)."""
    from confluent_kafka import Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{time.time_ns()}",
                  "enable.auto.commit": False, "log_level": 2, "fetch.max.bytes": 64 << 20,
                  "max.partition.fetch.bytes": 16 << 20, "queued.max.messages.kbytes": 1 << 20,
                  "fetch.wait.max.ms": 100})
    # the mock keeps only its last log segments: read from the log start, count what is there
    low, high = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
    expected = min(expected, high - low)
    c.assign([TopicPartition(topic, 0, low)])
    n = nbytes = 0
    t0 = time.monotonic()
    deadline = t0 + timeout
    while n < expected and time.monotonic() < deadline:
        for m in c.consume(num_messages=100_000, timeout=0.5):
            if m.error() is None:
                n += 1
                nbytes += len(m.value())
    elapsed = time.monotonic() - t0
    c.close()
    return {"msgs": n, "msgs_s": n / elapsed, "mb_s": nbytes / elapsed / 1e6}


def raw_fetch(bootstrap: str, topic: str, seconds: float) -> dict[str, float]:
    """Broker-side read rate without a client's per-message cost: raw Fetch v4 of partition 0
    from its log start, records counted from batch headers (bench.rawload)."""
    from confluent_kafka import Consumer, TopicPartition

    from . import rawload
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "rawfetch", "log_level": 2})
    low, _high = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
    c.close()
    host, port = bootstrap.rsplit(":", 1)
    st = rawload._run(rawload._fetch, host, int(port), topic, 1, max(5.0, seconds), [low])
    return {"msgs_s": st["records"] / st["elapsed"], "mb_s": st["bytes"] / st["elapsed"] / 1e6}


def produce_latency(bootstrap: str, topic: str, size: int, rate: float, seconds: float
                    ) -> dict[str, Any]:
    """Produce at a fixed rate (linger 0) and record send -> ack latency of every message (ms)."""
    import gc

    from confluent_kafka import Producer
    p = Producer({**PRODUCER_CONF, "linger.ms": 0, "bootstrap.servers": bootstrap})
    p.list_topics(topic, timeout=10)
    now = time.perf_counter
    gc_pauses: list[tuple[float, int, float]] = []   # this client's own collections
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = now()
        else:
            gc_pauses.append((gc_start[0], info["generation"], now() - gc_start[0]))
    gc.callbacks.append(on_gc)
    interval = 1.0 / rate
    # send and acknowledgement times of each message in arrays of floats, indexed by a number
    # the message carries in its first 8 value bytes, and one delivery callback for all: a
    # list of (sent, acked) tuples and a closure per message held ~600,000 objects the
    # collector tracks by the end of a 126,000 msgs/s run (more while acknowledgements lag),
    # and its collections paused this process for tens of ms - the acknowledgements of every
    # message in flight then waited too, and counted as broker latency (the more messages in
    # flight, the more a broker slower than the mock paid for it)
    n_max = int(rate * seconds) + 1024
    sent_ts, acked_ts = array("d", bytes(8 * n_max)), array("d", bytes(8 * n_max))
    number = struct.Struct(">Q")
    pack, unpack_from = number.pack, number.unpack_from
    pad = b"y" * max(size - number.size, 0)

    def delivered(err: Any, msg: Any) -> None:
        if err is None:
            acked_ts[unpack_from(msg.value())[0]] = now()

    gc.freeze()                 # nor rescan the process's start-up objects during the run
    host0 = host_ticks()
    t0 = now()
    sent = 0
    while True:
        t = now()
        if t - t0 >= seconds:
            break
        due = min(int((t - t0) / interval) + 1, n_max)
        while sent < due:
            sent_ts[sent] = now()
            p.produce(topic, pack(sent) + pad, partition=0, on_delivery=delivered)
            sent += 1
        p.poll(0)
        time.sleep(min(interval, 0.0005))
    p.flush(60)
    steal = steal_share(host0, host_ticks())
    gc.callbacks.remove(on_gc)
    gc.unfreeze()
    acked = [i for i in range(sent) if acked_ts[i] > 0]
    lat = [acked_ts[i] - sent_ts[i] for i in acked]
    sent_at = [sent_ts[i] - t0 for i in acked]
    ms = [x * 1000 for x in lat[len(lat) // 10:]]  # skip warm-up
    return {"rate": rate, "t0": t0, "p50": pct(ms, 0.5), "p99": pct(ms, 0.99), "p999": pct(ms, 0.999),
            "n": len(ms), "trace": latency_trace(sent_at, lat), "steal": steal,
            "client_gc": [(t - t0, g, d * 1000) for t, g, d in gc_pauses if g > 0 or d > 0.002]}


def latency_trace(sent_at: list[float], lat: list[float], step: float = 0.25
                  ) -> list[tuple[float, int, float, float, float]]:
    """(window start s, acks, p50, p99, max ms) per ``step`` of send time, warm-up included:
    latency that grows window after window is a queue (the broker or the client cannot keep
    up), isolated high windows are stalls."""
    windows: dict[int, list[float]] = {}
    for t, x in zip(sent_at, lat):
        windows.setdefault(int(t / step), []).append(x * 1000)
    return [(k * step, len(v), pct(v, 0.5), pct(v, 0.99), max(v))
            for k, v in sorted(windows.items())]


def run_target(bootstrap: str, sizes: list[int], seconds: float, restart=None,
               lat_rates: list[float] | None = None, create: bool = True,
               disk: str | None = None, broker_pid: int | None = None) -> dict[str, Any]:
    """All client benchmarks against one target; `restart` (if given) makes the next read cold;
    `disk`: the device under the broker's WAL and objects (its writes during each produce run
    are reported beside it, bench.device)."""
    out: dict[str, Any] = {"produce": {}, "series": {}}
    topic_100 = None
    for size in sizes:
        topic = f"bench-p-{size}-{time.time_ns()}"
        if create:  # the mock auto-creates topics on first use
            create_topic(bootstrap, topic)
        dev0, t0 = disk_counters(disk), time.monotonic()
        r = produce_throughput(bootstrap, topic, size, seconds, broker_pid=broker_pid)
        dev1, wall = disk_counters(disk), time.monotonic() - t0
        written = disk_writes(dev0, dev1, wall)
        if written is not None and r.get("mb_s"):
            r["disk_mb_s"], r["disk_busy"] = written[0] / wall / 1e6, written[1]
        out["produce"][size] = r
        out["series"][size] = r["series"]
        if topic_100 is None:  # hot: read the smallest-message topic back while in the LogCache
            topic_100 = (topic, r["msgs"], size)
            out["hot"] = consume_throughput(bootstrap, topic, r["msgs"])
            out["hot_raw"] = raw_fetch(bootstrap, topic, seconds)
    topic, count, size = topic_100
    out["consume_size"] = size
    if restart is not None:
        bootstrap = restart()
        out["cold"] = consume_throughput(bootstrap, topic, count)
    # latency at fixed rates: a tenth of the max rate of the first size, and 1000 msgs/s
    # (issue 20, Done-when 4)
    size0 = sizes[0]
    max_rate = out["produce"][size0]["msgs_s"]
    rates = lat_rates or [max(round(max_rate * 0.1, -2), 100), 1000]
    out["latency"] = []
    topic = f"bench-lat-{time.time_ns()}"
    if create:
        create_topic(bootstrap, topic)
    for rate in rates:
        out["latency"].append(produce_latency(bootstrap, topic, size0, rate, min(seconds, 5)))
    out["bootstrap"] = bootstrap
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def run(seconds: float = 8, sizes: list[int] | None = None, mock: bool = True,
        broker_args: list[str] | None = None) -> list[Result]:
    """Run the client benchmarks against a fresh broker and the mock; return result tables."""
    sizes = sizes or [100, 1024, 16384]
    broker = BrokerProc(broker_args).start()

    def restart() -> str:
        broker.stop()
        broker.start()
        return broker.bootstrap

    try:
        ours = run_target(broker.bootstrap, sizes, seconds, restart,
                          disk=device_of(broker.data_dir), broker_pid=broker.pid)
    finally:
        broker.close()
    theirs = None
    if mock:
        with MockCluster() as m:
            # same rates for the latency runs so the comparison is like for like
            theirs = run_target(m.bootstrap, sizes, seconds, None,
                                [r["rate"] for r in ours["latency"]], create=False)
    prod = Result("Produce throughput, confluent-kafka, acks=all, 1 partition",
                  ["msg size", "s3kafka msgs/s", "s3kafka MB/s", "mock msgs/s", "mock MB/s",
                   "ratio s3kafka/mock"])
    for size in sizes:
        a = ours["produce"][size]
        b = theirs["produce"][size] if theirs else {"msgs_s": float("nan"), "mb_s": float("nan")}
        prod.rows.append([size, a["msgs_s"], a["mb_s"], b["msgs_s"], b["mb_s"],
                          ratio(a["msgs_s"], b["msgs_s"])])
        prod.series[f"s3kafka {size} B"] = ours["series"][size]
        if theirs:
            prod.series[f"mock {size} B"] = theirs["series"][size]
    disk = [f"{size} B {a['disk_mb_s']:,.0f} MB/s (busy {100 * a['disk_busy']:.0f} %)"
            for size, a in ours["produce"].items() if a.get("disk_mb_s") is not None]
    if disk:
        prod.notes.append("the device under s3kafka's WAL and objects wrote during each produce "
                          "run (WAL + objects, /proc/diskstats; the mock keeps everything in "
                          "memory): " + ", ".join(disk))
    cpu = []
    for size in sizes:
        a, b = ours["produce"][size].get("cpu"), (theirs or {}).get("produce", {}).get(size, {}).get("cpu")
        if a:
            cpu.append(f"{size} B: client's busiest thread {100 * a['client_busiest']:.0f} %, "
                       f"client {100 * a['client']:.0f} %, broker {100 * (a['broker'] or 0):.0f} %"
                       + (f" (mock run: busiest {100 * b['client_busiest']:.0f} %, client and "
                          f"mock {100 * b['client']:.0f} %)" if b else ""))
    if cpu:
        prod.notes.append("CPU over each produce run from its 2nd second, % of one CPU (a busiest "
                          "client thread near 100 % is the Python produce loop: the row then "
                          "measures the client): " + "; ".join(cpu))
    cons = Result(f"Consume throughput, confluent-kafka, {ours['consume_size']} B messages",
                  ["read", "s3kafka msgs/s", "s3kafka MB/s", "mock msgs/s", "ratio s3kafka/mock"])
    mh = theirs["hot"] if theirs else {"msgs_s": float("nan")}
    for label, key in (("hot (LogCache)", "hot"), ("cold (object store, after restart)", "cold")):
        a = ours[key]
        cons.rows.append([label, a["msgs_s"], a["mb_s"], mh["msgs_s"], ratio(a["msgs_s"], mh["msgs_s"])])
    a = ours["hot_raw"]
    b = theirs["hot_raw"] if theirs else {"msgs_s": float("nan")}
    cons.rows.append(["hot, raw Fetch (no client per-message cost)", a["msgs_s"], a["mb_s"],
                      b["msgs_s"], ratio(a["msgs_s"], b["msgs_s"])])
    cons.notes.append("confluent-kafka rows are bound by the Python consumer (one Message object "
                      "per record); the raw Fetch row is what the broker serves")
    lat = Result(f"Produce latency, confluent-kafka, {sizes[0]} B, acks=all, linger 0 (ms)",
                 ["rate msgs/s", "s3kafka p50", "p99", "p999", "mock p50", "p99", "p999"])
    for i, a in enumerate(ours["latency"]):
        b = theirs["latency"][i] if theirs else {"p50": float("nan"), "p99": float("nan"),
                                                 "p999": float("nan")}
        lat.rows.append([a["rate"], a["p50"], a["p99"], a["p999"], b["p50"], b["p99"], b["p999"]])
        lat.percentiles[f"s3kafka @{a['rate']:.0f}/s"] = {k: a[k] for k in ("p50", "p99", "p999")}
        if theirs:
            lat.percentiles[f"mock @{b['rate']:.0f}/s"] = {k: b[k] for k in ("p50", "p99", "p999")}
    prod.extra = {"s3kafka": ours["produce"], "mock": theirs["produce"] if theirs else None}
    cons.extra = {"s3kafka": {k: ours[k] for k in ("hot", "cold", "hot_raw")},
                  "mock": {k: theirs[k] for k in ("hot", "hot_raw")} if theirs else None}
    lat.extra = {"s3kafka": ours["latency"], "mock": theirs["latency"] if theirs else None}
    for a in ours["latency"]:
        lat.notes.append(f"s3kafka at {a['rate']:.0f} msgs/s, p99 ms per 0.25 s of send time "
                         "(a queue grows window after window, a stall is one high window): "
                         + ", ".join(f"{w[3]:.1f}" for w in a.get("trace", [])))
    steals = [f"{a['rate']:.0f} msgs/s {100 * a.get('steal', float('nan')):.1f} % "
              f"(mock {100 * b.get('steal', float('nan')):.1f} %)"
              for a, b in zip(ours["latency"], theirs["latency"] if theirs else
                              [{}] * len(ours["latency"]))]
    lat.notes.append("host steal time during each run (/proc/stat: the share of the VM's CPU "
                     "time the host ran something else; ms-long stalls of broker and mock alike "
                     "come with it): " + ", ".join(steals))
    lat.notes.append("rates: a tenth of the 100 B maximum produce rate measured above "
                     "(with linger 5 ms), and 1000 msgs/s; one Python producer with a delivery "
                     "callback per message, so at high rates the client itself queues")
    return [prod, cons, lat]


class WindowPoller:
    """Scrapes the broker's /metrics every 0.25 s on a thread (latency ``--trace``): per
    window the object bytes uploaded, the event loop's worst lateness (broker/loop_watch.py),
    the longest collector pause and the longest WAL append - which of them a high latency
    window lines up with. (The maxima reset at each scrape.)"""

    NAMES = ("s3kafka_uploaded_bytes_total", "s3kafka_loop_lag_max_seconds",
             "s3kafka_gc_pause_max_seconds", "s3kafka_wal_append_max_seconds")

    def __init__(self, broker: Any, step: float = 0.25) -> None:
        import threading
        self.broker, self.step = broker, step
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self.broker.metrics(list(self.NAMES))))
            self._stop.wait(self.step)

    def stop(self, t0: float) -> list[tuple[float, float, float, float, float]]:
        """(send-time s, MB uploaded, loop lag max ms, gc pause max ms, WAL append max ms)
        per window ending at that time."""
        self._stop.set()
        self._thread.join()
        out = []
        up, lag, gcp, wal = self.NAMES
        for (_, a), (t, b) in zip(self.samples, self.samples[1:]):
            out.append((t - t0, (b[up] - a[up]) / 1e6, b[lag] * 1e3, b[gcp] * 1e3,
                        b[wal] * 1e3))
        return out


def latency_only(rates: list[float], size: int, seconds: float,
                 broker_args: list[str] | None = None, trace: bool = False) -> Result:
    """Produce latency at fixed rates against a fresh broker (quick before/after checks);
    ``trace``: also the latency over time of each rate, and the broker's Produce requests,
    runs (requests appended together) and CPU per request."""
    from .rawload import process_cpu_s
    broker = BrokerProc(broker_args).start()
    rows = []
    try:
        topic = f"bench-lat-{time.time_ns()}"
        create_topic(broker.bootstrap, topic)
        for rate in rates:
            before = [broker.metric(n) for n in ("s3kafka_requests_total",
                                                 "s3kafka_request_run_members_total",
                                                 "s3kafka_request_direct_total")]
            cpu0 = process_cpu_s(broker.pid)
            poller = WindowPoller(broker) if trace else None
            a = produce_latency(broker.bootstrap, topic, size, rate, seconds)
            if poller is not None:
                a["windows"] = poller.stop(a.get("t0", 0.0))
            cpu = process_cpu_s(broker.pid) - cpu0
            after = [broker.metric(n) for n in ("s3kafka_requests_total",
                                                "s3kafka_request_run_members_total",
                                                "s3kafka_request_direct_total")]
            a["requests"], a["in_runs"], a["direct"] = (y - x for x, y in zip(before, after))
            a["cpu_us_req"] = cpu / max(a["requests"], 1) * 1e6
            rows.append(a)
    finally:
        broker.close()
    lat = Result(f"Produce latency, confluent-kafka, {size} B, acks=all, linger 0 (ms)",
                 ["rate msgs/s", "p50", "p99", "p999", "acked", "requests", "in runs",
                  "direct", "broker CPU us/request", "host steal %"])
    for a in rows:
        lat.rows.append([a["rate"], a["p50"], a["p99"], a["p999"], a["n"], a["requests"],
                         a["in_runs"], a["direct"], a["cpu_us_req"], 100 * a["steal"]])
        if trace:
            lat.notes.append(f"{a['rate']:.0f} msgs/s over time (send time s: acks, p50 / p99 / "
                             "max ms): " + "; ".join(f"{t:.2f}: {n}, {p50:.1f} / {p99:.1f} / "
                                                     f"{mx:.1f}" for t, n, p50, p99, mx
                                                     in a["trace"]))
            if a.get("client_gc"):
                lat.notes.append(f"{a['rate']:.0f} msgs/s, the client's own collections of "
                                 "generation 1-2 or over 2 ms (send time s: generation, ms): "
                                 + ", ".join(f"{t:.2f}: {g}, {d:.1f}"
                                             for t, g, d in a["client_gc"]))
            if a.get("windows"):
                lat.notes.append(
                    f"{a['rate']:.0f} msgs/s, broker side per 0.25 s of the same clock (window "
                    "end s: event loop lag max / GC pause max / WAL append max ms, MB "
                    "uploaded): " + "; ".join(
                        f"{t:.2f}: {lag:.1f} / {gcp:.1f} / {wal:.1f}" + (f", {mb:.1f} MB"
                                                                          if mb else "")
                        for t, mb, lag, gcp, wal in a["windows"]))
    lat.notes.append("requests: all requests the broker answered meanwhile (Produce and the "
                     "producer's Metadata); in runs: Produce requests appended together with "
                     "others read at the same time; direct: Produce requests handled without a "
                     "task (appended in the read's loop step)")
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--sizes", default="100,1024,16384")
    ap.add_argument("--skip-mock", action="store_true")
    ap.add_argument("--latency-only", action="store_true",
                    help="only the fixed-rate latency runs (first size, --rates)")
    ap.add_argument("--rates", default="1000,30000")
    ap.add_argument("--trace", action="store_true",
                    help="latency-only: also latency over time and broker requests per rate")
    ap.add_argument("--broker-arg", action="append", default=[],
                    help="latency-only: an extra `broker serve` argument (repeatable), e.g. "
                    "--broker-arg=--upload-interval-s=7")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.latency_only:
        latency_only([float(r) for r in a.rates.split(",")], sizes[0], a.seconds,
                     broker_args=a.broker_arg or None, trace=a.trace).print()
        return
    for r in run(a.seconds, sizes, not a.skip_mock):
        r.print()


if __name__ == "__main__":
    main()
