"""Prometheus /metrics of a live broker under produce, fetch, group, upload, object-store
failure, compaction and DeleteRecords activity (confluent-kafka clients), the Grafana
dashboard against a live scrape, and --metrics-listen's start-up behaviour.

One broker serves the whole module (``activity``): scrapes are taken before, during an
object-store outage, and after everything settled; each test reads them.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client.parser import text_string_to_metric_families

from bench import ports
from bench.common import tied_popen
from conftest import REPO, free_port

DASHBOARD = REPO / "deploy" / "grafana" / "s3kafka-dashboard.json"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> tuple[str, Samples]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    samples: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``; KeyError if none."""
    found = [v for (n, ls), v in samples.items()
             if n == name and all((k, v2) in ls for k, v2 in labels.items())]
    if not found:
        raise KeyError(f"{name}{labels} not in the scrape")
    return sum(found)


@dataclass
class Activity:
    before: Samples
    outage: Samples
    reads: Samples          # after both groups read everything
    pre_reads: Samples      # after the first group, before the second
    after: Samples
    after_text: str
    topic: str
    group: str
    produced: int


def _produce(bootstrap: str, topic: str, n: int, size: int = 1000) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "batch.size": 65536,
                  "message.timeout.ms": 60000})
    errors: list = []
    for i in range(n):
        p.produce(topic, value=os.urandom(size), key=str(i).encode(),
                  on_delivery=lambda err, _m: errors.append(err) if err else None)
        p.poll(0)
    assert p.flush(60) == 0
    assert not errors, errors[:3]


def _consume(bootstrap: str, topic: str, group: str, n: int) -> Consumer:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe([topic])
    got, deadline = 0, time.monotonic() + 60
    while got < n and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is not None and not m.error():
            got += 1
    assert got >= n, f"consumed {got} of {n}"
    c.commit(asynchronous=False)
    return c


def _wait(port: int, pred, what: str, timeout: float = 30) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        _, s = scrape(port)
        try:
            if pred(s):
                return s
        except KeyError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def activity(module_broker_factory) -> Activity:
    mport = free_port()
    b = module_broker_factory([
        "--metrics-listen", f"127.0.0.1:{mport}",
        "--log-cache-bytes", str(1 << 20),          # small: old data is read from objects
        "--upload-interval-s", "0.2",
        "--backpressure-timeout-s", "1",
        "--compaction-interval-s", "1", "--compaction-min-objects", "2",
        "--cleanup-interval-s", "0.5"])
    bs = b.bootstrap
    topic, group = f"m-{uuid.uuid4().hex[:6]}", f"g-{uuid.uuid4().hex[:6]}"
    _, before = scrape(mport)

    _produce(bs, topic, 1500)                       # ~1.5 MiB through a 1 MiB LogCache
    _wait(mport, lambda s: total(s, "s3kafka_upload_backlog_bytes") == 0, "uploads")

    # object-store outage: the objects directory becomes a file, uploads fail, the backlog
    # grows until appends wait for room (back-pressure); then the store comes back
    objects = b.data_dir / "objects"
    away = b.data_dir / "objects.away"
    os.rename(objects, away)
    objects.write_bytes(b"")
    try:
        p = Producer({"bootstrap.servers": bs, "linger.ms": 5, "batch.size": 65536,
                      "message.timeout.ms": 60000})
        for i in range(1500):
            p.produce(topic, value=os.urandom(1000), key=str(i).encode())
            p.poll(0)
        # until an append gave up waiting (1 s): appends behind a waiting one wait in line
        # (issue 21), so only a wait that times out answers NOT_ENOUGH_REPLICAS
        outage = _wait(mport, lambda s: total(s, "s3kafka_backpressure_waits_total") > 0
                       and total(s, "s3kafka_object_store_errors_total", operation="put") > 0
                       and total(s, "s3kafka_request_errors_total", api="Produce",
                                 error="NOT_ENOUGH_REPLICAS") > 0,
                       "back-pressure during the outage")
    finally:
        objects.unlink()
        os.rename(away, objects)
    assert p.flush(60) == 0
    produced = 3000

    # a group reads everything (the start of the log only from objects), commits, leaves
    c = _consume(bs, topic, group, produced)
    _wait(mport, lambda s: total(s, "s3kafka_consumer_group_members", group=group) >= 1,
          "a group member")
    c.close()
    # a second group reads it again: block cache hits
    _, pre_reads = scrape(mport)
    c2 = _consume(bs, topic, group + "-2", produced)
    _, reads = scrape(mport)        # before compaction can replace the objects just read
    c2.close()
    _produce(bs, topic, 50, size=100)                # lag for the first group
    # DeleteRecords moves the log start (retention's trim path)
    admin = AdminClient({"bootstrap.servers": bs})
    for fut in admin.delete_records([TopicPartition(topic, 0, 100)]).values():
        fut.result(30)
    after = _wait(mport, lambda s: total(s, "s3kafka_compactions_total") > 0
                  and total(s, "s3kafka_objects_deleted_total") > 0
                  and total(s, "s3kafka_upload_backlog_bytes") == 0, "compaction and cleanup")
    text, after = scrape(mport)
    return Activity(before, outage, reads, pre_reads, after, text, topic, group,
                    produced + 50)


