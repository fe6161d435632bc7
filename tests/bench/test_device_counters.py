"""bench.device's disk counters: what rawload sets against the bytes produced (issue 20 item 1:
the device under the WAL and the file:// objects writes every produced byte twice)."""
from __future__ import annotations

import os

import pytest

from bench import device


def test_the_counters_of_the_disk_under_a_directory_count_what_is_written_there(tmp_path) -> None:
    disk = device.device_of(str(tmp_path))
    if disk is None:
        pytest.skip("no block device under the temporary directory (tmpfs or no /proc/diskstats)")
    before = device.disk_counters(disk)
    assert before
    data = os.urandom(1 << 20)
    with open(tmp_path / "f", "wb") as f:
        for _ in range(8):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    after = device.disk_counters(disk)
    written, busy = device.disk_writes(before, after, 1.0)
    assert written >= 8 << 20                  # at least the 8 MiB made durable
    assert busy >= 0


def test_no_disk_reads_as_unknown(tmp_path) -> None:
    assert device.disk_counters(None) == {}
    assert device.disk_counters("no-such-disk-s3kbench") == {}
    assert device.device_of(str(tmp_path / "missing")) is None
    assert device.disk_writes({}, {"disk write sectors": 1.0, "disk busy ms": 1.0}, 1.0) is None
