"""Requests whose handler failed still get an answer, as in Kafka.

Kafka answers a request whose handling threw with the request's own error response
(``AbstractRequest.getErrorResponse``: the request's topics, partitions, groups, ... each with
the error code) and keeps the connection open; only an exception it cannot map becomes
UNKNOWN_SERVER_ERROR. Closing the connection instead makes every client reconnect and
re-send, and hides what happened.

Two kinds of failure:

- the metadata store is unreachable (PostgreSQL cut, black-holed or restarting): a
  *retriable* error the client knows to wait out - COORDINATOR_NOT_AVAILABLE for the group and
  transaction APIs (the client looks the coordinator up again and retries, as with Kafka's
  group coordinator when its log is unavailable), REQUEST_TIMED_OUT for the APIs Kafka
  forwards to its controller (what a broker answers when the controller cannot be reached);
  logged as one episode (storage/sqldb.py: a WARNING when it starts, an INFO when the store
  answers again), never once per request;
- anything else is a bug: UNKNOWN_SERVER_ERROR, logged at ERROR with its traceback.

``error_response`` builds the answer from the response schema, mirroring the request
(kafka-python's schema objects), so it covers every API without a hand-written builder each.
"""
from __future__ import annotations

import logging
import sqlite3
import sys
from typing import Any

from protocol import ErrorCode as E, response_class
from storage import sqldb

log = logging.getLogger(__name__)

# group coordinator and transaction coordinator APIs: the client rediscovers the coordinator
_COORDINATOR_APIS = frozenset({8, 9, 10, 11, 12, 13, 14, 15, 16, 42, 47,   # groups
                               22, 24, 25, 26, 28, 65, 66})                # transactions
# what Kafka forwards to its controller (its answer when the controller cannot be reached)
_CONTROLLER_APIS = frozenset({19, 20, 21, 33, 37, 43, 44, 45, 46})
INIT_PRODUCER_ID = 22

# request array -> response array, where the names differ (tried after the same name)
_SOURCES: dict[str, tuple[str, ...]] = {
    "responses": ("topic_data", "topics", "topic_names", "resources"),
    "partition_responses": ("partition_data",),
    "partitions": ("partition_data", "partition_indexes"),
    "results": ("resources", "topics", "groups_names"),
    "coordinators": ("coordinator_keys",),
    "results_by_transaction": ("transactions",),
    "topic_results": ("topics",),
    "results_by_partition": ("partitions",),
    "results_by_topic_v3_and_below": ("v3_and_below_topics",),
    "replica_election_results": ("topic_partitions",),
    "partition_result": ("partitions",),
    "transaction_states": ("transactional_ids",),
}
# fields that say *which* item an answer is about: copied from the request item
_IDENTITY = frozenset({"name", "topic", "topic_name", "topic_id", "index", "partition_index",
                       "partition_id", "group_id", "member_id", "group_instance_id",
                       "transactional_id", "resource_type", "resource_name", "key"})
_RENAMED = {"partition_index": ("partition", "index"), "topic": ("name",),
            "name": ("topic",)}


def is_store_outage(exc: BaseException) -> bool:
    """The metadata database could not be reached (or its connection broke): retriable."""
    psycopg = sys.modules.get("psycopg")    # only loaded when PostgreSQL is configured
    pg_errors = (psycopg.OperationalError, psycopg.InterfaceError) if psycopg else ()
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 5:
        if isinstance(e, sqldb.MetadataUnreachable):
            return True
        # OperationalError: connection trouble, but also serialization failures and
        # deadlocks that outlasted the retries, a cancelled statement - all worth a retry
        if pg_errors and isinstance(e, pg_errors):
            return True
        if isinstance(e, sqlite3.OperationalError) and any(
                w in str(e) for w in ("locked", "busy", "disk I/O")):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


def outage_code(api_key: int, request: Any = None) -> int:
    """The retriable error Kafka answers for ``api_key`` while its metadata is unavailable."""
    if api_key == INIT_PRODUCER_ID and not getattr(request, "transactional_id", None):
        return E.COORDINATOR_LOAD_IN_PROGRESS   # idempotent producer: retried in place
    if api_key in _COORDINATOR_APIS:
        return E.COORDINATOR_NOT_AVAILABLE
    if api_key == 3 or api_key == 75:            # Metadata, DescribeTopicPartitions
        return E.LEADER_NOT_AVAILABLE
    return E.REQUEST_TIMED_OUT                   # controller APIs and the rest


def note(exc: BaseException, what: str) -> bool:
    """Log a failure the caller answers itself: an outage joins the store's episode (DEBUG
    here), anything else is logged at ERROR with its traceback. True for an outage."""
    if is_store_outage(exc):
        sqldb.note_unreachable(f"{what}: {_one_line(exc)}")
        return True
    log.error("%s failed: %r", what, exc, exc_info=exc)
    return False


