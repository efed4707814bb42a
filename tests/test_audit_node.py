"""The audit trail of a running node (``[audit]``): ``segnode serve``, DCMTK ``storescu`` and
``echoscu`` as the modality, Orthanc as the PACS, Debian's ``rsyslogd`` over TLS as the audit
record repository. Every message that arrives is parsed as RFC 5424 and validated against the
DICOM audit message schema (PS3.15 A.5.1) by libxml2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from pydicom import dcmread

from scripts.harness import storescu_args
from segnode.node.audit.syslog import MSGID, parse_message
from segnode.node.audit.validate import validate
from tests.conftest import LOOPBACK, Orthanc, free_port, require_tool, wait_for
from tests.fixtures.rsyslog import Rsyslog
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series

pytestmark = pytest.mark.interop

PATIENT_ID = "PID-AUDIT-4417"
SERIES = PhantomGeometry(rows=64, columns=64, slices=8)
CT = "1.2.840.10008.5.1.4.1.1.2"
SEG = "1.2.840.10008.5.1.4.1.1.66.4"
TOKEN = "audit-test-token-0123456789abcdef0123"


def audit_section(rsyslog: Rsyslog, pki: Path) -> dict[str, Any]:
    return {
        "enabled": True,
        "destinations": [f"syslog+tls://{LOOPBACK}:{rsyslog.port}"],
        "ca_file": str(pki / "ca.pem"),
        "cert_file": str(pki / "client.pem"),
        "key_file": str(pki / "client.key"),
    }


def received(rsyslog: Rsyslog) -> list[ET.Element]:
    """Every message the repository holds, checked (RFC 5424 header, schema) and parsed."""
    out = []
    for line in rsyslog.messages():
        parsed = parse_message(line)
        assert (parsed.facility, parsed.msgid, parsed.app_name) == (10, MSGID, "segnode")
        assert validate(parsed.msg) == [], parsed.msg.decode()
        out.append(ET.fromstring(parsed.msg))
    return out


def kind(root: ET.Element) -> str:
    """``EventID`` and its first ``EventTypeCode``, e.g. ``110100/110120``."""
    ev = root.find("EventIdentification")
    assert ev is not None
    event_id = ev.find("EventID")
    types = ev.findall("EventTypeCode")
    assert event_id is not None
    return "/".join([event_id.get("csd-code", ""), *(t.get("csd-code", "") for t in types[:1])])


def outcome(root: ET.Element) -> str:
    ev = root.find("EventIdentification")
    assert ev is not None
    return ev.get("EventOutcomeIndicator", "")


def action_code(root: ET.Element) -> str:
    ev = root.find("EventIdentification")
    assert ev is not None
    return ev.get("EventActionCode", "")


def description(root: ET.Element) -> str:
    return root.findtext("EventIdentification/EventOutcomeDescription") or ""


def objects(root: ET.Element) -> dict[str, ET.Element]:
    """Participant objects by their ID type code (2: patient, 110180: study, 110182: node)."""
    out = {}
    for o in root.iterfind("ParticipantObjectIdentification"):
        code = o.find("ParticipantObjectIDTypeCode")
        assert code is not None
        out[code.get("csd-code", "")] = o
    return out


def sop_classes(root: ET.Element) -> dict[str, int]:
    study = objects(root)["110180"]
    return {
        c.get("UID", ""): int(c.get("NumberOfInstances", "0"))
        for c in study.iterfind("ParticipantObjectDescription/SOPClass")
    }


def roles(root: ET.Element) -> dict[str, str]:
    """Active participants' UserID by role code (110153 source, 110152 destination)."""
    out = {}
    for p in root.iterfind("ActiveParticipant"):
        for r in p.iterfind("RoleIDCode"):
            out[r.get("csd-code", "")] = p.get("UserID", "")
    return out


