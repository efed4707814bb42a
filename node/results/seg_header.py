"""The parts of a DICOM Segmentation that do not depend on the labels, encoded as bytes.

:mod:`segnode.node.results.seg_encode` prepares them while inference runs and splices the frames in.
They are built the way highdicom 0.28's ``Segmentation`` builds them, so the file is byte for byte
the same: the header on highdicom's ``SOPClass`` (patient, study and equipment attributes
copied from the source by highdicom's module tables), content items with highdicom's
content classes, written by pydicom's writer (Explicit VR Little Endian, defined lengths,
PS3.5 7.1, 7.5). The Derivation Image (PS3.3 C.7.6.16.2.6) and Plane Position (C.7.6.16.2.3)
items of each slice are spliced from constant pieces (hundreds of slices), checked against a
whole pydicom-written item for the first and last slice.
"""

from __future__ import annotations

import datetime
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import highdicom as hd
import numpy as np
import numpy.typing as npt
from highdicom.spatial import VOLUME_INDEX_CONVENTION, get_normal_vector, get_volume_positions
from highdicom.sr.coding import CodedConcept
from pydicom.dataelem import DataElement
from pydicom.dataset import Dataset
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import correct_ambiguous_vr, write_data_element, write_dataset
from pydicom.sequence import Sequence as DicomSequence
from pydicom.sr.codedict import codes
from pydicom.valuerep import DA, DT, TM, format_number_as_ds

from segnode.engines.manifest import LabelSpec, ModelManifest
from segnode.node.ingest.volume import Volume
from segnode.node.results.build import (
    LABEL_MAP_SEGMENTATION_STORAGE,
    SEGMENTATION_STORAGE,
    Equipment,
    ResultError,
    ResultUIDs,
    derived_uid,
    segment_description,
    source_base,
)

#: highdicom matches a frame to a source plane closer than this (mm)
MATCH_TOLERANCE_MM = 1e-3


class Tag(IntEnum):
    """Tags of the elements the fast path writes per encode and checks, and the item tag
    (PS3.6; PS3.5 7.5)."""

    NUMBER_OF_FRAMES = 0x00280008
    DIMENSION_ORGANIZATION_TYPE = 0x00209311
    SEGMENT_SEQUENCE = 0x00620002
    SHARED_FUNCTIONAL_GROUPS = 0x52009229
    PER_FRAME_FUNCTIONAL_GROUPS = 0x52009230
    PIXEL_DATA = 0x7FE00010
    DERIVATION_IMAGE_SEQUENCE = 0x00089124
    FRAME_CONTENT_SEQUENCE = 0x00209111
    DIMENSION_INDEX_VALUES = 0x00209157
    PLANE_POSITION_SEQUENCE = 0x00209113
    SEGMENT_IDENTIFICATION_SEQUENCE = 0x0062000A
    REFERENCED_SEGMENT_NUMBER = 0x0062000B
    SEGMENT_NUMBER = 0x00620004
    TRACKING_UID = 0x00620021
    ITEM = 0xFFFEE000


_DERIVATION_CODE = CodedConcept.from_code(codes.cid7203.SegmentationImageDerivation)
_PURPOSE_CODE = CodedConcept.from_code(codes.cid7202.SourceImageForImageProcessingOperation)


# ----------------------------------------------------------------- element encoding


def tag_bytes(tag: int) -> bytes:
    """The 4 bytes of a tag in little endian (group, element)."""
    return struct.pack("<HH", tag >> 16, tag & 0xFFFF)


def short_element(tag: int, vr: bytes, value: bytes) -> bytes:
    """An element with a 2-byte length (PS3.5 7.1.2, Table 7.1-2)."""
    return tag_bytes(tag) + vr + struct.pack("<H", len(value)) + value


def long_header(tag: int, vr: bytes, length: int) -> bytes:
    """Header of an element with a 4-byte length (OB, OW, SQ, UT, ...; PS3.5 Table 7.1-1)."""
    return tag_bytes(tag) + vr + b"\x00\x00" + struct.pack("<I", length)


def item_header(length: int) -> bytes:
    """Header of a sequence item of defined length (PS3.5 7.5.1)."""
    return tag_bytes(Tag.ITEM) + struct.pack("<I", length)


