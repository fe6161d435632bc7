"""Pure Kafka wire protocol: no I/O, no asyncio.

The broker imports only this package (never ``kafka.*``); see docs/CONTRACTS.md and
docs/protocol.md.
"""
from .apis import SUPPORTED_APIS, api_name, is_flexible, request_class, response_class
from .errors import (
    CorruptRecordError, ErrorCode, MalformedRequestError, ProtocolError,
    UnknownApiError, UnsupportedCompressionError, UnsupportedVersionError,
)
from .frames import (
    RequestHeader, api_versions_fallback, build_api_versions_response, decode_body,
    encode_response, encode_response_parts, parse_header, parse_request,
)

__all__ = [
    "SUPPORTED_APIS", "api_name", "is_flexible", "request_class", "response_class",
    "CorruptRecordError", "ErrorCode", "MalformedRequestError", "ProtocolError",
    "UnknownApiError", "UnsupportedCompressionError", "UnsupportedVersionError",
    "RequestHeader", "api_versions_fallback", "build_api_versions_response", "decode_body",
    "encode_response", "encode_response_parts", "parse_header", "parse_request",
]
