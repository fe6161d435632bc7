"""Classic consumer-group coordinator (JoinGroup/SyncGroup/Heartbeat/LeaveGroup, committed offsets)."""
from .coordinator import CommittedOffset, GroupCoordinator, GroupSummary, MemberSummary
from .group import GroupState, JoinResult, SyncResult
from .store import GroupStore, SqliteGroupStore

__all__ = [
    "CommittedOffset", "GroupCoordinator", "GroupState", "GroupStore", "GroupSummary",
    "JoinResult", "MemberSummary", "SqliteGroupStore", "SyncResult",
]
