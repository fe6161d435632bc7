"""Helpers for the takeover tests: a dead node's WAL built in-process or by a killed engine
process, and an exact check of what the metadata and object stores hold afterwards."""
from __future__ import annotations

import os
import random
import subprocess
import sys

from storage.engine import WAL_RECORD, EngineConfig
from storage.metastore import MetaStore, NewObject
from storage.objects.format import Record, decode_object, encode_object
from storage.objects.store import ObjectStore
from storage.takeover import wal_identity
from storage.wal import DeltaWAL, WALConfig

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def node_config(tmp_path, meta_url: str, store_url: str, node_id: int, **kw) -> EngineConfig:
    """An engine of node ``node_id`` in tmp_path/n<id> on the shared stores: a 4 MiB WAL
    (fdatasync), no compaction or cleanup passes during a test; ``kw`` overrides."""
    return EngineConfig(**{**dict(
        data_dir=str(tmp_path / f"n{node_id}"), metadata_url=meta_url, object_store=store_url,
        node_id=node_id, wal_capacity=4 << 20, compaction_interval_s=3600,
        cleanup_interval_s=3600, wal_sync_mode="fdatasync"), **kw})


def payload(sid: int, base: int) -> bytes:
    """Deterministic bytes of varying size for (stream, offset): any mix-up shows."""
    rnd = random.Random(sid * 1_000_003 + base)
    return f"s{sid}o{base}:".encode() + rnd.randbytes(rnd.randrange(50, 3000))


def framed(sid: int, base: int, count: int) -> bytes:
    """A WAL record body as the engine writes it."""
    return WAL_RECORD.pack(sid, base, count) + payload(sid, base)


def commit_records(meta: MetaStore, store: ObjectStore, recs: list[tuple[int, int, int]],
                   node_id: int) -> None:
    """Upload and commit (sid, base, count) records the way the engine's uploader does."""
    recs = sorted(recs)
    oid, key = meta.prepare_object("sso", node_id)
    data, _i, ranges = encode_object([Record(s, b, c, payload(s, b)) for s, b, c in recs],
                                     16 << 10)
    store.put(key, data)
    meta.commit_objects([NewObject(oid, len(data), ranges)], [])


def open_wal(path: str, capacity: int, node_id: int, epoch: int = 0, **kw) -> DeltaWAL:
    w = DeltaWAL(WALConfig(path=path, capacity=capacity, node_id=node_id, node_epoch=epoch,
                           io_engine="threads", sync_mode="fdatasync", window_initial=1 << 16,
                           **kw))
    return w


def build_dead_wal(path: str, meta: MetaStore, store: ObjectStore, *, node_id: int,
                   streams: int = 3, records: int = 200, uploaded: int = 50,
                   capacity: int = 4 << 20, epoch: int = 0, seed: int = 0
                   ) -> list[tuple[int, int, int]]:
    """A node's WAL as it dies: ``records`` acknowledged records over new streams, the first
    ``uploaded`` committed to objects and trimmed, the rest only in the WAL (left open: no
    clean-shutdown header). Returns every acknowledged (stream, base, count)."""
    rng = random.Random(seed)
    sids = [meta.create_stream() for _ in range(streams)]
    ends = dict.fromkeys(sids, 0)
    w = open_wal(path, capacity, node_id, epoch)
    list(w.open())
    meta.register_wal(wal_identity(path, node_id, epoch, capacity))
    acked: list[tuple[int, int, int, int]] = []
    for _ in range(records):
        sid = rng.choice(sids)
        count = rng.randrange(1, 5)
        res = w.append(framed(sid, ends[sid], count), sid)
        res.future.result(timeout=30)
        acked.append((sid, ends[sid], count, res.next_offset))
        ends[sid] += count
    if uploaded:
        commit_records(meta, store, [a[:3] for a in acked[:uploaded]], node_id)
        w.trim(acked[uploaded - 1][3])
    w.stats["abandoned"] = 1          # dies here: no close(), no clean-shutdown header
    return [a[:3] for a in acked]


def committed(meta: MetaStore, store: ObjectStore) -> dict[int, list[tuple[int, int, bytes]]]:
    """Every committed (base, count, payload) per stream, read back from the objects."""
    out: dict[int, list[tuple[int, int, bytes]]] = {}
    for m in meta.streams():
        got = out.setdefault(m.stream_id, [])
        for r in meta.stream_ranges(m.stream_id):
            for rec in decode_object(bytes(store.get(r.key))):
                if (rec.stream_id == m.stream_id
                        and r.start_offset <= rec.base_offset < r.end_offset):
                    got.append((rec.base_offset, rec.count, bytes(rec.payload)))
        got.sort()
    return out


def check_exactly_once(meta: MetaStore, store: ObjectStore,
                       acked: list[tuple[int, int, int]]) -> int:
    """Every acknowledged record is committed exactly once with its bytes, each stream is
    contiguous from 0 to its committed end; returns the number of records checked."""
    data = committed(meta, store)
    ack_by = {(s, b): c for s, b, c in acked}
    n = 0
    for sid, recs in data.items():
        end = 0
        for base, count, body in recs:
            assert base == end, f"stream {sid}: offset {base} follows {end} (gap or duplicate)"
            assert body == payload(sid, base), f"stream {sid} offset {base}: wrong bytes"
            end = base + count
            n += 1
        m = meta.stream(sid)
        assert m is not None and m.end_offset == end, (sid, m, end)
    for (sid, base), count in ack_by.items():
        assert any(b == base and c == count for b, c, _ in data.get(sid, [])), \
            f"acknowledged record stream {sid} offset {base} lost"
    return n


def run_py(script: str, *args: str, env: dict | None = None, timeout: float = 60
           ) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    return subprocess.run([sys.executable, os.path.join(HERE, script), *args], env=e,
                          capture_output=True, text=True, timeout=timeout)
