"""Delta WAL benchmark: append throughput/latency against the raw O_DIRECT speed of the same device.

    python -m bench.wal [--path FILE_OR_DEVICE] [--capacity BYTES] [--sync dsync|fdatasync|none]
                        [--bytes N] [--sizes 1024,16384,...] [--rounds 3] [--half-seconds 3]
                        [--caller loop|thread] [--io-engine aio|threads]

For each record size it prints appended MB/s, records/s, device writes/s (IOPS), p50/p99 append
latency (append() call -> durable future) at full speed and at half of that speed, the raw
O_DIRECT sequential write MB/s of the same device (writes of the WAL's mean write size at full
speed, ``write KiB``, measured by a first untimed WAL run; same sync mode, same queue depth
as the WAL's IO threads, buffers from the WAL's own huge-page allocator: the
device is faster from huge pages, and raw gets that too), and the ratio WAL/raw. Each WAL run
first appends 2 x max_buffered_bytes untimed: a running broker's buffer pool is warm, a fresh
one faults its memory in (see _warm_up()).

The device's own speed drifts by +-20 % within seconds on these machines, so one raw figure
taken minutes away from the WAL's says little. Each size therefore runs ``--rounds`` WAL runs
alternating with raw runs (raw, WAL, raw, WAL, ..., raw); every WAL run is divided by the mean
of the raw runs right before and after it, and the median of those ratios is printed with its
range. The MB/s columns are medians over the rounds.

The half-speed runs pace appends at half the full-speed MB/s for ``--half-seconds`` each
(``--rounds`` of them; median p50/p99 and the p99 range are printed): a p99 over a fraction of
a second is just the one device hiccup that happened to fall into it. The loop caller gets its
records the way a broker's loop gets requests: a pacing thread wakes every 0.2 ms and hands
the loop what is due (asyncio.sleep() cannot: uvloop timers fire in whole milliseconds, so
1 GB/s came in 1 MB bursts). Both callers trim from another thread once a quarter of the ring
is in use, as the engine does after uploads. After each half-speed run the device alone is
driven at the same MB/s (256 KiB writes, one every 256 KiB/rate seconds, up to the WAL's IO
threads in flight) and the median of its p99 write latency is printed as ``dev p99``: where
the device itself stalls at that load (host write-back on a VM disk), no WAL on it can answer
faster.
A last table shows what each durability mode costs (256 KiB throughput, 4 KiB paced latency).

The loop caller calls ``attach_loop()`` as the engine does, so with ``--io-engine aio`` (the
default) the loop writes the WAL with native AIO; ``--io-engine threads`` keeps the IO threads
(the thread caller always uses them).
"""
from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from storage.wal import DeltaWAL, OverCapacityError, WALConfig  # noqa: E402
from storage.wal.block import BufferPool  # noqa: E402
from storage.wal.config import IO_ENGINES  # noqa: E402
from storage.wal.device import Device  # noqa: E402
from storage.wal.format import HEADER_AREA, RECORD_HEADER_SIZE, align_up  # noqa: E402
from bench.common import pct, threads_seconds  # noqa: E402

