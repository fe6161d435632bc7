"""Start-up mistakes end in one line and a non-zero exit code, and change nothing on disk;
a second broker on a held data directory or WAL is refused (issue 18, issue 17 item 4).

Each case starts ``python -m broker serve`` as a subprocess that exits within seconds."""
from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import time

import pytest

import loopdev
from bench import ports
from bench.common import tied_popen
from conftest import REPO, free_port

PY = sys.executable
CAP = "16MiB"


# data dirs of brokers running during a snapshot (their SQLite WAL and shared-memory files
# change with every cluster heartbeat)
_LIVE_DIRS: set[str] = set()


def snapshot(root: pathlib.Path) -> dict[str, str]:
    """Every path under root with its type and content hash: equal snapshots = nothing
    changed on disk."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            if f.startswith("broker-") and f.endswith(".log"):
                continue                     # logs of brokers this test runs
            if f.startswith("meta.db-") and _LIVE_DIRS & {dirpath, os.path.dirname(dirpath)}:
                continue                     # a running broker's lease heartbeats
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def serve(args: list[str], cwd: pathlib.Path, timeout: float = 40,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([PY, "-m", "broker", "serve", "--listen", f"127.0.0.1:{free_port()}",
                           *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=full_env)


def one_line(r: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """Assert the exit code and a single-line error on stderr containing every word."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def refused_unchanged(tmp_path: pathlib.Path, args: list[str], code: int, *words: str) -> str:
    before = snapshot(tmp_path)
    r = serve(args, tmp_path)
    line = one_line(r, code, *words)
    assert snapshot(tmp_path) == before, "the failed start changed files on disk"
    return line


# ---- configuration mistakes (exit 2) ------------------------------------------------------
def test_unknown_flag_is_one_line(tmp_path):
    refused_unchanged(tmp_path, ["--data-dir", "d", "--no-such-flag", "1"], 2,
                      "unrecognized arguments: --no-such-flag")


def test_invalid_toml_names_file_and_line(tmp_path):
    cfg = tmp_path / "broker.toml"
    cfg.write_text('listen = "127.0.0.1:9092"\nnode_id = 0\ndata_dir = "d\n')
    refused_unchanged(tmp_path, ["--config", str(cfg)], 2, str(cfg), "line 3", "invalid TOML")


def test_unknown_config_key_names_file_line_and_suggestion(tmp_path):
    cfg = tmp_path / "broker.toml"
    cfg.write_text('node_id = 0\n\n[engine]\nwal_capacty = "16MiB"\n')
    line = refused_unchanged(tmp_path, ["--config", str(cfg)], 2, str(cfg), "line 4",
                             "unknown option 'wal_capacty'")
    assert "did you mean 'wal_capacity'" in line
    props = tmp_path / "broker.properties"
    props.write_text("# comment\nnode.id=0\nlisten.port=9092\n")
    refused_unchanged(tmp_path, ["--config", str(props)], 2, str(props), "line 3",
                      "unknown option 'listen_port'")


def test_bad_value_in_config_file_names_line(tmp_path):
    props = tmp_path / "broker.properties"
    props.write_text("node.id=0\nwal.capacity=lots\n")
    refused_unchanged(tmp_path, ["--config", str(props)], 2, str(props), "line 2",
                      "wal_capacity")
    props.write_text("node.id=0\nthis line has no separator\n")
    refused_unchanged(tmp_path, ["--config", str(props)], 2, "line 2", "expected key=value")


def test_unknown_wal_io_engine_is_one_line(tmp_path):
    """A mistyped engine is refused, not taken as some default (issue 18's house rule)."""
    refused_unchanged(tmp_path, ["--data-dir", "d", "--wal-io-engine", "bogus"], 2,
                      "wal_io_engine must be one of uring, aio, threads")


