"""aiokafka: a transactional producer (commit and abort) and read_committed consumers that stop
at the last stable offset and never return aborted records."""
from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from clients.e2e_helpers import create_topic, unique

pytestmark = pytest.mark.e2e


async def read_all(bootstrap: str, topic: str, isolation: str, idle_s: float = 1.5) -> list[str]:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level=isolation,
                         enable_auto_commit=False, auto_offset_reset="earliest",
                         fetch_max_wait_ms=200)
    await c.start()
    try:
        tp = TopicPartition(topic, 0)
        c.assign([tp])
        await c.seek_to_beginning(tp)
        out: list[str] = []
        while True:
            batch = await c.getmany(timeout_ms=int(idle_s * 1000))
            if not batch:
                return out
            out += [m.value.decode() for msgs in batch.values() for m in msgs]
    finally:
        await c.stop()


async def end_offset(bootstrap: str, topic: str, isolation: str) -> int:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level=isolation)
    await c.start()
    try:
        tp = TopicPartition(topic, 0)
        return (await c.end_offsets([tp]))[tp]
    finally:
        await c.stop()


def test_aiokafka_transactions_and_read_committed(tbroker):
    async def run() -> None:
        topic = unique("aio-txn")
        create_topic(tbroker.bootstrap, topic, 1)
        p = AIOKafkaProducer(bootstrap_servers=tbroker.bootstrap,
                             transactional_id=unique("aio-tid"))
        await p.start()
        try:
            async with p.transaction():
                for i in range(5):
                    await p.send(topic, f"c-{i}".encode(), partition=0)
            await p.begin_transaction()
            for i in range(5):
                await p.send(topic, f"a-{i}".encode(), partition=0)
            await p.abort_transaction()
            await p.begin_transaction()
            await p.send_and_wait(topic, b"open", partition=0)
            # c-0..4, COMMIT, a-0..4, ABORT, then the open transaction at 12
            assert await end_offset(tbroker.bootstrap, topic, "read_committed") == 12
            assert await end_offset(tbroker.bootstrap, topic, "read_uncommitted") == 13
            assert await read_all(tbroker.bootstrap, topic, "read_committed") == [
                f"c-{i}" for i in range(5)]
            await p.commit_transaction()
        finally:
            await p.stop()
        assert await read_all(tbroker.bootstrap, topic, "read_committed") == [
            f"c-{i}" for i in range(5)] + ["open"]
        assert len(await read_all(tbroker.bootstrap, topic, "read_uncommitted")) == 11

    asyncio.run(run())
