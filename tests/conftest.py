"""Shared test harness: real broker processes, a moto S3 server, the Java client classpaths.

Every fixture starts real processes on free 127.0.0.1 ports and kills them at teardown, so a
test never depends on another test's leftovers; bench.common.tied_popen starts them, so they
also die when the pytest process is killed (SIGKILL, pytest-timeout, a cancelled CI run). When
a test fails, the tail of every broker log that was alive during it is attached to the failure
report (section "broker log tail").
"""
from __future__ import annotations

import os
import re
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
from filelock import FileLock

from bench import ports
from bench.common import tied_popen
from datapath.wire import api_versions_roundtrip

REPO = pathlib.Path(__file__).resolve().parent.parent
CACHE = REPO / "tests" / ".cache"
JAVA_CACHE = CACHE / "java"
JAVA_VERSIONS = ("3.9", "4.3")
TEST_WAL_CAPACITY = 64 << 20   # default --wal-capacity of test brokers (tests may pass their own)
START_TIMEOUT_S = float(os.environ.get("S3KAFKA_TEST_START_TIMEOUT", "60"))

# Brokers currently running in this pytest process (for log tails on failure).
_LIVE: set["BrokerProcess"] = set()


#: The tests that load the machine most (several brokers, JVMs, fault schedules), in lanes:
#: under pytest-xdist each lane runs on one worker, one test at a time, so at most two of them
#: overlap on the 2-core CI machine and they do not starve each other (or time out). A lane is
#: a list of path prefixes (new tests under them join it). tests/spark shares one SparkSession
#: (package fixture): one lane means one JVM, not one per worker. The lanes are balanced by
#: their run time in `make test ARGS=--durations=0` (2026-12-01, 2-core Zen 3 VM): chaos 267 s
#: + bench 116 s + Spark 422 s against the cluster's 618 s; Spark beside the cluster made a
#: 1,040 s lane, and that lane was the whole suite's wall time. On 2026-12-02 (the same kind of
#: VM, bench/HISTORY.md session 45) the Spark pipeline test alone took 459 s and chaos + bench +
#: Spark made a ~1,030 s lane, again the whole wall time: bench moved beside the cluster.
HEAVY_LANES: dict[str, tuple[str, ...]] = {
    "heavy-a": ("tests/chaos/", "tests/spark/"),
    "heavy-b": ("tests/cluster/", "tests/bench/"),
}


def work_unit(nodeid: str) -> str:
    """The pytest-xdist unit of work of a test: its lane, else its module (so module and
    package fixtures - brokers, a SparkSession - are set up once, on one worker)."""
    path = nodeid.split("::", 1)[0]
    for lane, prefixes in HEAVY_LANES.items():
        if path.startswith(prefixes):
            return lane
    return path


