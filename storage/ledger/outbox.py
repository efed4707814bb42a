"""The outbox: deliveries of results to their destinations.

Owns :class:`DueDelivery` and :class:`Outbox`: which deliveries are due, the start of an
attempt (one plain statement on the hot connection), its outcome (sent, retry later, given
up; the job becomes ``sent`` or ``failed``), deferring a destination that cannot be reached,
expiring deliveries past their age.

Must not touch: job creation, claiming or results (the jobs module's); a delivery's status
changes only through :func:`~segnode.storage.ledger.states.move_delivery`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

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


class Outbox(LedgerBase):
    """Deliveries and their attempts (a part of :class:`~segnode.storage.ledger.Ledger`)."""

    def due_deliveries(
        self, now: datetime | None = None, limit: int = 64, claim_s: float | None = None
    ) -> list[DueDelivery]:
        """Pending deliveries whose next attempt is due, oldest job first, SEG before SR.

        On a shared (PostgreSQL) ledger they are claimed: owned by this node, and not due
        for any other node (still due for this one) for ``claim_s`` seconds (default: the
        lease), which each attempt renews (:meth:`delivery_sending`). A node that dies while
        sending leaves them to the others once its heartbeat is older than the lease. Nodes
        claiming at once each get other rows (``SKIP LOCKED``). SQLite has one node: nothing
        to claim.
        """
        now = now or utcnow()
        query = (
            select(*_DUE_COLUMNS)
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
        out) or it is no longer pending.

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
                hot.execute(self._sql(_DELIVERY_SENDING), (stamp, delivery_id))
                return True
            until = now + (self.lease if claim_s is None else timedelta(seconds=claim_s))
            cur = hot.execute(
                self._sql(_DELIVERY_SENDING_CLAIMED),
                (stamp, until, delivery_id, self.node_name),
            )
            return bool(cur.rowcount)

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
            d.lease_until = None
            d.attempts += 1
            d.last_status = status[:16] if isinstance(status, str) else f"0x{status:04X}"
            d.last_error = None
            d.sent_at = now
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
        """Give up on a delivery; the job fails with the reason."""
        now = utcnow()
        with self._tx() as s:
            d = s.get(Delivery, delivery_id)
            if d is None or d.status != DeliveryStatus.PENDING:
                return  # already settled (sent, given up or cancelled): that stands
            d.attempts += 1
            _give_up(s, d, error, now)

    def next_delivery_time(self) -> datetime | None:
        """When the earliest pending delivery is due (and no other node's claim holds it)."""
        due = case(
            (Delivery.lease_until > Delivery.next_attempt_at, Delivery.lease_until),
            else_=Delivery.next_attempt_at,
        )
        with self._read() as s:
            return s.scalar(  # type: ignore[no-any-return]
                select(func.min(due))
                .join(Job, Job.id == Delivery.job_id)
                .where(Delivery.status == DeliveryStatus.PENDING, Job.state == JobState.ENCODED)
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
                job = _give_up(s, d, reason, now)
                if job is not None:
                    failed.append(job.id)
        return failed


def _give_up(s: Session, d: Delivery, reason: str, now: datetime) -> Job | None:
    """Fail delivery ``d`` for ``reason``, and with it its job when that job is waiting on
    its deliveries (``encoded``); return the job when it failed."""
    move_delivery(s, d, DeliveryStatus.FAILED, now, reason)
    d.last_error = reason[:1024]
    d.lease_until = None
    job = s.get(Job, d.job_id, with_for_update=True)
    if job is None or job.state != JobState.ENCODED:
        return None
    job.reason = f"delivery to {d.destination} failed: {reason}"[:2048]
    move(s, job, JobState.FAILED, now, message=job.reason)
    job.finished_at = now
    return job


_DELIVERY_SENDING = "UPDATE deliveries SET sending_at = ? WHERE id = ?"
_DELIVERY_SENDING_CLAIMED = (
    "UPDATE deliveries SET sending_at = ?, lease_until = ? "
    "WHERE id = ? AND status = 'pending' AND owner = ?"
)
