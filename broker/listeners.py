"""Named listeners, as Kafka's ``listeners`` / ``advertised.listeners``.

``--listeners INTERNAL://0.0.0.0:9092,EXTERNAL://0.0.0.0:19092`` opens one socket per name;
``--advertised-listeners INTERNAL://broker1:9092,EXTERNAL://localhost:19092`` says what each
is called from outside. A client is always told the addresses of the listener it connected
to (Metadata, FindCoordinator, KIP-951 endpoints), for this broker and for every other broker
of the cluster (each registers all its advertised listeners), so containers reach brokers by
their service names and the host through published ports, with no /etc/hosts entries.

Without ``--listeners`` the single ``--listen`` / ``--advertised-listener`` pair is one
listener named ``PLAINTEXT``, exactly as before.
"""
from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Any

DEFAULT_NAME = "PLAINTEXT"
_NAME = re.compile(r"^[A-Za-z0-9_]+$")


@dataclass(frozen=True)
class Listener:
    name: str
    host: str           # where to bind
    port: int
    adv_host: str       # what clients are told
    adv_port: int


def _host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what}: expected NAME://HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def parse(spec: str, what: str = "listeners") -> list[tuple[str, str, int]]:
    """``NAME://HOST:PORT,...`` -> [(NAME upper-cased, host, port)]; ValueError (one line)
    for a malformed entry or a name given twice."""
    out: list[tuple[str, str, int]] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, sep, rest = item.partition("://")
        if not sep or not _NAME.match(name):
            raise ValueError(f"{what}: expected NAME://HOST:PORT, got {item!r}")
        host, port = _host_port(rest, what)
        name = name.upper()
        if any(n == name for n, _, _ in out):
            raise ValueError(f"{what}: listener name {name} given twice")
        out.append((name, host, port))
    if spec.strip() and not out:
        raise ValueError(f"{what}: no listener in {spec!r}")
    return out


def _advertise(host: str) -> str:
    return socket.gethostname() if host in ("", "0.0.0.0", "::") else host


def of_config(cfg: Any) -> list[Listener]:
    """Every listener of a BrokerConfig; the first one is the broker's default address."""
    spec = getattr(cfg, "listeners", "") or ""
    if not spec.strip():
        from .config import split_host_port  # noqa: PLC0415

        host, port = split_host_port(cfg.listen)
        adv = cfg.advertised_listener
        ah, ap = split_host_port(adv) if adv else (_advertise(host), port)
        return [Listener(DEFAULT_NAME, host, port, ah, ap)]
    binds = parse(spec, "listeners")
    adv = {n: (h, p) for n, h, p in parse(getattr(cfg, "advertised_listeners", "") or "",
                                          "advertised_listeners")}
    unknown = sorted(set(adv) - {n for n, _, _ in binds})
    if unknown:
        raise ValueError(f"advertised_listeners: {', '.join(unknown)} not in listeners")
    ports = [p for _, _, p in binds if p]
    if len(ports) != len(set(ports)):
        raise ValueError("listeners: two listeners on one port")
    return [Listener(n, h, p, *adv.get(n, (_advertise(h), p))) for n, h, p in binds]


def encode(listeners: list[Listener]) -> str:
    """The advertised side, as registered in the cluster table (``NAME://host:port,...``)."""
    return ",".join(f"{x.name}://{_bracket(x.adv_host)}:{x.adv_port}" for x in listeners)


def decode(text: str | None) -> dict[str, tuple[str, int]]:
    """Registered advertised listeners -> {name: (host, port)} (empty for old rows)."""
    try:
        return {n: (h, p) for n, h, p in parse(text or "", "registered listeners")}
    except ValueError:
        return {}


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def of_connection(ctx: Any) -> str | None:
    """The listener name a request came in on (None for connections without one)."""
    return getattr(getattr(ctx, "conn", None), "listener", None)


def own_address(cfg: Any, listener: str | None) -> tuple[str, int]:
    """This broker's advertised (host, port) on a named listener (the default one if the
    name is unknown or None); a config without named listeners answers its advertised
    host and port."""
    if not hasattr(cfg, "listener_list"):
        return cfg.advertised_host, cfg.advertised_port
    lst = cfg.listener_list()
    for x in lst:
        if x.name == listener:
            return x.adv_host, x.adv_port
    return lst[0].adv_host, lst[0].adv_port
