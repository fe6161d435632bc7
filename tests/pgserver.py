"""A throw-away PostgreSQL server for the tests, from Debian's ``postgresql`` package.

``initdb`` into a temp dir and ``pg_ctl start`` on a free 127.0.0.1 port, as a non-root user
(PostgreSQL refuses to run as root: under root the server runs as ``postgres``, or ``nobody``).
Settings favour speed (fsync off: the data dies with the test session anyway). Each test gets a
fresh database from ``new_database()`` so tests never see each other's rows.
"""
from __future__ import annotations

import glob
import itertools
import os
import pwd
import shlex
import shutil
import subprocess
import tempfile

from bench.ports import free_port


def pg_bindir() -> str | None:
    """Directory of initdb/pg_ctl: ``pg_config --bindir``, else /usr/lib/postgresql/*/bin."""
    candidates = []
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
        candidates.append(out.stdout.strip())
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for d in candidates:
        if d and os.path.exists(os.path.join(d, "pg_ctl")) and os.path.exists(
                os.path.join(d, "initdb")):
            return d
    return None


class PostgresServer:
    """One running server; ``url(db)`` is a psycopg/--metadata URL for database ``db``."""

    USER = "s3kafka"

    def __init__(self) -> None:
        bindir = pg_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL binaries not found (run tests/setup_deps.sh)")
        self.bindir = bindir
        self.dir = tempfile.mkdtemp(prefix="s3kafka-pg-")
        self.data = os.path.join(self.dir, "data")
        self.port = free_port()
        self.host = "127.0.0.1"
        self._prefix: list[str] = []
        if os.geteuid() == 0:
            name = "postgres"
            try:
                pwd.getpwnam(name)
            except KeyError:
                name = "nobody"
            pw = pwd.getpwnam(name)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self._prefix = ["runuser", "-u", name, "--"]
        self._counter = itertools.count(1)

    def _run(self, *args: str) -> None:
        out = subprocess.run([*self._prefix, *args], capture_output=True, text=True, cwd="/")
        if out.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {out.stdout}{out.stderr}")

    def start(self) -> "PostgresServer":
        self._run(os.path.join(self.bindir, "initdb"), "-D", self.data, "-U", self.USER,
                  "--auth=trust", "-E", "UTF8", "--no-sync", "--locale=C")
        opts = (f"-p {self.port} -k {self.dir} -c listen_addresses={self.host} -c fsync=off"
                " -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
                " -c shared_buffers=32MB")
        self._run(os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-o", opts, "-w",
                  "-t", "60", "-l", os.path.join(self.dir, "server.log"), "start")
        self._watchdog()
        return self

    def _watchdog(self) -> None:
        """pg_ctl daemonizes the server, so a killed pytest (CI timeout, ^C twice, kill -9)
        would leak it: a detached shell stops it and removes its directory once this
        process is gone."""
        pg_ctl = os.path.join(self.bindir, "pg_ctl")
        stop = " ".join(shlex.quote(a) for a in
                        [*self._prefix, pg_ctl, "-D", self.data, "-m", "immediate", "stop"])
        script = (f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 2; done; "
                  f"if [ -d {shlex.quote(self.data)} ]; then {stop} >/dev/null 2>&1; "
                  f"rm -rf {shlex.quote(self.dir)}; fi")
        subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, cwd="/")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.USER}@{self.host}:{self.port}/{database}"

    def new_database(self, prefix: str = "t") -> str:
        """Create an empty database; returns its URL."""
        import psycopg  # noqa: PLC0415

        name = f"{prefix}_{os.getpid()}_{next(self._counter)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        """Drop a database made by new_database (connections still open are cut)."""
        import psycopg  # noqa: PLC0415

        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        try:
            self._run(os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-m", "immediate",
                      "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
