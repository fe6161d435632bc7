"""Idempotent-producer persistence on SQLite and PostgreSQL: ids, transactional epochs, snapshots."""
from __future__ import annotations

import threading

from broker.producer_state import ProducerStore


def test_ids_epochs_and_snapshots_survive_reopen(metadata_url):
    s1 = ProducerStore(metadata_url)
    ids = {s1.allocate_producer_id() for _ in range(3)}
    pid, epoch = s1.init_transactional("tx")
    s1.save_snapshot("topic-id", 0, 7, 100, '{"1": {}}')
    s1.save_snapshot_later("topic-id", 0, 7, 120, '{"2": {}}').result(30)
    s1.save_snapshot("other", 1, 8, 5, "{}")
    s1.close()
    s2 = ProducerStore(metadata_url)
    assert s2.allocate_producer_id() not in ids | {pid}
    assert s2.init_transactional("tx") == (pid, epoch + 1)
    assert s2.load_snapshot("topic-id", 0, 7) == (120, '{"2": {}}')
    assert s2.load_snapshot("topic-id", 0, 9) is None           # another stream: stale
    s2.delete_snapshots("topic-id")
    assert s2.load_snapshot("topic-id", 0, 7) is None
    assert s2.load_snapshot("other", 1, 8) == (5, "{}")
    s2.close()


def test_brokers_sharing_a_database_never_hand_out_one_id_twice(metadata_url):
    stores = [ProducerStore(metadata_url) for _ in range(3)]
    got: list[int] = []
    lock = threading.Lock()

    def allocate(store: ProducerStore) -> None:
        for _ in range(15):
            pid = store.allocate_producer_id()
            with lock:
                got.append(pid)

    threads = [threading.Thread(target=allocate, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == 45 and len(set(got)) == 45
    for s in stores:
        s.close()
