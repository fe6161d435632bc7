"""Catch-up read benchmark: does a consumer reading a large backlog from the object store slow
the producers and the tail consumers?

    python -m bench.catchup [--backlog-mb 200] [--rate 2000] [--size 1024] [--windows 16]
                            [--window 4] [--mode interleaved|phases] [--seconds 15] [--rounds 2]
                            [--skip-s3] [--profile DIR] [--engine-arg=--flag=value ...]

One broker (a subprocess, embedded defaults with a small LogCache so the backlog lives in the
object store). It prints: produce throughput (the backlog load, as fast as one producer goes);
then, at a fixed produce rate, p50/p99 produce latency (send -> ack) and p50/p99 tail consumer
end-to-end latency (send -> consumer receives), first alone and then while a second consumer
reads the whole backlog from offset 0; the ratio with/without; and the catch-up read MB/s from
file:// and from a moto S3 endpoint (moto in server mode on localhost). Producers and
consumers are separate processes (confluent-kafka) so they do not share a GIL with each other.
Goal: p99 latencies with the catch-up reader within 1.2x of those without it.

The machine is shared and noisy, so by default (``--mode interleaved``) the producer, the tail
consumer and the catch-up reader run for one long experiment and the catch-up reader is paused
and resumed in alternating windows (``--windows`` x ``--window`` s); each latency sample is
classed by its send time, so noise from other processes lands on both classes alike. The ratio
is reported pooled and per window pair (median and range). ``--mode phases`` runs separate
alone / loaded phases (``--rounds`` pairs) instead. The CPU share of every process (% of one
core) is printed too, since clients and broker share the cores. ``--profile DIR`` samples the
broker with py-spy (non-blocking, so latencies are not disturbed). ``--engine-arg`` passes
broker flags (e.g. ``--engine-arg=--cold-read-lag-target-ms=0``).

Two control figures say how far a ratio can be trusted: the *noise floor* is the same p99 ratio
taken between the alone windows of odd and of even window pairs (same condition on both sides:
what chance alone does, ideally 1.00x), and the objects written during each class show that
uploads, which cost the tail a few milliseconds each, fell into both classes alike (interleaved
runs upload every half window for that). ``--catchup-nice`` runs the reader process at a lower
CPU priority.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import os
import shutil
import socket
import subprocess
import tempfile
import time

from bench.common import (CLK_TCK, PY, REPO, free_port, pct, start_moto_s3,  # noqa: E402
                          TiedProcess, stat_cpu_s, task_ids, tied_popen)
from bench.device import device_of, disk_counters  # noqa: E402


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(main thread, all threads) CPU seconds of a process, from /proc."""
    return (stat_cpu_s(f"/proc/{pid}/task/{pid}/stat", 0.0),
            stat_cpu_s(f"/proc/{pid}/stat", 0.0))


