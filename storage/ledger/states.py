"""Job and delivery states, and the only moves between them.

Owns :class:`JobState`, :class:`DeliveryStatus`, their transition tables
(:data:`TRANSITIONS`, :data:`DELIVERY_MOVES`), :data:`ACTIVE_STATES` /
:data:`FINAL_STATES`, :class:`TransitionError` and the two functions every state change goes
through, :func:`move` and :func:`move_delivery` (each checks the move and records its event in
the caller's session).

Must not touch: connections, sessions or transactions (the caller's session is the
transaction), nor any query; it only changes the row it is given and adds its event.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from typing import TypeVar

from sqlalchemy.orm import Session

from segnode.storage.models import Delivery, Event, Job


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
    """Where one result's delivery to one destination is.

    ``failed``: this object was given up (its attempts or its age ran out, or it cannot be
    sent). ``cancelled``: it was not sent because of its job - a newer version superseded
    the job, an operator cancelled it, or another of its deliveries failed and the job
    failed with it; its ``last_error`` and event say which.
    """

    PENDING = "pending"
    SENT = "sent"
    FAILED = "failed"
    CANCELLED = "cancelled"


#: The moves a delivery may make (:func:`move_delivery`). A delivery given up (failed) or
#: cancelled may still turn out sent: its acknowledgement arrived after it was given up, and
#: the ledger records what happened. An operator's retry of a failed or cancelled job puts
#: its failed and cancelled deliveries back to pending (a superseded job is never retried).
DELIVERY_MOVES: dict[DeliveryStatus, frozenset[DeliveryStatus]] = {
    DeliveryStatus.PENDING: frozenset(
        {DeliveryStatus.SENT, DeliveryStatus.FAILED, DeliveryStatus.CANCELLED}
    ),
    DeliveryStatus.FAILED: frozenset({DeliveryStatus.PENDING, DeliveryStatus.SENT}),
    DeliveryStatus.CANCELLED: frozenset({DeliveryStatus.PENDING, DeliveryStatus.SENT}),
    DeliveryStatus.SENT: frozenset(),
}

#: Deliveries that will not be attempted again unless an operator retries their job.
UNSENT_FINAL = (DeliveryStatus.FAILED, DeliveryStatus.CANCELLED)


class TransitionError(RuntimeError):
    """A job was asked to make a move :data:`TRANSITIONS` does not allow (a bug)."""


_S = TypeVar("_S", JobState, DeliveryStatus)


def _transition(
    s: Session,
    now: datetime,
    what: str,
    moves: Mapping[_S, frozenset[_S]],
    current: _S,
    to: _S,
    *,
    job_id: int | None,
    kind: str,
    message: str | None,
    prefix: str = "",
) -> None:
    """Check ``current -> to`` against ``moves`` for ``what`` (a job or a delivery) and add
    its event to ``s``: ``prefix`` then ``message``, or the move itself without one.

    Raises
    ------
    TransitionError
        ``moves`` does not allow it.
    """
    if to not in moves[current]:
        raise TransitionError(f"{what}: {current} -> {to} is not an allowed move")
    text = prefix + (message if message is not None else f"{current} -> {to}")
    s.add(Event(at=now, kind=kind, job_id=job_id, message=text[:2048]))


def move_delivery(
    s: Session, d: Delivery, to: DeliveryStatus, now: datetime, message: str = ""
) -> None:
    """Move delivery ``d`` to ``to``, checked against :data:`DELIVERY_MOVES` (else
    :class:`TransitionError`), and record the event ``delivery-<status>``, which names the
    destination."""
    current = DeliveryStatus(d.status)
    _transition(
        s,
        now,
        f"delivery {d.id}",
        DELIVERY_MOVES,
        current,
        to,
        job_id=d.job_id,
        kind=f"delivery-{to}",
        message=message or None,
        prefix=f"{d.destination}: ",
    )
    d.status = to.value


def move(
    s: Session,
    job: Job,
    to: JobState,
    now: datetime,
    *,
    kind: str | None = None,
    message: str | None = None,
) -> None:
    """Move ``job`` to ``to`` in session ``s``, checked against :data:`TRANSITIONS` (else
    :class:`TransitionError`), and record the event (``kind``, default ``job-<state>``, with
    ``message``)."""
    current = JobState(job.state)
    _transition(
        s,
        now,
        f"job {job.id}",
        TRANSITIONS,
        current,
        to,
        job_id=job.id,
        kind=kind or f"job-{to}",
        message=message,
    )
    job.state = to.value
