"""Alternating A/B runs of the catch-up isolation bench: code trees and broker flags.

    python -m bench.catchup_ab --variant old=/path/to/old/checkout --variant new=.
                               [--variant name=TREE:--flag=value,...] [--rounds 3]
                               [--rt] [-- extra bench.catchup arguments]

Runs ``python -m bench.catchup --skip-s3`` (default: ``--backlog-mb 100 --seconds 10
--windows 30``, as ``make bench``) from each variant's tree with its broker flags (passed as
``--engine-arg``), variant after variant, round after round, so that the machine's load drifts
over all of them alike; then prints per variant every run's pooled p99 ratio (produce / tail),
noise floor and catch-up MB/s, and the median and range of the ratios. A difference between
variants means something only where it exceeds the spread of each variant's runs and the noise
floors are near 1.0. ``--rt`` runs each bench (broker and clients) at SCHED_FIFO 1 (``chrt -f
1``, as root): other processes' CPU then stays out of the latencies (their disk traffic does
not; the cold-read threads leave RT for SCHED_BATCH themselves).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess

from .common import PY

DEFAULT = ["--backlog-mb", "100", "--seconds", "10", "--windows", "30"]


def parse(text: str) -> dict[str, float]:
    """The figures of one bench.catchup run (NaN where missing)."""
    def num(pattern: str, group: int = 1) -> float:
        m = re.search(pattern, text)
        return float(m.group(group)) if m else float("nan")
    ratio = r"ratio p99 with/without \(pooled\): produce ([\d.]+)x, tail e2e ([\d.]+)x"
    return {"produce": num(ratio), "tail": num(ratio, 2),
            "floor": num(r"noise floor, alone vs alone[^:]*: produce ([\d.]+)x"),
            "mb_s": num(r"catch-up reader while on: ([\d.]+) MB/s"),
            "alone_p99": num(r"alone \(reader paused\)\s+\d+\s+[\d.]+\s+([\d.]+)")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True,
                    help="name=TREE[:--flag=value,...] (TREE: a checkout of this repository)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rt", action="store_true", help="run each bench at SCHED_FIFO 1")
    ap.add_argument("rest", nargs=argparse.REMAINDER,
                    help="after --: bench.catchup arguments instead of the make bench ones")
    a = ap.parse_args()
    extra = [x for x in a.rest if x != "--"] or DEFAULT
    variants = []
    for v in a.variant:
        name, _, spec = v.partition("=")
        tree, _, flags = spec.partition(":")
        variants.append((name, os.path.abspath(tree),
                         [f"--engine-arg={f}" for f in flags.split(",") if f]))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in variants}
    for r in range(a.rounds):
        for name, tree, flags in variants:
            cmd = ([*(["chrt", "-f", "1"] if a.rt else []), PY, "-m", "bench.catchup",
                    "--skip-s3", *extra, *flags])
            p = subprocess.run(cmd, cwd=tree, capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=tree))
            fig = parse(p.stdout)
            runs[name].append(fig)
            print(f"round {r + 1} {name}: produce {fig['produce']:.2f}x tail {fig['tail']:.2f}x "
                  f"(floor {fig['floor']:.2f}, alone p99 {fig['alone_p99']:.2f} ms, catch-up "
                  f"{fig['mb_s']:.1f} MB/s)" + ("" if p.returncode == 0 else
                                              f" exit {p.returncode}: {p.stderr[-300:]}"),
                  flush=True)
    print(f"\n{'variant':<12} {'produce ratio median (range)':>30} {'tail ratio median (range)':>28} "
          f"{'noise floors':>16} {'catch-up MB/s':>16}")
    for name, _, _ in variants:
        rs = runs[name]

        def span(key: str) -> str:
            v = sorted(x[key] for x in rs if x[key] == x[key])
            return f"{statistics.median(v):.2f} ({v[0]:.2f}-{v[-1]:.2f})" if v else "n/a"
        floors = sorted(x["floor"] for x in rs if x["floor"] == x["floor"])
        mbs = sorted(x["mb_s"] for x in rs if x["mb_s"] == x["mb_s"])
        print(f"{name:<12} {span('produce'):>30} {span('tail'):>28} "
              f"{(f'{floors[0]:.2f}-{floors[-1]:.2f}' if floors else 'n/a'):>16} "
              f"{(f'{mbs[0]:.1f}-{mbs[-1]:.1f}' if mbs else 'n/a'):>16}")


if __name__ == "__main__":
    main()
