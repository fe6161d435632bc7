"""The chaos workload's Java kafka-clients writer (ChaosWriter.java) as a writer thread.

Compiled once per source content into tests/.cache/java (the jars setup_deps.sh fetched);
``java_classpath()`` is None when Java or the jars are missing (the workload then runs the
Python clients only). The process reports every send, ack and failure on stdout; this thread
feeds them into the Ledger like the Python writers do.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import threading
import time
from typing import Any

from bench.common import tied_popen
from java_build import compile_once

from .threads import WorkerThread
from .workload import Ledger, value_of

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE / "ChaosWriter.java"
JAVA_CACHE = HERE.parent / ".cache" / "java"
VERSION = "4.3"


def java_classpath() -> str | None:
    """Classpath with the compiled ChaosWriter, or None (no java/javac or no jars)."""
    jars = sorted((JAVA_CACHE / f"kafka-{VERSION}").glob("*.jar"))
    if not shutil.which("javac") or not any(j.name.startswith("kafka-clients-") for j in jars):
        return None
    cp = os.pathsep.join(str(j) for j in jars)
    digest = hashlib.sha1(SRC.read_bytes()).hexdigest()[:12]
    return compile_once(SRC, cp, JAVA_CACHE / f"chaos-writer-{VERSION}-{digest}", "ChaosWriter")


class JavaWriter(WorkerThread):
    """One ChaosWriter process: idempotent acks=all, values ``<name>|<n>|...``."""

    def __init__(self, name: str, classpath: str, bootstrap: str, topic: str, partitions: int,
                 ledger: Ledger, stop: threading.Event, rate: float) -> None:
        super().__init__(f"writer-{name}")
        self.wname, self.cp, self.bootstrap = name, classpath, bootstrap
        self.topic, self.partitions, self.ledger = topic, partitions, ledger
        self.stop_ev, self.rate = stop, rate

    def _run(self) -> None:
        proc = tied_popen(
            ["java", "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-cp", self.cp,
             "ChaosWriter", self.bootstrap, self.topic, str(self.partitions), self.wname,
             str(self.rate)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

        def stopper() -> None:
            self.stop_ev.wait()
            try:
                assert proc.stdin is not None
                proc.stdin.write("stop\n")
                proc.stdin.close()
            except OSError:
                pass
        threading.Thread(target=stopper, daemon=True).start()
        led, name = self.ledger, self.wname
        done = False
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                f = line.split()
                if not f:
                    continue
                if f[0] == "S":
                    led.send(value_of(name, int(f[1])), int(f[2]))
                elif f[0] == "A":
                    led.ack(value_of(name, int(f[1])), int(f[2]), int(f[3]))
                elif f[0] == "E":
                    led.fail(value_of(name, int(f[1])), f[2], f[2], f[3] == "true")
                elif f[0] == "DONE":
                    done = True
        finally:
            deadline = time.monotonic() + 150
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if not done:
            raise RuntimeError(f"ChaosWriter {name} exited with {proc.returncode} before DONE")


def start_java_writers(classpath: Any, bootstrap: str, topic: str, partitions: int,
                       ledger: Ledger, stop: threading.Event, count: int = 1,
                       rate: float = 150.0) -> list[JavaWriter]:
    ws = [JavaWriter(f"jv{i}", classpath, bootstrap, topic, partitions, ledger, stop, rate)
          for i in range(count)]
    for w in ws:
        w.start()
    return ws