SIZES = [1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
PACE_TICK_S = 0.0002          # the paced loop caller's arrival granularity


def raw_write_mbps(path: str, capacity: int, sync_mode: str, write_size: int, threads: int,
                   total: int) -> float:
    """Sequential O_DIRECT writes of write_size from `threads` threads (like the WAL's pool)."""
    dev = Device(path, capacity, sync_mode)
    ring = capacity - HEADER_AREA
    nwrites = max(threads * 4, total // write_size)
    pool, bufs = wal_buffers(write_size, threads)
    counter = iter(range(nwrites))
    lock = threading.Lock()

    def worker(buf) -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            pos = HEADER_AREA + (i * write_size) % (ring - ring % write_size)
            dev.write(buf, pos)

    dt = threads_seconds(worker, bufs)
    dev.close()
    for b in bufs:
        b.release()
    pool.close()
    return nwrites * write_size / dt / 1e6


def wal_buffers(size: int, n: int) -> tuple[BufferPool, list[memoryview]]:
    """n buffers of size bytes (random content) from the allocator the WAL writes from: the
    device's speed depends on the memory it is given (huge pages make fewer, larger
    segments), so raw and WAL are measured on the same kind."""
    pool = BufferPool(64 << 20)
    bufs = [memoryview(pool.get(size, WALConfig.block_soft_limit))[:size] for _ in range(n)]
    for b in bufs:
        b[:] = os.urandom(size)
    return pool, bufs


def paced_device_latency(path: str, capacity: int, sync_mode: str, rate: float, total: int,
                          threads: int, write_size: int = 256 << 10) -> float:
    """p99 ms of the device alone, written sequentially at ``rate`` B/s in
    ``write_size`` writes with up to ``threads`` in flight: the floor under the WAL's latency
    at that load. Latency counts from each write's due time (a queued write waits too)."""
    dev = Device(path, capacity, sync_mode)
    ring = capacity - HEADER_AREA
    n = max(50, int(total // write_size))
    interval = write_size / rate
    pool, (buf,) = wal_buffers(write_size, 1)
    lat: list[float] = []
    todo: queue.SimpleQueue = queue.SimpleQueue()

    def worker() -> None:
        while True:
            item = todo.get()
            if item is None:
                return
            i, due = item
            dev.write(buf, HEADER_AREA + (i * write_size) % (ring - ring % write_size))
            lat.append(time.perf_counter() - due)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    t0 = time.perf_counter()
    for i in range(n):
        due = t0 + i * interval
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        todo.put((i, due))
    for _ in ts:
        todo.put(None)
    for t in ts:
        t.join()
    dev.close()
    buf.release()
    pool.close()
    return pct(lat, 0.99) * 1e3


def run_wal(cfg: WALConfig, size: int, total: int, rate: float | None) -> dict:
    """Append `total` bytes of `size`-byte records (paced to `rate` B/s if given)."""
    wal = DeltaWAL(cfg)
    list(wal.open())
    body = os.urandom(size)
    n = max(200, total // size)
    lat: list[float] = [0.0] * n
    done_at = [0.0]
    remaining = [n]
    ev = threading.Event()
    warm = [wal.append(body).future for _ in range(max(1, 2 * cfg.max_buffered_bytes // size))]
    for f in warm:                           # as _warm_up() does for the loop caller
        f.result(120)
    wal.trim(wal.confirmed_offset)
    writes_before, end_before = wal_writes(wal), wal.end_offset

    def cb(i: int, t0: float, _f) -> None:
        t1 = time.perf_counter()
        lat[i] = t1 - t0
        remaining[0] -= 1
        if remaining[0] == 0:
            done_at[0] = t1
            ev.set()

    t_start = time.perf_counter()
    interval = size / rate if rate else 0.0
    trim_after = cfg.capacity // 4
    trimmer = None
    for i in range(n):
        if rate:
            due = t_start + i * interval
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)        # never spin: a spinning producer holds the GIL
        if (trimmer is None or not trimmer.is_alive()) and \
                wal.end_offset - wal.trim_offset > trim_after:
            # as the engine does after each upload: trim from another thread, early
            trimmer = threading.Thread(target=wal.trim, args=(wal.confirmed_offset,))
            trimmer.start()
        while True:
            try:
                t0 = time.perf_counter()
                r = wal.append(body, stream_id=i % 8)
                break
            except OverCapacityError:        # stands in for "upload, then trim"
                wal.trim(wal.confirmed_offset)
                time.sleep(0.0002)
        r.future.add_done_callback(lambda f, i=i, t0=t0: cb(i, t0, f))
    ev.wait(120)
    elapsed = done_at[0] - t_start
    writes = wal_writes(wal) - writes_before
    wsize = (wal.end_offset - end_before) / max(1, writes)
    wal.close()
    return {"mbps": n * size / elapsed / 1e6, "rps": n / elapsed, "iops": writes / elapsed,
            "p50": pct(lat, 0.5) * 1e3, "p99": pct(lat, 0.99) * 1e3, "wsize": wsize}


def wal_writes(wal: DeltaWAL) -> int:
    return wal.stats["writes"]            # pwritev calls (merged blocks count once)


async def _warm_up(wal: DeltaWAL, body: bytes, rec: int, nbytes: int) -> None:
    """Append nbytes untimed, wait until durable, trim. A fresh WAL's buffer pool is empty:
    its first max_buffered_bytes of blocks fault in new memory (huge pages that, on these
    VMs, the host may have to back first: the first 30 of ~170 flush cycles of a 512 MiB run
    took ~6 ms instead of ~1.2), which a running broker paid once, long ago. The raw runs'
    buffers are written before their clock starts too."""
    import asyncio

    futs = []
    for _ in range(max(1, nbytes // len(body))):
        if not wal.has_room(rec):
            await wal.wait_for_room(rec)
        futs.append(wal.append_loop(body).future)
    await asyncio.gather(*futs)
    wal.trim(wal.confirmed_offset)


def run_wal_loop(cfg: WALConfig, size: int, total: int, rate: float | None) -> dict:
    """run_wal() as the engine calls the WAL: append_loop() from an asyncio (uvloop) loop,
    waiting for room when max_buffered_bytes are not yet durable; latency is append ->
    the future's done callback on the loop."""
    import asyncio
    import functools

    import uvloop

    async def go() -> dict:
        wal = DeltaWAL(cfg)
        list(wal.open())
        wal.attach_loop()                    # as the engine does (io_engine "uring"/"aio")
        loop = asyncio.get_running_loop()
        body = os.urandom(size)
        n = max(200, total // size)
        lat: list[float] = [0.0] * n
        left = [n]
        done = loop.create_future()
        rec = RECORD_HEADER_SIZE + size
        await _warm_up(wal, body, rec, 2 * cfg.max_buffered_bytes)
        writes_before, end_before = wal_writes(wal), wal.end_offset
        trim_after = cfg.capacity // 4
        trimming: asyncio.Future | None = None

        def cb(i: int, t0: float, _f) -> None:
            t1 = time.perf_counter()
            lat[i] = t1 - t0
            left[0] -= 1
            if not left[0]:
                done.set_result(t1)

        t_start = t0 = time.perf_counter()
        yielded = t_start
        allowed = [n]
        wake = asyncio.Event()
        stop = threading.Event()
        if rate:
            # Arrivals as a broker's loop sees them: a thread wakes every PACE_TICK_S and
            # hands the loop the records due by then, as epoll hands it the requests that
            # arrived. (asyncio.sleep() cannot pace this: uvloop timers fire in whole
            # milliseconds, so 1 GB/s came as 1 MB bursts, each queueing behind itself.)
            allowed[0] = 0

            def release(k: int) -> None:
                allowed[0] = k
                wake.set()

            def pacer() -> None:
                while not stop.is_set():
                    time.sleep(PACE_TICK_S)
                    k = min(n, int((time.perf_counter() - t_start) * rate / size) + 1)
                    loop.call_soon_threadsafe(release, k)
                    if k >= n:
                        return
            threading.Thread(target=pacer, daemon=True).start()
        for i in range(n):
            while i >= allowed[0]:
                wake.clear()
                await wake.wait()
                yielded = time.perf_counter()
            if t0 - yielded > 0.0002:
                # a broker's loop turns between requests: let completions run (a loop that
                # never yields would measure its own starvation, not the WAL)
                await asyncio.sleep(0)
                yielded = time.perf_counter()
            if trimming is not None and trimming.done():
                trimming.result()                # a failed trim fails the run
                trimming = None
            if trimming is None and wal.end_offset - wal.trim_offset > trim_after:
                # as the engine does after each upload: trim from another thread, long
                # before the ring is full (a full ring would stall appends)
                trimming = loop.run_in_executor(None, wal.trim, wal.confirmed_offset)
            if not wal.has_room(rec):
                await wal.wait_for_room(rec)
            while True:
                try:
                    t0 = time.perf_counter()
                    r = wal.append_loop(body, stream_id=i % 8)
                    break
                except OverCapacityError:        # stands in for "upload, then trim"
                    wal.trim(wal.confirmed_offset)
                    await asyncio.sleep(0.0002)
            r.future.add_done_callback(functools.partial(cb, i, t0))
        t_end = await asyncio.wait_for(done, 120)
        stop.set()
        elapsed = t_end - t_start
        writes = wal_writes(wal) - writes_before
        wsize = (wal.end_offset - end_before) / max(1, writes)
        wal.close()
        return {"mbps": n * size / elapsed / 1e6, "rps": n / elapsed,
                "iops": writes / elapsed, "p50": pct(lat, 0.5) * 1e3,
                "p99": pct(lat, 0.99) * 1e3, "wsize": wsize}

    return uvloop.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--path", help="WAL file or block device (default: a temp file)")
    ap.add_argument("--capacity", type=int, default=1 << 30)
    ap.add_argument("--sync", default="dsync", choices=["dsync", "fdatasync", "none"])
    ap.add_argument("--bytes", type=int, default=512 << 20, help="bytes appended per size")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--caller", default="loop", choices=["loop", "thread"],
                    help="loop: append_loop() from a uvloop event loop, as the engine calls the "
                         "WAL; thread: blocking append() from a plain thread")
    ap.add_argument("--io-engine", default=WALConfig.io_engine, choices=IO_ENGINES,
                    help="WALConfig.io_engine for the loop caller (see docs/wal.md)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="WAL runs per size, each between two raw runs (ratio = median); as "
                         "many half-speed runs, each followed by the device alone")
    ap.add_argument("--half-seconds", type=float, default=3.0,
                    help="length of each half-speed run (and of the device-alone run)")
    args = ap.parse_args()
    run = run_wal_loop if args.caller == "loop" else run_wal
    tmp = None
    path = args.path
    if path is None:
        tmp = tempfile.mkdtemp(prefix="walbench", dir="/var/tmp")
        path = os.path.join(tmp, "wal")
    base = dict(path=path, capacity=args.capacity, sync_mode=args.sync, io_engine=args.io_engine)
    cfg0 = WALConfig(**base)
    engine = args.io_engine if args.caller == "loop" else "threads"
    print(f"device {path}  capacity {args.capacity >> 20} MiB  sync {args.sync}  "
          f"queue depth {cfg0.io_threads}  block {cfg0.block_soft_limit >> 10} KiB  "
          f"caller {args.caller}  writes by {'the loop (native AIO)' if engine == 'aio' else 'IO threads'}")
    hdr = (f"{'record':>8} {'MB/s':>8} {'rec/s':>9} {'IOPS':>7} {'p50 ms':>7} {'p99 ms':>7} | "
           f"{'half MB/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'p99 range':>11} {'dev p99':>7} | "
           f"{'write KiB':>9} {'raw MB/s':>8} "
           f"{'ratio':>6} {'range':>9}")
    print(hdr)
    try:
        for size in [int(s) for s in args.sizes.split(",")]:
            # small records are bounded by Python per-append cost: fewer bytes keep runs short
            total = args.bytes if size >= 16 << 10 else min(args.bytes, 128 << 20)
            total = min(total, args.capacity // 2) if size < 64 << 10 else total
            # raw writes of the size the WAL writes at full speed (merged blocks: how many
            # depends on the record size and the backlog), measured by a first, untimed run
            wsize = align_up(int(run(WALConfig(**base), size, min(total, 128 << 20),
                                     None)["wsize"]))

            def raw_run() -> float:
                return raw_write_mbps(path, args.capacity, args.sync, wsize, cfg0.io_threads,
                                      total)
            raws = [raw_run()]
            fulls: list[dict] = []
            ratios: list[float] = []
            for _ in range(max(1, args.rounds)):
                fulls.append(run(WALConfig(**base), size, total, None))
                raws.append(raw_run())
                ratios.append(fulls[-1]["mbps"] / ((raws[-2] + raws[-1]) / 2))
            full = {k: statistics.median(f[k] for f in fulls) for k in fulls[0]}
            raw = statistics.median(raws)
            rate = full["mbps"] * 1e6 / 2
            # p99 over a fraction of a second is the worst device hiccup of that moment:
            # runs of --half-seconds, alternating with the device alone at the same rate
            halves: list[dict] = []
            devs: list[float] = []
            half_bytes = int(rate * args.half_seconds)
            for _ in range(max(1, args.rounds)):
                halves.append(run(WALConfig(**base), size, half_bytes, rate))
                devs.append(paced_device_latency(path, args.capacity, args.sync, rate,
                                                 half_bytes, cfg0.io_threads))
            half = {k: statistics.median(h[k] for h in halves) for k in halves[0]}
            half_p99s = [h["p99"] for h in halves]
            dev_p99 = statistics.median(devs)
            print(f"{size >> 10:>6}Ki {full['mbps']:>8.0f} {full['rps']:>9.0f} "
                  f"{full['iops']:>7.0f} "
                  f"{full['p50']:>7.2f} {full['p99']:>7.2f} | {half['mbps']:>9.0f} "
                  f"{half['p50']:>7.2f} {half['p99']:>7.2f} "
                  f"{min(half_p99s):>5.2f}-{max(half_p99s):<5.2f} {dev_p99:>7.2f} | "
                  f"{wsize >> 10:>9} {raw:>8.0f} "
                  f"{statistics.median(ratios):>6.2f} {min(ratios):>4.2f}-{max(ratios):<4.2f}",
                  flush=True)
        print("durability modes (cost of the barrier after each block write):")
        print(f"{'sync_mode':>10} {'256Ki MB/s':>10} | {'4Ki paced p50 ms':>16} {'p99 ms':>7}")
        for mode in ("none", "dsync", "fdatasync"):
            cfg = dict(base, sync_mode=mode)
            thr = run(WALConfig(**cfg), 256 << 10, min(args.bytes, 256 << 20), None)
            lat = run(WALConfig(**cfg), 4 << 10, 8 << 20, 4e6)
            print(f"{mode:>10} {thr['mbps']:>10.0f} | {lat['p50']:>16.3f} {lat['p99']:>7.3f}",
                  flush=True)
        ceiling = raw_write_mbps(path, args.capacity, "none", 1 << 20, 1, 256 << 20)
        print(f"device ceiling: O_DIRECT 1 MiB writes, queue depth 1, no sync: {ceiling:.0f} MB/s")
    finally:
        if tmp:
            os.unlink(path)
            os.rmdir(tmp)


if __name__ == "__main__":
    main()