class RunQueue:
    """Run-queue waits of one process's threads, from /proc/<pid>/task/*/schedstat: (main
    thread, all threads) seconds spent runnable but waiting for a CPU, and (main thread, all
    threads) times scheduled in - how long a process's wake-ups wait for a core (on 2 cores, a
    busy neighbour shows here, not in the process's own CPU time).

    The figures only grow between samples: schedstat is per thread, so a thread that exits (a
    client's librdkafka threads, when it closes before the last window ends; the whole
    process, once reaped) would take its waits out of the sum, and a window's difference
    came out negative ("producer -44.2 (-2651954)" in a make bench run). A thread keeps the
    figures it was last seen with, and a thread id seen again with smaller figures is a new
    thread (the id was reused): the old one's are kept beside it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.last: dict[str, tuple[int, int]] = {}      # tid -> (wait ns, schedule-ins)
        self.retired = [0, 0]                           # threads that exited or were replaced

    def _read(self) -> dict[str, tuple[int, int]]:
        now: dict[str, tuple[int, int]] = {}
        for tid in task_ids(self.pid):
            try:
                with open(f"/proc/{self.pid}/task/{tid}/schedstat") as f:
                    _run, wait, n = (int(x) for x in f.read().split())
            except (OSError, ValueError):
                continue
            now[tid] = (wait, n)
        return now

    def sample(self) -> tuple[float, float, int, int]:
        now = self._read()
        for tid, (wait, n) in self.last.items():
            cur = now.get(tid)
            if cur is None:
                now[tid] = (wait, n)                    # exited: keeps what it waited
            elif cur[0] < wait or cur[1] < n:           # a new thread under a reused id
                self.retired[0] += wait
                self.retired[1] += n
        self.last = now
        main_wait, main_n = now.get(str(self.pid), (0, 0))
        total = self.retired[0] + sum(w for w, _ in now.values())
        slices = self.retired[1] + sum(n for _, n in now.values())
        return main_wait / 1e9, total / 1e9, main_n, slices


def machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine used so far (every core), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / CLK_TCK        # all but idle and iowait


def cpu_share(t0: float) -> float:
    """% of one core this process used since ``t0`` (all its threads, librdkafka's too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return 100 * (r.ru_utime + r.ru_stime) / max(time.monotonic() - t0, 1e-3)


class Broker:
    """A broker subprocess on a free port."""

    def __init__(self, data_dir: str, extra: list[str]) -> None:
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.args = [PY, "-m", "broker", "serve", "--listen", self.bootstrap, "--data-dir",
                     data_dir, "--node-id", "0", *extra]
        self.objects_dir = os.path.join(data_dir, "objects")
        self.log = open(os.path.join(data_dir + ".log"), "ab")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = tied_popen(self.args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
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


def count_objects(root: str) -> int:
    """Objects in a file:// store (uploads and compactions add, cleanup removes)."""
    n = 0
    for _dirpath, _dirs, files in os.walk(root):
        n += sum(1 for f in files if ".tmp-" not in f)
    return n


def create_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 2})
    for f in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        f.result(30)


def load_backlog(bootstrap: str, topic: str, total: int, size: int,
                 batch_bytes: int = 1 << 20) -> float:
    """Produce ``total`` bytes as fast as possible in batches of up to ``batch_bytes``;
    returns MB/s acknowledged."""
    from confluent_kafka import Producer
    p = Producer({"bootstrap.servers": bootstrap, "log_level": 2, "acks": "all", "linger.ms": 5,
                  "batch.size": batch_bytes, "queue.buffering.max.kbytes": 256 << 10})
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


def producer_proc(bootstrap: str, topic: str, rate: int, size: int, seconds: float, q,
                  nice: int = 0) -> None:
    """Fixed-rate producer; reports (acked count, produce latencies)."""
    if nice:
        os.nice(nice)
    t_start = time.monotonic()
    from confluent_kafka import Producer
    lat: list[tuple[float, float]] = []
    p = Producer({"bootstrap.servers": bootstrap, "log_level": 2, "acks": "all", "linger.ms": 1})
    pad = os.urandom(size - 24)

    def cb(err, msg) -> None:
        if err is None:
            sent = float(msg.value()[:24])
            lat.append((sent, time.time() - sent))
    start = time.time()
    i = 0
    while time.time() - start < seconds:
        due = start + i / rate
        now = time.time()
        if due > now:
            # poll() takes whole milliseconds: a sub-millisecond wait would be poll(0) in a
            # busy loop (it burned ~80 % of a core). Messages due meanwhile go out right after;
            # each carries its own send time, so the latency figures are unaffected.
            p.poll(min(max(due - now, 0.001), 0.005))
            continue
        p.produce(topic, b"%024.6f" % time.time() + pad, on_delivery=cb)
        i += 1
        p.poll(0)
    p.flush(60)
    q.put(("producer", len(lat), lat, cpu_share(t_start)))


