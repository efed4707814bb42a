"""The Storage SCP in-process on a real loopback socket, driven by a pynetdicom SCU.

Covers the handler contract: write + record before success, duplicates, the non-CT policy,
the loop guard, unparseable and truncated data, disk errors (0xA700), AE allow-list, and
completion on association release (including a series split over two associations).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from pydicom import dcmread
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian, generate_uid
from pynetdicom import AE
from pynetdicom import _config as pynetdicom_config
from pynetdicom.sop_class import (  # type: ignore[attr-defined]
    CTImageStorage,
    RTDoseStorage,
    SegmentationStorage,
    Verification,
)
from sqlalchemy import select

from segnode.node.config import from_dict
from segnode.node.ingest.scp import StoreSCP
from segnode.node.ingest.series import CompletionLoop
from segnode.storage.ledger import Ledger
from segnode.storage.models import Event
from segnode.storage.spool import Spool
from tests.conftest import LOOPBACK, wait_for
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.scp_harness import settle_rejection


class Harness:
    """A StoreSCP on an ephemeral port with a completion log."""

    def __init__(self, tmp: Path, **node: object) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "model.json").write_text("{}")  # the SCP never loads the model
        cfg = from_dict(
            {
                "node": {"host": LOOPBACK, "port": 11112, **node},
                "model": {"manifest": str(tmp / "model.json")},
            }
        )
        self.config = replace(cfg, node=replace(cfg.node, port=0), data_dir=tmp)
        self.ledger = Ledger(tmp / "ledger.sqlite")
        self.spool = Spool(tmp / "spool")
        self.completed: list[tuple[str, str]] = []
        self.tracker = CompletionLoop(lambda s, t: self.completed.append((s, t)))
        self.scp = StoreSCP(self.config, self.ledger, self.spool, self.tracker)
        self.scp.start()

    def assoc(
        self, calling: str = "MODALITY", contexts: list[tuple[str, str]] | None = None
    ) -> object:
        ae = AE(ae_title=calling)
        for cls, ts in contexts or [(CTImageStorage, ExplicitVRLittleEndian)]:
            ae.add_requested_context(cls, ts)
        ae.add_requested_context(Verification)
        a = settle_rejection(ae.associate(LOOPBACK, self.scp.port, ae_title="SEGNODE"))
        return a

    def settle(self, still_open: int = 0) -> None:
        """Wait until only ``still_open`` associations are left and the completion thread
        has handled the others' ends."""
        server = self.scp.server
        assert server is not None
        wait_for(lambda: server.active_associations <= still_open, 10, "associations ended")
        self.tracker.flush()

    def close(self) -> None:
        self.scp.stop()
        self.tracker.stop()
        self.ledger.close()


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path / "node")
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def series(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("series")
    return write_synthetic_series(out, PhantomGeometry(rows=64, columns=64, slices=6))


def send(assoc: object, path_or_ds: Path | Dataset) -> int:
    if isinstance(path_or_ds, Dataset) and "TransferSyntaxUID" not in getattr(
        path_or_ds, "file_meta", {}
    ):
        path_or_ds.file_meta = FileMetaDataset()
        ts = ExplicitVRLittleEndian if "Manufacturer" in path_or_ds else ImplicitVRLittleEndian
        path_or_ds.file_meta.TransferSyntaxUID = ts
    status = assoc.send_c_store(path_or_ds)  # type: ignore[attr-defined]
    return int(status.Status) if status else -1


def send_header(h: Harness, sop_class: str, transfer_syntax: str, **elements: str) -> None:
    """Send one instance of ``sop_class`` (new UIDs, ``elements``, no pixel data) in its own
    association; it must be acknowledged with success."""
    ds = Dataset()
    ds.SOPClassUID = sop_class
    ds.SOPInstanceUID = generate_uid()
    ds.StudyInstanceUID = generate_uid()
    ds.SeriesInstanceUID = generate_uid()
    for keyword, value in elements.items():
        setattr(ds, keyword, value)
    a = h.assoc(contexts=[(sop_class, transfer_syntax)])
    assert send(a, ds) == 0
    a.release()  # type: ignore[attr-defined]


def test_echo_and_store_series_completes_on_release(h: Harness, series: list[Path]) -> None:
    a = h.assoc()
    assert a.is_established  # type: ignore[attr-defined]
    assert int(a.send_c_echo().Status) == 0  # type: ignore[attr-defined]
    for p in series:
        assert send(a, p) == 0
    uid = str(dcmread(series[0]).SeriesInstanceUID)
    assert h.completed == []  # not complete while the association is open
    a.release()  # type: ignore[attr-defined]
    h.settle()
    assert h.completed == [(uid, "association-release")]
    paths = h.ledger.instance_paths(uid)
    assert len(paths) == len(series)
    # Stored bytes are the sent dataset, as a valid Part 10 file.
    stored = dcmread(paths[0])
    assert stored.SOPInstanceUID == dcmread(series[0]).SOPInstanceUID
    assert stored.PixelData == dcmread(series[0]).PixelData


def test_duplicate_acknowledged_once(h: Harness, series: list[Path]) -> None:
    a = h.assoc()
    assert send(a, series[0]) == 0
    assert send(a, series[0]) == 0
    a.release()  # type: ignore[attr-defined]
    assert h.ledger.counts()["instances"] == 1


def test_a_resend_with_other_content_is_kept_out_but_reported(
    h: Harness, series: list[Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same SOP Instance UID with other content (a corrected resend) is acknowledged and
    the stored copy kept, as for any duplicate, but the difference is a warning and an event,
    not passed over; an identical resend is neither."""
    changed = dcmread(series[0])
    changed.InstanceNumber = 999
    changed.ImageComments = "corrected after the first send"
    other = tmp_path / "changed.dcm"
    changed.save_as(other, enforce_file_format=True)
    a = h.assoc()
    assert send(a, series[0]) == 0
    with caplog.at_level("WARNING"):
        assert send(a, series[0]) == 0  # identical
        assert not [r for r in caplog.records if "other content" in r.getMessage()]
        assert send(a, other) == 0
    a.release()  # type: ignore[attr-defined]
    assert h.ledger.counts()["instances"] == 1
    stored = dcmread(h.ledger.instance_paths(str(changed.SeriesInstanceUID))[0])
    assert "ImageComments" not in stored  # the first copy is kept
    warned = [r.getMessage() for r in caplog.records if "other content" in r.getMessage()]
    assert len(warned) == 1 and str(changed.SOPInstanceUID) in warned[0]
    assert "send a corrected instance with a new SOP Instance UID" in warned[0]
    with h.ledger._read() as s:
        kinds = list(s.scalars(select(Event.kind).where(Event.kind == "duplicate-differs")))
    assert len(kinds) == 1


def test_split_over_two_associations(h: Harness, series: list[Path]) -> None:
    uid = str(dcmread(series[0]).SeriesInstanceUID)
    a, b = h.assoc(), h.assoc()
    for p in series[:3]:
        assert send(a, p) == 0
    for p in series[3:]:
        assert send(b, p) == 0
    a.release()  # type: ignore[attr-defined]
    h.settle(still_open=1)
    assert h.completed == []  # b is still sending the same series
    b.release()  # type: ignore[attr-defined]
    h.settle()
    assert h.completed == [(uid, "association-release")]


def test_abort_does_not_complete(h: Harness, series: list[Path]) -> None:
    a = h.assoc()
    assert send(a, series[0]) == 0
    a.abort()  # type: ignore[attr-defined]
    h.settle()
    assert h.completed == []
    assert h.ledger.pending_series() == [str(dcmread(series[0]).SeriesInstanceUID)]


def test_non_ct_accepted_and_ignored(h: Harness) -> None:
    send_header(h, RTDoseStorage, ImplicitVRLittleEndian, Modality="RTDOSE")
    assert h.ledger.counts()["instances"] == 0
    h.settle()
    assert h.completed == []
    (row,) = h.ledger.ignored_series()
    assert "not CT" in row[2]


def test_non_ct_rejected_at_negotiation(tmp_path: Path) -> None:
    h = Harness(tmp_path, other_sop_classes="reject")
    try:
        a = h.assoc(contexts=[(RTDoseStorage, ImplicitVRLittleEndian)])
        # The association is accepted for Verification but the RT Dose context is refused.
        accepted = [cx.abstract_syntax for cx in a.accepted_contexts]  # type: ignore[attr-defined]
        assert RTDoseStorage not in accepted
        a.release()  # type: ignore[attr-defined]
    finally:
        h.close()


def test_loop_guard_ignores_own_seg(h: Harness) -> None:
    send_header(
        h, SegmentationStorage, ExplicitVRLittleEndian, Modality="SEG", Manufacturer="segnode"
    )
    (row,) = h.ledger.ignored_series()
    assert "loop guard" in row[2]


def test_truncated_refused_and_node_keeps_serving(
    h: Harness, series: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Send the file's bytes as they are (no re-encoding by the SCU), like a broken modality.
    monkeypatch.setattr(pynetdicom_config, "STORE_SEND_CHUNKED_DATASET", True)
    data = series[0].read_bytes()
    bad = tmp_path / "truncated.dcm"
    bad.write_bytes(data[: len(data) - 5000])
    a = h.assoc()
    assert 0xC000 <= send(a, bad) <= 0xCFFF
    a.release()  # type: ignore[attr-defined]
    garbage = tmp_path / "garbage.dcm"
    # A valid file meta followed by garbage bytes as the dataset.
    head = data[: 132 + 12 + int.from_bytes(data[140:144], "little")]
    garbage.write_bytes(head + b"\x08\x00\x18\x00UI\xff\x7f" + b"\x00" * 40)
    a = h.assoc()
    assert 0xC000 <= send(a, garbage) <= 0xCFFF
    a.release()  # type: ignore[attr-defined]
    assert h.ledger.counts()["instances"] == 0
    b = h.assoc()
    assert send(b, series[1]) == 0
    b.release()  # type: ignore[attr-defined]
    assert h.ledger.counts()["instances"] == 1


def test_disk_error_answers_a700(h: Harness, series: list[Path]) -> None:
    ds = dcmread(series[0])
    (h.spool.root / str(ds.StudyInstanceUID)).write_text("not a folder")
    a = h.assoc()
    assert send(a, series[0]) == 0xA700
    a.release()  # type: ignore[attr-defined]
    assert h.ledger.counts()["instances"] == 0


def test_calling_ae_allow_list(tmp_path: Path, series: list[Path]) -> None:
    h = Harness(tmp_path, allowed_calling_aes=["CT_SCANNER"])
    try:
        a = h.assoc(calling="STRANGER")
        assert a.is_rejected  # type: ignore[attr-defined]
        b = h.assoc(calling="CT_SCANNER")
        assert b.is_established  # type: ignore[attr-defined]
        assert send(b, series[0]) == 0
        b.release()  # type: ignore[attr-defined]
    finally:
        h.close()
