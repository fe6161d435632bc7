"""The host's steal time beside the latency runs (bench.common.host_ticks / steal_share): the
share of the VM's CPU time the host gave to something else, which a noisy hour's latency
stalls come with, the mock's as well as the broker's."""
from __future__ import annotations

import math
import time

from bench import goals
from bench.common import Result, host_ticks, steal_share


def test_host_ticks_count_up_and_steal_is_part_of_them() -> None:
    before = host_ticks()
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        pass
    after = host_ticks()
    assert after[1] > before[1] > 0
    assert 0 <= after[0] - before[0] <= after[1] - before[1]
    assert 0.0 <= steal_share(before, after) <= 1.0


def test_steal_share_is_steal_over_all_ticks() -> None:
    assert steal_share((10, 1000), (60, 2000)) == 0.05
    assert math.isnan(steal_share((10, 1000), (10, 1000)))


def test_goals_show_the_steal_of_the_1000_msgs_run() -> None:
    lat = Result("latency", ["rate"])
    lat.extra = {"s3kafka": [{"rate": 11_000, "p99": 5.0, "steal": 0.01},
                             {"rate": 1000, "p99": 3.0, "steal": 0.08}], "mock": None}
    table, _ = goals.evaluate({"latency": lat}, {"p99": 0.5}, None, "dsync")
    row = next(r for r in table.rows if str(r[1]).startswith("(info) host steal time"))
    assert row[2] == "0.08" and row[4] == "-"
