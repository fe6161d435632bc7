"""``s3kafka topics ...``: what kafka-topics.sh and kafka-configs.sh (topics) are used for daily.

list, describe, create, delete, alter-config, add-partitions. Every answer comes from the
broker over the Kafka protocol (Metadata, ListOffsets, DescribeConfigs, CreateTopics,
DeleteTopics, IncrementalAlterConfigs, CreatePartitions).
"""
from __future__ import annotations

import argparse
import re
from typing import Any

from .common import CliError, Family, Result, exception_line, kafka_error, list_offsets, parse_kv, table

TOPIC_OVERRIDE = "DYNAMIC_TOPIC_CONFIG"


def register(families: Any, common: argparse.ArgumentParser) -> None:
    fam = Family(families, common, "topics", help="list, describe, create, delete, alter topics",
                 description="Manage topics (like kafka-topics.sh and kafka-configs.sh "
                 "--entity-type topics).")
    p = fam.action("list", list_topics, help="topics with partition counts")
    p.add_argument("--exclude-internal", action="store_true", help="hide internal topics")

    p = fam.action("describe", describe_topics,
                   help="partitions, leaders, offsets and config overrides")
    p.add_argument("topics", nargs="*", metavar="TOPIC", help="default: every topic")
    p.add_argument("--all-configs", action="store_true",
                   help="every config with its value and source, not only overrides")

    p = fam.action("create", create_topic, help="create a topic")
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("--partitions", type=int, default=-1, metavar="N",
                   help="default: the broker's num.partitions")
    p.add_argument("--replication-factor", type=int, default=-1, metavar="R",
                   help="default: the broker's default.replication.factor")
    p.add_argument("--config", action="append", metavar="NAME=VALUE",
                   help="topic config override (repeatable, or comma-separated)")
    p.add_argument("--if-not-exists", action="store_true", help="succeed if it exists already")

    p = fam.action("delete", delete_topics, help="delete topics")
    p.add_argument("topics", nargs="+", metavar="TOPIC")
    p.add_argument("--if-exists", action="store_true", help="succeed if a topic does not exist")

    p = fam.action("alter-config", alter_config, help="set or remove topic config overrides")
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help="set an override (repeatable, or comma-separated)")
    p.add_argument("--delete", action="append", metavar="NAME",
                   help="remove an override, back to the default (repeatable)")

    p = fam.action("add-partitions", add_partitions,
                   help="grow a topic to a total partition count")
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("--total", type=int, required=True, metavar="N",
                   help="partition count after the change")


# ------------------------------------------------------------------------- helpers
def _metadata(admin: Any, names: list[str] | None) -> list[dict[str, Any]]:
    """Metadata of ``names`` (None: all topics); an unknown name is an error."""
    topics = admin.describe_topics(names)
    for t in topics:
        if t["error_code"]:
            if t["error_code"] == 3:
                raise CliError(f"topic '{t['name']}' does not exist")
            raise CliError(f"topic '{t['name']}': {kafka_error(t['error_code'])}")
    return sorted(topics, key=lambda t: t["name"])


def _topic_id(t: dict[str, Any]) -> str | None:
    tid = t.get("topic_id")
    return None if tid in (None, "AAAAAAAAAAAAAAAAAAAAAA") else str(tid)


def _replication_factor(t: dict[str, Any]) -> int:
    return max((len(p["replica_nodes"]) for p in t["partitions"]), default=0)


