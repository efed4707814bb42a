"""Assemble a CT series into one Hounsfield-unit volume with its patient geometry.

A :class:`Volume` is built from either a series of single-frame CT Image Storage instances
(PS3.3 A.3) or one multi-frame Enhanced / Legacy Converted Enhanced CT instance (PS3.3 A.38,
A.70). Slices are sorted along the slice normal, the geometry is checked (one orientation,
one matrix size, one pixel spacing, one Frame of Reference, a straight, untilted stack with
uniform spacing) and the stored values are converted to HU with each slice's own Modality LUT
(Rescale Slope / Intercept, PS3.3 C.11.1.1.2).

Geometry follows the Image Plane Module (PS3.3 C.7.6.2.1.1): Image Position (Patient) is the
centre of the first transmitted voxel, Image Orientation (Patient) holds the row direction
(direction of increasing column index) followed by the column direction (direction of
increasing row index), and Pixel Spacing is (spacing between rows, spacing between columns).

Tolerances (module constants, all documented in :class:`VolumeError` messages):

* orientation: every direction cosine within ``ORIENTATION_TOLERANCE`` (1e-4) of slice 0's;
* pixel spacing: within ``SPACING_TOLERANCE_MM`` (0.001 mm);
* slice spacing: each gap within ``max(GAP_TOLERANCE_MM, GAP_TOLERANCE_FRACTION * median)``,
  i.e. 0.02 mm or 1 % of the median gap, whichever is larger (0.02 mm absorbs positions
  written with two decimals);
* stack straightness (gantry tilt): each slice's in-plane offset from the line through slice 0
  along the normal within ``0.02 mm + 0.002 * distance`` (about 0.1 degree);
* duplicate positions: two slices closer than ``DUPLICATE_TOLERANCE_MM`` (0.01 mm) along the
  normal.

Decoding of compressed transfer syntaxes (JPEG Lossless, JPEG-LS, JPEG 2000, RLE, Deflated)
goes through pydicom's pixel data handlers (pylibjpeg, pyjpegls).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import numpy as np
import numpy.typing as npt
import pydicom
from pydicom.dataset import Dataset
from pydicom.errors import InvalidDicomError

from segnode.node.errors import SegnodeError

logger = logging.getLogger(__name__)

Vector = tuple[float, float, float]


class _GeometryFields(TypedDict):
    """Geometry keyword arguments of :class:`Volume` for a checked, sorted stack."""

    origin: Vector
    row_direction: Vector
    column_direction: Vector
    normal: Vector
    spacing: Vector
    positions: tuple[Vector, ...]


ORIENTATION_TOLERANCE = 1e-4
SPACING_TOLERANCE_MM = 1e-3
GAP_TOLERANCE_MM = 0.02
GAP_TOLERANCE_FRACTION = 0.01
TILT_TOLERANCE_MM = 0.02
TILT_TOLERANCE_SLOPE = 0.002
DUPLICATE_TOLERANCE_MM = 0.01
MIN_SLICES = 2

CT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.2"
ENHANCED_CT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.2.1"
LEGACY_CONVERTED_ENHANCED_CT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.2.2"
#: The SOP classes the node receives as CT and segments (the SCP's storage contexts, the
#: routing rules' CT check, the volume assembly).
CT_CLASSES = frozenset({CT_IMAGE_STORAGE, ENHANCED_CT_IMAGE_STORAGE})

# Pixel data elements dropped from the headers kept in Volume.sources.
_PIXEL_TAGS = frozenset(
    {
        0x7FE00010,  # Pixel Data
        0x7FE00008,  # Float Pixel Data
        0x7FE00009,  # Double Float Pixel Data
        0x7FE00001,  # Extended Offset Table
        0x7FE00002,  # Extended Offset Table Lengths
    }
)


class VolumeError(SegnodeError):
    """The instances do not form a volume the node can segment; the message says why and
    what to check at the modality."""


@dataclass(frozen=True, eq=False)
class Volume:
    """A CT volume in Hounsfield units and its patient geometry (LPS, mm).

    Voxel ``hu[k, i, j]`` is centred at
    ``positions[k] + i * spacing[1] * column_direction + j * spacing[2] * row_direction``,
    and ``positions[k] ~= origin + k * spacing[0] * normal`` (within the tolerances of this
    module). Treat ``hu`` as read-only.

    Attributes
    ----------
    hu
        float32 array ``(z, y, x)``; slices sorted ascending along ``normal``.
    origin
        Image Position (Patient) of slice 0.
    row_direction, column_direction
        Image Orientation (Patient) ``[:3]`` and ``[3:]``.
    normal
        ``row_direction x column_direction`` (unit length).
    spacing
        ``(slice spacing, PixelSpacing[0] (between rows), PixelSpacing[1] (between columns))``.
    sources
        Headers (no pixel data) of the source instances in z order; for a multi-frame source
        the one dataset.
    frame_of_reference_uid, study_instance_uid, series_instance_uid
        Identifiers shared by all sources.
    positions
        Image Position (Patient) of every slice as found in the source, in z order; empty
        means "the ideal grid" (``origin + k * spacing[0] * normal``).
    frame_numbers
        For a multi-frame source, the 1-based frame number of each slice in z order;
        empty for single-frame sources.
    """

    hu: npt.NDArray[np.float32]
    origin: Vector
    row_direction: Vector
    column_direction: Vector
    normal: Vector
    spacing: Vector
    sources: tuple[Dataset, ...]
    frame_of_reference_uid: str
    study_instance_uid: str
    series_instance_uid: str
    positions: tuple[Vector, ...] = field(default=())
    frame_numbers: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.hu.ndim != 3 or self.hu.dtype != np.float32:
            raise ValueError(f"hu must be a 3-D float32 array, got {self.hu.dtype} {self.hu.shape}")
        if self.positions and len(self.positions) != self.hu.shape[0]:
            raise ValueError("positions must have one entry per slice")
        if self.frame_numbers and len(self.frame_numbers) != self.hu.shape[0]:
            raise ValueError("frame_numbers must have one entry per slice")
        if not self.sources:
            raise ValueError("a volume needs at least one source dataset")

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(slices, rows, columns)``."""
        z, y, x = self.hu.shape
        return (int(z), int(y), int(x))

    @property
    def voxel_volume_ml(self) -> float:
        """Volume of one voxel in millilitres (cm^3)."""
        return float(np.prod(self.spacing)) / 1000.0

    @property
    def is_multiframe(self) -> bool:
        """Whether the slices come from one multi-frame instance."""
        return bool(self.frame_numbers)

    @property
    def slice_positions(self) -> tuple[Vector, ...]:
        """Image Position (Patient) of each slice in z order (source values when known)."""
        if self.positions:
            return self.positions
        o = np.asarray(self.origin)
        n = np.asarray(self.normal) * self.spacing[0]
        return tuple(_vec(o + k * n) for k in range(self.hu.shape[0]))

    @property
    def affine(self) -> npt.NDArray[np.float64]:
        """4x4 matrix mapping voxel index ``(k, i, j, 1)`` to LPS millimetres."""
        a = np.eye(4)
        a[:3, 0] = np.asarray(self.normal) * self.spacing[0]
        a[:3, 1] = np.asarray(self.column_direction) * self.spacing[1]
        a[:3, 2] = np.asarray(self.row_direction) * self.spacing[2]
        a[:3, 3] = self.origin
        return a


