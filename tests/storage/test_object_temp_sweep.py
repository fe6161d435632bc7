"""FileObjectStore.sweep_temp_files: temp files of puts killed mid-way (kill -9 between the
temp file's creation and its rename) are swept - into the recycle pool when large enough, else
unlinked - but never a live put's, in this process or another one sharing the directory (real
files, real child processes stopped or killed in the middle of a put)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from bench.common import tied_popen
from storage.engine import open_engine
from storage.objects import store as store_mod
from storage.objects.store import RECYCLE_DIR, TEMP_MARK, FileObjectStore

from storage_helpers import small_config

MIB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a put that stops after writing its first piece (1 MiB, or the whole object if smaller) and
# says so: the parent then finds its temp file, and stops or kills the child
CHILD = textwrap.dedent("""
    import os, sys, time
    from storage.objects import store as m
    root, size = sys.argv[1], int(sys.argv[2])
    s = m.FileObjectStore(root)

    def stall(fd):
        print("in put", flush=True)
        time.sleep(600)

    m.os.fdatasync = stall
    s.put("sso/0/7", b"\\x07" * size)
""")


def _temps(root) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root)
                  for n in names if TEMP_MARK in n)


def _pool(root) -> list[str]:
    d = os.path.join(root, RECYCLE_DIR)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _put_in_child(root, size: int) -> subprocess.Popen:
    """A child process stopped inside a put of ``size`` bytes, its temp file written."""
    p = tied_popen([sys.executable, "-c", CHILD, str(root), str(size)], cwd=REPO,
                   env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"in put\n"
    return p


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait()
    p.stdout.close()


@pytest.mark.parametrize("size", [2 * MIB, 100_000])
def test_a_put_killed_mid_way_leaves_a_temp_file_that_is_swept(tmp_path, size) -> None:
    p = _put_in_child(tmp_path, size)
    _kill(p)
    [tmp] = _temps(tmp_path)
    s = FileObjectStore(str(tmp_path))
    assert s.sweep_temp_files() == 0, "too fresh: could be a put between create and lock"
    assert s.sweep_temp_files(min_age_s=0) == 1
    assert _temps(tmp_path) == [] and not os.path.exists(tmp)
    # a big one (its first 1 MiB piece was written) is kept for reuse, a small one unlinked
    assert len(_pool(tmp_path)) == (1 if size >= store_mod.RECYCLE_MIN else 0)
    assert s.list() == []
    s.put("sso/0/8", b"\x08" * (2 * MIB))          # reuses the pooled file
    assert bytes(s.get("sso/0/8")) == b"\x08" * (2 * MIB)


def test_a_live_put_of_another_process_is_never_swept(tmp_path) -> None:
    p = _put_in_child(tmp_path, 2 * MIB)            # stopped in its put, not dead
    try:
        [tmp] = _temps(tmp_path)
        s = FileObjectStore(str(tmp_path))
        assert s.sweep_temp_files(min_age_s=0) == 0
        assert _temps(tmp_path) == [tmp] and _pool(tmp_path) == []
    finally:
        _kill(p)
    assert s.sweep_temp_files(min_age_s=0) == 1     # dead now: its lock went with it


def test_a_live_put_of_this_process_is_never_swept(tmp_path, monkeypatch) -> None:
    s = FileObjectStore(str(tmp_path))
    seen = []

    def sweep_during_put(fd):                      # another store of the same directory
        seen.append(FileObjectStore(str(tmp_path)).sweep_temp_files(min_age_s=0))
        seen.append(len(_temps(tmp_path)))
    monkeypatch.setattr(store_mod.os, "fdatasync", sweep_during_put)
    s.put("sso/0/1", b"\x01" * (2 * MIB))
    assert seen[:2] == [0, 1]
    assert bytes(s.get("sso/0/1")) == b"\x01" * (2 * MIB)


async def test_the_engine_sweeps_at_start_and_takes_its_recycle_bound(tmp_path,
                                                                     monkeypatch) -> None:
    monkeypatch.setattr(store_mod, "TEMP_SWEEP_AGE_S", 0.0)
    objects = tmp_path / "objects"
    _kill(_put_in_child(objects, 2 * MIB))
    assert len(_temps(objects)) == 1
    eng = open_engine(small_config(tmp_path, object_recycle_bytes=3 * MIB))
    await eng.start()
    try:
        assert eng.store.recycle_bytes == 3 * MIB
        for _ in range(500):                       # swept in the background
            if not _temps(objects):
                break
            await asyncio.sleep(0.01)
        assert _temps(objects) == [] and len(_pool(objects)) == 1
    finally:
        await eng.close()
