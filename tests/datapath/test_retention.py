"""Retention (retention.ms / retention.bytes / cleanup.policy) and producer-id durability."""
from __future__ import annotations

import types

import pytest

import broker.partition as partition_mod
from broker.producer_state import ProducerStore
from broker.retention import RetentionTask, apply_retention

from .batches import make_batch
from .test_partition import fake_broker, open_partition

NOW = 1_800_000_000_000


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of ~1 batch so retention works at batch granularity in these tests."""
    monkeypatch.setattr(partition_mod, "CHUNK_BYTES", 1)


async def test_retention_ms_trims_old_batches(tmp_path):
    configs = {"retention.ms": "1000"}
    p, *_ = await open_partition(tmp_path, configs=configs)
    await p.append(make_batch([b"old"], timestamps=[NOW - 5000]))
    await p.append(make_batch([b"old2"], timestamps=[NOW - 4000]))
    await p.append(make_batch([b"new"], timestamps=[NOW - 10]))
    assert await apply_retention([p], now_ms=NOW) == 1
    assert p.log_start_offset == 2
    assert await apply_retention([p], now_ms=NOW) == 0


async def test_retention_never_deletes_newest_chunk(tmp_path):
    p, *_ = await open_partition(tmp_path, configs={"retention.ms": "1000"})
    await p.append(make_batch([b"a"], timestamps=[NOW - 5000]))
    await p.append(make_batch([b"b"], timestamps=[NOW - 5000]))
    await apply_retention([p], now_ms=NOW)
    assert p.log_start_offset == 1 and p.high_watermark == 2


async def test_retention_bytes(tmp_path):
    configs = {"retention.bytes": "-1", "retention.ms": "-1"}
    p, *_ = await open_partition(tmp_path, configs=configs)
    for i in range(10):
        await p.append(make_batch([b"x" * 100], timestamps=[NOW]))
    size = p.log_index.total_bytes
    assert await apply_retention([p], now_ms=NOW) == 0
    configs["retention.bytes"] = str(size // 2)
    assert await apply_retention([p], now_ms=NOW) == 1
    assert p.log_start_offset == 5
    assert p.log_index.total_bytes <= size // 2


async def test_compact_policy_keeps_everything(tmp_path):
    configs = {"retention.ms": "1", "cleanup.policy": "compact"}
    p, *_ = await open_partition(tmp_path, configs=configs)
    await p.append(make_batch([b"a"], timestamps=[1]))
    await p.append(make_batch([b"b"], timestamps=[2]))
    assert await apply_retention([p], now_ms=NOW) == 0
    configs["cleanup.policy"] = "compact,delete"
    assert await apply_retention([p], now_ms=NOW) == 1


async def test_background_task_walks_broker_topics(tmp_path):
    p, *_ = await open_partition(tmp_path, configs={"retention.ms": "0"})
    await p.append(make_batch([b"a"], timestamps=[1]))
    await p.append(make_batch([b"b"], timestamps=[2]))
    broker = types.SimpleNamespace(topics={"t": types.SimpleNamespace(partitions=[p])})
    task = RetentionTask(broker, interval_s=0)
    task.start()
    assert await p.wait_for(0) and await _until(lambda: p.log_start_offset == 1)
    await task.stop()


async def _until(cond) -> bool:
    import asyncio
    for _ in range(1000):
        if cond():
            return True
        await asyncio.sleep(0.001)
    return cond()


def test_producer_ids_never_reused_across_reopen(tmp_path):
    db = str(tmp_path / "meta.db")
    s1 = ProducerStore(db)
    ids = {s1.allocate_producer_id() for _ in range(3)}
    s1.close()
    s2 = ProducerStore(db)
    assert s2.allocate_producer_id() not in ids
    pid, epoch = s2.init_transactional("tx")
    assert s2.init_transactional("tx") == (pid, epoch + 1)
    s2.close()


async def test_delete_records_style_trim_then_reopen(tmp_path):
    p, store, stream, _ = await open_partition(tmp_path)
    for i in range(4):
        await p.append(make_batch([b"%d" % i], timestamps=[NOW + i]))
    await p.trim_to(2)
    p2, *_ = await open_partition(tmp_path, store=store, stream=stream,
                                  broker=fake_broker(tmp_path))
    assert p2.log_start_offset == 2
    assert await p2.offset_for_timestamp(0) == (2, NOW + 2)


async def test_idle_producers_expire(tmp_path):
    import time

    p, *_ = await open_partition(tmp_path)
    await p.append(make_batch([b"a"], producer_id=11, epoch=0, base_sequence=0))
    await p.append(make_batch([b"b"], producer_id=12, epoch=0, base_sequence=0))
    now = int(time.time() * 1000)
    p.producers.entries[11].last_seen_ms = now - 2 * 86_400_000
    assert p.producers.expire_idle(now, 86_400_000) == 1
    assert set(p.producers.entries) == {12}
    # an expired producer is unknown again: Kafka accepts its next sequence as is
    r = await p.append(make_batch([b"c"], producer_id=11, epoch=0, base_sequence=7))
    assert (r.error, r.base_offset) == (0, 2)


async def test_background_task_expires_producers(tmp_path):
    p, *_ = await open_partition(tmp_path)
    await p.append(make_batch([b"a"], producer_id=21, epoch=0, base_sequence=0))
    p.producers.entries[21].last_seen_ms = 0
    cfg = types.SimpleNamespace(retention_check_interval_ms=1, producer_id_expiration_ms=1000)
    broker = types.SimpleNamespace(config=cfg, topics={"t": types.SimpleNamespace(partitions=[p])})
    task = RetentionTask(broker)
    task.start()
    assert await _until(lambda: not p.producers.entries)
    await task.stop()
