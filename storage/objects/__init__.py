"""Object format and object stores (file://, s3://, mem://)."""
from .format import CorruptObjectError, IndexEntry, Record, StreamRange, decode_block, \
    decode_footer, decode_index, decode_object, encode_object
from .store import ObjectNotFound, ObjectStore, ObjectStoreError, open_object_store

__all__ = ["CorruptObjectError", "IndexEntry", "Record", "StreamRange", "decode_block",
           "decode_footer", "decode_index", "decode_object", "encode_object", "ObjectNotFound",
           "ObjectStore", "ObjectStoreError", "open_object_store"]
