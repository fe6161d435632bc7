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


# api key -> handler of requests of one run key (one request alone, or a run) without a task:
# ``fn(items, futs, conn)`` takes them all - each future gets its answer later, then
# ``conn.answered()`` - or returns False having done nothing (the usual path handles them).
# Tasks it starts for some of them go to ``conn.track_slow(task)``.
NowHandler = Callable[[list[tuple["RequestContext", Any, float]], list[Any], Any], bool]
NOW_HANDLERS: dict[int, NowHandler] = {}


class Framed(list):
    """An answer a handler framed itself (length prefix, response header and body, as buffers
    for ``writelines``): the server writes it as it is instead of encoding it with the
    request's header (the task-less Produce path frames its answers in one step)."""

    __slots__ = ()


def now_handler(api_key: int) -> Callable[[NowHandler], NowHandler]:
    """Register ``fn`` as the task-less handler of ``api_key``'s run-keyed requests."""

    def register(fn: NowHandler) -> NowHandler:
        NOW_HANDLERS[api_key] = fn
        return fn

    return register


def run_handler(api_key: int, key: Callable[[Any], Any]) -> Callable[[RunHandler], RunHandler]:
    """Register ``fn`` as the run handler of ``api_key``, ``key`` as its run key."""

    def register(fn: RunHandler) -> RunHandler:
        RUN_HANDLERS[api_key] = (key, fn)
        return fn

    return register


@dataclass(slots=True)
class RequestContext:
    """What a handler may use besides the decoded request."""

    broker: Any  # broker.server.Broker (typed loosely to avoid an import cycle)
    header: Any  # protocol.RequestHeader
    conn: Any  # broker.server.Connection

    @property
    def version(self) -> int:
        return self.header.api_version
