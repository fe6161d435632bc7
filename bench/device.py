"""The WAL device's own write latency, the floor under any acks=all produce latency.

    python -m bench.device [--dir DIR] [--rate 1000] [--seconds 3]

Writes 4 KiB with O_DIRECT | O_DSYNC (the WAL's default durability: every write reaches
stable storage before it completes) to a preallocated file in ``--dir`` (default: the
temporary directory, where the bench brokers keep their data and WAL), one write at a time at
a fixed rate, and prints p50/p99/p999 in ms. ``bench.run_all`` sets the broker's produce p99
at 1000 msgs/s against this p99 (issue 20, Done-when 4).

``device_of``, ``disk_counters`` and ``disk_writes`` read what the device holding a directory
wrote and how long it was busy (/proc/diskstats): bench.rawload and bench.clients set them
against the bytes produced over the same window, bench.catchup and bench.coldpass against their
reads. With the embedded defaults every produced byte reaches this one device twice (the WAL,
then the file:// object), so the device's write rate, not the broker's CPU, can be what holds a
durable produce rate. ``write_rates`` measures how fast: on a thin-provisioned virtual disk
(and on SSDs after a discard) writing blocks no file has held costs more than overwriting
written ones, and the WAL overwrites its preallocated ring while every object is a new file.
"""
from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time

from .common import pct, threads_seconds

BLOCK = 4096


def write_latency(directory: str | None = None, rate: float = 1000, seconds: float = 3.0,
                  file_bytes: int = 64 << 20) -> dict[str, float | str]:
    """p50/p99/p999 (ms) of paced 4 KiB O_DIRECT|O_DSYNC writes to a file in ``directory``
    (sequential, wrapping over ``file_bytes``). Falls back to O_DSYNC alone where the
    filesystem refuses O_DIRECT (tmpfs); ``mode`` says which was used."""
    directory = directory or tempfile.gettempdir()
    fd_path = tempfile.mktemp(prefix="s3kbench-dev-", dir=directory)
    flags = _direct_or_not(fd_path, os.O_WRONLY | os.O_CREAT | os.O_DSYNC)
    mode = "O_DIRECT|O_DSYNC" if flags & getattr(os, "O_DIRECT", 0) else "O_DSYNC"
    fd = os.open(fd_path, flags, 0o600)
    buf = mmap.mmap(-1, BLOCK)          # page aligned, as O_DIRECT needs
    buf.write(b"\xa5" * BLOCK)
    lat: list[float] = []
    try:
        os.posix_fallocate(fd, 0, file_bytes)
        os.fsync(fd)
        now = time.perf_counter
        interval = 1.0 / rate
        pos = 0
        t0 = now()
        n = 0
        while True:
            due = t0 + n * interval
            t = now()
            if t - t0 >= seconds:
                break
            if due > t:
                time.sleep(due - t)
            s = now()
            os.pwrite(fd, buf, pos)
            lat.append((now() - s) * 1e3)
            pos = (pos + BLOCK) % file_bytes
            n += 1
    finally:
        os.close(fd)
        os.unlink(fd_path)
        buf.close()
    lat = lat[len(lat) // 10:]          # warm-up
    return {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "p999": pct(lat, 0.999),
            "n": len(lat), "mode": mode, "dir": directory}


def _direct_or_not(path: str, flags: int) -> int:
    """``flags`` with O_DIRECT where the filesystem under ``path`` takes it (not tmpfs)."""
    try:
        os.close(os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600))
        return flags | getattr(os, "O_DIRECT", 0)
    except OSError:
        return flags


