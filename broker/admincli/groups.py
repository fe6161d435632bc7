"""``s3kafka groups ...``: what kafka-consumer-groups.sh is used for daily.

list, describe (members, assignments, committed offsets, lag), reset-offsets (dry run unless
--execute, refused while the group has members, as Kafka refuses it), delete-offsets, delete.
"""
from __future__ import annotations

import argparse
import datetime as dt
import re
import time
from typing import Any

from .common import CliError, Family, Result, exception_line, kafka_error, list_offsets, table

INACTIVE_STATES = ("Empty", "Dead")


def register(families: Any, common: argparse.ArgumentParser) -> None:
    fam = Family(families, common, "groups", help="list, describe, reset offsets of, delete "
                 "consumer groups", description="Manage consumer groups (like "
                 "kafka-consumer-groups.sh).")
    fam.action("list", list_groups, help="groups with state and protocol type")

    p = fam.action("describe", describe_group,
                   help="members, assignments, committed offsets and lag")
    p.add_argument("group", metavar="GROUP")

    p = fam.action("reset-offsets", reset_offsets,
                   help="move committed offsets (dry run unless --execute)",
                   description="Plan, and with --execute commit, new offsets for an inactive "
                   "group. Offsets outside [log start, log end] are clamped to it.")
    p.add_argument("group", metavar="GROUP")
    scope = p.add_mutually_exclusive_group(required=True)
    scope.add_argument("--topic", action="append", metavar="TOPIC[:P,P...]",
                       help="a topic, or some of its partitions (repeatable)")
    scope.add_argument("--all-topics", action="store_true",
                       help="every partition the group has committed offsets for")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-earliest", action="store_true", help="the log start offset")
    to.add_argument("--to-latest", action="store_true", help="the log end offset")
    to.add_argument("--to-datetime", metavar="ISO",
                    help="first offset at or after this time, e.g. 2026-11-24T12:00:00Z (no "
                    "zone: local time) or epoch milliseconds; log end if none")
    to.add_argument("--by-duration", metavar="PnDTnHnMnS",
                    help="first offset at or after now minus this ISO 8601 duration, e.g. "
                    "PT30M or P1DT2H")
    to.add_argument("--to-offset", type=int, metavar="N", help="this offset")
    to.add_argument("--shift-by", type=int, metavar="N",
                    help="the committed offset plus N (negative moves back)")
    run = p.add_mutually_exclusive_group()
    run.add_argument("--execute", action="store_true", help="commit the planned offsets")
    run.add_argument("--dry-run", action="store_true", help="only show the plan (the default)")

    p = fam.action("delete-offsets", delete_offsets,
                   help="delete a group's committed offsets of some topics")
    p.add_argument("group", metavar="GROUP")
    p.add_argument("--topic", action="append", required=True, metavar="TOPIC[:P,P...]",
                   help="a topic (the partitions the group committed), or some of its "
                   "partitions (repeatable)")

    p = fam.action("delete", delete_groups, help="delete inactive groups and their offsets")
    p.add_argument("groups", nargs="+", metavar="GROUP")


# ------------------------------------------------------------------------- helpers
def _describe(admin: Any, group: str) -> dict[str, Any]:
    desc = admin.describe_groups([group])[group]
    # DescribeGroups v6+ (Kafka 4.x) answers GROUP_ID_NOT_FOUND for an unknown group, which
    # older versions reported as Dead without an error: kafka-python fills in Dead either way
    if desc.get("error") and "GroupIdNotFound" not in str(desc["error"]):
        raise CliError(f"cannot describe group '{group}': {desc['error']}")
    return desc


def _committed(admin: Any, group: str, tps: list | None = None) -> dict:
    """{TopicPartition: OffsetAndMetadata} of the group's commits (-1 = none dropped)."""
    got = admin.list_group_offsets({group: tps})[group]
    return {tp: om for tp, om in got.items() if om.offset is not None and om.offset >= 0}


def _existing(admin: Any, topics: set[str]) -> dict[str, list[int]]:
    """{topic: partition ids} of the topics that exist (commits may outlive a topic)."""
    if not topics:
        return {}
    return {t["name"]: sorted(p["partition_index"] for p in t["partitions"])
            for t in admin.describe_topics(sorted(topics)) if not t["error_code"]}