def _topic_configs(admin: Any, names: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """{topic: {config name: {value, source, ...}}} for every config of each topic."""
    from kafka.admin import ConfigResource  # noqa: PLC0415

    if not names:
        return {}
    got = admin.describe_configs([ConfigResource("TOPIC", n) for n in names], config_filter="all")
    return got.get("topic", {})


def _log_offsets(admin: Any, topics: list[dict[str, Any]]) -> tuple[dict, dict]:
    """(earliest, latest) offset per TopicPartition of these topics."""
    from kafka import TopicPartition  # noqa: PLC0415
    from kafka.admin import OffsetSpec  # noqa: PLC0415

    tps = [TopicPartition(t["name"], p["partition_index"]) for t in topics for p in t["partitions"]]
    return (list_offsets(admin, tps, OffsetSpec.EARLIEST),
            list_offsets(admin, tps, OffsetSpec.LATEST))


def _check(code: int, message: str | None, what: str) -> None:
    if code:
        raise CliError(f"{what}: {kafka_error(code, message)}")


# ------------------------------------------------------------------------- commands
def list_topics(args: argparse.Namespace, admin: Any) -> Result:
    topics = [t for t in _metadata(admin, None)
              if not (args.exclude_internal and t["is_internal"])]
    data = [{"name": t["name"], "topic_id": _topic_id(t), "partitions": len(t["partitions"]),
             "replication_factor": _replication_factor(t), "internal": bool(t["is_internal"])}
            for t in topics]
    lines = table(["TOPIC", "PARTITIONS", "REPLICATION-FACTOR", "INTERNAL"],
                  [(d["name"], d["partitions"], d["replication_factor"],
                    "yes" if d["internal"] else "no") for d in data])
    return Result(data, lines)


def describe_topics(args: argparse.Namespace, admin: Any) -> Result:
    from kafka import TopicPartition  # noqa: PLC0415

    topics = _metadata(admin, args.topics or None)
    configs = _topic_configs(admin, [t["name"] for t in topics])
    earliest, latest = _log_offsets(admin, topics)
    data, lines = [], []
    for t in topics:
        cfg = configs.get(t["name"], {})
        overrides = {k: v["value"] for k, v in sorted(cfg.items())
                     if v.get("config_source") == TOPIC_OVERRIDE}
        parts = []
        for p in sorted(t["partitions"], key=lambda p: p["partition_index"]):
            tp = TopicPartition(t["name"], p["partition_index"])
            parts.append({"partition": p["partition_index"], "leader": p["leader_id"],
                          "leader_epoch": p.get("leader_epoch"),
                          "replicas": list(p["replica_nodes"]), "isr": list(p["isr_nodes"]),
                          "offline_replicas": list(p.get("offline_replicas") or []),
                          "log_start_offset": earliest.get(tp), "log_end_offset": latest.get(tp)})
        entry: dict[str, Any] = {
            "name": t["name"], "topic_id": _topic_id(t), "internal": bool(t["is_internal"]),
            "partition_count": len(parts), "replication_factor": _replication_factor(t),
            "configs": overrides, "partitions": parts}
        if args.all_configs:
            entry["all_configs"] = {k: {"value": v["value"], "source": v.get("config_source"),
                                        "read_only": v.get("read_only", False)}
                                    for k, v in sorted(cfg.items())}
        data.append(entry)
        if lines:
            lines.append("")
        conf = ",".join(f"{k}={v}" for k, v in overrides.items())
        lines.append(f"Topic: {t['name']}  TopicId: {entry['topic_id'] or '-'}  "
                     f"PartitionCount: {len(parts)}  ReplicationFactor: "
                     f"{entry['replication_factor']}  Configs: {conf}".rstrip())
        lines += ["  " + row for row in table(
            ["PARTITION", "LEADER", "REPLICAS", "ISR", "LOG-START-OFFSET", "LOG-END-OFFSET"],
            [(p["partition"], p["leader"], ",".join(map(str, p["replicas"])),
              ",".join(map(str, p["isr"])), p["log_start_offset"], p["log_end_offset"])
             for p in parts])]
        if args.all_configs:
            lines += ["  " + row for row in table(
                ["CONFIG", "VALUE", "SOURCE"],
                [(k, v["value"], v["source"]) for k, v in entry["all_configs"].items()])]
    return Result(data, lines)


def create_topic(args: argparse.Namespace, admin: Any) -> Result:
    configs = parse_kv(args.config, "--config")
    resp = admin.create_topics(
        {args.topic: {"num_partitions": args.partitions,
                      "replication_factor": args.replication_factor, "configs": configs}},
        raise_errors=False)
    res = resp["topics"][0]
    if res["error_code"] == 36 and args.if_not_exists:
        return Result({"topic": args.topic, "created": False},
                      [f"Topic '{args.topic}' already exists."])
    _check(res["error_code"], res.get("error_message"), f"cannot create topic '{args.topic}'")
    t = _metadata(admin, [args.topic])[0]
    data = {"topic": args.topic, "created": True, "topic_id": _topic_id(t),
            "partitions": len(t["partitions"]), "replication_factor": _replication_factor(t),
            "configs": configs}
    return Result(data, [f"Created topic {args.topic}."])


def delete_topics(args: argparse.Namespace, admin: Any) -> Result:
    resp = admin.delete_topics(list(args.topics), raise_errors=False)
    data, lines, errors = [], [], []
    for res in resp["topics"]:
        code = res["error_code"]
        if code == 3 and args.if_exists:
            data.append({"topic": res["name"], "deleted": False})
            lines.append(f"Topic '{res['name']}' does not exist.")
        elif code == 3:
            errors.append(f"topic '{res['name']}' does not exist")
        elif code:
            errors.append(f"cannot delete topic '{res['name']}': "
                          f"{kafka_error(code, res.get('error_message'))}")
        else:
            data.append({"topic": res["name"], "deleted": True})
            lines.append(f"Deleted topic {res['name']}.")
    if errors:
        raise CliError("; ".join(errors))
    return Result(data, lines)


def alter_config(args: argparse.Namespace, admin: Any) -> Result:
    from kafka.admin import AlterConfigOp, ConfigResource  # noqa: PLC0415

    to_set = parse_kv(args.set, "--set")
    to_delete = [n.strip() for item in args.delete or [] for n in item.split(",") if n.strip()]
    if not to_set and not to_delete:
        raise CliError("nothing to change: give --set NAME=VALUE and/or --delete NAME")
    both = set(to_set) & set(to_delete)
    if both:
        raise CliError(f"both --set and --delete name {', '.join(sorted(both))}")
    _metadata(admin, [args.topic])
    ops: dict[str, Any] = {k: (AlterConfigOp.SET, v) for k, v in to_set.items()}
    ops.update({k: (AlterConfigOp.DELETE, None) for k in to_delete})
    try:
        got = admin.alter_configs([ConfigResource("TOPIC", args.topic, ops)],
                                  raise_on_unknown=False, incremental=True)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    outcome = got.get("topic", {}).get(args.topic, "OK")
    if outcome != "OK":  # kafka-python's "[Error 40] InvalidConfigurationError: <message>"
        m = re.match(r"\[Error (\d+)\] \w+: ?(.*)", outcome)
        why = kafka_error(int(m.group(1)), m.group(2) or None) if m else outcome
        raise CliError(f"cannot alter topic '{args.topic}': {why}")
    cfg = _topic_configs(admin, [args.topic]).get(args.topic, {})
    overrides = {k: v["value"] for k, v in sorted(cfg.items())
                 if v.get("config_source") == TOPIC_OVERRIDE}
    data = {"topic": args.topic, "set": to_set, "deleted": to_delete, "configs": overrides}
    lines = [f"Completed updating config for topic {args.topic}."]
    lines += table(["CONFIG", "VALUE"], overrides.items()) if overrides else [
        "No config overrides left."]
    return Result(data, lines)


def add_partitions(args: argparse.Namespace, admin: Any) -> Result:
    from kafka.errors import KafkaError  # noqa: PLC0415

    before = len(_metadata(admin, [args.topic])[0]["partitions"])
    try:
        resp = admin.create_partitions({args.topic: args.total}, raise_errors=False)
    except KafkaError as exc:
        raise CliError(f"cannot add partitions to '{args.topic}': {exception_line(exc)}") from None
    res = resp.results[0]
    _check(res.error_code, res.error_message, f"cannot add partitions to '{args.topic}'")
    data = {"topic": args.topic, "partitions_before": before, "partitions": args.total}
    return Result(data, [f"Topic {args.topic} now has {args.total} partitions "
                         f"(was {before})."])
