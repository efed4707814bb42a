"""Read what the node needs from a received dataset without touching its pixels.

The C-STORE handler gets the dataset as the peer encoded it. We parse the elements before
Pixel Data (UIDs, modality, manufacturer) and then check the Pixel Data element's framing
(declared length against the bytes that remain; for encapsulated data the sequence delimiter)
so that a truncated transfer is refused with a failure status rather than acknowledged.

A deflated dataset (PS3.5 §A.5) is inflated in bounded steps: a few megabytes of deflate can
expand to gigabytes, so inflating stops, and the dataset is refused, once its output passes the
node's instance size limit.
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset
from pydicom.filereader import read_dataset
from pydicom.tag import BaseTag
from pydicom.uid import (
    UID,
    DeflatedExplicitVRLittleEndian,
    ExplicitVRBigEndian,
    ImplicitVRLittleEndian,
)

SEQUENCE_DELIMITER = b"\xfe\xff\xdd\xe0\x00\x00\x00\x00"
PIXEL_TAGS = {0x7FE00010, 0x7FE00008, 0x7FE00009}
_LONG_VRS = {
    b"OB",
    b"OD",
    b"OF",
    b"OL",
    b"OV",
    b"OW",
    b"SQ",
    b"SV",
    b"UC",
    b"UN",
    b"UR",
    b"UT",
    b"UV",
}


#: Elements converted (and so validated) while the C-STORE is answered.
CHECKED = (
    "SOPClassUID",
    "SOPInstanceUID",
    "StudyInstanceUID",
    "SeriesInstanceUID",
    "Modality",
    "Manufacturer",
    "Rows",
    "Columns",
    "BitsAllocated",
    "SamplesPerPixel",
    "NumberOfFrames",
)


#: Bound on the inflated size of a deflated dataset when the caller gives none: the default
#: ``node.max_instance_mb``.
DEFAULT_MAX_INFLATED = 1024 * 2**20

#: Output of one inflate step; the bound is checked between steps.
_INFLATE_STEP = 16 * 2**20


class HeaderError(Exception):
    """The dataset cannot be understood (answer 0xC210 range)."""


class InflateLimitError(HeaderError):
    """A deflated dataset inflates past the size limit (answer 0xA700, out of resources)."""


@dataclass(frozen=True)
class Header:
    """The attributes the SCP needs, read from before Pixel Data."""

    dataset: Dataset
    has_pixel_data: bool
    #: Where native (defined-length) Pixel Data's value starts in the stream, and its length;
    #: None for encapsulated or absent pixel data, or a deflated stream.
    pixel_span: tuple[int, int] | None = None


def _stop_at_pixels(tag: BaseTag, _vr: str | None, _length: int) -> bool:
    return int(tag) in PIXEL_TAGS


class _ViewReader(io.RawIOBase):
    """A seekable read-only file over a buffer, without copying it (BytesIO would)."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        super().__init__()
        self._view = memoryview(data)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else self._pos + size
        out = bytes(self._view[self._pos : end])
        self._pos += len(out)
        return out

    def readinto(self, buffer: Any) -> int:
        out = self.read(len(buffer))
        buffer[: len(out)] = out
        return len(out)

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos


