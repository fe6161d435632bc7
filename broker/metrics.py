"""Prometheus metrics of the broker process, served on ``--metrics-listen`` (``/metrics``).

Per request the server bumps a few plain counters and two lock-free histograms
(``RequestStats``); everything else - connections, per-topic bytes and records, partitions,
groups and lag, and the storage engine's state (``storage.metrics``) - is read from the live
objects by collectors when a scrape comes in, so an unscraped broker computes nothing.

/metrics is served by a small asyncio HTTP responder on the broker's own event loop rather
than prometheus-client's threaded server: collectors then read loop-owned state (dicts the
handlers mutate) from the loop thread, without locks and without racing the handlers; only
the text rendering of what they collected runs on a thread.
"""
from __future__ import annotations

import asyncio
import logging
import os
from bisect import bisect_left as _bisect
from time import perf_counter as _now
from typing import Any, Awaitable, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry
from protocol import ErrorCode, api_name

from storage.metrics import Histogram, StorageCollector, histogram_family
from .failures import failure_answer
from .thread_names import PoolCPU

log = logging.getLogger(__name__)

DEFAULT_METRICS_LISTEN = "127.0.0.1:9644"
# request latency: ApiVersions/Metadata in tens of microseconds, acks=all produce in ~1 ms,
# long-polling fetches up to their max wait (500 ms by default in clients, up to seconds)
REQUEST_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_P = "s3kafka_"


def _error_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


class ApiStats:
    """One API's counters: answered requests per version, queue and handling histograms."""

    __slots__ = ("versions", "queue", "handling")

    def __init__(self) -> None:
        self.versions: dict[int, int] = {}
        self.queue = Histogram(REQUEST_BUCKETS)
        self.handling = Histogram(REQUEST_BUCKETS)


class RequestStats:
    """Per-request counters, updated on the event loop thread only (no locks)."""

    def __init__(self) -> None:
        self.apis: dict[int, ApiStats] = {}                         # api key -> stats
        self.errors: dict[tuple[int, int, str], int] = {}           # (api, version, error)
        self.topic_out: dict[str, list[int]] = {}                   # topic -> [bytes, records]
        self.connections_opened = 0
        self.run_requests = 0          # requests answered together with others (run handlers)
        self.runs = 0                  # run handler calls
        self.direct_requests = 0       # requests answered without a task (NOW_HANDLERS)
        self.answered = 0              # requests answered (all APIs): the loop watch's traffic

    def api(self, api_key: int) -> ApiStats:
        a = self.apis.get(api_key)
        if a is None:
            a = self.apis[api_key] = ApiStats()
        return a

    def observe(self, api_key: int, version: int, queued: float, handled: float) -> None:
        """One answered request: queue time (frame received -> handler runs) and handling."""
        self.answered += 1
        a = self.apis.get(api_key) or self.api(api_key)
        v = a.versions
        v[version] = v.get(version, 0) + 1
        q, h = a.queue, a.handling
        q.counts[_bisect(q.bounds, queued)] += 1
        q.sum += queued
        h.counts[_bisect(h.bounds, handled)] += 1
        h.sum += handled

    def error(self, api_key: int, version: int, error: str | int, n: int = 1) -> None:
        """A request (or ``n`` partitions of one) answered with an error, or refused."""
        name = error if isinstance(error, str) else _error_name(error)
        k = (api_key, version, name)
        self.errors[k] = self.errors.get(k, 0) + n

    def fetched(self, topic: str, nbytes: int, nrecords: int) -> None:
        """Bytes and records (batch header counts) a Fetch response carries for ``topic``."""
        t = self.topic_out.get(topic)
        if t is None:
            t = self.topic_out[topic] = [0, 0]
        t[0] += nbytes
        t[1] += nrecords


_DETACHED = RequestStats()   # for brokers without stats (handler tests' stand-ins)


def stats_of(broker: Any) -> RequestStats:
    """The broker's RequestStats (a detached one for stand-in brokers)."""
    return getattr(broker, "request_stats", _DETACHED)


