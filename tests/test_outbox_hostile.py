"""The outbox against hostile and broken Storage SCPs (raw sockets on loopback).

Each destination is a :class:`Hostile` SCP: a thread per connection that negotiates like a
Storage SCP and then answers our C-STORE as its ``mode`` says (a trickled response, a P-DATA
PDU announcing 4 GiB, a response to another message, a warning, a failure with an Error
Comment, an unknown PDU type, nothing...). The dispatcher runs in-process on a real ledger
(the helpers of ``tests/test_outbox.py``) with ``dispatch.timeout_s`` of 1 to 2 s, often with
a healthy destination (:class:`scripts.harness.CountingSCP`) in the same pass.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pydicom import dcmread
from sqlalchemy import select

from scripts.harness import CountingSCP
from segnode.node.dicom.ul_pdu import decode_command, encode_command
from segnode.node.outbox.scu import Dispatcher, echo
from segnode.node.peers import parse_peer
from segnode.storage.ledger import Ledger
from segnode.storage.models import Delivery, Result
from tests.conftest import LOOPBACK, wait_for
from tests.test_outbox import encoded_job, events, outbox_config
from tests.test_outbox_bytes import big_seg, result_paths

T = TypeVar("T")

ECHO = "1.2.840.10008.1.1"
EXPLICIT = "1.2.840.10008.1.2.1"


def _item(kind: int, payload: bytes) -> bytes:
    return struct.pack(">BBH", kind, 0, len(payload)) + payload


def _contexts(body: bytes) -> list[tuple[int, str, list[str]]]:
    """The presentation contexts of an A-ASSOCIATE-RQ body: (ID, abstract, syntaxes)."""
    out: list[tuple[int, str, list[str]]] = []
    items, i = body[68:], 0
    while i + 4 <= len(items):
        kind, _, length = struct.unpack(">BBH", items[i : i + 4])
        value = items[i + 4 : i + 4 + length]
        if kind == 0x20:
            abstract, syntaxes, j = "", [], 4
            while j + 4 <= len(value):
                sub, _, n = struct.unpack(">BBH", value[j : j + 4])
                text = value[j + 4 : j + 4 + n].decode().rstrip("\0 ")
                if sub == 0x30:
                    abstract = text
                elif sub == 0x40:
                    syntaxes.append(text)
                j += 4 + n
            out.append((value[0], abstract, syntaxes))
        i += 4 + length
    return out


def _accept(body: bytes) -> bytes:
    """An A-ASSOCIATE-AC accepting every proposed context (Explicit VR LE where offered)."""
    out = struct.pack(">HH", 1, 0) + body[4:36] + b"\0" * 32
    out += _item(0x10, b"1.2.840.10008.3.1.1.1")
    for cx_id, _, syntaxes in _contexts(body):
        syntax = EXPLICIT if EXPLICIT in syntaxes else syntaxes[0]
        out += _item(0x21, bytes([cx_id, 0, 0, 0]) + _item(0x40, syntax.encode()))
    user = _item(0x51, struct.pack(">I", 16384)) + _item(0x52, b"1.2.3.4") + _item(0x55, b"HOSTILE")
    out += _item(0x50, user)
    return struct.pack(">BBI", 0x02, 0, len(out)) + out


def _pdata(cx_id: int, value: bytes, command: bool = True) -> bytes:
    pdv = struct.pack(">IBB", len(value) + 2, cx_id, 0x03 if command else 0x02) + value
    return struct.pack(">BBI", 0x04, 0, len(pdv)) + pdv


def _us(value: int) -> bytes:
    return struct.pack("<H", value)


def _uid(value: str) -> bytes:
    raw = value.encode()
    return raw + b"\0" if len(raw) % 2 else raw


def _response(cx_id: int, rq: dict[int, bytes], status: int = 0, **change: Any) -> bytes:
    """A C-STORE-RSP to the request ``rq`` (its command elements), with ``change`` applied:
    ``msg_id``, ``uid``, ``cls``, ``field``, ``status`` (None: left out), ``comment``."""
    elements = {
        0x0002: _uid(change.get("cls", rq[0x0002].rstrip(b"\0").decode())),
        0x0100: _us(change.get("field", 0x8001)),
        0x0120: _us(change.get("msg_id", struct.unpack("<H", rq[0x0110])[0])),
        0x0800: _us(0x0101),
        0x1000: _uid(change.get("uid", rq[0x1000].rstrip(b"\0").decode())),
    }
    if change.get("status", status) is not None:
        elements[0x0900] = _us(change.get("status", status))
    if "comment" in change:
        elements[0x0902] = _uid(change["comment"])
    return _pdata(cx_id, encode_command(elements.items()))


class Hostile:
    """A Storage SCP on raw sockets that misbehaves as ``mode`` says.

    Modes, at the C-STORE (after the whole dataset arrived unless said otherwise): ``ok``
    (0x0000), ``double`` (0x0000 twice), ``trickle`` (the response one byte every 0.25 s),
    ``huge`` (a P-DATA-TF header announcing 0xFFFFFFF0 bytes, then zeros as fast as the
    socket takes them, up to ``flood_bytes``), ``wrong_msgid``, ``wrong_uid``,
    ``wrong_class``, ``echo_rsp`` (a C-ECHO-RSP), ``no_status``, ``status:XXXX``,
    ``comment`` (0xA700 with an Error Comment), ``garbage`` (a PDU of type 0x09),
    ``release`` (an A-RELEASE-RQ), ``silent`` (nothing); ``early`` answers 0x0000 once the
    command arrived and reads nothing more; ``unsolicited`` sends a C-STORE-RSP 0x0000 with
    the A-ASSOCIATE-AC, then stays silent; ``reject`` answers the A-ASSOCIATE-RQ with a
    permanent rejection, called AE title not recognised.

    Parameters
    ----------
    mode
        What it does.
    rcvbuf
        ``SO_RCVBUF`` of its connections (small: a large request cannot be sent whole
        before it reads).
    flood_bytes
        How much ``huge`` streams at most.
    """

    def __init__(self, mode: str, *, rcvbuf: int = 0, flood_bytes: int = 256 << 20) -> None:
        self.mode = mode
        self.flood_bytes = flood_bytes
        self.associations = 0
        self.datasets = 0
        self.trickling = threading.Event()
        self.aborts = 0
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._server = socket.socket()
        if rcvbuf:
            self._server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self._server.bind((LOOPBACK, 0))
        self._server.listen(8)
        self.port = int(self._server.getsockname()[1])
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True)
        self._accepter.start()

    @property
    def peer(self) -> str:
        """``AE@host:port``."""
        return f"HOSTILE@{LOOPBACK}:{self.port}"

    def stop(self) -> None:
        """Close everything and join the threads."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self._accepter.join(5)
        for t in self._threads:
            t.join(5)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _recv(self, conn: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def _pdu(self, conn: socket.socket) -> tuple[int, bytes]:
        kind, _, length = struct.unpack(">BBI", self._recv(conn, 6))
        return kind, self._recv(conn, length)

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ConnectionError), conn:
            _, body = self._pdu(conn)
            if self.mode == "reject":
                conn.sendall(struct.pack(">BBIBBBB", 0x03, 0, 4, 0, 1, 1, 7))
                self._stop.wait(1)
                return
            self.associations += 1
            accept = _accept(body)
            if self.mode == "unsolicited":
                fake = {0x0002: b"1.2.840.10008.5.1.4.1.1.66.4", 0x0110: _us(1), 0x1000: b"1.2.3"}
                accept += _response(_contexts(body)[0][0], fake)
            conn.sendall(accept)
            command: dict[int, bytes] = {}
            while not self._stop.is_set():
                kind, body = self._pdu(conn)
                if kind == 0x05:
                    conn.sendall(struct.pack(">BBII", 0x06, 0, 4, 0))
                    return
                if kind == 0x07:
                    self.aborts += 1
                    return
                offset = 0
                while offset < len(body):
                    (length,) = struct.unpack_from(">I", body, offset)
                    cx_id, control = body[offset + 4], body[offset + 5]
                    value = body[offset + 6 : offset + 4 + length]
                    offset += 4 + length
                    if control & 0x01:
                        command = decode_command(value)
                        if struct.unpack("<H", command[0x0100])[0] == 0x0030:
                            echo = {0x0002: _uid(ECHO), 0x0110: command[0x0110], 0x1000: b""}
                            conn.sendall(_response(cx_id, echo, field=0x8030))
                        elif self.mode == "early":
                            conn.sendall(_response(cx_id, command))
                            self._stop.wait(30)
                            return
                    elif control & 0x02:
                        self.datasets += 1
                        self._answer(conn, cx_id, command)

    def _answer(self, conn: socket.socket, cx_id: int, rq: dict[int, bytes]) -> None:
        mode = self.mode
        msg_id = struct.unpack("<H", rq[0x0110])[0]
        if mode == "ok":
            conn.sendall(_response(cx_id, rq))
        elif mode == "double":
            conn.sendall(_response(cx_id, rq) * 2)
        elif mode == "trickle":
            self.trickling.set()
            for byte in _response(cx_id, rq):
                conn.sendall(bytes([byte]))
                if self._stop.wait(0.25):
                    return
        elif mode == "huge":
            conn.sendall(struct.pack(">BBI", 0x04, 0, 0xFFFFFFF0))
            chunk, sent = b"\0" * (1 << 20), 0
            while sent < self.flood_bytes and not self._stop.is_set():
                conn.sendall(chunk)
                sent += len(chunk)
        elif mode == "wrong_msgid":
            conn.sendall(_response(cx_id, rq, msg_id=(msg_id + 1000) % 65536))
        elif mode == "wrong_uid":
            conn.sendall(_response(cx_id, rq, uid="1.2.3.4.5.6.7.8.9"))
        elif mode == "wrong_class":
            conn.sendall(_response(cx_id, rq, cls="1.2.840.10008.5.1.4.1.1.2"))
        elif mode == "echo_rsp":
            conn.sendall(_response(cx_id, rq, cls=ECHO, field=0x8030))
        elif mode == "no_status":
            conn.sendall(_response(cx_id, rq, status=None))
        elif mode.startswith("status:"):
            conn.sendall(_response(cx_id, rq, int(mode[7:], 16)))
        elif mode == "comment":
            conn.sendall(_response(cx_id, rq, 0xA700, comment="PACS disk full on /archive"))
        elif mode == "garbage":
            conn.sendall(b"\x09\x00\x00\x00\x00\x10" + b"\xde\xad\xbe\xef" * 4)
        elif mode == "release":
            conn.sendall(struct.pack(">BBII", 0x05, 0, 4, 0))


