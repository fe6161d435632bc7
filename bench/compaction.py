"""Log compaction of a large keyed log in bounded memory (broker/compaction.py).

    .venv/bin/python -m bench.compaction [--gib 1] [--keys 100000] [--value-bytes 1024]
                                         [--dedupe-mib 16] [--io-mib-s 0]

Writes a keyed log (``--keys`` keys updated round-robin in random order, ``--value-bytes``
values, 100 records a batch) through a Partition on a real engine (WAL file + file:// object
store in a temporary directory), uploads it, then runs the log cleaner until nothing is left
to clean, and prints: bytes and objects before and after, passes, time, the offset map size,
the process's peak RSS during the cleaning compared with its RSS before (the peak is reset
through /proc/self/clear_refs first, so the write phase does not count), and the latency of a
small producer appending to another partition every 5 ms, before and during the cleaning. Too slow for the test
suite (tests/compaction holds the small versions); not part of ``make bench``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time
import types
import uuid

from broker.compaction import LogCleaner
from broker.partition import Partition
from protocol import build_batch
from protocol.records import Record
from storage.engine import EngineConfig, open_engine

BATCH = 100


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


async def loop_lag(stop: asyncio.Event, out: list[float]) -> None:
    """How late a 1 ms sleep wakes up: event-loop stalls, apart from disk waits."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        out.append(time.perf_counter() - t - 0.001)


async def probe(p: Partition, stop: asyncio.Event, out: list[float]) -> None:
    """A small producer on another partition: one 1 KiB batch every 5 ms, latency of each."""
    value = b"x" * 1024
    while not stop.is_set():
        t = time.perf_counter()
        res = await p.append(build_batch([(b"probe", value)]))
        assert res.error == 0
        out.append(time.perf_counter() - t)
        await asyncio.sleep(0.005)


def summary(xs: list[float]) -> str:
    return (f"{len(xs)} appends p50 {pct(xs, 0.5):.2f} ms, p99 {pct(xs, 0.99):.2f} ms, "
            f"max {max(xs) * 1000 if xs else float('nan'):.1f} ms")


def rss_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                       # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def objects(root: str) -> tuple[int, int]:
    n = size = 0
    for d, _, files in os.walk(os.path.join(root, "objects")):
        for f in files:
            n += 1
            size += os.path.getsize(os.path.join(d, f))
    return n, size


async def run(args: argparse.Namespace) -> None:
    root = tempfile.mkdtemp(prefix="s3kafka-bench-compaction-")
    try:
        cfg = EngineConfig(data_dir=root, wal_capacity=512 << 20, log_cache_bytes=128 << 20,
                           block_cache_bytes=32 << 20, upload_threshold_bytes=32 << 20,
                           stream_object_threshold_bytes=1 << 20, cold_read_bytes_per_s=0,
                           compaction_interval_s=1e9, cleanup_interval_s=1.0,
                           wal_sync_mode="none" if args.no_sync else "fdatasync")
        eng = open_engine(cfg)
        await eng.start()
        broker = types.SimpleNamespace(config=types.SimpleNamespace(
            data_dir=root, log_cleaner_dedupe_buffer_size=args.dedupe_mib << 20,
            log_cleaner_io_max_bytes_per_second=args.io_mib_s << 20), topics={})
        stream = await eng.create_stream()
        p = await Partition.open(broker, "bench", uuid.uuid4(), 0, stream,
                                 {"cleanup.policy": "compact", "delete.retention.ms": "0"})
        target = int(args.gib * (1 << 30))
        rng = random.Random(1)
        value = os.urandom(args.value_bytes)
        order = list(range(args.keys))
        written = records = 0
        t0 = time.monotonic()
        now = int(time.time() * 1000) - 3_600_000
        while written < target:
            rng.shuffle(order)
            for i in range(0, len(order), BATCH):
                recs = [Record(j, now, b"key-%08d" % k, value) for j, k in
                        enumerate(order[i:i + BATCH])]
                b = build_batch(recs)
                res = await p.append(b)
                assert res.error == 0, res.error
                written += len(b)
                records += len(recs)
                if written >= target:
                    break
        await eng.flush()
        t_write = time.monotonic() - t0
        n0, bytes0 = objects(root)
        print(f"wrote {records} records, {written / 2**20:.0f} MiB of batches in "
              f"{t_write:.1f} s; {n0} objects, {bytes0 / 2**20:.0f} MiB")
        eng.drop_caches()
        p2 = await Partition.open(broker, "probe", uuid.uuid4(), 0, await eng.create_stream(),
                                  {})
        base: list[float] = []
        lag0: list[float] = []
        stop = asyncio.Event()
        tasks = [asyncio.create_task(probe(p2, stop, base)),
                 asyncio.create_task(loop_lag(stop, lag0))]
        await asyncio.sleep(3)
        stop.set()
        await asyncio.gather(*tasks)
        during: list[float] = []
        lag1: list[float] = []
        stop = asyncio.Event()
        tasks = [asyncio.create_task(probe(p2, stop, during)),
                 asyncio.create_task(loop_lag(stop, lag1))]
        cleaner = LogCleaner(broker)
        rss0 = rss_kib()
        peak_ok = reset_peak()
        t1 = time.monotonic()
        passes = []
        while (r := await cleaner.clean(p, force=True)) is not None:
            passes.append(r)
            print(f"  pass {len(passes)}: offsets {r.start}..{r.end} (mapped to {r.map_end}) "
                  f"keys {r.keys} bytes {r.bytes_before / 2**20:.0f} -> "
                  f"{r.bytes_after / 2**20:.1f} MiB, objects {r.objects_before} -> "
                  f"{r.objects_after}, {time.monotonic() - t1:.1f} s")
        t_clean = time.monotonic() - t1
        peak = rss_kib("VmHWM")
        stop.set()
        await asyncio.gather(*tasks)
        await eng.maintenance.purge()
        n1, bytes1 = objects(root)
        print(f"compacted in {t_clean:.1f} s ({bytes0 / 2**20 / max(t_clean, 1e-9):.0f} MiB/s), "
              f"{len(passes)} passes: objects {n0} -> {n1}, bytes {bytes0 / 2**20:.0f} MiB -> "
              f"{bytes1 / 2**20:.1f} MiB")
        print(f"RSS before cleaning {rss0 / 1024:.0f} MiB, peak during cleaning "
              f"{peak / 1024:.0f} MiB" + ("" if peak_ok else " (peak not reset: whole run)")
              + f"; offset map limit {args.dedupe_mib} MiB")
        print(f"produce on another partition, before cleaning: {summary(base)}")
        print(f"produce on another partition, while cleaning:  {summary(during)}")
        print(f"event-loop lag before: p99 {pct(lag0, 0.99):.2f} ms, max {max(lag0) * 1000:.1f} ms;"
              f" while cleaning: p99 {pct(lag1, 0.99):.2f} ms, max {max(lag1) * 1000:.1f} ms")
        await eng.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--value-bytes", type=int, default=1024)
    ap.add_argument("--dedupe-mib", type=int, default=16)
    ap.add_argument("--io-mib-s", type=int, default=0, help="cleaner read pacing, 0 = none")
    ap.add_argument("--no-sync", action="store_true", help="WAL without fdatasync")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
