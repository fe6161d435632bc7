"""The topic -> partition walk of the APIs that address partitions by topic name and index.

DeleteRecords, OffsetForLeaderEpoch, DescribeProducers and ListOffsets all answer one entry per
requested partition, grouped by topic in request order, and all answer a partition the broker
does not have with UNKNOWN_TOPIC_OR_PARTITION; only the per-partition answer differs.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from ..partition import Partition, find_topic, get_partition

# answer(topic name, request entry, partition or None when the broker has no such partition)
PartitionAnswer = Callable[[str, Any, Partition | None], Awaitable[Any]]


async def answer_partitions(broker: Any, topics: Iterable[Any] | None, answer: PartitionAnswer,
                            topic_response: Callable[[str, list[Any]], Any], *,
                            name_field: str = "name", partitions_field: str = "partitions",
                            index_field: str | None = "partition_index") -> list[Any]:
    """One ``topic_response(name, partition answers)`` per requested topic.

    Field names differ between the APIs' schemas (``name``/``topic``, ``partition_index``/
    ``partition``); ``index_field=None`` means the partition entries are bare indexes.
    """
    out = []
    for t in topics or []:
        name = getattr(t, name_field)
        topic = find_topic(broker, name)
        parts = []
        for entry in getattr(t, partitions_field) or []:
            index = entry if index_field is None else getattr(entry, index_field)
            parts.append(await answer(name, entry, get_partition(topic, index)))
        out.append(topic_response(name, parts))
    return out