@pytest.mark.parametrize("flag,url,words", [
    ("--object-store", "ftp://host/dir", ("object_store", "unknown scheme 'ftp'")),
    ("--object-store", "s3:///prefix", ("object_store", "no bucket")),
    ("--object-store", "s3://b/p?endpoint_url=localhost:9000", ("endpoint_url", "http://")),
    ("--metadata", "mysql://db/meta", ("metadata must be sqlite:///PATH or postgresql://",)),
    ("--metadata", "sqlite://meta.db", ("metadata must be sqlite:///PATH",)),
    ("--metadata", "postgresql://u:p@db:port/meta", ("bad metadata URL", "port")),
])
def test_bad_urls(tmp_path, flag, url, words):
    refused_unchanged(tmp_path, ["--data-dir", "d", flag, url], 2, *words)


# ---- environment mistakes (exit 1) ----------------------------------------------------------
def test_data_dir_that_is_a_file(tmp_path):
    (tmp_path / "d").write_text("not a directory")
    refused_unchanged(tmp_path, ["--data-dir", "d"], 1, "data directory", "not a directory")
    refused_unchanged(tmp_path, ["--data-dir", "d/sub"], 1, "data directory",
                      "not a directory")


def test_unwritable_data_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i not available (needed to make a directory unwritable for root)")
    try:
        if os.geteuid() != 0:
            ro.chmod(0o500)
        refused_unchanged(tmp_path, ["--data-dir", "ro/data"], 1, "data directory",
                          "not writable")
    finally:
        subprocess.run(["chattr", "-i", str(ro)], capture_output=True)


def test_wal_path_that_is_a_directory(tmp_path):
    (tmp_path / "waldir").mkdir()
    (tmp_path / "waldir" / "keep").write_text("x")
    refused_unchanged(tmp_path, ["--data-dir", "d", "--wal", "waldir"], 1, "waldir",
                      "is a directory")


def test_wal_on_missing_device_creates_nothing_under_dev(tmp_path):
    dev = f"/dev/s3kafka-test-{os.getpid()}"
    refused_unchanged(tmp_path, ["--data-dir", "d", "--wal", dev], 1, dev, "does not exist")
    assert not os.path.exists(dev)


def test_no_space_for_the_wal(tmp_path):
    # more than the whole filesystem, not just its free space: free space measured here can
    # grow before the broker checks (another process deleting files), and a request that then
    # fits is preallocated - a WAL of tens of GB that filled the disk of a shared machine
    vfs = os.statvfs(tmp_path)
    too_big = (vfs.f_blocks * vfs.f_frsize + (1 << 30)) // 4096 * 4096
    refused_unchanged(tmp_path, ["--data-dir", "d", "--wal-capacity", str(too_big)], 1,
                      "no space for the WAL", "--wal-capacity")


def test_foreign_file_is_refused_unless_wal_format(tmp_path):
    foreign = tmp_path / "disk.img"
    foreign.write_bytes(b"important data, not a WAL\n" * 1000)
    refused_unchanged(tmp_path, ["--data-dir", "d", "--wal", "disk.img", "--wal-capacity",
                                 CAP], 1, "not an s3kafka WAL", "--wal-format")
    # explicit permission: formatted, and the broker starts
    stop(start_broker(tmp_path, ["--data-dir", "d", "--wal", "disk.img", "--wal-capacity",
                                 CAP, "--wal-format"]))
    assert foreign.read_bytes()[:4] == b"SKWL"


def test_wal_capacity_differs_from_header(tmp_path):
    stop(start_broker(tmp_path, ["--data-dir", "d", "--wal-capacity", CAP]))
    refused_unchanged(tmp_path, ["--data-dir", "d", "--wal-capacity", "32MiB"], 1,
                      "capacity 16777216", "--wal-capacity 16777216")


@pytest.fixture
def loop_device(tmp_path):
    """A 32 MiB loop device (root and losetup needed, else skipped) over a file outside
    tmp_path's snapshots."""
    backing = tmp_path.parent / f"{tmp_path.name}-loop.img"
    try:
        with loopdev.loop_device(backing, 32 << 20) as dev:
            yield dev, backing
    finally:
        backing.unlink(missing_ok=True)


