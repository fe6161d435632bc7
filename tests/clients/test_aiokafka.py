"""aiokafka, unmodified, against s3kafka."""
from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.admin.records_to_delete import RecordsToDelete
from aiokafka.errors import TopicAlreadyExistsError
from aiokafka.structs import OffsetAndMetadata

from clients.e2e_helpers import (ACKS, CODECS, group_of_three_then_resume, produce_values,
                                 unique)

pytestmark = pytest.mark.e2e
N = 20


def _acks(a: str) -> int | str:
    return "all" if a == "all" else int(a)


async def consume_partition(bootstrap: str, topic: str, count: int, partition: int = 0) -> list:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                         auto_offset_reset="earliest")
    await c.start()
    try:
        tp = TopicPartition(topic, partition)
        c.assign([tp])
        await c.seek_to_beginning(tp)
        out: list = []
        deadline = time.monotonic() + 30
        while len(out) < count and time.monotonic() < deadline:
            for recs in (await c.getmany(timeout_ms=500)).values():
                out.extend(recs)
        return out
    finally:
        await c.stop()


async def test_produce_every_acks_and_codec(cbroker, topic_name):
    for acks in ACKS:
        for codec in CODECS:
            p = AIOKafkaProducer(bootstrap_servers=cbroker.bootstrap, acks=_acks(acks),
                                 compression_type=None if codec == "none" else codec,
                                 enable_idempotence=acks == "all", linger_ms=5)
            await p.start()
            try:
                futs = [await p.send(topic_name, value=f"{acks}-{codec}-{i}".encode(),
                                     partition=0) for i in range(N)]
                mds = await asyncio.gather(*futs)
            finally:
                await p.stop()
            if acks != "0":
                offs = [m.offset for m in mds]
                assert offs == sorted(offs) and len(set(offs)) == N
    total = N * len(ACKS) * len(CODECS)
    got = await consume_partition(cbroker.bootstrap, topic_name, total)
    assert [r.offset for r in got] == list(range(total))
    assert {r.value.decode() for r in got} == {
        f"{a}-{c}-{i}" for a in ACKS for c in CODECS for i in range(N)}


class Member:
    """An aiokafka group member on its own event loop (driven from one thread)."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        self.loop = asyncio.new_event_loop()

        async def make() -> AIOKafkaConsumer:
            c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group,
                                 session_timeout_ms=6000, heartbeat_interval_ms=300,
                                 auto_offset_reset="earliest", enable_auto_commit=False,
                                 fetch_max_wait_ms=200)
            await c.start()
            return c
        self.c = self.loop.run_until_complete(make())

    def poll_once(self) -> list[str]:
        batches = self.loop.run_until_complete(self.c.getmany(timeout_ms=200))
        return [r.value.decode() for recs in batches.values() for r in recs]

    def assignment(self) -> set[int]:
        return {tp.partition for tp in self.c.assignment()}

    def close(self) -> None:
        async def finish() -> None:
            if self.c.assignment():
                await self.c.commit()
            await self.c.stop()
        try:
            self.loop.run_until_complete(finish())
        finally:
            self.loop.close()


async def test_group_of_three_rebalances_then_resumes_after_restart(cbroker, topic_name):
    admin = AIOKafkaAdminClient(bootstrap_servers=cbroker.bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(topic_name, 6, 1)])
    await admin.close()
    # the members run in threads with their own loops; keep this loop free meanwhile
    await asyncio.to_thread(group_of_three_then_resume, cbroker, topic_name,
                            lambda group: Member(cbroker.bootstrap, group, topic_name))


async def test_admin_operations(cbroker, topic_name):
    admin = AIOKafkaAdminClient(bootstrap_servers=cbroker.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic_name, 2, 1,
                                            topic_configs={"retention.ms": "3600000"})])
        resp = await admin.create_topics([NewTopic(topic_name, 2, 1)])
        assert f"error_code={TopicAlreadyExistsError.errno}" in repr(resp), resp
        assert topic_name in await admin.list_topics()
        await admin.create_partitions({topic_name: NewPartitions(3)})
        descr = await admin.describe_topics([topic_name])
        assert len(descr[0]["partitions"]) == 3

        produce_values(cbroker.bootstrap, topic_name, [f"v{i}" for i in range(10)], partition=0)
        tp = TopicPartition(topic_name, 0)
        low = await admin.delete_records({tp: RecordsToDelete(before_offset=4)})
        assert low[tp] == 4

        cfg = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic_name)])
        text = repr(cfg)
        assert "retention.ms" in text and "3600000" in text and "cleanup.policy" in text

        group = unique("adm")
        c = AIOKafkaConsumer(bootstrap_servers=cbroker.bootstrap, group_id=group,
                             enable_auto_commit=False)
        await c.start()
        c.assign([tp])
        await c.commit({tp: OffsetAndMetadata(6, "")})
        await c.stop()
        assert group in repr(await admin.list_consumer_groups())
        offs = await admin.list_consumer_group_offsets(group)
        assert offs[tp].offset == 6
        await admin.delete_topics([topic_name])
    finally:
        await admin.close()