def tail_proc(bootstrap: str, topic: str, seconds: float, q, nice: int = 0) -> None:
    """Tail consumer from the end; reports end-to-end latencies."""
    if nice:
        os.nice(nice)
    t_start = time.monotonic()
    from confluent_kafka import Consumer, TopicPartition, OFFSET_END
    c = Consumer({"bootstrap.servers": bootstrap, "log_level": 2, "group.id": f"tail-{time.time_ns()}",
                  "fetch.wait.max.ms": 50, "enable.auto.commit": False})
    c.assign([TopicPartition(topic, 0, OFFSET_END)])
    lat: list[tuple[float, float]] = []
    end = time.time() + seconds
    while time.time() < end:
        m = c.poll(0.1)
        if m is not None and not m.error():
            sent = float(m.value()[:24])
            lat.append((sent, time.time() - sent))
    c.close()
    q.put(("tail", len(lat), lat, cpu_share(t_start)))


def catchup_proc(bootstrap: str, topic: str, seconds: float | None, q) -> None:
    """Read the topic from offset 0 as fast as possible (again and again until ``seconds``
    pass, if given); reports MB/s."""
    t_start = time.monotonic()
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
    q.put(("catchup", got, nbytes / (time.perf_counter() - t0) / 1e6, cpu_share(t_start)))


def gated_catchup_proc(bootstrap: str, topic: str, seconds: float, gate, q, nice: int = 0
                       ) -> None:
    """Read the topic from offset 0 over and over (one consumer, re-assigned to 0 at the end)
    while ``gate`` is set; paused (no fetches) while it is clear. Reports MB/s while on.
    ``nice`` lowers the reader process's CPU priority (librdkafka's threads inherit it)."""
    if nice:
        os.nice(nice)
    t_start = time.monotonic()
    from confluent_kafka import Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": bootstrap, "log_level": 2, "group.id": f"cu-{time.time_ns()}",
                  "enable.auto.commit": False, "fetch.max.bytes": 32 << 20,
                  "max.partition.fetch.bytes": 8 << 20, "queued.max.messages.kbytes": 32 << 10})
    low, high = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
    tp = TopicPartition(topic, 0, 0)
    c.assign([tp])
    c.pause([tp])
    on = False
    on_time = 0.0
    on_since = 0.0
    nbytes = got = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        want = gate.is_set()
        if want != on:
            now = time.monotonic()
            if want:
                c.resume([TopicPartition(topic, 0)])
                on_since = now
            else:
                c.pause([TopicPartition(topic, 0)])
                on_time += now - on_since
            on = want
        if not on:
            c.consume(1000, 0.02)          # serves callbacks; paused: returns nothing
            continue
        for m in c.consume(1000, 0.05):
            if m.error():
                continue
            got += 1
            nbytes += len(m)
            if m.offset() >= high - 1:     # the end: start over from 0
                c.assign([TopicPartition(topic, 0, 0)])
                break
    if on:
        on_time += time.monotonic() - on_since
    c.close()
    q.put(("catchup", got, nbytes / max(on_time, 1e-3) / 1e6, cpu_share(t_start)))


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


