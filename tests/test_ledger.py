"""The ledger on a real SQLite file and on a real PostgreSQL database (every test that does not
look at the file runs on both): instances, job versions, priorities, recovery, outbox."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from segnode.storage.ledger import (
    DELIVERY_MOVES,
    FINAL_STATES,
    TRANSITIONS,
    DeliveryStatus,
    InstanceRecord,
    JobState,
    JobView,
    Ledger,
    TransitionError,
    move,
    move_delivery,
    utcnow,
)
from segnode.storage.migrations import upgrade_database
from segnode.storage.models import Delivery, Event, Job
from segnode.storage.spool import Spool, SpoolError, valid_uid, write_atomic


def rec(sop: str, series: str = "1.2.3.1", study: str = "1.2.3", ae: str = "CT1") -> InstanceRecord:
    return InstanceRecord(
        sop, "1.2.840.10008.5.1.4.1.1.2", series, study, "1.2.840.10008.1.2.1", "CT", ae
    )


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    if request.param == "sqlite":
        led = Ledger(tmp_path / "ledger.sqlite")
    else:
        url = request.getfixturevalue("pg_url")
        upgrade_database(url)  # segnode db upgrade
        led = Ledger(url=url)
    yield led
    led.close()


def test_wal_and_permissions(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    assert ledger.path is not None
    con = sqlite3.connect(ledger.path)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert ledger.path.stat().st_mode & 0o777 == 0o600


def test_duplicates_are_not_stored_twice(ledger: Ledger, tmp_path: Path) -> None:
    assert ledger.record_instance(rec("1.1"), tmp_path / "a", 10)
    assert not ledger.record_instance(rec("1.1"), tmp_path / "a", 10)
    assert ledger.counts()["instances"] == 1


def test_job_versions_and_pending(ledger: Ledger, tmp_path: Path) -> None:
    for i in range(3):
        ledger.record_instance(rec(f"1.{i}"), tmp_path / str(i), 1)
    assert ledger.pending_series() == ["1.2.3.1"]
    j1 = ledger.create_job("1.2.3.1", trigger="t", model="m", engine="e")
    assert j1 is not None
    # A second signal for the same data creates nothing.
    assert ledger.create_job("1.2.3.1", trigger="t", model="m", engine="e") is None
    assert ledger.pending_series() == []
    # A late instance reopens the series as version 2; the queued v1 is superseded.
    ledger.record_instance(rec("1.9"), tmp_path / "9", 1)
    j2 = ledger.create_job("1.2.3.1", trigger="t", model="m", engine="e")
    assert j2 is not None
    v1, v2 = ledger.job(j1), ledger.job(j2)
    assert v1 is not None and v2 is not None
    assert (v1.state, v2.state, v2.version, v2.instance_count) == ("superseded", "queued", 2, 4)
    assert len({v1.seg_sop_uid, v2.seg_sop_uid, v1.sr_sop_uid, v2.sr_sop_uid}) == 4


def test_priority_then_age(ledger: Ledger, tmp_path: Path) -> None:
    ids = []
    for n, prio in enumerate((0, 5, 0)):
        ledger.record_instance(rec(f"2.{n}", series=f"1.2.3.{10 + n}"), tmp_path / str(n), 1)
        ids.append(
            ledger.create_job(f"1.2.3.{10 + n}", trigger="t", model="m", engine="e", priority=prio)
        )
    order = []
    while (job := ledger.claim_next_job()) is not None:
        order.append(job.id)
    assert order == [ids[1], ids[0], ids[2]]


def test_a_routine_job_waiting_past_max_wait_goes_before_urgent_ones(
    ledger: Ledger, tmp_path: Path
) -> None:
    """``[engine] max_wait_s``: urgent jobs go first, but a job queued longer than that goes
    before them (the oldest such first), so routine work is never starved."""
    ids = []
    for n, prio in enumerate((0, 0, 5)):
        ledger.record_instance(rec(f"9.{n}", series=f"1.2.9.{n}"), tmp_path / f"9{n}", 1)
        ids.append(
            ledger.create_job(f"1.2.9.{n}", trigger="t", model="m", engine="e", priority=prio)
        )
    with ledger.engine.begin() as conn:  # the two routine jobs were queued 2 and 1 hours ago
        for jid, hours in ((ids[0], 2), (ids[1], 1)):
            conn.execute(
                update(Job)
                .where(Job.id == jid)
                .values(created_at=utcnow() - timedelta(hours=hours))
            )
    job = ledger.claim_next_job()  # no limit: priority first
    assert job is not None and job.id == ids[2]
    ledger.requeue_job(job.id, "again")
    order = []
    while (job := ledger.claim_next_job(max_wait_s=5400)) is not None:
        order.append(job.id)  # only the 2-hour one is overdue
    assert order == [ids[0], ids[2], ids[1]]


def test_recover_requeues_then_gives_up(ledger: Ledger, tmp_path: Path) -> None:
    ledger.record_instance(rec("3.1"), tmp_path / "x", 1)
    jid = ledger.create_job("1.2.3.1", trigger="t", model="m", engine="e")
    assert jid is not None
    for _ in range(2):
        job = ledger.claim_next_job()
        assert job is not None and job.id == jid
        assert ledger.recover(max_attempts=3) == 1
    ledger.claim_next_job()
    assert ledger.recover(max_attempts=3) == 0
    view = ledger.job(jid)
    assert (
        view is not None and view.state == "failed" and "interrupted 3 times" in (view.reason or "")
    )


def test_outbox_lifecycle(ledger: Ledger, tmp_path: Path) -> None:
    ledger.record_instance(rec("4.1"), tmp_path / "x", 1)
    jid = ledger.create_job("1.2.3.1", trigger="t", model="m", engine="e")
    assert jid is not None
    job = ledger.claim_next_job()
    assert job is not None
    ledger.save_results(
        jid,
        [
            (
                "SEG",
                "1.2.840.10008.5.1.4.1.1.66.4",
                job.seg_sop_uid,
                job.seg_series_uid,
                tmp_path / "s",
            ),
            (
                "SR",
                "1.2.840.10008.5.1.4.1.1.88.34",
                job.sr_sop_uid,
                job.sr_series_uid,
                tmp_path / "r",
            ),
        ],
        ["A@h:1", "B@h:2"],
    )
    due = ledger.due_deliveries()
    assert [(d.kind, d.destination) for d in due[:2]] == [("SEG", "A@h:1"), ("SEG", "B@h:2")]
    assert len(due) == 4
    assert {(d.kind, d.waits_on) for d in due} == {("SEG", 0), ("SR", 1)}  # each SR after its SEG
    later = utcnow() + timedelta(hours=1)
    ledger.delivery_retry(due[0].id, "down", later)
    # The SR to A waits for the SEG to A (README: SEG first, then SR); B goes on.
    assert {(d.kind, d.destination) for d in ledger.due_deliveries()} == {
        ("SEG", "B@h:2"),
        ("SR", "B@h:2"),
    }
    for d in due[1:]:
        ledger.delivery_done(d.id, 0)
    assert ledger.job_state(jid) == "encoded"
    assert ledger.due_deliveries(later + timedelta(seconds=1))[0].attempts == 1
    ledger.delivery_done(due[0].id, 0)
    assert ledger.job_state(jid) == "sent"
    assert ledger.is_own_result(job.seg_sop_uid, "9.9")
    assert ledger.is_own_result("9.9", job.sr_series_uid)


def test_urgent_results_leave_before_routine_ones_waiting_in_the_outbox(
    ledger: Ledger, tmp_path: Path
) -> None:
    """Two jobs encoded, the routine one first: the outbox takes the urgent one's results
    first (issue 36: its results leave before routine results waiting in the outbox)."""
    ids = []
    for n, prio in enumerate((0, 10)):
        ledger.record_instance(rec(f"8.{n}", series=f"1.2.8.{n}"), tmp_path / f"8{n}", 1)
        jid = ledger.create_job(f"1.2.8.{n}", trigger="t", model="m", engine="e", priority=prio)
        assert jid is not None
        ids.append(jid)
    for _ in ids:  # the urgent job is claimed (and encoded) first; the routine one after it
        job = ledger.claim_next_job()
        assert job is not None
        ledger.save_results(
            job.id,
            [("SEG", "1.2.840.10008.5.1.4.1.1.66.4", job.seg_sop_uid, job.seg_series_uid,
              tmp_path / f"s{job.id}")],
            ["A@h:1"],
        )  # fmt: skip
    due = ledger.due_deliveries()
    assert [d.job_id for d in due] == [ids[1], ids[0]]


def test_cancel_and_retry(ledger: Ledger, tmp_path: Path) -> None:
    ledger.record_instance(rec("5.1"), tmp_path / "x", 1)
    jid = ledger.create_job("1.2.3.1", trigger="t", model="m", engine="e")
    assert jid is not None
    assert ledger.cancel_job(jid)
    assert ledger.claim_next_job() is None
    assert ledger.retry_job(jid)
    assert ledger.job_state(jid) == "queued"
    assert not ledger.cancel_job(9999)


def test_spool_rejects_hostile_uids(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    for bad in ("../../etc", "1.2/3", "", "1..2", "1.2.3a", "9" * 65):
        assert not valid_uid(bad)
        with pytest.raises(ValueError):
            spool.path_for("1.2", "1.3", bad)
    path, size = spool.store("1.2", "1.3", "1.4", [b"ab", b"cd"])
    assert path.read_bytes() == b"abcd" and size == 4
    assert path.is_relative_to(tmp_path / "spool")
    assert not list(path.parent.glob(".*.tmp"))


def test_spool_error_is_clear(tmp_path: Path) -> None:
    blocker = tmp_path / "spool"
    spool = Spool(blocker)
    (blocker / "1.2").write_text("a file where a folder should be")
    with pytest.raises(SpoolError, match="cannot write"):
        spool.store("1.2", "1.3", "1.4", [b"x"])
    write_atomic(tmp_path / "ok.bin", b"1")


def test_missing_instances_finds_spool_files_without_a_row(ledger: Ledger, tmp_path: Path) -> None:
    """Start-up recovery after a power cut: which spool files lost their row (looked up by
    SOP Instance UID, in chunks, so more files than one SQL statement takes)."""
    spool = Spool(tmp_path / "spool")
    paths = []
    for k in range(1, 1201):
        path, _ = spool.store("1.2.3", "1.2.3.1", f"1.2.3.1.{k}", [b"x"])
        paths.append(path)
        if k % 3:
            assert ledger.record_instance(rec(f"1.2.3.1.{k}"), path, 1)
    found = sorted(spool.instance_files())
    assert found == sorted(paths)
    missing = ledger.missing_instances(found)
    assert sorted(missing) == sorted(p for k, p in enumerate(paths, 1) if k % 3 == 0)
    assert len(missing) == 400


def _results(job: JobView, tmp_path: Path) -> list[tuple[str, str, str, str, Path]]:
    seg, sr = "1.2.840.10008.5.1.4.1.1.66.4", "1.2.840.10008.5.1.4.1.1.88.34"
    return [
        ("SEG", seg, job.seg_sop_uid, job.seg_series_uid, tmp_path / "s"),
        ("SR", sr, job.sr_sop_uid, job.sr_series_uid, tmp_path / "r"),
    ]


def test_no_partial_result_leaves(ledger: Ledger, tmp_path: Path) -> None:
    """A series that grows while its job runs, or after it is encoded but before delivery,
    never has that job's results sent; the next version supersedes it."""
    for i in range(3):
        ledger.record_instance(rec(f"6.{i}"), tmp_path / str(i), 1)
    j1 = ledger.create_job("1.2.3.1", trigger="t", model="m", engine="e")
    running = ledger.claim_next_job()
    assert running is not None and running.id == j1
    # An instance arrives while v1 runs: its results are not kept for sending.
    ledger.record_instance(rec("6.9"), tmp_path / "9", 1)
    assert ledger.save_results(running.id, _results(running, tmp_path), ["A@h:1"]) is False
    v1 = ledger.job(running.id)
    assert v1 is not None and v1.state == "superseded" and "while this job ran" in (v1.reason or "")
    assert ledger.due_deliveries() == []
    ledger.fail_job(running.id, "late failure")  # a superseded job stays superseded
    assert ledger.job_state(running.id) == "superseded"

    # v2 is encoded; an instance arrives before its delivery: nothing is due while it waits,
    # and v3 cancels v2's deliveries.
    j2 = ledger.create_job("1.2.3.1", trigger="t", model="m", engine="e")
    job2 = ledger.claim_next_job()
    assert job2 is not None and job2.id == j2
    assert ledger.save_results(job2.id, _results(job2, tmp_path), ["A@h:1"]) is True
    assert len(ledger.due_deliveries()) == 2
    ledger.record_instance(rec("6.10"), tmp_path / "10", 1)
    assert ledger.due_deliveries() == []  # the series grew: hold v2's results
    j3 = ledger.create_job("1.2.3.1", trigger="t", model="m", engine="e")
    assert j3 is not None
    assert ledger.job_state(job2.id) == "superseded"
    assert ledger.due_deliveries() == []
    job3 = ledger.claim_next_job()
    assert job3 is not None and job3.instance_count == 5
    assert ledger.save_results(job3.id, _results(job3, tmp_path), ["A@h:1"]) is True
    assert {d.job_id for d in ledger.due_deliveries()} == {job3.id}


