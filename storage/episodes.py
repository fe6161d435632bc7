"""Conditions logged once per episode, not once per request.

A full WAL, an object store that keeps failing and back-pressured producers can last minutes
and touch every request meanwhile: a log line per request or per retry buries everything
else. An Episode logs one line when the condition starts (with the reason) and one when it
ends (with its duration and how often it was met); between the two it only counts.
"""
from __future__ import annotations

import logging
import time


class Episode:
    """One kind of condition. ``hit(reason)`` whenever it is met; ``clear()`` when it is
    known to be over, or ``expire()`` periodically to end it after ``quiet_s`` without a
    hit (for conditions with no clear "over" event, such as back-pressure)."""

    def __init__(self, logger: logging.Logger, what: str, quiet_s: float = 5.0,
                 level: int = logging.WARNING, end_level: int | None = None) -> None:
        self.log = logger
        self.what = what
        self.quiet_s = quiet_s
        self.level = level
        self.end_level = level if end_level is None else end_level   # e.g. INFO: "it is back"
        self.active = False
        self.started = 0.0          # monotonic start of the current episode
        self.last_hit = 0.0
        self.hits = 0               # hits in the current episode
        self.episodes = 0           # episodes so far (for metrics)
        self.total_s = 0.0          # time spent in finished episodes (for metrics)

    def hit(self, reason: str) -> None:
        now = time.monotonic()
        self.last_hit = now
        self.hits += 1
        if not self.active:
            self.active = True
            self.started = now
            self.hits = 1
            self.episodes += 1
            self.log.log(self.level, "episode=%s state=started reason=%s", self.what, reason)
        elif self.log.isEnabledFor(logging.DEBUG):
            self.log.debug("episode=%s state=continues count=%d for_s=%.1f reason=%s",
                           self.what, self.hits, now - self.started, reason)

    def clear(self) -> None:
        if not self.active:
            return
        took = time.monotonic() - self.started
        self.active = False
        self.total_s += took
        self.log.log(self.end_level, "episode=%s state=ended duration_s=%.1f count=%d", self.what,
                     took, self.hits)

    def expire(self) -> None:
        if self.active and time.monotonic() - self.last_hit >= self.quiet_s:
            self.clear()
