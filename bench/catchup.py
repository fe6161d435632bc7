"""Catch-up read benchmark: does a consumer reading a large backlog from the object store slow
the producers and the tail consumers?

    python -m bench.catchup [--backlog-mb 200] [--seconds 15] [--rate 2000] [--size 1024]
                            [--skip-s3]

One broker (a subprocess, embedded defaults with a small LogCache so the backlog lives in the
object store). It prints: produce throughput (the backlog load, as fast as one producer goes);
then, at a fixed produce rate, p50/p99 produce latency (send -> ack) and p50/p99 tail consumer
end-to-end latency (send -> consumer receives), first alone and then while a second consumer
reads the whole backlog from offset 0; the ratio with/without; and the catch-up read MB/s from
file:// and from a moto S3 endpoint (moto in server mode on localhost). Producers and
consumers are separate processes (confluent-kafka) so they do not share a GIL with each other.
Goal: p99 latencies with the catch-up reader within 1.2x of those without it.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

from bench.common import PY, REPO, free_port, pct  # noqa: E402


class Broker:
    """A broker subprocess on a free port."""

    def __init__(self, data_dir: str, extra: list[str]) -> None:
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.args = [PY, "-m", "broker", "serve", "--listen", self.bootstrap, "--data-dir",
                     data_dir, "--node-id", "0", *extra]
        self.log = open(os.path.join(data_dir + ".log"), "ab")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONPATH=REPO))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("broker did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


def create_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 2})
    for f in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        f.result(30)


def load_backlog(bootstrap: str, topic: str, total: int, size: int) -> float:
    """Produce ``total`` bytes as fast as possible; returns MB/s acknowledged."""
    from confluent_kafka import Producer
    p = Producer({"bootstrap.servers": bootstrap, "log_level": 2, "acks": "all", "linger.ms": 5,
                  "batch.size": 1 << 20, "queue.buffering.max.kbytes": 256 << 10})
    value = os.urandom(size)
    n = total // size
    t0 = time.perf_counter()
    for _ in range(n):
        while True:
            try:
                p.produce(topic, value)
                break
            except BufferError:
                p.poll(0.01)
        p.poll(0)
    p.flush(300)
    return n * size / (time.perf_counter() - t0) / 1e6


def producer_proc(bootstrap: str, topic: str, rate: int, size: int, seconds: float, q) -> None:
    """Fixed-rate producer; reports (acked count, produce latencies)."""
    from confluent_kafka import Producer
    lat: list[float] = []
    p = Producer({"bootstrap.servers": bootstrap, "log_level": 2, "acks": "all", "linger.ms": 1})
    pad = os.urandom(size - 24)

    def cb(err, msg) -> None:
        if err is None:
            lat.append(time.time() - float(msg.value()[:24]))
    start = time.time()
    i = 0
    while time.time() - start < seconds:
        due = start + i / rate
        now = time.time()
        if due > now:
            p.poll(min(due - now, 0.005))
            continue
        p.produce(topic, b"%024.6f" % time.time() + pad, on_delivery=cb)
        i += 1
        p.poll(0)
    p.flush(60)
    q.put(("producer", len(lat), lat))


def tail_proc(bootstrap: str, topic: str, seconds: float, q) -> None:
    """Tail consumer from the end; reports end-to-end latencies."""
    from confluent_kafka import Consumer, TopicPartition, OFFSET_END
    c = Consumer({"bootstrap.servers": bootstrap, "log_level": 2, "group.id": f"tail-{time.time_ns()}",
                  "fetch.wait.max.ms": 50, "enable.auto.commit": False})
    c.assign([TopicPartition(topic, 0, OFFSET_END)])
    lat: list[float] = []
    end = time.time() + seconds
    while time.time() < end:
        m = c.poll(0.1)
        if m is not None and not m.error():
            lat.append(time.time() - float(m.value()[:24]))
    c.close()
    q.put(("tail", len(lat), lat))


def catchup_proc(bootstrap: str, topic: str, seconds: float | None, q) -> None:
    """Read the topic from offset 0 as fast as possible (again and again until ``seconds``
    pass, if given); reports MB/s."""
    from confluent_kafka import Consumer, TopicPartition
    got = 0
    nbytes = 0
    t0 = time.perf_counter()
    deadline = None if seconds is None else time.monotonic() + seconds
    while True:
        n, b = _catchup_pass(bootstrap, topic, deadline)
        got += n
        nbytes += b
        if deadline is None or time.monotonic() >= deadline:
            break
    q.put(("catchup", got, nbytes / (time.perf_counter() - t0) / 1e6))


def _catchup_pass(bootstrap: str, topic: str, deadline: float | None) -> tuple[int, int]:
    from confluent_kafka import Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": bootstrap, "log_level": 2, "group.id": f"cu-{time.time_ns()}",
                  "enable.auto.commit": False, "fetch.max.bytes": 32 << 20,
                  "max.partition.fetch.bytes": 8 << 20, "queued.max.messages.kbytes": 256 << 10})
    low, high = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
    c.assign([TopicPartition(topic, 0, 0)])
    got = 0
    nbytes = 0
    while got < high - low and (deadline is None or time.monotonic() < deadline):
        for m in c.consume(1000, 0.5):
            if not m.error():
                got += 1
                nbytes += len(m.value())
    c.close()
    return got, nbytes


def run_phase(b: Broker, args, with_catchup: bool) -> dict:
    q = mp.Queue()
    procs = [mp.Process(target=tail_proc, args=(b.bootstrap, "tail", args.seconds + 3, q)),
             mp.Process(target=producer_proc,
                        args=(b.bootstrap, "tail", args.rate, args.size, args.seconds, q))]
    if with_catchup:
        procs.append(mp.Process(target=catchup_proc,
                                args=(b.bootstrap, "backlog", args.seconds + 3, q)))
    procs[0].start()
    time.sleep(1.5)
    for p in procs[1:]:
        p.start()
    out = {}
    for _ in procs:
        name, n, val = q.get(timeout=args.seconds + 120)
        out[name] = (n, val)
    for p in procs:
        p.join(30)
    return out


def catchup_only(extra: list[str], args, label: str) -> float:
    d = tempfile.mkdtemp(prefix="s3k-cu-")
    b = Broker(os.path.join(d, "data"), extra)
    b.start()
    try:
        create_topic(b.bootstrap, "backlog")
        load_backlog(b.bootstrap, "backlog", args.backlog_mb << 20, 16 << 10)
        b.stop()
        b.start()                         # cold caches: everything comes from the store
        q = mp.Queue()
        p = mp.Process(target=catchup_proc, args=(b.bootstrap, "backlog", None, q))
        p.start()
        _, n, mbps = q.get(timeout=600)
        p.join(30)
        print(f"catch-up read from {label}: {mbps:.1f} MB/s ({n} records, cold caches)")
        return mbps
    finally:
        b.stop()
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backlog-mb", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--rate", type=int, default=2000, help="tail produce rate, msgs/s")
    ap.add_argument("--size", type=int, default=1024, help="tail message size, bytes")
    ap.add_argument("--skip-s3", action="store_true")
    ap.add_argument("--cold-read-mbps", type=int, default=64,
                    help="engine cold_read_bytes_per_s (MiB/s) during the latency phases; 0 = off")
    args = ap.parse_args()
    engine = ["--wal-capacity", str(512 << 20), "--log-cache-bytes", str(64 << 20),
              "--upload-threshold-bytes", str(16 << 20), "--upload-interval-s", "5",
              "--block-cache-bytes", str(64 << 20)]
    latency_engine = engine + ["--cold-read-bytes-per-s", str(args.cold_read_mbps << 20)]
    d = tempfile.mkdtemp(prefix="s3k-bench-")
    b = Broker(os.path.join(d, "data"), latency_engine)
    b.start()
    try:
        create_topic(b.bootstrap, "backlog")
        create_topic(b.bootstrap, "tail")
        mbps = load_backlog(b.bootstrap, "backlog", args.backlog_mb << 20, 16 << 10)
        print(f"produce throughput (one producer, 16 KiB records, acks=all): {mbps:.1f} MB/s")
        time.sleep(6)                     # let the upload interval pass: backlog in objects
        run_phase(b, argparse.Namespace(**{**vars(args), "seconds": 3}), False)   # warm-up
        alone = run_phase(b, args, False)
        loaded = run_phase(b, args, True)
    finally:
        b.stop()
        shutil.rmtree(d, ignore_errors=True)
    rows = []
    for name, res in (("alone", alone), ("with catch-up", loaded)):
        n, plat = res["producer"]
        _, tlat = res["tail"]
        rows.append((name, n / args.seconds, pct(plat, .5) * 1e3, pct(plat, .99) * 1e3,
                     pct(tlat, .5) * 1e3, pct(tlat, .99) * 1e3))
    print(f"tail load: {args.rate} msgs/s x {args.size} B for {args.seconds:.0f} s")
    print(f"{'phase':<14} {'acked/s':>8} {'prod p50':>9} {'prod p99':>9} {'e2e p50':>8} "
          f"{'e2e p99':>8}   (ms)")
    for r in rows:
        print(f"{r[0]:<14} {r[1]:8.0f} {r[2]:9.2f} {r[3]:9.2f} {r[4]:8.2f} {r[5]:8.2f}")
    print(f"ratio p99 with/without: produce {rows[1][3] / rows[0][3]:.2f}x, "
          f"tail e2e {rows[1][5] / rows[0][5]:.2f}x (goal <= 1.2x)")
    cn, cmbps = loaded["catchup"]
    print(f"catch-up reader during the tail load: {cmbps:.1f} MB/s ({cn} records; engine cold-read "
          f"cap {args.cold_read_mbps} MiB/s)")
    engine += ["--cold-read-bytes-per-s", "0"]       # raw catch-up speed, no throttle
    catchup_only(engine, args, "file://")
    if not args.skip_s3:
        import boto3
        port = free_port()
        env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        moto = subprocess.Popen([PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(100):
                try:
                    urllib.request.urlopen(url, timeout=1)
                    break
                except OSError:
                    time.sleep(0.1)
            boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                         aws_access_key_id="testing",
                         aws_secret_access_key="testing").create_bucket(Bucket="bench")
            store = (f"s3://bench/k?endpoint_url={url}&region=us-east-1&access_key_id=testing"
                     "&secret_access_key=testing")
            catchup_only(engine + ["--object-store", store], args, "moto S3")
        finally:
            moto.terminate()
            moto.wait(10)


if __name__ == "__main__":
    main()
