"""Raw-protocol load generator: pre-built 1 MiB record batches, acks=all, pipelined, several connections.

    python -m bench.rawload [--seconds 10] [--connections 4] [--depth 8] [--batch-bytes 1048576]
                            [--skip-mock] [--no-fetch] [--broker-arg=ARG ...]

Every Produce request frame is built once; per request only the 12-byte prefix (size, api key,
version, correlation id) is packed, and header + body go out in one ``writelines`` - so the
client is not the bottleneck. Each connection writes to its own partition and keeps `depth`
requests in flight. Reports MB/s, requests/s, request latency percentiles and the broker's CPU
time per request, against s3kafka and the librdkafka mock cluster. Answers a client would
retry (NOT_ENOUGH_REPLICAS: storage back-pressure) are resent and counted as retries, not
errors. ``--fetch`` adds a raw Fetch loop over the last 256 MiB just
written (still in the LogCache: hot; records/s counted from batch headers, not decoded).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import struct
import threading
import time
from typing import Any

from broker.thread_names import cpu_by_pool
from protocol import build_batch

from . import device
from .common import (BrokerProc, MockCluster, Result, create_topic, groups_ms_per_mib,
                     host_ticks, mock_cpu_s, pct, stat_cpu_s, stat_cpu_split, steal_share)

_PREFIX = struct.Struct(">ihhi")
_I32 = struct.Struct(">i")
_I16 = struct.Struct(">h")
_I64 = struct.Struct(">q")
CLIENT_ID = b"rawload"
# NOT_ENOUGH_REPLICAS (storage back-pressure), REQUEST_TIMED_OUT: clients retry these
RETRIABLE = frozenset({19, 7})
HOT_FETCH_BYTES = 256 << 20   # well inside the default 1 GiB LogCache
# the produce run's CPU per MiB is also reported from this many seconds on: a fresh broker's
# first second fills its 1 GiB LogCache with fresh memory (~1.0 ms/MiB while it faults in,
# ~0.45 after; bench/HISTORY.md session 30), which the whole-run figure includes
STEADY_FROM_S = 3.0


def batch_records(batch: bytes) -> int:
    """Record count from a v2 batch header."""
    return _I32.unpack_from(batch, 57)[0]


def _str(s: bytes) -> bytes:
    return _I16.pack(len(s)) + s


def produce_body(topic: str, partition: int, batch: bytes, acks: int = -1) -> bytes:
    """Produce v3 body (after the header's correlation id): client id, txn id, acks, timeout, data."""
    return (_str(CLIENT_ID) + _I16.pack(-1) + _I16.pack(acks) + _I32.pack(30000)
            + _I32.pack(1) + _str(topic.encode()) + _I32.pack(1) + _I32.pack(partition)
            + _I32.pack(len(batch)) + batch)


def fetch_body(topic: str, partition: int, offset: int, max_bytes: int) -> bytes:
    """Fetch v4 body: replica -1, max wait 0, min bytes 1, max bytes, isolation 0, one partition."""
    return (_str(CLIENT_ID) + _I32.pack(-1) + _I32.pack(100) + _I32.pack(1) + _I32.pack(max_bytes)
            + b"\x00" + _I32.pack(1) + _str(topic.encode()) + _I32.pack(1) + _I32.pack(partition)
            + struct.pack(">q", offset) + _I32.pack(max_bytes))


class _Conn(asyncio.Protocol):
    """Client side framing: hands each response frame (after its length) to `on_frame`."""

    def __init__(self, on_frame) -> None:
        self.buf = bytearray()
        self.on_frame = on_frame
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        pos = 0
        n = len(self.buf)
        while n - pos >= 4:
            (size,) = _I32.unpack_from(self.buf, pos)
            if n - pos - 4 < size:
                break
            self.on_frame(bytes(self.buf[pos + 4:pos + 4 + size]))
            pos += 4 + size
        if pos:
            del self.buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)


