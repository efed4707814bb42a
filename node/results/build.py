"""Encode a label map as DICOM SEG and its measurements as a TID 1500 Comprehensive 3D SR.

* :func:`build_seg` writes a BINARY Segmentation (PS3.3 A.51, C.8.20) with one segment per
  non-empty label, numbered 1..n in ascending label value (:func:`segment_numbers`), in the
  Frame of Reference of the source, with frame-level references to the source instances
  (Derivation Image, PS3.3 C.7.6.16.2.6) and the algorithm identification of the model
  (CID 7162 "Artificial Intelligence").
* :func:`build_sr` writes a Comprehensive 3D SR (PS3.3 A.35.13) holding a Measurement
  Report (PS3.16 TID 1500) with one Volumetric ROI group (TID 1411) per segment: a
  Referenced Segment, the finding type/category from the model manifest, and the volume
  (mL), mean and standard deviation of the attenuation (HU) within the segment.
* :func:`verify_seg` re-reads the encoded SEG and checks it reproduces the label map and
  geometry; run it before sending.

The measurements come from :mod:`segnode.node.results.statistics`;
:class:`segnode.node.results.sr_encode.SrPlan` writes the same SR as :func:`build_sr`, byte for
byte, prepared before the label map exists.

All UIDs come from :class:`ResultUIDs` or are derived from them, so re-encoding the same
result (after a crash) reproduces identical UIDs. A label map with no labelled voxel raises
:class:`NoSegmentsError`: neither a SEG (which needs at least one segment) nor a TID 1500
report (which needs at least one measurement group) can describe "nothing found".
"""

from __future__ import annotations

import copy
import io
import logging
import re
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import highdicom as hd
import numpy as np
import numpy.typing as npt
import pydicom
from highdicom.sr import (
    AlgorithmIdentification,
    CodedConcept,
    Comprehensive3DSR,
    DeviceObserverIdentifyingAttributes,
    FindingSite,
    Measurement,
    MeasurementReport,
    ObservationContext,
    ObserverContext,
    ReferencedSegment,
    SourceSeriesForSegmentation,
    TrackingIdentifier,
    VolumetricROIMeasurementsAndQualitativeEvaluations,
)
from pydicom.dataset import Dataset
from pydicom.multival import MultiValue
from pydicom.sr.codedict import codes
from pydicom.sr.coding import Code
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

from segnode.engines.manifest import LabelSpec, ModelManifest
from segnode.node.errors import NoSegmentsError as NoSegmentsError
from segnode.node.errors import ResultError as ResultError
from segnode.node.ingest.volume import Volume
from segnode.node.results.charset import result_character_set
from segnode.node.results.statistics import SegmentStatistics as SegmentStatistics
from segnode.node.results.statistics import label_counts, numbering
from segnode.node.results.statistics import segment_numbers as segment_numbers
from segnode.node.results.statistics import segment_statistics as segment_statistics

logger = logging.getLogger(__name__)

# highdicom warns of a Patient Name without a caret with the name in the message
# (highdicom.valuerep.check_person_name, called by every SOPClass built here); Python prints
# warnings to stderr, the journal, which holds no patient data (docs/operations.md). The
# filter is installed once, here, because warnings.catch_warnings is not thread-safe and
# results are encoded on worker threads. A single-component name is valid DICOM (PS3.5
# 6.2.1.2) and is copied as it is.
warnings.filterwarnings(
    "ignore",
    message=r'The string "[\s\S]*" is unlikely to represent the intended person name',
    category=UserWarning,
    module=r"highdicom\.",
)

#: Copied attributes whose values highdicom checks, and the forms it takes (PS3.3 C.7.1.1,
#: C.7.2.1; PS3.5 6.2: DA ``YYYYMMDD``, TM ``HH[MM[SS[.F{1,6}]]]``).
_COPIED_FORMS = {
    "PatientSex": re.compile(r"[MFO]"),
    "PatientBirthDate": re.compile(r"[0-9]{8}"),
    "StudyDate": re.compile(r"[0-9]{8}"),
    "StudyTime": re.compile(r"[0-9]{2}(?:[0-9]{2}(?:[0-9]{2}(?:\.[0-9]{1,6})?)?)?"),
}