@pytest.hookimpl(tryfirst=True, optionalhook=True)   # optional: `-p no:xdist` works
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadgroup`` (``make test``) schedules whole work_unit()s. pytest-xdist 3.8's
    own loadgroup does not group under pytest 9.2 (it renames ``item._nodeid``, which pytest no
    longer reads), so the grouping is done here, on the controller, from the node ids."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if "@" in nodeid.rsplit("::", 1)[-1]:      # an xdist_group mark, if xdist honours it
                return nodeid.rsplit("@", 1)[-1]
            return work_unit(nodeid)

    return WorkUnitScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:  # noqa: ARG001
    """Under pytest-xdist (``make test``: --dist loadgroup --no-loadscope-reorder, units in the
    order of the first test of each): the HEAVY_LANES first, then the modules holding slow
    tests, then the rest, so the run does not end on one worker finishing a long module
    alone. Stable and deterministic (every worker must collect the same order). A serial run
    keeps the file order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow_modules = {item.nodeid.split("::", 1)[0] for item in items
                    if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> tuple[int, int]:
        unit = work_unit(item.nodeid)
        slow = 0 if item.nodeid.split("::", 1)[0] in slow_modules else 1
        if unit in HEAVY_LANES:
            return (0, list(HEAVY_LANES).index(unit) * 2 + slow)
        return (1 + slow, 0)

    items.sort(key=rank)


def run_setup_deps() -> None:
    """tests/setup_deps.sh (idempotent), one pytest-xdist worker at a time: `make test` has
    already run it, this is for a bare `pytest` on a machine that lacks something."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / "setup_deps.lock")):
        subprocess.run(["bash", str(REPO / "tests" / "setup_deps.sh")], cwd=REPO,
                       stdin=subprocess.DEVNULL, check=False, timeout=1200)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 that no other live test process was handed (bench/ports.py:
    a broker killed for a restart leaves its port free in between)."""
    return ports.free_port()


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


class BrokerProcess:
    """One `python -m broker serve` subprocess; restartable with the same port and data dir."""

    def __init__(self, args: list[str], port: int, data_dir: pathlib.Path,
                 log_path: pathlib.Path, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port
        self.bootstrap = f"{host}:{port}"
        self.data_dir = data_dir
        self.args = args
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen | None = None
        self._spawned_wall = 0.0

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """(Re)start with the same args and port; return once ApiVersions is answered, by this
        process's own listener."""
        assert not self.running, "broker already running"
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("PYTHONPATH", str(REPO))
        if self.env:
            env.update(self.env)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {time.strftime('%H:%M:%S')}: {' '.join(self.args)}\n".encode())
            log.flush()
            self._spawned_wall = time.time()
            self.proc = tied_popen(
                self.args, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _LIVE.add(self)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"broker exited with {self.proc.returncode} during start-up\n{self.log_tail()}")
            # answered by this process: not by another that took the port while it was free
            if api_versions_roundtrip(self.host, self.port, timeout=1.0) and \
                    ports.listening_pid_owns(self.proc.pid, self.port):
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"broker did not answer ApiVersions within {START_TIMEOUT_S}s\n"
                           f"{self.log_tail()}")

    def interpreter_seconds(self) -> float:
        """Seconds the last start spent before the broker's own code ran (interpreter start-up
        and imports: several seconds on a loaded 2-core machine), from the log line
        'startup checks passed duration_s=X' (its timestamp minus X, minus the spawn time).
        Tests bounding a start subtract it; 0.0 when the line is missing."""
        import datetime  # noqa: PLC0415

        text = self.log_path.read_text(errors="replace").rsplit("\n===== start ", 1)[-1]
        m = re.search(r"^ts=(\S+) .*startup checks passed duration_s=([0-9.]+)", text, re.M)
        if not m:
            return 0.0
        ts = datetime.datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
        return max(0.0, ts - float(m.group(2)) - self._spawned_wall)

    def stop(self, timeout: float = 30) -> None:
        """Graceful stop (SIGTERM); asserts the process exits cleanly with code 0."""
        assert self.proc is not None and self.proc.poll() is None, "broker not running"
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR2)    # every thread's stack into the log
            time.sleep(1.0)
            self.kill()
            raise AssertionError(f"broker did not exit {timeout}s after SIGTERM\n{self.log_tail()}")
        _LIVE.discard(self)
        assert code == 0, f"broker exited with {code} after SIGTERM\n{self.log_tail()}"

    def kill(self) -> None:
        """Crash stop (SIGKILL), as a power loss would look to the broker."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        _LIVE.discard(self)

    def restart(self, hard: bool = False) -> None:
        """Stop (SIGTERM, or SIGKILL when hard) and start again on the same port and data."""
        if hard:
            self.kill()
        else:
            self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    # -- logs ----------------------------------------------------------------------------
    def log_text(self) -> str:
        """Everything the broker printed so far (stdout and stderr, all starts)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __repr__(self) -> str:
        return f"BrokerProcess({self.bootstrap}, data_dir={self.data_dir}, pid={self.pid})"


BrokerFactory = Callable[..., BrokerProcess]


@dataclass
class _BrokerPool:
    """Creates brokers under one base directory and kills them all on close."""
    base: pathlib.Path
    procs: list[BrokerProcess]

    def __call__(self, extra_args: Sequence[str] = (), env: dict[str, str] | None = None
                 ) -> BrokerProcess:
        extra = list(extra_args)
        n = len(self.procs)
        suffix = "" if n == 0 else f"-{n}"
        listen = _flag_value(extra, "--listen")
        if listen is None:
            port = free_port()
            listen_args = ["--listen", f"127.0.0.1:{port}"]
        else:
            port = int(listen.rsplit(":", 1)[1])
            listen_args = []
        data = _flag_value(extra, "--data-dir")
        if data is None:
            data_dir = self.base / f"data{suffix}"
            data_args = ["--data-dir", str(data_dir)]
        else:
            data_dir = pathlib.Path(data)
            data_args = []
        node_args = [] if _has_flag(extra, "--node-id") else ["--node-id", "0"]
        # a small WAL: the 2 GiB default is preallocated per broker and fills the disk
        wal_args = ([] if _has_flag(extra, "--wal-capacity") or "S3KAFKA_WAL_CAPACITY" in (env or {})
                    else ["--wal-capacity", str(TEST_WAL_CAPACITY)])
        # Kafka's 3 s first-join delay would slow every group test: tests ask for it explicitly
        delay_args = ([] if _has_flag(extra, "--group-initial-rebalance-delay-ms")
                      or "S3KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS" in (env or {})
                      else ["--group-initial-rebalance-delay-ms", "0"])
        metrics_args = ([] if _has_flag(extra, "--metrics-listen")
                        or "S3KAFKA_METRICS_LISTEN" in (env or {})
                        else ["--metrics-listen", "off"])
        # many brokers run at once, each with the 1 GiB LogCache default: faulting all of it
        # in at start (--frame-pretouch, 0.35 s of CPU, 1 GiB resident) is for tests asking
        pretouch_args = ([] if _has_flag(extra, "--frame-pretouch")
                         or "S3KAFKA_FRAME_PRETOUCH" in (env or {})
                         else ["--frame-pretouch", "false"])
        args = [sys.executable, "-m", "broker", "serve", *listen_args, *data_args,
                *node_args, *wal_args, *delay_args, *metrics_args, *pretouch_args, *extra]
        bp = BrokerProcess(args, port, data_dir, self.base / f"broker{suffix}.log", env=env)
        self.procs.append(bp)
        bp.start()
        return bp

    def close(self) -> None:
        for bp in self.procs:
            bp.kill()


