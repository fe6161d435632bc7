"""Broker._connection_idle wakes a shutdown waiting for idle connections (``_wait_idle``), and
only then: outside a wait it does not go over every connection (it runs after nearly every
answer of a client with one request in flight)."""
from __future__ import annotations

import asyncio
import types

from broker.server import Broker


class _Conn:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.busy = True
        self.asked = 0

    @property
    def idle(self) -> bool:
        self.asked += 1
        return not self.busy


def _broker() -> Broker:
    b = Broker.__new__(Broker)         # only what _connection_idle and _wait_idle use
    b.connections = set()
    b._idle = asyncio.Event()
    b._idle_waiting = False
    b.config = types.SimpleNamespace(shutdown_timeout_s=5.0)
    return b


async def test_outside_a_shutdown_wait_no_connection_is_asked():
    b = _broker()
    c = _Conn(b)
    b.connections.add(c)
    c.busy = False
    b._connection_idle()
    assert c.asked == 0 and not b._idle.is_set()


async def test_a_shutdown_wait_is_woken_by_the_last_connection_going_idle():
    b = _broker()
    c = _Conn(b)
    b.connections.add(c)
    waiter = asyncio.ensure_future(b._wait_idle(30.0))
    await asyncio.sleep(0)
    assert b._idle_waiting and not waiter.done()
    c.busy = False
    b._connection_idle()
    assert b._idle.is_set()                 # the wait's event, set by the connection
    await asyncio.wait_for(waiter, 5)
    assert not b._idle_waiting