SEGMENTATION_STORAGE = "1.2.840.10008.5.1.4.1.1.66.4"
LABEL_MAP_SEGMENTATION_STORAGE = "1.2.840.10008.5.1.4.1.1.66.7"
MILLILITER = Code("ml", "UCUM", "milliliter")
HOUNSFIELD_UNIT = Code("[hnsf'U]", "UCUM", "Hounsfield unit")
#: CID 7150 "Anatomical Structure" (91723000 today; 123037004 in older editions of PS3.16)
ANATOMICAL_STRUCTURES = frozenset({("91723000", "SCT"), ("123037004", "SCT")})
POSITION_TOLERANCE_MM = 0.01
_UID_NAMESPACE = uuid.UUID("6f1c9a52-3f0e-5b8e-9d43-7a2b0c5e8d11")  # segnode's UUID namespace
ORIENTATION_TOLERANCE = 1e-4


@dataclass(frozen=True)
class ResultUIDs:
    """UIDs of one result, allocated once and kept in the ledger."""

    seg_series_uid: str
    seg_sop_uid: str
    sr_series_uid: str
    sr_sop_uid: str

    @classmethod
    def new(cls) -> ResultUIDs:
        """Allocate four fresh UIDs (PS3.5 B.2, UUID-derived ``2.25`` root)."""
        return cls(*(str(generate_uid(prefix=None)) for _ in range(4)))


#: Series Number of the node's SEG and of its SR (PS3.3 C.7.3.1).
SEG_SERIES_NUMBER = 9901
SR_SERIES_NUMBER = 9902


@dataclass(frozen=True)
class Equipment:
    """General Equipment, General Series and General Image values of one SEG or SR: the
    series and instance numbers and who made it (PS3.3 C.7.5.1, C.7.3.1, C.7.6.1)."""

    software_version: str
    series_number: int
    manufacturer: str = "segnode"
    manufacturer_model_name: str = "segnode"
    device_serial: str = "segnode"
    instance_number: int = 1

    @classmethod
    def for_seg(cls, software_version: str) -> Equipment:
        """The node's SEG: Series Number :data:`SEG_SERIES_NUMBER`, the other defaults."""
        return cls(software_version, SEG_SERIES_NUMBER)

    @classmethod
    def for_sr(cls, software_version: str) -> Equipment:
        """The node's SR: Series Number :data:`SR_SERIES_NUMBER`, the other defaults."""
        return cls(software_version, SR_SERIES_NUMBER)

    def arguments(self) -> dict[str, Any]:
        """These values as the keyword arguments of highdicom's ``SOPClass`` (and of
        ``Segmentation`` and ``Comprehensive3DSR``, which pass them to it)."""
        return {
            "series_number": self.series_number,
            "instance_number": self.instance_number,
            "manufacturer": self.manufacturer,
            "manufacturer_model_name": self.manufacturer_model_name,
            "software_versions": self.software_version,
            "device_serial_number": self.device_serial,
        }


#: The names build_seg and segnode.node.results.seg_encode use.
_label_counts = label_counts
_numbering = numbering


def load_standard_tables() -> None:
    """Read highdicom's tables of the standard (SOP class to IOD, IOD modules, module
    attributes, anatomic regions) now, in the calling thread.

    highdicom reads each from a JSON file the first time an object is built; the parse is
    one C call that holds the interpreter lock throughout (about 0.5 s on a small machine).
    Left to the worker's warm-up after start, it stalled every other thread of the node that
    long, among them the main thread's systemd watchdog pings. Best effort: a highdicom
    without these private helpers reads them later as before.
    """
    try:
        from highdicom import _standard_utils as standard
    except ImportError:
        return
    for name in (
        "get_sop_class_iod_map",
        "get_iod_module_map",
        "get_module_attribute_map",
        "get_anatomic_region_map",
    ):
        getter = getattr(standard, name, None)
        if callable(getter):
            try:
                getter()
            except Exception as exc:  # the first result reads it then, or fails with the reason
                logger.debug("highdicom's %s: %s", name, exc)


def seg_algorithm(manifest: ModelManifest) -> hd.AlgorithmIdentificationSequence:
    """The SEG's Segmentation Algorithm Identification: the model's name and version, and
    as its Algorithm Parameters the precision that ran it (``precision``: ``fp32``,
    ``fp16``, ``bf16``, ``int8``; :func:`segnode.engines.base.run_precision`)."""
    return hd.AlgorithmIdentificationSequence(
        name=manifest.name,
        family=codes.cid7162.ArtificialIntelligence,
        version=manifest.version,
        parameters={"precision": manifest.precision},
    )


