"""ApiVersions: every API we advertise that has a handler, with its version range."""
from __future__ import annotations

from typing import Any

from protocol import SUPPORTED_APIS, response_class

from .registry import HANDLERS, RequestContext, handler

API_VERSIONS = 18


def advertised() -> dict[int, tuple[int, int]]:
    """Advertised ranges: the protocol's supported APIs that have a registered handler."""
    return {k: v for k, v in sorted(SUPPORTED_APIS.items()) if k in HANDLERS}


@handler(API_VERSIONS)
async def api_versions(ctx: RequestContext, req: Any) -> Any:
    """v3+ requests carry client software name/version (KIP-511); we accept any value."""
    cls = response_class(API_VERSIONS)
    keys = [cls.ApiVersion(api_key=k, min_version=lo, max_version=hi)
            for k, (lo, hi) in advertised().items()]
    return cls(version=ctx.version, error_code=0, api_keys=keys, throttle_time_ms=0)
