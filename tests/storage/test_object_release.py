"""Deleted object files are given back a piece at a time (storage/objects/release.py).

On a filesystem mounted with ``discard`` an unlink of a large file discards every block in
one system call and the WAL's writes on the same disk wait behind it (hundreds of ms on the
test VM). These tests hold the mechanism to its promises on real files: no single system
call frees more than one CHUNK, a deleted key is gone at once, a reader that opened it just
before still reads it whole, a file with another name keeps its bytes, and what a crash left
in the trash is removed by the next run.
"""
from __future__ import annotations

import os
import threading

import pytest

from storage.objects import release
from storage.objects import store as store_mod
from storage.objects.release import Trash, remove, shrink
from storage.objects.store import TRASH_DIR, FileObjectStore, ObjectNotFound, ObjectStoreError

MIB = 1 << 20


class _Calls:
    """os.ftruncate / os.unlink of one test, recorded with the size each call freed."""

    def __init__(self, monkeypatch) -> None:
        self.freed: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        real_ftruncate, real_unlink = os.ftruncate, os.unlink

        def ftruncate(fd: int, length: int) -> None:
            before = os.fstat(fd).st_size
            real_ftruncate(fd, length)
            with self._lock:
                self.freed.append(("ftruncate", max(0, before - length)))

        def unlink(path, *a, **kw) -> None:
            try:
                st = os.stat(path)
                size = st.st_size if st.st_nlink == 1 else 0
            except OSError:
                size = 0
            real_unlink(path, *a, **kw)
            with self._lock:
                self.freed.append(("unlink", size))

        monkeypatch.setattr(os, "ftruncate", ftruncate)
        monkeypatch.setattr(os, "unlink", unlink)

    def largest(self) -> int:
        with self._lock:
            return max((n for _, n in self.freed), default=0)


def _file(path, size: int) -> str:
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    return str(path)


def test_shrink_cuts_from_the_end_a_chunk_at_a_time(tmp_path, monkeypatch) -> None:
    p = _file(tmp_path / "f", 5 * MIB + 123)
    with open(p, "rb") as f:
        head = f.read(MIB + 7)
    calls = _Calls(monkeypatch)
    fd = os.open(p, os.O_WRONLY)
    try:
        shrink(fd, MIB + 7, chunk=MIB, pause_max_s=0.001)
    finally:
        os.close(fd)
    assert os.path.getsize(p) == MIB + 7
    with open(p, "rb") as f:
        assert f.read() == head                       # the kept part is untouched
    assert [k for k, _ in calls.freed] == ["ftruncate"] * 5
    assert calls.largest() <= MIB


def test_shrink_rests_after_each_cut_but_the_last_never_longer_than_the_cap(tmp_path) -> None:
    p = _file(tmp_path / "f", 4 * MIB)
    for cap in (10.0, 0.0):
        os.truncate(p, 4 * MIB)
        slept: list[float] = []
        fd = os.open(p, os.O_WRONLY)
        try:
            shrink(fd, 0, chunk=MIB, pause_max_s=cap, sleep=slept.append)
        finally:
            os.close(fd)
        assert os.path.getsize(p) == 0
        assert len(slept) == 3                          # 4 cuts, no rest after the last
        assert all(0 <= s <= cap for s in slept)
        if cap:
            assert 0 < sum(slept) < 5                   # as long as the cuts took
        else:
            assert sum(slept) == 0


def test_remove_gives_a_large_file_back_in_pieces_and_unlinks_it(tmp_path, monkeypatch) -> None:
    p = _file(tmp_path / "big", 6 * MIB)
    calls = _Calls(monkeypatch)
    remove(p, chunk=MIB, pause_max_s=0.0)
    assert not os.path.exists(p)
    assert calls.largest() <= MIB
    assert calls.freed[-1] == ("unlink", 0)
    remove(p)                                           # gone: nothing to do