@pytest.fixture
def broker_factory(tmp_path: pathlib.Path) -> Iterator[BrokerFactory]:
    """broker_factory(extra_args=(), env=None) -> started BrokerProcess; all killed at teardown.

    Defaults added unless extra_args name them: --listen 127.0.0.1:<free port>,
    --data-dir <tmp_path>/data[-n], --node-id 0, --wal-capacity 64 MiB, --metrics-listen off
    (many brokers run at once; a test that scrapes passes its own --metrics-listen),
    --frame-pretouch false.
    """
    pool = _BrokerPool(tmp_path, [])
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def broker(broker_factory: BrokerFactory) -> BrokerProcess:
    """One started broker with default settings, private to the test."""
    return broker_factory()


@pytest.fixture(scope="module")
def module_broker_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerFactory]:
    """Like broker_factory, shared by a whole test module (for tests that do not restart it)."""
    pool = _BrokerPool(tmp_path_factory.mktemp("mbroker"), [])
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def module_broker(module_broker_factory: BrokerFactory) -> BrokerProcess:
    """One broker shared by the tests of a module; tests must use their own topic names."""
    return module_broker_factory()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # noqa: ARG001
    """Attach the log tail of every running broker to a failing test's report."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and _LIVE:
        for bp in sorted(_LIVE, key=lambda b: b.port):
            report.sections.append((f"broker log tail {bp.bootstrap}", bp.log_tail()))


# -- S3 (moto server) -------------------------------------------------------------------------
class MotoServer:
    """moto's S3 server in a subprocess on a fixed free port; stop()/start() keep the port.

    moto keeps its state in memory: a stop() loses every bucket and object (tests of S3 outages
    should create the bucket again after start()).
    """

    def __init__(self, log_path: pathlib.Path) -> None:
        self.host = "127.0.0.1"
        self.port = free_port()
        self.url = f"http://{self.host}:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "moto already running"
        env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                   AWS_DEFAULT_REGION="us-east-1")
        with open(self.log_path, "ab") as log:
            self.proc = tied_popen(
                [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/", timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("moto server did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """A moto S3 server (.url, .stop(), .start()); bucket creation is up to the test."""
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


# -- Java kafka-clients -----------------------------------------------------------------------
def _classpath_for(version: str) -> str | None:
    jars = sorted((JAVA_CACHE / f"kafka-{version}").glob("*.jar"))
    if not any(j.name.startswith("kafka-clients-") for j in jars):
        return None
    return os.pathsep.join(str(j) for j in jars)


@pytest.fixture(scope="session")
def java_classpath() -> dict[str, str]:
    """{"3.9": "a.jar:b.jar:...", "4.3": ...}: the kafka-clients jars set up by setup_deps.sh.

    Runs tests/setup_deps.sh once if the jars are missing (it is idempotent); skips when the
    machine cannot provide them (no Java, no PyPI access).
    """
    cps = {v: _classpath_for(v) for v in JAVA_VERSIONS}
    if not all(cps.values()):
        run_setup_deps()
        cps = {v: _classpath_for(v) for v in JAVA_VERSIONS}
    missing = [v for v, cp in cps.items() if not cp]
    if missing:
        pytest.skip(f"Java kafka-clients {missing} not available (run tests/setup_deps.sh)")
    return {v: cp for v, cp in cps.items() if cp}


# -- PostgreSQL (metadata) ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def postgres() -> Iterator["PostgresServer"]:
    """A real PostgreSQL server (Debian's package, installed by setup_deps.sh when missing),
    in a temp dir on a free port; ``postgres.new_database()`` gives each test its own DB."""
    from pgserver import PostgresServer, pg_bindir  # noqa: PLC0415

    if pg_bindir() is None:
        run_setup_deps()
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def metadata_url(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[str]:
    """A fresh, empty metadata database URL: each test using it runs on SQLite and PostgreSQL
    (the PostgreSQL database is dropped afterwards)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/meta.db"
        return
    server = request.getfixturevalue("postgres")
    url = server.new_database()
    yield url
    server.drop_database(url)
