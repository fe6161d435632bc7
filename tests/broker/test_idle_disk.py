"""An idle broker does not flush the disk: its lease renewals (two SQLite commits a second)
commit without a flush (storage/sqldb.py ``relax``). Each flush is a cache flush of the device
the WAL shares: on a disk without FUA every acks=all WAL write waits for one too."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")


def _flushes(pid: int, seconds: float) -> list[str]:
    """fsync/fdatasync calls of ``pid``'s threads during ``seconds`` (strace -f -y)."""
    r = subprocess.run(["timeout", "-s", "INT", str(seconds), "strace", "-f", "-y", "-qq",
                        "-e", "trace=fsync,fdatasync", "-p", str(pid)],
                       capture_output=True, text=True, timeout=seconds + 30)
    if "Operation not permitted" in r.stderr:
        pytest.skip(f"strace cannot attach here: {r.stderr.strip().splitlines()[0]}")
    return [ln for ln in r.stderr.splitlines() if re.search(r"\b(fsync|fdatasync)\(", ln)]


def test_an_idle_broker_does_not_flush_its_metadata_every_second(broker) -> None:
    time.sleep(1.5)                       # start-up's own commits are done
    calls = _flushes(broker.proc.pid, 4.0)
    meta = [ln for ln in calls if "meta.db" in ln]
    # before: 2 a second (heartbeat and controller renewals at synchronous=FULL)
    assert meta == [], meta
    assert os.path.exists(broker.data_dir / "meta.db")   # it does use SQLite here
