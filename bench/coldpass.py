"""Cold raw Fetch passes over the same data, alternating between code trees and broker flags.

    python -m bench.coldpass --variant old=/path/to/old/checkout --variant new=.
                             [--variant name=TREE:--flag,value,...] [--rounds 3]
                             [--seconds 4] [--fetch-seconds 5] [--data-dir DIR]

Produces once (raw 1 MiB batches, 4 partitions, as bench.rawload), waits for the uploads, then
per round and variant restarts the broker from that variant's tree (PYTHONPATH and working
directory) with its extra flags and reads everything once from the log start through the object
store (bench.rawload's cold pass: one connection per partition, 8 MiB Fetch answers). Every pass
reads the same objects, so variants differ only in code and flags; alternating them spreads the
other processes' load over all (the shared development VM: single passes moved 2x). Printed per
pass: MB/s, MiB read, the broker's CPU per MiB (all threads; of it the event loop's thread), the
bench process's own (the client), and the data disk's busy share and read MB/s over the pass
(/proc/diskstats, every process: on a quiet machine a busy share near 100 % says the pass is
bound by the device, not by CPU). ``--data-dir`` keeps the data for another run (the topic is reused when it exists).

``--device THREADS,PIECE_MIB`` (repeatable, e.g. ``--device 4,8 --device 1,8``) adds, after each
round's passes, plain reads of the same object files with no broker running: every file read
whole from its start in PIECE_MIB O_DIRECT reads into a reused huge-page buffer, THREADS files at
a time (the cold pass's readers each read their partition's objects in order). It is what this
disk gives the pass's bytes in the same minutes, so "the pass is at the device" is checked
rather than assumed (the busy share alone did not tell: bench/HISTORY.md, sessions 20 and 22).
"""
from __future__ import annotations

import argparse
import os
import time

from . import catchup, common, profile, rawload
from .device import device_of, disk_counters
from .common import BrokerProc, create_topic


def _loop_cpu_s(pid: int | None) -> float:
    """CPU seconds of the broker's main thread (its event loop; thread id = process id)."""
    return profile.thread_cpu(pid).get(pid, float("nan")) if pid else float("nan")


def _cpu_by_role(pid: int | None) -> dict[str, float]:
    """CPU seconds of the broker's event loop thread and of all its other threads (cold
    reads, IO pools: Python 3.11's pools leave the native thread names as the process's)."""
    out = {"loop": 0.0, "other": 0.0}
    if not pid:
        return out
    for tid, cpu in profile.thread_cpu(pid).items():
        out["loop" if tid == pid else "other"] += cpu
    return out


