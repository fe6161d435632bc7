"""Run every benchmark and write bench/RESULTS.md with the tables and PNG plots.

    python -m bench.run_all [--quick] [--out bench/RESULTS.md] [--skip wal,catchup]

Runs, in order: the client benchmarks (confluent-kafka produce/consume/latency vs the mock),
the raw-protocol 1 MiB-batch load generator with hot and cold raw Fetch (vs the mock), the WAL
device's own write latency (bench/device.py), and the WAL and catch-up benchmarks of their
owners (bench/wal.py, bench/catchup.py, as subprocesses, their output captured verbatim).
Then it prints issue 20's Done-when figures as ratios with a PASS/FAIL line per item
(bench/goals.py), also at the top of RESULTS.md. ``--quick`` shrinks every size/time for a
smoke run.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from typing import Any

from . import clients, device, goals, rawload
from .common import PY, REPO, Result

HERE = os.path.dirname(os.path.abspath(__file__))


def plot(results: list[Result], out_dir: str, stem: str = "") -> list[str]:
    """Throughput-over-time and latency-percentile PNGs; returns the file names written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots (pip install -e '.[bench]')")
        return []
    files = []

    def finish(fig, ax, ylabel: str, title: str, name: str) -> None:
        """Log-scale y axis, labels and legend; save as out_dir/name and list it."""
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.savefig(os.path.join(out_dir, name), dpi=90)
        plt.close(fig)
        files.append(name)

    series = [(label, s) for r in results for label, s in r.series.items() if s]
    if series:
        fig, ax = plt.subplots(figsize=(9, 5))
        for label, s in series:
            ax.plot([t for t, _ in s], [v for _, v in s], label=label)
        ax.set_xlabel("seconds")
        finish(fig, ax, "MB/s", "Produce throughput over time", f"{stem}throughput.png")
    pcts = [(label, d) for r in results for label, d in r.percentiles.items()]
    if pcts:
        fig, ax = plt.subplots(figsize=(9, 5))
        keys = ["p50", "p99", "p999"]
        width = 0.8 / len(pcts)
        for i, (label, d) in enumerate(pcts):
            ax.bar([k + i * width for k in range(len(keys))], [d[k] for k in keys], width, label=label)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], keys)
        finish(fig, ax, "ms", "Produce latency percentiles", f"{stem}latency.png")
    return files


