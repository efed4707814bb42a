"""IHE ATNA audit logging (node/audit): the messages against the DICOM Audit Message Schema
(PS3.15 A.5.1) with libxml2's RELAX NG validator, the durable queue (order, once per
destination, the bound, SIGKILL), the UDP and file transports, and delivery to a real Debian
``rsyslogd`` over TLS (RFC 5425) across an outage of the receiver."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from segnode.node.audit import (
    Auditor,
    AuditSettings,
    NullAuditor,
    make_auditor,
    parse_destination,
)
from segnode.node.audit import messages as m
from segnode.node.audit.queue import AuditQueue
from segnode.node.audit.syslog import (
    BOM,
    MSGID,
    FileSyslog,
    MessageTooLarge,
    UdpSyslog,
    format_message,
    parse_message,
)
from segnode.node.audit.validate import validate
from tests.conftest import LOOPBACK, ROOT, free_port, wait_for
from tests.fixtures.rsyslog import Rsyslog

NODE = m.NodeIdentity(
    ae_title="SEGNODE",
    host_name="segnode-host",
    address="10.0.0.5",
    process_id="4242",
    source_id="segnode-site-1",
    enterprise_site="Radiology",
)
CT = "1.2.840.10008.5.1.4.1.1.2"
SEG = "1.2.840.10008.5.1.4.1.1.66.4"
HOSTILE = "Doe^John <b>&\"'\n\r\t\x00\x1b\ud800 end"


def every_message() -> dict[str, m.AuditMessage]:
    """One message of every builder (and variants)."""
    return {
        "start": m.application_activity(NODE, started=True),
        "stop-by-user": m.application_activity(NODE, started=False, user="root"),
        "refused": m.association_refused(
            NODE, calling_ae="INTRUDER", address="192.0.2.7", reason="calling AE not allowed"
        ),
        "in": m.instances_transferred(
            NODE,
            direction="in",
            peer_ae="CT01",
            peer_address="10.0.0.9",
            patient_id="PAT-1",
            patient_name="Doe^Jane",
            study_uid="1.2.3.4",
            sop_classes={CT: 120},
        ),
        "out-failed": m.instances_transferred(
            NODE,
            direction="out",
            peer_ae="PACS",
            peer_address="pacs.example.org",
            patient_id="PAT-1",
            patient_name=None,
            study_uid="1.2.3.4",
            sop_classes={SEG: 1, "1.2.840.10008.5.1.4.1.1.88.34": 0},
            outcome=m.MINOR_FAILURE,
            description="C-STORE status 0xA700",
        ),
        "deleted": m.study_deleted(
            NODE,
            patient_id="PAT-1",
            patient_name="Doe^Jane",
            study_uid="1.2.3.4",
            sop_classes={CT: 120},
            reason="retention: older than 30 days",
        ),
        "login-failed": m.user_authentication(
            NODE, user="admin", address="::1", success=False, description="wrong token"
        ),
        "hostile": m.instances_transferred(
            NODE,
            direction="in",
            peer_ae=HOSTILE,
            peer_address=HOSTILE,
            patient_id=HOSTILE,
            patient_name=HOSTILE,
            study_uid=HOSTILE,
            sop_classes={HOSTILE: 3},
            description=HOSTILE,
        ),
        **{
            f"alert-{kind}": m.security_alert(
                NODE,
                kind=kind,
                user="operator" if kind != "software_configuration" else None,
                address="192.0.2.8",
                description=f"{kind} event",
                outcome=m.SERIOUS_FAILURE if kind == "node_authentication" else m.SUCCESS,
            )
            for kind in m.SECURITY_ALERT_KINDS
        },
    }


MESSAGES = every_message()


def xml_of(message: m.AuditMessage) -> ET.Element:
    return ET.fromstring(message.to_xml())


def codes(root: ET.Element, path: str) -> list[str]:
    return [e.get("csd-code", "") for e in root.iterfind(path)]


# -- the messages against the schema -----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_every_builder_gives_a_schema_valid_message_on_one_line(name: str) -> None:
    xml = MESSAGES[name].to_xml()
    assert validate(xml) == [], xml.decode()
    assert b"\n" not in xml and b"\r" not in xml
    assert not xml.startswith(b"<?xml")
    xml.decode("utf-8")


@pytest.mark.parametrize(
    ("what", "old", "new"),
    [
        (
            "an outcome the schema does not know",
            b'EventOutcomeIndicator="0"',
            b'EventOutcomeIndicator="5"',
        ),
        ("no EventID", b"<EventID ", b"<EventTypeCode "),
        ("a code without its meaning", b' originalText="Application Activity"', b""),
        ("a date without a time", b'EventDateTime="', b'EventDateTime="2024-01-01 '),
        ("an unknown element", b"</AuditMessage>", b"<Extra/></AuditMessage>"),
        ("UserIsRequestor missing", b' UserIsRequestor="false"', b""),
    ],
)
def test_the_validator_rejects_a_broken_message(what: str, old: bytes, new: bytes) -> None:
    xml = MESSAGES["start"].to_xml()
    assert old in xml
    assert validate(xml.replace(old, new, 1)), what


def test_the_schema_puts_sop_classes_inside_the_description() -> None:
    """PS3.15 A.5.1.1: SOPClass is content of ParticipantObjectDescription, and a participant
    object needs a name (or a query)."""
    xml = MESSAGES["in"].to_xml()
    moved = xml.replace(b"<ParticipantObjectDescription>", b"").replace(
        b"</ParticipantObjectDescription>", b""
    )
    assert validate(moved)
    unnamed = xml.replace(b"<ParticipantObjectName>1.2.3.4</ParticipantObjectName>", b"")
    assert validate(unnamed)
    assert validate(b"<AuditMessage><oops") and validate(b"not xml")


def test_instances_transferred_names_source_destination_and_objects() -> None:
    received = xml_of(MESSAGES["in"])
    event = received.find("EventIdentification")
    assert event is not None
    assert event.get("EventActionCode") == "C" and event.get("EventOutcomeIndicator") == "0"
    assert codes(received, "EventIdentification/EventID") == ["110104"]
    peer, node = received.findall("ActiveParticipant")
    assert (peer.get("UserID"), peer.get("UserIsRequestor")) == ("CT01", "true")
    assert codes(peer, "RoleIDCode") == ["110153"]
    assert peer.get("NetworkAccessPointTypeCode") == "2"
    assert node.get("UserIsRequestor") == "false" and codes(node, "RoleIDCode") == ["110152"]
    assert node.get("AlternativeUserID") == "AETITLES=SEGNODE"
    source = received.find("AuditSourceIdentification")
    assert source is not None and source.get("AuditSourceID") == "segnode-site-1"
    assert source.get("AuditEnterpriseSiteID") == "Radiology"
    assert codes(source, "AuditSourceTypeCode") == ["4"]
    study, patient = received.findall("ParticipantObjectIdentification")
    assert (study.get("ParticipantObjectTypeCode"), study.get("ParticipantObjectTypeCodeRole")) == (
        "2",
        "3",
    )
    assert codes(study, "ParticipantObjectIDTypeCode") == ["110180"]
    [sop] = study.findall("ParticipantObjectDescription/SOPClass")
    assert (sop.get("UID"), sop.get("NumberOfInstances")) == (CT, "120")
    assert patient.get("ParticipantObjectID") == "PAT-1"
    assert codes(patient, "ParticipantObjectIDTypeCode") == ["2"]
    assert patient.findtext("ParticipantObjectName") == "Doe^Jane"

    sent = xml_of(MESSAGES["out-failed"])
    event = sent.find("EventIdentification")
    assert event is not None
    assert (event.get("EventActionCode"), event.get("EventOutcomeIndicator")) == ("R", "4")
    assert event.findtext("EventOutcomeDescription") == "C-STORE status 0xA700"
    node, peer = sent.findall("ActiveParticipant")
    assert node.get("UserIsRequestor") == "true" and codes(node, "RoleIDCode") == ["110153"]
    assert peer.get("UserIsRequestor") == "false" and codes(peer, "RoleIDCode") == ["110152"]
    assert peer.get("NetworkAccessPointTypeCode") == "1"  # a host name
    with pytest.raises(ValueError, match="direction"):
        m.instances_transferred(
            NODE,
            direction="sideways",  # type: ignore[arg-type]
            peer_ae="X",
            peer_address="x",
            patient_id="p",
            patient_name=None,
            study_uid="1",
            sop_classes={},
        )


def test_event_codes_of_every_builder() -> None:
    def event(name: str) -> tuple[str, list[str], list[str], str]:
        root = xml_of(MESSAGES[name])
        e = root.find("EventIdentification")
        assert e is not None
        return (
            codes(root, "EventIdentification/EventID")[0],
            codes(root, "EventIdentification/EventTypeCode"),
            codes(root, "ActiveParticipant/RoleIDCode"),
            f"{e.get('EventActionCode')}{e.get('EventOutcomeIndicator')}",
        )

    assert event("start") == ("110100", ["110120"], ["110150"], "E0")
    assert event("stop-by-user") == ("110100", ["110121"], ["110150", "110151"], "E0")
    assert event("refused") == ("110113", ["110126"], [], "E4")
    assert event("deleted")[0::3] == ("110105", "D0")
    assert event("login-failed")[:2] == ("110114", ["110122"])
    assert event("login-failed")[3] == "E4"
    assert event("alert-software_configuration")[:2] == ("110113", ["110131"])
    assert event("alert-security_configuration")[:2] == ("110113", ["110129"])
    assert event("alert-restricted_function")[:2] == ("110113", ["110132"])
    assert event("alert-node_authentication")[:2] == ("110113", ["110126"])
    with pytest.raises(ValueError, match="kind"):
        m.security_alert(NODE, kind="bogus", user=None, address=None, description="x")

    refused = xml_of(MESSAGES["refused"])
    peer = refused.findall("ActiveParticipant")[1]
    assert (peer.get("UserID"), peer.get("NetworkAccessPointID")) == ("INTRUDER", "192.0.2.7")
    [subject] = refused.findall("ParticipantObjectIdentification")
    assert codes(subject, "ParticipantObjectIDTypeCode") == ["110182"]
    detail = subject.find("ParticipantObjectDetail")
    assert detail is not None and detail.get("type") == "Alert Description"


def test_event_time_is_utc_with_milliseconds() -> None:
    e = xml_of(MESSAGES["start"]).find("EventIdentification")
    assert e is not None
    when = e.get("EventDateTime", "")
    assert when.endswith("Z") and len(when.split(".")[1]) == 4, when


def test_hostile_strings_stay_in_their_attribute() -> None:
    root = xml_of(MESSAGES["hostile"])
    patient = root.findall("ParticipantObjectIdentification")[1]
    assert patient.get("ParticipantObjectID") == m.clean(HOSTILE)
    assert "<b>" in (patient.findtext("ParticipantObjectName") or "")


# -- the queue ------------------------------------------------------------------------------


def test_queue_order_and_once_per_destination(tmp_path: Path) -> None:
    path = tmp_path / "audit.sqlite"
    q = AuditQueue(path, ["a", "b"], max_messages=100)
    for i in range(10):
        assert q.enqueue(f"m{i}".encode(), 5)
    first = q.fetch("a", 4)
    assert [x.payload for x in first] == [b"m0", b"m1", b"m2", b"m3"]
    q.ack("a", first[-1].seq)
    assert [x.payload for x in q.fetch("a", 100)] == [f"m{i}".encode() for i in range(4, 10)]
    q.ack("a", q.fetch("a", 100)[-1].seq)
    assert q.fetch("a", 100) == []
    assert q.count() == 10  # b has been sent nothing yet
    q.ack("b", q.fetch("b", 5)[-1].seq)
    assert q.count() == 5 and q.pending("b") == 5 and q.pending("a") == 0
    q.close()

    # After a restart, b goes on where it was; a new destination c gets what is still stored.
    q = AuditQueue(path, ["a", "b", "c"], max_messages=100)
    assert [x.payload for x in q.fetch("b", 100)] == [f"m{i}".encode() for i in range(5, 10)]
    assert len(q.fetch("c", 100)) == 5
    q.enqueue(b"m10", 4)
    assert [x.payload for x in q.fetch("a", 100)] == [b"m10"]
    assert q.fetch("a", 1)[0].severity == 4
    q.close()

    # A destination no longer configured holds nothing back.
    q = AuditQueue(path, ["a"], max_messages=100)
    q.ack("a", q.fetch("a", 100)[-1].seq)
    assert q.count() == 0
    q.close()


def test_queue_drop_oldest_logs_once_per_episode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    q = AuditQueue(tmp_path / "audit.sqlite", ["a"], max_messages=5, on_full="drop_oldest")
    with caplog.at_level("WARNING", logger="segnode.node.audit.queue"):
        for i in range(8):
            assert q.enqueue(f"m{i}".encode(), 5)
    assert [x.payload for x in q.fetch("a", 100)] == [f"m{i}".encode() for i in range(3, 8)]
    assert q.dropped == 3 and not q.refused
    assert sum("AUDIT QUEUE FULL" in r.message for r in caplog.records) == 1
    q.ack("a", q.fetch("a", 100)[-1].seq)
    caplog.clear()
    with caplog.at_level("WARNING", logger="segnode.node.audit.queue"):
        q.enqueue(b"again", 5)
    assert any("below its bound" in r.message for r in caplog.records)
    q.close()


def test_queue_refuses_when_full(tmp_path: Path) -> None:
    q = AuditQueue(tmp_path / "audit.sqlite", ["a"], max_messages=3, on_full="refuse")
    assert all(q.enqueue(b"x", 5) for _ in range(3))
    assert q.full()
    assert not q.enqueue(b"lost", 5)
    assert q.refused == 1 and q.dropped == 0
    q.ack("a", q.fetch("a", 1)[0].seq)
    assert not q.full() and q.enqueue(b"y", 5)
    q.close()


WRITER = """
import sys
from pathlib import Path
from segnode.node.audit.queue import AuditQueue
q = AuditQueue(Path(sys.argv[1]), ["a"], max_messages=1000000)
i = 0
while True:
    q.enqueue(b"message %d" % i, 5)
    print(i, flush=True)
    i += 1
