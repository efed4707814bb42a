"""The DICOM protocol layer: the Upper Layer acceptor and its PS3.8 state machine, TLS, the
association guards and rejections, and the header parser. It owns bytes on the wire and
association limits; it must not touch the ledger, the spool or series state.
"""
