"""The Upper Layer's wire formats: PDU and DIMSE command codecs and their constants.

Owns the protocol constants (the Application Context Name, segnode's Implementation Class UID
and version name, PDU types of PS3.8 §9.3, DIMSE command fields and statuses of PS3.7 §E.1),
the size limits a PDU or message is checked against (:data:`MAX_ASSOCIATE_RQ`,
:data:`MAX_COMMAND_BYTES`, :data:`MIN_FRAGMENT_COST`), the command-set codec
(:func:`encode_command`, :func:`decode_command`), PDV iteration and cost, the presentation
context check of an A-ASSOCIATE-RQ and the PDUs the acceptor sends (:func:`pdata_pdus`,
:func:`abort_pdu`, :func:`reject_pdu`, :data:`RELEASE_RQ_PDU`, :data:`RELEASE_RP_PDU`).
The A-ASSOCIATE-RQ/AC codecs are pynetdicom's.

Must not touch: sockets, time, threads or the state machine: functions of bytes to bytes (or
to values), which raise :class:`~segnode.node.dicom.ul_types.ProtocolError` on malformed
input; what to do about it is :mod:`segnode.node.dicom.ul_association`'s.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator

from pynetdicom.presentation import PresentationContext

from segnode.node.dicom.ul_types import ProtocolError

#: The DICOM Application Context Name (PS3.7 Annex A.2.1).
APPLICATION_CONTEXT_NAME = "1.2.840.10008.3.1.1.1"
#: segnode's Implementation Class UID (a UUID-derived UID, PS3.5 §B.2) and version name.
IMPLEMENTATION_CLASS_UID = "2.25.10026610226874283191782567681120315047"
IMPLEMENTATION_VERSION = "SEGNODE_0.1"
VERIFICATION = "1.2.840.10008.1.1"

# PDU types (PS3.8 §9.3)
ASSOCIATE_RQ, ASSOCIATE_AC, ASSOCIATE_RJ = 0x01, 0x02, 0x03
P_DATA_TF, RELEASE_RQ, RELEASE_RP, ABORT = 0x04, 0x05, 0x06, 0x07

# DIMSE command fields and elements (PS3.7 §E.1)
C_STORE_RQ, C_ECHO_RQ, C_CANCEL_RQ = 0x0001, 0x0030, 0x0FFF
NO_DATASET = 0x0101
UNRECOGNISED_OPERATION = 0x0211
SOP_CLASS_NOT_SUPPORTED = 0x0122

#: The largest A-ASSOCIATE-RQ accepted (a real one is a few kB; 256 contexts fit in 64 kB).
MAX_ASSOCIATE_RQ = 256 << 10
#: The largest DIMSE command set accepted (a real one is under 1 kB).
MAX_COMMAND_BYTES = 64 << 10
#: What a PDV counts against its message's limit at least: each fragment costs a memoryview
#: and a list slot besides its wire bytes, so a message of tiny fragments must not cost more
#: memory than its limit allows (a sender fragments to the maximum PDU length, kilobytes).
MIN_FRAGMENT_COST = 1 << 10


# -- encoding helpers ------------------------------------------------------------------------


def _command_element(element: int, value: bytes) -> bytes:
    if len(value) % 2:
        value += b"\x00"
    return struct.pack("<HHI", 0x0000, element, len(value)) + value


def _us(value: int) -> bytes:
    return struct.pack("<H", value)


def encode_command(elements: Iterable[tuple[int, bytes]]) -> bytes:
    """Encode a DIMSE command set (implicit VR little endian, group 0000)."""
    body = b"".join(_command_element(e, v) for e, v in sorted(elements))
    return _command_element(0x0000, struct.pack("<I", len(body))) + body


def decode_command(data: bytes | memoryview) -> dict[int, bytes]:
    """Decode a command set into {element: value bytes}; raises ProtocolError if malformed."""
    out: dict[int, bytes] = {}
    view = memoryview(data)
    offset, end = 0, len(view)
    while offset < end:
        if end - offset < 8:
            raise ProtocolError("truncated command element", 0x06)
        group, element, length = struct.unpack_from("<HHI", view, offset)
        offset += 8
        if group != 0x0000 or length > end - offset:
            raise ProtocolError("malformed command set", 0x06)
        out[element] = bytes(view[offset : offset + length])
        offset += length
    return out


def _text(value: bytes | None) -> str:
    return (value or b"").rstrip(b"\x00 ").decode("ascii", "replace").strip()


def _uint16(value: bytes | None, default: int = 0) -> int:
    return struct.unpack("<H", value[:2])[0] if value and len(value) >= 2 else default


def pdv_headers(body: memoryview) -> Iterator[tuple[int, int, int]]:
    """Check the PDV items of a P-DATA-TF body (PS3.8 §9.3.5.1) one at a time and yield each
    one's context ID, control header and value length; :class:`ProtocolError` (0x06) at the
    first whose length does not fit the PDU, or for a PDU without any (the acceptor and the
    requestor both read PDVs through it, then :func:`_each_pdv`)."""
    offset, end = 0, len(body)
    if end < 6:
        raise ProtocolError("P-DATA-TF without a PDV", 0x06)
    while offset < end:
        if end - offset < 6:
            raise ProtocolError("truncated PDV", 0x06)
        (length,) = struct.unpack_from(">I", body, offset)
        if length < 2 or length > end - offset - 4:
            raise ProtocolError("invalid PDV length", 0x06)
        yield body[offset + 4], body[offset + 5], length - 2
        offset += 4 + length


def _each_pdv(body: memoryview) -> Iterator[tuple[int, int, memoryview]]:
    """The PDVs of a checked P-DATA-TF body: (context ID, control header, value)."""
    offset, end = 0, len(body)
    while offset < end:
        (length,) = struct.unpack_from(">I", body, offset)
        yield body[offset + 4], body[offset + 5], body[offset + 6 : offset + 4 + length]
        offset += 4 + length


def _fragment_cost(value: memoryview) -> int:
    """What a PDV counts against its message's limit: its bytes on the wire (value and the
    6-byte PDV header), at least :data:`MIN_FRAGMENT_COST`."""
    return max(len(value) + 6, MIN_FRAGMENT_COST)


def _gather(
    parts: list[memoryview], size: int, value: memoryview, limit: int, what: str, reason: int
) -> int:
    """Add one PDV's ``value`` to a message's ``parts``; return the message's size so far as
    the limit counts it (:func:`_fragment_cost`: wire bytes, at least ``MIN_FRAGMENT_COST`` a
    fragment).

    Raises
    ------
    ProtocolError
        The size passes ``limit`` (0: none); the association is aborted with ``reason``.
    """
    if value:
        parts.append(value)
    size += _fragment_cost(value)
    if limit and size > limit:
        raise ProtocolError(
            f"{what} over {limit} bytes (PDV headers included, "
            f"at least {MIN_FRAGMENT_COST} a fragment)",
            reason,
        )
    return size


def _context_fault(contexts: Iterable[PresentationContext]) -> str:
    """What makes a decoded A-ASSOCIATE-RQ's presentation contexts invalid, "" if nothing: each
    item has one abstract syntax and at least one transfer syntax (PS3.8 §9.3.2.2), and an ID
    names one context (the A-ASSOCIATE-AC answers each ID once, §9.3.3.2); a request has
    one or more of them (§9.3.2)."""
    seen: set[int | None] = set()
    for cx in contexts:
        if not cx.abstract_syntax:
            return f"presentation context {cx.context_id} without an abstract syntax"
        if not cx.transfer_syntax:
            return f"presentation context {cx.context_id} without a transfer syntax"
        if cx.context_id in seen:
            return f"presentation context ID {cx.context_id} proposed twice"
        seen.add(cx.context_id)
    if not seen:
        return "no presentation context proposed"
    return ""


def pdata_pdus(context_id: int, command: bytes, max_pdu: int) -> list[bytes]:
    """P-DATA-TF PDU(s) carrying a command set, split to the peer's maximum PDU length."""
    room = len(command) if max_pdu == 0 else max(1, max_pdu - 6)
    pdus = []
    for start in range(0, len(command), room):
        piece = command[start : start + room]
        control = 0x01 | (0x02 if start + room >= len(command) else 0x00)
        pdv = struct.pack(">IBB", len(piece) + 2, context_id, control) + piece
        pdus.append(struct.pack(">BBI", P_DATA_TF, 0, len(pdv)) + pdv)
    return pdus


def abort_pdu(source: int = 0x02, reason: int = 0x00) -> bytes:
    """An A-ABORT PDU (PS3.8 §9.3.8) with its ``source`` and ``reason``."""
    return struct.pack(">BBIBBBB", ABORT, 0, 4, 0, 0, source, reason)


def reject_pdu(result: int, source: int, diagnostic: int) -> bytes:
    """An A-ASSOCIATE-RJ PDU (PS3.8 §9.3.4) with its ``result``, ``source`` and
    ``diagnostic``."""
    return struct.pack(">BBIBBBB", ASSOCIATE_RJ, 0, 4, 0, result, source, diagnostic)


RELEASE_RQ_PDU = struct.pack(">BBII", RELEASE_RQ, 0, 4, 0)
RELEASE_RP_PDU = struct.pack(">BBII", RELEASE_RP, 0, 4, 0)
