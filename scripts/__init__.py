"""Operational scripts: crash harness, outage scenario (run with ``python -m scripts.NAME``)."""
