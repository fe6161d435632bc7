"""Broker configuration: one dataclass, filled from flags > environment > config file > defaults.

Every engine knob (``storage.engine.EngineConfig``) is exposed automatically as ``--<name>``
(underscores become dashes), so a knob the engine adds needs no change here.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

ENV_PREFIX = "S3KAFKA_"

# Broker fields whose names differ from the engine's (flag name -> engine field).
_ENGINE_RENAMES = {"wal": "wal_path", "metadata": "metadata_url"}
_ENGINE_OWN = {"data_dir", "wal_path", "object_store", "metadata_url", "node_id"}


@dataclass
class BrokerConfig:
    """Everything ``s3kafka serve`` can be told; each field has a working default."""

    listen: str = "127.0.0.1:9092"
    advertised_listener: str = ""            # "" = the listen address (hostname if 0.0.0.0)
    listeners: str = ""                      # NAME://HOST:PORT,... (replaces listen; broker/listeners.py)
    advertised_listeners: str = ""           # NAME://HOST:PORT,... what each listener is called
    data_dir: str = "./data"
    wal: str = ""                            # "" = <data_dir>/wal
    object_store: str = ""                   # "" = file://<data_dir>/objects
    metadata: str = ""                       # "" = sqlite:///<data_dir>/meta.db
    node_id: int = 0
    rack: str = ""                           # Kafka's broker.rack (reported in Metadata)
    storage: str = "engine"                  # engine | memory (memory: nothing survives a restart)
    auto_create_topics: bool = True          # Kafka's auto.create.topics.enable
    default_partitions: int = 1              # Kafka's num.partitions
    delete_topic_enable: bool = True         # Kafka's delete.topic.enable
    max_request_bytes: int = 100 << 20       # larger frames close the connection
    max_inflight_requests: int = 256         # per connection; reading pauses above it
    # per connection: bytes of large (>= 64 KiB) request frames not answered yet; reading
    # pauses above it (256 requests of 1 MiB held a quarter GiB per producer)
    max_inflight_bytes: int = 32 << 20
    # fault in the LogCache's frame memory at start-up, in the background (broker/frames.py)
    frame_pretouch: bool = True
    shutdown_timeout_s: float = 30.0         # how long SIGTERM waits for in-flight requests
    retention_check_interval_ms: int = 300_000   # Kafka's log.retention.check.interval.ms
    producer_id_expiration_ms: int = 86_400_000  # Kafka's producer.id.expiration.ms
    log_cleaner_enable: bool = True              # Kafka's log.cleaner.enable
    log_cleaner_backoff_ms: int = 15_000         # Kafka's log.cleaner.backoff.ms
    log_cleaner_dedupe_buffer_size: int = 128 << 20   # log.cleaner.dedupe.buffer.size
    log_cleaner_io_max_bytes_per_second: float = 32 << 20  # log.cleaner.io.max.bytes.per.second
    transaction_max_timeout_ms: int = 900_000    # Kafka's transaction.max.timeout.ms
    transaction_version: int = 2                 # finalized transaction.version (1 or 2)
    group_min_session_timeout_ms: int = 6000
    group_max_session_timeout_ms: int = 1_800_000
    group_initial_rebalance_delay_ms: int = 3000
    offset_metadata_max_bytes: int = 4096
    topic_defaults: dict[str, str] = field(default_factory=dict)  # broker-wide topic config defaults
    log_level: str = "INFO"
    log_format: str = "text"                 # text (key=value) | json
    metrics_listen: str = "127.0.0.1:9644"   # Prometheus /metrics; "" or "off" = not served
    cluster_lease_ms: int = 6000             # broker lease in the cluster room (renewed 1/s)
    cluster_takeover_margin_ms: int = 1000   # after the lease lapsed, wait this long to fence
    allow_degraded_start: bool = False       # start even when the object store check fails
    config: str = ""                         # the config file these values were read from
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig overrides (field -> value)

    # ---- derived -------------------------------------------------------------------------
    def listener_list(self) -> list[Any]:
        """Every named listener (broker/listeners.py); one PLAINTEXT from --listen without
        --listeners."""
        from .listeners import of_config  # noqa: PLC0415

        return of_config(self)

    @property
    def listen_host(self) -> str:
        if self.listeners:
            return self.listener_list()[0].host
        return split_host_port(self.listen)[0]

    @property
    def listen_port(self) -> int:
        if self.listeners:
            return self.listener_list()[0].port
        return split_host_port(self.listen)[1]

    @property
    def advertised_host(self) -> str:
        if self.listeners:
            return self.listener_list()[0].adv_host
        if self.advertised_listener:
            return split_host_port(self.advertised_listener)[0]
        host = self.listen_host
        if host in ("", "0.0.0.0", "::"):
            return socket.gethostname()
        return host

    @property
    def advertised_port(self) -> int:
        if self.listeners:
            return self.listener_list()[0].adv_port
        if self.advertised_listener:
            return split_host_port(self.advertised_listener)[1]
        return self.listen_port

    @property
    def data_path(self) -> str:
        return os.path.abspath(self.data_dir)

    @property
    def wal_path(self) -> str:
        return self.wal or os.path.join(self.data_path, "wal")

    @property
    def object_store_url(self) -> str:
        return self.object_store or "file://" + os.path.join(self.data_path, "objects")

    @property
    def metadata_url(self) -> str:
        return self.metadata or "sqlite:///" + os.path.join(self.data_path, "meta.db")

    @property
    def auto_create_topics_enable(self) -> bool:
        return self.auto_create_topics

    @property
    def wal_io_engine(self) -> str:
        """The WAL's io_engine (engine option wal_io_engine, else its default): "uring" makes
        the broker cut large frames from arena slabs the WAL's io_uring registers."""
        return str(self.engine.get("wal_io_engine") or engine_defaults().get("wal_io_engine", ""))

    def engine_config(self) -> Any:
        """The ``storage.engine.EngineConfig`` for this broker (paths resolved)."""
        from storage.engine import EngineConfig  # noqa: PLC0415 - optional until the engine lands

        known = {f.name for f in fields(EngineConfig)}
        kwargs = {k: v for k, v in self.engine.items() if k in known}
        kwargs.update(data_dir=self.data_path, wal_path=self.wal_path,
                      object_store=self.object_store_url, metadata_url=self.metadata_url,
                      node_id=self.node_id)
        return EngineConfig(**kwargs)


