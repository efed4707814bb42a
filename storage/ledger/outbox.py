"""The outbox: deliveries of results to their destinations.

Owns :class:`DueDelivery` and :class:`Outbox`: which deliveries are due, the start of an
attempt (one plain statement on the hot connection), its outcome (sent, retry later, given
up; the job becomes ``sent`` or ``failed``, and a failed job's unsent deliveries are
cancelled), deferring a destination that cannot be reached, expiring deliveries past their
age; and :func:`cancel_unsent`, which ends the unsent deliveries of jobs that ended.

Order per destination: a job's results go to each destination in their order (SEG, then SR,
then any rejection note). A delivery is not due while an earlier one of its job to the same
destination is unacknowledged and not due itself (:func:`_earlier_unsent`); one that is due
behind such an earlier one carries their number (:attr:`DueDelivery.waits_on`), and the
outbox sends it only once those were accepted in the same pass.

Must not touch: job creation, claiming or results (the jobs module's); a delivery's status
changes only through :func:`~segnode.storage.ledger.states.move_delivery`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, case, func, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session, aliased

from segnode.storage.ledger.connection import LedgerBase, utcnow
from segnode.storage.ledger.states import DeliveryStatus, JobState, move, move_delivery
from segnode.storage.models import Delivery, Event, Job, Result, Series


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
    #: Earlier results of the job to this destination not acknowledged when it was selected
    #: (they are due too, before it): send it only once all of them were accepted.
    waits_on: int = 0


#: What :meth:`Outbox.due_deliveries` selects: the fields of :class:`DueDelivery`, by name.
_DUE_COLUMNS = (
    Delivery.id,
    Delivery.job_id,
    Delivery.destination,
    Result.path,
    Result.kind,
    Result.sop_instance_uid,
    Delivery.attempts,
    Result.sop_class_uid,
)


def _earlier_unsent(now: datetime | None = None) -> Select[int]:
    """How many earlier results of a delivery's job (in a query joining its :class:`Result`)
    to the same destination are unacknowledged; with ``now``, only those not due at ``now``
    (pending until later, given up or cancelled), which hold the delivery back.

    README "What comes back": SEG first, then SR; the SR must not reach a destination that
    has not accepted the SEG it references (nor a rejection note one that has not accepted
    the replacements it follows).
    """
    earlier, earlier_result = aliased(Delivery), aliased(Result)
    query = (
        select(func.count(earlier.id))
        .join(earlier_result, earlier_result.id == earlier.result_id)
        .where(
            earlier.job_id == Delivery.job_id,
            earlier.destination == Delivery.destination,
            earlier.status != DeliveryStatus.SENT,
            earlier_result.order < Result.order,
        )
    )
    if now is not None:
        due = (earlier.status == DeliveryStatus.PENDING) & (earlier.next_attempt_at <= now)
        query = query.where(~due)
    return query


class Outbox(LedgerBase):
    """Deliveries and their attempts (a part of :class:`~segnode.storage.ledger.Ledger`)."""

    def due_deliveries(
        self, now: datetime | None = None, limit: int = 64, claim_s: float | None = None
    ) -> list[DueDelivery]:
        """Pending deliveries whose next attempt is due, oldest job first, SEG before SR.

        One whose job's earlier result to the same destination is unacknowledged is due only
        when that one is due too (it comes first), and says so (:attr:`DueDelivery.waits_on`).

        On a shared (PostgreSQL) ledger they are claimed: owned by this node, and not due
        for any other node (still due for this one) for ``claim_s`` seconds (default: the
        lease), which each attempt renews (:meth:`delivery_sending`). A node that dies while
        sending leaves them to the others once its heartbeat is older than the lease. Nodes
        claiming at once each get other rows (``SKIP LOCKED``). SQLite has one node: nothing
        to claim.
        """
        now = now or utcnow()
        query = (
            select(*_DUE_COLUMNS, _earlier_unsent().scalar_subquery().label("waits_on"))
            .join(Result, Result.id == Delivery.result_id)
            .join(Job, Job.id == Delivery.job_id)
            .join(Series, Series.id == Job.series_id)
            .where(Delivery.status == DeliveryStatus.PENDING, Delivery.next_attempt_at <= now)
            .where(Job.state == JobState.ENCODED)
            # Not while newer instances of the series wait for their job: that job will
            # supersede this one (a series that grows after encoding is not sent).
            .where(Series.pending_since.is_(None))
            .where(_earlier_unsent(now).scalar_subquery() == 0)
            .order_by(Job.priority.desc(), Delivery.job_id, Result.order)
            .limit(limit)
        )
        if self.dialect == "sqlite":
            with self._read() as s:
                return [DueDelivery(**row._mapping) for row in s.execute(query)]
        until = now + (self.lease if claim_s is None else timedelta(seconds=claim_s))
        with self._tx() as s:
            # Its own claims stay due for this node (its one outbox thread settles each);
            # a node whose heartbeat stopped holds none.
            live = self._live_nodes()
            free = (
                Delivery.lease_until.is_(None)
                | (Delivery.lease_until <= now)
                | (Delivery.owner == self.node_name)
                | Delivery.owner.not_in(live)
            )
            rows = s.execute(query.where(free).with_for_update(of=Delivery, skip_locked=True)).all()
            if rows:
                s.execute(
                    update(Delivery)
                    .where(Delivery.id.in_([row.id for row in rows]))
                    .values(owner=self.node_name, lease_until=until)
                )
            return [DueDelivery(**row._mapping) for row in rows]

    def release_deliveries(self) -> int:
        """At start-up: end this node's claims (what it was sending when it stopped is due
        again at once, not after the claim runs out); return how many."""
        if self.dialect == "sqlite" or self.node_name is None:
            return 0
        with self._tx() as s:
            result: CursorResult[Any] = s.execute(  # type: ignore[assignment]
                update(Delivery)
                .where(Delivery.owner == self.node_name, Delivery.lease_until.is_not(None))
                .values(lease_until=None)
            )
            return int(result.rowcount or 0)

    def delivery_sending(self, delivery_id: int, claim_s: float | None = None) -> bool:
        """Record that the outbox starts an attempt of this delivery (the send stage); return
        False when it must not be sent: another node has taken it over (this node's claim ran
        out) or it is no longer pending (settled since it was selected: its job was cancelled,
        or failed through another delivery).

        One plain statement on the hot-path connection. SQLite: without a WAL fsync (losing
        the stamp to a power cut loses only a figure, and the attempt's outcome, the next
        ``FULL`` commit, makes it durable). PostgreSQL: it also renews this node's claim for
        ``claim_s`` seconds (default: the lease), only while the claim is still this node's.
        """
        now = utcnow()
        stamp = self._stamp(now)
        with self._write_lock, self._hot_lock:
            hot = self._hot_connection()
            if self.dialect == "sqlite":
                cur = hot.execute(self._sql(_DELIVERY_SENDING), (stamp, delivery_id))
                return bool(cur.rowcount)
            until = now + (self.lease if claim_s is None else timedelta(seconds=claim_s))
            cur = hot.execute(
                self._sql(_DELIVERY_SENDING_CLAIMED),
                (stamp, until, delivery_id, self.node_name),
            )
            return bool(cur.rowcount)

    def delivery_done(
        self, delivery_id: int, status: int | str, warning: str | None = None
    ) -> None:
        """Record a successful delivery and finish the job when all are sent.

        ``status`` is the C-STORE status (0x0000) or a text such as ``"HTTP 200"`` (STOW-RS);
        ``warning``, the destination's warning when it stored the object with one (its status
        and comment), is kept as a ``delivery-warning`` event of the job.
        """
        now = utcnow()
        with self._tx() as s:
            d = s.get(Delivery, delivery_id)
            if d is None or d.status == DeliveryStatus.SENT:
                return
            move_delivery(s, d, DeliveryStatus.SENT, now, "acknowledged")
            d.lease_until = None
            d.attempts += 1
            d.last_status = status[:16] if isinstance(status, str) else f"0x{status:04X}"
            # A warning stays readable where the delivery is listed (segnode jobs, the
            # console), and in the job's events.
            d.last_error = f"stored with {warning}"[:1024] if warning else None
            d.sent_at = now
            if warning:
                s.add(
                    Event(
                        at=now,
                        kind="delivery-warning",
                        job_id=d.job_id,
                        message=f"{d.destination}: stored with {warning}"[:2048],
                    )
                )
            s.flush()
            # The job's row first: two nodes acknowledging its last two deliveries at once
            # take turns here, and the second counts the first's as sent.
            job = s.get(Job, d.job_id, with_for_update=True)
            left = s.scalar(
                select(func.count(Delivery.id)).where(
                    Delivery.job_id == d.job_id, Delivery.status != DeliveryStatus.SENT
                )
            )
            if not left and job is not None and job.state == JobState.ENCODED:
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
            d.lease_until = None
            s.add(Event(at=utcnow(), kind="delivery-retry", job_id=d.job_id, message=error[:2048]))

    def delivery_failed(self, delivery_id: int, error: str) -> None:
        """Give up on a delivery; the job fails with the reason, and its other unsent
        deliveries are cancelled (:func:`cancel_unsent`)."""
        now = utcnow()
        with self._tx() as s:
            d = s.get(Delivery, delivery_id)
            if d is None or d.status != DeliveryStatus.PENDING:
                return  # already settled (sent, given up or cancelled): that stands
            d.attempts += 1
            _give_up(s, d, error, now)

    def next_delivery_time(self) -> datetime | None:
        """When the earliest pending delivery is due (and no other node's claim holds it;
        one waiting for an earlier result to its destination is not counted)."""
        due = case(
            (Delivery.lease_until > Delivery.next_attempt_at, Delivery.lease_until),
            else_=Delivery.next_attempt_at,
        )
        with self._read() as s:
            return s.scalar(  # type: ignore[no-any-return]
                select(func.min(due))
                .join(Result, Result.id == Delivery.result_id)
                .join(Job, Job.id == Delivery.job_id)
                .where(Delivery.status == DeliveryStatus.PENDING, Job.state == JobState.ENCODED)
                .where(_earlier_unsent(utcnow()).scalar_subquery() == 0)
            )

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
                .values(next_attempt_at=until, last_error=error[:1024], lease_until=None)
            )
            n = result.rowcount
            if record:
                msg = f"{destination}: {error}"[:2048]
                s.add(Event(at=utcnow(), kind="destination-down", message=msg))
            return int(n or 0)

    def expire_deliveries(self, created_before: datetime, reason: str) -> list[int]:
        """Fail pending deliveries older than ``created_before``, and their jobs (whose other
        unsent deliveries are cancelled); return the failed job ids."""
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
                .order_by(Delivery.id)
            ).all()
            # Every expired delivery fails for its own age first; only then do the jobs fail
            # and cancel what is left (younger deliveries).
            for d in rows:
                _fail(s, d, reason, now)
            for d in rows:
                job = _fail_job(s, d, reason, now)
                if job is not None:
                    failed.append(job.id)
        return failed


def cancel_unsent(s: Session, job_ids: Collection[int], why: str, now: datetime) -> int:
    """Cancel the pending deliveries of ``job_ids`` (their jobs ended: superseded, cancelled
    or failed), each recorded as a ``delivery-cancelled`` event with ``why``; return how many.

    A cancelled delivery is no longer due, nor counted pending; one whose send is in flight
    is still recorded ``sent`` if its acknowledgement arrives.
    """
    if not job_ids:
        return 0
    rows = s.scalars(
        select(Delivery)
        .where(Delivery.job_id.in_(job_ids), Delivery.status == DeliveryStatus.PENDING)
        .order_by(Delivery.id)
    ).all()
    for d in rows:
        move_delivery(s, d, DeliveryStatus.CANCELLED, now, why)
        d.last_error = why[:1024]
        d.lease_until = None
    return len(rows)


def _give_up(s: Session, d: Delivery, reason: str, now: datetime) -> Job | None:
    """Fail delivery ``d`` for ``reason``, and with it its job (:func:`_fail_job`)."""
    _fail(s, d, reason, now)
    return _fail_job(s, d, reason, now)


def _fail(s: Session, d: Delivery, reason: str, now: datetime) -> None:
    """Give up delivery ``d`` (pending) for ``reason``."""
    move_delivery(s, d, DeliveryStatus.FAILED, now, reason)
    d.last_error = reason[:1024]
    d.lease_until = None


def _fail_job(s: Session, d: Delivery, reason: str, now: datetime) -> Job | None:
    """Fail the job of the given-up delivery ``d`` when that job is waiting on its deliveries
    (``encoded``), and cancel its other unsent deliveries with the reason; return the job
    when it failed."""
    job = s.get(Job, d.job_id, with_for_update=True)
    if job is None or job.state != JobState.ENCODED:
        return None
    job.reason = f"delivery to {d.destination} failed: {reason}"[:2048]
    move(s, job, JobState.FAILED, now, message=job.reason)
    job.finished_at = now
    cancel_unsent(s, (job.id,), f"not sent: job {job.id} failed ({job.reason})", now)
    return job


_DELIVERY_SENDING = "UPDATE deliveries SET sending_at = ? WHERE id = ? AND status = 'pending'"
_DELIVERY_SENDING_CLAIMED = (
    "UPDATE deliveries SET sending_at = ?, lease_until = ? "
    "WHERE id = ? AND status = 'pending' AND owner = ?"
)
