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
    # KIP-890 part 2: the producer id and epoch before the last EndTxn's bump (a retried EndTxn
    # names them); row_version: compare-and-set of every write (a broker that lost the
    # coordinator role to another can never overwrite what the new one wrote)
    prev_producer_id: int = -1
    prev_epoch: int = -1
    row_version: int = 0

    def to_row(self) -> tuple[Any, ...]:
        offsets = {g: [[t, p, o, e, m] for (t, p), (o, e, m) in sorted(tp.items())]
                   for g, tp in self.pending_offsets.items()}
        return (self.transactional_id, self.producer_id, self.epoch, self.timeout_ms, self.state,
                json.dumps(sorted(self.partitions)), json.dumps(sorted(self.groups)),
                json.dumps(offsets), self.start_ms, self.update_ms, self.prev_producer_id,
                self.prev_epoch)

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> "TxnMeta":
        (tid, pid, epoch, timeout, state, parts, groups, offsets, start, update, prev_pid,
         prev_epoch, version) = row
        pending: PendingOffsets = {
            g: {(str(t), int(p)): (int(o), int(e), m) for t, p, o, e, m in rows}
            for g, rows in json.loads(offsets).items()}
        return cls(str(tid), int(pid), int(epoch), int(timeout), str(state),
                   {(str(t), int(p)) for t, p in json.loads(parts)}, set(json.loads(groups)),
                   pending, int(start), int(update), int(prev_pid), int(prev_epoch), int(version))


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
    (2, """
ALTER TABLE kafka_txn_state ADD COLUMN prev_producer_id BIGINT NOT NULL DEFAULT -1;
ALTER TABLE kafka_txn_state ADD COLUMN prev_epoch INTEGER NOT NULL DEFAULT -1;
ALTER TABLE kafka_txn_state ADD COLUMN row_version BIGINT NOT NULL DEFAULT 1
"""),
]

_COLUMNS = ("transactional_id, producer_id, epoch, timeout_ms, state, partitions, groups,"
            " pending_offsets, start_ms, update_ms, prev_producer_id, prev_epoch")


class StaleTxnState(Exception):
    """The row changed under this broker: another broker coordinates the id now."""


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
        rows = self._db.query(f"SELECT {_COLUMNS}, row_version FROM kafka_txn_state")
        return [TxnMeta.from_row(r) for r in rows]

    def load_one(self, transactional_id: str) -> TxnMeta | None:
        row = self._db.query_one(f"SELECT {_COLUMNS}, row_version FROM kafka_txn_state"
                                 " WHERE transactional_id = ?", (transactional_id,))
        return None if row is None else TxnMeta.from_row(row)

    def load_unfinished(self) -> list[TxnMeta]:
        """Transactions not complete yet (Ongoing, PrepareCommit, PrepareAbort)."""
        rows = self._db.query(f"SELECT {_COLUMNS}, row_version FROM kafka_txn_state"
                              " WHERE state IN (?, ?, ?)", (ONGOING, PREPARE_COMMIT, PREPARE_ABORT))
        return [TxnMeta.from_row(r) for r in rows]

    def load_by_producer(self, producer_id: int) -> TxnMeta | None:
        row = self._db.query_one(f"SELECT {_COLUMNS}, row_version FROM kafka_txn_state"
                                 " WHERE producer_id = ?", (producer_id,))
        return None if row is None else TxnMeta.from_row(row)

    def save(self, row: tuple[Any, ...], version: int) -> int:
        """Write the row if it is still at ``version`` (0: a new id); its new version, or
        StaleTxnState when another broker wrote it meanwhile."""
        if version == 0:
            n = self._db.execute(
                f"INSERT INTO kafka_txn_state ({_COLUMNS}, row_version) VALUES"
                " (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1)"
                " ON CONFLICT (transactional_id) DO NOTHING", row)
        else:
            n = self._db.execute(
                "UPDATE kafka_txn_state SET producer_id=?, epoch=?, timeout_ms=?, state=?,"
                " partitions=?, groups=?, pending_offsets=?, start_ms=?, update_ms=?,"
                " prev_producer_id=?, prev_epoch=?, row_version=row_version+1"
                " WHERE transactional_id=? AND row_version=?", row[1:] + (row[0], version))
        if n != 1:
            raise StaleTxnState(row[0])
        return version + 1

    def delete(self, transactional_id: str, version: int) -> None:
        """Forget an expired transactional id (if nobody wrote it meanwhile)."""
        self._db.execute("DELETE FROM kafka_txn_state WHERE transactional_id = ?"
                         " AND row_version = ?", (transactional_id, version))

    def close(self) -> None:
        self._db.close()
