"""FileObjectStore's recycle pool: deleted objects' files overwritten by later puts.

A put that takes a pooled file must publish exactly the new bytes (never the old object's,
whatever size either has), only after its durable rename; a put killed at any step leaves no
key naming garbage, and a restarted store adopts the pool (real files, real processes).
"""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap

import pytest

from storage.objects import store as store_mod
from storage.objects.store import RECYCLE_DIR, ObjectNotFound, ObjectStoreError, FileObjectStore

MIB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def no_quarantine(monkeypatch):
    """Pooled files are reusable at once (the quarantine has its own test)."""
    monkeypatch.setattr(store_mod, "RECYCLE_QUARANTINE_S", 0.0)


def _aligned(data: bytes) -> memoryview:
    """``data`` in a page-aligned buffer, as the engine's encode buffers (O_DIRECT pieces)."""
    buf = mmap.mmap(-1, len(data) + mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
    buf[:len(data)] = data
    return memoryview(buf)[:len(data)]


def _store(root, direct: bool = True) -> FileObjectStore:
    s = FileObjectStore(str(root))
    s.direct_writes = direct
    return s


def _pool(root) -> list[str]:
    d = os.path.join(root, RECYCLE_DIR)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def test_a_deleted_object_is_hidden_in_the_pool_and_never_a_key(tmp_path) -> None:
    s = _store(tmp_path)
    s.put("so/0/1", os.urandom(2 * MIB + 100))
    s.put("so/0/2", b"small")                       # below RECYCLE_MIN: unlinked
    s.delete(["so/0/1", "so/0/2", "nope"])
    assert len(_pool(tmp_path)) == 1
    assert s.list() == []
    with pytest.raises(ObjectNotFound):
        s.get("so/0/1")
    with pytest.raises(ObjectStoreError):
        s.get(f"{RECYCLE_DIR}/{_pool(tmp_path)[0]}")


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("new_size", [2 * MIB + 100, 2 * MIB - 5, 4 * MIB + 4096 + 7])
def test_a_put_overwrites_a_pooled_file_with_exactly_the_new_bytes(tmp_path, direct,
                                                                   new_size) -> None:
    """Shorter, aligned-tail and longer than the recycled object: the same inode (its blocks
    reused), the new object's bytes and size only."""
    s = _store(tmp_path, direct)
    old = b"\xee" * (3 * MIB + 1234)
    s.put("so/0/1", _aligned(old))
    ino = os.stat(tmp_path / "so/0/1").st_ino
    s.delete(["so/0/1"])
    new = os.urandom(new_size)
    s.put("so/0/2", _aligned(new))
    assert os.stat(tmp_path / "so/0/2").st_ino == ino, "the pooled file was reused"
    assert s.size("so/0/2") == new_size
    assert bytes(s.get("so/0/2")) == new
    assert _pool(tmp_path) == []
    assert s.list() == ["so/0/2"]


def test_a_small_object_never_takes_a_large_pooled_file(tmp_path) -> None:
    """A put of less than half a pooled file's size (or below RECYCLE_MIN) makes a new file:
    its ftruncate would free, and discard, most of the pooled blocks."""
    s = _store(tmp_path)
    s.put("so/0/1", _aligned(os.urandom(5 * MIB)))
    s.delete(["so/0/1"])
    s.put("so/0/2", _aligned(os.urandom(2 * MIB)))
    s.put("so/0/3", b"tiny")
    assert len(_pool(tmp_path)) == 1
    s.put("so/0/4", _aligned(os.urandom(3 * MIB)))
    assert _pool(tmp_path) == []


def test_a_pooled_file_waits_out_its_quarantine(tmp_path, monkeypatch) -> None:
    """A read that opened the object just before its delete must not see a new object's bytes:
    the file is reused only RECYCLE_QUARANTINE_S after the delete."""
    monkeypatch.setattr(store_mod, "RECYCLE_QUARANTINE_S", 3600.0)
    s = _store(tmp_path)
    s.put("so/0/1", _aligned(os.urandom(2 * MIB)))
    ino = os.stat(tmp_path / "so/0/1").st_ino
    fd = os.open(tmp_path / "so/0/1", os.O_RDONLY)    # a reader in flight
    try:
        before = os.pread(fd, 4096, 0)
        s.delete(["so/0/1"])
        s.put("so/0/2", _aligned(os.urandom(2 * MIB)))
        assert os.stat(tmp_path / "so/0/2").st_ino != ino
        assert os.pread(fd, 4096, 0) == before
    finally:
        os.close(fd)
    assert len(_pool(tmp_path)) == 1


def test_the_pool_is_bounded_and_prefers_the_closest_large_enough_file(tmp_path) -> None:
    s = _store(tmp_path)
    s.recycle_bytes = 10 * MIB
    for i, size in enumerate([4 * MIB, 2 * MIB, 3 * MIB, 5 * MIB]):
        s.put(f"so/0/{i}", _aligned(os.urandom(size)))
    inos = {i: os.stat(tmp_path / f"so/0/{i}").st_ino for i in range(4)}
    s.delete([f"so/0/{i}" for i in range(4)])
    assert len(_pool(tmp_path)) == 3                 # 4 + 2 + 3 MiB; 5 more would pass 10
    s.put("so/0/9", _aligned(os.urandom(2 * MIB + 10)))
    assert os.stat(tmp_path / "so/0/9").st_ino == inos[2]     # 3 MiB: closest above
    big = os.urandom(9 * MIB)
    s.put("so/0/8", _aligned(big))
    assert os.stat(tmp_path / "so/0/8").st_ino == inos[0]     # none large enough: largest
    assert bytes(s.get("so/0/8")) == big
    assert s.list() == ["so/0/8", "so/0/9"]


def test_a_restarted_store_adopts_the_pool_but_never_a_file_with_another_name(tmp_path) -> None:
    s = _store(tmp_path)
    for i in range(3):
        s.put(f"so/0/{i}", _aligned(os.urandom(2 * MIB)))
    keep = bytes(s.get("so/0/2"))
    s.delete(["so/0/0", "so/0/1"])
    pooled = _pool(tmp_path)
    # a pool name that is also an object (a cross-directory rename split by a crash on a file
    # system without a journal, as e2fsck leaves it: two links)
    os.link(tmp_path / RECYCLE_DIR / pooled[0], tmp_path / RECYCLE_DIR / "also-an-object")
    os.unlink(tmp_path / RECYCLE_DIR / pooled[0])
    os.link(tmp_path / "so/0/2", tmp_path / RECYCLE_DIR / "linked")
    again = _store(tmp_path)
    assert sorted(_pool(tmp_path)) == sorted(["also-an-object", pooled[1]])
    adopted = {os.stat(tmp_path / RECYCLE_DIR / n).st_ino for n in _pool(tmp_path)}
    again.put("so/0/7", _aligned(os.urandom(2 * MIB)))
    again.put("so/0/8", _aligned(os.urandom(2 * MIB)))
    assert {os.stat(tmp_path / f"so/0/{k}").st_ino for k in (7, 8)} == adopted
    assert bytes(again.get("so/0/2")) == keep, "the linked object is untouched"


# one step of a put over a pooled file, where the child dies like kill -9
STEPS = ["rename", "pieces", "ftruncate", "fdatasync", "replace", "_fsync_dir"]

CHILD = textwrap.dedent("""
    import mmap, os, sys
    from storage.objects import store as m
    root, step, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    m.RECYCLE_QUARANTINE_S = 0.0
    s = m.FileObjectStore(root)
    s.direct_writes = True

    def die(*a, **k):
        os._exit(137)

    if step == "rename":
        m.os.rename = die                  # the pooled file taken: before its rename
    elif step == "pieces":
        real = m._write_direct
        def half(fd, view, chunk=m.FILE_WRITE_CHUNK):
            real(fd, view[:len(view) // 2 // 4096 * 4096], chunk)
            die()
        m._write_direct = half             # half of the new bytes written over the old
    elif step in ("ftruncate", "fdatasync", "replace"):
        setattr(m.os, step, die)
    else:
        m._fsync_dir = die                 # renamed, not yet synced: may or may not be there
    data = bytes([seed]) * (2 * 1024 * 1024 + 777)
    buf = mmap.mmap(-1, len(data) + 4096, flags=mmap.MAP_PRIVATE)
    buf[:len(data)] = data
    s.put("so/0/new", memoryview(buf)[:len(data)])
    os._exit(0)
""")


@pytest.mark.parametrize("step", STEPS)
def test_a_put_killed_at_any_step_leaves_no_key_with_old_bytes(tmp_path, step) -> None:
    s = _store(tmp_path)
    old = b"\x01" * (3 * MIB + 5)
    s.put("so/0/old", _aligned(old))
    s.delete(["so/0/old"])
    assert len(_pool(tmp_path)) == 1
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), step, "7"], cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=REPO), capture_output=True)
    assert r.returncode == 137, r.stderr.decode()
    again = _store(tmp_path)
    keys = again.list()
    assert keys in ([], ["so/0/new"])
    if keys:
        assert step == "_fsync_dir", "published only after its durable rename"
        assert bytes(again.get("so/0/new")) == bytes([7]) * (2 * MIB + 777)
    else:
        with pytest.raises(ObjectNotFound):
            again.get("so/0/new")
    # whatever the crash left is under a temp name no key reaches, or still in the pool
    left = [p for p in (tmp_path / "so/0").iterdir()]
    assert all(".tmp-" in p.name for p in left if p.name != "new")
    again.put("so/0/after", _aligned(b"\x02" * (2 * MIB)))
    assert bytes(again.get("so/0/after")) == b"\x02" * (2 * MIB)
