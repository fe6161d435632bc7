"""Which errors a client may see under faults without a bug: the Kafka error codes that are
retriable (or group membership churn every member handles by rejoining), and a thread-safe
tally of errors by kind that keeps the ones that were not."""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

# Kafka error codes a client may see while brokers fail over, the store or PostgreSQL is away
# (retriable, or membership churn every group member handles by rejoining)
RETRIABLE_CODES = {
    3,    # UNKNOWN_TOPIC_OR_PARTITION (metadata not yet known to a restarted broker)
    5,    # LEADER_NOT_AVAILABLE
    6,    # NOT_LEADER_OR_FOLLOWER
    7,    # REQUEST_TIMED_OUT
    13,   # NETWORK_EXCEPTION
    14,   # COORDINATOR_LOAD_IN_PROGRESS
    15,   # COORDINATOR_NOT_AVAILABLE
    16,   # NOT_COORDINATOR
    19,   # NOT_ENOUGH_REPLICAS
    20,   # NOT_ENOUGH_REPLICAS_AFTER_APPEND
    22,   # ILLEGAL_GENERATION (a commit from before a rebalance: rejoin)
    25,   # UNKNOWN_MEMBER_ID (session expired while the coordinator moved: rejoin)
    27,   # REBALANCE_IN_PROGRESS
    56,   # KAFKA_STORAGE_ERROR
    74,   # FENCED_LEADER_EPOCH
    75,   # UNKNOWN_LEADER_EPOCH
    78,   # OFFSET_NOT_AVAILABLE
    79,   # MEMBER_ID_REQUIRED
    89,   # THROTTLING_QUOTA_EXCEEDED
}


def code_retriable(code: int) -> bool:
    """A broker error code (>0) must be in RETRIABLE_CODES; librdkafka's local errors (<0) are
    the client's view of connectivity (transport, timeouts, all brokers down) except _FATAL."""
    return code in RETRIABLE_CODES or (code < 0 and code != -150)


@dataclass
class Errors:
    """Errors by kind (thread-safe), and the ones that were not retriable."""

    kinds: Counter = field(default_factory=Counter)
    fatal: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, retriable: bool, detail: str = "") -> None:
        with self.lock:
            self.kinds[kind] += 1
            if not retriable:
                self.fatal.append(f"{kind}: {detail}"[:300])
