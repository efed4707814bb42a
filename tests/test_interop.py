"""End to end with real peers: DCMTK storescu as the modality, Orthanc as the PACS,
dciodvfy as the validator, ``segnode serve`` as a subprocess on loopback.
"""

from __future__ import annotations

import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import highdicom as hd
import numpy as np
import pytest
from pydicom import dcmread
from pydicom.filebase import DicomBytesIO
from pydicom.uid import DeflatedExplicitVRLittleEndian, ExplicitVRLittleEndian

from scripts.harness import storescu_args
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.ort_backend import OrtEngine
from segnode.node.config import DEFAULT_MODEL
from segnode.node.ingest.volume import assemble_volume
from tests.conftest import (
    LOOPBACK,
    PHANTOM,
    NodeProcess,
    Orthanc,
    free_port,
    require_data,
    require_tool,
    start_orthanc,
    wait_for,
)
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series

pytestmark = pytest.mark.interop


def storescu(
    node: NodeProcess, *paths: Path, calling: str = "MODALITY"
) -> subprocess.CompletedProcess[str]:
    """Send files/folders with DCMTK storescu, one association."""
    exe = require_tool("storescu")
    return subprocess.run(
        storescu_args(node.port, *paths, calling=calling, exe=exe),
        capture_output=True,
        text=True,
        timeout=300,
    )


