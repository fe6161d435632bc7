"""ApiVersions: every API we advertise that has a handler, with its version range."""
from __future__ import annotations

from typing import Any

from protocol import SUPPORTED_APIS, response_class

from .registry import HANDLERS, RequestContext, handler

API_VERSIONS = 18
_CACHE: dict[int, bytes] = {}   # version -> encoded body; the answer never changes at run time


def advertised() -> dict[int, tuple[int, int]]:
    """Advertised ranges: the protocol's supported APIs that have a registered handler."""
    return {k: v for k, v in sorted(SUPPORTED_APIS.items()) if k in HANDLERS}


def build_response(version: int) -> Any:
    cls = response_class(API_VERSIONS)
    keys = [cls.ApiVersion(api_key=k, min_version=lo, max_version=hi)
            for k, (lo, hi) in advertised().items()]
    return cls(version=version, error_code=0, api_keys=keys, throttle_time_ms=0)


@handler(API_VERSIONS)
async def api_versions(ctx: RequestContext, req: Any) -> Any:
    """v3+ requests carry client software name/version (KIP-511); we accept any value.

    Every client sends this first on every connection, so the encoded body is cached (it costs
    a few hundred microseconds to build)."""
    from ..server import EncodedBody  # noqa: PLC0415 - server imports the handlers

    body = _CACHE.get(ctx.version)
    if body is None:
        body = _CACHE[ctx.version] = EncodedBody(build_response(ctx.version).encode(
            version=ctx.version))
    return body