async def timed(fn: Callable[[Any, Any], Awaitable[Any]], ctx: Any, request: Any,
                stats: RequestStats, received: float) -> Any:
    """Run a handler and account it. The handler's first step runs in this task's first step
    (a plain ``await``), so request ordering is what it would be without the wrapper."""
    start = _now()
    try:
        result = await fn(ctx, request)
    except BaseException as exc:
        h = ctx.header
        stats.error(h.api_key, h.api_version, "EXCEPTION")
        stats.observe(h.api_key, h.api_version, start - received, _now() - start)
        if isinstance(exc, Exception):
            # answered like Kafka does (an error response, the connection stays open)
            answer = failure_answer(ctx, request, exc)
            if answer is not None:
                return answer
        raise
    h = ctx.header
    stats.observe(h.api_key, h.api_version, start - received, _now() - start)
    code = getattr(result, "error_code", 0)   # encoded bodies (Produce) count their own
    if code:
        stats.error(h.api_key, h.api_version, code)
    return result


class BrokerCollector(Collector):
    """Everything broker-side, read from the broker's objects at scrape time."""

    def __init__(self, broker: Any) -> None:
        self.broker = broker

    def collect(self) -> Iterator[Any]:
        b = self.broker
        st: RequestStats = b.request_stats
        info = GaugeMetricFamily(_P + "broker_info", "Constant 1, labelled with this broker's "
                                 "identity", labels=["node_id", "cluster_id"])
        info.add_metric([str(b.node_id), b.cluster_id or ""], 1)
        yield info
        yield GaugeMetricFamily(_P + "broker_start_time_seconds", "Unix time the broker "
                                "started", value=b.started_at)
        # -- requests
        reqs = CounterMetricFamily(_P + "requests", "Requests answered, per API and version",
                                   labels=["api", "version"])
        apis = sorted(st.apis.items())
        for key, a in apis:
            for ver, n in sorted(a.versions.items()):
                reqs.add_metric([api_name(key), str(ver)], n)
        yield reqs
        errs = CounterMetricFamily(_P + "request_errors", "Requests (or partitions of a "
                                   "request) answered with an error code, handlers that failed "
                                   "(EXCEPTION) and requests refused by closing the connection",
                                   labels=["api", "version", "error"])
        for (key, ver, err), n in sorted(st.errors.items()):
            errs.add_metric([api_name(key) if key >= 0 else "unknown", str(ver), err], n)
        yield errs
        yield histogram_family(_P + "request_queue_seconds", "Time from a request's last byte "
                               "received (decoding included) until its handler runs", ["api"],
                               (([api_name(k)], a.queue) for k, a in apis))
        yield histogram_family(_P + "request_handling_seconds", "Time a request's handler "
                               "takes (long-poll waits and storage appends included)", ["api"],
                               (([api_name(k)], a.handling) for k, a in apis))
        yield GaugeMetricFamily(_P + "active_connections", "Open client connections",
                                value=len(b.connections))
        # -- event loop stalls and collector pauses (maxima since the previous scrape)
        watch = getattr(b, "loop_watch", None)
        if watch is not None:
            yield GaugeMetricFamily(_P + "loop_lag_max_seconds", "Longest a 5 ms timer of the "
                                    "event loop fired late since the previous scrape (a "
                                    "request waited that long behind other loop work; "
                                    "every 250 ms while no client is connected)",
                                    value=watch.take_max())
            yield CounterMetricFamily(_P + "loop_stalls", "Times that timer fired 5 ms or "
                                      "more late", value=watch.stalls)
            yield CounterMetricFamily(_P + "loop_lag_seconds", "Total lateness of that timer",
                                      value=watch.lag_total)
        freezer = getattr(b, "_gc", None)
        if freezer is not None and hasattr(freezer, "take_max"):
            yield GaugeMetricFamily(_P + "gc_pause_max_seconds", "Longest cyclic garbage "
                                    "collection since the previous scrape",
                                    value=freezer.take_max())
            yield CounterMetricFamily(_P + "gc_pause_seconds", "Time spent in cyclic garbage "
                                      "collections", value=freezer.pause_total)
        yield CounterMetricFamily(_P + "connections_opened", "Client connections accepted",
                                  value=st.connections_opened)
        yield CounterMetricFamily(_P + "request_runs", "Runs of pipelined requests of one "
                                  "connection read together and handed to one run handler "
                                  "(Produce: one append for several small requests to one "
                                  "partition)", value=st.runs)
        yield CounterMetricFamily(_P + "request_run_members", "Requests answered as part of a "
                                  "run", value=st.run_requests)
        yield CounterMetricFamily(_P + "request_direct", "Requests handled without a task "
                                  "of their own (small plain Produce requests: appended in "
                                  "the read's loop step, answered from the WAL completion)",
                                  value=st.direct_requests)
        # -- topics and partitions
        bin_ = CounterMetricFamily(_P + "topic_bytes_in", "Produced record-batch bytes "
                                   "appended, per topic", labels=["topic"])
        rin = CounterMetricFamily(_P + "topic_records_in", "Produced records appended (from "
                                  "batch headers), per topic", labels=["topic"])
        hw = GaugeMetricFamily(_P + "partition_high_watermark", "High watermark (next offset) "
                               "per partition", labels=["topic", "partition"])
        start = GaugeMetricFamily(_P + "partition_log_start_offset", "Log start offset per "
                                  "partition", labels=["topic", "partition"])
        led = 0
        topics = b.topics
        for name, topic in sorted(topics.items()):
            nbytes = nrec = 0
            for i, p in enumerate(topic.partitions):
                if p is None:       # not open here (led by another broker)
                    continue
                led += 1
                nbytes += getattr(p, "bytes_in", 0)
                nrec += getattr(p, "records_in", 0)
                hw.add_metric([name, str(i)], p.high_watermark)
                start.add_metric([name, str(i)], p.log_start_offset)
            bin_.add_metric([name], nbytes)
            rin.add_metric([name], nrec)
        yield bin_
        yield rin
        bout = CounterMetricFamily(_P + "topic_bytes_out", "Record-batch bytes sent in Fetch "
                                   "responses, per topic", labels=["topic"])
        rout = CounterMetricFamily(_P + "topic_records_out", "Records sent in Fetch responses "
                                   "(from batch headers), per topic", labels=["topic"])
        for name, (nb, nr) in sorted(st.topic_out.items()):
            bout.add_metric([name], nb)
            rout.add_metric([name], nr)
        yield bout
        yield rout
        yield hw
        yield start
        # KIP-392 (broker/cluster/follower.py): fetches served here for partitions led by
        # another broker, and consumers this leader sent to a broker of their rack
        fr = getattr(b, "_follower_reads", None)
        yield CounterMetricFamily(_P + "follower_fetch_bytes", "Record-batch bytes this broker "
                                  "served as a KIP-392 follower (from the object store)",
                                  value=getattr(fr, "bytes", 0))
        yield CounterMetricFamily(_P + "fetch_redirects", "Fetch partitions this leader "
                                  "answered with a KIP-392 preferred read replica",
                                  value=getattr(fr, "redirects", 0))
        yield GaugeMetricFamily(_P + "topics", "Topics", value=len(topics))
        yield GaugeMetricFamily(_P + "partitions_led", "Partitions this broker leads",
                                value=led)
        # a single node is its own controller; with a cluster room, its view decides
        cluster = getattr(b, "cluster", None)
        controller = getattr(cluster, "controller_id", b.node_id)
        live = getattr(cluster, "live", None)
        yield GaugeMetricFamily(_P + "controller_active", "1 when this broker is the active "
                                "controller (a single node always is)",
                                value=int(controller == b.node_id))
        yield GaugeMetricFamily(_P + "cluster_brokers", "Live brokers this broker knows of "
                                "(itself included)", value=len(live) if live else 1)
        yield from self._groups(topics)

    def _groups(self, topics: dict[str, Any]) -> Iterator[Any]:
        coord = self.broker.groups
        count = GaugeMetricFamily(_P + "consumer_groups", "Consumer groups, per state",
                                  labels=["state"])
        members = GaugeMetricFamily(_P + "consumer_group_members", "Members per consumer "
                                    "group", labels=["group"])
        lag = GaugeMetricFamily(_P + "consumer_group_lag", "High watermark minus the group's "
                                "committed offset, per group and partition (records)",
                                labels=["group", "topic", "partition"])
        if coord is not None:
            states: dict[str, int] = {}
            for gid, g in sorted(coord.groups.items()):
                state = getattr(g.state, "value", str(g.state))
                states[state] = states.get(state, 0) + 1
                members.add_metric([gid], len(g.members))
            for state, n in sorted(states.items()):
                count.add_metric([state], n)
            for gid, committed in sorted(coord.offsets.items()):
                for (tname, idx), c in sorted(committed.items()):
                    topic = topics.get(tname)
                    if topic is None or not 0 <= idx < len(topic.partitions):
                        continue
                    lag.add_metric([gid, tname, str(idx)],
                                   max(0, topic.partitions[idx].high_watermark - c.offset))
        yield count
        yield members
        yield lag


