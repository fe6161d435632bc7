"""The memory the WAL writes from: block buffers carved from huge-page arenas, reused, bounded.

Why it matters: an O_DIRECT write from scattered 4 KiB pages is pinned page by page and split by
the device's segment limit; from huge pages it is a few contiguous segments (see
storage/wal/device.py, hugepage_arena)."""
from __future__ import annotations

import mmap

import pytest

from storage.wal import DeltaWAL, WALConfig
from storage.wal.block import BufferPool
from storage.wal.device import HUGE_PAGE, aligned_buffer
from storage.wal.placed import address

BLOCK = 256 << 10


def mapping_of(addr: int) -> dict[str, str]:
    """The /proc/self/smaps entry holding addr: its maps line and its counters."""
    entry: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                if inside:
                    break
                inside = lo <= addr < hi
                if inside:
                    entry["line"] = line.strip()
            elif inside:
                entry[head[0].rstrip(":")] = head[1]
    return entry


def thp_possible() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_block_buffers_are_carved_in_address_order_from_2mib_aligned_arenas():
    pool = BufferPool(max_bytes=64 << 20)
    bufs = [pool.get(1000, BLOCK) for _ in range(BufferPool.ARENA_BYTES // BLOCK + 1)]
    addrs = [address(b) for b in bufs]
    assert all(len(b) == BLOCK for b in bufs)
    assert addrs[0] % HUGE_PAGE == 0
    per_arena = BufferPool.ARENA_BYTES // BLOCK
    assert addrs[1:per_arena] == [addrs[0] + i * BLOCK for i in range(1, per_arena)]
    assert addrs[per_arena] % HUGE_PAGE == 0 and len(pool._arenas) == 2
    for b in bufs:
        b[:3] = b"abc"                                 # writable, distinct memory
    assert len({address(b) for b in bufs}) == len(bufs)
    for b in bufs:
        pool.put(b)
    pool.close()


def test_returned_buffers_are_reused_and_arenas_stop_at_the_pool_limit():
    pool = BufferPool(max_bytes=BufferPool.ARENA_BYTES)          # room for one arena
    first = pool.get(BLOCK, BLOCK)
    pool.put(first)
    assert pool.get(BLOCK, BLOCK) is first
    held = [first] + [pool.get(BLOCK, BLOCK) for _ in range(BufferPool.ARENA_BYTES // BLOCK)]
    assert len(pool._arenas) == 1
    assert type(held[-1]) is mmap.mmap                # past the limit: a mapping of its own
    big = pool.get(BufferPool.ARENA_MAX_CLASS + 1, BLOCK)
    assert type(big) is mmap.mmap and len(big) == BufferPool.ARENA_MAX_CLASS + BLOCK
    for b in held + [big]:
        pool.put(b)
    pool.close()
    assert pool._arenas == [] and pool._free == {}


@pytest.mark.skipif(not thp_possible(), reason="transparent huge pages are disabled here")
def test_arena_memory_is_backed_by_huge_pages():
    pool = BufferPool(max_bytes=64 << 20)
    bufs = [pool.get(BLOCK, BLOCK) for _ in range(BufferPool.ARENA_BYTES // BLOCK)]
    for b in bufs:
        b[:] = bytes(BLOCK)                           # first touch faults the memory in
    entry = mapping_of(address(bufs[0]))
    assert int(entry["AnonHugePages"]) >= HUGE_PAGE >> 10, entry
    for b in bufs:
        pool.put(b)
    pool.close()


def test_aligned_buffers_are_private_memory_not_shmem():
    """mmap's default anonymous mapping is shared (shmem: no transparent huge pages here, and
    copy-on-write rules of its own); the WAL's buffers are private."""
    buf = aligned_buffer(4 << 20)
    entry = mapping_of(address(buf))
    perms = entry["line"].split()[1]
    assert perms.endswith("p"), entry["line"]
    assert "/dev/zero" not in entry["line"]
    buf.close()


def test_wal_round_trip_through_arena_buffers(tmp_path):
    """Records written from arena buffers (threads engine, no event loop) read back intact,
    and closing the WAL unmaps its arenas."""
    path = str(tmp_path / "wal")
    w = DeltaWAL(WALConfig(path=path, capacity=64 << 20))
    list(w.open())
    bodies = [bytes([i % 251]) * (1000 + i * 997 % 300_000) for i in range(200)]
    futs = [w.append(b, stream_id=i % 3).future for i, b in enumerate(bodies)]
    for f in futs:
        f.result(30)
    assert w._pool._arenas
    w.close()
    assert w._pool._arenas == []
    r = DeltaWAL(WALConfig(path=path, capacity=64 << 20))
    try:
        assert [b for _, b in r.open()] == bodies
    finally:
        r.close()
