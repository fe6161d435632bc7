"""Random but well-formed messages of any (api, version), for fuzzing a running broker.

Values are drawn per field type (small numbers most of the time, sometimes extremes; random
strings and byte strings; 0-3 array elements), so requests decode fine and exercise the
handlers' semantic checks rather than the decoder.  Fields whose size is a resource request
(partition counts, timeouts) stay small so a fuzz run measures robustness, not capacity.
"""
from __future__ import annotations

import random
import uuid
from typing import Any

_SMALL_NAMES = ("count", "partitions", "replication_factor", "limit", "max_num_offsets")


def _int(rng: random.Random, bits: int, name: str) -> int:
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if name.endswith("_ms") or "timeout" in name or name.startswith("max_wait"):
        return rng.randint(-1, 300)
    if any(s in name for s in _SMALL_NAMES):
        return rng.randint(-2, 4)
    r = rng.random()
    if r < 0.75:
        return rng.randint(-2, 10)
    if r < 0.9:
        return rng.choice([lo, hi, -1, 0])
    return rng.randint(lo, hi)


def _string(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.3:
        return rng.choice(["", "x", "fuzz", "__consumer_offsets", "a.b-c_d"])
    if r < 0.9:
        return "".join(rng.choice("abcxyz-_.0123") for _ in range(rng.randint(1, 24)))
    return "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(1, 300)))


def _simple(field: Any, version: int, rng: random.Random, records: list[bytes],
            element: bool = False) -> Any:
    """A random value of a scalar field; ``element``: an array's element, which the
    array's nullability does not make nullable (Kafka has no null elements)."""
    t = field.type_str
    if not element and field.nullable_for_version_q(version) and rng.random() < 0.1:
        return None
    if t == "int8":
        return _int(rng, 8, field.name)
    if t in ("int16", "uint16"):
        return _int(rng, 16, field.name) & (0xFFFF if t == "uint16" else -1)
    if t == "int32":
        return _int(rng, 32, field.name)
    if t == "int64":
        return _int(rng, 64, field.name)
    if t == "float64":
        return rng.random() * 10
    if t == "bool":
        return rng.random() < 0.5
    if t == "string":
        return _string(rng)
    if t == "uuid":
        return uuid.UUID(int=rng.getrandbits(128)) if rng.random() < 0.7 else uuid.UUID(int=0)
    if t == "records":
        if records and rng.random() < 0.6:
            return rng.choice(records)
        return rng.randbytes(rng.randint(0, 120))
    if t == "bytes":
        return rng.randbytes(rng.randint(0, 64))
    return field.default


def random_struct(data_class: Any, version: int, rng: random.Random,
                  records: list[bytes] | None = None) -> Any:
    """An instance of ``data_class`` at ``version`` with random in-range values."""
    records = records or []
    kwargs: dict[str, Any] = {}
    for field in data_class._struct._fields:
        if not field.for_version_q(version):
            continue
        if field.tagged_field_q(version) and rng.random() < 0.7:
            continue
        nullable = field.nullable_for_version_q(version)
        if field.is_struct_array() or field.is_struct():
            sub = getattr(data_class, field.type_str, None) or field.data_class
            if field.is_struct():
                kwargs[field.name] = (None if nullable and rng.random() < 0.2
                                      else random_struct(sub, version, rng, records))
            elif nullable and rng.random() < 0.1:
                kwargs[field.name] = None
            else:
                kwargs[field.name] = [random_struct(sub, version, rng, records)
                                      for _ in range(rng.choice([0, 1, 1, 2, 3]))]
        elif field.is_array():
            if nullable and rng.random() < 0.1:
                kwargs[field.name] = None
            else:
                kwargs[field.name] = [_simple(field.array_of, version, rng, records, element=True)
                                      for _ in range(rng.choice([0, 1, 2]))]
        else:
            kwargs[field.name] = _simple(field, version, rng, records)
    return data_class(version=version, **kwargs)
