"""bench.device.write_rates and the figures make bench derives from it (issue 20 item 1: the
device's double write - the WAL's preallocated ring, then a new object file - bounds produce)."""
from __future__ import annotations

import math
import os

from bench import device, goals
from bench.common import Result


def test_write_rates_measure_new_and_written_blocks_and_leave_nothing_behind(tmp_path) -> None:
    r = device.write_rates(str(tmp_path), file_bytes=4 << 20, writers=2, piece=1 << 20)
    assert r["fresh_mb_s"] > 0 and r["overwrite_mb_s"] > 0
    # one byte into the WAL and one into a new object, one after the other
    want = 1 / (1 / r["fresh_mb_s"] + 1 / r["overwrite_mb_s"])
    assert math.isclose(r["produce_ceiling_mb_s"], want)
    assert r["produce_ceiling_mb_s"] < min(r["fresh_mb_s"], r["overwrite_mb_s"])
    assert os.listdir(tmp_path) == []


def _raw(ours_mb_s: float, mock_mb_s: float) -> Result:
    raw = Result("raw", ["target"])
    raw.extra["s3kafka"] = {"mb_s": ours_mb_s, "cpu_ms_mib": 0.4}
    raw.extra["mock"] = {"mb_s": mock_mb_s, "cpu_ms_mib": 0.3}
    return raw


def _row(table: Result, starts: str) -> list:
    return next(r for r in table.rows if str(r[1]).startswith(starts))


def test_goals_show_the_devices_ceiling_against_the_mock() -> None:
    dev = {"p99": 0.2, "rates": {"produce_ceiling_mb_s": 1200.0}}
    table, _ = goals.evaluate({"raw": _raw(1000.0, 4000.0)}, dev, None, "dsync")
    assert _row(table, "(info) device's produce ceiling")[2] == "1200.00"
    assert _row(table, "(info) that ceiling / mock")[2] == "0.30"
    # information rows: never a goal, never counted in the item's verdict
    assert _row(table, "(info) that ceiling / mock")[4] == "-"


def test_goals_without_the_rates_read_not_measured() -> None:
    table, _ = goals.evaluate({"raw": _raw(1000.0, 4000.0)}, {"p99": 0.2}, None, "dsync")
    assert _row(table, "(info) device's produce ceiling")[2] == "n/a"


def test_goals_show_the_steady_cpu_of_the_event_loop_and_the_object_writers() -> None:
    raw = _raw(1000.0, 4000.0)
    raw.extra["s3kafka"]["threads_ms_mib_steady"] = {"event-loop": 0.47, "s3k-io": 0.16,
                                                     "uvloop": 0.01}
    table, _ = goals.evaluate({"raw": raw}, {"p99": 0.2}, None, "dsync")
    assert _row(table, "(info) of which on the event loop")[2] == "0.47 ms"
    assert _row(table, "(info) of which on the object writers")[2] == "0.16 ms"
    assert _row(table, "(info) of which on the object writers")[4] == "-"
    # a run without the split (the mock, an old broker): not measured
    table, _ = goals.evaluate({"raw": _raw(1000.0, 4000.0)}, {"p99": 0.2}, None, "dsync")
    assert _row(table, "(info) of which on the event loop")[2] == "n/a"