def _assignment(member: dict[str, Any]) -> list[tuple[str, int]]:
    """(topic, partition) pairs of a consumer-protocol member (other protocols: none)."""
    a = member.get("member_assignment")
    if not isinstance(a, dict):
        return []
    return sorted((t["topic"], p) for t in a.get("assigned_partitions", []) for p in t["partitions"])


_DURATION = re.compile(r"P(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+(?:\.\d+)?)S)?)?")


def _parse_duration_ms(text: str) -> int:
    """ISO 8601 ``PnDTnHnMnS`` (what kafka-consumer-groups.sh --by-duration takes) -> ms."""
    m = _DURATION.fullmatch(text.strip().upper())
    if not m or text.strip().upper() in ("P", "PT") or text.strip().upper().endswith("T"):
        raise CliError(f"--by-duration {text!r} is not an ISO 8601 duration such as PT30M "
                       "or P1DT2H")
    d, h, mi, sec = (float(x) if x else 0.0 for x in m.groups())
    return int((((d * 24 + h) * 60 + mi) * 60 + sec) * 1000)


def _parse_topic_specs(specs: list[str]) -> dict[str, list[int] | None]:
    """``["t", "u:0,2"]`` -> ``{"t": None, "u": [0, 2]}`` (None: every partition)."""
    wanted: dict[str, list[int] | None] = {}
    for spec in specs:
        name, sep, parts = spec.partition(":")
        try:
            ids = [int(p) for p in parts.split(",") if p.strip()] if sep else None
        except ValueError:
            raise CliError(f"--topic {spec!r} is not TOPIC or TOPIC:P,P,...") from None
        if not name or ids == []:
            raise CliError(f"--topic {spec!r} is not TOPIC or TOPIC:P,P,...")
        wanted[name] = ids
    return wanted


def _parse_time_ms(text: str) -> int:
    if text.strip().lstrip("-").isdigit():
        return int(text)
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise CliError(f"--to-datetime {text!r} is not an ISO date-time such as "
                       "2026-11-24T12:00:00Z") from None
    if when.tzinfo is None:
        when = when.astimezone()  # local time, as kafka-consumer-groups.sh reads it
    return int(when.timestamp() * 1000)


# ------------------------------------------------------------------------- commands
def list_groups(args: argparse.Namespace, admin: Any) -> Result:
    groups = sorted(admin.list_groups(), key=lambda g: g["group_id"])
    data = [{"group": g["group_id"], "state": g.get("group_state"),
             "protocol_type": g.get("protocol_type") or ""} for g in groups]
    lines = table(["GROUP", "STATE", "PROTOCOL-TYPE"],
                  [(d["group"], d["state"], d["protocol_type"] or "-") for d in data])
    return Result(data, lines)


