"""The admin half of the ``s3kafka`` command: ``topics``, ``groups`` and ``cluster``.

It speaks the Kafka protocol through kafka-python's KafkaAdminClient, so it manages s3kafka and
Apache Kafka alike. One module per command family; ``main`` parses, connects, runs one command
and prints a table (default) or JSON (``--json``). Failures are one line on stderr and exit 1;
usage mistakes exit 2 (argparse).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from . import cluster, groups, topics
from .common import CliError, common_options, connect, emit, exception_line, option, \
    quiet_client_logs, start_watchdog

FAMILIES = ("topics", "groups", "cluster")


def build_parser() -> argparse.ArgumentParser:
    common = common_options()
    parser = argparse.ArgumentParser(prog="s3kafka", parents=[common],
                                     description="Administer any Kafka-protocol cluster.")
    families = parser.add_subparsers(dest="family", required=True, metavar="COMMAND")
    topics.register(families, common)
    groups.register(families, common)
    cluster.register(families, common)
    return parser


def main(argv: Sequence[str]) -> int:
    """``argv`` starts with the family word (``topics``, ``groups`` or ``cluster``)."""
    args = build_parser().parse_args(list(argv))
    quiet_client_logs()
    timeout = option(args, "timeout")
    if timeout <= 0:
        print("Error: --timeout must be positive", file=sys.stderr)
        return 2
    # every request is bounded by --timeout; this only catches a hang nothing else bounds
    start_watchdog(3 * timeout + 5)
    from kafka.errors import KafkaError  # noqa: PLC0415

    admin = None
    try:
        admin = connect(args)
        result = args.func(args, admin)
    except CliError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    except KafkaError as exc:
        print(f"Error: {exception_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a client surprise is still one line, not a trace
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"Error: {type(exc).__name__}: {first}".rstrip(": "), file=sys.stderr)
        return 1
    finally:
        if admin is not None:
            try:
                admin.close()
            except Exception:  # noqa: BLE001 - closing must not mask the command's outcome
                pass
    try:
        emit(result, option(args, "json"))
        sys.stdout.flush()
    except BrokenPipeError:  # `s3kafka topics list | head -1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
