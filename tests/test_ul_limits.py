"""The acceptor's limits, each on its own, against an in-process StoreSCP over loopback.

The end-to-end flood is in test_hostile.py; here each limit is provoked alone and the node is
shown to keep serving after it: ARTIM over the whole A-ASSOCIATE-RQ, the per-host and total
caps on pending connections (oldest closed first), the data-phase rate limit, the announced
maximum PDU length, the command-set and dataset bounds, a dataset whose encoding is not the
context's transfer syntax, accept() out of file descriptors, stopping with an idle peer, and no
pynetdicom private module in the product.
"""

from __future__ import annotations

import os
import re
import resource
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian

from tests.conftest import LOOPBACK, ROOT
from tests.scp_harness import SCPHarness
from tests.test_hostile import c_store_rq, ct_dataset, dataset_pdus
from tests.test_ul import associate_rq, recv_pdu

CT = "1.2.840.10008.5.1.4.1.1.2"


@pytest.fixture()
def fast(tmp_path: Path) -> Iterator[SCPHarness]:
    """Short timers: ARTIM 1 s, network timeout 1 s, small pending caps, 4 kB PDUs."""
    h = SCPHarness(
        tmp_path / "node",
        {
            "node": {
                "association_request_timeout_s": 1.0,
                "network_timeout_s": 1,
                "max_pending": 6,
                "max_pending_per_host": 3,
                "max_pdu": 4096,
                "max_instance_mb": 1,
            }
        },
    )
    try:
        yield h
    finally:
        h.close()


def closed_within(s: socket.socket, seconds: float) -> float | None:
    """Seconds until the node closes ``s`` (reading and discarding), None if it did not."""
    t0 = time.monotonic()
    s.settimeout(0.05)
    while time.monotonic() - t0 < seconds:
        try:
            if s.recv(65536) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t0
    return None


def associated(h: SCPHarness, rq: bytes | None = None) -> socket.socket:
    s = socket.create_connection((LOOPBACK, h.port), timeout=5)
    s.sendall(rq or associate_rq())
    assert recv_pdu(s)[0] == 0x02
    return s


def serves(h: SCPHarness) -> bool:
    a = h.assoc()
    ok = bool(a.is_established) and int(a.send_c_echo().Status) == 0
    a.release()
    return ok


def test_artim_covers_the_whole_request_however_it_trickles(fast: SCPHarness) -> None:
    rq = associate_rq()
    with socket.create_connection((LOOPBACK, fast.port), timeout=5) as s:
        t0 = time.monotonic()
        for i in range(12):  # a byte every 0.25 s: each read is quick, the request never ends
            try:
                s.send(rq[i : i + 1])
            except OSError:
                break
            time.sleep(0.25)
        took = closed_within(s, 5)
    assert took is not None
    assert time.monotonic() - t0 < 4  # ARTIM 1 s from the connection, not from the last byte
    assert serves(fast)


def test_oldest_pending_connection_of_a_host_is_closed_first(fast: SCPHarness) -> None:
    idle = [socket.create_connection((LOOPBACK, fast.port), timeout=5) for _ in range(3)]
    time.sleep(0.1)  # the node has accepted all three (in this order)
    newest = socket.create_connection((LOOPBACK, fast.port), timeout=5)
    try:
        assert closed_within(idle[0], 0.5) is not None  # over 3 per host: the oldest goes
        for s in idle[1:]:
            assert closed_within(s, 0.1) is None  # the others stay
        newest.sendall(associate_rq())  # and the newest still gets its association
        assert recv_pdu(newest)[0] == 0x02
    finally:
        for s in [*idle, newest]:
            s.close()


def test_pending_connections_are_capped_in_all(tmp_path: Path) -> None:
    h = SCPHarness(tmp_path / "n", {"node": {"max_pending": 4, "max_pending_per_host": 100}})
    try:
        # Four addresses of the loopback network, one connection each, then a fifth.
        socks = []
        for i in range(5):
            s = socket.socket()
            s.bind((f"127.0.0.{i + 2}", 0))
            s.connect((LOOPBACK, h.port))
            socks.append(s)
            time.sleep(0.05)
        assert closed_within(socks[0], 0.5) is not None
        assert all(closed_within(s, 0.05) is None for s in socks[1:])
        assert h.scp.server is not None and h.scp.server.pending_connections == 4
        assert h.scp.server.active_associations == 0  # pending ones are not associations
        for s in socks:
            s.close()
        assert serves(h)
    finally:
        h.close()


