"""Shared helpers for WAL tests: small rings so wrap-around happens within a test."""
from __future__ import annotations

import os

import pytest

from storage.wal import DeltaWAL, WALConfig


@pytest.fixture
def wal_path(tmp_path):
    return str(tmp_path / "wal")


@pytest.fixture
def make_wal(wal_path):
    """Open a DeltaWAL on a small file; returns (wal, recovered records)."""
    opened: list[DeltaWAL] = []

    def make(**kw):
        kw.setdefault("path", wal_path)
        kw.setdefault("capacity", 4 << 20)
        w = DeltaWAL(WALConfig(**kw))
        recs = list(w.open())
        opened.append(w)
        return w, recs

    yield make
    for w in opened:
        try:
            w.close()
        except Exception:
            pass


@pytest.fixture
def dfd(tmp_path):
    """A 4 MiB file opened O_DIRECT (plain where the file system refuses O_DIRECT): the native
    AIO and io_uring tests write into it."""
    path = tmp_path / "f"
    path.write_bytes(b"\0" * (4 << 20))
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDWR)
    yield fd
    os.close(fd)