def split_host_port(value: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); raises ValueError on garbage."""
    value = value.strip()
    if "://" in value:  # accept Kafka-style "PLAINTEXT://host:port"
        value = value.split("://", 1)[1]
    m = re.fullmatch(r"\[([^\]]*)\]:(\d+)|([^:]*):(\d+)", value)
    if not m:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host = m.group(1) if m.group(1) is not None else m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range in {value!r}")
    return host, port


_SIZE_SUFFIX = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
                "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
                "t": 1 << 40, "tib": 1 << 40}


def parse_int(value: Any) -> int:
    """Integers with optional binary size suffixes (``64MiB``, ``2g``) and ``_`` separators."""
    if isinstance(value, bool):
        raise ValueError("expected an integer")
    if isinstance(value, int):
        return value
    s = str(value).strip().replace("_", "")
    m = re.fullmatch(r"(-?\d+)\s*([a-zA-Z]*)", s)
    if not m or m.group(2).lower() not in _SIZE_SUFFIX:
        raise ValueError(f"expected an integer, got {value!r}")
    return int(m.group(1)) * _SIZE_SUFFIX[m.group(2).lower()]


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {value!r}")


def parse_kv_list(value: Any) -> dict[str, str]:
    """``a=1,b=2`` (or a mapping, or a list of ``a=1``) -> {"a": "1", "b": "2"}."""
    if isinstance(value, Mapping):
        return {str(k): _scalar_str(v) for k, v in value.items()}
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    out: dict[str, str] = {}
    for item in items:
        item = str(item).strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"expected NAME=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _scalar_str(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def convert(kind: Any, value: Any) -> Any:
    """Convert a flag/env/file value to a field's type."""
    if kind in (int, "int"):
        return parse_int(value)
    if kind in (float, "float"):
        return float(value)
    if kind in (bool, "bool"):
        return parse_bool(value)
    return str(value)


