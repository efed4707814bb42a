"""Jobs: from a series' pending instances to a finished job.

Owns :class:`NewJob` and :class:`JobStore`: creating job versions (superseding older ones),
taking a series without a job, claiming the next job, stage stamps, failing or finishing a
job, saving its results with their outbox rows, crash recovery, an operator's retry and
cancel, and appending events. Every state change goes through
:func:`~segnode.storage.ledger.states.move` / :func:`~segnode.storage.ledger.states.move_delivery`.

Must not touch: send attempts and their outcomes (the outbox module's; this one only creates
deliveries with the results, cancels the unsent ones of a superseded or cancelled job through
:func:`~segnode.storage.ledger.outbox.cancel_unsent`, and puts failed and cancelled ones back
to pending on a retry), nor the instances' hot path; it builds job snapshots through
:class:`~segnode.storage.ledger.views.Views`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from pydicom.uid import generate_uid
from sqlalchemy import case, func, or_, select, update
from sqlalchemy.orm import Session

from segnode.storage.ledger.connection import utcnow
from segnode.storage.ledger.nodes import NodeStore
from segnode.storage.ledger.outbox import cancel_unsent
from segnode.storage.ledger.states import (
    ACTIVE_STATES,
    UNSENT_FINAL,
    DeliveryStatus,
    JobState,
    move,
    move_delivery,
)
from segnode.storage.ledger.views import JobView, Views
from segnode.storage.models import Delivery, Event, Instance, Job, Result, Series

#: How the worker's reason begins when a job's spooled instance files are missing (a power
#: cut that took them, a disk replaced): :meth:`JobStore.resume_restored` runs such a job again
#: once the instances are stored again.
MISSING_FILES = "spooled instance file(s) are missing"


@dataclass(frozen=True)
class NewJob:
    """A job to create for a series version: a model, where its results go, its priority."""

    model_name: str
    model: str
    engine: str
    destinations: tuple[str, ...] = ()
    priority: int = 0
    rule: str = ""


class JobStore(Views, NodeStore):
    """Jobs and their lifecycle (a part of :class:`~segnode.storage.ledger.Ledger`).

    On a ledger several nodes share, a running job belongs to the node that claimed it
    (``owner``): only that node records its stages and results, and another node takes it
    over only once the owner's heartbeat is older than the lease (:meth:`take_over`). Rows
    that several nodes may change at once (the series when jobs are made, the job when it
    ends) are locked for the transaction (``SELECT ... FOR UPDATE``; a no-op on SQLite,
    whose writers are serialised anyway).
    """

    def _mine(self, job: Job) -> bool:
        """Whether this process may change ``job`` (it runs it, or claims nothing)."""
        return self.node_name is None or job.owner in (None, self.node_name)

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
            series = _pending_series(s, series_instance_uid)
            if series is None:
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
                cancel_unsent(s, undelivered, f"superseded by v{version}", now)
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
            self._notify(s)
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

    def ignore_series(self, series_instance_uid: str, reason: str) -> bool:
        """Take a series' pending instances without a job (routing selected no model).

        The series is listed by :meth:`ignored_series` with ``reason`` until new instances
        arrive. Returns False when nothing was pending.
        """
        now = utcnow()
        with self._tx() as s:
            series = _pending_series(s, series_instance_uid)
            if series is None:
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

    def claim_next_job(
        self, max_wait_s: float = 0.0, above_priority: int | None = None
    ) -> JobView | None:
        """Take the most urgent queued job (highest priority, then oldest) and mark it running,
        owned by this node (nodes claiming at once each get another job: ``SKIP LOCKED``).

        ``max_wait_s`` (``[engine] max_wait_s``; 0: never): a job queued longer than that goes
        first whatever its priority, the oldest of them first, so routine work is never starved
        by a stream of urgent series. ``above_priority``: only a job of a higher priority (a
        worker whose lanes have enough jobs ahead of its models still takes an urgent one).
        """
        now = utcnow()
        order = [Job.priority.desc(), Job.created_at, Job.id]
        if max_wait_s > 0:
            overdue = Job.created_at < now - timedelta(seconds=max_wait_s)
            order = [case((overdue, 0), else_=1), case((overdue, Job.created_at)), *order]
        with self._tx() as s:
            query = select(Job).where(Job.state == JobState.QUEUED)
            if above_priority is not None:
                query = query.where(Job.priority > above_priority)
            job = s.scalar(query.order_by(*order).limit(1).with_for_update(skip_locked=True))
            if job is None:
                return None
            on = f" on {self.node_name}" if self.node_name else ""
            move(s, job, JobState.RUNNING, now, message=f"attempt {job.attempts + 1}{on}")
            job.owner = self.node_name
            job.started_at = now
            job.attempts += 1
            s.flush()
            return self._view(s, job)

    def mark(self, job_id: int, stage: str) -> None:
        """Set a stage timestamp (``volume_at``, ``inference_at``)."""
        if stage not in ("volume_at", "inference_at"):
            raise ValueError(stage)
        mine = Job.owner.is_(None) | (Job.owner == self.node_name)
        with self._tx() as s:
            q = update(Job).where(Job.id == job_id)
            s.execute((q if self.node_name is None else q.where(mine)).values({stage: utcnow()}))

    def fail_job(self, job_id: int, reason: str) -> JobState | None:
        """End a running job as failed with a reason a human can act on.

        When its series received more instances while it ran, the job worked on part of the
        series (a slice gap, for one, may be only the instances still to come), so it ends
        as superseded instead, its failure kept in the reason: the next version, which the
        new instances complete, runs on the whole series.

        Returns
        -------
        JobState | None
            The state the job ended in; None when it was no longer this node's running job
            (superseded, cancelled or taken over while it ran: that state stands).
        """
        now = utcnow()
        with self._tx() as s:
            job = s.get(Job, job_id, with_for_update=True)
            if job is None or job.state != JobState.RUNNING or not self._mine(job):
                return None
            if _outgrown(s, job, now, f"it failed on what it had: {reason}"):
                return JobState.SUPERSEDED
            move(s, job, JobState.FAILED, now, message=reason)
            job.reason = reason[:2048]
            job.finished_at = now
            return JobState.FAILED

    def finish_empty(self, job_id: int, reason: str) -> None:
        """End a job as ``done`` with nothing to send (the model found no segment)."""
        now = utcnow()
        with self._tx() as s:
            job = s.get(Job, job_id, with_for_update=True)
            if job is None or job.state != JobState.RUNNING or not self._mine(job):
                return
            move(s, job, JobState.DONE, now, kind="job-empty", message=reason)
            job.reason = reason[:2048]
            job.encoded_at = now
            job.finished_at = now

    def superseded_sent(self, job_id: int) -> dict[str, list[tuple[str, Path]]]:
        """Results of older versions of the job's series that were delivered (SEG and SR, not
        rejection notes) and not yet withdrawn there: destination -> [(SOP Instance UID,
        file)]. A rejection note delivered by version k withdrew every earlier version's
        results at that destination, so only versions from k on are named again (each note
        named all the earlier ones before: 2, 4, 6, 8 ... objects)."""
        with self._read() as s:
            job = s.get(Job, job_id)
            if job is None:
                return {}
            older = (Job.series_id == job.series_id, Job.version < job.version)
            sent = Delivery.status == DeliveryStatus.SENT
            withdrawn = dict(
                s.execute(
                    select(Delivery.destination, func.max(Job.version))
                    .join(Result, Result.id == Delivery.result_id)
                    .join(Job, Job.id == Delivery.job_id)
                    .where(*older, sent, Result.kind == "KOS")
                    .group_by(Delivery.destination)
                ).all()
            )
            rows = s.execute(
                select(Delivery.destination, Job.version, Result.sop_instance_uid, Result.path)
                .join(Result, Result.id == Delivery.result_id)
                .join(Job, Job.id == Delivery.job_id)
                .where(*older, sent, Result.kind.in_(("SEG", "SR")))
                .order_by(Job.version, Result.order)
            ).all()
        out: dict[str, list[tuple[str, Path]]] = {}
        for dest, version, sop, path in rows:
            if version >= withdrawn.get(dest, 0):
                out.setdefault(dest, []).append((sop, Path(path)))
        return out

    def save_results(
        self,
        job_id: int,
        results: Sequence[tuple[str, str, str, str, Path]],
        destinations: Sequence[str],
        notes: Sequence[tuple[str, str, str, str, Path, Sequence[str]]] = (),
        memory: str = "",
    ) -> bool:
        """Record encoded result files and their outbox rows; the job becomes ``encoded``.

        Returns False, recording nothing to send, when the job is no longer running (a newer
        version superseded it), another node took it over (this node's heartbeat lapsed), or
        its series received more instances while it ran (it is then superseded: partial
        results never leave the node).

        Parameters
        ----------
        results
            ``(kind, sop_class_uid, sop_instance_uid, series_instance_uid, path)`` in send order.
        destinations
            Destination names (``AE@host:port``); one delivery row per result and destination.
        notes
            Objects for some destinations only, sent after ``results`` (rejection notes):
            ``(kind, sop_class_uid, sop_instance_uid, series_instance_uid, path, destinations)``.
        memory
            What the job took (its peak resident set), kept in the event of the move to
            ``encoded`` (``segnode jobs --events``).
        """
        now = utcnow()
        with self._tx() as s:
            job = s.get(Job, job_id, with_for_update=True)
            if job is None or job.state != JobState.RUNNING or not self._mine(job):
                return False
            if _outgrown(s, job, now, "not sent"):
                # Its results cover part of the series and must not leave; the next version
                # (the new instances complete it) will.
                job.encoded_at = now
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
            self._notify(s)
            done = f"{len(results)} objects" + (f"; {memory}" if memory else "")
            if destinations:
                move(s, job, JobState.ENCODED, now, message=done)
            else:
                move(s, job, JobState.DONE, now, kind="job-encoded", message=done)
                job.finished_at = now
            return True

    def recover(self, max_attempts: int) -> int:
        """At start-up: put jobs interrupted by a crash back in the queue; return how many.

        A job that was ``running`` goes back to ``queued`` (its result UIDs are kept), unless it
        has already been tried ``max_attempts`` times, then it fails with that reason. On a
        shared ledger only this node's own jobs and those of nodes whose lease expired are
        taken; others' running jobs are theirs.
        """
        return self._requeue(max_attempts, include_own=True)

    def take_over(self, max_attempts: int) -> int:
        """Requeue the running jobs of nodes whose heartbeat is older than the lease (they
        died, or lost the ledger); return how many. Each node runs it every few seconds."""
        return self._requeue(max_attempts, include_own=False)

    def _requeue(self, max_attempts: int, *, include_own: bool) -> int:
        now = utcnow()
        n = 0
        running = select(Job).where(Job.state == JobState.RUNNING)
        if self.node_name is not None:
            gone = self._gone_clause()
            running = running.where(gone | (Job.owner == self.node_name) if include_own else gone)
        elif not include_own:
            return 0
        with self._tx() as s:
            for job in s.scalars(running.with_for_update(skip_locked=True)).all():
                whose = "" if job.owner in (None, self.node_name) else f" from {job.owner}"
                if job.attempts >= max_attempts:
                    job.reason = f"interrupted {job.attempts} times while processing; giving up"
                    move(s, job, JobState.FAILED, now, kind="recovered", message="now failed")
                    job.finished_at = now
                else:
                    move(
                        s, job, JobState.QUEUED, now, kind="recovered", message=f"now queued{whose}"
                    )
                    n += 1
            if n:
                self._notify(s)
        return n

    def requeue_job(self, job_id: int, reason: str) -> bool:
        """Put this node's running job back in the queue (same result UIDs), for a reason
        that is not the job's (the ledger was unreachable while it ran); False when it is no
        longer running here."""
        with self._tx() as s:
            job = s.get(Job, job_id, with_for_update=True)
            if job is None or job.state != JobState.RUNNING or not self._mine(job):
                return False
            move(s, job, JobState.QUEUED, utcnow(), kind="recovered", message=reason)
            self._notify(s)
            return True

    def retry_job(self, job_id: int) -> bool:
        """Requeue a failed or cancelled job (same result UIDs).

        A job whose results were encoded and not all delivered goes back to the outbox
        (``encoded``): every delivery not yet sent (failed, or cancelled with the job) is
        pending again with a fresh start - attempts 0 (``dispatch.max_attempts`` anew), due
        now, its age (``dispatch.max_age_s``) counted from the retry; sent ones stay sent and
        are not sent again. The attempts before the retry stay in the job's events. Any other
        job goes back to the worker (``queued``).
        """
        with self._tx() as s:
            job = s.get(Job, job_id, with_for_update=True)
            if job is None or job.state not in (JobState.FAILED, JobState.CANCELLED):
                return False
            now = utcnow()
            unsent = s.scalars(
                select(Delivery)
                .where(Delivery.job_id == job_id, Delivery.status.in_(UNSENT_FINAL))
                .order_by(Delivery.id)
            ).all()
            if job.encoded_at is not None and not unsent and self._all_sent(s, job_id):
                # Cancelled while its last sends were in flight, which then succeeded: nothing
                # to run or send again; it ends as sent (running it again would leave it
                # encoded with nothing left to send).
                move(s, job, JobState.ENCODED, now, kind="job-retried", message="send again")
                move(s, job, JobState.SENT, now, message="all delivered before the retry")
                job.reason = None
                job.finished_at = now
                return True
            if job.encoded_at is not None and unsent:
                for d in unsent:
                    move_delivery(s, d, DeliveryStatus.PENDING, now, "retried")
                    d.next_attempt_at = d.created_at = now
                    d.attempts = 0
                    d.lease_until = None
                move(s, job, JobState.ENCODED, now, kind="job-retried", message="send again")
                self._notify(s)
            else:
                move(s, job, JobState.QUEUED, now, kind="job-retried", message="run again")
            job.reason = None
            job.finished_at = None
            return True

    def resume_restored(self, series_instance_uid: str) -> list[int]:
        """Requeue (same result UIDs) the series' jobs that failed because spooled files were
        missing (:data:`MISSING_FILES`) once every instance of the series has its whole file
        again (a sender's resend stored them anew). Returns the ids requeued.

        Only the latest version's jobs: an older version was replaced anyway.
        """
        with self._tx() as s:
            series = s.scalars(
                select(Series).where(Series.series_instance_uid == series_instance_uid)
            ).first()
            if series is None:
                return []
            latest = s.scalar(select(func.max(Job.version)).where(Job.series_id == series.id))
            jobs = s.scalars(
                select(Job).where(
                    Job.series_id == series.id,
                    Job.version == latest,
                    Job.state == JobState.FAILED,
                    Job.reason.contains(MISSING_FILES),
                )
            ).all()
            if not jobs:
                return []
            rows = s.execute(
                select(Instance.path, Instance.size).where(Instance.series_id == series.id)
            ).all()
            if not all(_whole(Path(path), size) for path, size in rows):
                return []
            now = utcnow()
            for job in jobs:
                move(
                    s,
                    job,
                    JobState.QUEUED,
                    now,
                    kind="job-resumed",
                    message=f"run again: all {len(rows)} instance files are stored again",
                )
                job.reason = None
                job.finished_at = None
            self._notify(s)
            return [job.id for job in jobs]

    @staticmethod
    def _all_sent(s: Session, job_id: int) -> bool:
        """Whether the job has deliveries and every one of them was sent."""
        statuses = set(s.scalars(select(Delivery.status).where(Delivery.job_id == job_id)))
        return statuses == {DeliveryStatus.SENT}

    def cancel_job(self, job_id: int) -> bool:
        """Cancel a job that has not finished; its deliveries not yet sent are cancelled
        with it (no longer due nor pending; :meth:`retry_job` makes them pending again)."""
        with self._tx() as s:
            job = s.get(Job, job_id, with_for_update=True)
            if job is None or job.state not in ACTIVE_STATES:
                return False
            now = utcnow()
            move(s, job, JobState.CANCELLED, now, message=f"cancelled while {job.state}")
            job.finished_at = now
            cancel_unsent(s, (job.id,), f"not sent: job {job.id} cancelled", now)
            return True

    def event(self, kind: str, message: str, *, job_id: int | None = None) -> None:
        """Append an event."""
        with self._tx() as s:
            s.add(Event(at=utcnow(), kind=kind, job_id=job_id, message=message[:2048]))


def _pending_series(s: Session, series_instance_uid: str) -> Series | None:
    """The series, locked for the transaction, when it has instances no job has taken (two
    nodes completing it at once take turns; the second finds nothing pending)."""
    series = s.scalar(
        select(Series).where(Series.series_instance_uid == series_instance_uid).with_for_update()
    )
    return None if series is None or series.pending_since is None else series


def _outgrown(s: Session, job: Job, now: datetime, outcome: str) -> bool:
    """Supersede the running ``job`` when its series received more instances while it ran
    (its input was part of the series); ``outcome`` ends the reason. Returns whether it did."""
    series = s.get(Series, job.series_id)
    if series is None or series.pending_since is None:
        return False
    reason = (
        f"the series received more instances while this job ran "
        f"({job.instance_count} -> {series.instance_count}); {outcome}"
    )
    move(s, job, JobState.SUPERSEDED, now, message=reason)
    job.reason = reason[:2048]
    job.finished_at = now
    return True


def _whole(path: Path, size: int) -> bool:
    """Whether ``path`` holds ``size`` bytes."""
    try:
        return path.stat().st_size == size
    except OSError:
        return False
