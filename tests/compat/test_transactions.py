"""Kafka's answer to a transaction timeout above ``transaction.max.timeout.ms`` (900000):
INVALID_TRANSACTION_TIMEOUT at once, which every client reports fatally. (Transactions
themselves are tested in tests/transactions.)
"""
from __future__ import annotations

import time

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from kafka import KafkaProducer
from kafka import errors as kerrors

pytestmark = pytest.mark.e2e
FAST_S = 10   # "at once": well under any client's own timeouts (60 s and more)


@pytest.mark.parametrize("timeout_ms,code", [
    (3_600_000, KafkaError.INVALID_TRANSACTION_TIMEOUT)])
def test_librdkafka_init_transactions_fails_fatally(abroker, timeout_ms, code):
    p = Producer({"bootstrap.servers": abroker.bootstrap, "transactional.id": f"tx-{timeout_ms}",
                  "transaction.timeout.ms": timeout_ms, "log_level": 0})
    t0 = time.monotonic()
    with pytest.raises(KafkaException) as info:
        p.init_transactions(60)
    err = info.value.args[0]
    assert err.code() == code and err.fatal(), err
    assert time.monotonic() - t0 < FAST_S


@pytest.mark.parametrize("timeout_ms,error", [
    (3_600_000, kerrors.InvalidTransactionTimeoutError)])
def test_kafka_python_init_transactions_fails(abroker, timeout_ms, error):
    t0 = time.monotonic()
    p = KafkaProducer(bootstrap_servers=abroker.bootstrap, transactional_id=f"kp-{timeout_ms}",
                      transaction_timeout_ms=timeout_ms)
    try:
        with pytest.raises(kerrors.KafkaError) as info:
            p.init_transactions()
    finally:
        p.close(timeout=5)
    # kafka-python raises the error itself, or wraps an unexpected one in its message
    assert isinstance(info.value, error) or error.__name__ in str(info.value), info.value
    assert time.monotonic() - t0 < FAST_S


def test_java_init_transactions(java_answers):
    for version, out in java_answers.items():
        assert out["txn"] == "ok", (version, out)
        # Java has no class for this error: "Unexpected error in InitProducerIdResponse"
        assert out["txn_timeout"] == "KafkaException", (version, out)
        assert out["txn_ms"] < FAST_S * 1000 and out["txn_timeout_ms"] < FAST_S * 1000, out


def test_idempotent_producer_still_gets_an_id(abroker):
    p = Producer({"bootstrap.servers": abroker.bootstrap, "enable.idempotence": True})
    reports: list = []
    p.produce("idem-still-works", b"v", on_delivery=lambda err, msg: reports.append(err))
    assert p.flush(30) == 0 and reports == [None]
