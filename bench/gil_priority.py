"""Event-loop lag while a background thread runs Python (holding the GIL), by the thread's
CPU priority: the priority inversion behind the log cleaner's loop stalls (docs/storage.md).

    .venv/bin/python -m bench.gil_priority [--seconds 6] [--reps 3]

The background thread decodes 100-record batches in a loop, as the cleaner does; the loop
sleeps 1 ms at a time and records how late it wakes up. Variants, alternated: nice 19 +
SCHED_BATCH (what the cleaner had), nice 0 + SCHED_BATCH (what it has), nice 0. The switch
interval is the WAL's (0.5 ms). The effect shows under load (other processes on the cores):
a preempted nice-19 GIL holder gets its next slice late, and the loop waits for it.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time

from protocol import build_batch, decode_records, iter_batches
from protocol.records import Record
from storage.thread_priority import lower_current_thread

PAYLOAD = build_batch([Record(i, 0, b"key-%08d" % i, b"x" * 1024) for i in range(100)])
VARIANTS = ("nice19+batch", "nice0+batch", "nice0")


def work(stop: threading.Event, variant: str) -> None:
    if variant == "nice19+batch":
        lower_current_thread(19, "idle")
    elif variant == "nice0+batch":
        lower_current_thread(0, "idle")
    while not stop.is_set():
        for v in iter_batches(PAYLOAD):
            for r in decode_records(v):
                hash(r.key)


async def run(variant: str, seconds: float) -> list[float]:
    stop = threading.Event()
    t = threading.Thread(target=work, args=(stop, variant))
    t.start()
    lags: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append((time.perf_counter() - t0 - 0.001) * 1000)
    stop.set()
    t.join()
    return sorted(lags)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    sys.setswitchinterval(0.0005)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for _ in range(args.reps):
        for variant in VARIANTS:
            lags = asyncio.run(run(variant, args.seconds))
            print(f"{variant:13} loop lag p99 {lags[int(0.99 * len(lags))]:6.2f} ms, "
                  f"max {lags[-1]:6.1f} ms, wake-ups > 50 ms: {sum(x > 50 for x in lags)}",
                  flush=True)


if __name__ == "__main__":
    main()
