"""Routing with real peers: Orthanc as the hospital PACS auto-routing CT to the node with the
Lua script of ``docs/examples/orthanc-autoroute.lua``, results back by C-STORE ("@sender") and
by DICOMweb STOW-RS (Orthanc's DICOMweb plugin), several models per series.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydicom import dcmread
from pydicom.filebase import DicomBytesIO

from segnode.node.config import DEFAULT_MODEL
from tests.conftest import (
    LOOPBACK,
    NodeProcess,
    Orthanc,
    free_port,
    launch_orthanc,
    require_tool,
    wait_for,
)
from tests.fixtures.sample_study import write_sample_study
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parent.parent
LUA = ROOT / "docs" / "examples" / "orthanc-autoroute.lua"
DICOMWEB_PLUGIN = Path("/usr/share/orthanc/plugins/libOrthancDicomWeb.so")
USER, PASSWORD = "segnode", "s3cret-for-tests"

NodeFactory = Callable[..., NodeProcess]


@pytest.fixture
def toml_node(tmp_path: Path) -> Iterator[NodeFactory]:
    """Factory: ``toml_node(body) -> NodeProcess`` from TOML text (tables the dict-based
    ``make_node`` cannot write); ``body`` continues the ``[node]`` table."""
    nodes: list[NodeProcess] = []

    def factory(body: str, port: int | None = None) -> NodeProcess:
        port = port or free_port()
        base = tmp_path / f"tnode{len(nodes)}"
        base.mkdir()
        cfg = base / "config.toml"
        cfg.write_text(
            f'data_dir = "{base / "data"}"\nlog_level = "INFO"\n'
            f'[node]\nae_title = "SEGNODE"\nhost = "{LOOPBACK}"\nport = {port}\n' + body
        )
        node = NodeProcess(cfg, base / "data", port, base / "node.log")
        nodes.append(node)
        node.start()
        return node

    yield factory
    for n in nodes:
        n.stop()
        print(f"--- node log {n.log_path} ---\n{n.log()[-20000:]}")


@dataclass
class Pacs(Orthanc):
    """Orthanc started with extra configuration (Lua, modalities, DICOMweb, users)."""

    auth: tuple[str, str] | None = None

    def _open(self, path: str, data: bytes | None = None) -> bytes:
        req = urllib.request.Request(f"http://{LOOPBACK}:{self.http_port}{path}", data=data)
        if self.auth is not None:
            token = base64.b64encode(":".join(self.auth).encode()).decode()
            req.add_header("Authorization", f"Basic {token}")
        with urllib.request.urlopen(req, timeout=30) as r:
            return bytes(r.read())

    def get(self, path: str) -> Any:
        """GET a REST resource as JSON."""
        return json.loads(self._open(path))

    def get_bytes(self, path: str) -> bytes:
        """GET raw bytes."""
        return self._open(path)

    def post(self, path: str, body: str) -> Any:
        """POST a text body; the answer as JSON."""
        return json.loads(self._open(path, body.encode()) or b"null")


def start_pacs(
    base: Path,
    dicom_port: int | None = None,
    extra: dict[str, Any] | None = None,
    auth: tuple[str, str] | None = None,
) -> Pacs:
    """Start Orthanc on loopback with ``extra`` configuration; wait for its REST API."""

    def pacs(dicom: int, http: int, proc: subprocess.Popen[bytes]) -> Pacs:
        return Pacs(dicom, http, proc, auth=auth)

    return launch_orthanc(base, pacs, dicom_port, Name="segnode-routing-test", **(extra or {}))


def start_dicomweb_pacs(base: Path, auth: tuple[str, str] | None = None) -> Pacs:
    """:func:`start_pacs` with Orthanc's DICOMweb plugin (the test skips without it) and, with
    ``auth``, HTTP Basic authentication as that one user."""
    require_tool("Orthanc")
    if not DICOMWEB_PLUGIN.exists():
        pytest.skip("orthanc-dicomweb not installed")
    extra: dict[str, Any] = {
        "Plugins": [str(DICOMWEB_PLUGIN)],
        "DicomWeb": {"Enable": True, "Root": "/dicom-web/"},
    }
    if auth is not None:
        extra.update(AuthenticationEnabled=True, RegisteredUsers={auth[0]: auth[1]})
    return start_pacs(base, extra=extra, auth=auth)


def storescu(port: int, called: str, *paths: Path, calling: str = "MODALITY") -> None:
    """DCMTK storescu: every file in one association."""
    exe = require_tool("storescu")
    args = [exe, "-aet", calling, "-aec", called, "+sd", "+r", "-R", LOOPBACK, str(port)]
    out = subprocess.run(
        [*args, *map(str, paths)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


SEG_CLASS = "1.2.840.10008.5.1.4.1.1.66.4"
SR_CLASS = "1.2.840.10008.5.1.4.1.1.88.34"  # Comprehensive 3D SR (the dose report is not)


def study_series(orthanc: Pacs, study_uid: str) -> dict[str, list[str]]:
    """Modality -> instance ids of one study in Orthanc; the node's results under their SOP
    class ("SEG" and "SR" keys: Segmentation and Comprehensive 3D SR only)."""
    hits = orthanc.post("/tools/lookup", study_uid)
    out: dict[str, list[str]] = {}
    for hit in hits:
        if hit["Type"] != "Study":
            continue
        for sid in orthanc.get(f"/studies/{hit['ID']}")["Series"]:
            s = orthanc.get(f"/series/{sid}")
            modality = s["MainDicomTags"].get("Modality", "")
            if modality in ("SEG", "SR"):
                tags = orthanc.get(f"/instances/{s['Instances'][0]}/simplified-tags")
                cls = tags.get("SOPClassUID")
                modality = {SEG_CLASS: "SEG", SR_CLASS: "SR"}.get(cls, f"other {modality}")
            out.setdefault(modality, []).extend(s["Instances"])
    return out


def counts(orthanc: Pacs, study_uid: str) -> tuple[int, int]:
    s = study_series(orthanc, study_uid)
    return len(s.get("SEG", [])), len(s.get("SR", []))


def test_orthanc_lua_autorouting_results_back_to_the_same_study(
    toml_node: NodeFactory, tmp_path: Path
) -> None:
    """Orthanc forwards stable CT series (Lua), the node routes them, results come back once."""
    require_tool("Orthanc")
    node_port, pacs_port = free_port(), free_port()
    orthanc = start_pacs(
        tmp_path / "pacs",
        dicom_port=pacs_port,
        extra={
            "StableAge": 2,
            "LuaScripts": [str(LUA)],
            "DicomModalities": {"SEGNODE": ["SEGNODE", LOOPBACK, node_port]},
        },
    )
    try:
        node = toml_node(
            f"""