def test_metrics_present_and_moving(activity: Activity) -> None:
    """Every listed metric is in the scrape and moved with the activity."""
    a, t = activity, activity.topic
    b, o, f = a.before, a.outage, a.after
    grew = lambda name, **kw: total(f, name, **kw) > total(b, name, **kw) if any(  # noqa: E731
        n == name for n, _ in b) else total(f, name, **kw) > 0
    # requests per API and version, errors, latency histograms (queue and handling apart)
    assert total(f, "s3kafka_requests_total", api="Produce") > 0
    assert total(f, "s3kafka_requests_total", api="Fetch") > 0
    assert total(f, "s3kafka_requests_total", api="JoinGroup") > 0
    assert total(f, "s3kafka_requests_total", api="DeleteRecords") == 1
    assert any(n == "s3kafka_requests_total" and dict(ls).get("version", "").isdigit()
               for n, ls in f)
    assert total(f, "s3kafka_request_errors_total", api="Produce",
                 error="NOT_ENOUGH_REPLICAS") > 0, "back-pressured appends answered retriable"
    for h in ("s3kafka_request_queue_seconds", "s3kafka_request_handling_seconds"):
        assert total(f, h + "_count", api="Produce") > 0
        assert total(f, h + "_bucket", api="Fetch", le="+Inf") == total(f, h + "_count",
                                                                        api="Fetch")
    # per-topic bytes and records in and out
    assert total(f, "s3kafka_topic_records_in_total", topic=t) == a.produced
    assert total(f, "s3kafka_topic_bytes_in_total", topic=t) > 3000 * 1000
    assert total(f, "s3kafka_topic_records_out_total", topic=t) >= 2 * 3000
    assert total(f, "s3kafka_topic_bytes_out_total", topic=t) >= 2 * 3000 * 1000
    assert grew("s3kafka_connections_opened_total")
    assert total(f, "s3kafka_active_connections") >= 0
    # WAL
    assert total(f, "s3kafka_wal_append_seconds_count") > 0
    assert grew("s3kafka_wal_appended_bytes_total")
    assert grew("s3kafka_wal_device_written_bytes_total")
    assert total(o, "s3kafka_wal_used_bytes") > 0 and total(o, "s3kafka_wal_fill_ratio") > 0
    assert total(f, "s3kafka_wal_capacity_bytes") == 64 << 20
    assert total(o, "s3kafka_backpressure_wait_seconds_total") > 0
    # episodes: active during the outage, counted and timed after it
    assert total(o, "s3kafka_episode_active", episode="producers_backpressured") == 1
    assert total(o, "s3kafka_episode_active", episode="object_store_failing") == 1
    assert total(f, "s3kafka_episode_active", episode="object_store_failing") == 0
    assert total(f, "s3kafka_episodes_total", episode="object_store_failing") >= 1
    assert total(f, "s3kafka_episode_seconds_total", episode="producers_backpressured") > 0
    for ep in ("wal_full", "maintenance_failing"):     # present (total raises KeyError if not)
        total(f, "s3kafka_episode_active", episode=ep)
    # caches
    assert total(f, "s3kafka_log_cache_bytes") > 0
    assert total(f, "s3kafka_log_cache_capacity_bytes") == 1 << 20
    assert grew("s3kafka_log_cache_hits_total") and grew("s3kafka_log_cache_misses_total")
    # (compaction later replaces the objects and drops their blocks)
    # (on a loaded machine a compaction may land between the second group's read and the
    # scrape: then its blocks are gone, and the compaction count says so)
    assert total(a.reads, "s3kafka_block_cache_bytes") > 0 or \
        total(a.reads, "s3kafka_compactions_total") > total(a.pre_reads, "s3kafka_compactions_total")
    assert grew("s3kafka_block_cache_hits_total") and grew("s3kafka_block_cache_misses_total")
    assert grew("s3kafka_block_cache_fetched_bytes_total")
    assert grew("s3kafka_read_buffers_mapped_bytes_total")    # cold reads into fresh buffers
    # present (total raises KeyError if not); what the pool holds at the last scrape depends
    # on compactions and evictions in between, so no value is asserted
    assert total(f, "s3kafka_read_buffers_bytes") >= 0
    assert total(f, "s3kafka_read_buffers_dropped_bytes_total") >= 0
    # uploads and the object store
    assert total(o, "s3kafka_upload_backlog_bytes") > 0
    assert total(o, "s3kafka_upload_oldest_age_seconds") > 0
    assert total(f, "s3kafka_upload_backlog_bytes") == 0
    assert grew("s3kafka_uploads_total") and grew("s3kafka_uploaded_bytes_total")
    assert total(f, "s3kafka_objects_written_total") > 0
    assert total(f, "s3kafka_upload_errors_total") > 0
    assert total(f, "s3kafka_object_store_request_seconds_count", operation="put") > 0
    assert total(f, "s3kafka_object_store_request_seconds_count", operation="get_ranges") + \
        total(f, "s3kafka_object_store_request_seconds_count", operation="get") > 0
    assert total(f, "s3kafka_object_store_errors_total", operation="put") > 0
    # compaction and retention work
    assert total(f, "s3kafka_compactions_total") > 0
    assert total(f, "s3kafka_compacted_objects_total") >= 2
    assert total(f, "s3kafka_objects_deleted_total") > 0
    assert total(f, "s3kafka_stream_trims_total") >= 1
    assert total(f, "s3kafka_stream_trimmed_records_total") >= 100
    assert total(f, "s3kafka_partition_log_start_offset", topic=t, partition="0") == 100
    assert total(f, "s3kafka_partition_high_watermark", topic=t, partition="0") == a.produced
    # groups, partitions, controller
    assert total(f, "s3kafka_consumer_groups") >= 2
    assert total(f, "s3kafka_consumer_group_members", group=a.group) == 0  # it left
    assert total(f, "s3kafka_consumer_group_lag", group=a.group, topic=t, partition="0") == 50
    assert total(f, "s3kafka_partitions_led") >= 1
    assert total(f, "s3kafka_topics") >= 1
    assert total(f, "s3kafka_controller_active") == 1
    assert total(f, "s3kafka_cluster_brokers") == 1
    assert total(f, "s3kafka_broker_info") == 1
    assert total(f, "process_resident_memory_bytes") > 0
    # CPU by thread pool: the event loop served everything; the object writers uploaded
    assert grew("s3kafka_thread_cpu_seconds_total", pool="event-loop")
    assert total(f, "s3kafka_thread_cpu_seconds_total", pool="s3k-io") > 0


