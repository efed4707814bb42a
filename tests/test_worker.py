"""The worker on a real ledger, spool and ONNX Runtime engine (no network)."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydicom import dcmread
from sqlalchemy import select

from segnode.engines.manifest import ModelManifest
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.ort_backend import OrtEngine
from segnode.node.config import DEFAULT_MODEL, from_dict
from segnode.node.pipeline.engine_pool import EnginePool
from segnode.node.pipeline.worker import Worker, result_paths
from segnode.node.results.build import ResultError, ResultUIDs
from segnode.storage.ledger import MISSING_FILES, InstanceRecord, JobView, Ledger
from segnode.storage.models import Event
from segnode.storage.spool import Spool
from tests.fixtures.synthetic import PhantomGeometry, synthetic_datasets, write_synthetic_series


@pytest.fixture(scope="module")
def engine() -> OrtEngine:
    eng = OrtEngine()
    eng.load(load_manifest(DEFAULT_MODEL))
    return eng


def ingest(ledger: Ledger, spool: Spool, files: list[Path]) -> str:
    for f in files:
        ds = dcmread(f)
        rec = InstanceRecord(
            str(ds.SOPInstanceUID),
            str(ds.SOPClassUID),
            str(ds.SeriesInstanceUID),
            str(ds.StudyInstanceUID),
            str(ds.file_meta.TransferSyntaxUID),
            "CT",
            "TEST",
        )
        path, size = spool.store(
            rec.study_instance_uid, rec.series_instance_uid, rec.sop_instance_uid, [f.read_bytes()]
        )
        ledger.record_instance(rec, path, size)
    return str(dcmread(files[0]).SeriesInstanceUID)


def worker_on(
    tmp_path: Path, engine: Any, manifest: ModelManifest, config: dict[str, Any] | None = None
) -> tuple[Worker, Ledger, Spool]:
    """A worker of ``config`` (defaults otherwise) with its ledger and spool in ``tmp_path``."""
    cfg = replace(from_dict(config or {}), data_dir=tmp_path)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    return (
        Worker(cfg, ledger, EnginePool.of_config(cfg, engine, manifest)),
        ledger,
        Spool(tmp_path / "spool"),
    )


def make(tmp_path: Path, engine: OrtEngine) -> tuple[Worker, Ledger, Spool]:
    return worker_on(tmp_path, engine, load_manifest(DEFAULT_MODEL))


def run_job(worker: Worker, ledger: Ledger, uid: str, model: str = "tissue") -> tuple[int, JobView]:
    """Queue a job for the series ``uid`` and run it; return its id and its ledger view."""
    jid = ledger.create_job(uid, trigger="test", model=model, engine="onnxruntime")
    assert jid is not None and worker.run_once()
    view = ledger.job(jid)
    assert view is not None
    return jid, view


def test_job_encodes_seg_and_sr_with_ledger_uids(tmp_path: Path, engine: OrtEngine) -> None:
    worker, ledger, spool = make(tmp_path, engine)
    files = write_synthetic_series(
        tmp_path / "in", PhantomGeometry(rows=96, columns=96, slices=10), seed=31
    )
    uid = ingest(ledger, spool, files)
    jid, view = run_job(worker, ledger, uid)
    assert view.state == "done"  # no destinations configured
    assert all(view.stages[k] is not None for k in ("volume", "inference", "encoded"))
    seg, sr = (dcmread(p) for p in result_paths(tmp_path, jid))
    assert {str(seg.SOPInstanceUID), str(sr.SOPInstanceUID)} == {view.seg_sop_uid, view.sr_sop_uid}
    assert not worker.run_once()  # queue empty


def test_no_segment_ends_done_with_reason(tmp_path: Path, engine: OrtEngine) -> None:
    worker, ledger, spool = make(tmp_path, engine)
    out = tmp_path / "air"
    out.mkdir()
    files = []
    for i, ds in enumerate(
        synthetic_datasets(PhantomGeometry(rows=32, columns=32, slices=4), seed=32)
    ):
        arr = np.zeros((32, 32), dtype=ds.pixel_array.dtype)  # stored 0 -> -1024 HU: all air
        ds.PixelData = arr.tobytes()
        f = out / f"{i}.dcm"
        ds.save_as(f, enforce_file_format=True)
        files.append(f)
    uid = ingest(ledger, spool, files)
    jid, view = run_job(worker, ledger, uid)
    assert view.state == "done"
    assert "nothing to send" in (view.reason or "")
    assert result_paths(tmp_path, jid) == []


def test_missing_spool_file_fails_with_reason(tmp_path: Path, engine: OrtEngine) -> None:
    worker, ledger, spool = make(tmp_path, engine)
    files = write_synthetic_series(
        tmp_path / "in", PhantomGeometry(rows=32, columns=32, slices=4), seed=33
    )
    uid = ingest(ledger, spool, files)
    ledger.instance_paths(uid)[1].unlink()
    jid, view = run_job(worker, ledger, uid)
    assert view.state == "failed" and MISSING_FILES in (view.reason or "")


class _ArrivesDuringTheJob:
    """Volumes that prebuild nothing, but record late instances of the series when the job
    asks (as a sender still transferring the series does while the job runs)."""

    def __init__(self, ledger: Ledger, spool: Spool, late: list[Path]) -> None:
        self.ledger, self.spool, self.late = ledger, spool, late

    def take(self, series_uid: str, paths: Any, timeout: float = 60.0) -> None:
        if self.late:
            ingest(self.ledger, self.spool, self.late)
            self.late = []

    def recycle(self, volume: Any) -> None:
        pass


def test_a_job_failing_on_a_series_that_grows_meanwhile_is_superseded(
    tmp_path: Path, engine: OrtEngine
) -> None:
    """A job sees a slice gap because the sender had not sent the missing slice yet; it
    arrives while the job runs: the job ends superseded (its failure in the reason), not
    failed, and the next version segments the whole series. The same gap with nothing
    arriving fails the job as before."""
    worker, ledger, spool = make(tmp_path, engine)
    files = write_synthetic_series(
        tmp_path / "in", PhantomGeometry(rows=96, columns=96, slices=10), seed=35
    )
    by_z = sorted(files, key=lambda f: float(dcmread(f).ImagePositionPatient[2]))
    uid = ingest(ledger, spool, [f for f in by_z if f != by_z[5]])
    late = _ArrivesDuringTheJob(ledger, spool, [by_z[5]])
    growing = Worker(worker.config, ledger, worker.pool, volumes=late)
    jid, view = run_job(growing, ledger, uid)
    assert view.state == "superseded"
    assert "more instances while this job ran (9 -> 10)" in (view.reason or "")
    assert "it failed on what it had: non-uniform slice spacing" in (view.reason or "")
    assert growing.last_result == f"job {jid} superseded"
    jid2, view2 = run_job(growing, ledger, uid)
    assert (view2.state, view2.version, view2.instance_count) == ("done", 2, 10)
    assert len(result_paths(tmp_path, jid2)) == 2

    gap = write_synthetic_series(
        tmp_path / "gap", PhantomGeometry(rows=32, columns=32, slices=8), seed=36
    )
    gap_z = sorted(gap, key=lambda f: float(dcmread(f).ImagePositionPatient[2]))
    uid = ingest(ledger, spool, [f for f in gap_z if f != gap_z[4]])
    _, view = run_job(worker, ledger, uid)
    assert view.state == "failed" and "non-uniform slice spacing" in (view.reason or "")


def _reread_labels(seg_path: Path, source_files: list[Path]) -> np.ndarray:
    """The SEG's label map by source instance, through highdicom (not our reader)."""
    import highdicom as hd

    seg = hd.seg.segread(seg_path)
    sources = sorted(
        (dcmread(f, stop_before_pixels=True) for f in source_files),
        key=lambda d: float(d.ImagePositionPatient[2]),
    )
    return np.asarray(
        seg.get_pixels_by_source_instance(
            source_sop_instance_uids=[str(d.SOPInstanceUID) for d in sources],
            combine_segments=True,
            assert_missing_frames_are_empty=True,
        )
    )


