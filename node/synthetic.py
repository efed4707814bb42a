"""Synthetic CT series (a body phantom) for tests and benchmarks.

The phantom is drawn in image coordinates, identically for every orientation: outside an
elliptical body there is air; the body has a fat rim and a soft-tissue core; a bone "spine"
rod runs through every slice and two air "lungs" fill the upper half of the stack (slices
with index ``k >= slices // 2`` in ascending order along the slice normal). Gaussian noise
is added everywhere. :func:`phantom_labels` returns the noise-free label map, so tests know
the truth.

Pixels are stored as unsigned 12-bit values (Bits Allocated 16, Bits Stored 12, Pixel
Representation 0) with Rescale Intercept -1024 and Rescale Slope 1, so stored 0 is -1024 HU
and HU above 3071 are clipped - the layout of most scanners (PS3.3 C.8.2.1).

Instances are CT Image Storage (PS3.3 A.3) or, from :func:`write_enhanced_ct`, one Enhanced
CT Image Storage instance (PS3.3 A.38). UIDs are derived from the seed unless given, so a
call is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.encaps import encapsulate
from pydicom.sequence import Sequence as DicomSequence
from pydicom.uid import (
    PYDICOM_IMPLEMENTATION_UID,
    UID,
    DeflatedExplicitVRLittleEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEGLosslessSV1,
    generate_uid,
)

from node.volume import CT_IMAGE_STORAGE, ENHANCED_CT_IMAGE_STORAGE

# Label values of the phantom and their nominal HU.
AIR, SOFT_TISSUE, FAT, LEFT_LUNG, RIGHT_LUNG, SPINE = 0, 1, 2, 3, 4, 5
NOMINAL_HU: dict[int, float] = {
    AIR: -1000.0,
    SOFT_TISSUE: 40.0,
    FAT: -100.0,
    LEFT_LUNG: -850.0,
    RIGHT_LUNG: -850.0,
    SPINE: 700.0,
}
NOISE_HU = 10.0
RESCALE_INTERCEPT = -1024
AXIAL: tuple[float, ...] = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)
SAGITTAL: tuple[float, ...] = (0.0, 1.0, 0.0, 0.0, 0.0, -1.0)
CORONAL: tuple[float, ...] = (1.0, 0.0, 0.0, 0.0, 0.0, -1.0)

_UNCOMPRESSED = {ExplicitVRLittleEndian, ImplicitVRLittleEndian, DeflatedExplicitVRLittleEndian}


def phantom_labels(rows: int, columns: int, slices: int) -> npt.NDArray[np.uint8]:
    """Noise-free label map ``(slices, rows, columns)`` of the phantom (values 0..5)."""
    y, x = np.mgrid[0:rows, 0:columns].astype(np.float32)
    cy, cx = (rows - 1) / 2.0, (columns - 1) / 2.0

    def ellipse(x0: float, y0: float, ax: float, ay: float) -> npt.NDArray[np.bool_]:
        result: npt.NDArray[np.bool_] = ((x - x0) / ax) ** 2 + ((y - y0) / ay) ** 2 <= 1.0
        return result

    body = ellipse(cx, cy, 0.42 * columns, 0.30 * rows)
    core = ellipse(cx, cy, 0.38 * columns, 0.26 * rows)
    spine = ellipse(cx, cy + 0.17 * rows, 0.05 * columns, 0.05 * rows)
    left = ellipse(cx + 0.17 * columns, cy - 0.04 * rows, 0.12 * columns, 0.15 * rows)
    right = ellipse(cx - 0.17 * columns, cy - 0.04 * rows, 0.12 * columns, 0.15 * rows)

    lower = np.zeros((rows, columns), dtype=np.uint8)
    lower[body] = FAT
    lower[core] = SOFT_TISSUE
    lower[spine] = SPINE
    upper = lower.copy()
    upper[left & core] = LEFT_LUNG
    upper[right & core] = RIGHT_LUNG
    out = np.empty((slices, rows, columns), dtype=np.uint8)
    out[: slices // 2] = lower
    out[slices // 2 :] = upper
    return out


def phantom_hu(rows: int, columns: int, slices: int, *, seed: int = 0) -> npt.NDArray[np.int16]:
    """HU of the phantom (integers, noise included), shape ``(slices, rows, columns)``."""
    labels = phantom_labels(rows, columns, slices)
    lut = np.array([NOMINAL_HU[v] for v in range(6)], dtype=np.float32)
    rng = np.random.default_rng(seed)
    hu = lut[labels] + rng.normal(0.0, NOISE_HU, labels.shape).astype(np.float32)
    return np.clip(np.rint(hu), -1024, 3071).astype(np.int16)


def _uid(seed: int, *parts: object) -> UID:
    return generate_uid(entropy_srcs=["segnode-synthetic", str(seed), *map(str, parts)])


def _positions(
    orientation: Sequence[float],
    rows: int,
    columns: int,
    slices: int,
    pixel_spacing: float,
    slice_spacing: float,
    origin: Sequence[float] | None,
) -> tuple[list[list[float]], npt.NDArray[np.float64]]:
    row = np.asarray(orientation[:3], dtype=np.float64)
    col = np.asarray(orientation[3:], dtype=np.float64)
    normal = np.cross(row, col)
    if origin is None:
        start = -(
            (columns - 1) / 2 * pixel_spacing * row
            + (rows - 1) / 2 * pixel_spacing * col
            + (slices - 1) / 2 * slice_spacing * normal
        )
    else:
        start = np.asarray(origin, dtype=np.float64)
    positions = [
        [round(float(v), 4) for v in start + k * slice_spacing * normal] for k in range(slices)
    ]
    return positions, normal


def _patient_study(ds: Dataset, *, patient_id: str, study_uid: str) -> None:
    """Patient, General Study, Patient Study modules (PS3.3 C.7.1.1, C.7.2.1)."""
    ds.SpecificCharacterSet = "ISO_IR 100"
    ds.PatientName = "SYNTHETIC^PHANTOM"
    ds.PatientID = patient_id
    ds.PatientBirthDate = ""
    ds.PatientSex = "O"
    ds.StudyInstanceUID = study_uid
    ds.StudyDate = "20240101"
    ds.StudyTime = "120000"
    ds.ReferringPhysicianName = ""
    ds.StudyID = "1"
    ds.AccessionNumber = ""
    ds.StudyDescription = "Synthetic phantom"


def synthetic_datasets(
    *,
    rows: int = 512,
    columns: int = 512,
    slices: int = 128,
    pixel_spacing: float = 0.7,
    slice_spacing: float = 1.25,
    orientation: Sequence[float] = AXIAL,
    origin: Sequence[float] | None = None,
    seed: int = 0,
    study_uid: str | None = None,
    series_uid: str | None = None,
    frame_of_reference_uid: str | None = None,
    patient_id: str = "SYNTH",
    modality: str = "CT",
    series_number: int = 1,
    images_in_acquisition: bool = False,
    hu: npt.NDArray[np.int16] | None = None,
) -> list[Dataset]:
    """Build the phantom as single-frame CT Image Storage datasets (uncompressed, in memory).

    Parameters
    ----------
    rows, columns, slices
        Matrix size and number of slices.
    pixel_spacing, slice_spacing
        Millimetres; ``slice_spacing`` is also the Slice Thickness.
    orientation
        Image Orientation (Patient), six direction cosines; the stack advances along
        ``row x column``.
    origin
        Image Position (Patient) of the first slice; default centres the volume on 0.
    seed
        Seeds the noise and the UIDs that are not given.
    study_uid, series_uid, frame_of_reference_uid
        UIDs; derived from ``seed`` when ``None``.
    patient_id, modality, series_number
        Header values (``modality`` other than "CT" is for negative tests).
    images_in_acquisition
        Write Images in Acquisition (0020,1002) = ``slices`` (the count hint that lets the
        node complete the series geometrically).
    hu
        ``(slices, rows, columns)`` HU values to store instead of the phantom (-1024..3071).

    Returns
    -------
    list of pydicom.Dataset
        One dataset per slice, in ascending order along the normal, with file meta.
    """
    study_uid = study_uid or _uid(seed, "study")
    series_uid = series_uid or _uid(seed, "series", series_number)
    frame_of_reference_uid = frame_of_reference_uid or _uid(seed, "for")
    if hu is None:
        hu = phantom_hu(rows, columns, slices, seed=seed)
    elif hu.shape != (slices, rows, columns):
        raise ValueError(f"hu has shape {hu.shape}, expected {(slices, rows, columns)}")
    stored = (hu.astype(np.int32) - RESCALE_INTERCEPT).astype(np.uint16)
    positions, normal = _positions(
        orientation, rows, columns, slices, pixel_spacing, slice_spacing, origin
    )
    axial = np.allclose(np.abs(normal), (0.0, 0.0, 1.0))
    out = []
    for k in range(slices):
        sop_uid = _uid(seed, series_uid, k)
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID = UID(CT_IMAGE_STORAGE)
        meta.MediaStorageSOPInstanceUID = sop_uid
        meta.TransferSyntaxUID = ExplicitVRLittleEndian
        meta.ImplementationClassUID = PYDICOM_IMPLEMENTATION_UID
        ds = Dataset()
        ds.file_meta = meta
        _patient_study(ds, patient_id=patient_id, study_uid=study_uid)
        # General Series (C.7.3.1)
        ds.Modality = modality
        ds.SeriesInstanceUID = series_uid
        ds.SeriesNumber = series_number
        ds.SeriesDescription = "Synthetic phantom"
        ds.BodyPartExamined = "CHEST"
        ds.PatientPosition = "HFS"
        # Frame of Reference (C.7.4.1)
        ds.FrameOfReferenceUID = frame_of_reference_uid
        ds.PositionReferenceIndicator = ""
        # General Equipment (C.7.5.1)
        ds.Manufacturer = "segnode"
        ds.ManufacturerModelName = "synthetic"
        # General Image (C.7.6.1), General Acquisition (C.7.10.1)
        ds.InstanceNumber = k + 1
        ds.ContentDate = "20240101"
        ds.ContentTime = "120000"
        ds.AcquisitionNumber = 1
        if images_in_acquisition:
            ds.ImagesInAcquisition = slices
        # Image Plane (C.7.6.2)
        ds.PixelSpacing = [pixel_spacing, pixel_spacing]
        ds.ImageOrientationPatient = [round(float(v), 10) for v in orientation]
        ds.ImagePositionPatient = positions[k]
        ds.SliceThickness = slice_spacing
        ds.SliceLocation = round(float(np.dot(positions[k], normal)), 4)
        # CT Image (C.8.2.1) and Image Pixel (C.7.6.3)
        ds.ImageType = (
            ["ORIGINAL", "PRIMARY", "AXIAL"] if axial else ["DERIVED", "SECONDARY", "OTHER"]
        )
        ds.SamplesPerPixel = 1
        ds.PhotometricInterpretation = "MONOCHROME2"
        ds.Rows = rows
        ds.Columns = columns
        ds.BitsAllocated = 16
        ds.BitsStored = 12
        ds.HighBit = 11
        ds.PixelRepresentation = 0
        ds.RescaleIntercept = RESCALE_INTERCEPT
        ds.RescaleSlope = 1
        ds.RescaleType = "HU"
        ds.KVP = 120
        ds.WindowCenter = 40
        ds.WindowWidth = 400
        # SOP Common (C.12.1)
        ds.SOPClassUID = UID(CT_IMAGE_STORAGE)
        ds.SOPInstanceUID = sop_uid
        ds.PixelData = stored[k].tobytes()
        out.append(ds)
    return out


def encode(ds: Dataset, transfer_syntax: str) -> None:
    """Re-encode ``ds`` in place into ``transfer_syntax`` (lossless syntaxes only).

    Uncompressed syntaxes (Implicit / Explicit VR Little Endian, Deflated) only change the
    file meta; RLE Lossless, JPEG-LS Lossless and JPEG 2000 Lossless go through pydicom's
    encoders (pydicom/pylibjpeg-rle, pyjpegls, pylibjpeg-openjpeg). pydicom has no JPEG
    Lossless (Process 14) encoder, so JPEG Lossless SV1 uses :func:`jpeg_lossless_sv1`.
    """
    uid = UID(transfer_syntax)
    if uid in _UNCOMPRESSED:
        ds.file_meta.TransferSyntaxUID = uid
        return
    if uid == JPEGLosslessSV1:
        frames = ds.pixel_array.reshape(-1, int(ds.Rows), int(ds.Columns))
        ds.PixelData = encapsulate(
            [jpeg_lossless_sv1(f, int(ds.BitsStored)) for f in frames.astype(np.uint16)]
        )
        ds["PixelData"].VR = "OB"
        ds.file_meta.TransferSyntaxUID = uid
        return
    ds.compress(uid)


def jpeg_lossless_sv1(frame: npt.NDArray[np.uint16], precision: int) -> bytes:
    """Encode one greyscale frame as JPEG Lossless, Process 14, Selection Value 1.

    A minimal ITU-T T.81 (ISO 10918-1) H.1 encoder for test data: one component, predictor
    1 (left neighbour; the row above for the first column, ``2**(precision-1)`` for the
    first pixel), no point transform, and a fixed Huffman table giving every difference
    category 0..16 a 5-bit code. Pure Python; meant for small frames.
    """
    rows, columns = frame.shape
    x = frame.astype(np.int64)
    prediction = np.empty_like(x)
    prediction[:, 1:] = x[:, :-1]
    prediction[1:, 0] = x[:-1, 0]
    prediction[0, 0] = 1 << (precision - 1)
    diffs = ((x - prediction) % 65536).ravel()
    diffs = np.where(diffs > 32768, diffs - 65536, diffs)

    bits: list[str] = []
    for d in diffs.tolist():
        size = abs(d).bit_length()
        bits.append(format(size, "05b"))
        if 0 < size < 16:
            bits.append(format(d if d > 0 else d - 1 + (1 << size), f"0{size}b"))
    stream = "".join(bits)
    stream += "1" * (-len(stream) % 8)
    data = bytearray()
    for i in range(0, len(stream), 8):
        byte = int(stream[i : i + 8], 2)
        data.append(byte)
        if byte == 0xFF:
            data.append(0x00)  # byte stuffing (T.81 F.1.2.3)

    def segment(marker: int, payload: bytes) -> bytes:
        return bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload

    counts = bytes(4) + bytes([17]) + bytes(11)  # 17 codes of length 5
    huffman = segment(0xC4, bytes([0x00]) + counts + bytes(range(17)))
    sof3 = segment(
        0xC3,
        bytes([precision]) + rows.to_bytes(2, "big") + columns.to_bytes(2, "big")
        + bytes([1, 1, 0x11, 0]),
    )  # fmt: skip
    sos = segment(0xDA, bytes([1, 1, 0x00, 1, 0, 0]))  # Ss = predictor 1, Se = 0, Al = 0
    return b"\xff\xd8" + huffman + sof3 + sos + bytes(data) + b"\xff\xd9"


def write_synthetic_series(
    out_dir: Path,
    *,
    rows: int = 512,
    columns: int = 512,
    slices: int = 128,
    pixel_spacing: float = 0.7,
    slice_spacing: float = 1.25,
    transfer_syntax: str = ExplicitVRLittleEndian,
    seed: int = 0,
    study_uid: str | None = None,
    series_uid: str | None = None,
    patient_id: str = "SYNTH",
    modality: str = "CT",
    orientation: Sequence[float] = AXIAL,
    origin: Sequence[float] | None = None,
    frame_of_reference_uid: str | None = None,
    images_in_acquisition: bool = False,
    hu: npt.NDArray[np.int16] | None = None,
) -> list[Path]:
    """Write the phantom as a CT Image Storage series, one file per slice.

    Parameters are those of :func:`synthetic_datasets`, plus

    out_dir
        Created if missing; files are named ``CT{k:04d}.dcm`` (k from 1, ascending along
        the normal).
    transfer_syntax
        Any of Explicit / Implicit VR Little Endian, Deflated Explicit VR Little Endian,
        RLE Lossless, JPEG-LS Lossless, JPEG 2000 Lossless, JPEG Lossless SV1.

    Returns
    -------
    list of pathlib.Path
        The files, in ascending order along the normal.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    datasets = synthetic_datasets(
        rows=rows,
        columns=columns,
        slices=slices,
        pixel_spacing=pixel_spacing,
        slice_spacing=slice_spacing,
        orientation=orientation,
        origin=origin,
        seed=seed,
        study_uid=study_uid,
        series_uid=series_uid,
        frame_of_reference_uid=frame_of_reference_uid,
        patient_id=patient_id,
        modality=modality,
        images_in_acquisition=images_in_acquisition,
        hu=hu,
    )
    for k, ds in enumerate(datasets, start=1):
        encode(ds, transfer_syntax)
        path = out_dir / f"CT{k:04d}.dcm"
        ds.save_as(path, enforce_file_format=True)
        paths.append(path)
    return paths


