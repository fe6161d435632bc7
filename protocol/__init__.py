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
    encode_response, encode_response_buffers, encode_response_parts, parse_header, parse_request,
    parse_response, unsupported_version_response,
)
from .batches import (
    CRC_START, HEADER_SIZE, BatchView, compute_crc, count_offsets, fill_max_timestamp,
    iter_batches, record_timestamps,
    rewrite_crc, set_base_offset, set_log_append_time, set_partition_leader_epoch,
    validate_batch,
)
from .compression import CODEC_NAMES, GZIP, LZ4, SNAPPY, ZSTD, compress, decompress
from .legacy import build_message_set, convert_legacy, down_convert, is_legacy
from .records import Record, build_batch, decode_batches, decode_records, has_keyless_record

COMPRESSION_NONE = 0

__all__ = [
    "SUPPORTED_APIS", "api_name", "is_flexible", "request_class", "response_class",
    "CorruptRecordError", "ErrorCode", "MalformedRequestError", "ProtocolError",
    "UnknownApiError", "UnsupportedCompressionError", "UnsupportedVersionError",
    "RequestHeader", "api_versions_fallback", "build_api_versions_response", "decode_body",
    "encode_response", "encode_response_buffers", "encode_response_parts", "parse_header",
    "parse_request", "parse_response", "unsupported_version_response",
    "CRC_START", "HEADER_SIZE", "BatchView", "compute_crc", "count_offsets", "fill_max_timestamp",
    "iter_batches",
    "record_timestamps", "rewrite_crc", "set_base_offset", "set_log_append_time",
    "set_partition_leader_epoch", "validate_batch", "CODEC_NAMES", "GZIP", "LZ4", "SNAPPY",
    "ZSTD", "COMPRESSION_NONE", "compress", "decompress", "build_message_set",
    "convert_legacy", "down_convert", "is_legacy", "Record", "build_batch", "decode_batches",
    "decode_records", "has_keyless_record",
]
