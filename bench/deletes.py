"""What deleting a large file does to the WAL's writes on the same disk.

    python -m bench.deletes [--dir /tmp] [--mib 512] [--runs 2] [--rate 1000]

Writes a file of ``--mib`` MiB with O_DIRECT, then paces 4 KiB O_DIRECT|O_DSYNC writes (the
WAL's acks=all writes, one at a time) at ``--rate`` per second while another thread deletes
the file: by one ``unlink`` (what an object store's delete did before session 52), and by
``storage.objects.release.remove`` (cut from its end 1 MiB at a time, resting after each cut
as long as it took). Prints, per way and run, how long the delete took and the writes' p50 /
p99 / max before, during and after it, and the p99 during over the p99 before (the same
device in the same run). On a filesystem mounted with ``discard`` an unlink discards every
block inside the call (docs/storage.md, "Deleted files given back a piece at a time").
"""
from __future__ import annotations

import argparse
import mmap
import os
import threading
import time

from storage.objects.release import remove

from .common import pct


def _fill(path: str, mib: int) -> None:
    buf = mmap.mmap(-1, 16 << 20)
    buf.write(os.urandom(1 << 20) * 16)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        for _ in range(max(1, mib // 16)):
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)


def one_run(directory: str, mib: int, way: str, rate: float) -> dict[str, float]:
    """One delete of a ``mib`` MiB file beside paced dsync writes: the figures above."""
    big = os.path.join(directory, f"s3kbench-deletes-{os.getpid()}.big")
    wal = os.path.join(directory, f"s3kbench-deletes-{os.getpid()}.wal")
    _fill(big, mib)
    wfd = os.open(wal, os.O_CREAT | os.O_RDWR | os.O_DIRECT | os.O_DSYNC, 0o600)
    slots = 4096
    try:
        zero = mmap.mmap(-1, 1 << 20)
        for off in range(0, slots * 4096, 1 << 20):          # written blocks: overwrites
            os.pwrite(wfd, zero, off)
        block = mmap.mmap(-1, 4096)
        block.write(b"w" * 4096)
        time.sleep(1.0)
        marks: dict[str, float] = {}

        def delete() -> None:
            time.sleep(1.0)
            marks["t0"] = time.monotonic()
            if way == "unlink":
                os.unlink(big)
            else:
                remove(big)
            marks["t1"] = time.monotonic()

        th = threading.Thread(target=delete)
        th.start()
        start = time.monotonic()
        lat: list[tuple[float, float]] = []
        n = 0
        while "t1" not in marks or time.monotonic() - marks["t1"] < 1.0:
            t = time.monotonic()
            os.pwrite(wfd, block, (n % slots) * 4096)
            lat.append((t, (time.monotonic() - t) * 1e3))
            n += 1
            rest = start + n / rate - time.monotonic()
            if rest > 0:
                time.sleep(rest)
        th.join()
    finally:
        os.close(wfd)
        for p in (wal, big):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
    t0, t1 = marks["t0"], marks["t1"]
    parts = {"before": [x for t, x in lat if t < t0], "during": [x for t, x in lat if t0 <= t < t1],
             "after": [x for t, x in lat if t >= t1]}
    out = {"delete_ms": (t1 - t0) * 1e3}
    for name, xs in parts.items():
        out[f"{name}_n"] = len(xs)
        for q in (50, 99):
            out[f"{name}_p{q}"] = pct(xs, q / 100) if xs else float("nan")
        out[f"{name}_max"] = max(xs) if xs else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp", help="directory on the disk to measure")
    ap.add_argument("--mib", type=int, default=512, help="size of the deleted file")
    ap.add_argument("--runs", type=int, default=2, help="runs of each way, alternated")
    ap.add_argument("--rate", type=float, default=1000.0, help="paced dsync writes per second")
    a = ap.parse_args()
    print(f"delete of a {a.mib} MiB file in {a.dir} beside 4 KiB O_DIRECT|O_DSYNC writes at "
          f"{a.rate:.0f}/s (ms)")
    print("| way | run | delete ms | writes before p50 / p99 | during: writes, p50 / p99 / max "
          "| after p99 | p99 during / before |")
    print("|---|---|---|---|---|---|---|")
    for run in range(1, a.runs + 1):
        for way in ("unlink", "release.remove"):
            r = one_run(a.dir, a.mib, way, a.rate)
            print(f"| {way} | {run} | {r['delete_ms']:.0f} | {r['before_p50']:.2f} / "
                  f"{r['before_p99']:.2f} | {r['during_n']:.0f}, {r['during_p50']:.2f} / "
                  f"{r['during_p99']:.2f} / {r['during_max']:.2f} | {r['after_p99']:.2f} | "
                  f"{r['during_p99'] / r['before_p99']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
