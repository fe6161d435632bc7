"""Issue 20's "Done when" figures, as ratios from one ``bench.run_all`` run, with a PASS/FAIL
line per item (the speed goals: the broker at the speed of its own WAL).

Each figure comes from the tables of the same run: raw 1 MiB produce and raw Fetch hot/cold
(bench.rawload) against the mock, confluent-kafka produce and latency (bench.clients) against
the mock, the WAL device's own write p99 (bench.device), and the catch-up isolation ratio
(bench.catchup's output). A figure that was not measured (skipped part) reads "n/a" and its
item "NOT RUN".
"""
from __future__ import annotations

import math
import re
from typing import Any

from .common import Result

NAN = float("nan")


def _ratio(a: Any, b: Any) -> float:
    try:
        return a / b if b else NAN
    except TypeError:
        return NAN


def _ok(value: float, goal: str) -> bool | None:
    """None when the value is missing; else whether ``value`` meets ``goal`` ('>= x'/'<= x';
    '' = shown for information, always met)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if not goal:
        return True
    op, limit = goal.split()
    return value >= float(limit) if op == ">=" else value <= float(limit)


def catchup_ratios(text: str) -> tuple[float, float]:
    """(produce, tail e2e) pooled p99 ratio with/without the catch-up reader from
    bench.catchup's output; NaN when absent."""
    m = re.search(r"ratio p99 with/without[^:]*: produce ([\d.]+)x, tail e2e ([\d.]+)x", text)
    return (float(m.group(1)), float(m.group(2))) if m else (NAN, NAN)


def catchup_info(text: str) -> tuple[float, float]:
    """(catch-up reader MB/s while producers ran, produce noise floor) from bench.catchup's
    output: a ratio bought by starving the reader is no isolation, and a floor far from 1.0
    says how far the ratio can be trusted; NaN when absent."""
    m = re.search(r"catch-up reader while on: ([\d.]+) MB/s", text)
    f = re.search(r"noise floor, alone vs alone[^:]*: produce ([\d.]+)x", text)
    return (float(m.group(1)) if m else NAN, float(f.group(1)) if f else NAN)