@pytest.fixture
def good() -> Iterator[CountingSCP]:
    scp = CountingSCP().start()
    yield scp
    scp.stop()


@contextlib.contextmanager
def hostile(mode: str, **options: Any) -> Iterator[Hostile]:
    scp = Hostile(mode, **options)
    try:
        yield scp
    finally:
        scp.stop()


def bounded(fn: Callable[[], T], limit: float) -> tuple[T, float]:
    """``fn()`` and its wall time; the test fails (rather than hangs) past ``limit`` s."""
    out: list[T] = []
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"still running after {limit:.0f} s"
    assert out, "raised (see the log)"
    return out[0], time.monotonic() - t0


def rows(ledger: Ledger, job_id: int) -> dict[tuple[str, str], Delivery]:
    """The job's deliveries by (destination AE title, kind)."""
    with ledger._read() as s:
        q = (
            select(Delivery, Result.kind)
            .join(Result, Result.id == Delivery.result_id)
            .where(Delivery.job_id == job_id)
        )
        return {(d.destination.split("@")[0], kind): d for d, kind in s.execute(q)}


def one_pass(
    tmp_path: Path, ledger: Ledger, peers: list[str], limit: float, **dispatch: Any
) -> Any:
    """One job to ``peers``, one dispatcher pass (bounded); the job's deliveries, the number
    sent and the pass's wall time."""
    job_id = encoded_job(ledger, tmp_path, peers)
    cfg = outbox_config(tmp_path, peers, **{"timeout_s": 1.5, "keep_open_s": 0, **dispatch})
    d = Dispatcher(cfg, ledger)
    try:
        sent, elapsed = bounded(d.run_once, limit)
    finally:
        bounded(d.stop, 10)
    return rows(ledger, job_id), sent, elapsed


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_trickled_response_ends_in_time_and_the_other_destination_is_served(
    tmp_path: Path, ledger: Ledger, good: CountingSCP
) -> None:
    """A destination trickling its response a byte at a time: the attempt ends within
    timeout_s of the request (the deadline is for the whole response), and the healthy
    destination of the same pass gets both objects meanwhile."""
    with hostile("trickle") as bad:
        got, sent, elapsed = one_pass(tmp_path, ledger, [bad.peer, good.peer], 10)
    assert sent == 2 and len(good.counts()) == 2
    assert elapsed < 1.5 + 2.0, elapsed
    seg = got[("HOSTILE", "SEG")]
    assert seg.status == "pending" and seg.attempts == 1
    assert "no complete response within 1.5 s" in (seg.last_error or "")
    assert got[("COUNTER", "SEG")].status == got[("COUNTER", "SR")].status == "sent"


