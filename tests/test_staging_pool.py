"""The staging pool: recycled, pre-written staging files (segnode.storage.spool.StagingPool), the
start-up checks that keep crash semantics whole with them, and the SCP's refill."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from pydicom import dcmread
from pydicom.uid import ExplicitVRLittleEndian
from pynetdicom.sop_class import CTImageStorage  # type: ignore[attr-defined]

from segnode.storage.ledger import InstanceRecord, Ledger
from segnode.storage.spool import POOL_SUFFIX, Spool
from tests.conftest import wait_for
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series

SMALL = 4096  # pool file size in these tests (bytes)


def pool_spool(root: Path, files: int = 3, size: int = SMALL) -> Spool:
    spool = Spool(root, pool_files=files)
    spool.pool.file_bytes = size
    return spool


def test_fill_take_and_cut_to_size(tmp_path: Path) -> None:
    spool = pool_spool(tmp_path / "spool")
    assert spool.pool.fill() == 3 and len(spool.pool) == 3
    assert spool.pool.fill() == 0  # already full
    files = sorted(spool.incoming_dir.iterdir())
    assert all(p.name.endswith(POOL_SUFFIX) and p.stat().st_size == SMALL for p in files)

    staging = spool.open_staged()
    assert staging.path in files and len(spool.pool) == 2
    staged = staging.write_synced([b"head", memoryview(b"-body")])
    assert staged.recycled and staged.size == 9
    assert staged.path.read_bytes() == b"head-body"  # cut: no byte of the old content left
    path = spool.place(staged, "1.2", "1.3", "1.4")
    spool.sync_folder(path, staged)
    assert path.read_bytes() == b"head-body" and not staged.path.exists()


def test_an_instance_larger_than_a_pool_file_is_written_whole(tmp_path: Path) -> None:
    spool = pool_spool(tmp_path / "spool", files=1)
    spool.pool.fill()
    data = os.urandom(3 * SMALL + 5)
    path, size = spool.store("1.2", "1.3", "1.5", [data])
    assert size == len(data) and path.read_bytes() == data
    assert len(spool.pool) == 0


def test_without_pool_files_a_new_file_is_staged(tmp_path: Path) -> None:
    spool = pool_spool(tmp_path / "spool", files=1)  # never filled
    staging = spool.open_staged()
    assert not staging.path.name.endswith(POOL_SUFFIX) and staging.capacity == 0
    staged = staging.write_synced([b"abc"])
    assert not staged.recycled and staged.path.read_bytes() == b"abc"


def test_an_abandoned_pool_file_goes_back_untouched(tmp_path: Path) -> None:
    spool = pool_spool(tmp_path / "spool", files=2)
    spool.pool.fill()
    staging = spool.open_staged()
    assert len(spool.pool) == 1
    staging.abandon()
    assert len(spool.pool) == 2 and staging.path.stat().st_size == SMALL
    fresh = pool_spool(tmp_path / "other", files=0).open_staged()
    fresh.abandon()  # a new staged file is removed instead
    assert not fresh.path.exists()


def test_restart_keeps_whole_pool_files_and_clears_the_rest(tmp_path: Path) -> None:
    spool = pool_spool(tmp_path / "spool", files=3)
    spool.pool.fill()
    cut = spool.open_staged()  # in flight at the crash: written and cut, not yet renamed
    cut.write_synced([b"partial"])
    leftover = spool.stage([b"a staged file"])
    spool.pool.fill()  # refilled meanwhile: 3 idle again

    again = pool_spool(tmp_path / "spool", files=2)
    assert again.clear_incoming() == 2  # the cut pool file and the staged file
    assert not leftover.path.exists() and not cut.path.exists()
    assert len(again.pool) == 2  # whole pool files adopted, up to the target
    left = sorted(p.name for p in again.incoming_dir.iterdir())
    assert len(left) == 2 and all(n.endswith(POOL_SUFFIX) for n in left)


def test_fill_stops_when_asked_and_on_os_errors(tmp_path: Path) -> None:
    spool = pool_spool(tmp_path / "spool", files=5)
    calls = []
    assert spool.pool.fill(should_stop=lambda: calls.append(1) is None and len(calls) > 2) == 2
    blocker = tmp_path / "blocked"
    blocker.write_text("not a folder")
    broken = Spool(tmp_path / "s2", pool_files=2)
    broken.pool.folder = blocker / "incoming"  # cannot be created
    assert broken.pool.fill() == 0


def rec(sop: str) -> InstanceRecord:
    return InstanceRecord(sop, str(CTImageStorage), "1.3", "1.2", ExplicitVRLittleEndian, "CT", "M")


def test_start_up_drops_a_row_whose_file_has_another_size(tmp_path: Path) -> None:
    """A recycled file renamed before its cut to size persisted was never acknowledged:
    start-up removes it with its row (the sender's retry stores it again)."""
    spool = pool_spool(tmp_path / "spool", files=1)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    try:
        good, size = spool.store("1.2", "1.3", "1.4", [b"complete"])
        assert ledger.record_instance(rec("1.4"), good, size)
        uncut = spool.path_for("1.2", "1.3", "1.5")
        uncut.write_bytes(b"instance" + bytes(SMALL - 8))  # the old length survived
        assert ledger.record_instance(rec("1.5"), uncut, 8)
        assert ledger.drop_unstored_instances() == 1
        assert ledger.has_instance("1.4") and good.exists()
        assert not ledger.has_instance("1.5") and not uncut.exists()
    finally:
        ledger.close()


def test_the_node_refills_its_pool_after_an_association(tmp_path: Path) -> None:
    """A series longer than the pool is stored whole (pool files first, then new files);
    once the association has ended and no job runs, the pool is written back to its size."""
    from tests.scp_harness import SCPHarness

    h = SCPHarness(tmp_path / "n", {"node": {"staging_pool_mb": 2}})  # 4 files of 512 KiB
    try:
        pool = h.spool.pool
        assert pool.target == 4
        assert h.scp.fill_staging_pool() == 4
        paths = write_synthetic_series(
            tmp_path / "ct", PhantomGeometry(rows=64, columns=64, slices=6), seed=81
        )
        a = h.assoc()
        for p in paths:
            status = a.send_c_store(dcmread(p))
            assert status.Status == 0
        assert len(pool) == 0 or len(pool) == 1  # the next file pre-opened after a response
        job_running = True
        h.scp.busy_elsewhere = lambda: job_running
        a.release()
        time.sleep(1.5)  # three refill delays: nothing written while a job runs
        assert len(pool) <= 1
        job_running = False
        wait_for(lambda: len(pool) == 4, 10, "pool refilled")
        stored = sorted(h.spool.instance_files())
        assert len(stored) == 6
        for p in paths:
            ds = dcmread(p)
            kept = h.spool.path_for(ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.SOPInstanceUID)
            assert dcmread(kept).PixelData == ds.PixelData
            with sqlite3.connect(h.config.data_dir / "ledger.sqlite") as db:
                (size,) = db.execute(
                    "SELECT size FROM instances WHERE sop_instance_uid = ?",
                    (str(ds.SOPInstanceUID),),
                ).fetchone()
            assert kept.stat().st_size == size
    finally:
        h.close()
