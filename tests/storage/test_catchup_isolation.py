"""Through the broker: a catch-up consumer paced by the adaptive cold-read budget still reads
the whole backlog from the object store, in order, while a producer and a tail consumer work
on another topic at the same time."""
from __future__ import annotations

import threading

import pytest

from broker_helpers import ENGINE_ARGS, check_log, consume_all, create_topic, produce

pytestmark = pytest.mark.e2e

PACED = ["--cold-read-bytes-per-s", str(2 << 20), "--cold-read-min-bytes-per-s", str(1 << 20),
         "--cold-read-lag-target-ms", "0.5", "--cold-read-max-bytes", str(32 << 10)]


def test_paced_catchup_reads_everything_while_tail_runs(broker_factory) -> None:
    b = broker_factory(ENGINE_ARGS + PACED)
    create_topic(b.bootstrap, "backlog")
    create_topic(b.bootstrap, "tail")
    backlog = [f"b-{i:06d}-".encode() * 100 for i in range(3000)]       # ~3 MB
    acked = produce(b.bootstrap, "backlog", backlog)
    assert len(acked) == len(backlog)
    b.stop()
    b.start()               # empty caches: every backlog byte is a cold read, paced
    tail_vals = [f"t-{i:05d}".encode() for i in range(400)]
    tail: dict[str, list] = {}

    def tail_load() -> None:
        tail["acked"] = produce(b.bootstrap, "tail", tail_vals)
        tail["read"] = consume_all(b.bootstrap, "tail", len(tail_vals))

    t = threading.Thread(target=tail_load)
    t.start()
    recs = consume_all(b.bootstrap, "backlog", len(backlog), timeout=120)
    t.join(120)
    check_log(recs, acked)
    assert [v for _, v in recs] == backlog, "cold reads return the backlog in order"
    assert tail["acked"] == tail_vals
    check_log(tail["read"], tail_vals)
    assert "Traceback" not in b.log_text()
