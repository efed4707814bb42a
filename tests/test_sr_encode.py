"""segnode.node.results.sr_encode and segnode.node.results.statistics: the SR prepared before the
labels exist equals build_sr's bytes, and the fast statistics equal the bincount ones they
replaced."""

from __future__ import annotations

import dataclasses
import datetime
import io
import subprocess
from collections.abc import Iterator
from pathlib import Path

import highdicom as hd
import numpy as np
import numpy.typing as npt
import pydicom
import pytest
from pydicom.sr.codedict import codes

from segnode.engines.manifest import LabelSpec
from segnode.node.ingest.volume import Volume, assemble_from_datasets, assemble_volume
from segnode.node.pipeline.worker import encode
from segnode.node.results.build import (
    LABEL_MAP_SEGMENTATION_STORAGE,
    SEGMENTATION_STORAGE,
    NoSegmentsError,
    ResultError,
    ResultUIDs,
    SegmentStatistics,
    build_sr,
    segment_statistics,
)
from segnode.node.results.sr_encode import SrPlan
from segnode.node.results.statistics import (
    SegmentStatsAccumulator,
    _bincount,
    label_counts,
)
from tests.conftest import PHANTOM, require_data, require_tool
from tests.fixtures.highdicom_clock import highdicom_clock
from tests.fixtures.statistics import bincount_statistics
from tests.fixtures.synthetic import phantom_labels, synthetic_datasets, write_enhanced_ct
from tests.test_results import MANIFEST, SMALL, SOURCE_WARNINGS, SR_EQUIPMENT, UIDS, evidence
from tests.test_seg_encode import prepare as prepare_seg
from tests.test_seg_encode import reference_seg

NOW = datetime.datetime(2026, 12, 4, 3, 4, 5, 678901)
#: Present label values of the label maps: 5, 3 and 1 segments.
PRESENT = {5: (1, 2, 3, 4, 5), 3: (1, 3, 5), 1: (3,)}


@pytest.fixture
def pinned_clock() -> Iterator[datetime.datetime]:
    """highdicom's clock stopped at ``NOW``."""
    with highdicom_clock(NOW):
        yield NOW


def _synthetic() -> Volume:
    return assemble_from_datasets(synthetic_datasets(SMALL))


def _enhanced(tmp_path: Path) -> Volume:
    path = write_enhanced_ct(tmp_path / "enhanced.dcm", SMALL)
    return assemble_volume([path])


def _phantom() -> Volume:
    return assemble_volume(sorted(p for p in require_data(PHANTOM).iterdir() if p.is_file()))


def _labels(volume: Volume, present: tuple[int, ...]) -> npt.NDArray[np.uint8]:
    labels = phantom_labels(*volume.shape[1:], volume.shape[0])
    labels[~np.isin(labels, present)] = 0
    return labels


@pytest.fixture(scope="module")
def phantom() -> Volume:
    return _phantom()


def _stored(stats: list[SegmentStatistics]) -> list[tuple[int, int, int, float, float, float]]:
    """What the SR stores of each segment."""
    return [
        (
            s.segment_number,
            s.label.value,
            s.voxels,
            round(s.volume_ml, 6),
            round(s.mean_hu, 4),
            round(s.std_hu, 4),
        )
        for s in stats
    ]


# ----------------------------------------------------------------------- statistics


@pytest.mark.parametrize("count", sorted(PRESENT))
def test_statistics_equal_bincount_synthetic(count: int) -> None:
    volume = _synthetic()
    labels = _labels(volume, PRESENT[count])
    stats = segment_statistics(volume, labels, MANIFEST)
    assert [s.label.value for s in stats] == list(PRESENT[count])
    # integer HU: every sum is exact, so the floats are the same bit for bit
    assert stats == bincount_statistics(volume, labels, MANIFEST)
    counts = label_counts(volume, labels, MANIFEST)
    np.testing.assert_array_equal(counts, _bincount(labels, 7))


@pytest.mark.interop
@pytest.mark.parametrize("count", sorted(PRESENT))
def test_statistics_equal_bincount_phantom(phantom: Volume, count: int) -> None:
    labels = _labels(phantom, PRESENT[count])
    assert segment_statistics(phantom, labels, MANIFEST) == bincount_statistics(
        phantom, labels, MANIFEST
    )
    thresholds = np.zeros(phantom.shape, dtype=np.uint8)
    thresholds[(phantom.hu > -500) & (phantom.hu <= 300)] = 1
    thresholds[phantom.hu > 300] = 5
    assert segment_statistics(phantom, thresholds, MANIFEST) == bincount_statistics(
        phantom, thresholds, MANIFEST
    )