@pytest.mark.parametrize("kind", ["BINARY", "LABELMAP"])
def test_worker_results_reread_by_highdicom_and_reencode_identically(
    tmp_path: Path, engine: OrtEngine, kind: str
) -> None:
    """The fast path's files: highdicom reads back the engine's label map (segment numbers in
    ascending label value), the SR references the SEG's class, and running the job again (as
    after a crash) writes the same bytes."""
    import highdicom as hd

    from segnode.node.config import ResultsConfig

    cfg = replace(from_dict({}), data_dir=tmp_path, results=ResultsConfig(kind))
    ledger = Ledger(tmp_path / "ledger.sqlite")
    worker = Worker(cfg, ledger, EnginePool.of_config(cfg, engine, load_manifest(DEFAULT_MODEL)))
    spool = Spool(tmp_path / "spool")
    files = write_synthetic_series(
        tmp_path / "in", PhantomGeometry(rows=96, columns=96, slices=12), seed=33
    )
    jid, _ = run_job(worker, ledger, ingest(ledger, spool, files))
    seg_path, sr_path = sorted(result_paths(tmp_path, jid))  # seg-..., sr-...
    first = (seg_path.read_bytes(), sr_path.read_bytes())
    seg = dcmread(seg_path)
    expected_class = {
        "BINARY": "1.2.840.10008.5.1.4.1.1.66.4",
        "LABELMAP": "1.2.840.10008.5.1.4.1.1.66.7",
    }[kind]
    assert seg.SOPClassUID == expected_class
    from segnode.node.ingest.volume import assemble_volume

    volume = assemble_volume(files)
    labels = engine.segment(volume.hu)
    present = [v for v in np.unique(labels).tolist() if v]
    lut = np.zeros(len(present) + 1, dtype=np.uint8)
    lut[1:] = present
    assert np.array_equal(lut[_reread_labels(seg_path, files)], labels)
    sr = hd.sr.srread(sr_path)
    (ref,) = {
        str(item.ReferencedSOPClassUID)
        for item in sr.CurrentRequestedProcedureEvidenceSequence[0]
        .ReferencedSeriesSequence[0]
        .ReferencedSOPSequence
        if item.ReferencedSOPInstanceUID == seg.SOPInstanceUID
    } or {None}
    assert ref == expected_class

    # The same job again, as after a crash between writing the files and the ledger's commit
    # (the ledger keeps the first run's outcome; the files are written again).
    for p in (seg_path, sr_path):
        p.unlink()
    view = ledger.job(jid)
    assert view is not None
    worker.process(view)
    assert (seg_path.read_bytes(), sr_path.read_bytes()) == first