[[node.peers]]
ae_title = "ORTHANC"
host = "{LOOPBACK}"
port = {pacs_port}

[dispatch]
retry_initial_s = 0.2

[[rules]]
name = "chest-ct"
modality = "CT"
body_part = ["CHEST"]
min_slices = 32
destinations = ["@sender"]
""",
            port=node_port,
        )
        files = write_sample_study(tmp_path / "study", slices=64, size=128)
        study = str(dcmread(files["axial"][0], stop_before_pixels=True).StudyInstanceUID)
        t0 = time.monotonic()
        storescu(pacs_port, "ORTHANC", tmp_path / "study")
        wait_for(lambda: counts(orthanc, study) == (1, 1), 90, "SEG + SR back in Orthanc")
        print(f"storescu to Orthanc -> SEG+SR in Orthanc: {time.monotonic() - t0:.1f} s")

        jobs = node.jobs()
        assert [(j["state"], j["rule"], j["model_name"]) for j in jobs["jobs"]] == [
            ("sent", "chest-ct", "default")
        ]
        job = jobs["jobs"][0]
        assert job["instances"] == 64 and job["trigger"] == "association-release"
        assert {(d["kind"], d["destination"]) for d in job["deliveries"]} == {
            ("SEG", f"ORTHANC@{LOOPBACK}:{pacs_port}"),
            ("SR", f"ORTHANC@{LOOPBACK}:{pacs_port}"),
        }
        localizer = str(dcmread(files["localizer"][0], stop_before_pixels=True).SeriesInstanceUID)
        ignored = {i["series"]: i for i in jobs["ignored"]}
        assert ignored[localizer]["calling_ae"] == "ORTHANC"
        assert (
            "ImageType ORIGINAL\\PRIMARY\\LOCALIZER has LOCALIZER" in (ignored[localizer]["reason"])
        )
        text = node.cli("jobs").stdout
        print(text)
        assert "IGNORED SERIES" in text and "LOCALIZER" in text
        # The dose SR is not CT: Orthanc keeps it and the Lua script does not forward it.
        dose = str(dcmread(files["dose"][0], stop_before_pixels=True).SeriesInstanceUID)
        assert dose not in ignored

        # Same study, same patient, referencing the axial series.
        seg_id = study_series(orthanc, study)["SEG"][0]
        seg = dcmread(DicomBytesIO(orthanc.get_bytes(f"/instances/{seg_id}/file")))
        assert seg.StudyInstanceUID == study and seg.PatientID == "ROUTING"
        axial = str(dcmread(files["axial"][0], stop_before_pixels=True).SeriesInstanceUID)
        assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == axial

        # Even if the PACS forwarded the results to the node, its loop guard ignores them.
        for inst in study_series(orthanc, study)["SEG"] + study_series(orthanc, study)["SR"]:
            orthanc.post("/modalities/SEGNODE/store", inst)
        wait_for(
            lambda: any("loop guard" in i["reason"] for i in node.jobs()["ignored"]),
            30,
            "loop guard event",
        )
        # Nothing loops: after more than two stable-age periods, counts are unchanged.
        time.sleep(5.0)
        assert counts(orthanc, study) == (1, 1)
        assert len(node.jobs()["jobs"]) == 1
        final = study_series(orthanc, study)
        assert len(final["CT"]) == 66 and len(final["other SR"]) == 1  # the dose report
    finally:
        orthanc.stop()


def test_stow_rs_and_two_models_dcmtk_direct(toml_node: NodeFactory, tmp_path: Path) -> None:
    """DCMTK sends the study straight to the node; two models; results by STOW-RS (with HTTP
    Basic authentication) to Orthanc's DICOMweb plugin."""
    orthanc = start_dicomweb_pacs(tmp_path / "pacs", auth=(USER, PASSWORD))
    try:
        (tmp_path / "password").write_text(PASSWORD + "\n")
        second = tmp_path / "second.json"
        manifest = DEFAULT_MODEL.read_text().replace('"tissue"', '"tissue-b"', 1)
        second.write_text(
            manifest.replace('"tissue.onnx"', f'"{DEFAULT_MODEL.parent}/tissue.onnx"')
        )
        stow = f"http://{LOOPBACK}:{orthanc.http_port}/dicom-web"
        node = toml_node(
            f"""
[dispatch]
retry_initial_s = 0.2

[models.second]
manifest = "{second}"

[[rules]]
name = "ct"
models = ["default", "second"]
destinations = [{{stow = "{stow}", username = "{USER}", password_file = "{tmp_path / "password"}"}}]
priority = 3
"""
        )
        files = write_sample_study(tmp_path / "study", slices=64, size=96)
        study = str(dcmread(files["axial"][0], stop_before_pixels=True).StudyInstanceUID)
        storescu(node.port, "SEGNODE", tmp_path / "study")
        wait_for(lambda: counts(orthanc, study) == (2, 2), 90, "2 SEG + 2 SR via STOW-RS")
        jobs = node.jobs()
        wait_for(
            lambda: [j["state"] for j in node.jobs()["jobs"]] == ["sent", "sent"], 30, "jobs sent"
        )
        jobs = node.jobs()
        assert sorted(j["model_name"] for j in jobs["jobs"]) == ["default", "second"]
        assert sorted(j["model"] for j in jobs["jobs"]) == ["tissue 1.0.0", "tissue-b 1.0.0"]
        assert all(j["priority"] == 3 for j in jobs["jobs"])
        for j in jobs["jobs"]:
            assert [(d["destination"], d["status"]) for d in j["deliveries"]] == [
                (f"stow:{stow}", "sent"),
                (f"stow:{stow}", "sent"),
            ]
        reasons = {i["reason"] for i in jobs["ignored"]}
        assert any("has LOCALIZER (skip_image_types)" in r for r in reasons)
        assert any("X-Ray Radiation Dose SR Storage is not CT" in r for r in reasons)
        descriptions = set()
        for inst in study_series(orthanc, study)["SEG"]:
            seg = dcmread(DicomBytesIO(orthanc.get_bytes(f"/instances/{inst}/file")))
            descriptions.add(str(seg.SeriesDescription))
            assert seg.StudyInstanceUID == study
        assert len(descriptions) == 2
    finally:
        orthanc.stop()


