"""Peers that abuse the Upper Layer within its framing, against an in-process StoreSCP on
loopback (raw sockets, hand-built PDUs).

Each case is a defect an audit of the acceptor found (scripts in the audit's a01, a03, a07 and
a12): P-DATA-TF PDUs packed with empty or one-byte PDVs (memory and CPU without bound while the
data bytes stayed under the message limits), a presentation context without an abstract
syntax (a traceback and no answer), a presentation-context ID proposed twice (bound twice),
one host holding every association slot, and a data-phase PDU sent in the same segment as
the A-ASSOCIATE-RQ (lost: the peer waited out the network timeout).
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian

from segnode.node.dicom.ul import decode_command, encode_command, pdata_pdus
from tests.conftest import LOOPBACK, wait_for
from tests.scp_harness import SCPHarness
from tests.test_hostile import c_store_rq, ct_dataset
from tests.test_ul import associate_rq, recv_pdu

CT = "1.2.840.10008.5.1.4.1.1.2"
VERIFICATION = "1.2.840.10008.1.1"
A_ASSOCIATE_AC, A_ASSOCIATE_RJ, P_DATA_TF, A_RELEASE_RP, A_ABORT = 0x02, 0x03, 0x04, 0x06, 0x07
RELEASE_RQ_PDU = struct.pack(">BBII", 0x05, 0, 4, 0)


@pytest.fixture()
def fast(tmp_path: Path) -> Iterator[SCPHarness]:
    """Network timeout 1 s (a node that waits for bytes it lost aborts after it), 4 kB PDUs,
    1 MiB instances."""
    h = SCPHarness(
        tmp_path / "node",
        {"node": {"network_timeout_s": 1, "max_pdu": 4096, "max_instance_mb": 1}},
    )
    try:
        yield h
    finally:
        h.close()


# -- helpers -----------------------------------------------------------------------------------


def _uid_item(kind: int, uid: str) -> bytes:
    return struct.pack(">BBH", kind, 0, len(uid)) + uid.encode()


def context_item(context_id: int, abstract: str | None, syntaxes: list[str]) -> bytes:
    """A Presentation Context Item (RQ, PS3.8 §9.3.2.2); ``abstract`` None leaves out the
    Abstract Syntax Sub-Item."""
    body = struct.pack(">BBBB", context_id, 0, 0, 0)
    if abstract is not None:
        body += _uid_item(0x30, abstract)
    body += b"".join(_uid_item(0x40, s) for s in syntaxes)
    return struct.pack(">BBH", 0x20, 0, len(body)) + body


def raw_rq(contexts: bytes) -> bytes:
    """An A-ASSOCIATE-RQ with the given presentation context items, built byte by byte (the
    PDU codecs refuse to build the malformed ones)."""
    user = struct.pack(">BBHI", 0x51, 0, 4, 16384) + _uid_item(0x52, "1.2.3.4")
    body = struct.pack(">HH", 1, 0) + b"SEGNODE".ljust(16) + b"RAW".ljust(16) + bytes(32)
    body += _uid_item(0x10, "1.2.840.10008.3.1.1.1") + contexts
    body += struct.pack(">BBH", 0x50, 0, len(user)) + user
    return struct.pack(">BBI", 0x01, 0, len(body)) + body


def pdv(context_id: int, control: int, value: bytes) -> bytes:
    return struct.pack(">IBB", len(value) + 2, context_id, control) + value


def pdata(*pdvs: bytes) -> bytes:
    body = b"".join(pdvs)
    return struct.pack(">BBI", P_DATA_TF, 0, len(body)) + body


def echo_rq(message_id: int = 1) -> bytes:
    return encode_command(
        [
            (0x0002, VERIFICATION.encode()),
            (0x0100, struct.pack("<H", 0x0030)),
            (0x0110, struct.pack("<H", message_id)),
            (0x0800, struct.pack("<H", 0x0101)),
        ]
    )


def associated(h: SCPHarness, rq: bytes | None = None, source: str = LOOPBACK) -> socket.socket:
    """A raw socket from ``source`` with an established association."""
    s = socket.create_connection((LOOPBACK, h.port), timeout=5, source_address=(source, 0))
    s.sendall(rq or associate_rq())
    kind, body = recv_pdu(s)
    assert kind == A_ASSOCIATE_AC, (kind, body[:4])
    return s


def answer(h: SCPHarness, rq: bytes, source: str = LOOPBACK) -> tuple[int, bytes]:
    """The node's first PDU in answer to ``rq`` (-1 when it closed without one)."""
    with socket.create_connection((LOOPBACK, h.port), timeout=5, source_address=(source, 0)) as s:
        s.sendall(rq)
        return recv_pdu(s)


