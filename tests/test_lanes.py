"""Several jobs in progress at once (``[engine] lanes``): the engine gate, the memory budget,
and the worker's lanes on a real ledger, spool and ONNX Runtime engine."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
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
from tests.conftest import wait_for
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.test_engine_load import GatedEngine
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
    with gate.hold(1) as held:
        assert held.waited < 0.5 and not held.shared
        time.sleep(0.2)
        assert gate.holder() == 1 and gate.busy_fraction() > 0
    busy = gate.busy_fraction()
    assert 0.2 / 60 <= busy < 0.5 / 60, busy
    mean = gate.mean_model_s()
    assert mean is not None and 0.2 <= mean < 0.5


def _hold_in_thread(
    gate: EngineGate, job_id: int, entered: list[int], release: threading.Event, **kw: Any
) -> threading.Thread:
    def run() -> None:
        with gate.hold(job_id, **kw):
            entered.append(job_id)
            release.wait(10)

    t = threading.Thread(target=run)
    t.start()
    return t


def _until(check: Callable[[], bool], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_two_slots_let_a_second_job_in_only_with_room() -> None:
    """Two slots: a job enters beside the holder only while ``room()`` says yes (asked
    again as it waits); without ``room`` (an engine that cannot share) it waits to be
    alone; a third never enters two slots; the busy share counts overlapping holds once."""
    gate = EngineGate(slots=2)
    room = {"now": False}
    entered: list[int] = []
    first_out, second_out, third_out = threading.Event(), threading.Event(), threading.Event()
    first = _hold_in_thread(gate, 1, entered, first_out)
    _until(lambda: entered == [1])
    second = _hold_in_thread(gate, 2, entered, second_out, room=lambda: room["now"])
    _until(lambda: gate.waiting() == {0: 1})
    time.sleep(0.3)
    assert entered == [1]  # no room yet
    room["now"] = True
    _until(lambda: entered == [1, 2])  # asked again while waiting: now beside the first
    assert gate.holders() == [1, 2] and gate.most_at_once == 2
    third = _hold_in_thread(gate, 3, entered, third_out, room=lambda: True)
    time.sleep(0.3)
    assert entered == [1, 2]  # both slots taken
    first_out.set()
    first.join(5)
    _until(lambda: entered == [1, 2, 3])
    second_out.set()
    third_out.set()
    second.join(5)
    third.join(5)
    busy = gate.busy_fraction() * 60  # seconds: one span, not the sum of three holds
    assert 0.6 <= busy < 1.5, busy
    alone_only: list[int] = []
    out = threading.Event()
    holder = _hold_in_thread(gate, 4, alone_only, out)
    _until(lambda: alone_only == [4])
    waiter = _hold_in_thread(gate, 5, alone_only, out)  # no room(): waits to be alone
    time.sleep(0.3)
    assert alone_only == [4]
    out.set()
    holder.join(5)
    waiter.join(5)
    assert alone_only == [4, 5]


def test_two_slots_the_most_urgent_enters_the_free_slot_and_a_failing_probe_waits() -> None:
    gate = EngineGate(slots=2)
    entered: list[int] = []
    out = [threading.Event() for _ in range(4)]
    a = _hold_in_thread(gate, 1, entered, out[0])
    b = _hold_in_thread(gate, 2, entered, out[1], room=lambda: True)
    _until(lambda: sorted(entered) == [1, 2])

    def broken() -> bool:
        raise RuntimeError("NVML gone")

    routine = _hold_in_thread(gate, 3, entered, out[2], room=lambda: True)
    _until(lambda: gate.waiting() == {0: 1})
    urgent = _hold_in_thread(gate, 9, entered, out[3], priority=10, room=broken)
    _until(lambda: gate.waiting() == {0: 1, 10: 1})
    out[0].set()
    a.join(5)
    time.sleep(0.3)  # a slot is free, but the urgent job's probe fails: it waits, and
    assert sorted(entered) == [1, 2]  # the routine job behind it does not pass it
    out[1].set()
    b.join(5)
    _until(lambda: len(entered) >= 3)
    assert entered[2] == 9  # alone now: the urgent job first
    for e in out:
        e.set()
    for t in (routine, urgent):
        t.join(5)
    assert entered[3] == 3


def test_no_job_enters_beside_a_more_urgent_one_unless_overdue() -> None:
    gate = EngineGate(max_wait_s=60, slots=2)
    entered: list[int] = []
    out = [threading.Event() for _ in range(3)]
    urgent = _hold_in_thread(gate, 1, entered, out[0], priority=10)
    _until(lambda: entered == [1])
    routine = _hold_in_thread(gate, 2, entered, out[1], room=lambda: True)
    time.sleep(0.3)
    assert entered == [1]  # a free slot, room, but the urgent job runs alone
    overdue = _hold_in_thread(gate, 3, entered, out[2], queued_s=90.0, room=lambda: True)
    _until(lambda: entered == [1, 3])  # waited past max_wait_s: it goes beside
    out[0].set()
    urgent.join(5)
    _until(lambda: entered == [1, 3, 2])
    for e in out:
        e.set()
    for t in (routine, overdue):
        t.join(5)


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


class SlotSlowEngine(SlowEngine):
    """:class:`SlowEngine` that the gate may let in beside another job while ``room`` says so
    (:class:`segnode.engines.base.SlotEngine`), recording whether each job was shared."""

    def __init__(self, seconds: float, worker: list[Worker]) -> None:
        super().__init__(seconds, worker)
        self.room = True
        self.shared: list[bool] = []

    def has_room(self) -> bool:
        return self.room

    @contextlib.contextmanager
    def job_scope(self, shared: Callable[[], bool]) -> Iterator[None]:
        yield
        self.shared.append(shared())


def _lanes_worker(
    tmp_path: Path, seconds: float, lanes: int, slots: int = 0
) -> tuple[Worker, Ledger, SlowEngine]:
    holder: list[Worker] = []
    engine = (SlotSlowEngine if slots else SlowEngine)(seconds, holder)
    engine.load(load_manifest(DEFAULT_MODEL))
    settings = {"lanes": lanes, "model_slots": slots or 1}
    worker, ledger, spool = worker_on(
        tmp_path, engine, load_manifest(DEFAULT_MODEL), {"engine": settings}
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


def _run_all(worker: Worker, ledger: Ledger, ids: list[int]) -> None:
    """Start the worker, wait until the jobs ``ids`` ended, stop it."""
    worker.start()
    try:
        _wait_done(ledger, ids)
    finally:
        worker.stop(10)


def _wait_stage(worker: Worker, job: int, stage: str) -> None:
    wait_for(lambda: worker.running.get(job) == stage, 30, f"job {job} {stage}", 0.01)


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


@pytest.mark.parametrize("room", [True, False])
def test_two_model_slots_run_two_jobs_at_once_where_there_is_room(
    tmp_path: Path, room: bool
) -> None:
    """``model_slots = 2``: with room on the device two jobs run their models at once (and
    each knows it shared them); without, one at a time, as with one slot."""
    worker, ledger, engine = _lanes_worker(tmp_path, 0.5, lanes=4, slots=2)
    assert isinstance(engine, SlotSlowEngine)
    engine.room = room
    assert worker.gate.slots == 2 and worker.ahead == 1
    ids = _queue(ledger, _series(tmp_path, ledger, worker, 4, seed=65))
    _run_all(worker, ledger, ids)
    assert [ledger.job_state(j) for j in ids] == ["done"] * 4
    assert engine.most_inside == (2 if room else 1)
    assert any(engine.shared) == room and len(engine.shared) == 4
    assert worker.gate.most_at_once == engine.most_inside


def test_an_urgent_job_runs_next_behind_the_job_in_the_model(tmp_path: Path) -> None:
    """Routine jobs fill the lanes; an urgent one queued meanwhile is taken by a free lane
    (beyond the jobs ahead) and enters the model right after the job in it."""
    worker, ledger, engine = _lanes_worker(tmp_path, 1.5, lanes=3)
    uids = _series(tmp_path, ledger, worker, 5, seed=70)
    routine = _queue(ledger, uids[:4])
    worker.start()
    try:
        wait_for(lambda: engine.order and worker.gate.waiting(), 30, "a job waiting", 0.01)
        (urgent,) = _queue(ledger, uids[4:], priority=10)
        worker.wake.set()
        _wait_stage(worker, urgent, "waiting for the model")
        in_model = len(engine.order)  # the routine job in the model when it came to the gate
        _wait_done(ledger, [*routine, urgent])
    finally:
        worker.stop(10)
    # a routine job was waiting for the model before it: the urgent one still went first
    assert engine.order.index(urgent) == in_model, engine.order
    assert [ledger.job_state(j) for j in routine] == ["done"] * 4


def test_an_urgent_job_starts_when_every_lane_holds_a_job(tmp_path: Path) -> None:
    """Two lanes, both holding routine jobs (one in the model, one waiting for it): the
    urgent lane takes the urgent job at once, and it enters the model right after the job
    in it, before the other routine job."""
    worker, ledger, engine = _lanes_worker(tmp_path, 1.5, lanes=2)
    assert worker.spare_lane
    uids = _series(tmp_path, ledger, worker, 3, seed=75)
    routine = _queue(ledger, uids[:2])
    worker.start()
    try:
        wait_for(
            lambda: sorted(worker.running.values()) == ["model", "waiting for the model"],
            30,
            "both lanes busy",
            0.01,
        )
        (urgent,) = _queue(ledger, uids[2:], priority=10)
        worker.wake.set()
        _wait_stage(worker, urgent, "waiting for the model")
        # it came to the gate while the first routine job was still in the model
        assert len(engine.order) == 1 and set(routine) <= set(worker.running), worker.running
        _wait_done(ledger, [*routine, urgent])
        # no third routine lane: the spare one takes only a more urgent job than all
        assert max(worker.gate.most_at_once, engine.most_inside) == 1
    finally:
        worker.stop(10)
    # either routine job may have reached the model first; the urgent one came next
    assert engine.order[1] == urgent and sorted(engine.order[::2]) == routine, engine.order
    assert [ledger.job_state(j) for j in [*routine, urgent]] == ["done"] * 3


def test_the_urgent_lane_takes_no_routine_job(tmp_path: Path) -> None:
    """Three routine jobs on two lanes: never more than two in progress at once."""
    worker, ledger, engine = _lanes_worker(tmp_path, 0.4, lanes=2)
    ids = _queue(ledger, _series(tmp_path, ledger, worker, 3, seed=85))
    _run_all(worker, ledger, ids)
    assert all(len(beside) <= 1 for beside in engine.beside), engine.beside
    assert [ledger.job_state(j) for j in ids] == ["done"] * 3


def test_a_model_loading_holds_up_no_other_job(tmp_path: Path) -> None:
    """A job whose model is still loading is not a job ahead of the models, and does not
    hold the other models: two lanes run the default model's jobs meanwhile."""
    GatedEngine.gate.clear()  # the model's load waits for it
    GatedEngine.failure = None
    holder: list[Worker] = []
    engine = SlowEngine(0.1, holder)
    engine.load(load_manifest(DEFAULT_MODEL))
    settings = {
        "engine": {"lanes": 2},
        "models": {"slow": {"manifest": str(DEFAULT_MODEL), "engine": "gated-test"}},
    }
    worker, ledger, spool = worker_on(tmp_path, engine, load_manifest(DEFAULT_MODEL), settings)
    holder.append(worker)
    worker_spool[id(worker)] = spool
    uids = _series(tmp_path, ledger, worker, 3, seed=90)
    slow = ledger.create_job(
        uids[0], trigger="t", model="tissue", engine="gated-test", model_name="slow"
    )
    assert slow is not None
    worker.start()
    try:
        _wait_stage(worker, slow, "loading its model")
        others = _queue(ledger, uids[1:])
        worker.wake.set()
        _wait_done(ledger, others, 30)
        assert worker.running.get(slow) == "loading its model"  # still loading meanwhile
        GatedEngine.gate.set()
        _wait_done(ledger, [slow], 30)
    finally:
        GatedEngine.gate.set()
        worker.stop(10)
    assert [ledger.job_state(j) for j in [*others, slow]] == ["done"] * 3


