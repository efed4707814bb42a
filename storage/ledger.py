"""The job ledger: every state change of the node is one short SQLite transaction.

SQLite runs in WAL mode with ``synchronous=FULL`` so that a committed row survives power loss;
an instance is acknowledged only after its row is committed. Writers are serialised with a
process-wide lock (SQLite allows one writer at a time anyway) so that concurrent associations
never see ``database is locked``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydicom.uid import generate_uid
from sqlalchemy import create_engine, event, func, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from storage.models import (
    SCHEMA_VERSION,
    Base,
    Delivery,
    Event,
    Instance,
    Job,
    Meta,
    Result,
    Series,
    Study,
)

log = logging.getLogger(__name__)

#: Jobs that are not finished: the worker or the outbox still has something to do.
ACTIVE_STATES = ("queued", "running", "encoded")
FINAL_STATES = ("sent", "done", "failed", "cancelled", "superseded")


def utcnow() -> datetime:
    """Naive UTC timestamp (SQLite stores no zone)."""
    return datetime.now(UTC).replace(tzinfo=None)


@dataclass(frozen=True)
class InstanceRecord:
    """What the SCP learned about an instance from its header."""

    sop_instance_uid: str
    sop_class_uid: str
    series_instance_uid: str
    study_instance_uid: str
    transfer_syntax_uid: str
    modality: str
    calling_ae: str


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


@dataclass(frozen=True)
class DueDelivery:
    """A delivery whose next attempt is due."""

    id: int
    job_id: int
    destination: str
    path: str
    kind: str
    sop_instance_uid: str
    attempts: int


class Ledger:
    """The node's durable state, on one SQLite file.

    Parameters
    ----------
    path
        The database file; its folder is created with mode 0700.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        self.engine: Engine = create_engine(
            f"sqlite:///{path}",
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=8,
            max_overflow=16,
        )
        event.listen(self.engine, "connect", _sqlite_pragmas)
        self._session = sessionmaker(self.engine, expire_on_commit=False)
        self._write_lock = threading.RLock()
        Base.metadata.create_all(self.engine)
        os.chmod(path, 0o600)
        with self._tx() as s:
            meta = s.get(Meta, "schema_version")
            if meta is None:
                s.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))
            elif int(meta.value) != SCHEMA_VERSION:
                raise RuntimeError(
                    f"ledger {path} has schema version {meta.value}, this segnode expects "
                    f"{SCHEMA_VERSION}; migrate or use another data directory"
                )

    def close(self) -> None:
        """Dispose of the connection pool."""
        self.engine.dispose()

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with self._write_lock, self._session.begin() as s:
            yield s

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._session() as s:
            yield s

    # -- instances and series ---------------------------------------------------------------

    def has_instance(self, sop_instance_uid: str) -> bool:
        """Whether an instance with this SOP Instance UID is already stored."""
        with self._read() as s:
            row = s.scalar(select(Instance.id).where(Instance.sop_instance_uid == sop_instance_uid))
            return row is not None

    def is_own_result(self, sop_instance_uid: str, series_instance_uid: str) -> bool:
        """Whether the object is one this node produced (loop guard)."""
        with self._read() as s:
            hit = s.scalar(
                select(Result.id).where(
                    (Result.sop_instance_uid == sop_instance_uid)
                    | (Result.series_instance_uid == series_instance_uid)
                )
            )
            if hit is not None:
                return True
            hit = s.scalar(
                select(Job.id).where(
                    (Job.seg_series_uid == series_instance_uid)
                    | (Job.sr_series_uid == series_instance_uid)
                )
            )
            return hit is not None

    def _series(self, s: Session, rec: InstanceRecord, now: datetime) -> Series:
        series = s.scalar(
            select(Series).where(Series.series_instance_uid == rec.series_instance_uid)
        )
        if series is None:
            study = s.scalar(
                select(Study).where(Study.study_instance_uid == rec.study_instance_uid)
            )
            if study is None:
                study = Study(study_instance_uid=rec.study_instance_uid, created_at=now)
                s.add(study)
                s.flush()
            series = Series(
                series_instance_uid=rec.series_instance_uid,
                study_id=study.id,
                modality=rec.modality[:16],
                calling_ae=rec.calling_ae[:16],
                first_received_at=now,
                last_received_at=now,
                pending_since=None,
                instance_count=0,
            )
            s.add(series)
            s.flush()
        return series

    def record_instance(self, rec: InstanceRecord, path: Path, size: int) -> bool:
        """Record a stored instance; return False if it was already there (duplicate)."""
        now = utcnow()
        try:
            with self._tx() as s:
                if s.scalar(
                    select(Instance.id).where(Instance.sop_instance_uid == rec.sop_instance_uid)
                ):
                    return False
                series = self._series(s, rec, now)
                s.add(
                    Instance(
                        sop_instance_uid=rec.sop_instance_uid,
                        sop_class_uid=rec.sop_class_uid,
                        series_id=series.id,
                        transfer_syntax_uid=rec.transfer_syntax_uid,
                        path=str(path),
                        size=size,
                        calling_ae=rec.calling_ae[:16],
                        received_at=now,
                    )
                )
                series.instance_count += 1
                series.last_received_at = now
                series.ignored_reason = None
                if series.pending_since is None:
                    series.pending_since = now
                return True
        except IntegrityError:
            return False

    def record_ignored(self, rec: InstanceRecord, reason: str) -> None:
        """Record that an instance was accepted but not kept, and why (series level)."""
        now = utcnow()
        with self._tx() as s:
            series = self._series(s, rec, now)
            series.last_received_at = now
            if series.instance_count == 0:
                series.ignored_reason = reason[:512]
            s.add(Event(at=now, kind="ignored", series_id=series.id, message=reason[:2048]))

    def pending_series(self, quiet_before: datetime | None = None) -> list[str]:
        """Series UIDs with instances not yet taken by a job.

        Parameters
        ----------
        quiet_before
            If given, only series whose last instance arrived before this time.
        """
        with self._read() as s:
            q = select(Series.series_instance_uid).where(Series.pending_since.is_not(None))
            if quiet_before is not None:
                q = q.where(Series.last_received_at < quiet_before)
            return list(s.scalars(q))

    def instance_paths(self, series_instance_uid: str) -> list[Path]:
        """Spool paths of every instance of a series."""
        with self._read() as s:
            rows = s.scalars(
                select(Instance.path)
                .join(Series, Series.id == Instance.series_id)
                .where(Series.series_instance_uid == series_instance_uid)
                .order_by(Instance.id)
            )
            return [Path(p) for p in rows]

    # -- jobs ----------------------------------------------------------------------------

    def create_job(
        self, series_instance_uid: str, *, trigger: str, model: str, engine: str, priority: int = 0
    ) -> int | None:
        """Turn a series' pending instances into a new job version.

        Returns the job id, or None when the series has nothing pending (another signal
        already created the job). Older queued versions of the series are superseded.
        """
        now = utcnow()
        with self._tx() as s:
            series = s.scalar(
                select(Series).where(Series.series_instance_uid == series_instance_uid)
            )
            if series is None or series.pending_since is None:
                return None
            version = (
                s.scalar(select(func.max(Job.version)).where(Job.series_id == series.id)) or 0
            ) + 1
            s.execute(
                update(Job)
                .where(Job.series_id == series.id, Job.state == "queued")
                .values(state="superseded", finished_at=now, reason=f"superseded by v{version}")
            )
            first, last = s.execute(
                select(func.min(Instance.received_at), func.max(Instance.received_at)).where(
                    Instance.series_id == series.id
                )
            ).one()
            job = Job(
                series_id=series.id,
                version=version,
                state="queued",
                priority=priority,
                model=model,
                engine=engine,
                trigger=trigger,
                instance_count=series.instance_count,
                first_instance_at=first,
                last_instance_at=last,
                created_at=now,
                seg_series_uid=generate_uid(),
                seg_sop_uid=generate_uid(),
                sr_series_uid=generate_uid(),
                sr_sop_uid=generate_uid(),
            )
            s.add(job)
            series.pending_since = None
            s.flush()
            s.add(
                Event(
                    at=now,
                    kind="job-created",
                    job_id=job.id,
                    series_id=series.id,
                    message=f"v{version} by {trigger}, {series.instance_count} instances",
                )
            )
            return job.id

    def claim_next_job(self) -> JobView | None:
        """Take the most urgent queued job (highest priority, then oldest) and mark it running."""
        now = utcnow()
        with self._tx() as s:
            job = s.scalar(
                select(Job)
                .where(Job.state == "queued")
                .order_by(Job.priority.desc(), Job.created_at, Job.id)
                .limit(1)
            )
            if job is None:
                return None
            job.state = "running"
            job.started_at = now
            job.attempts += 1
            s.flush()
            return self._view(s, job)

    def mark(self, job_id: int, stage: str) -> None:
        """Set a stage timestamp (``volume_at``, ``inference_at``)."""
        if stage not in ("volume_at", "inference_at"):
            raise ValueError(stage)
        with self._tx() as s:
            s.execute(update(Job).where(Job.id == job_id).values({stage: utcnow()}))

    def fail_job(self, job_id: int, reason: str) -> None:
        """End a job as failed with a reason a human can act on."""
        now = utcnow()
        with self._tx() as s:
            job = s.get(Job, job_id)
            if job is None:
                return
            job.state = "failed"
            job.reason = reason[:2048]
            job.finished_at = now
            s.add(Event(at=now, kind="job-failed", job_id=job_id, message=reason[:2048]))

    def save_results(
        self,
        job_id: int,
        results: Sequence[tuple[str, str, str, str, Path]],
        destinations: Sequence[str],
    ) -> None:
        """Record encoded result files and their outbox rows; the job becomes ``encoded``.

        Parameters
        ----------
        results
            ``(kind, sop_class_uid, sop_instance_uid, series_instance_uid, path)`` in send order.
        destinations
            Destination names (``AE@host:port``); one delivery row per result and destination.
        """
        now = utcnow()
        with self._tx() as s:
            job = s.get(Job, job_id)
            if job is None or job.state != "running":
                return
            for order, (kind, cls, sop, series_uid, path) in enumerate(results):
                res = s.scalar(select(Result).where(Result.sop_instance_uid == sop))
                if res is None:
                    res = Result(
                        job_id=job_id,
                        kind=kind,
                        sop_class_uid=cls,
                        sop_instance_uid=sop,
                        series_instance_uid=series_uid,
                        path=str(path),
                        order=order,
                    )
                    s.add(res)
                    s.flush()
                for dest in destinations:
                    exists = s.scalar(
                        select(Delivery.id).where(
                            Delivery.result_id == res.id, Delivery.destination == dest
                        )
                    )
                    if exists is None:
                        s.add(
                            Delivery(
                                result_id=res.id,
                                job_id=job_id,
                                destination=dest,
                                status="pending",
                                next_attempt_at=now,
                                created_at=now,
                            )
                        )
            job.encoded_at = now
            if destinations:
                job.state = "encoded"
            else:
                job.state = "done"
                job.finished_at = now
            s.add(
                Event(at=now, kind="job-encoded", job_id=job_id, message=f"{len(results)} objects")
            )

    # -- outbox --------------------------------------------------------------------------

    def due_deliveries(self, now: datetime | None = None, limit: int = 64) -> list[DueDelivery]:
        """Pending deliveries whose next attempt is due, oldest job first, SEG before SR."""
        now = now or utcnow()
        with self._read() as s:
            rows = s.execute(
                select(Delivery, Result)
                .join(Result, Result.id == Delivery.result_id)
                .join(Job, Job.id == Delivery.job_id)
                .where(Delivery.status == "pending", Delivery.next_attempt_at <= now)
                .where(Job.state == "encoded")
                .order_by(Job.priority.desc(), Delivery.job_id, Result.order)
                .limit(limit)
            ).all()
            return [
                DueDelivery(
                    id=d.id,
                    job_id=d.job_id,
                    destination=d.destination,
                    path=r.path,
                    kind=r.kind,
                    sop_instance_uid=r.sop_instance_uid,
                    attempts=d.attempts,
                )
                for d, r in rows
            ]

    def delivery_done(self, delivery_id: int, status: int) -> None:
        """Record a successful C-STORE (status 0x0000) and finish the job when all are sent."""
        now = utcnow()
        with self._tx() as s:
            d = s.get(Delivery, delivery_id)
            if d is None:
                return
            d.status = "sent"
            d.attempts += 1
            d.last_status = f"0x{status:04X}"
            d.last_error = None
            d.sent_at = now
            s.flush()
            left = s.scalar(
                select(func.count(Delivery.id)).where(
                    Delivery.job_id == d.job_id, Delivery.status != "sent"
                )
            )
            if not left:
                job = s.get(Job, d.job_id)
                if job is not None and job.state == "encoded":
                    job.state = "sent"
                    job.finished_at = now
                    s.add(Event(at=now, kind="job-sent", job_id=job.id, message="all delivered"))

    def delivery_retry(
        self, delivery_id: int, error: str, next_attempt_at: datetime, status: int | None = None
    ) -> None:
        """Record a failed attempt and when to try again."""
        with self._tx() as s:
            d = s.get(Delivery, delivery_id)
            if d is None:
                return
            d.attempts += 1
            d.last_error = error[:1024]
            d.last_status = None if status is None else f"0x{status:04X}"
            d.next_attempt_at = next_attempt_at
            s.add(Event(at=utcnow(), kind="delivery-retry", job_id=d.job_id, message=error[:2048]))

    def delivery_failed(self, delivery_id: int, error: str) -> None:
        """Give up on a delivery; the job fails with the reason."""
        now = utcnow()
        with self._tx() as s:
            d = s.get(Delivery, delivery_id)
            if d is None:
                return
            d.status = "failed"
            d.attempts += 1
            d.last_error = error[:1024]
            job = s.get(Job, d.job_id)
            if job is not None and job.state == "encoded":
                job.state = "failed"
                job.reason = f"delivery to {d.destination} failed: {error}"[:2048]
                job.finished_at = now

    def next_delivery_time(self) -> datetime | None:
        """When the earliest pending delivery is due."""
        with self._read() as s:
            return s.scalar(
                select(func.min(Delivery.next_attempt_at))
                .join(Job, Job.id == Delivery.job_id)
                .where(Delivery.status == "pending", Job.state == "encoded")
            )

    # -- recovery, control, views ----------------------------------------------------------

    def recover(self, max_attempts: int) -> int:
        """Put jobs interrupted by a crash back in the queue; return how many.

        A job that was ``running`` goes back to ``queued`` (its result UIDs are kept), unless it
        has already been tried ``max_attempts`` times, then it fails with that reason.
        """
        now = utcnow()
        n = 0
        with self._tx() as s:
            for job in s.scalars(select(Job).where(Job.state == "running")):
                if job.attempts >= max_attempts:
                    job.state = "failed"
                    job.reason = f"interrupted {job.attempts} times while processing; giving up"
                    job.finished_at = now
                else:
                    job.state = "queued"
                    n += 1
                s.add(Event(at=now, kind="recovered", job_id=job.id, message=f"now {job.state}"))
        return n

    def retry_job(self, job_id: int) -> bool:
        """Requeue a failed or cancelled job (same result UIDs)."""
        with self._tx() as s:
            job = s.get(Job, job_id)
            if job is None or job.state not in ("failed", "cancelled"):
                return False
            undelivered = s.scalar(
                select(func.count(Delivery.id)).where(
                    Delivery.job_id == job_id, Delivery.status == "failed"
                )
            )
            if job.encoded_at is not None and undelivered:
                s.execute(
                    update(Delivery)
                    .where(Delivery.job_id == job_id, Delivery.status == "failed")
                    .values(status="pending", next_attempt_at=utcnow())
                )
                job.state = "encoded"
            else:
                job.state = "queued"
            job.reason = None
            job.finished_at = None
            return True

    def cancel_job(self, job_id: int) -> bool:
        """Cancel a job that has not finished."""
        with self._tx() as s:
            job = s.get(Job, job_id)
            if job is None or job.state not in ACTIVE_STATES:
                return False
            job.state = "cancelled"
            job.finished_at = utcnow()
            return True

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
            select(Result.kind, Delivery.destination, Delivery.status, Delivery.attempts)
            .join(Result, Result.id == Delivery.result_id)
            .where(Delivery.job_id == job.id)
            .order_by(Result.order, Delivery.destination)
        ).all()
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
                "finished": job.finished_at,
            },
            seg_series_uid=job.seg_series_uid,
            seg_sop_uid=job.seg_sop_uid,
            sr_series_uid=job.sr_series_uid,
            sr_sop_uid=job.sr_sop_uid,
            deliveries=tuple((k, d, st, a) for k, d, st, a in dels),
        )

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
            return {
                "jobs": states,
                "instances": s.scalar(select(func.count(Instance.id))) or 0,
                "series_pending": s.scalar(
                    select(func.count(Series.id)).where(Series.pending_since.is_not(None))
                )
                or 0,
                "deliveries_pending": s.scalar(
                    select(func.count(Delivery.id)).where(Delivery.status == "pending")
                )
                or 0,
            }

    def event(self, kind: str, message: str, *, job_id: int | None = None) -> None:
        """Append an event."""
        with self._tx() as s:
            s.add(Event(at=utcnow(), kind=kind, job_id=job_id, message=message[:2048]))


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def backoff(attempts: int, initial: float, maximum: float) -> timedelta:
    """Exponential backoff: ``initial * 2**attempts`` capped at ``maximum`` seconds."""
    return timedelta(seconds=min(maximum, initial * (2 ** max(0, attempts))))
