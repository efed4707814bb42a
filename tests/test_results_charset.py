"""The Specific Character Set of the SEG and SR (segnode.node.results.charset): every source
character set gives results that encode, and the copied names read back as the source's.

Each source is written and read back with pydicom, so its strings are decoded from their
bytes as a received series' are. The SEG is checked on both paths (the worker's SegPlan,
byte for byte equal to highdicom's build_seg) and the SR on both (SrPlan and build_sr).
"""

from __future__ import annotations

import datetime
import io
from collections.abc import Iterator
from typing import Any

import pydicom
import pytest
from pydicom.dataset import Dataset

from segnode.node.ingest.volume import Volume, assemble_from_datasets
from segnode.node.pipeline.worker import encode
from segnode.node.results.build import build_sr, segment_statistics
from segnode.node.results.charset import UTF8, result_character_set
from segnode.node.results.sr_encode import SrPlan
from tests.fixtures.highdicom_clock import highdicom_clock
from tests.fixtures.phantom_model import MANIFEST
from tests.fixtures.synthetic import phantom_labels, synthetic_datasets
from tests.test_results import SMALL, SR_EQUIPMENT, UIDS
from tests.test_seg_encode import KINDS, assert_equal_to_highdicom, reference_seg
from tests.test_seg_encode import prepare as prepare_seg

NOW = datetime.datetime(2026, 12, 4, 3, 4, 5, 678901)
# Yamada^Tarou=山田^太郎 with JIS X 0208 escapes (PS3.5 H.3.1), as the audit's iso2022 case.
JIS_NAME = b"Yamada^Tarou=\x1b$B;3ED\x1b(B^\x1b$BB@O:\x1b(B"

#: (source Specific Character Set, Patient Name: bytes as stored or str for pydicom to
#: encode, Institution Name, the results' Specific Character Set)
CASES: dict[str, tuple[Any, bytes | str, str, Any]] = {
    "iso2022-ir87": (
        ["", "ISO 2022 IR 87"],
        JIS_NAME,
        "Tokyo",
        ["ISO 2022 IR 6", "ISO 2022 IR 87"],
    ),
    "unknown-term": ("ISO_IR 999", b"M\xfcller^X", "Klinik", UTF8),
    "latin1": ("ISO_IR 100", "Müller^Hans", "Universitätsspital", "ISO_IR 100"),
    "default": (None, "Smith^John", "General", None),
    "default-8bit": (None, b"M\xfcller^X", "General", UTF8),
    "extensions-8bit": (["", "ISO 2022 IR 87"], b"M\xfcller^X", "Tokyo", UTF8),
    "single-extension": ("ISO 2022 IR 100", "Müller^Hans", "Zürich", "ISO_IR 100"),
    "korean": (["", "ISO 2022 IR 149"], "Hong^Gildong=洪^吉洞=홍^길동", "Seoul", UTF8),
    "utf8": ("ISO_IR 192", "Müller^Jürgen=山田^太郎", "Zürich ✓", UTF8),
    "gb18030": ("GB18030", "王^小东", "北京", "GB18030"),
}


@pytest.fixture
def pinned_clock() -> Iterator[datetime.datetime]:
    with highdicom_clock(NOW):
        yield NOW


def source_volume(charset: Any, name: bytes | str, institution: str) -> Volume:
    """The small phantom with ``charset``, ``name`` and ``institution``, written and read."""
    datasets = []
    for ds in synthetic_datasets(SMALL):
        if charset is not None:
            ds.SpecificCharacterSet = charset
        elif "SpecificCharacterSet" in ds:
            del ds.SpecificCharacterSet
        ds.PatientName = "X^Y"
        if isinstance(name, bytes):
            ds["PatientName"].value = name
        else:
            ds.PatientName = name
        ds.InstitutionName = institution
        buffer = io.BytesIO()
        pydicom.dcmwrite(buffer, ds, enforce_file_format=True)
        datasets.append(pydicom.dcmread(io.BytesIO(buffer.getvalue())))
    return assemble_from_datasets(datasets)


