"""A loop device over a sparse file, for the tests that put a WAL on a real block device.

Needs root and losetup; otherwise the test is skipped. ``losetup -f`` picks the first free
device: two pytest-xdist workers attaching at once could pick the same one, so attaching is
serialised by a machine-wide file lock (a lost race would otherwise skip the test silently).
"""
from __future__ import annotations

import contextlib
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest
from filelock import FileLock

_LOCK = pathlib.Path(tempfile.gettempdir()) / "s3kafka-tests-losetup.lock"


@contextlib.contextmanager
def loop_device(backing: pathlib.Path, size: int) -> Iterator[str]:
    """Create ``backing`` (sparse, ``size`` bytes), attach it; yield the device path; detach."""
    if shutil.which("losetup") is None:
        pytest.skip("losetup is not installed: cannot create a loop device")
    with open(backing, "wb") as f:
        f.truncate(size)
    try:
        with FileLock(str(_LOCK)):
            dev = subprocess.run(["losetup", "-f", "--show", str(backing)], check=True,
                                 capture_output=True, text=True).stdout.strip()
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"losetup cannot attach a loop device here: {e}")
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)
