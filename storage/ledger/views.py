"""Read-only views of the ledger for the CLI, the web page, metrics and the worker.

Owns :class:`JobView` (a job's snapshot, built by ``Views._view``), :class:`SeriesSummary`
and :class:`Views`: one job or the latest jobs, jobs finished since a time, a job's state,
totals per state, ignored and held series, a pending series' summary for routing, the
failed jobs an operator may retry.

Must not touch: anything; every method here only reads (in a ``_read`` session, or, for
``_view``, in the caller's session) and writes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from segnode.storage.ledger.connection import LedgerBase, utcnow
from segnode.storage.ledger.states import DeliveryStatus, JobState
from segnode.storage.models import Delivery, Event, Instance, Job, Result, Series, Study


@dataclass(frozen=True)
class JobView:
    """A read-only snapshot of a job for the CLI and the worker."""

    id: int
    series_instance_uid: str
    study_instance_uid: str
    version: int
    state: str
    priority: int
    model: str
    engine: str
    trigger: str
    reason: str | None
    attempts: int
    instance_count: int
    stages: dict[str, datetime | None]
    seg_series_uid: str
    seg_sop_uid: str
    sr_series_uid: str
    sr_sop_uid: str
    deliveries: tuple[tuple[str, str, str, int], ...]  # (kind, destination, status, attempts)
    delivery_errors: tuple[str | None, ...] = ()  # last error of each delivery, same order
    delivery_acks: tuple[datetime | None, ...] = ()  # when each delivery was acknowledged
    delivery_starts: tuple[datetime | None, ...] = ()  # when its latest send attempt started
    superseded_by: int | None = None  # a later version of the series (its results replace ours)
    owner: str | None = None  # the node running it, or that ran it last (shared ledgers)
    model_name: str = "default"  # the configured model ([model] is "default", [models.NAME])
    rule: str = ""  # the routing rule that created the job
    destinations: tuple[str, ...] = ()  # where its results go (names, fixed at creation)


@dataclass(frozen=True)
class SeriesSummary:
    """What routing needs of a series with pending instances."""

    calling_ae: str
    instance_count: int
    first_instance: Path


class Views(LedgerBase):
    """Read-only queries (a part of :class:`~segnode.storage.ledger.Ledger`)."""

    def job_state(self, job_id: int) -> str | None:
        """The state of one job."""
        with self._read() as s:
            return s.scalar(select(Job.state).where(Job.id == job_id))

    def _view(self, s: Session, job: Job) -> JobView:
        series = s.get(Series, job.series_id)
        assert series is not None
        study = s.get(Study, series.study_id)
        assert study is not None
        dels = s.execute(
            select(
                Result.kind,
                Delivery.destination,
                Delivery.status,
                Delivery.attempts,
                Delivery.last_error,
                Delivery.sending_at,
                Delivery.sent_at,
            )
            .join(Result, Result.id == Delivery.result_id)
            .where(Delivery.job_id == job.id)
            .order_by(Result.order, Delivery.destination)
        ).all()
        starts = [t for *_, t, _ in dels if t is not None]
        return JobView(
            id=job.id,
            series_instance_uid=series.series_instance_uid,
            study_instance_uid=study.study_instance_uid,
            version=job.version,
            state=job.state,
            priority=job.priority,
            model=job.model,
            engine=job.engine,
            trigger=job.trigger,
            reason=job.reason,
            attempts=job.attempts,
            instance_count=job.instance_count,
            stages={
                "first_instance": job.first_instance_at,
                "last_instance": job.last_instance_at,
                "queued": job.created_at,
                "started": job.started_at,
                "volume": job.volume_at,
                "inference": job.inference_at,
                "encoded": job.encoded_at,
                "sending": min(starts) if starts else None,
                "finished": job.finished_at,
            },
            seg_series_uid=job.seg_series_uid,
            seg_sop_uid=job.seg_sop_uid,
            sr_series_uid=job.sr_series_uid,
            sr_sop_uid=job.sr_sop_uid,
            deliveries=tuple((k, d, st, a) for k, d, st, a, *_ in dels),
            delivery_errors=tuple(e for *_, e, _, _ in dels),
            delivery_acks=tuple(t for *_, t in dels),
            delivery_starts=tuple(t for *_, t, _ in dels),
            superseded_by=s.scalar(
                select(Job.id)
                .where(Job.series_id == job.series_id, Job.version > job.version)
                .order_by(Job.version.desc())
                .limit(1)
            ),
            model_name=job.model_name,
            rule=job.rule,
            destinations=tuple(json.loads(job.destinations or "[]")),
            owner=job.owner,
        )

    def jobs_finished_since(self, since: datetime, limit: int = 1000) -> list[JobView]:
        """Jobs that finished after ``since``, oldest first (for the stage histograms)."""
        with self._read() as s:
            rows = s.scalars(
                select(Job).where(Job.finished_at > since).order_by(Job.finished_at).limit(limit)
            )
            return [self._view(s, j) for j in rows]

    def series_calling_ae(self, series_instance_uid: str) -> str:
        """The calling AE title that first sent a series ("" if unknown)."""
        with self._read() as s:
            ae = s.scalar(
                select(Series.calling_ae).where(Series.series_instance_uid == series_instance_uid)
            )
            return str(ae or "")

    def job(self, job_id: int) -> JobView | None:
        """One job."""
        with self._read() as s:
            job = s.get(Job, job_id)
            return None if job is None else self._view(s, job)

    def jobs(self, limit: int = 50) -> list[JobView]:
        """Most recent jobs first."""
        with self._read() as s:
            rows = s.scalars(select(Job).order_by(Job.id.desc()).limit(limit))
            return [self._view(s, j) for j in rows]

    def ignored_series(self, limit: int = 50) -> list[tuple[str, str, str]]:
        """``(series uid, calling AE, reason)`` of series that were accepted but not processed."""
        with self._read() as s:
            rows = s.execute(
                select(Series.series_instance_uid, Series.calling_ae, Series.ignored_reason)
                .where(Series.ignored_reason.is_not(None))
                .order_by(Series.id.desc())
                .limit(limit)
            ).all()
            return [(a, b, c or "") for a, b, c in rows]

    def counts(self) -> dict[str, Any]:
        """Totals for ``segnode status``: jobs per state, instances, pending deliveries."""
        with self._read() as s:
            rows = s.execute(select(Job.state, func.count(Job.id)).group_by(Job.state)).all()
            states = {str(k): int(v) for k, v in rows}
            by_priority = s.execute(
                select(Job.priority, func.count(Job.id))
                .where(Job.state == JobState.QUEUED)
                .group_by(Job.priority)
            ).all()
            return {
                "jobs": states,
                "queued_by_priority": {str(k): int(v) for k, v in sorted(by_priority)},
                "encoded_last_10_min": s.scalar(
                    select(func.count(Job.id)).where(
                        Job.encoded_at >= utcnow() - timedelta(minutes=10)
                    )
                )
                or 0,
                "instances": s.scalar(select(func.count(Instance.id))) or 0,
                "series_pending": s.scalar(
                    select(func.count(Series.id)).where(Series.pending_since.is_not(None))
                )
                or 0,
                "deliveries_pending": s.scalar(
                    select(func.count(Delivery.id)).where(Delivery.status == DeliveryStatus.PENDING)
                )
                or 0,
                "deliveries_failed": s.scalar(
                    select(func.count(Delivery.id)).where(Delivery.status == DeliveryStatus.FAILED)
                )
                or 0,
            }

    def held_series(self, limit: int = 50) -> list[tuple[str, int, str, datetime]]:
        """Series with instances no job has taken yet, with the last hold reason noted since
        then (or "" ): (series UID, instances, reason, pending since)."""
        with self._read() as s:
            rows = s.execute(
                select(Series)
                .where(Series.pending_since.is_not(None))
                .order_by(Series.pending_since.desc())
                .limit(limit)
            ).scalars()
            out = []
            for series in rows:
                assert series.pending_since is not None
                msg = s.scalar(
                    select(Event.message)
                    .where(
                        Event.series_id == series.id,
                        Event.kind == "held",
                        Event.at >= series.pending_since,
                    )
                    .order_by(Event.id.desc())
                    .limit(1)
                )
                out.append(
                    (
                        series.series_instance_uid,
                        series.instance_count,
                        msg or "",
                        series.pending_since,
                    )
                )
            return out

    def series_summary(self, series_instance_uid: str) -> SeriesSummary | None:
        """Calling AE, instance count and first instance of a series with pending instances
        (None when nothing is pending)."""
        with self._read() as s:
            series = s.scalar(
                select(Series).where(Series.series_instance_uid == series_instance_uid)
            )
            if series is None or series.pending_since is None:
                return None
            first = s.scalar(
                select(Instance.path)
                .where(Instance.series_id == series.id)
                .order_by(Instance.id)
                .limit(1)
            )
            if first is None:
                return None
            return SeriesSummary(series.calling_ae, series.instance_count, Path(first))

    def failed_jobs(self) -> list[int]:
        """Ids of failed jobs that are the latest version of their series (for retry)."""
        with self._read() as s:
            latest = (
                select(Job.series_id, func.max(Job.version).label("v"))
                .group_by(Job.series_id)
                .subquery()
            )
            rows = s.scalars(
                select(Job.id)
                .join(latest, (latest.c.series_id == Job.series_id) & (latest.c.v == Job.version))
                .where(Job.state == JobState.FAILED)
                .order_by(Job.id)
            )
            return list(rows)
