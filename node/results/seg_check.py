"""Check a SEG encoded by :mod:`segnode.node.results.seg_encode` before it leaves, in milliseconds.

:func:`check_encoded` reads the produced bytes back with its own Explicit VR Little Endian
walker (PS3.5 7.1, 7.5) and checks what the fast path could get wrong:

* every length field: the elements must tile the file exactly, in ascending tag order;
* the file meta and every element that does not depend on the labels equal the prepared ones;
* Number of Frames equals the Per-Frame Functional Groups items and the Pixel Data length;
* the Segment Sequence describes segments 1..n (plus Background 0 for LABELMAP), each the
  prepared description of a manifest label, labels in ascending value;
* per frame: its Plane Position is a slice position of the volume (within 0.01 mm), its
  Derivation Image Sequence references that slice's source instance (and frame), its
  Dimension Index Values and Segment Identification agree with its segment and slice, and
  frames come in highdicom's order (segment, then position along the normal);
* the Pixel Data equals the label map: a BINARY frame equals, bit for bit, the voxels of its
  slice that hold its segment's label value (computed from bit planes of the label map, not
  as the encoder computes it), a LABELMAP frame the slice's segment numbers; and together
  the frames hold every labelled voxel (no frame missing, no value left undescribed).

The Segment Sequence items, Derivation Image and Plane Position items are compared with the
plan's prepared bytes; the prepared Plane Positions and source references of the slices in
use are decoded and compared with the volume's geometry and sources.

A deflated SEG (Deflated Explicit VR Little Endian, PS3.5 A.5) is checked on the data set the
encoder deflated (:attr:`~segnode.node.results.seg_encode.EncodedSeg.plain`), and its
deflate stream against it without a full inflate
(:func:`segnode.node.results.seg_deflate.check_blocks`: the joins of the parallel blocks, the
start of every block and the end of the stream); without that data set the stream is inflated
whole first.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import numpy.typing as npt
from pydicom.datadict import keyword_for_tag

from segnode.node.pipeline.parallel import map_blocks
from segnode.node.results.build import POSITION_TOLERANCE_MM, ResultError
from segnode.node.results.seg_deflate import check_blocks, inflate
from segnode.node.results.seg_encode import EncodedSeg, SegPlan
from segnode.node.results.seg_header import (
    Tag,
    item_header,
    long_header,
    short_element,
)

#: Slices whose bit planes :func:`_check_bit_planes` computes at once (4 MiB of label
#: copies and under 4 MiB of planes for 512 x 512 slices).
_RUN = 16

# VRs with a 4-byte length field (PS3.5 Table 7.1-1)
_LONG_VRS = frozenset(
    {b"OB", b"OD", b"OF", b"OL", b"OV", b"OW", b"SQ", b"SV", b"UC", b"UN", b"UR", b"UT", b"UV"}
)
_ITEM, _ITEM_END, _SEQUENCE_END = 0xFFFEE000, 0xFFFEE00D, 0xFFFEE0DD
_VARIABLE = frozenset(
    {
        Tag.NUMBER_OF_FRAMES,
        Tag.DIMENSION_ORGANIZATION_TYPE,
        Tag.SEGMENT_SEQUENCE,
        Tag.SHARED_FUNCTIONAL_GROUPS,
        Tag.PER_FRAME_FUNCTIONAL_GROUPS,
        Tag.PIXEL_DATA,
    }
)

Element = tuple[int, int, int, int]


class _Malformed(Exception):
    """The bytes do not parse; the message says where."""


def _name(tag: int) -> str:
    return keyword_for_tag(tag) or f"({tag >> 16:04X},{tag & 0xFFFF:04X})"


def _tag(buf: memoryview, pos: int) -> int:
    group, element = struct.unpack_from("<HH", buf, pos)
    return int(group) << 16 | int(element)


def elements(buf: memoryview, pos: int, end: int) -> list[Element]:
    """The data elements between ``pos`` and ``end`` (one dataset level)."""
    out = []
    while pos < end:
        if pos + 8 > end:
            raise _Malformed(f"element header at byte {pos} runs past {end}")
        tag = _tag(buf, pos)
        vr = bytes(buf[pos + 4 : pos + 6])
        if vr in _LONG_VRS:
            if pos + 12 > end:
                raise _Malformed(f"element {_name(tag)} at byte {pos} runs past {end}")
            (length,) = struct.unpack_from("<I", buf, pos + 8)
            start = pos + 12
        else:
            (length,) = struct.unpack_from("<H", buf, pos + 6)
            start = pos + 8
        if length == 0xFFFFFFFF:
            if vr != b"SQ":
                raise _Malformed(f"{_name(tag)} at byte {pos} has an undefined length")
            stop, after = _undefined_sequence(buf, start, end)
        else:
            stop = after = start + length
        if after > end:
            raise _Malformed(f"{_name(tag)} at byte {pos} ({length} bytes) runs past {end}")
        out.append((tag, pos, start, stop))
        pos = after
    return out


def _undefined_sequence(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """End of the items of an undefined-length sequence and the position after its
    delimiter (PS3.5 7.5.2)."""
    while pos + 8 <= end:
        tag = _tag(buf, pos)
        (length,) = struct.unpack_from("<I", buf, pos + 4)
        if tag == _SEQUENCE_END:
            return pos, pos + 8
        if tag != _ITEM:
            raise _Malformed(f"expected an item at byte {pos}")
        if length == 0xFFFFFFFF:
            pos += 8
            while True:
                if pos + 8 > end:
                    raise _Malformed("undefined-length item runs past the end")
                if _tag(buf, pos) == _ITEM_END:
                    pos += 8
                    break
                pos = _element_end(buf, pos, end)
        else:
            pos += 8 + length
    raise _Malformed("sequence delimiter missing")


def _element_end(buf: memoryview, pos: int, end: int) -> int:
    """End of the one element starting at ``pos`` (for walking undefined-length items)."""
    vr = bytes(buf[pos + 4 : pos + 6])
    if vr in _LONG_VRS:
        (length,) = struct.unpack_from("<I", buf, pos + 8)
        if length == 0xFFFFFFFF:
            return _undefined_sequence(buf, pos + 12, end)[1]
        return int(pos + 12 + length)
    return int(pos + 8 + struct.unpack_from("<H", buf, pos + 6)[0])


def items(buf: memoryview, start: int, end: int) -> list[tuple[int, int, int]]:
    """The defined-length items of a sequence value: (item start, value start, value end)."""
    out = []
    pos = start
    while pos < end:
        if pos + 8 > end or _tag(buf, pos) != _ITEM:
            raise _Malformed(f"expected an item at byte {pos}")
        (length,) = struct.unpack_from("<I", buf, pos + 4)
        if length == 0xFFFFFFFF or pos + 8 + length > end:
            raise _Malformed(f"item at byte {pos} has length {length:#x} past {end}")
        out.append((pos, pos + 8, pos + 8 + length))
        pos += 8 + length
    return out


def check_encoded(plan: SegPlan, encoded: EncodedSeg, labels: npt.NDArray[np.integer]) -> None:
    """Check that ``encoded.data`` is the SEG of ``labels`` that ``plan`` describes.

    Parameters
    ----------
    plan
        The plan that encoded it.
    encoded
        The result of ``plan.encode(labels)``; its frame arrays and segment numbers must
        agree with the bytes.
    labels
        The label map that was encoded.

    Raises
    ------
    ResultError
        Naming the first disagreement.
    """
    try:
        _check(plan, encoded, labels)
    except (_Malformed, struct.error, ValueError) as exc:  # ValueError: text that is no number
        raise ResultError(f"SEG check: the encoded bytes do not parse: {exc}") from exc


def _sequence(tag: int, item: bytes) -> bytes:
    """A sequence of one defined-length item."""
    return long_header(tag, b"SQ", len(item) + 8) + item_header(len(item)) + item


def _fail(message: str) -> ResultError:
    return ResultError(f"SEG check: {message}")


def _dataset(plan: SegPlan, encoded: EncodedSeg) -> tuple[memoryview, int]:
    """The buffer that holds the Explicit VR Little Endian data set and where it starts
    there, after the checks of the file meta and (deflated) of the deflate stream."""
    data = memoryview(encoded.data)
    if data[: len(plan.file_meta)] != plan.file_meta:
        raise _fail("preamble or file meta differ from the prepared ones")
    if encoded.deflated != plan.deflated:
        raise _fail(f"the SEG is in {encoded.transfer_syntax}, the plan's is another")
    if not plan.deflated:
        return data, len(plan.file_meta)
    stream = data[len(plan.file_meta) :]
    if encoded.plain is None:
        try:
            return memoryview(inflate(stream)), 0
        except zlib.error as exc:
            raise _fail(f"the deflated data set does not inflate: {exc}") from exc
    why = check_blocks(encoded.plain, stream, encoded.deflate_blocks)
    if why is not None:
        raise _fail(why)
    return memoryview(encoded.plain), 0


def _check(plan: SegPlan, encoded: EncodedSeg, labels: npt.NDArray[np.integer]) -> None:
    if labels.shape != plan.shape or not np.issubdtype(labels.dtype, np.integer):
        raise _fail(f"label map of {labels.dtype} {labels.shape} does not fit {plan.shape}")
    buf, start = _dataset(plan, encoded)
    top: dict[int, Element] = {}
    previous = -1
    for element in elements(buf, start, len(buf)):
        if element[0] <= previous:
            raise _fail(f"{_name(element[0])} follows {_name(previous)}: tags not ascending")
        previous = element[0]
        top[element[0]] = element
    for tag, expected in plan.fixed.items():
        if tag not in top or buf[top[tag][1] : top[tag][3]] != expected:
            raise _fail(f"{_name(tag)} differs from the prepared header")
    unexpected = set(top) - set(plan.fixed) - _VARIABLE
    missing = (_VARIABLE - {Tag.DIMENSION_ORGANIZATION_TYPE}) - set(top)
    if unexpected or missing:
        names = [_name(t) for t in sorted(unexpected | missing)]
        raise _fail(f"unexpected or missing elements {names}")

    def value(tag: int) -> memoryview:
        return buf[top[tag][2] : top[tag][3]]

    count = int(bytes(value(Tag.NUMBER_OF_FRAMES)).decode("ascii").strip())
    segments = _segments(plan, buf, top[Tag.SEGMENT_SEQUENCE])
    channels = 1 if plan.labelmap else len(segments)
    shared = plan.shared_single_segment if channels == 1 and not plan.labelmap else plan.shared
    if buf[top[Tag.SHARED_FUNCTIONAL_GROUPS][1] : top[Tag.SHARED_FUNCTIONAL_GROUPS][3]] != shared:
        raise _fail("Shared Functional Groups differ from the prepared ones")
    frame_segments, frame_slices = _frames(
        plan, buf, top[Tag.PER_FRAME_FUNCTIONAL_GROUPS], channels
    )
    if len(frame_slices) != count:
        raise _fail(f"Number of Frames {count}, {len(frame_slices)} per-frame items")
    if not (
        np.array_equal(frame_segments, encoded.frame_segments)
        and np.array_equal(frame_slices, encoded.frame_slices)
        and encoded.segment_numbers == {v: n for n, v in segments.items()}
    ):
        raise _fail("the frames or segment numbers reported do not match the bytes")
    if plan.labelmap:
        planes = frame_slices
    else:
        used = sorted(set(frame_segments.tolist()))
        if used != list(range(1, channels + 1)):
            raise _fail(f"frames use segments {used}, the SEG describes 1..{channels}")
        planes = np.unique(frame_slices)
    three_d = plan.is_3d(np.sort(planes), channels)
    has_type = Tag.DIMENSION_ORGANIZATION_TYPE in top
    if has_type != three_d or (has_type and bytes(value(Tag.DIMENSION_ORGANIZATION_TYPE)) != b"3D"):
        raise _fail("Dimension Organization Type does not match the frames' planes")
    flat = np.ascontiguousarray(labels).reshape(plan.shape[0], -1)
    _check_pixels(plan, value(Tag.PIXEL_DATA), frame_segments, frame_slices, segments, flat)


def _segments(plan: SegPlan, buf: memoryview, element: Element) -> dict[int, int]:
    """``{segment number: label value}`` from the Segment Sequence."""
    found = items(buf, element[2], element[3])
    if plan.labelmap:
        if not found or buf[found[0][0] : found[0][2]] != plan.background_item:
            raise _fail("LABELMAP Segment Sequence does not start with the Background segment")
        found = found[1:]
    if not found:
        raise _fail("the Segment Sequence is empty")
    values = sorted(plan.segment_items)
    out: dict[int, int] = {}
    candidate = 0
    for number, (start, _, end) in enumerate(found, start=1):
        item = buf[start:end]
        while candidate < len(values) and plan.segment_item(values[candidate], number) != item:
            candidate += 1
        if candidate == len(values):
            raise _fail(f"segment {number} is not the description of a manifest label in order")
        out[number] = values[candidate]
        candidate += 1
    return out


def _frames(
    plan: SegPlan, buf: memoryview, element: Element, channels: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Segment number and volume slice of every frame, checked against its items."""
    slice_of = {position: k for k, position in enumerate(plan.positions)}
    rank_of = np.empty(plan.shape[0], dtype=np.intp)
    rank_of[plan.plane_order] = np.arange(plan.shape[0])
    identification = {
        _sequence(
            Tag.SEGMENT_IDENTIFICATION_SEQUENCE,
            short_element(Tag.REFERENCED_SEGMENT_NUMBER, b"US", struct.pack("<H", n)),
        ): n
        for n in range(1, channels + 1)
    }
    with_identification = not plan.labelmap and channels > 1
    layout = [
        Tag.DERIVATION_IMAGE_SEQUENCE,
        Tag.FRAME_CONTENT_SEQUENCE,
        Tag.PLANE_POSITION_SEQUENCE,
    ]
    if with_identification:
        layout.append(Tag.SEGMENT_IDENTIFICATION_SEQUENCE)
    dims = 1 if plan.labelmap else 2
    content_prefix = _sequence(
        Tag.FRAME_CONTENT_SEQUENCE,
        short_element(Tag.DIMENSION_INDEX_VALUES, b"UL", b"\x00" * 4 * dims),
    )[: -4 * dims]
    unpack = struct.Struct(f"<{dims}I").unpack_from
    segments, slices, indices = [], [], []
    for i, (_, start, end) in enumerate(items(buf, element[2], element[3]), start=1):
        found = elements(buf, start, end)
        if [e[0] for e in found] != layout:
            raise _fail(f"frame {i} has functional groups {[_name(e[0]) for e in found]}")
        derivation, content, position = found[0], found[1], found[2]
        k = slice_of.get(bytes(buf[position[1] : position[3]]))
        if k is None:
            raise _fail(f"frame {i}: Plane Position is not the position of a volume slice")
        if buf[derivation[1] : derivation[3]] != plan.derivations[k]:
            raise _fail(f"frame {i}: Derivation Image Sequence is not slice {k}'s source")
        values = content[1] + len(content_prefix)
        if content[3] != values + 4 * dims or buf[content[1] : values] != content_prefix:
            raise _fail(f"frame {i}: malformed Frame Content (Dimension Index Values)")
        number = 0 if plan.labelmap else 1
        if with_identification:
            number = identification.get(bytes(buf[found[3][1] : found[3][3]]), -1)
            if number < 0:
                raise _fail(f"frame {i}: Segment Identification names no described segment")
        segments.append(number)
        slices.append(k)
        indices.append(unpack(buf, values))
    frame_segments = np.array(segments, dtype=np.intp)
    frame_slices = np.array(slices, dtype=np.intp)
    _check_geometry(plan, buf, np.unique(frame_slices))
    # highdicom's order: segment, then rank along the normal; dimension index values count it
    key = frame_segments * plan.shape[0] + rank_of[frame_slices]
    if len(key) and np.any(np.diff(key) <= 0):
        raise _fail("frames are not in (segment, position) order or repeat a plane")
    included = np.unique(rank_of[frame_slices])
    expected_rank = np.searchsorted(included, rank_of[frame_slices]) + 1
    got = np.array(indices, dtype=np.intp).reshape(len(indices), dims)
    if not np.array_equal(got[:, -1], expected_rank) or (
        dims == 2 and not np.array_equal(got[:, 0], frame_segments)
    ):
        raise _fail("Dimension Index Values do not count the frames' segments and planes")
    return frame_segments, frame_slices


