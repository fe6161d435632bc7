"""Shared bench helpers: a broker subprocess, the librdkafka mock peer, percentiles, tables.

Every benchmark starts its own broker(s) so runs are independent and reproducible.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.ports import free_port  # noqa: F401 - bench modules and tests import it from here
# one reader of /proc CPU figures, the broker's; thread_cpu: CPU seconds of each thread by id
from broker.thread_names import stat_cpu_split  # noqa: F401
from broker.thread_names import tasks_cpu as thread_cpu  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")      # /proc stat CPU figures are in these ticks


def threads_seconds(target: Any, args: list[Any]) -> float:
    """Seconds from starting one thread per item of ``args`` (``target(item)``) to the last
    one's end: the device probes' writers."""
    threads = [threading.Thread(target=target, args=(a,)) for a in args]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


#: A prefix that runs a command with the parent-death signal SIGKILL (util-linux; none where
#: setpriv is missing: the children then outlive a killed parent, as before).
DIE_WITH_PARENT = ("setpriv", "--pdeathsig", "KILL", "--") if shutil.which("setpriv") else ()
_FORKER: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_FORKER_LOCK = threading.Lock()


def _forker() -> concurrent.futures.ThreadPoolExecutor:
    """This process's one long-lived thread that forks children for the other threads (made
    again in a forked child, where the parent's thread does not exist)."""
    global _FORKER
    with _FORKER_LOCK:
        if _FORKER is None or _FORKER[0] != os.getpid():
            _FORKER = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="tied-popen"))
        return _FORKER[1]


