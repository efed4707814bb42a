"""What the outbox puts on the wire besides the protocol: the presentation contexts it
proposes and a result file's data set, as stored or encoded again in another transfer syntax.

Each storage SOP class the outbox sends is proposed with Explicit VR Little Endian (the result
files' own transfer syntax) and with Implicit VR Little Endian (the fallback), then
Verification (:func:`proposed_contexts`). :func:`dataset_offset` finds where a PS3.10 file's
data set starts, so that it is sent as the bytes the worker wrote; :func:`encode_dataset`
decodes and encodes it again only for a destination that accepted the other transfer syntax.

Must not touch: the ledger, associations and what is sent where and when, which are
:mod:`segnode.node.outbox.scu`'s; the result objects' content, which is
:mod:`segnode.node.results`'s. Nothing here writes a file.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

from pydicom import dcmread
from pydicom.errors import InvalidDicomError
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import write_dataset
from pydicom.uid import (
    Comprehensive3DSRStorage,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    KeyObjectSelectionDocumentStorage,
    SegmentationStorage,
)

from segnode.node.dicom.ul_pdu import VERIFICATION
from segnode.node.results.build import LABEL_MAP_SEGMENTATION_STORAGE

#: The storage SOP classes the outbox sends.
STORAGE_CLASSES = (
    SegmentationStorage,
    LABEL_MAP_SEGMENTATION_STORAGE,
    Comprehensive3DSRStorage,
    KeyObjectSelectionDocumentStorage,
)


def proposed_contexts() -> list[tuple[str, tuple[str, ...]]]:
    """The presentation contexts the outbox proposes (abstract syntax, transfer syntaxes).

    Each storage SOP class is proposed in two presentation contexts, Explicit VR Little Endian
    (the result files' own transfer syntax, sent as they are) and Implicit VR Little Endian
    (the fallback, re-encoded), so that a destination supporting both accepts the first rather
    than choosing Implicit from a single context (PS3.8 §9.3.2.2); then Verification.
    """
    contexts: list[tuple[str, tuple[str, ...]]] = []
    for cls in STORAGE_CLASSES:
        contexts.append((cls, (ExplicitVRLittleEndian,)))
        contexts.append((cls, (ImplicitVRLittleEndian,)))
    contexts.append((VERIFICATION, (ImplicitVRLittleEndian, ExplicitVRLittleEndian)))
    return contexts


#: Value representations whose length is a 32-bit field after two reserved bytes (PS3.5 §7.1.2).
_LONG_VRS = frozenset(
    {b"OB", b"OD", b"OF", b"OL", b"OV", b"OW", b"SQ", b"SV", b"UC", b"UN", b"UR", b"UT", b"UV"}
)


def dataset_offset(f: BinaryIO) -> int:
    """Where the data set of a PS3.10 file starts: after the 128-byte preamble, ``DICM`` and
    the File Meta Information (group 0002, Explicit VR Little Endian, PS3.10 §7.1), walked
    element by element.

    Raises
    ------
    InvalidDicomError
        The file has no PS3.10 preamble.
    """
    f.seek(0)
    head = f.read(132)
    if len(head) < 132 or head[128:132] != b"DICM":
        raise InvalidDicomError("not a PS3.10 file (no DICM prefix)")
    offset = 132
    while True:
        f.seek(offset)
        tag = f.read(8)
        if len(tag) < 8 or struct.unpack_from("<H", tag)[0] != 0x0002:
            return offset
        if tag[4:6] in _LONG_VRS:
            extra = f.read(4)
            if len(extra) < 4:
                raise InvalidDicomError("File Meta Information truncated")
            offset += 12 + struct.unpack("<I", extra)[0]
        else:
            offset += 8 + struct.unpack_from("<H", tag, 6)[0]


def encode_dataset(path: str | Path, syntax: str) -> bytes:
    """The data set of the file at ``path`` encoded again in ``syntax`` (Implicit or Explicit
    VR Little Endian), without its File Meta Information."""
    ds = dcmread(path)
    fp = DicomBytesIO()
    fp.is_little_endian = True
    fp.is_implicit_VR = syntax == ImplicitVRLittleEndian
    write_dataset(fp, ds)
    return bytes(fp.getvalue())


__all__ = ["dataset_offset", "encode_dataset", "proposed_contexts"]