def _check_geometry(plan: SegPlan, buf: memoryview, slices: npt.NDArray[np.intp]) -> None:
    """Each used slice's prepared Plane Position and source reference, decoded."""
    for k in slices.tolist():
        position = memoryview(plan.positions[k])
        (item,) = items(position, 12, len(position))
        (ipp,) = elements(position, item[1], item[2])
        text = bytes(position[ipp[2] : ipp[3]]).decode("ascii").strip(" \x00")
        values = np.array([float(v) for v in text.split("\\")])
        if values.shape != (3,) or np.max(np.abs(values - plan.slice_positions[k])) > (
            POSITION_TOLERANCE_MM
        ):
            raise _fail(f"slice {k} is written at {text}, not at {plan.slice_positions[k]}")
        derivation = memoryview(plan.derivations[k])
        (item,) = items(derivation, 12, len(derivation))
        source_sequence = elements(derivation, item[1], item[2])[0]
        (source,) = items(derivation, source_sequence[2], source_sequence[3])
        refs = {
            tag: bytes(derivation[start:stop]).decode("ascii").strip(" \x00")
            for tag, _, start, stop in elements(derivation, source[1], source[2])
            if tag in (0x00081155, 0x00081160)
        }
        if refs.get(0x00081155) != plan.source_uids[k] or (
            plan.source_frames and refs.get(0x00081160) != str(plan.source_frames[k])
        ):
            raise _fail(f"slice {k}'s frames reference {refs}, not its source")


