"""Profile the whole broker under a named workload with py-spy: every thread, and the time
each one waits for the interpreter lock.

    python -m bench.profile [--load raw|raw-small|clients|latency|hotfetch|coldfetch|fetch]
                            [--seconds 10] [--rate 250] [--out bench/profiles] [--perf]
                            [--batch-bytes N] [--msg-rate N] [--msg-size N]
                            [--storage engine|memory]
                            [--broker-arg=ARG ...]

Workloads: ``raw`` 1 MiB acks=all Produce requests (bench.rawload, 4 connections x 8 in
flight); ``raw-small`` the same with 1 KiB requests (per-request cost); ``clients`` one
confluent-kafka producer of ``--msg-size`` messages (100 B; bench.clients' throughput row:
linger 5 ms, ~1 MiB requests); ``latency`` the same at a fixed ``--msg-rate``
with linger 0 (bench.clients' latency run: many small Produce requests); ``hotfetch`` raw
Fetch over the last 256 MiB written (LogCache), after the uploads settled; ``coldfetch`` raw Fetch from the log start
after a restart (object store, BlockCache); ``fetch`` confluent-kafka consumers.

``py-spy record --native --threads --idle`` samples every thread of the broker process, idle or
not. Each sample is classed as *active* (running Python or native code, or in a system call
such as a socket write), *GIL wait* (blocked re-acquiring the interpreter lock: a condition
wait right under a C function that released it, e.g. ``os_pread`` or ``crc32c``) or *idle*
(waiting for work: epoll, a lock or a queue). Printed: per thread group (the loop, uvloop's
and the engine's pools: IO, cold reads, WAL, ...) the share of samples in each class and the
CPU seconds it used (from /proc, over the profile), then the top functions by own and by
total time over the active samples of all threads, and per busy thread group. The collapsed
stacks go to ``<out>/<load>.collapsed`` (open them in speedscope or any flame-graph tool).
``--perf``: ``perf record -g`` of the broker instead (kernel and native time; no ptrace stops,
which slow the broker to a fraction of its rate under py-spy), the top symbols overall and by
thread group (the threads named by one ``py-spy dump`` after the record: perf knows only ids).
(py-spy needs ptrace rights: run as root or with ``kernel.yama.ptrace_scope=0``.)
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

from . import clients, rawload
from .common import BrokerProc, create_topic, thread_cpu

HERE = os.path.dirname(os.path.abspath(__file__))
LOADS = ("raw", "raw-small", "clients", "latency", "hotfetch", "coldfetch", "fetch")
# blocking primitives: where a thread that is not running sits
_WAITS = ("pthread_cond_wait", "pthread_cond_timedwait", "pthread_cond_clockwait", "sem_wait",
          "sem_timedwait", "sem_clockwait")
_IDLE_LEAVES = ("epoll_wait", "epoll_pwait", "io_getevents", "select", "poll", "ppoll",
                "nanosleep", "clock_nanosleep", "accept", "accept4")
# C functions that wait for work or a Python lock (idle, not the GIL)
_IDLE_PARENTS = ("PyThread_acquire_lock_timed", "_queue_SimpleQueue_get_impl",
                 "lock_PyThread_acquire_lock", "acquire_timed")
_THREAD = re.compile(r"^thread \((?:0x)?([0-9a-fA-F]+)\)(?::\s*(.*))?$")


def _name(frame: str) -> str:
    return frame.split(" (", 1)[0]


def classify(frames: list[str]) -> str:
    """'active', 'gil' or 'idle' for one sample's stack (root first, leaf last)."""
    names = [_name(f) for f in frames]
    for k in range(len(names) - 1, -1, -1):
        n = names[k]
        if n in _IDLE_LEAVES:
            return "idle"
        if n in _WAITS:
            parent = names[k - 1] if k else ""
            return "idle" if parent in _IDLE_PARENTS or parent.startswith("PyThread_acquire") \
                else "gil"
        if n in _IDLE_PARENTS:
            return "idle"
        if not n.startswith("0x"):
            break             # a resolved function that is not a wait: running
    return "active"


