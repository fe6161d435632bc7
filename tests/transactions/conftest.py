"""Fixtures of the transaction tests: one broker per module."""
from __future__ import annotations

import pytest

from clients.e2e_helpers import CLIENT_BROKER_ARGS


@pytest.fixture(scope="module")
def tbroker(module_broker_factory):
    """The broker one transactions module shares."""
    return module_broker_factory(CLIENT_BROKER_ARGS)
