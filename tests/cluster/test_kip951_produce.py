"""KIP-951 in Produce: a broker that does not lead a partition answers NOT_LEADER_OR_FOLLOWER
with the current leader (v10+) and the leader's endpoint, so producers skip a Metadata round
trip. Exact fields checked over the wire on a 2-broker cluster."""
from __future__ import annotations

import pytest
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.protocol.producer import ProduceRequest, ProduceResponse

from datapath.batches import make_batch
from datapath.wire import WireClient

from .kit import wait_for

NOT_LEADER = 6


@pytest.mark.parametrize("metadata_url", ["sqlite"], indirect=True)
def test_produce_not_leader_names_the_leader(cluster_factory):
    brokers = cluster_factory(2)
    admin = KafkaAdminClient(bootstrap_servers=brokers[0].bootstrap)
    wait_for(lambda: len(admin.describe_cluster()["brokers"]) == 2, what="2 live brokers")
    admin.create_topics([NewTopic("k951", 2, 2)])

    def led() -> dict[int, tuple[int, int]]:
        d = admin.describe_topics(["k951"])[0]["partitions"]
        return {p["partition_index"]: (p["leader_id"], p["leader_epoch"]) for p in d}
    leaders = wait_for(lambda: (lambda d: d if len({v[0] for v in d.values()}) == 2 else None)(
        led()), what="one partition led by each broker")
    admin.close()
    part = next(p for p, (n, _) in leaders.items() if n == 1)     # led by broker 1
    batch = make_batch([b"x"])
    with WireClient("127.0.0.1", brokers[0].port) as c:
        wait_for(lambda: c.produce("k951", batch, partition=part).error_code == NOT_LEADER,
                 what="broker 0 knows it does not lead")
        tid = c.topic_id("k951")
        for version in (10, 11, 12, 13):
            req = c.produce_request("k951", {part: batch})
            if version >= 13:
                req.topic_data[0].topic_id = tid
            resp = c.call(req, ProduceResponse, version)
            pr = resp.responses[0].partition_responses[0]
            assert pr.error_code == NOT_LEADER, version
            assert (pr.current_leader.leader_id, pr.current_leader.leader_epoch) == \
                leaders[part], version
            assert [(e.node_id, e.host, e.port, e.rack) for e in resp.node_endpoints] == \
                [(1, "127.0.0.1", brokers[1].port, "r1")], version
        # v9 has neither field; the error alone
        pr = c.produce("k951", batch, partition=part, version=9)
        assert pr.error_code == NOT_LEADER
        # the leader accepts the same batch; a partition broker 0 leads is unaffected
        other = 1 - part
        # (it may still be opening there: UNKNOWN_TOPIC_OR_PARTITION, retriable, until then)
        wait_for(lambda: c.produce("k951", batch, partition=other, version=12).error_code == 0,
                 what="broker 0 accepts the partition it leads")
    with WireClient("127.0.0.1", brokers[1].port) as c:
        wait_for(lambda: c.produce("k951", batch, partition=part, version=12).error_code == 0,
                 what="broker 1 accepts the partition it leads")