def derived_uid(*parts: str) -> str:
    """Deterministic UID from ``parts``: a name-based (SHA-1) UUID in the ``2.25`` form of
    PS3.5 B.2, so the same result re-encoded gets the same UID."""
    return f"2.25.{uuid.uuid5(_UID_NAMESPACE, chr(0).join(parts)).int}"


def _code(value: tuple[str, str, str]) -> Code:
    return Code(value[0], value[1], value[2])


def _finding_site(spec: LabelSpec) -> FindingSite:
    """TID 1411's finding site of an anatomical label: its type, with its laterality."""
    laterality = _code(spec.modifier) if spec.modifier is not None else None
    return FindingSite(_code(spec.type), laterality=laterality)


def segment_description(
    spec: LabelSpec,
    number: int,
    algorithm: hd.AlgorithmIdentificationSequence,
    tracking_uid: str,
) -> hd.seg.SegmentDescription:
    """The Segment Sequence item of ``spec``: label, category, type with its modifier
    (laterality, inside the type's code item, PS3.3 C.8.20.2), anatomic region with its
    modifier, algorithm, tracking identifiers and colour."""
    description = hd.seg.SegmentDescription(
        segment_number=number,
        segment_label=spec.name[:64],
        segmented_property_category=_code(spec.category),
        segmented_property_type=_code(spec.type),
        algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
        algorithm_identification=algorithm,
        tracking_uid=tracking_uid,
        tracking_id=spec.name[:64],
        anatomic_regions=[_code(spec.anatomic_region)] if spec.anatomic_region else None,
        display_color=hd.color.CIELabColor.from_rgb(*spec.color),
    )
    if spec.modifier is not None:
        item = description.SegmentedPropertyTypeCodeSequence[0]
        item.SegmentedPropertyTypeModifierCodeSequence = [
            CodedConcept.from_code(_code(spec.modifier))
        ]
    if spec.anatomic_region is not None and spec.anatomic_region_modifier is not None:
        region = description.AnatomicRegionSequence[0]
        region.AnatomicRegionModifierSequence = [
            CodedConcept.from_code(_code(spec.anatomic_region_modifier))
        ]
    return description


def _source_headers(volume: Volume) -> list[Dataset]:
    """Source headers as highdicom needs them.

    highdicom copies Patient/Study attributes from the first source by attribute access and
    requires identical Image Orientation (Patient) strings; the volume accepted tolerance,
    so the first header gets empty Type 2 attributes where missing and every header the
    first one's orientation (copies; the volume's headers are not changed). A Patient's Sex,
    Birth Date, Study Date or Time that is not a DICOM value (``female``, ``1970-01-01``) is
    left empty, as Type 2 allows, and logged without the value: highdicom refuses it, and
    one malformed demographic must not cost the radiologist the segmentation.
    """
    sources = list(volume.sources)
    first = copy.deepcopy(sources[0])
    for keyword in (
        "PatientName", "PatientID", "PatientBirthDate", "PatientSex", "AccessionNumber",
        "StudyID", "StudyDate", "StudyTime", "ReferringPhysicianName",
    ):  # fmt: skip
        if keyword not in first:
            setattr(first, keyword, "")
    for keyword, form in _COPIED_FORMS.items():
        value = str(first.get(keyword) or "").strip()
        if value and form.fullmatch(value) is None:
            logger.warning(
                "the source's %s is not a valid DICOM value; left empty in the results", keyword
            )
            setattr(first, keyword, "")
    sources[0] = first
    if "ImageOrientationPatient" in first:
        iop = list(first.ImageOrientationPatient)
        for i, ds in enumerate(sources[1:], start=1):
            if list(ds.ImageOrientationPatient) != iop:
                ds = copy.deepcopy(ds)
                ds.ImageOrientationPatient = iop
                sources[i] = ds
    return sources