def test_a_slow_destination_does_not_delay_another(
    tmp_path: Path, ledger: Ledger, good: CountingSCP
) -> None:
    """Destinations are served side by side and independently: the healthy one's objects are
    acknowledged while the silent one still has its request outstanding, those of a job
    encoded meanwhile too (its pass does not wait for the silent destination's)."""
    with hostile("silent") as bad:
        first = encoded_job(ledger, tmp_path, [bad.peer, good.peer])
        cfg = outbox_config(tmp_path, [bad.peer, good.peer], timeout_s=4, keep_open_s=0)
        d = Dispatcher(cfg, ledger)
        t0 = time.monotonic()
        d.start()
        try:
            d.wake.set()
            wait_for(lambda: len(good.counts()) == 2, 5, "the healthy destination served")
            assert time.monotonic() - t0 < 1.5
            encoded_job(ledger, tmp_path, [bad.peer, good.peer])
            d.wake.set()
            wait_for(lambda: len(good.counts()) == 4, 5, "the second job served")
            assert time.monotonic() - t0 < 3.0  # before the silent one's attempt ended
            assert rows(ledger, first)[("HOSTILE", "SEG")].attempts == 0
        finally:
            _, stopped = bounded(d.stop, 10)
    assert stopped < 4 + 1.0, stopped
    seg = rows(ledger, first)[("HOSTILE", "SEG")]
    assert seg.attempts == 1 and "no complete response within 4 s" in (seg.last_error or "")