def text_value(value: str, pad: bytes = b" ") -> bytes:
    """ASCII ``value`` padded with ``pad`` to an even length (PS3.5 6.2)."""
    raw = value.encode("ascii")
    return raw + pad if len(raw) % 2 else raw


def sequence(tag: int, items: Sequence[bytes]) -> bytes:
    """A defined-length sequence element ``tag`` of the encoded ``items``."""
    body = b"".join(item_header(len(i)) + i for i in items)
    return long_header(tag, b"SQ", len(body)) + body


def encode_dataset(ds: Dataset, encoding: str | list[str]) -> bytes:
    """``ds``'s elements as pydicom writes them in a dataset with ``encoding``."""
    fp = DicomBytesIO()
    fp.is_little_endian = True
    fp.is_implicit_VR = False
    write_dataset(fp, ds, parent_encoding=encoding)
    return bytes(fp.getvalue())


def encode_element(elem: DataElement, encoding: str | list[str]) -> bytes:
    """``elem`` encoded by pydicom in Explicit VR Little Endian with ``encoding``."""
    fp = DicomBytesIO()
    fp.is_little_endian = True
    fp.is_implicit_VR = False
    write_data_element(fp, elem, encoding)
    return bytes(fp.getvalue())


def encode_elements(ds: Dataset, encoding: str | list[str]) -> dict[int, bytes]:
    """Each top-level element of ``ds`` encoded as ``pydicom.dcmwrite`` would write it."""
    ds = correct_ambiguous_vr(ds, True)
    out: dict[int, bytes] = {}
    for tag in sorted(ds.keys()):
        fp = DicomBytesIO()
        fp.is_little_endian = True
        fp.is_implicit_VR = False
        write_data_element(fp, ds[tag], encoding)
        out[int(tag)] = bytes(fp.getvalue())
    return out


# ------------------------------------------------------------------------------ header


def seg_base(
    src: Dataset,
    uids: ResultUIDs,
    sop_class_uid: str,
    equipment: Equipment,
    *,
    charset: str | list[str] | None,
    **more: Any,
) -> Dataset:
    """The SEG's SOP Common, Patient, Study, Series and Equipment attributes as
    ``hd.seg.Segmentation`` sets them on its base class from the first source ``src``
    (``more``: further base-class arguments, e.g. the series description)."""
    return source_base(
        src,
        modality="SEG",
        series_instance_uid=uids.seg_series_uid,
        sop_instance_uid=uids.seg_sop_uid,
        sop_class_uid=sop_class_uid,
        specific_character_set=charset,
        **equipment.arguments(),
        **more,
    )


def build_header(
    sources: Sequence[Dataset],
    shape: tuple[int, int, int],
    manifest: ModelManifest,
    uids: ResultUIDs,
    *,
    labelmap: bool,
    created: datetime.datetime,
    dimension_organization_uid: str,
    charset: str | list[str] | None,
    equipment: Equipment,
) -> Dataset:
    """Every top-level attribute of the SEG except those that depend on the labels (frame
    count, Segment Sequence, functional groups, Dimension Organization Type, Pixel Data).

    Patient, study, series, equipment and SOP common attributes are set as highdicom's
    ``Segmentation`` sets them: on its base class, with the source's Patient and Study
    modules copied by highdicom's module tables; then the Segmentation Image, Image Pixel,
    Frame of Reference, Common Instance Reference and Multi-frame Dimension modules
    (PS3.3 A.51, C.8.20.2, C.7.6.17).
    """
    src = sources[0]
    sop_class = LABEL_MAP_SEGMENTATION_STORAGE if labelmap else SEGMENTATION_STORAGE
    header = seg_base(
        src,
        uids,
        sop_class,
        equipment,
        charset=charset,
        series_description=f"SEG {manifest.name}"[:64],
        content_date=created.date(),
        content_time=created.time(),
    )
    header.InstanceCreationDate = DA(created.date())
    header.InstanceCreationTime = TM(created.time())
    header.copy_specimen_information(src)
    header.copy_patient_and_study_information(src)
    header._add_contributing_equipment(None, src)
    header.ContributingEquipmentSequence[-1].ContributionDateTime = DT(created)
    header.SegmentationType = "LABELMAP" if labelmap else "BINARY"
    header.ContentLabel = f"{src.Modality}_SEG"
    header.ContentDescription = f"{manifest.name} {manifest.version}"[:64]
    if labelmap:
        header.PixelPaddingValue = 0
    header.SegmentsOverlap = "NO"
    _image_modules(header, sources, shape, labelmap)
    header.DimensionIndexSequence = _dimension_index(dimension_organization_uid, labelmap)
    organization = Dataset()
    organization.DimensionOrganizationUID = dimension_organization_uid
    header.DimensionOrganizationSequence = [organization]
    return header


