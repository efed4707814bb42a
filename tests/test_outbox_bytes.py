"""The outbox sends the stored bytes over a kept-open association (real peers on loopback).

The destination is :class:`WireSCP`, a pynetdicom Storage SCP that keeps the raw P-DATA dataset
bytes of every C-STORE and counts associations, and can end an idle association itself
(A-RELEASE, A-ABORT, or closing the connection); or Orthanc. The dispatcher runs in-process on
a real ledger (the helpers of ``tests/test_outbox.py``).
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
from pydicom import dcmread
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian
from pynetdicom import AE, evt
from pynetdicom.pdu import P_DATA_TF
from pynetdicom.sop_class import (  # type: ignore[attr-defined]
    Comprehensive3DSRStorage,
    SegmentationStorage,
    Verification,
)
from sqlalchemy import select

import segnode.node.outbox.encoding as encoding_module
import segnode.node.outbox.scu as scu_module
from segnode.node.config import ConfigError, from_dict
from segnode.node.outbox.scu import SEND_PDU_BYTES, Dispatcher
from segnode.storage.ledger import Ledger
from segnode.storage.migrations import SchemaError
from segnode.storage.models import SCHEMA_VERSION, Delivery, Result
from tests.conftest import LOOPBACK, ROOT, free_port, require_tool, start_orthanc, wait_for
from tests.test_outbox import encoded_job, events, outbox_config, result_file

V1_LEDGER = Path(__file__).parent / "data" / "ledger-v1.sql"


class WireSCP:
    """A Storage SCP for SEG and SR that keeps what arrived on the wire.

    Parameters
    ----------
    syntaxes
        The transfer syntaxes it accepts.
    """

    def __init__(
        self,
        syntaxes: tuple[str, ...] = (ExplicitVRLittleEndian, ImplicitVRLittleEndian),
        max_pdu: int | None = None,
    ):
        self.received: list[tuple[str, bytes, str]] = []  # (SOP Instance UID, bytes, syntax)
        self.pdata_lengths: list[int] = []  # PDU length of every P-DATA-TF received
        self.associations = 0
        self.ended: list[str] = []  # "released" / "aborted", as seen by the SCP
        self.abort_next_on_reused = False  # abort (no answer) the 1st store of a used assoc
        self._stores: dict[int, int] = {}
        self._lock = threading.Lock()
        ae = AE(ae_title="WIRE")
        if max_pdu is not None:
            ae.maximum_pdu_size = max_pdu
        for cls in (SegmentationStorage, Comprehensive3DSRStorage):
            ae.add_supported_context(cls, list(syntaxes))
        ae.add_supported_context(Verification)
        self._server = ae.start_server(
            (LOOPBACK, 0),
            block=False,
            evt_handlers=[
                (evt.EVT_C_STORE, self._store),
                (evt.EVT_ACCEPTED, self._accepted),
                (evt.EVT_RELEASED, lambda e: self._end("released")),
                (evt.EVT_ABORTED, lambda e: self._end("aborted")),
                (evt.EVT_PDU_RECV, self._pdu),
            ],
        )
        self.port = int(self._server.server_address[1])

    @property
    def peer(self) -> str:
        """``AE@host:port``."""
        return f"WIRE@{LOOPBACK}:{self.port}"

    def _accepted(self, event: evt.Event) -> None:
        with self._lock:
            self.associations += 1

    def _pdu(self, event: evt.Event) -> None:
        if isinstance(event.pdu, P_DATA_TF):
            with self._lock:
                self.pdata_lengths.append(int(event.pdu.pdu_length))

    def _end(self, how: str) -> None:
        with self._lock:
            self.ended.append(how)

    def _store(self, event: evt.Event) -> int:
        key = id(event.assoc)
        with self._lock:
            n = self._stores[key] = self._stores.get(key, 0) + 1
            drop = self.abort_next_on_reused and self.associations == 1 and n == 3
            self.abort_next_on_reused &= not drop
        if drop:
            # The peer gives up the association as our request arrives: no answer.
            event.assoc.abort(block=False)
            return 0x0000
        with self._lock:
            cx = event.context
            raw = event.request.DataSet.getvalue()
            self.received.append(
                (str(event.request.AffectedSOPInstanceUID), raw, str(cx.transfer_syntax))
            )
        return 0x0000

    def open_associations(self) -> list[Any]:
        """The associations now established."""
        return [a for a in self._server.active_associations if a.is_established]

    def end_idle(self, how: str) -> None:
        """End every open association from this side: ``release``, ``abort`` or ``close``
        (the TCP connection, without a PDU)."""
        for assoc in self.open_associations():
            if how == "release":
                assoc.release()
            elif how == "abort":
                assoc.abort()
            else:
                assoc.dul.socket.socket.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        """Stop listening; abort what is open."""
        self._server.shutdown()


def dataset_bytes(file: Path | bytes) -> bytes:
    """The bytes of a Part 10 file after its File Meta Information (PS3.10 §7.1)."""
    data = file if isinstance(file, bytes) else file.read_bytes()
    assert data[128:132] == b"DICM"
    # (0002,0000) File Meta Information Group Length, explicit VR UL: value at 140.
    group_length = int.from_bytes(data[140:144], "little")
    return data[144 + group_length :]


@pytest.fixture
def wire() -> Iterator[WireSCP]:
    scp = WireSCP()
    yield scp
    scp.stop()


def big_seg(path: Path, sop_uid: str, study: str, size: int) -> None:
    """A SEG-class Part 10 file with ``size`` bytes of pixel data (many PDUs)."""
    result_file(
        path,
        SegmentationStorage,
        sop_uid,
        study,
        Rows=512,
        Columns=512,
        NumberOfFrames=size // (512 * 64),
        BitsAllocated=1,
        PixelData=os.urandom(size),
    )


def result_paths(ledger: Ledger, job_id: int) -> list[Path]:
    with ledger._read() as s:
        rows = s.scalars(select(Result.path).where(Result.job_id == job_id).order_by(Result.order))
        return [Path(p) for p in rows]


def run_until_sent(d: Dispatcher, ledger: Ledger, jobs: list[int], timeout: float = 20) -> None:
    wait_for(lambda: all(ledger.job_state(j) == "sent" for j in jobs), timeout, f"{jobs} sent")


def test_wire_bytes_are_the_stored_dataset_bytes(
    tmp_path: Path, ledger: Ledger, wire: WireSCP, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(a) What the destination receives is the file after its meta, byte for byte, with no
    decoding on the way (a dcmread would fail the test)."""
    job_id = encoded_job(ledger, tmp_path, [wire.peer])
    seg, sr = result_paths(ledger, job_id)
    view = ledger.job(job_id)
    assert view is not None
    big_seg(seg, view.seg_sop_uid, dcmread(sr).StudyInstanceUID, 3 * 2**20)

    def no_decoding(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the outbox decoded a result file")

    monkeypatch.setattr(encoding_module, "dcmread", no_decoding)
    monkeypatch.setattr(scu_module, "encode_dataset", no_decoding)
    d = Dispatcher(outbox_config(tmp_path, [wire.peer], keep_open_s=30), ledger)
    assert d.run_once() == 2
    d.stop()
    assert [(uid, ts) for uid, _, ts in wire.received] == [
        (view.seg_sop_uid, ExplicitVRLittleEndian),
        (view.sr_sop_uid, ExplicitVRLittleEndian),
    ]
    assert wire.received[0][1] == dataset_bytes(seg)
    assert wire.received[1][1] == dataset_bytes(sr)
    assert len(wire.received[0][1]) > 3 * 2**20  # many P-DATA-TF PDUs


def test_peer_without_a_pdu_limit_gets_1_mib_pdus(tmp_path: Path, ledger: Ledger) -> None:
    """A destination that takes PDUs of any length (maximum 0) still gets the SEG in PDUs of
    at most SEND_PDU_BYTES (not one PDU of the whole file), and the same bytes."""
    wire = WireSCP(max_pdu=0)
    try:
        job_id = encoded_job(ledger, tmp_path, [wire.peer])
        seg, _ = result_paths(ledger, job_id)
        view = ledger.job(job_id)
        assert view is not None
        big_seg(seg, view.seg_sop_uid, view.study_instance_uid, 3 * 2**20)
        d = Dispatcher(outbox_config(tmp_path, [wire.peer], keep_open_s=0), ledger)
        assert d.run_once() == 2
        d.stop()
        assert wire.received[0][1] == dataset_bytes(seg)
        # PDU length = PDV items (4-byte length + context + header byte + fragment)
        assert max(wire.pdata_lengths) <= SEND_PDU_BYTES
        assert sum(n > SEND_PDU_BYTES // 2 for n in wire.pdata_lengths) >= 3
    finally:
        wire.stop()


def test_implicit_only_destination_gets_a_reencoded_copy(tmp_path: Path, ledger: Ledger) -> None:
    """A destination that accepts only Implicit VR Little Endian: the fallback re-encodes."""
    scp = WireSCP(syntaxes=(ImplicitVRLittleEndian,))
    try:
        job_id = encoded_job(ledger, tmp_path, [scp.peer])
        d = Dispatcher(outbox_config(tmp_path, [scp.peer], keep_open_s=0), ledger)
        assert d.run_once() == 2
        d.stop()
    finally:
        scp.stop()
    seg = result_paths(ledger, job_id)[0]
    uid, raw, ts = scp.received[0]
    assert ts == ImplicitVRLittleEndian and raw != dataset_bytes(seg)
    ds = dcmread(BytesIO(raw), force=True)  # Implicit VR Little Endian, no File Meta
    assert ds.SOPInstanceUID == dcmread(seg).SOPInstanceUID == uid


def test_two_jobs_share_one_kept_open_association(
    tmp_path: Path, ledger: Ledger, wire: WireSCP
) -> None:
    """(b) The SEG and SR of a job sent within keep_open_s of the last go over the same
    association; it is released when keep_open_s has passed without use."""
    cfg = outbox_config(tmp_path, [wire.peer], keep_open_s=1.5)
    d = Dispatcher(cfg, ledger, rng=random.Random(1))
    d.start()
    try:
        first = encoded_job(ledger, tmp_path, [wire.peer])
        d.wake.set()
        run_until_sent(d, ledger, [first])
        time.sleep(0.3)  # the association idles, open
        assert len(wire.open_associations()) == 1
        # Its socket sends each PDU at once (no Nagle stall before the next object's data).
        (kept,) = d.kept._idle.values()
        sock = kept[0].socket
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        second = encoded_job(ledger, tmp_path, [wire.peer])
        d.wake.set()
        run_until_sent(d, ledger, [second])
        assert wire.associations == 1 and len(wire.received) == 4
        # Idle for keep_open_s: the outbox releases it (an A-RELEASE, not an abort).
        t0 = time.monotonic()
        wait_for(lambda: wire.ended == ["released"], 5, "idle association released")
        assert 0.8 < time.monotonic() - t0 < 3.5
        third = encoded_job(ledger, tmp_path, [wire.peer])
        d.wake.set()
        run_until_sent(d, ledger, [third])
        assert wire.associations == 2
    finally:
        d.stop()
    wait_for(lambda: wire.ended == ["released", "released"], 5, "released at stop")
    for job_id in (first, second, third):
        view = ledger.job(job_id)
        assert view is not None and [a for *_, a in view.deliveries] == [1, 1]


@pytest.mark.parametrize("how", ["release", "abort", "close"])
def test_peer_closes_idle_association(
    tmp_path: Path, ledger: Ledger, wire: WireSCP, how: str
) -> None:
    """(c) The destination ends the idle association (A-RELEASE, A-ABORT, TCP close): the
    next job goes over a new one, with one attempt per object and no retry recorded."""
    d = Dispatcher(outbox_config(tmp_path, [wire.peer], keep_open_s=60), ledger)
    d.start()
    try:
        first = encoded_job(ledger, tmp_path, [wire.peer])
        d.wake.set()
        run_until_sent(d, ledger, [first])
        wait_for(lambda: len(wire.open_associations()) == 1, 5, "kept open")
        wire.end_idle(how)
        wait_for(lambda: not wire.open_associations(), 5, "peer ended it")
        second = encoded_job(ledger, tmp_path, [wire.peer])
        d.wake.set()
        run_until_sent(d, ledger, [second])
    finally:
        d.stop()
    assert wire.associations == 2 and len(wire.received) == 4
    view = ledger.job(second)
    assert view is not None and [a for *_, a in view.deliveries] == [1, 1]
    assert events(ledger, "delivery-retry") == [] and events(ledger, "destination-down") == []


def test_peer_aborts_kept_association_as_we_send(
    tmp_path: Path, ledger: Ledger, wire: WireSCP
) -> None:
    """(c) The race: the peer drops the kept association while our request is on its way and
    never answers it. The object is sent again on a new association, no attempt used."""
    d = Dispatcher(outbox_config(tmp_path, [wire.peer], keep_open_s=60), ledger)
    try:
        first = encoded_job(ledger, tmp_path, [wire.peer])
        assert d.run_once() == 2
        wire.abort_next_on_reused = True
        second = encoded_job(ledger, tmp_path, [wire.peer])
        assert d.run_once() == 2
    finally:
        d.stop()
    assert wire.associations == 2
    assert [uid for uid, *_ in wire.received][-2:] == [
        v.seg_sop_uid if (v := ledger.job(second)) else "",
        v.sr_sop_uid if v else "",
    ]
    for job_id in (first, second):
        view = ledger.job(job_id)
        assert view is not None and view.state == "sent"
        assert [a for *_, a in view.deliveries] == [1, 1]
    assert events(ledger, "delivery-retry") == []


def test_keep_open_zero_releases_after_each_batch(
    tmp_path: Path, ledger: Ledger, wire: WireSCP
) -> None:
    """(d) keep_open_s = 0: one association per batch, released when the batch is done."""
    d = Dispatcher(outbox_config(tmp_path, [wire.peer], keep_open_s=0), ledger)
    try:
        for n in (1, 2):
            encoded_job(ledger, tmp_path, [wire.peer])
            assert d.run_once() == 2
            assert len(d.kept) == 0
            wait_for(lambda n=n: wire.ended == ["released"] * n, 5, "released")
    finally:
        d.stop()
    assert wire.associations == 2 and len(wire.received) == 4


#: A timestamp as the v1 ledger stores it (naive UTC, ``YYYY-MM-DD HH:MM:SS.ffffff``).
V1_TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}")


def load_v1_ledger(data: Path) -> Path:
    """A schema version 1 ledger (tests/data/ledger-v1.sql) in ``data``.

    Its timestamps move together so that the newest lies a minute ago: the dump's own dates
    would age its pending job past ``dispatch.max_age_s`` a day after it was written.
    """
    data.mkdir(parents=True, exist_ok=True)
    path = data / "ledger.sqlite"
    sql = V1_LEDGER.read_text().replace("@DATA@", str(data))
    times = [datetime.fromisoformat(t) for t in V1_TIME.findall(sql)]
    shift = datetime.now(UTC).replace(tzinfo=None) - timedelta(minutes=1) - max(times)
    sql = V1_TIME.sub(
        lambda m: (datetime.fromisoformat(m[0]) + shift).isoformat(" ", "microseconds"), sql
    )
    conn = sqlite3.connect(path)
    conn.executescript(sql)
    conn.close()
    return path


def test_v1_ledger_is_upgraded_and_keeps_its_jobs(tmp_path: Path, wire: WireSCP) -> None:
    """(e) A ledger made before deliveries.sending_at opens, is upgraded to the current
    version, keeps its jobs, and its pending deliveries are sent with the new stage."""
    data = tmp_path / "data"
    path = load_v1_ledger(data)
    led = Ledger(path)
    try:
        with sqlite3.connect(path) as conn:
            version = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            columns = {r[1] for r in conn.execute("PRAGMA table_info(deliveries)")}
        assert int(version[0]) == SCHEMA_VERSION == 3 and "sending_at" in columns
        old = led.job(1)
        assert old is not None and old.state == "sent"
        assert all(a is not None for a in old.delivery_acks)
        assert old.delivery_starts == (None, None) and old.stages["sending"] is None
        pending = led.job(2)
        assert pending is not None and pending.state == "encoded"
        # Its result files (the ledger's paths): rewrite them, send to the new destination.
        with led._read() as s:
            for r in s.scalars(select(Result).where(Result.job_id == 2)):
                cls = SegmentationStorage if r.kind == "SEG" else Comprehensive3DSRStorage
                result_file(Path(r.path), cls, r.sop_instance_uid, pending.study_instance_uid)
        with led._tx() as s:
            for dl in s.scalars(select(Delivery).where(Delivery.job_id == 2)):
                dl.destination = wire.peer
        d = Dispatcher(outbox_config(data, [wire.peer]), led)
        assert d.run_once() == 2
        d.stop()
        sent = led.job(2)
        assert sent is not None and sent.state == "sent"
        assert all(t is not None for t in sent.delivery_starts)
    finally:
        led.close()
    # Opening it again is a no-op.
    Ledger(path).close()
    # A ledger from a newer segnode is refused, unchanged.
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(SchemaError, match="newer"):
        Ledger(path)


def test_send_stage_in_segnode_jobs_json(tmp_path: Path, wire: WireSCP) -> None:
    """(f) ``segnode jobs --json`` shows when each delivery started sending and how long it
    took, and the job's ``sending`` stage; the text output shows the send time."""
    data = tmp_path / "data"
    data.mkdir()
    led = Ledger(data / "ledger.sqlite")
    try:
        job_id = encoded_job(led, data, [wire.peer])
        d = Dispatcher(outbox_config(data, [wire.peer]), led)
        assert d.run_once() == 2
        d.stop()
    finally:
        led.close()
    cli = [sys.executable, "-m", "segnode.node.ops.cli", "jobs", "--data-dir", str(data)]
    out = subprocess.run([*cli, "--json"], cwd=ROOT, capture_output=True, text=True, check=True)
    job = next(j for j in json.loads(out.stdout)["jobs"] if j["id"] == job_id)
    assert job["stages"]["encoded"] <= job["stages"]["sending"] <= job["stages"]["finished"]
    for dl in job["deliveries"]:
        assert dl["status"] == "sent"
        assert dl["sending_at"] is not None and dl["sending_at"] <= dl["acked_at"]
        assert 0 <= dl["send_s"] < 10
    text = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "sending +" in text and " in 0." in text


def test_orthanc_gets_both_jobs_over_a_kept_association(tmp_path: Path, ledger: Ledger) -> None:
    """Orthanc as the destination: two jobs within keep_open_s go over one association, and
    Orthanc stores every object with the dataset bytes of our file."""
    orthanc = start_orthanc(tmp_path / "orthanc")
    try:
        d = Dispatcher(outbox_config(tmp_path, [orthanc.peer], keep_open_s=30), ledger)
        jobs, used = [], []
        for _ in range(2):
            jobs.append(encoded_job(ledger, tmp_path, [orthanc.peer]))
            assert d.run_once() == 2
            assoc = d.kept.take(orthanc.peer)
            assert assoc is not None and assoc.is_established
            used.append(assoc)
            d.kept.put(orthanc.peer, assoc)
        assert used[0] is used[1]
        d.stop()
        assert not used[0].is_established  # released at stop
        for job_id in jobs:
            assert ledger.job_state(job_id) == "sent"
            for path in result_paths(ledger, job_id):
                uid = dcmread(path, stop_before_pixels=True).SOPInstanceUID
                lookup = urllib.request.Request(
                    f"http://{LOOPBACK}:{orthanc.http_port}/tools/lookup",
                    data=uid.encode(),
                    method="POST",
                )
                with urllib.request.urlopen(lookup, timeout=10) as r:
                    ids = json.loads(r.read())
                assert len(ids) == 1
                stored = orthanc.get_bytes(f"/instances/{ids[0]['ID']}/file")
                assert dataset_bytes(stored) == dataset_bytes(path)
    finally:
        orthanc.stop()


@pytest.mark.parametrize("syntax", ["+x=", "+xi"])
def test_dcmtk_storescp_stores_both_jobs(tmp_path: Path, ledger: Ledger, syntax: str) -> None:
    """DCMTK storescp as the destination: two jobs over one kept association, every object
    stored; with Explicit VR Little Endian accepted the stored data set is our file's, byte
    for byte (``--bit-preserving``), with Implicit VR Little Endian only (``+xi``) a
    re-encoded copy of the same object."""
    storescp = require_tool("storescp")
    port, out = free_port(), tmp_path / "storescp"
    out.mkdir()
    args = [storescp, "-aet", "STORESCP", "-od", str(out), "--bit-preserving", syntax]
    proc = subprocess.Popen([*args, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peer = f"STORESCP@{LOOPBACK}:{port}"
    try:

        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex((LOOPBACK, port)) == 0

        wait_for(listening, 10, "storescp listening")
        d = Dispatcher(outbox_config(tmp_path, [peer], keep_open_s=30), ledger)
        jobs = []
        for _ in range(2):
            jobs.append(encoded_job(ledger, tmp_path, [peer]))
            assert d.run_once() == 2
            assert len(d.kept) == 1  # kept open for the next job
        d.stop()
    finally:
        proc.terminate()
        proc.wait(10)
    stored = {dcmread(f).SOPInstanceUID: f for f in out.iterdir()}
    for job_id in jobs:
        assert ledger.job_state(job_id) == "sent"
        for path in result_paths(ledger, job_id):
            uid = dcmread(path, stop_before_pixels=True).SOPInstanceUID
            copy = stored[uid]
            if syntax == "+x=":
                assert dataset_bytes(copy) == dataset_bytes(path)
            else:
                assert dcmread(copy).file_meta.TransferSyntaxUID == ImplicitVRLittleEndian


def test_keep_open_s_is_validated() -> None:
    """``dispatch.keep_open_s``: default 10 s, 0 allowed, a negative value names the key."""
    assert from_dict({}).dispatch.keep_open_s == 10.0
    assert from_dict({"dispatch": {"keep_open_s": 0}}).dispatch.keep_open_s == 0.0
    with pytest.raises(ConfigError, match=r"dispatch\.keep_open_s"):
        from_dict({"dispatch": {"keep_open_s": -1}})
