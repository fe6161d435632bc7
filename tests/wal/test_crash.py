"""Crash test: a writer is SIGKILLed at random moments, many times on the same WAL.

After every kill the WAL is reopened and every acknowledged record (and every record an earlier
recovery returned, unless trimmed since) must come back exactly once, byte for byte, in order
per stream, with nothing corrupt or never appended.
"""
from __future__ import annotations

import contextlib
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

import loopdev

from bench.common import tied_popen
from storage.wal import DeltaWAL, WALConfig

from .crash_writer import payload

WRITER = os.path.join(os.path.dirname(__file__), "crash_writer.py")
STREAMS = 4


def parse_body(body: bytes) -> tuple[int, int]:
    stream, seq, size, _ = body.split(b":", 3)
    s, q, n = int(stream), int(seq), int(size)
    assert body == payload(s, q, n), f"corrupt record stream={s} seq={q}"
    return s, q


def run_writer_until_killed(path: str, capacity: int, seed: int, sync_mode: str,
                            starts: list[int], rng: random.Random,
                            engine: str = "threads") -> list[str]:
    """Start the writer, SIGKILL it after a random time under load, return its complete lines."""
    proc = tied_popen([sys.executable, WRITER, path, str(capacity), str(seed), sync_mode,
                       ",".join(map(str, starts)), engine], stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
    data = bytearray()
    fd = proc.stdout.fileno()
    ready_deadline = time.monotonic() + 60
    while b"READY\n" not in data:                       # wait for open() to finish
        r, _, _ = select.select([fd], [], [], 1)
        if r:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise AssertionError("writer died: " + proc.stderr.read().decode())
            data += chunk
        assert time.monotonic() < ready_deadline, "writer never became ready"
    kill_at = time.monotonic() + rng.uniform(0.02, 0.5)
    while time.monotonic() < kill_at:
        r, _, _ = select.select([fd], [], [], max(0.0, kill_at - time.monotonic()))
        if r:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
    proc.send_signal(signal.SIGKILL)
    rest = proc.stdout.read()                           # everything written before the kill
    data += rest
    proc.wait()
    err = proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    assert "Traceback" not in err, err
    text = data.decode()
    lines = text.split("\n")
    return lines[:-1]                                   # drop a possibly partial last line


def crash_loop(path: str, capacity: int, rounds: int, seed: int, sync_mode: str = "dsync",
               engine: str = "threads"):
    rng = random.Random(seed)
    # (stream, seq) -> offset of every record that must survive until trimmed
    must: dict[tuple[int, int], int] = {}
    trim = 0              # durable for sure (trim() returned)
    starts = [0] * STREAMS
    total_acked = 0
    trim_intent = 0       # trim() called, maybe durable
    for rnd in range(rounds):
        lines = run_writer_until_killed(path, capacity, rng.randrange(1 << 30), sync_mode,
                                        starts, rng, engine)
        for line in lines:
            parts = line.split()
            if parts[0] == "A":
                s, q, off = int(parts[1]), int(parts[2]), int(parts[3])
                must[(s, q)] = off
                total_acked += 1
            elif parts[0] == "T":
                trim = max(trim, int(parts[1]))
            elif parts[0] == "t":
                trim_intent = max(trim_intent, int(parts[1]))
        wal = DeltaWAL(WALConfig(path=path, capacity=capacity, sync_mode=sync_mode))
        recs = list(wal.open())
        wal.close()
        # a trim in flight at the kill may or may not have reached the header
        assert trim <= wal.trim_offset <= max(trim, trim_intent)
        trim = wal.trim_offset
        seen: dict[tuple[int, int], int] = {}
        last_seq = [-1] * STREAMS
        for off, body in recs:
            assert off >= trim, f"round {rnd}: record at {off} below durable trim {trim}"
            s, q = parse_body(body)
            assert q < starts[s] + 10_000_000
            assert (s, q) not in seen, f"round {rnd}: duplicate stream={s} seq={q}"
            assert q > last_seq[s], f"round {rnd}: stream {s} out of order ({q} after " \
                                    f"{last_seq[s]})"
            last_seq[s] = q
            seen[(s, q)] = off
        for key, off in must.items():
            if off >= trim:
                assert seen.get(key) == off, \
                    f"round {rnd}: lost acknowledged/recovered record {key} at {off}"
        # what recovery returned is durable now: it must come back until trimmed
        must = {k: v for k, v in seen.items()}
        starts = [max(last_seq[s] + 1, starts[s]) for s in range(STREAMS)]
        # the writer numbered past what it acknowledged: never reuse a seq
        for line in lines:
            parts = line.split()
            if parts[0] == "A":
                s, q = int(parts[1]), int(parts[2])
                starts[s] = max(starts[s], q + 1)
        starts = [x + 1000 for x in starts]   # skip seqs appended but neither acked nor found
    assert total_acked > rounds, "the writer acknowledged almost nothing"
    return total_acked


ENGINES = pytest.mark.parametrize("engine", ["threads", "uring", "aio"])


@ENGINES
def test_crash_loop_on_file(tmp_path, engine):
    crash_loop(str(tmp_path / "wal"), 8 << 20, rounds=15, seed=1, engine=engine)


@pytest.fixture
def loop_device(tmp_path):
    with loopdev.loop_device(tmp_path / "loop.img", 32 << 20) as dev:
        yield dev


@ENGINES
def test_crash_loop_on_loop_device(loop_device, engine):
    crash_loop(loop_device, 8 << 20, rounds=15, seed=2, engine=engine)


def test_device_smaller_than_capacity_is_refused(loop_device):
    from storage.wal import CapacityMismatchError
    with pytest.raises(CapacityMismatchError):
        DeltaWAL(WALConfig(path=loop_device, capacity=64 << 20)).open()


def test_loop_device_uses_only_configured_capacity(loop_device):
    w = DeltaWAL(WALConfig(path=loop_device, capacity=1 << 20))
    list(w.open())
    assert w.direct_io
    for i in range(400):                 # several laps of a 1 MiB ring on a 32 MiB device
        r = w.append(bytes([i % 256]) * 9000)
        r.future.result(10)
        w.trim(r.offset)
    w.close()
    w = DeltaWAL(WALConfig(path=loop_device, capacity=1 << 20))
    recs = list(w.open())
    assert recs == [(r.offset, bytes([399 % 256]) * 9000)]
    w.close()


# Rounds of the long crash loops: 30 keeps `make test` within its 15-minute budget (the
# 15-round loops above run too); S3KAFKA_WAL_CRASH_ROUNDS=60 or more for a longer soak.
LONG_ROUNDS = int(os.environ.get("S3KAFKA_WAL_CRASH_ROUNDS", "30"))


@pytest.mark.slow
@ENGINES
def test_crash_loop_long_file(tmp_path, engine):
    crash_loop(str(tmp_path / "wal"), 8 << 20, rounds=LONG_ROUNDS, seed=3, engine=engine)
    crash_loop(str(tmp_path / "wal2"), 8 << 20, rounds=max(1, LONG_ROUNDS // 3), seed=4,
               sync_mode="fdatasync", engine=engine)


@pytest.mark.slow
@ENGINES
def test_crash_loop_long_loop_device(loop_device, engine):
    crash_loop(loop_device, 8 << 20, rounds=max(1, LONG_ROUNDS * 2 // 3), seed=5, engine=engine)


@contextlib.contextmanager
def read_only_after(loop_device: str, w: DeltaWAL):
    """Make the device refuse writes for the block's duration, then close the WAL and check
    that only b"before" survived: nothing the device refused was acknowledged or recovered."""
    if shutil.which("blockdev") is None:
        pytest.skip("blockdev is not installed: cannot make the loop device read-only")
    subprocess.run(["blockdev", "--setro", loop_device], check=True)
    try:
        yield
    finally:
        subprocess.run(["blockdev", "--setrw", loop_device], check=True)
        w.close()
    w = DeltaWAL(WALConfig(path=loop_device, capacity=1 << 20))
    assert [b for _, b in w.open()] == [b"before"]
    w.close()


def test_device_write_errors_fail_futures_and_stop_appends(loop_device):
    """A device that starts refusing writes: no crash, no false acknowledgement."""
    from storage.wal import WALClosedError, WALError
    w = DeltaWAL(WALConfig(path=loop_device, capacity=1 << 20, io_engine="threads"))
    list(w.open())
    w.append(b"before").future.result(10)
    with read_only_after(loop_device, w):
        r = w.append(b"after")
        with pytest.raises(WALError):
            r.future.result(30)
        with pytest.raises(WALClosedError):
            w.append(b"refused")


async def test_device_write_errors_fail_loop_futures_and_stop_appends(loop_device):
    """The same with the event loop writing (native AIO): the refused write is retried, then
    fails its future and the WAL; nothing is acknowledged that the device did not take."""
    from storage.wal import WALClosedError, WALError
    w = DeltaWAL(WALConfig(path=loop_device, capacity=1 << 20))
    list(w.open())
    assert w.attach_loop()
    assert await w.append_loop(b"before").future >= 0
    with read_only_after(loop_device, w):
        r = w.append_loop(b"after")
        with pytest.raises(WALError):
            await r.future
        with pytest.raises(WALClosedError):
            w.append_loop(b"refused")
