"""What every admin subcommand shares: the connection, one-line errors, tables and ``--json``.

The admin CLI is a Kafka *client* (kafka-python's KafkaAdminClient): it is the one corner of
``broker/`` that imports ``kafka.*``, and the broker server never imports it.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_TIMEOUT_S = 15.0


class CliError(Exception):
    """A failure to report as one line ``Error: <message>`` and exit code 1."""


@dataclass
class Result:
    """What a command produced: ``data`` for ``--json``, ``lines`` for people.

    ``notes`` go to stderr in table mode (hints such as "dry run"), never into the JSON.
    """
    data: Any
    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def common_options() -> argparse.ArgumentParser:
    """Options accepted after any family or command word (defaults filled in by ``option``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--bootstrap-server", "-b", default=argparse.SUPPRESS, metavar="HOST:PORT",
                   help=f"broker to contact, comma-separated for several "
                        f"(default $S3KAFKA_BOOTSTRAP_SERVER or {DEFAULT_BOOTSTRAP})")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                   help="print one JSON document instead of tables")
    p.add_argument("--timeout", type=float, default=argparse.SUPPRESS, metavar="SECONDS",
                   help=f"give up on an unreachable or silent broker after this "
                        f"(default {DEFAULT_TIMEOUT_S:g})")
    return p


class Family:
    """One command family (``s3kafka topics ...``): every action accepts the common options
    (before or after its words) and names the function that runs it (``args.func``)."""

    def __init__(self, families: Any, common: argparse.ArgumentParser, name: str, help: str,
                 description: str) -> None:
        fam = families.add_parser(name, parents=[common], help=help, description=description)
        self._actions = fam.add_subparsers(dest="action", required=True, metavar="ACTION")
        self._common = common

    def action(self, name: str, func: Any, help: str, description: str | None = None
               ) -> argparse.ArgumentParser:
        """Add ``ACTION`` run by ``func(args, admin) -> Result``; its parser, for its arguments."""
        p = self._actions.add_parser(name, parents=[self._common], help=help,
                                     description=description)
        p.set_defaults(func=func)
        return p


def option(args: argparse.Namespace, name: str) -> Any:
    """The value of a common option wherever it was given, or its default."""
    if hasattr(args, name):
        return getattr(args, name)
    if name == "bootstrap_server":
        return os.environ.get("S3KAFKA_BOOTSTRAP_SERVER") or DEFAULT_BOOTSTRAP
    return {"json": False, "timeout": DEFAULT_TIMEOUT_S}[name]


def connect(args: argparse.Namespace) -> Any:
    """A KafkaAdminClient on --bootstrap-server that gives up after --timeout."""
    from kafka import KafkaAdminClient  # noqa: PLC0415 - keep `s3kafka --help` fast
    from kafka.errors import KafkaError  # noqa: PLC0415

    bootstrap = option(args, "bootstrap_server")
    servers = [b.strip() for b in bootstrap.split(",") if b.strip()]
    if not servers:
        raise CliError("--bootstrap-server is empty; give HOST:PORT")
    for server in servers:
        port = server.rpartition(":")[2] if ":" in server else "9092"
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise CliError(f"bad --bootstrap-server {server!r}: the port must be a number "
                           "from 1 to 65535")
    timeout_ms = int(option(args, "timeout") * 1000)
    try:
        return KafkaAdminClient(
            bootstrap_servers=servers, client_id="s3kafka-admin",
            request_timeout_ms=timeout_ms, bootstrap_timeout_ms=timeout_ms,
            reconnect_backoff_max_ms=1000)
    except KafkaError as exc:
        raise CliError(f"cannot reach a broker at {bootstrap} within "
                       f"{option(args, 'timeout'):g} s ({type(exc).__name__})") from None
    except ValueError as exc:  # a malformed host:port
        raise CliError(f"bad --bootstrap-server {bootstrap!r}: {exc}") from None


def start_watchdog(seconds: float) -> None:
    """Last resort against a hang: the process exits with a one-line error after ``seconds``."""
    def expire() -> None:
        sys.stderr.write(f"Error: no answer within {seconds:g} s; giving up\n")
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def quiet_client_logs() -> None:
    """kafka-python logs connection retries as warnings; the CLI reports failures itself."""
    logging.getLogger("kafka").setLevel(logging.CRITICAL)


def kafka_error(code: int, message: str | None = None) -> str:
    """``unknown topic 't' (UNKNOWN_TOPIC_OR_PARTITION)`` from a protocol error code."""
    import kafka.errors as Errors  # noqa: PLC0415

    err = Errors.for_code(code)
    name = getattr(err, "message", err.__name__)
    return f"{message or err.description} ({name})"


def exception_line(exc: Exception) -> str:
    """One line for a kafka-python exception (its str() may embed whole requests)."""
    err = type(exc)
    name = getattr(err, "message", None) or err.__name__
    desc = getattr(err, "description", "") or ""
    if not desc:
        desc = str(exc).splitlines()[0] if str(exc) else name
    return f"{desc} ({name})"


def list_offsets(admin: Any, tps: Sequence[Any], spec: Any) -> dict[Any, int]:
    """{TopicPartition: offset} by ListOffsets (spec: an OffsetSpec or a timestamp in ms).

    kafka-python fails the whole call on one partition's error; then each topic is asked on its
    own and a topic that still fails (e.g. an internal topic a broker does not serve) is left out.
    """
    from kafka.errors import KafkaError  # noqa: PLC0415

    if not tps:
        return {}
    try:
        got = admin.list_partition_offsets({tp: spec for tp in tps})
    except KafkaError:
        got = {}
        for topic in sorted({tp.topic for tp in tps}):
            try:
                got.update(admin.list_partition_offsets(
                    {tp: spec for tp in tps if tp.topic == topic}))
            except KafkaError:
                continue
    return {tp: o.offset for tp, o in got.items()}


def parse_kv(items: Iterable[str] | None, what: str) -> dict[str, str]:
    """``["a=1,b=2", "c=3"]`` -> ``{"a": "1", "b": "2", "c": "3"}`` (kafka-configs syntax)."""
    out: dict[str, str] = {}
    for item in items or []:
        for part in item.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise CliError(f"{what} {part!r} is not NAME=VALUE")
            out[key.strip()] = value.strip()
    return out


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """Left-aligned columns separated by two spaces, like the Kafka tools print."""
    cells = [[str(h) for h in headers]] + [["-" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def emit(result: Result, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.data, indent=2, sort_keys=False))
        return
    for line in result.lines:
        print(line)
    for note in result.notes:
        print(note, file=sys.stderr)
