"""Time and size retention: advances each partition's log start offset in the background.

Kafka deletes whole segments; here the unit is a log-index chunk (~1 MiB of whole produce
payloads), trimmed through ``Stream.trim`` so storage can drop the data. ``delete`` (and
``compact,delete``) apply retention.ms / retention.bytes; ``compact`` (and ``compact,delete``)
are compacted by the log cleaner (broker/compaction.py), started and stopped with this task.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Iterable

from .compaction import LogCleaner
from .partition import Partition
from .periodic import Periodic

log = logging.getLogger(__name__)

DEFAULT_RETENTION_MS = 7 * 24 * 3600 * 1000
DEFAULT_CHECK_INTERVAL_S = 300.0  # Kafka's log.retention.check.interval.ms
DEFAULT_PRODUCER_ID_EXPIRATION_MS = 86_400_000  # Kafka's producer.id.expiration.ms


def _int(configs: dict[str, str], name: str, default: int) -> int:
    try:
        return int(configs.get(name, default))
    except (TypeError, ValueError):
        return default


def retention_offset(partition: Partition, now_ms: int) -> int | None:
    """The log start offset retention wants for ``partition`` now (None: nothing to delete)."""
    configs = partition.configs
    policy = str(configs.get("cleanup.policy", "delete"))
    if "delete" not in policy.replace(" ", "").split(","):
        return None
    retention_ms = _int(configs, "retention.ms", DEFAULT_RETENTION_MS)
    retention_bytes = _int(configs, "retention.bytes", -1)
    cutoff = now_ms - retention_ms if retention_ms >= 0 else None
    max_bytes = retention_bytes if retention_bytes >= 0 else None
    if cutoff is None and max_bytes is None:
        return None
    point = partition.log_index.retention_point(cutoff, max_bytes)
    if point is None or point <= partition.log_start_offset:
        return None
    return min(point, partition.high_watermark)


async def apply_retention(partitions: Iterable[Partition], now_ms: int | None = None) -> int:
    """One retention pass; returns how many partitions were trimmed."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    trimmed = 0
    for p in list(partitions):
        try:
            target = retention_offset(p, now)
            if target is None:
                continue
            before = p.log_start_offset
            after = await p.trim_to(target)
            if after > before:
                trimmed += 1
                log.info("retention topic=%s partition=%d log_start_offset=%d->%d",
                         p.topic, p.index, before, after)
        except Exception:  # noqa: BLE001 - one bad partition must not stop retention
            log.exception("retention failed topic=%s partition=%d", p.topic, p.index)
    return trimmed


def broker_partitions(broker: Any) -> list[Partition]:
    """Every open partition of the broker (``broker.topics: dict[str, Topic]``)."""
    out: list[Partition] = []
    for topic in list(getattr(broker, "topics", {}).values()):
        out.extend(p for p in getattr(topic, "partitions", []) if isinstance(p, Partition))
    return out


class RetentionTask:
    """Background retention loop plus periodic producer-state snapshots."""

    def __init__(self, broker: Any, interval_s: float | None = None) -> None:
        self.broker = broker
        cfg = getattr(broker, "config", None)
        ms = getattr(cfg, "retention_check_interval_ms", None)
        self.interval_s = interval_s if interval_s is not None else (
            float(ms) / 1000 if ms else DEFAULT_CHECK_INTERVAL_S)
        exp = getattr(cfg, "producer_id_expiration_ms", None)
        self.producer_id_expiration_ms = int(exp) if exp else DEFAULT_PRODUCER_ID_EXPIRATION_MS
        self._periodic = Periodic("s3kafka-retention", self.interval_s, self._pass, log)
        self.cleaner = LogCleaner(broker)
        setattr(broker, "_log_cleaner", self.cleaner)

    def start(self) -> None:
        self.cleaner.start()
        self._periodic.start()

    async def _pass(self) -> None:
        parts = broker_partitions(self.broker)
        await apply_retention(parts)
        now = int(time.time() * 1000)
        for p in parts:
            if p.producers.expire_idle(now, self.producer_id_expiration_ms):
                p.mark_changed()
            p.snapshot()

    async def stop(self) -> None:
        await self.cleaner.stop()
        await self._periodic.stop()


def ensure_retention(broker: Any) -> None:
    """Start the broker's retention task once (called when the first partition opens)."""
    if broker is None or getattr(broker, "_datapath_retention", None) is not None:
        return
    task = RetentionTask(broker)
    setattr(broker, "_datapath_retention", task)
    task.start()
