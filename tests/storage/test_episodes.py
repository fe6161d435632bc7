"""Episode: a condition met on every request is logged once when it starts and once when it
ends, not per hit."""
from __future__ import annotations

import logging
import time

from storage.episodes import Episode


def test_one_start_and_one_end_line_per_episode(caplog):
    log = logging.getLogger("test.episodes")
    ep = Episode(log, "wal_full", quiet_s=0.05)
    with caplog.at_level(logging.INFO, logger="test.episodes"):
        for _ in range(1000):
            ep.hit("the WAL ring holds only data not yet uploaded")
        ep.expire()                               # hit just now: still on
        assert ep.active
        time.sleep(0.06)
        ep.expire()
        assert not ep.active
        ep.hit("again")
        ep.clear()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "episode=wal_full state=started reason=the WAL ring holds only data " \
                       "not yet uploaded"
    assert lines[1].startswith("episode=wal_full state=ended duration_s=")
    assert lines[1].endswith("count=1000")
    assert len(lines) == 4 and ep.episodes == 2