def test_wal_on_a_block_device(tmp_path, loop_device):
    """A device claimed elsewhere (mounted: O_EXCL gets EBUSY) is refused even with
    --wal-format; foreign data on a device is refused unchanged, a device smaller than the
    capacity is one line, --wal-format formats it, and a second broker on it is refused."""
    dev, backing = loop_device
    with open(dev, "r+b") as f:                   # something that looks like a filesystem
        f.write(b"\xeb\x52\x90NTFS    " + os.urandom(4096))
    before = hashlib.sha256(backing.read_bytes()).hexdigest()
    claim = os.open(dev, os.O_RDONLY | os.O_EXCL)    # as a mount or another claimer would
    try:
        refused_unchanged(tmp_path, ["--data-dir", "d", "--wal", dev, "--wal-capacity", CAP,
                                     "--wal-format"], 1, f"WAL {dev} is in use",
                          "mounted, or claimed by another process")
    finally:
        os.close(claim)
    refused_unchanged(tmp_path, ["--data-dir", "d", "--wal", dev, "--wal-capacity", CAP], 1,
                      dev, "not an s3kafka WAL", "--wal-format")
    refused_unchanged(tmp_path, ["--data-dir", "d", "--wal", dev, "--wal-capacity", "64MiB",
                                 "--wal-format"], 1, "less than the WAL capacity")
    assert hashlib.sha256(backing.read_bytes()).hexdigest() == before
    b = start_broker(tmp_path, ["--data-dir", "d", "--wal", dev, "--wal-capacity", CAP,
                                "--wal-format"])
    try:
        refused_unchanged(tmp_path, ["--data-dir", "d2", "--wal", dev, "--wal-capacity", CAP],
                          1, f"WAL {dev} is in use", f"pid {b.pid}")
    finally:
        stop(b)
    # its own WAL now: starts without --wal-format
    stop(start_broker(tmp_path, ["--data-dir", "d", "--wal", dev, "--wal-capacity", CAP]))


# ---- object store ---------------------------------------------------------------------------
def closed_port_url() -> str:
    port = free_port()       # nothing listens there
    return (f"s3://bucket/kafka?endpoint_url=http://127.0.0.1:{port}&region=us-east-1"
            "&access_key_id=k&secret_access_key=topsecret")


def test_unreachable_object_store_fails_fast(tmp_path):
    url = closed_port_url()
    t0 = time.monotonic()
    line = refused_unchanged(tmp_path, ["--data-dir", "d", "--object-store", url], 1,
                             "object store s3://bucket/kafka", "127.0.0.1",
                             "--allow-degraded-start")
    assert "topsecret" not in line
    assert time.monotonic() - t0 < 30


def test_black_holed_object_store_is_bounded(tmp_path):
    """An endpoint that accepts connections and never answers: start-up gives up in
    seconds (probe timeouts), not after botocore's default minutes. Measured against the same
    start-up refused at once (a closed port): on a loaded machine the interpreter start and
    imports alone can take many seconds, and they are not what is bounded here."""
    def url(port: int) -> str:
        return (f"s3://bucket?endpoint_url=http://127.0.0.1:{port}"
                "&region=us-east-1&access_key_id=k&secret_access_key=s")

    (tmp_path / "base").mkdir()
    t0 = time.monotonic()
    r = serve(["--data-dir", "d", "--object-store", url(free_port())], tmp_path / "base",
              timeout=120)
    baseline = time.monotonic() - t0
    assert r.returncode == 1 and "object store" in r.stderr, r.stderr
    with ports.listener(16) as hole:
        t0 = time.monotonic()
        refused_unchanged(tmp_path, ["--data-dir", "d", "--object-store", url(hole.getsockname()[1])],
                          1, "object store", "is not usable")
        assert time.monotonic() - t0 - baseline < 20, (time.monotonic() - t0, baseline)


def test_missing_bucket_is_named(tmp_path, s3_endpoint):
    url = (f"s3://no-such-bucket-here/x?endpoint_url={s3_endpoint.url}&region=us-east-1"
           "&access_key_id=testing&secret_access_key=testing")
    refused_unchanged(tmp_path, ["--data-dir", "d", "--object-store", url], 1,
                      "bucket 'no-such-bucket-here' does not exist")


