"""Folders the node creates are durable before anything in them is acknowledged, and a job
that failed for lost spool files runs again when the sender sends them again.

A new name survives a power cut only once the folder holding it is fsynced: a new series
folder's name needs its study folder's fsync, a new study folder's the spool's. These tests
record which folders are fsynced (the real ``os.fsync``, each call's path read back from
``/proc/self/fd``); ``tests/test_power_cut.py`` proves the same on a file system that
really drops unsynced names.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydicom import dcmread

from segnode.storage import durable
from segnode.storage.ledger import MISSING_FILES, Ledger
from segnode.storage.spool import Spool, write_atomic
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.test_scp import Harness, send

STUDY, SERIES, OTHER = "1.2.3", "1.2.3.4", "1.2.3.5"


class FsyncLog:
    """Every fsync of this process while installed: the path of each synced descriptor."""

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def folders(self) -> list[Path]:
        return [p for p in self.paths if p.is_dir()]

    def clear(self) -> None:
        self.paths.clear()


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[FsyncLog]:
    log = FsyncLog()
    real = os.fsync

    def recorded(fd: int) -> None:
        log.paths.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    yield log


def test_a_new_series_folder_is_durable_in_its_parents_before_the_instance(
    tmp_path: Path, fsyncs: FsyncLog
) -> None:
    spool = Spool(tmp_path / "spool")
    fsyncs.clear()
    path, _ = spool.store(STUDY, SERIES, "1.2.3.4.1", [b"x" * 100])
    study, series = path.parent.parent, path.parent
    synced = fsyncs.folders()
    # The new study folder's name (in the spool), the new series folder's (in the study),
    # the instance's (in the series).
    assert spool.root in synced and study in synced and series in synced
    assert synced.index(spool.root) < synced.index(series)  # before the rename's own sync
    assert synced.index(study) < synced.index(series)


def test_folders_are_synced_once_per_new_folder_not_per_instance(
    tmp_path: Path, fsyncs: FsyncLog
) -> None:
    spool = Spool(tmp_path / "spool")
    spool.store(STUDY, SERIES, "1.2.3.4.1", [b"x"])
    fsyncs.clear()
    path, _ = spool.store(STUDY, SERIES, "1.2.3.4.2", [b"y"])
    assert fsyncs.folders() == [path.parent]  # the rename only
    fsyncs.clear()
    other, _ = spool.store(STUDY, OTHER, "1.2.3.5.1", [b"z"])
    # A new series in a known study: the study's fsync, not the spool's.
    assert fsyncs.folders() == [other.parent.parent, other.parent]


def test_a_folder_removed_and_made_again_is_synced_again(tmp_path: Path, fsyncs: FsyncLog) -> None:
    spool = Spool(tmp_path / "spool")
    path, _ = spool.store(STUDY, SERIES, "1.2.3.4.1", [b"x"])
    path.unlink()
    path.parent.rmdir()  # retention purged the series
    fsyncs.clear()
    spool.store(STUDY, SERIES, "1.2.3.4.1", [b"x"])
    assert path.parent.parent in fsyncs.folders()


def test_a_folder_left_by_an_earlier_process_is_synced_when_first_used(
    tmp_path: Path, fsyncs: FsyncLog
) -> None:
    # A process killed between a mkdir and its parent's fsync leaves a folder whose name no
    # disk may hold yet: the next process syncs it before it acknowledges anything in it.
    (tmp_path / "spool" / STUDY / SERIES).mkdir(parents=True)
    spool = Spool(tmp_path / "spool")
    fsyncs.clear()
    path, _ = spool.store(STUDY, SERIES, "1.2.3.4.1", [b"x"])
    assert {path.parent.parent, spool.root} <= set(fsyncs.folders())


def test_staging_folder_results_folder_and_a_new_ledger_are_durable(
    tmp_path: Path, fsyncs: FsyncLog
) -> None:
    spool = Spool(tmp_path / "data" / "spool")
    assert tmp_path / "data" in fsyncs.folders()  # the spool's name
    assert tmp_path in fsyncs.folders()  # the new data folder's name
    fsyncs.clear()
    spool.stage([b"x"])
    assert spool.root in fsyncs.folders()  # .incoming/'s name
    fsyncs.clear()
    # A job's results: results/ and results/<job id>/ are new.
    sr = tmp_path / "data" / "results" / "7" / "sr.dcm"
    write_atomic(sr, b"sr")
    assert [tmp_path / "data", sr.parent.parent, sr.parent] == fsyncs.folders()
    fsyncs.clear()
    ledger = Ledger(tmp_path / "data" / "db" / "ledger.sqlite")
    try:
        # The new folder's name (in data/) and the new database file's (in db/).
        assert {tmp_path / "data", tmp_path / "data" / "db"} <= set(fsyncs.folders())
    finally:
        ledger.close()


def test_ensure_folder_refuses_a_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(FileExistsError):
        durable.ensure_folder(tmp_path / "f")


# Recovery: a job whose spooled files went missing (a power cut before this fix, a disk
# swapped) failed; the sender's resend of the series runs it again, with the same UIDs.


@pytest.fixture(scope="module")
def series(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("series")
    return write_synthetic_series(out, PhantomGeometry(rows=32, columns=32, slices=4), seed=7)


def _send_all(h: Harness, files: list[Path]) -> None:
    a = h.assoc()
    for f in files:
        assert send(a, f) == 0
    a.release()  # type: ignore[attr-defined]
    h.settle()


def _failed_for_missing_files(h: Harness, files: list[Path], reason: str | None = None) -> int:
    """The series stored, its job run and failed because every file went missing."""
    _send_all(h, files)
    uid = str(dcmread(files[0]).SeriesInstanceUID)
    jid = h.ledger.create_job(uid, trigger="test", model="tissue", engine="onnxruntime")
    assert jid is not None
    claimed = h.ledger.claim_next_job()
    assert claimed is not None and claimed.id == jid
    for p in h.ledger.instance_paths(uid):
        p.unlink()
    h.ledger.fail_job(jid, reason or f"{len(files)} {MISSING_FILES}, e.g. x.dcm")
    return jid


def test_a_job_failed_for_missing_files_runs_again_when_they_are_sent_again(
    tmp_path: Path, series: list[Path]
) -> None:
    h = Harness(tmp_path / "node")
    try:
        jid = _failed_for_missing_files(h, series)
        before = h.ledger.job(jid)
        assert before is not None and before.state == "failed"
        _send_all(h, series[:2])  # part of the resend: still failed (files still missing)
        job = h.ledger.job(jid)
        assert job is not None and job.state == "failed"
        _send_all(h, series[2:])
        job = h.ledger.job(jid)
        assert job is not None and job.state == "queued"
        assert (job.seg_sop_uid, job.sr_sop_uid) == (before.seg_sop_uid, before.sr_sop_uid)
        assert all(p.exists() for p in h.ledger.instance_paths(job.series_instance_uid))
    finally:
        h.close()


def test_a_job_failed_for_another_reason_stays_failed_on_a_resend(
    tmp_path: Path, series: list[Path]
) -> None:
    h = Harness(tmp_path / "node")
    try:
        jid = _failed_for_missing_files(h, series, reason="the model failed: bad input")
        _send_all(h, series)
        job = h.ledger.job(jid)
        assert job is not None and job.state == "failed"
    finally:
        h.close()
