"""Outbox guarantees with a real destination on loopback (a counting Storage SCP).

The dispatcher runs in-process on a real ledger holding encoded jobs whose result files are
small SEG / SR datasets; the destination is :class:`scripts.harness.CountingSCP`, which is down
(nothing listening on its port) for part of each test.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, generate_uid
from pynetdicom.sop_class import (  # type: ignore[attr-defined]
    Comprehensive3DSRStorage,
    SegmentationStorage,
)
from sqlalchemy import select

from scripts.harness import CountingSCP, free_port
from segnode.node.config import Config, from_dict
from segnode.node.outbox.policy import Backoff, CircuitBreakers
from segnode.node.outbox.scu import Dispatcher
from segnode.storage.ledger import InstanceRecord, Ledger, utcnow
from segnode.storage.models import Delivery, Event
from segnode.storage.spool import write_atomic
from tests.conftest import LOOPBACK, ROOT, wait_for


def result_file(path: Path, sop_class: str, sop_uid: str, study: str, **attributes: object) -> Path:
    """A minimal dataset of ``sop_class`` (and ``attributes``) written as a Part 10 file."""
    ds = Dataset()
    ds.SOPClassUID = sop_class
    ds.SOPInstanceUID = sop_uid
    ds.StudyInstanceUID = study
    ds.SeriesInstanceUID = generate_uid()
    ds.Modality = "SEG" if sop_class == SegmentationStorage else "SR"
    for keyword, value in attributes.items():
        setattr(ds, keyword, value)
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = sop_class
    ds.file_meta.MediaStorageSOPInstanceUID = sop_uid
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)
    return path


def one_instance(ledger: Ledger, out: Path, series: str, study: str) -> Path:
    """Record one CT instance of ``series`` (a one-byte spool file under ``out``); its path."""
    spool = out / "spool" / f"{generate_uid()}.dcm"
    write_atomic(spool, b"x")
    rec = InstanceRecord(generate_uid(), "1.2.840.10008.5.1.4.1.1.2", series, study, "", "CT", "M")
    ledger.record_instance(rec, spool, 1)
    return spool


def encoded_job(ledger: Ledger, out: Path, destinations: list[str]) -> int:
    """Record one instance, make a job, claim it and save SEG + SR results: an encoded job."""
    study, series = generate_uid(), generate_uid()
    one_instance(ledger, out, series, study)
    job_id = ledger.create_job(series, trigger="test", model="m", engine="e")
    assert job_id is not None
    job = ledger.claim_next_job()
    assert job is not None and job.id == job_id
    res = out / "results" / str(job_id)
    seg = result_file(res / "seg.dcm", SegmentationStorage, job.seg_sop_uid, study)
    sr = result_file(res / "sr.dcm", Comprehensive3DSRStorage, job.sr_sop_uid, study)
    ledger.save_results(
        job_id,
        [
            ("SEG", SegmentationStorage, job.seg_sop_uid, job.seg_series_uid, seg),
            ("SR", Comprehensive3DSRStorage, job.sr_sop_uid, job.sr_series_uid, sr),
        ],
        destinations,
    )
    return job_id


def outbox_config(tmp: Path, destinations: list[Any], **dispatch: Any) -> Config:
    """A config whose dispatch section sends to ``destinations`` with fast retries."""
    cfg = from_dict(
        {
            "dispatch": {
                "destinations": destinations,
                "retry_initial_s": 0.05,
                "retry_max_s": 0.2,
                "breaker_failures": 3,
                "breaker_cooldown_s": 0.6,
                "timeout_s": 5,
                **dispatch,
            }
        }
    )
    return replace(cfg, data_dir=tmp)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(tmp_path / "ledger.sqlite")
    yield led
    led.close()


def events(ledger: Ledger, kind: str) -> list[Event]:
    with ledger._read() as s:
        return list(s.scalars(select(Event).where(Event.kind == kind).order_by(Event.id)))


def test_jittered_backoff_bounds_and_spread() -> None:
    backoff = Backoff(0.5, 10.0, random.Random(1))
    for attempts in range(12):
        base = min(10.0, 0.5 * 2**attempts)
        values = [backoff.delay(attempts) for _ in range(200)]
        assert all(base / 2 <= v <= base for v in values)
        assert max(values) - min(values) > base / 4  # really jittered
    assert Backoff(1.0, 300.0, random.Random(1)).delay(10_000) <= 300.0  # no overflow


def test_circuit_breaker_opens_after_n_and_closes_on_success() -> None:
    now = [100.0]
    b = CircuitBreakers(3, 30.0, Backoff(1.0, 8.0, random.Random(0)), clock=lambda: now[0])
    assert b.blocked_for("P") == 0
    w1, opened = b.failure("P")
    assert not opened and 0.5 <= w1 <= 1.0 and b.blocked_for("P") == pytest.approx(w1)
    b.failure("P")
    w3, opened = b.failure("P")
    assert opened and 27 <= w3 <= 33 and b.is_open("P")
    now[0] += w3 + 0.01
    assert b.blocked_for("P") == 0  # half-open: one probe allowed
    w4, opened = b.failure("P")
    assert not opened and w4 >= 27  # the probe failed: open again, no second "opened"
    assert b.blocked_for("Q") == 0  # per destination
    assert b.success("P") and not b.is_open("P") and b.blocked_for("P") == 0


def test_destination_down_then_back_gets_everything_once(tmp_path: Path, ledger: Ledger) -> None:
    port = free_port()
    dest = f"COUNTER@{LOOPBACK}:{port}"
    cfg = outbox_config(tmp_path, [dest])
    jobs = [encoded_job(ledger, tmp_path, [dest]) for _ in range(3)]
    d = Dispatcher(cfg, ledger, rng=random.Random(7))
    d.start()
    scp = CountingSCP(port)
    try:
        # Down: connection attempts back off, then the breaker opens; no object uses attempts.
        wait_for(lambda: len(events(ledger, "destination-down")) >= 4, 20, "4 failed connects")
        assert d.breakers.is_open(dest)
        for job_id in jobs:
            view = ledger.job(job_id)
            assert view is not None and view.state == "encoded"
            assert [a for *_, a in view.deliveries] == [0, 0]
            assert all(
                "associat" in (e or "") or "unreachable" in (e or "") for e in view.delivery_errors
            )
        down = events(ledger, "destination-down")
        gaps = [(b.at - a.at).total_seconds() for a, b in zip(down[2:], down[3:], strict=False)]
        assert all(g >= 0.5 for g in gaps), gaps  # open breaker: one probe per cool-down
        scp.start()
        wait_for(lambda: all(ledger.job_state(j) == "sent" for j in jobs), 20, "all sent")
        time.sleep(0.5)  # nothing more arrives
    finally:
        d.stop()
        scp.stop()
    counts = scp.counts()
    assert len(counts) == 6 and set(counts.values()) == {1}, counts
    for job_id in jobs:
        view = ledger.job(job_id)
        assert view is not None
        assert [a for *_, a in view.deliveries] == [1, 1]  # one attempt each: the one that worked
    assert not d.breakers.is_open(dest)


def test_max_age_fails_visibly_and_retry_failed_requeues(tmp_path: Path) -> None:
    port = free_port()
    dest = f"COUNTER@{LOOPBACK}:{port}"
    data = tmp_path / "data"
    data.mkdir()
    led = Ledger(data / "ledger.sqlite")
    try:
        jobs = [encoded_job(led, data, [dest]) for _ in range(2)]
        cfg = outbox_config(data, [dest], max_age_s=0.5)
        dispatch_until(cfg, led, jobs, "failed", seed=3)  # expired
        view = led.job(jobs[0])
        assert view is not None and view.reason is not None and "max_age_s" in view.reason
        assert {st for _, _, st, _ in view.deliveries} == {"failed"}
        assert led.counts()["deliveries_failed"] == 4
    finally:
        led.close()
    cli = [sys.executable, "-m", "segnode.node.ops.cli"]
    out = subprocess.run(
        [*cli, "jobs", "--data-dir", str(data)], cwd=ROOT, capture_output=True, text=True
    )
    assert "max_age_s" in out.stdout and "failed" in out.stdout
    bad = subprocess.run([*cli, "retry", "--data-dir", str(data)], cwd=ROOT, capture_output=True)
    assert bad.returncode == 2
    out = subprocess.run(
        [*cli, "retry", "--failed", "--data-dir", str(data)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "requeued 2 failed job(s)" in out.stdout, out
    led = Ledger(data / "ledger.sqlite")
    scp = CountingSCP(port).start()
    try:
        dispatch_until(outbox_config(data, [dest], max_age_s=60), led, jobs, "sent")
    finally:
        scp.stop()
        led.close()
    assert sorted(scp.counts().values()) == [1, 1, 1, 1]


def dispatch_until(
    cfg: Config, led: Ledger, jobs: list[int], state: str, seed: int | None = None
) -> None:
    """Run a :class:`Dispatcher` on its thread until every job of ``jobs`` is in ``state``
    (15 s at most), then stop it."""
    d = Dispatcher(cfg, led, rng=None if seed is None else random.Random(seed))
    d.start()
    try:
        wait_for(lambda: all(led.job_state(j) == state for j in jobs), 15, f"jobs {state}")
    finally:
        d.stop()


def answering(scp: CountingSCP, answer: Callable[[str], int]) -> list[tuple[str, int]]:
    """Make ``scp`` (not started yet) answer each C-STORE with ``answer(kind)``; return the
    list it fills with ``(kind, status)`` in the order the requests arrived."""
    seen: list[tuple[str, int]] = []

    def handle(event: Any) -> int:
        cls = str(event.request.AffectedSOPClassUID)
        kind = "SEG" if cls == SegmentationStorage else "SR"
        status = answer(kind)
        seen.append((kind, status))
        return status

    scp._handle_store = handle  # type: ignore[method-assign]
    return seen


def delivery_ids(ledger: Ledger, job_id: int) -> list[int]:
    with ledger._read() as s:
        q = select(Delivery.id).where(Delivery.job_id == job_id).order_by(Delivery.id)
        return list(s.scalars(q))


def test_cancel_ends_unsent_deliveries_and_retry_sends_them(tmp_path: Path, ledger: Ledger) -> None:
    """``segnode cancel`` of a job waiting on a destination that is down: its deliveries leave
    the pending counts, are never sent, and a retry makes them pending afresh and sends them."""
    port = free_port()
    dest = f"COUNTER@{LOOPBACK}:{port}"
    cfg = outbox_config(tmp_path, [dest])
    job_id = encoded_job(ledger, tmp_path, [dest])
    down = Dispatcher(cfg, ledger, rng=random.Random(1))
    assert down.run_once() == 0  # refused: the deliveries wait for the destination
    down.stop()
    assert len(events(ledger, "destination-down")) == 1
    assert ledger.counts()["deliveries_pending"] == 2

    assert ledger.cancel_job(job_id)
    view = ledger.job(job_id)
    assert view is not None and view.state == "cancelled"
    assert [st for _, _, st, _ in view.deliveries] == ["cancelled", "cancelled"]
    assert all("cancelled" in (e or "") for e in view.delivery_errors)
    assert len(events(ledger, "delivery-cancelled")) == 2
    assert ledger.counts()["deliveries_pending"] == 0
    assert ledger.next_delivery_time() is None
    # A send already selected before the cancel does not start either.
    assert not any(ledger.delivery_sending(i) for i in delivery_ids(ledger, job_id))

    scp = CountingSCP(port).start()
    d = Dispatcher(cfg, ledger, rng=random.Random(2))
    try:
        assert d.run_once() == 0 and not scp.counts()  # up again: still nothing goes out
        assert ledger.retry_job(job_id)
        view = ledger.job(job_id)
        assert view is not None and view.state == "encoded"
        assert [(st, a) for _, _, st, a in view.deliveries] == [("pending", 0), ("pending", 0)]
        assert ledger.counts()["deliveries_pending"] == 2
        wait_for(lambda: d.run_once() >= 0 and ledger.job_state(job_id) == "sent", 10, "sent")
    finally:
        d.stop()
        scp.stop()
    assert sorted(scp.counts().values()) == [1, 1]
    view = ledger.job(job_id)
    assert view is not None and [a for *_, a in view.deliveries] == [1, 1]


def test_retry_of_a_job_whose_sends_in_flight_succeeded_after_its_cancel_ends_sent(
    tmp_path: Path, ledger: Ledger
) -> None:
    """Cancelled while both sends were in flight, and both were then acknowledged: a retry
    has nothing to run or send again, and the job ends sent (it used to run again and stay
    encoded with nothing to send)."""
    dest = f"COUNTER@{LOOPBACK}:{free_port()}"
    job_id = encoded_job(ledger, tmp_path, [dest])
    ids = delivery_ids(ledger, job_id)
    assert all(ledger.delivery_sending(i) for i in ids)  # both on the wire
    assert ledger.cancel_job(job_id)
    for i in ids:
        ledger.delivery_done(i, 0)  # ... and both acknowledged
    view = ledger.job(job_id)
    assert view is not None and view.state == "cancelled"
    assert [st for _, _, st, _ in view.deliveries] == ["sent", "sent"]
    assert ledger.retry_job(job_id)
    view = ledger.job(job_id)
    assert view is not None and view.state == "sent"
    assert ledger.counts()["deliveries_pending"] == 0


def test_sr_waits_for_the_seg_to_be_accepted(tmp_path: Path, ledger: Ledger) -> None:
    """Per destination the SR is not sent before the destination has accepted the SEG, even
    when the SEG is refused once (README: SEG first, then SR)."""
    refused: list[str] = []

    def once(kind: str) -> int:  # the first SEG is refused, everything after accepted
        if kind == "SEG" and not refused:
            refused.append(kind)
            return 0xA700
        return 0

    scp = CountingSCP()
    seen = answering(scp, once)
    scp.start()
    cfg = outbox_config(tmp_path, [scp.peer], max_attempts=3, retry_initial_s=0.2)
    job_id = encoded_job(ledger, tmp_path, [scp.peer])
    d = Dispatcher(cfg, ledger, rng=random.Random(4))
    try:
        assert d.run_once() == 0  # the SEG refused; the SR is not due behind it
        assert seen == [("SEG", 0xA700)]
        seg_due = ledger.next_delivery_time()
        assert seg_due is not None and seg_due > utcnow()  # the SR does not make it due now
        wait_for(lambda: d.run_once() >= 0 and ledger.job_state(job_id) == "sent", 10, "sent")
    finally:
        d.stop()
        scp.stop()
    assert seen == [("SEG", 0xA700), ("SEG", 0), ("SR", 0)]


def test_failed_delivery_ends_the_jobs_other_deliveries(tmp_path: Path, ledger: Ledger) -> None:
    """A destination answering 0xA700 to everything: each answer uses one attempt, with
    backoff between; the SEG fails after max_attempts and the job fails; the SR is never
    sent and ends cancelled with the reason, nothing stays pending. ``segnode retry`` gives
    both a fresh set of attempts."""
    accept = [False]
    scp = CountingSCP()
    seen = answering(scp, lambda kind: 0 if accept[0] else 0xA700)
    scp.start()
    cfg = outbox_config(tmp_path, [scp.peer], max_attempts=3)
    job_id = encoded_job(ledger, tmp_path, [scp.peer])
    dispatch_until(cfg, ledger, [job_id], "failed", seed=6)
    assert seen == [("SEG", 0xA700)] * 3
    assert len(events(ledger, "delivery-retry")) >= 2  # the attempts backed off between
    view = ledger.job(job_id)
    assert view is not None and "0xA700" in (view.reason or "")
    assert [(k, st, a) for k, _, st, a in view.deliveries] == [
        ("SEG", "failed", 3),
        ("SR", "cancelled", 0),
    ]
    assert "job " in (view.delivery_errors[1] or "") and "0xA700" in (view.delivery_errors[1] or "")
    counts = ledger.counts()
    assert counts["deliveries_pending"] == 0 and counts["deliveries_failed"] == 1
    assert ledger.next_delivery_time() is None

    assert ledger.retry_job(job_id)
    view = ledger.job(job_id)
    assert view is not None and view.state == "encoded"
    assert [(st, a) for _, _, st, a in view.deliveries] == [("pending", 0), ("pending", 0)]
    accept[0] = True
    try:
        dispatch_until(cfg, ledger, [job_id], "sent", seed=8)  # after the retry
    finally:
        scp.stop()
    view = ledger.job(job_id)
    assert view is not None and [a for *_, a in view.deliveries] == [1, 1]
    assert seen[3:] == [("SEG", 0), ("SR", 0)]


def test_expiry_fails_the_old_and_cancels_the_rest(tmp_path: Path, ledger: Ledger) -> None:
    """Deliveries past dispatch.max_age_s fail; the job's younger ones are cancelled with it."""
    dest = f"COUNTER@{LOOPBACK}:{free_port()}"
    job_id = encoded_job(ledger, tmp_path, [dest])
    seg, sr = delivery_ids(ledger, job_id)
    with ledger._tx() as s:  # the SR was made pending later (a retry of it alone, say)
        row = s.get(Delivery, sr)
        assert row is not None
        row.created_at = utcnow() + timedelta(hours=1)
    assert ledger.expire_deliveries(utcnow() + timedelta(minutes=1), "too old") == [job_id]
    view = ledger.job(job_id)
    assert view is not None and view.state == "failed"
    assert [st for _, _, st, _ in view.deliveries] == ["failed", "cancelled"]
    assert ledger.counts()["deliveries_pending"] == 0