#: The largest HU magnitude a CT modality LUT may give a 16-bit stored value (the widest
#: extended CT scales reach some 10^5; beyond it float32 HU lose their integer precision and,
#: far beyond, overflow to infinity in the model and the statistics).
MAX_ABS_HU = 1e7


@dataclass
class Slice:
    """One frame's geometry and pixel access, before sorting."""

    label: str  # human-readable reference for messages ("instance 12", "frame 3")
    position: npt.NDArray[np.float64]
    orientation: npt.NDArray[np.float64]
    pixel_spacing: tuple[float, float]
    slope: float
    intercept: float
    rows: int
    columns: int
    source_index: int  # index into the datasets (single-frame) or frame index (multi-frame)

    def __post_init__(self) -> None:
        """Refuse values no volume can be built from (a slice is valid once constructed):
        both the spool and the streaming assembly build their slices here."""
        for keyword, values in (
            ("ImagePositionPatient", self.position),
            ("ImageOrientationPatient", self.orientation),
            ("PixelSpacing", self.pixel_spacing),
        ):
            if not np.all(np.isfinite(values)):
                raise VolumeError(
                    f"{self.label}: {keyword} {list(map(float, values))} is not finite; "
                    "the modality wrote an invalid geometry"
                )
        if min(self.pixel_spacing) <= 0:
            raise VolumeError(
                f"{self.label}: PixelSpacing {list(self.pixel_spacing)} must be positive "
                "(mm between rows, mm between columns; PS3.3 C.7.6.2.1.1)"
            )
        if not (np.isfinite(self.slope) and self.slope != 0):
            raise VolumeError(
                f"{self.label}: RescaleSlope {self.slope} must be a finite non-zero number "
                "(HU = stored * slope + intercept; PS3.3 C.11.1.1.2)"
            )
        if not np.isfinite(self.intercept):
            raise VolumeError(
                f"{self.label}: RescaleIntercept {self.intercept} is not finite "
                "(HU = stored * slope + intercept; PS3.3 C.11.1.1.2)"
            )
        if abs(self.slope) * 0xFFFF + abs(self.intercept) > MAX_ABS_HU:
            raise VolumeError(
                f"{self.label}: RescaleSlope {self.slope:g} and RescaleIntercept "
                f"{self.intercept:g} map 16-bit stored values (CT's, PS3.3 C.8.2.1.1.4) beyond "
                f"±{MAX_ABS_HU:g} HU: not a CT modality LUT"
            )


