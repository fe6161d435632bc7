"""Kernel names for the broker's threads (broker/thread_names.py): what ``top -H``, ``ps -L``,
perf and bench.rawload's per-thread CPU split see instead of ``python`` for every thread."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from confluent_kafka import Producer

from broker.thread_names import NAME_BYTES, os_name
from conftest import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux names")


@pytest.mark.parametrize(("name", "expected"), [
    ("s3kafka-io_3", b"s3k-io_3"),
    ("s3kafka-cold_12", b"s3k-cold_12"),
    ("wal-io-0", b"wal-io-0"),
    ("cluster-lease_0", b"cluster-lease_0"),                 # exactly 15 bytes: kept
    ("s3kafka-producer-snapshots_0", b"s3k-producer_0"),     # cut, the pool index kept
    ("a-very-long-thread-name-without-index", b"a-very-long-thr"),
])
def test_kernel_name_is_short_and_keeps_the_pool_index(name: str, expected: bytes) -> None:
    assert os_name(name) == expected
    assert len(os_name(name)) <= NAME_BYTES


def test_a_multibyte_name_is_never_cut_inside_a_character() -> None:
    raw = os_name("é" * 20)
    assert len(raw) <= NAME_BYTES
    assert raw.decode("utf-8") == "é" * 7


def test_threads_started_after_install_carry_their_names() -> None:
    """In a fresh interpreter (install patches threading for the whole process): a plain
    Thread and a ThreadPoolExecutor's threads show their names in /proc; install is
    idempotent."""
    code = """
import concurrent.futures, threading
from broker import thread_names
assert thread_names.install() and thread_names.install()
def comm():
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        return f.read().strip()
seen = []
t = threading.Thread(target=lambda: seen.append(comm()), name="s3kafka-frames")
t.start(); t.join()
with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="s3kafka-io") as ex:
    seen.append(ex.submit(comm).result())
print(" ".join(seen))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["s3k-frames", "s3k-io_0"]


def test_a_running_broker_names_its_pools(broker) -> None:
    """A broker serving a produce: its object-store and metadata pool (s3k-io_N) and the
    frame filler are named; the main thread (the event loop) keeps the process's name."""
    p = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all"})
    p.produce("names", b"x" * 1000)
    assert p.flush(30) == 0
    pid = broker.pid
    deadline = time.monotonic() + 10
    names: dict[int, str] = {}
    while time.monotonic() < deadline:
        names = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    names[int(tid)] = f.read().strip()
            except OSError:
                continue
        if any(n.startswith("s3k-io_") for n in names.values()):
            break
        time.sleep(0.1)
    assert any(n.startswith("s3k-io_") for n in names.values()), names
    assert not names[pid].startswith("s3k-")
    others = [n for t, n in names.items() if t != pid]
    # every Python thread is named (libuv's and io_uring's own workers name themselves)
    assert "python" not in others and "python3" not in others, names


def test_pool_of_strips_the_index() -> None:
    from broker.thread_names import pool_of
    assert pool_of("s3k-io_3") == "s3k-io"
    assert pool_of("iou-wrk-4343") == "iou-wrk"
    assert pool_of("s3k-frames") == "s3k-frames"
    assert pool_of("_7") == "_7"


def test_pool_cpu_counts_a_thread_that_exited_and_never_goes_back() -> None:
    """PoolCPU: a named thread's CPU shows under its pool while it runs and stays counted
    after it exited (a plain sum would fall back: a counter reset for Prometheus)."""
    import threading

    from broker.thread_names import MAIN_POOL, PoolCPU, name_current_thread

    pool = PoolCPU()
    ready, done = threading.Event(), threading.Event()

    def burn() -> None:
        name_current_thread("s3kafka-pooltest_0")
        end = time.thread_time() + 0.25
        while time.thread_time() < end:
            pass
        ready.set()
        done.wait()

    t = threading.Thread(target=burn)
    t.start()
    ready.wait()
    during = pool.read()
    done.set()
    t.join()
    after = pool.read()
    assert during.get("s3k-pooltest", 0.0) >= 0.2
    assert after.get("s3k-pooltest", 0.0) >= during["s3k-pooltest"]
    assert after[MAIN_POOL] >= during[MAIN_POOL] > 0
