"""Start-up checks: every mistake a user can make is found before anything changes on disk.

Order (broker/cli.py runs it before the event loop starts):
1. read-only checks: the data directory is (or can be made) a
   writable directory that no other broker holds, the WAL path is usable (not a directory, not
   a missing device, no foreign data, the same capacity as its header, room on the
   filesystem, not locked), the metadata database's directory is writable, the listen
   address is free;
2. the object store: reachable, bucket exists, a small object can be written, read back and
   deleted, all within a bounded time (a black-holed endpoint must not stall start-up);
3. only then: the data directory is created and locked (``<data-dir>/broker.lock`` names the
   holder: pid, host, node id) and the WAL file is locked, both for the life of the process.

A failure raises StartupError with one line; the CLI prints it and exits non-zero.
"""
from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from .config import BrokerConfig

T = TypeVar("T")

log = logging.getLogger(__name__)

LOCK_FILE = "broker.lock"
STORE_CHECK_TIMEOUT_S = 15.0        # upper bound on the whole object store check
RESTART_STORE_CHECK_S = 2.0         # ... on a restart (WAL holds data), where it never refuses:
                                    # a black-holed store must not keep the listener closed
DEGRADED_WARN_INTERVAL_S = 60.0     # a degraded broker re-checks and warns this often


class StartupError(Exception):
    """A configuration or environment mistake found at start: the message is one line."""


@dataclass
class Startup:
    """What the checks hold for the life of the process (locks) and found (store state)."""

    lock_fds: list[int] = field(default_factory=list)
    created: list[str] = field(default_factory=list)   # paths the locks created (undo list)
    store_error: str = ""           # "" = the object store check passed
    degraded_reason: str = ""       # why the broker starts although store_error is set
    started: bool = False           # set once the broker serves (a later failure keeps files)
    wal_fd: int | None = None       # the WAL's lock (also in lock_fds)

    def release_wal(self) -> None:
        """Drop the WAL's lock (a fenced node waiting for its taker, which must open it)."""
        if self.wal_fd is not None:
            self.lock_fds.remove(self.wal_fd)
            os.close(self.wal_fd)
            self.wal_fd = None

    def lock_wal_again(self, cfg: BrokerConfig) -> None:
        """Take the WAL's lock again after release_wal (waiting while a taker holds it)."""
        if self.wal_fd is None:
            self.wal_fd = after_takeover(cfg, lambda: lock_wal(cfg, []))
            self.lock_fds.append(self.wal_fd)

    def release(self, undo: bool = False) -> None:
        """Drop the locks; with undo (start-up failed) also remove what taking them created,
        where it is still empty, so a failed start leaves the disk as it found it. Files go
        while still locked, so no other broker can lock a file that is then removed."""
        if undo:
            for path in reversed(self.created):
                try:
                    if os.path.isdir(path):
                        continue
                    if os.path.getsize(path) == 0 or os.path.basename(path) == LOCK_FILE:
                        os.unlink(path)
                except OSError:
                    pass
        for fd in self.lock_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.lock_fds.clear()
        if undo:
            for path in reversed(self.created):
                try:
                    if os.path.isdir(path):
                        os.rmdir(path)          # only when empty
                except OSError:
                    pass
        self.created.clear()


def redact_url(url: str) -> str:
    """The URL without secrets (for logs and messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if not parts.query:
        return url
    q = {k: ("***" if "secret" in k.lower() or "password" in k.lower() else v[-1])
         for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    return urlunsplit(parts._replace(query=urlencode(q, safe="/:*")))


# ---- 1. read-only checks ----------------------------------------------------------------
def _bind_error(host: str, port: int) -> str:
    """"" when host:port can be bound now, else the reason."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return str(e.strerror)
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return os.strerror(e.errno) if e.errno else str(e)
    return ""