def test_a_trickled_message_is_aborted(fast: SCPHarness) -> None:
    """Between messages silence is allowed for network_timeout (1 s); a PDU in progress must
    keep up 16 KiB/s beyond that: one byte every 0.3 s does not."""
    s = associated(fast)
    try:
        s.sendall(struct.pack(">BBI", 0x04, 0, 1000))  # a P-DATA-TF of 1000 bytes...
        t0 = time.monotonic()
        kind = None
        s.settimeout(0.3)
        while time.monotonic() - t0 < 5:
            try:
                s.send(b"\x00")  # ...trickled byte by byte
                head = s.recv(10)
            except TimeoutError:
                continue
            except OSError:
                break
            kind = head[0] if head else None
            break
        assert kind == 0x07  # A-ABORT
        assert 0.9 < time.monotonic() - t0 < 3
    finally:
        s.close()
    assert serves(fast)


def test_a_pdu_longer_than_announced_is_aborted_before_its_body(fast: SCPHarness) -> None:
    s = associated(fast)
    try:
        s.sendall(struct.pack(">BBI", 0x04, 0, 4097))  # one byte over max_pdu = 4096
        kind, body = recv_pdu(s)
        assert kind == 0x07 and body[2:4] == bytes([0x02, 0x06])  # provider, invalid parameter
        assert closed_within(s, 3) is not None
    finally:
        s.close()
    assert serves(fast)


def _command_pdus(command: bytes, piece: int = 4000) -> list[bytes]:
    out = []
    for start in range(0, len(command), piece):
        part = command[start : start + piece]
        control = 0x03 if start + piece >= len(command) else 0x01
        pdv = struct.pack(">IBB", len(part) + 2, 1, control) + part
        out.append(struct.pack(">BBI", 0x04, 0, len(pdv)) + pdv)
    return out


def _first_reply_to(s: socket.socket, pdus: list[bytes]) -> int:
    """Send ``pdus`` until the node stops reading; the type of the first PDU it sent back."""
    try:
        for pdu in pdus:
            try:
                s.sendall(pdu)
            except OSError:
                break
        return recv_pdu(s)[0]
    finally:
        s.close()


def test_command_set_and_dataset_are_bounded(fast: SCPHarness, tmp_path: Path) -> None:
    # A command set of 80 kB in 4 kB fragments: aborted after 64 kB.
    assert _first_reply_to(associated(fast), _command_pdus(b"\x00" * 80_000)) == 0x07
    # A dataset over max_instance_mb (1 MiB): aborted while it arrives, nothing kept.
    s = associated(fast, associate_rq(abstract=CT, syntax=ExplicitVRLittleEndian))
    command = _command_pdus(c_store_rq("1.2.3.4.5"))
    assert _first_reply_to(s, command + dataset_pdus(1, b"\x00" * (2 << 20), 4096)) == 0x07
    assert fast.ledger.counts()["instances"] == 0
    assert serves(fast)


def _store_raw(h: SCPHarness, context_syntax: str, data: bytes, sop_uid: str) -> int:
    s = associated(h, associate_rq(abstract=CT, syntax=context_syntax))
    try:
        for pdu in _command_pdus(c_store_rq(sop_uid)) + dataset_pdus(1, data, 4096):
            s.sendall(pdu)
        kind, body = recv_pdu(s)
        assert kind == 0x04
        from segnode.node.dicom.ul import decode_command

        status = struct.unpack("<H", decode_command(body[6:])[0x0900])[0]
        s.sendall(struct.pack(">BBII", 0x05, 0, 4, 0))
        assert recv_pdu(s)[0] == 0x06
        return int(status)
    finally:
        s.close()


def test_dataset_encoding_must_be_the_contexts_transfer_syntax(
    fast: SCPHarness, tmp_path: Path
) -> None:
    uid, explicit = ct_dataset(tmp_path / "e", ExplicitVRLittleEndian, 9301)
    assert _store_raw(fast, ImplicitVRLittleEndian, explicit, uid) == 0xC210
    uid2, implicit = ct_dataset(tmp_path / "i", ImplicitVRLittleEndian, 9302)
    assert _store_raw(fast, ExplicitVRLittleEndian, implicit, uid2) == 0xC210
    assert fast.ledger.counts()["instances"] == 0
    assert _store_raw(fast, ImplicitVRLittleEndian, implicit, uid2) == 0x0000  # matching: kept
    assert fast.ledger.counts()["instances"] == 1