def log_failure(logger: logging.Logger, exc: BaseException, msg: str, *args: Any) -> None:
    """``logger.exception(msg, *args)`` for a bug; for a metadata outage the store's episode
    (one WARNING per outage) and a DEBUG line: the operation is retried once it is back."""
    if is_store_outage(exc):
        sqldb.note_unreachable(_one_line(exc))
        logger.debug(msg + ": %s", *args, _one_line(exc))
    else:
        logger.error(msg, *args, exc_info=exc)


def failure_answer(ctx: Any, request: Any, exc: BaseException) -> Any | None:
    """The answer to a request whose handler raised ``exc`` (None: no error field in its
    schema, the connection is closed as before)."""
    h = ctx.header
    if h.api_key == 0 and getattr(request, "acks", -1) == 0:
        # acks=0 expects no answer: Kafka closes the connection to tell the producer (the
        # server logs it: "handler failed ... closing connection")
        return None
    outage = is_store_outage(exc)
    if outage:
        code = outage_code(h.api_key, request)
        sqldb.note_unreachable(f"api={h.api_key}: {_one_line(exc)}")
        message = "metadata store unavailable; retry"
    else:
        code = E.UNKNOWN_SERVER_ERROR
        message = "unexpected server error"
    try:
        answer = error_response(h.api_key, h.api_version, request, code, message)
    except Exception as build_exc:  # noqa: BLE001 - a schema gap: close as before
        log.error("no error answer for api=%d version=%d: %r", h.api_key, h.api_version,
                  build_exc)
        answer = None
    if answer is None:
        return None
    peer = getattr(getattr(ctx, "conn", None), "peer", "?")
    if outage:
        log.debug("api=%d peer=%s answered %s: %s", h.api_key, peer, E(code).name, exc)
    else:
        log.error("handler failed api=%d version=%d peer=%s; answered UNKNOWN_SERVER_ERROR",
                  h.api_key, h.api_version, peer, exc_info=exc)
    return answer


def error_response(api_key: int, version: int, request: Any, code: int,
                   message: str | None = None) -> Any | None:
    """The response of ``api_key``/``version`` answering ``request`` with ``code`` everywhere an
    error code fits: top level, and per item for the items the request named (topics,
    partitions, groups, resources ...). None when the schema has no error code at all."""
    cls = response_class(api_key)
    # OffsetFetch v2+ answers a failed group with its error alone (no partitions), as Kafka
    flat = api_key == 9 and version >= 2
    kwargs, has_error = _mirror(cls._struct.fields, version, request, int(code), message, flat)
    if not has_error:
        return None
    return cls(version=version, **kwargs)


def _mirror(fields: dict[str, Any], version: int, src: Any, code: int,
            message: str | None, flat: bool = False) -> tuple[dict[str, Any], bool]:
    """Keyword arguments of one response struct answering request item ``src``; ``flat``:
    a struct with an error code of its own lists no sub-items."""
    kwargs: dict[str, Any] = {}
    has_error = False
    own_error = flat and any(n == "error_code" and f.for_version_q(version)
                             for n, f in fields.items())
    for name, f in fields.items():
        if not f.for_version_q(version):
            continue
        if own_error and f.is_struct_array():
            kwargs[name] = []
        elif name.endswith("error_code"):
            kwargs[name] = code
            has_error = True
        elif name == "error_message":
            kwargs[name] = message
        elif name == "throttle_time_ms":
            kwargs[name] = 0
        elif name == "committed_offset":
            kwargs[name] = -1          # OffsetFetch v0-1: no offset (Kafka's INVALID_OFFSET)
        elif f.is_struct_array():
            items = []
            for item in _source_items(src, name):
                if isinstance(item, (str, int)) and not isinstance(item, bool):
                    sub = _scalar_item(f.fields, version, item)
                    sub_kw, sub_err = _mirror(f.fields, version, None, code, message, flat)
                    sub_kw.update(sub)
                else:
                    sub_kw, sub_err = _mirror(f.fields, version, item, code, message, flat)
                has_error = has_error or sub_err
                items.append(f.data_class(**sub_kw))
            if not items:   # still tell whether the items would carry an error code
                has_error = has_error or _mirror(f.fields, version, None, code, message)[1]
            kwargs[name] = items
        elif name in _IDENTITY and src is not None:
            for src_name in (name, *_RENAMED.get(name, ())):
                value = getattr(src, src_name, None)
                if value is not None and not isinstance(value, (list, tuple)):
                    kwargs[name] = value
                    break
    return kwargs, has_error


def _source_items(src: Any, name: str) -> list[Any]:
    if src is None:
        return []
    for src_name in (name, *_SOURCES.get(name, ())):
        value = getattr(src, src_name, None)
        if isinstance(value, (list, tuple)) and value:
            return list(value)
    return []


def _scalar_item(fields: dict[str, Any], version: int, item: str | int) -> dict[str, Any]:
    """A request item that is a bare name or index: the first field of that type names it."""
    want = ("string",) if isinstance(item, str) else ("int32", "int64", "int16")
    for name, f in fields.items():
        if f.for_version_q(version) and not f.is_array() and not f.is_struct() \
                and getattr(f, "type_str", None) in want and not name.endswith("error_code"):
            return {name: item}
    return {}


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__
