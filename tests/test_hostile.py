"""Hostile and careless peers against a real ``segnode serve`` subprocess on loopback.

Acceptance tests for the Upper Layer acceptor's defences: connections that never finish (or
trickle) their A-ASSOCIATE-RQ must not lock legitimate modalities out nor cost a thread each;
a P-DATA-TF announcing gigabytes is aborted at its header; a C-STORE on a Verification-only
association is refused and nothing is kept; the called AE title is checked when configured;
SIGTERM ends the process within ``stop_grace_s`` and aborts what is left with an A-ABORT.

The ``[node]`` keys used here (``stop_grace_s``, ``check_called_ae``) and the defaults relied on
(``max_pdu`` 1 MiB, ``max_pending`` 64 / ``max_pending_per_host`` 16,
``association_request_timeout_s`` 10) belong to the acceptor rewrite.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydicom import dcmread
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import write_dataset
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian
from pynetdicom import AE
from pynetdicom.association import Association
from pynetdicom.pdu import A_ASSOCIATE_AC
from pynetdicom.sop_class import CTImageStorage, Verification  # type: ignore[attr-defined]

from scripts.harness import query_ledger
from segnode.node.dicom.ul import decode_command, encode_command, pdata_pdus
from tests.conftest import LOOPBACK, NodeProcess, require_tool, wait_for
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.test_interop import storescu
from tests.test_ul import associate_rq, recv_pdu

MiB = 1 << 20
CT = str(CTImageStorage)
VERIFICATION = str(Verification)
A_ASSOCIATE_AC_TYPE, A_ASSOCIATE_RJ_TYPE, P_DATA_TF, A_ABORT = 0x02, 0x03, 0x04, 0x07
RELEASE_RQ_PDU = struct.pack(">BBII", 0x05, 0, 4, 0)


# -- helpers -----------------------------------------------------------------------------------


def echoscu(node: NodeProcess, called: str = "SEGNODE") -> subprocess.CompletedProcess[str]:
    """One C-ECHO with DCMTK echoscu (bounded timeouts)."""
    exe = require_tool("echoscu")
    return subprocess.run(
        [exe, "-aet", "ECHOER", "-aec", called, "-to", "10", "-ta", "10", "-td", "10"]
        + [LOOPBACK, str(node.port)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def threads_of(pid: int) -> int:
    """How many threads the process has now."""
    return len(os.listdir(f"/proc/{pid}/task"))


def rss_mib(pid: int) -> float:
    """Resident set size (VmRSS) of the process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def started(make_node: Any, **sections: dict[str, Any]) -> NodeProcess:
    """A started node; a node that cannot start (an unknown key) fails in 20 s, not 60."""
    node: NodeProcess = make_node(start=False, **sections)
    node.start(timeout=20)
    return node


def node_pid(node: NodeProcess) -> int:
    pid = node.pid
    assert pid is not None, "node not running"
    return pid


def steady_thread_count(pid: int, timeout: float = 20.0) -> int:
    """The thread count once it has not changed for 1 s (after start-up or a job)."""
    samples: list[int] = []

    def steady() -> bool:
        samples.append(threads_of(pid))
        return len(samples) >= 6 and len(set(samples[-6:])) == 1

    wait_for(steady, timeout, "a steady thread count", interval=0.2)
    return samples[-1]


def steady_rss_mib(pid: int, timeout: float = 30.0) -> float:
    """The RSS once it has moved less than 1 MiB over 1 s: the engine's background load
    and first allocations are done, so a later rise belongs to what the test does."""
    samples: list[float] = []

    def steady() -> bool:
        samples.append(rss_mib(pid))
        return len(samples) >= 6 and max(samples[-6:]) - min(samples[-6:]) < 1.0

    wait_for(steady, timeout, "a steady resident set size", interval=0.2)
    return samples[-1]


