"""The worker on a real ledger, spool and ONNX Runtime engine (no network)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from pydicom import dcmread

from engines.manifest import load_manifest
from engines.ort_backend import OrtEngine
from node.config import DEFAULT_MODEL, from_dict
from node.synthetic import synthetic_datasets, write_synthetic_series
from node.worker import Worker, result_paths
from storage.ledger import InstanceRecord, Ledger
from storage.spool import Spool


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


def make(tmp_path: Path, engine: OrtEngine) -> tuple[Worker, Ledger, Spool]:
    cfg = replace(from_dict({}), data_dir=tmp_path)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    return (
        Worker(cfg, ledger, engine, load_manifest(DEFAULT_MODEL)),
        ledger,
        Spool(tmp_path / "spool"),
    )


def test_job_encodes_seg_and_sr_with_ledger_uids(tmp_path: Path, engine: OrtEngine) -> None:
    worker, ledger, spool = make(tmp_path, engine)
    files = write_synthetic_series(tmp_path / "in", rows=96, columns=96, slices=10, seed=31)
    uid = ingest(ledger, spool, files)
    jid = ledger.create_job(uid, trigger="test", model="tissue", engine="onnxruntime")
    assert jid is not None and worker.run_once()
    view = ledger.job(jid)
    assert view is not None and view.state == "done"  # no destinations configured
    assert all(view.stages[k] is not None for k in ("volume", "inference", "encoded"))
    seg, sr = (dcmread(p) for p in result_paths(tmp_path, jid))
    assert {str(seg.SOPInstanceUID), str(sr.SOPInstanceUID)} == {view.seg_sop_uid, view.sr_sop_uid}
    assert not worker.run_once()  # queue empty


def test_no_segment_ends_done_with_reason(tmp_path: Path, engine: OrtEngine) -> None:
    worker, ledger, spool = make(tmp_path, engine)
    out = tmp_path / "air"
    out.mkdir()
    files = []
    for i, ds in enumerate(synthetic_datasets(rows=32, columns=32, slices=4, seed=32)):
        arr = np.zeros((32, 32), dtype=ds.pixel_array.dtype)  # stored 0 -> -1024 HU: all air
        ds.PixelData = arr.tobytes()
        f = out / f"{i}.dcm"
        ds.save_as(f, enforce_file_format=True)
        files.append(f)
    uid = ingest(ledger, spool, files)
    jid = ledger.create_job(uid, trigger="test", model="tissue", engine="onnxruntime")
    assert jid is not None and worker.run_once()
    view = ledger.job(jid)
    assert view is not None and view.state == "done"
    assert "nothing to send" in (view.reason or "")
    assert result_paths(tmp_path, jid) == []


def test_missing_spool_file_fails_with_reason(tmp_path: Path, engine: OrtEngine) -> None:
    worker, ledger, spool = make(tmp_path, engine)
    files = write_synthetic_series(tmp_path / "in", rows=32, columns=32, slices=4, seed=33)
    uid = ingest(ledger, spool, files)
    ledger.instance_paths(uid)[1].unlink()
    jid = ledger.create_job(uid, trigger="test", model="tissue", engine="onnxruntime")
    assert jid is not None and worker.run_once()
    view = ledger.job(jid)
    assert view is not None and view.state == "failed" and "missing" in (view.reason or "")
