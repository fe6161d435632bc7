"""Pure Kafka wire protocol: no I/O, no asyncio."""