def test_remove_leaves_a_second_name_whole(tmp_path) -> None:
    data = os.urandom(3 * MIB)
    p = tmp_path / "a"
    p.write_bytes(data)
    os.link(p, tmp_path / "b")                          # e.g. a rename a crash split
    remove(str(p), chunk=MIB, pause_max_s=0.0)
    assert not p.exists()
    assert (tmp_path / "b").read_bytes() == data


def test_the_trash_keeps_a_file_whole_for_a_reader_until_its_quarantine_ends(tmp_path) -> None:
    data = os.urandom(4 * MIB)
    p = tmp_path / "obj"
    p.write_bytes(data)
    trash = Trash(str(tmp_path / "trash"), quarantine_s=0.5)
    reader = os.open(p, os.O_RDONLY)                     # opened just before the delete
    try:
        assert trash.put(str(p))
        assert not p.exists()                           # the name is gone at once
        assert trash.pending() == 1
        assert os.pread(reader, len(data), 0) == data   # and the reader reads it whole
        assert trash.wait_empty(timeout=30)
        assert os.listdir(tmp_path / "trash") == []
        assert os.fstat(reader).st_size == 0            # then its blocks were given back
    finally:
        os.close(reader)
    assert not trash.put(str(p))                        # missing: nothing moved


def test_a_store_delete_never_frees_a_large_object_in_one_call(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(store_mod, "RECYCLE_QUARANTINE_S", 0.0)
    s = FileObjectStore(str(tmp_path), recycle_bytes=0)     # no pool: every delete removes
    s.put("so/0/1", os.urandom(8 * MIB + 5))
    s.put("so/0/2", b"small")
    calls = _Calls(monkeypatch)
    s.delete(["so/0/1", "so/0/2"])
    for key in ("so/0/1", "so/0/2"):                    # gone at once, as with an unlink
        with pytest.raises(ObjectNotFound):
            s.get(key)
    assert s.list() == []
    with pytest.raises(ObjectStoreError):
        s.get(f"{TRASH_DIR}/x")                          # the trash is never a key
    assert s._trash.wait_empty(timeout=30)
    assert os.listdir(tmp_path / TRASH_DIR) == []
    assert calls.largest() <= release.CHUNK


def test_a_recycled_files_longer_tail_is_cut_in_pieces(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(store_mod, "RECYCLE_QUARANTINE_S", 0.0)
    s = FileObjectStore(str(tmp_path))
    s.put("so/0/1", os.urandom(12 * MIB))
    s.delete(["so/0/1"])                                # into the pool
    calls = _Calls(monkeypatch)
    new = os.urandom(7 * MIB + 3)
    s.put("so/0/2", new)                                # takes the 12 MiB file, cuts 5 MiB
    assert bytes(s.get("so/0/2")) == new
    assert any(k == "ftruncate" for k, _ in calls.freed)
    assert calls.largest() <= release.CHUNK


def test_a_restarted_store_removes_what_the_last_run_left_in_the_trash(tmp_path) -> None:
    d = tmp_path / TRASH_DIR
    d.mkdir()
    for i in range(3):
        _file(d / f"left{i}", 2 * MIB)
    s = FileObjectStore(str(tmp_path))
    assert s._trash.wait_empty(timeout=30)
    assert os.listdir(d) == []
    assert s.list() == []


def test_a_file_the_trash_cannot_remove_is_logged_and_the_rest_still_goes(tmp_path, caplog) -> None:
    d = tmp_path / "trash"
    d.mkdir()
    (d / "a-dir").mkdir()                                # cannot be opened for writing
    _file(d / "b-file", 2 * MIB)
    trash = Trash(str(d), quarantine_s=0.0)
    trash.resume()
    assert trash.wait_empty(timeout=30)
    assert sorted(os.listdir(d)) == ["a-dir"]
    assert "could not remove deleted object file" in caplog.text
    p = _file(tmp_path / "later", 2 * MIB)                # the thread is still there
    assert trash.put(p)
    assert trash.wait_empty(timeout=30)
    assert sorted(os.listdir(d)) == ["a-dir"]
