"""Fast DICOM Segmentation encoding: everything that does not depend on the labels is encoded
before the labels exist; the labels are then bit-packed and spliced in.

:meth:`SegPlan.prepare` (run while inference runs) encodes, with
:mod:`segnode.node.results.seg_header`, the file meta, every header element, the Derivation Image
and Plane Position items of every slice, the shared functional groups, the dimension index and the
segment description elements of every manifest label. :meth:`SegPlan.encode` then only

* checks the label map (with the messages of :func:`segnode.node.results.build.build_seg`),
* compares it with each label value a few slices at a time and packs the comparison as
  1-bit frames (PS3.5 8.1.1: first pixel in the least significant bit, frames concatenated
  without padding), skipping empty frames,
* splices the frame count, the Segment Sequence, the per-frame items (PS3.3 C.7.6.16) and
  the Pixel Data between the prepared elements.

The file is byte for byte what highdicom 0.28 (``segnode.node.results.build.build_seg`` written by
``segnode.node.pipeline.worker.encode``) produces for the same inputs, BINARY or LABELMAP (Label Map
Segmentation Storage: one 8-bit frame of segment numbers per non-empty slice, Background
segment 0), except four values highdicom draws at build time, which the plan fixes:
Instance Creation, Content and Contribution Date/Time (``created``) and the Dimension
Organization UID (derived from the SOP Instance UID).
:func:`segnode.node.results.seg_check.check_encoded` checks the bytes before they leave.

In Deflated Explicit VR Little Endian (``transfer_syntax``; PS3.5 A.5, the node's default,
``[results] seg_transfer_syntax``) the same data set is deflated in parallel blocks
(:mod:`segnode.node.results.seg_deflate`) after the file meta that names that transfer syntax;
the encoded SEG keeps the data set as it was before deflating, for the check.
"""

from __future__ import annotations

import copy
import datetime
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from io import BytesIO

import highdicom as hd
import numpy as np
import numpy.typing as npt
import pydicom
from highdicom.spatial import get_volume_positions
from pydicom.charset import default_encoding
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import write_file_meta_info
from pydicom.uid import UID, DeflatedExplicitVRLittleEndian, ExplicitVRLittleEndian

from segnode.engines.manifest import ModelManifest
from segnode.node.ingest.volume import Volume
from segnode.node.pipeline.parallel import map_blocks
from segnode.node.results.build import (
    Equipment,
    NoSegmentsError,
    ResultError,
    ResultUIDs,
    _character_set,
    _source_headers,
    derived_uid,
    seg_algorithm,
)
from segnode.node.results.seg_deflate import deflate
from segnode.node.results.seg_header import (
    Geometry,
    SegmentItem,
    Tag,
    background_item,
    build_header,
    encode_element,
    encode_elements,
    item_header,
    long_header,
    segment_item_parts,
    sequence,
    short_element,
    text_value,
)

Chunk = bytes | memoryview  # a piece of the file, copied once into its buffer

#: The transfer syntaxes a SEG is encoded in (PS3.5 A.2, A.5).
TRANSFER_SYNTAXES = (ExplicitVRLittleEndian, DeflatedExplicitVRLittleEndian)


# ------------------------------------------------------------------------------ result


