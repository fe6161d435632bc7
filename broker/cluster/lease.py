"""Leases measured on monotonic clocks: this broker's own, and what it observes of others.

Fencing must not depend on two machines agreeing on the time of day. So:

- ``OwnLease``: a broker may acknowledge produces only until (the monotonic time at which its
  last *successful* renewal was sent) + lease. The renewal reached the database after it was
  sent, so everyone who later sees it sees it no earlier than that: the broker's own view
  always ends first.
- ``LeaseWatch``: every broker notes, on its own monotonic clock, when it last saw each
  broker row's lease column change. The controller fences a broker only after that row has
  not changed for its lease + the takeover margin. The renewal it last saw was written after
  the owner sent it, so the owner's lease had ended (by at least the margin, less clock-rate
  drift) before anyone touches its WAL. The lease column's value is only a renewal counter
  here; its wall-clock meaning is used as a hint for rows never seen change (a broker that
  starts does not wait a lease for long-dead rows to look dead - it still waits lease + margin
  before fencing them).
- A watcher that could not reach the database for a while (a PostgreSQL outage, its own
  pause: no read for ``blind_ms``, or its own renewals failing) cannot tell a broker that
  died from one that was cut off as it was: that time does not count as anyone's silence, so
  after the database is back the others have (nearly) a full lease + margin to renew before
  anyone is fenced. A broker that really died is fenced that much later. A gap between two
  reads is not blindness when this broker's own renewals reached the database all along
  (every gap between them, counted from the earliest each could have landed to the latest,
  below ``blind_ms``): the database was there, and only this broker's watch rounds ran late
  (a loaded machine). Counting such gaps as blindness postponed a dead broker's fence for as
  long as the rounds stayed late (the chaos suite at load 15-20: a paused broker never fenced).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Iterable

from storage.waits import wait_event

log = logging.getLogger("broker.cluster")


class OwnLease:
    """This broker's lease on its own monotonic clock (checked on every produce answer)."""

    def __init__(self, lease_ms: int) -> None:
        self.lease_s = lease_ms / 1000.0
        self.valid_until = 0.0          # monotonic; 0: never renewed (not a cluster member yet)
        self.enforced = False           # set once registered: before that, nothing to fence
        self.lapsed_at: float | None = None
        self.withheld = 0               # produce answers refused while lapsed (this lapse)
        self._renewal: asyncio.Event | None = None   # set by renewed() (wait_valid)

    def renewed(self, sent_at: float) -> None:
        """A renewal sent at monotonic ``sent_at`` succeeded."""
        until = sent_at + self.lease_s
        if until > self.valid_until:
            self.valid_until = until
        self.enforced = True
        if self._renewal is not None:
            self._renewal.set()
            self._renewal = None
        if self.lapsed_at is not None and time.monotonic() < self.valid_until:
            log.warning("lease renewed: acknowledging produces again after %.0f ms "
                        "(answers withheld=%d)", (time.monotonic() - self.lapsed_at) * 1000,
                        self.withheld)
            self.lapsed_at = None
            self.withheld = 0

    def valid(self) -> bool:
        """Whether produces may be appended and acknowledged now."""
        if not self.enforced:
            return True
        now = time.monotonic()
        if now < self.valid_until:
            return True
        if self.lapsed_at is None:
            self.lapsed_at = now
            log.warning("lease lapsed %.0f ms ago (no successful renewal): withholding produce "
                        "acknowledgements (NOT_LEADER_OR_FOLLOWER) until one succeeds",
                        (now - self.valid_until) * 1000)
        return False

    async def wait_valid(self, timeout_s: float) -> bool:
        """Until the lease is valid again (a renewal succeeded), at most ``timeout_s``;
        whether it is. Called from the event loop (renewed() runs there too)."""
        deadline = time.monotonic() + timeout_s
        while not self.valid():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._renewal is None:
                self._renewal = asyncio.Event()
            await wait_event(self._renewal, left)
        return True

    def withhold(self, n: int = 1) -> None:
        self.withheld += n

    def remaining_ms(self) -> float:
        return (self.valid_until - time.monotonic()) * 1000


