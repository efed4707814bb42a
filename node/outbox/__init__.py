"""The outbox: delivering the stored result files to their destinations (DIMSE C-STORE over kept-
open associations, DICOMweb STOW-RS), with retries and circuit breakers. It owns deliveries; it
must not encode results.
"""
