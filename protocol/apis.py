"""Which Kafka APIs and versions we advertise, and the kafka-python classes that encode them.

kafka-python 3.0.12's ``kafka.protocol`` compiles codecs from the Kafka JSON message specs; this
module is the only place that maps API keys to those classes, so the broker never imports
``kafka.*`` itself.
"""
from __future__ import annotations

from typing import Any

from kafka.protocol.admin import (
    DescribeTransactionsRequest, DescribeTransactionsResponse, ListTransactionsRequest,
    ListTransactionsResponse,
    AlterConfigsRequest, AlterConfigsResponse, CreatePartitionsRequest, CreatePartitionsResponse,
    CreateTopicsRequest, CreateTopicsResponse, DeleteGroupsRequest, DeleteGroupsResponse,
    DeleteRecordsRequest, DeleteRecordsResponse, DeleteTopicsRequest, DeleteTopicsResponse,
    DescribeClusterRequest, DescribeClusterResponse, DescribeConfigsRequest,
    DescribeConfigsResponse, DescribeGroupsRequest, DescribeGroupsResponse, DescribeLogDirsRequest,
    DescribeLogDirsResponse,
    DescribeProducersRequest, DescribeProducersResponse, DescribeTopicPartitionsRequest,
    DescribeTopicPartitionsResponse, IncrementalAlterConfigsRequest,
    IncrementalAlterConfigsResponse, ListGroupsRequest, ListGroupsResponse,
    AlterPartitionReassignmentsRequest, AlterPartitionReassignmentsResponse, ElectLeadersRequest,
    ElectLeadersResponse, ListPartitionReassignmentsRequest, ListPartitionReassignmentsResponse,
)
from kafka.protocol.consumer import (
    FetchRequest, FetchResponse, HeartbeatRequest, HeartbeatResponse, JoinGroupRequest,
    JoinGroupResponse, LeaveGroupRequest, LeaveGroupResponse, ListOffsetsRequest,
    ListOffsetsResponse, OffsetCommitRequest, OffsetCommitResponse, OffsetDeleteRequest,
    OffsetDeleteResponse, OffsetFetchRequest, OffsetFetchResponse, OffsetForLeaderEpochRequest,
    OffsetForLeaderEpochResponse, SyncGroupRequest, SyncGroupResponse,
)
from kafka.protocol.metadata import (
    ApiVersionsRequest, ApiVersionsResponse, FindCoordinatorRequest, FindCoordinatorResponse,
    MetadataRequest, MetadataResponse,
)
from kafka.protocol.producer import (
    AddOffsetsToTxnRequest, AddOffsetsToTxnResponse, AddPartitionsToTxnRequest,
    AddPartitionsToTxnResponse, EndTxnRequest, EndTxnResponse, InitProducerIdRequest,
    InitProducerIdResponse, ProduceRequest, ProduceResponse, TxnOffsetCommitRequest,
    TxnOffsetCommitResponse, WriteTxnMarkersRequest, WriteTxnMarkersResponse,
)

