"""The group store on SQLite and PostgreSQL: committed offsets and group state, transactional."""
from __future__ import annotations

from broker.groups.store import GroupRecord, OffsetRecord, SqlGroupStore


def test_offsets_upsert_delete_and_reopen(metadata_url):
    s = SqlGroupStore(metadata_url)
    s.commit_offsets([OffsetRecord("g", "t", 0, 5, 1, "m", 10),
                      OffsetRecord("g", "t", 1, 2**40, -1, None, 11)])
    s.commit_offsets([OffsetRecord("g", "t", 0, 7, 2, "m2", 12)])       # overwrite
    s.commit_offsets([])
    s.delete_offsets("g", [("t", 1), ("t", 9)])
    s.save_group(GroupRecord("g", "consumer", "range", 3, "m-1",
                             [{"member_id": "m-1", "assignment": "QUJD"}]))
    s.save_group(GroupRecord("g", "consumer", "roundrobin", 4, "m-1", []))
    s.save_group(GroupRecord("h", None, None, 0, None, []))
    s.commit_offsets([OffsetRecord("h", "t", 0, 1, -1, "", 13)])
    s.close()
    s = SqlGroupStore(metadata_url)
    assert s.load_offsets() == [OffsetRecord("g", "t", 0, 7, 2, "m2", 12),
                                OffsetRecord("h", "t", 0, 1, -1, "", 13)]
    assert sorted(s.load_groups(), key=lambda g: g.group_id) == [
        GroupRecord("g", "consumer", "roundrobin", 4, "m-1", []),
        GroupRecord("h", None, None, 0, None, [])]
    s.delete_group("h")
    assert [r.group_id for r in s.load_offsets()] == ["g"]
    assert [g.group_id for g in s.load_groups()] == ["g"]
    s.close()


def test_two_brokers_share_offsets(metadata_url):
    """What one broker (coordinator) commits, another opening the same database reads."""
    a, b = SqlGroupStore(metadata_url), SqlGroupStore(metadata_url)
    a.commit_offsets([OffsetRecord("g", "t", 0, 42, 0, "", 1)])
    assert b.load_offsets() == [OffsetRecord("g", "t", 0, 42, 0, "", 1)]
    a.close()
    b.close()
