"""The job ledger: every state change of the node is one short SQLite transaction.

SQLite runs in WAL mode with ``synchronous=FULL`` so that a committed row survives power loss,
with one exception: the SCP's per-instance rows (:meth:`Ledger.record_instance`) are committed
with ``synchronous=NORMAL`` - they survive a crash of the process, and the next ``FULL`` commit
of any other transaction (a job, an event) makes them durable on disk too. The spool file of an
acknowledged instance is always fsynced, so a power cut that loses the tail of those rows loses
nothing acknowledged: :meth:`Ledger.missing_instances` lists spool files without a row and the
node records them again at start-up (``Node.start``). Writers are serialised with a
process-wide lock (SQLite allows one writer at a time anyway) so that concurrent associations
never see ``database is locked``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydicom.uid import generate_uid
from sqlalchemy import DateTime, create_engine, event, func, or_, select, update
from sqlalchemy.engine import CursorResult, Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased, sessionmaker

from storage.migrations import upgrade
from storage.models import (
    SCHEMA_VERSION,
    Base,
    Delivery,
    Event,
    Instance,
    Job,
    Meta,
    Result,
    Sender,
    Series,
    SpoolPurge,
    Study,
)

log = logging.getLogger(__name__)


class JobState(StrEnum):
    """Where a job is. The ledger stores the value; the value compares equal to its text."""

    QUEUED = "queued"
    RUNNING = "running"
    ENCODED = "encoded"
    SENT = "sent"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SUPERSEDED = "superseded"


#: The moves a job may make (:func:`move`); any other is a bug and raises.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # claimed by the worker; a newer series version or an operator ends it first
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.SUPERSEDED, JobState.CANCELLED}),
    # results saved (sent next, or done with no destination / no segment), failed, superseded
    # by a newer version, cancelled; back to queued when a restart interrupted it
    JobState.RUNNING: frozenset(
        {
            JobState.ENCODED,
            JobState.DONE,
            JobState.FAILED,
            JobState.SUPERSEDED,
            JobState.CANCELLED,
            JobState.QUEUED,
        }
    ),
    # every delivery acknowledged, one given up, a newer version before any was sent
    JobState.ENCODED: frozenset(
        {JobState.SENT, JobState.FAILED, JobState.SUPERSEDED, JobState.CANCELLED}
    ),
    # an operator's retry: run again, or only send again what failed to go out
    JobState.FAILED: frozenset({JobState.QUEUED, JobState.ENCODED}),
    JobState.CANCELLED: frozenset({JobState.QUEUED, JobState.ENCODED}),
    JobState.SENT: frozenset(),
    JobState.DONE: frozenset(),
    JobState.SUPERSEDED: frozenset(),
}

#: Jobs that are not finished: the worker or the outbox still has something to do.
ACTIVE_STATES = (JobState.QUEUED, JobState.RUNNING, JobState.ENCODED)
FINAL_STATES = tuple(state for state, moves in TRANSITIONS.items() if state not in ACTIVE_STATES)


class DeliveryStatus(StrEnum):
    """Where one result's delivery to one destination is."""

    PENDING = "pending"
    SENT = "sent"
    FAILED = "failed"
    CANCELLED = "cancelled"


#: The moves a delivery may make (:func:`move_delivery`). A delivery given up (failed) or
#: cancelled may still turn out sent: its acknowledgement arrived after it was given up, and
#: the ledger records what happened.
DELIVERY_MOVES: dict[DeliveryStatus, frozenset[DeliveryStatus]] = {
    DeliveryStatus.PENDING: frozenset(
        {DeliveryStatus.SENT, DeliveryStatus.FAILED, DeliveryStatus.CANCELLED}
    ),
    DeliveryStatus.FAILED: frozenset({DeliveryStatus.PENDING, DeliveryStatus.SENT}),
    DeliveryStatus.CANCELLED: frozenset({DeliveryStatus.SENT}),
    DeliveryStatus.SENT: frozenset(),
}


class TransitionError(RuntimeError):
    """A job was asked to make a move :data:`TRANSITIONS` does not allow (a bug)."""


def move_delivery(
    s: Session, d: Delivery, to: DeliveryStatus, now: datetime, message: str = ""
) -> None:
    """Move delivery ``d`` to ``to``, checked against :data:`DELIVERY_MOVES`, and record the
    event (``delivery-<status>``, naming the destination).

    Raises
    ------
    TransitionError
        The move is not allowed from the delivery's status.
    """
    now_status = DeliveryStatus(d.status)
    if to not in DELIVERY_MOVES[now_status]:
        raise TransitionError(f"delivery {d.id}: {now_status} -> {to} is not an allowed move")
    d.status = to.value
    text = f"{d.destination}: {message or f'{now_status} -> {to}'}"
    s.add(Event(at=now, kind=f"delivery-{to}", job_id=d.job_id, message=text[:2048]))