def run_owner_bench(module: str, args: list[str], timeout: float) -> str:
    """Run another owner's benchmark module as a subprocess; return its output (or the failure)."""
    try:
        p = subprocess.run([PY, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                           timeout=timeout, env=dict(os.environ, PYTHONPATH=REPO))
        out = p.stdout + (f"\n(exit {p.returncode})\n{p.stderr[-3000:]}" if p.returncode else "")
    except subprocess.TimeoutExpired as e:
        out = f"(timed out after {timeout:.0f} s)\n{(e.stdout or b'')[-5000:]!r}"
    print(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes/times (smoke run)")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--skip", default="",
                    help="comma list of: clients,raw,device,wal,catchup")
    a = ap.parse_args(argv)
    skip = set(filter(None, a.skip.split(",")))
    q = a.quick
    started = time.monotonic()
    results: list[Result] = []
    by_name: dict[str, Result] = {}
    sections: list[str] = []
    # a smoke run's brokers format a smaller WAL ring (formatting writes all of it: 2 and 4 GiB
    # took 5 and 10 s on session 45's capped disk)
    small_wal = ["--wal-capacity", str(1 << 30)] if q else []
    if "clients" not in skip:
        rs = clients.run(seconds=1 if q else 6, sizes=[100, 1024] if q else None,
                         broker_args=small_wal)
        for r in rs:
            r.print()
        results += rs
        by_name.update(zip(("produce", "consume", "latency"), rs))
    if "raw" not in skip:
        rs = rawload.run(seconds=1 if q else 8, conns=2 if q else 4, depth=2 if q else 8,
                         batch_bytes=(64 << 10) if q else (1 << 20),
                         fetch_seconds=1 if q else 5, broker_args=small_wal)
        for r in rs:
            r.print()
        results += rs
        by_name["raw"] = rs[0]
    dev = None
    if "device" not in skip:
        dev = device.write_latency(seconds=1 if q else 3)
        r = Result("WAL device write latency (4 KiB, paced 1000/s, one at a time)",
                   ["mode", "directory", "p50 ms", "p99 ms", "p999 ms", "writes"])
        r.rows.append([dev["mode"], dev["dir"], dev["p50"], dev["p99"], dev["p999"], dev["n"]])
        r.notes.append("the floor under acks=all latency: the WAL writes with O_DIRECT and "
                       "dsync on the same filesystem (bench/device.py)")
        r.print()
        results.append(r)
        dev["rates"] = rates = device.write_rates(file_bytes=(64 << 20) if q else (1 << 30))
        r = Result("Device write rates (1 MiB O_DIRECT pieces, 2 writers, a file each)",
                   ["into new files MB/s", "over written blocks MB/s",
                    "produce ceiling MB/s (WAL + objects)"])
        r.rows.append([rates["fresh_mb_s"], rates["overwrite_mb_s"],
                       rates["produce_ceiling_mb_s"]])
        r.notes.append("each produced byte is written twice on this device: into the WAL's "
                       "preallocated ring (over written blocks) and into a new object file; "
                       "one after the other they allow 1 / (1/overwrite + 1/new) MB/s of "
                       "produce, a bound of the device measured alone (bench/device.py)")
        r.print()
        results.append(r)
    if "wal" not in skip:
        args = ["--bytes", str(8 << 20), "--sizes", "65536", "--capacity", str(256 << 20),
                "--rounds", "1", "--half-seconds", "0.5"] if q \
            else ["--bytes", str(256 << 20)]
        sections.append("## Delta WAL (bench/wal.py)\n```\n"
                        + run_owner_bench("bench.wal", args, 120 if q else 300) + "\n```")
    catchup_text = None
    if "catchup" not in skip:
        # 30 windows of 4 s (15 alternating pairs, ~52 s per class): with 10 windows the
        # pooled ratio moved 1.23-1.34 between runs of one build (bench/HISTORY.md, session 16)
        args = ["--backlog-mb", "8", "--seconds", "2", "--skip-s3"] if q else \
            ["--backlog-mb", "100", "--seconds", "10", "--windows", "30"]
        catchup_text = run_owner_bench("bench.catchup", args, 120 if q else 480)
        sections.append("## Catch-up reads (bench/catchup.py)\n```\n" + catchup_text + "\n```")
    from storage.engine import EngineConfig
    goal_table, verdicts = goals.evaluate(by_name, dev, catchup_text, EngineConfig().wal_sync_mode)
    goal_table.print()
    print("\n".join(verdicts))
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    stem = "quick-" if q else ""
    pngs = plot(results, out_dir, stem)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# s3kafka benchmark results\n",
             f"Written by `make bench` (`python -m bench.run_all{' --quick' if q else ''}`) on {now}; "
             f"{os.cpu_count()} CPUs, Python {platform.python_version()}, "
             f"{time.monotonic() - started:.0f} s total. Peer: librdkafka's mock cluster "
             "(in-memory, no durability), same clients, same run. See bench/README.md.\n",
             f"## {goal_table.name}\n\n{goal_table.table()}\n"]
    lines += [f"- {n}" for n in goal_table.notes]
    lines += ["", "```", *verdicts, "```", ""]
    for r in results:
        lines.append(f"## {r.name}\n\n{r.table()}\n")
        lines += [f"- {n}" for n in r.notes]
        lines.append("")
    for p in pngs:
        lines.append(f"![{p}]({p})\n")
    lines += [s + "\n" for s in sections]
    hist = os.path.join(HERE, "HISTORY.md")
    if os.path.exists(hist):
        lines.append("See bench/HISTORY.md for figures before/after each performance change.\n")
    with open(a.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {a.out} ({', '.join(pngs) or 'no plots'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