def describe_group(args: argparse.Namespace, admin: Any) -> Result:
    from kafka import TopicPartition  # noqa: PLC0415
    from kafka.admin import OffsetSpec  # noqa: PLC0415

    group = args.group
    desc = _describe(admin, group)
    committed = _committed(admin, group)
    if desc["group_state"] == "Dead" and not committed:
        raise CliError(f"consumer group '{group}' does not exist")
    owner: dict[Any, dict[str, Any]] = {}
    members = []
    for m in desc["members"]:
        assigned = _assignment(m)
        for t, p in assigned:
            owner[TopicPartition(t, p)] = m
        members.append({"member_id": m["member_id"], "group_instance_id": m["group_instance_id"],
                        "client_id": m["client_id"], "host": m["client_host"],
                        "assignment": [{"topic": t, "partition": p} for t, p in assigned]})
    tps = sorted(set(committed) | set(owner))
    existing = _existing(admin, {tp.topic for tp in tps})
    live = [tp for tp in tps if tp.partition in existing.get(tp.topic, ())]
    ends = list_offsets(admin, live, OffsetSpec.LATEST)
    rows = []
    for tp in tps:
        cur = committed[tp].offset if tp in committed else None
        end = ends.get(tp)
        m = owner.get(tp)
        rows.append({"topic": tp.topic, "partition": tp.partition, "current_offset": cur,
                     "log_end_offset": end,
                     "lag": None if cur is None or end is None else max(end - cur, 0),
                     "member_id": m["member_id"] if m else None,
                     "host": m["client_host"] if m else None,
                     "client_id": m["client_id"] if m else None})
    total_lag = sum(r["lag"] for r in rows if r["lag"] is not None)
    data = {"group": group, "state": desc["group_state"],
            "protocol_type": desc["protocol_type"], "protocol": desc["protocol_data"],
            "members": members, "offsets": rows, "total_lag": total_lag}
    lines = [f"Group: {group}  State: {desc['group_state']}  Protocol: "
             f"{desc['protocol_type'] or '-'}/{desc['protocol_data'] or '-'}  "
             f"Members: {len(members)}  Total lag: {total_lag}"]
    if members:
        lines += [""] + table(
            ["MEMBER-ID", "INSTANCE-ID", "CLIENT-ID", "HOST", "ASSIGNMENT"],
            [(m["member_id"], m["group_instance_id"], m["client_id"], m["host"],
              ",".join(f"{a['topic']}-{a['partition']}" for a in m["assignment"]) or "-")
             for m in members])
    if rows:
        lines += [""] + table(
            ["TOPIC", "PARTITION", "CURRENT-OFFSET", "LOG-END-OFFSET", "LAG", "CONSUMER-ID",
             "HOST", "CLIENT-ID"],
            [(r["topic"], r["partition"], r["current_offset"], r["log_end_offset"], r["lag"],
              r["member_id"], r["host"], r["client_id"]) for r in rows])
    return Result(data, lines)


def _reset_scope(args: argparse.Namespace, admin: Any, committed: dict) -> list:
    from kafka import TopicPartition  # noqa: PLC0415

    if args.all_topics:
        if not committed:
            raise CliError(f"group '{args.group}' has no committed offsets to reset")
        existing = _existing(admin, {tp.topic for tp in committed})
        return sorted(tp for tp in committed if tp.partition in existing.get(tp.topic, ()))
    wanted = _parse_topic_specs(args.topic)
    existing = _existing(admin, set(wanted))
    tps = []
    for name, ids in wanted.items():
        if name not in existing:
            raise CliError(f"topic '{name}' does not exist")
        for p in ids if ids is not None else existing[name]:
            if p not in existing[name]:
                raise CliError(f"topic '{name}' has no partition {p}")
            tps.append(TopicPartition(name, p))
    return sorted(set(tps))


