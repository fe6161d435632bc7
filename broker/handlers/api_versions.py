"""ApiVersions: every API we advertise that has a handler, with its version range, and (v3+)
the features of Kafka 4.x clients look for: ``transaction.version`` finalized at level 2
(KIP-890 part 2: Java kafka-clients 4.x then bump the producer epoch on every transaction) or 1
(``--transaction-version 1``: the protocol of Kafka 3.x)."""
from __future__ import annotations

from typing import Any

from protocol import SUPPORTED_APIS, response_class

from .registry import HANDLERS, RequestContext, handler

API_VERSIONS = 18
_CACHE: dict[tuple[int, int], bytes] = {}   # (version, transaction.version) -> encoded body
FEATURES_EPOCH = 1   # the finalized features never change while a broker runs


def advertised() -> dict[int, tuple[int, int]]:
    """Advertised ranges: the protocol's supported APIs that have a registered handler."""
    return {k: v for k, v in sorted(SUPPORTED_APIS.items()) if k in HANDLERS}


def transaction_version(broker: Any) -> int:
    """The finalized ``transaction.version`` of this broker (2 unless configured lower)."""
    return int(getattr(getattr(broker, "config", None), "transaction_version", 2))


def build_response(version: int, txn_version: int = 2) -> Any:
    cls = response_class(API_VERSIONS)
    keys = [cls.ApiVersion(api_key=k, min_version=lo, max_version=hi)
            for k, (lo, hi) in advertised().items()]
    extra: dict[str, Any] = {}
    if version >= 3:
        # v3 omits features whose minimum is 0 (ApiVersionsResponse.json); v4 lists them
        supported = [cls.SupportedFeatureKey(name="transaction.version", min_version=0,
                                             max_version=2)] if version >= 4 else []
        finalized = [cls.FinalizedFeatureKey(name="transaction.version",
                                             max_version_level=txn_version,
                                             min_version_level=txn_version)]
        extra = {"supported_features": supported, "finalized_features_epoch": FEATURES_EPOCH,
                 "finalized_features": finalized}
    return cls(version=version, error_code=0, api_keys=keys, throttle_time_ms=0, **extra)


@handler(API_VERSIONS)
async def api_versions(ctx: RequestContext, req: Any) -> Any:
    """v3+ requests carry client software name/version (KIP-511); we accept any value.

    Every client sends this first on every connection, so the encoded body is cached (it costs
    a few hundred microseconds to build)."""
    from ..server import EncodedBody  # noqa: PLC0415 - server imports the handlers

    key = (ctx.version, transaction_version(ctx.broker))
    body = _CACHE.get(key)
    if body is None:
        body = _CACHE[key] = EncodedBody(build_response(*key).encode(version=ctx.version))
    return body
