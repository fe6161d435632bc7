"""COMMIT/ABORT control batches (transaction markers), as Kafka writes them.

A marker is a v2 batch with the control and transactional attributes set, the producer's id
and epoch, sequence -1 and one record: key = (version int16 0, type int16: 0 abort, 1 commit),
value = (version int16 0, coordinator epoch int32).

s3kafka's transaction coordinators put a number in the coordinator epoch that grows with every
transaction of a producer (the transaction state's row version when it was prepared), so a
partition leader can tell a late copy of an earlier transaction's marker from the marker of
the transaction under way (``PartitionTxns.marked``).
"""
from __future__ import annotations

import struct

import protocol

ABORT, COMMIT = 0, 1
_KEY = struct.Struct(">hh")
_VALUE = struct.Struct(">hi")


def build_marker(producer_id: int, producer_epoch: int, commit: bool, coordinator_epoch: int,
                 timestamp_ms: int) -> bytearray:
    """One control batch at base offset 0 (the partition assigns the real offset)."""
    key = _KEY.pack(0, COMMIT if commit else ABORT)
    value = _VALUE.pack(0, coordinator_epoch)
    return bytearray(protocol.build_batch([(key, value)], base_offset=0, timestamp=timestamp_ms,
                                          producer_id=producer_id, producer_epoch=producer_epoch,
                                          base_sequence=-1, transactional=True, control=True,
                                          partition_leader_epoch=0))


def marker_is_commit(view: "protocol.BatchView") -> bool | None:
    """True for a COMMIT marker, False for ABORT, None for another control record."""
    fields = marker_fields(view)
    return None if fields is None else fields[0]


def marker_fields(view: "protocol.BatchView") -> tuple[bool, int] | None:
    """(commit, coordinator epoch) of a COMMIT/ABORT marker; None for another control record."""
    try:
        recs = protocol.decode_records(view)
    except Exception:  # noqa: BLE001 - an unreadable control batch is not a marker we know
        return None
    if not recs or recs[0].key is None or len(recs[0].key) < 4:
        return None
    _version, kind = _KEY.unpack_from(recs[0].key, 0)
    if kind not in (COMMIT, ABORT):
        return None
    value = recs[0].value
    epoch = _VALUE.unpack_from(value, 0)[1] if value is not None and len(value) >= 6 else -1
    return kind == COMMIT, epoch
