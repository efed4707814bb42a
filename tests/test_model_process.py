"""``[engine] model_process``: a model's engine in a process of its own
(:mod:`segnode.engines.model_process`).

Real child processes on the bundled default model (ONNX Runtime) and on a trained (version-2)
band model: the same labels as the engine in the node's own process, errors raised again in
the node with their type and message, a child killed in the middle of a job failing only that
job (the next one starts a new child), no shared files left behind, a child that ends with the
node, and a whole node running its jobs through one.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from scripts.harness import write_config
from segnode.engines import create_engine, load_manifest
from segnode.engines.base import EngineError
from segnode.engines.manifest import ModelManifest
from segnode.engines.model_process import SHARED_PREFIX, ProcessEngine, segment_volume
from segnode.engines.models import default_manifest_path
from segnode.engines.preprocess.orientation import GeometryError
from segnode.node.config import load_config
from segnode.node.ops.service import Node
from segnode.node.web.status import worker_figures
from tests.conftest import free_port, wait_for
from tests.fixtures.synthetic import PhantomGeometry, synthetic_datasets
from tests.test_engine_load import run
from tests.test_trained_runtime import geometry, phantom, tilted_geometry, write_trained

#: Every test's shared files in a folder of its own (tests/conftest.py), to count leftovers.
pytestmark = pytest.mark.usefixtures("shared_folder")


@pytest.fixture(scope="module")
def tissue() -> ModelManifest:
    return load_manifest(default_manifest_path())


@pytest.fixture
def proc_engine(tissue: ModelManifest) -> Iterator[ProcessEngine]:
    engine = ProcessEngine("onnxruntime", {"threads": 1})
    engine.load(tissue)
    yield engine
    engine.close()


def _volume(shape: tuple[int, int, int] = (24, 96, 96), seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    hu = rng.normal(0.0, 400.0, shape).astype(np.float32)
    hu[:, 20:70, 30:80] = 60.0  # a soft-tissue block with the noise around it
    return hu


def send_series(port: int, seed: int, slices: int = 4) -> list[int]:
    """C-STORE a small synthetic CT series (its own UIDs per seed) on one association."""
    from pynetdicom import AE
    from pynetdicom.sop_class import CTImageStorage  # type: ignore[attr-defined]

    ae = AE(ae_title="MODALITY")
    ae.add_requested_context(CTImageStorage)
    assoc = ae.associate("127.0.0.1", port, ae_title="SEGNODE")
    assert assoc.is_established
    try:
        series = synthetic_datasets(PhantomGeometry(rows=64, columns=64, slices=slices), seed=seed)
        return [int(assoc.send_c_store(ds).Status) for ds in series]
    finally:
        assoc.release()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): look at its state
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_labels_match_the_engine_in_the_node(
    proc_engine: ProcessEngine, tissue: ModelManifest, shared_folder: Path
) -> None:
    inside = create_engine("onnxruntime", threads=1)
    inside.load(tissue)
    hu = _volume()
    want = inside.segment(hu)
    got, sums = proc_engine.segment_job(hu)
    assert got.dtype == np.uint8 and got.shape == hu.shape
    assert np.array_equal(got, want)
    assert len(np.unique(want)) > 1  # the comparison is not of two empty maps
    assert sums is None  # ONNX Runtime does not sum on a device
    assert proc_engine.pid is not None and proc_engine.pid != os.getpid()
    assert proc_engine.precision_used == "fp32" and proc_engine.window_batch() >= 1
    assert proc_engine.has_room() is False  # ONNX Runtime runs one job at a time
    # the worker's dispatch goes to the child
    again, _ = segment_volume(proc_engine, tissue, hu, None)
    assert np.array_equal(again, want)
    assert np.array_equal(got, want)  # the first label map is not the second's file
    proc_engine.close()
    assert list(shared_folder.iterdir()) == []  # the shared files are gone
    assert np.array_equal(got, want)  # and a label map still held stays readable


def test_the_shared_files_are_kept_for_the_next_jobs(
    proc_engine: ProcessEngine, shared_folder: Path
) -> None:
    """The volume's file and the label map's (once the worker lets go of it) serve the next
    job: no new file, no page faults on fresh memory; the idle ones are bounded."""
    first, _ = proc_engine.segment_job(_volume(seed=1))
    files = {p.name for p in shared_folder.iterdir()}
    assert sorted(n.rsplit(".", 1)[1] for n in files) == ["hu", "labels"]
    held = first.copy()
    del first
    gc.collect()
    for seed in (2, 3, 4):
        labels, _ = proc_engine.segment_job(_volume(seed=seed))
        assert {p.name for p in shared_folder.iterdir()} == files, seed
        del labels
        gc.collect()
    # a smaller volume reuses a file twice its size at most: here a new one
    small, _ = proc_engine.segment_job(_volume((6, 32, 32)))
    assert len(list(shared_folder.iterdir())) == 4
    # two label maps held at once are two files; idle files stay at most two per kind
    maps = [proc_engine.segment_job(_volume(seed=s))[0] for s in (1, 5, 6)]
    assert np.array_equal(maps[0], held)
    del maps, small
    gc.collect()
    names = [p.name for p in shared_folder.iterdir()]
    assert sum(n.endswith(".labels") for n in names) == 2
    assert sum(n.endswith(".hu") for n in names) == 2


def test_two_jobs_at_once_each_get_their_own_labels(proc_engine: ProcessEngine) -> None:
    volumes = [_volume(seed=s) for s in (1, 2, 3)]
    results: dict[int, np.ndarray] = {}

    def one(i: int) -> None:
        results[i] = proc_engine.segment_job(volumes[i])[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, hu in enumerate(volumes):
        assert np.array_equal(results[i], proc_engine.segment_job(hu)[0]), i


def test_a_trained_model_runs_with_its_geometry_and_its_errors_come_back(
    tmp_path: Path, shared_folder: Path
) -> None:
    manifest = load_manifest(write_trained(tmp_path / "bands"))
    inside = create_engine("onnxruntime", threads=1)
    inside.load(manifest)
    engine = ProcessEngine("onnxruntime", {"threads": 1})
    engine.load(manifest)
    try:
        hu = phantom()
        where = geometry("head-first", hu.shape)
        want, _ = segment_volume(inside, manifest, hu, where)
        got, _ = segment_volume(engine, manifest, hu, where)
        assert np.array_equal(got, want)
        assert set(np.unique(got)) == {0, 1, 2}
        # a tilted series: the child's GeometryError, its type and its message
        small = phantom((12, 24, 24))
        tilted = tilted_geometry(12, 12.0)
        with pytest.raises(GeometryError, match=r"oblique series: an image axis is 12\.0"):
            engine.segment_job(small, tilted)
        # the child still serves after a job's error
        assert np.array_equal(engine.segment_job(hu, where)[0], want)
        assert engine.restarts == 0
        # the label map held, and at most two idle files of each kind
        assert len(list(shared_folder.iterdir())) <= 5
    finally:
        engine.close()
    assert list(shared_folder.iterdir()) == []


def test_files_a_dead_node_left_are_removed_at_start(
    tissue: ModelManifest, shared_folder: Path
) -> None:
    """A node killed in the middle of a job leaves its shared volume in /dev/shm (memory):
    the next model process' start removes it, and keeps those of running processes."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    stale = shared_folder / f"{SHARED_PREFIX}{int(dead.stdout)}-abc.hu"
    stale.write_bytes(b"\0" * 4096)
    live = shared_folder / f"{SHARED_PREFIX}{os.getpid()}-def.hu"
    live.write_bytes(b"\0" * 4096)
    other = shared_folder / "someone-else.bin"
    other.write_bytes(b"x")
    engine = ProcessEngine("onnxruntime", {"threads": 1})
    engine.load(tissue)
    try:
        assert not stale.exists()
        assert live.exists() and other.exists()
    finally:
        engine.close()


