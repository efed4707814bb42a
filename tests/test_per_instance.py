"""Senders that open one association per instance (issue: partial results in the PACS).

Real peers on loopback: DCMTK ``storescu`` called once per file, and Orthanc forwarding each
stored instance to the node from its ``OnStoredInstance`` Lua callback (the common routing
recipe). The node must put exactly one SEG and one SR per series into Orthanc, covering every
slice, and nothing else, ever.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydicom import dcmread
from pydicom.filebase import DicomBytesIO

from tests.conftest import (
    LOOPBACK,
    NodeProcess,
    Orthanc,
    free_port,
    require_tool,
    start_orthanc,
    wait_for,
)
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.test_interop import count_results, orthanc_results

pytestmark = [pytest.mark.interop, pytest.mark.slow]


def storescu_each(port: int, files: list[Path], calling: str = "SCRIPT") -> float:
    """One ``storescu`` process (one association) per file; return when the last returned."""
    exe = require_tool("storescu")
    for f in files:
        out = subprocess.run(
            [exe, "-aet", calling, "-aec", "SEGNODE", LOOPBACK, str(port), str(f)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr
    return time.monotonic()


def seg_sources(seg: bytes) -> set[str]:
    """SOP Instance UIDs the SEG references as its source images."""
    ds = dcmread(DicomBytesIO(seg))
    return {
        str(i.ReferencedSOPInstanceUID)
        for s in ds.ReferencedSeriesSequence
        for i in s.ReferencedInstanceSequence
    }


def series_jobs(node: NodeProcess, series_uid: str) -> list[dict[str, Any]]:
    jobs = [j for j in node.jobs()["jobs"] if j["series"] == series_uid]
    return sorted(jobs, key=lambda j: int(j["id"]))


def node_sending_to_orthanc(
    make_node: Any,
    tmp_path: Path,
    destination: Callable[[int], str] | None = None,
    **orthanc_extra: Any,
) -> tuple[NodeProcess, Orthanc]:
    """A node whose destination is an Orthanc started after it, on a port chosen first.
    ``destination(port)``: the destination's TOML (default ``"ORTHANC@host:port"``); an
    ``orthanc_extra`` value that is callable is given the node's port."""
    oport = free_port()
    node: NodeProcess = make_node(start=False, dispatch={"retry_initial_s": 0.2})
    dest = destination(oport) if destination else f'"ORTHANC@{LOOPBACK}:{oport}"'
    text = node.config_path.read_text()
    node.config_path.write_text(
        text.replace("[dispatch]\n", f"[dispatch]\ndestinations = [{dest}]\n")
    )
    node.start()
    extra = {k: v(node.port) if callable(v) else v for k, v in orthanc_extra.items()}
    return node, start_orthanc(tmp_path / "pacs", dicom_port=oport, **extra)


def test_storescu_once_per_file_gives_one_seg_and_sr_per_series(
    make_node: Any, tmp_path: Path
) -> None:
    node, orthanc = node_sending_to_orthanc(make_node, tmp_path)
    try:
        cases = {}
        for n, seed in ((40, 9501), (128, 9502)):
            files = write_synthetic_series(
                tmp_path / f"s{n}", PhantomGeometry(rows=64, columns=64, slices=n), seed=seed
            )
            ds = dcmread(files[0], stop_before_pixels=True)
            study, series = str(ds.StudyInstanceUID), str(ds.SeriesInstanceUID)
            last = storescu_each(node.port, files)
            wait_for(lambda s=study: count_results(orthanc, s) == (1, 1), 120, f"{n} SEG+SR")
            took = time.monotonic() - last
            (job,) = series_jobs(node, str(ds.SeriesInstanceUID))
            print(f"{n} slices, one association each: last response -> SEG+SR {took:.2f} s")
            print(f"  stages: {job['stages']}")
            cases[n] = (study, series, {str(dcmread(f).SOPInstanceUID) for f in files})
        time.sleep(30)  # a quiet period later: still one SEG and one SR per series
        for n, (study, series, sops) in cases.items():
            assert count_results(orthanc, study) == (1, 1), n
            (seg,) = orthanc_results(orthanc, study)["SEG"]
            assert seg_sources(seg) == sops  # every slice, not a part
            jobs = series_jobs(node, series)
            assert [j["state"] for j in jobs] == ["sent"], jobs  # one version, never partial
            assert jobs[0]["instances"] == n
            assert jobs[0]["trigger"] in ("sender-gap", "geometry"), jobs[0]["trigger"]
        status = node.cli("status")
        assert '"splits_series": true' in status.stdout, status.stdout
    finally:
        orthanc.stop()


