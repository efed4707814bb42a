"""The Upper Layer acceptor (node/dicom/ul.py) and the staged spool write, over real loopback
sockets.

Covers what the C-STORE path relies on beyond the SCP tests: the advertised maximum PDU
length, datasets fragmented over many PDUs stored byte for byte, responses split to the
peer's maximum PDU, Error Comment on failures, unrecognised DIMSE operations, rejection of a
foreign application context, aborts on protocol violations and silence, the hand-encoded
File Meta Information, and the crash clean-up of staged files and unacknowledged rows.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sqlite3
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydicom import dcmread
from pydicom.dataset import FileMetaDataset
from pydicom.uid import UID, ExplicitVRLittleEndian
from pynetdicom import AE
from pynetdicom.dsutils import encode_file_meta
from pynetdicom.pdu import A_ASSOCIATE_RQ
from pynetdicom.pdu_primitives import A_ASSOCIATE, MaximumLengthNotification
from pynetdicom.presentation import build_context
from pynetdicom.sop_class import CTImageStorage, Verification  # type: ignore[attr-defined]

from segnode.node.dicom.header import parse_header
from segnode.node.dicom.ul import (
    IMPLEMENTATION_CLASS_UID,
    IMPLEMENTATION_VERSION,
    AssociationInfo,
    StoreOutcome,
    StoreRequest,
    _Association,
    decode_command,
    encode_command,
    pdata_pdus,
)
from segnode.node.ingest.scp import file_meta
from segnode.node.ingest.streaming import Arrival
from segnode.storage.ledger import InstanceRecord, Ledger
from segnode.storage.spool import Spool, SpoolError, Staged, StagingFile, _after
from tests.conftest import LOOPBACK
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.scp_harness import SCPHarness, store


@pytest.fixture()
def h(tmp_path: Path) -> Iterator[SCPHarness]:
    harness = SCPHarness(tmp_path / "node", {"node": {"max_pdu": 4096}})
    try:
        yield harness
    finally:
        harness.close()


@pytest.fixture(scope="module")
def ct(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_synthetic_series(
        tmp_path_factory.mktemp("ul"), PhantomGeometry(rows=64, columns=64, slices=3), seed=7301
    )


def recv_pdu(s: socket.socket) -> tuple[int, bytes]:
    head = b""
    while len(head) < 6:
        chunk = s.recv(6 - len(head))
        if not chunk:
            return -1, b""
        head += chunk
    kind, _, length = struct.unpack(">BBI", head)
    body = b""
    while len(body) < length:
        chunk = s.recv(length - len(body))
        if not chunk:
            break
        body += chunk
    return kind, body


def associate_rq(
    app_context: str = "1.2.840.10008.3.1.1.1",
    abstract: str = str(CTImageStorage),
    syntax: str = ExplicitVRLittleEndian,
    called: str = "SEGNODE",
) -> bytes:
    """An A-ASSOCIATE-RQ PDU with one presentation context (ID 1) and a 16 kB max PDU."""
    rq = A_ASSOCIATE()
    rq.application_context_name = UID(app_context)
    rq.calling_ae_title = "RAW"
    rq.called_ae_title = called
    cx = build_context(abstract, syntax)
    cx.context_id = 1
    rq.presentation_context_definition_list = [cx]
    ml = MaximumLengthNotification()
    ml.maximum_length_received = 16384
    rq.user_information = [ml]
    pdu = A_ASSOCIATE_RQ()
    pdu.from_primitive(rq)
    return bytes(pdu.encode())


def test_max_pdu_is_advertised_and_fragmented_datasets_are_stored_exactly(
    h: SCPHarness, ct: list[Path]
) -> None:
    ae = AE(ae_title="MODALITY")
    ae.maximum_pdu_size = 1024  # the node's responses must fit this
    ae.add_requested_context(CTImageStorage, ExplicitVRLittleEndian)
    a = ae.associate(LOOPBACK, h.port, ae_title="SEGNODE")
    assert a.is_established
    assert a.acceptor.maximum_length == 4096
    assert a.acceptor.implementation_class_uid == IMPLEMENTATION_CLASS_UID
    assert a.acceptor.implementation_version_name == IMPLEMENTATION_VERSION
    for p in ct:
        assert store(a, p) == 0  # 64x64x2 bytes of pixels: several 4 kB PDUs each
    a.release()
    assert a.is_released
    for p in ct:
        sent = dcmread(p)
        (row,) = [r for r in h.spool.root.rglob(f"{sent.SOPInstanceUID}.dcm")]
        kept = dcmread(row)
        assert kept.PixelData == sent.PixelData
        assert kept.file_meta.SourceApplicationEntityTitle == "MODALITY"
        assert kept.file_meta.TransferSyntaxUID == ExplicitVRLittleEndian
    assert not list(h.spool.incoming_dir.iterdir())


def test_failure_status_carries_an_error_comment(h: SCPHarness, ct: list[Path]) -> None:
    ds = dcmread(ct[0])
    del ds.SeriesInstanceUID
    ae = AE(ae_title="MODALITY")
    ae.add_requested_context(CTImageStorage, ExplicitVRLittleEndian)
    a = ae.associate(LOOPBACK, h.port, ae_title="SEGNODE")
    status = a.send_c_store(ds)
    a.release()
    assert int(status.Status) == 0xC212
    assert "Series Instance UID" in str(status.ErrorComment)
    assert h.ledger.counts()["instances"] == 0
    assert not list(h.spool.incoming_dir.iterdir())  # the staged write was discarded


def test_unsupported_operation_gets_0211(h: SCPHarness) -> None:
    with socket.create_connection((LOOPBACK, h.port), timeout=5) as s:
        s.sendall(associate_rq(abstract=str(Verification)))
        assert recv_pdu(s)[0] == 0x02
        # A C-FIND-RQ (command field 0x0020) on the Verification context.
        cmd = encode_command(
            [
                (0x0002, str(Verification).encode()),
                (0x0100, struct.pack("<H", 0x0020)),
                (0x0110, struct.pack("<H", 7)),
                (0x0800, struct.pack("<H", 0x0101)),
            ]
        )
        s.sendall(pdata_pdus(1, cmd, 0)[0])
        kind, body = recv_pdu(s)
        assert kind == 0x04
        rsp = decode_command(body[6:])
        s.sendall(struct.pack(">BBII", 0x05, 0, 4, 0))  # A-RELEASE-RQ
        assert recv_pdu(s)[0] == 0x06
    assert struct.unpack("<H", rsp[0x0100])[0] == 0x8020
    assert struct.unpack("<H", rsp[0x0120])[0] == 7
    assert struct.unpack("<H", rsp[0x0900])[0] == 0x0211


def test_foreign_application_context_is_rejected(h: SCPHarness) -> None:
    with socket.create_connection((LOOPBACK, h.port), timeout=5) as s:
        s.sendall(associate_rq("1.2.3.4"))
        kind, body = recv_pdu(s)
    assert kind == 0x03  # A-ASSOCIATE-RJ
    assert tuple(body[1:4]) == (0x01, 0x01, 0x02)  # permanent, user, context not supported


def test_pdv_on_unaccepted_context_aborts_and_node_keeps_serving(
    h: SCPHarness, ct: list[Path]
) -> None:
    with socket.create_connection((LOOPBACK, h.port), timeout=5) as s:
        s.sendall(associate_rq())
        kind, _ = recv_pdu(s)
        assert kind == 0x02  # A-ASSOCIATE-AC
        s.sendall(pdata_pdus(99, b"\x00" * 8, 0)[0])
        kind, body = recv_pdu(s)
    assert kind == 0x07 and body[2] == 0x02  # A-ABORT from the service provider
    a = h.assoc()
    assert store(a, ct[0]) == 0
    a.release()


def test_silence_after_association_is_aborted(tmp_path: Path) -> None:
    h = SCPHarness(tmp_path / "n", {"node": {"network_timeout_s": 1}})
    try:
        with socket.create_connection((LOOPBACK, h.port), timeout=10) as s:
            s.sendall(associate_rq())
            assert recv_pdu(s)[0] == 0x02
            t0 = time.monotonic()
            kind, _ = recv_pdu(s)
            waited = time.monotonic() - t0
        assert kind == 0x07
        assert 0.8 < waited < 5
    finally:
        h.close()


def test_response_is_split_to_the_peers_maximum_pdu() -> None:
    cmd = encode_command([(0x0100, struct.pack("<H", 0x8001)), (0x1000, b"1.2.3" * 20)])
    pdus = pdata_pdus(3, cmd, 64)
    assert len(pdus) > 1 and all(len(p) <= 64 + 6 for p in pdus)
    payload = b""
    for i, p in enumerate(pdus):
        kind, _, length = struct.unpack(">BBI", p[:6])
        pdv_len, cx, control = struct.unpack(">IBB", p[6:12])
        assert (kind, cx, length) == (0x04, 3, len(p) - 6)
        assert control == (0x03 if i == len(pdus) - 1 else 0x01)
        payload += p[12 : 6 + 4 + pdv_len]
    assert decode_command(payload)[0x0100] == struct.pack("<H", 0x8001)


@pytest.mark.parametrize("calling", ["STORESCU", "ABC", ""])
def test_file_meta_matches_pydicom(calling: str) -> None:
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = UID(str(CTImageStorage))
    meta.MediaStorageSOPInstanceUID = UID("1.2.3.45")
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    meta.ImplementationClassUID = UID(IMPLEMENTATION_CLASS_UID)
    meta.ImplementationVersionName = IMPLEMENTATION_VERSION
    if calling:
        meta.SourceApplicationEntityTitle = calling
    expected = b"\x00" * 128 + b"DICM" + encode_file_meta(meta)
    assert file_meta(str(CTImageStorage), "1.2.3.45", ExplicitVRLittleEndian, calling) == expected


def test_parse_header_reads_a_memoryview_like_bytes(ct: list[Path]) -> None:
    raw = ct[0].read_bytes()
    ds = dcmread(ct[0])
    offset = 132 + 12 + int(ds.file_meta.FileMetaInformationGroupLength)
    data = raw[offset:]
    a = parse_header(data, ExplicitVRLittleEndian)
    b = parse_header(memoryview(bytearray(data)), ExplicitVRLittleEndian)
    assert a.has_pixel_data and b.has_pixel_data
    assert a.dataset.SOPInstanceUID == b.dataset.SOPInstanceUID == ds.SOPInstanceUID


def test_restart_clears_staged_files_and_unacknowledged_rows(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    ledger = Ledger(tmp_path / "ledger.sqlite")
    try:
        staged = spool.stage([b"abc", memoryview(b"def")])
        assert staged.path.read_bytes() == b"abcdef" and staged.size == 6
        kept, size = spool.store("1.2", "1.3", "1.4", [b"kept"])
        assert kept.read_bytes() == b"kept" and size == 4

        def rec(sop: str) -> InstanceRecord:
            return InstanceRecord(
                sop, str(CTImageStorage), "1.3", "1.2", ExplicitVRLittleEndian, "CT", "MODALITY"
            )

        assert ledger.record_instance(rec("1.4"), kept, 4)
        # A row committed whose rename never persisted (crash between the two fsyncs).
        assert ledger.record_instance(rec("1.5"), spool.path_for("1.2", "1.3", "1.5"), 9)
        assert ledger.counts()["instances"] == 2
        assert ledger.drop_unstored_instances() == 1
        assert ledger.has_instance("1.4") and not ledger.has_instance("1.5")
        assert spool.clear_incoming() == 1
        assert not staged.path.exists() and kept.exists()
    finally:
        ledger.close()


def test_bigger_instances_than_a_pdu_fragment_round_trip(tmp_path: Path) -> None:
    """A dataset split over dozens of PDVs reaches the handler whole (no-op check)."""
    h = SCPHarness(tmp_path / "n", {"node": {"max_pdu": 16384}})
    try:
        (path,) = write_synthetic_series(
            tmp_path / "big", PhantomGeometry(rows=256, columns=256, slices=1), seed=7302
        )
        ds = dcmread(path)
        a = h.assoc()
        assert store(a, ds) == 0
        a.release()
        (kept,) = list(h.spool.root.rglob(f"{ds.SOPInstanceUID}.dcm"))
        assert dcmread(kept).PixelData == ds.PixelData
    finally:
        h.close()


def test_an_instance_in_flight_is_claimed_by_one_association(h: SCPHarness) -> None:
    assert h.scp._try_claim("1.2.3.4")
    assert not h.scp._try_claim("1.2.3.4")  # held: another association is refused
    assert h.scp._try_claim("1.2.3.5")
    h.scp._release("1.2.3.4")
    assert h.scp._try_claim("1.2.3.4")  # free again once released
    h.scp._release("1.2.3.4")
    h.scp._release("1.2.3.5")


@pytest.mark.parametrize(("signed", "bits_stored"), [(0, 12), (1, 12), (0, 16), (1, 16), (1, 10)])
def test_native_pixels_match_pydicom(tmp_path: Path, signed: int, bits_stored: int) -> None:
    """The streaming decoder's shortcut gives pydicom's values, garbage in unused bits too."""
    import numpy as np

    from segnode.node.ingest.streaming import Arrival, native_pixels

    (path,) = write_synthetic_series(
        tmp_path, PhantomGeometry(rows=32, columns=24, slices=1), seed=7303
    )
    ds = dcmread(path)
    rng = np.random.default_rng(bits_stored + signed)
    raw = rng.integers(0, 2**16, size=(32, 24), dtype=np.uint16)  # unused bits set at random
    ds.PixelRepresentation = signed
    ds.BitsStored = bits_stored
    ds.HighBit = bits_stored - 1
    ds.PixelData = raw.astype("<u2").tobytes()
    arrival = Arrival(
        "1.2",
        "1.3",
        path,
        "X",
        header=ds,
        pixels=ds.PixelData,
        transfer_syntax=ExplicitVRLittleEndian,
    )
    fast = native_pixels(ds, arrival)
    assert fast is not None
    ref = ds.pixel_array
    assert fast.dtype == ref.dtype and np.array_equal(fast, ref)


def test_streaming_hand_off_follows_the_response_and_cannot_break_it(
    h: SCPHarness, ct: list[Path]
) -> None:
    """The decoder hears of a stored instance after its response was sent; an error there
    is logged and neither the status nor the association suffers."""
    seen: list[str] = []
    events: list[str] = []
    original_send = _Association._send

    def on_instance(arrival: Arrival) -> None:
        seen.append(arrival.sop_uid)
        events.append("hand-off")
        raise RuntimeError("decoder broke")

    def send(self: _Association, data: bytes) -> None:
        original_send(self, data)
        events.append("send")

    h.scp.on_instance = on_instance
    _Association._send = send  # type: ignore[method-assign]
    try:
        a = h.assoc()
        for p in ct:
            assert store(a, p) == 0
        a.release()
    finally:
        _Association._send = original_send  # type: ignore[method-assign]
    assert seen == [str(dcmread(p, stop_before_pixels=True).SOPInstanceUID) for p in ct]
    # The k-th hand-off comes after the k-th C-STORE response (sends: A-ASSOCIATE-AC, then
    # one response per instance, then A-RELEASE-RP).
    handoffs = [i for i, e in enumerate(events) if e == "hand-off"]
    for k, at in enumerate(handoffs, start=1):
        assert events[:at].count("send") >= 1 + k
    assert h.ledger.counts()["instances"] == len(ct)


def test_store_outcome_follow_ups_run_after_the_response_preopen_first(
    h: SCPHarness, ct: list[Path]
) -> None:
    """The handler returns its follow-ups in a :class:`StoreOutcome` (it mutates nothing
    shared); the association's thread runs them once the response is sent, in order: the
    next staging file first, then the hand-off; one that fails does not stop the next."""
    events: list[str] = []
    original_send = _Association._send

    def send(self: _Association, data: bytes) -> None:
        original_send(self, data)
        events.append("send")

    def preopen(_info: AssociationInfo) -> None:
        events.append("preopen")
        raise RuntimeError("spool gone")

    h.scp._preopen = preopen  # type: ignore[method-assign]
    h.scp._stored = lambda _arrival, _info: events.append("stored")  # type: ignore[method-assign]
    _Association._send = send  # type: ignore[method-assign]
    try:
        a = h.assoc()
        for p in ct[:2]:
            assert store(a, p) == 0
        a.release()
    finally:
        _Association._send = original_send  # type: ignore[method-assign]
    # A-ASSOCIATE-AC, then per instance: its response, then its two follow-ups.
    assert events[:7] == ["send", "send", "preopen", "stored", "send", "preopen", "stored"]
    assert not hasattr(AssociationInfo("A", "B", "h", 1), "after_reply")


def test_store_returns_a_typed_outcome(h: SCPHarness, ct: list[Path]) -> None:
    info = AssociationInfo("MODALITY", "SEGNODE", LOOPBACK, 1)
    ds = dcmread(ct[0])
    request = StoreRequest(
        str(ds.SOPClassUID), "not a uid", str(ExplicitVRLittleEndian), 1, 0, "", b""
    )
    refused = h.scp.store(info, request)
    assert isinstance(refused, StoreOutcome)
    assert (refused.status, refused.after) == (0xC211, ())
    assert refused.comment == "invalid Affected SOP Instance UID"


def test_staged_file_is_written_and_synced_in_one_call(tmp_path: Path) -> None:
    """The C-STORE path's staged file: opened with O_DSYNC (the write returns only when the
    data is on disk), all chunks in one writev, removed when the write fails."""
    spool = Spool(tmp_path / "spool")
    staging = spool.open_staged()
    assert fcntl.fcntl(staging._fd, fcntl.F_GETFL) & os.O_DSYNC
    staged = staging.write_synced([b"DICM", memoryview(bytearray(b"-data-"))[1:5]])
    assert staged.path.read_bytes() == b"DICMdata" and staged.size == 8
    failing = spool.open_staged()
    # A read-only descriptor in its place (not its own closed: a number another thread's
    # new file may take): the write fails with EBADF.
    own, failing._fd = failing._fd, os.open(os.devnull, os.O_RDONLY)
    with pytest.raises(SpoolError, match="cannot write to the spool"):
        failing.write_synced([b"x"])
    os.close(own)
    assert not failing.path.exists()


def test_short_write_remainder() -> None:
    views = [memoryview(b"abc"), memoryview(b"defg"), memoryview(b"h")]
    assert [bytes(v) for v in _after(views, 0)] == [b"abc", b"defg", b"h"]
    assert [bytes(v) for v in _after(views, 4)] == [b"efg", b"h"]
    assert [bytes(v) for v in _after(views, 7)] == [b"h"]
    assert _after(views, 8) == []


def _incoming(h: SCPHarness, want: int) -> list[Path]:
    deadline = time.monotonic() + 5
    while True:
        files = sorted((h.spool.root / ".incoming").iterdir())
        if len(files) == want or time.monotonic() > deadline:
            return files
        time.sleep(0.01)


def test_next_staged_file_is_created_after_the_response(h: SCPHarness, ct: list[Path]) -> None:
    """After each CT response the association's next staged file is opened (off the next
    instance's path); the next instance is written into it, and the release removes the
    one left over."""
    a = h.assoc()
    assert store(a, ct[0]) == 0
    (ready,) = _incoming(h, 1)
    assert ready.stat().st_size == 0
    assert store(a, ct[1]) == 0
    (again,) = _incoming(h, 1)
    assert again != ready and not ready.exists()  # the first was used (and renamed)
    sop = str(dcmread(ct[1], stop_before_pixels=True).SOPInstanceUID)
    (kept,) = h.spool.root.rglob(f"{sop}.dcm")
    assert dcmread(kept).PixelData == dcmread(ct[1]).PixelData
    a.release()
    assert _incoming(h, 0) == []
    assert h.ledger.counts()["instances"] == 2


def refused_without_a_trace_then_stored(h: SCPHarness, path: Path) -> None:
    """The first C-STORE of ``path`` is refused (0xA700) leaving neither row nor file; the
    sender's retry is stored."""
    a = h.assoc()
    assert store(a, path) == 0xA700
    assert h.ledger.counts()["instances"] == 0
    assert not list(h.spool.root.rglob("*.dcm"))
    assert store(a, path) == 0  # the sender's retry
    a.release()
    assert h.ledger.counts()["instances"] == 1
    assert len(list(h.spool.root.rglob("*.dcm"))) == 1


