"""segnode.node.results.seg_encode / segnode.node.results.seg_check: the fast SEG encoder equals
highdicom byte for byte.

The reference is what the node sends today: ``segnode.node.results.build.build_seg`` written by
``segnode.node.pipeline.worker.encode``. highdicom draws four values at build time (Instance
Creation, Content and Contribution Date/Time from the clock, the Dimension Organization UID at
random); the plan fixes them (``created``, a UID derived from the SOP Instance UID), and the
tests set highdicom's dataset to the plan's values before writing it. Everything else, the
file meta and every byte of every element, nested item and frame, must be equal.

For LABELMAP the reference is ``build_seg`` with highdicom's ``Segmentation`` told to build
``SegmentationTypeValues.LABELMAP`` (same descriptions, positions and equipment).
"""

from __future__ import annotations

import dataclasses
import io
import shutil
import struct
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import highdicom as hd
import numpy as np
import numpy.typing as npt
import pydicom
import pytest
from pydicom.dataset import Dataset
from pydicom.valuerep import DA, DT, TM

from segnode.engines.manifest import LabelSpec, ModelManifest
from segnode.node.ingest.volume import Volume, assemble_volume
from segnode.node.pipeline.worker import encode
from segnode.node.results.build import (
    NoSegmentsError,
    ResultError,
    ResultUIDs,
    build_seg,
    build_sr,
    seg_label_map,
)
from segnode.node.results.seg_check import check_encoded, elements, items
from segnode.node.results.seg_encode import EncodedSeg, SegPlan
from segnode.node.results.seg_header import (
    LABEL_MAP_SEGMENTATION_STORAGE,
    SEGMENTATION_STORAGE,
    Tag,
)
from tests.conftest import LIVER, PHANTOM, require_data, require_tool
from tests.fixtures.synthetic import SAGITTAL, phantom_labels, write_enhanced_ct
from tests.test_results import (
    MANIFEST,
    OBLIQUE,
    SEG_EQUIPMENT,
    SMALL,
    SOURCE_WARNINGS,
    SR_EQUIPMENT,
    UIDS,
    evidence,
    small_volume,
    truth,
)

KINDS = ("BINARY", "LABELMAP")

# dicom3tools of 2022 predates Label Map Segmentation Storage (2024): it knows no such IOD
# and applies the BINARY rule "segment numbers from 1" to the Background segment 0.
DCIODVFY_LABELMAP_UNKNOWN = (
    "Error - Information Object Not found",
    "Error - SegmentNumber not monotonically increasing from one by one - have "
    "SegmentSequence item number 1 (from one) with SegmentNumber of 0",
)


# ----------------------------------------------------------------------------- helpers