def test_statistics_of_non_integer_hu_agree_to_rounding() -> None:
    volume = _synthetic()
    rng = np.random.default_rng(7)
    hu = (volume.hu * np.float32(1.37) + rng.normal(0, 0.3, volume.shape)).astype(np.float32)
    scaled = dataclasses.replace(volume, hu=hu)
    labels = _labels(volume, PRESENT[5])
    stats = segment_statistics(scaled, labels, MANIFEST)
    reference = bincount_statistics(scaled, labels, MANIFEST)
    assert _stored(stats) == _stored(reference)
    for new, old in zip(stats, reference, strict=True):
        assert new.mean_hu == pytest.approx(old.mean_hu, rel=1e-12, abs=1e-9)
        assert new.std_hu == pytest.approx(old.std_hu, rel=1e-9, abs=1e-9)


def _fragmented(shape: tuple[int, ...], top: int, seed: int) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, top + 1, shape).astype(np.uint8)


def test_statistics_of_fragmented_maps_and_many_labels() -> None:
    """Short runs (np.bincount per chunk) and a model with more labels than compared one by
    one (np.bincount throughout) give the same statistics."""
    volume = _synthetic()
    noisy = _fragmented(volume.shape, 6, seed=1)
    assert segment_statistics(volume, noisy, MANIFEST) == bincount_statistics(
        volume, noisy, MANIFEST
    )
    tissue = ("85756007", "SCT", "Tissue")
    many = dataclasses.replace(
        MANIFEST,
        name="many",
        labels=tuple(LabelSpec(v, f"Label {v}", tissue, tissue) for v in range(1, 41)),
    )
    labels = _fragmented(volume.shape, 40, seed=2)
    labels[:4] = phantom_labels(*volume.shape[1:], 4)
    assert segment_statistics(volume, labels, many) == bincount_statistics(volume, labels, many)
    np.testing.assert_array_equal(label_counts(volume, labels, many), _bincount(labels, 41))


def test_accumulator_fed_in_slabs() -> None:
    volume = _synthetic()
    labels = _labels(volume, PRESENT[5])
    whole = segment_statistics(volume, labels, MANIFEST)
    accumulator = SegmentStatsAccumulator(MANIFEST)
    for start, stop in ((0, 3), (3, 4), (4, 8)):
        accumulator.add(labels[start:stop], volume.hu[start:stop])
    assert accumulator.result(volume.voxel_volume_ml) == whole
    rows = SegmentStatsAccumulator(MANIFEST)
    for z in range(volume.shape[0]):
        for y in range(0, volume.shape[1], 7):  # odd pieces, 2-D and int16 HU
            rows.add(labels[z, y : y + 7], volume.hu[z, y : y + 7].astype(np.int16))
    assert rows.result(volume.voxel_volume_ml) == whole


def test_statistics_reject_what_label_counts_rejects() -> None:
    volume = _synthetic()
    labels = _labels(volume, PRESENT[5])
    labels[0, 0, 0] = 9
    with pytest.raises(ResultError, match=r"values \[9\] that model phantom"):
        segment_statistics(volume, labels, MANIFEST)
    signed = labels.astype(np.int16)
    signed[0, 0, 0] = -1
    with pytest.raises(ResultError, match=r"values \[-1\] that model phantom"):
        segment_statistics(volume, signed, MANIFEST)
    with pytest.raises(ResultError, match=r"values \[9\] that model phantom"):
        SegmentStatsAccumulator(MANIFEST).add(labels[:1], volume.hu[:1])
    with pytest.raises(ResultError, match="shape"):
        segment_statistics(volume, labels[1:], MANIFEST)
    with pytest.raises(ResultError, match="must be integer"):
        segment_statistics(volume, labels.astype(np.float32), MANIFEST)
    with pytest.raises(ResultError, match="shape"):
        SegmentStatsAccumulator(MANIFEST).add(labels[:1], volume.hu[:2])


# ------------------------------------------------------------------------------- SR


def _reference_bytes(
    volume: Volume, labels: npt.NDArray[np.integer], seg_class: str = SEGMENTATION_STORAGE
) -> bytes:
    """build_seg, build_sr and segnode.node.pipeline.worker.encode, as the worker writes the SR
    today."""
    kind = "LABELMAP" if seg_class == LABEL_MAP_SEGMENTATION_STORAGE else "BINARY"
    seg = reference_seg(volume, labels, kind)
    assert seg.SOPClassUID == seg_class
    return encode(build_sr(volume, labels, MANIFEST, seg, UIDS, equipment=SR_EQUIPMENT))


def _plan(volume: Volume, seg_class: str = SEGMENTATION_STORAGE, uids: ResultUIDs = UIDS) -> SrPlan:
    """The SR of ``volume`` prepared from the plan of its SEG of class ``seg_class``."""
    kind = "LABELMAP" if seg_class == LABEL_MAP_SEGMENTATION_STORAGE else "BINARY"
    return SrPlan.prepare(volume, prepare_seg(volume, kind, uids=uids), equipment=SR_EQUIPMENT)