def test_a_pass_ending_during_the_due_query_does_not_start_another_on_stale_rows(
    tmp_path: Path, ledger: Ledger
) -> None:
    """A destination's pass that ends while the outbox reads the due deliveries does not get
    a new pass from those rows: they may predate its outcome (a stale attempt count gave a
    delivery max_attempts + 1 attempts, CI 2026-12-05). The next round sends."""
    scp = CountingSCP()
    seen = answering(scp, lambda kind: 0)
    scp.start()
    cfg = outbox_config(tmp_path, [scp.peer], max_attempts=2)
    job_id = encoded_job(ledger, tmp_path, [scp.peer])
    d = Dispatcher(cfg, ledger, rng=random.Random(5))
    dest = ledger.due_deliveries()[0].destination
    query = ledger.due_deliveries

    def pass_ends_meanwhile(**kwargs: Any) -> Any:
        rows = query(**kwargs)
        d._busy.discard(dest)  # the pass in progress ends after the rows were read
        return rows

    try:
        d._busy.add(dest)
        ledger.due_deliveries = pass_ends_meanwhile  # type: ignore[method-assign]
        assert d._start(None) == []
        assert seen == []
        ledger.due_deliveries = query  # type: ignore[method-assign]
        wait_for(lambda: d.run_once() >= 0 and ledger.job_state(job_id) == "sent", 10, "sent")
    finally:
        d.stop()
        scp.stop()
    assert seen == [("SEG", 0), ("SR", 0)]