def test_stop_aborts_an_idle_association_at_once(tmp_path: Path) -> None:
    h = SCPHarness(tmp_path / "n")
    s = associated(h)
    t0 = time.monotonic()
    h.close()  # stop_grace_s = 5, but nothing is in flight
    took = time.monotonic() - t0
    kind, body = recv_pdu(s)
    s.close()
    assert kind == 0x07 and body[2] == 0x00  # A-ABORT from the service user (the node)
    assert took < 2.5


def test_the_port_stays_answerable_after_stop(tmp_path: Path) -> None:
    """A status line written while the node stops (the engine finishing its load then)
    asks for the port after the listener is closed: it gets the bound port, not EBADF."""
    h = SCPHarness(tmp_path / "n")
    port = h.port
    assert port > 0
    h.close()
    assert h.scp.port == port


CHILD = textwrap.dedent(
    """
    import resource, sys, time
    from segnode.node.dicom.ul import Acceptor, AcceptorOptions, StoreOutcome
    class H:
        def requested(self, info): return None
        def accepted(self, info): pass
        def store(self, info, request): return StoreOutcome(0)
        def closed(self, info, released): pass
    acc = Acceptor(AcceptorOptions("SEGNODE", {"1.2.840.10008.1.1": ["1.2.840.10008.1.2"]}), H())
    acc.start(("127.0.0.1", 0))
    import os
    n = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (n + 8, n + 8))
    print(acc.server_address[1], flush=True)
    time.sleep(60)
    """
)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_accept_out_of_file_descriptors_backs_off(tmp_path: Path) -> None:
    """With 8 descriptors to spare and 40 connections, accept() fails with EMFILE: the
    acceptor pauses (instead of spinning on a listener that stays readable) and serves again
    once descriptors are free."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft > 200
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        socks = [socket.create_connection((LOOPBACK, port), timeout=5) for _ in range(40)]
        time.sleep(0.3)
        c0 = _cpu_s(child.pid)
        time.sleep(2.0)
        busy = _cpu_s(child.pid) - c0
        assert busy < 0.5, f"acceptor used {busy:.2f} s of CPU in 2 s while out of descriptors"
        for s in socks:
            s.close()
        with socket.create_connection((LOOPBACK, port), timeout=5) as s:
            s.sendall(associate_rq(abstract="1.2.840.10008.1.1", syntax=ImplicitVRLittleEndian))
            assert recv_pdu(s)[0] == 0x02
    finally:
        child.kill()
        _, err = child.communicate(timeout=10)
    assert b"pausing" in err  # logged (rate-limited), not silent


def test_no_pynetdicom_private_module_in_the_product() -> None:
    """No pynetdicom private module, and so no module-level mutable configuration (the
    outbox's requestor is the node's own since it stopped using pynetdicom's association)."""
    private = re.compile(r"pynetdicom\._|from pynetdicom import _")
    for package in ("node", "engines", "storage"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            assert not private.search(text), f"{path} uses a pynetdicom private module"


def test_the_node_announces_its_own_implementation_class_uid(fast: SCPHarness) -> None:
    from pynetdicom import PYNETDICOM_IMPLEMENTATION_UID

    from segnode.node.dicom.ul import IMPLEMENTATION_CLASS_UID, IMPLEMENTATION_VERSION

    a = fast.assoc()
    assert a.acceptor.implementation_class_uid == IMPLEMENTATION_CLASS_UID
    assert str(PYNETDICOM_IMPLEMENTATION_UID) != IMPLEMENTATION_CLASS_UID
    assert a.acceptor.implementation_version_name == IMPLEMENTATION_VERSION
    a.release()


def test_a_failing_association_check_costs_one_connection_only(
    fast: SCPHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = fast.scp.requested

    def flaky(info: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("access policy broke")
        return real(info)  # type: ignore[arg-type]

    monkeypatch.setattr(fast.scp, "requested", flaky)
    with socket.create_connection((LOOPBACK, fast.port), timeout=5) as s:
        s.sendall(associate_rq())
        assert closed_within(s, 3) is not None  # that one is closed...
    assert serves(fast)  # ...and the listener goes on
    assert fast.scp.server is not None and fast.scp.server.alive
