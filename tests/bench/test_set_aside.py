"""bench.common.set_aside: a bench broker's files give their space back at once and keep their
inodes until the bench process ends (ext4 without a journal makes every file create skip the
inodes deleted in the last minutes, so deleting one step's objects slowed the next step's puts)."""
from __future__ import annotations

import os

from bench import common


def test_set_aside_empties_files_in_place_and_deletes_the_tree_at_the_end(tmp_path) -> None:
    root = tmp_path / "broker"
    (root / "data" / "objects").mkdir(parents=True)
    obj = root / "data" / "objects" / "o1"
    obj.write_bytes(os.urandom(1 << 20))
    wal = root / "data" / "wal"
    wal.write_bytes(b"w" * 8192)
    inode = obj.stat().st_ino
    common.set_aside(str(root))
    try:
        assert obj.stat().st_size == 0 and wal.stat().st_size == 0
        assert obj.stat().st_ino == inode            # the same file, not a new one
        assert str(root) in common._SET_ASIDE
    finally:
        common._delete_set_aside()
    assert not root.exists()
    assert common._SET_ASIDE == []