def source_base(
    src: Dataset,
    *,
    modality: str,
    series_instance_uid: str,
    sop_instance_uid: str,
    sop_class_uid: str,
    **more: Any,
) -> hd.SOPClass:
    """highdicom's ``SOPClass`` as ``Segmentation`` and ``Comprehensive3DSR`` make their base
    from their first source or evidence ``src``: its Study Instance UID and the Patient and
    Study arguments taken from it, Explicit VR Little Endian (``more``: further arguments,
    e.g. :meth:`Equipment.arguments`)."""
    return hd.SOPClass(
        study_instance_uid=src.StudyInstanceUID,
        series_instance_uid=series_instance_uid,
        sop_instance_uid=sop_instance_uid,
        sop_class_uid=sop_class_uid,
        modality=modality,
        transfer_syntax_uid=ExplicitVRLittleEndian,
        patient_id=src.PatientID,
        patient_name=src.PatientName,
        patient_birth_date=src.PatientBirthDate,
        patient_sex=src.PatientSex,
        accession_number=src.AccessionNumber,
        study_id=src.StudyID,
        study_date=src.StudyDate,
        study_time=src.StudyTime,
        referring_physician_name=getattr(src, "ReferringPhysicianName", None),
        **more,
    )


def _character_set(volume: Volume) -> str | list[str] | None:
    """The Specific Character Set of the SEG and SR of ``volume``
    (:func:`segnode.node.results.charset.result_character_set` of its first source)."""
    return result_character_set(volume.sources[0])


def build_seg(
    volume: Volume,
    labels: npt.NDArray[np.integer],
    manifest: ModelManifest,
    uids: ResultUIDs,
    *,
    equipment: Equipment,
    workers: int = 0,
) -> Dataset:
    """Encode ``labels`` as a BINARY DICOM Segmentation of ``volume``.

    Parameters
    ----------
    volume
        The source volume (its headers become the SEG's references).
    labels
        Label map, same shape as ``volume.hu``; values are manifest label values, 0 is
        background.
    manifest
        Model that produced the labels (segment codes, colours, algorithm name/version).
    uids
        Series and SOP Instance UIDs of the SEG.
    equipment
        General Equipment / General Series / General Image values of the SEG (the node's:
        :meth:`Equipment.for_seg`).
    workers
        Passed to highdicom (processes for frame encoding; 0 encodes in this process).

    Returns
    -------
    pydicom.Dataset
        A ``highdicom.seg.Segmentation`` (Segmentation Storage, Explicit VR Little Endian,
        empty frames omitted).

    Raises
    ------
    NoSegmentsError
        No label is present in ``labels``.
    ResultError
        ``labels`` does not fit the volume or the manifest, or highdicom rejects the input.
    """
    numbers = _numbering(_label_counts(volume, labels, manifest), manifest)
    if not numbers:
        raise NoSegmentsError(
            f"model {manifest.name} {manifest.version} found no segment in series "
            f"{volume.series_instance_uid}; no SEG or SR is produced"
        )
    lut = np.zeros(
        max(s.value for s in manifest.labels) + 1,
        dtype=np.uint8 if len(numbers) < 256 else np.uint16,
    )
    for value, number in numbers.items():
        lut[value] = number
    pixels = lut[labels]

    algorithm = seg_algorithm(manifest)
    descriptions = []
    for value, number in numbers.items():
        spec = manifest.label(value)
        descriptions.append(
            segment_description(
                spec, number, algorithm, derived_uid(uids.seg_sop_uid, "segment", str(number))
            )
        )
    positions = [
        hd.PlanePositionSequence(hd.CoordinateSystemNames.PATIENT, list(p))
        for p in volume.slice_positions
    ]
    try:
        seg = hd.seg.Segmentation(
            source_images=_source_headers(volume),
            pixel_array=pixels,
            segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
            segment_descriptions=descriptions,
            series_instance_uid=uids.seg_series_uid,
            sop_instance_uid=uids.seg_sop_uid,
            **equipment.arguments(),
            content_description=f"{manifest.name} {manifest.version}"[:64],
            series_description=f"SEG {manifest.name}"[:64],
            plane_positions=positions,
            omit_empty_frames=True,
            workers=workers,
            specific_character_set=_character_set(volume),
        )
    except (ValueError, TypeError) as exc:
        raise ResultError(f"cannot encode the segmentation: {exc}") from exc
    logger.debug(
        "SEG %s: %d segments, %d frames, series %s",
        uids.seg_sop_uid,
        len(numbers),
        int(seg.NumberOfFrames),
        volume.series_instance_uid,
    )
    return seg