def parse_header(
    stream: bytes | memoryview,
    transfer_syntax: str,
    *,
    max_inflated: int = DEFAULT_MAX_INFLATED,
) -> Header:
    """Parse the non-pixel elements of an encoded dataset and check its framing.

    Parameters
    ----------
    stream
        The dataset as sent (no preamble or file meta).
    transfer_syntax
        The negotiated transfer syntax UID.
    max_inflated
        Most bytes a deflated dataset may inflate to (the node's instance size limit).

    Raises
    ------
    InflateLimitError
        If a deflated dataset inflates past ``max_inflated`` bytes.
    HeaderError
        If the elements cannot be parsed or Pixel Data is truncated.
    """
    implicit = transfer_syntax == ImplicitVRLittleEndian
    little = transfer_syntax != ExplicitVRBigEndian
    data: bytes | bytearray | memoryview = stream
    _check_vr_encoding(stream, transfer_syntax, implicit)
    if transfer_syntax == DeflatedExplicitVRLittleEndian:
        data = inflate(stream, max_inflated)
    fp = _ViewReader(data)
    try:
        ds = read_dataset(cast(BinaryIO, fp), implicit, little, stop_when=_stop_at_pixels)
        _check_value_lengths(ds)
        # Convert the elements the SCP and the framing check read, so that a malformed value
        # of one of them fails here. The others stay raw (converting all of them cost ~1 ms
        # per instance); a malformed one fails the job later, with its reason.
        for keyword in CHECKED:
            _ = ds.get(keyword)
    except HeaderError:
        raise
    except Exception as exc:  # pydicom raises many types on garbage  # noqa: BLE001
        raise HeaderError(f"dataset cannot be parsed: {type(exc).__name__}: {exc}") from exc
    pos = fp.tell()
    length, start = _check_pixel_framing(data, pos, implicit, little)
    if length is not None:
        encapsulated = UID(transfer_syntax).is_encapsulated
        if encapsulated != (length == 0xFFFFFFFF):
            raise HeaderError(
                f"{'native' if encapsulated else 'encapsulated'} Pixel Data on a presentation "
                f"context negotiated for {UID(transfer_syntax).name}"
            )
    if length is not None and length != 0xFFFFFFFF:
        expected = _native_length(ds)
        if expected is not None and length < expected:
            raise HeaderError(
                f"Pixel Data holds {length} bytes but Rows x Columns x frames needs {expected} "
                "(truncated)"
            )
    native = (
        length is not None
        and length != 0xFFFFFFFF
        and data is stream
        and bytes(data[pos : pos + 4]) in (b"\xe0\x7f\x10\x00", b"\x7f\xe0\x00\x10")
    )
    span = (start, int(length)) if native and length is not None else None
    return Header(dataset=ds, has_pixel_data=length is not None, pixel_span=span)


def inflate(stream: bytes | memoryview, limit: int) -> bytearray:
    """Inflate a Deflated Explicit VR Little Endian dataset (raw deflate, PS3.5 §A.5) in
    steps of at most ``_INFLATE_STEP`` bytes, stopping as soon as the output passes ``limit``.

    Raises
    ------
    InflateLimitError
        If the dataset inflates to more than ``limit`` bytes.
    HeaderError
        If the stream is not valid deflate or ends before its last block.
    """
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    out = bytearray()
    pending: bytes | memoryview = stream
    try:
        while True:
            chunk = inflater.decompress(pending, min(_INFLATE_STEP, limit + 1 - len(out)))
            out += chunk
            if len(out) > limit:
                # (Short: it is the Error Comment, an LO of 64 characters.)
                raise InflateLimitError(
                    f"deflated dataset inflates past the {limit / 2**20:g} MiB instance limit"
                )
            pending = inflater.unconsumed_tail
            # Input left, or output the last step had no room for: go on.
            if inflater.eof or not (pending or chunk):
                break
    except zlib.error as exc:
        raise HeaderError(f"deflated dataset cannot be inflated: {exc}") from exc
    if not inflater.eof:
        raise HeaderError("deflated dataset cannot be inflated: the deflate stream is truncated")
    return out


#: Value Representations (PS3.5 §6.2), to tell explicit from implicit VR encoding.
_VRS = frozenset(
    b"AE AS AT CS DA DS DT FD FL IS LO LT OB OD OF OL OV OW PN SH SL SQ SS ST SV TM UC UI UL UN "
    b"UR US UT UV".split()
)