def announced_max_pdu(ac_body: bytes) -> int:
    """The Maximum Length Received the node announced in its A-ASSOCIATE-AC."""
    ac = A_ASSOCIATE_AC()
    ac.decode(struct.pack(">BBI", A_ASSOCIATE_AC_TYPE, 0, len(ac_body)) + ac_body)
    assert ac.user_information is not None, "A-ASSOCIATE-AC without user information"
    length = ac.user_information.maximum_length
    assert length is not None, "A-ASSOCIATE-AC without a Maximum Length sub-item"
    return int(length)


def raw_association(
    node: NodeProcess, rq: bytes | None = None, timeout: float = 10.0
) -> tuple[socket.socket, int]:
    """A raw socket with an established association; returns it and the node's max PDU."""
    s = socket.create_connection((LOOPBACK, node.port), timeout=timeout)
    s.sendall(associate_rq() if rq is None else rq)
    kind, body = recv_pdu(s)
    if kind != A_ASSOCIATE_AC_TYPE:
        s.close()
        raise AssertionError(f"expected A-ASSOCIATE-AC, got PDU type {kind} {body[:8]!r}")
    return s, announced_max_pdu(body)


def ct_dataset(folder: Path, syntax: str, seed: int) -> tuple[str, bytes]:
    """One synthetic CT instance: its SOP Instance UID and its dataset encoded in ``syntax``
    (implicit or explicit VR little endian) without File Meta Information."""
    (path,) = write_synthetic_series(
        folder, PhantomGeometry(rows=64, columns=64, slices=1), seed=seed
    )
    ds = dcmread(path)
    del ds.file_meta
    fp = DicomBytesIO()
    fp.is_little_endian = True
    fp.is_implicit_VR = syntax == ImplicitVRLittleEndian
    write_dataset(fp, ds)
    return str(ds.SOPInstanceUID), fp.getvalue()


def c_store_rq(sop_uid: str, sop_class: str = CT, message_id: int = 1) -> bytes:
    """A C-STORE-RQ command set (a data set follows)."""
    return encode_command(
        [
            (0x0002, sop_class.encode()),
            (0x0100, struct.pack("<H", 0x0001)),
            (0x0110, struct.pack("<H", message_id)),
            (0x0700, struct.pack("<H", 0x0000)),
            (0x0800, struct.pack("<H", 0x0000)),
            (0x1000, sop_uid.encode()),
        ]
    )


def dataset_pdus(context_id: int, data: bytes, max_pdu: int) -> list[bytes]:
    """P-DATA-TF PDUs carrying a data set (PDV control 0x00 / 0x02 on the last fragment)."""
    room = len(data) if max_pdu == 0 else max(1, max_pdu - 6)
    pdus = []
    for start in range(0, len(data), room):
        piece = data[start : start + room]
        control = 0x02 if start + room >= len(data) else 0x00
        pdv = struct.pack(">IBB", len(piece) + 2, context_id, control) + piece
        pdus.append(struct.pack(">BBI", P_DATA_TF, 0, len(pdv)) + pdv)
    return pdus


def unread_by_node(node_port: int, peer_port: int) -> int | None:
    """Bytes the node's end of a loopback connection has received but not yet read (the
    rx_queue of /proc/net/tcp), or None when that socket is not listed."""
    local = f"0100007F:{node_port:04X}"
    remote = f"0100007F:{peer_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            return int(fields[4].split(":")[1], 16)
    return None


def ledger_instances(node: NodeProcess, series_uid: str | None = None) -> int:
    """Instances recorded in the node's ledger (of one series, or all), read-only."""
    [row] = query_ledger(node.data_dir, "count(*)", "instances", series_uid=series_uid)
    return int(row[0])


# -- 1. connections that never associate ----------------------------------------------------


