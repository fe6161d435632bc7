"""Child process of the crash test: appends from several streams under load until killed.

Prints `A <stream> <seq> <offset>` only after that record's future completed,
`t <offset>` before calling trim() and `T <offset>` only after it returned; each line is one os.write (atomic on a pipe).
Usage: crash_writer.py <path> <capacity> <seed> <sync_mode> <start seqs as s0,s1,...> [engine]
engine "threads" (default): blocking append() from the main thread, IO threads write;
"uring" / "aio": append_loop() from a uvloop event loop that writes through io_uring / native
AIO (attach_loop()).
"""
from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from storage.wal import DeltaWAL, OverCapacityError, WALConfig  # noqa: E402
from storage.wal.config import LOOP_ENGINES  # noqa: E402


def payload(stream: int, seq: int, size: int) -> bytes:
    """Deterministic body, so the parent can verify every byte without seeing it appended."""
    head = f"{stream}:{seq}:{size}:".encode()
    rnd = random.Random(stream * 1_000_003 + seq)
    return head + rnd.randbytes(size)


def next_size(rng: random.Random) -> int:
    r = rng.random()
    return rng.randrange(10, 2000) if r < 0.6 else (
        rng.randrange(2000, 40_000) if r < 0.95 else rng.randrange(40_000, 300_000))


async def run_on_loop(wal: DeltaWAL, rng: random.Random, seqs: list[int]) -> None:
    """The engine's way: append_loop() on the loop, which also submits and reaps the writes;
    acknowledgements are printed from the futures' callbacks on the loop."""
    assert wal.attach_loop(), "native AIO was not attached"
    acked: list[int] = []

    def on_done(stream: int, seq: int, fut) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        acked.append(fut.result())
        os.write(1, f"A {stream} {seq} {fut.result()}\n".encode())

    def trim_to(target: int | None) -> bool:
        if target is None or target <= wal.trim_offset:
            return False
        os.write(1, f"t {target}\n".encode())
        wal.trim(target)
        os.write(1, f"T {target}\n".encode())
        return True

    os.write(1, b"READY\n")
    n = 0
    while True:
        stream = rng.randrange(len(seqs))
        body = payload(stream, seqs[stream], next_size(rng))
        if not wal.has_room(len(body) + 64):
            await wal.wait_for_room(len(body) + 64)
        try:
            res = wal.append_loop(body, stream_id=stream)
        except OverCapacityError:
            if not trim_to(acked[-1] if acked else None):
                await asyncio.sleep(0.001)
            continue
        seq = seqs[stream]
        seqs[stream] += 1
        res.future.add_done_callback(lambda f, s=stream, q=seq: on_done(s, q, f))
        n += 1
        if n % 8 == 0:
            await asyncio.sleep(0)               # a broker's loop turns between requests
        if n % 200 == 0 and rng.random() < 0.5:
            trim_to(acked[len(acked) // 2] if acked else None)


def main() -> None:
    path, capacity, seed, sync_mode, starts = sys.argv[1:6]
    engine = sys.argv[6] if len(sys.argv) > 6 else "threads"
    rng = random.Random(int(seed))
    seqs = [int(x) for x in starts.split(",")]
    wal = DeltaWAL(WALConfig(path=path, capacity=int(capacity), sync_mode=sync_mode,
                             block_soft_limit=64 << 10, window_initial=256 << 10,
                             window_max=2 << 20, io_threads=4, io_engine=engine))
    list(wal.open())
    if engine in LOOP_ENGINES:
        import uvloop
        uvloop.run(run_on_loop(wal, rng, seqs))
        return
    out_lock = threading.Lock()
    acked: list[int] = []          # offsets acknowledged, in completion order

    def on_done(stream: int, seq: int, fut) -> None:
        if fut.exception() is not None:
            return
        with out_lock:
            acked.append(fut.result())
            os.write(1, f"A {stream} {seq} {fut.result()}\n".encode())

    os.write(1, b"READY\n")
    n = 0
    while True:
        stream = rng.randrange(len(seqs))
        body = payload(stream, seqs[stream], next_size(rng))
        try:
            res = wal.append(body, stream_id=stream)
        except OverCapacityError:
            with out_lock:
                target = acked[-1] if acked else None
            if target is not None and target > wal.trim_offset:
                os.write(1, f"t {target}\n".encode())
                wal.trim(target)
                os.write(1, f"T {target}\n".encode())
            else:
                time.sleep(0.001)
            continue
        seq = seqs[stream]
        seqs[stream] += 1
        res.future.add_done_callback(lambda f, s=stream, q=seq: on_done(s, q, f))
        n += 1
        if n % 200 == 0 and rng.random() < 0.5:
            with out_lock:
                target = acked[len(acked) // 2] if acked else None
            if target is not None and target > wal.trim_offset:
                os.write(1, f"t {target}\n".encode())
                wal.trim(target)
                os.write(1, f"T {target}\n".encode())


if __name__ == "__main__":
    main()
