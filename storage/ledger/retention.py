"""Retention: which delivered series' spool files may be deleted, and the record of it.

Owns :class:`PurgeCandidate` and :class:`Retention`: series whose latest job finished before
a time with nothing pending or still working, and the ``spool_purges`` row and ``retention``
event of a deletion (``segnode.node.ops.retention`` deletes the files).

Must not touch: any row but its own (it reads jobs and instances, and writes only
``spool_purges`` rows and ``retention`` events); it deletes no file itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, or_, select
from sqlalchemy.orm import aliased

from segnode.storage.ledger.connection import LedgerBase, utcnow
from segnode.storage.ledger.states import ACTIVE_STATES, JobState
from segnode.storage.models import Event, Instance, Job, Series, SpoolPurge

#: A job in these states may be retried (``segnode retry``); one not yet encoded runs again
#: on the series' spool files.
_RETRYABLE = (JobState.FAILED, JobState.CANCELLED)


class Retention(LedgerBase):
    """Retention's questions and records (a part of :class:`~segnode.storage.ledger.Ledger`)."""

    def purge_candidates(self, finished_before: datetime, limit: int = 50) -> list[PurgeCandidate]:
        """Series whose latest job finished (``sent``, or ``done``) before ``finished_before``,
        with nothing pending, not purged since.

        A series with a job still working, or one that failed or was cancelled before its
        results were encoded (an operator's retry runs it again on these files), is kept,
        whichever model's job it is: only a retry that succeeds, or a newer version of the
        series, lets it go.
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
                .where(
                    sibling.series_id == Series.id,
                    or_(
                        sibling.state.in_(ACTIVE_STATES),
                        sibling.state.in_(_RETRYABLE) & sibling.encoded_at.is_(None),
                    ),
                )
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
