"""Servers the project starts itself (demo, tests, benchmarks): embedded PostgreSQL, a Kafka-protocol broker."""