def assemble_volume(paths: Sequence[Path], *, min_slices: int = MIN_SLICES) -> Volume:
    """Read DICOM files and assemble them into a :class:`Volume`.

    Parameters
    ----------
    paths
        Files of one CT series (any order), or one multi-frame Enhanced CT file.
    min_slices
        As for :func:`assemble_from_datasets`.

    Returns
    -------
    Volume

    Raises
    ------
    VolumeError
        A file is not DICOM or the instances do not form a volume.
    """
    datasets: list[Dataset] = []
    for path in paths:
        try:
            datasets.append(pydicom.dcmread(path))
        except InvalidDicomError as exc:
            raise VolumeError(f"{path} is not a DICOM file: {exc}") from exc
        except OSError as exc:
            raise VolumeError(f"cannot read {path}: {exc}") from exc
    return assemble_from_datasets(datasets, min_slices=min_slices)


def assemble_from_datasets(datasets: Sequence[Dataset], *, min_slices: int = MIN_SLICES) -> Volume:
    """Assemble datasets (with pixel data) into a :class:`Volume`.

    The datasets are not modified.

    Parameters
    ----------
    datasets
        Single-frame CT instances of one series in any order, or exactly one multi-frame
        (Enhanced / Legacy Converted Enhanced) CT instance.
    min_slices
        Fewest slices accepted (at least 2).

    Returns
    -------
    Volume
        The slices sorted along the slice normal, in Hounsfield units (float32).

    Raises
    ------
    VolumeError
        The instances do not form a volume; the message names the offending slices.
    """
    if min_slices < MIN_SLICES:
        raise ValueError(f"min_slices must be at least {MIN_SLICES}")
    if not datasets:
        raise VolumeError("no instances received")
    for ds in datasets:
        check_instance(ds)
    multiframe = [ds for ds in datasets if int(ds.get("NumberOfFrames", 1) or 1) > 1]
    if multiframe:
        if len(datasets) != 1:
            raise VolumeError(
                f"got {len(datasets)} instances of which {len(multiframe)} are multi-frame; "
                "send either one multi-frame CT instance or a series of single-frame slices"
            )
        volume = _assemble_multiframe(datasets[0], min_slices)
    else:
        volume = _assemble_single_frames(datasets, min_slices)
    logger.debug(
        "series %s: volume %s, spacing %s mm, normal %s",
        volume.series_instance_uid,
        volume.shape,
        tuple(round(v, 4) for v in volume.spacing),
        tuple(round(v, 4) for v in volume.normal),
    )
    return volume


