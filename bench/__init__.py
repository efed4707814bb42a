"""Benchmarks and benchmark models (not installed with the node)."""
