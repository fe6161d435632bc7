"""Authorized operations (KIP-430) as Kafka reports them without an authorizer.

With no authorizer Kafka grants, and reports, every operation valid for the resource type
(its AclEntry.supportedOperations), as a 32-bit field with bit ``1 << code`` set for each
AclOperation code; INT32_MIN means "not requested" (clients show null). kafka-python's codec
takes these fields as sets of bit positions (None = not requested) for Metadata, DescribeCluster
and DescribeGroups, and as a plain int32 for DescribeTopicPartitions.
"""
from __future__ import annotations

NOT_REQUESTED = -2147483648

# AclOperation codes (org.apache.kafka.common.acl.AclOperation)
READ, WRITE, CREATE, DELETE, ALTER, DESCRIBE = 3, 4, 5, 6, 7, 8
CLUSTER_ACTION, DESCRIBE_CONFIGS, ALTER_CONFIGS, IDEMPOTENT_WRITE = 9, 10, 11, 12

TOPIC_OPS = frozenset({READ, WRITE, CREATE, DESCRIBE, DELETE, ALTER, DESCRIBE_CONFIGS,
                       ALTER_CONFIGS})
GROUP_OPS = frozenset({READ, DESCRIBE, DELETE})
CLUSTER_OPS = frozenset({CREATE, CLUSTER_ACTION, DESCRIBE_CONFIGS, ALTER_CONFIGS,
                         IDEMPOTENT_WRITE, ALTER, DESCRIBE})


def ops_if(requested: object, ops: frozenset[int]) -> set[int] | None:
    """The codec's form of ``ops`` when the client asked for them, else None (INT32_MIN)."""
    return set(ops) if requested else None


def as_int32(ops: frozenset[int]) -> int:
    """The bitfield as the int32 the wire carries (DescribeTopicPartitions' plain field)."""
    return sum(1 << c for c in ops)
