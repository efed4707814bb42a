"""Series completion: deciding that a series is ready to become a job.

Signals, in order of speed:

1. **Geometric completeness.** The slices received so far are uniformly spaced along the
   slice normal with no gap, and their number equals what the instances announce: Images in
   Acquisition (0020,1002) for single-frame CT, Number of Frames (0028,0008) for one
   multi-frame instance (PS3.3 C.7.6.2, C.7.6.6). Evaluated off the SCP thread by
   :mod:`node.streaming` through :class:`SeriesGeometry`; it can fire at the last instance,
   before the association is released.
2. **Association release.** When an association that delivered instances of a series is
   released normally and no other open association has delivered instances of the same
   series, the series is complete.
3. **Quiet period** (fallback). A series with instances not yet taken by a job, no open
   association touching it, and nothing received for ``quiet_period_s`` seconds is complete.
   This also covers aborted associations and series left pending by a restart.

Which of signals 1 and 2 count is a per-sender policy (``[[series.senders]]``, PS3.8 calling
AE title): ``auto`` (both), ``release``, ``geometry`` (for modalities that split a series over
several associations) or ``quiet`` (the timer only).

The tracker holds only which open associations touched which series; everything durable
(instances, pending flags, jobs) is in the ledger, so losing this state in a crash loses
nothing: the quiet-period rule picks the series up after restart.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from node.volume import (
    DUPLICATE_TOLERANCE_MM,
    GAP_TOLERANCE_FRACTION,
    GAP_TOLERANCE_MM,
    ORIENTATION_TOLERANCE,
)

log = logging.getLogger(__name__)

OnComplete = Callable[[str, str], None]
PolicyFn = Callable[[str], str]

RELEASE = "association-release"
GEOMETRY = "geometry"
QUIET = "quiet-period"

#: Signals (besides the quiet-period fallback) each completion mode listens to.
MODE_SIGNALS: dict[str, frozenset[str]] = {
    "auto": frozenset({RELEASE, GEOMETRY}),
    "release": frozenset({RELEASE}),
    "geometry": frozenset({GEOMETRY}),
    "quiet": frozenset(),
}


class CompletionTracker:
    """Which open associations touched which series, and the per-sender policy.

    Parameters
    ----------
    on_complete
        Called as ``on_complete(series_uid, trigger)`` outside the tracker's lock.
    complete_on_release
        Whether a normal release completes series at all (config
        ``series.complete_on_release``; false removes the release signal for every sender).
    policy
        Completion mode of a calling AE title (``auto``, ``release``, ``geometry``,
        ``quiet``); ``auto`` for every sender when None.
    """

    def __init__(
        self,
        on_complete: OnComplete,
        *,
        complete_on_release: bool = True,
        policy: PolicyFn | None = None,
    ) -> None:
        self._on_complete = on_complete
        self._release = complete_on_release
        self._policy = policy or (lambda _ae: "auto")
        self._lock = threading.Lock()
        self._by_assoc: dict[int, set[str]] = defaultdict(set)
        self._open: set[int] = set()
        self._calling: dict[int, str] = {}

    def signals(self, calling_ae: str) -> frozenset[str]:
        """The completion signals that count for ``calling_ae``."""
        out = MODE_SIGNALS.get(self._policy(calling_ae), MODE_SIGNALS["auto"])
        return out if self._release else out - {RELEASE}

    def opened(self, assoc_id: int, calling_ae: str = "") -> None:
        """An association was accepted."""
        with self._lock:
            self._open.add(assoc_id)
            self._calling[assoc_id] = calling_ae.strip()

    def touched(self, assoc_id: int, series_uid: str) -> None:
        """An association delivered an instance of ``series_uid``."""
        with self._lock:
            self._by_assoc[assoc_id].add(series_uid)

    def busy(self, series_uid: str) -> bool:
        """Whether an open association has delivered instances of ``series_uid``."""
        with self._lock:
            return any(series_uid in s for a, s in self._by_assoc.items() if a in self._open)

    def closed(self, assoc_id: int, *, released: bool) -> list[str]:
        """An association ended; return (and report) the series it completed.

        Parameters
        ----------
        released
            True for a normal A-RELEASE, False for an abort or a dropped connection; only a
            release completes series (an aborted transfer waits for the quiet period), and
            only for senders whose policy counts the release.
        """
        with self._lock:
            self._open.discard(assoc_id)
            calling = self._calling.pop(assoc_id, "")
            touched = self._by_assoc.pop(assoc_id, set())
            if not released or RELEASE not in self.signals(calling):
                return []
            still_busy = set().union(*self._by_assoc.values()) if self._by_assoc else set()
            done = sorted(touched - still_busy)
        for uid in done:
            self._complete(uid, RELEASE)
        return done

    def geometry_complete(self, series_uid: str, calling_ae: str) -> bool:
        """The series is geometrically complete; complete it if the sender's policy agrees."""
        if GEOMETRY not in self.signals(calling_ae):
            return False
        self._complete(series_uid, GEOMETRY)
        return True

    def _complete(self, series_uid: str, trigger: str) -> None:
        try:
            self._on_complete(series_uid, trigger)
        except Exception:  # a job-creation failure must not kill the calling thread
            log.exception("completing series failed")


class SeriesGeometry:
    """Slice positions received for one series, to tell when the stack is complete.

    Uses the tolerances of :mod:`node.volume`, so a stack called complete here is one that
    volume assembly accepts (same orientation, no duplicate, uniform spacing).
    """

    def __init__(self) -> None:
        self.positions: dict[str, npt.NDArray[np.float64]] = {}
        self.orientation: npt.NDArray[np.float64] | None = None
        self.expected: int | None = None
        self.mixed = False
        self.fired = False

    def add(
        self,
        sop_uid: str,
        position: npt.NDArray[np.float64] | None,
        orientation: npt.NDArray[np.float64] | None,
        expected: int | None,
    ) -> bool:
        """Record one slice; True exactly once, when the stack first becomes complete.

        Parameters
        ----------
        position, orientation
            Image Position / Orientation (Patient); None when the instance lacks them (the
            series can then never be called complete by geometry).
        expected
            The instance's Images in Acquisition, if present.
        """
        if position is None or orientation is None:
            self.mixed = True
        elif self.orientation is None:
            self.orientation = orientation
        elif float(np.max(np.abs(orientation - self.orientation))) > ORIENTATION_TOLERANCE:
            self.mixed = True
        if expected is not None:
            if self.expected is not None and expected != self.expected:
                self.mixed = True
            self.expected = expected
        if position is not None:
            self.positions[sop_uid] = position
        if self.fired or self.mixed or self.expected is None:
            return False
        if len(self.positions) != self.expected:
            return False
        self.fired = uniform_stack(list(self.positions.values()), self.orientation)
        return self.fired


def uniform_stack(
    positions: list[npt.NDArray[np.float64]], orientation: npt.NDArray[np.float64] | None
) -> bool:
    """Whether slice positions form a gap-free stack with uniform spacing along the normal."""
    if orientation is None or len(positions) < 2:
        return False
    normal = np.cross(orientation[:3], orientation[3:])
    norm = float(np.linalg.norm(normal))
    if norm < 1e-6:
        return False
    d = np.sort(np.asarray(positions) @ (normal / norm))
    gaps = np.diff(d)
    if bool(np.any(gaps < DUPLICATE_TOLERANCE_MM)):
        return False
    median = float(np.median(gaps))
    tolerance = max(GAP_TOLERANCE_MM, GAP_TOLERANCE_FRACTION * median)
    return bool(np.all(np.abs(gaps - median) <= tolerance))