async def _produce_conn(host: str, port: int, topic: str, partition: int, batch: bytes, depth: int,
                        end: float, stats: dict[str, Any]) -> None:
    body = produce_body(topic, partition, batch)
    frame_size = 8 + len(body)
    err_pos = 4 + 4 + 2 + len(topic.encode()) + 4 + 4  # corr, n topics, name, n parts, partition
    sent: dict[int, float] = {}
    window = asyncio.Semaphore(depth)
    loop = asyncio.get_running_loop()
    now = time.perf_counter

    corr = 0
    transport: Any = None

    def on_frame(frame: bytes) -> None:
        nonlocal corr
        (got,) = _I32.unpack_from(frame, 0)
        t = now()
        t_sent = sent.pop(got)
        (err,) = _I16.unpack_from(frame, err_pos)
        if err in RETRIABLE and t < end + 30:
            # storage back-pressure: resend, as every Kafka client does; latency and the
            # window slot run on from the first send
            stats["retries"] = stats.get("retries", 0) + 1
            corr += 1
            sent[corr] = t_sent
            transport.writelines((_PREFIX.pack(frame_size, 0, 3, corr), body))
            return
        stats["lat"].append(t - t_sent)
        if err:
            stats["errors"] += 1
            codes = stats.setdefault("error_codes", {})
            codes[err] = codes.get(err, 0) + 1
        else:
            stats["bytes"] += len(batch)
            stats["reqs"] += 1
            stats["ts"].append((t, len(batch)))
        window.release()

    transport, proto = await loop.create_connection(lambda: _Conn(on_frame), host, port)
    try:
        while now() < end:
            await window.acquire()
            corr += 1
            sent[corr] = now()
            transport.writelines((_PREFIX.pack(frame_size, 0, 3, corr), body))
        for _ in range(depth):  # drain
            await asyncio.wait_for(window.acquire(), 60)
    finally:
        transport.close()


async def _produce(host: str, port: int, topic: str, conns: int, depth: int, seconds: float,
                   batch: bytes) -> dict[str, Any]:
    stats: dict[str, Any] = {"bytes": 0, "reqs": 0, "errors": 0, "lat": [], "ts": []}
    t0 = time.perf_counter()
    end = t0 + seconds
    await asyncio.gather(*(_produce_conn(host, port, topic, i, batch, depth, end, stats)
                           for i in range(conns)))
    elapsed = time.perf_counter() - t0
    stats["elapsed"] = elapsed
    stats["t0"] = t0
    return stats


class _FrameReader(asyncio.BufferedProtocol):
    """Client side framing for large responses: each frame is received straight into one
    reused buffer (no joins, no copies), then handed to `on_frame` as a memoryview that is
    valid until the callback returns."""

    def __init__(self, on_frame) -> None:
        self.on_frame = on_frame
        self.head = bytearray(4)
        self.head_fill = 0
        self.body = bytearray(1 << 20)
        self.size = -1
        self.fill = 0
        self.closed = asyncio.get_running_loop().create_future()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.size < 0:
            return memoryview(self.head)[self.head_fill:]
        return memoryview(self.body)[self.fill:self.size]

    def buffer_updated(self, nbytes: int) -> None:
        if self.size < 0:
            self.head_fill += nbytes
            if self.head_fill < 4:
                return
            (self.size,) = _I32.unpack_from(self.head, 0)
            self.head_fill = self.fill = 0
            if len(self.body) < self.size:
                self.body = bytearray(self.size)
        else:
            self.fill += nbytes
        if self.fill >= self.size:
            size, self.size = self.size, -1
            with memoryview(self.body)[:size] as frame:
                self.on_frame(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)


