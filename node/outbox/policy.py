"""The outbox's delivery policy: when a failed delivery or destination is tried again, when a
destination is skipped, which of a job's results may go next, and which associations stay
open between batches.

:class:`Backoff` gives the retry delays (exponential, half of each random);
:class:`CircuitBreakers` counts a destination's connection failures and skips it for a
cooldown once they reach the threshold; :class:`InOrder` holds a job's later results back
within a pass until its earlier ones were accepted; :class:`KeptAssociations` keeps one
established association per destination for ``dispatch.keep_open_s``. The breakers and the
kept associations live in memory (a restart closes them); what must survive a restart is in
the ledger.

Must not touch: the ledger, result files and the sending itself, which are
:mod:`segnode.node.outbox.scu`'s; the association's protocol, which is
:mod:`segnode.node.dicom.requestor`'s.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from segnode.node.dicom.requestor import Association
from segnode.storage.ledger import DueDelivery

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backoff:
    """The outbox's retry delays: "equal jitter" exponential backoff.

    The exponential delay ``min(maximum, initial * 2**attempts)`` is split in half: one half
    is always waited, the other is uniformly random (from ``rng``), so that many nodes or
    objects do not retry in step. One backoff serves a delivery's retries and a destination's
    connection attempts while its breaker is closed.
    """

    initial: float
    maximum: float
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def delay(self, attempts: int) -> float:
        """Seconds to wait after ``attempts`` failures."""
        base = min(self.maximum, self.initial * (2 ** min(max(0, attempts), 62)))
        return float(base / 2 + self.rng.uniform(0, base / 2))


@dataclass
class _BreakerState:
    failures: int = 0
    open_until: float = 0.0


class CircuitBreakers:
    """One circuit breaker per destination (connection-level failures only).

    Parameters
    ----------
    threshold
        Consecutive connection failures that open the breaker.
    cooldown
        Seconds an open breaker skips its destination before one probe is allowed.
    backoff
        Waits between connection attempts while the breaker is still closed (its ``rng``
        also jitters the cooldown).
    clock
        Monotonic clock (seconds).
    """

    def __init__(
        self,
        threshold: int,
        cooldown: float,
        backoff: Backoff,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.backoff = backoff
        self._clock = clock or time.monotonic
        self._state: dict[str, _BreakerState] = defaultdict(_BreakerState)
        self._lock = threading.Lock()

    def blocked_for(self, dest: str) -> float:
        """Seconds the breaker of ``dest`` still skips it (0: an attempt may be made)."""
        with self._lock:
            st = self._state.get(dest)
            return 0.0 if st is None else max(0.0, st.open_until - self._clock())

    def is_open(self, dest: str) -> bool:
        """Whether ``dest`` has failed ``threshold`` times in a row (open or half-open)."""
        with self._lock:
            st = self._state.get(dest)
            return st is not None and st.failures >= self.threshold

    def failure(self, dest: str) -> tuple[float, bool]:
        """Record a connection failure; return ``(seconds to wait, breaker just opened)``."""
        with self._lock:
            st = self._state[dest]
            st.failures += 1
            if st.failures >= self.threshold:
                wait = self.cooldown * self.backoff.rng.uniform(0.9, 1.1)
                opened = st.failures == self.threshold
            else:
                wait = self.backoff.delay(st.failures - 1)
                opened = False
            st.open_until = self._clock() + wait
            return wait, opened

    def success(self, dest: str) -> bool:
        """Record a successful association; return True if the breaker was open."""
        with self._lock:
            st = self._state.pop(dest, None)
            return st is not None and st.failures >= self.threshold


class InOrder:
    """Within one pass to one destination: whether a job's next result may be sent.

    A result waits on the earlier results of its job to the destination that were not
    acknowledged when it was selected (:attr:`~segnode.storage.ledger.DueDelivery.waits_on`);
    it goes only once this pass has seen all of them accepted. Once one of a job's results
    is not accepted (refused, no answer, not sent), the job's later ones wait for a later
    pass, where the ledger holds them back until the earlier one is due again.
    """

    def __init__(self) -> None:
        self._accepted: dict[int, int] = defaultdict(int)
        self._held: set[int] = set()

    def may_send(self, d: DueDelivery) -> bool:
        """Whether every earlier result ``d`` waits on was accepted in this pass."""
        if d.job_id in self._held or self._accepted[d.job_id] < d.waits_on:
            self._held.add(d.job_id)
            return False
        return True

    def outcome(self, d: DueDelivery, accepted: bool) -> None:
        """Record whether ``d`` was accepted (anything else holds its job's later results)."""
        if accepted:
            self._accepted[d.job_id] += 1
        else:
            self._held.add(d.job_id)


class KeptAssociations:
    """Established C-STORE associations kept open between batches, one per destination.

    Before a batch, the destination's pass takes its association (:meth:`take`) and puts it
    back after (:meth:`put`); passes to different destinations run on different threads, so
    the map is behind a lock (an association itself is used by one thread at a time: taken
    out of the map while in use). :meth:`close_idle` runs at each wake-up of the outbox loop:
    it ends the associations on which the peer sent anything (an A-RELEASE-RQ is answered; an
    A-ABORT or a closed connection ends it; anything else is a protocol violation, aborted)
    and releases those idle ``keep_open`` seconds; :meth:`close_all` runs when the outbox
    stops. With ``keep_open`` 0 every association is released after its batch.

    Parameters
    ----------
    keep_open
        Seconds an association may stay idle (``dispatch.keep_open_s``).
    clock
        Monotonic clock (seconds).
    """

    def __init__(self, keep_open: float, clock: Callable[[], float] | None = None) -> None:
        self.keep_open = keep_open
        self._clock = clock or time.monotonic
        self._idle: dict[str, tuple[Association, float]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._idle)

    def take(self, dest: str) -> Association | None:
        """The open association to ``dest``, or None (then the caller opens one)."""
        with self._lock:
            entry = self._idle.pop(dest, None)
        if entry is None:
            return None
        assoc, since = entry
        if self._clock() - since >= self.keep_open:
            assoc.release()
            return None
        if not assoc.poll_idle():
            log.info("%s ended the idle association (%s)", dest, assoc.ended)
            return None
        return assoc

    def put(self, dest: str, assoc: Association) -> None:
        """Keep ``assoc`` for the next batch to ``dest``, or release it (``keep_open`` 0)."""
        if self.keep_open > 0 and assoc.is_established:
            with self._lock:
                old = self._idle.pop(dest, None)
                self._idle[dest] = (assoc, self._clock())
            if old is not None and old[0] is not assoc:
                old[0].release()
        else:
            assoc.release()

    def close_idle(self) -> float | None:
        """Release associations idle ``keep_open`` seconds or more; end those the peer ended
        or sent anything on. Returns the seconds until the next one is due, None when none is
        open.

        The peers' news is read under the lock, so that a pass never finds its destination's
        association missing meanwhile: it costs a poll per association, and a PDU's read only
        when one has begun to arrive (bounded by the requestor's release time); the releases
        happen outside it.
        """
        now = self._clock()
        due: float | None = None
        expired: list[tuple[str, Association, float]] = []
        with self._lock:
            for dest, (assoc, since) in list(self._idle.items()):
                left = since + self.keep_open - now
                if left <= 0:
                    del self._idle[dest]
                    expired.append((dest, assoc, now - since))
                elif not assoc.poll_idle():
                    del self._idle[dest]
                    log.info("%s ended the idle association (%s)", dest, assoc.ended)
                else:
                    due = left if due is None else min(due, left)
        for dest, assoc, idle in expired:
            log.debug("releasing the association to %s, idle %.1f s", dest, idle)
            assoc.release()
        return due

    def close_all(self) -> None:
        """Release every kept association (the outbox stops)."""
        with self._lock:
            entries, self._idle = self._idle, {}
        for assoc, _ in entries.values():
            assoc.release()


__all__ = ["Backoff", "CircuitBreakers", "InOrder", "KeptAssociations"]
