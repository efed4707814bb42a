"""Several jobs in progress at once (``[engine] lanes``): the engine gate, the memory budget,
and the worker's lanes on a real ledger, spool and ONNX Runtime engine."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from segnode.engines.manifest_parse import load_manifest
from segnode.engines.ort_backend import OrtEngine
from segnode.node.config import DEFAULT_MODEL
from segnode.node.pipeline.gate import EngineGate
from segnode.node.pipeline.worker import MemoryBudget, Worker
from segnode.storage.ledger import Ledger
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.test_worker import ingest, worker_on

# ------------------------------------------------------------------------------- the gate


def _enter_in_order(gate: EngineGate, waiters: list[tuple[int, int, float]]) -> list[int]:
    """Hold the gate, queue ``waiters`` (job id, priority, queued seconds) behind it one by
    one, release it; return the order they entered in."""
    entered: list[int] = []
    release = threading.Event()

    def first() -> None:
        with gate.hold(0):
            release.wait(10)

    def waiter(job_id: int, priority: int, queued_s: float) -> None:
        with gate.hold(job_id, priority, queued_s):
            entered.append(job_id)

    threads = [threading.Thread(target=first)]
    threads[0].start()
    while gate.holder() != 0:
        time.sleep(0.001)
    for n, (job_id, priority, queued_s) in enumerate(waiters):
        t = threading.Thread(target=waiter, args=(job_id, priority, queued_s))
        t.start()
        threads.append(t)
        while sum(gate.waiting().values()) < n + 1:
            time.sleep(0.001)
    assert gate.waiting() == {
        p: sum(1 for _, q, _ in waiters if q == p) for p in {p for _, p, _ in waiters}
    }
    release.set()
    for t in threads:
        t.join(10)
    return entered


def test_the_most_urgent_waiting_job_enters_next_then_the_oldest() -> None:
    gate = EngineGate()
    assert _enter_in_order(gate, [(1, 0, 9.0), (2, 5, 1.0), (3, 0, 8.0), (4, 5, 0.5)]) == [
        2,
        4,
        1,
        3,
    ]
    assert gate.holder() is None and gate.waiting() == {}


def test_a_job_queued_past_max_wait_enters_before_urgent_ones() -> None:
    gate = EngineGate(max_wait_s=60)
    order = _enter_in_order(gate, [(1, 0, 30.0), (2, 9, 1.0), (3, 0, 90.0), (4, 0, 120.0)])
    assert order == [4, 3, 2, 1]


def test_busy_share_and_expected_model_time() -> None:
    gate = EngineGate()
    assert gate.busy_fraction() == 0.0 and gate.mean_model_s() is None
    with gate.hold(1) as waited:
        assert waited < 0.5
        time.sleep(0.2)
        assert gate.holder() == 1 and gate.busy_fraction() > 0
    busy = gate.busy_fraction()
    assert 0.2 / 60 <= busy < 0.5 / 60, busy
    mean = gate.mean_model_s()
    assert mean is not None and 0.2 <= mean < 0.5


def test_memory_budget_waits_for_the_jobs_ahead() -> None:
    budget = MemoryBudget(limit=100)
    order: list[str] = []
    with budget.reserve(1, base=20, need=50):

        def second() -> None:
            with budget.reserve(2, base=20, need=50) as waited:
                order.append(f"second after {waited:.1f}")

        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.3)
        assert order == [] and budget.held() == 50  # 20 + 50 + 50 > 100: it waits
        order.append("first out")
    t.join(5)
    assert order[0] == "first out" and order[1].startswith("second after 0.")
    with budget.reserve(3, base=20, need=500) as waited:  # alone: never waits
        assert waited < 0.1


# ------------------------------------------------------------------------------- the lanes


class SlowEngine(OrtEngine):
    """The real ONNX Runtime engine, a set time slower, recording what ran beside it."""

    def __init__(self, seconds: float, worker: list[Worker]) -> None:
        super().__init__()
        self.seconds, self.worker = seconds, worker
        self.inside = 0
        self.most_inside = 0
        self.beside: list[dict[int, str]] = []  # the other jobs in progress, at each entry
        self.order: list[int] = []
        self._lock = threading.Lock()

    def segment(self, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        worker = self.worker[0]
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            holder = worker.gate.holder()
            self.order.append(holder if holder is not None else -1)
            self.beside.append({j: s for j, s in worker.running.items() if j != holder})
        try:
            time.sleep(self.seconds)
            return super().segment(hu)
        finally:
            with self._lock:
                self.inside -= 1


def _series(tmp_path: Path, ledger: Ledger, worker: Worker, n: int, seed: int) -> list[str]:
    geometry = PhantomGeometry(rows=64, columns=64, slices=12)
    spool = worker_spool[id(worker)]
    return [
        ingest(
            ledger,
            spool,
            write_synthetic_series(tmp_path / f"s{seed + k}", geometry, seed=seed + k),
        )
        for k in range(n)
    ]


worker_spool: dict[int, Any] = {}


def _lanes_worker(tmp_path: Path, seconds: float, lanes: int) -> tuple[Worker, Ledger, SlowEngine]:
    holder: list[Worker] = []
    engine = SlowEngine(seconds, holder)
    engine.load(load_manifest(DEFAULT_MODEL))
    worker, ledger, spool = worker_on(
        tmp_path, engine, load_manifest(DEFAULT_MODEL), {"engine": {"lanes": lanes}}
    )
    holder.append(worker)
    worker_spool[id(worker)] = spool
    return worker, ledger, engine


def _queue(ledger: Ledger, uids: list[str], priority: int = 0) -> list[int]:
    """One tissue job per series; their ids."""
    ids = []
    for uid in uids:
        jid = ledger.create_job(
            uid, trigger="t", model="tissue", engine="onnxruntime", priority=priority
        )
        assert jid is not None
        ids.append(jid)
    return ids


def _wait_done(ledger: Ledger, ids: list[int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(ledger.job_state(j) in ("done", "failed") for j in ids):
            return
        time.sleep(0.05)
    raise AssertionError({j: ledger.job_state(j) for j in ids})


def test_lanes_overlap_jobs_and_run_the_model_one_job_at_a_time(tmp_path: Path) -> None:
    """Three lanes, four jobs: every job is done, the model never ran two jobs at once, and
    while it ran one, another job was in progress beside it."""
    worker, ledger, engine = _lanes_worker(tmp_path, 0.4, lanes=3)
    assert worker.lanes == 3 and worker.ahead == 1
    uids = _series(tmp_path, ledger, worker, 4, seed=60)
    ids = _queue(ledger, uids)
    worker.start()
    try:
        _wait_done(ledger, ids)
        assert worker.alive()
    finally:
        worker.stop(10)
    assert [ledger.job_state(j) for j in ids] == ["done"] * 4
    assert engine.most_inside == 1
    assert sorted(engine.order) == sorted(ids)
    assert any(beside for beside in engine.beside), engine.beside
    assert worker.gate.mean_model_s() is not None and worker.gate.busy_fraction() > 0


def test_an_urgent_job_runs_next_behind_the_job_in_the_model(tmp_path: Path) -> None:
    """Routine jobs fill the lanes; an urgent one queued meanwhile is taken by a free lane
    (beyond the jobs ahead) and enters the model right after the job in it."""
    worker, ledger, engine = _lanes_worker(tmp_path, 1.5, lanes=3)
    uids = _series(tmp_path, ledger, worker, 5, seed=70)
    routine = _queue(ledger, uids[:4])
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while len(engine.order) < 1 or not worker.gate.waiting():
            assert time.monotonic() < deadline, "no job waits for the model"
            time.sleep(0.01)
        (urgent,) = _queue(ledger, uids[4:], priority=10)
        worker.wake.set()
        while worker.running.get(urgent) != "waiting for the model":
            assert time.monotonic() < deadline, worker.running
            time.sleep(0.01)
        in_model = len(engine.order)  # the routine job in the model when it came to the gate
        _wait_done(ledger, [*routine, urgent])
    finally:
        worker.stop(10)
    # a routine job was waiting for the model before it: the urgent one still went first
    assert engine.order.index(urgent) == in_model, engine.order
    assert [ledger.job_state(j) for j in routine] == ["done"] * 4


def test_one_lane_is_one_job_at_a_time(tmp_path: Path) -> None:
    worker, ledger, engine = _lanes_worker(tmp_path, 0.1, lanes=1)
    assert worker.ahead == 1
    uids = _series(tmp_path, ledger, worker, 2, seed=80)
    ids = _queue(ledger, uids)
    worker.start()
    try:
        _wait_done(ledger, ids)
    finally:
        worker.stop(10)
    assert engine.beside == [{}, {}]  # nothing else in progress while the model ran


@pytest.mark.parametrize("lanes", [0, 2])
def test_lanes_setting(tmp_path: Path, lanes: int) -> None:
    worker, _, _ = worker_on(
        tmp_path, OrtEngine(), load_manifest(DEFAULT_MODEL), {"engine": {"lanes": lanes}}
    )
    assert worker.lanes == (lanes or 2)  # 0: two for onnxruntime, a CPU engine
    gpu = {"engine": {"lanes": lanes}, "model": {"engine": "torch"}}
    (tmp_path / "gpu").mkdir()
    worker, _, _ = worker_on(tmp_path / "gpu", OrtEngine(), load_manifest(DEFAULT_MODEL), gpu)
    assert worker.lanes == (lanes or 3)
