"""Event generator for the s3kafka Spark pipeline.

Writes deterministic JSON events (same flags + seed = same events) to a topic, with each
record's Kafka timestamp set to the event time so ``startingOffsetsByTimestamp`` selects by
event time. ``--summary`` prints the exact per-window totals the pipeline must produce, which is
how the end-to-end test (and a user) checks the job's output.

    python deploy/spark/generator.py --bootstrap-servers 127.0.0.1:9092 --topic events --count 10000
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from typing import Iterator, Sequence

DEFAULT_KINDS = ("view", "click", "cart", "purchase")


def make_events(
    count: int,
    start_ms: int,
    step_ms: int = 100,
    seed: int = 1,
    kinds: Sequence[str] = DEFAULT_KINDS,
    users: int = 50,
    id_prefix: str = "e",
    first_index: int = 0,
) -> Iterator[dict]:
    """Yield ``count`` events whose event times advance by ``step_ms`` from ``start_ms``.

    ``first_index`` continues a previous run's sequence (ids and times) so a second call with the
    same seed appends new events instead of repeating old ones.
    """
    rng = random.Random(f"{seed}:{first_index}")
    for i in range(first_index, first_index + count):
        kind = kinds[rng.randrange(len(kinds))]
        yield {
            "event_id": f"{id_prefix}{i}",
            "user": f"u{rng.randrange(users)}",
            "kind": kind,
            "amount_cents": rng.randrange(1, 10_000) if kind == "purchase" else 0,
            "ts": start_ms + i * step_ms,
        }


def summarize(events: Sequence[dict], window_ms: int = 60_000) -> dict[tuple[int, str], dict[str, int]]:
    """Exact per (tumbling window start ms, kind) totals: what the pipeline must output."""
    out: dict[tuple[int, str], dict[str, int]] = defaultdict(lambda: {"events": 0, "amount_cents": 0})
    for e in events:
        key = (e["ts"] - e["ts"] % window_ms, e["kind"])
        out[key]["events"] += 1
        out[key]["amount_cents"] += e["amount_cents"]
    return dict(out)


def ensure_topic(bootstrap: str, topic: str, partitions: int) -> None:
    """Create the topic with ``partitions`` partitions unless it exists already."""
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="s3kafka-generator")
    try:
        admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        admin.close()


def produce(
    bootstrap: str,
    topic: str,
    events: Sequence[dict],
    rate: float = 0.0,
    malformed_every: int = 0,
) -> int:
    """Send events keyed by user (so one user's events stay ordered); returns records sent.

    ``malformed_every`` > 0 interleaves a non-JSON record every N events: the job must skip it.
    Blocks until every record is acknowledged (acks=all), so the caller can rely on them.
    """
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, client_id="s3kafka-generator")
    sent = 0
    started = time.monotonic()
    try:
        for n, e in enumerate(events, 1):
            producer.send(
                topic,
                key=e["user"].encode(),
                value=json.dumps(e, separators=(",", ":")).encode(),
                timestamp_ms=e["ts"],
            )
            sent += 1
            if malformed_every and n % malformed_every == 0:
                producer.send(topic, key=b"garbage", value=b"{not json", timestamp_ms=e["ts"])
                sent += 1
            if rate > 0:
                ahead = n / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        producer.flush()
    finally:
        producer.close()
    return sent


def parse_time_ms(text: str | None) -> int:
    """Epoch milliseconds from a number or an ISO-8601 time; now when absent."""
    if not text:
        return int(time.time() * 1000)
    if text.lstrip("-").isdigit():
        return int(text)
    from datetime import datetime, timezone

    dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


def build_parser() -> argparse.ArgumentParser:
    """Generator flags."""
    p = argparse.ArgumentParser(prog="generator.py", description="Write JSON events to an s3kafka topic")
    p.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    p.add_argument("--topic", default="events")
    p.add_argument("--count", type=int, default=1000, help="number of events")
    p.add_argument("--start-time", default=None, help="event time of the first event: epoch ms or ISO-8601 (now)")
    p.add_argument("--step-ms", type=int, default=100, help="event-time distance between events")
    p.add_argument("--first-index", type=int, default=0, help="continue a previous run (ids/times) from here")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help="comma-separated event kinds")
    p.add_argument("--users", type=int, default=50, help="number of distinct users")
    p.add_argument("--rate", type=float, default=0.0, help="events per second (0 = as fast as possible)")
    p.add_argument("--partitions", type=int, default=0, help="create the topic with N partitions if missing")
    p.add_argument("--malformed-every", type=int, default=0, help="add a non-JSON record every N events")
    p.add_argument("--summary", action="store_true", help="print the expected per-window totals as JSON lines")
    p.add_argument("--window-ms", type=int, default=60_000, help="window length used by --summary")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: generate, send, optionally print the expected aggregates."""
    args = build_parser().parse_args(argv)
    start = parse_time_ms(args.start_time)
    events = list(
        make_events(
            args.count,
            start,
            args.step_ms,
            args.seed,
            [k for k in args.kinds.split(",") if k],
            args.users,
            first_index=args.first_index,
        )
    )
    if args.partitions > 0:
        ensure_topic(args.bootstrap_servers, args.topic, args.partitions)
    sent = produce(args.bootstrap_servers, args.topic, events, args.rate, args.malformed_every)
    print(json.dumps({"sent": sent, "events": len(events), "first_ts": start, "topic": args.topic}), file=sys.stderr)
    if args.summary:
        for (window_start, kind), totals in sorted(summarize(events, args.window_ms).items()):
            print(json.dumps({"window_start_ms": window_start, "kind": kind, **totals}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