def reset_offsets(args: argparse.Namespace, admin: Any) -> Result:
    from kafka.admin import OffsetSpec  # noqa: PLC0415
    from kafka.structs import OffsetAndMetadata  # noqa: PLC0415

    group = args.group
    when_ms = _parse_time_ms(args.to_datetime) if args.to_datetime is not None else None
    if args.by_duration is not None:
        when_ms = int(time.time() * 1000) - _parse_duration_ms(args.by_duration)
    state = _describe(admin, group)["group_state"]
    if state not in INACTIVE_STATES:
        raise CliError(f"Assignments can only be reset if the group '{group}' is inactive, "
                       f"but the current state is {state}.")
    committed = _committed(admin, group)
    tps = _reset_scope(args, admin, committed)
    earliest = list_offsets(admin, tps, OffsetSpec.EARLIEST)
    latest = list_offsets(admin, tps, OffsetSpec.LATEST)
    unread = [tp for tp in tps if tp not in earliest or tp not in latest]
    if unread:
        raise CliError(f"cannot read the log offsets of {unread[0].topic}-{unread[0].partition}")
    notes: list[str] = []
    if when_ms is not None:
        found = list_offsets(admin, tps, when_ms)
    plan = []
    for tp in tps:
        cur = committed[tp].offset if tp in committed else None
        lo, hi = earliest[tp], latest[tp]
        if args.to_earliest:
            new = lo
        elif args.to_latest:
            new = hi
        elif when_ms is not None:
            new = found[tp] if found.get(tp, -1) >= 0 else hi
        elif args.to_offset is not None:
            new = args.to_offset
        else:
            if cur is None:
                raise CliError(f"cannot shift offset for partition {tp.topic}-{tp.partition} "
                               "since there is no current committed offset")
            new = cur + args.shift_by
        if new < lo:
            notes.append(f"New offset ({new}) is lower than the earliest offset of "
                         f"{tp.topic}-{tp.partition}; {lo} is used.")
            new = lo
        elif new > hi:
            notes.append(f"New offset ({new}) is higher than the latest offset of "
                         f"{tp.topic}-{tp.partition}; {hi} is used.")
            new = hi
        plan.append((tp, cur, new))
    if args.execute and plan:
        offsets = {tp: OffsetAndMetadata(new, committed[tp].metadata if tp in committed else "",
                                         None) for tp, _, new in plan}
        result = admin.alter_group_offsets(group, offsets)
        failed = {tp: err for tp, err in result.items() if err.errno}
        if failed:
            tp, err = sorted(failed.items())[0]
            raise CliError(f"could not commit offsets of group '{group}' "
                           f"({len(failed)} partitions failed, {tp.topic}-{tp.partition}: "
                           f"{kafka_error(err.errno)})")
    else:
        notes.append("Dry run: nothing was changed; add --execute to commit these offsets.")
    data = {"group": group, "executed": bool(args.execute),
            "partitions": [{"topic": tp.topic, "partition": tp.partition,
                            "current_offset": cur, "new_offset": new} for tp, cur, new in plan]}
    lines = table(["GROUP", "TOPIC", "PARTITION", "CURRENT-OFFSET", "NEW-OFFSET"],
                  [(group, tp.topic, tp.partition, cur, new) for tp, cur, new in plan])
    return Result(data, lines, notes)


def delete_offsets(args: argparse.Namespace, admin: Any) -> Result:
    from kafka import TopicPartition  # noqa: PLC0415
    from kafka.errors import KafkaError  # noqa: PLC0415

    group = args.group
    wanted = _parse_topic_specs(args.topic)
    committed = _committed(admin, group)
    tps = sorted({TopicPartition(t, p) for t, ids in wanted.items() for p in
                  (ids if ids is not None else [tp.partition for tp in committed if tp.topic == t])})
    if not tps:
        raise CliError(f"group '{group}' has no committed offsets of "
                       f"{', '.join(sorted(wanted))}")
    try:
        result = admin.delete_group_offsets(group, tps)
    except KafkaError as exc:
        raise CliError(f"cannot delete offsets of group '{group}': {exception_line(exc)}") from None
    failed = sorted((tp, err) for tp, err in result.items() if err.errno)
    if failed:
        tp, err = failed[0]
        raise CliError(f"cannot delete offsets of group '{group}' for {tp.topic}-{tp.partition}"
                       f"{f' and {len(failed) - 1} more' if len(failed) > 1 else ''}: "
                       f"{kafka_error(err.errno)}")
    data = {"group": group, "deleted": [{"topic": tp.topic, "partition": tp.partition}
                                        for tp in sorted(result)]}
    lines = table(["TOPIC", "PARTITION", "STATUS"],
                  [(tp.topic, tp.partition, "Successful") for tp in sorted(result)])
    return Result(data, lines)


def delete_groups(args: argparse.Namespace, admin: Any) -> Result:
    import kafka.errors as Errors  # noqa: PLC0415

    outcome = admin.delete_groups(list(args.groups))
    failed = {g: r for g, r in outcome.items() if r != "OK"}
    if failed:
        parts = []
        for g, r in sorted(failed.items()):
            err = getattr(Errors, r, None)
            why = kafka_error(err.errno) if err is not None and hasattr(err, "errno") else r
            parts.append(f"group '{g}' could not be deleted: {why}")
        raise CliError("; ".join(parts))
    deleted = sorted(outcome)
    quoted = ", ".join(f"'{g}'" for g in deleted)
    return Result([{"group": g, "deleted": True} for g in deleted],
                  [f"Deletion of requested consumer groups ({quoted}) was successful."])