def _segment_label_map(seg: Dataset) -> dict[int, str]:
    return {int(item.SegmentNumber): str(item.SegmentLabel) for item in seg.SegmentSequence}


def build_sr(
    volume: Volume,
    labels: npt.NDArray[np.integer],
    manifest: ModelManifest,
    seg: Dataset,
    uids: ResultUIDs,
    *,
    equipment: Equipment,
) -> Dataset:
    """Encode the segment measurements as a TID 1500 Comprehensive 3D SR.

    The worker's path to the same bytes in a few milliseconds, prepared before the labels
    exist, is :class:`segnode.node.results.sr_encode.SrPlan`; this function is the reference it is
    tested against. It is :func:`segment_statistics` then :func:`sr_of_statistics`.

    Parameters
    ----------
    volume, labels, manifest
        As given to :func:`build_seg`.
    seg
        The SEG built from them (its SOP Instance UID and segment numbers are referenced);
        BINARY, or LABELMAP (Label Map Segmentation Storage).
    uids
        Series and SOP Instance UIDs of the SR (tracking UIDs derive from them).
    equipment
        Equipment and series values of the SR (the node's: :meth:`Equipment.for_sr`); the
        observer device (TID 1004) is named after its ``manufacturer`` and
        ``device_serial``.

    Returns
    -------
    pydicom.Dataset
        A ``highdicom.sr.Comprehensive3DSR`` (complete, unverified).

    Raises
    ------
    NoSegmentsError
        No label is present in ``labels``.
    ResultError
        ``seg`` does not describe the segments of ``labels``.
    """
    return sr_of_statistics(
        segment_statistics(volume, labels, manifest), volume, manifest, seg, uids, equipment
    )


def sr_of_statistics(
    stats: Sequence[SegmentStatistics],
    volume: Volume,
    manifest: ModelManifest,
    seg: Dataset,
    uids: ResultUIDs,
    equipment: Equipment,
) -> Dataset:
    """:func:`build_sr` from the measurements of its label map (``stats``, in segment
    order) and the SR's ``equipment``.

    Raises
    ------
    NoSegmentsError
        ``stats`` is empty.
    ResultError
        ``seg`` does not describe the segments of ``stats``.
    """
    if not stats:
        raise NoSegmentsError("no segment found; no SR is produced")
    described = _segment_label_map(seg)
    if str(seg.SOPClassUID) == LABEL_MAP_SEGMENTATION_STORAGE:
        described.pop(0, None)  # a label map describes its background as segment 0
    expected = {s.segment_number: s.label.name[:64] for s in stats}
    if described != expected:
        raise ResultError(f"SEG segments {described} do not match the label map {expected}")
    if str(seg.SOPInstanceUID) != uids.seg_sop_uid:
        raise ResultError("seg is not the SEG of these ResultUIDs")
    report = measurement_report(
        stats,
        manifest,
        uids,
        seg_sop_class_uid=str(seg.SOPClassUID),
        source_series_uid=volume.series_instance_uid,
        equipment=equipment,
    )
    return sr_document(
        [seg, *_source_headers(volume)],
        report,
        manifest,
        uids,
        specific_character_set=_character_set(volume),
        equipment=equipment,
    )


