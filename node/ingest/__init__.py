"""Ingest: the Storage SCP (write, record, reply), streaming decode into the series' slabs, volume
assembly, series completion and sender patterns. It owns what arrives until a series is
complete; it must not run inference or send results.
"""
