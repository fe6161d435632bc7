"""Caches: LogCache (hot tail, FIFO, bounded) and BlockCache (cold reads, LRU, readahead)."""
from .block_cache import BlockCache
from .log_cache import CacheEntry, LogCache

__all__ = ["BlockCache", "CacheEntry", "LogCache"]