# api_key -> (min, max) advertised in ApiVersions.  Why these bounds:
# - The maxima are Kafka 4.1's, for every API offered: clients infer the broker's release from
#   the highest versions (kafka-python reads Produce v13 as Kafka 4.1) and then send that
#   release's versions of every API, so one coherent set is advertised (KAFKA_41_MAX below).
# - Produce from v0 (librdkafka disables compression otherwise, KAFKA-18659); v13 uses topic ids.
# - Fetch from v0 (v0-3 answers are down-converted to magic 0/1 message sets for pre-0.11
#   clients); v17/v18 only add tagged follower fields (KIP-853, KIP-1166) a consumer never sets.
# - ListOffsets v9 adds -5 (latest tiered: none here), v10 a timeout for remote lookups.
# - OffsetCommit/OffsetFetch from v0 (ZooKeeper-era simple consumers); <= 9: v10 is KIP-848.
# - FindCoordinator v5 (TRANSACTION_ABORTABLE, never sent) and v6 (share groups: refused).
# - OffsetForLeaderEpoch 2-4: Java clients validate positions only with v3+.
# - ApiVersions 0-4: kafka-python 3.x sends v4 first, aiokafka v0.
# - Transactions (24-26, 28, 65, 66) at Kafka 4.1's maxima; WriteTxnMarkers (27) v1 (as
#   Kafka 4.1) carries markers from a transaction coordinator to the leaders on other brokers
#   (and Admin's abortTransaction).
_SUPPORTED: dict[int, tuple[int, int, type, type]] = {
    0: (0, 13, ProduceRequest, ProduceResponse),
    1: (0, 18, FetchRequest, FetchResponse),
    2: (0, 10, ListOffsetsRequest, ListOffsetsResponse),
    3: (0, 13, MetadataRequest, MetadataResponse),
    8: (0, 9, OffsetCommitRequest, OffsetCommitResponse),
    9: (0, 9, OffsetFetchRequest, OffsetFetchResponse),
    10: (0, 6, FindCoordinatorRequest, FindCoordinatorResponse),
    11: (0, 9, JoinGroupRequest, JoinGroupResponse),
    12: (0, 4, HeartbeatRequest, HeartbeatResponse),
    13: (0, 5, LeaveGroupRequest, LeaveGroupResponse),
    14: (0, 5, SyncGroupRequest, SyncGroupResponse),
    15: (0, 6, DescribeGroupsRequest, DescribeGroupsResponse),
    16: (0, 5, ListGroupsRequest, ListGroupsResponse),
    18: (0, 4, ApiVersionsRequest, ApiVersionsResponse),
    19: (2, 7, CreateTopicsRequest, CreateTopicsResponse),
    20: (1, 6, DeleteTopicsRequest, DeleteTopicsResponse),
    21: (0, 2, DeleteRecordsRequest, DeleteRecordsResponse),
    22: (0, 5, InitProducerIdRequest, InitProducerIdResponse),
    23: (2, 4, OffsetForLeaderEpochRequest, OffsetForLeaderEpochResponse),
    24: (0, 5, AddPartitionsToTxnRequest, AddPartitionsToTxnResponse),
    25: (0, 4, AddOffsetsToTxnRequest, AddOffsetsToTxnResponse),
    26: (0, 5, EndTxnRequest, EndTxnResponse),
    27: (1, 1, WriteTxnMarkersRequest, WriteTxnMarkersResponse),
    28: (0, 5, TxnOffsetCommitRequest, TxnOffsetCommitResponse),
    32: (1, 4, DescribeConfigsRequest, DescribeConfigsResponse),
    33: (0, 2, AlterConfigsRequest, AlterConfigsResponse),
    35: (1, 4, DescribeLogDirsRequest, DescribeLogDirsResponse),
    37: (0, 3, CreatePartitionsRequest, CreatePartitionsResponse),
    42: (0, 2, DeleteGroupsRequest, DeleteGroupsResponse),
    43: (0, 2, ElectLeadersRequest, ElectLeadersResponse),
    44: (0, 1, IncrementalAlterConfigsRequest, IncrementalAlterConfigsResponse),
    45: (0, 1, AlterPartitionReassignmentsRequest, AlterPartitionReassignmentsResponse),
    46: (0, 0, ListPartitionReassignmentsRequest, ListPartitionReassignmentsResponse),
    47: (0, 0, OffsetDeleteRequest, OffsetDeleteResponse),
    60: (0, 2, DescribeClusterRequest, DescribeClusterResponse),
    61: (0, 0, DescribeProducersRequest, DescribeProducersResponse),
    65: (0, 0, DescribeTransactionsRequest, DescribeTransactionsResponse),
    66: (0, 2, ListTransactionsRequest, ListTransactionsResponse),
    75: (0, 0, DescribeTopicPartitionsRequest, DescribeTopicPartitionsResponse),
}

SUPPORTED_APIS: dict[int, tuple[int, int]] = {k: (v[0], v[1]) for k, v in _SUPPORTED.items()}

# Kafka 4.1's highest version of each API we offer (its ApiVersions answer): the advertised
# maxima must equal these, or a client that infers "4.1" from Produce v13 sends versions we
# refuse. tests/fuzz/test_api_coverage.py checks this table against kafka-python's record of
# Kafka 4.1 (kafka.protocol.broker_version_data).
KAFKA_RELEASE = (4, 1)
KAFKA_41_MAX: dict[int, int] = {
    0: 13, 1: 18, 2: 10, 3: 13, 8: 9, 9: 9, 10: 6, 11: 9, 12: 4, 13: 5, 14: 5, 15: 6, 16: 5,
    18: 4, 19: 7, 20: 6, 21: 2, 22: 5, 23: 4, 24: 5, 25: 4, 26: 5, 27: 1, 28: 5, 32: 4, 33: 2, 35: 4,
    37: 3, 42: 2, 43: 2, 44: 1, 45: 1, 46: 0, 47: 0, 60: 2, 61: 0, 65: 0, 66: 2, 75: 0,
}

API_VERSIONS_KEY = 18
PRODUCE_KEY = 0
FETCH_KEY = 1


def api_name(api_key: int) -> str:
    """Kafka's name of an API (e.g. ``Produce``), or ``Unknown(<key>)`` for logs."""
    entry = _SUPPORTED.get(api_key)
    if entry is not None:
        return str(entry[2].name)[: -len("Request")]
    try:
        from kafka.protocol.api_key import ApiKey

        return ApiKey(api_key).name
    except ValueError:
        return f"Unknown({api_key})"


def request_class(api_key: int) -> Any:
    """kafka-python request class (unversioned) for a supported API key; KeyError otherwise."""
    return _SUPPORTED[api_key][2]


def response_class(api_key: int) -> Any:
    """kafka-python response class (unversioned) for a supported API key; KeyError otherwise.

    Build a response with ``response_class(k)(version=header.api_version, field=...)``.
    """
    return _SUPPORTED[api_key][3]


def is_flexible(api_key: int, api_version: int) -> bool:
    """True when this (api, version) uses compact encodings and tagged fields (KIP-482)."""
    return bool(_SUPPORTED[api_key][2].flexible_version_q(api_version))
