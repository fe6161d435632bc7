"""The harness's children die with the process that started them, even when it is SIGKILLed.

A pytest run killed by a timeout wrapper or a cancelled CI job used to leave its brokers and
moto servers running with parent pid 1 (start_new_session detaches them from the terminal's
process group): 22 idle brokers skewed the benchmarks of session 32 for hours.
bench.common.tied_popen starts them with the parent-death signal; this test kills a real
process that started fixture brokers and checks that they go too.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from bench.common import task_ids
from datapath.wire import api_versions_roundtrip

REPO = pathlib.Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 30.0

# Starts what the fixtures start (a broker from the main thread, one from a thread that ends
# at once, a moto server) and what the bench starts (bench.common.BrokerProc, a TiedProcess),
# prints them as "<word in its command line> <pid> <port>" lines, then the id of the ended
# thread, and waits to be killed.
CHILD = r"""
import pathlib, sys, threading, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import conftest
from bench.common import BrokerProc, TiedProcess

base = pathlib.Path(sys.argv[2])
pool = conftest._BrokerPool(base, [])
main = pool()
starter = threading.Thread(target=pool)
starter.start()
starter.join()
moto = conftest.MotoServer(base / "moto.log")
moto.start()
(base / "bench").mkdir()
bench = BrokerProc(["--wal-capacity", "64MiB"], data_dir=str(base / "bench")).start()
for b in (main, pool.procs[1]):
    print("broker", b.pid, b.port)
print("moto.server", moto.proc.pid, moto.port)
print("broker", bench.pid, bench.port)
reader = TiedProcess(target=time.sleep, args=(3600,))
reader.start()
print("python", reader.pid, 0)
print("thread", starter.native_id, flush=True)
threading.Event().wait()
"""


def running(pid: int, word: str) -> bool:
    """Process ``pid`` runs ``word`` (a zombie's cmdline is empty, a reused pid's differs)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return word.encode() in f.read()
    except OSError:
        return False


def poll(cond: Callable[[], bool], timeout: float) -> bool:
    """``cond()`` became true within ``timeout`` seconds (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_fixture_and_bench_children_die_with_a_sigkilled_parent(tmp_path) -> None:
    """SIGKILL of a process that started fixture brokers (one from a thread that has ended),
    a moto server, a bench broker and a forked bench process: every one is gone soon after.
    Until then the broker whose starting thread ended still serves, in its own session."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(REPO), str(tmp_path)],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    kids: list[tuple[str, int, int]] = []
    try:
        assert child.stdout is not None
        parts = child.stdout.readline().split()
        while parts and parts[0] != "thread":
            kids.append((parts[0], int(parts[1]), int(parts[2])))
            parts = child.stdout.readline().split()
        assert parts, f"the child exited with {child.wait()} before its report"
        assert poll(lambda: parts[1] not in task_ids(child.pid), GONE_WITHIN_S)
        assert all(running(pid, word) for word, pid, _port in kids), kids
        assert api_versions_roundtrip("127.0.0.1", kids[1][2], timeout=5.0)   # thread's
        assert os.getsid(kids[0][1]) == kids[0][1]      # start_new_session still applies

        child.send_signal(signal.SIGKILL)
        child.wait(30)
        assert poll(lambda: not any(running(pid, word) for word, pid, _ in kids),
                    GONE_WITHIN_S), [k for k in kids if running(k[1], k[0])]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        for word, pid, _port in kids:            # no orphans even when the test fails
            if running(pid, word):
                os.kill(pid, signal.SIGKILL)