def _check_vr_encoding(stream: bytes | memoryview, transfer_syntax: str, implicit: bool) -> None:
    """The first element's encoding must be the negotiated transfer syntax's (explicit VR
    has a VR where implicit VR has the low bytes of a length)."""
    if len(stream) < 8 or transfer_syntax in (DeflatedExplicitVRLittleEndian, ExplicitVRBigEndian):
        return
    if bytes(stream[0:2]) != b"\x08\x00":
        return  # judged only on the usual first group (0008), where the two encodings differ
    has_vr = bytes(stream[4:6]) in _VRS
    if implicit and has_vr:
        raise HeaderError(
            "dataset is in explicit VR on a context negotiated for Implicit VR Little Endian"
        )
    if not implicit and not has_vr:
        raise HeaderError(f"dataset is not in explicit VR as {UID(transfer_syntax).name} requires")


def _check_value_lengths(ds: Dataset) -> None:
    """Each top-level element before Pixel Data must hold the bytes its length declares
    (pydicom reads a value that runs past the end of the stream short, without an error)."""
    for tag in ds.keys():  # noqa: SIM118 (iterating ds converts every element)
        elem = ds.get_item(tag)
        if not isinstance(elem, RawDataElement) or elem.length == 0xFFFFFFFF:
            continue
        value = elem.value
        if value is not None and len(value) < elem.length:
            raise HeaderError(
                f"element {tag} declares {elem.length} bytes but only {len(value)} arrived "
                "(truncated)"
            )


def _native_length(ds: Dataset) -> int | None:
    """Bytes that native (uncompressed) Pixel Data must hold, or None if unknown."""
    try:
        rows, cols = int(ds.Rows), int(ds.Columns)
        bits = int(ds.BitsAllocated)
        spp = int(ds.get("SamplesPerPixel", 1) or 1)
        frames = int(ds.get("NumberOfFrames", 1) or 1)
    except (AttributeError, TypeError, ValueError):
        return None
    if bits == 1:
        return (rows * cols * spp * frames + 7) // 8
    return rows * cols * spp * frames * (bits // 8)


def _check_pixel_framing(
    data: bytes | bytearray | memoryview, pos: int, implicit: bool, little: bool
) -> tuple[int | None, int]:
    """Check the Pixel Data element's framing; return its declared length (None: absent) and
    where its value starts."""
    remaining = len(data) - pos
    if remaining == 0:
        return None, pos
    if remaining < 8:
        raise HeaderError("dataset ends inside an element header")
    end = "<" if little else ">"
    group, elem = struct.unpack_from(f"{end}HH", data, pos)
    tag = (group << 16) | elem
    if tag not in PIXEL_TAGS:
        raise HeaderError(f"unexpected element ({group:04X},{elem:04X}) at the pixel data position")
    if implicit:
        (length,) = struct.unpack_from(f"{end}I", data, pos + 4)
        start = pos + 8
    else:
        vr = bytes(data[pos + 4 : pos + 6])
        if vr in _LONG_VRS:
            if remaining < 12:
                raise HeaderError("dataset ends inside the Pixel Data header")
            (length,) = struct.unpack_from(f"{end}I", data, pos + 8)
            start = pos + 12
        else:
            (length,) = struct.unpack_from(f"{end}H", data, pos + 6)
            start = pos + 8
    if length == 0xFFFFFFFF:
        # Encapsulated (PS3.5 §A.4): items then a Sequence Delimitation Item.
        trailer = bytes(data[-8:])
        if trailer != SEQUENCE_DELIMITER and not _delimited_before_trailer(data, start):
            raise HeaderError("encapsulated Pixel Data has no sequence delimiter (truncated)")
        return int(length), start
    if start + length > len(data):
        raise HeaderError(
            f"Pixel Data declares {length} bytes but only {len(data) - start} arrived (truncated)"
        )
    return int(length), start


def _delimited_before_trailer(data: bytes | bytearray | memoryview, start: int) -> bool:
    """Walk encapsulated items; True if a sequence delimiter is reached inside ``data``."""
    pos = start
    while pos + 8 <= len(data):
        group, elem, length = struct.unpack_from("<HHI", data, pos)
        if (group, elem) == (0xFFFE, 0xE0DD):
            return True
        if (group, elem) != (0xFFFE, 0xE000):
            return False
        pos += 8 + length
    return False
