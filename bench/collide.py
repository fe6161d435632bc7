"""What a cold read in flight costs a WAL write on the same disk, per read piece size.

    python -m bench.collide [--dir DIR] [--pieces 262144,65536,32768] [--rounds 4]
                            [--seconds 3] [--read-mb-s 20] [--rate 1000] [--write]

``--write``: the other thread writes an object instead (O_DIRECT writes of the piece size into
a file, an fdatasync after each 8 MiB span, paced the same way): what an upload's put on a
file:// store costs a WAL write on the same disk (FileObjectStore.put, GENTLE_WRITE_CHUNK).

One thread writes 4 KiB with O_DIRECT | O_DSYNC at ``--rate`` writes/s (the WAL's durable
write, as ``bench.device``); another reads a 512 MiB file with O_DIRECT in pieces of the given
size, one piece at a time, in 8 MiB spans paced to ``--read-mb-s`` on average (what the
BlockCache's prefetches do for a paced catch-up reader while producers append:
``FileObjectStore`` with ``gentle``). Each write is classed by whether a read was in flight when
it started; per piece size and round the table gives how many writes met a read, the write p50
/ p90 of both classes, and a read's own time. The difference between the classes is what a
catch-up reader adds to an acks=all produce that meets one of its reads; the share of writes
that meet one decides whether that lands in the produce p99. Comparing within one run keeps the
other processes' I/O on a shared disk out of the figure (plain p99s swing 1-20 ms there).
Piece sizes alternate round by round. The files (~0.6 GB) are deleted afterwards.
"""
from __future__ import annotations

import argparse
import bisect
import mmap
import os
import shutil
import tempfile
import threading
import time

from .common import pct

PAGE = 4096
READ_FILE = 512 << 20
WAL_FILE = 64 << 20
SPAN = 8 << 20


def _make_files(d: str) -> tuple[str, str]:
    rf, wf = os.path.join(d, "object"), os.path.join(d, "wal")
    chunk = os.urandom(1 << 20)
    for path, size in ((rf, READ_FILE), (wf, WAL_FILE)):
        with open(path, "wb") as f:
            for _ in range(size >> 20):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    return rf, wf


def run(rfd: int, wfd: int, piece: int, seconds: float, rate: float, read_rate: float,
        write: bool = False) -> dict[str, float]:
    """One condition: paced dsync writes while a paced reader reads ``piece`` bytes per call
    (0: no reader). Returns counts and ms figures."""
    stop = threading.Event()
    reads: list[tuple[float, float]] = []
    rbuf = mmap.mmap(-1, SPAN)
    wbuf = mmap.mmap(-1, PAGE)
    wbuf.write(os.urandom(PAGE))

    def reader() -> None:
        mv = memoryview(rbuf)
        pos = 0
        due = time.perf_counter()
        while not stop.is_set():
            for off in range(0, SPAN, piece):
                a = time.perf_counter()
                if write:
                    os.pwritev(rfd, [mv[:piece]], (pos + off) % READ_FILE)
                else:
                    os.preadv(rfd, [mv[:piece]], (pos + off) % READ_FILE)
                reads.append((a, time.perf_counter()))
            if write:                       # the put's durability point, once per span
                a = time.perf_counter()
                os.fdatasync(rfd)
                reads.append((a, time.perf_counter()))
            pos = (pos + SPAN) % READ_FILE
            due += SPAN / read_rate
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            else:
                due = time.perf_counter()
        mv.release()

    th = threading.Thread(target=reader, daemon=True) if piece else None
    if th:
        th.start()
    writes: list[tuple[float, float]] = []
    off = 0
    due = time.perf_counter()
    end = due + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        os.pwrite(wfd, wbuf, off)
        writes.append((t0, time.perf_counter() - t0))
        off = (off + PAGE) % WAL_FILE
        due += 1 / rate
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
    stop.set()
    if th:
        th.join()
    reads.sort()
    starts = [a for a, _ in reads]
    met: list[float] = []
    free: list[float] = []
    for t0, lat in writes:
        i = bisect.bisect_right(starts, t0)
        (met if any(reads[j][1] > t0 for j in range(max(0, i - 4), i)) else free).append(lat)
    own = [b - a for a, b in reads]
    return {"writes": len(writes), "met": len(met),
            "met_p50": pct(met, .5) * 1e3 if met else float("nan"),
            "met_p90": pct(met, .9) * 1e3 if met else float("nan"),
            "free_p50": pct(free, .5) * 1e3, "free_p90": pct(free, .9) * 1e3,
            "all_p99": pct([lat for _, lat in writes], .99) * 1e3,
            "read_ms": pct(own, .5) * 1e3 if own else float("nan"),
            "read_mb_s": (len(own) * piece / seconds / 1e6) if own else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default=None, help="where the files go (default: the temp dir, "
                    "where the bench brokers keep their WAL and objects)")
    ap.add_argument("--pieces", default="262144,65536,32768")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rate", type=float, default=1000, help="dsync writes per second")
    ap.add_argument("--read-mb-s", type=float, default=20, help="average read rate (MB/s)")
    ap.add_argument("--write", action="store_true",
                    help="the other thread writes (an upload's put) instead of reading")
    a = ap.parse_args()
    pieces = [int(x) for x in a.pieces.split(",")]
    d = tempfile.mkdtemp(prefix="s3kbench-collide-", dir=a.dir)
    try:
        rf, wf = _make_files(d)
        rfd = os.open(rf, (os.O_WRONLY if a.write else os.O_RDONLY) | os.O_DIRECT)
        wfd = os.open(wf, os.O_WRONLY | os.O_DIRECT | os.O_DSYNC)
        rows = {p: [] for p in pieces}
        for _ in range(a.rounds):
            for p in pieces:
                rows[p].append(run(rfd, wfd, p, a.seconds, a.rate, a.read_mb_s * 1e6, a.write))
        os.close(rfd)
        os.close(wfd)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    other = "write" if a.write else "read"
    print(f"4 KiB O_DIRECT|O_DSYNC writes at {a.rate:.0f}/s beside O_DIRECT {other}s paced to "
          f"{a.read_mb_s:g} MB/s in 8 MiB spans, one piece per call"
          f"{' (an fdatasync after each span)' if a.write else ''}; {a.rounds} rounds of "
          f"{a.seconds:g} s alternating")
    print(f"{'piece':>8} | {'writes meeting a ' + other:>21} | {'write p50 met / free':>20} | "
          f"{'write p90 met / free':>20} | {'p99 all':>7} | {other + ' ms':>7}   (one cell per "
          f"round)")
    for p in pieces:
        for r in rows[p]:
            print(f"{p >> 10:>5} KiB | {r['met']:>7d} of {r['writes']:<5d} "
                  f"({100 * r['met'] / max(r['writes'], 1):4.1f} %) | "
                  f"{r['met_p50']:8.3f} / {r['free_p50']:<8.3f} | "
                  f"{r['met_p90']:8.3f} / {r['free_p90']:<8.3f} | {r['all_p99']:7.3f} | "
                  f"{r['read_ms']:7.3f}")


if __name__ == "__main__":
    main()
