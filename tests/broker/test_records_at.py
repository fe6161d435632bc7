"""broker.frames.produce_records_at in C (protocol._produce.records_at) answers exactly what
its Python version answers - the place, None or NEED_MORE - on Produce frames of every shape the
server may see first bytes of, cut at every length, and on mutated bytes."""
from __future__ import annotations

import random
import struct

import pytest

from broker import frames
from broker.frames import NEED_MORE, _produce_records_at_py

from test_placed_produce import _uv, batch, produce_v3, produce_v9

_I16, _I32 = struct.Struct(">h"), struct.Struct(">i")



def _c():
    try:
        from protocol._produce import records_at
    except ImportError:
        pytest.skip("protocol._produce not built")
    return records_at


def _v3_txn(corr: int, topic: bytes, txn: bytes | None, client: bytes | None) -> bytes:
    rec = batch(2, 40)
    body = ((_I16.pack(-1) if client is None else _I16.pack(len(client)) + client)
            + (_I16.pack(-1) if txn is None else _I16.pack(len(txn)) + txn)
            + _I16.pack(-1) + _I32.pack(30000) + _I32.pack(1) + _I16.pack(len(topic)) + topic
            + _I32.pack(1) + _I32.pack(4) + _I32.pack(len(rec)) + rec)
    return _I16.pack(0) + _I16.pack(5) + _I32.pack(corr) + body


def _v9_odd(topic: bytes, name_len: int, parts: int, tags: int) -> bytes:
    rec = batch(2, 40)
    return (_I16.pack(0) + _I16.pack(9) + _I32.pack(1) + _I16.pack(2) + b"ab" + _uv(tags)
            + _uv(0) + _I16.pack(1) + _I32.pack(30000) + _uv(2) + _uv(name_len) + topic
            + _uv(parts) + _I32.pack(0) + _uv(len(rec) + 1) + rec + b"\0\0\0")


def _frames() -> list[bytes]:
    rec = batch(30, 100)
    out = [produce_v3(1, "tp", [(2, rec)])[4:], produce_v9(2, "topic-x", 7, rec)[4:],
           produce_v3(3, "tp", [(0, rec), (1, rec)])[4:],
           _v3_txn(4, b"t", b"txn-1", b"cli"), _v3_txn(5, b"t", None, None),
           _v9_odd(b"abc", 4, 2, 0), _v9_odd(b"abc", 0, 2, 0), _v9_odd(b"abc", 4, 3, 0),
           _v9_odd(b"abc", 4, 2, 1), _v9_odd(b"", 1, 2, 0)]
    f = bytearray(out[0])
    f[2:4] = _I16.pack(2)                      # v2: not a version of the place
    out.append(bytes(f))
    f = bytearray(out[0])
    f[0:2] = _I16.pack(1)                      # a Fetch
    out.append(bytes(f))
    f = bytearray(out[1])
    f[8:10] = _I16.pack(-1)                    # null client id (flexible)
    out.append(bytes(f))
    return out


@pytest.mark.parametrize("i", range(13))
def test_every_prefix_answers_as_the_python_version(i):
    records_at = _c()
    frame = _frames()[i]
    for pos in (0, 3):
        buf = b"\xee" * pos + frame + b"\x80" * 16      # stale bytes past ``end`` ignored
        for end in range(pos, pos + min(len(frame), 400) + 1):
            want = _produce_records_at_py(buf, pos, end)
            got = records_at(buf, pos, end)
            assert got == want, (i, pos, end)
            assert (got is NEED_MORE) == (want is NEED_MORE), (i, pos, end)


def test_mutated_bytes_answer_as_the_python_version():
    records_at = _c()
    rnd = random.Random(20261130)
    base = _frames()
    for _ in range(4000):
        f = bytearray(rnd.choice(base)[:300])
        for _ in range(rnd.randint(1, 4)):
            f[rnd.randrange(min(len(f), 80))] = rnd.choice((0, 1, 2, 0x7F, 0x80, 0xFF,
                                                             rnd.randrange(256)))
        end = rnd.randint(0, len(f))
        want = _produce_records_at_py(f, 0, end)
        got = records_at(f, 0, end)
        assert got == want and (got is NEED_MORE) == (want is NEED_MORE), (bytes(f), end)


def test_the_server_uses_the_c_version_and_its_need_more():
    records_at = _c()
    assert frames.produce_records_at is records_at
    assert frames.produce_records_at(b"\0\0", 0, 2) is NEED_MORE