# --------------------------------------------------------------------------- checks


def check_instance(ds: Dataset, *, pixel_data: bool | None = None) -> None:
    """Refuse an instance that cannot be a slice of a CT volume (``pixel_data``: whether it
    has Pixel Data, where that is known without the element being in ``ds``)."""
    modality = str(ds.get("Modality", ""))
    if modality != "CT":
        raise VolumeError(
            f"instance {ds.get('SOPInstanceUID', '?')} has modality {modality or '(none)'!r}; "
            "only CT series can be segmented"
        )
    if not (0x7FE00010 in ds if pixel_data is None else pixel_data):
        raise VolumeError(
            f"instance {ds.get('SOPInstanceUID', '?')} has no Pixel Data (7FE0,0010); "
            "send the images, not only their headers"
        )
    if int(ds.get("SamplesPerPixel", 1)) != 1:
        raise VolumeError(
            f"instance {ds.get('SOPInstanceUID', '?')} has Samples per Pixel "
            f"{ds.SamplesPerPixel}; CT images must be greyscale"
        )
    for keyword in ("StudyInstanceUID", "SeriesInstanceUID", "FrameOfReferenceUID", "Rows"):
        if not ds.get(keyword):
            raise VolumeError(
                f"instance {ds.get('SOPInstanceUID', '?')} lacks {keyword}; "
                "cannot place it in a volume"
            )


def same_uid(datasets: Sequence[Dataset], keyword: str, what: str) -> str:
    """The one value of ``keyword`` in ``datasets``; :class:`VolumeError` naming ``what``
    when they hold several."""
    values = sorted({str(ds.get(keyword, "")) for ds in datasets})
    if len(values) != 1:
        raise VolumeError(
            f"instances have {len(values)} different {what} ({keyword}: "
            f"{', '.join(values)}); send one series in one frame of reference"
        )
    return values[0]


def _float_list(value: object, n: int, keyword: str, label: str) -> list[float]:
    """The ``n`` numbers of attribute ``keyword`` of slice ``label``; :class:`VolumeError`
    naming both when there are not ``n`` or they do not read as numbers.

    One value reads as a number, not a list: pydicom gives a ``DSfloat`` for VM 1.
    """
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        items = list(value)
    else:
        items = [value]
    if len(items) != n:
        raise VolumeError(f"{label}: {keyword} must have {n} values, got {len(items)}")
    try:
        return [float(v) for v in items]
    except (TypeError, ValueError, OverflowError) as exc:
        raise VolumeError(f"{label}: unreadable {keyword} {value!r}") from exc


def _check_orientation(orientation: npt.NDArray[np.float64], label: str) -> None:
    row, col = orientation[:3], orientation[3:]
    if (
        abs(np.linalg.norm(row) - 1) > 1e-3
        or abs(np.linalg.norm(col) - 1) > 1e-3
        or abs(float(np.dot(row, col))) > 1e-3
    ):
        raise VolumeError(
            f"{label}: Image Orientation (Patient) {orientation.tolist()} is not two orthogonal "
            "unit vectors"
        )


# ----------------------------------------------------------------------- single-frame


def _assemble_single_frames(datasets: Sequence[Dataset], min_slices: int) -> Volume:
    study = same_uid(datasets, "StudyInstanceUID", "studies")
    series = same_uid(datasets, "SeriesInstanceUID", "series")
    frame_of_reference = same_uid(datasets, "FrameOfReferenceUID", "Frames of Reference")
    slices = [single_frame_slice(ds, index) for index, ds in enumerate(datasets)]
    order, geometry = sort_and_check(slices, min_slices)
    rows, columns = slices[0].rows, slices[0].columns
    hu = np.empty((len(order), rows, columns), dtype=np.float32)
    for k, i in enumerate(order):
        s = slices[i]
        hu[k] = _to_hu(decode_stored(datasets[s.source_index], s.label), s.slope, s.intercept)
    return Volume(
        hu=hu,
        sources=tuple(source_header(datasets[slices[i].source_index]) for i in order),
        frame_of_reference_uid=frame_of_reference,
        study_instance_uid=study,
        series_instance_uid=series,
        **geometry,
    )


