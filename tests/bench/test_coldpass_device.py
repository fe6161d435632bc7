"""bench.coldpass's device pass: plain reads of the pass's object files, every byte once."""
from __future__ import annotations

import os

from bench import coldpass


def test_device_pass_reads_every_object_file_whole(tmp_path) -> None:
    objects = tmp_path / "objects" / "so" / "0"
    objects.mkdir(parents=True)
    sizes = {"000000000001": 3 * 4096, "000000000002": 5 * 4096 + 100, "000000000003": 0}
    for name, n in sizes.items():
        (objects / name).write_bytes(os.urandom(n))
    (objects / "000000000004.tmp-abc").write_bytes(b"x" * 4096)   # an upload not yet published
    # 8 KiB pieces: files longer than one piece are read in several calls, the tail short
    st = coldpass.device_pass(str(tmp_path / "objects"), threads=2, piece=8192, dev=None)
    assert st["files"] == 3
    assert st["bytes"] == sum(sizes.values())
    assert st["seconds"] > 0
