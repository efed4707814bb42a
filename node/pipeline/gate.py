"""The engine gate: a few jobs at a time on the models, the most urgent waiting job next.

The worker runs several jobs at once (``[engine] lanes``): while one job's model runs, the
next jobs' volumes are assembled and their results prepared, and the last ones' results
encoded, written and handed to the outbox. The models themselves run ``slots`` jobs at a time
(``[engine] model_slots``): one on a CPU engine, which uses every core; on a GPU two, each on
a CUDA stream of its own, so that one job's kernels fill the gaps the other's Python and
copies leave. A lane about to run its model waits here, and when a slot is free the waiting
job of the highest priority enters, the oldest (lowest job id) of equal priority first. A job
enters beside another only while ``room()`` says the device has the memory for it (the
free memory of the GPU against the peak of a job of that model, measured when one ran alone);
alone it always enters. No job enters beside a more urgent one (unless it waited
``max_wait_s``): an urgent job shares the device at most with the job it found there. A job
that waited ``max_wait_s`` enters before any that has not: the
rule that keeps routine jobs from being starved by urgent ones is the ledger's
(:meth:`Ledger.claim_next_job`), applied here too.

The gate also keeps the figures the console, ``segnode status`` and Prometheus show: the
share of the last minute the models were busy, the jobs waiting for it by priority, and the
expected wait of a new job (the mean model time of recent jobs, times the jobs ahead of it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

WINDOW_S = 60.0
"""Seconds over which :meth:`EngineGate.busy_fraction` is measured."""

RECENT_JOBS = 20
"""Model times (of the last jobs) the expected wait is estimated from."""


ROOM_RECHECK_S = 0.25
"""While the job next in line waits for room beside the jobs holding the models, how often
it asks again (their memory changes while they run)."""


@dataclass(order=True)
class _Ticket:
    rank: tuple[int, int, float, int]
    job_id: int = field(compare=False)
    priority: int = field(compare=False)


@dataclass
class Hold:
    """A job's hold of the models: the seconds it waited, and whether another job held them
    at any time beside it (its measurements are then not those of a job alone)."""

    waited: float = 0.0
    shared: bool = False
    since: float = 0.0


class EngineGate:
    """``slots`` holders at a time; waiting holders enter by priority (see the module)."""

    def __init__(self, max_wait_s: float = 0.0, slots: int = 1) -> None:
        self.max_wait_s = max_wait_s
        self.slots = max(1, slots)
        self._cond = threading.Condition()
        self._waiting: list[_Ticket] = []
        self._holders: dict[int, tuple[_Ticket, Hold]] = {}
        #: Start of the present busy period (some job holding the models), else None.
        self._busy_since: float | None = None
        #: (start, end) of the busy periods that ended in the last :data:`WINDOW_S`.
        self._spans: deque[tuple[float, float]] = deque()
        self._recent: deque[float] = deque(maxlen=RECENT_JOBS)
        #: Most jobs that held the models at once.
        self.most_at_once = 0

    def _may_enter(self, ticket: _Ticket, room: Callable[[], bool] | None) -> bool:
        if min(self._waiting) is not ticket:
            return False
        if not self._holders:
            return True
        if len(self._holders) >= self.slots:
            return False
        overdue = ticket.rank[0] == 0
        if not overdue and any(t.priority > ticket.priority for t, _ in self._holders.values()):
            return False  # a more urgent job runs its model without a newcomer beside it
        try:
            return room is not None and bool(room())
        except Exception:  # a failing probe keeps the job waiting for the models alone
            return False

    @contextmanager
    def hold(
        self,
        job_id: int,
        priority: int = 0,
        queued_s: float = 0.0,
        room: Callable[[], bool] | None = None,
    ) -> Iterator[Hold]:
        """Wait for a slot of the models, then hold it.

        ``queued_s``: how long the job had been queued when it started (a job past
        ``max_wait_s`` enters first). ``room()``: whether the device has the memory for this
        job beside those holding the models; without it the job enters only alone.
        """
        overdue = self.max_wait_s > 0 and queued_s >= self.max_wait_s
        # overdue first, the longest queued of them first; then by priority, then job id
        rank = (0, 0, -queued_s, job_id) if overdue else (1, -priority, 0.0, job_id)
        ticket = _Ticket(rank, job_id, priority)
        held = Hold()
        t0 = time.monotonic()
        with self._cond:
            self._waiting.append(ticket)
            while not self._may_enter(ticket, room):
                # beside others, the room is asked again as their memory changes
                others = bool(self._holders) and len(self._holders) < self.slots
                self._cond.wait(ROOM_RECHECK_S if others and room is not None else None)
            self._waiting.remove(ticket)
            held.since = time.monotonic()
            held.waited = held.since - t0
            if self._holders:
                held.shared = True
                for _, other in self._holders.values():
                    other.shared = True
            else:
                self._busy_since = held.since
            self._holders[job_id] = (ticket, held)
            self.most_at_once = max(self.most_at_once, len(self._holders))
            self._cond.notify_all()  # the next in line may fit beside this one
        try:
            yield held
        finally:
            with self._cond:
                end = time.monotonic()
                self._recent.append(end - held.since)
                del self._holders[job_id]
                if not self._holders and self._busy_since is not None:
                    self._spans.append((self._busy_since, end))
                    self._busy_since = None
                self._cond.notify_all()

    def busy_fraction(self, now: float | None = None) -> float:
        """The share of the last :data:`WINDOW_S` seconds some job held the models (0 to 1)."""
        now = time.monotonic() if now is None else now
        start = now - WINDOW_S
        with self._cond:
            while self._spans and self._spans[0][1] < start:
                self._spans.popleft()
            busy = sum(min(b, now) - max(a, start) for a, b in self._spans if b > start)
            if self._busy_since is not None:
                busy += now - max(self._busy_since, start)
        return max(0.0, min(1.0, busy / WINDOW_S))

    def waiting(self) -> dict[int, int]:
        """Jobs waiting for the models, by priority."""
        with self._cond:
            out: dict[int, int] = {}
            for ticket in self._waiting:
                out[ticket.priority] = out.get(ticket.priority, 0) + 1
            return out

    def holder(self) -> int | None:
        """The job that entered the models first of those running them now."""
        with self._cond:
            return next(iter(self._holders), None)

    def holders(self) -> list[int]:
        """The jobs running their models now, in the order they entered."""
        with self._cond:
            return list(self._holders)

    def mean_model_s(self) -> float | None:
        """The mean model time of the recent jobs, divided by the most jobs that held the
        models at once (a job takes longer beside another, but jobs leave that much more
        often); None before the first."""
        with self._cond:
            if not self._recent:
                return None
            return sum(self._recent) / len(self._recent) / max(1, self.most_at_once)
