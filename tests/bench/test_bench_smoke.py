"""Smoke test: every benchmark's code path runs with tiny sizes and produces figures.

Asserts that figures exist and are positive, never how fast they are (speed lives in bench/).
"""
from __future__ import annotations

import re

import pytest

from bench import run_all


def _table_row(text: str, section: str, target: str) -> dict[str, str]:
    """The row of ``target`` in the first Markdown table after heading ``section``, by column name."""
    lines = text[text.index(section):].splitlines()
    header_at = next(i for i, line in enumerate(lines) if line.startswith("| "))
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    names = cells(lines[header_at])
    for line in lines[header_at + 2:]:
        if not line.startswith("|"):
            break
        row = dict(zip(names, cells(line)))
        if row.get(names[0]) == target:
            return row
    raise AssertionError(f"no {target!r} row in {section!r}")


@pytest.mark.timeout(280)
def test_run_all_quick_writes_results_with_figures(tmp_path) -> None:
    out = tmp_path / "RESULTS.md"
    assert run_all.main(["--quick", "--out", str(out)]) == 0
    text = out.read_text()
    for title in ("Produce throughput, confluent-kafka", "Consume throughput", "Produce latency",
                  "Raw-protocol produce", "Device write rates", "Delta WAL", "Catch-up reads"):
        assert title in text
    assert "Traceback" not in text
    # s3kafka rows carry real, positive numbers (the raw loadgen got acks without errors)
    raw = _table_row(text, "Raw-protocol produce", "s3kafka")
    assert float(raw["MB/s"].replace(",", "")) > 0 and raw["errors"] == "0"
    prod = re.search(r"\| 100 \| ([\d,.]+) \| ([\d,.]+) \| ([\d,.]+) \|", text)
    assert prod and float(prod.group(1).replace(",", "")) > 0 and float(prod.group(3).replace(",", "")) > 0
    # who was busy during the 100 B produce run: the client's loop thread and the broker did work
    cpu = re.search(r"100 B: client's busiest thread (\d+) %, client (\d+) %, broker (\d+) %", text)
    assert cpu and int(cpu.group(1)) > 0 and int(cpu.group(2)) >= int(cpu.group(1)) \
        and int(cpu.group(3)) > 0, text[text.index("Produce throughput"):][:2000]
    try:  # plots need the `bench` extra (matplotlib); `make test` installs only `test`
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "quick-throughput.png").stat().st_size > 0
    assert (tmp_path / "quick-latency.png").stat().st_size > 0
