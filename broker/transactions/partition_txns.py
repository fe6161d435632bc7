"""What one partition keeps of transactions: ongoing ones, the LSO and the aborted index.

- ``ongoing``: producer id -> offset of its transaction's first batch in this partition (set
  when a transactional batch gets its offsets, cleared when the marker is durable). The last
  stable offset is the smallest of them, or the high watermark when there is none.
- ``aborted``: (producer id, first offset, last offset = the ABORT marker's offset), in marker
  order, so sorted by last offset. A read_committed Fetch gets the entries that overlap the
  fetched range; clients drop those producers' batches in it.
- ``fence``: producer id -> epoch of its last marker; a transactional batch with an older epoch
  arrives after its transaction was ended (a zombie) and is refused.
- ``marked``: producer id -> the largest coordinator epoch of its markers here. A marker sent
  by a transaction coordinator that is not above it is a late copy of one already written (a
  call that timed out at the coordinator and was retried, then reached the leader after the
  next transaction began): written, it would end that next transaction here.
- ``verified``: producer id -> epoch a transaction coordinator on another broker confirmed
  (this partition is in its ongoing transaction); ``guards``: the check in flight per producer.
  A marker clears both, so an answer that crosses a marker is not taken (Kafka's
  verification guard). Not saved: after a restart the coordinator is asked again.

The state is saved in the partition's producer snapshot (metadata store) and rebuilt from the
batch headers and markers of the log tail after it, so it survives restarts exactly.
Nothing here runs for non-transactional batches.
"""
from __future__ import annotations

import bisect
from typing import Any


class PartitionTxns:
    """Transactions of one partition (see the module docstring)."""

    __slots__ = ("ongoing", "aborted", "_aborted_last", "fence", "marked", "verified", "guards",
                 "gate")

    def __init__(self) -> None:
        self.ongoing: dict[int, int] = {}
        self.aborted: list[tuple[int, int, int]] = []
        self._aborted_last: list[int] = []
        self.fence: dict[int, int] = {}
        self.marked: dict[int, int] = {}
        self.verified: dict[int, int] = {}
        self.guards: dict[int, object] = {}
        self.gate: Any = None   # asyncio.Lock of the appends waiting for a coordinator

    def lso(self, high_watermark: int) -> int:
        if not self.ongoing:
            return high_watermark
        return min(min(self.ongoing.values()), high_watermark)

    def begin(self, producer_id: int, offset: int) -> bool:
        """A transactional batch at ``offset``; True when it starts the producer's transaction."""
        if producer_id in self.ongoing:
            return False
        self.ongoing[producer_id] = offset
        return True

    def end(self, producer_id: int, epoch: int, commit: bool, marker_offset: int,
            coordinator_epoch: int = -1) -> None:
        """A durable marker at ``marker_offset`` ends the producer's transaction here."""
        if coordinator_epoch > self.marked.get(producer_id, -1):
            self.marked[producer_id] = coordinator_epoch
        first = self.ongoing.pop(producer_id, None)
        self.verified.pop(producer_id, None)
        self.guards.pop(producer_id, None)
        if epoch > self.fence.get(producer_id, -1):
            self.fence[producer_id] = epoch
        if not commit and first is not None:
            self.aborted.append((producer_id, first, marker_offset))
            self._aborted_last.append(marker_offset)

    def marked_already(self, producer_id: int, coordinator_epoch: int) -> bool:
        """A coordinator's marker that is a copy of one written here already (see ``marked``)."""
        return coordinator_epoch <= self.marked.get(producer_id, -1)

    def fenced(self, producer_id: int, epoch: int) -> bool:
        return epoch < self.fence.get(producer_id, -1)

    def aborted_between(self, start: int, end: int) -> list[tuple[int, int]]:
        """(producer id, first offset) of aborted transactions overlapping [start, end)."""
        i = bisect.bisect_left(self._aborted_last, start)
        return [(pid, first) for pid, first, _last in self.aborted[i:] if first < end]

    def trim_below(self, log_start: int) -> None:
        """Drop aborted entries wholly below the log start (retention, DeleteRecords)."""
        i = bisect.bisect_left(self._aborted_last, log_start)
        if i:
            del self.aborted[:i]
            del self._aborted_last[:i]

    def forget_aborted(self, markers: list[tuple[int, int]]) -> None:
        """Drop the entries of aborted transactions whose markers (producer id, marker offset)
        the log cleaner removed with the last of their data (nothing is left to filter)."""
        gone = set(markers)
        keep = [a for a in self.aborted if (a[0], a[2]) not in gone]
        if len(keep) != len(self.aborted):
            self.aborted = keep
            self._aborted_last = [a[2] for a in keep]

    # --- snapshots -------------------------------------------------------------------------
    def to_state(self, covered: int) -> dict[str, Any]:
        """What the snapshot covering offsets below ``covered`` holds (the rest is replayed)."""
        return {"ongoing": {str(p): o for p, o in self.ongoing.items() if o < covered},
                "aborted": [list(a) for a in self.aborted if a[2] < covered],
                "fence": {str(p): e for p, e in self.fence.items()},
                "marked": {str(p): e for p, e in self.marked.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> "PartitionTxns":
        t = cls()
        if not state:
            return t
        t.ongoing = {int(p): int(o) for p, o in state.get("ongoing", {}).items()}
        t.aborted = sorted((tuple(int(x) for x in a) for a in state.get("aborted", [])),
                           key=lambda a: a[2])  # type: ignore[misc]
        t._aborted_last = [a[2] for a in t.aborted]
        t.fence = {int(p): int(e) for p, e in state.get("fence", {}).items()}
        t.marked = {int(p): int(e) for p, e in state.get("marked", {}).items()}
        return t