def _check_pixels(
    plan: SegPlan,
    pixel_data: memoryview,
    frame_segments: npt.NDArray[np.intp],
    frame_slices: npt.NDArray[np.intp],
    segments: dict[int, int],
    flat: npt.NDArray[np.integer],
) -> None:
    """The frames equal the label map on their slices and hold every labelled voxel."""
    count, pixels = len(frame_slices), flat.shape[1]
    size = count * pixels if plan.labelmap else (count * pixels + 7) // 8
    if len(pixel_data) != size + size % 2:
        raise _fail(f"Pixel Data has {len(pixel_data)} bytes, {count} frames need {size}")
    data = np.frombuffer(pixel_data, dtype=np.uint8, count=size)
    if plan.labelmap:
        frames = data.reshape(count, pixels)
        renumbered = any(v != n for n, v in segments.items())
        for i, k in enumerate(frame_slices.tolist()):
            expected = flat[k]
            if renumbered:  # else the described values are 1..n, each its own number
                expected = np.zeros(pixels, dtype=np.uint8)
                for number, value in segments.items():
                    expected[flat[k] == value] = number
            if not np.array_equal(frames[i], expected):
                _mismatch(frames[i], expected, i, k, plan)
        if count and int(frames.max()) > max(segments):
            raise _fail("a frame holds a segment number the SEG does not describe")
        nonempty = np.flatnonzero(flat.any(axis=1))
        if not np.array_equal(np.sort(frame_slices), nonempty):
            raise _fail("the frames are not exactly the slices that hold labels")
        return
    if pixels % 8 == 0:
        _check_bit_planes(
            plan, data.reshape(count, -1), frame_segments, frame_slices, segments, flat
        )
        return
    bits = np.unpackbits(data, bitorder="little")[: count * pixels].reshape(count, pixels)
    for i, (n, k) in enumerate(zip(frame_segments.tolist(), frame_slices.tolist(), strict=True)):
        expected = flat[k] == segments[n]
        if not np.array_equal(bits[i].astype(np.bool_), expected):
            _mismatch(bits[i].astype(np.bool_), expected, i, k, plan)
    if _popcount(data) != int(np.count_nonzero(flat)):
        raise _fail("labelled voxels are missing from the frames (a frame is missing)")