def measurement_report(
    stats: Sequence[SegmentStatistics],
    manifest: ModelManifest,
    uids: ResultUIDs,
    *,
    seg_sop_class_uid: str,
    source_series_uid: str,
    equipment: Equipment,
) -> MeasurementReport:
    """The TID 1500 content of :func:`build_sr`: one TID 1411 group per entry of ``stats``.

    Each group references segment ``segment_number`` of the SEG ``uids.seg_sop_uid`` (of
    class ``seg_sop_class_uid``) and holds the volume (mL, 6 decimals), mean and standard
    deviation (HU, 4 decimals); its tracking UID derives from ``uids.sr_sop_uid`` and the
    segment number. The observer device is named after the SR's ``equipment`` (its
    manufacturer and device serial number).
    """
    device = DeviceObserverIdentifyingAttributes(
        uid=derived_uid("segnode-device", equipment.manufacturer, equipment.device_serial),
        name="segnode",
        manufacturer_name=equipment.manufacturer,
        model_name=f"{manifest.name} {manifest.version}"[:64],
        serial_number=equipment.device_serial,
    )
    context = ObservationContext(
        observer_device_context=ObserverContext(
            observer_type=codes.cid270.Device, observer_identifying_attributes=device
        )
    )
    algorithm = AlgorithmIdentification(
        name=manifest.name,
        version=manifest.version,
        family=codes.cid7162.ArtificialIntelligence,
        parameters=[f"precision={manifest.precision}"],
    )
    groups = []
    for s in stats:
        spec = s.label
        anatomical = (spec.category[0], spec.category[1]) in ANATOMICAL_STRUCTURES
        groups.append(
            VolumetricROIMeasurementsAndQualitativeEvaluations(
                tracking_identifier=TrackingIdentifier(
                    uid=derived_uid(uids.sr_sop_uid, "segment", str(s.segment_number)),
                    identifier=spec.name[:64],
                ),
                referenced_segment=ReferencedSegment(
                    sop_class_uid=seg_sop_class_uid,
                    sop_instance_uid=uids.seg_sop_uid,
                    segment_number=s.segment_number,
                    source_series=SourceSeriesForSegmentation(source_series_uid),
                ),
                finding_type=_code(spec.type),
                finding_category=_code(spec.category),
                finding_sites=[_finding_site(spec)] if anatomical else None,
                algorithm_id=algorithm,
                measurements=[
                    Measurement(
                        name=codes.SCT.Volume,
                        value=round(s.volume_ml, 6),
                        unit=MILLILITER,
                        method=codes.cid7472.VolumeFromVoxelSummation,
                    ),
                    Measurement(
                        name=codes.DCM.AttenuationCoefficient,
                        value=round(s.mean_hu, 4),
                        unit=HOUNSFIELD_UNIT,
                        derivation=codes.cid7464.Mean,
                    ),
                    Measurement(
                        name=codes.DCM.AttenuationCoefficient,
                        value=round(s.std_hu, 4),
                        unit=HOUNSFIELD_UNIT,
                        derivation=codes.cid7464.StandardDeviation,
                    ),
                ],
            )
        )
    return MeasurementReport(
        observation_context=context,
        procedure_reported=codes.cid100.CTUnspecifiedBodyRegion,
        imaging_measurements=groups,
    )


def sr_document(
    evidence: Sequence[Dataset],
    report: MeasurementReport,
    manifest: ModelManifest,
    uids: ResultUIDs,
    *,
    specific_character_set: str | list[str] | None,
    equipment: Equipment,
) -> Comprehensive3DSR:
    """The Comprehensive 3D SR of :func:`build_sr` around ``report``, made by ``equipment``
    (:func:`build_sr`'s: its Manufacturer's Model Name is ``"segnode"``).

    highdicom takes the Patient and Study modules, and the Contributing Equipment, from
    ``evidence[0]`` (the SEG) and lists all of ``evidence`` in the Current Requested
    Procedure Evidence Sequence.
    """
    try:
        return Comprehensive3DSR(
            evidence=evidence,
            content=report,
            series_instance_uid=uids.sr_series_uid,
            sop_instance_uid=uids.sr_sop_uid,
            is_complete=True,
            series_description=f"SR {manifest.name}"[:64],
            specific_character_set=specific_character_set,
            **equipment.arguments(),
        )
    except (ValueError, TypeError) as exc:
        raise ResultError(f"cannot encode the measurement report: {exc}") from exc


# ------------------------------------------------------------------------------ verify


def _reencode(ds: Dataset) -> Dataset:
    """Write ``ds`` to bytes and read it back, as a receiver would."""
    buffer = io.BytesIO()
    try:
        pydicom.dcmwrite(buffer, ds, enforce_file_format=True)
    except (ValueError, TypeError, AttributeError) as exc:
        raise ResultError(f"the SEG cannot be written: {exc}") from exc
    buffer.seek(0)
    return pydicom.dcmread(buffer)


def _item(ds: Dataset, frame: int, sequence: str) -> Dataset | None:
    per_frame = ds.PerFrameFunctionalGroupsSequence[frame]
    if sequence in per_frame:
        return per_frame[sequence][0]  # type: ignore[no-any-return]
    shared = ds.SharedFunctionalGroupsSequence[0]
    if sequence in shared:
        return shared[sequence][0]  # type: ignore[no-any-return]
    return None