def single_frame_slice(ds: Dataset, index: int) -> Slice:
    """Geometry and rescale of one single-frame instance (Image Plane, CT Image modules)."""
    label = f"instance {ds.get('InstanceNumber', '?')} ({ds.get('SOPInstanceUID', '?')})"
    for keyword in ("ImagePositionPatient", "ImageOrientationPatient", "PixelSpacing"):
        if keyword not in ds or ds[keyword].VM == 0:
            raise VolumeError(f"{label} lacks {keyword}; cannot place it in a volume")
    return _plane_slice(ds, index, label, position=ds, orientation=ds, measures=ds, rescale=ds)


def _plane_slice(
    ds: Dataset,
    index: int,
    label: str,
    *,
    position: Dataset,
    orientation: Dataset,
    measures: Dataset,
    rescale: Dataset,
) -> Slice:
    """The :class:`Slice` of frame ``index`` of ``ds`` from the datasets holding its Image
    Position / Orientation (Patient), Pixel Spacing and Rescale Slope / Intercept: ``ds``
    itself for a single-frame instance, functional group items for a multi-frame one."""
    ps = _float_list(measures.PixelSpacing, 2, "PixelSpacing", label)
    return Slice(
        label=label,
        position=np.array(
            _float_list(position.ImagePositionPatient, 3, "ImagePositionPatient", label)
        ),
        orientation=np.array(
            _float_list(orientation.ImageOrientationPatient, 6, "ImageOrientationPatient", label)
        ),
        pixel_spacing=(ps[0], ps[1]),
        slope=_number(rescale.get("RescaleSlope"), 1.0, "RescaleSlope", label),
        intercept=_number(rescale.get("RescaleIntercept"), 0.0, "RescaleIntercept", label),
        rows=int(ds.Rows),
        columns=int(ds.Columns),
        source_index=index,
    )


# ------------------------------------------------------------------------ multi-frame


def _functional_group(ds: Dataset, frame: int, sequence: str) -> Dataset | None:
    """Item of ``sequence`` for ``frame`` (0-based): per-frame first, then shared
    (PS3.3 C.7.6.16)."""
    per_frame = ds.get("PerFrameFunctionalGroupsSequence")
    if per_frame is not None and frame < len(per_frame):
        item = per_frame[frame].get(sequence)
        if item:
            return item[0]  # type: ignore[no-any-return]
    shared = ds.get("SharedFunctionalGroupsSequence")
    if shared:
        item = shared[0].get(sequence)
        if item:
            return item[0]  # type: ignore[no-any-return]
    return None


def _assemble_multiframe(ds: Dataset, min_slices: int) -> Volume:
    frames = int(ds.NumberOfFrames)
    per_frame = ds.get("PerFrameFunctionalGroupsSequence")
    if per_frame is None or len(per_frame) != frames:
        raise VolumeError(
            f"multi-frame instance {ds.get('SOPInstanceUID', '?')} has {frames} frames but "
            f"{0 if per_frame is None else len(per_frame)} Per-Frame Functional Groups items"
        )
    slices = []
    for f in range(frames):
        label = f"frame {f + 1} of instance {ds.get('SOPInstanceUID', '?')}"
        position = _functional_group(ds, f, "PlanePositionSequence")
        orientation = _functional_group(ds, f, "PlaneOrientationSequence")
        measures = _functional_group(ds, f, "PixelMeasuresSequence")
        if position is None or "ImagePositionPatient" not in position:
            raise VolumeError(f"{label} has no Plane Position (Patient); cannot place it")
        if orientation is None or "ImageOrientationPatient" not in orientation:
            raise VolumeError(f"{label} has no Plane Orientation (Patient); cannot place it")
        if measures is None or "PixelSpacing" not in measures:
            raise VolumeError(f"{label} has no Pixel Measures / Pixel Spacing; cannot place it")
        transform = _functional_group(ds, f, "PixelValueTransformationSequence")
        slices.append(
            _plane_slice(
                ds,
                f,
                label,
                position=position,
                orientation=orientation,
                measures=measures,
                rescale=transform if transform is not None else ds,
            )
        )
    order, geometry = sort_and_check(slices, min_slices)
    label = f"instance {ds.get('SOPInstanceUID', '?')}"
    pixels = decode_stored(ds, label)
    if pixels.ndim != 3 or pixels.shape[0] != frames:
        raise VolumeError(
            f"{label}: decoded pixel data has shape {pixels.shape}, expected {frames} frames"
        )
    hu = np.empty((len(order), int(ds.Rows), int(ds.Columns)), dtype=np.float32)
    for k, i in enumerate(order):
        s = slices[i]
        hu[k] = _to_hu(pixels[s.source_index], s.slope, s.intercept)
    return Volume(
        hu=hu,
        sources=(source_header(ds),),
        frame_of_reference_uid=str(ds.FrameOfReferenceUID),
        study_instance_uid=str(ds.StudyInstanceUID),
        series_instance_uid=str(ds.SeriesInstanceUID),
        frame_numbers=tuple(slices[i].source_index + 1 for i in order),
        **geometry,
    )


