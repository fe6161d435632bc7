"""The device layer: preallocation of a WAL file is really written, never clobbering data."""
from __future__ import annotations

import os
import subprocess

from storage.wal.device import Device
from storage.wal.format import ALIGN


def _extents_unwritten(path: str) -> bool | None:
    """True when filefrag reports an 'unwritten' extent, None when filefrag is unavailable."""
    try:
        r = subprocess.run(["filefrag", "-v", path], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return "unwritten" in r.stdout


def test_new_wal_file_is_zero_filled_to_capacity(tmp_path):
    path = str(tmp_path / "wal")
    d = Device(path, 8 << 20, "dsync")
    assert d.created and d.direct
    d.close()
    assert os.path.getsize(path) == 8 << 20
    with open(path, "rb") as f:
        assert f.read() == bytes(8 << 20)
    # written, not merely reserved: no extent is left "unwritten" for the first lap to convert
    assert _extents_unwritten(path) in (False, None)


def test_growing_a_short_file_keeps_its_data(tmp_path):
    path = str(tmp_path / "wal")
    head = os.urandom(3 * ALIGN + 100)               # unaligned old size
    with open(path, "wb") as f:
        f.write(head)
    d = Device(path, 4 << 20, "dsync")
    d.close()
    with open(path, "rb") as f:
        data = f.read()
    assert len(data) == 4 << 20
    assert data[:len(head)] == head
    assert data[len(head):] == bytes(len(data) - len(head))
