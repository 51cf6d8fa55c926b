"""Benchmarks for hvdmagic; each script runs with one command, see docs/performance.md."""
