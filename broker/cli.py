"""``s3kafka`` command line: ``s3kafka serve [flags]`` (``python -m broker serve`` is the same);
``s3kafka topics|groups|cluster ...`` is the admin CLI (broker/admincli/)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Sequence

from . import thread_names
from .config import BrokerConfig, broker_fields, build_config, engine_defaults, engine_fields

_HELP = {
    "listen": "HOST:PORT to accept Kafka clients on (default 127.0.0.1:9092)",
    "advertised_listener": "HOST:PORT clients are told to connect to (default: --listen)",
    "listeners": "named listeners NAME://HOST:PORT,... (Kafka's listeners; replaces --listen), "
                 "e.g. INTERNAL://0.0.0.0:9092,EXTERNAL://0.0.0.0:19092",
    "advertised_listeners": "what each named listener is called by clients, e.g. "
                            "INTERNAL://broker1:9092,EXTERNAL://localhost:19092 (default: "
                            "its bind address); clients get the addresses of the listener "
                            "they connected to",
    "data_dir": "directory for the WAL file, objects and metadata (default ./data)",
    "wal": "WAL file or raw block device (default <data-dir>/wal)",
    "object_store": "file://DIR, s3://bucket/prefix?endpoint_url=..., mem:// "
                    "(default file://<data-dir>/objects)",
    "metadata": "metadata database URL (default sqlite:///<data-dir>/meta.db)",
    "node_id": "this broker's node id (default 0; unique in a cluster)",
    "rack": "broker.rack: this broker's rack, reported to clients (default none)",
    "storage": "engine (durable, default) or memory (tests only; nothing survives a restart)",
    "auto_create_topics": "auto.create.topics.enable: create unknown topics on Metadata/Produce "
                          "(default true)",
    "default_partitions": "num.partitions for auto-created topics and CreateTopics with -1 "
                          "(default 1)",
    "delete_topic_enable": "delete.topic.enable (default true)",
    "max_request_bytes": "largest request frame accepted; larger ones close the connection "
                         "(default 100MiB)",
    "max_inflight_requests": "requests in flight per connection before reading pauses "
                             "(default 256)",
    "max_inflight_bytes": "bytes of large (>= 64 KiB) request frames in flight per connection "
                          "before reading pauses (default 32MiB)",
    "frame_pretouch": "fault in the memory of the LogCache's produce frames (--log-cache-bytes) "
                      "right after start-up, on a background thread, instead of while the "
                      "first GiB is produced (waiting while catch-up reads run at 64 MiB/s "
                      "or more); the broker's resident memory is then the "
                      "LogCache's size from the start (default true)",
    "shutdown_timeout_s": "seconds SIGTERM waits for in-flight requests (default 30)",
    "retention_check_interval_ms": "log.retention.check.interval.ms (default 300000)",
    "topic_defaults": "broker-wide topic config defaults, NAME=VALUE[,NAME=VALUE...] "
                      "(repeatable), e.g. retention.ms=3600000",
    "producer_id_expiration_ms": "producer.id.expiration.ms: idle idempotent producers are "
                                 "forgotten after this (default 86400000)",
    "log_cleaner_enable": "log.cleaner.enable: compact topics with cleanup.policy=compact "
                          "(default true)",
    "log_cleaner_backoff_ms": "log.cleaner.backoff.ms: pause between log cleaner rounds "
                              "(default 15000)",
    "log_cleaner_dedupe_buffer_size": "log.cleaner.dedupe.buffer.size: bytes of the key -> "
                                      "offset map of one cleaning pass (default 128MiB)",
    "log_cleaner_io_max_bytes_per_second": "log.cleaner.io.max.bytes.per.second: cleaner read "
                                           "rate cap, 0 = none (default 32MiB)",
    "transaction_max_timeout_ms": "transaction.max.timeout.ms: larger transaction.timeout.ms "
                                  "values get INVALID_TRANSACTION_TIMEOUT (default 900000)",
    "transaction_version": "the finalized transaction.version feature advertised in "
                           "ApiVersions: 2 = KIP-890 part 2 (Kafka 4.x clients bump the "
                           "producer epoch on every transaction), 1 = Kafka 3.x's protocol "
                           "(default 2)",
    "group_min_session_timeout_ms": "group.min.session.timeout.ms (default 6000)",
    "group_max_session_timeout_ms": "group.max.session.timeout.ms (default 1800000)",
    "group_initial_rebalance_delay_ms": "group.initial.rebalance.delay.ms (default 3000, as "
                                        "Kafka: members joining together share a generation)",
    "offset_metadata_max_bytes": "offset.metadata.max.bytes (default 4096)",
    "log_level": "DEBUG, INFO, WARNING, ERROR (default INFO)",
    "log_format": "text (key=value) or json (default text)",
    "metrics_listen": "HOST:PORT serving Prometheus /metrics, or off (default "
                      "127.0.0.1:9644; if that default is taken the broker warns and runs "
                      "without metrics, an explicit address that is taken is an error)",
    "cluster_lease_ms": "how long a broker's cluster lease lasts without renewal; a broker "
                        "silent this long plus the margin is fenced and its WAL taken over "
                        "(default 6000)",
    "cluster_takeover_margin_ms": "wait this long after a lease lapsed before fencing the "
                                  "broker (default 1000)",
    "allow_degraded_start": "start even when the object store check fails (uploads wait and "
                            "retry; a warning every minute until it works). Default: exit "
                            "with the error, unless the WAL holds data (a restart)",
}
_ENGINE_HELP = {
    "wal_format": "erase and format a --wal file or device that holds data which is not an "
                  "s3kafka WAL (default false: refuse it; blank space is formatted anyway)",
}


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage mistake in one line (no usage block) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


ADMIN_COMMANDS = {"topics": "admin: list, describe, create, delete, alter topics",
                  "groups": "admin: list, describe, reset offsets of, delete consumer groups",
                  "cluster": "admin: describe the cluster"}


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=INFO logger=broker.server msg`` lines; messages are key=value already."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = (f"ts={ts}.{int(record.msecs):03d}Z level={record.levelname} "
                f"logger={record.name} {record.getMessage()}")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        obj = {"ts": record.created, "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _bool_flag(kind: object) -> dict[str, str]:
    """A boolean option alone means true (``--wal-format``); ``--wal-format false`` works too."""
    return {"nargs": "?", "const": "true"} if kind is bool else {}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="s3kafka", description="Kafka-compatible broker on "
                                   "object storage behind a Delta WAL")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the broker",
                           description="Run one broker. Every option can also be set with the "
                           "environment variable S3KAFKA_<NAME> (e.g. S3KAFKA_LISTEN) or in a "
                           "--config file (TOML or key=value); flag > env > file > default.")
    serve.add_argument("--config", default=None, help="TOML or key=value properties file")
    for name, kind in broker_fields().items():
        if name == "topic_defaults":
            serve.add_argument(_flag(name), "--topic-default", dest=name, action="append",
                               default=None, metavar="NAME=VALUE", help=_HELP[name])
            continue
        serve.add_argument(_flag(name), dest=name, default=None, **_bool_flag(kind),
                           metavar=getattr(kind, "__name__", "VALUE").upper(),
                           help=_HELP.get(name, ""))
    eng = serve.add_argument_group("storage engine knobs (docs/storage.md)")
    defaults = engine_defaults()
    for name, kind in engine_fields().items():
        eng.add_argument(_flag(name), dest=name, default=None, **_bool_flag(kind),
                         metavar=getattr(kind, "__name__", "VALUE").upper(),
                         help=_ENGINE_HELP.get(name, f"default {defaults.get(name)!r}"))
    for name, text in ADMIN_COMMANDS.items():  # listed for --help; main() hands them over
        sub.add_parser(name, help=text, add_help=False)
    return parser


def parse_config(argv: Sequence[str] | None = None, env: dict[str, str] | None = None
                 ) -> BrokerConfig:
    """argv (without the program name, starting with ``serve``) -> BrokerConfig."""
    args = build_parser().parse_args(argv)
    flags = vars(args)
    if flags.get("topic_defaults"):
        merged: list[str] = []
        for item in flags["topic_defaults"]:
            merged.extend(item.split(","))
        flags["topic_defaults"] = merged
    return build_config(flags, env)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``s3kafka`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ADMIN_COMMANDS:
        from .admincli import main as admin_main  # noqa: PLC0415 - keep serve's start lean

        return admin_main(args)
    try:
        cfg = parse_config(argv)
    except (ValueError, OSError) as exc:
        print(f"s3kafka: configuration error: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level, cfg.log_format)
    # before any thread starts: top -H, ps -L and perf then show each pool's threads by name
    thread_names.install()
    from .startup_checks import StartupError, prepare  # noqa: PLC0415

    t0 = time.monotonic()
    try:
        startup = prepare(cfg)
    except StartupError as exc:      # one line in the configured log format
        logging.getLogger("broker.startup").error("cannot start: %s", exc)
        return 1
    checks_s = time.monotonic() - t0
    from .server import run  # noqa: PLC0415 - keep --help fast

    # the first line of a start that passed its checks (a refused start prints only its
    # error); its timestamp minus the checks' duration tells how long the interpreter's
    # start-up and imports took (seconds on a loaded machine)
    logging.getLogger("broker.startup").info("startup checks passed duration_s=%.3f",
                                             checks_s)

    code = 1
    try:
        code = run(cfg, startup)
        return code
    finally:
        # a start that failed after the checks (exit 1 from run) removes the empty WAL file,
        # lock file and directories it created; a broker that ran keeps them
        startup.release(undo=code != 0 and not getattr(startup, "started", False))


if __name__ == "__main__":
    sys.exit(main())
