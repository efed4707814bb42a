"""``[results] encode_processes``: the SEG encoded and checked in processes of their own
(:mod:`segnode.node.results.encode_process`).

Real child processes: the same file as the encoder in the node, bit for bit, for 117
segments; errors raised again in the node with their type and message and no file left; an
encoder killed in the middle of a SEG failing only that SEG (the next one starts a new
process); and a worker whose jobs' SEGs come from one, read back by highdicom.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import highdicom as hd
import numpy as np
import pytest
from pydicom import dcmread
from pydicom.uid import DeflatedExplicitVRLittleEndian

from bench.seg_size import blob_labels, blob_manifest, blob_volume
from scripts.harness import write_config
from segnode.engines import load_manifest
from segnode.engines.child_process import SHARED_PREFIX
from segnode.engines.models import default_manifest_path
from segnode.engines.ort_backend import OrtEngine
from segnode.node import __version__
from segnode.node.config import load_config
from segnode.node.errors import NoSegmentsError, ResultError
from segnode.node.ops.service import Node
from segnode.node.pipeline.worker import result_paths
from segnode.node.results.build import Equipment, ResultUIDs
from segnode.node.results.encode_process import SegEncoders, encode_and_write
from segnode.node.results.seg_encode import SegPlan
from segnode.node.results.statistics import segment_statistics
from segnode.node.web.status import worker_figures
from tests.conftest import free_port, wait_for
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.test_engine_load import run
from tests.test_model_process import send_series
from tests.test_worker import ingest, run_job, worker_on

SHAPE = (24, 96, 96)


#: Every test's shared files in a folder of its own (tests/conftest.py), to count leftovers.
pytestmark = pytest.mark.usefixtures("shared_folder")


@pytest.fixture(scope="module")
def plan() -> SegPlan:
    """A deflated BINARY SEG plan of 117 labels on a synthetic CT of :data:`SHAPE`."""
    return SegPlan.prepare(
        blob_volume(SHAPE),
        blob_manifest(),
        ResultUIDs.new(),
        segmentation_type="BINARY",
        transfer_syntax=DeflatedExplicitVRLittleEndian,
        equipment=Equipment.for_seg(__version__),
        created=datetime(2026, 12, 7, 8, 0, 0),
    )


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    return blob_labels(SHAPE)


@pytest.fixture
def encoders() -> Iterator[SegEncoders]:
    pool = SegEncoders(1)
    pool.start()
    yield pool
    pool.close()


def test_an_encoder_process_writes_the_bytes_of_the_node(
    encoders: SegEncoders, plan: SegPlan, labels: np.ndarray, tmp_path: Path, shared_folder: Path
) -> None:
    with ThreadPoolExecutor(1) as helper:
        here = encode_and_write(plan, labels, tmp_path / "here" / "seg.dcm", helper)
    there = encoders.submit(plan, labels, tmp_path / "there" / "seg.dcm").result(60)
    assert there.pid != os.getpid() and here.pid == os.getpid()
    assert there.temp.read_bytes() == here.temp.read_bytes()
    assert there.size == here.size == there.temp.stat().st_size
    assert there.segment_numbers == here.segment_numbers and len(there.segment_numbers) == 117
    assert there.frames == here.frames > 117
    seg = hd.seg.segread(there.temp)  # a reader we did not write
    assert seg.number_of_segments == 117
    # the label map's file is kept for the next SEG: no new file, the same bytes
    files = sorted(shared_folder.iterdir())
    assert [p.suffix for p in files] == [".seglabels"]
    again = encoders.submit(plan, labels, tmp_path / "again" / "seg.dcm").result(60)
    assert again.temp.read_bytes() == here.temp.read_bytes()
    assert sorted(shared_folder.iterdir()) == files
    encoders.close()
    assert list(shared_folder.iterdir()) == []  # the shared label map is gone


def test_an_encoder_process_gives_the_statistics_of_the_node(
    encoders: SegEncoders, plan: SegPlan, labels: np.ndarray, tmp_path: Path, shared_folder: Path
) -> None:
    volume = blob_volume(SHAPE)
    there = encoders.submit(
        plan, labels, tmp_path / "seg.dcm", volume.hu, voxel_volume_ml=volume.voxel_volume_ml
    ).result(60)
    assert there.statistics == segment_statistics(volume, labels, plan.manifest)
    assert len(there.statistics) == 117 and there.statistics_s > 0
    assert sorted(p.suffix for p in shared_folder.iterdir()) == [".seghu", ".seglabels"]
    encoders.close()
    assert list(shared_folder.iterdir()) == []  # the label map and the HU are gone


def test_errors_come_back_with_their_type_and_leave_no_file(
    encoders: SegEncoders, plan: SegPlan, labels: np.ndarray, tmp_path: Path, shared_folder: Path
) -> None:
    out = tmp_path / "out"
    with pytest.raises(NoSegmentsError, match="found no segment"):
        encoders.submit(plan, np.zeros_like(labels), out / "seg.dcm").result(60)
    unknown = labels.copy()
    unknown[0, 0, 0] = 200
    with pytest.raises(ResultError, match=r"values \[200\]"):
        encoders.submit(plan, unknown, out / "seg.dcm").result(60)
    assert not out.exists() or list(out.iterdir()) == []
    assert [p.suffix for p in shared_folder.iterdir()] == [".seglabels"]  # kept, not leaked
    # and the process still serves
    assert encoders.submit(plan, labels, out / "seg.dcm").result(60).frames > 0


def test_a_killed_encoder_fails_its_seg_and_the_next_starts_another(
    encoders: SegEncoders, plan: SegPlan, tmp_path: Path, shared_folder: Path
) -> None:
    big = blob_labels((160, 512, 512))  # about a second of encoding: time to kill it
    big_plan = SegPlan.prepare(
        blob_volume(big.shape),
        blob_manifest(),
        ResultUIDs.new(),
        transfer_syntax=DeflatedExplicitVRLittleEndian,
        equipment=Equipment.for_seg(__version__),
    )
    (first,) = [f["pid"] for f in encoders.figures()]
    assert first is not None
    future = encoders.submit(big_plan, big, tmp_path / "a" / "seg.dcm")
    wait_for(
        lambda: any(p.name.startswith(SHARED_PREFIX) for p in shared_folder.iterdir()),
        10,
        "the label map shared",
    )
    os.kill(first, signal.SIGKILL)
    with pytest.raises(ResultError, match="was killed by SIGKILL while it ran this job"):
        future.result(60)
    assert [p.suffix for p in shared_folder.iterdir()] == [".seglabels"]  # back in the pool
    again = encoders.submit(plan, blob_labels(SHAPE), tmp_path / "b" / "seg.dcm").result(60)
    assert again.frames > 0
    assert encoders.figures() == [{"pid": again.pid, "restarts": 1}]
    assert again.pid != first


def test_two_encoders_share_the_segs(plan: SegPlan, labels: np.ndarray, tmp_path: Path) -> None:
    """Two SEGs at once go to two processes."""
    pool = SegEncoders(2)
    pool.start()
    try:
        gate = threading.Barrier(2)

        def one(k: int) -> int:
            gate.wait()
            return pool.submit(plan, labels, tmp_path / str(k) / "seg.dcm").result(60).pid

        with ThreadPoolExecutor(2) as threads:
            pids = set(threads.map(one, range(2)))
        assert pids == {f["pid"] for f in pool.figures()}
    finally:
        pool.close()
    assert all(f["pid"] is None for f in pool.figures())


def test_a_worker_encodes_its_segs_in_an_encoder_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = OrtEngine(threads=1)
    manifest = load_manifest(default_manifest_path())
    engine.load(manifest)
    worker, ledger, spool = worker_on(
        tmp_path, engine, manifest, {"results": {"encode_processes": 1}}
    )
    try:
        files = write_synthetic_series(
            tmp_path / "in", PhantomGeometry(rows=96, columns=96, slices=10), seed=31
        )
        uid = ingest(ledger, spool, files)
        with caplog.at_level("INFO", logger="segnode.node.pipeline.worker"):
            jid, view = run_job(worker, ledger, uid)  # starts the encoder process
        assert view.state == "done", view.reason
        assert worker.encoders is not None
        ((pid, restarts),) = [(f["pid"], f["restarts"]) for f in worker.encoders.figures()]
        assert pid not in (None, os.getpid()) and restarts == 0
        line = next(r.getMessage() for r in caplog.records if "timing ms" in r.getMessage())
        assert "SEG encode" in line and f"encoder process {pid})" in line
        assert f"(CPU in encoder process {pid}, " in line  # the statistics too
        seg_path = next(p for p in result_paths(tmp_path, jid) if p.name.startswith("seg-"))
        seg = hd.seg.segread(seg_path)  # a reader we did not write
        assert str(seg.SOPInstanceUID) == view.seg_sop_uid
        assert dcmread(seg_path).file_meta.TransferSyntaxUID == DeflatedExplicitVRLittleEndian
        assert [p.name for p in seg_path.parent.iterdir() if p.name.startswith(".")] == []
    finally:
        worker.stop()
        engine.close()
    assert [f["pid"] for f in worker.encoders.figures()] == [None]  # stop closed it


def test_a_node_with_encoder_processes_serves_on_after_one_dies(tmp_path: Path) -> None:
    config = load_config(
        write_config(
            tmp_path / "config.toml",
            tmp_path / "data",
            free_port(),
            results={"encode_processes": 1},
            series={"quiet_period_s": 60},
        )
    )
    node = Node(config)
    node.start()
    thread, errors = run(node)
    try:
        assert send_series(node.scp.port, seed=3) == [0x0000] * 4
        wait_for(lambda: node.ledger.counts()["jobs"].get("done"), 60, "the first job done")
        (figures,) = worker_figures(node)["encode_processes"]
        first = figures["pid"]
        assert first not in (None, os.getpid())
        os.kill(first, signal.SIGKILL)  # while idle: the next SEG starts another
        wait_for(lambda: node.worker.encoders.figures()[0]["pid"] is None, 10, "its end seen")
        assert send_series(node.scp.port, seed=4, slices=5) == [0x0000] * 5
        wait_for(lambda: node.ledger.counts()["jobs"].get("done") == 2, 60, "the second job")
        assert node.ledger.counts()["jobs"] == {"done": 2}
        (figures,) = worker_figures(node)["encode_processes"]
        assert figures["restarts"] == 1 and figures["pid"] not in (None, first)
    finally:
        node.request_stop()
        thread.join(30)
    assert not errors
    assert node.worker.encoders.figures()[0]["pid"] is None  # the node's stop closed it