def _measurements(data: bytes) -> list[tuple[int, str, float, float, float]]:
    """(segment number, referenced SOP Instance, volume, mean, std) of each group, as
    highdicom reads them back."""
    sr = hd.sr.srread(io.BytesIO(data))
    assert isinstance(sr, hd.sr.Comprehensive3DSR)
    report = hd.sr.MeasurementReport.from_sequence(sr.content)
    out: list[tuple[int, str, float, float, float]] = []
    for group in report.get_volumetric_roi_measurement_groups():
        ref = group.referenced_segment
        assert ref is not None and ref.referenced_segment_numbers is not None
        by_derivation = {
            m.derivation.meaning: m.value
            for m in group.get_measurements(name=codes.DCM.AttenuationCoefficient)
            if m.derivation is not None
        }
        (volume,) = group.get_measurements(name=codes.SCT.Volume)
        out.append(
            (
                ref.referenced_segment_numbers[0],
                str(ref.referenced_sop_instance_uid),
                volume.value,
                by_derivation["Mean"],
                by_derivation["Standard Deviation"],
            )
        )
    return out


#: dicom3tools (the 2022 snapshot Debian ships) predates Label Map Segmentation Storage
#: (Supplement 243): its condition on Referenced Segment Number knows only the classes of
#: its time, so it reports each group's reference to a LABELMAP SEG.
DCIODVFY_LABELMAP_UNKNOWN = (
    "Error - Shall not be present for Referenced SOP Class that is not segmentation - "
    "attribute <ReferencedSegmentNumber>"
)


def _dciodvfy(data: bytes, path: Path, *, known_errors: int = 0) -> list[str]:
    """Validate with dicom3tools: no error but ``known_errors`` times the LABELMAP one;
    return the warnings."""
    tool = require_tool("dciodvfy")
    path.write_bytes(data)
    proc = subprocess.run([tool, str(path)], capture_output=True, text=True, check=False)
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [line for line in lines if "Error" in line]
    assert errors == [DCIODVFY_LABELMAP_UNKNOWN] * known_errors, "\n".join(lines)
    return [line for line in lines if "Warning" in line]


def _check_sr(volume: Volume, count: int, tmp_path: Path, seg_class: str) -> bytes:
    labels = _labels(volume, PRESENT[count])
    plan = _plan(volume, seg_class)
    stats = segment_statistics(volume, labels, MANIFEST)
    data = plan.encode(stats, now=NOW)
    assert data == _reference_bytes(volume, labels, seg_class)
    assert _measurements(data) == [
        (s.segment_number, UIDS.seg_sop_uid, *_stored([s])[0][3:]) for s in stats
    ]
    ds = pydicom.dcmread(io.BytesIO(data))
    assert ds.ContentDate == "20261204" and ds.ContentTime == "030405.678901"
    listed = evidence(ds)
    assert (UIDS.seg_series_uid, seg_class, UIDS.seg_sop_uid) in listed
    assert len(listed) == 1 + len(volume.sources)
    labelmap = seg_class == LABEL_MAP_SEGMENTATION_STORAGE
    warnings = _dciodvfy(data, tmp_path / f"sr-{count}.dcm", known_errors=count * labelmap)
    assert all(any(known in w for known in SOURCE_WARNINGS) for w in warnings), warnings
    return data


@pytest.mark.interop
@pytest.mark.parametrize("count", sorted(PRESENT))
def test_sr_bytes_equal_build_sr_synthetic(
    pinned_clock: datetime.datetime, tmp_path: Path, count: int
) -> None:
    _check_sr(_synthetic(), count, tmp_path, SEGMENTATION_STORAGE)


@pytest.mark.interop
def test_sr_bytes_equal_build_sr_enhanced_and_label_map(
    pinned_clock: datetime.datetime, tmp_path: Path
) -> None:
    """One multi-frame source instance; a LABELMAP SEG."""
    volume = _enhanced(tmp_path)
    _check_sr(volume, 5, tmp_path, SEGMENTATION_STORAGE)
    _check_sr(volume, 3, tmp_path, LABEL_MAP_SEGMENTATION_STORAGE)


@pytest.mark.interop
@pytest.mark.filterwarnings("ignore:The string .* is unlikely to represent")
@pytest.mark.parametrize("count", sorted(PRESENT))
def test_sr_bytes_equal_build_sr_phantom(
    pinned_clock: datetime.datetime, phantom: Volume, tmp_path: Path, count: int
) -> None:
    _check_sr(phantom, count, tmp_path, SEGMENTATION_STORAGE)