# ---------------------------------------------------------------------------- geometry


def sort_and_check(slices: list[Slice], min_slices: int) -> tuple[list[int], _GeometryFields]:
    """Sort slices along the normal and check the stack; return the order and geometry."""
    if len(slices) < min_slices:
        raise VolumeError(
            f"got {len(slices)} slice(s); a volume needs at least {min_slices}. "
            "Send the whole series, not a single image"
        )
    first = slices[0]
    _check_orientation(first.orientation, first.label)
    for s in slices[1:]:
        deviation = float(np.max(np.abs(s.orientation - first.orientation)))
        if deviation > ORIENTATION_TOLERANCE:
            raise VolumeError(
                f"mixed orientations: {s.label} has Image Orientation (Patient) "
                f"{s.orientation.tolist()}, {first.label} has {first.orientation.tolist()} "
                f"(tolerance {ORIENTATION_TOLERANCE}); send one orientation per series"
            )
        if (s.rows, s.columns) != (first.rows, first.columns):
            raise VolumeError(
                f"mixed sizes: {s.label} is {s.rows}x{s.columns}, {first.label} is "
                f"{first.rows}x{first.columns}; a series must have one matrix size"
            )
        if max(abs(a - b) for a, b in zip(s.pixel_spacing, first.pixel_spacing, strict=True)) > (
            SPACING_TOLERANCE_MM
        ):
            raise VolumeError(
                f"mixed pixel spacing: {s.label} has {list(s.pixel_spacing)} mm, "
                f"{first.label} has {list(first.pixel_spacing)} mm"
            )
    row = first.orientation[:3] / np.linalg.norm(first.orientation[:3])
    col = first.orientation[3:] / np.linalg.norm(first.orientation[3:])
    normal = np.cross(row, col)
    normal /= np.linalg.norm(normal)

    distances = np.array([float(np.dot(s.position, normal)) for s in slices])
    order = [int(i) for i in np.argsort(distances, kind="stable")]
    d = distances[order]
    gaps = np.diff(d)
    for k in (int(i) for i in np.flatnonzero(gaps < DUPLICATE_TOLERANCE_MM)):
        a, b = slices[order[k]], slices[order[k + 1]]
        raise VolumeError(
            f"duplicate slice position: {a.label} and {b.label} are both at "
            f"{a.position.tolist()} ({gaps[k]:.3f} mm apart along the normal); "
            "remove the duplicate or send the series once"
        )
    origin = slices[order[0]].position
    for k, i in enumerate(order[1:], start=1):
        offset = slices[i].position - origin
        in_plane = offset - float(np.dot(offset, normal)) * normal
        shift = float(np.linalg.norm(in_plane))
        along = float(d[k] - d[0])
        if shift > TILT_TOLERANCE_MM + TILT_TOLERANCE_SLOPE * along:
            angle = float(np.degrees(np.arctan2(shift, along)))
            raise VolumeError(
                f"slices are not stacked along the slice normal: {slices[i].label} is shifted "
                f"{shift:.2f} mm in-plane over {along:.2f} mm ({angle:.1f} degrees) - gantry "
                "tilt or a sheared stack; reconstruct the series without tilt"
            )
    median = float(np.median(gaps))
    tolerance = max(GAP_TOLERANCE_MM, GAP_TOLERANCE_FRACTION * median)
    for k in (int(i) for i in np.flatnonzero(np.abs(gaps - median) > tolerance)):
        a, b = slices[order[k]], slices[order[k + 1]]
        raise VolumeError(
            f"non-uniform slice spacing: {gaps[k]:.3f} mm between {a.label} at "
            f"{d[k]:.2f} mm and {b.label} at {d[k + 1]:.2f} mm along the normal, where the "
            f"median spacing is {median:.3f} mm (tolerance {tolerance:.3f} mm); "
            "slices are missing or the series mixes reconstructions"
        )
    spacing = float((d[-1] - d[0]) / (len(d) - 1))
    geometry: _GeometryFields = {
        "origin": _vec(origin),
        "row_direction": _vec(row),
        "column_direction": _vec(col),
        "normal": _vec(normal),
        "spacing": (spacing, first.pixel_spacing[0], first.pixel_spacing[1]),
        "positions": tuple(_vec(slices[i].position) for i in order),
    }
    return order, geometry