def check_listen(cfg: BrokerConfig) -> None:
    """The listen address (and an explicitly given --metrics-listen) can be bound."""
    why = _bind_error(cfg.listen_host, cfg.listen_port)
    if why:
        if why == os.strerror(errno.EADDRINUSE):
            why = "the port is in use"
        raise StartupError(f"cannot listen on {cfg.listen}: {why}")
    metrics = getattr(cfg, "metrics_listen", "").strip()
    default = getattr(BrokerConfig, "metrics_listen", "")
    if metrics and metrics.lower() not in ("off", "none", "disabled") and metrics != default:
        from .config import split_host_port  # noqa: PLC0415

        why = _bind_error(*split_host_port(metrics))
        if why:       # the default being taken only warns (broker/metrics.py)
            raise StartupError(f"--metrics-listen {metrics}: {why}")


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _writable_dir(path: str) -> str:
    """"" when path can be written (probed with a temporary file, removed again) or created."""
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        return f"{existing} is not a directory"
    probe = os.path.join(existing, f".s3kafka-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{existing} is not writable ({e.strerror})"
    return ""


def check_data_dir(cfg: BrokerConfig) -> None:
    path = cfg.data_path
    problem = _writable_dir(path)
    if problem:
        raise StartupError(f"data directory {path} cannot be used: {problem}")
    holder = _probe_lock(os.path.join(path, LOCK_FILE))
    if holder is not None:
        raise StartupError(f"data directory {path} is in use by another broker ({holder}); "
                           "stop it first or choose another --data-dir")


def _probe_lock(lock_path: str) -> str | None:
    """The holder's description when lock_path is locked by another process, else None."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        try:
            text = os.pread(fd, 512, 0).decode(errors="replace").strip()
        except OSError:
            text = ""
        return text or "holder unknown"
    finally:
        os.close(fd)


def check_wal(cfg: BrokerConfig) -> str:
    """Inspect the WAL path (storage/wal/device.py): returns "new", "blank", "wal", "format"."""
    from storage.wal.device import inspect_wal_path  # noqa: PLC0415
    from storage.wal.errors import WALError  # noqa: PLC0415

    ec = cfg.engine_config()
    try:
        return inspect_wal_path(ec.wal_path, ec.wal_capacity, bool(ec.wal_format))
    except WALError as e:
        raise StartupError(str(e)) from None


def check_metadata(cfg: BrokerConfig) -> None:
    url = cfg.metadata_url
    path = url[len("sqlite:///"):] if url.startswith("sqlite:///") else ""
    if not path or path == ":memory:":
        return
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise StartupError(f"metadata database {path} is a directory (--metadata "
                           "sqlite:///PATH names a file)")
    problem = _writable_dir(os.path.dirname(path))
    if problem:
        raise StartupError(f"metadata database {path} cannot be created: {problem}")
    if os.path.exists(path):
        import sqlite3  # noqa: PLC0415

        # read-only: a garbage or foreign file is refused before anything else. Not
        # immutable=1: that ignores the -wal file, and a database whose last changes are
        # still only there (a connection left open at exit, a checkpoint cut short) then
        # reads as empty or "malformed" although it is intact
        try:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
            try:
                db.execute("PRAGMA schema_version").fetchone()
            finally:
                db.close()
        except sqlite3.Error as e:
            raise StartupError(f"metadata database {path} cannot be read: {e}") from None


# ---- 2. the object store --------------------------------------------------------------------
def check_object_store(url: str, timeout: float = STORE_CHECK_TIMEOUT_S) -> str:
    """Write, read back and delete a small object; "" when that works, else the error (one
    line). Bounded by `timeout` even if the store's client would wait longer."""
    parts = urlsplit(url)
    if parts.scheme in ("file", ""):
        # the directory open_object_store would use (file://DIR, file://localhost/DIR, DIR)
        root = url if not parts.scheme else (
            parts.netloc + parts.path if parts.netloc not in ("", "localhost") else parts.path)
        if not os.path.isdir(root):             # not created yet: nothing to write into
            problem = _writable_dir(root)
            return f"{root}: {problem}" if problem else ""
    result: list[str] = []

    def probe() -> None:
        try:
            from storage.objects.store import open_object_store  # noqa: PLC0415

            store = open_object_store(url, probe=True)
            try:
                store.check()
            finally:
                store.close()
            result.append("")
        except Exception as e:  # noqa: BLE001 - any failure is the answer
            msg = " ".join(str(e).split()) or type(e).__name__
            result.append(msg)

    t = threading.Thread(target=probe, name="s3kafka-store-check", daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        return f"no answer within {timeout:.0f} s"
    return result[0]


# ---- 3. taking ownership ----------------------------------------------------------------------
def _makedirs(path: str, created: list[str]) -> None:
    """os.makedirs that records each directory it creates (outermost first)."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.exists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        os.mkdir(d)
        created.append(d)


def lock_data_dir(cfg: BrokerConfig, created: list[str]) -> int:
    """Create the data directory and hold an exclusive lock on its lock file for the life of
    the process; the file names the holder for the next broker that tries."""
    path = cfg.data_path
    try:
        _makedirs(path, created)
        lock_path = os.path.join(path, LOCK_FILE)
        if not os.path.exists(lock_path):
            created.append(lock_path)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise StartupError(f"data directory {path} cannot be used: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "holder unknown"
        os.close(fd)
        raise StartupError(f"data directory {path} is in use by another broker ({holder}); "
                           "stop it first or choose another --data-dir") from None
    info = (f"pid {os.getpid()} on host {socket.gethostname()}, node {cfg.node_id}, "
            f"since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, info, 0)
    return fd


def lock_wal(cfg: BrokerConfig, created: list[str]) -> int:
    """Hold an exclusive lock on the WAL file or device for the life of the process (the file
    is created empty here when new; the engine preallocates and formats it)."""
    import stat  # noqa: PLC0415

    from storage.wal.device import busy_message, lock_exclusive, open_exclusive_probe  # noqa: PLC0415
    from storage.wal.errors import WALError  # noqa: PLC0415

    path = cfg.engine_config().wal_path
    try:
        _makedirs(os.path.dirname(os.path.abspath(path)), created)
        if not os.path.exists(path):
            created.append(path)
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        else:       # a block device is also claimed with O_EXCL for the process's life
            fd = open_exclusive_probe(path, stat.S_ISBLK(os.stat(path).st_mode))
    except OSError as e:
        if e.errno == errno.EBUSY:
            raise StartupError(busy_message(path, os.path.abspath(path))) from None
        raise StartupError(f"cannot open WAL {path}: {e.strerror}") from None
    try:
        lock_exclusive(fd, path)
    except WALError as e:
        os.close(fd)
        raise StartupError(str(e)) from None
    return fd


def fenced_taker(cfg: BrokerConfig) -> int | None:
    """The broker taking this node's WAL over while its cluster row is ``fenced``; None
    otherwise (no such row, no cluster tables, database unreachable). Read-only."""
    from broker.cluster.store import FENCED  # noqa: PLC0415
    from storage import sqldb  # noqa: PLC0415

    url = cfg.metadata_url
    if not sqldb.is_postgres_url(url) and not os.path.exists(sqldb.sqlite_path(url)):
        return None
    try:
        db = sqldb.connect(url)
    except Exception:  # noqa: BLE001 - not our question to answer here
        return None
    try:
        rows = db.query("SELECT state, taker FROM cluster_brokers WHERE node_id = ?",
                        (cfg.node_id,))
    except Exception:  # noqa: BLE001 - no cluster tables yet
        return None
    finally:
        db.close()
    return int(rows[0][1]) if rows and rows[0][0] == FENCED else None


def after_takeover(cfg: BrokerConfig, check: Callable[[], T]) -> T:
    """``check()`` (the WAL's inspection or lock), except that a fenced node whose WAL its
    taker holds waits for the takeover to finish (docs/cluster.md: up to
    ``cluster_takeover_wait_s``, logged once) instead of refusing: restarting a broker right
    after it was fenced is what supervisors do."""
    deadline: float | None = None
    grace: float | None = None
    while True:
        try:
            return check()
        except StartupError:
            taker = fenced_taker(cfg)
            now = time.monotonic()
            if taker is None:
                if deadline is None:
                    raise
                # the takeover we waited for just ended (the row is no longer fenced); its
                # taker lets the WAL's lock go right after: retry for a few seconds
                grace = now + 10.0 if grace is None else grace
                if now > grace:
                    raise
                time.sleep(0.5)
                continue
            if deadline is None:
                deadline = now + float(getattr(cfg, "cluster_takeover_wait_s", 120.0))
                log.warning("waiting for the takeover of this node's WAL by broker %d "
                            "(it holds the WAL's lock while it recovers it)", taker)
            elif now > deadline:
                raise StartupError(f"node id {cfg.node_id} is being taken over by broker "
                                   f"{taker}; start again when that is done") from None
            time.sleep(0.5)


def prepare(cfg: BrokerConfig) -> Startup:
    """Run every check, then take the locks. Raises StartupError (nothing changed on disk)."""
    check_data_dir(cfg)
    check_metadata(cfg)
    wal_state = after_takeover(cfg, lambda: check_wal(cfg)) if cfg.storage == "engine" else ""
    check_listen(cfg)
    startup = Startup()
    if cfg.storage == "engine":
        url = cfg.object_store_url
        err = check_object_store(url, RESTART_STORE_CHECK_S if wal_state == "wal"
                                 else STORE_CHECK_TIMEOUT_S)
        if err:
            startup.store_error = err
            line = f"object store {redact_url(url)} is not usable: {err}"
            if cfg.allow_degraded_start:
                startup.degraded_reason = "--allow-degraded-start"
            elif wal_state == "wal":
                # a restart: refusing would make the records acknowledged from the WAL
                # unavailable; serve them and keep retrying uploads (issue 21)
                startup.degraded_reason = "its WAL holds this broker's data (a restart)"
            else:
                raise StartupError(line + " (pass --allow-degraded-start to start anyway)")
    try:
        startup.lock_fds.append(lock_data_dir(cfg, startup.created))
        if cfg.storage == "engine":
            startup.wal_fd = after_takeover(cfg, lambda: lock_wal(cfg, startup.created))
            startup.lock_fds.append(startup.wal_fd)
            from storage.crash import crash_point  # noqa: PLC0415 - a test hook
            crash_point("startup_wal_locked")
    except BaseException:
        startup.release(undo=True)
        raise
    return startup


async def watch_degraded_store(url: str, first_error: str, reason: str,
                               interval: float = DEGRADED_WARN_INTERVAL_S) -> None:
    """Warn once per interval while the object store check fails; one line when it works."""
    since = time.monotonic()
    log.warning("object store unusable, starting degraded (%s) url=%s error=%s; uploads wait "
                "and retry, produces are back-pressured once the WAL fills", reason,
                redact_url(url), first_error)
    while True:
        await asyncio.sleep(interval)
        err = await asyncio.to_thread(check_object_store, url)
        if not err:
            log.warning("object store usable again after %.0f s url=%s",
                        time.monotonic() - since, redact_url(url))
            return
        log.warning("object store still unusable for %.0f s url=%s error=%s",
                    time.monotonic() - since, redact_url(url), err)