def write_rates(directory: str | None = None, file_bytes: int = 1 << 30, writers: int = 2,
                overwrite_passes: int = 2, piece: int = 1 << 20) -> dict[str, float | str]:
    """MB/s of ``writers`` threads writing ``piece``-sized O_DIRECT pieces, each into its own
    file of ``file_bytes``: first into new files (blocks no file held: as each object put),
    then ``overwrite_passes`` times over the same, now written, blocks (as the WAL's
    preallocated ring), each file fdatasync'ed at the end of a pass.

    ``produce_ceiling`` is the durable produce rate the two allow when every produced byte is
    written once into the WAL and once into a new object and the device does one at a time:
    1 / (1/overwrite + 1/fresh). Writes that overlap can beat it a little; it is a bound of
    the device, not of the broker."""
    directory = directory or tempfile.gettempdir()
    paths = [tempfile.mktemp(prefix=f"s3kbench-rate{i}-", dir=directory) for i in range(writers)]
    buf = mmap.mmap(-1, piece)          # page aligned, as O_DIRECT needs
    buf.write(os.urandom(piece))
    flags = _direct_or_not(paths[0], os.O_WRONLY | os.O_CREAT)

    def one_pass(passes: int) -> float:
        """Seconds for every writer to write its whole file ``passes`` times."""
        def write(path: str) -> None:
            fd = os.open(path, flags, 0o600)
            try:
                for _ in range(passes):
                    for at in range(0, file_bytes, piece):
                        os.pwrite(fd, buf, at)
                    os.fdatasync(fd)
            finally:
                os.close(fd)
        return threads_seconds(write, paths)

    try:
        fresh_s = one_pass(1)
        over_s = one_pass(overwrite_passes)
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
        buf.close()
    total = writers * file_bytes
    fresh = total / fresh_s / 1e6
    over = total * overwrite_passes / over_s / 1e6
    return {"fresh_mb_s": fresh, "overwrite_mb_s": over,
            "produce_ceiling_mb_s": 1 / (1 / over + 1 / fresh),
            "writers": float(writers), "file_bytes": float(file_bytes), "dir": directory}


def device_of(path: str) -> str | None:
    """Name of the block device (as /proc/diskstats names it) holding ``path``; None when it
    is not a plain disk (tmpfs, overlay without a device of its own)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                v = line.split()
                if int(v[0]) == major and int(v[1]) == minor:
                    return v[2]
    except OSError:
        pass
    return None


def disk_counters(dev: str | None) -> dict[str, float]:
    """Cumulative /proc/diskstats counters of ``dev``: reads, read sectors, read ms, writes,
    write sectors, write ms, busy ms (the device had requests in flight); empty when unknown."""
    if dev is None:
        return {}
    with open("/proc/diskstats") as f:
        for line in f:
            v = line.split()
            if v[2] == dev:
                return {"disk reads": float(v[3]), "disk read sectors": float(v[5]),
                        "disk read ms": float(v[6]), "disk writes": float(v[7]),
                        "disk write sectors": float(v[9]), "disk write ms": float(v[10]),
                        "disk busy ms": float(v[12])}
    return {}


def disk_writes(before: dict[str, float], after: dict[str, float],
                wall: float) -> tuple[float, float] | None:
    """(bytes written, share of ``wall`` seconds busy) between two ``disk_counters`` of one
    device; None when either is unknown."""
    if not before or not after or wall <= 0:
        return None
    return ((after["disk write sectors"] - before["disk write sectors"]) * 512,
            (after["disk busy ms"] - before["disk busy ms"]) / 1e3 / wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--rate", type=float, default=1000)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rates", action="store_true",
                    help="also the 1 MiB write rates into new files and over written blocks")
    a = ap.parse_args()
    r = write_latency(a.dir, a.rate, a.seconds)
    print(f"4 KiB {r['mode']} writes at {a.rate:.0f}/s in {r['dir']}: p50 {r['p50']:.3f} ms, "
          f"p99 {r['p99']:.3f} ms, p999 {r['p999']:.3f} ms ({r['n']} writes)")
    if a.rates:
        w = write_rates(a.dir)
        print(f"1 MiB O_DIRECT writes, {w['writers']:.0f} writers: new files "
              f"{w['fresh_mb_s']:,.0f} MB/s, over written blocks {w['overwrite_mb_s']:,.0f} MB/s; "
              f"WAL + objects allow at most {w['produce_ceiling_mb_s']:,.0f} MB/s of produce")


if __name__ == "__main__":
    main()
