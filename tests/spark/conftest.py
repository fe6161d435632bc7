"""Fixtures of the Spark pipeline tests: import path of deploy/spark and one local SparkSession."""
from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Iterator

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SPARK_DIR = REPO / "deploy" / "spark"
if str(SPARK_DIR) not in sys.path:
    sys.path.insert(0, str(SPARK_DIR))


@pytest.fixture(scope="package")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One local[2] SparkSession for the Spark tests (JVM start-up is the expensive part);
    stopped when tests/spark is done so it holds no memory during other areas' tests."""
    pyspark = pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    session = (
        SparkSession.builder.master("local[2]")
        .appName("s3kafka-spark-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.warehouse.dir", str(warehouse))
        .config("spark.driver.extraJavaOptions", f"-Dderby.system.home={warehouse}")
        .config("spark.sql.streaming.stateStore.maintenanceInterval", "600s")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    assert pyspark.__version__
    yield session
    session.stop()


#: A small WAL: the default 2 GiB preallocation per broker fills /tmp quickly across test runs.
SMALL_WAL = ["--wal-capacity", str(128 << 20)]


@pytest.fixture(scope="module")
def spark_broker(module_broker_factory):
    """One broker per test module (each test uses its own topics), with a small WAL."""
    return module_broker_factory(SMALL_WAL)