async def _fetch(host: str, port: int, topic: str, partitions: int, seconds: float,
                 starts: list[int], max_bytes: int = 8 << 20, wrap: bool = False
                 ) -> dict[str, Any]:
    """One connection per partition, one Fetch in flight each, from `starts` to the high
    watermark; with `wrap`, over and over from `starts` until `seconds` passed (a steady
    read rate over a fixed range, e.g. the LogCache's tail)."""
    stats = {"bytes": 0, "records": 0, "reqs": 0, "passes": 0}
    loop = asyncio.get_running_loop()
    end = time.perf_counter() + seconds
    name = topic.encode()

    async def one(partition: int) -> None:
        offset = starts[partition]
        got: asyncio.Future | None = None
        state = {"offset": offset, "hw": 0, "n": 0}

        def on_frame(frame: memoryview) -> None:
            # v4 response: corr, throttle, n topics, name, n parts, partition, error, hw,
            # lso, aborted (array), records (bytes); batches counted from their headers
            pos = 4 + 4 + 4 + 2 + len(name) + 4 + 4
            (err,) = _I16.unpack_from(frame, pos)
            (hw,) = _I64.unpack_from(frame, pos + 2)
            pos += 2 + 8 + 8
            (naborted,) = _I32.unpack_from(frame, pos)
            pos += 4 + max(naborted, 0) * 16
            (rlen,) = _I32.unpack_from(frame, pos)
            pos += 4
            stop = pos + max(rlen, 0)
            n = 0
            off = state["offset"]
            if not err:
                while stop - pos >= 61:  # batch header: base offset, length ... record count
                    (base,) = _I64.unpack_from(frame, pos)
                    (blen,) = _I32.unpack_from(frame, pos + 8)
                    if pos + 12 + blen > stop:
                        break
                    (count,) = _I32.unpack_from(frame, pos + 57)
                    stats["records"] += count
                    stats["bytes"] += 12 + blen
                    n += 1
                    off = base + count  # whole batches only (no compaction gaps here)
                    pos += 12 + blen
            state["offset"], state["hw"], state["n"] = off, hw, n
            got.set_result(err)  # type: ignore[union-attr]

        transport, _ = await loop.create_connection(lambda: _FrameReader(on_frame), host, port)
        try:
            while time.perf_counter() < end:
                body = fetch_body(topic, partition, state["offset"], max_bytes)
                got = loop.create_future()
                transport.writelines((_PREFIX.pack(8 + len(body), 1, 4, 1), body))
                err = await got
                if state["n"]:
                    stats["reqs"] += 1
                if state["offset"] >= state["hw"] or (err and not state["n"]):
                    if not wrap:
                        return
                    stats["passes"] += 1
                    state["offset"] = starts[partition]
        finally:
            transport.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in range(partitions)))
    stats["elapsed"] = time.perf_counter() - t0
    return stats


def _run(coro_fn, *args) -> Any:
    try:
        import uvloop
        return uvloop.run(coro_fn(*args))
    except ImportError:  # pragma: no cover
        return asyncio.run(coro_fn(*args))


