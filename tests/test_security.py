"""Security: DICOM TLS both ways, refusals, no patient data in logs, private files.

Certificates are made for each test session with the ``openssl`` command line: a test CA, a
server certificate for ``localhost``/127.0.0.1, a client certificate from the same CA, and a
self-signed "rogue" client certificate.
"""

from __future__ import annotations

import random
import socket
import ssl
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydicom import dcmread
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, generate_uid
from pynetdicom import AE

from scripts.harness import CountingSCP, NodeRunner, free_port, send_files, write_config
from segnode.node.config import TLSConfig
from segnode.node.dicom.tls import server_context
from segnode.node.outbox.scu import Dispatcher
from segnode.storage.ledger import Ledger
from tests.conftest import LOOPBACK, require_tool, wait_for
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.scp_harness import SCPHarness, store
from tests.test_outbox import encoded_job, outbox_config


@dataclass(frozen=True)
class PKI:
    """Files of the test PKI."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path

    def client(
        self, cert: Path | None = None, key: Path | None = None, ca: Path | None = None
    ) -> tuple[ssl.SSLContext, str]:
        """``tls_args`` for a pynetdicom SCU."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca or self.ca))
        if cert is not None:
            ctx.load_cert_chain(str(cert), str(key))
        return ctx, "localhost"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    require_tool("openssl")
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"),
        "-days", "2", "-subj", "/CN=segnode test CA",
    )  # fmt: skip

    def issue(name: str, ext: str) -> None:
        (d / f"{name}.ext").write_text(ext)
        _openssl(
            "req", *ec, "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"),
            "-subj", f"/CN={name}",
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"),
            "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-out", str(d / f"{name}.pem"),
            "-days", "2", "-extfile", str(d / f"{name}.ext"),
        )  # fmt: skip

    issue(
        "server",
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "extendedKeyUsage=serverAuth\n",
    )
    issue("client", "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
    _openssl(
        "req", "-x509", *ec, "-keyout", str(d / "rogue.key"), "-out", str(d / "rogue.pem"),
        "-days", "2", "-subj", "/CN=rogue",
    )  # fmt: skip
    return PKI(
        d / "ca.pem",
        d / "server.pem",
        d / "server.key",
        d / "client.pem",
        d / "client.key",
        d / "rogue.pem",
        d / "rogue.key",
    )


@pytest.fixture(scope="module")
def series(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_synthetic_series(
        tmp_path_factory.mktemp("sec"), PhantomGeometry(rows=64, columns=64, slices=4), seed=501
    )


def tls_raw(pki: PKI, **extra: object) -> dict[str, object]:
    return {
        "tls": {
            "enabled": True,
            "cert_file": str(pki.server_cert),
            "key_file": str(pki.server_key),
            "ca_file": str(pki.ca),
            **extra,
        }
    }


@pytest.fixture
def tls_node(tmp_path: Path, pki: PKI) -> Iterator[SCPHarness]:
    h = SCPHarness(tmp_path / "n", tls_raw(pki, require_client_cert=True))
    yield h
    h.close()


def test_tls_with_client_certificate_accepted(
    tls_node: SCPHarness, pki: PKI, series: list[Path]
) -> None:
    a = tls_node.assoc(tls_args=pki.client(pki.client_cert, pki.client_key))
    assert a.is_established
    assert int(a.send_c_echo().Status) == 0
    assert store(a, series[0]) == 0
    a.release()
    assert tls_node.ledger.counts()["instances"] == 1


def test_tls_refusals(tls_node: SCPHarness, pki: PKI) -> None:
    # No client certificate while one is required.
    assert not tls_node.assoc(tls_args=pki.client(), timeout=5).is_established
    # A certificate from another CA.
    rogue = pki.client(pki.rogue_cert, pki.rogue_key)
    assert not tls_node.assoc(tls_args=rogue, timeout=5).is_established
    # Plain TCP on the TLS port.
    assert not tls_node.assoc(timeout=5).is_established
    # A client that does not trust our server certificate gives up itself.
    untrusting = pki.client(pki.client_cert, pki.client_key, ca=pki.rogue_cert)
    assert not tls_node.assoc(tls_args=untrusting, timeout=5).is_established
    # TLS older than 1.2 is not offered.
    ctx = server_context(
        TLSConfig(enabled=True, cert_file=pki.server_cert, key_file=pki.server_key)
    )
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode == ssl.CERT_NONE
    # The node still serves a good client after all that.
    good = tls_node.assoc(tls_args=pki.client(pki.client_cert, pki.client_key))
    assert good.is_established
    good.release()


def test_silent_client_does_not_block_the_tls_listener(tls_node: SCPHarness, pki: PKI) -> None:
    """The TLS handshake runs in the connection's thread, not in the accept loop."""
    with socket.create_connection((LOOPBACK, tls_node.port)) as idle:
        idle.settimeout(1)
        t0 = time.monotonic()
        a = tls_node.assoc(tls_args=pki.client(pki.client_cert, pki.client_key), timeout=5)
        assert a.is_established and time.monotonic() - t0 < 3
        a.release()


def test_tls_on_its_own_port_keeps_plain_port(tmp_path: Path, pki: PKI, series: list[Path]) -> None:
    h = SCPHarness(tmp_path / "n", tls_raw(pki, port=free_port()))
    try:
        assert h.scp.tls_port is not None and h.scp.tls_port != h.port
        plain = h.assoc()
        assert plain.is_established and store(plain, series[0]) == 0
        plain.release()
        secure = h.assoc(port=h.scp.tls_port, tls_args=pki.client())
        assert secure.is_established and store(secure, series[1]) == 0
        secure.release()
        assert not h.assoc(port=h.scp.tls_port, timeout=5).is_established
    finally:
        h.close()


def test_unknown_calling_ae_refused(tmp_path: Path, pki: PKI) -> None:
    h = SCPHarness(
        tmp_path / "n", {**tls_raw(pki), "node": {"allowed_calling_aes": ["CT_SCANNER"]}}
    )
    try:
        a = h.assoc("STRANGER", tls_args=pki.client())
        assert a.is_rejected
        b = h.assoc("CT_SCANNER", tls_args=pki.client())
        assert b.is_established
        b.release()
    finally:
        h.close()


def test_outgoing_tls_delivers_once(tmp_path: Path, pki: PKI) -> None:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(str(pki.server_cert), str(pki.server_key))
    server.load_verify_locations(cafile=str(pki.ca))
    server.verify_mode = ssl.CERT_REQUIRED
    scp = CountingSCP(ssl_context=server).start()
    good = {
        "peer": scp.peer,
        "tls": True,
        "ca_file": str(pki.ca),
        "cert_file": str(pki.client_cert),
        "key_file": str(pki.client_key),
        "server_name": "localhost",
    }
    bare = {"peer": scp.peer, "tls": True, "ca_file": str(pki.ca), "server_name": "localhost"}
    try:
        for name, dest, sent in (("bare", bare, 0), ("good", good, 2)):
            led = Ledger(tmp_path / name / "ledger.sqlite")
            try:
                job = encoded_job(led, tmp_path / name, [scp.peer])
                d = Dispatcher(outbox_config(tmp_path, [dest]), led, rng=random.Random(1))
                assert d.run_once() == sent, name
                assert led.job_state(job) == ("sent" if sent else "encoded")
                if not sent:  # our client certificate missing: refused, no attempt used
                    view = led.job(job)
                    assert view is not None and [a for *_, a in view.deliveries] == [0, 0]
                    assert scp.counts() == {}
            finally:
                led.close()
    finally:
        scp.stop()
    assert sorted(scp.counts().values()) == [1, 1]


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[NodeRunner, CountingSCP, str]:
    """A node subprocess at DEBUG level fed good, bad and foreign data with a patient name."""
    base = tmp_path_factory.mktemp("e2e")
    secret_name, secret_id = "ZZTOPSECRET^ALICE", "PIDXYZ987"
    files = write_synthetic_series(
        base / "good",
        PhantomGeometry(rows=64, columns=64, slices=6),
        seed=502,
        patient_id=secret_id,
    )
    for f in files:
        ds = dcmread(f)
        ds.PatientName = secret_name
        ds.save_as(f)
    one = write_synthetic_series(
        base / "one", PhantomGeometry(rows=32, columns=32, slices=1), seed=503
    )
    bad = dcmread(one[0])
    bad.PatientName, bad.PatientID = secret_name, secret_id
    short = dcmread(files[0])
    short.SOPInstanceUID = generate_uid()
    short.PixelData = short.PixelData[:100]  # truncated: refused with a failure status
    foreign = Dataset()  # a non-CT object: accepted and ignored
    foreign.SOPClassUID = "1.2.840.10008.5.1.4.1.1.481.2"
    foreign.SOPInstanceUID = generate_uid()
    foreign.StudyInstanceUID = generate_uid()
    foreign.SeriesInstanceUID = generate_uid()
    foreign.Modality = "RTDOSE"
    foreign.PatientName, foreign.PatientID = secret_name, secret_id
    foreign.file_meta = FileMetaDataset()
    foreign.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian

    scp = CountingSCP().start()
    port = free_port()
    cfg = write_config(
        base / "config.toml",
        base / "data",
        port,
        top={"log_level": "DEBUG"},
        dispatch={"destinations": [scp.peer], "retry_initial_s": 0.1},
        # A single instance on its own association waits for more until the quiet period.
        series={"quiet_period_s": 3},
    )
    node = NodeRunner(cfg, base / "data", port, base / "node.log")
    node.start()
    try:
        assert send_files(files, port, calling="CT1").complete
        assert send_files([bad], port).complete
        r = send_files([short], port)
        assert r.statuses[str(short.SOPInstanceUID)] >= 0xC000
        ae = AE(ae_title="DOSE")
        ae.add_requested_context(foreign.SOPClassUID, ExplicitVRLittleEndian)
        a = ae.associate(LOOPBACK, port, ae_title="SEGNODE")
        assert a.is_established and int(a.send_c_store(foreign).Status) == 0
        a.release()
        wait_for(lambda: len(scp.counts()) == 2, 60, "SEG + SR delivered")
        wait_for(
            lambda: '"failed"' in node.cli("jobs", "--json").stdout, 30, "the 1-slice job failed"
        )
    finally:
        node.stop()
        scp.stop()
    return node, scp, f"{secret_name}|{secret_id}"


def test_no_patient_names_or_ids_in_logs_or_ledger(
    e2e_run: tuple[NodeRunner, CountingSCP, str],
) -> None:
    node, _, secrets = e2e_run
    text = node.log()
    assert "DEBUG" in text and "job 1" in text  # the log really covers the run
    words = [w for s in secrets.split("|") for w in (s, *s.split("^"))]
    for word in words:
        assert word not in text, f"{word!r} in the node log"
    for f in node.data_dir.glob("ledger.sqlite*"):
        blob = f.read_bytes()
        for word in words:
            assert word.encode() not in blob, f"{word!r} in {f.name}"


def test_data_dir_and_files_are_private(e2e_run: tuple[NodeRunner, CountingSCP, str]) -> None:
    node, _, _ = e2e_run
    data = node.data_dir
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    ledger_files = sorted(data.glob("ledger.sqlite*"))
    assert ledger_files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in ledger_files)
    checked = 0
    for sub in ("spool", "results"):
        for p in (data / sub).rglob("*"):
            want = 0o700 if p.is_dir() else 0o600
            assert stat.S_IMODE(p.stat().st_mode) == want, p
            checked += 1
    assert checked > 6