def verify_seg(
    seg: Dataset,
    volume: Volume,
    labels: npt.NDArray[np.integer],
    *,
    encoded: bytes | None = None,
    with_highdicom: bool = False,
) -> None:
    """Check that the encoded SEG reproduces ``labels`` on the geometry of ``volume``.

    The SEG is written to bytes (or ``encoded``, the exact bytes that will be sent, is used)
    and read back; then

    * SOP Class, Study, Frame of Reference and the references to every source instance
      (Referenced Series Sequence, PS3.3 C.12.2) are checked;
    * the shared orientation and pixel spacing must equal the volume's, and every frame's
      Image Position (Patient) must be a slice position of the volume (0.01 mm);
    * every frame's source reference (Derivation Image Sequence) must name the source
      instance (and frame) of that slice;
    * the frames, put back at those slices, must give ``labels`` exactly (segment numbers
      mapped back to label values through the Segment Labels);
    * with ``with_highdicom``, highdicom's reader, addressing frames by their source
      references, must agree too. The tests run that (0.9 s of 1.3 s for 128 x 512 x 512
      frames); the worker, before every send, the checks above (pydicom reads the bytes).

    Raises
    ------
    ResultError
        Naming the first disagreement.
    """
    ds = _reencode(seg) if encoded is None else pydicom.dcmread(io.BytesIO(encoded))
    if str(ds.SOPClassUID) != SEGMENTATION_STORAGE:
        raise ResultError(f"SOP Class {ds.SOPClassUID} is not Segmentation Storage")
    for keyword, expected in (
        ("FrameOfReferenceUID", volume.frame_of_reference_uid),
        ("StudyInstanceUID", volume.study_instance_uid),
    ):
        if str(ds.get(keyword, "")) != expected:
            raise ResultError(f"{keyword} {ds.get(keyword)} differs from the source {expected}")
    referenced = {
        str(item.ReferencedSOPInstanceUID)
        for series in ds.get("ReferencedSeriesSequence", [])
        for item in series.ReferencedInstanceSequence
    }
    missing = [str(s.SOPInstanceUID) for s in volume.sources if s.SOPInstanceUID not in referenced]
    if missing:
        raise ResultError(f"SEG does not reference source instances {missing[:3]}...")

    shared = ds.SharedFunctionalGroupsSequence[0]
    iop = np.array([float(v) for v in shared.PlaneOrientationSequence[0].ImageOrientationPatient])
    expected_iop = np.array(volume.row_direction + volume.column_direction)
    if np.max(np.abs(iop - expected_iop)) > ORIENTATION_TOLERANCE:
        raise ResultError(f"SEG orientation {iop.tolist()} differs from {expected_iop.tolist()}")
    spacing = [float(v) for v in shared.PixelMeasuresSequence[0].PixelSpacing]
    if max(abs(spacing[0] - volume.spacing[1]), abs(spacing[1] - volume.spacing[2])) > 1e-4:
        raise ResultError(f"SEG pixel spacing {spacing} differs from {volume.spacing[1:]}")
    if (int(ds.Rows), int(ds.Columns)) != volume.shape[1:]:
        raise ResultError(f"SEG frames are {ds.Rows}x{ds.Columns}, volume {volume.shape[1:]}")

    if labels.shape != volume.shape or (labels.size and int(labels.min()) < 0):
        raise ResultError(f"label map of shape {labels.shape} does not fit {volume.shape}")
    counts = np.bincount(labels.ravel().astype(np.intp, copy=False))
    present = [v for v in np.flatnonzero(counts).tolist() if v != 0]
    numbers = {number: value for number, value in enumerate(present, start=1)}
    names = _segment_label_map(ds)
    if sorted(names) != list(range(1, len(numbers) + 1)) or len(names) != len(numbers):
        raise ResultError(f"SEG describes segments {sorted(names)}, label map has {numbers}")

    positions = np.array(volume.slice_positions)
    frames = ds.pixel_array
    if frames.ndim == 2:
        frames = frames[None]
    rebuilt = np.zeros(volume.shape, dtype=labels.dtype)
    for f in range(frames.shape[0]):
        identification = _item(ds, f, "SegmentIdentificationSequence")
        plane = _item(ds, f, "PlanePositionSequence")
        if identification is None or plane is None:
            raise ResultError(f"SEG frame {f + 1} lacks its segment number or plane position")
        number = int(identification.ReferencedSegmentNumber)
        ipp = np.array([float(v) for v in plane.ImagePositionPatient])
        distance = np.linalg.norm(positions - ipp, axis=1)
        k = int(np.argmin(distance))
        if distance[k] > POSITION_TOLERANCE_MM:
            raise ResultError(
                f"SEG frame {f + 1} at {ipp.tolist()} is not at any source slice position "
                f"(nearest {distance[k]:.3f} mm away)"
            )
        if number not in numbers:
            raise ResultError(f"SEG frame {f + 1} refers to unknown segment {number}")
        _check_source_reference(ds, f, volume, k)
        mask = frames[f].astype(bool)
        if np.any(rebuilt[k][mask]):
            raise ResultError(f"SEG frame {f + 1} overlaps another segment on slice {k}")
        rebuilt[k][mask] = numbers[number]
    if not np.array_equal(rebuilt, labels):
        diff = np.argwhere(rebuilt != labels)
        raise ResultError(
            f"SEG does not reproduce the label map: {len(diff)} voxels differ, first at "
            f"(z, y, x) = {tuple(int(v) for v in diff[0])}"
        )
    if with_highdicom:
        _verify_with_highdicom(ds, volume, labels, numbers)