def group_of(thread_name: str) -> str:
    """Thread group: the pool's name without the worker number (s3kafka-cold_1 -> s3kafka-cold)."""
    return re.sub(r"[_-]\d+$", "", thread_name or "?")


def analyse(collapsed: str, cpu: dict[int, float] | None = None, n: int = 15) -> str:
    """The report: per thread group class shares and CPU, then top functions."""
    groups: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    tids: dict[str, set[int]] = collections.defaultdict(set)
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    g_own: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    g_total: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    active_all = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        frames = stack.split(";")
        m = _THREAD.match(frames[0])
        group = "?"
        if m:
            group = group_of(m.group(2) or "")
            try:
                tids[group].add(int(m.group(1), 16 if frames[0].startswith("thread (0x") else 10))
            except ValueError:
                pass
            frames = frames[1:]
        kind = classify(frames)
        groups[group][kind] += c
        if kind != "active" or not frames:
            continue
        active_all += c
        own[frames[-1]] += c
        g_own[group][frames[-1]] += c
        for f in set(frames):
            total[f] += c
            g_total[group][f] += c
    out = [f"{'thread group':<24} {'threads':>7} {'active %':>9} {'GIL wait %':>10} "
           f"{'idle %':>7} {'CPU s':>7}"]
    order = sorted(groups, key=lambda g: -groups[g]["active"])
    for g in order:
        k = groups[g]
        s = sum(k.values()) or 1
        cpu_s = sum((cpu or {}).get(t, 0.0) for t in tids[g]) if cpu else float("nan")
        out.append(f"{g:<24} {len(tids[g]) or '?':>7} {100 * k['active'] / s:9.1f} "
                   f"{100 * k['gil'] / s:10.1f} {100 * k['idle'] / s:7.1f} {cpu_s:7.2f}")
    out.append("(shares are of each group's samples; py-spy counts a runnable thread waiting for "
               "a CPU as active: on a busy machine trust CPU s)")
    pct = (lambda c: 100.0 * c / max(active_all, 1))
    out.append(f"\ntop by own time, % of active samples of all threads ({active_all}):")
    out += [f"{pct(c):6.1f}%  {f}" for f, c in own.most_common(n)]
    out.append("\ntop by total time:")
    out += [f"{pct(c):6.1f}%  {f}" for f, c in total.most_common(n + 40)
            if not f.startswith(("_run_module_as_main", "_run_code", "<module>", "main (",
                                 "run (", "Runner.run", "run_until_complete", "run_forever",
                                 "Loop__", "Py_XDECREF", "Py_DECREF", "0x", "_bootstrap",
                                 "Thread.run", "Thread._bootstrap", "clone", "start_thread",
                                 "pythread_wrapper", "thread_run", "_worker", "uv",
                                 "Handle__run", "loop_cb_", "task_step", "TaskStep",
                                 "__Pyx_", "timed ("))][:n]
    for g in order[:4]:
        act = groups[g]["active"]
        if not act:
            continue
        out.append(f"\n{g}: top by own time, % of its active samples ({act}):")
        out += [f"{100 * c / act:6.1f}%  {f}" for f, c in g_own[g].most_common(8)]
    return "\n".join(out)