def _type_of(f: dataclasses.Field) -> Any:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return {"int": int, "float": float, "bool": bool, "str": str}.get(t, t)


def broker_fields() -> dict[str, Any]:
    """Broker field name -> type, for the scalar fields settable by flag/env/file."""
    return {f.name: _type_of(f) for f in fields(BrokerConfig) if f.name not in ("engine", "config")}


def engine_fields() -> dict[str, Any]:
    """Engine knobs the CLI exposes (name -> type), empty while storage.engine is missing."""
    try:
        from storage.engine import EngineConfig  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - the engine may not be importable yet
        return {}
    return {f.name: _type_of(f) for f in fields(EngineConfig) if f.name not in _ENGINE_OWN}


def engine_defaults() -> dict[str, Any]:
    """Engine knob -> its default value (for --help and docs)."""
    try:
        from storage.engine import EngineConfig  # noqa: PLC0415
    except Exception:  # noqa: BLE001
        return {}
    return {f.name: getattr(EngineConfig(), f.name) for f in fields(EngineConfig)}


def _norm(key: str) -> str:
    return key.strip().lower().replace("-", "_").replace(".", "_")


class ConfigFileError(ValueError):
    """A config file mistake; the message names the file and, where known, the line."""


def _toml_key_lines(text: str) -> dict[str, int]:
    """Normalised key -> line number of its ``key = value`` line (tables ``[engine]`` and
    ``[topic_defaults]`` flattened the way read_config_file flattens them)."""
    lines: dict[str, int] = {}
    table = ""
    for lineno, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*\[\s*([^\]]+?)\s*\]", line)
        if m:
            table = _norm(m.group(1).strip('"'))
            continue
        m = re.match(r"\s*(\"[^\"]*\"|'[^']*'|[A-Za-z0-9_.\-]+)\s*=", line)
        if not m:
            continue
        key = _norm(m.group(1).strip("\"'"))
        if table in ("", "engine"):
            lines.setdefault(key, lineno)
        elif table not in ("topic_defaults", "topic"):
            lines.setdefault(f"{table}_{key}", lineno)
        if table in ("topic_defaults", "topic"):
            lines.setdefault("topic_defaults", lineno)
    return lines


def _flatten(prefix: str, table: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}_{_norm(k)}"
        if isinstance(v, Mapping):
            out.update(_flatten(key, v))
        else:
            out[key] = v
    return out


def read_config_file(path: str, lines: dict[str, int] | None = None) -> dict[str, Any]:
    """TOML (``*.toml``, or when it parses as TOML) or ``key=value`` properties -> flat dict.

    TOML tables ``[engine]`` and ``[topic_defaults]`` are understood; properties files may use
    ``topic.defaults.<name>=value`` (or ``topic_defaults.<name>``) for topic config defaults.
    ``lines`` (when given) receives each key's line number, for messages naming the line.
    Raises ConfigFileError naming the file (and line) for anything it cannot read.
    """
    lines = {} if lines is None else lines
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise ConfigFileError(f"config file {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigFileError(f"config file {path}, line {line}: not UTF-8 text") from None
    data: dict[str, Any] | None = None
    if path.endswith(".toml"):
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            m = re.search(r"\(at line (\d+), column \d+\)", str(e))
            where = f", line {m.group(1)}" if m else ""
            msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(e))
            raise ConfigFileError(f"config file {path}{where}: invalid TOML: {msg}") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            data = None
    out: dict[str, Any] = {}
    if data is not None:
        lines.update(_toml_key_lines(text))
        for k, v in data.items():
            nk = _norm(k)
            if isinstance(v, dict) and nk == "engine":
                for ek, ev in v.items():
                    out[_norm(ek)] = ev
            elif isinstance(v, dict) and nk in ("topic_defaults", "topic"):
                out["topic_defaults"] = {str(tk): _scalar_str(tv) for tk, tv in v.items()}
            elif isinstance(v, dict):        # dotted keys (node.id = 0) or another table
                out.update(_flatten(nk, v))
            else:
                out[nk] = v
        return out
    topic_defaults: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line[0] in "#!":
            continue
        sep = min((i for i in (line.find("="), line.find(":")) if i > 0), default=-1)
        if sep < 0:
            raise ConfigFileError(f"config file {path}, line {lineno}: expected key=value, "
                                  f"got {line[:60]!r}")
        k, v = line[:sep].strip(), line[sep + 1:].strip()
        for prefix in ("topic.defaults.", "topic_defaults.", "topic-defaults."):
            if k.startswith(prefix):
                topic_defaults[k[len(prefix):]] = v
                lines.setdefault("topic_defaults", lineno)
                break
        else:
            out[_norm(k)] = v
            lines[_norm(k)] = lineno
    if topic_defaults:
        out["topic_defaults"] = topic_defaults
    return out


