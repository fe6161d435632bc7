"""Produce answers withheld because this broker's lease lapsed (broker/handlers/produce.py
``_withhold``): the batches are stored, so their producers' next batches must wait for the
retries, through the real handler and codecs."""
from __future__ import annotations

import types

from protocol import ErrorCode, request_class

from .batches import make_batch
from .test_handler_versions import make_broker, roundtrip


class _Lease:
    """Valid at the door, lapsed once the append is done and not renewed within the wait;
    ``renew()`` makes it valid again."""

    def __init__(self) -> None:
        self.ok = True
        self.withheld = 0
        self.checks = 0

    def valid(self) -> bool:
        self.checks += 1
        return self.ok and self.checks % 2 == 1     # the door passes, the answer finds it gone

    async def wait_valid(self, timeout_s: float) -> bool:
        return False

    def withhold(self, n: int = 1) -> None:
        self.withheld += n

    def renew(self) -> None:
        self.ok, self.valid = True, lambda: True     # type: ignore[method-assign]


def _produce(seq: int, value: bytes):
    Req = request_class(0)
    TD, PD = Req.TopicProduceData, Req.TopicProduceData.PartitionProduceData
    batch = make_batch([value], producer_id=7, epoch=0, base_sequence=seq)
    return Req(transactional_id=None, acks=-1, timeout_ms=1000,
               topic_data=[TD(name="t", partition_data=[PD(index=0, records=batch)])])


async def _answer(b, seq: int, value: bytes) -> tuple[int, int]:
    p = (await roundtrip(b, 0, 9, _produce(seq, value))).responses[0].partition_responses[0]
    return p.error_code, p.base_offset


async def test_a_withheld_stored_batch_holds_back_its_producers_next_batch(tmp_path):
    """Seq 1 is appended while the lease lapses and is not renewed within the wait: answered
    NOT_LEADER_OR_FOLLOWER although stored. Once renewed, the producer's pipelined seq 2 must
    get a retriable error (not its offset: librdkafka would then acknowledge seq 1 implicitly,
    without an offset) until seq 1's retry is answered as a duplicate with its offset."""
    b = await make_broker(tmp_path)
    lease = _Lease()
    assert await _answer(b, 0, b"A") == (0, 0)          # no cluster yet
    b.cluster = types.SimpleNamespace(own_lease=lease)
    assert await _answer(b, 1, b"B") == (ErrorCode.NOT_LEADER_OR_FOLLOWER, -1)
    assert lease.withheld == 1
    lease.renew()
    assert (await _answer(b, 2, b"C"))[0] == ErrorCode.NOT_ENOUGH_REPLICAS
    assert await _answer(b, 1, b"B") == (0, 1)          # the retry: a duplicate, its offset
    assert await _answer(b, 2, b"C") == (0, 2)
    assert b.topics["t"].partitions[0].high_watermark == 3