def _check_bit_planes(
    plan: SegPlan,
    frames: npt.NDArray[np.uint8],
    frame_segments: npt.NDArray[np.intp],
    frame_slices: npt.NDArray[np.intp],
    segments: dict[int, int],
    flat: npt.NDArray[np.integer],
) -> None:
    """BINARY frames of whole bytes, checked against bit planes of the label map.

    Bit j of every label is packed, slice by slice, into a 1-bit plane (as many planes as
    the largest value has bits), and their OR is the slice's labelled voxels. On every slice
    the frames must be disjoint (their bit counts add up to their OR's), their OR must be
    the labelled voxels, and for every j the OR of the frames whose label value has bit j set
    must be plane j. Then each labelled voxel lies in exactly one frame, whose value has the
    voxel's bits: every frame holds exactly its value's voxels, no frame is missing and no
    voxel has a value the SEG does not describe. (A different computation from the encoder's
    comparisons, on the packed data; where it fails, each frame is compared with the AND of
    the planes for its value, to name the first frame that differs.)
    """
    if np.issubdtype(flat.dtype, np.signedinteger) and int(flat.min()) < 0:
        raise _fail("the label map holds negative values")
    numbers = sorted(segments)
    values = np.array([segments[n] for n in numbers], dtype=np.int64)
    width = max(int(flat.max()), int(values.max())).bit_length()
    set_bits = ((values[:, None] >> np.arange(width)[None, :]) & 1).astype(np.bool_)
    described = set(values.tolist())
    slices, pixels = flat.shape
    # the frames of each slice, in frame order (frames are in segment order, then slice)
    by_slice = np.argsort(frame_slices, kind="stable")
    bounds = np.searchsorted(frame_slices[by_slice], np.arange(slices + 1))

    def one_slice(z: int) -> None:
        scratch = np.empty(pixels, dtype=flat.dtype)
        planes = np.empty((width, pixels // 8), dtype=np.uint8)
        for j in range(width):
            np.bitwise_and(flat[z], 1 << j, out=scratch)
            planes[j] = np.packbits(scratch, bitorder="little")
        labelled = np.bitwise_or.reduce(planes, axis=0)
        mine = by_slice[bounds[z] : bounds[z + 1]]
        got = frames[mine]
        union = np.bitwise_or.reduce(got, axis=0) if len(mine) else np.zeros_like(labelled)
        bits = set_bits[frame_segments[mine] - 1]  # (frames, width)
        exact = _popcount(got.ravel()) == _popcount(union) and np.array_equal(union, labelled)
        for j in range(width):
            if not exact:
                break
            exact = np.array_equal(np.bitwise_or.reduce(got[bits[:, j]], axis=0), planes[j])
        if not exact:
            framed = values[frame_segments[mine] - 1]
            _diagnose(plan, z, flat[z], planes, got, mine, framed, described)
            raise _fail(f"the frames of slice {z} do not reproduce its labels")

    # per segment and bit: 0xFF where the segment's value has the bit, else 0
    masks = np.where(set_bits, np.uint8(0xFF), np.uint8(0))[:, :, None]

    def block(start: int, stop: int) -> None:
        """The conditions above, slice by slice, in a few numpy calls per slice (each call
        gives the interpreter lock away and must take it back: under a burst that wait is
        most of the check's time): the bit planes of :data:`_RUN` slices at once, and the
        frames of a slice against all of them in one masked OR."""
        for z0 in range(start, stop, _RUN):
            z1 = min(stop, z0 + _RUN)
            scratch = np.empty((z1 - z0, pixels), dtype=flat.dtype)
            planes = np.empty((z1 - z0, width, pixels // 8), dtype=np.uint8)
            for j in range(width):
                np.bitwise_and(flat[z0:z1], 1 << j, out=scratch)
                planes[:, j] = np.packbits(scratch, axis=1, bitorder="little")
            labelled = np.bitwise_or.reduce(planes, axis=1)  # (slices, bytes)
            for z in range(z0, z1):
                mine = by_slice[bounds[z] : bounds[z + 1]]
                if not len(mine):
                    exact = not labelled[z - z0].any()
                else:
                    got = frames[mine]
                    union = np.bitwise_or.reduce(got, axis=0)
                    exact = (
                        _popcount(got.ravel()) == _popcount(union)
                        and np.array_equal(union, labelled[z - z0])
                        and np.array_equal(
                            np.bitwise_or.reduce(
                                got[:, None, :] & masks[frame_segments[mine] - 1], axis=0
                            ),
                            planes[z - z0],
                        )
                    )
                if not exact:
                    one_slice(z)  # names the first frame that differs, and explains it
                    raise _fail(f"the frames of slice {z} do not reproduce its labels")

    # blocks of slices on several threads; the first failing block's error is raised
    map_blocks(block, slices, 1)


def _diagnose(
    plan: SegPlan,
    z: int,
    row: npt.NDArray[np.integer],
    planes: npt.NDArray[np.uint8],
    got: npt.NDArray[np.uint8],
    mine: npt.NDArray[np.intp],
    framed: npt.NDArray[np.int64],
    described: set[int],
) -> None:
    """Fail naming what is wrong with the frames ``got`` (frame indices ``mine``, label
    values ``framed``) of slice ``z``: the first frame that is not the AND of the planes
    for its value, else what they leave out."""
    bits = (framed[:, None] >> np.arange(len(planes))[None, :]) & 1
    masks = np.where(bits == 1, 0, 0xFF).astype(np.uint8)  # XOR: complement where bit is 0
    for i, f in enumerate(mine.tolist()):
        expected = np.bitwise_and.reduce(planes ^ masks[i][:, None], axis=0)
        if not np.array_equal(expected, got[i]):
            a = np.unpackbits(got[i], bitorder="little").astype(np.bool_)
            b = np.unpackbits(expected, bitorder="little").astype(np.bool_)
            _mismatch(a, b, f, z, plan)
    _uncovered(z, row, framed.tolist(), described)


def _uncovered(
    z: int, row: npt.NDArray[np.integer], framed: list[int], described: set[int]
) -> None:
    """Fail naming what the frames of slice ``z`` (of label values ``framed``) leave out: a
    value the SEG describes without a frame there, or values it does not describe."""
    present = np.unique(row[row != 0]).tolist()
    for value in present:
        if value in described and value not in framed:
            raise _fail(f"label {value} has voxels on slice {z} but no frame there")
    others = [v for v in present if v not in described]
    if others:
        raise _fail(
            f"slice {z}: its voxels of {others} hold label values the SEG does not describe"
        )


def _popcount(data: npt.NDArray[np.uint8]) -> int:
    """Number of set bits (counted eight bytes at a time)."""
    whole = len(data) // 8 * 8
    words = data[:whole].view(np.uint64)
    return int(np.bitwise_count(words).sum()) + int(np.bitwise_count(data[whole:]).sum())


def _mismatch(
    got: npt.NDArray[np.generic],
    expected: npt.NDArray[np.generic],
    frame: int,
    k: int,
    plan: SegPlan,
) -> None:
    first = int(np.flatnonzero(got != expected)[0])
    y, x = divmod(first, plan.shape[2])
    raise _fail(
        f"frame {frame + 1} does not reproduce the label map on slice {k}: "
        f"{int(np.count_nonzero(got != expected))} voxels differ, first at (z, y, x) = {(k, y, x)}"
    )