class Attacker:
    """Holds ``idle`` connections that send nothing and ``trickle`` connections that send the
    first 3 bytes of an A-ASSOCIATE-RQ and then one byte every ``period`` seconds, from one
    background thread. Any connection the node closes (or answers) is opened again, one new
    connection every ``gap`` seconds at most, so its count stays up for the whole attack."""

    def __init__(
        self, port: int, idle: int, trickle: int, period: float = 2.0, gap: float = 0.005
    ) -> None:
        self.port = port
        self.period = period
        self.gap = gap
        self.rq = associate_rq()
        # slot -> (socket or None, is_trickle, bytes of the RQ sent, time of the last byte)
        self.slots: list[list[Any]] = [[None, False, 0, 0.0] for _ in range(idle)]
        self.slots += [[None, True, 0, 0.0] for _ in range(trickle)]
        self.opened = 0  # connections opened in all (initial + re-opened)
        self.closed_by_node = 0
        self.connect_errors = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="attacker", daemon=True)

    def start(self) -> Attacker:
        self._thread.start()
        return self

    def running(self) -> bool:
        """Whether the thread still holds (and re-opens) its connections."""
        return self._thread.is_alive() and self.error is None

    def open_count(self) -> int:
        """Connections open now (a node that evicts the oldest keeps this near its cap)."""
        return sum(1 for slot in self.slots if slot[0] is not None)

    def stop(self) -> None:
        """Stop the thread and close every socket it holds."""
        self._stop.set()
        self._thread.join(30)
        for slot in self.slots:
            if slot[0] is not None:
                with contextlib.suppress(OSError):
                    slot[0].close()
                slot[0] = None
        if self.error is not None:
            raise AssertionError(f"attacker thread failed: {self.error!r}") from self.error

    def _open(self, slot: list[Any]) -> None:
        try:
            s = socket.create_connection((LOOPBACK, self.port), timeout=2)
        except OSError:
            self.connect_errors += 1
            return
        s.setblocking(False)
        slot[0], slot[2], slot[3] = s, 0, time.monotonic()
        self.opened += 1
        if slot[1]:
            self._send(slot, self.rq[:3])

    def _send(self, slot: list[Any], data: bytes) -> None:
        try:
            sent = slot[0].send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop(slot)
            return
        slot[2] += sent
        slot[3] = time.monotonic()

    def _drop(self, slot: list[Any]) -> None:
        with contextlib.suppress(OSError):
            slot[0].close()
        slot[0] = None
        self.closed_by_node += 1

    def _run(self) -> None:
        try:
            next_open = 0.0
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_open:
                    dead = [slot for slot in self.slots if slot[0] is None]
                    if dead:
                        self._open(dead[0])
                        next_open = now + self.gap
                for slot in self.slots:
                    if slot[0] is not None and slot[1] and now - slot[3] >= self.period:
                        at = slot[2] % len(self.rq)
                        self._send(slot, self.rq[at : at + 1])
                socks = {slot[0]: slot for slot in self.slots if slot[0] is not None}
                readable, _, _ = select.select(list(socks), [], [], 0.002)
                for s in readable:  # EOF, a reset, an A-ASSOCIATE-RJ or an A-ABORT
                    with contextlib.suppress(OSError):
                        s.recv(65536)
                    self._drop(socks[s])
        except BaseException as exc:  # reported by stop()
            self.error = exc


