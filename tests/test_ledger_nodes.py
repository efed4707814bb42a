"""Several nodes on one PostgreSQL ledger, at the ledger's level: who may take which job and
delivery, and when a node whose heartbeat stopped is taken over.

Each test runs two or three :class:`~segnode.storage.ledger.Ledger` objects on one database,
joined under different node names, as separate ``segnode serve`` processes would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from pydicom import dcmread

from scripts.harness import send_files
from segnode.node.ingest.scp import record_from_file
from segnode.storage.ledger import InstanceRecord, JobView, Ledger
from segnode.storage.migrations import upgrade_database
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.scp_harness import SCPHarness

SEG = "1.2.840.10008.5.1.4.1.1.66.4"
SR = "1.2.840.10008.5.1.4.1.1.88.34"


def rec(sop: str, series: str = "1.2.3.1") -> InstanceRecord:
    return InstanceRecord(
        sop, "1.2.840.10008.5.1.4.1.1.2", series, "1.2.3", "1.2.840.10008.1.2.1", "CT", "CT1"
    )


@pytest.fixture
def nodes(pg_url: str) -> Iterator[list[Ledger]]:
    """Nodes ``a``, ``b`` and ``c`` on one fresh database, with a lease of 1 s."""
    upgrade_database(pg_url)
    ledgers = [Ledger(url=pg_url) for _ in range(3)]
    for name, led in zip("abc", ledgers, strict=True):
        led.join(name, f"SEGNODE@127.0.0.1:1110{ord(name) - 97}", lease_s=1.0)
    yield ledgers
    for led in ledgers:
        led.close()


def results(job: JobView, tmp: Path) -> list[tuple[str, str, str, str, Path]]:
    return [
        ("SEG", SEG, job.seg_sop_uid, job.seg_series_uid, tmp / "seg.dcm"),
        ("SR", SR, job.sr_sop_uid, job.sr_series_uid, tmp / "sr.dcm"),
    ]


def queued_job(led: Ledger, tmp: Path, series: str = "1.2.3.1") -> int:
    assert led.record_instance(rec(f"{series}.1", series), tmp / series, 1)
    jid = led.create_job(series, trigger="t", model="m", engine="e")
    assert jid is not None
    return jid


def test_a_running_job_is_its_nodes_until_its_heartbeat_stops(
    nodes: list[Ledger], tmp_path: Path
) -> None:
    """a claims the job; b neither gets it nor may take it over while a beats; once a's
    heartbeat is older than the lease, b requeues it, claims it and finishes it, and a, come
    back, records nothing for it."""
    a, b, _ = nodes
    jid = queued_job(a, tmp_path)
    job = a.claim_next_job()
    assert job is not None and job.id == jid and job.owner == "a"
    assert b.claim_next_job() is None
    a.heartbeat()
    assert b.take_over(max_attempts=3) == 0
    assert b.recover(max_attempts=3) == 0  # b's start-up takes only its own and the gone
    time.sleep(1.2)  # a's lease runs out
    assert b.take_over(max_attempts=3) == 1
    taken = b.claim_next_job()
    assert taken is not None and taken.id == jid and taken.owner == "b"
    assert taken.seg_sop_uid == job.seg_sop_uid  # the ledger's UIDs, not new ones
    # a was only slow: what it does now for the job changes nothing.
    a.heartbeat()
    a.mark(jid, "inference_at")
    assert not a.save_results(jid, results(job, tmp_path), ["PACS@h:1"])
    a.fail_job(jid, "a's late failure")
    view = b.job(jid)
    assert view is not None and view.state == "running" and view.owner == "b"
    assert view.stages["inference"] is None
    assert b.save_results(jid, results(taken, tmp_path), ["PACS@h:1"])
    assert b.job_state(jid) == "encoded"


def test_nodes_claiming_at_once_each_get_other_jobs(nodes: list[Ledger], tmp_path: Path) -> None:
    """Three nodes claim from a queue of 30 jobs at once, ten rounds each: every job is
    claimed exactly once (SELECT ... FOR UPDATE SKIP LOCKED)."""
    for k in range(30):
        queued_job(nodes[0], tmp_path, f"1.2.3.{k + 10}")
    claimed: list[list[int]] = [[], [], []]
    barrier = threading.Barrier(3)

    def claim(i: int) -> None:
        barrier.wait()
        for _ in range(10):
            job = nodes[i].claim_next_job()
            if job is not None:
                claimed[i].append(job.id)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    every = sorted(claimed[0] + claimed[1] + claimed[2])
    assert len(every) == 30 and len(set(every)) == 30, claimed
    views = [nodes[0].job(j) for j in every]
    assert {v.owner for v in views if v is not None} <= {"a", "b", "c"}
    assert all(
        v is not None and v.owner == "abc"[i]
        for i in range(3)
        for v in map(nodes[0].job, claimed[i])
    )


def test_two_nodes_completing_a_series_at_once_make_one_job(
    nodes: list[Ledger], tmp_path: Path
) -> None:
    """The quiet-period scans of two nodes find the same pending series at once: one job
    (the series row is locked while its jobs are made), no error on the other."""
    for k in range(20):
        series = f"1.2.4.{k}"
        nodes[0].record_instance(rec(f"{series}.1", series), tmp_path / series, 1)
        made: list[int | None] = []
        barrier = threading.Barrier(2)

        def create(
            i: int,
            series: str = series,
            made: list[int | None] = made,
            barrier: threading.Barrier = barrier,
        ) -> None:
            barrier.wait()
            made.append(nodes[i].create_job(series, trigger="quiet", model="m", engine="e"))

        threads = [threading.Thread(target=create, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert made.count(None) == 1, made


def test_a_claimed_delivery_is_its_nodes_until_the_claim_runs_out(
    nodes: list[Ledger], tmp_path: Path
) -> None:
    """a claims the deliveries; b does not see them while a's claim holds (and a beats);
    after the claim runs out b claims them, and a, whose claim was taken, is told not to
    send."""
    a, b, _ = nodes
    jid = queued_job(a, tmp_path)
    job = a.claim_next_job()
    assert job is not None and a.save_results(jid, results(job, tmp_path), ["PACS@h:1"])
    a.heartbeat()  # (the fixture's lease is 1 s: a stays alive for the checks below)
    due = a.due_deliveries(claim_s=3.0)
    assert [d.kind for d in due] == ["SEG", "SR"]
    assert b.due_deliveries() == []
    assert a.delivery_sending(due[0].id, claim_s=3.0)  # renews a's claim of the SEG
    time.sleep(3.1)
    a.heartbeat()  # alive: b takes the deliveries because the claim ran out
    taken = b.due_deliveries(claim_s=30)
    assert [d.kind for d in taken] == ["SEG", "SR"]
    assert not a.delivery_sending(due[1].id)  # a's claim is gone: a does not send the SR
    assert b.delivery_sending(taken[1].id)
    b.delivery_done(taken[0].id, 0)
    b.delivery_done(taken[1].id, 0)
    assert b.job_state(jid) == "sent"


def test_a_restarted_node_sends_what_it_had_claimed_at_once(
    nodes: list[Ledger], tmp_path: Path
) -> None:
    """A node that stopped while sending releases its claims when it starts again (same
    name): its deliveries are due for it at once, not after the claim."""
    a, b, _ = nodes
    jid = queued_job(a, tmp_path)
    job = a.claim_next_job()
    assert job is not None and a.save_results(jid, results(job, tmp_path), ["PACS@h:1"])
    a.heartbeat()
    assert len(a.due_deliveries(claim_s=300)) == 2
    assert b.due_deliveries() == []
    assert a.release_deliveries() == 2
    assert len(b.due_deliveries()) == 2


def test_the_last_two_acknowledgements_at_once_finish_the_job(
    nodes: list[Ledger], tmp_path: Path
) -> None:
    """Two nodes acknowledge a job's SEG and SR at the same moment, 15 times: the job is
    ``sent`` every time (the job's row is locked before the deliveries left are counted)."""
    a, b, _ = nodes
    for k in range(15):
        series = f"1.2.5.{k}"
        jid = queued_job(a, tmp_path, series)
        job = a.claim_next_job()
        assert job is not None and job.id == jid
        assert a.save_results(jid, results(job, tmp_path), ["PACS@h:1"])
        seg, sr = a.due_deliveries()
        barrier = threading.Barrier(2)

        def ack(led: Ledger, delivery: int, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            led.delivery_done(delivery, 0)

        threads = [
            threading.Thread(target=ack, args=(a, seg.id)),
            threading.Thread(target=ack, args=(b, sr.id)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert a.job_state(jid) == "sent", k


def test_status_lists_every_node_and_which_are_alive(nodes: list[Ledger]) -> None:
    """``segnode status`` facts: each node with its address, alive while it beats, and
    stopped after a clean stop."""
    a, b, c = nodes
    a.heartbeat()
    b.heartbeat()
    c.leave()
    seen = {n.name: n for n in a.nodes()}
    assert set(seen) == {"a", "b", "c"}
    assert seen["a"].alive and seen["b"].alive and seen["a"].address == "SEGNODE@127.0.0.1:11100"
    assert not seen["c"].alive and seen["c"].stopped_at is not None
    time.sleep(1.1)
    a.heartbeat()
    seen = {n.name: n for n in a.nodes()}
    assert seen["a"].alive and not seen["b"].alive


def row_without_file(node: SCPHarness, file: Path) -> tuple[InstanceRecord, Path]:
    """``node`` commits ``file``'s instance row and writes no file: what a node that died
    (or whose commit was never confirmed) leaves. Returns the record and the row's path."""
    lost = record_from_file(file)
    path = node.spool.path_for(
        lost.study_instance_uid, lost.series_instance_uid, lost.sop_instance_uid
    )
    assert node.ledger.record_instance(lost, path, file.stat().st_size)
    assert not path.exists()
    return lost, path


def test_an_instance_another_node_recorded_without_its_file_is_stored_here(
    pg_url: str, tmp_path: Path
) -> None:
    """Node a committed an instance's row and died before its file was written (a row is
    committed while its file is made durable); the modality sends the series again to
    node b. b stores that instance itself, the row now names b's copy, and the instance a
    did store whole is acknowledged as a duplicate without a second copy."""
    upgrade_database(pg_url)
    raw = {"ledger": {"url": pg_url}}
    a, b = SCPHarness(tmp_path / "a", raw), SCPHarness(tmp_path / "b", raw)
    try:
        files = write_synthetic_series(
            tmp_path / "s", PhantomGeometry(rows=32, columns=32, slices=3), seed=5
        )
        lost, a_path = row_without_file(a, files[0])
        sent = send_files(files[1:2], a.port)
        assert sent.acknowledged == [str(record_from_file(files[1]).sop_instance_uid)]
        again = send_files(files, b.port)
        assert len(again.acknowledged) == 3 and set(again.statuses.values()) == {0}, again
        path, size = b.ledger.instance_file(lost.sop_instance_uid) or (None, 0)
        assert path is not None and path.is_relative_to(tmp_path / "b") and path.exists()
        assert size == path.stat().st_size
        kept = record_from_file(files[1])
        kept_path, _ = b.ledger.instance_file(kept.sop_instance_uid) or (None, 0)
        assert kept_path is not None and kept_path.is_relative_to(tmp_path / "a")
        assert not b.spool.path_for(
            kept.study_instance_uid, kept.series_instance_uid, kept.sop_instance_uid
        ).exists()
        assert b.ledger.series_totals(lost.series_instance_uid)[0] == 3
    finally:
        a.close()
        b.close()


def test_a_starting_node_drops_only_its_own_unwritten_rows(
    nodes: list[Ledger], tmp_path: Path
) -> None:
    """At start-up a node removes rows of its own spool whose file is missing (never
    acknowledged); a row of another node's spool stays, since that node may be writing the
    file right now."""
    a, b, _ = nodes
    mine, theirs = tmp_path / "a" / "spool", tmp_path / "b" / "spool"
    assert a.record_instance(rec("1.2.6.1", "1.2.6"), mine / "1.2.6.1.dcm", 10)
    assert b.record_instance(rec("1.2.6.2", "1.2.6"), theirs / "1.2.6.2.dcm", 10)
    assert a.drop_unstored_instances(mine) == 1
    assert a.instance_file("1.2.6.1") is None
    assert a.instance_file("1.2.6.2") == (theirs / "1.2.6.2.dcm", 10)


def test_an_idle_node_hears_of_a_new_job_at_once(nodes: list[Ledger], tmp_path: Path) -> None:
    """b listens (LISTEN/NOTIFY): a job queued by a, and results a encodes, wake it within a
    fraction of a second, not at its next poll."""
    a, b, _ = nodes
    woken = threading.Event()
    b.listen(woken.set)
    time.sleep(0.3)  # the listener's LISTEN is in place
    t0 = time.monotonic()
    jid = queued_job(a, tmp_path)
    assert woken.wait(2.0), "no notification for the queued job"
    queued_after = time.monotonic() - t0
    woken.clear()
    job = a.claim_next_job()
    assert job is not None and a.save_results(jid, results(job, tmp_path), ["PACS@h:1"])
    assert woken.wait(2.0), "no notification for the encoded results"
    assert queued_after < 1.5, queued_after  # (the listener itself never polls)


def test_the_hot_path_connects_again_after_the_server_dropped_it(
    pg_url: str, tmp_path: Path
) -> None:
    """The database server ends every connection (a restart, a failover): the next
    per-instance statement may fail (the SCP answers 0xA700 and the sender retries), and
    the ones after it run on a new connection."""
    upgrade_database(pg_url)
    led = Ledger(url=pg_url)
    try:
        assert led.record_instance(rec("1.2.7.1", "1.2.7"), tmp_path / "1", 10)
        with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql")) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        stored = []
        for n in range(2, 5):
            try:
                stored.append(
                    led.record_instance(rec(f"1.2.7.{n}", "1.2.7"), tmp_path / str(n), 10)
                )
            except Exception as exc:  # the first use of the dropped connection
                assert "terminat" in str(exc) or "closed" in str(exc), exc
        assert stored[-2:] == [True, True], stored
        assert led.counts()["instances"] == 1 + len(stored)
    finally:
        led.close()


def test_an_own_row_whose_commit_was_not_confirmed_is_stored_again(
    pg_url: str, tmp_path: Path
) -> None:
    """On PostgreSQL a commit can happen without the node hearing of it (the connection
    broke), so the C-STORE was answered as failed and no file was written. The sender's
    retry is not taken for a duplicate: the node stores it, then answers success."""
    upgrade_database(pg_url)
    h = SCPHarness(tmp_path / "n", {"ledger": {"url": pg_url}})
    try:
        files = write_synthetic_series(
            tmp_path / "s", PhantomGeometry(rows=32, columns=32, slices=2), seed=9
        )
        lost, path = row_without_file(h, files[0])
        sent = send_files(files, h.port)
        assert set(sent.statuses.values()) == {0}, sent
        assert h.ledger.instance_file(lost.sop_instance_uid) == (path, path.stat().st_size)
        assert dcmread(path).SOPInstanceUID == lost.sop_instance_uid
    finally:
        h.close()


def _shown(led: Ledger, name: str) -> set[str]:
    """``SHOW name`` on each session kind of a node: the engine's, the hot path's, the one
    holding the lock on its name."""
    with led.engine.connect() as conn:
        engine = str(conn.exec_driver_sql(f"SHOW {name}").scalar())
    hot = str(led._hot_connection().execute(f"SHOW {name}").fetchone()[0])
    assert led._node_lock is not None
    lock = str(led._node_lock.execute(f"SHOW {name}").fetchone()[0])
    return {engine, hot, lock}


def test_the_server_notices_within_seconds_that_a_node_lost_power(nodes: list[Ledger]) -> None:
    # A node that loses power sends no FIN: the server keeps its sessions, the advisory lock
    # on its name (it cannot start again: "already running") and the row locks of an open
    # transaction until TCP keepalive probes go unanswered, after 2 h by the OS's default.
    # (python -m scripts.power_harness --postgres --silent-network shows it end to end.)
    assert _shown(nodes[0], "tcp_keepalives_idle") == {"10"}
    assert _shown(nodes[0], "tcp_keepalives_interval") == {"5"}
    assert _shown(nodes[0], "tcp_keepalives_count") == {"3"}


def test_options_in_the_ledger_url_reach_every_session(pg_url: str) -> None:
    # libpq's options take spaces; the URL has them percent-encoded.
    upgrade_database(pg_url)
    led = Ledger(
        url=pg_url + "?options=-c%20statement_timeout%3D12345%20-c%20tcp_keepalives_count%3D4"
    )
    try:
        led.join("a", "SEGNODE@127.0.0.1:11100", lease_s=1.0)
        assert _shown(led, "statement_timeout") == {"12345ms"}
        assert _shown(led, "tcp_keepalives_count") == {"4"}  # the URL's own wins
        assert _shown(led, "tcp_keepalives_idle") == {"10"}
    finally:
        led.close()
