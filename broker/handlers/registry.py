"""Maps API keys to async handlers; each handler module registers itself on import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

Handler = Callable[["RequestContext", Any], Awaitable[Any]]
HANDLERS: dict[int, Handler] = {}
# api key -> (run key of a decoded request or None, handler of a run of requests): consecutive
# requests of one connection read together whose run keys are equal (and not None) may be
# handed to the run handler at once, which answers each (a list of bodies, in order)
RunHandler = Callable[[list["RequestContext"], list[Any]], Awaitable[list[Any]]]
RUN_HANDLERS: dict[int, tuple[Callable[[Any], Any], RunHandler]] = {}


def handler(api_key: int) -> Callable[[Handler], Handler]:
    """Register ``fn`` as the handler of ``api_key`` (one handler per key)."""

    def register(fn: Handler) -> Handler:
        if api_key in HANDLERS and HANDLERS[api_key] is not fn:
            raise RuntimeError(f"api key {api_key} registered twice")
        HANDLERS[api_key] = fn
        return fn

    return register


def run_handler(api_key: int, key: Callable[[Any], Any]) -> Callable[[RunHandler], RunHandler]:
    """Register ``fn`` as the run handler of ``api_key``, ``key`` as its run key."""

    def register(fn: RunHandler) -> RunHandler:
        RUN_HANDLERS[api_key] = (key, fn)
        return fn

    return register


@dataclass
class RequestContext:
    """What a handler may use besides the decoded request."""

    broker: Any  # broker.server.Broker (typed loosely to avoid an import cycle)
    header: Any  # protocol.RequestHeader
    conn: Any  # broker.server.Connection

    @property
    def version(self) -> int:
        return self.header.api_version