def sent_until_answer(s: socket.socket, pdus: list[bytes]) -> tuple[int, bytes, float]:
    """Send ``pdus`` until the node stops reading; its first PDU back and how long that took
    from the first send."""
    t0 = time.monotonic()
    for pdu in pdus:
        try:
            s.sendall(pdu)
        except OSError:
            break
    kind, body = recv_pdu(s)
    return kind, body, time.monotonic() - t0


def response_status(body: bytes) -> int:
    """The Status (0000,0900) of a DIMSE response in one P-DATA-TF PDV."""
    return int(struct.unpack("<H", decode_command(body[6:])[0x0900])[0])


def serves(h: SCPHarness) -> bool:
    a = h.assoc()
    ok = bool(a.is_established) and int(a.send_c_echo().Status) == 0
    a.release()
    return ok


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


# -- 1. empty and tiny PDVs (a01) ------------------------------------------------------------


def test_an_empty_pdv_that_is_not_last_aborts_at_once(fast: SCPHarness) -> None:
    """A PDU of header-only command PDVs not marked last: before, each kept a memoryview (and
    its PDU) alive and counted nothing against the command limit (60 MiB sent: 2.4 GiB)."""
    s = associated(fast)
    with s:
        kind, body, took = sent_until_answer(s, [pdata(*[pdv(1, 0x01, b"")] * 600)] * 8)
    assert kind == A_ABORT and body[2:4] == bytes([0x02, 0x06]), (kind, body[:4])
    assert took < 0.9  # at the first PDU, not after the 1 s network timeout
    assert serves(fast)


def test_an_empty_last_fragment_is_accepted(fast: SCPHarness, tmp_path: Path) -> None:
    """A sender whose data ends on a fragment boundary may close the message with an empty
    last PDV (pynetdicom does for an empty file-backed dataset, DCMTK at a buffer boundary)."""
    uid, data = ct_dataset(tmp_path / "ct", ExplicitVRLittleEndian, 9401)
    s = associated(fast, associate_rq(abstract=CT, syntax=ExplicitVRLittleEndian))
    with s:
        s.sendall(b"".join(pdata_pdus(1, c_store_rq(uid), 4096)))
        for start in range(0, len(data), 4000):  # every fragment not last...
            s.sendall(pdata(pdv(1, 0x00, data[start : start + 4000])))
        s.sendall(pdata(pdv(1, 0x02, b"")))  # ...and an empty last one
        kind, body = recv_pdu(s)
        assert kind == P_DATA_TF and response_status(body) == 0x0000
        s.sendall(pdata(pdv(1, 0x03, b"")))  # an empty command set, last: answered, no abort
        kind, body = recv_pdu(s)
        assert kind == P_DATA_TF and response_status(body) == 0x0211
        s.sendall(RELEASE_RQ_PDU)
        assert recv_pdu(s)[0] == A_RELEASE_RP
    assert fast.ledger.counts()["instances"] == 1


def test_one_byte_command_fragments_count_their_headers(fast: SCPHarness) -> None:
    """10 000 one-byte command fragments: 10 kB of data, under the 64 KiB command limit, but
    70 kB on the wire and 10 000 objects kept: aborted (invalid PDU parameter) while they
    arrive."""
    s = associated(fast)
    pdus = [pdata(*[pdv(1, 0x01, b"\x00")] * 500)] * 20  # 3.5 kB PDUs, under max_pdu 4096
    with s:
        kind, body, took = sent_until_answer(s, pdus)
    assert kind == A_ABORT and body[2:4] == bytes([0x02, 0x06]), (kind, body[:4])
    assert took < 0.9
    assert serves(fast)


def test_one_byte_dataset_fragments_count_against_the_instance_limit(fast: SCPHarness) -> None:
    """200 000 one-byte dataset fragments (200 kB of data, under max_instance_mb = 1): aborted
    by the service provider while they arrive, not by the network timeout."""
    s = associated(fast, associate_rq(abstract=CT, syntax=ExplicitVRLittleEndian))
    pdus = pdata_pdus(1, c_store_rq("1.2.3.4.5"), 4096)
    pdus += [pdata(*[pdv(1, 0x00, b"\x00")] * 580)] * 345
    with s:
        kind, body, took = sent_until_answer(s, pdus)
    assert kind == A_ABORT and body[2] == 0x02, (kind, body[:4])  # provider, not a timeout
    assert took < 0.9
    assert fast.ledger.counts()["instances"] == 0
    assert serves(fast)


# -- 2. malformed presentation contexts (a03, a12) -------------------------------------------