def test_one_plan_serves_any_label_map(pinned_clock: datetime.datetime) -> None:
    volume = _synthetic()
    plan = _plan(volume)
    for count in (1, 5, 3):
        labels = _labels(volume, PRESENT[count])
        stats = segment_statistics(volume, labels, MANIFEST)
        assert plan.encode(stats, now=NOW) == _reference_bytes(volume, labels)


def test_encode_stamps_the_current_time() -> None:
    volume = _synthetic()
    stats = segment_statistics(volume, _labels(volume, PRESENT[3]), MANIFEST)
    plan = _plan(volume)
    before = datetime.datetime.now()
    now = pydicom.dcmread(io.BytesIO(plan.encode(stats)))
    after = datetime.datetime.now()
    pinned = pydicom.dcmread(io.BytesIO(plan.encode(stats, now=NOW)))
    stamped = datetime.datetime.strptime(f"{now.ContentDate}{now.ContentTime}", "%Y%m%d%H%M%S.%f")
    assert before <= stamped <= after
    clock = {"InstanceCreationDate", "InstanceCreationTime", "ContentDate", "ContentTime"}
    for keyword in clock:
        now[keyword].value = pinned[keyword].value
    now.ContributingEquipmentSequence[
        -1
    ].ContributionDateTime = pinned.ContributingEquipmentSequence[-1].ContributionDateTime
    assert now == pinned


def test_encode_checks_its_input() -> None:
    volume = _synthetic()
    stats = segment_statistics(volume, _labels(volume, PRESENT[3]), MANIFEST)
    plan = _plan(volume)
    with pytest.raises(NoSegmentsError):
        plan.encode([])
    with pytest.raises(ResultError, match="numbered 1..n"):
        plan.encode(stats[1:])
    with pytest.raises(ResultError, match="numbered 1..n"):
        plan.encode([stats[1], stats[0]])
    renamed = LabelSpec(3, "Other", MANIFEST.label(3).category, MANIFEST.label(3).type)
    with pytest.raises(ResultError, match="is not phantom's"):
        plan.encode([SegmentStatistics(1, renamed, 1, 1.0, 0.0, 0.0)])
    with pytest.raises(ResultError, match="is nan"):
        plan.encode([SegmentStatistics(1, MANIFEST.label(3), 1, 1.0, float("nan"), 0.0)])
    ct = dataclasses.replace(
        prepare_seg(volume, "BINARY"), sop_class_uid="1.2.840.10008.5.1.4.1.1.2"
    )
    with pytest.raises(ResultError, match="not a Segmentation SOP Class"):
        SrPlan.prepare(volume, ct, equipment=SR_EQUIPMENT)
    other_series = assemble_from_datasets(synthetic_datasets(SMALL, seed=5))
    with pytest.raises(ResultError, match="not the SEG of this volume's series"):
        SrPlan.prepare(other_series, prepare_seg(volume, "BINARY"), equipment=SR_EQUIPMENT)


def test_plans_for_other_uids_differ() -> None:
    volume = _synthetic()
    stats = segment_statistics(volume, _labels(volume, PRESENT[1]), MANIFEST)
    other = ResultUIDs.new()
    data = _plan(volume, uids=other).encode(stats, now=NOW)
    ds = pydicom.dcmread(io.BytesIO(data))
    assert ds.SOPInstanceUID == other.sr_sop_uid
    assert ds.SeriesInstanceUID == other.sr_series_uid
    assert _measurements(data)[0][1] == other.seg_sop_uid


@pytest.mark.interop
def test_sr_of_117_structures(tmp_path: Path) -> None:
    """TotalSegmentator's ``total``: a label map of 117 structures (``bench.seg_size``'s
    blobs, organs to ribs) gives an SR with one volumetric measurement group per structure,
    each with the volume, mean and standard deviation highdicom reads back as computed, that
    dciodvfy passes."""
    from bench.seg_size import blob_labels, blob_manifest, blob_volume

    volume = blob_volume((40, 128, 128))
    labels = blob_labels((40, 128, 128))
    manifest = blob_manifest()
    assert np.unique(labels).size == 118
    plan = SrPlan.prepare(volume, prepare_seg(volume, "BINARY", manifest), equipment=SR_EQUIPMENT)
    stats = segment_statistics(volume, labels, manifest)
    data = plan.encode(stats, now=NOW)
    measured = _measurements(data)
    assert len(measured) == len(stats) == 117
    assert [m[0] for m in measured] == [s.segment_number for s in stats]
    for m, s in zip(measured, stats, strict=True):
        assert m[2:] == pytest.approx(_stored([s])[0][3:], rel=1e-6), s.label.name
    warnings = _dciodvfy(data, tmp_path / "sr-117.dcm")
    assert all(any(known in w for known in SOURCE_WARNINGS) for w in warnings), warnings
