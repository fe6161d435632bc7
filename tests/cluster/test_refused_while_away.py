"""A produce that finds its partition not open here while this broker opens it, or releases it
and then keeps it (the release failed), is answered NOT_LEADER_OR_FOLLOWER with nothing of it
remembered by the Partition installed a moment later. When that produce was the retry of a
stored batch (seq n: its first answer lost to a kill -9, a pause or a cut connection) and the
producer's stored seq n+1, pipelined right behind it, reached the installed Partition, n+1 was
answered with its offset after n's error: librdkafka then acknowledges seq n implicitly,
without an offset (the chaos suites' ``acked_without_offset``); a seq n that was never stored
made n+1 an OUT_OF_ORDER_SEQUENCE (a librdkafka epoch bump). The refusals now leave failed marks
on the Partition the operation installs (docs/datapath.md "Failed marks"), like every other
refusal of an idempotent batch."""
from __future__ import annotations

import asyncio
import types
import uuid

from broker.cluster.room import ClusterRoom
from broker.cluster.store import ClusterStore
from broker.handlers.produce import _append
from broker.partition import Partition
from protocol import ErrorCode
from storage.memory import MemoryStreamStore

from datapath.batches import make_batch

TID = uuid.uuid4()


def idem(value: bytes, seq: int, pid: int = 7, epoch: int = 0) -> bytes:
    return make_batch([value], producer_id=pid, epoch=epoch, base_sequence=seq)


async def _setup(tmp_path, store_ns: types.SimpleNamespace):
    url = f"sqlite:///{tmp_path}/meta.db"
    cfg = types.SimpleNamespace(node_id=0, rack=None, metadata_url=url, data_dir=str(tmp_path),
                                cluster_lease_ms=6000, cluster_takeover_margin_ms=1000)
    broker = types.SimpleNamespace(config=cfg, topic_manager=None, topics={}, store=store_ns,
                                   meta=None)
    room = ClusterRoom(broker)
    room.store = ClusterStore(url)
    broker.cluster = room
    mem = MemoryStreamStore()
    stream = await mem.create_stream()
    topic = types.SimpleNamespace(name="t", topic_id=TID, partitions=[None], configs={},
                                  stream_ids=[stream.stream_id])
    broker.topics["t"] = topic
    # seq 0 and 1 of producer 7 are stored; their answers were lost (a kill, a cut)
    p = await Partition.open(broker, "t", TID, 0, stream, {})
    assert (await p.append(idem(b"A", 0))).base_offset == 0
    assert (await p.append(idem(b"B", 1))).base_offset == 1
    return room, broker, topic, p, stream


async def _held_back_then_taken(broker, topic, first) -> None:
    """``first`` (seq 0's retry, refused while the partition was away) is NOT_LEADER; seq 1's
    retry on the installed partition is held back behind seq 0's mark (the old code answered it
    with its offset: seq 0 acknowledged implicitly); both retried once more are taken in order."""
    r0 = await first
    r1 = await _append(topic, 0, bytearray(idem(b"B", 1)), 9, None, broker)
    assert r0.error == ErrorCode.NOT_LEADER_OR_FOLLOWER
    assert r1.error == ErrorCode.NOT_ENOUGH_REPLICAS, r1
    r0 = await _append(topic, 0, bytearray(idem(b"A", 0)), 9, None, broker)
    r1 = await _append(topic, 0, bytearray(idem(b"B", 1)), 9, None, broker)
    assert (r0.error, r0.base_offset, r1.error, r1.base_offset) == (0, 0, 0, 1)


async def _close(room, topic) -> None:
    for q in topic.partitions:
        if q is not None:
            await q.close()
    room.store.close()


async def test_a_retry_refused_during_a_failed_release_holds_back_its_stored_successor(
        tmp_path) -> None:
    gate = asyncio.Event()

    async def release_stream(stream_id: int) -> int:
        await gate.wait()
        raise OSError("object store cut: release failed")

    room, broker, topic, p, _stream = await _setup(
        tmp_path, types.SimpleNamespace(release_stream=release_stream))
    try:
        topic.partitions[0] = p
        await asyncio.to_thread(room.store.assign_new, str(TID), 0, [0], 1)
        await room._refresh(force=True)
        key = (str(TID), 0)
        room._spawn(key, room._release(topic, 0, room.assign[key]), "release t-0")
        while topic.partitions[0] is not None:
            await asyncio.sleep(0)
        # seq 0's retry arrives while the partition is being released: held, then refused
        first = asyncio.ensure_future(_append(topic, 0, bytearray(idem(b"A", 0)), 9, None,
                                              broker))
        await asyncio.sleep(0)
        gate.set()                      # the release fails: the partition reopens here
        while topic.partitions[0] is None or topic.partitions[0] is p:
            await asyncio.sleep(0.01)
        await _held_back_then_taken(broker, topic, first)
    finally:
        await _close(room, topic)


async def test_a_retry_refused_while_the_partition_opens_holds_back_its_stored_successor(
        tmp_path) -> None:
    gate = asyncio.Event()
    streams: dict = {}

    async def acquire_stream(stream_id: int, epoch: int):
        await gate.wait()
        return streams[stream_id]

    room, broker, topic, p, stream = await _setup(
        tmp_path, types.SimpleNamespace(acquire_stream=acquire_stream))
    try:
        await p.close()                 # led elsewhere until now (its state in the snapshot)
        streams[stream.stream_id] = stream
        await asyncio.to_thread(room.store.assign_new, str(TID), 0, [0], 1)
        await room._refresh(force=True)
        key = (str(TID), 0)
        room._spawn(key, room._open(topic, 0, room.assign[key]), "open t-0")
        await asyncio.sleep(0)
        first = asyncio.ensure_future(_append(topic, 0, bytearray(idem(b"A", 0)), 9, None,
                                              broker))
        await asyncio.sleep(0)
        assert first.done()             # not held: no release runs here
        gate.set()
        while topic.partitions[0] is None:
            await asyncio.sleep(0.01)
        await _held_back_then_taken(broker, topic, first)
    finally:
        await _close(room, topic)
