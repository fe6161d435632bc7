"""Child process: one takeover (killed by a crash point or SIGKILL in the tests).
Usage: run_takeover.py <wal> <meta url> <store url> <node id> <node epoch> <taker> <taker epoch>"""
from __future__ import annotations

import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from storage.metastore import open_metastore  # noqa: E402
from storage.objects.store import open_object_store  # noqa: E402
from storage.takeover import take_over_wal  # noqa: E402

import storage.takeover as takeover  # noqa: E402

logging.basicConfig(level=logging.INFO)
wal, meta_url, store_url, node, epoch, taker, taker_epoch = sys.argv[1:8]
meta = open_metastore(meta_url)
store = open_object_store(store_url)
if os.environ.get("TAKEOVER_SLOW"):
    # many small objects, each put a little slow: a SIGKILL at a random moment lands before
    # the fence, mid-upload, around the commit or after it
    takeover.MAX_OBJECT_BYTES = 32 << 10
    put = store.put
    store.put = lambda key, data: (time.sleep(0.01), put(key, data))[1]  # type: ignore
print("READY", flush=True)
res = take_over_wal(wal, node_id=int(node), node_epoch=int(epoch), taker=int(taker),
                    taker_epoch=int(taker_epoch), meta=meta, store=store,
                    object_block_bytes=16 << 10)
print("DONE", res.committed_records, res.skipped_records, flush=True)