@dataclass
class _Seen:
    instance: str
    lease_value: int
    at: float              # monotonic time we first saw this (instance, lease value)
    wall_expired: bool     # first sight ever, and the value's wall time had passed


class LeaseWatch:
    """When each broker row's lease last changed, on this broker's monotonic clock."""

    def __init__(self, blind_ms: float = 1000.0) -> None:
        self._seen: dict[int, _Seen] = {}
        self.blind_ms = blind_ms        # a gap between reads this long: we were blind
        self._last: float | None = None  # monotonic time of the last read
        self._blind_since: float | None = None     # set by blind_since()
        self.blind_gaps = 0
        # our own renewals that committed since the last read: (sent, acknowledged) monotonic
        self._renewals: list[tuple[float, float]] = []

    def renewal(self, sent: float, acked: float) -> None:
        """A renewal of our own, sent at ``sent``, committed (answer at ``acked``): the
        database was reachable at some moment in between."""
        self._renewals.append((sent, acked))
        if len(self._renewals) > 256:
            del self._renewals[:128]

    def _reached_throughout(self, start: float, end: float) -> bool:
        """Whether our renewals show the database reachable from ``start`` to ``end`` with no
        gap of ``blind_ms`` or more (worst case: each renewal landed as late as its answer,
        the one before as early as its send)."""
        limit = self.blind_ms / 1000
        early = start
        for sent, acked in self._renewals:
            if acked <= start:
                continue
            if acked - early > limit:
                return False
            early = max(early, sent)
        return end - early <= limit

    def blind_since(self, since: float) -> None:
        """Our own writes to the database failed from monotonic ``since`` until now (reads
        may have worked): whoever was alive then may have been cut off as we were."""
        self._blind_since = since if self._blind_since is None else min(self._blind_since,
                                                                         since)

    def observe(self, rows: Iterable[object], now_ms: int) -> None:
        now = time.monotonic()
        since = self._blind_since
        if self._last is not None and (now - self._last) * 1000 > self.blind_ms \
                and not self._reached_throughout(self._last, now):
            since = self._last if since is None else min(since, self._last)
        blind = since is not None
        if blind:
            self.blind_gaps += 1
            log.warning("metadata unreachable for %.0f ms: that time does not count towards "
                        "any broker's lease lapse", (now - since) * 1000)  # type: ignore[operator]
        self._last, self._blind_since = now, None
        self._renewals = [r for r in self._renewals if r[1] > now]
        seen: dict[int, _Seen] = {}
        for r in rows:
            node, inst, value = r.node_id, r.instance, r.lease_until_ms  # type: ignore[attr-defined]
            old = self._seen.get(node)
            if old is not None and old.instance == inst and old.lease_value == value:
                # unchanged; the time we were blind does not count as its silence: it may
                # have been cut off just as we were
                seen[node] = old if not blind else _Seen(
                    inst, value, min(now, old.at + (now - since)), old.wall_expired)  # type: ignore[operator]
            else:
                seen[node] = _Seen(inst, value, now, old is None and value <= now_ms)
        self._seen = seen

    def unchanged_ms(self, node: int) -> float:
        """How long the row's lease has not changed, as seen here (0 for an unknown row)."""
        s = self._seen.get(node)
        return 0.0 if s is None else (time.monotonic() - s.at) * 1000

    def alive(self, node: int, lease_ms: int) -> bool:
        """Renewed within a lease as seen here (a first sight of a row whose wall-clock lease
        had already ended counts as not alive: only a hint, fencing never relies on it)."""
        s = self._seen.get(node)
        if s is None or s.lease_value <= 0 or s.wall_expired:
            return False
        return (time.monotonic() - s.at) * 1000 < lease_ms

    def expired(self, node: int, lease_ms: int, margin_ms: int) -> bool:
        """Safe to fence: no renewal seen for lease + margin on this broker's clock."""
        s = self._seen.get(node)
        return s is not None and (time.monotonic() - s.at) * 1000 > lease_ms + margin_ms