def test_degraded_start_episodes_and_restart_with_store_down(tmp_path):
    """--allow-degraded-start serves produces from the WAL while the store is down; the
    back-pressure and the failing store are logged once per episode, not per request; after
    kill -9 the WAL holds this broker's data, so it restarts without the flag and serves the
    acknowledged records."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    url = closed_port_url()
    args = ["--data-dir", "d", "--wal-capacity", CAP, "--object-store", url,
            "--log-cache-bytes", "1MiB", "--backpressure-timeout-s", "0.2",
            "--metrics-listen", "off"]
    b = start_broker(tmp_path, [*args, "--allow-degraded-start"])
    acked: dict[int, bytes] = {}
    refused = []

    def cb(err, msg) -> None:
        (refused.append(err) if err else acked.__setitem__(msg.offset(), msg.value()))
    p = Producer({"bootstrap.servers": b.bootstrap, "acks": "all", "linger.ms": 5,
                  "message.timeout.ms": 3000})
    for i in range(1500):
        while True:
            try:
                p.produce("t", b"%06d" % i + b"x" * 2000, partition=0, on_delivery=cb)
                break
            except BufferError:
                p.poll(0.01)
        p.poll(0)
    p.flush(30)
    log = b.log()
    b.kill()
    assert acked and refused, (len(acked), len(refused))
    warn = [ln for ln in log.splitlines() if "starting degraded" in ln]
    assert len(warn) == 1 and "--allow-degraded-start" in warn[0] and "topsecret" not in log
    assert log.count("episode=producers_backpressured state=started") <= 2, log
    assert log.count("episode=object_store_failing state=started") == 1, log
    assert log.count("upload failed") == 1, log
    # restart, store still down: the WAL's records are served
    b = start_broker(tmp_path, args)
    try:
        wait_for_line(b, "a restart", timeout=30)   # logged by a task, maybe after ApiVersions
        c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": "g",
                      "enable.auto.commit": False})
        c.assign([TopicPartition("t", 0, 0)])
        seen: dict[int, bytes] = {}
        deadline = time.monotonic() + 30
        while len(seen) < len(acked) and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None and not m.error():
                seen[m.offset()] = m.value()
        c.close()
        assert {o: seen.get(o) for o in acked} == acked
    finally:
        b.kill()


# ---- a second broker ------------------------------------------------------------------------
def test_second_broker_on_locked_data_dir_or_wal(tmp_path):
    p = start_broker(tmp_path, ["--data-dir", "d", "--wal-capacity", CAP])
    try:
        line = refused_unchanged(tmp_path, ["--data-dir", "d", "--wal-capacity", CAP], 1,
                                 "data directory", "in use by another broker",
                                 f"pid {p.pid}", "node 0")
        assert "host" in line
        line = refused_unchanged(tmp_path, ["--data-dir", "d2", "--wal", "d/wal",
                                            "--wal-capacity", CAP, "--node-id", "1"], 1,
                                 "WAL d/wal is in use", f"pid {p.pid}")
        assert not (tmp_path / "d2").exists()
    finally:
        stop(p)
    # released at exit: the same data dir starts again
    stop(start_broker(tmp_path, ["--data-dir", "d", "--wal-capacity", CAP]))


def test_port_in_use_is_one_line(tmp_path):
    with ports.listener(1) as s:
        port = s.getsockname()[1]
        before = snapshot(tmp_path)
        r = subprocess.run([PY, "-m", "broker", "serve", "--listen", f"127.0.0.1:{port}",
                            "--data-dir", "d"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=40, env={**os.environ, "PYTHONPATH": str(REPO)})
        one_line(r, 1, f"127.0.0.1:{port}", "in use")
        assert snapshot(tmp_path) == before


# ---- logging --------------------------------------------------------------------------------
def test_idle_broker_logs_nothing_periodic(tmp_path):
    """After the start-up lines an idle broker writes nothing at INFO, even with its periodic
    tasks (maintenance, retention, uploads) running several times in the window."""
    p = start_broker(tmp_path, ["--data-dir", "d", "--wal-capacity", CAP,
                                "--cleanup-interval-s", "0.5",
                                "--retention-check-interval-ms", "500",
                                "--upload-interval-s", "0.5"])
    try:
        started = p.log()
        assert "wal=" in started and "object_store=" in started and "metadata=" in started
        time.sleep(4)
    finally:
        log = stop(p)
    idle = log.split("broker started", 1)[1].splitlines()[1:]
    # the frame pre-touch's one line (--frame-pretouch) reports start-up work finished later
    idle = [ln for ln in idle if "broker stopping" not in ln and "broker stopped" not in ln
            and "large frames pre-touched" not in ln]
    assert idle == [], idle


# ---- helpers ----------------------------------------------------------------------------------
class Broker:
    """A broker subprocess whose stderr goes to a file (read while it runs)."""

    def __init__(self, cwd: pathlib.Path, args: list[str]) -> None:
        self.log_path = cwd / f"broker-{free_port()}.log"
        self._fh = open(self.log_path, "w")
        args = ["--listen", f"127.0.0.1:{free_port()}", *args]
        self.proc = tied_popen(
            [PY, "-m", "broker", "serve", *args],
            cwd=cwd, stdout=self._fh, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        self.pid = self.proc.pid
        self.bootstrap = args[args.index("--listen") + 1] if "--listen" in args else ""

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
        self._fh.close()

    def log(self) -> str:
        return self.log_path.read_text()


def start_broker(cwd: pathlib.Path, args: list[str]) -> Broker:
    b = Broker(cwd, args)
    wait_for_line(b, "broker started")
    if "--data-dir" in args:
        b.live_dir = str(cwd / args[args.index("--data-dir") + 1])
        _LIVE_DIRS.add(b.live_dir)
    return b


def wait_for_line(b: Broker, needle: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        log = b.log()
        if needle in log:
            return log
        if b.proc.poll() is not None:
            raise AssertionError(f"broker exited ({b.proc.returncode}) before {needle!r}:\n{log}")
        if time.monotonic() > deadline:
            b.proc.kill()
            raise AssertionError(f"no {needle!r} in the broker log:\n{log}")
        time.sleep(0.05)


def stop(b: Broker) -> str:
    """SIGTERM, wait, return the whole log (removed, so snapshots see no log file); the exit
    must be clean."""
    b.proc.terminate()
    try:
        code = b.proc.wait(30)
    finally:
        b._fh.close()
        _LIVE_DIRS.discard(getattr(b, "live_dir", ""))
    log = b.log()
    b.log_path.unlink()
    assert code == 0, log
    return log


def test_degraded_broker_warns_each_interval_until_the_store_works(tmp_path, caplog):
    """watch_degraded_store (run by a degraded broker every 60 s): one warning per interval
    while the check fails, one line when it works, then silence."""
    import asyncio
    import logging

    from broker.startup_checks import watch_degraded_store

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the store's parent directory should be")
    url = f"file://{blocker}/objects"

    async def scenario() -> None:
        task = asyncio.create_task(watch_degraded_store(url, "first error", "test", 0.2))
        await asyncio.sleep(0.5)
        blocker.unlink()
        blocker.mkdir()
        await asyncio.wait_for(task, 5)

    with caplog.at_level(logging.WARNING, logger="broker.startup_checks"):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records]
    assert "starting degraded (test)" in lines[0] and "first error" in lines[0]
    assert 1 <= sum("still unusable" in ln for ln in lines) <= 3, lines
    assert "usable again" in lines[-1]


def test_a_start_that_fails_after_the_checks_removes_what_the_locks_created(tmp_path):
    """prepare() creates the data dir, its lock file and an empty WAL file; a start that then
    fails (run() exit 1) undoes exactly that, so the disk is as it was."""
    from broker.cli import parse_config
    from broker.startup_checks import prepare

    before = snapshot(tmp_path)
    cfg = parse_config(["serve", "--data-dir", str(tmp_path / "a" / "d"), "--wal",
                        str(tmp_path / "w" / "wal"), "--wal-capacity", CAP, "--listen",
                        f"127.0.0.1:{free_port()}", "--metrics-listen", "off"], env={})
    startup = prepare(cfg)
    assert (tmp_path / "a" / "d" / "broker.lock").exists() and (tmp_path / "w" / "wal").exists()
    startup.release(undo=True)
    assert snapshot(tmp_path) == before


def test_metadata_database_that_is_not_sqlite(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "meta.db").write_bytes(b"not a database" * 512)
    refused_unchanged(tmp_path, ["--data-dir", "d"], 1, "meta.db", "not a database")
