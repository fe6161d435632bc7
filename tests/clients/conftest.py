"""Fixtures of the end-to-end client tests (helpers live in e2e_helpers.py)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from clients.e2e_helpers import CLIENT_BROKER_ARGS, JavaCli, compile_java, unique


@pytest.fixture(scope="module")
def cbroker(module_broker_factory):
    """The broker shared by one client test module (restartable by the restart tests)."""
    return module_broker_factory(CLIENT_BROKER_ARGS)


@pytest.fixture(scope="session")
def java_cli(java_classpath: dict[str, str]) -> dict[str, JavaCli]:
    """{"3.9": JavaCli, "4.3": JavaCli}: KafkaCli compiled with javac against each version."""
    return {v: JavaCli(v, compile_java(v, cp)) for v, cp in java_classpath.items()}


@pytest.fixture
def topic_name(request) -> Iterator[str]:
    """A fresh topic name for this test (modules share one broker)."""
    yield unique(request.node.name.split("[")[0].replace("_", "-")[:30])