def assert_copied(result: Dataset, source: Dataset, charset: Any) -> None:
    assert result.get("SpecificCharacterSet") == charset
    assert str(result.PatientName) == str(source.PatientName)
    assert result.PatientID == source.PatientID
    assert "\ufffd" not in str(result.PatientName)


@pytest.mark.filterwarnings("ignore:Unknown encoding")
@pytest.mark.parametrize("case", sorted(CASES))
def test_results_keep_the_decoded_names(case: str, pinned_clock: datetime.datetime) -> None:
    charset, name, institution, expected = CASES[case]
    volume = source_volume(charset, name, institution)
    source = volume.sources[0]
    assert result_character_set(source) == expected
    labels = phantom_labels(*volume.shape[1:], volume.shape[0])
    for kind in KINDS:
        ours = assert_equal_to_highdicom(volume, labels, kind)  # the worker's = build_seg's
        assert_copied(pydicom.dcmread(io.BytesIO(ours.data)), source, expected)
    stats = segment_statistics(volume, labels, MANIFEST)
    plan = SrPlan.prepare(volume, prepare_seg(volume, "BINARY"), equipment=SR_EQUIPMENT)
    written = plan.encode(stats, now=NOW)
    seg = reference_seg(volume, labels)
    assert written == encode(build_sr(volume, labels, MANIFEST, seg, UIDS, equipment=SR_EQUIPMENT))
    assert_copied(pydicom.dcmread(io.BytesIO(written)), source, expected)


def test_japanese_name_keeps_its_bytes(pinned_clock: datetime.datetime) -> None:
    """The ISO 2022 IR 87 name is written with the same escape sequences it came with."""
    volume = source_volume(["", "ISO 2022 IR 87"], JIS_NAME, "Tokyo")
    labels = phantom_labels(*volume.shape[1:], volume.shape[0])
    seg = pydicom.dcmread(io.BytesIO(assert_equal_to_highdicom(volume, labels, "BINARY").data))
    assert str(seg.PatientName) == "Yamada^Tarou=山田^太郎"
    raw = pydicom.dcmread(io.BytesIO(encode(seg)))
    assert raw.get_item("PatientName").value.rstrip(b" ") == JIS_NAME


def test_malformed_demographics_are_left_empty_not_fatal(
    pinned_clock: datetime.datetime, caplog: pytest.LogCaptureFixture
) -> None:
    """A Patient's Sex of ``female`` or a Birth Date ``1970-01-01`` used to fail the whole job
    (highdicom refuses them) with the value in the reason; the results now carry them empty
    (Type 2), on both SEG paths and the SR, and the log names the attribute, not the value."""
    datasets = []
    for ds in synthetic_datasets(SMALL):
        ds.PatientSex = "female"
        ds.PatientBirthDate = "1970-01-01"
        ds.StudyTime = "10h20"
        buffer = io.BytesIO()
        pydicom.dcmwrite(buffer, ds, enforce_file_format=True)
        datasets.append(pydicom.dcmread(io.BytesIO(buffer.getvalue())))
    volume = assemble_from_datasets(datasets)
    labels = phantom_labels(*volume.shape[1:], volume.shape[0])
    caplog.clear()  # writing the test's own files warned of the values
    with caplog.at_level("WARNING"):
        ours = assert_equal_to_highdicom(volume, labels, "BINARY")
    seg = pydicom.dcmread(io.BytesIO(ours.data))
    assert seg.PatientSex == "" and seg.PatientBirthDate == "" and seg.StudyTime == ""
    assert seg.StudyDate == datasets[0].StudyDate  # a valid one is copied
    stats = segment_statistics(volume, labels, MANIFEST)
    plan = SrPlan.prepare(volume, prepare_seg(volume, "BINARY"), equipment=SR_EQUIPMENT)
    with caplog.at_level("WARNING"):
        sr = pydicom.dcmread(io.BytesIO(plan.encode(stats, now=NOW)))
    assert sr.PatientSex == "" and sr.PatientBirthDate == ""
    logged = caplog.text
    assert "PatientSex is not a valid DICOM value" in logged
    assert "female" not in logged and "1970-01-01" not in logged