def test_sender_patterns_and_holds_are_kept(ledger: Ledger, tmp_path: Path) -> None:
    ledger.save_sender("SCANNER1", 40, 40, "nccc", 42.0)
    ledger.save_sender("SCANNER1", 41, 41, "ncccc", 40.0)
    assert ledger.senders() == [("SCANNER1", 41, 41, "ncccc", 40.0)]
    ledger.record_instance(rec("7.1"), tmp_path / "1", 1)
    ledger.record_hold("1.2.3.1", "waiting 0.5 s for more instances from SCANNER1")
    ((uid, n, reason, _since),) = ledger.held_series()
    assert (uid, n) == ("1.2.3.1", 1) and reason.startswith("waiting 0.5 s")
    ledger.create_job("1.2.3.1", trigger="t", model="m", engine="e")
    assert ledger.held_series() == []


def job_events(ledger: Ledger, job_id: int) -> list[tuple[str, str]]:
    with ledger._read() as s:
        rows = s.execute(
            select(Event.kind, Event.message).where(Event.job_id == job_id).order_by(Event.id)
        ).all()
    return [(str(k), str(m)) for k, m in rows]


def test_every_state_change_is_an_allowed_move_with_its_event(
    ledger: Ledger, tmp_path: Path
) -> None:
    """A job's life through the public methods: each change recorded as an event."""
    ledger.record_instance(rec("5.1", series="1.5"), tmp_path / "a", 1)
    job_id = ledger.create_job("1.5", trigger="t", model="m", engine="e")
    assert job_id is not None
    job = ledger.claim_next_job()
    assert job is not None
    seg = tmp_path / "seg.dcm"
    seg.write_bytes(b"x")
    ledger.save_results(job_id, [("SEG", "1.2", "9.9", "9.8", seg)], ["PACS@127.0.0.1:104"])
    (due,) = ledger.due_deliveries()
    ledger.delivery_failed(due.id, "refused")
    assert ledger.retry_job(job_id)  # failed -> encoded: only the delivery again
    (due,) = ledger.due_deliveries()
    ledger.delivery_done(due.id, 0)
    assert ledger.job_state(job_id) == JobState.SENT == "sent"
    assert not ledger.cancel_job(job_id) and not ledger.retry_job(job_id)  # sent is final
    kinds = [kind for kind, _ in job_events(ledger, job_id)]
    assert [k for k in kinds if k.startswith("job-")] == [
        "job-created",
        "job-running",
        "job-encoded",
        "job-failed",
        "job-retried",
        "job-sent",
    ]
    # the delivery's own moves: given up, retried, acknowledged
    assert [k for k in kinds if k.startswith("delivery-")] == [
        "delivery-failed",
        "delivery-pending",
        "delivery-sent",
    ]
    assert ("delivery-failed", "PACS@127.0.0.1:104: refused") in job_events(ledger, job_id)