def make_batch(batch_bytes: int, record_bytes: int = 1000) -> bytes:
    """One uncompressed v2 batch of about `batch_bytes` (records of `record_bytes` values)."""
    n = max(1, batch_bytes // (record_bytes + 10))
    # real producers set first/max timestamps; without them the broker must decode records
    return build_batch([(None, b"r" * record_bytes)] * n, timestamp=int(time.time() * 1000))


def series_of(ts: list[tuple[float, int]], t0: float, step: float = 0.5) -> list[tuple[float, float]]:
    """(time, MB/s) per `step` bucket from per-response (time, bytes) samples."""
    buckets: dict[int, int] = {}
    for t, b in ts:
        k = int((t - t0) / step)
        buckets[k] = buckets.get(k, 0) + b
    return [((k + 1) * step, v / step / 1e6) for k, v in sorted(buckets.items())]


MOCK_PID = 0   # "pid" of the librdkafka mock: its thread in this process (bench.common)


def process_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` (all threads) from /proc; MOCK_PID: the
    mock cluster's thread in this process; NaN if unknown."""
    if pid is None:
        return float("nan")
    if pid == MOCK_PID:
        return mock_cpu_s()
    return stat_cpu_s(f"/proc/{pid}/stat", float("nan"))


def process_cpu_kernel_s(pid: int | None) -> tuple[float, float]:
    """(``process_cpu_s``, its kernel (system) part) from one reading; the kernel part is NaN
    for the mock (its thread's split is not read) or when unknown."""
    split = stat_cpu_split(f"/proc/{pid}/stat") if pid and pid != MOCK_PID else None
    return (sum(split), split[1]) if split else (process_cpu_s(pid), float("nan"))


def process_pools_cpu(pid: int | None) -> dict[str, float]:
    """Process ``pid``'s CPU seconds by thread pool (the names a broker gives its threads,
    broker/thread_names.py; the main thread is "event-loop"); empty for the mock (its
    cluster thread lives in this process) or when unknown."""
    return cpu_by_pool(pid) if pid and pid != MOCK_PID else {}


class _LaterSample(threading.Thread):
    """Process ``pid``'s CPU seconds (``cpu``; ``kernel``: its system part) and the
    perf_counter time (``at``) ``delay`` seconds from now, read on a thread while the
    produce run holds the main one."""

    def __init__(self, pid: int | None, delay: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.delay = pid, delay
        self.at: float | None = None
        self.cpu = self.kernel = float("nan")
        self.threads: dict[str, float] = {}    # CPU seconds by thread group (not the mock)
        self.start()

    def run(self) -> None:
        time.sleep(self.delay)
        self.cpu, self.kernel = process_cpu_kernel_s(self.pid)
        self.threads = process_pools_cpu(self.pid)
        self.at = time.perf_counter()


def mib_after(acks: list[tuple[float, int]], at: float) -> float:
    """MiB acknowledged from ``at`` on; ``acks`` are (perf_counter time, bytes) of each
    acknowledgement."""
    return sum(b for t, b in acks if t >= at) / (1 << 20)


def cpu_ms_per_mib_after(acks: list[tuple[float, int]], at: float, cpu_at: float,
                         cpu_end: float) -> float:
    """CPU ms per MiB acknowledged from ``at`` on (``mib_after``), ``cpu_at`` / ``cpu_end``
    the process's CPU seconds at ``at`` and at the end of the run; NaN when nothing was
    acknowledged after ``at``."""
    mib = mib_after(acks, at)
    return (cpu_end - cpu_at) * 1e3 / mib if mib else float("nan")


def wait_quiet(pid: int | None, timeout: float = 30.0, busy: float = 0.15) -> float:
    """Wait until process ``pid`` uses under ``busy`` of a core over half a second (the
    uploads of what was just produced are done), at most ``timeout`` s; returns the wait."""
    t0 = time.monotonic()
    if not pid:
        return 0.0
    prev = process_cpu_s(pid)
    while time.monotonic() - t0 < timeout:
        time.sleep(0.5)
        cur = process_cpu_s(pid)
        if cur - prev < busy * 0.5:
            break
        prev = cur
    return time.monotonic() - t0


def watermarks(bootstrap: str, topic: str, partitions: int) -> list[tuple[int, int]]:
    """(log start, high watermark) of each partition."""
    from confluent_kafka import Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "rawload", "log_level": 2})
    try:
        return [c.get_watermark_offsets(TopicPartition(topic, i), timeout=10)
                for i in range(partitions)]
    finally:
        c.close()


def fetch_figures(bootstrap: str, topic: str, partitions: int, seconds: float,
                  starts: list[int], wrap: bool, pid: int | None) -> dict[str, float]:
    """Raw Fetch rate (MB/s, records/s) and the broker's CPU ms per MiB served."""
    host, port = bootstrap.rsplit(":", 1)
    cpu0 = process_cpu_s(pid)
    ft = _run(_fetch, host, int(port), topic, partitions, seconds, starts, 8 << 20, wrap)
    cpu = process_cpu_s(pid) - cpu0
    mib = ft["bytes"] / (1 << 20)
    return {"mb_s": ft["bytes"] / ft["elapsed"] / 1e6, "rec_s": ft["records"] / ft["elapsed"],
            "cpu_ms_mib": cpu * 1e3 / mib if mib else float("nan"), "mib": mib}


def bench_target(bootstrap: str, seconds: float, conns: int, depth: int, batch: bytes,
                 create: bool, fetch: bool, pid: int | None = None, restart=None,
                 fetch_seconds: float = 5.0, settle=None, disk: str | None = None
                 ) -> dict[str, Any]:
    """Raw produce (``disk``: the device holding the broker's WAL and objects, whose writes and
    busy time over the produce window are reported beside it); then (``fetch``) hot raw Fetch over the last HOT_FETCH_BYTES, read over
    and over for ``fetch_seconds`` once the broker's uploads are done (the data is still
    in the LogCache); then (``restart``: a callable restarting the broker, returning its
    bootstrap and pid; the shutdown uploads everything and empties the caches) one cold pass
    from the log start, through the object store."""
    host, port = bootstrap.rsplit(":", 1)
    topic = f"raw-{time.time_ns()}"
    if create:
        create_topic(bootstrap, topic, conns)
    else:  # the mock auto-creates (with its default partition count) on Metadata
        from confluent_kafka import Producer
        p = Producer({"bootstrap.servers": bootstrap, "log_level": 2})
        p.list_topics(topic, timeout=10)
    cpu0 = process_cpu_s(pid)
    dev0, w0 = device.disk_counters(disk), time.monotonic()
    host0 = host_ticks()
    mark = _LaterSample(pid, STEADY_FROM_S) if seconds >= STEADY_FROM_S + 2 else None
    st = _run(_produce, host, int(port), topic, conns, depth, seconds, batch)
    cpu_end, kernel_end = process_cpu_kernel_s(pid)
    threads_end = process_pools_cpu(pid)
    steal = steal_share(host0, host_ticks())
    cpu = cpu_end - cpu0
    dev1, wall = device.disk_counters(disk), time.monotonic() - w0
    ms = [x * 1000 for x in st["lat"]]
    mib = st["bytes"] / (1 << 20)
    out = {"mb_s": st["bytes"] / st["elapsed"] / 1e6, "req_s": st["reqs"] / st["elapsed"],
           # broker CPU (all threads) per acknowledged request / MiB: robust to a busy machine
           "cpu_us_req": cpu / max(st["reqs"], 1) * 1e6,
           "cpu_ms_mib": cpu * 1e3 / mib if mib else float("nan"),
           "errors": st["errors"], "error_codes": st.get("error_codes", {}),
           "retries": st.get("retries", 0), "p50": pct(ms, 0.5), "p99": pct(ms, 0.99),
           "p999": pct(ms, 0.999), "series": series_of(st["ts"], st["t0"]), "steal": steal}
    if mark is not None:
        mark.join()
        if mark.at is not None:
            out["cpu_ms_mib_steady"] = cpu_ms_per_mib_after(st["ts"], mark.at, mark.cpu,
                                                            cpu_end)
            # its kernel part (system time: the socket receive copy, the WAL's and the
            # objects' Direct IO, fsyncs, context switches): the floor under the figure
            out["kernel_ms_mib_steady"] = cpu_ms_per_mib_after(st["ts"], mark.at,
                                                               mark.kernel, kernel_end)
            # by thread group: the event loop, the object writers (s3k-io), ...
            if mark.threads and threads_end:
                out["threads_ms_mib_steady"] = groups_ms_per_mib(
                    mark.threads, threads_end, mib_after(st["ts"], mark.at))
    written = device.disk_writes(dev0, dev1, wall)
    if written is not None and st["bytes"]:
        # the device's own account of the window: bytes it wrote per byte produced (WAL +
        # objects: 2 with the embedded defaults once uploads keep up) and its busy share
        out.update({"disk": disk, "disk_mb_s": written[0] / wall / 1e6,
                    "disk_per_byte": written[0] / st["bytes"], "disk_busy": written[1]})
    if fetch:
        # hot = the tail that is still in the LogCache: the last HOT_FETCH_BYTES of all partitions
        # (the mock keeps only its last segments: never before the log start)
        out["settle_s"] = settle() if settle is not None else wait_quiet(pid)
        per_part = HOT_FETCH_BYTES // conns // len(batch) * batch_records(batch)
        marks = watermarks(bootstrap, topic, conns)
        starts = [max(low, high - per_part) for low, high in marks]
        fetch_figures(bootstrap, topic, conns, 1.0, starts, True, pid)   # warm-up, untimed
        hot = fetch_figures(bootstrap, topic, conns, fetch_seconds, starts, True, pid)
        out.update({"fetch_mb_s": hot["mb_s"], "fetch_rec_s": hot["rec_s"],
                    "fetch_cpu_ms_mib": hot["cpu_ms_mib"]})
        if restart is not None:
            bootstrap, pid = restart()
            marks = watermarks(bootstrap, topic, conns)
            cold = fetch_figures(bootstrap, topic, conns, fetch_seconds,
                                 [low for low, _ in marks], False, pid)
            out.update({"cold_mb_s": cold["mb_s"], "cold_cpu_ms_mib": cold["cpu_ms_mib"],
                        "cold_mib": cold["mib"]})
    return out


def run(seconds: float = 10, conns: int = 4, depth: int = 8, batch_bytes: int = 1 << 20,
        mock: bool = True, fetch: bool = True, broker_args: list[str] | None = None,
        fetch_seconds: float = 5.0) -> list[Result]:
    """Raw produce and hot/cold fetch against a fresh broker, then the same against the mock
    (hot only: it has no object store); returns the result table."""
    batch = make_batch(batch_bytes)
    broker = BrokerProc(["--wal-capacity", str(4 << 30), *(broker_args or [])]).start()

    def restart() -> tuple[str, int]:
        broker.stop()
        broker.start()
        return broker.bootstrap, broker.pid

    try:
        ours = bench_target(broker.bootstrap, seconds, conns, depth, batch, True, fetch,
                            broker.pid, restart, fetch_seconds, broker.wait_uploaded,
                            device.device_of(broker.data_dir))
    finally:
        broker.close()
    theirs = None
    if mock:
        with MockCluster() as m:
            theirs = bench_target(m.bootstrap, seconds, min(conns, 4), depth, batch, False, fetch,
                                  MOCK_PID, fetch_seconds=fetch_seconds)
    nan = float("nan")
    r = Result(f"Raw-protocol produce, {len(batch) >> 10} KiB batches, acks=all, {conns} connections x "
               f"{depth} in flight; raw Fetch v4 hot (LogCache) and cold (object store)",
               ["target", "MB/s", "requests/s", "p50 ms", "p99 ms", "p999 ms",
                "broker CPU ms/MiB", "refused+resent", "errors", "fetch MB/s hot",
                "hot CPU ms/MiB", "fetch MB/s cold", "cold CPU ms/MiB"])
    for name, d in (("s3kafka", ours), ("mock", theirs)):
        if d is None:
            continue
        r.rows.append([name, d["mb_s"], d["req_s"], d["p50"], d["p99"], d["p999"],
                       d.get("cpu_ms_mib", nan),
                       d.get("retries", 0), d["errors"], d.get("fetch_mb_s", nan),
                       d.get("fetch_cpu_ms_mib", nan),
                       d.get("cold_mb_s", nan), d.get("cold_cpu_ms_mib", nan)])
        r.series[f"{name} raw 1 MiB"] = d["series"]
        r.percentiles[f"{name} raw 1 MiB"] = {k: d[k] for k in ("p50", "p99", "p999")}
    for name, d in (("s3kafka", ours), ("mock", theirs)):
        if d is not None and d.get("error_codes"):
            r.notes.append(f"{name} error responses by Kafka error code: {d['error_codes']}")
        if d is not None and d.get("retries"):
            r.notes.append(f"{name}: {d['retries']} requests answered NOT_ENOUGH_REPLICAS "
                           "(storage back-pressure) or REQUEST_TIMED_OUT were resent, like a "
                           "client retries them (latency counted from the first send)")
    r.notes.append("broker CPU: the s3kafka process (all threads, /proc); for the mock, its "
                   "cluster thread (rdk:mock) in the bench process")
    steady = [f"{name} {d['cpu_ms_mib_steady']:.3f}" for name, d in (("s3kafka", ours),
              ("mock", theirs)) if d is not None and "cpu_ms_mib_steady" in d]
    if steady:
        r.notes.append(f"broker CPU ms per MiB acknowledged from {STEADY_FROM_S:.0f} s into the "
                       f"run on (a fresh broker's first ~1 GiB fills its LogCache with fresh "
                       f"memory): {', '.join(steady)}")
    kernel = ours.get("kernel_ms_mib_steady", float("nan"))
    if kernel == kernel:
        r.notes.append(f"of s3kafka's, in the kernel (system time: the socket receive copy, the "
                       f"WAL's and the objects' Direct IO, fsyncs, task switches): {kernel:.3f} "
                       f"ms/MiB; in user space (the interpreter, CRC, uvloop): "
                       f"{ours['cpu_ms_mib_steady'] - kernel:.3f}")
    steal = {name: d["steal"] for name, d in (("s3kafka", ours), ("mock", theirs))
             if d is not None and not math.isnan(d.get("steal", math.nan))}
    if steal:
        r.notes.append("host steal time during the produce runs (/proc/stat: the share of the "
                       "VM's CPU time the host ran something else): "
                       + ", ".join(f"{name} {100 * v:.1f} %" for name, v in steal.items()))
    groups = ours.get("threads_ms_mib_steady") or {}
    shown = [f"{g} {v:.3f}" for g, v in groups.items() if v >= 0.005]
    if shown:
        r.notes.append(f"the same by thread (kernel names, broker/thread_names.py; the event "
                       f"loop receives, checks and appends, s3k-io writes the objects and "
                       f"calls the metadata store), ms/MiB: {', '.join(shown)}")
    if ours.get("disk_mb_s") is not None:
        r.notes.append(f"the device under s3kafka's WAL and objects ({ours['disk']}) during its "
                       f"produce run: {ours['disk_mb_s']:,.0f} MB/s written "
                       f"({ours['disk_per_byte']:.2f} bytes per byte produced: WAL + objects), "
                       f"busy {100 * ours['disk_busy']:.0f} % of the time (/proc/diskstats); the "
                       "mock keeps everything in memory")
    if fetch:
        r.notes.append(f"hot fetch: the last {HOT_FETCH_BYTES >> 20} MiB written, read over and "
                       f"over for {fetch_seconds:.0f} s (after 1 s untimed) once the broker's uploads were done "
                       f"(after {ours.get('settle_s', 0):.1f} s; the data is still in the LogCache); "
                       "cold fetch: after a restart (the shutdown uploads everything), one pass "
                       f"from the log start through the object store ({ours.get('cold_mib', 0):.0f}"
                       " MiB read)")
    r.extra = {"s3kafka": ours, "mock": theirs}
    if theirs:
        def ratio(a: float, b: float) -> float:
            return a / b if b else nan
        r.notes.append(f"ratio s3kafka/mock produce: {ratio(ours['mb_s'], theirs['mb_s']):.2f}; "
                       f"hot fetch: {ratio(ours.get('fetch_mb_s', nan), theirs.get('fetch_mb_s', nan)):.2f}; "
                       f"cold/hot fetch: {ratio(ours.get('cold_mb_s', nan), ours.get('fetch_mb_s', nan)):.2f}")
    return [r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch-bytes", type=int, default=1 << 20)
    ap.add_argument("--fetch-seconds", type=float, default=5.0)
    ap.add_argument("--skip-mock", action="store_true")
    ap.add_argument("--fetch", action="store_true", default=True)
    ap.add_argument("--no-fetch", dest="fetch", action="store_false", help="produce only")
    ap.add_argument("--broker-arg", action="append", default=[],
                    help="extra broker argument, repeatable (e.g. --broker-arg=--storage "
                         "--broker-arg=memory to time the request path without the WAL)")
    a = ap.parse_args()
    for r in run(a.seconds, a.connections, a.depth, a.batch_bytes, not a.skip_mock, a.fetch,
                 a.broker_arg, a.fetch_seconds):
        r.print()


if __name__ == "__main__":
    main()