def test_prebuilt_volume_goes_back_to_the_pool_after_its_job(
    tmp_path: Path, engine: OrtEngine
) -> None:
    """The worker hands the job's prebuilt volume back to the streaming assembler, so the
    next series decodes into memory already touched."""
    from segnode.node.ingest.streaming import Arrival, StreamingAssembler

    worker, ledger, spool = make(tmp_path, engine)
    asm = StreamingAssembler(workers=1, max_bytes=256 * 2**20)
    asm.start()
    worker.volumes = asm
    try:
        files = write_synthetic_series(
            tmp_path / "in", PhantomGeometry(rows=32, columns=32, slices=70), seed=34
        )
        uid = ingest(ledger, spool, files)
        for i, path in enumerate(ledger.instance_paths(uid)):
            asm.submit(Arrival(uid, f"sop{i}", path, "TEST", 0))
        assert asm.wait_idle()
        run_job(worker, ledger, uid)
        assert asm.taken == 1  # the job used the prebuilt volume
        # the two 64-slice slabs went back while gathering, the 70-slice volume after the job
        assert asm.pool.idle_bytes == (64 + 64 + 70) * 32 * 32 * 4
    finally:
        asm.stop()


def test_seg_that_fails_its_check_leaves_no_file(
    tmp_path: Path, engine: OrtEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SEG is written while it is checked; a failed check fails the job and removes
    the written bytes (no result file under any name)."""
    import segnode.node.results.encode_process as encode_module

    def corrupt(*_: object) -> None:
        raise ResultError("frame 3 does not reproduce the label map on slice 2")

    monkeypatch.setattr(encode_module, "check_encoded", corrupt)
    worker, ledger, spool = make(tmp_path, engine)
    files = write_synthetic_series(
        tmp_path / "in", PhantomGeometry(rows=64, columns=64, slices=6), seed=34
    )
    uid = ingest(ledger, spool, files)
    jid, view = run_job(worker, ledger, uid)
    assert view.state == "failed"
    assert "does not reproduce the label map" in (view.reason or "")
    folder = tmp_path / "results" / str(jid)
    assert not folder.exists() or list(folder.iterdir()) == []


def test_start_caches_the_sr_template_that_real_series_use(
    tmp_path: Path, engine: OrtEngine
) -> None:
    """The worker prepares a result for its own two-slice warm-up series at start (no test
    fixture at run time); a synthetic series then finds that SR template (no new one)."""
    import subprocess
    import sys

    from segnode.node.ingest.volume import assemble_from_datasets
    from segnode.node.results import sr_encode

    sr_encode._TEMPLATES.clear()
    worker, ledger, _ = make(tmp_path, engine)
    worker.start()
    try:
        assert worker.warming is not None
        worker.warming.result(30)
        assert len(sr_encode._TEMPLATES) == 2  # ASCII and Latin-1
        volume = assemble_from_datasets(
            synthetic_datasets(PhantomGeometry(rows=16, columns=16, slices=3))
        )
        worker._prepare(volume, load_manifest(DEFAULT_MODEL), ResultUIDs.new(), datetime.now())
        assert len(sr_encode._TEMPLATES) == 2  # the same key as the Latin-1 one: a hit
    finally:
        worker.stop(10)
        ledger.close()
    code = (
        "import sys, segnode.node.ops.service, segnode.node.pipeline.worker as w\n"
        "w.assemble_from_datasets(w.warm_up_series(), min_slices=2)\n"
        "bad = [m for m in sys.modules if m == 'tests' or m.startswith('tests.')]\n"
        "sys.exit(f'fixtures imported: {bad}' if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def queued_job(tmp_path: Path, engine: OrtEngine, seed: int) -> tuple[Worker, Ledger, int]:
    """A worker, its ledger and the id of one queued job of a 96x96x10 synthetic series."""
    worker, ledger, spool = make(tmp_path, engine)
    files = write_synthetic_series(
        tmp_path / "in", PhantomGeometry(rows=96, columns=96, slices=10), seed=seed
    )
    jid = ledger.create_job(
        ingest(ledger, spool, files), trigger="test", model="tissue", engine="onnxruntime"
    )
    assert jid is not None
    return worker, ledger, jid


def test_a_ledger_outage_during_a_job_queues_it_again(
    tmp_path: Path, engine: OrtEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger's database stops answering while a job runs (a PostgreSQL failover): the
    job is not failed for it; once the ledger answers it is queued again (same result UIDs)
    and then finished, and the worker thread keeps running."""
    from sqlalchemy.exc import OperationalError

    worker, ledger, jid = queued_job(tmp_path, engine, seed=35)
    real_mark = Ledger.mark
    outage = [1]

    def mark(self: Ledger, job_id: int, stage: str) -> None:
        if outage:
            outage.pop()
            raise OperationalError("UPDATE jobs ...", {}, Exception("server closed the connection"))
        real_mark(self, job_id, stage)

    monkeypatch.setattr(Ledger, "mark", mark)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while ledger.job_state(jid) not in ("done", "failed") and time.monotonic() < deadline:
            time.sleep(0.05)
        view = ledger.job(jid)
        assert view is not None and view.state == "done", view
        assert view.attempts == 2 and view.reason is None and view.stages["encoded"] is not None
        assert worker.alive()
    finally:
        worker.stop(10)


def test_no_space_for_the_results_queues_the_job_until_there_is_room(
    tmp_path: Path, engine: OrtEngine, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """The results' file system is full: the job is not failed ("internal error: OSError:
    [Errno 28]" with a traceback, until an operator retried it); it waits in the queue with the
    reason as an event, and runs again by itself once the files can be written."""
    import errno
    import logging

    from segnode.node.pipeline import worker as worker_module

    worker, ledger, jid = queued_job(tmp_path, engine, seed=36)
    real_write = worker_module.write_atomic
    full = [1]

    def write_atomic(path: Path, data: bytes) -> None:
        if full:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(worker_module, "write_atomic", write_atomic)
    monkeypatch.setattr(worker_module, "NO_SPACE_WAIT_S", 0.01)
    with caplog.at_level(logging.ERROR, logger=worker_module.__name__):
        assert worker.run_once()
    view = ledger.job(jid)
    assert view is not None and view.state == "queued", view
    [line] = [r for r in caplog.records if f"job {jid}: no space left" in r.getMessage()]
    assert line.exc_info is None
    with ledger.engine.connect() as conn:
        events = conn.execute(select(Event.message).where(Event.job_id == jid)).scalars().all()
    assert any("no space for its results" in message for message in events), events
    full.clear()  # room again
    assert worker.run_once()
    view = ledger.job(jid)
    assert view is not None and view.state == "done" and view.reason is None, view
    assert len(result_paths(tmp_path, jid)) == 2


PHANTOM_MODEL = Path(__file__).parent / "data" / "nnunet_phantom" / "phantom.json"


def test_a_job_over_the_memory_limit_fails_naming_it_and_the_next_one_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``[engine] memory_limit``: a trained model's job estimated above it fails before it
    runs, with the figures; the worker goes on, and a job that fits gives its peak resident
    set in the timing line."""
    manifest = load_manifest(PHANTOM_MODEL)
    trained = OrtEngine()
    trained.load(manifest)
    worker, ledger, spool = worker_on(tmp_path, trained, manifest, {"engine": {"memory_limit": 1}})
    assert worker.memory_limit == 1024 * 1024
    geometry = PhantomGeometry(rows=64, columns=64, slices=12)
    first = ingest(ledger, spool, write_synthetic_series(tmp_path / "a", geometry, seed=41))
    _, view = run_job(worker, ledger, first, model="phantom")
    assert view.state == "failed"
    assert "not enough memory" in (view.reason or "")
    assert "[engine] memory_limit 0.0 GiB" in (view.reason or "")
    assert "64x64x12" in (view.reason or "")

    worker.memory_limit = 64 * 1024**3
    second = ingest(ledger, spool, write_synthetic_series(tmp_path / "b", geometry, seed=42))
    with caplog.at_level("INFO", logger="segnode.node.pipeline.worker"):
        _, view = run_job(worker, ledger, second, model="phantom")
    assert view.state == "done"
    timing = [r.getMessage() for r in caplog.records if "timing ms" in r.getMessage()]
    assert len(timing) == 1 and "peak RSS" in timing[0] and "estimated" in timing[0]
    # ... and the ledger keeps it with the job (the event of its move to done/encoded), and
    # the metrics gauge reads it from the worker.
    with ledger.engine.connect() as conn:
        messages = (
            conn.execute(select(Event.message).where(Event.job_id == view.id)).scalars().all()
        )
    assert any("peak RSS" in m and "estimated" in m for m in messages), messages
    assert 0 < worker.last_peak_rss < 64 * 1024**3


def test_memory_limit_defaults_to_a_share_of_the_available_memory(
    tmp_path: Path, engine: OrtEngine
) -> None:
    from segnode.engines.memory import available_bytes  # noqa: PLC0415

    worker, _, _ = worker_on(
        tmp_path, engine, load_manifest(DEFAULT_MODEL), {"engine": {"memory_fraction": 0.5}}
    )
    assert 0 < worker.memory_limit <= 0.5 * available_bytes() * 1.2