@pytest.mark.interop
@pytest.mark.slow
def test_idle_and_trickling_connections_do_not_block_legitimate_peers(
    make_node: Any, tmp_path: Path
) -> None:
    node: NodeProcess = make_node()
    pid = node_pid(node)
    # A warm-up series first: the first job starts threads that stay (the engine's, the
    # worker's); the idle count is the one after it, with every lazily started thread there.
    write_synthetic_series(
        tmp_path / "warm", PhantomGeometry(rows=32, columns=32, slices=4), seed=9101
    )
    assert storescu(node, tmp_path / "warm").returncode == 0
    wait_for(lambda: [j["state"] for j in node.jobs()["jobs"]] == ["done"], 60, "warm-up job done")
    idle = steady_thread_count(pid)

    files = write_synthetic_series(
        tmp_path / "s", PhantomGeometry(rows=64, columns=64, slices=16), seed=9102
    )
    series_uid = str(dcmread(files[0], stop_before_pixels=True).SeriesInstanceUID)

    def series_jobs() -> list[dict[str, Any]]:
        return [j for j in node.jobs()["jobs"] if j["series"] == series_uid]

    attacker = Attacker(node.port, idle=64, trickle=16).start()
    try:
        wait_for(lambda: attacker.opened >= 80, 20, "the attacker's 80 connections")
        # Hold the attack for a while (two trickle periods) before the legitimate peers come;
        # sample the node's threads meanwhile: pending connections are one selector thread's
        # work, so at most a few threads may come and go (a thread-per-connection acceptor
        # shows ~80 more here).
        peak = idle
        held_until = time.monotonic() + 4.5
        while time.monotonic() < held_until:
            peak = max(peak, threads_of(pid))
            time.sleep(0.1)
        assert attacker.running(), attacker.error

        t0 = time.monotonic()
        echo = echoscu(node)
        t_echo = time.monotonic() - t0
        assert echo.returncode == 0, f"echoscu failed under attack:\n{echo.stdout}{echo.stderr}"
        t0 = time.monotonic()
        sent = storescu(node, tmp_path / "s")
        t_store = time.monotonic() - t0
        assert sent.returncode == 0, f"storescu failed under attack:\n{sent.stdout}{sent.stderr}"
        wait_for(
            lambda: [j["state"] for j in series_jobs()] == ["done"], 60, "the series' job done"
        )
        assert attacker.running(), attacker.error  # held until the job was done
    finally:
        open_now = attacker.open_count()
        attacker.stop()
        print(
            f"attacker: {attacker.opened} connections opened, {attacker.closed_by_node} closed "
            f"by the node, {open_now} open at the end, {attacker.connect_errors} refused"
        )

    print(
        f"under attack: echoscu {t_echo:.2f} s, storescu of 16 slices {t_store:.2f} s; "
        f"threads idle {idle}, peak {peak}"
    )
    assert peak <= idle + 4, f"threads rose from {idle} to {peak} while connections pended"
    (job,) = series_jobs()
    assert job["instances"] == 16
    assert ledger_instances(node, series_uid) == 16
    assert len(node.jobs()["jobs"]) == 2  # the warm-up's and this one: segmented exactly once
    # Every thread the attack or the association cost is gone once the sockets are closed.
    wait_for(lambda: threads_of(pid) == idle, 30, f"thread count back to {idle}")
    assert node.alive()


# -- 2. a P-DATA-TF PDU announcing 4 GiB -----------------------------------------------------


@pytest.mark.interop
def test_huge_pdata_pdu_is_aborted_at_once(make_node: Any) -> None:
    node: NodeProcess = make_node()
    pid = node_pid(node)
    # The node listens before its engine has loaded: measure from a settled process.
    steady_thread_count(pid)
    steady_rss_mib(pid)
    s, announced = raw_association(node)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 * 1024)
    sndbuf = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    # What the node's kernel may hold for it unread (loopback receive buffer, autotuned).
    rcvbuf_max = int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])
    bound = announced + MiB + sndbuf + rcvbuf_max
    rss_before = rss_mib(pid)

    s.settimeout(0.2)
    s.sendall(struct.pack(">BBI", P_DATA_TF, 0, 0xFFFFFFF0))
    pushed = 0
    send_error: list[str] = []
    done = threading.Event()

    def stream() -> None:
        nonlocal pushed
        chunk = memoryview(bytes(64 * 1024))
        try:
            # Past ``bound`` the node has taken more than it may; stop there (the assertion
            # below fails) rather than push 4 GiB into a node that keeps reading.
            while not done.is_set() and pushed <= bound:
                try:
                    pushed += s.send(chunk)
                except TimeoutError:
                    continue
        except OSError as exc:  # EPIPE / ECONNRESET: the node closed its end
            send_error.append(type(exc).__name__)
        finally:
            done.set()

    sender = threading.Thread(target=stream, name="pdata-flood", daemon=True)
    received = b""
    ending = ""
    peak_rss = rss_before
    sender.start()
    try:
        deadline = time.monotonic() + 30
        quiet_until = float("inf")  # 5 s after the sender stopped
        while time.monotonic() < min(deadline, quiet_until):
            peak_rss = max(peak_rss, rss_mib(pid))
            if done.is_set() and quiet_until == float("inf"):
                quiet_until = time.monotonic() + 5
            try:
                data = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                ending = "reset"
                break
            if not data:
                ending = "EOF"
                break
            received += data
            if len(received) >= 10 and received[0] == A_ABORT:
                ending = "A-ABORT"
                break
    finally:
        done.set()
        sender.join(10)
        s.close()
    rss_after = rss_mib(pid)

    kinds = received[:1].hex()
    print(
        f"ending {ending!r} after {received[:10]!r}; {pushed} bytes pushed (bound {bound}); "
        f"send error {send_error}; RSS {rss_before:.0f} -> peak {peak_rss:.0f} / {rss_after:.0f}"
    )
    assert ending, f"no A-ABORT and no close; {pushed} bytes pushed (bound {bound})"
    assert not received or received[0] == A_ABORT, f"node sent PDU type {kinds}, not A-ABORT"
    assert pushed < bound, f"node took {pushed} bytes of a 4 GiB PDU (bound {bound})"
    assert max(rss_after, peak_rss) - rss_before < 64, (rss_before, peak_rss, rss_after)
    assert announced == MiB, f"node announces max PDU {announced}, expected the 1 MiB default"
    echo = echoscu(node)
    assert echo.returncode == 0, echo.stdout + echo.stderr


