"""Results: the DICOM SEG and TID 1500 SR (highdicom reference build, fast encoders, their checks)
and the segment statistics. It owns the bytes of every result object; it must not touch the
ledger or the network.
"""