LUA = """
function OnStoredInstance(instanceId, tags, metadata, origin)
  if tags['Modality'] == 'CT' then
    SendToModality(instanceId, 'segnode')
  end
end
"""


def test_orthanc_forwarding_each_instance_gives_one_seg_and_sr(
    make_node: Any, tmp_path: Path
) -> None:
    lua = tmp_path / "forward.lua"
    lua.write_text(LUA)
    node, orthanc = node_sending_to_orthanc(
        make_node,
        tmp_path,
        LuaScripts=[str(lua)],
        DicomModalities=lambda port: {"segnode": ["SEGNODE", LOOPBACK, port]},
        DicomAssociationCloseDelay=0,  # one association per forwarded instance
    )
    oport = orthanc.dicom_port
    try:
        files = write_synthetic_series(
            tmp_path / "s", PhantomGeometry(rows=64, columns=64, slices=40), seed=9503
        )
        ds = dcmread(files[0], stop_before_pixels=True)
        study, series = str(ds.StudyInstanceUID), str(ds.SeriesInstanceUID)
        exe = require_tool("storescu")
        out = subprocess.run(
            [
                exe,
                "-aet",
                "MODALITY",
                "-aec",
                "ORTHANC",
                "+sd",
                LOOPBACK,
                str(oport),
                str(tmp_path / "s"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        wait_for(lambda: count_results(orthanc, study) == (1, 1), 120, "SEG+SR via Orthanc")
        t_done = time.monotonic()
        time.sleep(30)
        assert count_results(orthanc, study) == (1, 1)
        (seg,) = orthanc_results(orthanc, study)["SEG"]
        assert seg_sources(seg) == {str(dcmread(f).SOPInstanceUID) for f in files}
        jobs = series_jobs(node, series)
        *partial, whole = jobs
        assert whole["state"] == "sent" and whole["instances"] == len(files), jobs
        # Under a loaded machine Orthanc's forwarding can pause long enough after a batch
        # for a release to complete part of the series; that job must then have stopped
        # before encoding: superseded (also when it failed on a slice gap while the rest
        # arrived), or refused by the volume's slice-gap check when nothing arrived while
        # it ran. Nothing of it reaches the PACS (exactly one SEG and SR above, of every
        # instance).
        for j in partial:
            assert j["instances"] < len(files) and not j["deliveries"], jobs
            assert j["state"] == "superseded" or (
                j["state"] == "failed" and "slices are missing" in j["reason"]
            ), jobs
        later = time.monotonic() - t_done
        print(f"Orthanc forwarding: one SEG+SR, still {later:.0f} s later")
    finally:
        orthanc.stop()


def orthanc_kos(orthanc: Any, study_uid: str) -> list[bytes]:
    """Key Object Selection Documents Orthanc holds in a study."""
    out: list[bytes] = []
    for sid in orthanc.get("/series"):
        s = orthanc.get(f"/series/{sid}")
        study = orthanc.get(f"/studies/{s['ParentStudy']}")
        if study["MainDicomTags"].get("StudyInstanceUID") != study_uid:
            continue
        if s["MainDicomTags"].get("Modality") == "KO":
            out.extend(orthanc.get_bytes(f"/instances/{i}/file") for i in s["Instances"])
    return out


def test_a_late_instance_after_delivery_sends_new_results_and_a_rejection_note(
    make_node: Any, tmp_path: Path
) -> None:
    """With ``reject_superseded = true`` the destination gets the new SEG and SR and an IOCM
    rejection note (KOS, "Rejected for Quality Reasons") naming the old SEG and SR; a third
    version's note names only the second's (the first's were withdrawn already)."""
    from segnode.node.dicom.rejection import rejected_uids

    node, orthanc = node_sending_to_orthanc(
        make_node,
        tmp_path,
        lambda port: f'{{ peer = "ORTHANC@{LOOPBACK}:{port}", reject_superseded = true }}',
    )
    try:
        files = write_synthetic_series(
            tmp_path / "s", PhantomGeometry(rows=64, columns=64, slices=21), seed=9504
        )
        ds = dcmread(files[0], stop_before_pixels=True)
        study, series = str(ds.StudyInstanceUID), str(ds.SeriesInstanceUID)
        (tmp_path / "first").mkdir()
        for f in files[:-2]:
            (tmp_path / "first" / f.name).symlink_to(f)
        exe = require_tool("storescu")
        cmd = [exe, "-aet", "CT1", "-aec", "SEGNODE", "+sd", LOOPBACK, str(node.port)]
        assert subprocess.run([*cmd, str(tmp_path / "first")], timeout=60).returncode == 0
        wait_for(lambda: count_results(orthanc, study) == (1, 1), 120, "v1 SEG+SR")
        wait_for(lambda: [j["state"] for j in series_jobs(node, series)] == ["sent"], 30, "v1")
        (v1,) = series_jobs(node, series)
        assert subprocess.run([*cmd, str(files[-2])], timeout=60).returncode == 0  # late
        wait_for(lambda: count_results(orthanc, study) == (2, 2), 120, "v2 SEG+SR")
        wait_for(lambda: len(orthanc_kos(orthanc, study)) == 1, 60, "rejection note")
        (kos,) = orthanc_kos(orthanc, study)
        note = dcmread(DicomBytesIO(kos))
        title = note.ConceptNameCodeSequence[0]
        assert (title.CodeValue, title.CodingSchemeDesignator) == ("113001", "DCM")
        assert rejected_uids(note) == {v1["seg_sop_uid"], v1["sr_sop_uid"]}
        jobs = {j["version"]: j for j in series_jobs(node, series)}
        assert jobs[2]["state"] == "sent" and jobs[2]["instances"] == 20
        kinds = [d["kind"] for d in jobs[2]["deliveries"]]
        assert kinds == ["SEG", "SR", "KOS"]  # the new results first, then the note
        (seg2,) = [s for s in orthanc_results(orthanc, study)["SEG"] if len(seg_sources(s)) == 20]
        assert seg_sources(seg2) == {str(dcmread(f).SOPInstanceUID) for f in files[:-1]}
        assert subprocess.run([*cmd, str(files[-1])], timeout=60).returncode == 0  # later still
        wait_for(lambda: len(orthanc_kos(orthanc, study)) == 2, 120, "the second note")
        notes = [rejected_uids(dcmread(DicomBytesIO(k))) for k in orthanc_kos(orthanc, study)]
        v2 = {j["version"]: j for j in series_jobs(node, series)}[2]
        assert {v2["seg_sop_uid"], v2["sr_sop_uid"]} in notes, notes
        assert {v1["seg_sop_uid"], v1["sr_sop_uid"]} in notes, notes  # and only the first
    finally:
        orthanc.stop()


def test_interleaved_per_instance_and_whole_series_senders(make_node: Any, tmp_path: Path) -> None:
    """Two scanners at once: PI sends one instance per association, CT a whole series on one
    association in the middle of it. CT's series completes at its release; PI's once, whole."""
    import threading

    node: NodeProcess = make_node()
    pi_files = write_synthetic_series(
        tmp_path / "pi", PhantomGeometry(rows=64, columns=64, slices=60), seed=9505
    )
    ct_files = write_synthetic_series(
        tmp_path / "ct", PhantomGeometry(rows=64, columns=64, slices=30), seed=9506
    )
    pi_series = str(dcmread(pi_files[0], stop_before_pixels=True).SeriesInstanceUID)
    ct_series = str(dcmread(ct_files[0], stop_before_pixels=True).SeriesInstanceUID)
    sender = threading.Thread(target=storescu_each, args=(node.port, pi_files, "PI"))
    sender.start()
    time.sleep(0.5)  # PI is under way
    exe = require_tool("storescu")
    cmd = [exe, "-aet", "CT", "-aec", "SEGNODE", "+sd", LOOPBACK, str(node.port)]
    assert subprocess.run([*cmd, str(tmp_path / "ct")], timeout=60).returncode == 0
    assert sender.is_alive(), "PI finished before CT: not interleaved"
    t_ct = time.monotonic()
    wait_for(lambda: series_jobs(node, ct_series), 10, "CT's job")
    ct_queued = time.monotonic() - t_ct
    sender.join(120)

    def pi_settled() -> bool:
        states = [j["state"] for j in series_jobs(node, pi_series)]
        return bool(states) and states[-1] == "done" and set(states[:-1]) <= {"superseded"}

    # While CT's job runs inference on both cores, PI's next storescu may start late enough
    # for its hold to expire: a job for part of PI's series is then allowed, as long as it
    # is superseded (never encoded, never sent) and one job covers the whole series.
    wait_for(pi_settled, 60, "PI's job")
    wait_for(lambda: [j["state"] for j in series_jobs(node, ct_series)] == ["done"], 60, "CT")
    pi_job = series_jobs(node, pi_series)[-1]
    for partial in series_jobs(node, pi_series)[:-1]:
        assert partial["state"] == "superseded" and partial["instances"] < 60
    (ct_job,) = series_jobs(node, ct_series)
    assert (pi_job["instances"], pi_job["trigger"]) == (60, "sender-gap")
    assert (ct_job["instances"], ct_job["trigger"]) == (30, "association-release")
    print(f"CT's job seen {ct_queued:.2f} s after its storescu returned (polling the CLI)")