# ------------------------------------------------------------------------------ pixels


def decode_stored(ds: Dataset, label: str) -> npt.NDArray[np.generic]:
    """Stored values of ``ds`` through pydicom's decoders (no Modality LUT)."""
    try:
        arr: npt.NDArray[np.generic] = ds.pixel_array
    except Exception as exc:  # decoder plugins raise anything; report it with the syntax
        syntax = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", None)
        name = getattr(syntax, "name", str(syntax))
        raise VolumeError(
            f"{label}: cannot decode pixel data in transfer syntax {name}: {exc}. "
            "Install the matching pylibjpeg plugin or send uncompressed"
        ) from exc
    return arr


def _to_hu(
    stored: npt.NDArray[np.generic], slope: float, intercept: float
) -> npt.NDArray[np.float32]:
    """Apply the Modality LUT (PS3.3 C.11.1.1.2): HU = stored * slope + intercept."""
    out = np.empty(stored.shape, dtype=np.float32)
    rescale_into(out, stored, slope, intercept)
    return out


def rescale_into(
    out: npt.NDArray[np.float32], stored: npt.NDArray[np.generic], slope: float, intercept: float
) -> None:
    """``out = float32(stored) * slope + intercept``, computed in float32 with the cast folded
    into the first pass (the arithmetic of :func:`_to_hu`, shared with streaming assembly so
    both give identical values)."""
    if slope != 1.0:
        np.multiply(stored, np.float32(slope), out=out, dtype=np.float32, casting="unsafe")
        if intercept != 0.0:
            out += np.float32(intercept)
    elif intercept != 0.0:
        np.add(stored, np.float32(intercept), out=out, dtype=np.float32, casting="unsafe")
    else:
        np.copyto(out, stored, casting="unsafe")


def _number(value: object, default: float, keyword: str, label: str) -> float:
    """Rescale value ``keyword`` of slice ``label`` (``default`` when absent or empty)."""
    if value is None or value == "":
        return default
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError) as exc:
        raise VolumeError(f"{label}: unreadable {keyword} {value!r}") from exc


def source_header(ds: Dataset, *, share: bool = False) -> Dataset:
    """Copy of ``ds`` without pixel data (file meta kept).

    ``share=True`` moves the elements instead of deep-copying them, for a caller that owns
    ``ds`` and drops it afterwards (streaming assembly); the result is equal either way.
    """
    if share:  # elements as read, not yet converted: values are decoded when first used
        out = Dataset({e.tag: e for e in ds.elements() if e.tag not in _PIXEL_TAGS})
    else:
        out = Dataset()
        for elem in ds:
            if elem.tag not in _PIXEL_TAGS:
                out.add(copy.deepcopy(elem))
    if hasattr(ds, "file_meta"):
        out.file_meta = ds.file_meta if share else copy.deepcopy(ds.file_meta)
    return out


def _vec(a: npt.ArrayLike) -> Vector:
    x, y, z = (float(v) for v in np.asarray(a, dtype=np.float64))
    return (x, y, z)