class ThreadPoolCollector(Collector):
    """CPU seconds of the broker's threads by pool (broker/thread_names.py): the event loop
    near one second per second is a saturated broker whatever its other threads do - the
    question Kafka's RequestHandlerAvgIdlePercent and NetworkProcessorAvgIdlePercent answer."""

    def __init__(self) -> None:
        self._cpu = PoolCPU()

    def collect(self) -> Iterator[Any]:
        fam = CounterMetricFamily(
            _P + "thread_cpu_seconds", "CPU seconds (user + system) used by the broker's "
            "threads, by pool: event-loop is the main thread, the others their kernel names "
            "without the index (s3k-io, s3k-cold, s3k-send, ...)", labels=["pool"])
        for pool, seconds in sorted(self._cpu.read().items()):
            fam.add_metric([pool], seconds)
        yield fam


def build_registry(broker: Any) -> CollectorRegistry:
    """The registry /metrics serves: broker, storage engine, and the process itself."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(BrokerCollector(broker))
    reg.register(StorageCollector(lambda: broker.store))
    reg.register(ThreadPoolCollector())
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    GCCollector(registry=reg)
    return reg


class _Snapshot(Collector):
    """Metric families already collected, for rendering off the event loop."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Iterator[Any]:
        return iter(self.families)


