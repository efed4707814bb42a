"""segnode.node.results.build: DICOM SEG and TID 1500 SR from a label map, checked by re-reading and
dciodvfy."""

from __future__ import annotations

import copy
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import highdicom as hd
import numpy as np
import numpy.typing as npt
import pydicom
import pytest
from pydicom.dataset import Dataset
from pydicom.sr.codedict import codes
from pydicom.uid import generate_uid

from segnode.node.ingest.volume import Volume, assemble_from_datasets, assemble_volume
from segnode.node.results.build import (
    Equipment,
    NoSegmentsError,
    ResultError,
    ResultUIDs,
    build_seg,
    build_sr,
    segment_numbers,
    segment_statistics,
    verify_seg,
)
from tests.conftest import LIVER, PHANTOM, require_data, require_tool
from tests.fixtures.phantom_model import MANIFEST
from tests.fixtures.synthetic import (
    AXIAL,
    SAGITTAL,
    PhantomGeometry,
    phantom_labels,
    synthetic_datasets,
    write_enhanced_ct,
)

SMALL = PhantomGeometry(rows=48, columns=40, slices=8)
UIDS = ResultUIDs(
    seg_series_uid="2.25.1001",
    seg_sop_uid="2.25.1002",
    sr_series_uid="2.25.1003",
    sr_sop_uid="2.25.1004",
)
SEG_EQUIPMENT = Equipment.for_seg("0.1.0")
SR_EQUIPMENT = Equipment.for_sr("0.1.0")
OBLIQUE = (
    float(np.cos(np.radians(30))),
    float(np.sin(np.radians(30))),
    0.0,
    0.0,
    0.0,
    -1.0,
)


def small_volume(**geometry: Any) -> Volume:
    """The small phantom, ``geometry`` overriding fields of :data:`SMALL`."""
    datasets = synthetic_datasets(replace(SMALL, **geometry))
    return assemble_from_datasets(datasets[::-1])


def truth(volume: Volume) -> npt.NDArray[np.uint8]:
    return phantom_labels(*volume.shape[1:], volume.shape[0])


def encode_both(
    volume: Volume, labels: npt.NDArray[np.integer], uids: ResultUIDs = UIDS
) -> tuple[Dataset, Dataset]:
    seg = build_seg(volume, labels, MANIFEST, uids, equipment=SEG_EQUIPMENT)
    verify_seg(seg, volume, labels, with_highdicom=True)
    sr = build_sr(volume, labels, MANIFEST, seg, uids, equipment=SR_EQUIPMENT)
    return seg, sr


# Warnings dciodvfy gives for attributes copied unchanged from real sources.
SOURCE_WARNINGS = ("Retired Person Name form",)


def dciodvfy(ds: Dataset, path: Path) -> list[str]:
    """Validate with dicom3tools; fail on any error, return the warnings."""
    tool = require_tool("dciodvfy")
    ds.save_as(path, enforce_file_format=True)
    proc = subprocess.run([tool, str(path)], capture_output=True, text=True, check=False)
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [line for line in lines if "Error" in line]
    assert not errors, "\n".join(lines)
    return [line for line in lines if "Warning" in line]


# --------------------------------------------------------------------------- UIDs


def test_result_uids_new() -> None:
    a, b = ResultUIDs.new(), ResultUIDs.new()
    values = [a.seg_series_uid, a.seg_sop_uid, a.sr_series_uid, a.sr_sop_uid]
    assert len(set(values)) == 4
    assert a != b
    assert all(v.startswith("2.25.") and len(v) <= 64 for v in values)


def test_same_uids_give_same_objects() -> None:
    volume = small_volume()
    labels = truth(volume)
    seg1, sr1 = encode_both(volume, labels)
    seg2, sr2 = encode_both(volume, labels)
    assert seg1.SOPInstanceUID == seg2.SOPInstanceUID == UIDS.seg_sop_uid
    assert seg1.SeriesInstanceUID == UIDS.seg_series_uid
    assert sr1.SOPInstanceUID == sr2.SOPInstanceUID == UIDS.sr_sop_uid
    assert sr1.SeriesInstanceUID == UIDS.sr_series_uid
    assert [s.TrackingUID for s in seg1.SegmentSequence] == [
        s.TrackingUID for s in seg2.SegmentSequence
    ]
    groups1 = _groups(sr1)
    groups2 = _groups(sr2)
    assert [g.tracking_uid for g in groups1] == [g.tracking_uid for g in groups2]
    assert seg1.PixelData == seg2.PixelData