def test_a_failed_write_takes_back_the_row_committed_beside_it(
    h: SCPHarness, ct: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger row is committed while the file is written: when the write fails, the
    answer is 0xA700, the row is gone, no file is kept, and the retry is stored."""
    from segnode.storage import spool as spool_module

    real = spool_module.StagingFile.write_synced
    calls: list[int] = []

    def failing(self: spool_module.StagingFile, chunks: list[bytes]) -> spool_module.Staged:
        calls.append(1)
        if len(calls) == 1:
            # A read-only descriptor in its place: the write fails with EBADF and the file is
            # removed. (Closing the file's own descriptor instead let another thread's new
            # file, the ledger's, take its number, and the failing write then hit that.)
            own, self._fd = self._fd, os.open(os.devnull, os.O_RDONLY)
            try:
                return real(self, chunks)
            finally:
                os.close(own)
        return real(self, chunks)

    monkeypatch.setattr(spool_module.StagingFile, "write_synced", failing)
    refused_without_a_trace_then_stored(h, ct[0])


def test_a_failed_folder_sync_removes_the_renamed_file(
    h: SCPHarness, ct: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is renamed into the spool, then its folder's sync fails (EMFILE, EIO): the
    answer is 0xA700 and neither the file nor its row stays. A file left behind was taken in
    at the next start as an acknowledged instance whose row was lost."""
    real = Spool.sync_folder
    calls: list[int] = []

    def failing(path: Path, staged: Any = None) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise SpoolError(f"cannot sync {path.parent.name}: Too many open files")
        real(path, staged)

    monkeypatch.setattr(Spool, "sync_folder", staticmethod(failing))
    refused_without_a_trace_then_stored(h, ct[0])


def test_a_row_left_by_a_refusal_is_not_taken_for_a_stored_copy(
    h: SCPHarness, ct: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Disk full: the spool write fails, and so does the removal of the row committed beside
    it. The answer is 0xA700, and the resend is stored, not acknowledged as a duplicate of a
    file that does not exist (it was answered 0x0000 and never stored, restarts included)."""
    real_write = StagingFile.write_synced
    writes: list[int] = []

    def full_once(self: StagingFile, chunks: list[bytes]) -> Staged:
        writes.append(1)
        if len(writes) == 1:
            raise SpoolError("cannot write to the spool: No space left on device")
        return real_write(self, chunks)

    def ledger_full(_sop_uid: str) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(StagingFile, "write_synced", full_once)
    monkeypatch.setattr(h.ledger, "forget_instance", ledger_full)
    a = h.assoc()
    assert store(a, ct[0]) == 0xA700
    sop = str(dcmread(ct[0], stop_before_pixels=True).SOPInstanceUID)
    assert h.ledger.has_instance(sop) and not list(h.spool.root.rglob("*.dcm"))
    assert store(a, ct[0]) == 0  # the resend, once there is room
    a.release()
    (kept,) = h.spool.root.rglob(f"{sop}.dcm")
    assert dcmread(kept).PixelData == dcmread(ct[0]).PixelData
    assert h.ledger.counts()["instances"] == 1
    assert h.ledger.instance_file(sop) == (kept, kept.stat().st_size)


def test_association_ids_are_never_reused() -> None:
    """Handlers key per-association state by ``info.id``; unlike ``id(info)`` it cannot come
    back for a later association once an earlier one's object is freed."""
    from segnode.node.dicom.ul import AssociationInfo

    seen = set()
    for _ in range(1000):
        info = AssociationInfo("A", "B", "127.0.0.1", 1)
        seen.add(info.id)
        del info
    assert len(seen) == 1000