def test_announced_4_gib_pdu_is_refused_without_reading_it(tmp_path: Path, ledger: Ledger) -> None:
    """A response PDU announcing 0xFFFFFFF0 bytes, followed by a flood of zeros: aborted at
    its header, at once, with the size in the reason; nothing of it is buffered."""
    peak = [rss_mib()]
    start = peak[0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with hostile("huge") as bad:
            got, sent, elapsed = one_pass(tmp_path, ledger, [bad.peer], 20, timeout_s=2)
    finally:
        done.set()
        sampler.join()
    assert sent == 0 and elapsed < 1.0, elapsed
    assert peak[0] - start < 100, f"RSS grew {peak[0] - start:.0f} MiB"
    seg = got[("HOSTILE", "SEG")]
    assert seg.attempts == 1 and "4294967280" in (seg.last_error or "")


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("unsolicited", "before our C-STORE-RQ"),
        ("wrong_msgid", "message ID"),
        ("wrong_uid", "SOP Instance UID 1.2.3.4.5.6.7.8.9"),
        ("wrong_class", "SOP Class UID 1.2.840.10008.5.1.4.1.1.2"),
        ("echo_rsp", "C-ECHO-RSP"),
        ("no_status", "without a Status"),
        ("release", "A-RELEASE-RQ"),
    ],
)
def test_invalid_responses_are_not_acknowledgements(
    tmp_path: Path, ledger: Ledger, mode: str, says: str
) -> None:
    """A response that does not answer our request (another message, another object, another
    service, before the request, without a status, a release request instead) is a protocol
    violation: the association is aborted, the attempt fails, and the reason says what."""
    with hostile(mode) as bad:
        got, sent, elapsed = one_pass(tmp_path, ledger, [bad.peer], 10)
        wait_for(lambda: bad.aborts >= 1 or mode == "unsolicited", 2, "our A-ABORT")
    assert sent == 0 and elapsed < 1.0, elapsed
    seg = got[("HOSTILE", "SEG")]
    assert seg.status == "pending" and seg.attempts == 1, (seg.status, seg.last_error)
    assert "protocol violation" in (seg.last_error or "") and says in (seg.last_error or ""), (
        seg.last_error
    )


def test_response_before_the_dataset_is_refused(tmp_path: Path, ledger: Ledger) -> None:
    """A destination that answers 0x0000 as soon as the command arrived, before it read the
    dataset (which cannot all be on its way: it does not read): not an acknowledgement."""
    with hostile("early", rcvbuf=32 << 10) as bad:
        job_id = encoded_job(ledger, tmp_path, [bad.peer])
        seg_path, _ = result_paths(ledger, job_id)
        view = ledger.job(job_id)
        assert view is not None
        big_seg(seg_path, view.seg_sop_uid, dcmread(seg_path).StudyInstanceUID, 8 << 20)
        cfg = outbox_config(tmp_path, [bad.peer], timeout_s=2, keep_open_s=0)
        d = Dispatcher(cfg, ledger)
        try:
            sent, _ = bounded(d.run_once, 10)
        finally:
            bounded(d.stop, 10)
    seg = rows(ledger, job_id)[("HOSTILE", "SEG")]
    assert sent == 0 and seg.status == "pending" and seg.attempts == 1
    assert "before our C-STORE-RQ was complete" in (seg.last_error or ""), seg.last_error