# ---------------------------------------------------------------------------- SEG


def test_segment_numbers_skip_empty_labels() -> None:
    labels = np.zeros((2, 4, 4), dtype=np.uint8)
    labels[0, 0, 0] = 2
    labels[1, 1, 1] = 5
    assert segment_numbers(labels, MANIFEST) == {2: 1, 5: 2}


def test_seg_axial() -> None:
    volume = small_volume()
    labels = truth(volume)
    seg, _ = encode_both(volume, labels)
    assert seg.SOPClassUID == "1.2.840.10008.5.1.4.1.1.66.4"
    assert seg.SegmentationType == "BINARY"
    assert seg.FrameOfReferenceUID == volume.frame_of_reference_uid
    assert seg.StudyInstanceUID == volume.study_instance_uid
    assert seg.SeriesNumber == 9901
    # five labels present (6 "Liver" is not): five segments, in label order
    assert [(s.SegmentNumber, s.SegmentLabel) for s in seg.SegmentSequence] == [
        (1, "Soft tissue"),
        (2, "Fat"),
        (3, "Left lung"),
        (4, "Right lung"),
        (5, "Spine"),
    ]
    first = seg.SegmentSequence[0]
    assert first.SegmentAlgorithmType == "AUTOMATIC"
    assert first.SegmentAlgorithmName == "phantom"
    algorithm = first.SegmentationAlgorithmIdentificationSequence[0]
    assert algorithm.AlgorithmName == "phantom"
    assert algorithm.AlgorithmVersion == "1.2.3"
    assert algorithm.AlgorithmFamilyCodeSequence[0].CodeMeaning == "Artificial Intelligence"
    assert seg.SegmentSequence[2].SegmentedPropertyTypeCodeSequence[0].CodeValue == "44029006"
    referenced = {
        item.ReferencedSOPInstanceUID
        for item in seg.ReferencedSeriesSequence[0].ReferencedInstanceSequence
    }
    assert referenced == {ds.SOPInstanceUID for ds in volume.sources}
    # lungs only in the upper half: empty frames are omitted
    assert seg.NumberOfFrames == 3 * SMALL.slices + 2 * (SMALL.slices // 2)


def _source_frame_uids(seg: Dataset) -> list[str]:
    return [
        f.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID
        for f in seg.PerFrameFunctionalGroupsSequence
    ]


@pytest.mark.parametrize(
    "orientation",
    [(1.0, 0.0, 0.0, 0.0, -1.0, 0.0), SAGITTAL, OBLIQUE],
    ids=["flipped-axial", "sagittal", "oblique"],
)
def test_seg_geometry_non_axial(orientation: tuple[float, ...]) -> None:
    volume = small_volume(orientation=orientation)
    labels = truth(volume)
    seg, _ = encode_both(volume, labels)
    shared = seg.SharedFunctionalGroupsSequence[0]
    np.testing.assert_allclose(
        [float(v) for v in shared.PlaneOrientationSequence[0].ImageOrientationPatient],
        orientation,
        atol=1e-6,
    )
    positions = {tuple(np.round(p, 3)) for p in volume.slice_positions}
    for frame in seg.PerFrameFunctionalGroupsSequence:
        ipp = frame.PlanePositionSequence[0].ImagePositionPatient
        assert tuple(np.round([float(v) for v in ipp], 3)) in positions
    assert set(_source_frame_uids(seg)) <= {ds.SOPInstanceUID for ds in volume.sources}


def test_seg_frames_reference_their_source_slice() -> None:
    volume = small_volume()
    seg, _ = encode_both(volume, truth(volume))
    by_uid = {ds.SOPInstanceUID: ds for ds in volume.sources}
    for frame in seg.PerFrameFunctionalGroupsSequence:
        uid = frame.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID
        source = by_uid[uid].ImagePositionPatient
        ipp = frame.PlanePositionSequence[0].ImagePositionPatient
        np.testing.assert_allclose([float(v) for v in ipp], [float(v) for v in source])


def test_seg_tolerates_orientation_jitter() -> None:
    datasets = synthetic_datasets(SMALL)
    datasets[3].ImageOrientationPatient = [1.0, 0.00002, 0.0, -0.00002, 1.0, 0.0]
    volume = assemble_from_datasets(datasets)
    seg, _ = encode_both(volume, truth(volume))
    assert volume.sources[3].ImageOrientationPatient[1] == pytest.approx(0.00002)


def test_seg_from_enhanced_ct(tmp_path: Path) -> None:
    order = [3, 1, 0, 5, 4, 2, 7, 6]
    path = write_enhanced_ct(tmp_path / "enhanced.dcm", SMALL, frame_order=order)
    volume = assemble_volume([path])
    labels = truth(volume)
    seg, sr = encode_both(volume, labels)
    # each SEG frame refers to the source frame at its position
    source = pydicom.dcmread(path)
    for frame in seg.PerFrameFunctionalGroupsSequence:
        ref = frame.DerivationImageSequence[0].SourceImageSequence[0]
        src = source.PerFrameFunctionalGroupsSequence[int(ref.ReferencedFrameNumber) - 1]
        np.testing.assert_allclose(
            [float(v) for v in frame.PlanePositionSequence[0].ImagePositionPatient],
            [float(v) for v in src.PlanePositionSequence[0].ImagePositionPatient],
        )
    assert dciodvfy(seg, tmp_path / "seg.dcm") == []
    assert dciodvfy(sr, tmp_path / "sr.dcm") == []


def test_all_empty_labels() -> None:
    volume = small_volume()
    labels = np.zeros(volume.shape, dtype=np.uint8)
    with pytest.raises(NoSegmentsError, match="found no segment"):
        build_seg(volume, labels, MANIFEST, UIDS, equipment=SEG_EQUIPMENT)
    assert issubclass(NoSegmentsError, ResultError)


def test_unknown_label_value() -> None:
    volume = small_volume()
    labels = truth(volume)
    labels[0, 0, 0] = 9
    with pytest.raises(ResultError, match=r"values \[9\] that model phantom"):
        build_seg(volume, labels, MANIFEST, UIDS, equipment=SEG_EQUIPMENT)


def test_label_shape_mismatch() -> None:
    volume = small_volume()
    with pytest.raises(ResultError, match="shape"):
        build_seg(volume, truth(volume)[1:], MANIFEST, UIDS, equipment=SEG_EQUIPMENT)


@pytest.mark.parametrize("with_highdicom", [False, True])
def test_verify_detects_wrong_labels(with_highdicom: bool) -> None:
    volume = small_volume()
    labels = truth(volume)
    seg = build_seg(volume, labels, MANIFEST, UIDS, equipment=SEG_EQUIPMENT)
    changed = labels.copy()
    changed[2, 20, 20] = 0 if changed[2, 20, 20] else 1
    with pytest.raises(ResultError, match="1 voxels differ, first at"):
        verify_seg(seg, volume, changed, with_highdicom=with_highdicom)


def test_verify_detects_a_wrong_source_reference_without_highdicom() -> None:
    """The check the worker runs before every send (no highdicom re-read) still catches a
    frame that derives from the wrong source instance."""
    volume = small_volume()
    labels = truth(volume)
    seg = build_seg(volume, labels, MANIFEST, UIDS, equipment=SEG_EQUIPMENT)
    verify_seg(seg, volume, labels)
    swapped = copy.deepcopy(seg)
    source = swapped.PerFrameFunctionalGroupsSequence[0].DerivationImageSequence[0]
    source.SourceImageSequence[0].ReferencedSOPInstanceUID = generate_uid()
    with pytest.raises(ResultError, match="derives from"):
        verify_seg(swapped, volume, labels)


@pytest.mark.parametrize("with_highdicom", [False, True])
def test_verify_detects_wrong_geometry(with_highdicom: bool) -> None:
    volume = small_volume()
    labels = truth(volume)
    seg = build_seg(volume, labels, MANIFEST, UIDS, equipment=SEG_EQUIPMENT)
    moved = copy.deepcopy(seg)
    frame = moved.PerFrameFunctionalGroupsSequence[0].PlanePositionSequence[0]
    x, y, z = (float(v) for v in frame.ImagePositionPatient)
    frame.ImagePositionPatient = [x, y, z + 0.6]
    with pytest.raises(ResultError, match="not at any source slice position"):
        verify_seg(moved, volume, labels, with_highdicom=with_highdicom)
    rotated = copy.deepcopy(seg)
    plane = rotated.SharedFunctionalGroupsSequence[0].PlaneOrientationSequence[0]
    plane.ImageOrientationPatient = [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    with pytest.raises(ResultError, match="orientation"):
        verify_seg(rotated, volume, labels, with_highdicom=with_highdicom)
    other = copy.deepcopy(seg)
    other.FrameOfReferenceUID = generate_uid()
    with pytest.raises(ResultError, match="FrameOfReferenceUID"):
        verify_seg(other, volume, labels, with_highdicom=with_highdicom)


# ----------------------------------------------------------------------------- SR


def _groups(sr: Dataset) -> list[hd.sr.VolumetricROIMeasurementsAndQualitativeEvaluations]:
    report = hd.sr.MeasurementReport.from_sequence(hd.sr.Comprehensive3DSR.from_dataset(sr).content)
    return report.get_volumetric_roi_measurement_groups()


def evidence(sr: Dataset) -> set[tuple[str, str, str]]:
    """Series, SOP Class and SOP Instance UID of each instance the SR lists as evidence."""
    return {
        (series.SeriesInstanceUID, item.ReferencedSOPClassUID, item.ReferencedSOPInstanceUID)
        for study in sr.CurrentRequestedProcedureEvidenceSequence
        for series in study.ReferencedSeriesSequence
        for item in series.ReferencedSOPSequence
    }


def test_sr_content() -> None:
    volume = small_volume(slice_spacing=2.5, pixel_spacing=0.8)
    labels = truth(volume)
    seg, sr = encode_both(volume, labels)
    assert sr.SOPClassUID == "1.2.840.10008.5.1.4.1.1.88.34"
    assert sr.SeriesNumber == 9902
    assert sr.CompletionFlag == "COMPLETE"
    assert sr.VerificationFlag == "UNVERIFIED"
    assert sr.ContentTemplateSequence[0].TemplateIdentifier == "1500"
    listed = {uid for _, _, uid in evidence(sr)}
    assert seg.SOPInstanceUID in listed
    assert {ds.SOPInstanceUID for ds in volume.sources} <= listed

    groups = _groups(sr)
    assert len(groups) == 5
    voxel_ml = 2.5 * 0.8 * 0.8 / 1000
    for value, group in enumerate(groups, start=1):
        spec = MANIFEST.label(value)
        ref = group.referenced_segment
        assert ref is not None
        assert ref.referenced_sop_instance_uid == seg.SOPInstanceUID
        assert ref.referenced_segment_numbers == [value]  # labels 1..5 all present
        assert group.finding_type is not None
        assert group.finding_type.value == spec.type[0]
        mask = labels == value
        volumes = group.get_measurements(name=codes.SCT.Volume)
        assert len(volumes) == 1
        assert volumes[0].unit.value == "ml"
        assert volumes[0].value == pytest.approx(mask.sum() * voxel_ml, abs=1e-6)
        attenuation = group.get_measurements(name=codes.DCM.AttenuationCoefficient)
        by_derivation = {m.derivation.meaning: m for m in attenuation if m.derivation}
        assert by_derivation["Mean"].unit.value == "[hnsf'U]"
        assert by_derivation["Mean"].value == pytest.approx(float(volume.hu[mask].mean()), abs=1e-3)
        assert by_derivation["Standard Deviation"].value == pytest.approx(
            float(volume.hu[mask].std()), abs=1e-3
        )


def test_sr_finding_site_only_for_anatomy() -> None:
    volume = small_volume()
    _, sr = encode_both(volume, truth(volume))
    groups = _groups(sr)
    assert groups[0].finding_sites == []  # soft tissue: a tissue, not a site
    assert [s.value.value for s in groups[2].finding_sites] == ["44029006"]


def test_segment_statistics_match_numpy() -> None:
    volume = small_volume()
    labels = truth(volume)
    for stat in segment_statistics(volume, labels, MANIFEST):
        mask = labels == stat.label.value
        assert stat.voxels == int(mask.sum())
        assert stat.mean_hu == pytest.approx(float(volume.hu[mask].astype(np.float64).mean()))
        assert stat.std_hu == pytest.approx(float(volume.hu[mask].astype(np.float64).std()))


def test_sr_rejects_foreign_seg() -> None:
    volume = small_volume()
    labels = truth(volume)
    seg = build_seg(volume, labels, MANIFEST, UIDS, equipment=SEG_EQUIPMENT)
    fewer = labels.copy()
    fewer[fewer == 5] = 0
    with pytest.raises(ResultError, match="do not match the label map"):
        build_sr(volume, fewer, MANIFEST, seg, UIDS, equipment=SR_EQUIPMENT)


# ------------------------------------------------------------------ dciodvfy, real data


@pytest.mark.interop
@pytest.mark.parametrize(
    "orientation", [AXIAL, SAGITTAL, OBLIQUE], ids=["axial", "sagittal", "oblique"]
)
def test_dciodvfy_synthetic(tmp_path: Path, orientation: tuple[float, ...]) -> None:
    datasets = synthetic_datasets(replace(SMALL, orientation=orientation))
    warnings = dciodvfy(datasets[0], tmp_path / "ct.dcm")
    # a non-axial synthetic slice has Image Type value 3 OTHER, which dciodvfy warns about
    assert all("<OTHER> for value 3 of attribute <Image Type>" in w for w in warnings)
    assert orientation != AXIAL or warnings == []
    volume = assemble_from_datasets(datasets)
    seg, sr = encode_both(volume, truth(volume))
    assert dciodvfy(seg, tmp_path / "seg.dcm") == []
    assert dciodvfy(sr, tmp_path / "sr.dcm") == []


@pytest.mark.interop
def test_dciodvfy_enhanced_ct(tmp_path: Path) -> None:
    path = write_enhanced_ct(tmp_path / "e.dcm", SMALL)
    assert dciodvfy(pydicom.dcmread(path), tmp_path / "e2.dcm") == []


def _threshold_labels(volume: Volume) -> npt.NDArray[np.uint8]:
    labels = np.zeros(volume.shape, dtype=np.uint8)
    labels[(volume.hu > -500) & (volume.hu <= 300)] = 1
    labels[volume.hu > 300] = 5
    return labels


@pytest.mark.interop
@pytest.mark.filterwarnings("ignore:The string .* is unlikely to represent")
def test_real_phantom_seg_and_sr(tmp_path: Path) -> None:
    volume = assemble_volume(sorted(p for p in require_data(PHANTOM).iterdir() if p.is_file()))
    labels = _threshold_labels(volume)
    seg, sr = encode_both(volume, labels)
    assert [s.SegmentLabel for s in seg.SegmentSequence] == ["Soft tissue", "Spine"]
    for ds, name in ((seg, "seg.dcm"), (sr, "sr.dcm")):
        warnings = dciodvfy(ds, tmp_path / name)
        assert all(any(known in w for known in SOURCE_WARNINGS) for w in warnings), warnings


@pytest.mark.interop
@pytest.mark.filterwarnings("ignore:The string .* is unlikely to represent")
def test_real_liver_seg_and_sr(tmp_path: Path) -> None:
    # the source has an empty Specific Character Set and no Laterality (dciodvfy errors in
    # the source); the SEG and SR must not inherit them
    volume = assemble_volume(sorted(require_data(LIVER).glob("*.dcm")))
    labels = _threshold_labels(volume)
    seg, sr = encode_both(volume, labels)
    assert "SpecificCharacterSet" not in seg
    for ds, name in ((seg, "seg.dcm"), (sr, "sr.dcm")):
        warnings = dciodvfy(ds, tmp_path / name)
        assert all(any(known in w for known in SOURCE_WARNINGS) for w in warnings), warnings


@pytest.mark.slow
def test_full_size_volume_encodes(tmp_path: Path) -> None:
    """512 x 512 x 128 with five labels: builds and verifies (timings in the report)."""
    datasets = synthetic_datasets(PhantomGeometry(rows=512, columns=512, slices=128))
    volume = assemble_from_datasets(datasets)
    seg, sr = encode_both(volume, truth(volume))
    assert len(seg.SegmentSequence) == 5
    assert len(_groups(sr)) == 5
