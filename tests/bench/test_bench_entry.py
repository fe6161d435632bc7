"""Every bench module that has a command line starts on its own: ``python -m bench.X --help``
in a fresh interpreter (an import cycle between bench modules broke ``python -m bench.clients``
while ``make bench``, which imports them in another order, still ran)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
MODULES = sorted(p.stem for p in BENCH.glob("*.py")
                 if '__name__ == "__main__"' in p.read_text())


def test_the_bench_has_command_lines() -> None:
    assert {"clients", "profile", "rawload", "run_all"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_each_bench_command_starts_on_its_own(module: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent))
    r = subprocess.run([sys.executable, "-m", f"bench.{module}", "--help"], cwd=BENCH.parent,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in r.stdout.lower()