def tied_popen(args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)`` whose child the kernel SIGKILLs when this process
    dies, even by SIGKILL (a timeout wrapper, pytest-timeout's os._exit, a cancelled CI run):
    brokers and moto servers left behind with parent pid 1 sat idle for hours and skewed the
    benchmarks (session 32). The parent-death signal fires when the *thread* that forked the
    child ends, so a call from any thread but the main one forks on one long-lived thread (a
    broker restarted by a short-lived thread must outlive it). ``.args`` is ``args``, without
    the setpriv prefix. It covers the child only: what the child forks or daemonizes (pg_ctl's
    server, tests/pgserver.py) needs a watchdog of its own."""
    argv = [*DIE_WITH_PARENT, *args]

    def spawn() -> subprocess.Popen:
        proc = subprocess.Popen(argv, **kwargs)
        proc.args = args
        return proc

    if threading.current_thread() is threading.main_thread():
        return spawn()
    return _forker().submit(spawn).result()


PR_SET_PDEATHSIG = 1     # prctl(2)


class TiedProcess(multiprocessing.Process):
    """A multiprocessing.Process that the kernel SIGKILLs when the thread that started it
    ends, as tied_popen's children: bench.catchup's reader without a time limit polled a dead
    broker forever once its bench was killed. Start it from the main thread."""

    def run(self) -> None:
        import ctypes  # noqa: PLC0415
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        parent = multiprocessing.parent_process()
        if parent is not None and os.getppid() != parent.pid:
            os._exit(1)                       # the parent died before the prctl call
        super().run()


def task_ids(pid: int | str) -> list[str]:
    """The thread ids of process ``pid`` ("self": this process); none once it is gone."""
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def stat_cpu_s(path: str, default: float | None = None) -> float | None:
    """User + system CPU seconds from a /proc ``stat`` file (a process's or a thread's);
    ``default`` when it cannot be read (the process or thread has exited)."""
    split = stat_cpu_split(path)
    return sum(split) if split is not None else default


def groups_ms_per_mib(before: dict[str, float], after: dict[str, float],
                      mib: float) -> dict[str, float]:
    """Each thread pool's CPU ms per MiB between two readings of CPU seconds by pool (a
    broker's pools: broker.thread_names.cpu_by_pool; the main thread is "event-loop"), largest
    first (a group that started in between counts from zero); empty for no bytes."""
    if not mib:
        return {}
    per = {g: (cpu - before.get(g, 0.0)) * 1e3 / mib for g, cpu in after.items()}
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def host_ticks() -> tuple[int, int]:
    """(steal, all) CPU ticks of this machine so far (/proc/stat): steal is the time its
    virtual CPUs wanted to run while the host ran something else; (0, 0) where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        ticks = [int(x) for x in fields[1:9]]       # user nice system idle iowait irq softirq steal
        return ticks[7], sum(ticks)
    except (OSError, ValueError, IndexError):
        return 0, 0


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of all CPU time the host took from this VM between two ``host_ticks``
    readings: a latency run's milliseconds-long stalls line up with it, whatever the broker
    does (bench/HISTORY.md, session 50). NaN when nothing was counted."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else float("nan")


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..1); NaN for no samples."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def wait_until(cond, timeout: float, what: str = ""):
    """Poll ``cond()`` every 50 ms until it returns something true (an exception counts as
    false: a broker view catching up) and return that; RuntimeError after ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            v = cond()
        except Exception:  # noqa: BLE001 - a broker view catching up
            v = None
        if v:
            return v
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what or cond}")


def start_moto_s3(prefix: str, wait_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """A moto S3 server on a free port with the bucket "bench": (its process, the broker's
    --object-store URL for ``prefix`` in it). The caller terminates the process."""
    import boto3  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415
    port = free_port()
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    moto = tied_popen([PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(int(wait_s * 10)):
            try:
                urllib.request.urlopen(url, timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                     aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket="bench")
    except BaseException:
        moto.terminate()
        moto.wait(10)
        raise
    return moto, (f"s3://bench/{prefix}?endpoint_url={url}&region=us-east-1"
                  "&access_key_id=testing&secret_access_key=testing")


_SET_ASIDE: list[str] = []


def set_aside(root: str) -> None:
    """Truncate every file under ``root`` to nothing now and delete the tree when this
    process ends. On ext4 without a journal (as on the machines these figures come from)
    every file create skips, one by one, the inodes deleted in the last 60-300 s: deleting
    the hundreds of object files of one bench step made the next step's object puts
    0.01-0.05 ms/MiB dearer (bench/HISTORY.md, session 31). Truncated files give their space
    back and keep their inodes until the run is over."""
    for path, _dirs, files in os.walk(root):
        for name in files:
            try:
                os.truncate(os.path.join(path, name), 0)
            except OSError:
                pass
    if not _SET_ASIDE:
        atexit.register(_delete_set_aside)
    _SET_ASIDE.append(root)


def _delete_set_aside() -> None:
    while _SET_ASIDE:
        shutil.rmtree(_SET_ASIDE.pop(), ignore_errors=True)


class BrokerProc:
    """An s3kafka broker subprocess on a free port with its own temporary data dir."""

    def __init__(self, extra: list[str] | None = None, data_dir: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="s3kbench-")
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        self.args = [PY, "-m", "broker", "serve", "--listen", self.bootstrap, "--data-dir",
                     os.path.join(self.data_dir, "data"), "--node-id", "0",
                     "--log-level", "WARNING", "--metrics-listen",
                     f"127.0.0.1:{self.metrics_port}", *(extra or [])]
        self.env = dict(os.environ, PYTHONPATH=REPO, **(env or {}))
        self.log_path = os.path.join(self.data_dir, "broker.log")
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> "BrokerProc":
        log = open(self.log_path, "ab")
        self.proc = tied_popen(self.args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               env=self.env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited: {self.log_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("broker did not start")

    def metric(self, name: str) -> float:
        """Sum of a Prometheus metric's samples on the broker's /metrics (NaN if unreadable)."""
        return self.metrics([name])[name]

    def metrics(self, names: list[str]) -> dict[str, float]:
        """``metric`` of several names from one scrape (some gauges reset on each scrape)."""
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {name: float("nan") for name in names}
        totals: dict[str, float] = {}
        for line in text.splitlines():
            for name in names:
                if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
                    totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return {name: totals.get(name, float("nan")) for name in names}

    def wait_uploaded(self, timeout: float = 60.0) -> float:
        """Wait until the uploads of what was appended are done; returns the wait. Done: the
        upload backlog is empty, or it is below the upload threshold (64 MiB by default: the
        rest waits for the upload interval, 60 s) and no object was written for a second."""
        t0 = time.monotonic()
        last, same = None, 0
        while time.monotonic() - t0 < timeout:
            backlog = self.metric("s3kafka_upload_backlog_bytes")
            uploaded = self.metric("s3kafka_uploaded_bytes_total")
            if backlog != backlog or uploaded != uploaded:   # NaN: no metrics, do not wait
                break
            same = same + 1 if uploaded == last else 0
            if backlog <= 0 or (backlog < (64 << 20) and same >= 4):
                break
            last = uploaded
            time.sleep(0.25)
        return time.monotonic() - t0

    def log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        """Stop and empty the data dir (if we made it); it is deleted when this process ends
        (``set_aside``)."""
        self.stop()
        if self._own_dir:
            set_aside(self.data_dir)

    def __enter__(self) -> "BrokerProc":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


class MockCluster:
    """librdkafka's in-memory mock cluster (the side-by-side peer).

    The cluster lives inside a client handle created with ``test.mock.num.brokers``; its
    bootstrap address is read back from that handle's Metadata, so other clients (and other
    processes) can connect to it while the handle is alive.
    """

    def __init__(self) -> None:
        from confluent_kafka import Producer
        self._handle = Producer({"test.mock.num.brokers": 1, "log_level": 2})
        md = self._handle.list_topics(timeout=10)
        b = next(iter(md.brokers.values()))
        self.bootstrap = f"{b.host}:{b.port}"

    def close(self) -> None:
        self._handle.flush(1)
        self._handle = None

    def __enter__(self) -> "MockCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def mock_cpu_s() -> float:
    """CPU seconds (user + system) of librdkafka's mock cluster threads in this process
    (named ``rdk:mock``): what the mock broker itself spends, next to s3kafka's process CPU."""
    total = 0.0
    for tid in task_ids("self"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "rdk:mock":
                    continue
        except OSError:
            continue
        total += stat_cpu_s(f"/proc/self/task/{tid}/stat", 0.0)
    return total


def create_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    """Create a topic via the admin API (works against both the broker and the mock)."""
    from confluent_kafka.admin import AdminClient, NewTopic
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 2})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(30)


@dataclass
class Result:
    """One benchmark's output: table rows plus optional time series / percentiles for plots."""
    name: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # label -> (t, MB/s)
    percentiles: dict[str, dict[str, float]] = field(default_factory=dict)       # label -> {p50..}
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)                          # raw figures

    def table(self) -> str:
        """Markdown table (also readable on a terminal)."""
        def fmt(v: Any) -> str:
            if isinstance(v, float):
                return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
            return str(v)
        out = ["| " + " | ".join(self.columns) + " |",
               "|" + "---|" * len(self.columns)]
        out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in self.rows]
        return "\n".join(out)

    def print(self) -> None:
        print(f"\n## {self.name}\n{self.table()}")
        for n in self.notes:
            print(f"- {n}")
        sys.stdout.flush()