def test_one_lane_is_one_job_at_a_time(tmp_path: Path) -> None:
    worker, ledger, engine = _lanes_worker(tmp_path, 0.1, lanes=1)
    assert worker.ahead == 1
    uids = _series(tmp_path, ledger, worker, 2, seed=80)
    ids = _queue(ledger, uids)
    _run_all(worker, ledger, ids)
    assert engine.beside == [{}, {}]  # nothing else in progress while the model ran
    assert not worker.spare_lane  # one job at a time, urgent ones too


@pytest.mark.parametrize("lanes", [0, 2])
def test_lanes_setting(tmp_path: Path, lanes: int) -> None:
    worker, _, _ = worker_on(
        tmp_path, OrtEngine(), load_manifest(DEFAULT_MODEL), {"engine": {"lanes": lanes}}
    )
    assert worker.lanes == (lanes or 2)  # 0: two for onnxruntime, a CPU engine
    gpu = {"engine": {"lanes": lanes}, "model": {"engine": "torch"}}
    (tmp_path / "gpu").mkdir()
    worker, _, _ = worker_on(tmp_path / "gpu", OrtEngine(), load_manifest(DEFAULT_MODEL), gpu)
    assert worker.lanes == (lanes or 3)  # 0: one job in the model, one preparing, one finishing
    assert worker.gate.slots == 1 and worker.ahead == max(1, (lanes or 3) - 2)
    two = {"engine": {"lanes": lanes, "model_slots": 2}, "model": {"engine": "torch"}}
    (tmp_path / "two").mkdir()
    worker, _, _ = worker_on(tmp_path / "two", OrtEngine(), load_manifest(DEFAULT_MODEL), two)
    assert worker.lanes == (lanes or 4) and worker.gate.slots == 2  # 0: the slots + 2