class MetricsServer:
    """GET /metrics over HTTP/1.x on the broker's event loop (one request per connection)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[:2]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            method = parts[0] if parts else ""
            path = (parts[1] if len(parts) > 1 else "/").split("?", 1)[0]
            ctype = "text/plain; charset=utf-8"
            if method not in ("GET", "HEAD"):
                status, body = "405 Method Not Allowed", b"only GET\n"
            elif path in ("/metrics", "/metrics/"):
                try:
                    # read the state on the loop (consistent, no locks); render the text, the
                    # larger part (~20 ms for 1000 partitions), on a thread so the loop keeps
                    # serving between GIL switches instead of stalling for the whole scrape
                    snapshot = _Snapshot(list(self.registry.collect()))
                    status, body = "200 OK", await asyncio.to_thread(generate_latest, snapshot)
                    ctype = CONTENT_TYPE_LATEST
                except Exception as exc:  # noqa: BLE001 - a collector bug: this scrape only
                    log.error("metrics scrape failed error=%r", exc)
                    status, body = "500 Internal Server Error", b"scrape failed\n"
            elif path == "/":
                status, body = "200 OK", b"s3kafka: metrics at /metrics\n"
            else:
                status, body = "404 Not Found", b"not found; try /metrics\n"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: "
                         f"{len(body)}\r\nConnection: close\r\n\r\n".encode("latin-1"))
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ConnectionError):
            pass
        finally:
            writer.close()


async def start_metrics(broker: Any) -> MetricsServer | None:
    """Serve /metrics on the configured address; None when disabled.

    An address given explicitly that cannot be bound is a start-up error naming the flag. The
    default address being taken (a second broker on the same host) is only a warning: that
    broker runs without metrics rather than failing to start."""
    if getattr(broker, "metrics_server", None) is not None:
        return broker.metrics_server            # already serving (started once per process)
    listen = broker.config.metrics_listen.strip()
    if listen.lower() in ("", "off", "none", "disabled"):
        return None
    from .config import split_host_port  # noqa: PLC0415

    host, port = split_host_port(listen)
    server = MetricsServer(build_registry(broker))
    try:
        await server.start(host, port)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        if listen == DEFAULT_METRICS_LISTEN:
            log.warning("metrics not served: the default --metrics-listen %s is taken (%s); "
                        "pass --metrics-listen HOST:PORT or off", listen, reason)
            return None
        raise OSError(f"--metrics-listen {listen}: {reason}") from None
    h, p = server.address
    log.info("metrics served at http://%s:%d/metrics", h, p)
    return server
