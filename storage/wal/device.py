"""The raw device under the WAL: a block device or a preallocated file, written with O_DIRECT.

O_DIRECT alone does not make a write durable on a drive with a volatile cache, so every
write is followed by a durability barrier chosen by `sync_mode` (O_DSYNC on open, or
fdatasync per written block). Where O_DIRECT is refused (tmpfs, some FUSE), the device falls
back to buffered writes plus fdatasync and logs a warning once.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import threading
import time

from .errors import CapacityMismatchError, WALError, WALLockedError, WALPathError
from .format import ALIGN, HEADER_AREA, HEADER_SLOT_SIZE, WALHeader, align_up, newest_header

log = logging.getLogger(__name__)

_BLKGETSIZE64 = 0x80081272
_warned_fallback = False
_warn_lock = threading.Lock()


HUGE_PAGE = 2 << 20


def aligned_buffer(size: int) -> mmap.mmap:
    """An anonymous, page-aligned, zero-filled buffer usable for O_DIRECT IO.

    Private (not the shared anonymous memory mmap gives by default: that is shmem, which gets
    no transparent huge pages here), kept out of forked children (no copy-on-write under a
    write in flight), and, from 2 MiB up, backed by huge pages where the kernel allows: see
    hugepage_arena()."""
    size = align_up(max(size, ALIGN))
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _advise(buf, 0, size)
    return buf


def hugepage_arena(size: int) -> tuple[mmap.mmap, int]:
    """A private mapping with `size` bytes starting at a 2 MiB boundary: returns the mapping
    and that offset. Why: an O_DIRECT write from 4 KiB pages is pinned page by page and split
    by the device's segment limit (a loop device takes 128 segments: 512 KiB of scattered
    pages); from huge pages it is a few contiguous segments. Raw AIO on a loop device, 4 x
    1 MiB in flight: io_submit 6-10 us per write instead of 26-35, 2678-2833 MB/s instead of
    1716-2428 (bench/HISTORY.md, session 9)."""
    size = align_up(size, HUGE_PAGE)
    buf = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe = ctypes.c_char.from_buffer(buf)
    off = -ctypes.addressof(probe) % HUGE_PAGE
    del probe
    _advise(buf, off, size)
    return buf, off


def _advise(buf: mmap.mmap, start: int, length: int) -> None:
    """Keep the mapping out of forked children and ask for huge pages over [start,
    start+length) when it holds a whole one. Advice only: refused advice changes nothing."""
    advice = [(getattr(mmap, "MADV_DONTFORK", None), 0, len(buf))]
    if length >= HUGE_PAGE:
        advice.append((getattr(mmap, "MADV_HUGEPAGE", None), start, length))
    for option, lo, n in advice:
        if option is None:
            continue
        try:
            buf.madvise(option, lo, n)
        except (OSError, ValueError):
            pass


def _device_size(fd: int, st: os.stat_result) -> int:
    if stat.S_ISBLK(st.st_mode):
        try:
            buf = fcntl.ioctl(fd, _BLKGETSIZE64, b"\0" * 8)
            return struct.unpack("Q", buf)[0]
        except OSError:
            return os.lseek(fd, 0, os.SEEK_END)
    return st.st_size


# How much of an existing file or device must be zero for it to count as blank (formattable
# without --wal-format): the header slots plus the start of the ring. A filesystem, partition
# table or LVM label always writes inside this range.
BLANK_PROBE_BYTES = 1 << 20


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << (shift - 4)) == 0:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} bytes"


def lock_holder(path: str) -> str:
    """Who holds a lock on path, from /proc/locks: "pid N (command line)" or "" if unknown."""
    try:
        st = os.stat(path)
        ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as fh:
            for line in fh:
                parts = line.split()
                if "->" in parts:
                    continue
                if len(parts) >= 6 and parts[5] == ident:
                    pid = int(parts[4])
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as c:
                            cmd = c.read().replace(b"\0", b" ").decode(errors="replace").strip()
                    except OSError:
                        cmd = ""
                    return f"pid {pid}" + (f" ({cmd[:120]})" if cmd else "")
    except (OSError, ValueError):
        pass
    return ""


def lock_exclusive(fd: int, path: str, what: str = "WAL") -> None:
    """Take the exclusive, non-blocking flock that keeps a second broker off this file or
    device (released when the descriptor closes, also on kill -9)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = lock_holder(path)
        raise WALLockedError(f"{what} {path} is in use by another process"
                             + (f": {holder}" if holder else "")
                             + "; stop that broker first or give this one its own --wal") from None