def drive(load: str, broker: BrokerProc, seconds: float, ready: threading.Event,
          batch_bytes: int = 1 << 20, msg_rate: float = 12_700, msg_size: int = 100) -> None:
    """Prepare the workload (fill the log for fetches), set ``ready``, then run it for
    ``seconds``."""
    bootstrap = broker.bootstrap
    host, port = bootstrap.rsplit(":", 1)
    try:
        if load in ("raw", "raw-small"):
            size = 1024 if load == "raw-small" else batch_bytes
            ready.set()
            rawload.bench_target(bootstrap, seconds, 4, 8, rawload.make_batch(size), True, False)
        elif load in ("hotfetch", "coldfetch"):
            topic = f"pf-{time.time_ns()}"
            create_topic(bootstrap, topic, 4)
            batch = rawload.make_batch(1 << 20)
            rawload._run(rawload._produce, host, int(port), topic, 4, 4, 8, batch)
            broker.wait_uploaded()
            marks = rawload.watermarks(bootstrap, topic, 4)
            if load == "coldfetch":
                broker.stop()
                broker.start()
                bootstrap = broker.bootstrap
                starts = [low for low, _ in marks]
            else:
                per = rawload.HOT_FETCH_BYTES // 4 // len(batch) * rawload.batch_records(batch)
                starts = [max(low, high - per) for low, high in marks]
            ready.set()
            rawload._run(rawload._fetch, host, int(port), topic, 4, seconds, starts, 8 << 20, True)
        elif load == "fetch":
            topic = f"pf-{time.time_ns()}"
            create_topic(bootstrap, topic)
            r = clients.produce_throughput(bootstrap, topic, 100, 3)
            ready.set()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                clients.consume_throughput(bootstrap, topic, r["msgs"], timeout=end - time.monotonic())
        elif load == "latency":
            topic = f"pl-{time.time_ns()}"
            create_topic(bootstrap, topic)
            ready.set()
            r = clients.produce_latency(bootstrap, topic, 100, msg_rate, seconds)
            print(f"latency load: {msg_rate:.0f} msgs/s, p50 {r['p50']:.2f} p99 {r['p99']:.2f} "
                  f"p999 {r['p999']:.2f} ms, {r['n']} acked after warm-up")
        else:
            topic = f"pc-{time.time_ns()}"
            create_topic(bootstrap, topic)
            ready.set()
            clients.produce_throughput(bootstrap, topic, msg_size, seconds)
    finally:
        ready.set()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--load", default="raw", choices=LOADS)
    ap.add_argument("--out", default=os.path.join(HERE, "profiles"))
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--batch-bytes", type=int, default=1 << 20,
                    help="raw load: bytes per Produce request")
    ap.add_argument("--msg-rate", type=float, default=12_700,
                    help="latency load: 100 B messages/s (linger 0, acks=all, as bench.clients)")
    ap.add_argument("--msg-size", type=int, default=100,
                    help="clients load: bytes per message (bench.clients' rows: 100, 1024, 16384)")
    ap.add_argument("--storage", default="engine", choices=["engine", "memory"],
                    help="memory: profile the request path without WAL and object store")
    ap.add_argument("--broker-arg", action="append", default=[],
                    help="extra broker argument, repeatable")
    ap.add_argument("--analyse", metavar="FILE", help="only print the report of a collapsed file")
    ap.add_argument("--perf", action="store_true",
                    help="`perf record -g` the broker instead of py-spy and print where its CPU "
                         "goes including the kernel (page faults, copies into the page cache, "
                         "socket copies: invisible to py-spy)")
    a = ap.parse_args(argv)
    if a.analyse:
        with open(a.analyse) as f:
            print(analyse(f.read()))
        return
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    os.makedirs(a.out, exist_ok=True)
    raw_out = os.path.join(a.out, f"{a.load}.collapsed")
    with BrokerProc(["--wal-capacity", str(4 << 30), "--storage", a.storage,
                     *a.broker_arg]) as b:
        ready = threading.Event()
        t = threading.Thread(target=drive, args=(a.load, b, a.seconds + 2, ready,
                                                 a.batch_bytes, a.msg_rate, a.msg_size))
        t.start()
        ready.wait()
        time.sleep(1)
        cpu0 = thread_cpu(b.pid)
        perf_out = os.path.join(a.out, f"{a.load}.perf.data")
        names: dict[int, str] = {}
        if a.perf:      # instead of py-spy: its ptrace stops would show in perf's samples
            subprocess.run(["perf", "record", "-q", "-g", "-o", perf_out, "-p", str(b.pid),
                            "--", "sleep", str(int(a.seconds))], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            names = thread_names(spy, b.pid)    # after the record: one short stop
        else:
            subprocess.run([spy, "record", "--native", "--threads", "--idle",
                            "--pid", str(b.pid), "-r", str(a.rate), "-d", str(int(a.seconds)),
                            "--format", "raw", "-o", raw_out], check=False,
                           stdout=subprocess.DEVNULL)
        cpu1 = thread_cpu(b.pid)
        t.join()
    cpu = {tid: cpu1[tid] - cpu0.get(tid, 0.0) for tid in cpu1}
    if a.perf:
        print(f"perf profile of the whole broker under '{a.load}' load, {a.seconds:.0f} s")
        print(f"broker CPU over the profile: {sum(cpu.values()):.2f} s (all threads)")
        print(perf_report(perf_out, names=names))
        return
    with open(raw_out) as f:
        collapsed = f.read()
    print(f"profile of the whole broker under '{a.load}' load, {a.seconds:.0f} s -> {raw_out}")
    print(f"broker CPU over the profile: {sum(cpu.values()):.2f} s (all threads)\n")
    print(analyse(collapsed, cpu))


def thread_names(spy: str, pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name of ``pid`` (one ``py-spy dump``; {} when it
    cannot): perf knows threads only by id, every one of them called "python"."""
    try:
        r = subprocess.run([spy, "dump", "--json", "--pid", str(pid)], capture_output=True,
                           text=True, timeout=30)
        return {int(t["os_thread_id"]): t.get("thread_name") or "?"
                for t in json.loads(r.stdout) if t.get("os_thread_id") is not None}
    except (OSError, ValueError, KeyError, TypeError, subprocess.SubprocessError):
        return {}


_PID_SYM = re.compile(r"^\s*([0-9.]+)%\s+(\d+):\S*\s+(?:\[[.k]\]\s+)?(.*?)\s*$")


def by_thread_group(report: str, names: dict[int, str], n: int = 8) -> str:
    """`perf report --sort pid,sym` text regrouped by thread group (group_of the thread's
    Python name; a thread py-spy did not name is ``tid N``): each group's share of all
    samples, then its top ``n`` symbols as % of all samples. A start-up job that is still
    running (the frames thread's pre-touch) then shows as its own group instead of mixing
    its page clearing into the top symbols."""
    share: collections.Counter[str] = collections.Counter()
    syms: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in report.splitlines():
        m = _PID_SYM.match(line)
        if not m or line.lstrip().startswith("#"):
            continue
        pct, tid, sym = float(m.group(1)), int(m.group(2)), m.group(3)
        g = group_of(names[tid]) if tid in names else f"tid {tid}"
        share[g] += pct
        syms[g][sym] += pct
    out = ["by thread group, % of all broker samples:"]
    out += [f"{pct:6.1f}%  {g}" for g, pct in share.most_common()]
    for g, _pct in share.most_common(4):
        out.append(f"\n{g}: top symbols, % of all broker samples")
        out += [f"{pct:6.2f}%  {sym}" for sym, pct in syms[g].most_common(n)]
    return "\n".join(out)


def perf_report(path: str, n: int = 25, names: dict[int, str] | None = None) -> str:
    """The top symbols of a `perf record -g` file by own time, by thread group (``names``:
    thread_names) and, for the kernel, by total time (what each syscall or fault costs with
    everything under it)."""
    if not os.path.exists(path):
        return "\n(no perf data: perf missing or not permitted)"
    out = ["", f"perf ({path}): top symbols by own time, % of all broker samples"]
    own = subprocess.run(["perf", "report", "-i", path, "--no-children", "--sort", "dso,sym",
                          "--stdio", "-g", "none"], capture_output=True, text=True).stdout
    out += [ln for ln in own.splitlines() if "%" in ln and not ln.startswith("#")][:n]
    if names is not None:
        per = subprocess.run(["perf", "report", "-i", path, "--no-children", "--sort",
                              "pid,sym", "--stdio", "-g", "none"], capture_output=True,
                             text=True).stdout
        out += ["", by_thread_group(per, names)]
    out.append("\nkernel symbols by total time (children included)")
    tot = subprocess.run(["perf", "report", "-i", path, "--children", "--sort", "sym",
                          "--stdio", "-g", "none"], capture_output=True, text=True).stdout
    out += [ln for ln in tot.splitlines() if "[k]" in ln and "%" in ln][:n]
    return "\n".join(out)


if __name__ == "__main__":
    main()