@pytest.mark.interop
def test_pdata_packed_with_empty_pdvs_is_aborted_without_growing(make_node: Any) -> None:
    """1 MiB P-DATA-TF PDUs of header-only command PDVs not marked last (the audit's a01):
    before, none counted against the command limit and each kept its PDU alive, 60 MiB sent
    grew the node to 2.4 GiB. Now the first such PDV is an invalid PDU: A-ABORT."""
    node: NodeProcess = make_node()
    pid = node_pid(node)
    steady_thread_count(pid)
    rss_before = steady_rss_mib(pid)
    s, announced = raw_association(node)
    empty = struct.pack(">IBB", 2, 1, 0x01)  # command fragment, not last, no data
    body = empty * (announced // len(empty))
    pdu = struct.pack(">BBI", P_DATA_TF, 0, len(body)) + body
    sent = 0
    with s:
        for _ in range(16):
            try:
                s.sendall(pdu)
            except OSError:  # the node closed its end after the abort
                break
            sent += 1
            if select.select([s], [], [], 0.05)[0]:  # the node answered
                break
        kind, reply = recv_pdu(s)
    grown = rss_mib(pid) - rss_before
    print(f"{sent} PDU(s) of {len(pdu)} bytes sent; answer {kind} {reply[:4]!r}; RSS +{grown:.0f}")
    assert kind == A_ABORT and reply[2:4] == bytes([0x02, 0x06]), (kind, reply[:4])
    assert grown < 64, f"RSS grew {grown:.0f} MiB"
    echo = echoscu(node)
    assert echo.returncode == 0, echo.stdout + echo.stderr


# -- 3. C-STORE on a Verification-only association ------------------------------------------


def test_ct_store_on_a_verification_context_is_refused(make_node: Any, tmp_path: Path) -> None:
    node: NodeProcess = make_node()
    sop_uid, data = ct_dataset(tmp_path / "ct", ImplicitVRLittleEndian, seed=9103)
    rq = associate_rq(abstract=VERIFICATION, syntax=ImplicitVRLittleEndian)
    s, announced = raw_association(node, rq)
    with s:
        s.sendall(b"".join(pdata_pdus(1, c_store_rq(sop_uid), announced)))
        s.sendall(b"".join(dataset_pdus(1, data, announced)))
        kind, body = recv_pdu(s)
        assert kind == P_DATA_TF, f"expected a C-STORE-RSP, got PDU type {kind}"
        payload, control = b"", 0
        while True:  # the response may come in several PDVs / PDUs
            offset = 0
            while offset < len(body):
                (length,) = struct.unpack_from(">I", body, offset)
                control = body[offset + 5]
                payload += body[offset + 6 : offset + 4 + length]
                offset += 4 + length
            if control & 0x02:
                break
            kind, body = recv_pdu(s)
            assert kind == P_DATA_TF
        rsp = decode_command(payload)
        s.sendall(RELEASE_RQ_PDU)
        assert recv_pdu(s)[0] == 0x06  # A-RELEASE-RP
    assert struct.unpack("<H", rsp[0x0100])[0] == 0x8001  # C-STORE-RSP
    status = struct.unpack("<H", rsp[0x0900])[0]
    assert status != 0x0000, "a CT instance on a Verification context was acknowledged"
    assert status == 0x0122, f"status 0x{status:04X}, expected 0x0122 (SOP class not supported)"
    assert not list((node.data_dir / "spool").rglob("*.dcm"))
    assert ledger_instances(node) == 0
    status_out = node.cli("status")
    assert status_out.returncode == 0, status_out.stderr
    assert json.loads(status_out.stdout)["instances"] == 0


# -- 4. called AE title -----------------------------------------------------------------------


@pytest.mark.interop
def test_called_ae_title_is_checked_when_configured(make_node: Any) -> None:
    lenient: NodeProcess = make_node()
    wrong = echoscu(lenient, called="WRONGAE")
    assert wrong.returncode == 0, wrong.stdout + wrong.stderr  # check_called_ae is off
    lenient.stop()

    node = started(make_node, node={"check_called_ae": True})
    rejected = echoscu(node, called="WRONGAE")
    assert rejected.returncode != 0, "a wrong called AE title was accepted"
    with socket.create_connection((LOOPBACK, node.port), timeout=10) as s:
        s.sendall(
            associate_rq(abstract=VERIFICATION, syntax=ImplicitVRLittleEndian, called="WRONGAE")
        )
        kind, body = recv_pdu(s)
    assert kind == A_ASSOCIATE_RJ_TYPE
    assert tuple(body[1:4]) == (0x01, 0x01, 0x07)  # permanent, service user, called AE unknown
    right = echoscu(node, called="SEGNODE")
    assert right.returncode == 0, right.stdout + right.stderr


# -- 5. SIGTERM with associations open -------------------------------------------------------


@pytest.mark.slow
def test_sigterm_stops_promptly_with_associations_open(make_node: Any, tmp_path: Path) -> None:
    grace = 2
    node = started(make_node, node={"stop_grace_s": grace})
    ae = AE(ae_title="IDLER")
    ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = 60
    ae.add_requested_context(CTImageStorage, ExplicitVRLittleEndian)
    assocs: list[Association] = []
    raw: socket.socket | None = None
    try:
        for _ in range(3):
            assocs.append(ae.associate(LOOPBACK, node.port, ae_title="SEGNODE"))
            assert assocs[-1].is_established
        # A raw association in the middle of a C-STORE: the command, then a data set PDU of
        # which only the first half is sent.
        sop_uid, data = ct_dataset(tmp_path / "ct", ExplicitVRLittleEndian, seed=9104)
        raw, announced = raw_association(node)
        assert announced == 0 or len(data) + 12 <= announced
        raw.sendall(b"".join(pdata_pdus(1, c_store_rq(sop_uid), announced)))
        (pdu,) = dataset_pdus(1, data, 0)
        raw.sendall(pdu[: 12 + len(data) // 2])
        client_port = raw.getsockname()[1]
        wait_for(lambda: unread_by_node(node.port, client_port) == 0, 10, "node read the half")

        t0 = time.monotonic()
        code = node.stop(timeout=grace + 5)
        elapsed = time.monotonic() - t0
        print(f"SIGTERM to exit: {elapsed:.2f} s (stop_grace_s {grace})")
        assert code == 0, f"exit code {code} after {elapsed:.1f} s"
        assert elapsed <= grace + 5

        wait_for(lambda: not any(a.is_established for a in assocs), 10, "idle peers aborted")
        # The raw peer gets an A-ABORT, then the end of the stream, not a reset.
        raw.settimeout(10)
        received = b""
        try:
            while chunk := raw.recv(65536):
                received += chunk
        except ConnectionResetError:
            pytest.fail(f"connection reset; received before it: {received[:16]!r}")
        assert received[:1] == bytes([A_ABORT]), f"expected A-ABORT, got {received[:16]!r}"
        assert len(received) == 10, received
    finally:
        for a in assocs:
            if a.is_established:
                a.abort()
        if raw is not None:
            raw.close()