def _image_modules(
    header: Dataset, sources: Sequence[Dataset], shape: tuple[int, int, int], labelmap: bool
) -> None:
    """Frame of Reference, Image Pixel, General Image and Common Instance Reference
    attributes (PS3.3 C.8.20.2, C.12.2) in highdicom's form."""
    src = sources[0]
    header.FrameOfReferenceUID = src.FrameOfReferenceUID
    header.PositionReferenceIndicator = getattr(src, "PositionReferenceIndicator", None)
    bits = 8 if labelmap else 1
    header.BitsAllocated = bits
    header.SamplesPerPixel = 1
    header.PhotometricInterpretation = "MONOCHROME2"
    header.BitsStored = bits
    header.HighBit = bits - 1
    header.PixelRepresentation = 0
    header.ImageType = ["DERIVED", "PRIMARY"]
    header.PresentationLUTShape = "IDENTITY"
    references: list[Dataset] = []
    by_series: dict[str, list[Dataset]] = {}
    for ds in sources:
        ref = Dataset()
        ref.ReferencedSOPClassUID = ds.SOPClassUID
        ref.ReferencedSOPInstanceUID = ds.SOPInstanceUID
        references.append(ref)
        by_series.setdefault(ds.SeriesInstanceUID, []).append(ref)
    header.SourceImageSequence = references
    series = []
    for uid, refs in by_series.items():
        item = Dataset()
        item.SeriesInstanceUID = uid
        item.ReferencedInstanceSequence = refs
        series.append(item)
    header.ReferencedSeriesSequence = series
    header.LossyImageCompression = getattr(src, "LossyImageCompression", "00")
    if header.LossyImageCompression == "01":
        for keyword in ("LossyImageCompressionRatio", "LossyImageCompressionMethod"):
            if keyword in src:
                setattr(header, keyword, src[keyword].value)
    header.Rows, header.Columns = shape[1], shape[2]


def _dimension_index(uid: str, labelmap: bool) -> list[Dataset]:
    """Dimension Index Sequence (C.7.6.17): segment number (BINARY), then position."""
    pointers = [] if labelmap else [(0x0062000B, 0x0062000A, "Referenced Segment Number")]
    pointers.append((0x00200032, Tag.PLANE_POSITION_SEQUENCE, "Image Position Patient"))
    items = []
    for pointer, group, label in pointers:
        item = Dataset()
        item.DimensionIndexPointer = pointer
        item.FunctionalGroupPointer = group
        item.DimensionOrganizationUID = uid
        item.DimensionDescriptionLabel = label
        items.append(item)
    return items


@dataclass(frozen=True)
class SegmentItem:
    """A segment description item with its Segment Number and Tracking UID left out."""

    head: bytes  # elements before Segment Number (0062,0004)
    middle: bytes  # elements between Segment Number and Tracking UID (0062,0021)
    tail: bytes  # elements after Tracking UID


def _description(
    spec: LabelSpec, number: int, algorithm: hd.AlgorithmIdentificationSequence
) -> hd.seg.SegmentDescription:
    """The segment description :func:`segnode.node.results.build.build_seg` writes for ``spec``."""
    return segment_description(spec, number, algorithm, derived_uid("placeholder"))


