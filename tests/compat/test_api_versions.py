"""ApiVersions advertises one coherent release (Kafka 4.1): kafka-python, which infers the
release from the highest versions and then sends that release's versions of every API, works
both auto-detecting and pinned to an older release (a pinned (3, 9) consumer used to loop
forever on FindCoordinator v6 / ListOffsets v9 / Metadata v13 being refused)."""
from __future__ import annotations

import pytest
from kafka import KafkaConsumer, KafkaProducer

from clients.e2e_helpers import unique

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("api_version", [None, (3, 9), (4, 1)], ids=["auto", "3.9", "4.1"])
def test_kafka_python_group_consumer(abroker, api_version):
    topic, group = unique("apiv"), unique("apiv-g")
    kw = {} if api_version is None else {"api_version": api_version}
    p = KafkaProducer(bootstrap_servers=abroker.bootstrap, **kw)
    try:
        for i in range(5):
            p.send(topic, key=b"k", value=b"v%d" % i).get(timeout=30)
    finally:
        p.close(timeout=10)
    c = KafkaConsumer(topic, bootstrap_servers=abroker.bootstrap, group_id=group,
                      auto_offset_reset="earliest", enable_auto_commit=False,
                      consumer_timeout_ms=20_000, **kw)
    try:
        assert c.config["api_version"] == (api_version or (4, 1))   # auto: inferred as 4.1
        got = []
        for m in c:
            got.append(m.value)
            if len(got) == 5:
                break
        assert got == [b"v%d" % i for i in range(5)]
        c.commit()
        tp = next(iter(c.assignment()))
        assert c.committed(tp) == 5
        assert c.end_offsets([tp])[tp] == 5
        assert c.beginning_offsets([tp])[tp] == 0
    finally:
        c.close()
