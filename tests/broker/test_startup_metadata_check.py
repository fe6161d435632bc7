"""The start-up check of a SQLite metadata file reads it as SQLite would (with its -wal file).

A fresh clone's CI once refused a restart after a clean SIGTERM stop with "database disk image
is malformed": the check opened the file with ``immutable=1``, which ignores the -wal file,
while the database's content was still only in the WAL (another connection of the stopped
broker had kept it from being checkpointed)."""
from __future__ import annotations

import subprocess
import sys
import types

import pytest

from broker.startup_checks import StartupError, check_metadata

TABLES = 200
WRITER = f"""
import os, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
db.execute("PRAGMA journal_mode=WAL")
for i in range({TABLES}):     # a schema larger than one page: page 1 becomes an interior page
    db.execute(f"CREATE TABLE t{{i}}_{'x' * 60}(a INTEGER, b TEXT, c BLOB)")
db.commit()
os._exit(0)          # no close, no checkpoint: the schema is only in the -wal file
"""


def _checkpoint_cut_after_page_1(path) -> None:
    """Write the newest page 1 of the -wal file into the database file, as a checkpoint
    (which copies pages in page order) stopped right after its first page would."""
    wal = (path.parent / (path.name + "-wal")).read_bytes()
    page_size = int.from_bytes(wal[8:12], "big")
    newest = None
    for off in range(32, len(wal) - 24 - page_size + 1, 24 + page_size):
        if int.from_bytes(wal[off:off + 4], "big") == 1:
            newest = wal[off + 24:off + 24 + page_size]
    assert newest is not None
    with open(path, "r+b") as f:
        f.write(newest)


def _cfg(path) -> types.SimpleNamespace:
    return types.SimpleNamespace(metadata_url=f"sqlite:///{path}")


def test_database_whose_changes_are_only_in_its_wal_is_accepted(tmp_path) -> None:
    path = tmp_path / "meta.db"
    subprocess.run([sys.executable, "-c", WRITER, str(path)], check=True)
    assert (tmp_path / "meta.db-wal").stat().st_size > 0
    _checkpoint_cut_after_page_1(path)
    check_metadata(_cfg(path))                       # no StartupError: the WAL is read
    import sqlite3  # noqa: PLC0415

    db = sqlite3.connect(path)
    assert db.execute("SELECT count(*) FROM sqlite_master").fetchone() == (TABLES,)
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    db.close()


def test_garbage_file_is_refused(tmp_path) -> None:
    path = tmp_path / "meta.db"
    path.write_bytes(b"not a database at all" * 100)
    with pytest.raises(StartupError, match="cannot be read: file is not a database"):
        check_metadata(_cfg(path))
