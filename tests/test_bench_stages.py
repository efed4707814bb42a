"""The benchmarks' stage breakdown (bench.ingest.job_stages) read from real ledger columns.

``make bench`` and ``bench.gpu_e2e`` split a job's time into the node's metric stages from
the ledger's timestamps; a renamed stage or column must fail here, not in a GPU run.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from bench.ingest import STAGE_COLUMNS, STAGES, job_stages
from segnode.storage.models import Job

T0 = datetime(2026, 12, 5, 2, 0, 0)


def job_row(**offsets: float) -> dict[str, str | int | None]:
    """A ``jobs`` row as :func:`bench.ingest.ledger_job` returns it (naive UTC text; a
    stage not reached is NULL)."""
    row: dict[str, str | int | None] = {"id": 7, "trigger": "release"}
    row |= dict.fromkeys(STAGE_COLUMNS.values())
    for key, seconds in offsets.items():
        row[STAGE_COLUMNS[key]] = str(T0 + timedelta(seconds=seconds))
    return row


def epoch(seconds: float) -> float:
    return (T0 + timedelta(seconds=seconds)).replace(tzinfo=UTC).timestamp()


def test_stage_columns_are_job_columns_and_stage_ends_are_named() -> None:
    columns = set(Job.__table__.columns.keys())
    assert set(STAGE_COLUMNS.values()) <= columns
    for _, start, end in STAGES:
        assert start in STAGE_COLUMNS and end in (*STAGE_COLUMNS, "last ack")


def test_stages_from_the_ledger_and_from_the_senders_last_response() -> None:
    row = job_row(
        first_instance=0.0,
        last_instance=1.0,
        queued=1.01,
        started=1.02,
        volume=1.1,
        inference=1.4,
        encoded=1.5,
    )
    start, stages = job_stages(row, acked=epoch(1.6))
    assert start == epoch(1.0)
    got = {s["stage"]: s["seconds"] for s in stages}
    assert got == {
        "completion": 0.01,
        "queue": 0.01,
        "volume": 0.08,
        "inference": 0.3,
        "encode": 0.1,
        "delivery": 0.1,
    }
    assert sum(s["share"] for s in stages) == pytest.approx(1.0, abs=1e-3)
    # measured from the sender's last response (0.05 s before the ledger's last instance)
    start, stages = job_stages(row, acked=epoch(1.6), last=epoch(0.95))
    assert start == epoch(0.95) and stages[0] == {
        "stage": "completion",
        "start_s": 0.0,
        "seconds": 0.06,
        "share": 0.0923,
    }


def test_stages_the_ledger_lacks_are_left_out() -> None:
    row = job_row(last_instance=1.0, queued=1.01, started=1.02)
    _, stages = job_stages(row, acked=epoch(2.0))
    assert [s["stage"] for s in stages] == ["completion", "queue"]
    with pytest.raises(ValueError, match="no last instance"):
        job_stages(job_row(queued=1.0), acked=epoch(2.0))