def test_readme_table_lists_every_metric(activity: Activity) -> None:
    """The README's Metrics table names every s3kafka_ family the broker exposes."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    exposed = {fam.name + ("_total" if fam.type == "counter" else "")
               for fam in text_string_to_metric_families(activity.after_text)
               if fam.name.startswith("s3kafka_")}
    assert len(exposed) > 40
    missing = sorted(n for n in exposed if f"`{n}`" not in section)
    assert not missing, f"not in the README Metrics table: {missing}"


def test_dashboard_uses_only_existing_metrics(activity: Activity) -> None:
    """Every metric a dashboard query uses is in a live scrape."""
    dash = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("expr", "definition") and isinstance(v, str):
                    exprs.append(v)
                elif k == "query" and isinstance(v, dict) and "query" in v:
                    exprs.append(v["query"])
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(dash)
    assert len(exprs) > 30
    used = {m for e in exprs for m in re.findall(r"\b((?:s3kafka|process)_[a-z0-9_]+)", e)}
    scraped = {n for n, _ in activity.after}
    missing = sorted(used - scraped)
    assert not missing, f"dashboard uses metrics the broker does not expose: {missing}"
    # and the dashboard covers each area
    for needed in ("s3kafka_requests_total", "s3kafka_wal_append_seconds_bucket",
                   "s3kafka_consumer_group_lag", "s3kafka_upload_backlog_bytes",
                   "s3kafka_object_store_request_seconds_bucket"):
        assert needed in used


def test_idle_broker_logs_nothing_and_scrapes_quietly(broker_factory) -> None:
    """An idle broker with metrics on writes no log line, scraped or not."""
    mport = free_port()
    b = broker_factory(["--metrics-listen", f"127.0.0.1:{mport}"])
    assert f"metrics served at http://127.0.0.1:{mport}/metrics" in b.log_text()
    scrape(mport)
    n = len(b.log_text())
    time.sleep(3)
    scrape(mport)
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/", timeout=5) as r:
        assert b"/metrics" in r.read()
    assert b.log_text()[n:].strip() == ""


def _serve(tmp_path: pathlib.Path, *args: str, env: dict[str, str] | None = None
           ) -> subprocess.Popen:
    e = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    e.pop("S3KAFKA_METRICS_LISTEN", None) if env is None else None
    return tied_popen(
        [sys.executable, "-m", "broker", "serve", "--listen", f"127.0.0.1:{free_port()}",
         "--data-dir", str(tmp_path / "d"), "--wal-capacity", "4MiB", *args],
        cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_explicit_metrics_address_taken_is_a_one_line_error(tmp_path) -> None:
    with ports.listener() as s:
        port = s.getsockname()[1]
        proc = _serve(tmp_path, "--metrics-listen", f"127.0.0.1:{port}")
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    errors = [ln for ln in out.splitlines() if "level=ERROR" in ln or "Traceback" in ln]
    assert len(errors) == 1, out
    assert f"cannot start: --metrics-listen 127.0.0.1:{port}: Address already in use" in out
    assert not (tmp_path / "d").exists(), "nothing opened or written before the check"


@pytest.mark.xdist_group("port-9644")   # the default metrics port: one test at a time holds it
def test_default_metrics_address_taken_only_warns(broker_factory) -> None:
    """A second broker on a host finds the default port taken: it runs, without metrics."""
    for _attempt in range(3):
        holder = socket.socket()
        # SO_REUSEADDR: a closed connection in TIME_WAIT on 9644 must not stop the holder (the
        # broker binds with it, so it would get the port and the test would fail). Another
        # live process may hold 9644 for a while (another checkout's broker or run of this
        # test): wait for it; if it still holds the port, that is the same situation, unless
        # it lets go while the broker starts (then the broker serves metrics: try again).
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held = False
        try:
            deadline = time.monotonic() + 30
            while not held:
                try:
                    holder.bind(("127.0.0.1", 9644))
                    holder.listen()
                    held = True
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
            b = broker_factory(env={"S3KAFKA_METRICS_LISTEN": "127.0.0.1:9644"})
        finally:
            holder.close()
        log = b.log_text()
        if held or "metrics served at" not in log:
            break
        b.stop()
    assert "metrics not served: the default --metrics-listen 127.0.0.1:9644 is taken" in log
    assert b.running


def test_metrics_listen_bad_value_is_a_config_error(tmp_path) -> None:
    proc = _serve(tmp_path, "--metrics-listen", "nonsense")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "metrics_listen" in out and "Traceback" not in out
    assert not (tmp_path / "d").exists()