def device_pass(objects_dir: str, threads: int, piece: int, dev: str | None) -> dict:
    """Read every file under ``objects_dir`` once with O_DIRECT, ``piece`` bytes per read into
    one reused buffer per thread (huge pages where the kernel gives them), ``threads`` files
    at a time; returns bytes, seconds, and the device's requests (count, sectors, ms) over it.
    File systems that refuse O_DIRECT (tmpfs) are read through the page cache."""
    import mmap
    import threading
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(objects_dir) for f in fs
                   if ".tmp-" not in f)
    lock = threading.Lock()
    todo = iter(files)
    total = [0]
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            buf = mmap.mmap(-1, piece, flags=mmap.MAP_PRIVATE)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    buf.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass
            mv = memoryview(buf)
            while True:
                with lock:
                    path = next(todo, None)
                if path is None:
                    return
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                except OSError:
                    fd = os.open(path, os.O_RDONLY)
                got = 0
                try:
                    while True:
                        r = os.preadv(fd, [mv], got)
                        got += r
                        if r < piece:
                            break
                finally:
                    os.close(fd)
                with lock:
                    total[0] += got
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)

    d0, t0 = disk_counters(dev), time.monotonic()
    ths = [threading.Thread(target=worker) for _ in range(max(1, threads))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    wall, d1 = time.monotonic() - t0, disk_counters(dev)
    if errors:
        raise errors[0]
    delta = {k: d1.get(k, float("nan")) - d0.get(k, float("nan")) for k in
             ("disk reads", "disk read sectors", "disk read ms", "disk busy ms")}
    return {"bytes": total[0], "seconds": wall, "files": len(files), **delta}


def _vmstat() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                k, v = line.split()
                if k in ("thp_fault_alloc", "pgfault"):
                    out[k] = int(v)
    except OSError:
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True,
                    help="name=TREE[:--flag,value,...] (TREE: a checkout of this repository)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="produce time")
    ap.add_argument("--fetch-seconds", type=float, default=5.0, help="most time per pass")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--device", action="append", default=[], metavar="THREADS,PIECE_MIB",
                    help="after each round, plain O_DIRECT reads of the same objects (no broker)")
    a = ap.parse_args()
    variants = []
    for v in a.variant:
        name, _, rest = v.partition("=")
        tree, _, flags = rest.partition(":")
        variants.append((name, os.path.abspath(tree), [x for x in flags.split(",") if x]))
    if a.data_dir:
        os.makedirs(a.data_dir, exist_ok=True)
    broker = BrokerProc(["--wal-capacity", str(1 << 30)], data_dir=a.data_dir)
    base = list(broker.args)
    dev = device_of(broker.data_dir)
    nan = float("nan")

    def start(tree: str, flags: list[str]) -> None:
        common.REPO = tree                   # BrokerProc.start's working directory
        broker.env["PYTHONPATH"] = tree
        broker.args = base + flags
        broker.start()

    topic, conns = "coldpass", 4
    results: dict[str, list[float]] = {}
    try:
        start(*variants[0][1:])
        host, port = broker.bootstrap.rsplit(":", 1)
        marks = None
        try:
            create_topic(broker.bootstrap, topic, conns)
        except Exception:  # noqa: BLE001 - the topic of an earlier run (--data-dir)
            marks = rawload.watermarks(broker.bootstrap, topic, conns)
        if marks is None:
            st = rawload._run(rawload._produce, host, int(port), topic, conns, 8, a.seconds,
                              rawload.make_batch(1 << 20))
            print(f"produced {st['bytes'] / 1e6:.0f} MB", flush=True)
            broker.wait_uploaded()
            marks = rawload.watermarks(broker.bootstrap, topic, conns)
        for r in range(a.rounds):
            for name, tree, flags in variants:
                broker.stop()
                start(tree, flags)
                time.sleep(0.5)
                host, port = broker.bootstrap.rsplit(":", 1)
                cpu0, cl0 = rawload.process_cpu_s(broker.pid), time.process_time()
                loop0 = _loop_cpu_s(broker.pid)
                roles0, vm0 = _cpu_by_role(broker.pid), _vmstat()
                disk0, t0 = disk_counters(dev), time.monotonic()
                ft = rawload._run(rawload._fetch, host, int(port), topic, conns, a.fetch_seconds,
                                  [lo for lo, _ in marks], 8 << 20, False)
                cpu, cl = rawload.process_cpu_s(broker.pid) - cpu0, time.process_time() - cl0
                loop = _loop_cpu_s(broker.pid) - loop0
                roles1, vm1 = _cpu_by_role(broker.pid), _vmstat()
                disk1, wall = disk_counters(dev), time.monotonic() - t0
                busy = (disk1.get("disk busy ms", nan) - disk0.get("disk busy ms", nan)) / wall / 10
                sectors = disk1.get("disk read sectors", nan) - disk0.get("disk read sectors", nan)
                rd = sectors * 512 / wall / 1e6
                nreq = max(disk1.get("disk reads", nan) - disk0.get("disk reads", nan), 1)
                req_kib = sectors / 2 / nreq           # mean device request (max_sectors_kb caps it)
                req_ms = (disk1.get("disk read ms", nan) - disk0.get("disk read ms", nan)) / nreq
                mib = ft["bytes"] / (1 << 20)
                mb_s = ft["bytes"] / ft["elapsed"] / 1e6
                results.setdefault(name, []).append(mb_s)
                print(f"round {r} {name:10s} {mb_s:7.0f} MB/s {mib:6.0f} MiB in {ft['elapsed']:.2f} s"
                      f"  broker {cpu * 1e3 / mib:.3f} ms/MiB (loop {loop * 1e3 / mib:.3f})  client {cl * 1e3 / mib:.3f} ms/MiB"
                      f"  disk busy {busy:.0f} % read {rd:.0f} MB/s in {req_kib:.0f} KiB requests of {req_ms:.2f} ms  load {os.getloadavg()[0]:.1f}", flush=True)
                # per thread role (ms/MiB) and, machine-wide, fresh huge pages (MiB) and page faults
                print("        threads ms/MiB " + " ".join(
                    f"{k} {(roles1[k] - roles0[k]) * 1e3 / mib:.3f}" for k in roles0)
                    + f"  fresh huge pages {(vm1.get('thp_fault_alloc', 0) - vm0.get('thp_fault_alloc', 0)) * 2} MiB"
                    + f"  page faults {vm1.get('pgfault', 0) - vm0.get('pgfault', 0)}", flush=True)
            if a.device:
                broker.stop()                    # the disk alone: no broker beside the reads
                for spec in a.device:
                    th, _, mib = spec.partition(",")
                    st = device_pass(os.path.join(broker.data_dir, "data", "objects"), int(th),
                                     int(float(mib or 8) * (1 << 20)), dev)
                    nreq = max(st["disk reads"], 1)
                    name = f"device {th}x{mib or 8}M"
                    results.setdefault(name, []).append(st["bytes"] / st["seconds"] / 1e6)
                    print(f"round {r} {name:10s} {st['bytes'] / st['seconds'] / 1e6:7.0f} MB/s "
                          f"{st['bytes'] / (1 << 20):6.0f} MiB in {st['seconds']:.2f} s  "
                          f"disk busy {st['disk busy ms'] / st['seconds'] / 10:.0f} % in "
                          f"{st['disk read sectors'] / 2 / nreq:.0f} KiB requests of "
                          f"{st['disk read ms'] / nreq:.2f} ms  load {os.getloadavg()[0]:.1f}",
                          flush=True)
    finally:
        broker.close()
    for name, v in results.items():
        print(f"{name}: {' '.join(f'{x:.0f}' for x in v)} MB/s")


if __name__ == "__main__":
    main()