def dciodvfy_errors(data: bytes, tmp: Path, name: str) -> list[str]:
    """Run dciodvfy on ``data``; return its error lines. A deflated file (the SEG's default
    transfer syntax) is validated inflated: Debian's dicom3tools is built without zlib."""
    exe = require_tool("dciodvfy")
    f = tmp / name
    ds = dcmread(DicomBytesIO(data))
    if ds.file_meta.TransferSyntaxUID == DeflatedExplicitVRLittleEndian:
        ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds.save_as(f, enforce_file_format=True)
    else:
        f.write_bytes(data)
    out = subprocess.run([exe, "-new", str(f)], capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    return [ln for ln in text.splitlines() if ln.startswith("Error")]


def orthanc_results(orthanc: Orthanc, study_uid: str) -> dict[str, list[bytes]]:
    """SEG and SR instances (as bytes) that Orthanc holds in a study."""
    out: dict[str, list[bytes]] = {"SEG": [], "SR": []}
    for sid in orthanc.get("/series"):
        s = orthanc.get(f"/series/{sid}")
        study = orthanc.get(f"/studies/{s['ParentStudy']}")
        if study["MainDicomTags"].get("StudyInstanceUID") != study_uid:
            continue
        mod = s["MainDicomTags"].get("Modality", "")
        if mod in out:
            out[mod].extend(orthanc.get_bytes(f"/instances/{i}/file") for i in s["Instances"])
    return out


def count_results(orthanc: Orthanc, study_uid: str) -> tuple[int, int]:
    r = orthanc_results(orthanc, study_uid)
    return len(r["SEG"]), len(r["SR"])


def expected_labels(files: list[Path]) -> tuple[Any, np.ndarray]:
    """Assemble the source volume and segment it with the default model, as the node does."""
    vol = assemble_volume(files)
    eng = OrtEngine()
    eng.load(load_manifest(DEFAULT_MODEL))
    try:
        return vol, eng.segment(vol.hu)
    finally:
        eng.close()


def check_seg_matches(seg_bytes: bytes, vol: Any, labels: np.ndarray) -> None:
    """Re-read the SEG with highdicom: same label map per source slice, same geometry."""
    seg = hd.seg.Segmentation.from_dataset(dcmread(DicomBytesIO(seg_bytes)))
    manifest = load_manifest(DEFAULT_MODEL)
    by_name = {lab.name: lab.value for lab in manifest.labels}
    assert seg.FrameOfReferenceUID == vol.frame_of_reference_uid
    src_uids = [str(s.SOPInstanceUID) for s in vol.sources]
    referenced = {
        str(i.ReferencedSOPInstanceUID)
        for s in seg.ReferencedSeriesSequence
        for i in s.ReferencedInstanceSequence
    }
    assert referenced == set(src_uids)
    present = sorted(int(v) for v in np.unique(labels) if v != 0)
    seg_numbers = {int(d.SegmentNumber): by_name[str(d.SegmentLabel)] for d in seg.SegmentSequence}
    assert sorted(seg_numbers.values()) == present
    for number, value in seg_numbers.items():
        masks = seg.get_pixels_by_source_instance(
            source_sop_instance_uids=src_uids, segment_numbers=[number], skip_overlap_checks=True
        )[..., 0]
        np.testing.assert_array_equal(
            masks.astype(bool), labels == value, err_msg=f"segment {number}"
        )
    # Geometry: each frame lies at its source slice's position and orientation.
    pos = {
        str(f.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID): [
            float(x) for x in f.PlanePositionSequence[0].ImagePositionPatient
        ]
        for f in seg.PerFrameFunctionalGroupsSequence
    }
    for src in vol.sources:
        if str(src.SOPInstanceUID) in pos:
            np.testing.assert_allclose(
                pos[str(src.SOPInstanceUID)],
                [float(x) for x in src.ImagePositionPatient],
                atol=1e-3,
            )
    ori = seg.SharedFunctionalGroupsSequence[0].PlaneOrientationSequence[0].ImageOrientationPatient
    np.testing.assert_allclose(
        [float(x) for x in ori], [*vol.row_direction, *vol.column_direction], atol=1e-4
    )


@pytest.fixture(scope="module")
def synthetic_series(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_synthetic_series(
        tmp_path_factory.mktemp("synth"),
        PhantomGeometry(rows=256, columns=256, slices=40),
        patient_id="SYNTHE2E",
        seed=15,
    )


def test_end_to_end_phantom_and_synthetic(
    make_node: Any, orthanc: Orthanc, synthetic_series: list[Path], tmp_path: Path
) -> None:
    phantom = require_data(PHANTOM)
    node = make_node(dispatch={"destinations": [orthanc.peer], "retry_initial_s": 0.2})
    cases = {"phantom": sorted(phantom.iterdir()), "synthetic": synthetic_series}
    for name, files in cases.items():
        t0 = time.monotonic()
        r = storescu(node, *(files if name == "phantom" else [files[0].parent]))
        assert r.returncode == 0, r.stdout + r.stderr
        study = str(dcmread(files[0], stop_before_pixels=True).StudyInstanceUID)
        wait_for(
            lambda s=study: count_results(orthanc, s) == (1, 1), 120, f"{name} SEG+SR in Orthanc"
        )
        elapsed = time.monotonic() - t0
        print(f"{name}: storescu start -> SEG+SR in Orthanc {elapsed:.2f} s")
        results = orthanc_results(orthanc, study)
        for kind in ("SEG", "SR"):
            errors = dciodvfy_errors(results[kind][0], tmp_path, f"{name}-{kind}.dcm")
            assert errors == [], f"dciodvfy {kind}: {errors}"
        vol, labels = expected_labels(files)
        check_seg_matches(results["SEG"][0], vol, labels)
        sr = dcmread(DicomBytesIO(results["SR"][0]))
        assert sr.SOPClassUID == "1.2.840.10008.5.1.4.1.1.88.34"
        assert sr.ContentTemplateSequence[0].TemplateIdentifier == "1500"
    jobs = node.jobs()["jobs"]
    assert sorted(j["state"] for j in jobs) == ["sent", "sent"]
    assert all(j["trigger"] == "association-release" for j in jobs)
    # Nothing more arrives: exactly one SEG and one SR per series.
    time.sleep(1.0)
    for files in cases.values():
        study = str(dcmread(files[0], stop_before_pixels=True).StudyInstanceUID)
        assert count_results(orthanc, study) == (1, 1)


def test_bad_inputs_keep_node_serving(make_node: Any, tmp_path: Path) -> None:
    """Non-volume series fail with a reason; own results are ignored; node keeps serving."""
    node = make_node()
    # A single slice cannot form a volume.
    one = write_synthetic_series(
        tmp_path / "one", PhantomGeometry(rows=32, columns=32, slices=1), seed=11
    )
    assert storescu(node, *one).returncode == 0
    # A series with a gap.
    gap = write_synthetic_series(
        tmp_path / "gap", PhantomGeometry(rows=32, columns=32, slices=6), seed=12
    )
    gap[2].unlink()
    assert storescu(node, tmp_path / "gap").returncode == 0
    wait_for(
        lambda: len([j for j in node.jobs()["jobs"] if j["state"] == "failed"]) == 2,
        60,
        "2 failed jobs",
    )
    reasons = " | ".join(j["reason"] for j in node.jobs()["jobs"])
    assert "slice" in reasons.lower()
    assert "gap" in reasons.lower() or "spacing" in reasons.lower()
    text = node.cli("jobs").stdout
    assert "failed" in text and "reason:" in text
    # The node still serves a good series afterwards.
    write_synthetic_series(
        tmp_path / "good", PhantomGeometry(rows=64, columns=64, slices=8), seed=13
    )
    assert storescu(node, tmp_path / "good").returncode == 0
    wait_for(lambda: any(j["state"] == "done" for j in node.jobs()["jobs"]), 60, "a done job")
    # Its SEG sent back to the node is ignored by the loop guard.
    done = next(j for j in node.jobs()["jobs"] if j["state"] == "done")
    seg_file = next((node.data_dir / "results" / str(done["id"])).glob("seg-*.dcm"))
    assert storescu(node, seg_file).returncode == 0
    ignored = node.jobs()["ignored"]
    assert any("loop guard" in i["reason"] for i in ignored)
    assert len(node.jobs()["jobs"]) == 3


def test_restart_after_sigkill_delivers_once(
    make_node: Any, synthetic_series: list[Path], tmp_path: Path
) -> None:
    """SIGKILL after the series was acknowledged, before results were sent: they arrive once."""
    pacs_port = free_port()  # the PACS is down while the node first works
    node = make_node(
        dispatch={
            "destinations": [f"ORTHANC@{LOOPBACK}:{pacs_port}"],
            "retry_initial_s": 0.2,
            "retry_max_s": 0.5,
        }
    )
    r = storescu(node, synthetic_series[0].parent)
    assert r.returncode == 0
    study = str(dcmread(synthetic_series[0], stop_before_pixels=True).StudyInstanceUID)
    wait_for(
        lambda: node.jobs()["jobs"] and node.jobs()["jobs"][0]["state"] == "encoded",
        120,
        "job encoded",
    )
    before = node.jobs()["jobs"][0]
    assert any(d["attempts"] >= 1 for d in before["deliveries"]) or before["deliveries"]
    node.kill()
    orthanc = start_orthanc(tmp_path / "pacs", dicom_port=pacs_port)
    try:
        node.start()
        wait_for(lambda: count_results(orthanc, study) == (1, 1), 120, "SEG+SR after restart")
        wait_for(lambda: node.jobs()["jobs"][0]["state"] == "sent", 30, "job sent")
        after = node.jobs()["jobs"][0]
        assert after["seg_sop_uid"] == before["seg_sop_uid"]
        res = orthanc_results(orthanc, study)
        assert str(dcmread(DicomBytesIO(res["SEG"][0])).SOPInstanceUID) == before["seg_sop_uid"]
        assert str(dcmread(DicomBytesIO(res["SR"][0])).SOPInstanceUID) == before["sr_sop_uid"]
        time.sleep(1.0)
        assert count_results(orthanc, study) == (1, 1)
    finally:
        orthanc.stop()


def test_instance_rows_lost_by_a_power_cut_are_recorded_again(
    make_node: Any, tmp_path: Path
) -> None:
    """Instance rows are committed without a WAL fsync; their spool files are fsynced. When a
    power cut loses the last rows, start-up records the files again and the series' job
    still uses every acknowledged instance."""
    node = make_node(series={"complete_on_release": False, "quiet_period_s": 1.0})
    files = write_synthetic_series(
        tmp_path / "s", PhantomGeometry(rows=64, columns=64, slices=8), seed=15
    )
    assert storescu(node, tmp_path / "s").returncode == 0
    node.kill()
    # What a power cut can leave: the files are there, the last rows are not.
    db = sqlite3.connect(node.data_dir / "ledger.sqlite")
    with db:
        lost = db.execute(
            "SELECT sop_instance_uid FROM instances ORDER BY id DESC LIMIT 3"
        ).fetchall()
        db.execute(
            "DELETE FROM instances WHERE id IN (SELECT id FROM instances ORDER BY id DESC LIMIT 3)"
        )
        db.execute("UPDATE series SET instance_count = instance_count - 3")
    db.close()
    assert len(lost) == 3
    node.start()
    wait_for(
        lambda: node.jobs()["jobs"] and node.jobs()["jobs"][0]["state"] == "done", 60, "job done"
    )
    job = node.jobs()["jobs"][0]
    assert job["instances"] == len(files)
    assert "recorded 3 spooled instance(s) whose ledger row was lost" in node.log()
    db = sqlite3.connect(node.data_dir / "ledger.sqlite")
    try:
        kept = db.execute("SELECT transfer_syntax_uid FROM instances ORDER BY id LIMIT 1")
        (syntax,) = kept.fetchone()
        for (sop,) in lost:
            row = db.execute(
                "SELECT calling_ae, transfer_syntax_uid, size FROM instances "
                "WHERE sop_instance_uid = ?",
                (sop,),
            ).fetchone()
            assert row is not None and row[0] == "MODALITY" and row[2] > 0
            assert row[1] == syntax
    finally:
        db.close()


def test_sigkill_before_job_resumes_from_ledger(make_node: Any, tmp_path: Path) -> None:
    """Instances acknowledged but no job yet (quiet-period fallback after restart)."""
    node = make_node(series={"complete_on_release": False, "quiet_period_s": 1.0})
    files = write_synthetic_series(
        tmp_path / "s", PhantomGeometry(rows=64, columns=64, slices=8), seed=14
    )
    assert storescu(node, tmp_path / "s").returncode == 0
    node.kill()
    node.start()
    wait_for(
        lambda: node.jobs()["jobs"] and node.jobs()["jobs"][0]["state"] == "done", 60, "job done"
    )
    job = node.jobs()["jobs"][0]
    assert job["trigger"] == "quiet-period" and job["instances"] == len(files)
