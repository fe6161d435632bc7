"""Where the filesystem refuses O_DIRECT (ramfs), the WAL falls back to buffered writes."""
from __future__ import annotations

import logging
import subprocess

import pytest

from storage.wal import DeltaWAL, WALConfig
from storage.wal import device as device_mod


@pytest.fixture
def ramfs_dir(tmp_path):
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "ramfs", "none", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount ramfs (needs root): {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_buffered_fallback_warns_once_and_keeps_data(ramfs_dir, caplog, monkeypatch):
    monkeypatch.setattr(device_mod, "_warned_fallback", False)
    caplog.set_level(logging.WARNING, logger="storage.wal.device")
    for name in ("a", "b"):
        w = DeltaWAL(WALConfig(path=str(ramfs_dir / name), capacity=1 << 20))
        list(w.open())
        assert not w.direct_io
        rs = [w.append(bytes([i]) * 3000, stream_id=i % 2) for i in range(50)]
        for r in rs:
            r.future.result(10)
        w.close()
        w = DeltaWAL(WALConfig(path=str(ramfs_dir / name), capacity=1 << 20))
        assert [b for _, b in w.open()] == [bytes([i]) * 3000 for i in range(50)]
        w.close()
    warnings = [r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]
    assert len(warnings) == 1