def segment_item_parts(
    spec: LabelSpec, algorithm: hd.AlgorithmIdentificationSequence, encoding: str | list[str]
) -> SegmentItem:
    """The Segment Sequence item of ``spec`` as bytes around its Segment Number, so that the
    number can be spliced in per SEG."""
    elements = encode_elements(_description(spec, 1, algorithm), encoding)
    tags = sorted(elements)
    return SegmentItem(
        head=b"".join(elements[t] for t in tags if t < Tag.SEGMENT_NUMBER),
        middle=b"".join(elements[t] for t in tags if Tag.SEGMENT_NUMBER < t < Tag.TRACKING_UID),
        tail=b"".join(elements[t] for t in tags if t > Tag.TRACKING_UID),
    )


def background_item(
    first: LabelSpec, algorithm: hd.AlgorithmIdentificationSequence, encoding: str | list[str]
) -> bytes:
    """Segment 0 of a LABELMAP SEG, as highdicom adds it (black, the first segment's
    algorithm type and name, no algorithm identification)."""
    description = _description(first, 1, algorithm)
    background = hd.seg.SegmentDescription(
        segment_number=1,
        segment_label="Background",
        segmented_property_category=codes.DCM.Background,
        segmented_property_type=codes.DCM.Background,
        algorithm_type=description.SegmentAlgorithmType,
        algorithm_identification=algorithm,
        display_color=hd.color.CIELabColor(0.0, 0.0, 0.0),
    )
    background.SegmentNumber = 0
    del background.SegmentationAlgorithmIdentificationSequence
    body = encode_dataset(background, encoding)
    return item_header(len(body)) + body