def test_a_load_error_is_raised_in_the_node(tissue: ModelManifest, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.onnx"
    broken = type(tissue)(**{**tissue.__dict__, "onnx_path": missing})
    engine = ProcessEngine("onnxruntime", {})
    with pytest.raises(EngineError) as caught:
        engine.load(broken)
    assert "nowhere.onnx" in str(caught.value)
    proc = engine._proc
    assert proc is not None and proc.poll() is not None  # the child did not stay behind
    assert engine.pid is None


def test_a_killed_child_fails_its_job_and_the_next_job_starts_another(
    proc_engine: ProcessEngine, shared_folder: Path
) -> None:
    big = _volume((160, 512, 512))  # long enough to be killed in the middle
    first = proc_engine.pid
    assert first is not None
    outcome: list[BaseException | None] = []

    def job() -> None:
        try:
            proc_engine.segment_job(big)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=job)
    thread.start()
    wait_for(
        lambda: any(p.name.startswith(SHARED_PREFIX) for p in shared_folder.iterdir()),
        30,
        "the job's shared volume",
    )
    time.sleep(0.3)
    os.kill(first, signal.SIGKILL)
    thread.join(60)
    [error] = outcome
    assert isinstance(error, EngineError), error
    assert "killed by SIGKILL while it ran this job" in str(error)
    wait_for(lambda: not _alive(first), 10, "the killed child reaped")
    # the job's files went back to the pools (kept for the next job, not lost)
    kept = {p.name for p in shared_folder.iterdir()}
    assert sorted(n.rsplit(".", 1)[1] for n in kept) == ["hu", "labels"]
    # the next job starts a new child and succeeds
    hu = _volume()
    labels, _ = proc_engine.segment_job(hu)
    assert labels.shape == hu.shape and len(np.unique(labels)) > 1
    assert proc_engine.restarts == 1
    assert proc_engine.pid not in (None, first)