def _check_source_reference(ds: Dataset, frame: int, volume: Volume, k: int) -> None:
    """The frame's Derivation Image Sequence names slice ``k``'s source (and frame)."""
    derivation = _item(ds, frame, "DerivationImageSequence")
    try:
        source = derivation.SourceImageSequence[0] if derivation is not None else None
        uid = str(source.ReferencedSOPInstanceUID) if source is not None else None
    except (AttributeError, IndexError):
        uid = None
    if volume.is_multiframe:
        expected_uid = str(volume.sources[0].SOPInstanceUID)
        wanted_frame: int | None = int(volume.frame_numbers[k])
    else:
        expected_uid = str(volume.sources[k].SOPInstanceUID)
        wanted_frame = None
    if uid != expected_uid:
        raise ResultError(
            f"SEG frame {frame + 1} derives from {uid}, not from slice {k}'s source {expected_uid}"
        )
    if wanted_frame is not None:
        assert source is not None
        got_frame = _first_int(source.get("ReferencedFrameNumber"))
        if got_frame != wanted_frame:
            raise ResultError(
                f"SEG frame {frame + 1} derives from frame {got_frame}, not {wanted_frame}"
            )


def _first_int(value: object) -> int | None:
    """The first value of an IS element (VM 1-n) as an int, None if absent or invalid."""
    if isinstance(value, MultiValue | list | tuple):
        value = value[0] if value else None
    try:
        return None if value is None else int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def seg_label_map(seg: hd.seg.Segmentation, volume: Volume) -> npt.NDArray[np.integer]:
    """The segment numbers of ``seg`` on ``volume``'s grid ``(z, y, x)``, found by the
    SEG's source references (highdicom), as a viewer reads them."""
    if volume.is_multiframe:
        pixels = seg.get_pixels_by_source_frame(
            source_sop_instance_uid=str(volume.sources[0].SOPInstanceUID),
            source_frame_numbers=list(volume.frame_numbers),
            combine_segments=True,
            assert_missing_frames_are_empty=True,
        )
    else:
        pixels = seg.get_pixels_by_source_instance(
            source_sop_instance_uids=[str(s.SOPInstanceUID) for s in volume.sources],
            combine_segments=True,
            assert_missing_frames_are_empty=True,
        )
    return np.asarray(pixels)


def _verify_with_highdicom(
    ds: Dataset,
    volume: Volume,
    labels: npt.NDArray[np.integer],
    numbers: dict[int, int],
) -> None:
    try:
        array = seg_label_map(hd.seg.Segmentation.from_dataset(ds, copy=False), volume)
    except (ValueError, RuntimeError, KeyError, AttributeError) as exc:
        raise ResultError(f"highdicom cannot read the SEG back by source reference: {exc}") from exc
    lut = np.zeros(max(numbers) + 1, dtype=labels.dtype)
    for number, value in numbers.items():
        lut[number] = value
    if not np.array_equal(lut[array], labels):
        raise ResultError("SEG frames read back by source reference do not reproduce the labels")
