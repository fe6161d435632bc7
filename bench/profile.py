"""Profile a broker under load with py-spy and print where its time goes.

    python -m bench.profile [--seconds 10] [--load raw|clients|fetch] [--out bench/profiles]
                             [--batch-bytes N] [--idle]

Starts a broker, drives it with the raw 1 MiB-batch produce load, a 100 B confluent-kafka
producer, or raw fetches, while ``py-spy record --native`` samples the broker process. Writes
the collapsed stacks (feed them to any flame-graph tool, e.g. speedscope) and prints the top functions by own time and by
total time - the list the performance work is driven by.
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import threading
import time

from . import clients, rawload
from .common import BrokerProc, create_topic

HERE = os.path.dirname(os.path.abspath(__file__))


def top(collapsed: str, n: int = 15) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(own-time, total-time) top-n frames from py-spy's collapsed output, as % of samples."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    all_samples = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        all_samples += c
        frames = stack.split(";")
        own[frames[-1]] += c
        for f in set(frames):
            total[f] += c
    pct = (lambda items: [(f, 100.0 * c / max(all_samples, 1)) for f, c in items])
    return pct(own.most_common(n)), pct(total.most_common(n))


def drive(load: str, bootstrap: str, seconds: float, batch_bytes: int = 1 << 20) -> None:
    """Run the chosen load against the broker for `seconds`."""
    if load == "raw":
        rawload.bench_target(bootstrap, seconds, 4, 8, rawload.make_batch(batch_bytes), True, False)
    elif load == "fetch":
        topic = f"pf-{time.time_ns()}"
        create_topic(bootstrap, topic)
        r = clients.produce_throughput(bootstrap, topic, 100, 3)
        for _ in range(max(1, int(seconds // 3))):
            clients.consume_throughput(bootstrap, topic, r["msgs"], timeout=seconds)
    else:
        topic = f"pc-{time.time_ns()}"
        create_topic(bootstrap, topic)
        clients.produce_throughput(bootstrap, topic, 100, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--load", default="raw", choices=["raw", "clients", "fetch"])
    ap.add_argument("--out", default=os.path.join(HERE, "profiles"))
    ap.add_argument("--rate", type=int, default=250)
    ap.add_argument("--batch-bytes", type=int, default=1 << 20,
                    help="raw load: bytes per Produce request (1024: per-request cost)")
    ap.add_argument("--idle", action="store_true", help="also sample idle threads (py-spy --idle)")
    ap.add_argument("--storage", default="engine", choices=["engine", "memory"],
                    help="memory: profile the request path without WAL and object store")
    a = ap.parse_args()
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    os.makedirs(a.out, exist_ok=True)
    with BrokerProc(["--wal-capacity", str(4 << 30), "--storage", a.storage]) as b:
        raw_out = os.path.join(a.out, f"{a.load}.collapsed")
        t = threading.Thread(target=drive, args=(a.load, b.bootstrap, a.seconds + 2,
                                                 a.batch_bytes))
        t.start()
        time.sleep(1)
        subprocess.run([spy, "record", "--native", "--pid", str(b.pid), "-r", str(a.rate), "-d",
                        str(int(a.seconds)), "--format", "raw", "-o", raw_out,
                        *(["--idle"] if a.idle else [])],
                       check=False)
        t.join()
    with open(raw_out) as f:
        collapsed = f.read()
    own, tot = top(collapsed)
    print(f"profile of the broker under '{a.load}' load -> {raw_out}")
    print("\ntop by own time (% of samples):")
    for f, p in own:
        print(f"{p:6.1f}%  {f}")
    print("\ntop by total time:")
    for f, p in tot:
        print(f"{p:6.1f}%  {f}")


if __name__ == "__main__":
    main()
