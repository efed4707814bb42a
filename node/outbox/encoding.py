"""What the outbox puts on the wire besides the protocol: the presentation contexts it
proposes and a result file's data set, as stored or encoded again in another transfer syntax.

Each storage SOP class the outbox sends is proposed with Explicit VR Little Endian (the result
files' own transfer syntax) and with Implicit VR Little Endian (the fallback), then
Verification (:func:`proposed_contexts`); the Segmentation classes first also with Deflated
Explicit VR Little Endian, the SEG's transfer syntax by default (``[results]
seg_transfer_syntax``). :func:`dataset_offset` finds where a PS3.10 file's data set starts, so
that it is sent as the bytes the worker wrote; :func:`encode_dataset` encodes it again only for
a destination that accepted another transfer syntax: a deflated SEG is inflated for a
destination that takes Explicit VR Little Endian only (the inflated bytes are that data set,
nothing is decoded), decoded and encoded for one that takes Implicit VR Little Endian only;
:func:`explicit_file` is the inflated file for a STOW-RS server that refuses the deflated one.

Must not touch: the ledger, associations and what is sent where and when, which are
:mod:`segnode.node.outbox.scu`'s; the result objects' content, which is
:mod:`segnode.node.results`'s. Nothing here writes a file.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import BinaryIO

from pydicom import dcmread
from pydicom.errors import InvalidDicomError
from pydicom.filebase import DicomBytesIO
from pydicom.filereader import read_file_meta_info
from pydicom.filewriter import write_dataset, write_file_meta_info
from pydicom.uid import (
    Comprehensive3DSRStorage,
    DeflatedExplicitVRLittleEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    KeyObjectSelectionDocumentStorage,
    SegmentationStorage,
)

from segnode.node.dicom.ul_pdu import VERIFICATION
from segnode.node.results.build import LABEL_MAP_SEGMENTATION_STORAGE
from segnode.node.results.seg_deflate import deflate, inflate

#: The storage SOP classes the outbox sends.
STORAGE_CLASSES = (
    SegmentationStorage,
    LABEL_MAP_SEGMENTATION_STORAGE,
    Comprehensive3DSRStorage,
    KeyObjectSelectionDocumentStorage,
)


#: The Segmentation SOP classes, whose files may be deflated.
SEGMENTATION_CLASSES = (SegmentationStorage, LABEL_MAP_SEGMENTATION_STORAGE)


def proposed_contexts(*, deflated_seg: bool = True) -> list[tuple[str, tuple[str, ...]]]:
    """The presentation contexts the outbox proposes (abstract syntax, transfer syntaxes).

    Each storage SOP class is proposed in presentation contexts of one transfer syntax each,
    so that a destination supporting several accepts each rather than choosing one from a
    single context (PS3.8 §9.3.2.2): with ``deflated_seg`` the Segmentation classes first in
    Deflated Explicit VR Little Endian (the SEG files' own, sent as they are); then every class
    in Explicit VR Little Endian (the other result files', sent as they are, and the deflated
    SEG's fallback, inflated) and Implicit VR Little Endian (the last fallback, re-encoded);
    then Verification.
    """
    contexts: list[tuple[str, tuple[str, ...]]] = []
    for cls in STORAGE_CLASSES:
        if deflated_seg and cls in SEGMENTATION_CLASSES:
            contexts.append((cls, (DeflatedExplicitVRLittleEndian,)))
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
    """The data set of the file at ``path`` encoded again in ``syntax`` (Implicit, Explicit
    or Deflated Explicit VR Little Endian), without its File Meta Information.

    Between Explicit VR Little Endian and its deflated form the data set's bytes are inflated
    or deflated as they are; Implicit VR Little Endian is decoded and encoded by pydicom.

    Raises
    ------
    InvalidDicomError
        The file is not PS3.10, or its deflated data set does not inflate.
    """
    with open(path, "rb") as f:
        offset = dataset_offset(f)
        meta = read_file_meta_info(path)
        stored = str(meta.get("TransferSyntaxUID", ""))
        pair = {stored, syntax}
        if pair == {ExplicitVRLittleEndian, DeflatedExplicitVRLittleEndian}:
            f.seek(offset)
            data = f.read()
            if syntax == ExplicitVRLittleEndian:
                try:
                    return inflate(data)
                except zlib.error as exc:
                    raise InvalidDicomError(
                        f"the deflated data set does not inflate: {exc}"
                    ) from exc
            return deflate(data).stream
    ds = dcmread(path)
    fp = DicomBytesIO()
    fp.is_little_endian = True
    fp.is_implicit_VR = syntax == ImplicitVRLittleEndian
    write_dataset(fp, ds)
    data = bytes(fp.getvalue())
    return deflate(data).stream if syntax == DeflatedExplicitVRLittleEndian else data


def explicit_file(path: str | Path) -> bytes | None:
    """The PS3.10 file at ``path`` in Explicit VR Little Endian if it is deflated (its data
    set inflated, its File Meta Information naming Explicit VR Little Endian), else None:
    for a STOW-RS server that refuses the deflated SEG.

    Raises
    ------
    InvalidDicomError
        The file is not PS3.10, or its deflated data set does not inflate.
    """
    meta = read_file_meta_info(path)
    if str(meta.get("TransferSyntaxUID", "")) != DeflatedExplicitVRLittleEndian:
        return None
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    fp = DicomBytesIO()
    fp.is_little_endian, fp.is_implicit_VR = True, False
    with open(path, "rb") as f:
        fp.write(f.read(128))
    fp.write(b"DICM")
    write_file_meta_info(fp, meta, enforce_standard=True)
    return bytes(fp.getvalue()) + encode_dataset(path, ExplicitVRLittleEndian)


__all__ = [
    "SEGMENTATION_CLASSES",
    "dataset_offset",
    "encode_dataset",
    "explicit_file",
    "proposed_contexts",
]