def open_exclusive_probe(path: str, is_block_device: bool) -> int:
    """A read-only descriptor; on a block device with O_EXCL, which the kernel refuses (EBUSY)
    while the device is mounted or claimed by another O_EXCL opener through any device node,
    not only this path (flock sees only this inode)."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if is_block_device:
        flags |= os.O_EXCL
    return os.open(path, flags)


def busy_message(path: str, apath: str) -> str:
    holder = lock_holder(apath)
    return (f"WAL {path} is in use (" + (f"another broker: {holder}" if holder else
                                         "mounted, or claimed by another process")
            + "); stop it first or give this broker its own --wal")


def classify(head: bytes | memoryview) -> tuple[str, WALHeader | None]:
    """What the first bytes of a file/device hold: ("wal", header), ("blank", None) for all
    zeros, or ("foreign", None) for data that is not an s3kafka WAL."""
    hdr = newest_header(head[:HEADER_SLOT_SIZE], head[HEADER_SLOT_SIZE:HEADER_AREA])
    if hdr is not None:
        return "wal", hdr
    if not any(head):
        return "blank", None
    return "foreign", None


def inspect_wal_path(path: str, capacity: int, allow_format: bool = False) -> str:
    """Check, without changing anything, that path can hold a WAL of `capacity` bytes.

    Returns "new" (the file will be created), "blank", "wal" or "format" (foreign data that
    allow_format lets the broker erase). Raises WALPathError / CapacityMismatchError /
    WALLockedError with a one-line message otherwise: a path under /dev that does not exist
    (never create a regular file there), a directory, a device or file smaller than the
    capacity with no room to grow, foreign data, a WAL formatted with another capacity, or a
    WAL another process holds."""
    apath = os.path.abspath(path)
    try:
        st = os.stat(apath)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise WALPathError(f"cannot use WAL path {path}: {e.strerror}") from None
    if st is None:
        if apath == "/dev" or apath.startswith("/dev/"):
            raise WALPathError(f"WAL device {path} does not exist (a path under /dev must be an "
                               "existing block device; s3kafka never creates files there)")
        parent = os.path.dirname(apath)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise WALPathError(f"cannot create WAL file {path}: {parent} is not a directory")
        if not os.access(parent, os.W_OK):
            raise WALPathError(f"cannot create WAL file {path}: {parent} is not writable")
        _check_space(path, parent, capacity, 0)
        return "new"
    if stat.S_ISDIR(st.st_mode):
        raise WALPathError(f"WAL path {path} is a directory; --wal names a file or block "
                           "device (default <data-dir>/wal)")
    is_blk = stat.S_ISBLK(st.st_mode)
    if not is_blk and not stat.S_ISREG(st.st_mode):
        raise WALPathError(f"WAL path {path} is neither a regular file nor a block device")
    try:
        fd = open_exclusive_probe(apath, is_blk)
    except OSError as e:
        if e.errno == errno.EBUSY:
            raise WALLockedError(busy_message(path, apath)) from None
        raise WALPathError(f"cannot open WAL {path}: {e.strerror}") from None
    try:
        size = _device_size(fd, os.fstat(fd))
        head = os.pread(fd, BLANK_PROBE_BYTES, 0)
        try:                                   # a lock probe: released again at close
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(apath)
            hdr = newest_header(head[:HEADER_SLOT_SIZE], head[HEADER_SLOT_SIZE:HEADER_AREA])
            node = f", node {hdr.node_id}" if hdr is not None else ""
            raise WALLockedError(f"WAL {path} is in use by another broker ("
                                 + (holder or "holder unknown") + node
                                 + "); stop it first or give this broker its own --wal"
                                 ) from None
    finally:
        os.close(fd)
    kind, hdr = classify(head)
    if kind == "wal":
        assert hdr is not None
        if hdr.capacity != capacity:
            raise CapacityMismatchError(
                f"WAL {path} was formatted with capacity {hdr.capacity} ({_human(hdr.capacity)})"
                f" but the configured capacity is {capacity} ({_human(capacity)}); start with "
                f"--wal-capacity {hdr.capacity}")
    elif kind == "foreign" and not allow_format:
        raise WALPathError(
            f"WAL {path} holds data that is not an s3kafka WAL; refusing to overwrite it "
            "(pass --wal-format to erase and format it)")
    if is_blk:
        if size < capacity:
            raise WALPathError(f"WAL device {path} has {size} bytes ({_human(size)}), less "
                               f"than the WAL capacity {capacity} ({_human(capacity)}); "
                               f"pass --wal-capacity {size // ALIGN * ALIGN} or less")
    elif size < capacity:
        _check_space(path, os.path.dirname(apath), capacity, st.st_blocks * 512)
    return {"wal": "wal", "blank": "blank", "foreign": "format"}[kind]


def _check_space(path: str, directory: str, capacity: int, allocated: int) -> None:
    """Refuse a WAL file the filesystem cannot hold (before anything is preallocated)."""
    try:
        vfs = os.statvfs(directory)
    except OSError:
        return
    free = vfs.f_bavail * vfs.f_frsize
    need = capacity - allocated
    if need > free:
        fit = max((free + allocated) // 2 // ALIGN * ALIGN, 0)
        raise WALPathError(
            f"no space for the WAL {path}: its capacity {capacity} ({_human(capacity)}) needs "
            f"{_human(need)} more, the filesystem has {_human(free)} free; pass a smaller "
            f"--wal-capacity (e.g. {_human(fit)}) or free space")


LOOP_MAJOR = 7      # Linux loop devices (include/uapi/linux/major.h)


def on_loop_device(st: os.stat_result) -> bool:
    """Whether writes to what ``st`` describes are served by a loop device's kernel worker:
    the device itself, or a file on a file system mounted from one."""
    dev = st.st_rdev if stat.S_ISBLK(st.st_mode) else st.st_dev
    return os.major(dev) == LOOP_MAJOR


class Device:
    """Positional, aligned reads and writes with the configured durability barrier."""

    def __init__(self, path: str, capacity: int, sync_mode: str = "dsync",
                 lock: bool = False) -> None:
        self.path = path
        self.lock = lock
        self.capacity = capacity
        self.sync_mode = sync_mode
        self.direct = True
        self.is_block_device = False
        self.on_loop_device = False     # writes served by a loop device's kernel worker
        self.created = False
        self._fd = -1
        self._open()

    # -- opening -------------------------------------------------------------------------
    def _flags(self, direct: bool) -> int:
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        if direct:
            flags |= os.O_DIRECT
        if direct and self.sync_mode == "dsync":
            flags |= os.O_DSYNC         # buffered fallback uses fdatasync instead
        return flags

    def _open(self) -> None:
        apath = os.path.abspath(self.path)
        exists = os.path.exists(self.path)
        if exists:
            st = os.stat(self.path)
            self.is_block_device = stat.S_ISBLK(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                raise WALPathError(f"WAL path {self.path} is a directory")
        if not exists:
            if apath == "/dev" or apath.startswith("/dev/"):
                raise WALPathError(f"WAL device {self.path} does not exist (s3kafka never "
                                   "creates files under /dev)")
            parent = os.path.dirname(apath)
            os.makedirs(parent, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            self.created = True
        try:
            fd = os.open(self.path, self._flags(True))
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise WALError(f"cannot open WAL device {self.path}: {e}") from e
            fd = os.open(self.path, self._flags(False))
            self.direct = False
        self._fd = fd
        try:
            if self.lock:
                lock_exclusive(fd, self.path)
            st = os.fstat(fd)
            self.on_loop_device = on_loop_device(st)
            size = _device_size(fd, st)
            if self.is_block_device:
                if size < self.capacity:
                    raise CapacityMismatchError(
                        f"device {self.path} has {size} bytes, less than the configured WAL "
                        f"capacity {self.capacity}")
            elif size < self.capacity:
                self._preallocate(size)
            if self.direct and not self._probe_direct():
                # the lock belongs to the open file description: take it again on the new
                # one (the data-dir lock keeps a second broker of this data dir out meanwhile)
                os.close(fd)
                self._fd = os.open(self.path, self._flags(False))
                if self.lock:
                    lock_exclusive(self._fd, self.path)
                self.direct = False
            if self.direct and not self.is_block_device and size < self.capacity:
                self._zero_fill(align_up(size))
        except BaseException:
            self.close()
            raise
        if not self.direct:
            global _warned_fallback
            with _warn_lock:
                if not _warned_fallback:
                    _warned_fallback = True
                    log.warning("O_DIRECT refused for %s; using buffered writes + fdatasync",
                                self.path)
            if self.sync_mode == "none":
                log.warning("sync_mode=none without O_DIRECT: acknowledged data may sit in the "
                            "page cache")

    def _preallocate(self, size: int) -> None:
        """Reserve the whole ring now so a full filesystem fails at start, not mid-write."""
        try:
            os.posix_fallocate(self._fd, 0, self.capacity)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                os.ftruncate(self._fd, self.capacity)
            else:
                raise WALError(f"cannot preallocate {self.capacity} bytes for {self.path}: {e}"
                               ) from e
        os.fsync(self._fd)
        if size == 0:
            self.created = True

    def _zero_fill(self, start: int) -> None:
        """Write zeros over the newly reserved range once. fallocate leaves "unwritten" extents:
        the first O_DSYNC write into each one converts it, which costs a journal commit per
        write (measured: first lap 1.3 GB/s, p99 2.1 ms vs 2.1 GB/s, p99 0.8 ms later)."""
        total = self.capacity - start
        if total <= 0:
            return
        t0 = time.monotonic()
        chunk = min(8 << 20, total)
        buf = aligned_buffer(chunk)
        try:
            pos = start
            while pos < self.capacity:
                n = min(chunk, self.capacity - pos)
                self._write_all(memoryview(buf)[:n], pos)
                pos += n
        finally:
            buf.close()
        os.fsync(self._fd)
        took = time.monotonic() - t0
        (log.info if took > 1 else log.debug)(
            "WAL file %s: zero-filled %d MiB in %.1f s", self.path, total >> 20, took)

    def _probe_direct(self) -> bool:
        buf = aligned_buffer(ALIGN)
        try:
            os.preadv(self._fd, [buf], 0)
            return True
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False
            raise
        finally:
            buf.close()

    # -- IO ------------------------------------------------------------------------------
    def write(self, buf, position: int) -> None:
        """Write the whole buffer at position (both aligned) and make it durable."""
        self._write_all(buf, position)
        self._barrier()

    def _write_all(self, buf, position: int) -> None:
        view = memoryview(buf)
        done = 0
        total = len(view)
        while done < total:
            n = os.pwritev(self._fd, [view[done:]], position + done)
            if n <= 0:
                raise WALError(f"short write on {self.path} at {position + done}")
            done += n

    def _barrier(self) -> None:
        if self.sync_mode == "fdatasync" or (not self.direct and self.sync_mode != "none"):
            os.fdatasync(self._fd)

    def writev(self, bufs: list, position: int) -> None:
        """Write consecutive aligned buffers with one pwritev, then the durability barrier."""
        if len(bufs) == 1:
            self.write(bufs[0], position)
            return
        total = sum(len(b) for b in bufs)
        done = os.pwritev(self._fd, bufs, position)
        if done < total:                      # rare short write: finish piece by piece
            at = 0
            for b in bufs:
                end = at + len(b)
                if end > done:
                    start = max(done, at) - at
                    self._write_all(memoryview(b)[start:], position + at + start)
                at = end
        self._barrier()

    def read_into(self, buf, position: int) -> int:
        """Fill an aligned buffer from position; returns bytes read."""
        view = memoryview(buf)
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], position + done)
            if n <= 0:
                break
            done += n
        return done

    def read(self, position: int, length: int) -> bytes:
        """Read an arbitrary (unaligned) range through an aligned bounce buffer."""
        start = position - position % ALIGN
        end = align_up(position + length)
        buf = aligned_buffer(end - start)
        try:
            self.read_into(buf, start)
            return bytes(buf[position - start:position - start + length])
        finally:
            buf.close()

    def sync(self) -> None:
        """Explicit barrier (used after header writes when not O_DSYNC)."""
        if self.sync_mode != "none":
            os.fdatasync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            finally:
                self._fd = -1

    @property
    def fd(self) -> int:
        return self._fd
