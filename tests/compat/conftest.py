"""Fixtures of the Kafka-answers tests: one broker per module, Java's answers run once."""
from __future__ import annotations

import pytest

from clients.e2e_helpers import CLIENT_BROKER_ARGS, JavaCli, compile_java, unique


@pytest.fixture(scope="module")
def abroker(module_broker_factory):
    """The broker one answers module shares."""
    return module_broker_factory(CLIENT_BROKER_ARGS)


@pytest.fixture(scope="module")
def java_answers(abroker, java_classpath) -> dict[str, dict]:
    """{"3.9": outcomes, "4.3": outcomes} of KafkaCli's ``answers`` command (one JVM each)."""
    out = {}
    for version, cp in sorted(java_classpath.items()):
        cli = JavaCli(version, compile_java(version, cp))
        out[version] = cli("answers", bootstrap=abroker.bootstrap,
                           topic=unique(f"java{version.replace('.', '')}"), timeout=240)
    return out