@dataclass(frozen=True, eq=False)
class EncodedSeg:
    """A SEG encoded by :meth:`SegPlan.encode`.

    Attributes
    ----------
    data
        The PS3.10 file: preamble, file meta, dataset (deflated in Deflated Explicit VR
        Little Endian).
    segment_numbers
        ``{label value: segment number}`` of the labels present.
    frame_segments
        Segment number of each frame (for LABELMAP: 0, a frame holds every segment).
    frame_slices
        Volume slice index (``volume.hu[k]``) of each frame.
    transfer_syntax
        The file's transfer syntax (one of :data:`TRANSFER_SYNTAXES`).
    plain
        Deflated only: the data set before it was deflated (Explicit VR Little Endian), which
        :func:`segnode.node.results.seg_check.check_encoded` reads instead of inflating.
    deflate_blocks
        Deflated only: where each independently deflated block starts, (offset in the data
        set, offset in the deflated data set) (:func:`segnode.node.results.seg_deflate.deflate`).
    """

    data: bytes
    segment_numbers: dict[int, int]
    frame_segments: npt.NDArray[np.intp]
    frame_slices: npt.NDArray[np.intp]
    sop_class_uid: str
    sop_instance_uid: str
    series_instance_uid: str
    transfer_syntax: str = ExplicitVRLittleEndian
    plain: bytes | bytearray | memoryview | None = None
    deflate_blocks: tuple[tuple[int, int], ...] = ()

    @property
    def deflated(self) -> bool:
        """Whether the data set is deflated (Deflated Explicit VR Little Endian)."""
        return self.transfer_syntax == DeflatedExplicitVRLittleEndian

    @property
    def number_of_frames(self) -> int:
        """Number of frames in the Pixel Data."""
        return len(self.frame_slices)


# -------------------------------------------------------------------------------- plan