def test_a_context_without_abstract_syntax_is_answered_with_an_abort(
    fast: SCPHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """Item length 4 (the context ID only): pynetdicom decodes a context without abstract
    syntax; before, negotiation raised TypeError in the association's thread (a traceback)
    and the peer got no PDU at all."""
    bad = bytearray(context_item(1, CT, [ExplicitVRLittleEndian]))
    struct.pack_into(">H", bad, 2, 4)
    rq = raw_rq(bytes(bad) + context_item(3, VERIFICATION, [ImplicitVRLittleEndian]))
    kind, body = answer(fast, rq)
    assert kind == A_ABORT and body[2:4] == bytes([0x02, 0x06]), (kind, body[:4])
    # A context with an abstract syntax and no transfer syntax likewise.
    kind, body = answer(fast, raw_rq(context_item(1, VERIFICATION, [])))
    assert kind == A_ABORT and body[2:4] == bytes([0x02, 0x06]), (kind, body[:4])
    no_tracebacks(caplog)
    assert serves(fast)


def test_a_context_id_proposed_twice_is_not_bound_twice(fast: SCPHarness) -> None:
    """ID 1 for Verification, then ID 1 again for CT Image Storage: before, both were accepted
    in the A-ASSOCIATE-AC and ID 1 ended bound to CT (a C-ECHO on it got 0x0122)."""
    rq = raw_rq(
        context_item(1, VERIFICATION, [ImplicitVRLittleEndian])
        + context_item(1, CT, [ExplicitVRLittleEndian])
    )
    kind, body = answer(fast, rq)
    assert kind == A_ABORT and body[2:4] == bytes([0x02, 0x06]), (kind, body[:4])
    assert serves(fast)


def test_a_request_without_presentation_contexts_is_aborted(fast: SCPHarness) -> None:
    """PS3.8 §9.3.2: one or more presentation context items. Before, such a request got an
    A-ASSOCIATE-AC that accepted nothing, and its association held a slot doing nothing."""
    kind, body = answer(fast, raw_rq(b""))
    assert kind == A_ABORT and body[2:4] == bytes([0x02, 0x06]), (kind, body[:4])
    assert serves(fast)


# -- 3. one host holding every slot (a07) ----------------------------------------------------


def test_one_host_cannot_hold_every_association(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With the defaults (16 associations) one address holds at most 8; the next from it is
    rejected as transient local-limit-exceeded, logged once for the address however often it
    tries; another address still gets in."""
    h = SCPHarness(tmp_path / "n")
    held: list[socket.socket] = []
    try:
        held = [associated(h) for _ in range(8)]
        for _ in range(3):
            kind, body = answer(h, associate_rq())
            assert kind == A_ASSOCIATE_RJ and tuple(body[1:4]) == (0x02, 0x03, 0x02)
        other = associated(h, source="127.0.0.2")
        held.append(other)
        assert h.scp.server is not None and h.scp.server.active_associations == 9
        refusals = [r.getMessage() for r in caplog.records if "from that address" in r.getMessage()]
        assert len(refusals) == 1 and "127.0.0.1" in refusals[0], refusals
        held.pop(0).close()  # a slot of that host frees: it may associate again
        server = h.scp.server
        wait_for(lambda: server.active_associations == 8, 5, "the closed association to end")
        held.append(associated(h))
    finally:
        for s in held:
            s.close()
        h.close()


def test_the_per_host_cap_is_a_setting(tmp_path: Path) -> None:
    h = SCPHarness(tmp_path / "n", {"node": {"max_associations_per_host": 2}})
    held: list[socket.socket] = []
    try:
        held = [associated(h) for _ in range(2)]
        kind, body = answer(h, associate_rq())
        assert kind == A_ASSOCIATE_RJ and tuple(body[1:4]) == (0x02, 0x03, 0x02)
        held.append(associated(h, source="127.0.0.2"))
    finally:
        for s in held:
            s.close()
        h.close()


# -- 4. data with the request (a remainder of the RQ's segment) ------------------------------


def test_a_pdu_sent_with_the_request_is_served(fast: SCPHarness) -> None:
    """A-ASSOCIATE-RQ and a C-ECHO-RQ in one send: before, the C-ECHO was thrown away with the
    rest of the read and the node aborted after network_timeout_s of 'silence'."""
    rq = associate_rq(abstract=VERIFICATION, syntax=ImplicitVRLittleEndian)
    with socket.create_connection((LOOPBACK, fast.port), timeout=5) as s:
        s.sendall(rq + pdata_pdus(1, echo_rq(), 4096)[0])
        assert recv_pdu(s)[0] == A_ASSOCIATE_AC
        kind, body = recv_pdu(s)
        assert kind == P_DATA_TF and response_status(body) == 0x0000, (kind, body[:10])
        s.sendall(RELEASE_RQ_PDU)
        assert recv_pdu(s)[0] == A_RELEASE_RP