def test_stow_rs_failures(toml_node: NodeFactory, tmp_path: Path) -> None:
    """A STOW-RS error status uses attempts and fails the job with the HTTP status; a server
    that cannot be reached uses none."""
    orthanc = start_dicomweb_pacs(tmp_path / "pacs")
    try:
        wrong = f"stow:http://{LOOPBACK}:{orthanc.http_port}/no-dicom-web"
        down = f"stow:http://{LOOPBACK}:{free_port()}/dicom-web"
        node = toml_node(
            f"""
[dispatch]
destinations = ["{wrong}", "{down}"]
retry_initial_s = 0.05
retry_max_s = 0.1
max_attempts = 2
"""
        )
        write_synthetic_series(
            tmp_path / "s", PhantomGeometry(rows=96, columns=96, slices=10), seed=71
        )
        storescu(node.port, "SEGNODE", tmp_path / "s")
        wait_for(lambda: node.jobs()["jobs"][0]["state"] == "failed", 60, "job failed")
        job = node.jobs()["jobs"][0]
        assert job["reason"].startswith(f"delivery to {wrong} failed: HTTP 404")
        by_dest = {(d["kind"], d["destination"]): d for d in job["deliveries"]}
        assert by_dest[("SEG", wrong)]["status"] == "failed"
        assert by_dest[("SEG", wrong)]["attempts"] == 2
        assert by_dest[("SEG", down)]["attempts"] == 0
    finally:
        orthanc.stop()
