"""Durable transaction state in the metadata database (table ``kafka_txn_state``).

One row per transactional id, written (and committed) at every state change before the
coordinator answers, so a restarted broker (or, with a shared PostgreSQL database, another
broker taking the coordinator over) resumes every transaction where it stood: completes a
PREPARE_COMMIT/PREPARE_ABORT and aborts an ONGOING one after its timeout.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from storage import sqldb

# Kafka's TransactionState names
EMPTY, ONGOING = "Empty", "Ongoing"
PREPARE_COMMIT, PREPARE_ABORT = "PrepareCommit", "PrepareAbort"
COMPLETE_COMMIT, COMPLETE_ABORT = "CompleteCommit", "CompleteAbort"
STATES = (EMPTY, ONGOING, PREPARE_COMMIT, PREPARE_ABORT, COMPLETE_COMMIT, COMPLETE_ABORT)

# (offset, leader epoch, metadata) per (topic, partition), per group
PendingOffsets = dict[str, dict[tuple[str, int], tuple[int, int, str | None]]]


@dataclass
class TxnMeta:
    """One transactional id's state (Kafka's TransactionMetadata)."""

    transactional_id: str
    producer_id: int
    epoch: int
    timeout_ms: int
    state: str = EMPTY
    partitions: set[tuple[str, int]] = field(default_factory=set)
    groups: set[str] = field(default_factory=set)
    pending_offsets: PendingOffsets = field(default_factory=dict)
    start_ms: int = -1
    update_ms: int = 0

    def to_row(self) -> tuple[Any, ...]:
        offsets = {g: [[t, p, o, e, m] for (t, p), (o, e, m) in sorted(tp.items())]
                   for g, tp in self.pending_offsets.items()}
        return (self.transactional_id, self.producer_id, self.epoch, self.timeout_ms, self.state,
                json.dumps(sorted(self.partitions)), json.dumps(sorted(self.groups)),
                json.dumps(offsets), self.start_ms, self.update_ms)

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> "TxnMeta":
        tid, pid, epoch, timeout, state, parts, groups, offsets, start, update = row
        pending: PendingOffsets = {
            g: {(str(t), int(p)): (int(o), int(e), m) for t, p, o, e, m in rows}
            for g, rows in json.loads(offsets).items()}
        return cls(str(tid), int(pid), int(epoch), int(timeout), str(state),
                   {(str(t), int(p)) for t, p in json.loads(parts)}, set(json.loads(groups)),
                   pending, int(start), int(update))


STEPS: list[sqldb.Step] = [
    (1, """
CREATE TABLE IF NOT EXISTS kafka_txn_state (
    transactional_id TEXT PRIMARY KEY,
    producer_id BIGINT NOT NULL,
    epoch INTEGER NOT NULL,
    timeout_ms BIGINT NOT NULL,
    state TEXT NOT NULL,
    partitions TEXT NOT NULL,
    groups TEXT NOT NULL,
    pending_offsets TEXT NOT NULL,
    start_ms BIGINT NOT NULL,
    update_ms BIGINT NOT NULL)
"""),
]


class TxnStore:
    """Blocking calls: the coordinator runs them on a worker thread."""

    def __init__(self, db_url: str) -> None:
        self._db = sqldb.connect(db_url)
        try:
            self._db.migrate("transactions", STEPS)
        except BaseException:
            self._db.close()
            raise

    def load_all(self) -> list[TxnMeta]:
        rows = self._db.query(
            "SELECT transactional_id, producer_id, epoch, timeout_ms, state, partitions,"
            " groups, pending_offsets, start_ms, update_ms FROM kafka_txn_state")
        return [TxnMeta.from_row(r) for r in rows]

    def save(self, row: tuple[Any, ...]) -> None:
        self._db.execute(
            "INSERT INTO kafka_txn_state (transactional_id, producer_id, epoch, timeout_ms,"
            " state, partitions, groups, pending_offsets, start_ms, update_ms)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (transactional_id) DO UPDATE SET"
            " producer_id=excluded.producer_id, epoch=excluded.epoch,"
            " timeout_ms=excluded.timeout_ms, state=excluded.state,"
            " partitions=excluded.partitions, groups=excluded.groups,"
            " pending_offsets=excluded.pending_offsets, start_ms=excluded.start_ms,"
            " update_ms=excluded.update_ms", row)

    def delete(self, transactional_id: str) -> None:
        """Forget an expired transactional id."""
        self._db.execute("DELETE FROM kafka_txn_state WHERE transactional_id = ?",
                         (transactional_id,))

    def close(self) -> None:
        self._db.close()