def _where(source: str, name: str, config_path: str, lines: Mapping[str, int]) -> str:
    """Where a value came from, for error messages: the flag, the variable or file:line."""
    if source == "flag":
        return "--" + name.replace("_", "-")
    if source == "env":
        return ENV_PREFIX + name.upper()
    line = lines.get(name)
    return f"config file {config_path}" + (f", line {line}" if line else "") + f" ({name})"


def build_config(flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> BrokerConfig:
    """Merge ``flags`` (None = not given) over environment over config file over defaults."""
    env = os.environ if env is None else env
    bf, ef = broker_fields(), engine_fields()
    config_path = flags.get("config") or env.get(ENV_PREFIX + "CONFIG") or ""
    lines: dict[str, int] = {}
    file_vals = read_config_file(config_path, lines) if config_path else {}
    known = set(bf) | set(ef) | set(_ENGINE_RENAMES) | {"config"}
    unknown = sorted((k for k in file_vals if k not in known), key=lambda k: lines.get(k, 0))
    if unknown:
        first = unknown[0]
        line = lines.get(first)
        hint = difflib.get_close_matches(first, sorted(known), n=1)
        more = f" (and {len(unknown) - 1} more: {', '.join(unknown[1:])})" if unknown[1:] else ""
        raise ConfigFileError(
            f"config file {config_path}" + (f", line {line}" if line else "")
            + f": unknown option {first!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
            + more)
    cfg = BrokerConfig(config=config_path)
    for name, kind in {**bf, **ef}.items():
        value: Any = flags.get(name)
        source = "flag"
        if value is None:
            value = env.get(ENV_PREFIX + name.upper())
            source = "env"
        if value is None:
            value = file_vals.get(name)
            source = "file"
        if value is None:
            continue
        try:
            if name == "topic_defaults":
                parsed: Any = parse_kv_list(value)
            else:
                parsed = convert(kind, value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad value for {_where(source, name, config_path, lines)}: {exc}"
                             ) from None
        if name in bf:
            setattr(cfg, name, parsed)
        else:
            cfg.engine[name] = parsed
    validate(cfg)
    return cfg


_STORE_FORMS = "file:///DIR, s3://BUCKET[/PREFIX][?endpoint_url=http://HOST:PORT&...] or mem://"


def check_object_store_url(url: str) -> None:
    """Refuse an object store URL no store can be built from (no I/O)."""
    from urllib.parse import parse_qs, urlsplit  # noqa: PLC0415

    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise ValueError(f"bad object_store URL {url!r}: {e}; expected {_STORE_FORMS}") from None
    if parts.scheme not in ("file", "s3", "mem", ""):
        raise ValueError(f"bad object_store URL {url!r}: unknown scheme {parts.scheme!r}; "
                         f"expected {_STORE_FORMS}")
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ValueError(f"bad object_store URL {url!r}: no bucket; expected {_STORE_FORMS}")
        endpoint = parse_qs(parts.query).get("endpoint_url", [""])[-1]
        if endpoint and urlsplit(endpoint).scheme not in ("http", "https"):
            raise ValueError(f"bad object_store URL {url!r}: endpoint_url {endpoint!r} must "
                             "start with http:// or https://")
    if parts.scheme == "file" and not (parts.path or parts.netloc):
        raise ValueError(f"bad object_store URL {url!r}: no directory; expected {_STORE_FORMS}")


def check_metadata_url(url: str) -> None:
    """Refuse a metadata URL the metadata stores cannot open (no I/O)."""
    if url.startswith(("postgresql://", "postgres://")):
        from urllib.parse import urlsplit  # noqa: PLC0415

        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as e:
            raise ValueError(f"bad metadata URL: {e}") from None
        if not parts.hostname and "host=" not in parts.query:
            raise ValueError("bad metadata URL: no host; expected "
                             "postgresql://USER:PASS@HOST:PORT/DB")
        return
    if url.startswith("sqlite:"):
        if not url.startswith("sqlite:///") or len(url) <= len("sqlite:///"):
            raise ValueError(f"bad metadata URL {url!r}: expected sqlite:///relative/path.db or "
                             "sqlite:////absolute/path.db")
        return
    raise ValueError(f"bad metadata URL {url!r}: expected sqlite:///PATH or "
                     "postgresql://USER:PASS@HOST:PORT/DB")


def validate(cfg: BrokerConfig) -> None:
    """Reject values the broker cannot run with, with a message naming the option."""
    split_host_port(cfg.listen)
    if cfg.advertised_listener:
        split_host_port(cfg.advertised_listener)
    if cfg.advertised_listeners and not cfg.listeners:
        raise ValueError("advertised_listeners needs listeners (or use advertised_listener "
                         "with listen)")
    cfg.listener_list()      # ValueError naming the option
    if cfg.metrics_listen.strip().lower() not in ("", "off", "none", "disabled"):
        try:
            split_host_port(cfg.metrics_listen)
        except ValueError as exc:
            raise ValueError(f"metrics_listen: {exc} (or 'off')") from None
    if cfg.storage not in ("engine", "memory"):
        raise ValueError("storage must be 'engine' or 'memory'")
    if cfg.default_partitions < 1:
        raise ValueError("default_partitions must be >= 1")
    if cfg.max_inflight_bytes < 1:
        raise ValueError("max_inflight_bytes must be >= 1")
    if cfg.max_request_bytes < 1024:
        raise ValueError("max_request_bytes must be >= 1024")
    if cfg.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("log_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
    if cfg.log_format not in ("text", "json"):
        raise ValueError("log_format must be 'text' or 'json'")
    if cfg.node_id < 0:
        raise ValueError("node_id must be >= 0")
    if cfg.transaction_version not in (1, 2):
        raise ValueError("transaction_version must be 1 or 2")
    if cfg.metadata and not cfg.metadata.startswith(("sqlite:///", "postgresql://",
                                                     "postgres://")):
        raise ValueError("metadata must be sqlite:///PATH or postgresql://USER:PASS@HOST:PORT/DB"
                         f", got {cfg.metadata!r}")
    check_object_store_url(cfg.object_store_url)
    check_metadata_url(cfg.metadata_url)
    # engine options with a fixed set of values: refused here, not in a traceback at start
    from storage.thread_priority import IO_CLASSES  # noqa: PLC0415
    from storage.wal.config import IO_ENGINES, SYNC_MODES  # noqa: PLC0415

    io_class = cfg.engine.get("cold_read_io_class", "")
    if io_class and io_class not in IO_CLASSES:
        raise ValueError(f"cold_read_io_class must be one of {sorted(IO_CLASSES)} or empty")
    if cfg.engine.get("wal_sync_mode", SYNC_MODES[0]) not in SYNC_MODES:
        raise ValueError(f"wal_sync_mode must be one of {', '.join(SYNC_MODES)}")
    if cfg.engine.get("wal_io_engine", IO_ENGINES[0]) not in IO_ENGINES:
        raise ValueError(f"wal_io_engine must be one of {', '.join(IO_ENGINES)}")
    from .topics import TopicError, validate_config  # noqa: PLC0415 - avoid a cycle at import

    for name, value in list(cfg.topic_defaults.items()):
        try:
            cfg.topic_defaults[name] = validate_config(name, value)
        except TopicError as exc:
            raise ValueError(f"topic_defaults: {exc.message}") from None