def test_warning_status_counts_as_stored(tmp_path: Path, ledger: Ledger) -> None:
    """0xB000 (coercion of data elements) means stored (PS3.4 §B.2.3): the delivery is done,
    with the warning recorded as its status, and the SR follows."""
    with hostile("status:B000") as bad:
        got, sent, _ = one_pass(tmp_path, ledger, [bad.peer], 10)
    assert sent == 2
    for kind in ("SEG", "SR"):
        row = got[("HOSTILE", kind)]
        assert (row.status, row.attempts, row.last_status) == ("sent", 1, "0xB000")
        assert (row.last_error or "").startswith("stored with warning 0xB000"), row.last_error
    warned = [e.message for e in events(ledger, "delivery-warning")]
    assert len(warned) == 2 and all("stored with warning 0xB000" in m for m in warned), warned


def test_failure_reason_carries_the_error_comment(tmp_path: Path, ledger: Ledger) -> None:
    """0xA700 with an Error Comment: a failed attempt whose reason names the status and
    quotes the comment."""
    with hostile("comment") as bad:
        got, sent, _ = one_pass(tmp_path, ledger, [bad.peer], 10)
    seg = got[("HOSTILE", "SEG")]
    assert sent == 0 and seg.attempts == 1 and seg.last_status == "0xA700"
    assert seg.last_error == (
        "destination answered 0xA700 (Out of Resources): PACS disk full on /archive"
    )


def test_permanent_rejection_is_explained(tmp_path: Path, ledger: Ledger) -> None:
    """An A-ASSOCIATE-RJ: no attempt used, and the reason in words with its codes."""
    with hostile("reject") as bad:
        got, sent, _ = one_pass(tmp_path, ledger, [bad.peer], 10)
    seg = got[("HOSTILE", "SEG")]
    assert sent == 0 and seg.attempts == 0
    why = "association rejected permanently by the service user: called AE title not recognised"
    assert seg.last_error == f"{why} (1/1/7)"
    assert [e.message for e in events(ledger, "destination-down")] == [f"{bad.peer}: {why} (1/1/7)"]


def test_garbage_pdu_fails_at_once(tmp_path: Path, ledger: Ledger) -> None:
    """An unknown PDU type in place of the response: aborted at once, not after timeout_s."""
    with hostile("garbage") as bad:
        got, sent, elapsed = one_pass(tmp_path, ledger, [bad.peer], 10, timeout_s=3)
    seg = got[("HOSTILE", "SEG")]
    assert sent == 0 and elapsed < 1.0 and seg.attempts == 1
    assert "unrecognised PDU type 0x09" in (seg.last_error or ""), seg.last_error


def test_stop_returns_in_time_during_a_trickled_response(tmp_path: Path, ledger: Ledger) -> None:
    """Dispatcher.stop while a response trickles in: the outbox thread ends within
    timeout_s (the attempt's deadline), and the node can exit."""
    with hostile("trickle") as bad:
        encoded_job(ledger, tmp_path, [bad.peer])
        d = Dispatcher(outbox_config(tmp_path, [bad.peer], timeout_s=1.5), ledger)
        d.start()
        d.wake.set()
        assert bad.trickling.wait(10)
        _, elapsed = bounded(lambda: d.stop(timeout=10), 12)
        assert not d.is_alive() and elapsed < 1.5 + 1.0, elapsed


def test_a_second_response_ends_the_association_without_using_an_attempt(
    tmp_path: Path, ledger: Ledger
) -> None:
    """A destination answering every request twice: the first answer counts; the second,
    found waiting before the next request, ends that association (A-ABORT) and the next
    object goes over a new one, one attempt each."""
    with hostile("double") as bad:
        got, sent, _ = one_pass(tmp_path, ledger, [bad.peer], 10)
        assert bad.associations == 2
    assert sent == 2
    assert [(r.status, r.attempts) for r in got.values()] == [("sent", 1), ("sent", 1)]


def test_echo_says_why_it_failed(caplog: pytest.LogCaptureFixture) -> None:
    """``segnode echo``: 0 from a destination that answers; -1 from one that rejects the
    association, with the reason logged in one line."""
    with hostile("ok") as ok, hostile("reject") as bad:
        assert echo(parse_peer(ok.peer, "peer"), timeout=2) == 0
        assert echo(parse_peer(bad.peer, "peer"), timeout=2) == -1
    assert "rejected permanently by the service user" in caplog.text
    assert "Traceback" not in caplog.text