def test_a_move_outside_the_table_raises(ledger: Ledger, tmp_path: Path) -> None:
    ledger.record_instance(rec("6.1", series="1.6"), tmp_path / "a", 1)
    job_id = ledger.create_job("1.6", trigger="t", model="m", engine="e")
    assert job_id is not None
    with ledger._tx() as s:
        job = s.get(Job, job_id)
        assert job is not None
        with pytest.raises(TransitionError, match="queued -> sent"):
            move(s, job, JobState.SENT, utcnow())
        move(s, job, JobState.CANCELLED, utcnow())
    assert ledger.job_state(job_id) == "cancelled"
    # The table: final states go nowhere; every state is in it; retries leave failed and
    # cancelled only.
    assert all(not TRANSITIONS[st] for st in FINAL_STATES if st not in ("failed", "cancelled"))
    assert set(TRANSITIONS) == set(JobState)
    assert {st for st, moves in TRANSITIONS.items() if JobState.QUEUED in moves} == {
        JobState.RUNNING,
        JobState.FAILED,
        JobState.CANCELLED,
    }


def test_delivery_moves_and_a_late_acknowledgement(ledger: Ledger, tmp_path: Path) -> None:
    """A delivery given up may still be acknowledged (recorded as sent); a sent one stays
    sent; a move outside DELIVERY_MOVES raises."""
    ledger.record_instance(rec("7.1", series="1.7"), tmp_path / "a", 1)
    job_id = ledger.create_job("1.7", trigger="t", model="m", engine="e")
    assert job_id is not None and ledger.claim_next_job() is not None
    seg = tmp_path / "seg.dcm"
    seg.write_bytes(b"x")
    ledger.save_results(job_id, [("SEG", "1.2", "9.7", "9.6", seg)], ["PACS@127.0.0.1:104"])
    (due,) = ledger.due_deliveries()
    ledger.delivery_failed(due.id, "refused")
    ledger.delivery_done(due.id, 0)  # its acknowledgement came after all
    ledger.delivery_failed(due.id, "late error")  # does not undo what happened
    with ledger._read() as s:
        d = s.get(Delivery, due.id)
        assert d is not None and d.status == DeliveryStatus.SENT == "sent"
    with ledger._tx() as s:
        d = s.get(Delivery, due.id)
        assert d is not None
        with pytest.raises(TransitionError, match="sent -> pending"):
            move_delivery(s, d, DeliveryStatus.PENDING, utcnow())
    assert set(DELIVERY_MOVES) == set(DeliveryStatus) and not DELIVERY_MOVES[DeliveryStatus.SENT]