def run_phase(b: Broker, args, with_catchup: bool, profile: str | None = None) -> dict:
    """One phase: tail consumer + fixed-rate producer (+ the catch-up reader); returns each
    client's (count, value) plus the CPU share (% of one core) of every process."""
    q = mp.Queue()
    procs = [TiedProcess(target=tail_proc, args=(b.bootstrap, "tail", args.seconds + 3, q)),
             TiedProcess(target=producer_proc,
                        args=(b.bootstrap, "tail", args.rate, args.size, args.seconds, q))]
    if with_catchup:
        procs.append(TiedProcess(target=catchup_proc,
                                args=(b.bootstrap, "backlog", args.seconds + 3, q)))
    procs[0].start()
    time.sleep(1.5)
    assert b.proc is not None
    spy = None
    if profile:
        spy = subprocess.Popen([os.path.join(os.path.dirname(PY), "py-spy"), "record",
                                "--nonblocking", "--threads", "--idle", "--pid",
                                str(b.proc.pid), "-r", "200", "-d", str(int(args.seconds)),
                                "-f", "raw", "-o", profile],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    main0, all0 = cpu_seconds(b.proc.pid)
    t0 = time.monotonic()
    for p in procs[1:]:
        p.start()
    out: dict = {}
    cpu: dict[str, float] = {}
    for _ in procs:
        name, n, val, used = q.get(timeout=args.seconds + 120)
        out[name] = (n, [x[1] for x in val] if name != "catchup" else val)
        cpu[name] = used
        if name == "producer":     # the load ends with the producer: broker CPU up to here
            main1, all1 = cpu_seconds(b.proc.pid)
            wall = time.monotonic() - t0
    for p in procs:
        p.join(30)
    if spy is not None:
        spy.wait(60)
    share = dict(cpu)
    share["broker loop"] = 100 * (main1 - main0) / wall
    share["broker other threads"] = 100 * ((all1 - all0) - (main1 - main0)) / wall
    out["cpu"] = share
    return out


def run_interleaved(b: Broker, args) -> dict:
    """Producer, tail consumer and catch-up reader run for the whole experiment; the catch-up
    reader is switched on and off in alternating ``--window`` second windows (off first).
    Every latency sample is classed by its send time; the first ``--settle`` seconds of a
    window are left out (the switch is still taking effect). External noise on a shared machine
    lands on both classes alike, which separate phases cannot promise."""
    import threading
    q = mp.Queue()
    gate = mp.Event()
    total = args.windows * args.window
    cn = args.clients_nice
    procs = [TiedProcess(target=tail_proc, args=(b.bootstrap, "tail", total + 4.5, q, cn)),
             TiedProcess(target=producer_proc,
                        args=(b.bootstrap, "tail", args.rate, args.size, total + 1, q, cn)),
             TiedProcess(target=gated_catchup_proc,
                        args=(b.bootstrap, "backlog", total + 1.5, gate, q,
                              args.catchup_nice or cn))]
    procs[0].start()
    time.sleep(1.5)
    assert b.proc is not None
    for p in procs[1:]:
        p.start()
    t0 = time.time() + 1.0                 # windows start once the producer runs
    spy = None
    if args.profile:
        spy = subprocess.Popen([os.path.join(os.path.dirname(PY), "py-spy"), "record",
                                "--nonblocking", "--threads", "--idle", "--pid",
                                str(b.proc.pid), "-r", "200", "-d", str(int(total)), "-f",
                                "raw", "-o",
                                os.path.join(args.profile, "interleaved.txt")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    pids = {"broker loop": b.proc.pid, "producer": procs[1].pid, "tail": procs[0].pid,
            "catch-up": procs[2].pid}
    snaps: list[dict[str, float]] = []
    dev = device_of(b.objects_dir)
    queues = {k: RunQueue(pid) for k, pid in pids.items()}
    cpu_last = {k: (0.0, 0.0) for k in pids}

    def snap() -> dict[str, float]:
        out = {}
        for k, pid in pids.items():
            # a reaped process reads as 0 CPU: it keeps the figures it was last seen with
            (main_s, all_s), (main_0, all_0) = cpu_seconds(pid), cpu_last[k]
            main_s, all_s = cpu_last[k] = max(main_s, main_0), max(all_s, all_0)
            rq_main, rq_all, n_main, slices = queues[k].sample()
            if k == "broker loop":
                out[k] = main_s
                out["broker other"] = all_s - main_s
                out["rq broker loop"] = rq_main
                out["rq broker other"] = rq_all - rq_main
                out["rn broker loop"] = n_main
                out["rn broker other"] = slices - n_main
            else:
                out[k] = all_s
                out["rq " + k] = rq_all
                out["rn " + k] = slices
        out["whole machine"] = machine_busy_seconds()
        out["uploads"] = float(count_objects(b.objects_dir))
        out.update(disk_counters(dev))
        return out

    def toggle() -> None:
        for k in range(args.windows):
            time.sleep(max(0.0, t0 + k * args.window - time.time()))
            gate.set() if k % 2 else gate.clear()
            snaps.append(snap())
        time.sleep(max(0.0, t0 + total - time.time()))
        snaps.append(snap())
        gate.clear()
    th = threading.Thread(target=toggle, daemon=True)
    th.start()
    main0, all0 = cpu_seconds(b.proc.pid)
    w0 = time.monotonic()
    out: dict = {}
    cpu: dict[str, float] = {}
    for _ in procs:
        name, n, val, used = q.get(timeout=total + 180)
        out[name] = (n, val)
        cpu[name] = used
        if name == "producer":
            main1, all1 = cpu_seconds(b.proc.pid)
            wall = time.monotonic() - w0
    for p in procs:
        p.join(30)
    th.join(5)
    if spy is not None:
        spy.wait(60)
    cpu["broker loop"] = 100 * (main1 - main0) / wall
    cpu["broker other threads"] = 100 * ((all1 - all0) - (main1 - main0)) / wall
    out["cpu"] = cpu
    per_state: dict[str, dict[str, float]] = {"off": {}, "on": {}}
    for k in range(len(snaps) - 1):
        st = per_state["on" if k % 2 else "off"]
        for name, v in snaps[k + 1].items():
            st[name] = st.get(name, 0.0) + v - snaps[k][name]
    on_time = args.window * (args.windows // 2)
    out["uploads"] = {st: int(d.pop("uploads", 0)) for st, d in per_state.items()}
    out["disk"] = {st: {k: d.pop(k) for k in list(d) if k.startswith("disk ")}
                   for st, d in per_state.items()}
    out["run_queue"] = {st: {k: d.pop(k) for k in list(d) if k.startswith(("rq ", "rn "))}
                        for st, d in per_state.items()}
    out["disk_name"] = dev
    out["t0"] = t0
    out["cpu_windows"] = {st: {n: 100 * v / on_time for n, v in d.items()}
                          for st, d in per_state.items()}
    classes: dict[tuple[str, int], dict[str, list[float]]] = {}
    for name in ("producer", "tail"):
        for sent, lat in out[name][1]:
            k, into = divmod(sent - t0, args.window)
            if k < 0 or k >= args.windows or into < args.settle:
                continue
            classes.setdefault(("on" if int(k) % 2 else "off", int(k) // 2), {}) \
                .setdefault(name, []).append(lat)
    out["classes"] = classes
    return out


def report_interleaved(res: dict, args) -> None:
    cls = res["classes"]
    print(f"{'windows':<22} {'samples':>8} {'prod p50':>9} {'prod p99':>9} {'e2e p50':>8} "
          f"{'e2e p99':>8}   (ms)")
    pooled = {"off": {"producer": [], "tail": []}, "on": {"producer": [], "tail": []}}
    pairs = []
    for pair in range(args.windows // 2):
        for state in ("off", "on"):
            d = cls.get((state, pair), {})
            for name in ("producer", "tail"):
                pooled[state][name].extend(d.get(name, []))
        off, on = cls.get(("off", pair), {}), cls.get(("on", pair), {})
        if off.get("producer") and on.get("producer") and off.get("tail") and on.get("tail"):
            pairs.append((pct(on["producer"], .99) / pct(off["producer"], .99),
                          pct(on["tail"], .99) / pct(off["tail"], .99)))
    rows = {}
    for state, label in (("off", "alone (reader paused)"), ("on", "with catch-up")):
        pl, tl = pooled[state]["producer"], pooled[state]["tail"]
        rows[state] = (pct(pl, .99), pct(tl, .99))
        print(f"{label:<22} {len(pl):8d} {pct(pl, .5) * 1e3:9.2f} {pct(pl, .99) * 1e3:9.2f} "
              f"{pct(tl, .5) * 1e3:8.2f} {pct(tl, .99) * 1e3:8.2f}")
    pr = rows["on"][0] / rows["off"][0]
    tr = rows["on"][1] / rows["off"][1]
    print(f"ratio p99 with/without (pooled): produce {pr:.2f}x, tail e2e {tr:.2f}x (goal <= 1.2x)")
    if pairs:
        ps = sorted(a for a, _ in pairs)
        ts = sorted(b_ for _, b_ in pairs)
        print(f"per window pair p99 ratio: produce median {ps[len(ps) // 2]:.2f}x "
              f"(range {ps[0]:.2f}-{ps[-1]:.2f}), tail e2e median {ts[len(ts) // 2]:.2f}x "
              f"(range {ts[0]:.2f}-{ts[-1]:.2f}) over {len(pairs)} pairs")
    # the noise floor: alone windows of even pairs against alone windows of odd pairs (the
    # same condition on both sides; how far from 1.0 this lands is what chance alone does)
    aa = {0: {"producer": [], "tail": []}, 1: {"producer": [], "tail": []}}
    for (state, pair), d in cls.items():
        if state == "off":
            for name in ("producer", "tail"):
                aa[pair % 2][name].extend(d.get(name, []))
    if all(aa[k]["producer"] and aa[k]["tail"] for k in aa):
        print(f"noise floor, alone vs alone (odd/even window pairs): produce "
              f"{pct(aa[1]['producer'], .99) / pct(aa[0]['producer'], .99):.2f}x, tail e2e "
              f"{pct(aa[1]['tail'], .99) / pct(aa[0]['tail'], .99):.2f}x")
    up = res.get("uploads")
    if up:
        print(f"objects written (uploads) during alone windows: {up['off']}, with catch-up: "
              f"{up['on']}")
    disk = res.get("disk", {})
    if disk.get("off") and disk.get("on"):
        secs = args.window * (args.windows // 2)
        for st, label in (("off", "reader paused"), ("on", "with catch-up")):
            d = disk[st]
            w, r = d["disk writes"], d["disk reads"]
            print(f"device {res['disk_name']}, {label:<13}: {w / secs:6.0f} writes/s at "
                  f"{d['disk write ms'] / max(w, 1):.3f} ms mean, {r / secs:5.0f} reads/s "
                  f"({d['disk read sectors'] * 512 / secs / 1e6:6.1f} MB/s) at "
                  f"{d['disk read ms'] / max(r, 1):.3f} ms mean, busy "
                  f"{100 * d['disk busy ms'] / 1000 / secs:3.0f} % (whole device, all processes)")
    n, mbps = res["catchup"]
    print(f"catch-up reader while on: {mbps:.1f} MB/s ({n} records)")
    rq = res.get("run_queue", {})
    for st, label in (("off", "reader paused"), ("on", "with catch-up")):
        d = rq.get(st, {})
        if d:
            secs = args.window * (args.windows // 2)
            print(f"run-queue wait ms/s (per wake-up us), {label:<13}: " + ", ".join(
                f"{n[3:]} {1e3 * v / secs:.1f}"
                + (f" ({1e6 * v / max(d.get('rn ' + n[3:]) or 1, 1):.0f})"
                   if "rn " + n[3:] in d else "")
                for n, v in d.items() if n.startswith("rq ")))
    cw = res.get("cpu_windows", {})
    for st, label in (("off", "reader paused"), ("on", "with catch-up")):
        d = cw.get(st, {})
        if d:
            print(f"CPU % of one core, {label:<13}: " + ", ".join(
                f"{n} {v:.0f}" for n, v in d.items()) + f" (of {100 * (os.cpu_count() or 1)})")


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
        p = TiedProcess(target=catchup_proc, args=(b.bootstrap, "backlog", None, q))
        p.start()
        _, n, mbps, _cpu = q.get(timeout=600)
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
    ap.add_argument("--mode", choices=("interleaved", "phases"), default="interleaved",
                    help="interleaved: one long run, the catch-up reader switched on/off in "
                         "alternating windows; phases: separate alone / loaded phases")
    ap.add_argument("--windows", type=int, default=None,
                    help="interleaved: number of windows (default: each state gets 2 x "
                         "--seconds in total, like two rounds of phases)")
    ap.add_argument("--window", type=float, default=4.0, help="interleaved: window seconds")
    ap.add_argument("--settle", type=float, default=0.5,
                    help="interleaved: seconds left out at the start of each window")
    ap.add_argument("--rounds", type=int, default=2,
                    help="phases: alone / with-catch-up phase pairs, alternating, in one run")
    ap.add_argument("--skip-s3", action="store_true")
    ap.add_argument("--backlog-batch-bytes", type=int, default=1 << 20,
                    help="producer batch.size of the backlog: a cold read returns at least one "
                         "whole batch, so this bounds the catch-up answers from below")
    ap.add_argument("--catchup-nice", type=int, default=0,
                    help="interleaved: run the catch-up reader process at this nice value "
                         "(e.g. 19: its CPU stands for a client on another machine)")
    ap.add_argument("--clients-nice", type=int, default=0,
                    help="interleaved: run all three client processes (producer, tail consumer, "
                         "catch-up reader) at this nice value, so the broker has its two cores "
                         "first, as on its own host; the catch-up client's CPU then no longer "
                         "counts against the broker")
    ap.add_argument("--dump", metavar="FILE",
                    help="interleaved: write the window schedule and every latency sample "
                         "(send time, latency) as JSON, to class broker-side traces alike")
    ap.add_argument("--profile", metavar="DIR",
                    help="py-spy (raw collapsed stacks) of the broker during each phase")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="extra broker flag for the latency phases (repeat; e.g. "
                         "--engine-arg=--cold-read-bytes-per-s=0)")
    args = ap.parse_args()
    if args.windows is None:
        args.windows = 2 * max(1, round(2 * args.seconds / args.window))
    args.windows += args.windows % 2
    # Uploads (one object per interval, its write-back on the WAL's disk) cost the tail a few
    # milliseconds each: every 5 s they landed in alone and catch-up windows by chance (3 vs 6
    # in one run), and the pooled ratio swung 0.6-2.2x between identical runs. Interleaved,
    # they run twice per window, so both classes get their share.
    upload_every = args.window / 2 if args.mode == "interleaved" else 5.0
    engine = ["--wal-capacity", str(512 << 20), "--log-cache-bytes", str(64 << 20),
              "--upload-threshold-bytes", str(16 << 20), "--upload-interval-s", str(upload_every),
              "--block-cache-bytes", str(64 << 20)]
    latency_engine = engine + [a for e in args.engine_arg for a in e.split("=", 1)]
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    d = tempfile.mkdtemp(prefix="s3k-bench-")
    b = Broker(os.path.join(d, "data"), latency_engine)
    b.start()
    phases: list[tuple[str, dict]] = []
    try:
        create_topic(b.bootstrap, "backlog")
        create_topic(b.bootstrap, "tail")
        mbps = load_backlog(b.bootstrap, "backlog", args.backlog_mb << 20, 16 << 10,
                            args.backlog_batch_bytes)
        print(f"produce throughput (one producer, 16 KiB records, acks=all): {mbps:.1f} MB/s")
        time.sleep(6)                     # let the upload interval pass: backlog in objects
        run_phase(b, argparse.Namespace(**{**vars(args), "seconds": 3}), False)   # warm-up
        if args.mode == "interleaved":
            inter = run_interleaved(b, args)
        for r in range(args.rounds if args.mode == "phases" else 0):
            for name, loaded in (("alone", False), ("with catch-up", True)):
                prof = None
                if args.profile:
                    prof = os.path.join(args.profile, f"{'loaded' if loaded else 'alone'}-{r}.txt")
                phases.append((name, run_phase(b, args, loaded, prof)))
    finally:
        b.stop()
        shutil.rmtree(d, ignore_errors=True)
    flags = ' '.join(latency_engine[10:]) or '-'
    if args.mode == "interleaved":
        print(f"tail load: {args.rate} msgs/s x {args.size} B; {args.windows} windows of "
              f"{args.window:.0f} s, catch-up reader off/on alternating (first {args.settle} s "
              f"of each window left out); uploads every {upload_every:g} s; broker flags "
              f"{flags}")
    else:
        print(f"tail load: {args.rate} msgs/s x {args.size} B for {args.seconds:.0f} s per phase; "
              f"{args.rounds} rounds alternating; broker flags {flags}")
    try:
        from storage.engine import EngineConfig
        dflt = EngineConfig()
        print("engine cold-read defaults: " + ", ".join(
            f"{k}={getattr(dflt, k)}" for k in ("cold_read_bytes_per_s", "cold_read_min_bytes_per_s",
                                                "cold_read_lag_target_ms", "cold_read_max_bytes")
            if hasattr(dflt, k)))
    except ImportError:
        pass
    print("catch-up reader: one confluent-kafka consumer process from offset 0 (again and again), "
          "consume(1000) batches, counting value bytes; "
          + (f"nice {args.catchup_nice or args.clients_nice}"
             if args.catchup_nice or args.clients_nice else "normal OS priority")
          + (f"; producer and tail consumer at nice {args.clients_nice}"
             if args.clients_nice else ""))
    if args.mode == "interleaved":
        report_interleaved(inter, args)
        if args.dump:
            import json
            with open(args.dump, "w") as f:
                json.dump({"t0": inter["t0"], "window": args.window, "windows": args.windows,
                           "settle": args.settle, "producer": inter["producer"][1],
                           "tail": inter["tail"][1]}, f)
        phases = []
    else:
        report_phases(phases, args)
    if args.profile:
        from bench.profile import analyse
        for f in sorted(os.listdir(args.profile)):
            with open(os.path.join(args.profile, f)) as fh:
                print(f"--- py-spy {f} (every thread, idle too; non-blocking samples)")
                print(analyse(fh.read(), n=12))
    engine += ["--cold-read-bytes-per-s", "0"]       # raw catch-up speed, no throttle
    engine += [a for e in args.engine_arg for a in e.split("=", 1)
               if not e.startswith("--cold-read-bytes-per-s")]
    catchup_only(engine, args, "file://")
    if not args.skip_s3:
        moto, store = start_moto_s3("k", wait_s=10.0)
        try:
            catchup_only(engine + ["--object-store", store], args, "moto S3")
        finally:
            moto.terminate()
            moto.wait(10)


def report_phases(phases: list, args) -> None:
    print(f"{'phase':<14} {'acked/s':>8} {'prod p50':>9} {'prod p99':>9} {'e2e p50':>8} "
          f"{'e2e p99':>8}   (ms)   catch-up MB/s | CPU % of a core: broker loop/other, "
          "producer, tail, catch-up")
    pooled: dict[str, tuple[list[float], list[float]]] = {}
    p99s: list[tuple[float, float]] = []
    for name, res in phases:
        n, plat = res["producer"]
        _, tlat = res["tail"]
        pl, tl = pooled.setdefault(name, ([], []))
        pl.extend(plat)
        tl.extend(tlat)
        cu = f"{res['catchup'][1]:8.1f}" if "catchup" in res else f"{'-':>8}"
        c = res["cpu"]
        print(f"{name:<14} {n / args.seconds:8.0f} {pct(plat, .5) * 1e3:9.2f} "
              f"{pct(plat, .99) * 1e3:9.2f} {pct(tlat, .5) * 1e3:8.2f} {pct(tlat, .99) * 1e3:8.2f}"
              f"          {cu}      | {c['broker loop']:3.0f}/{c['broker other threads']:<3.0f} "
              f"{c['producer']:4.0f} {c['tail']:4.0f} {c.get('catchup', 0):4.0f}")
        if "catchup" in res:
            prev = phases[len(p99s) * 2][1]
            p99s.append((pct(plat, .99) / pct(prev["producer"][1], .99),
                         pct(tlat, .99) / pct(prev["tail"][1], .99)))
    print("ratio p99 with/without per round: " +
          ", ".join(f"produce {a:.2f}x / e2e {b_:.2f}x" for a, b_ in p99s))
    (pa, ta), (pl_, tl_) = pooled["alone"], pooled["with catch-up"]
    print(f"ratio p99 with/without, pooled over the rounds: produce "
          f"{pct(pl_, .99) / pct(pa, .99):.2f}x ({pct(pa, .99) * 1e3:.2f} -> "
          f"{pct(pl_, .99) * 1e3:.2f} ms), tail e2e {pct(tl_, .99) / pct(ta, .99):.2f}x "
          f"({pct(ta, .99) * 1e3:.2f} -> {pct(tl_, .99) * 1e3:.2f} ms) (goal <= 1.2x)")
    cus = [res["catchup"] for _, res in phases if "catchup" in res]
    print(f"catch-up reader during the tail load: "
          f"{', '.join(f'{v:.1f}' for _, v in cus)} MB/s ({sum(n for n, _ in cus)} records)")


if __name__ == "__main__":
    main()