"""


def test_an_enqueued_message_survives_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "audit.sqlite"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    confirmed = -1
    try:
        for line in writer.stdout:
            confirmed = int(line)
            if confirmed >= 200:
                break
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    q = AuditQueue(path, ["a"], max_messages=1000000)
    stored = [x.payload for x in q.fetch("a", 100000)]
    q.close()
    assert len(stored) > confirmed
    assert stored[: confirmed + 1] == [b"message %d" % i for i in range(confirmed + 1)]


# -- transports and destinations ----------------------------------------------------------


def frame(message: m.AuditMessage, created: float | None = None) -> bytes:
    from datetime import UTC, datetime

    return format_message(
        message.to_xml(),
        severity=message.severity,
        hostname="test-host",
        app_name="segnode",
        procid="77",
        timestamp=datetime.fromtimestamp(created or time.time(), UTC),
    )


def check_syslog(data: bytes, severity: int = 5) -> bytes:
    """The audit XML of one RFC 5424 message, after checking its header."""
    parsed = parse_message(data)
    assert (parsed.facility, parsed.severity, parsed.version) == (10, severity, 1)
    assert (parsed.msgid, parsed.structured_data, parsed.bom) == (MSGID, "-", True)
    assert parsed.app_name == "segnode" and parsed.timestamp.endswith("Z")
    assert validate(parsed.msg) == []
    return parsed.msg


def test_udp_transport_one_datagram_per_message() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind((LOOPBACK, 0))
        server.settimeout(5)
        udp = UdpSyslog(LOOPBACK, server.getsockname()[1])
        sent = [frame(MESSAGES["in"]), frame(MESSAGES["out-failed"])]
        udp.send(sent)
        got = [server.recvfrom(65535)[0] for _ in sent]
        udp.close()
    assert got == sent
    check_syslog(got[0], severity=5)
    check_syslog(got[1], severity=4)
    big = m.instances_transferred(
        NODE,
        direction="in",
        peer_ae="CT",
        peer_address="10.0.0.9",
        patient_id="P",
        patient_name=None,
        study_uid="1.2",
        sop_classes={f"1.2.{i}": 1 for i in range(2000)},
    )
    with pytest.raises(MessageTooLarge, match="65000"):
        UdpSyslog(LOOPBACK, 9).send([frame(big)])


def test_file_transport_one_line_per_message(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "audit.log"
    f = FileSyslog(path)
    f.send([frame(MESSAGES["start"]), frame(MESSAGES["hostile"])])
    f.send([frame(MESSAGES["deleted"])])
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 4
    for line in lines[:-1]:
        assert line.split(b" ", 7)[7].startswith(BOM)
        check_syslog(line)


@pytest.mark.parametrize(
    ("url", "kind", "host", "port", "path"),
    [
        ("syslog+tls://audit.example.org:6514", "tls", "audit.example.org", 6514, None),
        ("syslog+tls://audit.example.org", "tls", "audit.example.org", 6514, None),
        ("syslog+udp://[::1]:5514", "udp", "::1", 5514, None),
        ("syslog+udp://10.0.0.1", "udp", "10.0.0.1", 514, None),
        ("file:///var/log/segnode/audit.log", "file", "", 0, Path("/var/log/segnode/audit.log")),
        ("file:audit/audit.log", "file", "", 0, Path("audit/audit.log")),
    ],
)
def test_parse_destination(url: str, kind: str, host: str, port: int, path: Path | None) -> None:
    d = parse_destination(url)
    assert (d.kind, d.host, d.port, d.path) == (kind, host, port, path)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("syslog://host:514", "syslog\\+tls://"),
        ("http://host", "syslog\\+tls://"),
        ("syslog+tls://:6514", "host is missing"),
        ("syslog+tls://host:99999", "port"),
        ("syslog+tls://host:0", "port"),
        ("syslog+tls://host:abc", "port"),
        ("syslog+udp://host:514/path", "only HOST:PORT"),
        ("syslog+tls://user@host:6514", "user"),
        ("file://server/share/audit.log", "no host"),
        ("file:///var/log/", "file name"),
        ("", "syslog\\+tls://"),
    ],
)
def test_parse_destination_says_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_destination(url)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="on_full"):
        AuditSettings(on_full="block")
    with pytest.raises(ValueError, match="max_queued"):
        AuditSettings(max_queued=0)
    with pytest.raises(ValueError, match="names no destination"):
        AuditSettings(enabled=True)
    with pytest.raises(ValueError, match=r"audit.destinations\[1\]"):
        AuditSettings(destinations=("file:a.log", "ftp://x"))
    with pytest.raises(ValueError, match="twice"):
        AuditSettings(destinations=("file:a.log", "file:a.log"))
    with pytest.raises(ValueError, match="tls_key"):
        AuditSettings(tls_key=Path("k.pem"))


# -- the auditor --------------------------------------------------------------------------


def test_null_auditor_does_nothing(tmp_path: Path) -> None:
    auditor = make_auditor(AuditSettings(), tmp_path)
    assert isinstance(auditor, NullAuditor)
    auditor.start()
    auditor.emit(MESSAGES["start"])
    assert auditor.admits() and auditor.status()["enabled"] is False
    auditor.stop()
    assert list(tmp_path.iterdir()) == []


def test_auditor_writes_a_file_and_stops_promptly(tmp_path: Path) -> None:
    closed = free_port()  # nothing listens: every attempt is refused
    settings = AuditSettings(
        enabled=True,
        destinations=("file:audit.log", f"syslog+tls://{LOOPBACK}:{closed}"),
    )
    auditor = make_auditor(settings, tmp_path)
    assert isinstance(auditor, Auditor)
    auditor.emit(MESSAGES["start"])  # before start: kept, sent once started
    auditor.start()
    for name in ("in", "deleted", "hostile"):
        auditor.emit(MESSAGES[name])
    log = tmp_path / "audit.log"
    wait_for(lambda: log.exists() and log.read_bytes().count(b"\n") == 4, 10, "4 lines")
    got = [check_syslog(line, severity=5) for line in log.read_bytes().splitlines()]
    assert got == [MESSAGES[n].to_xml() for n in ("start", "in", "deleted", "hostile")]
    tls = f"syslog+tls://{LOOPBACK}:{closed}"
    wait_for(lambda: auditor.status()["destinations"][tls]["last_error"], 10, "a TLS failure")
    status = auditor.status()
    assert status["queued"] == 4 and status["sent"] == 4
    assert status["destinations"]["file:audit.log"]["pending"] == 0
    assert status["destinations"][tls]["pending"] == 4
    assert status["destinations"][tls]["connected"] is False
    assert "Connection refused" in status["destinations"][tls]["last_error"]
    began = time.monotonic()
    auditor.stop(timeout=1.0)
    assert time.monotonic() - began < 3.0
    auditor.emit(MESSAGES["start"])  # after stop: logged, never raised

    # What the TLS destination was not sent is still queued at the next start.
    q = AuditQueue(tmp_path / "audit.sqlite", settings.destinations, max_messages=10)
    assert q.pending(tls) == 4 and q.pending("file:audit.log") == 0
    q.close()


def test_auditor_over_udp_skips_only_a_message_too_large(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    big = m.instances_transferred(
        NODE,
        direction="in",
        peer_ae="CT",
        peer_address="10.0.0.9",
        patient_id="P",
        patient_name=None,
        study_uid="1.2",
        sop_classes={f"1.2.{i}": 1 for i in range(2000)},
    )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind((LOOPBACK, 0))
        server.settimeout(10)
        url = f"syslog+udp://{LOOPBACK}:{server.getsockname()[1]}"
        auditor = Auditor(AuditSettings(enabled=True, destinations=(url,)), tmp_path)
        auditor.start()
        for message in (MESSAGES["start"], big, MESSAGES["refused"]):
            auditor.emit(message)
        got = [server.recvfrom(65535)[0] for _ in range(2)]
        wait_for(lambda: auditor.status()["queued"] == 0, 10, "an empty queue")
        auditor.stop()
    assert [check_syslog(got[0], 5), check_syslog(got[1], 4)] == [
        MESSAGES["start"].to_xml(),
        MESSAGES["refused"].to_xml(),
    ]
    assert auditor.status()["sent"] == 2
    assert any("over the 65000-byte limit" in r.message for r in caplog.records)


def test_auditor_refuses_when_full(tmp_path: Path) -> None:
    settings = AuditSettings(
        enabled=True,
        destinations=(f"syslog+udp://{LOOPBACK}:9",),
        max_queued=2,
        on_full="refuse",
    )
    auditor = Auditor(settings, tmp_path)  # not started: nothing leaves the queue
    auditor.emit(MESSAGES["start"])
    assert auditor.admits()
    auditor.emit(MESSAGES["start"])
    assert not auditor.admits()
    auditor.emit(MESSAGES["start"])
    assert auditor.status()["refused"] == 1 and auditor.status()["queued"] == 2
    auditor.stop()


# -- a real rsyslogd over TLS ----------------------------------------------------------------


def marked(i: int) -> m.AuditMessage:
    return m.instances_transferred(
        NODE,
        direction="in",
        peer_ae="CT01",
        peer_address="10.0.0.9",
        patient_id="PAT-1",
        patient_name="Doe^Jane",
        study_uid="1.2.3.4",
        sop_classes={CT: i + 1},
        description=f"message {i}",
    )


def descriptions(lines: list[bytes]) -> list[str]:
    return [
        ET.fromstring(check_syslog(line)).findtext("EventIdentification/EventOutcomeDescription")
        or ""
        for line in lines
    ]


def test_rsyslog_over_tls_gets_every_message_once_in_order(
    rsyslog: Rsyslog, tmp_path: Path
) -> None:
    pki = tmp_path / "pki"
    url = f"syslog+tls://{LOOPBACK}:{rsyslog.port}"
    settings = AuditSettings(
        enabled=True,
        destinations=(url,),
        tls_ca=pki / "ca.pem",
        tls_cert=pki / "client.pem",
        tls_key=pki / "client.key",
    )
    auditor = Auditor(settings, tmp_path / "data", hostname="segnode-host")
    auditor.start()
    try:
        for i in range(5):
            auditor.emit(marked(i))
        wait_for(lambda: len(rsyslog.messages()) >= 5, 15, "5 messages at rsyslogd")
        assert auditor.status()["destinations"][url]["connected"] is True

        rsyslog.stop()
        for i in range(5, 10):
            auditor.emit(marked(i))
        wait_for(lambda: auditor.status()["destinations"][url]["last_error"], 10, "a failure")
        assert auditor.status()["destinations"][url]["pending"] == 5
        rsyslog.start()  # the same port
        wait_for(lambda: len(rsyslog.messages()) >= 10, 30, "10 messages at rsyslogd")
        wait_for(lambda: auditor.status()["queued"] == 0, 10, "an empty queue")
    finally:
        auditor.stop()
    assert descriptions(rsyslog.messages()) == [f"message {i}" for i in range(10)]
    status = auditor.status()
    assert status["sent"] == 10 and status["dropped"] == 0


def test_tls_verifies_the_server_certificate(rsyslog: Rsyslog, tmp_path: Path) -> None:
    url = f"syslog+tls://{LOOPBACK}:{rsyslog.port}"
    settings = AuditSettings(
        enabled=True,
        destinations=(url,),
        tls_ca=tmp_path / "pki" / "other-ca.pem",
        tls_cert=tmp_path / "pki" / "client.pem",
        tls_key=tmp_path / "pki" / "client.key",
    )
    auditor = Auditor(settings, tmp_path / "data", hostname="segnode-host")
    auditor.start()
    try:
        auditor.emit(marked(0))
        error: Any = wait_for(
            lambda: auditor.status()["destinations"][url]["last_error"], 10, "a TLS failure"
        )
    finally:
        auditor.stop(timeout=0.5)
    assert "CERTIFICATE_VERIFY_FAILED" in error
    assert rsyslog.messages() == []