@dataclass(frozen=True, eq=False, repr=False)
class SegPlan:
    """Everything of a SEG that depends only on the source series, the model and the UIDs.

    Build with :meth:`prepare`; :meth:`encode` then turns a label map into the file.
    Attributes not listed are the prepared byte pieces.

    Attributes
    ----------
    labelmap
        Label Map Segmentation Storage (LABELMAP) instead of a BINARY Segmentation.
    transfer_syntax
        Explicit VR Little Endian, or Deflated Explicit VR Little Endian.
    shape
        ``(slices, rows, columns)`` of the volume and of the label maps it encodes.
    created
        Instance Creation, Content and Contribution Date/Time.
    sop_class_uid
        Segmentation Storage (BINARY) or Label Map Segmentation Storage (LABELMAP).
    uids, manifest, equipment
        As given to :meth:`prepare` (what an SR that references this SEG reads of it:
        :meth:`segnode.node.results.sr_encode.SrPlan.prepare`).
    dimension_organization_uid
        Derived from the SEG's SOP Instance UID.
    slice_positions, source_uids, source_frames
        Per volume slice: the position the frames must have, the source SOP Instance UID
        and (multi-frame source) frame number the frames must reference.
    plane_order
        Volume slice indices in the order highdicom writes frames (ascending along its
        normal, PS3.3 C.7.6.17 Dimension Index Values count in this order).
    """

    labelmap: bool
    transfer_syntax: str
    shape: tuple[int, int, int]
    created: datetime.datetime
    dimension_organization_uid: str
    sop_class_uid: str
    uids: ResultUIDs
    manifest: ModelManifest
    equipment: Equipment
    series_instance_uid: str
    slice_positions: npt.NDArray[np.float64]
    source_uids: tuple[str, ...]
    source_frames: tuple[int, ...]
    plane_order: npt.NDArray[np.intp]
    file_meta: bytes
    explicit_meta: bytes
    fixed: dict[int, bytes]
    shared: bytes
    shared_single_segment: bytes
    derivations: tuple[bytes, ...]
    positions: tuple[bytes, ...]
    segment_items: dict[int, SegmentItem]
    background_item: bytes
    _frame_positions: npt.NDArray[np.float64]
    _orientation: tuple[float, ...]

    @classmethod
    def prepare(
        cls,
        volume: Volume,
        manifest: ModelManifest,
        uids: ResultUIDs,
        *,
        segmentation_type: str = "BINARY",
        transfer_syntax: str = ExplicitVRLittleEndian,
        equipment: Equipment,
        created: datetime.datetime | None = None,
    ) -> SegPlan:
        """Encode everything but the frames; uses the volume's headers, geometry and shape
        only (never ``volume.hu``).

        Parameters
        ----------
        volume, manifest, uids, equipment
            As for :func:`segnode.node.results.build.build_seg`.
        segmentation_type
            ``"BINARY"`` (Segmentation Storage, one 1-bit frame per segment and slice) or
            ``"LABELMAP"`` (Label Map Segmentation Storage, one 8-bit frame per slice).
        transfer_syntax
            Explicit VR Little Endian (highdicom's bytes) or Deflated Explicit VR Little
            Endian (the same data set, deflated).
        created
            Instance Creation / Content / Contribution Date and Time; default now.

        Raises
        ------
        ResultError
            The sources cannot be described as highdicom would (a slice matching no source
            plane, a source lacking Slice Thickness, more than 255 LABELMAP labels).
        ValueError
            Unknown ``segmentation_type`` or ``transfer_syntax``.
        """
        if transfer_syntax not in TRANSFER_SYNTAXES:
            raise ValueError(f"a SEG is not encoded in transfer syntax {transfer_syntax}")
        kind = hd.seg.SegmentationTypeValues(segmentation_type)
        if kind == hd.seg.SegmentationTypeValues.FRACTIONAL:
            raise ValueError("FRACTIONAL segmentations are not encoded by segnode")
        labelmap = kind == hd.seg.SegmentationTypeValues.LABELMAP
        if labelmap and len(manifest.labels) > 255:
            raise ResultError("a LABELMAP SEG of more than 255 labels needs 16-bit frames")
        created = created if created is not None else datetime.datetime.now()
        sources = _source_headers(volume)
        charset = _character_set(volume)
        encoding: str | list[str] = charset if charset else default_encoding
        dim_uid = derived_uid(uids.seg_sop_uid, "dimension-organization")
        try:
            header = build_header(
                sources,
                volume.shape,
                manifest,
                uids,
                labelmap=labelmap,
                created=created,
                dimension_organization_uid=dim_uid,
                charset=charset,
                equipment=equipment,
            )
            geometry = Geometry.of(volume, sources)
            fixed = encode_elements(header, header.get("SpecificCharacterSet", encoding))

            algorithm = seg_algorithm(manifest)
            items = {
                spec.value: segment_item_parts(spec, algorithm, encoding)
                for spec in sorted(manifest.labels, key=lambda s: s.value)
            }
        except (ValueError, TypeError) as exc:  # highdicom's checks of the header values
            raise ResultError(f"cannot encode the segmentation: {exc}") from exc
        first = sorted(manifest.labels, key=lambda s: s.value)[0]
        return cls(
            labelmap=labelmap,
            transfer_syntax=transfer_syntax,
            shape=volume.shape,
            created=created,
            dimension_organization_uid=dim_uid,
            sop_class_uid=str(header.SOPClassUID),
            uids=uids,
            manifest=manifest,
            equipment=equipment,
            series_instance_uid=volume.series_instance_uid,
            slice_positions=np.array(volume.slice_positions, dtype=np.float64),
            source_uids=geometry.source_uids,
            source_frames=geometry.source_frames,
            plane_order=geometry.plane_order,
            file_meta=_file_meta(header, transfer_syntax),
            explicit_meta=_file_meta(header, ExplicitVRLittleEndian),
            fixed=fixed,
            shared=encode_element(geometry.shared(single_segment=False), encoding),
            shared_single_segment=encode_element(geometry.shared(single_segment=True), encoding),
            derivations=geometry.derivations(encoding),
            positions=geometry.positions(encoding),
            segment_items=items,
            background_item=background_item(first, algorithm, encoding),
            _frame_positions=geometry.frame_positions,
            _orientation=geometry.orientation,
        )

    def __repr__(self) -> str:
        kind = "LABELMAP" if self.labelmap else "BINARY"
        deflated = ", deflated" if self.deflated else ""
        return (
            f"SegPlan({kind}{deflated}, shape={self.shape}, "
            f"sop_instance_uid={self.uids.seg_sop_uid})"
        )

    @property
    def deflated(self) -> bool:
        """Whether the SEG is encoded in Deflated Explicit VR Little Endian."""
        return self.transfer_syntax == DeflatedExplicitVRLittleEndian

    # ------------------------------------------------------------------------ encode

    def segment_item(self, value: int, number: int) -> bytes:
        """The Segment Sequence item (header included) of label ``value`` as segment
        ``number`` (Tracking UID derived from the SOP Instance UID and the number, as
        :func:`segnode.node.results.build.build_seg` does)."""
        parts = self.segment_items[value]
        uid = derived_uid(self.uids.seg_sop_uid, "segment", str(number))
        body = b"".join(
            (
                parts.head,
                short_element(Tag.SEGMENT_NUMBER, b"US", struct.pack("<H", number)),
                parts.middle,
                short_element(Tag.TRACKING_UID, b"UI", text_value(uid, b"\x00")),
                parts.tail,
            )
        )
        return item_header(len(body)) + body

    def is_3d(self, planes: npt.NDArray[np.intp], channels: int) -> bool:
        """Whether highdicom calls frames at volume slices ``planes`` (ascending) with
        ``channels`` segment channels a regularly spaced "3D" organisation (C.7.6.17)."""
        if len(planes) < 2 or channels != 1:
            return False
        spacing, _ = get_volume_positions(
            image_positions=self._frame_positions[planes].tolist(),
            image_orientation=self._orientation,
            sort=False,
        )
        return spacing is not None and spacing > 0.0

    def encode(self, labels: npt.NDArray[np.integer]) -> EncodedSeg:
        """Encode ``labels`` as the SEG file.

        Parameters
        ----------
        labels
            Label map of shape :attr:`shape`; 0 is background, other values are manifest
            label values.

        Returns
        -------
        EncodedSeg

        Raises
        ------
        NoSegmentsError
            No label is present.
        ResultError
            ``labels`` does not fit the volume or holds values the manifest does not describe.
        """
        flat = self._checked(labels)
        values = [s.value for s in sorted(self.manifest.labels, key=lambda s: s.value)]
        presence = _presence(flat, values)
        hits: list[bool] = np.any(presence, axis=1).tolist()
        present = [v for v, hit in zip(values, hits, strict=True) if hit]
        if not present:
            raise NoSegmentsError(
                f"model {self.manifest.name} {self.manifest.version} found no segment in "
                f"series {self.series_instance_uid}; no SEG or SR is produced"
            )
        numbers = {value: number for number, value in enumerate(present, start=1)}
        nonempty: npt.NDArray[np.bool_] = np.any(presence, axis=0)
        planes = self.plane_order[nonempty[self.plane_order]]
        rank = np.zeros(self.shape[0], dtype=np.intp)
        rank[planes] = np.arange(1, len(planes) + 1)
        index = {v: i for i, v in enumerate(values)}
        frames: _Frames | None = None
        if self.labelmap:
            segments = np.zeros(len(planes), dtype=np.intp)
            slices = planes
            pixels = _labelmap_frames(flat, planes, numbers)
        else:
            per_segment = [planes[presence[index[v], planes]] for v in present]
            segments = np.repeat(np.arange(1, len(present) + 1), [len(p) for p in per_segment])
            slices = np.concatenate(per_segment)
            frames = _Frames(flat, np.array(present)[segments - 1], slices)
            pixels = [long_header(Tag.PIXEL_DATA, b"OB", frames.length)]
        channels = 1 if self.labelmap else len(present)
        variable: dict[int, list[Chunk]] = {
            Tag.NUMBER_OF_FRAMES: [
                short_element(Tag.NUMBER_OF_FRAMES, b"IS", text_value(str(len(slices))))
            ],
            Tag.SEGMENT_SEQUENCE: [self._segment_sequence(numbers)],
            Tag.SHARED_FUNCTIONAL_GROUPS: [
                self.shared_single_segment if channels == 1 and not self.labelmap else self.shared
            ],
            Tag.PER_FRAME_FUNCTIONAL_GROUPS: self._per_frame(segments, slices, rank, channels),
            Tag.PIXEL_DATA: pixels,  # the last element: BINARY frames are packed after it
        }
        nonempty_ascending = np.flatnonzero(nonempty)
        if self.is_3d(nonempty_ascending, channels):
            variable[Tag.DIMENSION_ORGANIZATION_TYPE] = [
                short_element(Tag.DIMENSION_ORGANIZATION_TYPE, b"CS", b"3D")
            ]
        parts: list[Chunk] = [] if self.deflated else [self.file_meta]
        for tag in sorted({*self.fixed, *variable}):
            if tag in variable:
                parts.extend(variable[tag])
            else:
                parts.append(self.fixed[tag])
        # one buffer, the BINARY frames packed into their place on several threads
        header = b"".join(parts)  # one copy of some 40 000 small parts, not one each
        head = len(header)
        # Not zero-filled (a bytearray would write all of it once more): the header and
        # every byte of the frames, their padding included, are written below.
        store = np.empty(head + (frames.length if frames is not None else 0), dtype=np.uint8)
        buffer = store.data
        buffer[:head] = header
        del header
        if frames is not None:
            frames.pack(buffer[head:])
        plain: memoryview | None = None
        blocks: tuple[tuple[int, int], ...] = ()
        if self.deflated:
            # 8-bit label maps deflate smaller and faster as runs (docs/performance.md)
            strategy = zlib.Z_RLE if self.labelmap else zlib.Z_DEFAULT_STRATEGY
            deflated = deflate(buffer, strategy=strategy)
            plain, blocks = buffer, deflated.blocks
            data = self.file_meta + deflated.stream
        else:
            data = bytes(buffer)
        return EncodedSeg(
            data=data,
            segment_numbers=numbers,
            frame_segments=segments,
            frame_slices=np.asarray(slices, dtype=np.intp),
            sop_class_uid=self.sop_class_uid,
            sop_instance_uid=self.uids.seg_sop_uid,
            series_instance_uid=self.uids.seg_series_uid,
            transfer_syntax=self.transfer_syntax,
            plain=plain,
            deflate_blocks=blocks,
        )

    def reference(self, encoded: EncodedSeg) -> Dataset:
        """The SEG as a pydicom Dataset without its functional groups and Pixel Data, for
        objects that reference it (the SR's ``seg``, evidence lists): every prepared header
        element, Number of Frames and the Segment Sequence of ``encoded``."""
        numbers = encoded.segment_numbers
        elements = {
            **self.fixed,
            Tag.NUMBER_OF_FRAMES: short_element(
                Tag.NUMBER_OF_FRAMES, b"IS", text_value(str(encoded.number_of_frames))
            ),
            Tag.SEGMENT_SEQUENCE: self._segment_sequence(numbers),
        }
        data = self.explicit_meta + b"".join(elements[t] for t in sorted(elements))
        return pydicom.dcmread(BytesIO(data))

    def _checked(self, labels: npt.NDArray[np.integer]) -> npt.NDArray[np.integer]:
        """``labels`` as a C-contiguous ``(slices, rows * columns)`` array, after the checks
        (and with the messages) of :func:`segnode.node.results.build.build_seg`."""
        if labels.shape != self.shape:
            raise ResultError(f"label map has shape {labels.shape}, volume has {self.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise ResultError(f"label map must be integer, got {labels.dtype}")
        known = {s.value for s in self.manifest.labels}
        top = max(known)
        described = (
            f"that model {self.manifest.name} {self.manifest.version} does not describe "
            f"(known: {sorted(known)})"
        )
        low = int(labels.min()) if np.issubdtype(labels.dtype, np.signedinteger) else 0
        high = int(labels.max()) if labels.size else 0
        if low < 0 or high > top:
            outside = labels[(labels < 0) | (labels > top)]
            found = sorted({int(v) for v in outside[:100_000]})
            raise ResultError(f"label map contains values {found} {described}")
        gaps = [v for v in range(1, high + 1) if v not in known]
        unknown = [v for v in gaps if np.any(labels == v)]
        if unknown:
            raise ResultError(f"label map contains values {unknown} {described}")
        return np.ascontiguousarray(labels).reshape(self.shape[0], -1)

    def _segment_sequence(self, numbers: dict[int, int]) -> bytes:
        items = [self.segment_item(v, n) for v, n in numbers.items()]
        if self.labelmap:
            items.insert(0, self.background_item)
        body = b"".join(items)
        return long_header(Tag.SEGMENT_SEQUENCE, b"SQ", len(body)) + body

    def _per_frame(
        self,
        segments: npt.NDArray[np.intp],
        slices: npt.NDArray[np.intp],
        rank: npt.NDArray[np.intp],
        channels: int,
    ) -> list[Chunk]:
        """The Per-Frame Functional Groups Sequence (C.7.6.16.1): per frame the slice's
        Derivation Image and Plane Position items, the Dimension Index Values
        (segment number and plane rank, or plane rank for LABELMAP) and, with more than one
        segment, the Segment Identification."""
        values = 1 if self.labelmap else 2
        content = short_element(Tag.DIMENSION_INDEX_VALUES, b"UL", b"\x00" * 4 * values)
        frame_content = sequence(Tag.FRAME_CONTENT_SEQUENCE, [content])
        prefix = frame_content[: -4 * values]
        identification = {
            n: sequence(
                Tag.SEGMENT_IDENTIFICATION_SEQUENCE,
                [short_element(Tag.REFERENCED_SEGMENT_NUMBER, b"US", struct.pack("<H", n))],
            )
            for n in range(1, channels + 1)
        }
        with_identification = not self.labelmap and channels > 1
        extra = len(identification[1]) if with_identification else 0
        parts: list[Chunk] = []
        pack = struct.Struct("<I" if self.labelmap else "<II").pack
        ranks = rank.tolist()
        for n, k in zip(segments.tolist(), slices.tolist(), strict=True):
            derivation, position = self.derivations[k], self.positions[k]
            length = len(derivation) + len(frame_content) + len(position) + extra
            parts.append(item_header(length))
            parts.append(derivation)
            parts.append(prefix + (pack(ranks[k]) if self.labelmap else pack(n, ranks[k])))
            parts.append(position)
            if with_identification:
                parts.append(identification[n])
        total = sum(len(p) for p in parts)
        return [long_header(Tag.PER_FRAME_FUNCTIONAL_GROUPS, b"SQ", total), *parts]


def _file_meta(header: Dataset, transfer_syntax: str) -> bytes:
    """Preamble, ``DICM`` and File Meta Information (PS3.10 7.1) of ``header`` naming
    ``transfer_syntax``, as ``pydicom.dcmwrite`` writes them."""
    meta = FileMetaDataset(copy.deepcopy(header.file_meta))
    meta.TransferSyntaxUID = UID(transfer_syntax)
    fp = DicomBytesIO()
    fp.is_little_endian, fp.is_implicit_VR = True, False
    fp.write(header.preamble or b"\x00" * 128)
    fp.write(b"DICM")
    write_file_meta_info(fp, meta, enforce_standard=True)
    return bytes(fp.getvalue())


# ------------------------------------------------------------------------------ frames


def _presence(flat: npt.NDArray[np.integer], values: Sequence[int]) -> npt.NDArray[np.bool_]:
    """Which of ``values`` each slice of ``flat`` (slices x pixels; values from 0 to
    ``max(values)``, as :meth:`SegPlan._checked` ensures) holds, found in blocks of slices on
    several threads (:func:`segnode.node.pipeline.parallel.map_blocks`)."""
    slices = flat.shape[0]
    presence = np.zeros((len(values), slices), dtype=np.bool_)
    wanted = np.asarray(values, dtype=np.intp)

    def block(start: int, stop: int) -> None:
        seen = np.zeros(int(wanted.max()) + 1, dtype=np.bool_)
        for z in range(start, stop):
            seen[:] = False
            seen[flat[z]] = True
            presence[:, z] = seen[wanted]  # each block writes its own columns

    map_blocks(block, slices, 1)
    return presence


@dataclass(frozen=True, eq=False)
class _Frames:
    """The BINARY frames: per frame the label value and volume slice it shows."""

    flat: npt.NDArray[np.integer]
    values: npt.NDArray[np.intp]
    slices: npt.NDArray[np.intp]

    @property
    def length(self) -> int:
        """Bytes of the Pixel Data value: the frames' bits packed without padding between
        frames (PS3.5 8.1.1), padded to even length as highdicom pads it."""
        size = (len(self.slices) * int(self.flat.shape[1]) + 7) // 8
        return size + size % 2

    def pack(self, out: memoryview) -> None:
        """Pack the frames into ``out`` (:attr:`length` bytes): each frame compares its
        slice with its value, first pixel in the least significant bit (PS3.5 8.1.1), on
        several threads when a frame is a whole number of bytes."""
        target = np.frombuffer(out, dtype=np.uint8)
        pixels = self.flat.shape[1]
        values, slices = self.values.tolist(), self.slices.tolist()
        size = (len(values) * pixels + 7) // 8
        if size % 2:
            target[size] = ord("0")  # highdicom pads with the character "0", not a null byte
        if pixels % 8:  # frames share bytes: pack them all at once
            masks = np.concatenate([self.flat[k] == v for v, k in zip(values, slices, strict=True)])
            packed = np.packbits(masks, bitorder="little")
            target[: len(packed)] = packed
            return
        step = pixels // 8  # bytes per frame
        frames = target[: len(values) * step].reshape(len(values), step)
        # run[f]: frames f, f+1, ... that show one value on consecutive slices (frames come
        # by segment, then slice): they are compared in one numpy call
        run = [1] * len(values)
        for f in range(len(values) - 2, -1, -1):
            if values[f + 1] == values[f] and slices[f + 1] == slices[f] + 1:
                run[f] = run[f + 1] + 1

        def block(start: int, stop: int) -> None:
            # up to _PACK_FRAMES frames per numpy call: each call gives the interpreter lock
            # away and must take it back, which under a burst waits for the receiving threads
            mask = np.empty((_PACK_FRAMES, pixels), dtype=np.bool_)
            first = start
            while first < stop:
                n = min(stop - first, _PACK_FRAMES, run[first])
                k = slices[first]
                np.equal(self.flat[k : k + n], values[first], out=mask[:n])
                frames[first : first + n] = np.packbits(mask[:n], axis=1, bitorder="little")
                first += n

        map_blocks(block, len(values), _PACK_FRAMES)


#: BINARY frames compared and packed per numpy call (a 4 MiB mask for 512 x 512 frames).
_PACK_FRAMES = 16


def _labelmap_frames(
    flat: npt.NDArray[np.integer], planes: npt.NDArray[np.intp], numbers: dict[int, int]
) -> list[Chunk]:
    """The Pixel Data element of 8-bit LABELMAP frames (segment numbers) of ``planes``."""
    moved = {v: n for v, n in numbers.items() if v != n}
    frames: list[Chunk] = []
    for k in planes.tolist():
        row = flat[k]
        if moved or row.dtype != np.uint8:
            out = row.astype(np.uint8)
            for value, number in moved.items():
                out[row == value] = number
            frames.append(out.data)
        else:
            frames.append(row.data)
    length = len(planes) * flat.shape[1]
    if length % 2:
        frames.append(b"0")
        length += 1
    return [long_header(Tag.PIXEL_DATA, b"OB", length), *frames]