def write_enhanced_ct(
    path: Path,
    *,
    rows: int = 512,
    columns: int = 512,
    slices: int = 128,
    pixel_spacing: float = 0.7,
    slice_spacing: float = 1.25,
    orientation: Sequence[float] = AXIAL,
    seed: int = 0,
    study_uid: str | None = None,
    series_uid: str | None = None,
    patient_id: str = "SYNTH",
    per_frame_rescale: bool = False,
    frame_order: Sequence[int] | None = None,
    transfer_syntax: str = ExplicitVRLittleEndian,
) -> Path:
    """Write the phantom as one Enhanced CT Image Storage instance (PS3.3 A.38).

    Parameters
    ----------
    path
        Output file.
    per_frame_rescale
        Put the Pixel Value Transformation in each frame's functional groups (with a
        different intercept per frame, stored values shifted to match) instead of the shared
        ones (PS3.3 C.7.6.16.2.9).
    frame_order
        Permutation of ``range(slices)``: frame ``f`` holds phantom slice
        ``frame_order[f]``. Default ascending.
    transfer_syntax
        As for :func:`write_synthetic_series`.

    Other parameters are those of :func:`synthetic_datasets`.

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    order = list(range(slices)) if frame_order is None else [int(i) for i in frame_order]
    if sorted(order) != list(range(slices)):
        raise ValueError("frame_order must be a permutation of range(slices)")
    study_uid = study_uid or _uid(seed, "study")
    series_uid = series_uid or _uid(seed, "series", "enhanced")
    sop_uid = _uid(seed, series_uid, "enhanced")
    hu = phantom_hu(rows, columns, slices, seed=seed)
    positions, _ = _positions(
        orientation, rows, columns, slices, pixel_spacing, slice_spacing, None
    )
    intercepts = [
        float(RESCALE_INTERCEPT - (f % 4 if per_frame_rescale else 0)) for f in range(slices)
    ]
    stored = np.stack(
        [(hu[order[f]].astype(np.int32) - int(intercepts[f])) for f in range(slices)]
    ).astype(np.uint16)

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = UID(ENHANCED_CT_IMAGE_STORAGE)
    meta.MediaStorageSOPInstanceUID = sop_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    meta.ImplementationClassUID = PYDICOM_IMPLEMENTATION_UID
    ds = Dataset()
    ds.file_meta = meta
    _patient_study(ds, patient_id=patient_id, study_uid=study_uid)
    ds.Modality = "CT"
    ds.SeriesInstanceUID = series_uid
    ds.SeriesNumber = 2
    ds.SeriesDescription = "Synthetic phantom (enhanced)"
    ds.PatientPosition = "HFS"
    ds.FrameOfReferenceUID = _uid(seed, "for")
    ds.PositionReferenceIndicator = ""
    # Enhanced General Equipment (C.7.5.2)
    ds.Manufacturer = "segnode"
    ds.ManufacturerModelName = "synthetic"
    ds.DeviceSerialNumber = "0"
    ds.SoftwareVersions = "1"
    # Enhanced CT Image (C.8.15.2), Image Pixel
    ds.ImageType = ["DERIVED", "PRIMARY", "VOLUME", "NONE"]
    ds.PixelPresentation = "MONOCHROME"
    ds.VolumetricProperties = "VOLUME"
    ds.VolumeBasedCalculationTechnique = "NONE"
    ds.ContentQualification = "RESEARCH"
    ds.InstanceNumber = 1
    ds.ContentDate = "20240101"
    ds.ContentTime = "120000"
    ds.AcquisitionNumber = 1
    ds.AcquisitionDateTime = "20240101120000"
    ds.AcquisitionDuration = 1.0
    ds.BurnedInAnnotation = "NO"
    ds.LossyImageCompression = "00"
    ds.PresentationLUTShape = "IDENTITY"
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.Rows = rows
    ds.Columns = columns
    ds.BitsAllocated = 16
    ds.BitsStored = 12
    ds.HighBit = 11
    ds.PixelRepresentation = 0
    ds.AcquisitionContextSequence = DicomSequence()
    # Multi-frame Functional Groups (C.7.6.16) and Dimension (C.7.6.17)
    ds.NumberOfFrames = slices
    dim_uid = _uid(seed, series_uid, "dimension")
    dims = []
    for pointer, group in ((0x00209056, 0x00209111), (0x00209057, 0x00209111)):
        item = Dataset()
        item.DimensionOrganizationUID = dim_uid
        item.DimensionIndexPointer = pointer
        item.FunctionalGroupPointer = group
        dims.append(item)
    org = Dataset()
    org.DimensionOrganizationUID = dim_uid
    ds.DimensionOrganizationSequence = [org]
    ds.DimensionIndexSequence = dims
    ds.DimensionOrganizationType = "3D"

    shared = Dataset()
    measures = Dataset()
    measures.PixelSpacing = [pixel_spacing, pixel_spacing]
    measures.SliceThickness = slice_spacing
    shared.PixelMeasuresSequence = [measures]
    plane = Dataset()
    plane.ImageOrientationPatient = [round(float(v), 10) for v in orientation]
    shared.PlaneOrientationSequence = [plane]
    frame_type = Dataset()
    frame_type.FrameType = ["DERIVED", "PRIMARY", "VOLUME", "NONE"]
    frame_type.PixelPresentation = "MONOCHROME"
    frame_type.VolumetricProperties = "VOLUME"
    frame_type.VolumeBasedCalculationTechnique = "NONE"
    shared.CTImageFrameTypeSequence = [frame_type]
    anatomy = Dataset()
    anatomy.FrameLaterality = "U"
    region = Dataset()
    region.CodeValue = "51185008"
    region.CodingSchemeDesignator = "SCT"
    region.CodeMeaning = "Thorax"
    anatomy.AnatomicRegionSequence = [region]
    shared.FrameAnatomySequence = [anatomy]
    irradiation = Dataset()
    irradiation.IrradiationEventUID = _uid(seed, series_uid, "irradiation")
    shared.IrradiationEventIdentificationSequence = [irradiation]
    if not per_frame_rescale:
        shared.PixelValueTransformationSequence = [_rescale(intercepts[0])]
    ds.SharedFunctionalGroupsSequence = [shared]

    per_frame = []
    for f in range(slices):
        item = Dataset()
        content = Dataset()
        content.FrameAcquisitionDateTime = "20240101120000"
        content.FrameReferenceDateTime = "20240101120000"
        content.FrameAcquisitionDuration = 1.0
        content.StackID = "1"
        content.InStackPositionNumber = order[f] + 1
        content.DimensionIndexValues = [1, order[f] + 1]
        item.FrameContentSequence = [content]
        position = Dataset()
        position.ImagePositionPatient = positions[order[f]]
        item.PlanePositionSequence = [position]
        if per_frame_rescale:
            item.PixelValueTransformationSequence = [_rescale(intercepts[f])]
        per_frame.append(item)
    ds.PerFrameFunctionalGroupsSequence = per_frame
    ds.SOPClassUID = UID(ENHANCED_CT_IMAGE_STORAGE)
    ds.SOPInstanceUID = sop_uid
    ds.PixelData = stored.tobytes()
    encode(ds, transfer_syntax)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)
    return path


def _rescale(intercept: float) -> Dataset:
    item = Dataset()
    item.RescaleIntercept = intercept
    item.RescaleSlope = 1
    item.RescaleType = "HU"
    return item
