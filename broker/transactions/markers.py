"""COMMIT/ABORT control batches (transaction markers), as Kafka writes them.

A marker is a v2 batch with the control and transactional attributes set, the producer's id
and epoch, sequence -1 and one record: key = (version int16 0, type int16: 0 abort, 1 commit),
value = (version int16 0, coordinator epoch int32).
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
    try:
        recs = protocol.decode_records(view)
    except Exception:  # noqa: BLE001 - an unreadable control batch is not a marker we know
        return None
    if not recs or recs[0].key is None or len(recs[0].key) < 4:
        return None
    _version, kind = _KEY.unpack_from(recs[0].key, 0)
    if kind == COMMIT:
        return True
    if kind == ABORT:
        return False
    return None