def move(
    s: Session,
    job: Job,
    to: JobState,
    now: datetime,
    *,
    kind: str | None = None,
    message: str | None = None,
) -> None:
    """Move ``job`` to ``to`` in session ``s``, checked against :data:`TRANSITIONS`, and
    record the event (``kind``, default ``job-<state>``, with ``message``).

    Raises
    ------
    TransitionError
        The move is not allowed from the job's state.
    """
    now_state = JobState(job.state)
    if to not in TRANSITIONS[now_state]:
        raise TransitionError(f"job {job.id}: {now_state} -> {to} is not an allowed move")
    job.state = to.value
    text = message if message is not None else f"{now_state} -> {to}"
    s.add(Event(at=now, kind=kind or f"job-{to}", job_id=job.id, message=text[:2048]))


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
    delivery_errors: tuple[str | None, ...] = ()  # last error of each delivery, same order
    delivery_acks: tuple[datetime | None, ...] = ()  # when each delivery was acknowledged
    delivery_starts: tuple[datetime | None, ...] = ()  # when its latest send attempt started
    superseded_by: int | None = None  # a later version of the series (its results replace ours)
    model_name: str = "default"  # the configured model ([model] is "default", [models.NAME])
    rule: str = ""  # the routing rule that created the job
    destinations: tuple[str, ...] = ()  # where its results go (names, fixed at creation)


@dataclass(frozen=True)
class NewJob:
    """A job to create for a series version: a model, where its results go, its priority."""

    model_name: str
    model: str
    engine: str
    destinations: tuple[str, ...] = ()
    priority: int = 0
    rule: str = ""