@dataclass(frozen=True)
class Geometry:
    """Source planes of the volume's slices and highdicom's view of them."""

    sources: tuple[Dataset, ...]
    multiframe: bool
    source_uids: tuple[str, ...]
    source_frames: tuple[int, ...]
    orientation: tuple[float, ...]
    frame_positions: npt.NDArray[np.float64]
    plane_order: npt.NDArray[np.intp]
    orientation_item: hd.PlaneOrientationSequence
    measures: DicomSequence
    position_items: tuple[hd.PlanePositionSequence, ...]

    @classmethod
    def of(cls, volume: Volume, sources: Sequence[Dataset]) -> Geometry:
        """The geometry of ``volume`` as highdicom's SEG constructor would derive it."""
        src = sources[0]
        coordinate = hd.CoordinateSystemNames.PATIENT
        frames = tuple(int(f) for f in volume.frame_numbers)
        try:
            if volume.is_multiframe:
                shared = src.SharedFunctionalGroupsSequence[0]
                orientation = hd.PlaneOrientationSequence.from_sequence(
                    shared.PlaneOrientationSequence
                )
                measures = shared.PixelMeasuresSequence
                per_frame = src.PerFrameFunctionalGroupsSequence
                items = tuple(
                    hd.PlanePositionSequence.from_sequence(per_frame[f - 1].PlanePositionSequence)
                    for f in frames
                )
            else:
                orientation = hd.PlaneOrientationSequence(coordinate, src.ImageOrientationPatient)
                measures = hd.PixelMeasuresSequence(
                    pixel_spacing=src.PixelSpacing,
                    slice_thickness=src.SliceThickness,
                    spacing_between_slices=src.get("SpacingBetweenSlices", None),
                )
                items = tuple(
                    hd.PlanePositionSequence(coordinate, ds.ImagePositionPatient) for ds in sources
                )
        except (AttributeError, IndexError, KeyError, ValueError, TypeError) as exc:
            raise ResultError(f"cannot describe the source planes of the SEG: {exc}") from exc
        cosines = tuple(float(v) for v in orientation[0].ImageOrientationPatient)
        # the positions build_seg gives highdicom (as DS, whose float values are unchanged),
        # matched to the source planes as highdicom matches them
        given = np.array(volume.slice_positions, dtype=np.float64)
        found = np.array([[float(v) for v in i[0].ImagePositionPatient] for i in items])
        # (slices are at least 0.01 mm apart, so a source plane this close is the nearest)
        if len(found) != len(given) or np.any(
            np.linalg.norm(given - found, axis=1) >= MATCH_TOLERANCE_MM
        ):
            raise ResultError("the volume's slice positions do not match its source planes")
        normal = get_normal_vector(cosines, index_convention=VOLUME_INDEX_CONVENTION)
        _, order = np.unique(given @ normal, return_index=True)
        if len(order) != len(given):
            raise ResultError("two slices of the volume share a position")
        if "SpacingBetweenSlices" not in measures[0]:
            spacing, _ = get_volume_positions(
                image_positions=given.tolist(), image_orientation=cosines
            )
            if spacing is not None:
                measures[0].SpacingBetweenSlices = format_number_as_ds(spacing)
        uids = (
            tuple(str(src.SOPInstanceUID) for _ in frames)
            if volume.is_multiframe
            else tuple(str(ds.SOPInstanceUID) for ds in sources)
        )
        return cls(
            sources=tuple(sources),
            multiframe=volume.is_multiframe,
            source_uids=uids,
            source_frames=frames,
            orientation=cosines,
            frame_positions=given,
            plane_order=order.astype(np.intp),
            orientation_item=orientation,
            measures=measures,
            position_items=items,
        )

    def shared(self, *, single_segment: bool) -> DataElement:
        """Shared Functional Groups Sequence (C.7.6.16.1): orientation, pixel measures and,
        for a BINARY SEG of one segment, its Segment Identification."""
        item = Dataset()
        item.PlaneOrientationSequence = self.orientation_item
        item.PixelMeasuresSequence = self.measures
        if single_segment:
            identification = Dataset()
            identification.add(DataElement(Tag.REFERENCED_SEGMENT_NUMBER, "US", 1))
            item.add(DataElement(Tag.SEGMENT_IDENTIFICATION_SEQUENCE, "SQ", [identification]))
        return DataElement(Tag.SHARED_FUNCTIONAL_GROUPS, "SQ", [item])

    def derivations(self, encoding: str | list[str]) -> tuple[bytes, ...]:
        """Each slice's Derivation Image Sequence element (C.7.6.16.2.6): the constant code
        items written by pydicom, the references spliced in; the first and last slices are
        also written whole by pydicom and must come out the same."""
        code = encode_element(DataElement(0x00089215, "SQ", [_DERIVATION_CODE]), encoding)
        tail = encode_element(DataElement(0x0028135A, "CS", "YES"), encoding) + encode_element(
            DataElement(0x0040A170, "SQ", [_PURPOSE_CODE]), encoding
        )
        out = []
        for k in range(len(self.position_items)):
            ds = self.sources[0] if self.multiframe else self.sources[k]
            body = short_element(0x00081150, b"UI", text_value(str(ds.SOPClassUID), b"\x00"))
            body += short_element(0x00081155, b"UI", text_value(str(ds.SOPInstanceUID), b"\x00"))
            if self.multiframe:
                body += short_element(0x00081160, b"IS", text_value(str(self.source_frames[k])))
            item = sequence(0x00082112, [body + tail]) + code
            out.append(sequence(Tag.DERIVATION_IMAGE_SEQUENCE, [item]))
        for k in {0, len(out) - 1}:
            if out[k] != encode_element(self._derivation(k), encoding):
                raise AssertionError(f"spliced Derivation Image item of slice {k} differs")
        return tuple(out)

    def _derivation(self, k: int) -> DataElement:
        """Slice ``k``'s Derivation Image Sequence as highdicom builds it."""
        ds = self.sources[0] if self.multiframe else self.sources[k]
        source = Dataset()
        source.add(DataElement(0x00081150, "UI", ds[0x00080016].value))
        source.add(DataElement(0x00081155, "UI", ds[0x00080018].value))
        source.add(DataElement(0x0040A170, "SQ", [_PURPOSE_CODE]))
        source.add(DataElement(0x0028135A, "CS", "YES"))
        if self.multiframe:
            source.add(DataElement(0x00081160, "IS", self.source_frames[k]))
        derivation = Dataset()
        derivation.add(DataElement(0x00089215, "SQ", [_DERIVATION_CODE]))
        derivation.add(DataElement(0x00082112, "SQ", [source]))
        return DataElement(Tag.DERIVATION_IMAGE_SEQUENCE, "SQ", [derivation])

    def positions(self, encoding: str | list[str]) -> tuple[bytes, ...]:
        """Each slice's Plane Position Sequence element (C.7.6.16.2.3)."""
        return tuple(
            sequence(Tag.PLANE_POSITION_SEQUENCE, [encode_element(item[0][0x00200032], encoding)])
            for item in self.position_items
        )