def send(port: int, folder: Path, calling: str = "MODALITY") -> None:
    exe = require_tool("storescu")
    done = subprocess.run(
        storescu_args(port, folder, calling=calling, exe=exe),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def post(url: str, token: str | None = None) -> int:
    req = urllib.request.Request(url, method="POST", data=b"")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_series_end_to_end_is_audited_to_rsyslog_over_tls(
    rsyslog: Rsyslog, orthanc: Orthanc, make_node: Any, tmp_path: Path
) -> None:
    token = tmp_path / "web-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    web_port = free_port()
    node = make_node(
        audit=audit_section(rsyslog, tmp_path / "pki"),
        dispatch={"destinations": [orthanc.peer]},
        node={"allowed_calling_aes": ["MODALITY"]},
        web={"enabled": True, "listen": f"{LOOPBACK}:{web_port}", "token_file": str(token)},
    )
    files = write_synthetic_series(tmp_path / "series", SERIES, seed=33, patient_id=PATIENT_ID)
    study_uid = str(dcmread(files[0], stop_before_pixels=True).StudyInstanceUID)
    send(node.port, tmp_path / "series")
    wait_for(lambda: [j["state"] for j in node.jobs()["jobs"]] == ["sent"], 120, "the job sent")

    # an unknown calling AE: refused (a Security Alert, Node Authentication)
    echo = subprocess.run(
        [require_tool("echoscu"), "-aet", "INTRUDER", "-aec", "SEGNODE", LOOPBACK, str(node.port)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert echo.returncode != 0
    # a peer that sends garbage instead of an A-ASSOCIATE-RQ: cut off (Security Alert)
    with socket.create_connection((LOOPBACK, node.port), timeout=10) as raw:
        raw.sendall(b"\x09\x00\x00\x00\x00\x04junk")
        raw.recv(64)  # the node's A-ABORT, or the close
    # a console retry without the token: 401 (User Authentication, failed)
    assert post(f"http://{LOOPBACK}:{web_port}/api/v1/jobs/1/retry") == 401
    # with it: refused, the job is not failed (Use of Restricted Function, the outcome said)
    assert post(f"http://{LOOPBACK}:{web_port}/api/v1/jobs/1/retry", TOKEN) == 409
    # the command line's cancel (the job is sent: refused), audited through the node's queue
    assert node.cli("cancel", "1").returncode == 1
    pid = str(node.pid)  # the node's UserID in its messages
    node.stop()

    want = {"110100/110120", "110113/110131", "110104", "110113/110126", "110114/110122"}
    want |= {"110113/110132", "110100/110121"}
    wait_for(
        lambda: want <= {kind(r) for r in received(rsyslog)},
        60,
        "every expected message at the repository",
    )
    got = received(rsyslog)
    kinds = [kind(r) for r in got]
    assert kinds[0] == "110100/110120" and kinds[-1] == "110100/110121", kinds

    transfers = [r for r in got if kind(r) == "110104"]
    inbound = [r for r in transfers if action_code(r) == "C"]
    outbound = [r for r in transfers if action_code(r) == "R"]
    assert len(inbound) == 1 and len(outbound) >= 1, kinds
    r = inbound[0]
    assert objects(r)["2"].get("ParticipantObjectID") == PATIENT_ID
    assert objects(r)["110180"].get("ParticipantObjectID") == study_uid
    assert sop_classes(r) == {CT: SERIES.slices}
    assert roles(r) == {"110153": "MODALITY", "110152": pid}
    assert outcome(r) == "0"

    sent = {uid: n for r in outbound for uid, n in sop_classes(r).items() if n}
    assert sent.get(SEG) == 1 and len(sent) == 2, sent  # the SEG and the SR
    for r in outbound:
        assert objects(r)["2"].get("ParticipantObjectID") == PATIENT_ID
        assert objects(r)["110180"].get("ParticipantObjectID") == study_uid
        assert roles(r)["110152"] == orthanc.aet and outcome(r) == "0"

    alerts = [r for r in got if kind(r) == "110113/110126"]
    refusal = next(r for r in alerts if "INTRUDER" in ET.tostring(r).decode())
    cut = next(r for r in alerts if "cut off" in description(r))
    assert "unrecognised PDU type 0x09" in description(cut) and outcome(cut) == "4"
    assert outcome(r) == "0" and outcome(refusal) == "4"
    assert "INTRUDER" in ET.tostring(refusal).decode()
    assert "calling AE title not recognised (1/1/3)" in description(refusal)
    login = next(r for r in got if kind(r) == "110114/110122")
    assert outcome(login) == "4" and "missing bearer token" in description(login)
    actions = [description(r) for r in got if kind(r) == "110113/110132"]
    assert any("job 1: retry: refused" in d for d in actions), actions
    assert any("job 1: cancel: refused" in d for d in actions), actions
    config = next(r for r in got if kind(r) == "110113/110131")
    assert "first start with auditing" in description(config)
    # the node's log names no patient (the audit repository does)
    assert PATIENT_ID not in node.log()


def test_an_outage_and_a_kill_lose_no_message(
    rsyslog: Rsyslog, make_node: Any, tmp_path: Path
) -> None:
    """The repository is down while 5 series arrive; the node is killed (SIGKILL) during the
    outage and started again; when the repository returns, every message arrives once and in
    order. ``SEGNODE_AUDIT_OUTAGE_S`` sets the outage (the acceptance run: 120)."""
    outage = float(os.environ.get("SEGNODE_AUDIT_OUTAGE_S", "3"))
    node = make_node(audit=audit_section(rsyslog, tmp_path / "pki"))
    wait_for(lambda: len(received(rsyslog)) >= 2, 30, "the start's messages")
    rsyslog.stop()
    down = time.monotonic()
    studies = []
    for k in range(5):
        folder = tmp_path / f"series-{k}"
        files = write_synthetic_series(folder, SERIES, seed=100 + k, patient_id=f"PID-{k}")
        studies.append(str(dcmread(files[0], stop_before_pixels=True).StudyInstanceUID))
        send(node.port, folder)
    queued = node.data_dir / "audit.sqlite"
    assert queued.exists()
    node.kill()  # during the outage, with the messages queued
    node.start()
    status = node.cli("status")
    assert status.returncode == 0, status.stderr
    [waiting] = json.loads(status.stdout)["audit"]["waiting"].values()
    assert waiting["messages"] >= 5 + 2 and waiting["oldest_s"] > 0, waiting
    time.sleep(max(0.0, outage - (time.monotonic() - down)))
    rsyslog.start()
    # 2 at the first start; 5 transfers; start and configuration of the second run
    wait_for(lambda: len(received(rsyslog)) >= 2 + 5 + 2, 90, "every queued message")
    node.stop()
    wait_for(lambda: len(received(rsyslog)) >= 10, 30, "the stop")
    time.sleep(1.0)  # nothing more may come
    got = received(rsyslog)
    raw = rsyslog.messages()
    assert len(raw) == len(set(raw)) == 10, [kind(r) for r in got]
    kinds = [kind(r) for r in got]
    assert kinds == [
        "110100/110120",
        "110113/110131",
        *["110104"] * 5,
        "110100/110120",
        "110113/110131",
        "110100/110121",
    ], kinds
    assert [objects(r)["110180"].get("ParticipantObjectID") for r in got[2:7]] == studies
    assert [objects(r)["2"].get("ParticipantObjectID") for r in got[2:7]] == [
        f"PID-{k}" for k in range(5)
    ]
    assert "unchanged since the last start" in description(got[8])


def test_a_failed_tls_handshake_and_a_flood_of_refusals_are_alerts(
    make_node: Any, tmp_path: Path
) -> None:
    """To a file destination: a TLS client without a certificate is a Security Alert; twenty
    refusals of one host within the interval are one alert, and the stop says how many more."""
    import ssl

    from tests.fixtures.rsyslog import make_pki

    pki = tmp_path / "pki"
    make_pki(pki)
    log = tmp_path / "audit.log"
    port = free_port()
    node = make_node(
        audit={"enabled": True, "destinations": [f"file:{log}"]},
        tls={
            "enabled": True,
            "port": port,
            "cert_file": str(pki / "server.pem"),
            "key_file": str(pki / "server.key"),
            "ca_file": str(pki / "ca.pem"),
            "require_client_cert": True,
        },
        node={"allowed_calling_aes": ["MODALITY"]},
    )
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    with (
        pytest.raises((ssl.SSLError, ConnectionError, OSError)),
        socket.create_connection((LOOPBACK, port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(b"\x01\x00")
        tls.recv(16)  # TLS 1.3: the refusal of the missing certificate comes here
    for _ in range(20):
        subprocess.run(
            [require_tool("echoscu"), "-aet", "INTRUDER", LOOPBACK, str(node.port)],
            capture_output=True,
            timeout=30,
        )
    node.stop()
    lines = [parse_message(x) for x in log.read_bytes().splitlines()]
    for p in lines:
        assert validate(p.msg) == [], p.msg.decode()
    got = [ET.fromstring(p.msg) for p in lines]
    alerts = [description(r) for r in got if kind(r) == "110113/110126"]
    assert any("TLS handshake failed" in d for d in alerts), alerts
    refusals = [d for d in alerts if "calling AE title not recognised" in d]
    assert len(refusals) == 1, alerts  # one per interval; the rest counted
    assert any("19 more refusal of 127.0.0.1" in d for d in alerts), alerts


def test_retention_deleting_a_series_is_a_study_deleted(make_node: Any, tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    node = make_node(
        audit={"enabled": True, "destinations": [f"file:{log}"]},
        retention={"spool_days": 1e-5, "check_interval_s": 1},  # about a second
    )
    files = write_synthetic_series(tmp_path / "series", SERIES, seed=71, patient_id=PATIENT_ID)
    study_uid = str(dcmread(files[0], stop_before_pixels=True).StudyInstanceUID)
    send(node.port, tmp_path / "series")

    def deleted() -> list[ET.Element]:
        if not log.exists():
            return []
        got = [ET.fromstring(parse_message(x).msg) for x in log.read_bytes().splitlines()]
        return [r for r in got if kind(r) == "110105"]

    [r] = wait_for(deleted, 60, "the Study Deleted message")
    node.stop()
    assert validate(ET.tostring(r)) == []
    assert action_code(r) == "D" and outcome(r) == "0"
    assert objects(r)["2"].get("ParticipantObjectID") == PATIENT_ID
    assert objects(r)["110180"].get("ParticipantObjectID") == study_uid
    assert sop_classes(r) == {CT: SERIES.slices}
    assert "retention: series" in description(r) and "file(s) deleted" in description(r)
    assert not list((node.data_dir / "spool").rglob("*.dcm"))
