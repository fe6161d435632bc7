"""Named listeners (Kafka's listeners / advertised.listeners) on a 2-broker cluster: a client
is told the addresses of the listener it connected to, for every broker (Metadata,
DescribeCluster, FindCoordinator), and real clients work through either listener. The single
--listen / --advertised-listener pair keeps working (every other test uses it)."""
from __future__ import annotations

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient
from kafka.protocol.metadata import MetadataRequest, MetadataResponse

import protocol
from conftest import free_port
from datapath.wire import WireClient

from .kit import wait_for

FIND_COORDINATOR = 10


def metadata_brokers(port: int) -> dict[int, tuple[str, int]]:
    with WireClient("127.0.0.1", port) as c:
        r = c.call(MetadataRequest(topics=[], allow_auto_topic_creation=False,
                                   include_topic_authorized_operations=False),
                   MetadataResponse, 12)
    return {b.node_id: (b.host, b.port) for b in r.brokers}


def coordinator(port: int, group: str) -> tuple[int, str, int]:
    with WireClient("127.0.0.1", port) as c:
        r = c.call(protocol.request_class(FIND_COORDINATOR)(key_type=0, coordinator_keys=[group]),
                   protocol.response_class(FIND_COORDINATOR), 4)
    x = r.coordinators[0]
    assert x.error_code == 0
    return x.node_id, x.host, x.port


@pytest.mark.parametrize("metadata_url", ["sqlite"], indirect=True)
def test_each_listener_advertises_its_own_addresses(cluster_factory):
    internal = {n: free_port() for n in (0, 1)}
    external = {n: free_port() for n in (0, 1)}
    brokers = []
    for n in (0, 1):
        brokers += cluster_factory(1, first_id=n, extra=(
            "--listen", f"127.0.0.1:{internal[n]}",
            "--listeners", f"INTERNAL://127.0.0.1:{internal[n]},"
                           f"EXTERNAL://127.0.0.1:{external[n]}",
            "--advertised-listeners", f"INTERNAL://127.0.0.1:{internal[n]},"
                                      f"external://localhost:{external[n]}"))
    want_int = {n: ("127.0.0.1", internal[n]) for n in (0, 1)}
    want_ext = {n: ("localhost", external[n]) for n in (0, 1)}
    for n in (0, 1):
        wait_for(lambda n=n: metadata_brokers(internal[n]) == want_int, what="internal view")
        assert metadata_brokers(external[n]) == want_ext
    # FindCoordinator: the coordinator's address on the asking client's listener
    for g in ("g-a", "g-b", "g-c", "g-d"):
        node, host, port = coordinator(external[0], g)
        assert (host, port) == want_ext[node]
        assert coordinator(internal[1], g) == (node, *want_int[node])
    # DescribeCluster through the external listener
    admin = AdminClient({"bootstrap.servers": f"localhost:{external[0]}"})
    md = admin.describe_cluster(request_timeout=30).result()
    assert sorted((b.id, b.host, b.port) for b in md.nodes) == \
        [(n, *want_ext[n]) for n in (0, 1)]

    # a producer and a group consumer that only know the external listener
    boot = f"localhost:{external[0]}"
    p = Producer({"bootstrap.servers": boot, "acks": "all"})
    for i in range(50):
        p.produce("lst", value=f"v{i}".encode(), partition=0)
    assert p.flush(30) == 0
    c = Consumer({"bootstrap.servers": boot, "group.id": "lst-g",
                  "auto.offset.reset": "earliest"})
    c.subscribe(["lst"])
    got: list[bytes] = []
    wait_for(lambda: (got.extend(m.value() for m in c.consume(50, 0.5) if not m.error())
                      or len(got) >= 50), what="50 records through the external listener")
    c.commit(asynchronous=False)
    c.close()
    assert got == [f"v{i}".encode() for i in range(50)]
