"""segnode.node.results.sr_encode's template cache: a plan spliced from the template of an earlier
job equals the full highdicom path's and build_sr's bytes; the evidence encoded without
highdicom equals ``collect_evidence``'s."""

from __future__ import annotations

import datetime
from pathlib import Path
from unittest import mock

import highdicom as hd
import numpy as np
import numpy.typing as npt
import pydicom
import pytest

from segnode.node.ingest.volume import Volume, assemble_from_datasets
from segnode.node.pipeline.worker import encode
from segnode.node.results import sr_encode
from segnode.node.results.build import (
    ResultUIDs,
    build_seg,
    build_sr,
    segment_statistics,
)
from segnode.node.results.sr_encode import SrPlan
from tests.fixtures.synthetic import PhantomGeometry, synthetic_datasets
from tests.test_results import MANIFEST, SEG_EQUIPMENT, SR_EQUIPMENT
from tests.test_sr_encode import NOW, PRESENT, _enhanced, _labels, _phantom, _plan, _synthetic
from tests.test_sr_encode import pinned_clock as pinned_clock


def _reference_for(volume: Volume, labels: npt.NDArray[np.integer], uids: ResultUIDs) -> bytes:
    seg = build_seg(volume, labels, MANIFEST, uids, equipment=SEG_EQUIPMENT)
    return encode(build_sr(volume, labels, MANIFEST, seg, uids, equipment=SR_EQUIPMENT))


@pytest.mark.filterwarnings("ignore:The string .* is unlikely to represent")
@pytest.mark.parametrize("kind", ["synthetic", "other series", "enhanced", "phantom"])
def test_spliced_plan_equals_full_path(
    pinned_clock: datetime.datetime, tmp_path: Path, kind: str
) -> None:
    """The first plan of a key comes from highdicom's document and keeps the template; the
    next ones (another series, patient, source layout) are spliced from it: same bytes."""
    volume = {
        "synthetic": _synthetic,
        "other series": lambda: assemble_from_datasets(
            synthetic_datasets(PhantomGeometry(rows=48, columns=40, slices=5), seed=3)
        ),
        "enhanced": lambda: _enhanced(tmp_path),
        "phantom": _phantom,
    }[kind]()
    labels = _labels(volume, PRESENT[3])
    stats = segment_statistics(volume, labels, MANIFEST)
    sr_encode._TEMPLATES.clear()
    first = _plan(_synthetic(), uids=ResultUIDs.new())  # full path, keeps the template
    assert len(sr_encode._TEMPLATES) == 1
    uids = ResultUIDs.new()
    with mock.patch.object(SrPlan, "_from_model", side_effect=AssertionError("full path")):
        spliced = _plan(volume, uids=uids)
    sr_encode._TEMPLATES.clear()
    full = _plan(volume, uids=uids)
    data = spliced.encode(stats, now=NOW)
    assert data == full.encode(stats, now=NOW) == _reference_for(volume, labels, uids)
    assert first.encode(stats, now=NOW) != data


def test_jobs_the_template_does_not_cover_take_the_full_path(
    pinned_clock: datetime.datetime,
) -> None:
    volume = _synthetic()
    labels = _labels(volume, PRESENT[5])
    stats = segment_statistics(volume, labels, MANIFEST)
    _plan(volume, uids=ResultUIDs.new())
    uids = ResultUIDs.new()
    with mock.patch.object(sr_encode, "_evidence", return_value=None):
        plan = _plan(volume, uids=uids)
    assert plan.encode(stats, now=NOW) == _reference_for(volume, labels, uids)


def _evidence_datasets(study: str, series: list[str], sop_class: str) -> list[pydicom.Dataset]:
    out = []
    for i, uid in enumerate(series):
        ds = pydicom.Dataset()
        ds.StudyInstanceUID, ds.SeriesInstanceUID = study, uid
        ds.SOPClassUID, ds.SOPInstanceUID = sop_class, f"1.2.3.4.{i % 4}.{i}"
        out.append(ds)
    return out


@pytest.mark.filterwarnings("ignore:Invalid value for VR UI")
def test_evidence_bytes_equal_highdicom_collect_evidence() -> None:
    """Several series in one study (interleaved), a duplicate instance, odd and even UID
    lengths; another study or a UID pydicom would have to clean up: not encoded here."""
    ct = "1.2.840.10008.5.1.4.1.1.2"
    evidence = _evidence_datasets("1.2.3", ["1.2.3.1", "1.2.3.22", "1.2.3.1", "1.2.3.22"], ct)
    evidence.append(evidence[1])
    content = pydicom.Dataset()
    content.ContentSequence = []
    items, other = hd.sr.utils.collect_evidence(evidence, content, "1.2.3")
    assert not other
    reference = pydicom.Dataset()
    reference.CurrentRequestedProcedureEvidenceSequence = items
    expected = sr_encode._element_bytes(
        reference["CurrentRequestedProcedureEvidenceSequence"], "iso8859"
    )
    assert sr_encode._evidence(evidence, "1.2.3") == expected
    assert sr_encode._evidence(evidence, "1.2.4") is None
    evidence[0].SOPInstanceUID = "1.2.3.4.0.x"
    assert sr_encode._evidence(evidence, "1.2.3") is None
