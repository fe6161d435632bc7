"""Stream storage engine: Delta WAL, caches, object store. Knows nothing of Kafka requests."""