def test_close_ends_the_child_and_it_is_not_started_again(
    tissue: ModelManifest,
) -> None:
    engine = ProcessEngine("onnxruntime", {"threads": 1})
    engine.load(tissue)
    pid = engine.pid
    assert pid is not None
    engine.close()
    wait_for(lambda: not _alive(pid), 10, "the child gone after close")
    with pytest.raises(EngineError, match="closed"):
        engine.segment_job(_volume())


def test_the_child_ends_with_the_node(tmp_path: Path) -> None:
    """A node killed with SIGKILL leaves no model process behind."""
    script = tmp_path / "holder.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            from segnode.engines import load_manifest
            from segnode.engines.model_process import ProcessEngine
            from segnode.engines.models import default_manifest_path
            engine = ProcessEngine("onnxruntime", {"threads": 1})
            engine.load(load_manifest(default_manifest_path()))
            print(engine.pid, flush=True)
            time.sleep(120)
            """
        )
    )
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        child = int(holder.stdout.readline())
        assert _alive(child)
        holder.kill()
        holder.wait(10)
        wait_for(lambda: not _alive(child), 10, "the model process gone with its node")
    finally:
        holder.kill()


def test_a_node_runs_its_jobs_in_a_model_process(tmp_path: Path) -> None:
    config = load_config(
        write_config(
            tmp_path / "config.toml",
            tmp_path / "data",
            free_port(),
            engine={"model_process": True},
            series={"quiet_period_s": 60},
        )
    )
    assert config.engine.model_process is True
    node = Node(config)
    node.start()
    thread, errors = run(node)
    try:
        engine: Any = node.engine
        assert isinstance(engine, ProcessEngine)
        first = engine.pid
        assert first is not None and first != os.getpid()
        assert send_series(node.scp.port, seed=3) == [0x0000] * 4
        wait_for(lambda: node.ledger.counts()["jobs"].get("done"), 60, "the first job done")
        # the model process dies while idle: the next series starts another and is done
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: engine.pid is None, 10, "the node saw its model process end")
        assert send_series(node.scp.port, seed=4, slices=5) == [0x0000] * 5
        wait_for(lambda: node.ledger.counts()["jobs"].get("done") == 2, 60, "the second job")
        assert engine.pid not in (None, first)
        assert node.ledger.counts()["jobs"] == {"done": 2}
        processes = worker_figures(node)["model_processes"]
        assert processes == {"default": {"pid": engine.pid, "restarts": 1}}
    finally:
        node.request_stop()
        thread.join(30)
    assert not errors
    assert engine.pid is None  # the node's stop closed it