def evaluate(by_name: dict[str, Result], device: dict[str, Any] | None,
             catchup_text: str | None, wal_sync_default: str) -> tuple[Result, list[str]]:
    """The Done-when table (figure, value, goal, met) and one verdict line per item."""
    rows: list[tuple[int, str, float, str, str]] = []   # item, figure, value, goal, unit

    def add(item: int, figure: str, value: float, goal: str, unit: str = "") -> None:
        rows.append((item, figure, value, goal, unit))

    raw = by_name.get("raw")
    ours = raw.extra.get("s3kafka") if raw else None
    mock = raw.extra.get("mock") if raw else None
    if ours:
        add(1, "raw 1 MiB produce MB/s, s3kafka/mock", _ratio(ours["mb_s"], (mock or {}).get("mb_s")),
            ">= 0.5")
        add(1, "broker CPU per MiB produced", ours.get("cpu_ms_mib", NAN), "<= 0.5", "ms")
        # the same from 3 s on: the fresh broker's LogCache fill (its first ~1 GiB lands in
        # fresh memory) left out; information only, the goal is the whole run's
        add(1, "(info) broker CPU per MiB produced after the first 3 s (LogCache filled)",
            ours.get("cpu_ms_mib_steady", NAN), "", "ms")
        # its kernel part: the receive copy, the Direct IO of WAL and objects, fsyncs, task
        # switches; what the interpreter's share is measured against
        add(1, "(info) of which in the kernel (system time), after the first 3 s",
            ours.get("kernel_ms_mib_steady", NAN), "", "ms")
        # by thread (broker/thread_names.py): the event loop (receive, checks, WAL) and the
        # object writers (s3k-io: the upload's puts and metadata calls) are nearly all of it
        groups = ours.get("threads_ms_mib_steady") or {}
        add(1, "(info) of which on the event loop thread, after the first 3 s",
            groups.get("event-loop", NAN), "", "ms")
        add(1, "(info) of which on the object writers (s3k-io threads), after the first 3 s",
            groups.get("s3k-io", NAN), "", "ms")
        refused = ours.get("retries", 0) + ours.get("error_codes", {}).get(19, 0)
        add(1, "produce requests refused by back-pressure", float(refused), "<= 0")
        # what holds the MB/s: the device under the WAL and the file:// objects writes every
        # produced byte twice; the mock keeps everything in memory
        add(1, "(info) device MB/s written during raw produce (WAL + objects)",
            ours.get("disk_mb_s", NAN), "")
        add(1, "(info) device bytes written per byte produced",
            ours.get("disk_per_byte", NAN), "")
        add(1, "(info) device busy during raw produce, share of the time",
            ours.get("disk_busy", NAN), "")
        # the device measured alone (bench.device.write_rates): how far its double write lets
        # the MB/s ratio go in this run
        ceiling = ((device or {}).get("rates") or {}).get("produce_ceiling_mb_s", NAN)
        add(1, "(info) device's produce ceiling alone (WAL overwrite + new object files), MB/s",
            ceiling, "")
        add(1, "(info) that ceiling / mock MB/s: the most this device lets the ratio reach",
            _ratio(ceiling, (mock or {}).get("mb_s")), "")
    else:
        add(1, "raw 1 MiB produce MB/s, s3kafka/mock", NAN, ">= 0.5")
    prod = by_name.get("produce")
    for size, goal in ((100, ">= 1.0"), (1024, ">= 0.5"), (16384, ">= 0.5")):
        a = prod.extra["s3kafka"].get(size) if prod else None
        b = (prod.extra.get("mock") or {}).get(size) if prod else None
        add(2, f"confluent-kafka produce {size} B msgs/s, s3kafka/mock",
            _ratio(a["msgs_s"], b["msgs_s"]) if a and b else NAN, goal)
    add(3, "hot consume, raw Fetch MB/s, s3kafka/mock",
        _ratio(ours.get("fetch_mb_s"), (mock or {}).get("fetch_mb_s")) if ours else NAN, ">= 1.0")
    add(3, "cold consume (object store) / hot, raw Fetch MB/s",
        _ratio(ours.get("cold_mb_s"), ours.get("fetch_mb_s")) if ours else NAN, ">= 0.5")
    # information, robust on a busy machine: CPU per MiB against the mock's own thread
    if ours and mock:
        add(1, "(info) broker CPU per MiB produced, mock/s3kafka",
            _ratio(mock.get("cpu_ms_mib"), ours.get("cpu_ms_mib")), "")
        add(3, "(info) broker CPU per MiB served hot, mock/s3kafka",
            _ratio(mock.get("fetch_cpu_ms_mib"), ours.get("fetch_cpu_ms_mib")), "")
    if ours:
        add(3, "(info) broker CPU per MiB served cold, ms", ours.get("cold_cpu_ms_mib", NAN), "",
            "ms")
    lat = by_name.get("latency")
    pts = lat.extra["s3kafka"] if lat else []
    # bench.clients measures a tenth of the max rate first, then 1000 msgs/s
    tenth = pts[0] if len(pts) >= 2 else None
    at1000 = pts[-1] if pts else None
    add(4, f"produce p99, 100 B, linger 0, at a tenth of the max rate "
           f"({tenth['rate']:.0f} msgs/s)" if tenth else "produce p99 at a tenth of the max rate",
        tenth["p99"] if tenth else NAN, "<= 10", "ms")
    dev = device["p99"] if device else NAN
    add(4, f"produce p99 at 1000 msgs/s ({at1000['p99']:.2f} ms) minus the WAL device's write "
           f"p99 ({dev:.2f} ms)" if at1000 else "produce p99 at 1000 msgs/s minus the device p99",
        at1000["p99"] - dev if at1000 else NAN, "<= 2", "ms")
    # the host's share of the VM's CPU time during that run: a noisy hour's stalls hit the
    # mock as well (bench.common.steal_share)
    add(4, "(info) host steal time during the 1000 msgs/s run, share of all CPU time",
        at1000.get("steal", NAN) if at1000 else NAN, "")
    cp, ct = catchup_ratios(catchup_text or "")
    add(5, "catch-up isolation, pooled p99 ratio, produce", cp, "<= 1.2")
    add(5, "catch-up isolation, pooled p99 ratio, tail end-to-end", ct, "<= 1.2")
    cmb, floor = catchup_info(catchup_text or "")
    add(5, "catch-up reader MB/s while producers run (info)", cmb, "")
    add(5, "catch-up noise floor, alone vs alone p99 ratio (info)", floor, "")
    add(5, "WAL sync mode default is dsync (1 = yes)", 1.0 if wal_sync_default == "dsync" else 0.0,
        ">= 1")

    table = Result("Issue 20: Done-when figures of this run", ["item", "figure", "value", "goal",
                                                               "met"])
    verdict: dict[int, list[bool | None]] = {}
    rows.sort(key=lambda r: r[0])
    for item, figure, value, goal, unit in rows:
        met = _ok(value, goal)
        if goal:
            verdict.setdefault(item, []).append(met)
        shown = "n/a" if met is None else (f"{value:.2f} {unit}".strip())
        table.rows.append([item, figure, shown, f"{goal} {unit}".strip() if goal else "-",
                           "-" if not goal else {True: "yes", False: "NO", None: "n/a"}[met]])
    lines = []
    names = {1: "raw 1 MiB produce vs mock, CPU/MiB, no back-pressure",
             2: "confluent-kafka produce vs mock",
             3: "hot Fetch vs mock, cold vs hot",
             4: "produce latency p99",
             5: "catch-up isolation, durability defaults",
             6: "closing note (before/after table, three largest costs): bench/HISTORY.md"}
    for item in range(1, 6):
        mets = verdict.get(item, [None])
        state = "NOT RUN" if all(m is None for m in mets) else \
            "PASS" if all(m is True for m in mets) else "FAIL"
        lines.append(f"Done-when {item} ({names[item]}): {state}")
    lines.append(f"Done-when 6 ({names[6]}): see the file, not measured here")
    table.notes.append("the crash tests (tests/wal, tests/storage) are the other half of item 5: "
                       "`make test`")
    return table, lines