@dataclass(frozen=True)
class SeriesSummary:
    """What routing needs of a series with pending instances."""

    calling_ae: str
    instance_count: int
    first_instance: Path


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
    sop_class_uid: str = ""


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
        # Create the file 0600 before SQLite opens it: its -wal and -shm files take its mode.
        os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
        os.chmod(path, 0o600)
        self.engine: Engine = create_engine(
            f"sqlite:///{path}",
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=8,
            max_overflow=16,
        )
        event.listen(self.engine, "connect", _sqlite_pragmas)
        self._session = sessionmaker(self.engine, expire_on_commit=False)
        self._write_lock = threading.RLock()
        # The SCP's per-instance statements go through one plain sqlite3 connection (an
        # eighth of SQLAlchemy's per-statement cost); used under _hot_lock, after _write_lock
        # when writing.
        self._hot: sqlite3.Connection | None = None
        self._hot_lock = threading.Lock()
        self._datetime_bind: Any = None
        # An older ledger is upgraded in place before anything reads it; a newer one stops
        # here (storage.migrations.SchemaError).
        found = upgrade(path)
        if found is not None and found != SCHEMA_VERSION:
            log.info("ledger %s upgraded from schema version %d to %d", path, found, SCHEMA_VERSION)
        Base.metadata.create_all(self.engine)
        os.chmod(path, 0o600)
        with self._tx() as s:
            if s.get(Meta, "schema_version") is None:
                s.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))

    def _stamp(self, when: datetime) -> str:
        """``when`` as the dialect stores DateTime columns (for the plain-SQL hot path)."""
        if self._datetime_bind is None:
            impl = DateTime().dialect_impl(self.engine.dialect)
            self._datetime_bind = impl.bind_processor(self.engine.dialect)
        return str(self._datetime_bind(when) if self._datetime_bind else when.isoformat(" "))

    def close(self) -> None:
        """Dispose of the connection pool."""
        with self._hot_lock:
            if self._hot is not None:
                self._hot.close()
                self._hot = None
        self.engine.dispose()

    def _hot_connection(self) -> sqlite3.Connection:
        """The hot-path connection (autocommit mode: transactions are explicit); call under
        ``_hot_lock``."""
        if self._hot is None:
            conn = sqlite3.connect(
                self.path, timeout=30, check_same_thread=False, isolation_level=None
            )
            _sqlite_pragmas(conn, None)
            # Instance rows: no WAL fsync per commit (see the module docstring); the spool
            # file is the durable record, and start-up re-records files without a row.
            conn.execute("PRAGMA synchronous=NORMAL")
            self._hot = conn
        return self._hot

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
        """Whether an instance with this SOP Instance UID is already stored.

        Asked for every received instance: one indexed lookup on the hot-path connection.
        """
        with self._hot_lock:
            row = self._hot_connection().execute(_HAS_INSTANCE, (sop_instance_uid,)).fetchone()
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

    def record_instance(
        self, rec: InstanceRecord, path: Path, size: int, *, _retry: bool = True
    ) -> bool:
        """Record a stored instance; return False if it was already there (duplicate).

        The SCP's hot path: one short transaction of three plain SQL statements on the
        hot-path connection: find the series, insert the instance (its unique SOP Instance UID
        refuses a duplicate), update the series' counters. The first instance of a series
        creates the study and series rows through the ORM instead. Committed before the caller
        answers success, without a WAL fsync (``synchronous=NORMAL``): the instance's spool
        file, fsynced before the answer, is what survives a power cut, and start-up records
        again any file whose row was lost (:meth:`missing_instances`).
        """
        now = utcnow()
        stamp = self._stamp(now)
        values = (
            rec.sop_instance_uid,
            rec.sop_class_uid,
            0,
            rec.transfer_syntax_uid,
            str(path),
            size,
            rec.calling_ae[:16],
            stamp,
        )
        with self._write_lock:
            with self._hot_lock:
                conn = self._hot_connection()
                conn.execute("BEGIN IMMEDIATE")
                try:
                    row = conn.execute(_SERIES_ID, (rec.series_instance_uid,)).fetchone()
                    if row is not None:
                        conn.execute(_INSERT_INSTANCE, (*values[:2], row[0], *values[3:]))
                        conn.execute(_SERIES_RECEIVED, (stamp, stamp, row[0]))
                        conn.execute("COMMIT")
                        return True
                    conn.execute("ROLLBACK")
                except sqlite3.IntegrityError:
                    conn.execute("ROLLBACK")
                    return False
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            # The series' first instance: create the study and series rows.
            try:
                with self.engine.begin() as sa:
                    with Session(bind=sa) as s:
                        series_id = self._series(s, rec, now).id
                    sa.exec_driver_sql(_INSERT_INSTANCE, (*values[:2], series_id, *values[3:]))
                    sa.exec_driver_sql(_SERIES_RECEIVED, (stamp, stamp, series_id))
                    return True
            except IntegrityError:
                # A duplicate SOP Instance UID, or the study/series row created meanwhile by
                # another writer: only the first is a duplicate; the second is retried.
                if self.has_instance(rec.sop_instance_uid) or not _retry:
                    return False
        return self.record_instance(rec, path, size, _retry=False)

    def forget_instance(self, sop_instance_uid: str) -> None:
        """Remove an instance row that was never acknowledged (its file did not persist)."""
        with self._write_lock, self.engine.begin() as conn:
            row = conn.exec_driver_sql(_INSTANCE_SERIES, (sop_instance_uid,)).first()
            if row is not None:
                conn.exec_driver_sql(_DELETE_INSTANCE, (row[0],))
                conn.exec_driver_sql(_SERIES_FORGOT, (row[1],))

    def drop_unstored_instances(self) -> int:
        """At start-up: remove rows of series still receiving whose spool file is missing.

        The C-STORE path commits the ledger row while the spool folder's fsync runs; a crash
        between the two can leave a row whose rename did not persist. Such an instance was
        never acknowledged, so the row goes (and the sender's retry stores it again).

        A file whose size differs from the row's is unacknowledged too: a recycled staging
        file is cut to the instance's size and renamed, then both are synced before the
        answer; a file system that kept the rename but not the cut leaves the old length.
        Such a file goes with its row.
        """
        with self.engine.connect() as conn:
            rows = conn.exec_driver_sql(_PENDING_INSTANCES).all()
        missing = []
        for sop_uid, path, size in rows:
            try:
                actual = os.stat(path).st_size
            except OSError:
                missing.append(sop_uid)
                continue
            if size is not None and actual != size:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                missing.append(sop_uid)
        for sop_uid in missing:
            self.forget_instance(sop_uid)
        return len(missing)

    def missing_instances(self, paths: Sequence[Path]) -> list[Path]:
        """The spool files among ``paths`` that have no instance row.

        A power cut can lose the last instance rows (committed with ``synchronous=NORMAL``)
        while their fsynced files remain: start-up records those files again.
        """
        # Spool files are named <SOP Instance UID>.dcm: look them up by that unique index,
        # a chunk at a time (a ledger may hold far more rows than the spool has files).
        known: set[str] = set()
        names = [p.name.removesuffix(".dcm") for p in paths]
        with self.engine.connect() as conn:
            for i in range(0, len(names), 500):
                chunk = names[i : i + 500]
                marks = ", ".join("?" * len(chunk))
                rows = conn.exec_driver_sql(
                    f"SELECT sop_instance_uid FROM instances WHERE sop_instance_uid IN ({marks})",
                    tuple(chunk),
                )
                known.update(r[0] for r in rows)
        return [p for p, name in zip(paths, names, strict=True) if name not in known]

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
        self,
        series_instance_uid: str,
        *,
        trigger: str,
        model: str,
        engine: str,
        priority: int = 0,
        model_name: str = "default",
        destinations: Sequence[str] = (),
    ) -> int | None:
        """Turn a series' pending instances into a new job version with one model.

        Returns the job id, or None when the series has nothing pending (another signal
        already created the job). Older queued versions of the series are superseded.
        """
        spec = NewJob(model_name, model, engine, tuple(destinations), priority)
        ids = self.create_jobs(series_instance_uid, trigger=trigger, jobs=[spec])
        return ids[0] if ids else None

    def create_jobs(
        self, series_instance_uid: str, *, trigger: str, jobs: Sequence[NewJob]
    ) -> list[int]:
        """Turn a series' pending instances into a new version with one job per model.

        All jobs share the version and the instances; each has its own result UIDs. Returns
        their ids, or ``[]`` when the series has nothing pending (another signal already
        created the jobs). Older queued jobs of the series are superseded.
        """
        now = utcnow()
        if not jobs:
            return []
        with self._tx() as s:
            series = s.scalar(
                select(Series).where(Series.series_instance_uid == series_instance_uid)
            )
            if series is None or series.pending_since is None:
                return []
            version = (
                s.scalar(select(func.max(Job.version)).where(Job.series_id == series.id)) or 0
            ) + 1
            # Older versions whose results have not left the node never will: queued and
            # running jobs, and encoded jobs with nothing delivered yet (their deliveries are
            # cancelled). A job that delivered something keeps going (its results are
            # replaced, and withdrawn where the destination takes rejection notes).
            sent_any = (
                select(Delivery.id)
                .where(Delivery.job_id == Job.id, Delivery.status == DeliveryStatus.SENT)
                .exists()
            )
            undelivered = s.scalars(
                select(Job.id).where(
                    Job.series_id == series.id,
                    or_(
                        Job.state.in_((JobState.QUEUED, JobState.RUNNING)),
                        (Job.state == JobState.ENCODED) & ~sent_any,
                    ),
                )
            ).all()
            if undelivered:
                why = f"superseded by v{version} before its results were sent"
                for old_job in s.scalars(select(Job).where(Job.id.in_(undelivered))):
                    move(s, old_job, JobState.SUPERSEDED, now, message=why)
                    old_job.finished_at, old_job.reason = now, why
                pending = s.scalars(
                    select(Delivery).where(
                        Delivery.job_id.in_(undelivered),
                        Delivery.status == DeliveryStatus.PENDING,
                    )
                )
                for d in pending.all():
                    move_delivery(s, d, DeliveryStatus.CANCELLED, now, f"superseded by v{version}")
                    d.last_error = f"superseded by v{version}"
            older = s.scalars(
                select(Job.id).where(
                    Job.series_id == series.id,
                    Job.state.in_((JobState.ENCODED, JobState.SENT, JobState.DONE)),
                )
            ).all()
            first, last = s.execute(
                select(func.min(Instance.received_at), func.max(Instance.received_at)).where(
                    Instance.series_id == series.id
                )
            ).one()
            ids: list[int] = []
            for spec in jobs:
                job = Job(
                    series_id=series.id,
                    version=version,
                    state=JobState.QUEUED.value,
                    priority=spec.priority,
                    model=spec.model,
                    model_name=spec.model_name,
                    rule=spec.rule,
                    destinations=json.dumps(list(spec.destinations)),
                    engine=spec.engine,
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
                s.flush()
                ids.append(job.id)
                s.add(
                    Event(
                        at=now,
                        kind="job-created",
                        job_id=job.id,
                        series_id=series.id,
                        message=f"v{version} by {trigger}, {series.instance_count} instances, "
                        f"model {spec.model_name}",
                    )
                )
            series.pending_since = None
            series.ignored_reason = None
            for old_id in older:  # a late instance reopened the series: older results replaced
                s.add(
                    Event(
                        at=now,
                        kind="results-superseded",
                        job_id=old_id,
                        series_id=series.id,
                        message=f"results superseded by job {ids[0]} (v{version})",
                    )
                )
            return ids

    # -- sender patterns and held series -------------------------------------------------

    def senders(self) -> list[tuple[str, int, int, str, float | None]]:
        """Learnt sender patterns: (calling AE, associations, instances, recent, gap in ms)."""
        with self._read() as s:
            return [
                (r.calling_ae, r.associations, r.instances, r.recent, r.gap_ms)
                for r in s.scalars(select(Sender).order_by(Sender.calling_ae))
            ]

    def save_sender(
        self, calling_ae: str, associations: int, instances: int, recent: str, gap_ms: float | None
    ) -> None:
        """Store a sender's learnt pattern."""
        with self._tx() as s:
            row = s.get(Sender, calling_ae[:16])
            if row is None:
                row = Sender(calling_ae=calling_ae[:16])
                s.add(row)
            row.associations, row.instances = associations, instances
            row.recent, row.gap_ms, row.updated_at = recent[-32:], gap_ms, utcnow()

    def record_hold(self, series_instance_uid: str, reason: str) -> None:
        """Note why a release did not complete a series (shown by ``segnode jobs``)."""
        with self._tx() as s:
            series = s.scalar(
                select(Series).where(Series.series_instance_uid == series_instance_uid)
            )
            if series is not None:
                s.add(Event(at=utcnow(), kind="held", series_id=series.id, message=reason[:2048]))

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

    def ignore_series(self, series_instance_uid: str, reason: str) -> bool:
        """Take a series' pending instances without a job (routing selected no model).

        The series is listed by :meth:`ignored_series` with ``reason`` until new instances
        arrive. Returns False when nothing was pending.
        """
        now = utcnow()
        with self._tx() as s:
            series = s.scalar(
                select(Series).where(Series.series_instance_uid == series_instance_uid)
            )
            if series is None or series.pending_since is None:
                return False
            series.pending_since = None
            series.ignored_reason = reason[:512]
            s.add(Event(at=now, kind="ignored", series_id=series.id, message=reason[:2048]))
            return True

    def queued_siblings(self, job_id: int) -> int:
        """Queued jobs of the same series version as ``job_id`` (other models)."""
        with self._read() as s:
            job = s.get(Job, job_id)
            if job is None:
                return 0
            n = s.scalar(
                select(func.count(Job.id)).where(
                    Job.series_id == job.series_id,
                    Job.version == job.version,
                    Job.state == JobState.QUEUED,
                    Job.id != job.id,
                )
            )
            return int(n or 0)

    def claim_next_job(self) -> JobView | None:
        """Take the most urgent queued job (highest priority, then oldest) and mark it running."""
        now = utcnow()
        with self._tx() as s:
            job = s.scalar(
                select(Job)
                .where(Job.state == JobState.QUEUED)
                .order_by(Job.priority.desc(), Job.created_at, Job.id)
                .limit(1)
            )
            if job is None:
                return None
            move(s, job, JobState.RUNNING, now, message=f"attempt {job.attempts + 1}")
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
            if job is None or job.state != JobState.RUNNING:
                return  # superseded (or cancelled) while it ran: that state stands
            move(s, job, JobState.FAILED, now, message=reason)
            job.reason = reason[:2048]
            job.finished_at = now

    def finish_empty(self, job_id: int, reason: str) -> None:
        """End a job as ``done`` with nothing to send (the model found no segment)."""
        now = utcnow()
        with self._tx() as s:
            job = s.get(Job, job_id)
            if job is None or job.state != JobState.RUNNING:
                return
            move(s, job, JobState.DONE, now, kind="job-empty", message=reason)
            job.reason = reason[:2048]
            job.encoded_at = now
            job.finished_at = now

    def superseded_sent(self, job_id: int) -> dict[str, list[tuple[str, Path]]]:
        """Results of older versions of the job's series that were delivered (SEG and SR, not
        rejection notes): destination -> [(SOP Instance UID, file)]."""
        with self._read() as s:
            job = s.get(Job, job_id)
            if job is None:
                return {}
            rows = s.execute(
                select(Delivery.destination, Result.sop_instance_uid, Result.path)
                .join(Result, Result.id == Delivery.result_id)
                .join(Job, Job.id == Delivery.job_id)
                .where(
                    Job.series_id == job.series_id,
                    Job.version < job.version,
                    Delivery.status == DeliveryStatus.SENT,
                    Result.kind.in_(("SEG", "SR")),
                )
                .order_by(Job.version, Result.order)
            ).all()
        out: dict[str, list[tuple[str, Path]]] = {}
        for dest, sop, path in rows:
            out.setdefault(dest, []).append((sop, Path(path)))
        return out

    def save_results(
        self,
        job_id: int,
        results: Sequence[tuple[str, str, str, str, Path]],
        destinations: Sequence[str],
        notes: Sequence[tuple[str, str, str, str, Path, Sequence[str]]] = (),
    ) -> bool:
        """Record encoded result files and their outbox rows; the job becomes ``encoded``.

        Returns False, recording nothing to send, when the job is no longer running (a newer
        version superseded it) or its series received more instances while it ran (it is
        then superseded: partial results never leave the node).

        Parameters
        ----------
        results
            ``(kind, sop_class_uid, sop_instance_uid, series_instance_uid, path)`` in send order.
        destinations
            Destination names (``AE@host:port``); one delivery row per result and destination.
        notes
            Objects for some destinations only, sent after ``results`` (rejection notes):
            ``(kind, sop_class_uid, sop_instance_uid, series_instance_uid, path, destinations)``.
        """
        now = utcnow()
        with self._tx() as s:
            job = s.get(Job, job_id)
            if job is None or job.state != JobState.RUNNING:
                return False
            series = s.get(Series, job.series_id)
            if series is not None and series.pending_since is not None:
                # Instances arrived while the job ran: its results cover part of the series
                # and must not leave; the next version (the new instances complete it) will.
                reason = (
                    f"the series received more instances while this job ran "
                    f"({job.instance_count} -> {series.instance_count}); not sent"
                )
                move(s, job, JobState.SUPERSEDED, now, message=reason)
                job.reason = reason
                job.encoded_at = job.finished_at = now
                return False
            items: list[tuple[str, str, str, str, Path, Sequence[str]]] = [
                (*r, destinations) for r in results
            ]
            items += notes
            for order, (kind, cls, sop, series_uid, path, dests) in enumerate(items):
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
                for dest in dests:
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
                                status=DeliveryStatus.PENDING.value,
                                next_attempt_at=now,
                                created_at=now,
                            )
                        )
            job.encoded_at = now
            done = f"{len(results)} objects"
            if destinations:
                move(s, job, JobState.ENCODED, now, message=done)
            else:
                move(s, job, JobState.DONE, now, kind="job-encoded", message=done)
                job.finished_at = now
            return True

    # -- outbox --------------------------------------------------------------------------

    def due_deliveries(self, now: datetime | None = None, limit: int = 64) -> list[DueDelivery]:
        """Pending deliveries whose next attempt is due, oldest job first, SEG before SR."""
        now = now or utcnow()
        with self._read() as s:
            rows = s.execute(
                select(Delivery, Result)
                .join(Result, Result.id == Delivery.result_id)
                .join(Job, Job.id == Delivery.job_id)
                .join(Series, Series.id == Job.series_id)
                .where(Delivery.status == DeliveryStatus.PENDING, Delivery.next_attempt_at <= now)
                .where(Job.state == JobState.ENCODED)
                # Not while newer instances of the series wait for their job: that job will
                # supersede this one (a series that grows after encoding is not sent).
                .where(Series.pending_since.is_(None))
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
                    sop_class_uid=r.sop_class_uid,
                )
                for d, r in rows
            ]

    def delivery_sending(self, delivery_id: int) -> None:
        """Record that the outbox starts an attempt of this delivery (the send stage).

        One plain statement on the hot-path connection, without a WAL fsync: losing the
        stamp to a power cut loses only a figure, and the attempt's outcome (the next
        ``FULL`` commit) makes it durable.
        """
        stamp = self._stamp(utcnow())
        with self._write_lock, self._hot_lock:
            self._hot_connection().execute(_DELIVERY_SENDING, (stamp, delivery_id))

    def delivery_done(self, delivery_id: int, status: int | str) -> None:
        """Record a successful delivery and finish the job when all are sent.

        ``status`` is the C-STORE status (0x0000) or a text such as ``"HTTP 200"`` (STOW-RS).
        """
        now = utcnow()
        with self._tx() as s:
            d = s.get(Delivery, delivery_id)
            if d is None or d.status == DeliveryStatus.SENT:
                return
            move_delivery(s, d, DeliveryStatus.SENT, now, "acknowledged")
            d.attempts += 1
            d.last_status = status[:16] if isinstance(status, str) else f"0x{status:04X}"
            d.last_error = None
            d.sent_at = now
            s.flush()
            left = s.scalar(
                select(func.count(Delivery.id)).where(
                    Delivery.job_id == d.job_id, Delivery.status != DeliveryStatus.SENT
                )
            )
            if not left:
                job = s.get(Job, d.job_id)
                if job is not None and job.state == JobState.ENCODED:
                    move(s, job, JobState.SENT, now, message="all delivered")
                    job.finished_at = now

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
            if d is None or d.status != DeliveryStatus.PENDING:
                return  # already settled (sent, given up or cancelled): that stands
            move_delivery(s, d, DeliveryStatus.FAILED, now, error)
            d.attempts += 1
            d.last_error = error[:1024]
            job = s.get(Job, d.job_id)
            if job is not None and job.state == JobState.ENCODED:
                job.reason = f"delivery to {d.destination} failed: {error}"[:2048]
                move(s, job, JobState.FAILED, now, message=job.reason)
                job.finished_at = now

    def next_delivery_time(self) -> datetime | None:
        """When the earliest pending delivery is due."""
        with self._read() as s:
            return s.scalar(
                select(func.min(Delivery.next_attempt_at))
                .join(Job, Job.id == Delivery.job_id)
                .where(Delivery.status == DeliveryStatus.PENDING, Job.state == JobState.ENCODED)
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
            for job in s.scalars(select(Job).where(Job.state == JobState.RUNNING)).all():
                if job.attempts >= max_attempts:
                    job.reason = f"interrupted {job.attempts} times while processing; giving up"
                    move(s, job, JobState.FAILED, now, kind="recovered", message="now failed")
                    job.finished_at = now
                else:
                    move(s, job, JobState.QUEUED, now, kind="recovered", message="now queued")
                    n += 1
        return n

    def retry_job(self, job_id: int) -> bool:
        """Requeue a failed or cancelled job (same result UIDs)."""
        with self._tx() as s:
            job = s.get(Job, job_id)
            if job is None or job.state not in (JobState.FAILED, JobState.CANCELLED):
                return False
            undelivered = s.scalar(
                select(func.count(Delivery.id)).where(
                    Delivery.job_id == job_id, Delivery.status == DeliveryStatus.FAILED
                )
            )
            if job.encoded_at is not None and undelivered:
                now = utcnow()
                failed = s.scalars(
                    select(Delivery).where(
                        Delivery.job_id == job_id, Delivery.status == DeliveryStatus.FAILED
                    )
                )
                for d in failed.all():
                    move_delivery(s, d, DeliveryStatus.PENDING, now, "retried")
                    d.next_attempt_at = d.created_at = now
                    d.attempts = 0
                move(s, job, JobState.ENCODED, utcnow(), kind="job-retried", message="send again")
            else:
                move(s, job, JobState.QUEUED, utcnow(), kind="job-retried", message="run again")
            job.reason = None
            job.finished_at = None
            return True

    def cancel_job(self, job_id: int) -> bool:
        """Cancel a job that has not finished."""
        with self._tx() as s:
            job = s.get(Job, job_id)
            if job is None or job.state not in ACTIVE_STATES:
                return False
            now = utcnow()
            move(s, job, JobState.CANCELLED, now, message=f"cancelled while {job.state}")
            job.finished_at = now
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
            return {
                "jobs": states,
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

    def event(self, kind: str, message: str, *, job_id: int | None = None) -> None:
        """Append an event."""
        with self._tx() as s:
            s.add(Event(at=utcnow(), kind=kind, job_id=job_id, message=message[:2048]))

    # -- hardening: resource limits, outbox guarantees, retention ----------------------------

    def series_totals(self, series_instance_uid: str) -> tuple[int, int]:
        """``(instances, bytes)`` stored for a series (0, 0 if unknown)."""
        with self._read() as s:
            n, size = s.execute(
                select(func.count(Instance.id), func.coalesce(func.sum(Instance.size), 0))
                .join(Series, Series.id == Instance.series_id)
                .where(Series.series_instance_uid == series_instance_uid)
            ).one()
            return int(n), int(size)

    def defer_destination(
        self, destination: str, until: datetime, error: str, *, record: bool = True
    ) -> int:
        """Push every pending delivery to ``destination`` to ``until`` without using attempts.

        Used when the destination cannot be reached at all (connection refused, association
        rejected, circuit breaker open): that says nothing about the objects, so their attempt
        counts stay; ``dispatch.max_age_s`` bounds how long they wait. ``record`` adds a
        ``destination-down`` event (one per failed connection). Returns how many rows.
        """
        with self._tx() as s:
            result: CursorResult[Any] = s.execute(  # type: ignore[assignment]
                update(Delivery)
                .where(
                    Delivery.destination == destination,
                    Delivery.status == DeliveryStatus.PENDING,
                    Delivery.next_attempt_at < until,
                )
                .values(next_attempt_at=until, last_error=error[:1024])
            )
            n = result.rowcount
            if record:
                msg = f"{destination}: {error}"[:2048]
                s.add(Event(at=utcnow(), kind="destination-down", message=msg))
            return int(n or 0)

    def expire_deliveries(self, created_before: datetime, reason: str) -> list[int]:
        """Fail pending deliveries older than ``created_before``; return the failed job ids."""
        now = utcnow()
        failed: list[int] = []
        with self._tx() as s:
            rows = s.scalars(
                select(Delivery)
                .join(Job, Job.id == Delivery.job_id)
                .where(
                    Delivery.status == DeliveryStatus.PENDING,
                    Delivery.created_at < created_before,
                    Job.state == JobState.ENCODED,
                )
            ).all()
            for d in rows:
                move_delivery(s, d, DeliveryStatus.FAILED, now, reason)
                d.last_error = reason[:1024]
                job = s.get(Job, d.job_id)
                if job is not None and job.state == JobState.ENCODED:
                    job.reason = f"delivery to {d.destination} failed: {reason}"[:2048]
                    move(s, job, JobState.FAILED, now, message=job.reason)
                    job.finished_at = now
                    failed.append(job.id)
        return failed

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

    def purge_candidates(self, finished_before: datetime, limit: int = 50) -> list[PurgeCandidate]:
        """Series whose latest job finished (``sent``, or ``done``) before ``finished_before``,
        with nothing pending, not purged since.
        """
        with self._read() as s:
            latest = (
                select(Job.series_id, func.max(Job.id).label("jid"))
                .group_by(Job.series_id)
                .subquery()
            )
            sibling = aliased(Job)  # another model's job of the series, still working
            busy = (
                select(sibling.id)
                .where(sibling.series_id == Series.id, sibling.state.in_(ACTIVE_STATES))
                .exists()
            )
            rows = s.execute(
                select(Series.id, Series.series_instance_uid)
                .join(latest, latest.c.series_id == Series.id)
                .join(Job, Job.id == latest.c.jid)
                .outerjoin(SpoolPurge, SpoolPurge.series_id == Series.id)
                .where(
                    Series.pending_since.is_(None),
                    Job.state.in_((JobState.SENT, JobState.DONE)),
                    ~busy,
                    Job.finished_at < finished_before,
                    or_(SpoolPurge.id.is_(None), SpoolPurge.purged_at < Job.finished_at),
                )
                .order_by(Series.id)
                .limit(limit)
            ).all()
            out = []
            for sid, uid in rows:
                paths = s.scalars(select(Instance.path).where(Instance.series_id == sid)).all()
                sent = s.scalars(
                    select(Job.id).where(Job.series_id == sid, Job.state == JobState.SENT)
                ).all()
                out.append(PurgeCandidate(sid, uid, tuple(paths), tuple(sent)))
            return out

    def record_purge(self, series_id: int, files: int, size: int) -> None:
        """Record that a series' spool files (and sent results) were deleted."""
        now = utcnow()
        with self._tx() as s:
            row = s.scalar(select(SpoolPurge).where(SpoolPurge.series_id == series_id))
            if row is None:
                s.add(SpoolPurge(series_id=series_id, purged_at=now, files=files, size_bytes=size))
            else:
                row.purged_at = now
                row.files += files
                row.size_bytes += size
            s.add(
                Event(
                    at=now,
                    kind="retention",
                    series_id=series_id,
                    message=f"deleted {files} file(s), {size} bytes",
                )
            )


@dataclass(frozen=True)
class PurgeCandidate:
    """A delivered series whose files retention may delete."""

    series_id: int
    series_instance_uid: str
    instance_paths: tuple[str, ...]
    sent_job_ids: tuple[int, ...]


# The SCP's per-instance statements (see Ledger.record_instance / has_instance).
_HAS_INSTANCE = "SELECT 1 FROM instances WHERE sop_instance_uid = ?"
_SERIES_ID = "SELECT id FROM series WHERE series_instance_uid = ?"
_INSTANCE_SERIES = "SELECT id, series_id FROM instances WHERE sop_instance_uid = ?"
_DELETE_INSTANCE = "DELETE FROM instances WHERE id = ?"
_DELIVERY_SENDING = "UPDATE deliveries SET sending_at = ? WHERE id = ?"
_SERIES_FORGOT = "UPDATE series SET instance_count = MAX(instance_count - 1, 0) WHERE id = ?"
_PENDING_INSTANCES = (
    "SELECT i.sop_instance_uid, i.path, i.size FROM instances i "
    "JOIN series s ON s.id = i.series_id WHERE s.pending_since IS NOT NULL"
)
_INSERT_INSTANCE = (
    "INSERT INTO instances (sop_instance_uid, sop_class_uid, series_id, transfer_syntax_uid, "
    "path, size, calling_ae, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_SERIES_RECEIVED = (
    "UPDATE series SET instance_count = instance_count + 1, last_received_at = ?, "
    "ignored_reason = NULL, pending_since = COALESCE(pending_since, ?) WHERE id = ?"
)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()
