"""The asyncio Kafka-protocol server: connections, handlers, partitions, groups, metadata, CLI."""
