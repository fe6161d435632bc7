"""storage._copycrc's frame arena faults a new slab in a page at a time (a write per page, each
fault under the slab's own VMA lock), not with one madvise(MADV_POPULATE_WRITE) over the whole
slab: that call holds the process's mmap_lock from its first page to its last (22-60 ms for a
64 MiB slab on the bench VM, 200 ms at worst), and the event loop's next mmap or munmap waited
behind it (bench/HISTORY.md, session 35 stall). Counts only: the bytes faulted in by grow and
the faults left for whoever writes the slab."""
from __future__ import annotations

import ctypes
import resource

import pytest

from storage.copycrc import frame_arena

SLAB = 64 << 20                 # broker/frames.py REGISTERED_SLAB


def _arena():
    if frame_arena is None:
        pytest.skip("storage._copycrc not built (no frame_arena)")
    return frame_arena(SLAB, 4 * SLAB, False)       # 4 KiB pages, as the io_uring WAL's


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_grow_faults_in_each_slab_it_maps_by_itself():
    arena = _arena()
    assert arena.grow(True)
    assert arena.faulted == SLAB
    assert arena.grow(True)
    assert arena.faulted == 2 * SLAB


def test_a_slab_grown_unpopulated_is_not_faulted_in():
    arena = _arena()
    assert arena.grow(False)
    assert arena.faulted == 0


def test_every_page_of_the_slab_is_there_after_grow():
    """grow's writes cover the whole slab: writing all of it again faults (almost) nothing."""
    arena = _arena()
    assert arena.grow(True)
    frame = arena.take(SLAB)                        # the slab's one free run, whole
    assert frame is not None
    c = ctypes.c_char.from_buffer(frame)
    try:
        addr = ctypes.addressof(c)
        before = _minflt()
        ctypes.memset(addr, 0x78, SLAB)             # no Python allocation in between
        faults = _minflt() - before
    finally:
        del c
    # 16,384 pages: each would fault had grow left it; a missed 2 MiB alone is 512
    assert faults < 256, faults


def test_fault_in_leaves_no_page_of_a_fresh_buffer_to_fault():
    """broker/frames.py's prefill faults its bytearray frames in with fault_in (a write per page,
    the interpreter lock released) instead of one madvise over the frame: afterwards writing
    the whole buffer faults (almost) nothing, from an unaligned start to an unaligned end."""
    from storage.copycrc import fault_in, map_buffer
    if fault_in is None or map_buffer is None:
        pytest.skip("storage._copycrc not built (no fault_in)")
    size = 16 << 20
    buf = map_buffer(size, False)                   # fresh anonymous pages, none touched
    view = memoryview(buf)[100:size - 100]          # both ends inside a page
    fault_in(view)
    c = ctypes.c_char.from_buffer(buf)
    try:
        before = _minflt()
        ctypes.memset(ctypes.addressof(c), 0x78, size)
        faults = _minflt() - before
    finally:
        del c
    assert faults < 64, faults                      # 4,096 pages: each would fault otherwise
    view.release()


def test_fault_in_refuses_a_read_only_buffer():
    from storage.copycrc import fault_in
    if fault_in is None:
        pytest.skip("storage._copycrc not built (no fault_in)")
    with pytest.raises(BufferError):
        fault_in(b"read only")
