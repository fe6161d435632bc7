"""In-memory state of one classic consumer group: members, generation, protocol, state."""
from __future__ import annotations

import asyncio
import base64
import struct
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class GroupState(str, Enum):
    """Kafka's classic group states (names as DescribeGroups/ListGroups report them)."""

    EMPTY = "Empty"
    PREPARING_REBALANCE = "PreparingRebalance"
    COMPLETING_REBALANCE = "CompletingRebalance"
    STABLE = "Stable"
    DEAD = "Dead"


@dataclass
class JoinResult:
    """What a JoinGroup call resolves to (the handler maps it onto the versioned response)."""

    error: int
    member_id: str = ""
    generation_id: int = -1
    protocol_type: str | None = None
    protocol_name: str | None = None
    leader_id: str = ""
    members: list[tuple[str, str | None, bytes]] = field(default_factory=list)
    skip_assignment: bool = False


@dataclass
class SyncResult:
    error: int
    protocol_type: str | None = None
    protocol_name: str | None = None
    assignment: bytes = b""


@dataclass
class Member:
    """One group member; futures are set while a JoinGroup/SyncGroup call is parked."""

    member_id: str
    instance_id: str | None
    client_id: str
    client_host: str
    session_timeout_ms: int
    rebalance_timeout_ms: int
    protocol_type: str
    protocols: list[tuple[str, bytes]]
    assignment: bytes = b""
    join_future: asyncio.Future[JoinResult] | None = None
    sync_future: asyncio.Future[SyncResult] | None = None
    session_timer: asyncio.TimerHandle | None = None

    @property
    def awaiting_join(self) -> bool:
        return self.join_future is not None and not self.join_future.done()

    @property
    def awaiting_sync(self) -> bool:
        return self.sync_future is not None and not self.sync_future.done()

    def protocol_names(self) -> list[str]:
        return [name for name, _ in self.protocols]

    def metadata_for(self, protocol: str | None) -> bytes:
        for name, meta in self.protocols:
            if name == protocol:
                return meta
        return b""

    def same_protocols(self, protocols: list[tuple[str, bytes]]) -> bool:
        return [(n, bytes(m)) for n, m in self.protocols] == [(n, bytes(m)) for n, m in protocols]

    def complete_join(self, result: JoinResult) -> None:
        if self.awaiting_join:
            self.join_future.set_result(result)  # type: ignore[union-attr]
        self.join_future = None

    def complete_sync(self, result: SyncResult) -> None:
        if self.awaiting_sync:
            self.sync_future.set_result(result)  # type: ignore[union-attr]
        self.sync_future = None

    def cancel_timer(self) -> None:
        if self.session_timer is not None:
            self.session_timer.cancel()
            self.session_timer = None

    def to_json(self) -> dict[str, Any]:
        return {
            "member_id": self.member_id,
            "instance_id": self.instance_id,
            "client_id": self.client_id,
            "client_host": self.client_host,
            "session_timeout_ms": self.session_timeout_ms,
            "rebalance_timeout_ms": self.rebalance_timeout_ms,
            "protocol_type": self.protocol_type,
            "protocols": [[n, base64.b64encode(bytes(m)).decode()] for n, m in self.protocols],
            "assignment": base64.b64encode(self.assignment).decode(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Member":
        return cls(
            member_id=d["member_id"],
            instance_id=d.get("instance_id"),
            client_id=d.get("client_id", ""),
            client_host=d.get("client_host", ""),
            session_timeout_ms=int(d["session_timeout_ms"]),
            rebalance_timeout_ms=int(d["rebalance_timeout_ms"]),
            protocol_type=d.get("protocol_type", ""),
            protocols=[(n, base64.b64decode(m)) for n, m in d.get("protocols", [])],
            assignment=base64.b64decode(d.get("assignment", "")),
        )


@dataclass
class Group:
    """A classic group. All mutation happens on the event loop, so no locks are needed."""

    group_id: str
    state: GroupState = GroupState.EMPTY
    protocol_type: str | None = None
    protocol_name: str | None = None
    generation_id: int = 0
    leader_id: str | None = None
    members: dict[str, Member] = field(default_factory=dict)
    static_members: dict[str, str] = field(default_factory=dict)  # instance id -> member id
    pending_members: dict[str, asyncio.TimerHandle] = field(default_factory=dict)  # v4+ ids handed out
    rebalance_timer: asyncio.TimerHandle | None = None
    initial_delay_active: bool = False

    def is_empty(self) -> bool:
        return not self.members

    def add_member(self, member: Member) -> None:
        if not self.members:
            self.protocol_type = member.protocol_type
        self.members[member.member_id] = member
        if member.instance_id is not None:
            self.static_members[member.instance_id] = member.member_id
        if self.leader_id is None:
            self.leader_id = member.member_id

    def remove_member(self, member_id: str) -> Member | None:
        member = self.members.pop(member_id, None)
        if member is None:
            return None
        member.cancel_timer()
        if member.instance_id is not None and self.static_members.get(member.instance_id) == member_id:
            del self.static_members[member.instance_id]
        if self.leader_id == member_id:
            joined = [m for m in self.members.values() if m.awaiting_join]
            pool = joined or list(self.members.values())
            self.leader_id = pool[0].member_id if pool else None
        return member

    def is_static_member_fenced(self, member_id: str, instance_id: str | None) -> bool:
        """A request carrying an instance id whose current member id is someone else's."""
        if instance_id is None:
            return False
        current = self.static_members.get(instance_id)
        return current is not None and current != member_id

    def candidate_protocols(self, exclude: str | None = None) -> list[str]:
        """Protocols every member (except ``exclude``) supports, in the first member's order."""
        members = [m for m in self.members.values() if m.member_id != exclude]
        if not members:
            return []
        common = set(members[0].protocol_names())
        for m in members[1:]:
            common &= set(m.protocol_names())
        return [p for p in members[0].protocol_names() if p in common]

    def supports_protocols(self, protocol_type: str, protocols: list[tuple[str, bytes]], member_id: str | None) -> bool:
        """JoinGroup's consistency check: same protocol type and at least one common protocol."""
        if not protocols or not protocol_type:
            return False
        others = [m for m in self.members.values() if m.member_id != member_id]
        if not others:
            return True
        if self.protocol_type is not None and protocol_type != self.protocol_type:
            return False
        candidates = set(self.candidate_protocols(exclude=member_id))
        return any(name in candidates for name, _ in protocols)

    def select_protocol(self) -> str | None:
        """Each member votes for its most preferred candidate protocol; most votes wins,
        ties go to the earliest candidate (as Kafka does)."""
        candidates = self.candidate_protocols()
        if not candidates:
            return None
        votes = {p: 0 for p in candidates}
        for m in self.members.values():
            for name in m.protocol_names():
                if name in votes:
                    votes[name] += 1
                    break
        return max(candidates, key=lambda p: (votes[p], -candidates.index(p)))

    def all_members_joined(self) -> bool:
        return not self.pending_members and all(m.awaiting_join for m in self.members.values())

    def subscribed_topics(self) -> set[str] | None:
        """Topics the members subscribe to (consumer protocol only; None = unknown)."""
        if self.protocol_type != "consumer":
            return None
        topics: set[str] = set()
        for m in self.members.values():
            parsed = parse_subscription(m.metadata_for(self.protocol_name) if self.protocol_name else
                                        (m.protocols[0][1] if m.protocols else b""))
            if parsed is None:
                return None
            topics |= parsed
        return topics


def parse_subscription(metadata: bytes) -> set[str] | None:
    """Topics of a ConsumerProtocolSubscription (int16 version, [string] topics, ...)."""
    try:
        buf = memoryview(bytes(metadata))
        (count,) = struct.unpack_from(">i", buf, 2)
        pos, topics = 6, set()
        for _ in range(max(count, 0)):
            (n,) = struct.unpack_from(">h", buf, pos)
            pos += 2
            if n < 0 or pos + n > len(buf):
                return None
            topics.add(bytes(buf[pos:pos + n]).decode("utf-8"))
            pos += n
        return topics
    except (struct.error, UnicodeDecodeError):
        return None
