"""The engine gate: one job at a time on the models, the most urgent waiting job next.

The worker runs several jobs at once (``[engine] lanes``): while one job's model runs, the
next jobs' volumes are assembled and their results prepared, and the last ones' results
encoded, written and handed to the outbox. The models themselves run one job at a time (a
GPU gives a job nothing by sharing it with another, and a CPU engine uses every core): a
lane about to run its model waits here, and when the model is free the waiting job of the
highest priority enters, the oldest (lowest job id) of equal priority first. A job that
waited ``max_wait_s`` enters before any that has not: the rule that keeps routine jobs from
being starved by urgent ones is the ledger's (:meth:`Ledger.claim_next_job`), applied here
too.

The gate also keeps the figures the console, ``segnode status`` and Prometheus show: the
share of the last minute the models were busy, the jobs waiting for it by priority, and the
expected wait of a new job (the mean model time of recent jobs, times the jobs ahead of it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

WINDOW_S = 60.0
"""Seconds over which :meth:`EngineGate.busy_fraction` is measured."""

RECENT_JOBS = 20
"""Model times (of the last jobs) the expected wait is estimated from."""


@dataclass(order=True)
class _Ticket:
    rank: tuple[int, int, float, int]
    job_id: int = field(compare=False)
    priority: int = field(compare=False)


class EngineGate:
    """One holder at a time; waiting holders enter by priority (see the module)."""

    def __init__(self, max_wait_s: float = 0.0) -> None:
        self.max_wait_s = max_wait_s
        self._cond = threading.Condition()
        self._waiting: list[_Ticket] = []
        self._holder: _Ticket | None = None
        self._since = 0.0
        #: (start, end) of the holds that ended in the last :data:`WINDOW_S`.
        self._spans: deque[tuple[float, float]] = deque()
        self._recent: deque[float] = deque(maxlen=RECENT_JOBS)

    @contextmanager
    def hold(self, job_id: int, priority: int = 0, queued_s: float = 0.0) -> Iterator[float]:
        """Wait for the models, then hold them; yields the seconds waited.

        ``queued_s``: how long the job had been queued when it started (a job past
        ``max_wait_s`` enters first).
        """
        overdue = self.max_wait_s > 0 and queued_s >= self.max_wait_s
        # overdue first, the longest queued of them first; then by priority, then job id
        rank = (0, 0, -queued_s, job_id) if overdue else (1, -priority, 0.0, job_id)
        ticket = _Ticket(rank, job_id, priority)
        t0 = time.monotonic()
        with self._cond:
            self._waiting.append(ticket)
            while self._holder is not None or min(self._waiting) is not ticket:
                self._cond.wait()
            self._waiting.remove(ticket)
            self._holder, self._since = ticket, time.monotonic()
        try:
            yield self._since - t0
        finally:
            with self._cond:
                end = time.monotonic()
                self._spans.append((self._since, end))
                self._recent.append(end - self._since)
                self._holder = None
                self._cond.notify_all()

    def busy_fraction(self, now: float | None = None) -> float:
        """The share of the last :data:`WINDOW_S` seconds the models were held (0 to 1)."""
        now = time.monotonic() if now is None else now
        start = now - WINDOW_S
        with self._cond:
            while self._spans and self._spans[0][1] < start:
                self._spans.popleft()
            busy = sum(min(b, now) - max(a, start) for a, b in self._spans if b > start)
            if self._holder is not None:
                busy += now - max(self._since, start)
        return max(0.0, min(1.0, busy / WINDOW_S))

    def waiting(self) -> dict[int, int]:
        """Jobs waiting for the models, by priority."""
        with self._cond:
            out: dict[int, int] = {}
            for ticket in self._waiting:
                out[ticket.priority] = out.get(ticket.priority, 0) + 1
            return out

    def holder(self) -> int | None:
        """The job running its model now."""
        with self._cond:
            return None if self._holder is None else self._holder.job_id

    def mean_model_s(self) -> float | None:
        """The mean model time of the recent jobs (None before the first)."""
        with self._cond:
            return sum(self._recent) / len(self._recent) if self._recent else None