@contextmanager
def building(kind: str) -> Iterator[None]:
    """Make ``build_seg`` build ``kind`` (it always asks highdicom for BINARY)."""
    if kind == "BINARY":
        yield
        return
    original = hd.seg.Segmentation

    class LabelMapSegmentation(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["segmentation_type"] = hd.seg.SegmentationTypeValues.LABELMAP
            super().__init__(*args, **kwargs)

    hd.seg.Segmentation = LabelMapSegmentation
    try:
        yield
    finally:
        hd.seg.Segmentation = original


def pin(seg: Dataset, plan: SegPlan) -> None:
    """Give highdicom's dataset the four values it draws at build time, as the plan has them."""
    seg.InstanceCreationDate = DA(plan.created.date())
    seg.InstanceCreationTime = TM(plan.created.time())
    seg.ContentDate = DA(plan.created.date())
    seg.ContentTime = TM(plan.created.time())
    seg.ContributingEquipmentSequence[-1].ContributionDateTime = DT(plan.created)
    seg.DimensionOrganizationSequence[0].DimensionOrganizationUID = plan.dimension_organization_uid
    for item in seg.DimensionIndexSequence:
        item.DimensionOrganizationUID = plan.dimension_organization_uid


def reference_seg(
    volume: Volume,
    labels: npt.NDArray[np.integer],
    kind: str = "BINARY",
    manifest: ModelManifest = MANIFEST,
    uids: ResultUIDs = UIDS,
) -> Dataset:
    """``build_seg``'s SEG of ``labels`` (highdicom's), of ``kind``."""
    with building(kind):
        return build_seg(volume, labels, manifest, uids, equipment=SEG_EQUIPMENT)


def highdicom_seg(volume: Volume, labels: npt.NDArray[np.integer], plan: SegPlan) -> Dataset:
    """highdicom's SEG of ``labels`` as ``plan`` encodes them (its model, UIDs and clock)."""
    kind = "LABELMAP" if plan.labelmap else "BINARY"
    seg = reference_seg(volume, labels, kind, plan.manifest, plan.uids)
    pin(seg, plan)
    return seg


def prepare(
    volume: Volume, kind: str, manifest: ModelManifest = MANIFEST, uids: ResultUIDs = UIDS
) -> SegPlan:
    return SegPlan.prepare(volume, manifest, uids, equipment=SEG_EQUIPMENT, segmentation_type=kind)


def differences(ours: bytes, theirs: bytes) -> list[str]:
    """Element-by-element differences (every element, every nested item), for the message."""
    a, b = pydicom.dcmread(io.BytesIO(ours)), pydicom.dcmread(io.BytesIO(theirs))
    out: list[str] = []

    def walk(x: Dataset, y: Dataset, path: str) -> None:
        for tag in sorted(set(x.keys()) | set(y.keys())):
            if tag not in x or tag not in y:
                out.append(f"{path}{tag} only in {'highdicom' if tag not in x else 'ours'}")
                continue
            ex, ey = x[tag], y[tag]
            if ex.VR == "SQ" and ey.VR == "SQ":
                if len(ex.value) != len(ey.value):
                    out.append(f"{path}{ex.keyword}: {len(ex.value)} vs {len(ey.value)} items")
                for i, (ix, iy) in enumerate(zip(ex.value, ey.value, strict=False)):
                    walk(ix, iy, f"{path}{ex.keyword}[{i}].")
            elif ex.VR != ey.VR or ex.value != ey.value:
                out.append(f"{path}{ex.keyword}: {ex.value!r:.60} vs {ey.value!r:.60}")

    walk(a.file_meta, b.file_meta, "meta.")
    walk(a, b, "")
    return out or ["(datasets equal, bytes differ)"]


def frames_of(seg: Dataset, volume: Volume) -> tuple[list[int], list[int]]:
    """Segment number and volume slice of each of highdicom's frames."""
    positions = np.array(volume.slice_positions)
    segments, slices = [], []
    shared = seg.SharedFunctionalGroupsSequence[0]
    for frame in seg.PerFrameFunctionalGroupsSequence:
        ipp = np.array([float(v) for v in frame.PlanePositionSequence[0].ImagePositionPatient])
        slices.append(int(np.argmin(np.linalg.norm(positions - ipp, axis=1))))
        identification = frame.get("SegmentIdentificationSequence") or shared.get(
            "SegmentIdentificationSequence"
        )
        segments.append(int(identification[0].ReferencedSegmentNumber) if identification else 0)
    return segments, slices


def assert_equal_to_highdicom(
    volume: Volume,
    labels: npt.NDArray[np.integer],
    kind: str,
    manifest: ModelManifest = MANIFEST,
) -> EncodedSeg:
    plan = prepare(volume, kind, manifest)
    ours = plan.encode(labels)
    seg = highdicom_seg(volume, labels, plan)
    theirs = encode(seg)
    assert ours.data == theirs, differences(ours.data, theirs)
    check_encoded(plan, ours, labels)
    segments, slices = frames_of(seg, volume)
    assert ours.frame_segments.tolist() == segments
    assert ours.frame_slices.tolist() == slices
    assert ours.number_of_frames == int(seg.NumberOfFrames)
    numbers = {int(s.SegmentNumber): str(s.SegmentLabel) for s in seg.SegmentSequence}
    assert {n: manifest.label(v).name for v, n in ours.segment_numbers.items()} == {
        n: label for n, label in numbers.items() if n
    }
    return ours


# -------------------------------------------------------------------------- label maps


def three_segments(labels: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Soft tissue, fat, spine (the lungs removed): 3 segments, labels 1, 2, 5."""
    out = labels.copy()
    out[(out == 3) | (out == 4)] = 0
    return out


def some_absent(labels: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Labels 2 and 4 absent: segments 1, 2, 3 are labels 1, 3, 5 (numbers move)."""
    out = labels.copy()
    out[(out == 2) | (out == 4)] = 0
    return out


def one_segment(labels: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Only the right lung (upper slices): one segment, identified in the shared groups."""
    out = labels.copy()
    out[out != 4] = 0
    return out


def empty_slices(labels: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Two empty slices in the middle: the frames are no longer a regular 3D stack."""
    out = labels.copy()
    out[3:5] = 0
    return out


LABELINGS: dict[str, Callable[[npt.NDArray[np.uint8]], npt.NDArray[np.uint8]]] = {
    "five": lambda labels: labels,
    "three": three_segments,
    "absent": some_absent,
    "one": one_segment,
    "gap": empty_slices,
}


# ------------------------------------------------------------------- byte equality


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("labeling", list(LABELINGS))
def test_equal_to_highdicom_axial(kind: str, labeling: str) -> None:
    volume = small_volume()
    assert_equal_to_highdicom(volume, LABELINGS[labeling](truth(volume)), kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("labeling", ["five", "absent"])
@pytest.mark.parametrize(
    "orientation",
    [(1.0, 0.0, 0.0, 0.0, -1.0, 0.0), SAGITTAL, OBLIQUE],
    ids=["flipped-axial", "sagittal", "oblique"],
)
def test_equal_to_highdicom_orientations(
    orientation: tuple[float, ...], labeling: str, kind: str
) -> None:
    volume = small_volume(orientation=orientation)
    assert_equal_to_highdicom(volume, LABELINGS[labeling](truth(volume)), kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("labeling", ["five", "three", "gap"])
def test_equal_to_highdicom_frames_not_whole_bytes(kind: str, labeling: str) -> None:
    """45 x 41 pixels: BINARY frames run across byte boundaries (PS3.5 8.1.1) and the Pixel
    Data has an odd length, padded as highdicom pads it."""
    volume = small_volume(rows=45, columns=41, slices=7)
    encoded = assert_equal_to_highdicom(volume, LABELINGS[labeling](truth(volume)), kind)
    assert len(encoded.data) % 2 == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("labeling", ["five", "absent", "gap"])
def test_equal_to_highdicom_enhanced_ct(tmp_path: Path, kind: str, labeling: str) -> None:
    """A multi-frame source with frames out of order: frames reference source frame numbers."""
    path = write_enhanced_ct(tmp_path / "enhanced.dcm", SMALL, frame_order=[3, 1, 0, 5, 4, 2, 7, 6])
    volume = assemble_volume([path])
    assert_equal_to_highdicom(volume, LABELINGS[labeling](truth(volume)), kind)


def _threshold_labels(volume: Volume) -> npt.NDArray[np.uint8]:
    labels = np.zeros(volume.shape, dtype=np.uint8)
    labels[(volume.hu > -500) & (volume.hu <= 300)] = 1
    labels[volume.hu > 300] = 5
    return labels


@pytest.fixture(scope="module")
def phantom() -> Volume:
    return assemble_volume(sorted(p for p in require_data(PHANTOM).iterdir() if p.is_file()))


@pytest.mark.filterwarnings("ignore:The string .* is unlikely to represent")
@pytest.mark.parametrize("kind", KINDS)
def test_equal_to_highdicom_real_phantom(phantom: Volume, kind: str) -> None:
    """The Philips phantom: the source's own patient/study attributes and its positions."""
    assert_equal_to_highdicom(phantom, _threshold_labels(phantom), kind)


@pytest.mark.filterwarnings("ignore:The string .* is unlikely to represent")
@pytest.mark.parametrize("kind", KINDS)
def test_equal_to_highdicom_real_liver(kind: str) -> None:
    """Empty Specific Character Set in the source: no character set in the SEG."""
    volume = assemble_volume(sorted(require_data(LIVER).glob("*.dcm")))
    encoded = assert_equal_to_highdicom(volume, _threshold_labels(volume), kind)
    assert "SpecificCharacterSet" not in pydicom.dcmread(io.BytesIO(encoded.data))


def test_equal_to_highdicom_manifest_with_gaps() -> None:
    """Label values 2, 5, 9 (not 1..n): segment numbers and LUT-free frames still agree."""
    manifest = dataclasses.replace(
        MANIFEST,
        labels=(
            dataclasses.replace(MANIFEST.labels[1], value=2),
            dataclasses.replace(MANIFEST.labels[4], value=5),
            LabelSpec(9, "Lungs", MANIFEST.labels[2].category, MANIFEST.labels[2].type),
        ),
    )
    volume = small_volume()
    labels = truth(volume)
    labels[(labels == 3) | (labels == 4)] = 9
    labels[labels == 1] = 0
    for kind in KINDS:
        encoded = assert_equal_to_highdicom(volume, labels, kind, manifest)
        assert encoded.segment_numbers == {2: 1, 5: 2, 9: 3}


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_equal_to_highdicom_full_size(kind: str) -> None:
    """512 x 512 x 128, five labels: the size the product encodes."""
    volume = small_volume(rows=512, columns=512, slices=128)
    assert_equal_to_highdicom(volume, truth(volume), kind)


def test_sop_classes_and_pinned_values() -> None:
    volume = small_volume()
    for kind, sop_class in zip(
        KINDS, (SEGMENTATION_STORAGE, LABEL_MAP_SEGMENTATION_STORAGE), strict=True
    ):
        plan = prepare(volume, kind)
        ds = pydicom.dcmread(io.BytesIO(plan.encode(truth(volume)).data))
        assert ds.SOPClassUID == ds.file_meta.MediaStorageSOPClassUID == sop_class
        assert ds.SegmentationType == kind
        assert ds.ContentDate == plan.created.strftime("%Y%m%d")
        assert ds.ContentTime == plan.created.strftime("%H%M%S.%f")
        assert ds.DimensionOrganizationSequence[0].DimensionOrganizationUID == (
            plan.dimension_organization_uid
        )
    with pytest.raises(ValueError):
        prepare(volume, "FRACTIONAL")


def test_prepare_does_not_read_the_voxels() -> None:
    """A plan built from a volume whose HU are all NaN encodes the same bytes."""
    volume = small_volume()
    blank = dataclasses.replace(volume, hu=np.broadcast_to(np.float32(np.nan), volume.shape))
    labels = truth(volume)
    for kind in KINDS:
        plan = prepare(volume, kind)
        other = SegPlan.prepare(
            blank,
            MANIFEST,
            UIDS,
            equipment=SEG_EQUIPMENT,
            segmentation_type=kind,
            created=plan.created,
        )
        assert other.encode(labels).data == plan.encode(labels).data


@pytest.mark.parametrize("kind", KINDS)
def test_reference_dataset(kind: str) -> None:
    """The header-only Dataset for objects that reference the SEG (the SR's evidence)."""
    volume = small_volume()
    labels = some_absent(truth(volume))
    plan = prepare(volume, kind)
    encoded = plan.encode(labels)
    reference = plan.reference(encoded)
    full = pydicom.dcmread(io.BytesIO(encoded.data))
    for tag in (
        Tag.SHARED_FUNCTIONAL_GROUPS,
        Tag.PER_FRAME_FUNCTIONAL_GROUPS,
        Tag.PIXEL_DATA,
        Tag.DIMENSION_ORGANIZATION_TYPE,
    ):
        full.pop(tag, None)
    assert reference == full
    if kind == "BINARY":
        sr = build_sr(volume, labels, MANIFEST, reference, UIDS, equipment=SR_EQUIPMENT)
        assert UIDS.seg_sop_uid in {uid for _, _, uid in evidence(sr)}


# ----------------------------------------------------------------- highdicom re-read


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ["axial", "oblique", "enhanced"])
def test_highdicom_reads_back(tmp_path: Path, case: str, kind: str) -> None:
    if case == "enhanced":
        order = [3, 1, 0, 5, 4, 2, 7, 6]
        path = write_enhanced_ct(tmp_path / "e.dcm", SMALL, frame_order=order)
        volume = assemble_volume([path])
    else:
        volume = small_volume(orientation=OBLIQUE) if case == "oblique" else small_volume()
    labels = some_absent(truth(volume))
    encoded = prepare(volume, kind).encode(labels)
    seg = hd.seg.Segmentation.from_dataset(pydicom.dcmread(io.BytesIO(encoded.data)))
    array = seg_label_map(seg, volume)
    lut = np.zeros(max(encoded.segment_numbers.values()) + 1, dtype=np.uint8)
    for value, number in encoded.segment_numbers.items():
        lut[number] = value
    assert np.array_equal(lut[array], labels)
    # segment descriptions
    assert seg.segment_numbers == sorted(encoded.segment_numbers.values())
    for value, number in encoded.segment_numbers.items():
        spec, description = MANIFEST.label(value), seg.get_segment_description(number)
        assert description.segment_label == spec.name
        assert description.segmented_property_type.value == spec.type[0]
        assert description.segmented_property_category.value == spec.category[0]
    # geometry: the same planes, spacing and in-plane axes as the volume
    geometry = seg.get_volume_geometry()
    assert geometry is not None
    assert geometry.spatial_shape == volume.shape
    planes = np.array([geometry.affine @ (k, 0, 0, 1) for k in range(volume.shape[0])])[:, :3]
    np.testing.assert_allclose(
        np.sort(planes, axis=0), np.sort(np.array(volume.slice_positions), axis=0), atol=1e-4
    )
    np.testing.assert_allclose(geometry.affine[:3, 1:3], volume.affine[:3, 1:3], atol=1e-6)
    np.testing.assert_allclose(geometry.spacing, volume.spacing, atol=1e-4)


# -------------------------------------------------------------------------- dciodvfy


def dciodvfy(data: bytes, path: Path) -> tuple[list[str], list[str]]:
    """Errors and warnings of dicom3tools' validator on ``data``."""
    tool = require_tool("dciodvfy")
    path.write_bytes(data)
    proc = subprocess.run([tool, str(path)], capture_output=True, text=True, check=False)
    lines = (proc.stdout + proc.stderr).splitlines()
    return [x for x in lines if "Error" in x], [x for x in lines if "Warning" in x]


@pytest.mark.interop
@pytest.mark.parametrize("case", ["axial", "sagittal", "oblique", "enhanced", "one-segment"])
def test_dciodvfy(tmp_path: Path, case: str) -> None:
    if case == "enhanced":
        volume = assemble_volume([write_enhanced_ct(tmp_path / "e.dcm", SMALL)])
    else:
        orientation = {"sagittal": SAGITTAL, "oblique": OBLIQUE}.get(case)
        volume = small_volume(orientation=orientation) if orientation else small_volume()
    labels = one_segment(truth(volume)) if case == "one-segment" else some_absent(truth(volume))
    errors, warnings = dciodvfy(prepare(volume, "BINARY").encode(labels).data, tmp_path / "b.dcm")
    assert errors == [] and warnings == []
    errors, warnings = dciodvfy(prepare(volume, "LABELMAP").encode(labels).data, tmp_path / "l.dcm")
    assert sorted(errors) == sorted(DCIODVFY_LABELMAP_UNKNOWN) and warnings == []


@pytest.mark.interop
@pytest.mark.filterwarnings("ignore:The string .* is unlikely to represent")
def test_dciodvfy_real_phantom(tmp_path: Path, phantom: Volume) -> None:
    labels = _threshold_labels(phantom)
    errors, warnings = dciodvfy(prepare(phantom, "BINARY").encode(labels).data, tmp_path / "b.dcm")
    assert errors == []
    assert all(any(known in w for known in SOURCE_WARNINGS) for w in warnings), warnings
    errors, warnings = dciodvfy(
        prepare(phantom, "LABELMAP").encode(labels).data, tmp_path / "l.dcm"
    )
    assert sorted(errors) == sorted(DCIODVFY_LABELMAP_UNKNOWN)
    assert all(any(known in w for known in SOURCE_WARNINGS) for w in warnings), warnings


# -------------------------------------------------------------------- input checks


def test_no_segments() -> None:
    volume = small_volume()
    zeros = np.zeros(volume.shape, dtype=np.uint8)
    with pytest.raises(NoSegmentsError) as ours:
        prepare(volume, "BINARY").encode(zeros)
    with pytest.raises(NoSegmentsError) as theirs:
        build_seg(volume, zeros, MANIFEST, UIDS, equipment=SEG_EQUIPMENT)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize(
    "change",
    ["value above the manifest", "negative value", "value in a manifest gap", "shape", "dtype"],
)
def test_invalid_label_maps_as_build_seg(change: str) -> None:
    volume = small_volume()
    labels: npt.NDArray[Any] = truth(volume)
    manifest = MANIFEST
    if change == "value above the manifest":
        labels[0, 0, 0] = 9
    elif change == "negative value":
        labels = labels.astype(np.int16)
        labels[1, 2, 3] = -1
    elif change == "value in a manifest gap":
        manifest = dataclasses.replace(
            MANIFEST, labels=tuple(s for s in MANIFEST.labels if s.value != 3)
        )
    elif change == "shape":
        labels = labels[1:]
    else:
        labels = labels.astype(np.float32)
    with pytest.raises(ResultError) as ours:
        prepare(volume, "BINARY", manifest).encode(labels)
    with pytest.raises(ResultError) as theirs:
        build_seg(volume, labels, manifest, UIDS, equipment=SEG_EQUIPMENT)
    assert str(ours.value) == str(theirs.value)


def test_invalid_equipment_values_as_build_seg() -> None:
    volume = small_volume()
    long_name = "x" * 65  # LO holds 64 characters
    equipment = dataclasses.replace(SEG_EQUIPMENT, manufacturer=long_name)
    with pytest.raises(ResultError) as ours:
        SegPlan.prepare(volume, MANIFEST, UIDS, equipment=equipment)
    with pytest.raises(ResultError) as theirs:
        build_seg(volume, truth(volume), MANIFEST, UIDS, equipment=equipment)
    assert str(ours.value) == str(theirs.value)


# ------------------------------------------------------------------- the check


def _value(data: bytes, tag: int) -> tuple[int, int]:
    """Start and end of a top-level element's value."""
    view = memoryview(data)
    meta_end = 144 + struct.unpack_from("<I", data, 140)[0]
    for element in elements(view, meta_end, len(view)):
        if element[0] == tag:
            return element[2], element[3]
    raise KeyError(tag)


def _frame_items(data: bytes) -> list[tuple[int, int, int]]:
    start, end = _value(data, Tag.PER_FRAME_FUNCTIONAL_GROUPS)
    return items(memoryview(data), start, end)


@pytest.fixture
def encoded_binary() -> tuple[SegPlan, EncodedSeg, npt.NDArray[np.uint8]]:
    volume = small_volume()
    labels = truth(volume)
    plan = prepare(volume, "BINARY")
    encoded = plan.encode(labels)
    check_encoded(plan, encoded, labels)
    return plan, encoded, labels


def assert_rejected(
    plan: SegPlan,
    encoded: EncodedSeg,
    data: bytes | bytearray,
    labels: npt.NDArray[np.integer],
    *,
    match: str,
) -> None:
    """``check_encoded`` rejects ``data`` as ``encoded``'s bytes with a message matching
    ``match``."""
    with pytest.raises(ResultError, match=match):
        check_encoded(plan, dataclasses.replace(encoded, data=bytes(data)), labels)


def swapped(data: bytes, a: tuple[int, int], b: tuple[int, int]) -> bytearray:
    """``data`` with its ranges ``a`` and ``b`` (start, end; the same length) exchanged."""
    out = bytearray(data)
    out[a[0] : a[1]], out[b[0] : b[1]] = data[b[0] : b[1]], data[a[0] : a[1]]
    return out


def test_check_catches_a_flipped_bit(encoded_binary: Any) -> None:
    plan, encoded, labels = encoded_binary
    data = bytearray(encoded.data)
    start, _ = _value(encoded.data, Tag.PIXEL_DATA)
    frame_bytes = labels[0].size // 8
    data[start + 3 * frame_bytes + frame_bytes // 2] ^= 0x10
    assert_rejected(plan, encoded, data, labels, match="frame 4 does not reproduce the label map")


def test_check_catches_wrong_frame_order(encoded_binary: Any) -> None:
    plan, encoded, labels = encoded_binary
    start, _ = _value(encoded.data, Tag.PIXEL_DATA)
    size = labels[0].size // 8
    a, b = start + 2 * size, start + 20 * size  # two frames of different segments
    data = swapped(encoded.data, (a, a + size), (b, b + size))
    assert_rejected(plan, encoded, data, labels, match="frame (3|21) does not reproduce")
    # per-frame items of the same length swapped: frames out of (segment, position) order
    frames = _frame_items(encoded.data)
    lengths = [end - start for start, _, end in frames]
    i = 0
    j = next(j for j in range(1, len(frames)) if lengths[j] == lengths[i])
    (a0, _, a1), (b0, _, b1) = frames[i], frames[j]
    data = swapped(encoded.data, (a0, a1), (b0, b1))
    assert_rejected(plan, encoded, data, labels, match="order|does not reproduce")


def test_check_catches_a_wrong_segment_number(encoded_binary: Any) -> None:
    plan, encoded, labels = encoded_binary
    _, _, end = _frame_items(encoded.data)[0]
    data = bytearray(encoded.data)
    assert struct.unpack_from("<H", data, end - 2)[0] == 1  # Referenced Segment Number
    struct.pack_into("<H", data, end - 2, 2)
    assert_rejected(plan, encoded, data, labels, match="order|does not reproduce|Dimension Index")
    struct.pack_into("<H", data, end - 2, 7)
    assert_rejected(plan, encoded, data, labels, match="names no described segment")


def test_check_catches_truncated_pixel_data(encoded_binary: Any) -> None:
    plan, encoded, labels = encoded_binary
    assert_rejected(plan, encoded, encoded.data[:-100], labels, match="do not parse")
    # a consistent element, one frame short
    start, end = _value(encoded.data, Tag.PIXEL_DATA)
    size = labels[0].size // 8
    data = bytearray(encoded.data[: end - size])
    struct.pack_into("<I", data, start - 4, end - size - start)
    assert_rejected(plan, encoded, data, labels, match="Pixel Data has")


def test_check_catches_a_wrong_plane_position(encoded_binary: Any) -> None:
    plan, encoded, labels = encoded_binary
    frame_start, _, frame_end = _frame_items(encoded.data)[5]
    data = bytearray(encoded.data)
    view = memoryview(data)
    position = next(e for e in elements(view, frame_start + 8, frame_end) if e[0] == 0x00209113)
    text = bytes(data[position[1] : position[3]])
    digit = max(i for i, c in enumerate(text) if chr(c).isdigit())
    data[position[1] + digit] = ord("7") if text[digit] != ord("7") else ord("3")
    del view
    assert_rejected(
        plan, encoded, data, labels, match="Plane Position is not the position of a volume slice"
    )


def test_check_catches_header_and_count_changes(encoded_binary: Any) -> None:
    plan, encoded, labels = encoded_binary
    data = encoded.data.replace(b"SYNTH", b"SYNTI", 1)
    assert_rejected(
        plan, encoded, data, labels, match="PatientName differs from the prepared header"
    )
    count = b"\x28\x00\x08\x00IS\x02\x00" + str(encoded.number_of_frames).encode()
    assert count in encoded.data
    data = encoded.data.replace(count, count[:-2] + b"99", 1)
    assert_rejected(plan, encoded, data, labels, match="Number of Frames")


def test_check_catches_labels_that_differ(encoded_binary: Any) -> None:
    plan, encoded, labels = encoded_binary
    changed = labels.copy()
    changed[2, 20, 20] = 2 if changed[2, 20, 20] != 2 else 1
    with pytest.raises(ResultError, match=r"voxels differ, first at \(z, y, x\) = \(2, 20, 20\)"):
        check_encoded(plan, encoded, changed)
    missing = labels.copy()
    missing[0, 0, 0] = 3  # left lung on a slice that has no left-lung frame
    with pytest.raises(ResultError, match="label 3 has voxels on slice 0 but no frame there"):
        check_encoded(plan, encoded, missing)
    undescribed = labels.copy()
    assert undescribed[0, 0, 0] == 0
    undescribed[0, 0, 0] = 6  # a label the SEG does not describe, on background
    with pytest.raises(ResultError, match="hold label values the SEG does not describe"):
        check_encoded(plan, encoded, undescribed)


@pytest.mark.parametrize("kind", KINDS)
def test_check_catches_a_flipped_bit_across_frame_boundaries(kind: str) -> None:
    """45 x 41 frames: BINARY frames share bytes; the check unpacks the whole Pixel Data."""
    volume = small_volume(rows=45, columns=41, slices=7)
    labels = truth(volume)
    plan = prepare(volume, kind)
    encoded = plan.encode(labels)
    check_encoded(plan, encoded, labels)
    start, end = _value(encoded.data, Tag.PIXEL_DATA)
    data = bytearray(encoded.data)
    data[(start + end) // 2] ^= 0x04
    assert_rejected(plan, encoded, data, labels, match="does not reproduce the label map")


def test_check_labelmap_catches_a_changed_voxel() -> None:
    volume = small_volume()
    labels = some_absent(truth(volume))
    plan = prepare(volume, "LABELMAP")
    encoded = plan.encode(labels)
    check_encoded(plan, encoded, labels)
    start, _ = _value(encoded.data, Tag.PIXEL_DATA)
    data = bytearray(encoded.data)
    data[start + 3 * labels[0].size + 100] ^= 0x01
    assert_rejected(plan, encoded, data, labels, match="frame 4 does not reproduce")


def test_full_size_encode_and_check_agree() -> None:
    """The tissue model's five labels on 128 x 512 x 512: the check accepts the encoding."""
    labels = phantom_labels(512, 512, 128)
    volume = small_volume(rows=512, columns=512, slices=128)
    plan = prepare(volume, "BINARY")
    encoded = plan.encode(labels)
    check_encoded(plan, encoded, labels)
    present = [[np.any(s == v) for s in labels] for v in range(1, 6)]
    assert encoded.number_of_frames == int(np.count_nonzero(present))


LEFT = ("7771000", "SCT", "Left")
RIGHT = ("24028007", "SCT", "Right")
KIDNEY = ("64033007", "SCT", "Kidney")
ABDOMEN = ("818981001", "SCT", "Abdomen")


def lateral_manifest() -> ModelManifest:
    """Two kidneys told apart by their laterality (as TotalSegmentator's labels are), one
    structure with an anatomic region."""
    category = ("123037004", "SCT", "Anatomical Structure")
    return dataclasses.replace(
        MANIFEST,
        labels=(
            LabelSpec(1, "kidney_left", category, KIDNEY, (185, 102, 83), modifier=LEFT),
            LabelSpec(2, "kidney_right", category, KIDNEY, (185, 102, 83), modifier=RIGHT),
            LabelSpec(
                3,
                "fat",
                MANIFEST.labels[1].category,
                MANIFEST.labels[1].type,
                anatomic_region=ABDOMEN,
                anatomic_region_modifier=LEFT,
            ),  # fmt: skip
        ),
    )


@pytest.mark.parametrize("kind", KINDS)
def test_laterality_and_anatomic_region(tmp_path: Path, kind: str) -> None:
    """A label's laterality goes into its type's code item
    (SegmentedPropertyTypeModifierCodeSequence) and its anatomic region into the segment;
    the fast bytes equal highdicom's, highdicom reads the codes back, and the SR's finding
    site carries the laterality."""
    manifest = lateral_manifest()
    volume = small_volume()
    labels = truth(volume)
    labels[labels > 3] = 3
    encoded = assert_equal_to_highdicom(volume, labels, kind, manifest)
    seg = hd.seg.segread(io.BytesIO(encoded.data))
    found = {}
    for item in seg.SegmentSequence:
        if int(item.SegmentNumber) == 0:
            continue
        type_item = item.SegmentedPropertyTypeCodeSequence[0]
        modifier = type_item.get("SegmentedPropertyTypeModifierCodeSequence")
        region = item.get("AnatomicRegionSequence")
        found[str(item.SegmentLabel)] = (
            str(type_item.CodeValue),
            str(modifier[0].CodeMeaning) if modifier else None,
            str(region[0].CodeValue) if region else None,
            str(region[0].AnatomicRegionModifierSequence[0].CodeMeaning) if region else None,
        )
    assert found == {
        "kidney_left": ("64033007", "Left", None, None),
        "kidney_right": ("64033007", "Right", None, None),
        "fat": (MANIFEST.labels[1].type[0], None, "818981001", "Left"),
    }
    if kind == "BINARY" and shutil.which("dciodvfy"):
        errors, warnings = dciodvfy(encoded.data, tmp_path / "lateral.dcm")
        assert errors == [] and warnings == []
    sr = build_sr(volume, labels, manifest, pydicom.dcmread(io.BytesIO(encoded.data)), UIDS,
                  equipment=SR_EQUIPMENT)  # fmt: skip
    report = hd.sr.srread(io.BytesIO(_bytes(sr))).content
    lateralities = sorted(
        str(site.laterality.meaning) if site.laterality else "-"
        for group in report.get_volumetric_roi_measurement_groups()
        for site in group.finding_sites
    )
    assert lateralities == ["Left", "Right"]  # fat is no anatomical structure: no site


def _bytes(ds: Dataset) -> bytes:
    out = io.BytesIO()
    ds.save_as(out, enforce_file_format=True)
    return out.getvalue()
