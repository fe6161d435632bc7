"""Spark's Kafka connector calls, reproduced with the Java client against a real s3kafka broker.

spark-sql-kafka-0-10 cannot be downloaded here (Maven only), so java/SparkConnectorCalls.java
makes the same client calls with the same configs as its driver (AdminClient), executors
(assign/seek/poll consumer) and sink (byte-array producer). Spark 4.x ships kafka-clients 3.9;
4.3 is checked too because users upgrade the client jar.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import uuid

import pytest
from filelock import FileLock

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "java" / "SparkConnectorCalls.java"
CLASSES = HERE.parents[1] / "tests" / ".cache" / "java" / "spark-classes"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _compile(version: str, classpath: str) -> pathlib.Path:
    """javac the reproduction against this client version (once, unless the source changed)."""
    if shutil.which("javac") is None:
        pytest.skip("javac not installed")
    out = CLASSES / version
    target = out / "SparkConnectorCalls.class"
    CLASSES.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CLASSES / f"{version}.lock")):   # pytest-xdist workers: one javac at a time
        if not target.exists() or target.stat().st_mtime < SOURCE.stat().st_mtime:
            out.mkdir(parents=True, exist_ok=True)
            subprocess.run(["javac", "-cp", classpath, "-d", str(out), str(SOURCE)], check=True,
                           timeout=300)
    return out


def _run(version: str, classpath: str, bootstrap: str, *extra: str) -> subprocess.CompletedProcess:
    classes = _compile(version, classpath)
    topic = f"spark-repro-{uuid.uuid4().hex[:8]}"
    cp = os.pathsep.join([str(classes), classpath])
    return subprocess.run(
        ["java", "-cp", cp, "SparkConnectorCalls", bootstrap, topic, *extra],
        capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
    )


def _report(proc: subprocess.CompletedProcess) -> str:
    oks = sum(1 for line in proc.stdout.splitlines() if line.startswith("OK "))
    return f"exit {proc.returncode} after {oks} passed checks\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("version", ["3.9", "4.3"])
def test_driver_executor_and_sink_calls(version, java_classpath, spark_broker):
    """describeTopics/listTopics/listOffsets (earliest, latest, forTimestamp; both isolation
    levels), assign + seekToBeginning/End + position + seek + poll, byte-array producer."""
    if version not in java_classpath:
        pytest.skip(f"kafka-clients {version} not available")
    proc = _run(version, java_classpath[version], spark_broker.bootstrap)
    assert proc.returncode == 0 and "DONE" in proc.stdout, _report(proc)
    assert "FAIL" not in proc.stdout


def test_isolation_levels_with_an_open_transaction(java_classpath, spark_broker):
    """read_committed latest offset stops at the open transaction (Spark's driver honours
    kafka.isolation.level); after commit, the executor reads across the commit marker."""
    proc = _run("3.9", java_classpath["3.9"], spark_broker.bootstrap, "transactions")
    assert proc.returncode == 0 and "DONE" in proc.stdout, _report(proc)
